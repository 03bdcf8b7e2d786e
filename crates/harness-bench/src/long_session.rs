//! Steps on long sessions against steps on short ones, and context assembly on each.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use harness_store::Durability;
use serde_json::{json, Value};

use crate::plan::Plan;
use crate::probe::StepSample;
use crate::rig::{At, Driver, Rig, ScriptKind};
use crate::stats::{per, progress, Percentiles, Steps};

/// Sessions of each length the phase alternates over.
const LONG_PHASE_SESSIONS: usize = 4;
/// Entries of the short sessions (before their turns); the long ones have `Plan::long_entries`.
const SHORT_ENTRIES: usize = 10;

/// Steps on short and on long sessions; times in µs.
pub(crate) struct LongSession {
    pub(crate) short: Steps,
    pub(crate) long: Steps,
    pub(crate) assemble: Assemble,
}

impl LongSession {
    /// Whole step on a 1,000-entry session over the same on a 10-entry one (p50s).
    pub(crate) fn step_ratio(&self) -> f64 {
        per(self.long.whole.p50, self.short.whole.p50)
    }

    /// The same with the store's time taken out of both.
    pub(crate) fn overhead_ratio(&self) -> f64 {
        per(self.long.outside_store.p50, self.short.outside_store.p50)
    }

    /// Assembly on a summarized 1,000-entry session over assembly on a 10-entry one (p50s).
    pub(crate) fn summarized_assemble_ratio(&self) -> f64 {
        per(self.assemble.summarized_p50, self.assemble.short_p50)
    }
}

/// `context::assemble` as the step awaits it, p50 µs: on 10-entry, 1,000-entry, and 1,000-entry
/// sessions whose history a compaction record already summarizes.
pub(crate) struct Assemble {
    pub(crate) short_p50: f64,
    pub(crate) long_p50: f64,
    pub(crate) summarized_p50: f64,
}

/// Appends user messages until the session has `entries` entries.
pub(crate) async fn fill_transcript(
    d: &Driver,
    session_id: &str,
    from: usize,
    entries: usize,
) -> Result<()> {
    for i in from..entries {
        d.harness
            .bus()
            .call(
                "session::append",
                json!({"session_id": session_id, "message": {"role": "user", "content": [{"type": "text", "text": format!("earlier message {i}")}], "timestamp": 1}}),
                None,
            )
            .await
            .map_err(|e| anyhow!("session::append: {e}"))?;
    }
    Ok(())
}

/// Writes a compaction record whose tail anchor keeps the last `keep` entries, as the loop does
/// after summarizing the rest.
pub(crate) async fn summarize_transcript(d: &Driver, session_id: &str, keep: usize) -> Result<()> {
    let mut entries: Vec<Value> = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let page = d
            .harness
            .bus()
            .call(
                "session::messages",
                json!({"session_id": session_id, "include_custom": false, "limit": 500, "cursor": cursor}),
                None,
            )
            .await
            .map_err(|e| anyhow!("session::messages: {e}"))?;
        entries.extend(page["messages"].as_array().cloned().unwrap_or_default());
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
    }
    let anchor = match entries.len().checked_sub(keep).and_then(|i| entries.get(i)) {
        Some(e) => e["entry_id"].as_str().unwrap_or_default().to_string(),
        None => bail!("the session has fewer than {keep} entries to keep"),
    };
    d.harness
        .bus()
        .call(
            "session::append",
            json!({"session_id": session_id, "entry_id": format!("e_bench_{session_id}_compaction_{}", entries.len()),
                   "custom": {"custom_type": "compaction", "data": {
                       "summary": "The user sent a thousand short numbered messages; nothing else happened.",
                       "tail_start_entry_id": anchor, "summarized_head_tokens": 6000}}}),
            None,
        )
        .await
        .map_err(|e| anyhow!("session::append: {e}"))?;
    Ok(())
}

