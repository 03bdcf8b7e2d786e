//! An append: a request validated before its write (`PreparedAppend::new`) and run inside it
//! (`PreparedAppend::run`), alone (`SessionStore::append`) or in a bus commit batch with the
//! turn's other writes (`register_transactional`).

use std::sync::Arc;

use harness_store::StoreError;
use harness_types::message::AgentMessage;
use harness_types::session::*;
use harness_types::HarnessError;
use rusqlite::{params, Connection, OptionalExtension};
use serde_json::{json, Value};

use super::entry_log::*;
use super::require_session;
use crate::changes::ChangeLog;
use crate::topics;

/// A validated `append`, ready to run inside a write.
pub(crate) struct PreparedAppend {
    session_id: String,
    entry_id: String,
    kind: &'static str,
    body: String,
    origin: Option<String>,
    /// What the change log is given (see `changes.rs`).
    message: Option<AgentMessage>,
    custom: Option<CustomEntry>,
    origin_value: Option<Value>,
}

/// What an append looks up in `entries` when the writer's index of the log (see
/// `entry_log.rs`) has neither the entry nor its session: its materialized seq, and the
/// session's last.
const APPEND_LOOKUP: &str = "
SELECT (SELECT seq FROM entries WHERE session_id = ?1 AND entry_id = ?2),
       (SELECT COALESCE(MAX(seq), 0) FROM entries WHERE session_id = ?1)";

/// The same when the index has an append of the session: its seq is past every materialized
/// one (it was numbered past them, and the index keeps it until it is folded), so only the
/// entry is looked up.
const APPEND_LOOKUP_ENTRY: &str = "SELECT seq FROM entries WHERE session_id = ?1 AND entry_id = ?2";

impl PreparedAppend {
    pub(crate) fn new(req: AppendRequest) -> std::result::Result<PreparedAppend, HarnessError> {
        let (kind, body) = match (&req.message, &req.custom) {
            (Some(m), None) => (
                "message",
                serde_json::to_string(m).map_err(|e| HarnessError::internal(e.to_string()))?,
            ),
            (None, Some(c)) => (
                "custom",
                serde_json::to_string(c).map_err(|e| HarnessError::internal(e.to_string()))?,
            ),
            (Some(_), Some(_)) => {
                return Err(HarnessError::invalid_field(
                    "message",
                    "give either message or custom, not both",
                ))
            }
            (None, None) => {
                return Err(HarnessError::invalid_field(
                    "message",
                    "required (or custom)",
                ))
            }
        };
        let entry_id = req
            .entry_id
            .clone()
            .unwrap_or_else(harness_types::ids::new_entry_id);
        if entry_id.is_empty() {
            return Err(HarnessError::invalid_field("entry_id", "must not be empty"));
        }
        Ok(PreparedAppend {
            origin: req.origin.as_ref().map(|o| o.to_string()),
            session_id: req.session_id,
            entry_id,
            kind,
            body,
            message: req.message,
            custom: req.custom,
            origin_value: req.origin,
        })
    }

    /// Inside a caller's write (events are inserted, subscribers not woken).
    /// Returns the answer and the id of the event it inserted (None: the entry existed).
    pub(crate) fn run(
        &self,
        conn: &Connection,
        log: &Arc<ChangeLog>,
    ) -> std::result::Result<(AppendResponse, Option<i64>), StoreError> {
        let PreparedAppend {
            session_id,
            entry_id,
            kind,
            body,
            origin,
            ..
        } = self;
        // Entries never outlive their session (`delete` removes both in one write), so an
        // entry found, or a session with entries, proves the session exists: the check runs
        // only for a session's first entry.
        // The entry's seq if it exists (an entry keeps its seq in every version, logged or
        // materialized), and the session's last seq, materialized and logged: the next is past
        // both. A logged entry needs no statement; otherwise one looks up the entry in
        // `entries`, and the session's last seq there only when the index has none of it
        // (each part walks one index).
        let (logged, last_logged) = writer_tail(session_id, entry_id);
        let (found, materialized) = match logged {
            Some(at) => (Some(at.seq), 0),
            None if last_logged > 0 => (
                conn.prepare_cached(APPEND_LOOKUP_ENTRY)?
                    .query_row(params![session_id, entry_id], |r| r.get(0))
                    .optional()?,
                0,
            ),
            None => conn
                .prepare_cached(APPEND_LOOKUP)?
                .query_row(params![session_id, entry_id], |r| {
                    Ok((r.get(0)?, r.get(1)?))
                })?,
        };
        if let Some(seq) = found {
            return Ok((
                AppendResponse {
                    entry_id: entry_id.clone(),
                    seq,
                    appended: false,
                },
                None,
            ));
        }
        let seq = materialized.max(last_logged) + 1;
        if seq == 1 {
            require_session(conn, session_id)?;
        }
        let chg = change_event(
            conn,
            session_id,
            topics::MESSAGE_ADDED,
            &json!({"session_id": session_id, "entry_id": entry_id, "seq": seq}),
        )?;
        log_entry_in(
            conn,
            chg,
            session_id,
            seq,
            entry_id,
            kind,
            body,
            origin.as_deref(),
            0,
        )?;
        log.publish(session_id, chg, || Entry {
            entry_id: entry_id.clone(),
            seq,
            message: self.message.clone(),
            custom: self.custom.clone(),
            origin: self.origin_value.clone(),
            revision: 0,
        });
        Ok((
            AppendResponse {
                entry_id: entry_id.clone(),
                seq,
                appended: true,
            },
            Some(chg),
        ))
    }
}

