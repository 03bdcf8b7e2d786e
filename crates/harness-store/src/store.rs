//! The [`Store`]: one SQLite file in WAL mode, one writer thread with group commit, pooled
//! readers, and an explicit, group-committed durability barrier.
//!
//! Durability model (the reason for this shape):
//! * `write` resolves after the batch `COMMIT`. With `journal_mode=WAL` + `synchronous=NORMAL`
//!   the commit has appended its frames to the `-wal` file, i.e. they are in the OS page cache:
//!   they survive a SIGKILL of this process, not a power loss.
//! * `barrier` (in [`Durability::Full`]) resolves once an `fsync` of the `-wal` file has covered
//!   every commit made before the call. One fsync serves every barrier that is waiting when it
//!   starts, so N concurrent loop steps pay far fewer than N fsyncs.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};
use tokio::sync::{oneshot, watch};

use crate::cache::KvCache;
use crate::error::{io_is_full, StoreError};
use crate::lock::Access;
use crate::wal_pages::{PageLog, WalPages};
use crate::writer::{self, writer_loop, Closure, Op};
use crate::{events, schema};

/// How long a connection waits on a lock held by another connection (e.g. a checkpoint).
pub(crate) const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// Idle reader connections kept open; more are opened on demand and closed after use.
const MAX_IDLE_READERS: usize = 16;
/// WAL frames committed since the last request after which the checkpointer copies them into
/// the database (SQLite's own automatic checkpoint uses the same 1,000 pages).
const CHECKPOINT_FRAMES: i32 = 1000;
/// WAL length at which the writer itself checkpoints after a commit. Under constant writes the
/// checkpointer, which runs beside the writer, never finds the WAL fully copied at the moment
/// the writer starts a transaction (which is when the WAL starts over), so it would only grow.
/// By then the checkpointer has copied almost all of it, and the writer's checkpoint copies
/// what is left. That checkpoint stalls every session's writes for its copy and two fsyncs
/// (2-20 ms under load), so it should be rare: at 5,000 frames (about 20 MiB of WAL) the bench's
/// 200 busy sessions spent 0.20-0.22 of the wall time in it, against 0.26-0.29 at 4,000.
const WRITER_CHECKPOINT_FRAMES: i32 = 5 * CHECKPOINT_FRAMES;

/// What [`Store::barrier`] guarantees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// `barrier` fsyncs the WAL: everything committed before it survives power loss.
    Full,
    /// `barrier` only waits for the commit (which `write` already did): a process crash loses
    /// nothing, a power loss or kernel crash may lose the most recent commits (the database is
    /// never corrupted). No fsync on the hot path at all; SQLite still fsyncs at checkpoints.
    Normal,
}

/// Counters since open (monotonic).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Batch transactions committed (each holds one or more successful writes).
    pub commits: u64,
    /// Write ops executed (successful or not).
    pub writes: u64,
    /// fsyncs issued by barriers.
    pub fsyncs: u64,
    /// Pages the commits wrote to the WAL (its frames): what a commit costs the writer and,
    /// once checkpointed, the disk twice over.
    pub wal_frames: u64,
    /// Time the writer thread spent on batches, from taking the first op to its replies
    /// (commit and its own checkpoints included): against wall time, how busy the one
    /// writer every session shares is.
    pub writer_busy_ns: u64,
    /// Of that, time in the writer's own catch-up checkpoints (see `WRITER_CHECKPOINT_FRAMES`),
    /// during which no write of any session commits.
    pub writer_checkpoint_ns: u64,
    /// Times the writer, idle or stopping, checkpointed the whole WAL and truncated it to
    /// nothing (not counted in `writer_busy_ns`: no write was waiting).
    pub wal_truncations: u64,
    /// Time the syncer thread spent in barriers' fsyncs: against wall time, how close the
    /// fsyncs are to bounding durable throughput (one runs at a time).
    pub syncer_busy_ns: u64,
    /// Times a large batch with nothing queued waited a moment for one more write before its
    /// COMMIT (see `writer.rs`, `Linger`).
    pub linger_waits: u64,
    /// Of those waits, the ones a write answered.
    pub linger_answered: u64,
}

