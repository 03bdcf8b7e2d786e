//! What `session::list` adds to each session, so a list view needs no request per session.

use std::collections::HashMap;

use harness_store::StoreError;
use harness_types::message::AgentMessage;
use harness_types::session::*;
use rusqlite::{params, Connection, OptionalExtension};
use serde_json::Value;

use super::entry_log::*;
use super::Row;

/// The additive `session::list` fields, so a list view needs no request per session: the
/// preview, the latest model, the parent, and the cost of the session's tree (its sub-agents
/// found through their `metadata.parent_session_id`).
pub(super) fn list_summaries(
    conn: &Connection,
    sessions: &mut [SessionMeta],
    children: &HashMap<String, Vec<String>>,
    unfolded_ids: &HashMap<String, Vec<i64>>,
) -> std::result::Result<(), StoreError> {
    let mut first_user = conn.prepare_cached(
        "SELECT seq, entry_id, kind, body, origin, revision, chg FROM entries
         WHERE session_id = ?1 AND kind = 'message'
         AND json_extract(body, '$.role') = 'user' ORDER BY seq LIMIT 1",
    )?;
    let mut last_assistant = conn.prepare_cached(
        "SELECT seq, entry_id, kind, body, origin, revision, chg FROM entries
         WHERE session_id = ?1 AND kind = 'message' AND json_extract(body, '$.role') = 'assistant'
         ORDER BY seq DESC LIMIT 1",
    )?;
    let mut own_cost = conn.prepare_cached(
        "SELECT SUM(json_extract(body, '$.usage.cost_usd')) FROM entries
         WHERE session_id = ?1 AND kind = 'message' AND json_extract(body, '$.role') = 'assistant'",
    )?;
    let mut cost_at = conn.prepare_cached(
        "SELECT json_extract(body, '$.usage.cost_usd') FROM entries
         WHERE session_id = ?1 AND seq = ?2 AND kind = 'message'
         AND json_extract(body, '$.role') = 'assistant'",
    )?;
    let no_ids = Vec::new();
    let unfolded_of = |sid: &str| {
        unfolded_in(conn, sid, unfolded_ids.get(sid).unwrap_or(&no_ids)).map(|rows| {
            // Each unfolded version with its parsed body, to tell roles apart.
            rows.into_values()
                .filter(|r| r.kind == "message")
                .filter_map(|r| {
                    let v: Value = serde_json::from_str(&r.body).ok()?;
                    Some((r, v))
                })
                .collect::<Vec<_>>()
        })
    };
    let role = |v: &Value| v.get("role").and_then(Value::as_str).map(str::to_string);
    for meta in sessions.iter_mut() {
        let sid = meta.session_id.clone();
        let unfolded = unfolded_of(&sid)?;
        // The overlay's first user message: the materialized one, or an unfolded version
        // with a lower seq or of the same entry.
        let mut first = first_user.query_row(params![sid], row).optional()?;
        for (r, v) in &unfolded {
            let earlier = first.as_ref().is_none_or(|f| r.seq <= f.seq);
            if earlier && role(v).as_deref() == Some("user") {
                first = Some(Row {
                    body: r.body.clone(),
                    entry_id: r.entry_id.clone(),
                    kind: r.kind.clone(),
                    origin: r.origin.clone(),
                    ..*r
                });
            }
        }
        if let Some(body) = first.map(|f| f.body) {
            if let Ok(AgentMessage::User(m)) = serde_json::from_str::<AgentMessage>(&body) {
                let text = harness_types::message::joined_text(&m.content);
                meta.preview = Some(text.chars().take(80).collect());
            }
        }
        let mut last: Option<(i64, Value)> = last_assistant
            .query_row(params![sid], row)
            .optional()?
            .and_then(|r| Some((r.seq, serde_json::from_str(&r.body).ok()?)));
        for (r, v) in &unfolded {
            let later = last.as_ref().is_none_or(|(seq, _)| r.seq >= *seq);
            if later && role(v).as_deref() == Some("assistant") {
                last = Some((r.seq, v.clone()));
            }
        }
        if let Some((_, body)) = last {
            let text = |k: &str| body.get(k).and_then(Value::as_str).map(str::to_string);
            meta.model = text("model");
            meta.provider = text("provider");
        }
        meta.parent_session_id = meta
            .metadata
            .get("parent_session_id")
            .and_then(Value::as_str)
            .map(str::to_string);
        // The tree, walked breadth-first; `seen` guards against a metadata cycle.
        let mut total = 0.0;
        let mut seen = std::collections::HashSet::new();
        let mut own = Some(unfolded);
        let mut queue = vec![sid];
        while let Some(s) = queue.pop() {
            if !seen.insert(s.clone()) {
                continue;
            }
            let cost: Option<f64> = own_cost.query_row(params![s], |r| r.get(0))?;
            total += cost.unwrap_or(0.0);
            // The listed session's versions were read above; its descendants' are read here.
            let versions = match own.take() {
                Some(versions) => versions,
                None => unfolded_of(&s)?,
            };
            // An unfolded version's cost replaces the materialized one of its entry.
            for (r, v) in versions {
                if role(&v).as_deref() != Some("assistant") {
                    continue;
                }
                let before: Option<f64> = cost_at
                    .query_row(params![s, r.seq], |r| r.get(0))
                    .optional()?
                    .flatten();
                let now = v.pointer("/usage/cost_usd").and_then(Value::as_f64);
                total += now.unwrap_or(0.0) - before.unwrap_or(0.0);
            }
            if let Some(c) = children.get(&s) {
                queue.extend(c.iter().cloned());
            }
        }
        meta.cost_usd = Some(total);
    }
    Ok(())
}

/// Each parent session's sub-agents (by their `metadata.parent_session_id`).
pub(super) fn children_in(
    conn: &Connection,
) -> std::result::Result<HashMap<String, Vec<String>>, StoreError> {
    let mut children: HashMap<String, Vec<String>> = HashMap::new();
    let mut stmt = conn.prepare_cached(
        "SELECT session_id, json_extract(metadata, '$.parent_session_id') FROM sessions
         WHERE json_valid(metadata) AND json_extract(metadata, '$.parent_session_id') IS NOT NULL",
    )?;
    let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?;
    for row in rows {
        let (child, parent) = row?;
        children.entry(parent).or_default().push(child);
    }
    Ok(children)
}