#[cfg(test)]
mod writer_index {
    use super::*;
    use harness_types::message::{AgentMessage, ContentBlock, UserMessage};

    fn prepared(entry_id: &str) -> PreparedAppend {
        PreparedAppend::new(AppendRequest {
            session_id: "s".into(),
            message: Some(AgentMessage::User(UserMessage {
                content: vec![ContentBlock::text(entry_id)],
                timestamp: 0,
            })),
            custom: None,
            entry_id: Some(entry_id.into()),
            origin: None,
        })
        .unwrap()
    }

    /// An append whose write rolls back (a failing replayable write, its run's other writes
    /// rolled back and run again, a failing once write) leaves the writer's index of the log
    /// as it found it: its entry is neither found nor counted by the appends after it in the
    /// same batch, and can be appended again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_writes_append_is_forgotten_by_the_writers_index() {
        let dir = tempfile::tempdir().unwrap();
        let (store, sessions) = super::super::store_with_session(dir.path()).await;
        let first = prepared("e1");
        let log = sessions.change_log().clone();
        store.write(move |c| first.run(c, &log)).await.unwrap();

        // Holds the writer until every write below is queued, so they share the next batch.
        let (release, held) = std::sync::mpsc::channel::<()>();
        let hold = tokio::spawn({
            let store = store.clone();
            async move {
                store
                    .write(move |_| {
                        let _ = held.recv_timeout(std::time::Duration::from_secs(10));
                        Ok(())
                    })
                    .await
            }
        });
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let commits = store.stats().commits;
        let append = |entry_id: &'static str, fail: bool, replayable: bool| {
            let store = store.clone();
            let log = sessions.change_log().clone();
            let prepared = prepared(entry_id);
            let run = move |c: &Connection| {
                let (answer, _) = prepared.run(c, &log)?;
                if fail {
                    return Err(StoreError::Invalid(format!("{entry_id} fails")));
                }
                Ok(answer)
            };
            let task = tokio::spawn(async move {
                if replayable {
                    store.write_replayable(run).await
                } else {
                    store.write(run).await
                }
            });
            // In this order in the queue.
            std::thread::sleep(std::time::Duration::from_millis(20));
            task
        };
        let rerun = append("e2", false, true);
        let failed = append("e3", true, true);
        let once_failed = append("e4", true, false);
        let after = append("e5", false, true);
        release.send(()).unwrap();
        hold.await.unwrap().unwrap();
        let rerun = rerun.await.unwrap().unwrap();
        assert!(failed.await.unwrap().is_err());
        assert!(once_failed.await.unwrap().is_err());
        let after = after.await.unwrap().unwrap();
        // The held write's batch commits alone (it outlasted a batch's time), then the
        // queued appends' batch.
        assert_eq!(
            store.stats().commits,
            commits + 2,
            "the appends in one batch"
        );

        assert!(
            rerun.appended,
            "run again after its run rolled back: {rerun:?}"
        );
        assert_eq!(rerun.seq, 2);
        assert!(after.appended);
        assert_eq!(after.seq, 3, "the failed appends are not counted");
        for gone in ["e3", "e4"] {
            assert!(sessions.entry("s", gone).unwrap().is_none(), "{gone}");
        }
        assert_eq!(sessions.entry("s", "e2").unwrap().unwrap().seq, 2);
        let again = sessions.append(AppendRequest {
            session_id: "s".into(),
            message: Some(AgentMessage::User(UserMessage {
                content: vec![ContentBlock::text("e3")],
                timestamp: 0,
            })),
            custom: None,
            entry_id: Some("e3".into()),
            origin: None,
        });
        let again = again.await.unwrap();
        assert!(again.appended);
        assert_eq!(again.seq, 4);
    }
}
