//! The transcript's append-only entry log: an append or update writes the entry's new version
//! here (its row id is the change event's id) instead of rewriting the session's leaf of
//! `entries`; the store's fold brings the latest versions into `entries` (in parts, see
//! [`fold_part_in`]). Readers
//! and the writer find a version not yet folded through this module.

use harness_store::{insert_event_in, FoldPart, StoreError};
use harness_types::session::*;
use rusqlite::{params, Connection, OptionalExtension};
use serde_json::Value;
use std::cell::RefCell;
use std::collections::HashMap;

use super::{entry_from_row, Row};

/// The writer's index of `entry_log`: where each session's logged entries are, and its last
/// seq. It lives in the writer thread's memory (readers do not need it: they find a session's
/// log rows from the store's unfolded event ids) and follows the writer's transaction: every
/// change registers its undo with [`harness_store::on_rollback`], so a write that rolls back
/// leaves it as it found it, and an append sees the entries appended before it in the same
/// batch. It was a TEMP table: an append's lookup through it and its index row cost ~7 % of
/// the writer's time.
#[derive(Default)]
struct SessionTail {
    /// The seq of the last append logged here (0: none, only updates): every seq the session
    /// has, logged or materialized, is at or below it, as the append was numbered past them
    /// all. An update of an older entry does not raise it.
    last_seq: i64,
    entries: HashMap<String, Logged>,
}

/// Where an entry's latest logged version is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Logged {
    pub(super) seq: i64,
    /// Its row in `entry_log` (the change event's id).
    pub(super) id: i64,
}

thread_local! {
    static LOG_INDEX: RefCell<HashMap<String, SessionTail>> = RefCell::new(HashMap::new());
}

/// How to put the writer's index back as a change found it.
type Undo = Box<dyn FnOnce(&mut HashMap<String, SessionTail>)>;

/// Changes the writer's index and registers how to put it back; off a writer thread (where
/// nothing could undo it) the change is undone at once and refused.
fn change_tail(
    change: impl FnOnce(&mut HashMap<String, SessionTail>) -> Undo,
) -> std::result::Result<(), StoreError> {
    let undo = LOG_INDEX.with(|t| change(&mut t.borrow_mut()));
    let undo = move || LOG_INDEX.with(|t| undo(&mut t.borrow_mut()));
    harness_store::on_rollback(undo).map_err(|undo| {
        undo();
        StoreError::Invalid(
            "the entry log's index is kept on the store's writer thread only".into(),
        )
    })
}

/// An entry's latest logged version and its session's last logged seq (0: none), as the
/// writer sees them inside its transaction.
pub(super) fn writer_tail(session_id: &str, entry_id: &str) -> (Option<Logged>, i64) {
    LOG_INDEX.with(|t| {
        t.borrow().get(session_id).map_or((None, 0), |s| {
            (s.entries.get(entry_id).copied(), s.last_seq)
        })
    })
}

/// Records a version just written to the log (an append's or an update's) in the writer's
/// index.
fn index_version(
    session_id: &str,
    entry_id: &str,
    at: Logged,
    append: bool,
) -> std::result::Result<(), StoreError> {
    change_tail(|tail| {
        let new_session = !tail.contains_key(session_id);
        let session = tail.entry(session_id.to_string()).or_default();
        let last_seq = session.last_seq;
        if append {
            session.last_seq = last_seq.max(at.seq);
        }
        let before = session.entries.insert(entry_id.to_string(), at);
        let (session_id, entry_id) = (session_id.to_string(), entry_id.to_string());
        Box::new(move |tail| {
            if new_session {
                tail.remove(&session_id);
            } else if let Some(session) = tail.get_mut(&session_id) {
                session.last_seq = last_seq;
                match before {
                    Some(before) => {
                        session.entries.insert(entry_id, before);
                    }
                    None => {
                        session.entries.remove(&entry_id);
                    }
                }
            }
        })
    })
}