/// Text steps on sessions of [`SHORT_ENTRIES`] and of `plan.long_entries` entries, alternating
/// (concurrency 1, fsync off, each session already stepped once, as in a live conversation).
pub(crate) async fn long_session(at: At<'_>, plan: &Plan) -> Result<LongSession> {
    progress!(
        "long sessions ({} steps on {SHORT_ENTRIES}-entry and on {}-entry sessions, fsync off)",
        plan.long_turns,
        plan.long_entries
    );
    let (rig, d) = Rig::open(at, ScriptKind::Text, Durability::Normal).await?;
    let (mut short, mut long, mut summarized) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..LONG_PHASE_SESSIONS {
        let sid = d.turn(None, None).await?;
        fill_transcript(&d, &sid, 2, plan.long_entries - 2).await?;
        summarize_transcript(&d, &sid, SHORT_ENTRIES - 2).await?;
        d.turn(Some(sid.clone()), None).await?;
        summarized.push(sid);
    }
    for i in 0..2 * LONG_PHASE_SESSIONS {
        let sid = d.turn(None, None).await?;
        // A turn leaves 2 entries (the message and the answer); the next one adds 2 more.
        let target = if i % 2 == 0 {
            SHORT_ENTRIES
        } else {
            plan.long_entries
        } - 2;
        fill_transcript(&d, &sid, 2, target).await?;
        d.turn(Some(sid.clone()), None).await?;
        if i % 2 == 0 {
            short.push(sid);
        } else {
            long.push(sid);
        }
    }
    let mut long_turns = HashSet::new();
    let mut summarized_turns = HashSet::new();
    let deadline = Instant::now() + plan.long_cap;
    let ((), samples) = rig
        .sampled(async {
            let mut done = 0;
            while done < plan.long_turns && Instant::now() < deadline {
                let i = done % LONG_PHASE_SESSIONS;
                // Short sessions are swapped for fresh ones as they grow, so they stay near 10
                // entries.
                if done > 0 && i == 0 && done % (4 * LONG_PHASE_SESSIONS) == 0 {
                    rig.probe.sample_steps.store(false, Ordering::Relaxed);
                    for sid in short.iter_mut() {
                        let fresh = d.turn(None, None).await?;
                        fill_transcript(&d, &fresh, 2, SHORT_ENTRIES - 2).await?;
                        d.turn(Some(fresh.clone()), None).await?;
                        *sid = fresh;
                    }
                    // The summarized sessions are summarized again, so their window stays the
                    // last few entries instead of growing with every measured turn.
                    for sid in &summarized {
                        summarize_transcript(&d, sid, SHORT_ENTRIES - 2).await?;
                        d.turn(Some(sid.clone()), None).await?;
                    }
                    rig.queue_idle().await?;
                    rig.probe.sample_steps.store(true, Ordering::Relaxed);
                }
                d.turn(Some(short[i].clone()), None).await?;
                let (_, turn_id) = d.send(Some(long[i].clone()), None).await?;
                d.probe.wait(&turn_id).await?;
                long_turns.insert(turn_id);
                let (_, turn_id) = d.send(Some(summarized[i].clone()), None).await?;
                d.probe.wait(&turn_id).await?;
                summarized_turns.insert(turn_id);
                done += 1;
            }
            Ok(())
        })
        .await?;
    rig.close().await;
    let (summarized_s, rest): (Vec<&StepSample>, Vec<&StepSample>) = samples
        .iter()
        .filter(|s| !s.turn_id.is_empty())
        .partition(|s| summarized_turns.contains(&s.turn_id));
    let (long_s, short_s): (Vec<&StepSample>, Vec<&StepSample>) = rest
        .into_iter()
        .partition(|s| long_turns.contains(&s.turn_id));
    if long_s.is_empty() || short_s.is_empty() {
        bail!("the long-session phase measured no step");
    }
    let assemble_p50 = |v: &[&StepSample]| {
        let ns = v
            .iter()
            .filter_map(|s| s.by_op.get("context::assemble").map(|(_, ns)| *ns));
        Percentiles::of(ns.collect()).p50
    };
    Ok(LongSession {
        short: Steps::of(short_s.iter().copied()),
        long: Steps::of(long_s.iter().copied()),
        assemble: Assemble {
            short_p50: assemble_p50(&short_s),
            long_p50: assemble_p50(&long_s),
            summarized_p50: assemble_p50(&summarized_s),
        },
    })
}
