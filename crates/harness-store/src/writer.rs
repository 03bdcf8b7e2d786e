//! The writer thread: every write queued at the same moment runs in one transaction (group
//! commit), and each op's failure is confined to that op.
//!
//! How an op is confined decides what the batch costs. A SAVEPOINT per op makes SQLite copy
//! every page the op touches into a statement journal first, and costs two more statements per
//! op: on a step's writes that was a sixth of the writer's time. So ops come in two kinds:
//!
//! * a **once** op (any closure: it may have effects outside the database) runs in its own
//!   savepoint, as it always did;
//! * a **replayable** op only touches the connection, so it may run again: consecutive
//!   replayable ops run with no savepoint of their own. When one fails, the run of replayable
//!   ops it belongs to is rolled back (to one savepoint taken where the run started, or, when
//!   the run started the transaction, by rolling the transaction back: no journal at all), the
//!   failing op gets its error, and the others run again, each in its own savepoint this time.
//!
//! Either way an op's reply is sent only after the batch COMMIT succeeded: a resolved write is
//! a committed write.
//!
//! A full disk (SQLITE_FULL, usually at the COMMIT, when the WAL cannot grow) rolls the batch
//! back whole: every op of it answers [`StoreError::Full`], nothing of it stays, and the writer
//! takes the next batch as usual, so writes succeed again as soon as space returns. The store
//! remembers the failure (see `Counters::note_full`) until a commit writes to the WAL again.

use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::mpsc;

use rusqlite::Connection;
use tokio::sync::oneshot;

use crate::cache::KvCache;
use crate::error::{sqlite_is_full, StoreError};
use crate::events::EventTail;
use crate::panic_message;
use crate::store::Counters;

/// Most ops folded into one transaction; bounds a batch's latency and memory.
const MAX_BATCH: usize = 1024;

/// How long a batch goes on taking in ops that arrived while it ran before it commits.
const MAX_BATCH_TIME: std::time::Duration = std::time::Duration::from_millis(2);

/// How long the writer waits without a write before it empties the WAL (see [`truncate_wal`]).
/// Long enough that a burst's pauses (a model's latency) do not pay for a checkpoint, short
/// enough that a quiet server's WAL is back to nothing within a second.
const IDLE_TRUNCATE_AFTER: std::time::Duration = std::time::Duration::from_millis(500);

/// How long an idle truncation waits for readers to leave the WAL before it gives up.
const TRUNCATE_BUSY_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(200);

/// How long the truncation at close keeps trying while readers or the checkpointer are in
/// its way.
const CLOSE_BUSY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// What the host runs on the writer thread once an idle store has given its own memory back
/// ([`set_idle_release`]).
static IDLE_RELEASE: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

/// Sets what an idle writer runs after it has folded, emptied the WAL and shrunk SQLite's
/// cache: the host's way to give back the free pages its allocator keeps for this thread (the
/// store does not own the allocator). Set once per process; later calls change nothing and
/// return `false`.
pub fn set_idle_release(release: fn()) -> bool {
    IDLE_RELEASE.set(release).is_ok()
}

/// Work a write leaves for the writer to run later: after the batch's COMMIT
/// ([`after_commit`]), or if its changes roll back ([`on_rollback`]).
type Deferred = Vec<Box<dyn FnOnce()>>;

thread_local! {
    /// Work the batch in progress leaves for after its COMMIT ([`after_commit`]); `None` off a
    /// writer thread.
    static AFTER_COMMIT: RefCell<Option<Deferred>> = const { RefCell::new(None) };
}

/// Runs `f` once the batch the current write belongs to has committed, before any write of
/// the batch is answered, so a read that starts after a write resolved finds `f` done. Dropped
/// unrun with whatever the batch rolls back. For in-memory copies of what writes change (a
/// write-through cache publishing what a write stored). Returns false, and drops `f`, off a
/// writer thread: the caller must then stop trusting its copy.
pub fn after_commit(f: impl FnOnce() + 'static) -> bool {
    AFTER_COMMIT.with(|pending| match pending.borrow_mut().as_mut() {
        Some(list) => {
            list.push(Box::new(f));
            true
        }
        None => false,
    })
}

