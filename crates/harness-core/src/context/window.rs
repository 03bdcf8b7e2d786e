//! The window a step hands `context::assemble`, kept per session between steps.
//!
//! A step used to rebuild its window from the whole transcript: a copy of every message, every
//! entry id and every result id, then a byte bound and an orphan scan over all of them. On a
//! 1,000-entry session that copying was most of the step. [`WindowState`] lives beside the
//! session's transcript copy and is brought up to date with what changed since the previous
//! step: the entries from the lowest changed index on are folded in again, everything before
//! them is kept. A full rebuild goes through the same code, from index 0, so the kept window and
//! a fresh one cannot drift apart (the tests compare them).

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use harness_types::context::{CompactionRecord, PreviousSummary, COMPACTION_ENTRY};
use harness_types::message::{AgentMessage, ContentBlock};
use harness_types::session::Entry;
use serde::Deserialize as _;

use super::Window;

/// Identities of window messages (see `WindowState::identities`).
static NEXT_IDENTITY: AtomicU64 = AtomicU64::new(1);

/// One session's window and what the loop derives from it, current to `entries[..covered]`.
#[derive(Debug, Default)]
pub(crate) struct WindowState {
    covered: usize,
    /// The latest compaction entry (its index) the window is anchored by, and the anchor's
    /// index: the window starts there.
    compaction_at: Option<usize>,
    start: usize,
    /// The first user message: always in the window, first when the anchor is after it.
    opening: Option<usize>,
    previous: Option<PreviousSummary>,
    messages: Arc<Vec<AgentMessage>>,
    /// A process-unique identity per message, new whenever a message is (re)placed: the
    /// context manager reuses its count of a message it has seen with the same identity.
    identities: Arc<Vec<u64>>,
    entry_ids: Arc<Vec<String>>,
    /// The entry index of each message.
    positions: Vec<usize>,
    /// [`byte_bound`](super::byte_bound) of each message, and their sum.
    bytes: Vec<u64>,
    total_bytes: u64,
    /// Call ids with a result anywhere in the covered transcript.
    answered: Arc<HashSet<String>>,
    /// Entry ids of messages left out because alone they do not fit (see
    /// [`EXCLUDED_ENTRY`](super::EXCLUDED_ENTRY)).
    excluded: HashSet<String>,
    /// Call ids asked for in the window, answered in the window, and the first without the second.
    calls: HashSet<String>,
    results: HashSet<String>,
    unresolved: HashSet<String>,
    /// How many updates rebuilt from scratch (the tests check the kept path is taken).
    #[cfg(test)]
    pub(crate) rebuilds: usize,
}

impl WindowState {
    /// A window built from scratch.
    pub(crate) fn build(entries: &[Entry]) -> WindowState {
        let mut s = WindowState::default();
        s.update(entries, 0);
        s
    }

    /// Brings the window up to date with `entries`, of which those from `dirty_from` on may have
    /// changed (been replaced, inserted or appended) since the last update.
    pub(crate) fn update(&mut self, entries: &[Entry], dirty_from: usize) {
        let dirty_from = dirty_from.min(self.covered).min(entries.len());
        let compaction_at = latest_compaction(entries);
        let anchor_moved =
            compaction_at != self.compaction_at || compaction_at.is_some_and(|at| at >= dirty_from);
        let head_changed =
            dirty_from <= self.start || self.opening.is_some_and(|o| o >= dirty_from);
        // A new exclusion takes out a message already folded in: rebuilt (rare).
        let excludes = entries.iter().skip(dirty_from).any(is_exclusion);
        if self.covered == 0
            || anchor_moved
            || head_changed
            || excludes
            || self.drops_a_result(dirty_from)
        {
            #[cfg(test)]
            let rebuilds = self.rebuilds + 1;
            *self = WindowState::default();
            #[cfg(test)]
            {
                self.rebuilds = rebuilds;
            }
            self.anchor(entries, compaction_at);
            self.extend(entries, 0);
            return;
        }
        self.truncate(dirty_from);
        self.extend(entries, dirty_from);
    }

    /// The window for a step, with the user messages that arrived after `watermark` (the last
    /// entry the previous step saw).
    pub(crate) fn window(&self, entries: &[Entry], watermark: Option<&str>) -> Window {
        let watermark = watermark.and_then(|w| entries.iter().rposition(|e| e.entry_id == w));
        let mut late_users = Vec::new();
        if let Some(w) = watermark {
            for (k, &at) in self.positions.iter().enumerate().rev() {
                if at <= w {
                    break;
                }
                let m = &self.messages[k];
                if matches!(m, AgentMessage::User(_)) && Some(at) != self.opening {
                    late_users.push(m.clone());
                }
            }
            late_users.reverse();
        }
        Window {
            messages: self.messages.clone(),
            identities: self.identities.clone(),
            entry_ids: self.entry_ids.clone(),
            late_users,
            previous: self.previous.clone(),
            answered: self.answered.clone(),
            bytes: self.total_bytes,
            unresolved_calls: !self.unresolved.is_empty(),
            resume_notice: None,
        }
    }

