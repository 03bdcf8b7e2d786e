//! The queue rows this process's writer inserted, handed to the next wake of their queue.
//!
//! Why: after every commit that enqueues (every step schedules the next), the queue's wake
//! used to read the new rows back from SQLite: a pooled reader whose page cache the commit had
//! just emptied, the rows' pages fetched again from the WAL and their payloads parsed — about a
//! seventh of a text step's CPU on the loop's side. The writer already had each row: it leaves
//! it here once the batch has committed ([`crate::after_commit`]), and the wake takes it.
//!
//! When the inbox can answer: the table's ids are AUTOINCREMENT and this process is the
//! database's only writer (`lock.rs`), so the writer's inserts come with consecutive ids. The
//! inbox knows every row above `complete_after` (until taken); a queue whose watermark is at or
//! above it finds here everything the table holds for it past the watermark. Anything else — a
//! gap in the ids (another process that took its turn on a shared database), rows inserted
//! before this process opened the store, an inbox that overflowed — moves `complete_after` up,
//! and the queue reads the table as before (its watermark then catches up with what the inbox
//! had seen before the read, so the next wake is served from here again).
//!
//! Who may take: one [`InboxClaim`] per store at a time, held by the store's `Queues`. Taking
//! moves rows out of the inbox into that `Queues`' index and its watermarks; a second taker
//! would move rows the first one then never sees. Only a claim has the taking methods, and a new
//! claim starts from "nothing known", so rows a dropped owner had taken are read from the table.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::store::Store;

/// Rows kept for queues that are not woken (none dispatches them in this process); past it the
/// inbox forgets them all and every queue reads the table once.
const MAX_ROWS: usize = 4_096;

/// One inserted row: its payload stays text, parsed by the waker, not on the writer thread.
pub(crate) struct InsertedRow {
    pub(crate) id: i64,
    pub(crate) group: String,
    pub(crate) function_id: String,
    pub(crate) payload: String,
}

#[derive(Default)]
pub(crate) struct QueueInbox {
    state: Mutex<State>,
    /// Whether an [`InboxClaim`] is alive.
    claimed: AtomicBool,
}

#[derive(Default)]
struct State {
    /// Every row inserted with an id above this is in `rows` or was taken by its queue's wake.
    /// Starts "nothing known" (0 with no row seen: see `push`).
    complete_after: i64,
    /// The highest id pushed (0: none yet).
    last: i64,
    rows: HashMap<String, VecDeque<InsertedRow>>,
    count: usize,
}

/// What [`QueueInbox::take`] answers.
pub(crate) enum Taken {
    /// Every row of the queue above the watermark (oldest first, possibly none), and the new
    /// watermark.
    Rows(Vec<InsertedRow>, i64),
    /// The inbox cannot vouch for the queue's rows above its watermark: read the table.
    Unknown,
}

thread_local! {
    /// The inbox of the store whose writer runs on this thread (set when the writer starts).
    static WRITER_INBOX: RefCell<Option<Arc<QueueInbox>>> = const { RefCell::new(None) };
}

/// Makes the current thread `inbox`'s writer: rows enqueued here are handed over on commit.
pub(crate) fn install_writer(inbox: Arc<QueueInbox>) {
    WRITER_INBOX.with(|i| *i.borrow_mut() = Some(inbox));
}

/// Hands `row` of `queue` to the inbox once the batch inserting it commits. Off a writer thread
/// nothing is handed over: the wake reads the table, as it must for a row the inbox never saw.
pub(crate) fn pend(queue: &str, row: InsertedRow) {
    let Some(inbox) = WRITER_INBOX.with(|i| i.borrow().clone()) else {
        return;
    };
    let queue = queue.to_string();
    crate::after_commit(move || inbox.push(&queue, row));
}

impl QueueInbox {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn push(&self, queue: &str, row: InsertedRow) {
        let mut s = self.state();
        if row.id != s.last + 1 || s.last == 0 {
            // Rows below this one are not known here (inserted before the store opened, by
            // another process, or never handed over): only what comes after is vouched for.
            s.complete_after = s.complete_after.max(row.id - 1);
        }
        s.last = s.last.max(row.id);
        if s.count >= MAX_ROWS {
            s.rows.clear();
            s.count = 0;
            s.complete_after = s.last;
            return;
        }
        s.count += 1;
        s.rows.entry(queue.to_string()).or_default().push_back(row);
    }

    /// Forgets every row and vouches for none seen so far: their queues read the table next.
    fn forget_all(&self) {
        let mut s = self.state();
        s.rows.clear();
        s.count = 0;
        s.complete_after = s.last;
    }

    /// The rows of `queue` above `scanned`, when the inbox holds all of them.
    fn take(&self, queue: &str, scanned: i64) -> Taken {
        let mut s = self.state();
        if s.last == 0 || scanned < s.complete_after {
            return Taken::Unknown;
        }
        let last = s.last;
        let rows: Vec<InsertedRow> = s
            .rows
            .remove(queue)
            .map(|q| q.into_iter().collect())
            .unwrap_or_default();
        s.count -= rows.len();
        let rows = rows.into_iter().filter(|r| r.id > scanned).collect();
        Taken::Rows(rows, last.max(scanned))
    }