thread_local! {
    /// How to undo the in-memory changes of the batch in progress ([`on_rollback`]), oldest
    /// first; `None` off a writer thread.
    static ON_ROLLBACK: RefCell<Option<Deferred>> = const { RefCell::new(None) };
}

/// Runs `f` if the changes of the current write roll back (its own savepoint's, its run's, or
/// the whole batch's), before the writer runs anything else; dropped unrun once the batch has
/// committed. For state a writer keeps in its own memory beside what a write stores (an index
/// the next write of the same batch must see, as it would see a TEMP table's rows): `f` puts
/// back what the write changed, and undos run newest first, so each finds the state its change
/// left. Off a writer thread nothing could run it: `f` is handed back, for the caller to undo
/// its change itself.
pub fn on_rollback<F: FnOnce() + 'static>(f: F) -> Result<(), F> {
    ON_ROLLBACK.with(|pending| match pending.borrow_mut().as_mut() {
        Some(list) => {
            list.push(Box::new(f));
            Ok(())
        }
        None => Err(f),
    })
}

/// Where a write's own work starts in both lists: what it queues after this is undone or
/// dropped with it.
#[derive(Clone, Copy)]
struct Marks {
    after: usize,
    undo: usize,
}

fn marks() -> Marks {
    Marks {
        after: AFTER_COMMIT.with(|p| p.borrow().as_ref().map_or(0, Vec::len)),
        undo: ON_ROLLBACK.with(|p| p.borrow().as_ref().map_or(0, Vec::len)),
    }
}

/// The writes since `marks` rolled back: their after-commit work is dropped and their
/// in-memory changes undone, newest first.
fn rolled_back_since(marks: Marks) {
    let dropped = AFTER_COMMIT.with(|p| {
        p.borrow_mut()
            .as_mut()
            .map(|l| l.split_off(marks.after.min(l.len())))
    });
    drop(dropped);
    let undo = ON_ROLLBACK.with(|p| {
        p.borrow_mut()
            .as_mut()
            .map(|l| l.split_off(marks.undo.min(l.len())))
    });
    for f in undo.into_iter().flatten().rev() {
        if let Err(payload) = catch_unwind(AssertUnwindSafe(f)) {
            tracing::error!(
                "harness-store: undoing a rolled-back write panicked: {}",
                panic_message(payload.as_ref())
            );
        }
    }
}

/// The batch committed: what would have undone its writes is dropped.
fn committed_undo() {
    let done = ON_ROLLBACK.with(|p| p.borrow_mut().as_mut().map(std::mem::take));
    drop(done);
}

const NOTHING: Marks = Marks { after: 0, undo: 0 };

/// Runs what the committed batch left, in the order its writes queued it. A panic in one is
/// logged and does not stop the others (nor the writer).
fn run_after_commit() {
    let list = AFTER_COMMIT.with(|p| p.borrow_mut().as_mut().map(std::mem::take));
    for f in list.into_iter().flatten() {
        if let Err(payload) = catch_unwind(AssertUnwindSafe(f)) {
            tracing::error!(
                "harness-store: after-commit work panicked: {}",
                panic_message(payload.as_ref())
            );
        }
    }
}

/// A write op as the writer thread sees it.
pub(crate) trait Op: Send {
    /// Runs on the batch's connection, or learns why it cannot run. Returns whether it
    /// succeeded. A [`Op::replayable`] op may be run again after its changes were rolled back.
    fn run(&mut self, conn: Result<&Connection, &str>) -> bool;
    /// Whether [`Op::run`] may be called more than once.
    fn replayable(&self) -> bool;
    /// Whether the latest run failed because the disk is full.
    fn failed_full(&self) -> bool;
    /// Sends the outcome of the latest run; `lost` means the batch was lost after it succeeded.
    fn reply(self: Box<Self>, lost: Option<Lost>);
}

/// Why a batch was lost after some of its ops had succeeded.
#[derive(Clone, Debug)]
pub(crate) struct Lost {
    reason: String,
    full: bool,
}

impl Lost {
    fn new(reason: impl Into<String>) -> Lost {
        Lost {
            reason: reason.into(),
            full: false,
        }
    }

