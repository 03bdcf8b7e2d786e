//! Durable FIFO queues (`queue_messages` table) with per-group ordering.
//!
//! * The table is the truth; an in-memory index per queue (group → pending messages, plus a FIFO
//!   of groups that are eligible) drives dispatch, so dispatch never scans the table.
//! * New rows reach the index through a scan of "ready rows with id > last scanned id". Scans are
//!   serialised and ids are never reused (AUTOINCREMENT, reserved ahead: see [`ID_COUNTER`]) and
//!   committed in id order by the single writer, so a scan can neither miss a row nor see one
//!   twice. The first scan (at the first `enqueue`/`wake`/`start`) loads every ready row: a
//!   crashed process's in-flight messages are simply ready again, which is redelivery
//!   (at-least-once).
//! * Per group: only the oldest message is eligible, and never while another message of that
//!   group is in flight or waiting out its retry backoff. Groups run in parallel up to
//!   `concurrency` handlers, round-robin.
//! * Handler Ok → the row is deleted, the group's next message becomes eligible, then
//!   `Store::barrier` (the step's one fsync, shared by all concurrent acks).
//!   Handler Err / panic / lease expiry → `attempts + 1` and `last_error` are persisted; past
//!   `max_retries` the row becomes `dead` (dead letter) and the group moves on, otherwise it is
//!   retried after `backoff_ms * 2^(attempts-1)` with the group still blocked.
//! * A full disk spends no attempt: a handler that failed while the store could not write (or
//!   with a `harness/storage_full` error) is retried after at most [`FULL_RETRY_MAX`], for as
//!   long as it takes, so no message dies of a full disk. An ack that fails for lack of space
//!   is retried itself, with the group still blocked: the handler's work is committed, so
//!   running it again would do it twice, and moving on would reorder the group.
//!
//! * A row whose payload is not JSON (possible through [`enqueue_text_in`]) takes its place in
//!   its group like any other, and when its turn comes it is dead-lettered without running the
//!   handler: nothing can handle it, and the rows behind it go on.
//!
//! One `Queues` per database per process: two instances would each dispatch the same rows. Only
//! the first one alive takes the rows the writer hands over (`queue_inbox.rs`); a second one reads
//! the table on every wake, so at least it cannot take rows away from the first.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::future::BoxFuture;
use rusqlite::{Connection, OptionalExtension};
use serde_json::Value;
use tokio::sync::{watch, Notify};
use tokio::task::{JoinHandle, JoinSet};

use crate::error::{StoreError, STORAGE_FULL};
use crate::queue_inbox::{InboxClaim, InsertedRow, Taken};
use crate::store::Store;

/// How long `shutdown` lets in-flight deliveries finish before aborting them (their rows stay in
/// the table and are redelivered by the next process).
const SHUTDOWN_GRACE: Duration = Duration::from_millis(200);
/// Cap on the backoff exponent (`2^20` × backoff is already absurdly long).
const MAX_BACKOFF_SHIFT: u32 = 20;
/// Longest wait between two tries of a delivery or an ack that failed for lack of space: space
/// may come back at any time, and then the work should resume soon.
const FULL_RETRY_MAX: Duration = Duration::from_secs(5);

/// Per-queue settings (in memory; not persisted).
#[derive(Clone, Debug)]
pub struct QueueConfig {
    /// Most handlers running at once across all groups.
    pub concurrency: usize,
    /// Failed deliveries retried before the message becomes a dead letter.
    pub max_retries: u32,
    /// Base retry delay; doubles with each failed attempt.
    pub backoff_ms: u64,
    /// Lease: a handler still running after this long is aborted and counted as failed.
    pub visibility_timeout_ms: u64,
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            concurrency: 64,
            max_retries: 3,
            backoff_ms: 1000,
            visibility_timeout_ms: 15 * 60 * 1000,
        }
    }
}

/// One delivery of a message.
#[derive(Clone, Debug)]
pub struct QueueMessage {
    pub id: i64,
    pub queue: String,
    pub group: String,
    pub function_id: String,
    pub payload: Value,
    /// 1 for the first delivery, 2 for the first retry, ... (persisted failed attempts + 1).
    /// In [`Queues::dead_letters`] it is the number of failed deliveries.
    pub attempt: u32,
}

