//! Append-only event log (`events` table) with an optional dedupe key, plus a wake-up signal.
//!
//! Subscribers get a `tokio::sync::watch::Receiver<i64>` holding the latest committed event id.
//! A watch (rather than a broadcast) because subscribers only need "something new up to id N"
//! and then page with [`Store::events_after`]: it is one shared slot (no per-message allocation),
//! it can never lag or drop (a slow reader just sees the newest id), and it coalesces bursts.
//!
//! A session's events are found without an index written on every insert. An index keyed by
//! session puts each session's newest entries on a leaf of its own, so every commit rewrote one
//! leaf per session it touched (2.2–3.1 of the ~10 WAL pages a bench step wrote). Instead the
//! index (`events_by_session`) is brought up to date in batches, the *fold*: everything up to
//! mark `upto` is in it, and the ids above (the *tail*) are kept in memory, each with a hash of
//! its session, in id order. The writer folds when the tail reaches [`FOLD_EVENTS`], when it is
//! idle and when the store closes; one fold rewrites each session's leaf once for thousands of
//! events. At open the tail is read back from the log (ids above the stored mark). Under load a
//! fold runs in parts between the writer's batches, so that no step's commit waits for a whole
//! one (see [`fold_part_in`]); one part moves the mark, and those before it write nothing a
//! reader looks at.
//!
//! Dedupe keys are folded the same way. A unique index on the log's key column had its new
//! keys at two right edges (the keys begin with their topic), rewritten by every commit: 0.7 of
//! a step's ~5.5 WAL pages. The keys of the tail's events are in the writer's memory
//! ([`EventTail`]'s key set: no WAL page; each insert registers its undo with
//! [`crate::on_rollback`], so a key rolls back with the batch or an op's savepoint and a retried
//! write within a batch still sees its own); the fold moves them to `event_keys`, in key order.
//! An insert with a key looks in both. At open the set is filled from the keys of the events
//! above the mark. (It was a TEMP table: a look-up and an insert there cost each event with a
//! key two statements, and the table's pages stayed with the connection.)

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

use rusqlite::{Connection, OptionalExtension};
use serde_json::Value;

use crate::error::StoreError;
use crate::store::Store;

/// Unfolded events after which the writer folds them into `events_by_session`. A fold rewrites
/// about one leaf per session with events in the tail, so the larger the tail the fewer pages
/// an event costs (at 200 busy sessions: 3.0 WAL pages a step at 16,384, 2.8 at 32,768, and
/// the writer busy 0.80 of the wall instead of 0.83); the tail costs ~8 bytes an event in
/// memory, the writer keeps its dedupe keys and the entry log's index until the fold (an idle
/// writer folds and gives that memory back), and a fold takes the writer's time in parts of
/// about a millisecond each.
pub(crate) const FOLD_EVENTS: usize = 32768;

/// What another crate folds with the events: a table it keeps, like the index, in a log
/// ordered by event id and brings up to date in the fold's parts (see [`Store::on_fold`]).
pub type FoldHook = Arc<dyn Fn(&Connection, &FoldPart<'_>) -> Result<(), StoreError> + Send + Sync>;

/// One part of a fold, as a [`FoldHook`] is given it, each inside a write of the store's writer
/// (see [`fold_part_in`]), in this order. Several may share one write (an idle writer folds
/// whole).
#[derive(Debug)]
pub enum FoldPart<'a> {
    /// A fold begins: it brings in what has an event id in `(from, to]`. A hook keeps the
    /// fold's working tables in the `fold` schema (an in-memory database of the writer's
    /// connection, emptied when the writer is idle): created here if need be, as they may be
    /// gone since the last fold.
    Begin { from: i64, to: i64 },
    /// What has an event id in `(after, through]`, to be read (ranges in order, from `from`
    /// to `to`).
    Collect { after: i64, through: i64 },
    /// The sessions whose ids are in `(after, through]` (`through` None: every one after
    /// `after`), in key order; `after` is `""` in the first.
    Sessions {
        after: &'a str,
        through: Option<&'a str>,
    },
    /// When this part's write commits the mark is `to`: readers look up by event id only what
    /// is above it.
    End { to: i64 },
    /// What is dead at or below `through` may go (`through` rising in steps to the fold's
    /// `to`, after `End`): everything at or below the mark is, including what an abandoned
    /// fold left behind.
    Sweep { through: i64 },
}