    /// A lost batch whose cause was `e`: a full disk keeps its kind.
    fn from_sqlite(what: &str, e: &rusqlite::Error) -> Lost {
        Lost {
            reason: format!("{what}: {e}"),
            full: sqlite_is_full(e),
        }
    }

    fn full(mut self, full: bool) -> Lost {
        self.full |= full;
        self
    }

    fn error(self) -> StoreError {
        if self.full {
            StoreError::Full(self.reason)
        } else {
            StoreError::Invalid(self.reason)
        }
    }
}

fn guarded<R>(
    conn: Result<&Connection, &str>,
    f: impl FnOnce(&Connection) -> Result<R, StoreError>,
) -> Result<R, StoreError> {
    match conn {
        Ok(conn) => catch_unwind(AssertUnwindSafe(|| f(conn))).unwrap_or_else(|payload| {
            Err(StoreError::Invalid(format!(
                "write closure panicked: {}",
                panic_message(payload.as_ref())
            )))
        }),
        Err(reason) => Err(StoreError::Invalid(reason.to_string())),
    }
}

fn send<R>(
    tx: oneshot::Sender<Result<R, StoreError>>,
    out: Option<Result<R, StoreError>>,
    lost: Option<Lost>,
) {
    let out = match (out, lost) {
        (Some(Ok(_)), Some(lost)) => Err(lost.error()),
        (Some(res), _) => res.map_err(StoreError::classified),
        (None, _) => Err(StoreError::Invalid("the write never ran".into())),
    };
    let _ = tx.send(out);
}

/// A write closure and where its answer goes. A replayable one only touches the connection, so
/// it may run again after a rollback; any other runs at most once, in its own savepoint.
pub(crate) struct Closure<F, R> {
    f: F,
    replayable: bool,
    out: Option<Result<R, StoreError>>,
    tx: oneshot::Sender<Result<R, StoreError>>,
}

impl<F, R> Closure<F, R> {
    pub(crate) fn replayable(f: F, tx: oneshot::Sender<Result<R, StoreError>>) -> Self {
        Closure {
            f,
            replayable: true,
            out: None,
            tx,
        }
    }
}

/// A closure that runs at most once (a second run answers an error instead).
pub(crate) fn once<R>(
    f: impl FnOnce(&Connection) -> Result<R, StoreError>,
    tx: oneshot::Sender<Result<R, StoreError>>,
) -> Closure<impl FnMut(&Connection) -> Result<R, StoreError>, R> {
    let mut f = Some(f);
    Closure {
        f: move |conn: &Connection| match f.take() {
            Some(f) => f(conn),
            None => Err(StoreError::Invalid("a write ran twice".into())),
        },
        replayable: false,
        out: None,
        tx,
    }
}

impl<F, R> Op for Closure<F, R>
where
    F: FnMut(&Connection) -> Result<R, StoreError> + Send,
    R: Send,
{
    fn run(&mut self, conn: Result<&Connection, &str>) -> bool {
        let res = guarded(conn, &mut self.f);
        let ok = res.is_ok();
        self.out = Some(res);
        ok
    }

    fn replayable(&self) -> bool {
        self.replayable
    }

    fn failed_full(&self) -> bool {
        matches!(&self.out, Some(Err(e)) if e.is_full())
    }

    fn reply(self: Box<Self>, lost: Option<Lost>) {
        send(self.tx, self.out, lost)
    }
}