/// A barrier waiting for the syncer: fsync must cover commit sequence number `target`.
struct SyncRequest {
    target: u64,
    reply: oneshot::Sender<Result<(), StoreError>>,
}

/// Shared between handles and the two threads (the threads never hold an `Inner`, so dropping
/// the last `Store` really drops the channels and lets the threads exit).
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) commits: AtomicU64,
    pub(crate) writes: AtomicU64,
    fsyncs: AtomicU64,
    /// Sequence number of the latest commit; starts at 1 so that the first barrier of a process
    /// always fsyncs (it also covers whatever a crashed predecessor left in the page cache).
    pub(crate) commit_seq: AtomicU64,
    /// Highest `commit_seq` known to be on stable storage.
    synced_seq: AtomicU64,
    wal_frames: AtomicU64,
    pub(crate) writer_busy_ns: AtomicU64,
    pub(crate) writer_checkpoint_ns: AtomicU64,
    /// Checkpoint time of the batch in progress, moved to `writer_checkpoint_ns` when the
    /// batch's busy time is counted, so that the two never disagree.
    pub(crate) batch_checkpoint_ns: AtomicU64,
    /// Times the idle or stopping writer emptied the WAL.
    pub(crate) wal_truncations: AtomicU64,
    syncer_busy_ns: AtomicU64,
    pub(crate) linger_waits: AtomicU64,
    pub(crate) linger_answered: AtomicU64,
    /// Why the latest write, fsync or checkpoint failed for lack of space, until a commit
    /// writes to the WAL again ([`Store::storage_full`]).
    full: Mutex<Option<String>>,
}

impl Counters {
    /// Remembers that the disk is full (the reason is what `/healthz` shows).
    pub(crate) fn note_full(&self, reason: &str) {
        let mut full = self.full.lock().unwrap_or_else(|e| e.into_inner());
        if full.is_none() {
            tracing::error!(
                reason,
                "harness-store: storage full; writes fail until space returns"
            );
        }
        *full = Some(reason.to_string());
    }

    /// A commit wrote to the WAL: there was space for it.
    fn clear_full(&self) {
        let mut full = self.full.lock().unwrap_or_else(|e| e.into_inner());
        if full.take().is_some() {
            tracing::warn!("harness-store: storage available again; writes resumed");
        }
    }
}

struct Inner {
    path: PathBuf,
    durability: Durability,
    // An RwLock so every `write` only takes the shared side to clone-free send (mpsc::Sender is
    // Sync); `close` takes the exclusive side once to drop the sender.
    writer_tx: RwLock<Option<mpsc::Sender<Box<dyn Op>>>>,
    syncer_tx: RwLock<Option<mpsc::Sender<SyncRequest>>>,
    // A std Mutex for the reader pool: it is held only to push/pop a connection (never across
    // a query or an await), so it is uncontended and cheaper than an async lock.
    readers: Mutex<Vec<Connection>>,
    counters: Arc<Counters>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Latest committed event id (see `events.rs` for why a watch channel).
    events_tx: watch::Sender<i64>,
    kv_cache: Arc<KvCache>,
    /// Event ids not folded into the per-session index yet (`events.rs`).
    event_tail: Arc<events::EventTail>,
    /// The queue rows the writer inserted, for the queues' wakes (`queue_inbox.rs`).
    queue_inbox: Arc<crate::queue_inbox::QueueInbox>,
    page_log: Arc<PageLog>,
    /// One value per type for crates that keep an in-memory copy of what this store holds
    /// ([`Store::shared`]).
    shared: Mutex<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>,
    /// Held while the database is open (see `lock.rs`).
    _lock: Arc<crate::lock::DbLock>,
}

/// Handle to the database; cheap to clone, all clones share one writer.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.inner.path)
            .field("durability", &self.inner.durability)
            .finish()
    }
}