/// The ids above the fold mark, in memory (see the module docs).
#[derive(Default)]
pub(crate) struct EventTail {
    state: Mutex<TailState>,
    hooks: Mutex<Vec<FoldHook>>,
    /// The dedupe keys of the events above the fold mark, as the writer sees them inside its
    /// transaction (see the module docs): written by the writer only.
    keys: Mutex<HashSet<String>>,
}

#[derive(Default)]
struct TailState {
    /// Every event with a session and an id up to here is in `events_by_session`.
    upto: i64,
    /// The id of each event with a session above `upto`, by the hash of its session id, in id
    /// order: a read of one session's tail takes its own ids, not a scan of every session's
    /// (32,768 before a fold).
    by_session: HashMap<u64, VecDeque<i64>>,
    /// How many ids `by_session` holds.
    len: usize,
    /// The tail length at which the writer folds next (raised after a failed fold, so a full
    /// disk does not make every commit try again).
    fold_at: usize,
    /// The highest event id (with a session or not) whose batch committed and whose ids are in
    /// `by_session`: what subscribers may be woken to. The log's own `MAX(id)` may be ahead of it
    /// between a COMMIT and its after-commit step, when a reader woken to it would not find
    /// the event in the tail yet.
    last: i64,
}

fn session_hash(session_id: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    session_id.hash(&mut h);
    h.finish()
}