/// Blocks for the first op, drains whatever else is already queued and runs it all as one
/// transaction, taking in what arrives meanwhile (up to [`MAX_BATCH`] ops or
/// [`MAX_BATCH_TIME`]) before the COMMIT. Exits when every sender is gone and the queue is empty.
pub(crate) fn writer_loop(
    conn: Connection,
    rx: mpsc::Receiver<Box<dyn Op>>,
    counters: &Counters,
    cache: &KvCache,
    tail: &std::sync::Arc<EventTail>,
) {
    AFTER_COMMIT.with(|p| *p.borrow_mut() = Some(Vec::new()));
    ON_ROLLBACK.with(|p| *p.borrow_mut() = Some(Vec::new()));
    let mut batch: Vec<Box<dyn Op>> = Vec::with_capacity(MAX_BATCH);
    // Commits since the WAL was last emptied: an idle writer with none has nothing to truncate.
    let mut unsettled = false;
    let mut linger = Linger::default();
    loop {
        let first = match rx.recv_timeout(IDLE_TRUNCATE_AFTER) {
            Ok(op) => op,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                // Idle: the tail is folded before the WAL is emptied, so neither memory nor
                // the next open holds more than a burst's events.
                if tail.len() > 0 || !cache.log.is_empty() || crate::events::fold_under_way() {
                    fold_events(&conn, counters, cache, tail, true);
                    unsettled = true;
                }
                if unsettled {
                    unsettled = !truncate_wal(&conn, counters);
                    if !unsettled {
                        // The TEMP tables' and the folds' scratch pages stay in this connection's
                        // cache at the size the last burst left them; an idle store gives
                        // them back (the cache refills from the OS's pages on the next burst).
                        let _ = exec(&conn, "PRAGMA shrink_memory");
                        // The fold's own tables go the same way (see `renew_fold_db`).
                        if let Err(e) = crate::events::renew_fold_db(&conn) {
                            tracing::warn!(error = %e, "harness-store: fold tables kept");
                        }
                        // The pages the burst's rows and logs took stay with this thread's
                        // heap until the host's allocator is told (0.1–1 MB after a busy
                        // burst), and only this thread can tell it about its own.
                        if let Some(release) = IDLE_RELEASE.get() {
                            release();
                        }
                    }
                }
                continue;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                if tail.len() > 0 || !cache.log.is_empty() || crate::events::fold_under_way() {
                    fold_events(&conn, counters, cache, tail, true);
                    unsettled = true;
                }
                // A clean stop leaves the data directory holding what it stores, not the WAL's
                // high-water mark: the last connection to close would delete the WAL, but the
                // writer's is not the last one (readers and the checkpointer close after it).
                // Nothing waits on the writer any more, and the checkpointer may be copying the
                // WAL: its PASSIVE checkpoint holds the checkpoint lock, which SQLite does not
                // wait for (no busy handler: the TRUNCATE fails at once), so try again until
                // it is done rather than give up (a clean stop under load left 20 MB so).
                if unsettled {
                    let deadline = std::time::Instant::now() + CLOSE_BUSY_TIMEOUT;
                    while !truncate_wal(&conn, counters) && std::time::Instant::now() < deadline {
                        std::thread::sleep(std::time::Duration::from_millis(5));
                    }
                }
                break;
            }
        };
        unsettled = true;
        let started = std::time::Instant::now();
        batch.push(first);
        let mut txn = Batch::new(&conn, cache, counters);
        let mut ran = 0;
        // Drains what is queued, runs it, and drains again: what arrived while the batch ran
        // joins it rather than wait for the COMMIT and open a transaction of its own (a
        // commit's cost is mostly the right edges it rewrites, whatever it carries). A large
        // batch also waits a moment for more (see `Linger`).
        loop {
            while ran + batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(op) => batch.push(op),
                    Err(_) => break,
                }
            }
            if batch.is_empty() {
                // Nothing queued: a large batch waits a moment for the next write, while such
                // waits have lately been answered (see `Linger`).
                if !linger.large(ran) {
                    break;
                }
                match linger.wait(&rx, counters) {
                    Some(op) => batch.push(op),
                    None => break,
                }
            }
            for op in batch.drain(..) {
                counters.writes.fetch_add(1, Ordering::Relaxed);
                txn.run(op);
                ran += 1;
            }
            if ran >= MAX_BATCH || started.elapsed() >= MAX_BATCH_TIME {
                break;
            }
        }
        linger.batch_ran(ran);
        txn.commit(counters);
        // A fold runs in parts, one after each batch (see `events::fold_part_in`).
        if crate::events::fold_under_way() || tail.due() || cache.log.due() {
            fold_events(&conn, counters, cache, tail, false);
        }
        let checkpoint = counters.batch_checkpoint_ns.swap(0, Ordering::Relaxed);
        counters
            .writer_checkpoint_ns
            .fetch_add(checkpoint, Ordering::Relaxed);
        // A wait for the next write is not work.
        let busy = started.elapsed().saturating_sub(linger.take_waited());
        counters
            .writer_busy_ns
            .fetch_add(busy.as_nanos() as u64, Ordering::Relaxed);
    }
}