/// Forgets a deleted session's logged entries.
pub(super) fn forget_session(session_id: &str) -> std::result::Result<(), StoreError> {
    change_tail(|tail| {
        let removed = tail.remove_entry(session_id);
        Box::new(move |tail| {
            if let Some((id, session)) = removed {
                tail.insert(id, session);
            }
        })
    })
}

/// The log was folded into `entries`: the index starts over.
fn forget_all() -> std::result::Result<(), StoreError> {
    change_tail(|tail| {
        let all = std::mem::take(tail);
        Box::new(move |tail| *tail = all)
    })
}

/// The log's versions up to `to` were folded into `entries`: the index keeps the later ones.
/// A session with none left is forgotten (its last seq is in `entries` now).
fn forget_upto(to: i64) -> std::result::Result<(), StoreError> {
    change_tail(|tail| {
        let all = std::mem::take(tail);
        for (session_id, session) in &all {
            let entries: HashMap<String, Logged> = session
                .entries
                .iter()
                .filter(|(_, at)| at.id > to)
                .map(|(entry_id, at)| (entry_id.clone(), *at))
                .collect();
            if !entries.is_empty() {
                tail.insert(
                    session_id.clone(),
                    SessionTail {
                        last_seq: session.last_seq,
                        entries,
                    },
                );
            }
        }
        Box::new(move |tail| *tail = all)
    })
}

/// What a killed process left in the log, folded at open: the rows at or below the store's
/// fold mark are dead (folded, their sweep cut short) and go first, as an older version than
/// the row's must not replace it; then the latest version of each entry replaces the
/// materialized row, in key order, and the log starts over. `DELETE` without a condition
/// empties the table without visiting its rows.
const FOLD_WHOLE_LOG: &str = "
DELETE FROM entry_log WHERE id <= (SELECT upto FROM folds WHERE name = 'events');
INSERT OR REPLACE INTO entries (session_id, seq, entry_id, kind, body, origin, revision, chg)
    SELECT session_id, seq, entry_id, kind, body, origin, revision, MAX(id) FROM entry_log
    GROUP BY session_id, seq ORDER BY session_id, seq;
DELETE FROM entry_log;
";

/// At open, before anything reads the transcript (see [`FOLD_WHOLE_LOG`]).
pub(super) fn fold_whole_log_in(conn: &Connection) -> std::result::Result<(), StoreError> {
    conn.execute_batch(FOLD_WHOLE_LOG)?;
    forget_all()
}

/// The entries a fold brings into `entries`: the latest logged version of each, up to the
/// fold's mark (in the fold's own database, see `FoldPart::Begin`), noted as the fold collects.
const FOLD_ENTRIES: &str = "CREATE TABLE IF NOT EXISTS fold.fold_entries(
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    id INTEGER NOT NULL,
    PRIMARY KEY(session_id, seq)
) WITHOUT ROWID;
DELETE FROM fold.fold_entries;";