    /// The highest id handed over so far: a read of the table that starts after this call sees
    /// every row up to it (a row is handed over only once committed).
    fn seen(&self) -> i64 {
        self.state().last
    }

    /// After `queue` read the table up to `scanned`: the rows it read are dropped here.
    fn forget_through(&self, queue: &str, scanned: i64) {
        let mut s = self.state();
        let Some(q) = s.rows.get_mut(queue) else {
            return;
        };
        let before = q.len();
        q.retain(|r| r.id > scanned);
        let gone = before - q.len();
        if q.is_empty() {
            s.rows.remove(queue);
        }
        s.count -= gone;
    }
}

/// The right to take rows from a store's inbox (see the module doc); released when dropped.
pub(crate) struct InboxClaim {
    store: Store,
}

impl InboxClaim {
    /// The claim on `store`'s inbox, or `None` while another one is alive.
    pub(crate) fn new(store: &Store) -> Option<InboxClaim> {
        let inbox = store.queue_inbox();
        inbox
            .claimed
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .ok()?;
        // A previous owner may have taken rows it never delivered: they are ready in the
        // table, and the new owner's watermarks start below them.
        inbox.forget_all();
        Some(InboxClaim {
            store: store.clone(),
        })
    }

    fn inbox(&self) -> &QueueInbox {
        self.store.queue_inbox()
    }

    /// See [`QueueInbox::take`].
    pub(crate) fn take(&self, queue: &str, scanned: i64) -> Taken {
        self.inbox().take(queue, scanned)
    }

    /// See [`QueueInbox::seen`].
    pub(crate) fn seen(&self) -> i64 {
        self.inbox().seen()
    }

    /// See [`QueueInbox::forget_through`].
    pub(crate) fn forget_through(&self, queue: &str, scanned: i64) {
        self.inbox().forget_through(queue, scanned)
    }
}

impl Drop for InboxClaim {
    fn drop(&mut self) {
        self.inbox().claimed.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: i64) -> InsertedRow {
        InsertedRow {
            id,
            group: "g".into(),
            function_id: "f".into(),
            payload: format!("{{\"n\":{id}}}"),
        }
    }

    fn ids(t: Taken) -> Option<(Vec<i64>, i64)> {
        match t {
            Taken::Rows(rows, scanned) => Some((rows.iter().map(|r| r.id).collect(), scanned)),
            Taken::Unknown => None,
        }
    }

    #[test]
    fn a_queue_is_served_once_its_watermark_reaches_what_the_inbox_vouches_for() {
        let inbox = QueueInbox::default();
        // Nothing seen yet: the table must be read.
        assert!(ids(inbox.take("q", 0)).is_none());
        // The first row seen is 5: rows 1-4 may exist in the table.
        inbox.push("q", row(5));
        inbox.push("other", row(6));
        inbox.push("q", row(7));
        assert!(ids(inbox.take("q", 3)).is_none());
        // The queue read the table up to what the inbox had seen before the read.
        let seen = inbox.seen();
        assert_eq!(seen, 7);
        inbox.forget_through("q", seen);
        assert_eq!(ids(inbox.take("q", seen)), Some((vec![], 7)));
        // From then on its rows come from here, another queue's ids in between.
        inbox.push("q", row(8));
        inbox.push("other", row(9));
        inbox.push("q", row(10));
        assert_eq!(ids(inbox.take("q", 7)), Some((vec![8, 10], 10)));
        assert_eq!(ids(inbox.take("other", 4)), Some((vec![6, 9], 10)));
        assert_eq!(inbox.state().count, 0);
    }

    #[test]
    fn a_gap_in_the_ids_sends_every_queue_below_it_back_to_the_table() {
        let inbox = QueueInbox::default();
        inbox.push("q", row(1));
        assert_eq!(ids(inbox.take("q", 0)), Some((vec![1], 1)));
        // Rows 2-4 were inserted by someone else: a queue at 1 cannot be served from here.
        inbox.push("q", row(5));
        assert!(ids(inbox.take("q", 1)).is_none());
        assert_eq!(ids(inbox.take("q", 4)), Some((vec![5], 5)));
    }

    #[test]
    fn an_overflowing_inbox_forgets_its_rows_and_vouches_only_for_later_ones() {
        let inbox = QueueInbox::default();
        let mut id = 0;
        for _ in 0..=MAX_ROWS {
            id += 1;
            inbox.push("never woken", row(id));
        }
        assert!(ids(inbox.take("q", 0)).is_none());
        assert_eq!(inbox.state().count, 0);
        id += 1;
        inbox.push("q", row(id));
        assert_eq!(ids(inbox.take("q", id - 1)), Some((vec![id], id)));
    }
}