impl EventTail {
    fn state(&self) -> MutexGuard<'_, TailState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn writer_keys(&self) -> MutexGuard<'_, HashSet<String>> {
        self.keys.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts over from what the database holds: the fold mark and the events above it.
    pub(crate) fn load(&self, conn: &Connection) -> Result<(), StoreError> {
        let upto: i64 = conn
            .prepare("SELECT upto FROM folds WHERE name = 'events'")?
            .query_row([], |r| r.get(0))?;
        let (mut by_session, mut len) = (HashMap::<u64, VecDeque<i64>>::new(), 0);
        let mut stmt = conn.prepare(
            "SELECT session_id, id FROM events WHERE id > ?1 AND session_id IS NOT NULL ORDER BY id",
        )?;
        let mut found = stmt.query([upto])?;
        while let Some(row) = found.next()? {
            let session: String = row.get(0)?;
            by_session
                .entry(session_hash(&session))
                .or_default()
                .push_back(row.get(1)?);
            len += 1;
        }
        // The tail's dedupe keys, for the writer (see the module docs).
        let mut keys = HashSet::new();
        let mut stmt =
            conn.prepare("SELECT dedupe_key FROM events WHERE id > ?1 AND dedupe_key IS NOT NULL")?;
        let mut found = stmt.query([upto])?;
        while let Some(row) = found.next()? {
            keys.insert(row.get(0)?);
        }
        *self.writer_keys() = keys;
        let last = max_event_id(conn)?;
        *self.state() = TailState {
            upto,
            by_session,
            len,
            fold_at: FOLD_EVENTS,
            last,
        };
        Ok(())
    }

    /// Event `id` committed; `hash` is its session's when it has one.
    fn push(&self, hash: Option<u64>, id: i64) {
        let mut state = self.state();
        state.last = state.last.max(id);
        let Some(hash) = hash else {
            return;
        };
        state.len += 1;
        // Ids arrive in commit order; one that does not (nothing should) still lands in place.
        let ids = state.by_session.entry(hash).or_default();
        match ids.back() {
            Some(&last) if last > id => {
                let at = ids.partition_point(|&i| i < id);
                ids.insert(at, id);
            }
            _ => ids.push_back(id),
        }
    }

    /// The fold mark and the tail ids of `session_id` above `after` (some may belong to another
    /// session of the same hash: the caller checks).
    fn after(&self, session_id: &str, after: i64) -> (i64, Vec<i64>) {
        let hash = session_hash(session_id);
        let state = self.state();
        let ids = state.by_session.get(&hash).map_or_else(Vec::new, |ids| {
            let from = ids.partition_point(|&id| id <= after);
            ids.range(from..).copied().collect()
        });
        (state.upto, ids)
    }

    pub(crate) fn len(&self) -> usize {
        self.state().len
    }

    /// See [`TailState::last`].
    fn last(&self) -> i64 {
        self.state().last
    }

    /// Whether the writer should fold after its commit.
    pub(crate) fn due(&self) -> bool {
        let state = self.state();
        state.len >= state.fold_at.max(FOLD_EVENTS)
    }

    /// The fold up to `upto` committed: those ids are in the index now.
    fn folded(&self, upto: i64) {
        let mut state = self.state();
        let mut folded = 0;
        state.by_session.retain(|_, ids| {
            let done = ids.partition_point(|&id| id <= upto);
            ids.drain(..done);
            folded += done;
            !ids.is_empty()
        });
        state.len -= folded;
        if state.len == 0 {
            // Its table's memory too: the idle fold leaves nothing behind.
            state.by_session = HashMap::new();
        }
        state.upto = state.upto.max(upto);
        state.fold_at = FOLD_EVENTS;
    }

    pub(crate) fn fold_failed(&self) {
        let mut state = self.state();
        state.fold_at = state.len + FOLD_EVENTS;
    }
}

std::thread_local! {
    /// The tail of the store whose writer runs on this thread (`None` elsewhere).
    static WRITER_TAIL: std::cell::RefCell<Option<Arc<EventTail>>> =
        const { std::cell::RefCell::new(None) };
}

pub(crate) fn install_writer(tail: Arc<EventTail>) {
    WRITER_TAIL.with(|t| *t.borrow_mut() = Some(tail));
}

/// Adds event `id` (of `session_id`, if any) to the tail once the batch inserting it commits.
/// Off a writer thread (a connection of no open store) nothing is added: the next open reads
/// the event back from the log.
fn pend(session_id: Option<&str>, id: i64) {
    let Some(tail) = WRITER_TAIL.with(|t| t.borrow().clone()) else {
        return;
    };
    let hash = session_id.map(session_hash);
    crate::after_commit(move || tail.push(hash, id));
}

/// One row of the log.
#[derive(Clone, Debug, serde::Serialize)]
pub struct EventRow {
    pub id: i64,
    pub session_id: Option<String>,
    pub topic: String,
    pub payload: Value,
    pub at_ms: i64,
}

/// Inserts an event inside a caller's write. Returns `None` when `dedupe_key` is already
/// present (the event was recorded before: idempotent retries). Call [`Store::notify_events`]
/// after the write resolves so subscribers learn of it.
pub fn insert_event_in(
    conn: &Connection,
    session_id: Option<&str>,
    topic: &str,
    payload: &Value,
    dedupe_key: Option<&str>,
) -> Result<Option<i64>, StoreError> {
    let text = serde_json::to_string(payload)?;
    insert_event_text_in(conn, session_id, topic, &text, dedupe_key)
}

/// [`insert_event_in`] with the payload already serialised (by the caller, off the writer
/// thread). `text` must be JSON: readers parse it.
pub fn insert_event_text_in(
    conn: &Connection,
    session_id: Option<&str>,
    topic: &str,
    text: &str,
    dedupe_key: Option<&str>,
) -> Result<Option<i64>, StoreError> {
    let tail = match dedupe_key {
        Some(key) => {
            let tail = WRITER_TAIL.with(|t| t.borrow().clone()).ok_or_else(|| {
                StoreError::Invalid(
                    "events with a dedupe key are written by the store's writer only".into(),
                )
            })?;
            // The tail's keys first (in memory), then the folded ones.
            if tail.writer_keys().contains(key)
                || conn
                    .prepare_cached("SELECT 1 FROM event_keys WHERE dedupe_key = ?1")?
                    .exists([key])?
            {
                return Ok(None);
            }
            Some(tail)
        }
        None => None,
    };
    conn.prepare_cached(
        "INSERT INTO events(session_id, topic, payload, dedupe_key, at_ms)
         VALUES (?1, ?2, ?3, ?4, ?5)",
    )?
    .execute((session_id, topic, text, dedupe_key, harness_types::now_ms()))?;
    let id = conn.last_insert_rowid();
    // After the event, so a failed insert leaves no key behind to refuse its retry.
    if let (Some(key), Some(tail)) = (dedupe_key, tail) {
        tail.writer_keys().insert(key.to_string());
        let key = key.to_string();
        if let Err(undo) = crate::on_rollback(move || {
            tail.writer_keys().remove(&key);
        }) {
            undo();
        }
    }
    pend(session_id, id);
    Ok(Some(id))
}

/// Keys a fold part brings into the index, about (a part ends at a session's last key): ~1 ms
/// of the writer's time under load, about what the workers have queued for it, so a part does
/// not leave them waiting the way a whole fold (30–40 ms) did.
const FOLD_PART_KEYS: i64 = 1024;

/// Event ids a collecting part reads (in id order, into TEMP tables: ~1 ms under load).
const FOLD_COLLECT_IDS: i64 = 1024;

/// Event ids a sweeping part covers (it drops rows in id order, with no index to write).
const FOLD_SWEEP_IDS: i64 = 4096;

/// The fold's keys, in key order: the `(session, id)` of each event it brings into the index
/// (see [`fold_part_in`]), in the fold's own database ([`renew_fold_db`]).
const FOLD_KEYS: &str = "CREATE TABLE IF NOT EXISTS fold.fold_keys(
    session_id TEXT NOT NULL,
    id INTEGER NOT NULL,
    PRIMARY KEY(session_id, id)
) WITHOUT ROWID;
DELETE FROM fold.fold_keys;";