/// Plans that do not depend on bound values. Without it SQLite marks a cached statement to be
/// parsed and planned again whenever a new value is bound to some of its parameters (a bound
/// `LIMIT`, and `MAX(seq) … WHERE session_id = ?` since 3.54): the append's next-seq lookup did
/// that on every entry, ~8 % of the store writer's time. Our statements are planned for their
/// shape, never for a value, and no statistics are gathered, so nothing is lost.
fn stable_plans(conn: &Connection) -> Result<(), StoreError> {
    conn.set_db_config(
        rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG,
        true,
    )?;
    Ok(())
}

impl Store {
    /// Opens (creating if needed, with parent directories) the database at `path`, switches it to
    /// WAL, creates the schema and starts the writer and syncer threads.
    ///
    /// The database is this process's alone: another process that has it open is refused by
    /// name (`harness/store_in_use`), and so is one that tries while this one has it.
    pub fn open(path: &Path, durability: Durability) -> Result<Store, StoreError> {
        Store::open_with(path, durability, Access::Exclusive)
    }

    /// [`Store::open`] for processes that take turns on one database ([`Access::Shared`]).
    pub fn open_shared(path: &Path, durability: Durability) -> Result<Store, StoreError> {
        Store::open_with(path, durability, Access::Shared)
    }

    fn open_with(path: &Path, durability: Durability, access: Access) -> Result<Store, StoreError> {
        if let Some(parent) = path.parent() {
            if !parent.as_os_str().is_empty() {
                std::fs::create_dir_all(parent)?;
            }
        }
        let lock = crate::lock::acquire(path, access)?;
        let conn = Connection::open(path)?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        stable_plans(&conn)?;
        // A newer harness may keep rows where this one does not look (and a migration of ours
        // would stamp its own version over the newer one): refused before anything is written.
        let found = schema::version(&conn)?;
        if found > schema::SCHEMA_VERSION {
            return Err(StoreError::TooNew {
                path: path.display().to_string(),
                found,
                supported: schema::SCHEMA_VERSION,
            });
        }
        let mode: String =
            conn.pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(StoreError::Invalid(format!(
                "cannot switch {} to WAL (journal_mode={mode})",
                path.display()
            )));
        }
        // NORMAL on purpose: commits do not fsync; durability comes from our own fsync of the WAL
        // at barriers (group-committed). SQLite still fsyncs the WAL before a checkpoint and the
        // database file after it, so checkpointed data is always on disk before the WAL resets.
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        // Keep the WAL from staying huge after a burst (truncated on reset, same inode).
        conn.pragma_update(None, "journal_size_limit", 64 * 1024 * 1024)?;
        // Each op's savepoint journals the pages it touches; past 64 KiB in a batch SQLite
        // spills that journal to a temporary file and every later page costs a pwrite (and
        // each batch opens the file again). It is never needed after the batch: keep it in
        // memory.
        conn.pragma_update(None, "temp_store", "MEMORY")?;
        conn.set_prepared_statement_cache_capacity(64);
        schema::create(&conn)?;
        let last_event = events::max_event_id(&conn)?;
        let event_tail = Arc::new(events::EventTail::default());
        event_tail.load(&conn)?;
        events::renew_fold_db(&conn)?;

        let counters = Arc::new(Counters::default());
        counters.commit_seq.store(1, Ordering::SeqCst);

        let mut conn = conn;
        let kv_cache = Arc::new(KvCache::default());
        crate::kv_log::recover(&conn, &kv_cache)?;
        let changed = kv_cache.change_log();
        let inserted = kv_cache.insert_log();
        conn.update_hook(Some(
            move |action: rusqlite::hooks::Action, _: &str, table: &str, rowid: i64| {
                if table == "kv" {
                    changed
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(rowid);
                    if action == rusqlite::hooks::Action::SQLITE_INSERT {
                        inserted
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push(rowid);
                    }
                }
            },
        ))?;
        let mut threads = Vec::with_capacity(3);
        let requests = match start_checkpointer(path, counters.clone()) {
            Ok((requests, thread)) => {
                threads.push(thread);
                Some(requests)
            }
            // Not fatal: the writer checkpoints as SQLite's automatic checkpoint would, only slower.
            Err(e) => {
                tracing::warn!(error = %e, "harness-store: no checkpoint thread; the writer checkpoints");
                None
            }
        };
        let page_size: i64 = conn.query_row("PRAGMA page_size", [], |r| r.get(0))?;
        let page_log = Arc::new(PageLog::new(path, page_size as u64));
        hand_off_checkpoints(&mut conn, requests, counters.clone(), page_log.clone())?;