/// How long a batch with nothing queued waits for one more write before it commits.
const LINGER: std::time::Duration = std::time::Duration::from_micros(40);

/// A batch waits ([`LINGER`]) once it has run this many writes (or two, while recent batches
/// ran twice this on average).
const LINGER_FROM: usize = 8;

/// Whether a batch that has run everything queued waits [`LINGER`] for one more write.
///
/// A commit's cost is mostly fixed (the right edges of the logs it appends to, the database
/// header, the free list): pages a step follow commits a step (≈ 2.7 + 4.8 × commits a step at
/// 200 sessions), so a write that joins the batch instead of opening the next one saves most of
/// a commit. But a write's caller waits for the COMMIT, so when every writer there is already
/// waits on this batch nothing comes, and the wait is only their loss (a step of a few
/// sessions makes several writes in a row, each waiting for its commit). The writer cannot
/// count its writers; two signs stand in:
///
/// * the batches' size: callers make one write at a time, so a batch that ran
///   [`LINGER_FROM`] writes had that many callers waiting on it at once, and more are likely
///   between two writes; so are they when the recent batches ran twice that on average (many
///   callers, though this batch is small), and then a batch of two waits too. A few
///   sessions' batches are smaller, and a lone write never waits;
/// * its recent waits: it waits while more than half of them were answered, and otherwise
///   tries one wait in [`Linger::PROBE`], to notice when they would be again.
///
/// It waits again after each answered wait, up to the batch's [`MAX_BATCH_TIME`].
#[derive(Default)]
struct Linger {
    /// Share of recent waits answered, in 1/256 (an average over ~8 waits).
    answered: u32,
    /// Batches that could have waited since the last wait.
    since: u32,
    /// Time spent waiting in the batch in progress.
    waited: std::time::Duration,
    /// Writes a batch ran lately, in 1/16 (an average over ~8 batches).
    mean_batch: usize,
}

impl Linger {
    const PROBE: u32 = 16;
    /// Waits while more than this share of recent waits was answered (in 1/256).
    const WORTH: u32 = 128;

    /// Waits for the next write if waits are worth it now; counts the wait in `counters`.
    fn wait(
        &mut self,
        rx: &mpsc::Receiver<Box<dyn Op>>,
        counters: &Counters,
    ) -> Option<Box<dyn Op>> {
        if !self.worth_waiting() {
            return None;
        }
        let from = std::time::Instant::now();
        let got = rx.recv_timeout(LINGER).ok();
        self.waited += from.elapsed();
        self.answered(got.is_some());
        counters.linger_waits.fetch_add(1, Ordering::Relaxed);
        if got.is_some() {
            counters.linger_answered.fetch_add(1, Ordering::Relaxed);
        }
        got
    }

    /// Whether this batch waits (and then that it is the probe's turn no longer).
    fn worth_waiting(&mut self) -> bool {
        self.since += 1;
        if self.answered <= Self::WORTH && self.since < Self::PROBE {
            return false;
        }
        self.since = 0;
        true
    }

    /// Notes whether a wait was answered.
    fn answered(&mut self, hit: bool) {
        self.answered = (self.answered * 7 + if hit { 256 } else { 0 }) / 8;
    }

    /// Whether a batch that ran `ran` writes is large enough to wait: [`LINGER_FROM`] writes,
    /// or any two while the batches lately ran twice that on average (many writers).
    fn large(&self, ran: usize) -> bool {
        ran >= LINGER_FROM || (ran >= 2 && self.mean_batch >= 2 * LINGER_FROM * 16)
    }

    fn batch_ran(&mut self, ran: usize) {
        self.mean_batch = (self.mean_batch * 7 + ran * 16) / 8;
    }

    fn take_waited(&mut self) -> std::time::Duration {
        std::mem::take(&mut self.waited)
    }
}