/// Gives the writer's connection a new, empty `fold` database, outside a transaction, unless a
/// fold is under way. The fold's working tables (its keys, and a hook's, see
/// [`FoldPart::Begin`]) live there, in memory, not in TEMP tables: pages a TEMP table has used
/// stay with the connection (~1 MB after a fold of 16,384 events, a tenth of the memory 10,000
/// idle sessions take), while a detached database gives back everything it held. The writer
/// renews it when it has folded and is idle.
pub(crate) fn renew_fold_db(conn: &Connection) -> Result<(), StoreError> {
    if fold_under_way() {
        return Ok(());
    }
    let attached = conn
        .prepare_cached("SELECT 1 FROM pragma_database_list WHERE name = 'fold'")?
        .exists([])?;
    if attached {
        conn.execute_batch("DETACH DATABASE fold")?;
    }
    conn.execute_batch("ATTACH DATABASE ':memory:' AS fold")?;
    Ok(())
}

/// A fold under way on this writer: what it brings in and how far its parts got.
#[derive(Clone)]
struct Fold {
    /// The mark it moves from and to: it brings in the events in `(from, to]`.
    from: i64,
    to: i64,
    stage: Stage,
    /// The hooks as the fold began: each sees every part from its `Begin`.
    hooks: Vec<FoldHook>,
}

/// Where a fold is (see [`fold_part_in`]), each stage in parts of its own.
#[derive(Clone)]
enum Stage {
    /// Reading the events after this id (and the hooks' rows) into the fold's TEMP tables.
    Collect { after: i64 },
    /// Writing the keys of the sessions after this one (`""`: from the first) into the index.
    Sessions { after: String },
    /// The kv log (`kv_log.rs`), which folds with the events.
    Kv,
    /// The mark moves (the dedupe keys and the hooks' `End` with it).
    End,
    /// Dropping what the fold made dead, the ids after this one (see [`FoldPart::Sweep`]).
    Sweep { after: i64 },
}

std::thread_local! {
    /// The fold under way on this thread's writer (see [`fold_part_in`]).
    static FOLDING: std::cell::RefCell<Option<Fold>> = const { std::cell::RefCell::new(None) };
    /// The mark as this thread's writer last moved it, in its transaction: the tail's moves
    /// only once that commits, and a whole fold may begin in the same write.
    static MOVED_TO: std::cell::Cell<i64> = const { std::cell::Cell::new(0) };
}

/// Whether a fold is under way on this thread's writer: its next part runs after the next
/// commit.
pub(crate) fn fold_under_way() -> bool {
    FOLDING.with(|f| f.borrow().is_some())
}

/// Forgets the fold under way (after a part failed): the next one starts over, and every
/// part is idempotent (`OR IGNORE`, `OR REPLACE`, a delete), so what the abandoned one wrote
/// is written again at most.
pub(crate) fn abandon_fold() {
    FOLDING.with(|f| *f.borrow_mut() = None);
}

/// Sets the fold under way, undone if the write rolls back.
fn set_folding(next: Option<Fold>) -> Result<(), StoreError> {
    let before = FOLDING.with(|f| f.replace(next));
    crate::on_rollback(move || FOLDING.with(|f| *f.borrow_mut() = before)).map_err(|undo| {
        undo();
        StoreError::Invalid("events are folded by the store's writer only".into())
    })
}