/// Processes one message; `Err(reason)` asks for a retry.
pub type QueueHandler =
    Arc<dyn Fn(QueueMessage) -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// Inserts a message inside a caller's write (same transaction as the caller's other changes).
/// After that write resolves, call [`Queues::wake`] so the dispatcher picks it up.
pub fn enqueue_in(
    conn: &Connection,
    queue: &str,
    group: &str,
    function_id: &str,
    payload: &Value,
) -> Result<i64, StoreError> {
    enqueue_text_in(
        conn,
        queue,
        group,
        function_id,
        &serde_json::to_string(payload)?,
    )
}

/// Queue ids a single write of `sqlite_sequence` reserves (see [`QueueIds`]).
const RESERVED_IDS: i64 = 1 << 16;

/// The writer's next queue id and how far `sqlite_sequence` has reserved ids.
///
/// Why: `queue_messages` is AUTOINCREMENT so that an id is never used twice (acked rows are
/// deleted, the newest included), and SQLite keeps that promise by writing the table's row of
/// `sqlite_sequence` with every insert: a page rewritten by every commit that enqueues (0.12–0.15
/// WAL pages a step at 200 sessions). Ids now come from this counter, in the writer thread's
/// memory (read from the database at its first enqueue; each change registers its undo with
/// [`crate::on_rollback`], so it rolls back with the batch or an op's savepoint and ids stay
/// consecutive), and `sqlite_sequence` is moved [`RESERVED_IDS`] ahead whenever an id passes
/// it, in the same transaction: SQLite writes it only when an id exceeds it, and a new writer
/// starts past it, so no id is used twice, across a SIGKILL too. (The counter was a TEMP table:
/// its `UPDATE … RETURNING` was 3 % of the writer's time.) Off a writer thread nothing can undo
/// a change, so the counter is read from the database at every enqueue there.
#[derive(Clone, Copy)]
struct QueueIds {
    next: i64,
    reserved: i64,
}

thread_local! {
    static QUEUE_IDS: std::cell::Cell<Option<QueueIds>> = const { std::cell::Cell::new(None) };
}

/// Sets the writer's counter to `ids`, undone if the write rolls back.
fn set_queue_ids(ids: QueueIds) {
    let before = QUEUE_IDS.replace(Some(ids));
    if let Err(undo) = crate::on_rollback(move || QUEUE_IDS.set(before)) {
        undo();
    }
}

/// Takes the next queue id; returns it with the reservation it is checked against.
fn take_queue_id(conn: &Connection) -> Result<QueueIds, StoreError> {
    let ids = match QUEUE_IDS.get() {
        Some(ids) => ids,
        None => {
            let n: i64 = conn
                .prepare_cached(
                    "SELECT MAX(
                        COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'queue_messages'), 0),
                        COALESCE((SELECT MAX(id) FROM queue_messages), 0))",
                )?
                .query_row([], |r| r.get(0))?;
            QueueIds {
                next: n + 1,
                reserved: n,
            }
        }
    };
    set_queue_ids(QueueIds {
        next: ids.next + 1,
        ..ids
    });
    Ok(ids)
}

/// Moves the reservation in `sqlite_sequence` (which the insert of `id` just raised to `id`)
/// past `id`, on disk and in the counter.
fn reserve_ids(conn: &Connection, id: i64) -> Result<(), StoreError> {
    let upto = id + RESERVED_IDS;
    conn.prepare_cached("UPDATE sqlite_sequence SET seq = ?1 WHERE name = 'queue_messages'")?
        .execute([upto])?;
    if let Some(ids) = QUEUE_IDS.get() {
        set_queue_ids(QueueIds {
            reserved: upto,
            ..ids
        });
    }
    Ok(())
}

