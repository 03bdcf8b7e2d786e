//! A session's transcript as the loop reads it: from this process's copy, brought up to date
//! with what changed since (`session::changes`), and the window a step builds on it.

use std::sync::Arc;
use std::time::Duration;

use harness_types::session::{
    ChangesRequest, ChangesResponse, Entry, MessagesRequest, MessagesResponse,
};
use harness_types::HarnessError;

use crate::context::Window;
use crate::harness::{CachedTranscript, Harness, Result};

impl Harness {
    /// Every entry of the session (custom records included), in `seq` order. Reads only what
    /// changed since this process last read the session (see [`Harness::transcript_shared`]).
    pub(crate) async fn transcript(&self, session_id: &str) -> Result<Vec<Entry>> {
        Ok(self.transcript_shared(session_id).await?.as_ref().clone())
    }

    /// `session::changes`, in-process when the transcript store is (no JSON either way). The
    /// outer error is the bus's; the inner one an answer of the wrong shape.
    async fn changes(
        &self,
        req: ChangesRequest,
    ) -> std::result::Result<Result<ChangesResponse>, harness_bus::BusError> {
        const ID: &str = "session::changes";
        let timeout = Duration::from_millis(self.config().session_timeout_ms);
        if let Some(local) = self.inner.bus.local_handler(ID) {
            let ctx = harness_bus::CallContext::default();
            return harness_bus::local::invoke(local.as_ref(), ID, Box::new(req), ctx, timeout)
                .await
                .map(Ok);
        }
        let payload = match serde_json::to_value(&req) {
            Ok(payload) => payload,
            Err(e) => return Ok(Err(HarnessError::internal(e.to_string()))),
        };
        let answer = self.inner.bus.call(ID, payload, Some(timeout)).await?;
        Ok(serde_json::from_value(answer).map_err(|e| {
            HarnessError::dependency(format!("{ID} answered an unexpected shape: {e}"))
        }))
    }

    /// [`Harness::transcript`] without the copy: the returned list is shared with the
    /// per-session cache, so a step on a long session costs its new entries, not its history.
    /// Asks `session::changes` for the entries appended or updated since the cached mark (one
    /// indexed read when nothing changed); without that function (another transcript store),
    /// reads the whole transcript every time.
    pub(crate) async fn transcript_shared(&self, session_id: &str) -> Result<Arc<Vec<Entry>>> {
        let cached = self
            .inner
            .transcripts
            .lock()
            .expect("transcripts lock")
            .take(session_id);
        let mut mark = cached.as_ref().map(|c| c.mark);
        let mut cached = cached.unwrap_or_else(|| CachedTranscript::new(None, Arc::default()));
        loop {
            let req = ChangesRequest {
                session_id: session_id.to_string(),
                after: mark,
                limit: Some(500),
            };
            let page: ChangesResponse = match self.changes(req).await {
                Ok(page) => page?,
                Err(e) if e.is_not_found() => {
                    return self.transcript_paged(session_id).await.map(Arc::new)
                }
                Err(e) => return Err(e.into_harness()),
            };
            let touched = merge_changes(Arc::make_mut(&mut cached.entries), page.entries);
            cached.dirty_from = cached.dirty_from.min(touched);
            mark = Some(page.mark);
            if !page.more {
                break;
            }
        }
        let entries = cached.entries.clone();
        if let Some(mark) = mark {
            cached.mark = mark;
            self.inner
                .transcripts
                .lock()
                .expect("transcripts lock")
                .put(session_id, cached);
        }
        Ok(entries)
    }