/// Runs one part of the fold under way, beginning one if none is, inside the caller's write.
/// Returns whether that was the last part.
///
/// A fold brings the events in `(from, to]` into `events_by_session` (and each hook's table,
/// [`Store::on_fold`]) in parts, each its own write between the writer's batches, none long
/// enough to leave the workers without a commit to wait for: the events are read into TEMP
/// tables a range of ids at a time, the index is written a range of sessions at a time, in
/// key order (each session's leaf still written once a fold), the kv log folds, then one part
/// moves the mark, and the last ones drop what the fold made dead. Readers take the index's
/// rows up to the mark only, so what the parts before the mark moved wrote is not read
/// through the index, and the tail still names those events. A kill between parts leaves the
/// mark where it was; the next fold writes the same rows again (`OR IGNORE`).
pub(crate) fn fold_part_in(conn: &Connection, tail: &Arc<EventTail>) -> Result<bool, StoreError> {
    let fold = match FOLDING.with(|f| f.borrow().clone()) {
        Some(fold) => fold,
        None => {
            let from = tail.state().upto.max(MOVED_TO.get());
            let to = max_event_id(conn)?;
            let hooks = tail.hooks.lock().unwrap_or_else(|e| e.into_inner()).clone();
            if to <= from {
                // No events to fold: the kv log only.
                fold_kv(conn)?;
                return Ok(true);
            }
            conn.execute_batch(FOLD_KEYS)?;
            for hook in &hooks {
                hook(conn, &FoldPart::Begin { from, to })?;
            }
            Fold {
                from,
                to,
                stage: Stage::Collect { after: from },
                hooks,
            }
        }
    };
    let hooks = |part: FoldPart<'_>| -> Result<(), StoreError> {
        fold.hooks.iter().try_for_each(|hook| hook(conn, &part))
    };
    let next = match &fold.stage {
        Stage::Collect { after } => {
            let through = (after + FOLD_COLLECT_IDS).min(fold.to);
            conn.prepare_cached(
                "INSERT INTO fold.fold_keys(session_id, id)
                 SELECT session_id, id FROM events
                 WHERE id > ?1 AND id <= ?2 AND session_id IS NOT NULL",
            )?
            .execute((after, through))?;
            hooks(FoldPart::Collect {
                after: *after,
                through,
            })?;
            if through < fold.to {
                Stage::Collect { after: through }
            } else {
                Stage::Sessions {
                    after: String::new(),
                }
            }
        }
        Stage::Sessions { after } => {
            // The part ends with the session at this offset (all of its keys); None: the rest.
            let through: Option<String> = conn
                .prepare_cached(
                    "SELECT session_id FROM fold.fold_keys WHERE session_id > ?1
                     ORDER BY session_id, id LIMIT 1 OFFSET ?2",
                )?
                .query_row(rusqlite::params![after, FOLD_PART_KEYS - 1], |r| r.get(0))
                .optional()?;
            match &through {
                Some(through) => conn
                    .prepare_cached(
                        "INSERT OR IGNORE INTO events_by_session(session_id, id)
                         SELECT session_id, id FROM fold.fold_keys
                         WHERE session_id > ?1 AND session_id <= ?2",
                    )?
                    .execute((after, through))?,
                None => conn
                    .prepare_cached(
                        "INSERT OR IGNORE INTO events_by_session(session_id, id)
                         SELECT session_id, id FROM fold.fold_keys WHERE session_id > ?1",
                    )?
                    .execute([after])?,
            };
            hooks(FoldPart::Sessions {
                after,
                through: through.as_deref(),
            })?;
            match through {
                Some(after) => Stage::Sessions { after },
                None => Stage::Kv,
            }
        }
        Stage::Kv => {
            fold_kv(conn)?;
            Stage::End
        }
        Stage::End => {
            // The tail's dedupe keys, those of events past `to` too (the writer's own view): a
            // key is looked up in both places, so one moved early is found all the same.
            // Their undo first: a failed insert below rolls the part back, and the keys with it.
            let keys = Arc::new(std::mem::take(&mut *tail.writer_keys()));
            let (restore, kept) = (tail.clone(), keys.clone());
            if let Err(undo) = crate::on_rollback(move || {
                *restore.writer_keys() = Arc::unwrap_or_clone(kept);
            }) {
                undo();
            }
            let mut sorted: Vec<&String> = keys.iter().collect();
            sorted.sort_unstable();
            let mut insert =
                conn.prepare_cached("INSERT OR IGNORE INTO event_keys(dedupe_key) VALUES (?1)")?;
            for key in sorted {
                insert.execute([key])?;
            }
            conn.prepare_cached("UPDATE folds SET upto = ?1 WHERE name = 'events'")?
                .execute([fold.to])?;
            conn.prepare_cached("DELETE FROM fold.fold_keys")?
                .execute([])?;
            hooks(FoldPart::End { to: fold.to })?;
            let before = MOVED_TO.replace(fold.to);
            if let Err(undo) = crate::on_rollback(move || MOVED_TO.set(before)) {
                undo();
            }
            let (tail, to) = (tail.clone(), fold.to);
            if !crate::after_commit(move || tail.folded(to)) {
                return Err(StoreError::Invalid(
                    "events are folded by the store's writer only".into(),
                ));
            }
            Stage::Sweep { after: fold.from }
        }
        Stage::Sweep { after } => {
            let through = (after + FOLD_SWEEP_IDS).min(fold.to);
            hooks(FoldPart::Sweep { through })?;
            if through >= fold.to {
                set_folding(None)?;
                return Ok(true);
            }
            Stage::Sweep { after: through }
        }
    };
    set_folding(Some(Fold {
        stage: next,
        ..fold
    }))?;
    Ok(false)
}