/// The session store's share of each part of the store's fold (see [`SessionStore::open`] and
/// `FoldPart`): the entries' latest versions up to the fold's mark are noted as the fold
/// collects, replace their materialized rows one range of sessions a part, in key order (each
/// session's leaves written once a fold), and leave the log after the mark has moved.
///
/// Until the mark moves, every folded version is still in the log and readers still look it
/// up there (by the events above the old mark), and a version in the log is never older than
/// its row: the row a part wrote is the same version as the log's latest or an older one. A
/// version logged after the fold began (above its mark) stays in the log for the next fold.
/// After the mark has moved, no reader or writer looks up a version at or below it in the log
/// (they go by the events above the mark, and the writer's index forgets them), so the sweep
/// may take its time. A session deleted meanwhile lost its log rows, so the join below finds
/// nothing of it to bring back.
pub(super) fn fold_part_in(
    conn: &Connection,
    part: &FoldPart<'_>,
) -> std::result::Result<(), StoreError> {
    match part {
        FoldPart::Begin { .. } => conn.execute_batch(FOLD_ENTRIES)?,
        FoldPart::Collect { after, through } => {
            // In id order: a later version of an entry replaces the one noted before it.
            conn.prepare_cached(
                "INSERT OR REPLACE INTO fold.fold_entries(session_id, seq, id)
                 SELECT session_id, seq, id FROM entry_log WHERE id > ?1 AND id <= ?2
                 ORDER BY id",
            )?
            .execute([after, through])?;
        }
        FoldPart::Sessions {
            after,
            through: Some(through),
        } => {
            conn.prepare_cached(&format!("{FOLD_SESSIONS} AND f.session_id <= ?2"))?
                .execute(params![after, through])?;
        }
        FoldPart::Sessions {
            after,
            through: None,
        } => {
            conn.prepare_cached(FOLD_SESSIONS)?.execute([after])?;
        }
        FoldPart::End { to } => {
            conn.prepare_cached("DELETE FROM fold.fold_entries")?
                .execute([])?;
            forget_upto(*to)?;
        }
        FoldPart::Sweep { through } => {
            // From the log's start: rows a fold abandoned after its end (a full disk) went dead
            // below this fold's range, and go now (rows already gone cost nothing to skip).
            conn.prepare_cached("DELETE FROM entry_log WHERE id <= ?1")?
                .execute([through])?;
        }
    }
    Ok(())
}

/// A part's entries (see [`fold_part_in`]), from the sessions after `?1`, in key order.
const FOLD_SESSIONS: &str = "
INSERT OR REPLACE INTO entries (session_id, seq, entry_id, kind, body, origin, revision, chg)
    SELECT l.session_id, l.seq, l.entry_id, l.kind, l.body, l.origin, l.revision, l.id
    FROM fold.fold_entries f CROSS JOIN entry_log l ON l.id = f.id
    WHERE f.session_id > ?1";

/// The columns [`row`] reads, in its order; `entry_log` names its `id` as `chg`.
pub(super) const ENTRY_COLS: &str = "seq, entry_id, kind, body, origin, revision, chg";
pub(super) const LOG_COLS: &str = "seq, entry_id, kind, body, origin, revision, id";

pub(super) fn row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Row> {
    Ok(Row {
        seq: r.get(0)?,
        entry_id: r.get(1)?,
        kind: r.get(2)?,
        body: r.get(3)?,
        origin: r.get(4)?,
        revision: r.get(5)?,
        chg: r.get(6)?,
    })
}

impl Row {
    pub(super) fn entry(self) -> std::result::Result<Entry, StoreError> {
        entry_from_row(
            self.entry_id,
            self.seq,
            &self.kind,
            &self.body,
            self.origin,
            self.revision,
        )
    }
}

/// A session's entry versions not folded yet, the latest of each `seq`, read by the ids of the
/// session's unfolded events (an entry change's log row has its event's id). Inside the
/// caller's read transaction, with ids taken before it began: a fold committed since moved
/// the rows to `entries`, which the same snapshot then shows.
pub(super) fn unfolded_in(
    conn: &Connection,
    session_id: &str,
    ids: &[i64],
) -> std::result::Result<std::collections::BTreeMap<i64, Row>, StoreError> {
    let mut out = std::collections::BTreeMap::new();
    if ids.is_empty() {
        return Ok(out);
    }
    // Ids come oldest first: a later version of the same entry replaces an earlier.
    let span = (ids[0], ids[ids.len() - 1]);
    // The span's rows are mostly other sessions' when this one's ids are sparse in it (many
    // busy sessions interleaved): then looking each id up reads less than scanning the span.
    let dense = (ids.len() as i64).saturating_mul(SPARSE) > span.1 - span.0;
    if ids.len() <= POINT_LOOKUPS || !dense {
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {LOG_COLS} FROM entry_log WHERE id = ?1 AND session_id = ?2"
        ))?;
        for id in ids {
            if let Some(r) = stmt.query_row(params![id, session_id], row).optional()? {
                out.insert(r.seq, r);
            }
        }
        return Ok(out);
    }
    // Many ids, dense in their span: one scan of the span reads each page once. The session's
    // rows there are exactly those the ids name (every event of the session up to the last id
    // committed before the ids were taken).
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {LOG_COLS} FROM entry_log WHERE id >= ?1 AND id <= ?2 AND session_id = ?3
         ORDER BY id"
    ))?;
    for r in stmt.query_map(params![span.0, span.1, session_id], row)? {
        let r = r?;
        out.insert(r.seq, r);
    }
    Ok(out)
}

