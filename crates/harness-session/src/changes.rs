//! What `session::changes` answers without SQLite: per session, the changes committed since a
//! reader last looked.
//!
//! Why it pays: the loop asks for a session's changes at every step, and a reader connection's
//! page cache is emptied whenever the database changed since its last read, which under load
//! is every read: each `changes` re-read every page on its path, a `pread` each.
//!
//! How it stays exact (the same rule as the kv cache in `harness-store`):
//!
//! * Only the writer adds to it: every append, update and delete publishes what it stored,
//!   after its batch COMMIT and before any write of the batch is answered
//!   ([`harness_store::after_commit`]). A rolled-back write publishes nothing.
//! * A session's log is opened by a reader, from what one SQLite read returned up to its mark
//!   `m`, and only if no change of that session above `m` was published yet. Every change the
//!   read missed commits later, so its publication finds the log open and lands in it.
//! * A log answers only readers whose mark is at or above the mark it was opened at. Each
//!   answer drops the changes at or below the reader's mark (the loop, its one regular reader,
//!   never asks for them again; another reader asking from further back reads SQLite).
//!
//! It is bounded: at most [`MAX_LOGS`] sessions have a log (the oldest are closed), and the
//! latest mark of at most [`MAX_KNOWN`] sessions is remembered (past it, the ones without a log
//! are forgotten and their largest mark becomes a floor every new log must be at or above).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use harness_types::session::{ChangesResponse, Entry};

/// Most sessions with an open log.
const MAX_LOGS: usize = 1024;
/// Most entries one log holds; past it the log is closed (nobody is reading it).
const MAX_CHANGES: usize = 256;
/// Most sessions whose latest published mark is remembered.
const MAX_KNOWN: usize = 64 * 1024;

/// The store's change log (one per store: see [`harness_store::Store::shared`]).
#[derive(Default)]
pub(crate) struct ChangeLog {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    sessions: HashMap<String, Known>,
    /// Sessions with a log, oldest opened first (may name sessions whose log is closed).
    opened: VecDeque<String>,
    logs: usize,
    /// The largest latest mark among the sessions forgotten to stay under [`MAX_KNOWN`].
    floor: i64,
    /// A write could not publish (it ran off a writer thread): nothing here is trusted again.
    disabled: bool,
}

#[derive(Default)]
struct Known {
    /// The mark of the latest change published for the session.
    latest: i64,
    log: Option<Log>,
}

struct Log {
    /// Every change of the session above this mark is in `changes`.
    from: i64,
    /// (mark, the entry as that change left it), in commit order.
    changes: Vec<(i64, Entry)>,
}