/// Folds the event tail into the per-session index (`events.rs`) as a batch of its own: the
/// next part of the fold under way (or the first of a new one), or, `whole`, the rest of it and
/// a whole one after it. A failure (a full disk) is logged, abandons the fold under way and
/// leaves the tail as it was, to be folded later.
fn fold_events(
    conn: &Connection,
    counters: &Counters,
    cache: &KvCache,
    tail: &std::sync::Arc<EventTail>,
    whole: bool,
) {
    let folding = tail.clone();
    let fold = move |c: &Connection| {
        if whole {
            crate::events::fold_in(c, &folding)
        } else {
            crate::events::fold_part_in(c, &folding).map(|_| ())
        }
    };
    let (tx, mut rx) = oneshot::channel();
    let mut txn = Batch::new(conn, cache, counters);
    txn.run(Box::new(once(fold, tx)));
    txn.commit(counters);
    let failed = match rx.try_recv() {
        Ok(Ok(())) => return,
        Ok(Err(e)) => e.to_string(),
        Err(_) => "no answer".to_string(),
    };
    crate::events::abandon_fold();
    tail.fold_failed();
    tracing::warn!(error = %failed, "harness-store: event fold deferred");
}

/// Copies the whole WAL into the database and truncates it to nothing (`TRUNCATE` checkpoint:
/// the WAL is synced before the copy, the database after it, so nothing committed is at risk).
/// Only when the writer is idle or stopping: it waits for readers to leave the WAL, during
/// which no write commits. Returns whether the WAL is empty now; a reader or the checkpointer
/// in the way makes it return false, and the next idle moment tries again.
fn truncate_wal(conn: &Connection, counters: &Counters) -> bool {
    // Readers are short; one that is not must not hold a waiting write for long.
    let _ = conn.busy_timeout(TRUNCATE_BUSY_TIMEOUT);
    // (busy, frames in the WAL, frames checkpointed)
    let out: rusqlite::Result<(i64, i64, i64)> =
        conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        });
    let _ = conn.busy_timeout(crate::store::BUSY_TIMEOUT);
    match out {
        Ok((0, _, _)) => {
            counters.wal_truncations.fetch_add(1, Ordering::Relaxed);
            true
        }
        Ok(_) => false,
        Err(e) => {
            let e = StoreError::from(e);
            if let StoreError::Full(reason) = &e {
                counters.note_full(&format!("checkpoint: {reason}"));
            }
            tracing::debug!(error = %e, "harness-store: idle checkpoint deferred");
            false
        }
    }
}

fn exec(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([]).map(|_| ())
}

/// Where the current run of replayable ops starts.
#[derive(Clone, Copy)]
struct Run {
    /// Index in `Batch::done` of the run's first op.
    at: usize,
    /// A `SAVEPOINT run` marks its start; otherwise it started the transaction.
    savepoint: bool,
    /// The cache's pending fills when the run started (see `KvCache::pending_mark`).
    fills: usize,
    /// The after-commit work and the undos queued when the run started.
    marks: Marks,
}

/// One batch transaction on its way to the COMMIT.
struct Batch<'c> {
    conn: &'c Connection,
    /// Where a full disk is noted (see `Counters::note_full`).
    counters: &'c Counters,
    /// Its pending write-through fills go with whatever the batch rolls back.
    cache: &'c KvCache,
    in_txn: bool,
    /// Ops that succeeded in this transaction, in order, waiting for the COMMIT.
    done: Vec<Box<dyn Op>>,
    run: Option<Run>,
}

const RUN_LOST: &str = "the batch transaction was ended inside a write; its writes were lost";

/// An op that cannot run at all (no transaction, no savepoint) answers `reason`.
fn refuse(mut op: Box<dyn Op>, reason: &str) {
    op.run(Err(reason));
    op.reply(None);
}

impl<'c> Batch<'c> {
    fn new(conn: &'c Connection, cache: &'c KvCache, counters: &'c Counters) -> Self {
        Batch {
            conn,
            counters,
            cache,
            in_txn: false,
            done: Vec::new(),
            run: None,
        }
    }

