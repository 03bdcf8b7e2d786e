//! Session trees: a session and its sub-agents' sessions, read from the sessions' parent links
//! (`harness::session-tree`), and counters over them (`harness::metrics`).

use std::collections::HashMap;

use harness_types::api::{
    MetricsCounters, MetricsRequest, MetricsResponse, MetricsTotals, SessionMetrics,
    SessionTreeNode, SessionTreeRequest,
};
use harness_types::message::AgentMessage;
use harness_types::session::{ListRequest, ListResponse, SessionMeta};
use harness_types::HarnessError;

use crate::harness::{Harness, Result};

fn parent_of(meta: &SessionMeta) -> Option<String> {
    meta.metadata
        .get("parent_session_id")
        .and_then(serde_json::Value::as_str)
        .map(str::to_string)
}

/// Adds `v` to an optional sum that stays present only while every observation had the field.
fn add(sum: &mut Option<u64>, v: Option<u64>, first: bool) {
    *sum = match (first, *sum, v) {
        (true, _, v) => v,
        (false, Some(s), Some(v)) => Some(s + v),
        _ => None,
    };
}

/// Counts one generation's usage (a reply's or a compaction's) into `c`; each token sum and
/// `cost` stay present only while every generation so far reported them.
fn count_usage(
    c: &mut MetricsCounters,
    cost: &mut Option<f64>,
    first: &mut bool,
    u: &harness_types::message::Usage,
) {
    add(&mut c.input_tokens, u.input, *first);
    add(&mut c.output_tokens, u.output, *first);
    add(&mut c.cache_read_tokens, u.cache_read, *first);
    add(&mut c.cache_write_tokens, u.cache_write, *first);
    add(&mut c.reasoning_tokens, u.reasoning, *first);
    *cost = match (*first, *cost, u.cost_usd) {
        (true, _, v) => v,
        (false, Some(s), Some(v)) => Some(s + v),
        _ => None,
    };
    *first = false;
}