/// The kv log's fold (it folds with the events, `kv_log.rs`).
fn fold_kv(conn: &Connection) -> Result<(), StoreError> {
    match crate::cache::writer_cache() {
        Some(cache) => crate::kv_log::fold_in(conn, &cache),
        None => Ok(()),
    }
}

/// Folds every event above the mark into `events_by_session` inside the caller's write: the
/// rest of the fold under way, or a whole one. The tail drops what was folded once that write
/// commits (nothing changes if it rolls back).
pub(crate) fn fold_in(conn: &Connection, tail: &Arc<EventTail>) -> Result<(), StoreError> {
    // A fold under way began before the latest events: a whole one follows it.
    for _ in 0..1 + usize::from(fold_under_way()) {
        while !fold_part_in(conn, tail)? {}
    }
    Ok(())
}

/// A session's folded events in `(after, upto]` (see the module docs).
const EVENTS_FOLDED: &str = "SELECT e.id, e.session_id, e.topic, e.payload, e.at_ms
                 FROM events_by_session s CROSS JOIN events e ON e.id = s.id
                 WHERE s.session_id = ?1 AND s.id > ?2 AND s.id <= ?3 ORDER BY s.id";

/// One event of the tail, by id.
const EVENT_BY_ID: &str = "SELECT id, session_id, topic, payload, at_ms FROM events WHERE id = ?1";

type RawEvent = (i64, Option<String>, String, String, i64);

