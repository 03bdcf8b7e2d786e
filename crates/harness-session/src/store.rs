//! Typed transcript operations over the embedded store's SQLite connection.

use std::collections::HashMap;
use std::sync::Arc;

use harness_store::{insert_event_in, FoldPart, Store, StoreError};
use harness_types::message::AgentMessage;
use harness_types::session::*;
use harness_types::{now_ms, ErrorCode, HarnessError};
use rusqlite::{params, Connection, OptionalExtension};
use serde_json::{json, Value};

use crate::changes::ChangeLog;

mod append;
mod entry_log;
mod list;
mod status_log;

use crate::topics;
pub(crate) use append::PreparedAppend;
use entry_log::*;
use list::*;
use status_log::StatusLog;

/// The largest page `messages` returns.
pub const MAX_PAGE: u32 = 500;

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Harness(#[from] HarnessError),
    #[error("transcript store: {0}")]
    Store(#[from] StoreError),
}

impl From<rusqlite::Error> for SessionError {
    fn from(e: rusqlite::Error) -> Self {
        SessionError::Store(StoreError::Sqlite(e))
    }
}

impl From<SessionError> for HarnessError {
    fn from(e: SessionError) -> Self {
        match e {
            SessionError::Harness(h) => h,
            // A full disk keeps its kind (HTTP 507: the same call succeeds once there is space).
            SessionError::Store(s) => match s.classified() {
                StoreError::Full(reason) => HarnessError::new(ErrorCode::StorageFull, reason),
                s => HarnessError::new(ErrorCode::State, s.to_string()),
            },
        }
    }
}

type Result<T> = std::result::Result<T, SessionError>;

/// Lifts a typed error through the store's write closure, which only carries `StoreError`.
fn reject(e: HarnessError) -> StoreError {
    StoreError::Invalid(e.to_string())
}

fn lower(e: StoreError) -> SessionError {
    match e {
        StoreError::Invalid(text) => SessionError::Harness(HarnessError::from_wire(&text)),
        other => SessionError::Store(other),
    }
}

/// Each entry once, at its latest change, in change order. Pages of events are read one
/// snapshot each: an entry changed again between two pages' reads is the latest on both.
fn latest_per_entry(changes: Vec<(i64, Entry)>) -> Vec<(i64, Entry)> {
    let mut seen = std::collections::HashSet::new();
    let mut out: Vec<(i64, Entry)> = changes
        .into_iter()
        .rev()
        .filter(|(_, e)| seen.insert(e.entry_id.clone()))
        .collect();
    out.reverse();
    out
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    title TEXT,
    metadata TEXT NOT NULL DEFAULT '{}',
    kind TEXT,
    status TEXT NOT NULL DEFAULT 'idle',
    status_reason TEXT,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS entries (
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    entry_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    body TEXT NOT NULL,
    origin TEXT,
    revision INTEGER NOT NULL DEFAULT 0,
    chg INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (session_id, seq)
) WITHOUT ROWID;
CREATE UNIQUE INDEX IF NOT EXISTS entries_by_id ON entries (session_id, entry_id);
CREATE TABLE IF NOT EXISTS entry_log (
    id INTEGER PRIMARY KEY,
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    entry_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    body TEXT NOT NULL,
    origin TEXT,
    revision INTEGER NOT NULL
);
";

/// Earlier layouts indexed `(session_id, chg)`. Changes are found through the events instead
/// (see [`SessionStore::changes`]): the index was a fourth B-tree leaf of the session dirtied by
/// every append and update (about 1.5 of the 14.5 WAL pages a text step wrote), for a read the
/// change log now answers from memory almost every time.
const DROP_CHANGE_INDEX: &str = "DROP INDEX IF EXISTS entries_by_change;";

/// Where entries written before `chg` existed are placed: below every real mark (event ids are
/// positive) and still ordered by `seq`, so a reader starting from the beginning sees them once.
const LEGACY_CHANGE_BASE: i64 = -(1 << 62);

/// `session::changes` from a real mark (event ids start at 1): the session's events after it
/// (`Store::events_after`, which costs the session's events, not the log's) name the entries
/// they changed, and an entry counts at its latest change only (`chg` is that event's id).
/// Costs the events since the mark, not the transcript. An event that names an entry without
/// being its change (one published by anyone else) matches nothing. Events are read in pages
/// of this many.
const CHANGE_EVENT_PAGE: usize = 256;

/// `session::changes` from the beginning (or a legacy mark below 0, see `LEGACY_CHANGE_BASE`):
/// the whole transcript is the answer anyway, scanned in key order.
const CHANGES_FROM_START: &str = "
    SELECT seq, entry_id, kind, body, origin, revision, chg FROM entries
    WHERE session_id = ?1 AND chg > ?2 ORDER BY chg";

/// A page's `limit`: [`MAX_PAGE`] when not given; 0 or more than that is refused.
fn page_limit(limit: Option<u32>) -> Result<u32> {
    let limit = limit.unwrap_or(MAX_PAGE);
    if limit == 0 || limit > MAX_PAGE {
        return Err(HarnessError::invalid_field(
            "limit",
            format!("must be between 1 and {MAX_PAGE} (got {limit})"),
        )
        .into());
    }
    Ok(limit)
}

/// `chg` is an entry's change mark: the id of the event its latest append or update inserted in
/// the same transaction (with the session's id and the entry's id in it). Event ids are never
/// reused and the single writer commits them in order, so "entries with `chg` > m" is exactly
/// what changed after a reader saw mark m, and each of them is found from its own event.
fn migrate(conn: &Connection) -> std::result::Result<(), StoreError> {
    conn.execute_batch(SCHEMA)?;
    let has_chg = conn
        .prepare("SELECT 1 FROM pragma_table_info('entries') WHERE name = 'chg'")?
        .exists([])?;
    if !has_chg {
        conn.execute_batch("ALTER TABLE entries ADD COLUMN chg INTEGER NOT NULL DEFAULT 0")?;
        conn.execute("UPDATE entries SET chg = ?1 + seq", [LEGACY_CHANGE_BASE])?;
    }
    conn.execute_batch(DROP_CHANGE_INDEX)?;
    // What a killed process left in the log is folded now: from here on the log only holds
    // rows whose events are above the store's fold mark, which is how readers find them.
    fold_whole_log_in(conn)?;
    conn.execute_batch(status_log::SCHEMA)?;
    status_log::recover_in(conn)?;
    Ok(())
}

/// Whether this store's folds already carry the entries (one hook per store).
#[derive(Default)]
struct FoldsEntries(std::sync::atomic::AtomicBool);

/// The transcript store. Cheap to clone.
#[derive(Clone)]
pub struct SessionStore {
    store: Store,
    /// Shared by every `SessionStore` over the same store (its writes must all reach it).
    log: Arc<ChangeLog>,
    /// Statuses not folded into their rows yet (`status_log.rs`); shared the same way.
    statuses: Arc<StatusLog>,
}

fn status_str(s: SessionStatus) -> &'static str {
    match s {
        SessionStatus::Idle => "idle",
        SessionStatus::Working => "working",
        SessionStatus::Done => "done",
        SessionStatus::Error => "error",
    }
}

fn parse_status(s: &str) -> SessionStatus {
    match s {
        "working" => SessionStatus::Working,
        "done" => SessionStatus::Done,
        "error" => SessionStatus::Error,
        _ => SessionStatus::Idle,
    }
}

fn meta_in(
    conn: &Connection,
    session_id: &str,
) -> std::result::Result<Option<SessionMeta>, StoreError> {
    let row = conn
        .prepare_cached(
            "SELECT title, metadata, kind, status, status_reason, created_at, updated_at
             FROM sessions WHERE session_id = ?1",
        )?
        .query_row(params![session_id], |r| {
            Ok((
                r.get::<_, Option<String>>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, Option<String>>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, Option<String>>(4)?,
                r.get::<_, i64>(5)?,
                r.get::<_, i64>(6)?,
            ))
        })
        .optional()?;
    Ok(row.map(
        |(title, metadata, kind, status, status_reason, created_at, updated_at)| SessionMeta {
            session_id: session_id.to_string(),
            title,
            metadata: serde_json::from_str(&metadata).unwrap_or(Value::Null),
            kind,
            status: parse_status(&status),
            status_reason,
            created_at,
            updated_at,
            preview: None,
            model: None,
            provider: None,
            parent_session_id: None,
            cost_usd: None,
        },
    ))
}

/// As [`meta_in`], on the writer: with the status its transaction sees (`status_log.rs`).
fn meta_in_writer(
    conn: &Connection,
    session_id: &str,
) -> std::result::Result<Option<SessionMeta>, StoreError> {
    let Some(mut meta) = meta_in(conn, session_id)? else {
        return Ok(None);
    };
    if let Some(pending) = status_log::pending_in_writer(session_id) {
        pending.apply(&mut meta);
    }
    Ok(Some(meta))
}

fn insert_session_in(
    conn: &Connection,
    session_id: &str,
    title: Option<&str>,
    metadata: &Value,
    kind: Option<&str>,
) -> std::result::Result<(), StoreError> {
    let now = now_ms();
    conn.prepare_cached(
        "INSERT INTO sessions (session_id, title, metadata, kind, status, created_at, updated_at)
         VALUES (?1, ?2, ?3, ?4, 'idle', ?5, ?5)",
    )?
    .execute(params![session_id, title, metadata.to_string(), kind, now])?;
    Ok(())
}

fn entry_from_row(
    entry_id: String,
    seq: i64,
    kind: &str,
    body: &str,
    origin: Option<String>,
    revision: i64,
) -> std::result::Result<Entry, StoreError> {
    let origin = origin.map(|o| serde_json::from_str(&o)).transpose()?;
    let (message, custom) = if kind == "custom" {
        (None, Some(serde_json::from_str::<CustomEntry>(body)?))
    } else {
        (Some(serde_json::from_str::<AgentMessage>(body)?), None)
    };
    Ok(Entry {
        entry_id,
        seq,
        message,
        custom,
        origin,
        revision,
    })
}

/// One version of an entry as stored (materialized in `entries`, or in `entry_log` where `chg`
/// is the row id).
#[derive(Clone)]
struct Row {
    seq: i64,
    entry_id: String,
    kind: String,
    body: String,
    origin: Option<String>,
    revision: i64,
    chg: i64,
}

fn require_session(conn: &Connection, session_id: &str) -> std::result::Result<(), StoreError> {
    let exists: bool = conn
        .prepare_cached("SELECT 1 FROM sessions WHERE session_id = ?1")?
        .exists(params![session_id])?;
    if exists {
        Ok(())
    } else {
        Err(reject(HarnessError::not_found(format!(
            "session_id: no session '{session_id}'"
        ))))
    }
}

impl SessionStore {
    /// Creates the tables if needed.
    pub async fn open(store: Store) -> Result<SessionStore> {
        store.write(migrate).await?;
        let statuses = store.shared::<StatusLog>();
        let hooked = store.shared::<FoldsEntries>();
        if !hooked.0.swap(true, std::sync::atomic::Ordering::SeqCst) {
            let folding = statuses.clone();
            store.on_fold(Arc::new(move |conn: &Connection, part: &FoldPart<'_>| {
                fold_part_in(conn, part)?;
                match part {
                    FoldPart::End { to } => status_log::fold_in(conn, &folding, *to),
                    _ => Ok(()),
                }
            }));
        }
        let log = store.shared::<ChangeLog>();
        Ok(SessionStore {
            store,
            log,
            statuses,
        })
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub(crate) fn change_log(&self) -> &Arc<ChangeLog> {
        &self.log
    }

    /// Runs `f` as a replayable write, then wakes event subscribers for the event it inserted
    /// (none: nothing changed, nobody to wake) and returns its answer.
    async fn write_notified<R, F>(&self, f: F) -> Result<R>
    where
        R: Send + 'static,
        F: FnMut(&Connection) -> std::result::Result<(R, Option<i64>), StoreError>,
        F: Send + 'static,
    {
        let (response, event) = self.store.write_replayable(f).await.map_err(lower)?;
        if let Some(id) = event {
            self.store.notify_event(id);
        }
        Ok(response)
    }

    pub async fn create(&self, req: CreateRequest) -> Result<CreateResponse> {
        let session_id = req
            .session_id
            .clone()
            .unwrap_or_else(harness_types::ids::new_session_id);
        validate_session_id(&session_id)?;
        let id = session_id.clone();
        self.store
            .write_replayable(move |conn| {
                if meta_in(conn, &id)?.is_some() {
                    return Err(reject(HarnessError::invalid_field(
                        "session_id",
                        format!("session '{id}' already exists"),
                    )));
                }
                insert_session_in(
                    conn,
                    &id,
                    req.title.as_deref(),
                    req.metadata.as_ref().unwrap_or(&json!({})),
                    req.kind.as_deref(),
                )
            })
            .await
            .map_err(lower)?;
        Ok(CreateResponse { session_id })
    }

    /// Creates the session if it does not exist; title/metadata apply only on creation.
    pub async fn ensure(&self, req: EnsureRequest) -> Result<EnsureResponse> {
        validate_session_id(&req.session_id)?;
        if let Some(meta) = self.get(&req.session_id)? {
            return Ok(EnsureResponse {
                meta,
                created: false,
            });
        }
        self.store
            .write_replayable(move |conn| {
                if let Some(meta) = meta_in_writer(conn, &req.session_id)? {
                    return Ok(EnsureResponse {
                        meta,
                        created: false,
                    });
                }
                insert_session_in(
                    conn,
                    &req.session_id,
                    req.title.as_deref(),
                    req.metadata.as_ref().unwrap_or(&json!({})),
                    req.kind.as_deref(),
                )?;
                let meta = meta_in(conn, &req.session_id)?
                    .ok_or_else(|| StoreError::Invalid("session vanished".into()))?;
                Ok(EnsureResponse {
                    meta,
                    created: true,
                })
            })
            .await
            .map_err(lower)
    }

    pub fn get(&self, session_id: &str) -> Result<Option<SessionMeta>> {
        // The overlay before the row (see `status_log.rs`).
        let pending = self.statuses.get(session_id);
        let meta = self.store.read(|conn| meta_in(conn, session_id))?;
        Ok(meta.map(|mut meta| {
            if let Some(p) = pending {
                p.apply(&mut meta);
            }
            meta
        }))
    }

    pub(crate) fn statuses(&self) -> &Arc<StatusLog> {
        &self.statuses
    }

    pub fn entry(&self, session_id: &str, entry_id: &str) -> Result<Option<Entry>> {
        self.read_merged(session_id, |conn, unfolded| {
            latest_in_reader(conn, session_id, entry_id, &unfolded)?
                .map(Row::entry)
                .transpose()
        })
    }

    /// Runs `f` in one read transaction with the session's unfolded entry versions (see
    /// [`unfolded_in`]): what the transcript holds is `entries` overlaid with them, the newer
    /// change winning.
    fn read_merged<R>(
        &self,
        session_id: &str,
        f: impl FnOnce(
            &Connection,
            std::collections::BTreeMap<i64, Row>,
        ) -> std::result::Result<R, StoreError>,
    ) -> Result<R> {
        // Taken before the snapshot starts (see `unfolded_in`).
        let ids = self.store.unfolded_session_events(session_id, 0);
        self.store
            .read(|conn| {
                conn.execute_batch("BEGIN")?;
                let unfolded = unfolded_in(conn, session_id, &ids)?;
                let out = f(conn, unfolded);
                // `Store::read` rolls back whatever is left open.
                let _ = conn.execute_batch("COMMIT");
                out
            })
            .map_err(lower)
    }

    /// Appends an entry; an existing `entry_id` is a no-op that returns the original.
    pub async fn append(&self, req: AppendRequest) -> Result<AppendResponse> {
        let prepared = PreparedAppend::new(req)?;
        let log = self.log.clone();
        self.write_notified(move |conn| prepared.run(conn, &log))
            .await
    }

    /// Replaces a message's content wholesale (and usage/stop reason when given).
    pub async fn update_message(&self, req: UpdateMessageRequest) -> Result<UpdateMessageResponse> {
        let log = self.log.clone();
        self.write_notified(move |conn| update_message_in(conn, &req, &log))
            .await
    }

    /// One page of the transcript, oldest first.
    pub fn messages(&self, req: &MessagesRequest) -> Result<MessagesResponse> {
        let limit = page_limit(req.limit)?;
        let after_seq: i64 = match &req.cursor {
            Some(c) => c.parse().map_err(|_| {
                HarnessError::invalid_field(
                    "cursor",
                    format!("not a cursor from this store: '{c}'"),
                )
            })?,
            None => 0,
        };
        let page = self.read_merged(&req.session_id, |conn, unfolded| {
            require_session(conn, &req.session_id)?;
            let mut floor = after_seq;
            if let Some(after) = &req.after_entry_id {
                let seq = latest_in_reader(conn, &req.session_id, after, &unfolded)?
                    .map(|r| r.seq)
                    .ok_or_else(|| {
                        reject(HarnessError::not_found(format!(
                            "after_entry_id: no entry '{after}' in session '{}'",
                            req.session_id
                        )))
                    })?;
                floor = floor.max(seq);
            }
            let sql = if req.include_custom {
                "SELECT seq, entry_id, kind, body, origin, revision, chg FROM entries
                 WHERE session_id = ?1 AND seq > ?2 ORDER BY seq"
            } else {
                "SELECT seq, entry_id, kind, body, origin, revision, chg FROM entries
                 WHERE session_id = ?1 AND seq > ?2 AND kind = 'message' ORDER BY seq"
            };
            // The page is cut here (the overlay below may replace rows); the rows stream in
            // index order, so nothing past the page is read.
            let mut stmt = conn.prepare_cached(sql)?;
            let rows = stmt.query_map(params![req.session_id, floor], row)?;
            // The first `limit + 1` of the overlay are among the first `limit + 1` rows of
            // `entries` and the unfolded versions (an unfolded version replaces a row, or
            // comes after them all).
            let mut merged = std::collections::BTreeMap::new();
            for r in rows.take(limit as usize + 1) {
                let r = r?;
                merged.insert(r.seq, r);
            }
            for (seq, r) in unfolded {
                if seq <= floor || (!req.include_custom && r.kind != "message") {
                    continue;
                }
                let old = merged.remove(&seq);
                if let Some(r) = newer(old, Some(r)) {
                    merged.insert(seq, r);
                }
            }
            merged
                .into_values()
                .take(limit as usize + 1)
                .map(Row::entry)
                .collect::<std::result::Result<Vec<_>, _>>()
        })?;
        let mut messages = page;
        let next_cursor = if messages.len() > limit as usize {
            messages.truncate(limit as usize);
            messages.last().map(|e| e.seq.to_string())
        } else {
            None
        };
        Ok(MessagesResponse {
            messages,
            next_cursor,
        })
    }

    /// The entries appended or updated after change mark `after` (see [`ChangesRequest`]).
    pub fn changes(&self, req: &ChangesRequest) -> Result<ChangesResponse> {
        let limit = page_limit(req.limit)?;
        let after = req.after.unwrap_or(i64::MIN);
        if let Some(answer) = self.log.read(&req.session_id, after, limit as usize) {
            return Ok(answer);
        }
        let mut rows = if after >= 0 {
            self.changed_after_mark(&req.session_id, after, limit as usize)?
        } else {
            self.changed_from_start(&req.session_id, after, limit)?
        };
        let more = rows.len() > limit as usize;
        rows.truncate(limit as usize);
        let mark = rows.last().map_or(after, |(chg, _)| *chg);
        if !more {
            // Every change up to `mark` was read: later ones will be published to the log.
            self.log.open(&req.session_id, mark);
        }
        Ok(ChangesResponse {
            entries: rows.into_iter().map(|(_, e)| e).collect(),
            mark,
            more,
        })
    }

    /// Up to `limit + 1` entries changed after mark `after` (≥ 0), by change mark, found from
    /// the session's events, each counting only if it is its entry's latest change. The events are
    /// read before the entries:
    /// an entry changed again in between is left out here, and its newer change, above every
    /// mark answered now, is found from the answer's mark.
    fn changed_after_mark(
        &self,
        session_id: &str,
        after: i64,
        limit: usize,
    ) -> Result<Vec<(i64, Entry)>> {
        let mut out = Vec::new();
        let mut cursor = after;
        loop {
            let events = self
                .store
                .events_after(session_id, cursor, CHANGE_EVENT_PAGE)?;
            let last_page = events.len() < CHANGE_EVENT_PAGE;
            if let Some(last) = events.last() {
                cursor = last.id;
            }
            let named: Vec<(i64, String)> = events
                .into_iter()
                .filter(|e| e.topic == topics::MESSAGE_ADDED || e.topic == topics::MESSAGE_UPDATED)
                .filter_map(|e| Some((e.id, e.payload.get("entry_id")?.as_str()?.to_string())))
                .collect();
            self.read_merged(session_id, |conn, unfolded| {
                for (id, entry_id) in named {
                    if out.len() > limit {
                        break;
                    }
                    let latest = latest_in_reader(conn, session_id, &entry_id, &unfolded)?;
                    if let Some(r) = latest.filter(|r| r.chg == id) {
                        out.push((id, r.entry()?));
                    }
                }
                Ok(())
            })?;
            out = latest_per_entry(out);
            if out.len() > limit || last_page {
                break;
            }
        }
        // An entry proves its session exists (see `PreparedAppend::run`): the session is
        // looked up only when there is none, to tell "nothing new" from "no such session".
        if out.is_empty() {
            self.store
                .read(|conn| require_session(conn, session_id))
                .map_err(lower)?;
        }
        Ok(out)
    }

    /// Up to `limit + 1` entries with a change mark above `after` (< 0: from the start), by
    /// change mark: the whole transcript is the answer anyway, scanned in key order.
    fn changed_from_start(
        &self,
        session_id: &str,
        after: i64,
        limit: u32,
    ) -> Result<Vec<(i64, Entry)>> {
        self.read_merged(session_id, |conn, unfolded| {
            // The page is cut here, not by a bound LIMIT (see `messages`). An unfolded
            // version moves its entry later in change order, so as many more rows are read
            // as there are unfolded versions.
            let mut stmt = conn.prepare_cached(CHANGES_FROM_START)?;
            let rows = stmt.query_map(params![session_id, after], row)?;
            let mut by_seq = std::collections::BTreeMap::new();
            for r in rows.take(limit as usize + 1 + unfolded.len()) {
                let r = r?;
                by_seq.insert(r.seq, r);
            }
            for (seq, r) in unfolded {
                if r.chg <= after {
                    continue;
                }
                let old = by_seq.remove(&seq);
                if let Some(r) = newer(old, Some(r)) {
                    by_seq.insert(seq, r);
                }
            }
            let mut rows: Vec<Row> = by_seq.into_values().collect();
            rows.sort_by_key(|r| r.chg);
            let mut out = Vec::new();
            for r in rows.into_iter().take(limit as usize + 1) {
                out.push((r.chg, r.entry()?));
            }
            // An entry proves its session exists (see `PreparedAppend::run`): the session
            // is looked up only when there is none, to tell "nothing new" from "no such".
            if out.is_empty() {
                require_session(conn, session_id)?;
            }
            Ok(out)
        })
    }

    /// Every entry of a session, paging internally.
    pub fn all_entries(&self, session_id: &str, include_custom: bool) -> Result<Vec<Entry>> {
        let mut out = Vec::new();
        let mut cursor = None;
        loop {
            let page = self.messages(&MessagesRequest {
                session_id: session_id.to_string(),
                include_custom,
                limit: Some(MAX_PAGE),
                cursor,
                after_entry_id: None,
            })?;
            out.extend(page.messages);
            match page.next_cursor {
                Some(c) => cursor = Some(c),
                None => return Ok(out),
            }
        }
    }

    /// Sets the coarse status; the same status and reason again changes nothing and fires nothing.
    pub async fn set_status(&self, req: SetStatusRequest) -> Result<SetStatusResponse> {
        // Most calls repeat the current status: answer those from a reader, without a write.
        if let Some(meta) = self.get(&req.session_id)? {
            if meta.status == req.status && meta.status_reason == req.reason {
                return Ok(SetStatusResponse { changed: false });
            }
        }
        let statuses = self.statuses.clone();
        self.write_notified(move |conn| set_status_in(conn, &req, &statuses))
            .await
    }

    /// Deletes a session and every entry of it in one transaction; `deleted` is false when
    /// there was no such session, so a repeated delete (a redelivered deletion step) is a no-op.
    /// The session's events stay in the log: they are history, and a reader resuming the event
    /// stream must not find a hole.
    pub async fn delete(&self, req: DeleteRequest) -> Result<DeleteResponse> {
        let log = self.log.clone();
        let statuses = self.statuses.clone();
        self.write_notified(move |conn| {
            if meta_in(conn, &req.session_id)?.is_none() {
                return Ok((DeleteResponse { deleted: false }, None));
            }
            conn.prepare_cached("DELETE FROM entries WHERE session_id = ?1")?
                .execute(params![req.session_id])?;
            // The log is short (it is emptied by every fold): scanned, not indexed.
            conn.prepare_cached("DELETE FROM entry_log WHERE session_id = ?1")?
                .execute(params![req.session_id])?;
            forget_session(&req.session_id)?;
            conn.prepare_cached("DELETE FROM sessions WHERE session_id = ?1")?
                .execute(params![req.session_id])?;
            status_log::forget_in(&statuses, &req.session_id)?;
            let event = insert_event_in(
                conn,
                Some(&req.session_id),
                topics::DELETED,
                &json!({"session_id": req.session_id}),
                None,
            )?;
            // Without an event id the mark is every change ever made (no log reopens
            // on what the delete removed).
            log.publish_delete(&req.session_id, event.unwrap_or(i64::MAX));
            Ok((DeleteResponse { deleted: true }, event))
        })
        .await
    }

    pub fn list(&self, req: &ListRequest) -> Result<ListResponse> {
        let limit = req.limit.unwrap_or(100).clamp(1, MAX_PAGE);
        let after = req.cursor.clone().unwrap_or_default();
        let ids: Vec<String> = self.store.read(|conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT session_id FROM sessions WHERE session_id > ?1 ORDER BY session_id",
            )?;
            // The page is cut here, not by a bound LIMIT (see `messages`).
            let rows = stmt.query_map(params![after], |r| r.get::<_, String>(0))?;
            Ok(rows
                .take(limit as usize + 1)
                .collect::<std::result::Result<Vec<_>, _>>()?)
        })?;
        let mut sessions = Vec::new();
        for id in ids.iter().take(limit as usize) {
            if let Some(meta) = self.get(id)? {
                sessions.push(meta);
            }
        }
        let children = self.store.read(children_in)?;
        // Every session whose entries the summaries read: the page's and their sub-agents'.
        let mut unfolded_ids = HashMap::new();
        let mut queue: Vec<String> = sessions.iter().map(|m| m.session_id.clone()).collect();
        while let Some(s) = queue.pop() {
            if unfolded_ids.contains_key(&s) {
                continue;
            }
            if let Some(c) = children.get(&s) {
                queue.extend(c.iter().cloned());
            }
            let ids = self.store.unfolded_session_events(&s, 0);
            unfolded_ids.insert(s, ids);
        }
        // One snapshot, begun after the unfolded ids were taken (see `unfolded_in`).
        self.store.read(|conn| {
            conn.execute_batch("BEGIN")?;
            let out = list_summaries(conn, &mut sessions, &children, &unfolded_ids);
            let _ = conn.execute_batch("COMMIT");
            out
        })?;
        let next_cursor = (ids.len() > limit as usize)
            .then(|| sessions.last().map(|m| m.session_id.clone()))
            .flatten();
        Ok(ListResponse {
            sessions,
            next_cursor,
        })
    }
}