/// Up to this many unfolded events a session's logged versions are looked up one by one;
/// past it, by one scan of the log over their span, unless they are sparse in it.
const POINT_LOOKUPS: usize = 32;

/// A session's ids are sparse in their span when it holds more than this many ids for each of
/// them.
const SPARSE: i64 = 4;

/// The newer of two versions of an entry (by change mark).
pub(super) fn newer(a: Option<Row>, b: Option<Row>) -> Option<Row> {
    match (a, b) {
        (Some(a), Some(b)) => Some(if b.chg > a.chg { b } else { a }),
        (a, b) => a.or(b),
    }
}

/// The latest version of an entry as the writer sees it, inside its transaction: the log's
/// (through the writer's tail index) or else the materialized one.
pub(super) fn latest_in_writer(
    conn: &Connection,
    session_id: &str,
    entry_id: &str,
) -> std::result::Result<Option<Row>, StoreError> {
    if let (Some(at), _) = writer_tail(session_id, entry_id) {
        return Ok(conn
            .prepare_cached(&format!("SELECT {LOG_COLS} FROM entry_log WHERE id = ?1"))?
            .query_row([at.id], row)
            .optional()?);
    }
    materialized(conn, session_id, entry_id)
}

/// The latest version of an entry as a reader sees it (`unfolded`: from [`unfolded_in`]).
pub(super) fn latest_in_reader(
    conn: &Connection,
    session_id: &str,
    entry_id: &str,
    unfolded: &std::collections::BTreeMap<i64, Row>,
) -> std::result::Result<Option<Row>, StoreError> {
    // The latest version found in the log is never older than the materialized one: a fold
    // writes a row with a version the log keeps until the mark has moved past it, and drops
    // folded versions in id order (see `fold_part_in`).
    if let Some(r) = unfolded.values().find(|r| r.entry_id == entry_id) {
        return Ok(Some(r.clone()));
    }
    materialized(conn, session_id, entry_id)
}

/// The materialized version of an entry (`entries`), if it has one.
fn materialized(
    conn: &Connection,
    session_id: &str,
    entry_id: &str,
) -> std::result::Result<Option<Row>, StoreError> {
    Ok(conn
        .prepare_cached(&format!(
            "SELECT {ENTRY_COLS} FROM entries WHERE session_id = ?1 AND entry_id = ?2"
        ))?
        .query_row(params![session_id, entry_id], row)
        .optional()?)
}

/// Writes one version of an entry (an append or an update) to the log, where the fold will
/// find it, and to the writer's index of the log.
#[allow(clippy::too_many_arguments)]
pub(super) fn log_entry_in(
    conn: &Connection,
    chg: i64,
    session_id: &str,
    seq: i64,
    entry_id: &str,
    kind: &str,
    body: &str,
    origin: Option<&str>,
    revision: i64,
) -> std::result::Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT INTO entry_log (id, session_id, seq, entry_id, kind, body, origin, revision)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    )?
    .execute(params![
        chg, session_id, seq, entry_id, kind, body, origin, revision
    ])?;
    // An append's first version is revision 0; an update's is 1 or more.
    index_version(session_id, entry_id, Logged { seq, id: chg }, revision == 0)
}

/// Inserts the event announcing an entry change and returns its id, the entry's new change mark.
pub(super) fn change_event(
    conn: &Connection,
    session_id: &str,
    topic: &str,
    payload: &Value,
) -> std::result::Result<i64, StoreError> {
    insert_event_in(conn, Some(session_id), topic, payload, None)?
        .ok_or_else(|| StoreError::Invalid("an event without a dedupe key was not inserted".into()))
}