    /// The window a step over `entries` (the first `upto` of the session's transcript) hands
    /// the context manager: the session's kept window brought up to date when `entries` is the
    /// cached copy, one built from scratch otherwise (a redelivered step that stops short of
    /// its own assistant entry, a copy another reader replaced).
    pub(crate) fn window_of(
        &self,
        session_id: &str,
        entries: &Arc<Vec<Entry>>,
        upto: usize,
        watermark: Option<&str>,
    ) -> Window {
        if upto >= entries.len() {
            let kept = self
                .inner
                .transcripts
                .lock()
                .expect("transcripts lock")
                .window(session_id, entries, watermark);
            if let Some(w) = kept {
                return w;
            }
        }
        crate::context::window(&entries[..upto.min(entries.len())], watermark)
    }

    /// Drops this process's copy of a session's transcript (the session is gone).
    pub(crate) fn forget_transcript(&self, session_id: &str) {
        self.inner
            .transcripts
            .lock()
            .expect("transcripts lock")
            .take(session_id);
    }

    /// Every entry, paging through `session::messages` (the whole history, every time).
    async fn transcript_paged(&self, session_id: &str) -> Result<Vec<Entry>> {
        let mut out = Vec::new();
        let mut cursor = None;
        loop {
            let page: MessagesResponse = self
                .call(
                    "session::messages",
                    &MessagesRequest {
                        session_id: session_id.to_string(),
                        include_custom: true,
                        limit: Some(500),
                        cursor,
                        after_entry_id: None,
                    },
                )
                .await?;
            out.extend(page.messages);
            match page.next_cursor {
                Some(c) => cursor = Some(c),
                None => return Ok(out),
            }
        }
    }
}

/// A session's transcript read at most once by what follows a turn's end (its telemetry and its
/// usage milestones, each of which may want it or not): the second asks nothing of the store.
#[derive(Default)]
pub(crate) struct TranscriptOnce(Option<Arc<Vec<Entry>>>);

impl TranscriptOnce {
    pub(crate) async fn get(&mut self, h: &Harness, session_id: &str) -> Result<Arc<Vec<Entry>>> {
        if let Some(entries) = &self.0 {
            return Ok(Arc::clone(entries));
        }
        let entries = h.transcript_shared(session_id).await?;
        self.0 = Some(Arc::clone(&entries));
        Ok(entries)
    }
}

/// Folds changed entries into a transcript kept in `seq` order: an entry already there is
/// replaced (an update), a new one is inserted at its place (almost always the end). Answers the
/// lowest index it touched (`entries.len()` when nothing changed).
fn merge_changes(entries: &mut Vec<Entry>, changed: Vec<Entry>) -> usize {
    let mut lowest = usize::MAX;
    for e in changed {
        let at = match entries.binary_search_by_key(&e.seq, |x| x.seq) {
            Ok(at) => {
                entries[at] = e;
                at
            }
            Err(at) => {
                entries.insert(at, e);
                at
            }
        };
        lowest = lowest.min(at);
    }
    lowest.min(entries.len())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use harness_types::session::CustomEntry;

    /// A custom entry at `seq`, its data its `revision`.
    pub(crate) fn entry(seq: i64, revision: i64) -> Entry {
        Entry {
            entry_id: format!("e{seq}"),
            seq,
            message: None,
            custom: Some(CustomEntry {
                custom_type: "t".into(),
                data: serde_json::json!(revision),
            }),
            origin: None,
            revision,
        }
    }

    #[test]
    fn changes_merge_in_seq_order_and_replace_updates() {
        let mut entries = vec![entry(1, 0), entry(2, 0)];
        let lowest = merge_changes(&mut entries, vec![entry(4, 0), entry(2, 1), entry(3, 0)]);
        let got: Vec<(i64, i64)> = entries.iter().map(|e| (e.seq, e.revision)).collect();
        assert_eq!(got, [(1, 0), (2, 1), (3, 0), (4, 0)]);
        // The update of seq 2 is the lowest change: a kept window is redone from there.
        assert_eq!(lowest, 1);
        assert_eq!(merge_changes(&mut entries, vec![entry(5, 0)]), 4);
        assert_eq!(merge_changes(&mut entries, Vec::new()), entries.len());
    }
}