    fn run(&mut self, op: Box<dyn Op>) {
        if !self.in_txn {
            if let Err(e) = exec(self.conn, "BEGIN IMMEDIATE") {
                return refuse(op, &format!("cannot begin the batch transaction: {e}"));
            }
            self.in_txn = true;
        }
        if !op.replayable() {
            self.close_run();
            if self.in_txn {
                self.isolated(op);
            } else {
                refuse(op, RUN_LOST);
            }
            return;
        }
        if self.run.is_none() {
            // Nothing kept in the transaction yet: rolling it back undoes exactly this run.
            let savepoint = !self.done.is_empty();
            if savepoint {
                if let Err(e) = exec(self.conn, "SAVEPOINT run") {
                    return refuse(op, &format!("cannot open a savepoint: {e}"));
                }
            }
            self.run = Some(Run {
                at: self.done.len(),
                savepoint,
                fills: self.cache.pending_mark(),
                marks: marks(),
            });
        }
        let Some((op, ok)) = self.attempt(op) else {
            return;
        };
        if ok {
            self.done.push(op);
        } else {
            self.undo_run();
            op.reply(None);
        }
    }

    /// Ends the current run of replayable ops (its savepoint folds into the transaction).
    fn close_run(&mut self) {
        if let Some(Run {
            savepoint: true, ..
        }) = self.run.take()
        {
            if let Err(e) = exec(self.conn, "RELEASE run") {
                self.abort(Lost::from_sqlite(
                    "savepoint bookkeeping failed, batch rolled back",
                    &e,
                ));
            }
        }
    }

    /// An op of the current run failed: roll the run back and run its other ops again, each in
    /// its own savepoint (so that one failing now, unlike the first time, only fails itself).
    fn undo_run(&mut self) {
        let Some(run) = self.run else { return };
        let undone = if run.savepoint {
            exec(self.conn, "ROLLBACK TO run")
        } else {
            exec(self.conn, "ROLLBACK").and_then(|_| {
                self.in_txn = false;
                exec(self.conn, "BEGIN IMMEDIATE").map(|_| self.in_txn = true)
            })
        };
        if let Err(e) = undone {
            self.abort(Lost::from_sqlite(
                "cannot roll back a failed write, batch rolled back",
                &e,
            ));
            return;
        }
        self.cache.drop_pending_since(run.fills);
        rolled_back_since(run.marks);
        let again = self.done.split_off(run.at);
        for op in again {
            if !self.in_txn {
                op.reply(Some(Lost::new(RUN_LOST)));
                continue;
            }
            self.isolated(op);
        }
    }

    /// Runs `op` in its own savepoint: a failure rolls back only its changes.
    fn isolated(&mut self, op: Box<dyn Op>) {
        if let Err(e) = exec(self.conn, "SAVEPOINT op") {
            return refuse(op, &format!("cannot open a savepoint: {e}"));
        }
        let fills = self.cache.pending_mark();
        let marks = marks();
        let Some((op, ok)) = self.attempt(op) else {
            return;
        };
        let closed = if ok {
            exec(self.conn, "RELEASE op")
        } else {
            exec(self.conn, "ROLLBACK TO op").and_then(|_| exec(self.conn, "RELEASE op"))
        };
        match closed {
            Ok(()) if ok => self.done.push(op),
            Ok(()) => {
                self.cache.drop_pending_since(fills);
                rolled_back_since(marks);
                op.reply(None)
            }
            Err(e) => {
                let lost = Lost::from_sqlite("savepoint bookkeeping failed, batch rolled back", &e);
                self.abort(lost.clone());
                op.reply(Some(lost));
            }
        }
    }

    /// Runs `op` in the open transaction: the op and whether it succeeded, or `None` when the
    /// transaction ended under it (it issued COMMIT/ROLLBACK, or SQLite rolled back after e.g.
    /// SQLITE_FULL) and nothing of this batch is known to be committed, which every op of the
    /// batch so far, this one included, has then been told.
    fn attempt(&mut self, mut op: Box<dyn Op>) -> Option<(Box<dyn Op>, bool)> {
        let ok = op.run(Ok(self.conn));
        let full = self.saw(op.as_ref());
        if self.conn.is_autocommit() {
            // SQLite rolls the whole transaction back when a statement without a statement
            // journal (a plain one-row insert) runs out of space: say so.
            let lost = if full {
                Lost::new(format!("database or disk is full: {RUN_LOST}")).full(true)
            } else {
                Lost::new(RUN_LOST)
            };
            self.lost(lost.clone());
            op.reply(Some(lost));
            return None;
        }
        Some((op, ok))
    }