/// [`enqueue_in`] with the payload already serialised (by the caller, off the writer thread).
/// `text` must be JSON: the dispatcher parses it.
pub fn enqueue_text_in(
    conn: &Connection,
    queue: &str,
    group: &str,
    function_id: &str,
    text: &str,
) -> Result<i64, StoreError> {
    let QueueIds { next: id, reserved } = take_queue_id(conn)?;
    conn.prepare_cached(
        "INSERT INTO queue_messages(id, queue, grp, function_id, payload, attempts, status, enqueued_at)
         VALUES (?1, ?2, ?3, ?4, ?5, 0, 'ready', ?6)",
    )?
    .execute((id, queue, group, function_id, text, harness_types::now_ms()))?;
    if id > reserved {
        reserve_ids(conn, id)?;
    }
    crate::queue_inbox::pend(
        queue,
        InsertedRow {
            id,
            group: group.to_string(),
            function_id: function_id.to_string(),
            payload: text.to_string(),
        },
    );
    Ok(id)
}

/// All queues of one store.
#[derive(Clone)]
pub struct Queues {
    inner: Arc<QueuesInner>,
}

struct QueuesInner {
    store: Store,
    /// The right to take the rows the writer hands over; `None` when another `Queues` of this
    /// store has it (then every wake reads the table).
    inbox: Option<InboxClaim>,
    // std Mutex: only held to look up / insert a queue's state, never across an await.
    queues: Mutex<HashMap<String, Arc<QueueState>>>,
    /// `true` once `shutdown` was called; dropping it (last `Queues` dropped) also stops the
    /// dispatchers, which hold no reference back to `QueuesInner`.
    shutdown: watch::Sender<bool>,
    dispatchers: Mutex<Vec<JoinHandle<()>>>,
}

struct QueueState {
    name: String,
    config: Mutex<QueueConfig>,
    /// Wakes the dispatcher (new rows, a freed slot, an unblocked group). `notify_one` stores a
    /// permit when the dispatcher is busy, so a wake-up is never lost and there is no polling.
    wake: Notify,
    /// Highest id merged from the table. Held across the scan's read + merge so that scans are
    /// serialised (a std Mutex: the read is a short indexed query and there is no await inside).
    scanned: Mutex<i64>,
    /// Held only for O(1) bookkeeping, never across an await or a query.
    index: Mutex<Index>,
    started: AtomicBool,
}

/// Invariant: a group name is in `ready` iff the group has pending messages and is not busy.
#[derive(Default)]
struct Index {
    groups: HashMap<String, Group>,
    ready: VecDeque<String>,
    /// Messages not yet acked or dead-lettered (including the in-flight ones).
    depth: usize,
    /// Handlers currently running.
    running: usize,
}

#[derive(Default)]
struct Group {
    /// Oldest first; while `busy`, the front is the message in flight or in backoff.
    pending: VecDeque<Pending>,
    busy: bool,
}

/// A row of the queue as the index holds it.
#[derive(Clone, Debug)]
struct Pending {
    msg: QueueMessage,
    /// Why the row's payload is not JSON (its `msg.payload` is then the text as a JSON string):
    /// the row is dead-lettered when its turn comes.
    unreadable: Option<String>,
}

impl Pending {
    /// The row `(id, group, function_id, payload, attempts)` of `queue`; `attempt` is `attempts`
    /// plus `next`.
    fn from_row(
        queue: &str,
        (id, group, function_id, payload, attempts): (i64, String, String, String, i64),
        next: u32,
    ) -> Pending {
        let (payload, unreadable) = match serde_json::from_str(&payload) {
            Ok(value) => (value, None),
            Err(e) => (
                Value::String(payload),
                Some(format!("payload is not JSON: {e}")),
            ),
        };
        Pending {
            msg: QueueMessage {
                id,
                queue: queue.to_string(),
                group,
                function_id,
                payload,
                attempt: u32::try_from(attempts)
                    .unwrap_or(u32::MAX - next)
                    .saturating_add(next),
            },
            unreadable,
        }
    }
}

impl Index {
    fn push(&mut self, row: Pending) {
        let group = self.groups.entry(row.msg.group.clone()).or_default();
        let was_idle = group.pending.is_empty() && !group.busy;
        let name = row.msg.group.clone();
        group.pending.push_back(row);
        self.depth += 1;
        if was_idle {
            self.ready.push_back(name);
        }
    }