    /// Finds the window's start from the latest compaction record that reads, and the opening
    /// message.
    fn anchor(&mut self, entries: &[Entry], compaction_at: Option<usize>) {
        self.compaction_at = compaction_at;
        let record = compaction_at.and_then(|at| {
            entries[..=at].iter().rev().find_map(|e| {
                let c = e.custom.as_ref().filter(|c| c.custom_type == COMPACTION_ENTRY)?;
                match CompactionRecord::deserialize(&c.data) {
                    Ok(r) => Some(r),
                    Err(err) => {
                        tracing::warn!(entry = %e.entry_id, "ignoring a compaction entry that does not parse: {err}");
                        None
                    }
                }
            })
        });
        let anchored = record.and_then(|r| {
            let at = entries
                .iter()
                .position(|e| e.entry_id == r.tail_start_entry_id)?;
            Some((r, at))
        });
        self.start = anchored.as_ref().map_or(0, |(_, at)| *at);
        self.previous = anchored.map(|(r, _)| PreviousSummary {
            summary: r.summary,
            summarized_head_tokens: r.summarized_head_tokens,
        });
        self.excluded = entries
            .iter()
            .filter(|e| is_exclusion(e))
            .filter_map(|e| {
                e.custom.as_ref()?.data["entry_id"]
                    .as_str()
                    .map(str::to_string)
            })
            .collect();
        self.opening = entries.iter().position(|e| {
            matches!(e.message, Some(AgentMessage::User(_))) && !self.excluded.contains(&e.entry_id)
        });
        if let Some(at) = self.opening.filter(|at| *at < self.start) {
            if let Some(m) = &entries[at].message {
                self.push(at, &entries[at].entry_id, m);
            }
        }
    }

    /// Whether redoing the entries from `from` on takes a result out of the window: `answered`
    /// cannot tell whether another entry holds the same id, so that (rare) case rebuilds.
    fn drops_a_result(&self, from: usize) -> bool {
        self.positions
            .iter()
            .rev()
            .take_while(|&&at| at >= from)
            .zip(self.messages.iter().rev())
            .any(|(_, m)| matches!(m, AgentMessage::FunctionResult(_)))
    }

    /// Drops the messages of entries from `from` on.
    fn truncate(&mut self, from: usize) {
        while self.positions.last().is_some_and(|&at| at >= from) {
            self.positions.pop();
            Arc::make_mut(&mut self.identities).pop();
            Arc::make_mut(&mut self.entry_ids).pop();
            self.total_bytes -= self.bytes.pop().unwrap_or(0);
            if let Some(m) = Arc::make_mut(&mut self.messages).pop() {
                self.forget_calls(&m);
            }
        }
        self.covered = from;
    }

    /// Folds in the entries from `from` on.
    fn extend(&mut self, entries: &[Entry], from: usize) {
        for (i, e) in entries.iter().enumerate().skip(from) {
            let Some(m) = &e.message else { continue };
            if self.excluded.contains(&e.entry_id) {
                continue;
            }
            if self.opening.is_none() && matches!(m, AgentMessage::User(_)) {
                self.opening = Some(i);
            }
            if let AgentMessage::FunctionResult(r) = m {
                if !self.answered.contains(&r.function_call_id) {
                    Arc::make_mut(&mut self.answered).insert(r.function_call_id.clone());
                }
            }
            // The opening message before the anchor was placed first by `anchor`.
            if i < self.start || !m.is_model_visible() {
                continue;
            }
            self.push(i, &e.entry_id, m);
        }
        self.covered = entries.len();
    }

    fn push(&mut self, at: usize, entry_id: &str, m: &AgentMessage) {
        let bytes = super::byte_bound(std::slice::from_ref(m));
        self.positions.push(at);
        Arc::make_mut(&mut self.identities).push(NEXT_IDENTITY.fetch_add(1, Ordering::Relaxed));
        Arc::make_mut(&mut self.entry_ids).push(entry_id.to_string());
        self.bytes.push(bytes);
        self.total_bytes += bytes;
        self.note_calls(m);
        Arc::make_mut(&mut self.messages).push(m.clone());
    }

    fn note_calls(&mut self, m: &AgentMessage) {
        match m {
            AgentMessage::FunctionResult(r) => {
                self.results.insert(r.function_call_id.clone());
                self.unresolved.remove(&r.function_call_id);
            }
            _ => {
                for id in call_ids(m) {
                    self.calls.insert(id.to_string());
                    if !self.results.contains(id) {
                        self.unresolved.insert(id.to_string());
                    }
                }
            }
        }
    }

    fn forget_calls(&mut self, m: &AgentMessage) {
        match m {
            AgentMessage::FunctionResult(r) => {
                self.results.remove(&r.function_call_id);
                if self.calls.contains(&r.function_call_id) {
                    self.unresolved.insert(r.function_call_id.clone());
                }
            }
            _ => {
                for id in call_ids(m) {
                    self.calls.remove(id);
                    self.unresolved.remove(id);
                }
            }
        }
    }
}

fn is_exclusion(e: &Entry) -> bool {
    e.custom
        .as_ref()
        .is_some_and(|c| c.custom_type == super::EXCLUDED_ENTRY)
}

/// The latest compaction entry's index.
fn latest_compaction(entries: &[Entry]) -> Option<usize> {
    entries.iter().rposition(|e| {
        e.custom
            .as_ref()
            .is_some_and(|c| c.custom_type == COMPACTION_ENTRY)
    })
}

fn call_ids(m: &AgentMessage) -> impl Iterator<Item = &str> {
    let content: &[ContentBlock] = match m {
        AgentMessage::Assistant(a) => &a.content,
        _ => &[],
    };
    content.iter().filter_map(|b| match b {
        ContentBlock::FunctionCall { id, .. } => Some(id.as_str()),
        _ => None,
    })
}