fn lock(m: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ChangeLog {
    /// Called by a write on the writer thread that changed an entry of `session_id` (change
    /// mark `chg`). `entry` is asked for only when the session has a log to put it in.
    pub(crate) fn publish(
        self: &Arc<Self>,
        session_id: &str,
        chg: i64,
        entry: impl FnOnce() -> Entry,
    ) {
        let entry = self.has_log(session_id).then(entry);
        let log = self.clone();
        let session = session_id.to_string();
        if !harness_store::after_commit(move || log.published(session, chg, entry)) {
            self.disable();
        }
    }

    /// Called by a delete of `session_id` (on the writer thread) whose event is `mark`.
    pub(crate) fn publish_delete(self: &Arc<Self>, session_id: &str, mark: i64) {
        let log = self.clone();
        let session = session_id.to_string();
        if !harness_store::after_commit(move || log.deleted(session, mark)) {
            self.disable();
        }
    }

    fn has_log(&self, session_id: &str) -> bool {
        let inner = lock(&self.inner);
        !inner.disabled
            && inner
                .sessions
                .get(session_id)
                .is_some_and(|k| k.log.is_some())
    }

    fn disable(&self) {
        let mut inner = lock(&self.inner);
        inner.disabled = true;
        inner.sessions.clear();
        inner.opened.clear();
        inner.logs = 0;
    }

    fn published(&self, session_id: String, chg: i64, entry: Option<Entry>) {
        let mut inner = lock(&self.inner);
        if inner.disabled {
            return;
        }
        let known = inner.sessions.entry(session_id).or_default();
        known.latest = known.latest.max(chg);
        let close = match (&mut known.log, entry) {
            (Some(log), Some(entry)) => {
                // Readers get an entry once, as it is now: its older change goes (a streamed
                // reply updates one entry many times).
                log.changes.retain(|(_, e)| e.entry_id != entry.entry_id);
                log.changes.push((chg, entry));
                // Nobody reads this session: stop holding its entries.
                log.changes.len() > MAX_CHANGES
            }
            // The log was opened after the write looked: it cannot be completed.
            (Some(_), None) => true,
            (None, _) => false,
        };
        if close {
            known.log = None;
            inner.logs -= 1;
        }
        inner.bound_known();
    }

    fn deleted(&self, session_id: String, mark: i64) {
        let mut inner = lock(&self.inner);
        if inner.disabled {
            return;
        }
        let known = inner.sessions.entry(session_id).or_default();
        known.latest = known.latest.max(mark);
        if known.log.take().is_some() {
            inner.logs -= 1;
        }
    }

    /// The changes of `session_id` after `after`, if the session's log holds them all.
    pub(crate) fn read(
        &self,
        session_id: &str,
        after: i64,
        limit: usize,
    ) -> Option<ChangesResponse> {
        let mut inner = lock(&self.inner);
        if inner.disabled {
            return None;
        }
        let log = inner.sessions.get_mut(session_id)?.log.as_mut()?;
        if after < log.from {
            return None;
        }
        // The reader has everything up to `after`.
        log.changes.retain(|(chg, _)| *chg > after);
        log.from = after;
        // Each entry is there once, at its latest change (see `published`), as SQLite answers.
        let mut latest: Vec<&(i64, Entry)> = log.changes.iter().collect();
        let more = latest.len() > limit;
        latest.truncate(limit);
        Some(ChangesResponse {
            mark: latest.last().map_or(after, |(chg, _)| *chg),
            entries: latest.into_iter().map(|(_, e)| e.clone()).collect(),
            more,
        })
    }

    /// Opens `session_id`'s log after a SQLite read that returned every change up to `mark`,
    /// unless a later change was published already (the read may have missed it).
    pub(crate) fn open(&self, session_id: &str, mark: i64) {
        let mut inner = lock(&self.inner);
        if inner.disabled {
            return;
        }
        let floor = inner.floor;
        let latest = inner.sessions.get(session_id).map(|k| k.latest);
        if latest.unwrap_or(floor) > mark {
            return;
        }
        let known = inner.sessions.entry(session_id.to_string()).or_default();
        if known.log.is_some() {
            return;
        }
        known.log = Some(Log {
            from: mark,
            changes: Vec::new(),
        });
        inner.logs += 1;
        inner.opened.push_back(session_id.to_string());
        while inner.logs > MAX_LOGS {
            let Some(oldest) = inner.opened.pop_front() else {
                break;
            };
            if let Some(k) = inner.sessions.get_mut(&oldest) {
                if k.log.take().is_some() {
                    inner.logs -= 1;
                }
            }
        }
        if inner.opened.len() > 4 * MAX_LOGS {
            let Inner {
                sessions, opened, ..
            } = &mut *inner;
            opened.retain(|s| sessions.get(s).is_some_and(|k| k.log.is_some()));
        }
        inner.bound_known();
    }
}

impl Inner {
    /// Forgets the sessions without a log past [`MAX_KNOWN`]; their marks become the floor.
    fn bound_known(&mut self) {
        if self.sessions.len() <= MAX_KNOWN {
            return;
        }
        let mut floor = self.floor;
        self.sessions.retain(|_, k| {
            if k.log.is_some() {
                return true;
            }
            floor = floor.max(k.latest);
            false
        });
        self.floor = floor;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str, revision: i64) -> Entry {
        Entry {
            entry_id: id.into(),
            seq: 1,
            message: None,
            custom: None,
            origin: None,
            revision,
        }
    }

    fn ids(r: &ChangesResponse) -> Vec<(&str, i64)> {
        r.entries
            .iter()
            .map(|e| (e.entry_id.as_str(), e.revision))
            .collect()
    }

    #[test]
    fn a_log_opens_only_over_every_published_change() {
        let log = ChangeLog::default();
        // A write the read did not see was already published: no log.
        log.published("s".into(), 12, None);
        log.open("s", 10);
        assert!(log.read("s", 10, 100).is_none());
        // A read that saw it opens one.
        log.open("s", 12);
        assert_eq!(log.read("s", 12, 100).map(|r| r.mark), Some(12));
        // Never for a reader from further back than the log.
        assert!(log.read("s", 11, 100).is_none());
    }

    #[test]
    fn an_entry_changed_twice_is_answered_once_as_it_is_now() {
        let log = ChangeLog::default();
        log.open("s", 0);
        log.published("s".into(), 1, Some(entry("a", 0)));
        log.published("s".into(), 2, Some(entry("b", 0)));
        log.published("s".into(), 3, Some(entry("a", 1)));
        let r = log.read("s", 0, 100).unwrap();
        assert_eq!(ids(&r), [("b", 0), ("a", 1)]);
        assert_eq!((r.mark, r.more), (3, false));
        // What the reader has is dropped; the rest pages.
        log.published("s".into(), 4, Some(entry("c", 0)));
        log.published("s".into(), 5, Some(entry("d", 0)));
        let p1 = log.read("s", 3, 1).unwrap();
        assert_eq!((ids(&p1), p1.mark, p1.more), (vec![("c", 0)], 4, true));
        let p2 = log.read("s", 4, 1).unwrap();
        assert_eq!((ids(&p2), p2.mark, p2.more), (vec![("d", 0)], 5, false));
    }

    #[test]
    fn a_change_the_log_cannot_hold_closes_it() {
        let log = ChangeLog::default();
        log.open("s", 0);
        // Published without its entry (the write looked before the log opened).
        log.published("s".into(), 1, None);
        assert!(log.read("s", 0, 100).is_none());
        // A delete closes it, and no read from before the delete opens it again.
        log.open("t", 0);
        log.deleted("t".into(), 7);
        assert!(log.read("t", 0, 100).is_none());
        log.open("t", 5);
        assert!(log.read("t", 5, 100).is_none());
        // Too many changes nobody reads close it.
        log.open("u", 0);
        for i in 0..=MAX_CHANGES as i64 {
            log.published("u".into(), 10 + i, Some(entry(&format!("e{i}"), 0)));
        }
        assert!(log.read("u", 0, 100).is_none());
    }

    #[test]
    fn forgotten_sessions_leave_a_floor_and_a_write_off_the_writer_disables_all() {
        let log = Arc::new(ChangeLog::default());
        for i in 0..=MAX_KNOWN as i64 {
            log.published(format!("s{i}"), i + 1, None);
        }
        // s0 was forgotten: its change may be as late as the floor.
        log.open("s0", 0);
        assert!(log.read("s0", 0, 100).is_none());
        log.open("s0", MAX_KNOWN as i64 + 1);
        assert!(log.read("s0", MAX_KNOWN as i64 + 1, 100).is_some());
        // Published from a thread that is no store's writer: nothing is trusted any more.
        log.publish("s0", 1 << 40, || entry("x", 0));
        assert!(log.read("s0", MAX_KNOWN as i64 + 1, 100).is_none());
        log.open("fresh", 1 << 50);
        assert!(log.read("fresh", 1 << 50, 100).is_none());
    }

    #[test]
    fn at_most_max_logs_are_open() {
        let log = ChangeLog::default();
        for i in 0..=MAX_LOGS {
            log.open(&format!("s{i}"), 0);
        }
        assert!(log.read("s0", 0, 1).is_none(), "the oldest was closed");
        assert!(log.read(&format!("s{MAX_LOGS}"), 0, 1).is_some());
        assert_eq!(lock(&log.inner).logs, MAX_LOGS);
    }
}