    /// Takes the next eligible message (round-robin over groups) if a slot is free.
    fn next(&mut self, concurrency: usize) -> Option<Pending> {
        if self.running >= concurrency {
            return None;
        }
        while let Some(name) = self.ready.pop_front() {
            let Some(group) = self.groups.get_mut(&name) else {
                continue;
            };
            let Some(msg) = group.pending.front() else {
                continue;
            };
            if group.busy {
                continue;
            }
            group.busy = true;
            self.running += 1;
            return Some(msg.clone());
        }
        None
    }

    fn handler_finished(&mut self) {
        self.running = self.running.saturating_sub(1);
    }

    /// The group's in-flight message is gone (acked or dead): the next one becomes eligible.
    fn finish(&mut self, group: &str, id: i64) {
        let Some(g) = self.groups.get_mut(group) else {
            return;
        };
        if g.pending.front().map(|p| p.msg.id) == Some(id) {
            g.pending.pop_front();
            self.depth = self.depth.saturating_sub(1);
        }
        g.busy = false;
        if g.pending.is_empty() {
            self.groups.remove(group);
        } else {
            self.ready.push_back(group.to_string());
        }
    }

    /// Records the attempt count the retry will carry.
    fn set_attempt(&mut self, group: &str, id: i64, attempt: u32) {
        if let Some(front) = self
            .groups
            .get_mut(group)
            .and_then(|g| g.pending.front_mut())
            .filter(|p| p.msg.id == id)
        {
            front.msg.attempt = attempt;
        }
    }