fn raw_event(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawEvent> {
    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
}

fn parsed((id, session_id, topic, payload, at_ms): RawEvent) -> Result<EventRow, StoreError> {
    Ok(EventRow {
        id,
        session_id,
        topic,
        payload: serde_json::from_str(&payload)?,
        at_ms,
    })
}

/// Inside a caller's write or read: the latest event of each session among `topics` with an
/// id above `after`, oldest first, and the log's highest id. For a crate that keeps a table of
/// its own up to date from its events in folds (see [`Store::on_fold`]) and, at open, catches
/// up on what a killed process committed after its last fold.
pub fn latest_by_session_in(
    conn: &Connection,
    after: i64,
    topics: &[&str],
) -> Result<(Vec<EventRow>, i64), StoreError> {
    let upto = max_event_id(conn)?;
    let mut stmt = conn.prepare_cached(
        "SELECT id, session_id, topic, payload, at_ms FROM events
         WHERE id > ?1 AND session_id IS NOT NULL ORDER BY id",
    )?;
    // Each session's latest, as read; only those payloads are parsed.
    let mut latest: std::collections::HashMap<String, RawEvent> = Default::default();
    let mut rows = stmt.query([after])?;
    while let Some(r) = rows.next()? {
        let topic: String = r.get(2)?;
        if !topics.contains(&topic.as_str()) {
            continue;
        }
        let session: String = r.get(1)?;
        latest.insert(
            session.clone(),
            (r.get(0)?, Some(session), topic, r.get(3)?, r.get(4)?),
        );
    }
    let mut out = latest
        .into_values()
        .map(parsed)
        .collect::<Result<Vec<_>, _>>()?;
    out.sort_by_key(|e| e.id);
    Ok((out, upto))
}

/// Inside a caller's write or read: the log's highest event id (0 when it is empty).
pub fn last_event_id_in(conn: &Connection) -> Result<i64, StoreError> {
    max_event_id(conn)
}

pub(crate) fn max_event_id(conn: &Connection) -> Result<i64, StoreError> {
    Ok(conn
        .prepare_cached("SELECT COALESCE(MAX(id), 0) FROM events")?
        .query_row([], |r| r.get(0))?)
}

impl Store {
    /// Appends one event (committed when it resolves) and wakes subscribers.
    pub async fn append_event(
        &self,
        session_id: Option<&str>,
        topic: &str,
        payload: &Value,
        dedupe_key: Option<&str>,
    ) -> Result<Option<i64>, StoreError> {
        let session_id = session_id.map(str::to_string);
        let topic = topic.to_string();
        let text = serde_json::to_string(payload)?;
        let dedupe_key = dedupe_key.map(str::to_string);
        let id = self
            .write_replayable(move |c| {
                insert_event_text_in(
                    c,
                    session_id.as_deref(),
                    &topic,
                    &text,
                    dedupe_key.as_deref(),
                )
            })
            .await?;
        if let Some(id) = id {
            self.publish_event_id(id);
        }
        Ok(id)
    }

    /// Wakes subscribers after events were inserted with [`insert_event_in`] inside a caller's
    /// write (call it once that write has resolved). Up to the last event whose commit is
    /// complete here, not the log's `MAX(id)`: an event of a batch still between its COMMIT and
    /// its after-commit step is not in the tail yet, a subscriber woken to it would read a page
    /// without it, and its own wake-up, coming later with the same id, would wake nobody.
    pub fn notify_events(&self) {
        self.publish_event_id(self.event_tail().last());
    }

    /// Wakes subscribers after a caller's write that inserted event `id` with
    /// [`insert_event_in`] has resolved: [`Store::notify_events`] without reading the log.
    pub fn notify_event(&self, id: i64) {
        self.publish_event_id(id);
    }

    /// A receiver whose value is the latest committed event id; `changed()` fires on new events.
    pub fn subscribe_events(&self) -> tokio::sync::watch::Receiver<i64> {
        self.events_sender().subscribe()
    }

    /// Up to `limit` events of a session with `id > after_id`, oldest first (cursor paging).
    /// Costs the session's events read, not the log's: the folded ones through the index, the
    /// tail's from the ids kept in memory.
    pub fn events_after(
        &self,
        session_id: &str,
        after_id: i64,
        limit: usize,
    ) -> Result<Vec<EventRow>, StoreError> {
        // Mark and tail are taken together, before the read: a fold that commits meanwhile
        // only adds to the index what the tail ids already name. Every tail id of the session's
        // hash, not `limit` of them: one of another session with the same hash would otherwise
        // take a place in the page, and a short page reads as "caught up" to a stream.
        let (upto, tail) = self.event_tail().after(session_id, after_id);
        self.read(|c| {
            let mut out = Vec::new();
            if after_id < upto {
                let mut stmt = c.prepare_cached(EVENTS_FOLDED)?;
                // Rows stream in index order; stopping early reads nothing more.
                let rows = stmt.query_map((session_id, after_id, upto), raw_event)?;
                for row in rows.take(limit) {
                    out.push(parsed(row?)?);
                }
            }
            let mut by_id = c.prepare_cached(EVENT_BY_ID)?;
            for id in tail {
                if out.len() >= limit {
                    break;
                }
                let row = by_id.query_row([id], raw_event)?;
                if row.1.as_deref() == Some(session_id) {
                    out.push(parsed(row)?);
                }
            }
            Ok(out)
        })
    }

    /// Folds the events not yet in the per-session index into it now (the writer does so on
    /// its own when the tail grows long, when idle and at close; see the module docs).
    /// Resolves once the fold committed.
    pub async fn fold_events(&self) -> Result<(), StoreError> {
        let tail = self.event_tail().clone();
        self.write(move |c| fold_in(c, &tail)).await
    }

    /// Events above the fold mark, kept in memory until the next fold.
    pub fn unfolded_events(&self) -> usize {
        self.event_tail().len()
    }

    /// The ids of `session_id`'s events above the fold mark (and above `after`), oldest first,
    /// as committed when called; a few may be another session's (same hash): check the row.
    /// A crate folding a table of its own with the events ([`Store::on_fold`]) finds a
    /// session's unfolded rows from these.
    pub fn unfolded_session_events(&self, session_id: &str, after: i64) -> Vec<i64> {
        self.event_tail().after(session_id, after).1
    }

    /// Runs `hook` in every part of every fold (see [`FoldPart`]), each inside the part's write,
    /// after the index's share of that part is written.
    pub fn on_fold(&self, hook: FoldHook) {
        self.event_tail()
            .hooks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(hook);
    }

    /// Highest committed event id (0 when the log is empty).
    pub fn last_event_id(&self) -> Result<i64, StoreError> {
        self.read(max_event_id)
    }

    /// Raises the watched id (never lowers it: concurrent publishers may finish out of order).
    fn publish_event_id(&self, id: i64) {
        self.events_sender().send_if_modified(|current| {
            if id > *current {
                *current = id;
                true
            } else {
                false
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Durability;
    use rusqlite::StatementStatus;

    /// Appends `n` events of `session`.
    async fn append(store: &Store, session: &str, n: usize) {
        for i in 0..n {
            store
                .append_event(Some(session), "t", &serde_json::json!({ "i": i }), None)
                .await
                .unwrap();
        }
    }

    /// Paging through sessions reuses the cached statement as prepared: a new session id bound
    /// to the leading column of the index the rows are ordered by does not make SQLite compile
    /// it again (see `store::stable_plans`).
    #[tokio::test]
    async fn paging_never_reprepares() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("e.db"), Durability::Normal).unwrap();
        append(&store, "s", 5).await;
        // Folded, so the pages come through the per-session index.
        store.fold_events().await.unwrap();
        for (session, after, limit) in [("s", 0, 2), ("s", 2, 10), ("x", 0, 1), ("s", 300, 3)] {
            let page = store.events_after(session, after, limit).unwrap();
            assert!(page.len() <= limit);
        }
        assert_eq!(store.events_after("s", 0, 2).unwrap().len(), 2);
        let reprepared = store
            .read(|c| {
                Ok(c.prepare_cached(EVENTS_FOLDED)?
                    .get_status(StatementStatus::RePrepare))
            })
            .unwrap();
        assert_eq!(reprepared, 0);
    }

    /// A session's tail ids come from its own list, which follows the pushes (one
    /// out of order too) and folds.
    #[test]
    fn a_sessions_tail_ids_follow_pushes_and_folds() {
        let tail = EventTail::default();
        let (a, b) = (session_hash("a"), session_hash("b"));
        for id in [1, 3, 5, 7] {
            tail.push(Some(a), id);
        }
        for id in [2, 4, 8] {
            tail.push(Some(b), id);
        }
        tail.push(Some(b), 6);
        tail.push(None, 9);
        assert_eq!(tail.after("a", 0).1, vec![1, 3, 5, 7]);
        assert_eq!(tail.after("b", 0).1, vec![2, 4, 6, 8]);
        assert_eq!(tail.after("b", 4).1, vec![6, 8]);
        assert_eq!(tail.after("c", 0).1, Vec::<i64>::new());
        tail.folded(5);
        assert_eq!(tail.after("a", 0), (5, vec![7]));
        assert_eq!(tail.after("b", 0), (5, vec![6, 8]));
        tail.folded(8);
        assert_eq!(tail.after("a", 0).1, Vec::<i64>::new());
        assert!(tail.state().by_session.is_empty());
        assert_eq!(tail.len(), 0);
    }

    /// Tail ids whose session hash collides with the one asked for are skipped without
    /// shortening the page: a full page still holds `limit` of the session's own events.
    #[tokio::test]
    async fn a_hash_collision_in_the_tail_does_not_shorten_a_page() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("e.db"), Durability::Normal).unwrap();
        append(&store, "other", 4).await;
        append(&store, "s", 3).await;
        // Give the other session's tail rows the hash of "s", as a collision would.
        {
            let mut state = store.event_tail().state();
            assert_eq!(state.len, 7, "nothing folded yet");
            let mut all: Vec<i64> = state.by_session.drain().flat_map(|(_, ids)| ids).collect();
            all.sort_unstable();
            state.by_session.insert(session_hash("s"), all.into());
        }
        let page = store.events_after("s", 0, 3).unwrap();
        let ids: Vec<i64> = page.iter().map(|e| e.id).collect();
        assert_eq!(ids, vec![5, 6, 7]);
        assert!(page.iter().all(|e| e.session_id.as_deref() == Some("s")));
    }
}