/// `update-message` inside a caller's write (events are inserted, subscribers not woken).
pub(crate) fn update_message_in(
    conn: &Connection,
    req: &UpdateMessageRequest,
    log: &Arc<ChangeLog>,
) -> std::result::Result<(UpdateMessageResponse, Option<i64>), StoreError> {
    let Some(entry) = latest_in_writer(conn, &req.session_id, &req.entry_id)? else {
        // Only now the session: an entry found proves it exists (see `PreparedAppend::run`).
        require_session(conn, &req.session_id)?;
        return Err(reject(HarnessError::not_found(format!(
            "entry_id: no entry '{}' in session '{}'",
            req.entry_id, req.session_id
        ))));
    };
    let seq = entry.seq;
    let entry = entry.entry()?;
    if let Some(expected) = req.expected_revision {
        if expected != entry.revision {
            return Ok((
                UpdateMessageResponse {
                    updated: false,
                    revision: entry.revision,
                },
                None,
            ));
        }
    }
    let mut message = entry.message.ok_or_else(|| {
        reject(HarnessError::invalid_field(
            "entry_id",
            format!("entry '{}' is a custom record, not a message", req.entry_id),
        ))
    })?;
    apply_update(&mut message, req).map_err(reject)?;
    let revision = entry.revision + 1;
    let origin = match (entry.origin, req.origin.clone()) {
        (Some(Value::Object(mut old)), Some(Value::Object(new))) => {
            old.extend(new);
            Some(Value::Object(old))
        }
        (old, new) => new.or(old),
    };
    let chg = change_event(
        conn,
        &req.session_id,
        topics::MESSAGE_UPDATED,
        &json!({"session_id": req.session_id, "entry_id": req.entry_id, "revision": revision}),
    )?;
    log_entry_in(
        conn,
        chg,
        &req.session_id,
        seq,
        &req.entry_id,
        "message",
        &serde_json::to_string(&message)?,
        origin.as_ref().map(|o| o.to_string()).as_deref(),
        revision,
    )?;
    log.publish(&req.session_id, chg, || Entry {
        entry_id: req.entry_id.clone(),
        seq: entry.seq,
        message: Some(message),
        custom: None,
        origin,
        revision,
    });
    Ok((
        UpdateMessageResponse {
            updated: true,
            revision,
        },
        Some(chg),
    ))
}