        // The writer is a dedicated OS thread, not a tokio task: SQLite calls block (and a
        // checkpoint can take a while), and a single owner of the write connection needs no lock.
        let (writer_tx, writer_rx) = mpsc::channel::<Box<dyn Op>>();
        let queue_inbox = Arc::new(crate::queue_inbox::QueueInbox::default());
        let writer = {
            let counters = counters.clone();
            let cache = kv_cache.clone();
            let inbox = queue_inbox.clone();
            let tail = event_tail.clone();
            std::thread::Builder::new()
                .name("harness-store-writer".into())
                .spawn(move || {
                    crate::cache::install_writer(cache.clone());
                    crate::queue_inbox::install_writer(inbox);
                    events::install_writer(tail.clone());
                    writer_loop(conn, writer_rx, &counters, &cache, &tail)
                })?
        };
        // fsync runs on its own thread so the writer keeps committing while the disk syncs; the
        // next fsync then covers everything committed meanwhile (pipelined group commit).
        let (syncer_tx, syncer_rx) = mpsc::channel::<SyncRequest>();
        let syncer = {
            let counters = counters.clone();
            let db = path.to_path_buf();
            std::thread::Builder::new()
                .name("harness-store-syncer".into())
                .spawn(move || syncer_loop(db, syncer_rx, counters))?
        };