impl Harness {
    /// Every session, by id, and the children of each.
    async fn sessions_by_parent(
        &self,
    ) -> Result<(HashMap<String, SessionMeta>, HashMap<String, Vec<String>>)> {
        let mut all = HashMap::new();
        let mut children: HashMap<String, Vec<String>> = HashMap::new();
        let mut cursor = None;
        loop {
            let page: ListResponse = self
                .call(
                    "session::list",
                    &ListRequest {
                        limit: Some(500),
                        cursor,
                    },
                )
                .await?;
            for meta in page.sessions {
                if let Some(p) = parent_of(&meta) {
                    children.entry(p).or_default().push(meta.session_id.clone());
                }
                all.insert(meta.session_id.clone(), meta);
            }
            match page.next_cursor {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
        for list in children.values_mut() {
            list.sort();
        }
        Ok((all, children))
    }

    /// The tree rooted at a session, depth first (the root first), and every session by id.
    pub(crate) async fn tree_ids(
        &self,
        root: &str,
    ) -> Result<(
        Vec<(String, Option<String>, u32)>,
        HashMap<String, SessionMeta>,
    )> {
        let (all, children) = self.sessions_by_parent().await?;
        if !all.contains_key(root) {
            return Err(HarnessError::not_found(format!(
                "session_id: unknown session '{root}'"
            )));
        }
        let mut out = Vec::new();
        let mut stack = vec![(root.to_string(), None, 0u32)];
        while let Some((id, parent, depth)) = stack.pop() {
            // A forged cycle in the parent links ends the walk instead of looping.
            if out.iter().any(|(seen, _, _)| *seen == id) || depth > 64 {
                continue;
            }
            for child in children.get(&id).into_iter().flatten().rev() {
                stack.push((child.clone(), Some(id.clone()), depth + 1));
            }
            out.push((id, parent, depth));
        }
        Ok((out, all))
    }

    pub async fn session_tree(&self, req: SessionTreeRequest) -> Result<SessionTreeNode> {
        let (ids, all) = self.tree_ids(&req.session_id).await?;
        let mut nodes: Vec<SessionTreeNode> = Vec::with_capacity(ids.len());
        for (id, parent, depth) in &ids {
            let rec = self.load_record(id).await?;
            nodes.push(SessionTreeNode {
                session_id: id.clone(),
                parent_session_id: parent.clone(),
                depth: *depth,
                title: all.get(id).and_then(|m| m.title.clone()),
                turn_id: rec.as_ref().map(|r| r.turn_id.clone()),
                turn_status: rec.as_ref().map(|r| r.status),
                display: all
                    .get(id)
                    .and_then(|m| m.metadata.get("subagent_display"))
                    .and_then(|d| serde_json::from_value(d.clone()).ok()),
                children: vec![],
            });
        }
        // Assemble bottom-up: a node's children come after it in depth-first order.
        while nodes.len() > 1 {
            let node = nodes.pop().expect("more than one node");
            let parent = node.parent_session_id.clone();
            match nodes
                .iter_mut()
                .rev()
                .find(|n| Some(&n.session_id) == parent.as_ref())
            {
                Some(p) => p.children.insert(0, node),
                None => break,
            }
        }
        nodes
            .pop()
            .ok_or_else(|| HarnessError::internal("an empty session tree"))
    }

    pub async fn metrics(&self, req: MetricsRequest) -> Result<MetricsResponse> {
        let (ids, _) = self.tree_ids(&req.root_session_id).await?;
        let mut complete = true;
        let mut by_session = Vec::with_capacity(ids.len());
        let mut totals = MetricsCounters::default();
        let mut first_total = true;
        let mut traces = Vec::new();
        for (id, parent, depth) in ids {
            match self.load_record(&id).await? {
                Some(r) if r.is_terminal() => {}
                _ => complete = false,
            }
            let mut c = MetricsCounters::default();
            let mut first = true;
            let mut cost: Option<f64> = None;
            let entries = self.transcript(&id).await?;
            traces.push(crate::trace::session_traces(&id, &entries));
            for e in entries {
                match e.message {
                    Some(AgentMessage::Assistant(a)) => {
                        c.turns += 1;
                        c.function_calls += crate::usage::calls_made(&a);
                        count_usage(&mut c, &mut cost, &mut first, &a.usage.unwrap_or_default());
                    }
                    Some(AgentMessage::FunctionResult(r)) if r.is_error => {
                        c.function_call_errors += 1;
                    }
                    // A compaction's summary was generated too: its tokens and cost count.
                    None => {
                        let Some(u) = e
                            .custom
                            .as_ref()
                            .filter(|c| c.custom_type == harness_types::context::COMPACTION_ENTRY)
                            .and_then(|c| c.data.get("usage"))
                            .and_then(|u| {
                                serde_json::from_value::<harness_types::message::Usage>(u.clone())
                                    .ok()
                            })
                        else {
                            continue;
                        };
                        count_usage(&mut c, &mut cost, &mut first, &u);
                    }
                    _ => {}
                }
            }
            c.cost_usd = cost;
            totals.turns += c.turns;
            totals.function_calls += c.function_calls;
            totals.function_call_errors += c.function_call_errors;
            if c.turns > 0 {
                add(&mut totals.input_tokens, c.input_tokens, first_total);
                add(&mut totals.output_tokens, c.output_tokens, first_total);
                add(
                    &mut totals.cache_read_tokens,
                    c.cache_read_tokens,
                    first_total,
                );
                add(
                    &mut totals.cache_write_tokens,
                    c.cache_write_tokens,
                    first_total,
                );
                add(
                    &mut totals.reasoning_tokens,
                    c.reasoning_tokens,
                    first_total,
                );
                totals.cost_usd = match (first_total, totals.cost_usd, c.cost_usd) {
                    (true, _, v) => v,
                    (false, Some(s), Some(v)) => Some(s + v),
                    _ => None,
                };
                first_total = false;
            }
            by_session.push(SessionMetrics {
                session_id: id,
                parent_session_id: parent,
                depth,
                counters: c,
            });
        }
        let sessions = by_session.len() as u64;
        let totals = if complete {
            MetricsTotals {
                sessions,
                counters: totals,
            }
        } else {
            // A tree still working has no final totals yet.
            MetricsTotals {
                sessions: 0,
                counters: MetricsCounters::default(),
            }
        };
        Ok(MetricsResponse {
            root_session_id: req.root_session_id,
            complete,
            totals,
            by_session,
            traces: Some(crate::trace::traces_summary(traces)),
        })
    }
}