/// `set-status` inside a caller's write (events are inserted, subscribers not woken). The row
/// is left to the fold (`status_log.rs`): the change is the event and the writer's TEMP row.
pub(crate) fn set_status_in(
    conn: &Connection,
    req: &SetStatusRequest,
    statuses: &Arc<StatusLog>,
) -> std::result::Result<(SetStatusResponse, Option<i64>), StoreError> {
    let Some((status, reason)) = status_log::current_in_writer(conn, &req.session_id)? else {
        require_session(conn, &req.session_id)?;
        return Ok((SetStatusResponse { changed: false }, None));
    };
    if status == req.status && reason == req.reason {
        return Ok((SetStatusResponse { changed: false }, None));
    }
    let event = insert_event_in(
        conn,
        Some(&req.session_id),
        topics::STATUS_CHANGED,
        &json!({"session_id": req.session_id, "status": req.status, "reason": req.reason}),
        None,
    )?;
    status_log::record(
        statuses,
        &req.session_id,
        req.status,
        req.reason.as_deref(),
        now_ms(),
    )?;
    Ok((SetStatusResponse { changed: true }, event))
}

fn validate_session_id(id: &str) -> std::result::Result<(), HarnessError> {
    if id.is_empty() || id.len() > 256 || id.chars().any(|c| c.is_control()) {
        return Err(HarnessError::invalid_field(
            "session_id",
            "must be 1 to 256 characters with no control characters",
        ));
    }
    Ok(())
}

