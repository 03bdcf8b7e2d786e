//! A session's status, kept off its `sessions` row between folds. Every step sets the status
//! twice (working, then done), and an `UPDATE` of the row dirtied a leaf of `sessions` in
//! almost every commit (1.2 WAL pages a commit at 200 busy sessions). The change is recorded
//! by the event `set-status` inserts anyway; the row catches up in the store's fold.
//!
//! * **The writer** keeps the latest unfolded status of each session in its own thread's
//!   memory: it writes no WAL page, yet every change registers its undo with
//!   [`harness_store::on_rollback`], so it rolls back with the batch and its savepoints, and a
//!   `set-status` later in the same batch compares against it. (It was a TEMP table: looking a
//!   status up and recording one there cost ~4 % of the writer's time.)
//! * **Readers** overlay the row with [`StatusLog`], the latest *committed* unfolded status of
//!   each session, filled after each COMMIT (before the write is answered) and emptied after
//!   the fold that wrote those statuses into the rows commits. A reader takes the overlay
//!   before it reads the row: the overlay it took is never older than the row it then reads
//!   was when it took it. (A read racing a delete and a create again under the same id can
//!   put the deleted session's last status on the new row, once.)
//! * **A killed process** leaves its unfolded statuses only in the events. `status_fold`
//!   holds the event id up to which the rows are complete; at open, the latest status event
//!   of each session above it is written into its row (unless the session was deleted after
//!   it), and the mark moves to the log's end.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use harness_store::{last_event_id_in, latest_by_session_in, StoreError};
use harness_types::session::{SessionMeta, SessionStatus};
use rusqlite::{params, Connection, OptionalExtension};

use super::{parse_status, status_str};
use crate::topics;

/// The fold's own mark (one row), in the database.
pub(super) const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS status_fold (
    name TEXT PRIMARY KEY,
    upto INTEGER NOT NULL
) WITHOUT ROWID;
";

std::thread_local! {
    /// The writer's unfolded statuses, by session (see the module docs).
    static WRITER_PENDING: RefCell<HashMap<String, Pending>> = RefCell::new(HashMap::new());
}

/// Changes the writer's unfolded statuses and registers how to put them back; off a writer
/// thread (where nothing could undo it) the change is undone at once and refused.
fn change_pending(
    change: impl FnOnce(&mut HashMap<String, Pending>) -> Box<dyn FnOnce(&mut HashMap<String, Pending>)>,
) -> Result<(), StoreError> {
    let undo = WRITER_PENDING.with(|p| change(&mut p.borrow_mut()));
    let undo = move || WRITER_PENDING.with(|p| undo(&mut p.borrow_mut()));
    harness_store::on_rollback(undo).map_err(|undo| {
        undo();
        StoreError::Invalid("statuses are written by the store's writer only".into())
    })
}

/// Sets (or, None, forgets) the writer's unfolded status of one session.
fn set_pending(session_id: &str, pending: Option<Pending>) -> Result<(), StoreError> {
    change_pending(|map| {
        let before = match pending {
            Some(p) => map.insert(session_id.to_string(), p),
            None => map.remove(session_id),
        };
        let session_id = session_id.to_string();
        Box::new(move |map| match before {
            Some(p) => {
                map.insert(session_id, p);
            }
            None => {
                map.remove(&session_id);
            }
        })
    })
}

/// A status not yet in its session's row.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Pending {
    pub(crate) status: SessionStatus,
    pub(crate) reason: Option<String>,
    pub(crate) updated_at: i64,
}

impl Pending {
    /// Puts this status on `meta`, read from its row.
    pub(crate) fn apply(self, meta: &mut SessionMeta) {
        meta.status = self.status;
        meta.status_reason = self.reason;
        meta.updated_at = meta.updated_at.max(self.updated_at);
    }
}

/// The readers' overlay (see the module docs); one per store.
#[derive(Default)]
pub(crate) struct StatusLog {
    pending: Mutex<HashMap<String, Pending>>,
}

impl StatusLog {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Pending>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The latest committed status of `session_id` that its row does not hold yet.
    pub(crate) fn get(&self, session_id: &str) -> Option<Pending> {
        self.lock().get(session_id).cloned()
    }

    /// After the COMMIT of a write that changed the status (on the writer thread).
    fn publish(self: &Arc<Self>, session_id: &str, pending: Option<Pending>) {
        let log = self.clone();
        let session = session_id.to_string();
        let queued = harness_store::after_commit(move || {
            let mut map = log.lock();
            match pending {
                Some(p) => map.insert(session, p),
                None => map.remove(&session),
            };
        });
        debug_assert!(queued, "statuses are written by the store's writer only");
    }
}

/// The status the writer sees for `session_id` inside its transaction: its unfolded one, or
/// the row's (None: no such session).
pub(super) fn current_in_writer(
    conn: &Connection,
    session_id: &str,
) -> Result<Option<(SessionStatus, Option<String>)>, StoreError> {
    if let Some(p) = pending_in_writer(session_id) {
        return Ok(Some((p.status, p.reason)));
    }
    Ok(conn
        .prepare_cached("SELECT status, status_reason FROM sessions WHERE session_id = ?1")?
        .query_row([session_id], |r| {
            Ok((parse_status(&r.get::<_, String>(0)?), r.get(1)?))
        })
        .optional()?)
}

/// The writer's unfolded status of `session_id`, inside its transaction.
pub(super) fn pending_in_writer(session_id: &str) -> Option<Pending> {
    WRITER_PENDING.with(|p| p.borrow().get(session_id).cloned())
}