    /// Backoff over: the group's front message is eligible again.
    fn unblock(&mut self, group: &str) {
        if let Some(g) = self.groups.get_mut(group) {
            g.busy = false;
            if !g.pending.is_empty() {
                self.ready.push_back(group.to_string());
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Our critical sections do not panic; if one ever did, the data is still consistent enough
    // to keep serving rather than cascade panics through every task.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl QueueState {
    fn config(&self) -> QueueConfig {
        lock(&self.config).clone()
    }

    /// Merges ready rows with id > last scanned into the index and wakes the dispatcher: the
    /// rows the writer handed over when it can vouch for all of them (`queue_inbox.rs`), else
    /// read from the table. Rows taken from the inbox are in the index before the watermark
    /// moves past them: nothing between the two can fail (a payload that is not JSON is indexed
    /// as such), so a taken row cannot be lost.
    fn scan(&self, store: &Store, inbox: Option<&InboxClaim>) -> Result<usize, StoreError> {
        let mut scanned = lock(&self.scanned);
        let after = *scanned;
        let taken = inbox.map_or(Taken::Unknown, |i| i.take(&self.name, after));
        let rows = match taken {
            Taken::Rows(rows, upto) => {
                *scanned = upto;
                rows.into_iter().map(|r| self.handed(r)).collect()
            }
            Taken::Unknown => {
                // Every row up to it committed before the read starts: the read sees them.
                let seen = inbox.map_or(0, |i| i.seen());
                let rows = self.read_ready(store, after)?;
                *scanned = rows.last().map_or(after, |p| p.msg.id).max(seen).max(after);
                if let Some(inbox) = inbox {
                    inbox.forget_through(&self.name, *scanned);
                }
                rows
            }
        };
        if rows.is_empty() {
            return Ok(0);
        }
        let n = rows.len();
        {
            let mut index = lock(&self.index);
            for row in rows {
                index.push(row);
            }
        }
        drop(scanned);
        self.wake.notify_one();
        Ok(n)
    }

    /// A row the writer handed over (never delivered yet).
    fn handed(&self, r: InsertedRow) -> Pending {
        Pending::from_row(&self.name, (r.id, r.group, r.function_id, r.payload, 0), 1)
    }

    /// The queue's ready rows with id > `after`, oldest first.
    fn read_ready(&self, store: &Store, after: i64) -> Result<Vec<Pending>, StoreError> {
        store.read(|c| {
            let mut stmt = c.prepare_cached(
                "SELECT id, grp, function_id, payload, attempts FROM queue_messages
                 WHERE queue = ?1 AND status = 'ready' AND id > ?2 ORDER BY id",
            )?;
            rows(&mut stmt, (&self.name, after), &self.name, 1)
        })
    }
}

impl Queues {
    pub fn new(store: Store) -> Queues {
        let inbox = InboxClaim::new(&store);
        if inbox.is_none() {
            tracing::warn!(
                path = %store.path().display(),
                "harness-store: a second Queues on one store: it reads the table on every wake, and both dispatch the same rows"
            );
        }
        Queues {
            inner: Arc::new(QueuesInner {
                store,
                inbox,
                queues: Mutex::new(HashMap::new()),
                shutdown: watch::channel(false).0,
                dispatchers: Mutex::new(Vec::new()),
            }),
        }
    }

    /// Sets a queue's config (the latest call wins). Queues used without `define` get
    /// [`QueueConfig::default`].
    pub fn define(&self, queue: &str, config: QueueConfig) {
        let state = self.state(queue);
        *lock(&state.config) = config;
    }

    /// Durably inserts a message (committed, not fsynced) and wakes the dispatcher at once.
    /// Works before `start` (the message waits in the table and the index). An `Err` means the
    /// message was not enqueued.
    pub async fn enqueue(
        &self,
        queue: &str,
        group: &str,
        function_id: &str,
        payload: &Value,
    ) -> Result<i64, StoreError> {
        let (q, g, f, p) = (
            queue.to_string(),
            group.to_string(),
            function_id.to_string(),
            serde_json::to_string(payload)?,
        );
        let id = self
            .inner
            .store
            .write_replayable(move |c| enqueue_text_in(c, &q, &g, &f, &p))
            .await?;
        // The row is committed: report success even if the in-memory pickup fails, so the caller
        // does not enqueue a duplicate. The next enqueue/wake (or restart) rescans from the same
        // watermark and finds it.
        if let Err(e) = self.wake(queue) {
            tracing::error!(queue, id, error = %e, "harness-store: queue rescan failed after enqueue");
        }
        Ok(id)
    }

    /// Picks up rows inserted with [`enqueue_in`] (call after the write resolved): rescans only
    /// ids above the last one seen, then wakes the dispatcher.
    pub fn wake(&self, queue: &str) -> Result<(), StoreError> {
        self.state(queue)
            .scan(&self.inner.store, self.inner.inbox.as_ref())
            .map(|_| ())
    }

    /// Starts the queue's dispatcher (a tokio task; call inside a runtime). Loads every ready row
    /// of the queue, including those a crashed process had in flight. A second `start` of the
    /// same queue, or a `start` after `shutdown`, is ignored with a warning.
    pub fn start(&self, queue: &str, handler: QueueHandler) {
        let state = self.state(queue);
        if *self.inner.shutdown.borrow() {
            tracing::warn!(queue, "harness-store: start after shutdown ignored");
            return;
        }
        if state.started.swap(true, Ordering::SeqCst) {
            tracing::warn!(queue, "harness-store: queue already started");
            return;
        }
        if let Err(e) = state.scan(&self.inner.store, self.inner.inbox.as_ref()) {
            // Not fatal: the next enqueue/wake rescans from the same watermark.
            tracing::error!(queue, error = %e, "harness-store: initial queue load failed");
        }
        let task = tokio::spawn(dispatch_loop(
            state,
            self.inner.store.clone(),
            handler,
            self.inner.shutdown.subscribe(),
        ));
        lock(&self.inner.dispatchers).push(task);
    }

    /// Stops dispatching, gives in-flight deliveries a short grace period, then aborts them.
    /// Unacked rows stay in the table and are redelivered by the next `start` on this database.
    pub async fn shutdown(&self) {
        self.inner.shutdown.send_replace(true);
        let tasks = std::mem::take(&mut *lock(&self.inner.dispatchers));
        for task in tasks {
            let _ = task.await;
        }
    }

    /// Messages of the queue not yet acked or dead-lettered, as known in memory (including
    /// in-flight ones and, before `start`, those loaded by `enqueue`/`wake`).
    pub fn depth(&self, queue: &str) -> usize {
        let state = lock(&self.inner.queues).get(queue).cloned();
        state.map(|s| lock(&s.index).depth).unwrap_or(0)
    }

    /// Messages that exhausted their retries, oldest first. A payload that is not JSON (a row
    /// dead-lettered for it) is given as its text, a JSON string.
    pub fn dead_letters(&self, queue: &str) -> Result<Vec<QueueMessage>, StoreError> {
        self.inner.store.read(|c| {
            let mut stmt = c.prepare_cached(
                "SELECT id, grp, function_id, payload, attempts FROM queue_messages
                 WHERE queue = ?1 AND status = 'dead' ORDER BY id",
            )?;
            Ok(rows(&mut stmt, [queue], queue, 0)?
                .into_iter()
                .map(|p| p.msg)
                .collect())
        })
    }

    fn state(&self, queue: &str) -> Arc<QueueState> {
        lock(&self.inner.queues)
            .entry(queue.to_string())
            .or_insert_with(|| {
                Arc::new(QueueState {
                    name: queue.to_string(),
                    config: Mutex::new(QueueConfig::default()),
                    wake: Notify::new(),
                    scanned: Mutex::new(0),
                    index: Mutex::new(Index::default()),
                    started: AtomicBool::new(false),
                })
            })
            .clone()
    }
}

/// Hands eligible messages to delivery tasks until shutdown; sleeps on `wake` in between.
async fn dispatch_loop(
    state: Arc<QueueState>,
    store: Store,
    handler: QueueHandler,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut deliveries = JoinSet::new();
    loop {
        if *shutdown.borrow() {
            break;
        }
        let concurrency = state.config().concurrency.max(1);
        loop {
            let next = lock(&state.index).next(concurrency);
            let Some(row) = next else { break };
            deliveries.spawn(deliver(state.clone(), store.clone(), handler.clone(), row));
        }
        tokio::select! {
            _ = state.wake.notified() => {}
            changed = shutdown.changed() => {
                if changed.is_err() || *shutdown.borrow() {
                    break;
                }
            }
            Some(done) = deliveries.join_next(), if !deliveries.is_empty() => {
                if let Err(e) = done {
                    tracing::error!(queue = %state.name, error = %e, "harness-store: delivery task failed");
                }
            }
        }
    }
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while deliveries.join_next().await.is_some() {}
    })
    .await;
    deliveries.shutdown().await;
}

/// Aborts the handler task when the delivery is dropped (lease expiry, shutdown).
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs the handler in its own task (so a panic or an abort cannot hurt the dispatcher) under
/// the visibility timeout.
async fn run_handler(
    handler: &QueueHandler,
    msg: QueueMessage,
    lease: Duration,
) -> Result<(), String> {
    let handler = handler.clone();
    let mut task = AbortOnDrop(tokio::spawn(async move { handler(msg).await }));
    match tokio::time::timeout(lease, &mut task.0).await {
        Ok(Ok(result)) => result,
        Ok(Err(e)) if e.is_panic() => Err(format!(
            "handler panicked: {}",
            crate::panic_message(e.into_panic().as_ref())
        )),
        Ok(Err(_)) => Err("handler task was cancelled".to_string()),
        Err(_) => Err(format!(
            "visibility timeout: handler still running after {} ms",
            lease.as_millis()
        )),
    }
}

enum Failure {
    Retry {
        attempts: u32,
    },
    Dead {
        attempts: u32,
    },
    /// The row no longer exists (deleted behind our back): nothing left to retry.
    Gone,
}

async fn deliver(state: Arc<QueueState>, store: Store, handler: QueueHandler, row: Pending) {
    let Pending { msg, unreadable } = row;
    let mut config = state.config();
    let lease = Duration::from_millis(config.visibility_timeout_ms);
    let outcome = match unreadable {
        // No handler can take it and no retry can mend it: straight to the dead letters.
        Some(reason) => {
            config.max_retries = 0;
            Err(reason)
        }
        None => run_handler(&handler, msg.clone(), lease).await,
    };
    // The concurrency slot is about running handlers: free it now, while the group itself stays
    // blocked until the ack is durable (or the backoff is over).
    lock(&state.index).handler_finished();
    state.wake.notify_one();

    match outcome {
        Ok(()) => {
            let id = msg.id;
            let mut deleted = ack(&store, id).await;
            let mut waits = 0u32;
            while matches!(&deleted, Err(e) if e.is_full()) {
                waits = waits.saturating_add(1);
                tracing::debug!(queue = %state.name, id, waits, "harness-store: ack waits for space");
                tokio::time::sleep(backoff(config.backoff_ms, waits).min(FULL_RETRY_MAX)).await;
                deleted = ack(&store, id).await;
            }
            // The group's next message may start once the delete is committed: everything it
            // writes lands after the delete in the WAL, so whatever fsync makes its effects
            // durable makes this ack durable too. The fsync below then stays off the handoff.
            lock(&state.index).finish(&msg.group, id);
            state.wake.notify_one();
            let acked = match deleted {
                Ok(()) => store.barrier().await,
                Err(e) => Err(e),
            };
            if let Err(e) = acked {
                // At-least-once: the row may still be ready in the table and will be redelivered
                // by the next process; do not re-run a handler that succeeded.
                tracing::warn!(queue = %state.name, id, error = %e, "harness-store: ack failed");
            }
        }
        Err(reason) if store.storage_full().is_some() || reason.contains(STORAGE_FULL) => {
            // Not the message's fault: keep its attempts for failures of its own.
            tracing::debug!(queue = %state.name, id = msg.id, %reason, "harness-store: delivery failed for lack of space, will retry");
            tokio::time::sleep(backoff(config.backoff_ms, 1).min(FULL_RETRY_MAX)).await;
            lock(&state.index).unblock(&msg.group);
        }
        Err(reason) => match record_failure(&store, msg.id, &reason, config.max_retries).await {
            Ok(Failure::Retry { attempts }) => {
                tracing::debug!(queue = %state.name, id = msg.id, attempts, %reason, "harness-store: delivery failed, will retry");
                lock(&state.index).set_attempt(&msg.group, msg.id, attempts.saturating_add(1));
                tokio::time::sleep(backoff(config.backoff_ms, attempts)).await;
                lock(&state.index).unblock(&msg.group);
            }
            Ok(Failure::Dead { attempts }) => {
                tracing::warn!(queue = %state.name, id = msg.id, group = %msg.group, attempts, %reason, "harness-store: message dead-lettered");
                lock(&state.index).finish(&msg.group, msg.id);
            }
            Ok(Failure::Gone) => lock(&state.index).finish(&msg.group, msg.id),
            Err(e) => {
                // Could not persist the failure: retry anyway (the count is kept in memory).
                tracing::warn!(queue = %state.name, id = msg.id, error = %e, "harness-store: cannot record a failed delivery");
                lock(&state.index).set_attempt(&msg.group, msg.id, msg.attempt.saturating_add(1));
                tokio::time::sleep(backoff(config.backoff_ms, msg.attempt)).await;
                lock(&state.index).unblock(&msg.group);
            }
        },
    }
    state.wake.notify_one();
}

/// Deletes a delivered message (its ack).
async fn ack(store: &Store, id: i64) -> Result<(), StoreError> {
    store
        .write_replayable(move |c| {
            c.prepare_cached("DELETE FROM queue_messages WHERE id = ?1")?
                .execute([id])?;
            Ok(())
        })
        .await
}

/// `attempts + 1` and `last_error`, and the dead-letter transition, in one statement.
async fn record_failure(
    store: &Store,
    id: i64,
    reason: &str,
    max_retries: u32,
) -> Result<Failure, StoreError> {
    let reason = reason.to_string();
    store
        .write_replayable(move |c| {
            let row: Option<(i64, String)> = c
                .prepare_cached(
                    "UPDATE queue_messages SET attempts = attempts + 1, last_error = ?2,
                         status = CASE WHEN attempts + 1 > ?3 THEN 'dead' ELSE 'ready' END
                     WHERE id = ?1 RETURNING attempts, status",
                )?
                .query_row((id, &reason, i64::from(max_retries)), |r| {
                    Ok((r.get(0)?, r.get(1)?))
                })
                .optional()?;
            Ok(match row {
                None => Failure::Gone,
                Some((attempts, status)) => {
                    let attempts = u32::try_from(attempts).unwrap_or(u32::MAX);
                    if status == "dead" {
                        Failure::Dead { attempts }
                    } else {
                        Failure::Retry { attempts }
                    }
                }
            })
        })
        .await
}

/// `backoff_ms * 2^(attempts-1)`, saturating.
fn backoff(backoff_ms: u64, attempts: u32) -> Duration {
    let shift = attempts.saturating_sub(1).min(MAX_BACKOFF_SHIFT);
    Duration::from_millis(backoff_ms.saturating_mul(1u64 << shift))
}

/// The rows of `queue` a `SELECT id, grp, function_id, payload, attempts` answers. `attempt` is
/// the row's `attempts` plus `next`: 1 for a message about to be delivered, 0 for a dead one
/// (the attempts it had).
fn rows(
    stmt: &mut rusqlite::CachedStatement<'_>,
    params: impl rusqlite::Params,
    queue: &str,
    next: u32,
) -> Result<Vec<Pending>, StoreError> {
    let rows = stmt.query_map(params, |r| {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
    })?;
    let mut out = Vec::new();
    for row in rows {
        out.push(Pending::from_row(queue, row?, next));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(id: i64, group: &str) -> Pending {
        Pending::from_row("q", (id, group.into(), "f".into(), "null".into(), 0), 1)
    }

    #[test]
    fn backoff_is_exponential_and_saturates() {
        assert_eq!(backoff(1000, 1), Duration::from_millis(1000));
        assert_eq!(backoff(1000, 2), Duration::from_millis(2000));
        assert_eq!(backoff(1000, 3), Duration::from_millis(4000));
        assert_eq!(backoff(u64::MAX, 40), Duration::from_millis(u64::MAX));
    }

    #[test]
    fn a_row_that_is_not_json_is_indexed_with_its_text_and_the_reason() {
        let row = Pending::from_row("q", (7, "g".into(), "f".into(), "{oops".into(), 2), 1);
        assert_eq!(row.msg.payload, Value::String("{oops".into()));
        assert_eq!(row.msg.attempt, 3);
        let reason = row.unreadable.expect("not JSON");
        assert!(reason.starts_with("payload is not JSON: "), "{reason}");
        assert!(msg(1, "g").unreadable.is_none());
    }

    #[test]
    fn index_keeps_one_in_flight_per_group_and_round_robins() {
        let mut ix = Index::default();
        ix.push(msg(1, "a"));
        ix.push(msg(2, "a"));
        ix.push(msg(3, "b"));
        assert_eq!(ix.depth, 3);
        let first = ix.next(10).unwrap();
        let second = ix.next(10).unwrap();
        assert_eq!((first.msg.id, second.msg.id), (1, 3));
        assert!(ix.next(10).is_none(), "group a is busy");
        ix.handler_finished();
        ix.finish("a", 1);
        assert_eq!(ix.next(10).unwrap().msg.id, 2);
        ix.handler_finished();
        ix.handler_finished();
        ix.finish("a", 2);
        ix.finish("b", 3);
        assert_eq!(ix.depth, 0);
        assert!(ix.groups.is_empty(), "empty groups are forgotten");
    }

    #[test]
    fn index_respects_concurrency_and_retry_keeps_position() {
        let mut ix = Index::default();
        ix.push(msg(1, "a"));
        ix.push(msg(2, "b"));
        assert_eq!(ix.next(1).unwrap().msg.id, 1);
        assert!(ix.next(1).is_none(), "slot taken");
        ix.handler_finished();
        ix.set_attempt("a", 1, 2);
        assert_eq!(ix.next(1).unwrap().msg.id, 2, "a is in backoff");
        ix.handler_finished();
        ix.finish("b", 2);
        ix.unblock("a");
        let again = ix.next(1).unwrap();
        assert_eq!((again.msg.id, again.msg.attempt), (1, 2));
    }
}