        Ok(Store {
            inner: Arc::new(Inner {
                path: path.to_path_buf(),
                durability,
                writer_tx: RwLock::new(Some(writer_tx)),
                syncer_tx: RwLock::new(Some(syncer_tx)),
                readers: Mutex::new(Vec::new()),
                counters,
                threads: Mutex::new({
                    threads.push(writer);
                    threads.push(syncer);
                    threads
                }),
                events_tx: watch::channel(last_event).0,
                kv_cache,
                event_tail,
                queue_inbox,
                page_log,
                shared: Mutex::default(),
                _lock: lock,
            }),
        })
    }

    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// The store's one `T`, made on first use and shared by every clone of this handle: for a
    /// crate's in-memory copy of rows, which every writer of those rows must keep up to date
    /// (two copies over one store would miss each other's writes).
    pub fn shared<T: Default + Send + Sync + 'static>(&self) -> Arc<T> {
        let mut shared = self.inner.shared.lock().unwrap_or_else(|e| e.into_inner());
        let any = shared
            .entry(TypeId::of::<T>())
            .or_insert_with(|| Arc::new(T::default()))
            .clone();
        any.downcast::<T>()
            .unwrap_or_else(|_| unreachable!("stored under its own type id"))
    }

    pub fn durability(&self) -> Durability {
        self.inner.durability
    }

    /// Runs `f` on the writer thread inside the current batch transaction, in its own SAVEPOINT:
    /// if `f` returns `Err` (or panics) only its own changes are rolled back. Resolves after the
    /// batch COMMIT: the effects are visible to `read` and survive a kill of this process, but
    /// are not necessarily fsynced (use [`Store::barrier`]).
    ///
    /// `f` must not issue transaction control (`BEGIN`/`COMMIT`/`ROLLBACK`); if the transaction
    /// ends under it, every op of the batch so far is reported as failed.
    pub async fn write<R, F>(&self, f: F) -> Result<R, StoreError>
    where
        F: FnOnce(&Connection) -> Result<R, StoreError> + Send + 'static,
        R: Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        self.submit(Box::new(writer::once(f, tx)), rx).await
    }

    /// [`Store::write`] for a closure that only changes the database through the connection it
    /// is given (no effect elsewhere: no channel, no counter, nothing it consumes), so that it
    /// can run again: the writer runs such ops without a savepoint each, and if one fails it
    /// rolls back the ops around it and runs the others again. Same guarantees as `write`
    /// (a failure or panic undoes only this op; the result is committed when it resolves) at a
    /// fraction of the writer's cost. Every hot-path write of the loop is one of these.
    pub async fn write_replayable<R, F>(&self, f: F) -> Result<R, StoreError>
    where
        F: FnMut(&Connection) -> Result<R, StoreError> + Send + 'static,
        R: Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        self.submit(Box::new(Closure::replayable(f, tx)), rx).await
    }

    async fn submit<R>(
        &self,
        op: Box<dyn Op>,
        rx: oneshot::Receiver<Result<R, StoreError>>,
    ) -> Result<R, StoreError> {
        {
            let guard = self
                .inner
                .writer_tx
                .read()
                .unwrap_or_else(|e| e.into_inner());
            let sender = guard.as_ref().ok_or(StoreError::Closed)?;
            sender.send(op).map_err(|_| StoreError::Closed)?;
        }
        // A dropped reply sender means the writer thread died: report Closed, never hang.
        rx.await.map_err(|_| StoreError::Closed)?
    }

    /// Resolves once every write committed before this call is on stable storage.
    ///
    /// * [`Durability::Full`]: an fsync of the `-wal` file. Barriers are group-committed: all
    ///   barriers waiting when an fsync starts share it, and a barrier whose writes an earlier
    ///   fsync already covered returns at once without any syscall.
    /// * [`Durability::Normal`]: returns at once (the commit already happened when `write`
    ///   resolved). Trade: no fsync cost, but a power loss may drop the latest commits; a crash
    ///   of this process loses nothing.
    pub async fn barrier(&self) -> Result<(), StoreError> {
        let counters = &self.inner.counters;
        let target = counters.commit_seq.load(Ordering::SeqCst);
        if self.inner.durability == Durability::Normal
            || target <= counters.synced_seq.load(Ordering::SeqCst)
        {
            return if self.is_closed() {
                Err(StoreError::Closed)
            } else {
                Ok(())
            };
        }
        let (tx, rx) = oneshot::channel();
        {
            let guard = self
                .inner
                .syncer_tx
                .read()
                .unwrap_or_else(|e| e.into_inner());
            let sender = guard.as_ref().ok_or(StoreError::Closed)?;
            sender
                .send(SyncRequest { target, reply: tx })
                .map_err(|_| StoreError::Closed)?;
        }
        rx.await.map_err(|_| StoreError::Closed)?
    }

    /// Runs `f` on a pooled reader connection. WAL readers never block the writer nor each
    /// other, and each statement starts a fresh snapshot, so `f` sees every write whose `write`
    /// future has resolved. Synchronous: meant for short indexed reads.
    pub fn read<R>(
        &self,
        f: impl FnOnce(&Connection) -> Result<R, StoreError>,
    ) -> Result<R, StoreError> {
        let pooled = self
            .inner
            .readers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop();
        let conn = match pooled {
            Some(conn) => conn,
            None => self.open_reader()?,
        };
        let res = f(&conn);
        // A closure that left a transaction open would pin an old snapshot on this connection and
        // break read-your-writes for the next user: roll it back, or drop the connection.
        if !conn.is_autocommit() && conn.execute_batch("ROLLBACK").is_err() {
            return res;
        }
        let mut pool = self.inner.readers.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < MAX_IDLE_READERS {
            pool.push(conn);
        }
        res
    }

    /// Why the store could not write for lack of space (disk or quota full), if the latest
    /// such failure has not been followed by a successful commit yet. Reads keep working
    /// meanwhile, and the first commit that finds space again clears it.
    pub fn storage_full(&self) -> Option<String> {
        self.inner
            .counters
            .full
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn stats(&self) -> StoreStats {
        let c = &self.inner.counters;
        StoreStats {
            commits: c.commits.load(Ordering::Relaxed),
            writes: c.writes.load(Ordering::Relaxed),
            fsyncs: c.fsyncs.load(Ordering::Relaxed),
            wal_frames: c.wal_frames.load(Ordering::Relaxed),
            writer_busy_ns: c.writer_busy_ns.load(Ordering::Relaxed),
            writer_checkpoint_ns: c.writer_checkpoint_ns.load(Ordering::Relaxed),
            wal_truncations: c.wal_truncations.load(Ordering::Relaxed),
            syncer_busy_ns: c.syncer_busy_ns.load(Ordering::Relaxed),
            linger_waits: c.linger_waits.load(Ordering::Relaxed),
            linger_answered: c.linger_answered.load(Ordering::Relaxed),
        }
    }

    /// Bytes SQLite's allocator holds now, for every connection of the process (page caches,
    /// prepared statements, schemas): the part of the process's memory the stores cost.
    pub fn sqlite_heap_bytes() -> i64 {
        // SAFETY: reads SQLite's global memory counter; no pointer is passed.
        unsafe { rusqlite::ffi::sqlite3_memory_used() }
    }

    /// Starts counting, from now on, which table or index each page the commits write to the
    /// WAL belongs to (`on`), or stops. Costs the writer a read of each frame's header: for
    /// profiles and the bench, not for serving.
    pub fn record_wal_pages(&self, on: bool) {
        self.inner.page_log.set(on);
    }

    /// The WAL pages counted since [`Store::record_wal_pages`] started, by table or index
    /// (empty when not recording). Scans the database's pages once to name them.
    pub fn wal_pages_by_table(&self) -> Result<WalPages, StoreError> {
        let log = self.inner.page_log.clone();
        self.read(move |conn| log.by_table(conn))
    }

    /// Stops accepting writes, lets the writer drain what is already queued, and joins the
    /// threads. Later `write`/`barrier` calls (on any clone) return [`StoreError::Closed`].
    /// Dropping every clone has the same effect without the join.
    pub fn close(&self) {
        self.inner
            .writer_tx
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        self.inner
            .syncer_tx
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let threads =
            std::mem::take(&mut *self.inner.threads.lock().unwrap_or_else(|e| e.into_inner()));
        let me = std::thread::current().id();
        for t in threads {
            // A write closure may hold a Store clone and call close(): never join ourselves.
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
        self.inner
            .readers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    fn is_closed(&self) -> bool {
        self.inner
            .writer_tx
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
    }

    fn open_reader(&self) -> Result<Connection, StoreError> {
        let conn = Connection::open_with_flags(
            &self.inner.path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        stable_plans(&conn)?;
        conn.set_prepared_statement_cache_capacity(64);
        Ok(conn)
    }

    pub(crate) fn kv_cache(&self) -> &KvCache {
        &self.inner.kv_cache
    }

    pub(crate) fn event_tail(&self) -> &Arc<events::EventTail> {
        &self.inner.event_tail
    }

    pub(crate) fn queue_inbox(&self) -> &crate::queue_inbox::QueueInbox {
        &self.inner.queue_inbox
    }

    pub(crate) fn events_sender(&self) -> &watch::Sender<i64> {
        &self.inner.events_tx
    }
}

/// Opens the checkpointer's own connection and starts its thread. Returns where to ask for a
/// checkpoint.
fn start_checkpointer(
    path: &Path,
    counters: Arc<Counters>,
) -> Result<(mpsc::SyncSender<()>, JoinHandle<()>), StoreError> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    // A checkpoint fsyncs the WAL before it copies frames out of it and the database after,
    // so what it copies is on disk before the WAL can start over.
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    let (tx, rx) = mpsc::sync_channel::<()>(1);
    let thread = std::thread::Builder::new()
        .name("harness-store-checkpointer".into())
        .spawn(move || checkpointer_loop(conn, rx, counters))?;
    Ok((tx, thread))
}

/// Replaces the writer's automatic checkpoint (which copies WAL frames into the database, and
/// fsyncs both, on the writer thread, in the middle of a batch) with a request to the
/// checkpointer thread every [`CHECKPOINT_FRAMES`] new frames, and a checkpoint of what is left
/// on the writer itself only once the WAL reaches [`WRITER_CHECKPOINT_FRAMES`]. Without a
/// checkpointer (`requests` is None) the writer checkpoints every [`CHECKPOINT_FRAMES`], as
/// SQLite would. Counts the frames each commit wrote and the time the writer spent checkpointing.
fn hand_off_checkpoints(
    conn: &mut Connection,
    requests: Option<mpsc::SyncSender<()>>,
    counters: Arc<Counters>,
    page_log: Arc<PageLog>,
) -> Result<(), StoreError> {
    let mut next_at = CHECKPOINT_FRAMES;
    let mut last = 0;
    conn.wal_hook(Some(move |wal: &mut rusqlite::hooks::Wal, frames: i32| {
        // `frames` is the WAL's length after this commit; shorter than before, it started over.
        let wrote = if frames >= last {
            frames - last
        } else {
            frames
        };
        last = frames;
        page_log.commit(frames - wrote + 1, frames);
        counters
            .wal_frames
            .fetch_add(wrote.max(0) as u64, Ordering::Relaxed);
        // The hook runs only for a commit that wrote its frames: there is space again.
        counters.clear_full();
        if frames < next_at - CHECKPOINT_FRAMES {
            // The WAL started over.
            next_at = CHECKPOINT_FRAMES;
        }
        let on_writer = match &requests {
            Some(_) => frames >= WRITER_CHECKPOINT_FRAMES,
            None => frames >= CHECKPOINT_FRAMES,
        };
        if on_writer {
            let started = std::time::Instant::now();
            // Busy while the checkpointer runs: the next commit tries again.
            if let Err(e) = wal.checkpoint_v2(rusqlite::wal::CheckpointMode::PASSIVE) {
                tracing::debug!(error = %e, "harness-store: writer checkpoint deferred");
            }
            counters
                .batch_checkpoint_ns
                .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        } else if frames >= next_at {
            next_at = frames.saturating_add(CHECKPOINT_FRAMES);
            if let Some(requests) = &requests {
                // Full: a request is already waiting, and it will cover these frames too.
                let _ = requests.try_send(());
            }
        }
        Ok(())
    }))?;
    Ok(())
}

/// Serves checkpoint requests until the writer is gone. A PASSIVE checkpoint runs beside the
/// writer (it takes no lock the writer needs) and copies every frame committed when it started.
fn checkpointer_loop(conn: Connection, requests: mpsc::Receiver<()>, counters: Arc<Counters>) {
    while requests.recv().is_ok() {
        // (busy, frames in the WAL, frames checkpointed)
        let copied: rusqlite::Result<i64> =
            conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| r.get(2));
        if let Err(e) = copied {
            // The database file could not grow: the WAL keeps the frames, and grows instead
            // until it cannot either.
            let e = StoreError::from(e);
            if let StoreError::Full(reason) = &e {
                counters.note_full(&format!("checkpoint: {reason}"));
            }
            tracing::warn!(error = %e, "harness-store: checkpoint failed; the next request retries");
        }
    }
}

/// Serves barriers: block for one request, take every request already waiting, and issue one
/// fsync for all of them (unless an earlier fsync already covers them all).
fn syncer_loop(db: PathBuf, rx: mpsc::Receiver<SyncRequest>, counters: Arc<Counters>) {
    let mut wal_path = OsString::from(db.as_os_str());
    wal_path.push("-wal");
    let wal_path = PathBuf::from(wal_path);
    let mut wal: Option<File> = None;
    // After a failed fsync the kernel may have dropped dirty pages and a later fsync could
    // "succeed" without them: stay failed rather than claim durability we do not have. Only a
    // full disk is recovered from (see `checkpoint_all`); any other failure stays until restart.
    let mut poisoned: Option<SyncFailure> = None;
    let mut waiting: Vec<SyncRequest> = Vec::new();
    while let Ok(first) = rx.recv() {
        waiting.push(first);
        while let Ok(req) = rx.try_recv() {
            waiting.push(req);
        }
        if poisoned.as_ref().is_some_and(|p| p.full) {
            let upto = counters.commit_seq.load(Ordering::SeqCst);
            match checkpoint_all(&db) {
                Ok(true) => {
                    tracing::warn!("harness-store: the WAL is checkpointed and synced again after a full disk; barriers resume");
                    counters.synced_seq.fetch_max(upto, Ordering::SeqCst);
                    poisoned = None;
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::debug!(error = %e, "harness-store: still no space to recover durability")
                }
            }
        }
        let target = waiting.iter().map(|r| r.target).max().unwrap_or(0);
        let result: Result<(), SyncFailure> = if let Some(failure) = &poisoned {
            Err(failure.clone())
        } else if target <= counters.synced_seq.load(Ordering::SeqCst) {
            Ok(())
        } else {
            // Everything committed up to `upto` is already in the WAL file's page cache.
            let upto = counters.commit_seq.load(Ordering::SeqCst);
            let started = std::time::Instant::now();
            let synced = sync_wal(&db, &wal_path, &mut wal);
            counters
                .syncer_busy_ns
                .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            match synced {
                Ok(()) => {
                    counters.fsyncs.fetch_add(1, Ordering::Relaxed);
                    counters.synced_seq.fetch_max(upto, Ordering::SeqCst);
                    Ok(())
                }
                Err(e) => {
                    let failure = SyncFailure {
                        reason: format!("fsync of {} failed: {e}", wal_path.display()),
                        full: io_is_full(&e),
                    };
                    tracing::error!("harness-store: {}", failure.reason);
                    if failure.full {
                        counters.note_full(&failure.reason);
                    }
                    poisoned = Some(failure.clone());
                    Err(failure)
                }
            }
        };
        for req in waiting.drain(..) {
            let out = result.clone().map_err(|f| {
                if f.full {
                    StoreError::Full(f.reason)
                } else {
                    StoreError::Io(std::io::Error::other(f.reason))
                }
            });
            let _ = req.reply.send(out);
        }
    }
}

/// Why barriers fail.
#[derive(Clone)]
struct SyncFailure {
    reason: String,
    /// ENOSPC/EDQUOT: recoverable once there is space again.
    full: bool,
}

/// After an fsync failed for lack of space, the WAL's pages in the page cache may never reach
/// the disk, so no later fsync of it proves anything. What does: a FULL checkpoint, which
/// copies every frame of the WAL into the database file (fresh writes) and syncs it. Returns
/// whether every frame was copied (then everything committed before the call is durable).
fn checkpoint_all(db: &Path) -> Result<bool, StoreError> {
    let conn = Connection::open(db)?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    // (busy, frames in the WAL, frames checkpointed)
    let (busy, log, copied): (i64, i64, i64) =
        conn.query_row("PRAGMA wal_checkpoint(FULL)", [], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })?;
    Ok(busy == 0 && log == copied)
}

/// fsyncs the WAL. The first time, also fsyncs the database file and its directory so that the
/// files' creation and anything a crashed predecessor left unsynced are durable too. The WAL
/// handle stays valid for the store's life: SQLite only deletes `-wal` when the last connection
/// closes, and our writer connection lives as long as this thread's store.
fn sync_wal(db: &Path, wal_path: &Path, wal: &mut Option<File>) -> std::io::Result<()> {
    match wal {
        Some(file) => file.sync_data(),
        None => {
            File::open(db)?.sync_all()?;
            let file = File::open(wal_path)?;
            file.sync_all()?;
            if let Some(dir) = db.parent().filter(|p| !p.as_os_str().is_empty()) {
                File::open(dir)?.sync_all()?;
            }
            *wal = Some(file);
            Ok(())
        }
    }
}