/// Records a status change inside the writer's transaction (its event is the caller's).
pub(super) fn record(
    log: &Arc<StatusLog>,
    session_id: &str,
    status: SessionStatus,
    reason: Option<&str>,
    updated_at: i64,
) -> Result<(), StoreError> {
    let pending = Pending {
        status,
        reason: reason.map(str::to_string),
        updated_at,
    };
    set_pending(session_id, Some(pending.clone()))?;
    log.publish(session_id, Some(pending));
    Ok(())
}

/// Forgets a deleted session's unfolded status, inside the delete's transaction.
pub(super) fn forget_in(log: &Arc<StatusLog>, session_id: &str) -> Result<(), StoreError> {
    set_pending(session_id, None)?;
    log.publish(session_id, None);
    Ok(())
}

/// The store's fold: the unfolded statuses into their rows, the mark to `upto`, and, once
/// that commits, the readers' overlay emptied (every status in it is in a row by then: the
/// writer alone fills it, and not during the fold's own transaction).
pub(super) fn fold_in(
    conn: &Connection,
    log: &Arc<StatusLog>,
    upto: i64,
) -> Result<(), StoreError> {
    // Every unfolded status into its row, in key order, and the writer's map starts over.
    let mut folded = Vec::new();
    change_pending(|map| {
        folded = map.iter().map(|(s, p)| (s.clone(), p.clone())).collect();
        let all = std::mem::take(map);
        Box::new(move |map| *map = all)
    })?;
    folded.sort_by(|a, b| a.0.cmp(&b.0));
    let mut update = conn.prepare_cached(UPDATE_ROW)?;
    for (session_id, p) in folded {
        update.execute(params![
            session_id,
            status_str(p.status),
            p.reason,
            p.updated_at
        ])?;
    }
    set_mark(conn, upto)?;
    let log = log.clone();
    let queued = harness_store::after_commit(move || log.lock().clear());
    debug_assert!(queued, "statuses are folded by the store's writer only");
    Ok(())
}

/// A session's status into its row.
const UPDATE_ROW: &str = "UPDATE sessions SET status = ?2, status_reason = ?3,
    updated_at = MAX(updated_at, ?4) WHERE session_id = ?1";

fn set_mark(conn: &Connection, upto: i64) -> Result<(), StoreError> {
    conn.prepare_cached("INSERT OR REPLACE INTO status_fold (name, upto) VALUES ('status', ?1)")?
        .execute([upto])?;
    Ok(())
}

/// At open, before anything reads a status: what a killed process committed after its last
/// fold, from the events, into the rows.
pub(super) fn recover_in(conn: &Connection) -> Result<(), StoreError> {
    let mark: Option<i64> = conn
        .query_row(
            "SELECT upto FROM status_fold WHERE name = 'status'",
            [],
            |r| r.get(0),
        )
        .optional()?;
    let Some(mark) = mark else {
        // A new store, or one a version that wrote every status into its row left: the rows
        // are complete. From here on the mark is always there (set now, moved by each fold).
        return set_mark(conn, last_event_id_in(conn)?);
    };
    let (latest, upto) =
        latest_by_session_in(conn, mark, &[topics::STATUS_CHANGED, topics::DELETED])?;
    for event in latest {
        // A session deleted after its last status change is gone, or was created again after
        // the delete with the status a new session has.
        if event.topic != topics::STATUS_CHANGED {
            continue;
        }
        let Some(session_id) = event.session_id else {
            continue;
        };
        let status = event
            .payload
            .get("status")
            .and_then(|s| s.as_str())
            .map(parse_status);
        let reason = event.payload.get("reason").and_then(|r| r.as_str());
        if let Some(status) = status {
            conn.prepare_cached(UPDATE_ROW)?.execute(params![
                session_id,
                status_str(status),
                reason,
                event.at_ms
            ])?;
        }
    }
    set_mark(conn, upto)
}

#[cfg(test)]
mod writer_map {
    use super::super::{set_status_in, SessionStore};
    use harness_store::StoreError;
    use harness_types::session::*;

    /// A `set-status` whose write rolls back leaves the writer's map as it found it: readers
    /// never see the status, the same status set again is a change, and the fold writes the
    /// one that committed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rolled_back_status_is_forgotten_by_the_writer() {
        let dir = tempfile::tempdir().unwrap();
        let (store, sessions) = super::super::store_with_session(dir.path()).await;
        let set = |status| SetStatusRequest {
            session_id: "s".into(),
            status,
            reason: None,
        };
        let statuses = sessions.statuses().clone();
        let req = set(SessionStatus::Working);
        let failed = store
            .write(move |c| {
                let (answer, _) = set_status_in(c, &req, &statuses)?;
                assert!(answer.changed);
                Err::<(), _>(StoreError::Invalid("the write fails".into()))
            })
            .await;
        assert!(failed.is_err());
        let status = |s: &SessionStore| s.get("s").unwrap().unwrap().status;
        assert_eq!(status(&sessions), SessionStatus::Idle);
        let again = sessions.set_status(set(SessionStatus::Working)).await;
        assert!(again.unwrap().changed, "the rolled-back status was kept");
        store.fold_events().await.unwrap();
        assert_eq!(status(&sessions), SessionStatus::Working);
        let row: String = store
            .read(|c| {
                Ok(c.query_row(
                    "SELECT status FROM sessions WHERE session_id = 's'",
                    [],
                    |r| r.get(0),
                )?)
            })
            .unwrap();
        assert_eq!(row, "working");
    }
}