fn apply_update(
    message: &mut AgentMessage,
    req: &UpdateMessageRequest,
) -> std::result::Result<(), HarnessError> {
    match message {
        AgentMessage::Assistant(m) => {
            m.content = req.content.clone();
            if let Some(usage) = &req.usage {
                m.usage = Some(usage.clone());
            }
            if let Some(stop) = req.stop_reason {
                m.stop_reason = stop;
            }
            if let Some(details) = &req.details {
                if let Some(kind) = details.get("error_kind") {
                    m.error_kind = serde_json::from_value(kind.clone()).ok();
                }
                if let Some(msg) = details.get("error_message").and_then(Value::as_str) {
                    m.error_message = Some(msg.to_string());
                }
                if let Some(native) = details.get("native_stop_reason").and_then(Value::as_str) {
                    m.native_stop_reason = Some(native.to_string());
                }
            }
        }
        AgentMessage::User(m) => m.content = req.content.clone(),
        AgentMessage::Custom(m) => m.content = req.content.clone(),
        AgentMessage::FunctionResult(m) => {
            m.content = req.content.clone();
            if let Some(details) = &req.details {
                m.details = details.clone();
            }
        }
    }
    Ok(())
}

/// A store in `dir` with one session, `s`, for the writer's tests.
#[cfg(test)]
async fn store_with_session(dir: &std::path::Path) -> (Store, SessionStore) {
    let store = Store::open(&dir.join("s.db"), harness_store::Durability::Normal).unwrap();
    let sessions = SessionStore::open(store.clone()).await.unwrap();
    sessions
        .create(CreateRequest {
            session_id: Some("s".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    (store, sessions)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str, seq: i64) -> Entry {
        Entry {
            entry_id: id.into(),
            seq,
            message: None,
            custom: None,
            origin: None,
            revision: 0,
        }
    }

    /// An entry found on two pages (changed again between their reads) is answered once, at
    /// its later change; the others keep their order.
    #[test]
    fn an_entry_changed_between_two_pages_is_answered_once_at_its_latest() {
        let changes = vec![
            (10, entry("a", 1)),
            (11, entry("b", 2)),
            (12, entry("c", 3)),
            (20, entry("a", 1)),
        ];
        let got: Vec<(i64, String)> = latest_per_entry(changes)
            .into_iter()
            .map(|(chg, e)| (chg, e.entry_id))
            .collect();
        assert_eq!(
            got,
            vec![(11, "b".into()), (12, "c".into()), (20, "a".into())]
        );
    }
}