    /// Notes a full disk if `op`'s latest run failed for lack of space; returns whether it did.
    fn saw(&self, op: &dyn Op) -> bool {
        let full = op.failed_full();
        if full {
            self.counters
                .note_full("a write failed: database or disk is full");
        }
        full
    }

    /// Rolls the transaction back and tells every op that had succeeded in it.
    fn abort(&mut self, lost: Lost) {
        if !self.conn.is_autocommit() {
            let _ = self.conn.execute_batch("ROLLBACK");
        }
        self.lost(lost);
    }

    /// The transaction is gone: every op that had succeeded in it is told so.
    fn lost(&mut self, lost: Lost) {
        if lost.full {
            self.counters.note_full(&lost.reason);
        }
        self.in_txn = false;
        self.run = None;
        self.cache.drop_pending_since(0);
        rolled_back_since(NOTHING);
        for op in self.done.drain(..) {
            op.reply(Some(lost.clone()));
        }
    }

    /// `COMMIT`, then the replies (after the commit, so a resolved write is always committed).
    fn commit(mut self, counters: &Counters) {
        if !self.in_txn {
            rolled_back_since(NOTHING);
            return;
        }
        // Read inside the transaction, where the inserted rows are (see `cache.rs`).
        let inserted = self.cache.inserted_keys(self.conn);
        match exec(self.conn, "COMMIT") {
            Ok(()) => {
                if !self.done.is_empty() {
                    counters.commits.fetch_add(1, Ordering::Relaxed);
                    // Bumped before replying: a barrier issued after a resolved write sees it.
                    counters.commit_seq.fetch_add(1, Ordering::SeqCst);
                }
                // Before any reply: a read after a resolved write never finds the old value.
                // The after-commit work first: a reader that sees the cache's generation move
                // on must also find what the kv log's versions moved to (`kv_log.rs`).
                committed_undo();
                run_after_commit();
                self.cache.committed(&inserted);
                for op in self.done.drain(..) {
                    op.reply(None);
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "harness-store: batch COMMIT failed");
                self.cache.forget(&inserted);
                self.abort(Lost::from_sqlite("batch commit failed", &e));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Linger, LINGER_FROM};

    /// A writer starts out committing at once and tries a wait once in `PROBE` batches; waits
    /// that are answered make it wait every time, and unanswered ones stop it again.
    #[test]
    fn the_writer_waits_while_its_waits_are_answered() {
        let mut linger = Linger::default();
        let tries: Vec<bool> = (0..2 * Linger::PROBE)
            .map(|_| linger.worth_waiting())
            .collect();
        assert_eq!(tries.iter().filter(|w| **w).count(), 2, "probes only");
        assert!(tries[Linger::PROBE as usize - 1]);
        // An average over ~8 waits: six answered in a row make it wait every time.
        for _ in 0..6 {
            assert!(!(0..3).all(|_| linger.worth_waiting()));
            linger.answered(true);
        }
        assert!((0..20).all(|_| linger.worth_waiting()), "answered: waits");
        for _ in 0..2 {
            linger.answered(false);
        }
        assert!(!linger.worth_waiting(), "unanswered: commits at once");
    }

    /// A batch is large enough to wait at `LINGER_FROM` writes; a batch of two is too once
    /// recent batches averaged twice that, and a lone write never is.
    #[test]
    fn a_batch_waits_when_it_or_the_recent_ones_are_large() {
        let mut linger = Linger::default();
        assert!(!linger.large(1) && !linger.large(2) && !linger.large(LINGER_FROM - 1));
        assert!(linger.large(LINGER_FROM));
        for _ in 0..20 {
            linger.batch_ran(4 * LINGER_FROM);
        }
        assert!(linger.large(2), "many writers lately");
        assert!(!linger.large(1), "a lone write");
        for _ in 0..20 {
            linger.batch_ran(3);
        }
        assert!(!linger.large(2), "few writers again");
    }
}
