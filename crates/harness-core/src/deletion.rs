//! `harness::delete-session-tree`: deleting a session and every sub-agent session under it.
//!
//! Admission is quick and durable: the operation row (state scope `harness_deletion`, one per
//! root, id `delete_<sha256 of the root id>`) and a tombstone per member (`harness_tombstone`)
//! are written, then one step goes on the `harness-session-deletion` queue. From the tombstone
//! on, no send or spawn reaches a member. The step cancels every member, waits until each turn
//! has ended, tells the surviving parent once, and deletes child-first, saving its progress after
//! each session, so a step redelivered after a crash resumes where the last one stopped and never
//! deletes twice. Work it cannot confirm (a turn that does not end in time, an approval left
//! behind) fails the attempt with the data kept; the operator retries with `attempt + 1`.
//! Tombstones are never removed: a deleted session's id is not reusable.

use std::collections::HashMap;
use std::time::Duration;

use harness_types::api::{
    DeleteTreeRequest, DeleteTreeStatusRequest, DeletionEventFilter, DeletionSnapshot,
    DeletionStatus, StopRequest,
};
use harness_types::message::AgentMessage;
use harness_types::session::{AppendRequest, DeleteRequest, DeleteResponse, SessionMeta};
use harness_types::{now_ms, ErrorCode, HarnessError};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::harness::{Harness, Result};
use crate::record::CallCheckpoint;
use crate::{topics, TURN_SCOPE};

/// The queue deletion steps run on, one operation at a time per operation id.
pub const DELETION_QUEUE: &str = "harness-session-deletion";
const OPS_SCOPE: &str = "harness_deletion";
const TOMBSTONE_SCOPE: &str = "harness_tombstone";
/// The approval gate's state scope (its rows carry the `session_id` they hold a call of).
const APPROVALS_SCOPE: &str = "approvals";
/// How long one attempt waits for the members' turns to end before it fails closed.
const ATTEMPT_DEADLINE_MS: i64 = 120_000;

/// The durable operation: what callers see plus what the step needs to resume.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Operation {
    #[serde(flatten)]
    snapshot: DeletionSnapshot,
    /// The members, children before their parents (the deletion order), fixed at admission.
    members: Vec<String>,
    /// The root's parent, told once that its sub-agent is gone.
    #[serde(default)]
    parent_session_id: Option<String>,
    /// When this attempt was admitted (its deadline starts here).
    started_at: i64,
}

/// The payload of one deletion step on the queue.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct DeletionStep {
    pub operation_id: String,
    pub attempt: u32,
}

#[derive(Debug, Serialize, Deserialize)]
struct Tombstone {
    operation_id: String,
    at: i64,
}

/// `ms` since the epoch as `YYYY-MM-DDTHH:MM:SSZ` (UTC), for messages people read.
fn utc_text(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // The civil date of a day count, by 400-year eras of 146,097 days (starting 0000-03-01,
    // so the leap day ends a year).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

pub(crate) fn operation_id(session_id: &str) -> String {
    format!(
        "delete_{}",
        harness_types::digest::sha256_hex(session_id.as_bytes())
    )
}

fn parent_of(meta: &SessionMeta) -> Option<String> {
    meta.metadata
        .get("parent_session_id")
        .and_then(Value::as_str)
        .map(str::to_string)
}

fn state_err(e: harness_bus::BusError) -> HarnessError {
    e.into_harness()
}

impl Harness {
    pub async fn delete_session_tree(&self, req: DeleteTreeRequest) -> Result<DeletionSnapshot> {
        if req.session_id.is_empty() {
            return Err(HarnessError::invalid_field(
                "session_id",
                "must not be empty",
            ));
        }
        if req.attempt == Some(0) {
            return Err(HarnessError::invalid_field("attempt", "starts at 1"));
        }
        let op_id = operation_id(&req.session_id);
        // Admissions of one root are serialized; the key cannot collide with a session id.
        let _guard = self.inner.locks.lock(&op_id).await;
        let mut op = match self.load_op(&op_id).await? {
            Some(op) => match op.snapshot.status {
                DeletionStatus::Deleting | DeletionStatus::Completed => {
                    if let Some(a) = req.attempt.filter(|a| *a != op.snapshot.attempt) {
                        return Err(HarnessError::invalid_field(
                            "attempt",
                            format!(
                                "operation {op_id} is on attempt {} ({}); attempt {a} is not it",
                                op.snapshot.attempt,
                                status_word(op.snapshot.status)
                            ),
                        ));
                    }
                    return Ok(op.snapshot);
                }
                DeletionStatus::Failed => {
                    let want = op.snapshot.attempt + 1;
                    if req.attempt != Some(want) {
                        return Err(HarnessError::invalid_field(
                            "attempt",
                            format!(
                                "attempt {} of operation {op_id} failed ({}); retry with attempt {want}",
                                op.snapshot.attempt,
                                op.snapshot.error.as_deref().unwrap_or("no reason recorded")
                            ),
                        ));
                    }
                    self.readmit(op, want).await?
                }
            },
            None => {
                if let Some(a) = req.attempt.filter(|a| *a != 1) {
                    return Err(HarnessError::invalid_field(
                        "attempt",
                        format!(
                            "no attempt of this deletion has failed, so the first is 1, not {a}"
                        ),
                    ));
                }
                self.admit(&req.session_id, op_id.clone()).await?
            }
        };
        self.save_op(&op).await?;
        self.write_tombstones(&op).await?;
        self.enqueue_deletion(&op).await?;
        self.emit_deletion(&mut op).await;
        Ok(op.snapshot)
    }

    pub async fn delete_session_tree_status(
        &self,
        req: DeleteTreeStatusRequest,
    ) -> Result<DeletionSnapshot> {
        match self.load_op(&req.operation_id).await? {
            Some(op) => Ok(op.snapshot),
            None => Err(HarnessError::not_found(format!(
                "operation_id: no deletion '{}'",
                req.operation_id
            ))),
        }
    }

    /// A first attempt: the members from the live tree, refused when a member or an ancestor
    /// is being deleted by another operation.
    async fn admit(&self, root: &str, op_id: String) -> Result<Operation> {
        let (ids, all) = self.tree_ids(root).await?;
        let mut guarded: Vec<String> = ids.iter().map(|(id, _, _)| id.clone()).collect();
        let parent = all.get(root).and_then(parent_of);
        let mut up = parent.clone();
        while let Some(p) = up.filter(|p| !guarded.contains(p)) {
            guarded.push(p.clone());
            up = all.get(&p).and_then(parent_of);
        }
        for id in &guarded {
            if let Some(t) = self.tombstone(id).await? {
                if t.operation_id == op_id {
                    continue;
                }
                let other = self.load_op(&t.operation_id).await?;
                if other.is_none_or(|o| o.snapshot.status != DeletionStatus::Failed) {
                    return Err(HarnessError::new(
                        ErrorCode::State,
                        format!(
                            "session_id: session '{id}' is already being deleted by operation {}",
                            t.operation_id
                        ),
                    ));
                }
            }
        }
        // Depth-first order puts a parent before its children; deletion goes the other way.
        let members: Vec<String> = ids.into_iter().rev().map(|(id, _, _)| id).collect();
        Ok(Operation {
            snapshot: DeletionSnapshot {
                operation_id: op_id,
                attempt: 1,
                session_id: root.to_string(),
                status: DeletionStatus::Deleting,
                deleted_session_ids: Vec::new(),
                error: None,
            },
            members,
            parent_session_id: parent,
            started_at: now_ms(),
        })
    }

    /// A retry of a failed attempt: members that still exist (the tombstones kept the tree
    /// from growing), what was deleted before kept in the snapshot.
    async fn readmit(&self, mut op: Operation, attempt: u32) -> Result<Operation> {
        op.snapshot.attempt = attempt;
        op.snapshot.status = DeletionStatus::Deleting;
        op.snapshot.error = None;
        op.started_at = now_ms();
        Ok(op)
    }

    async fn load_op(&self, op_id: &str) -> Result<Option<Operation>> {
        let v = self.state_get(OPS_SCOPE, op_id).await?;
        v.map(|v| {
            serde_json::from_value(v)
                .map_err(|e| HarnessError::state(format!("deletion {op_id} is unreadable: {e}")))
        })
        .transpose()
    }

    async fn save_op(&self, op: &Operation) -> Result<()> {
        let v = serde_json::to_value(op).map_err(|e| HarnessError::internal(e.to_string()))?;
        self.inner
            .bus
            .state_set(OPS_SCOPE, &op.snapshot.operation_id, v)
            .await
            .map_err(state_err)
    }

    async fn tombstone(&self, session_id: &str) -> Result<Option<Tombstone>> {
        let v = self.state_get(TOMBSTONE_SCOPE, session_id).await?;
        Ok(v.and_then(|v| serde_json::from_value(v).ok()))
    }

    /// Refuses a send or spawn that names a deleted (or being deleted) session.
    pub(crate) async fn refuse_tombstoned(&self, field: &str, session_id: &str) -> Result<()> {
        match self.tombstone(session_id).await? {
            None => Ok(()),
            Some(t) => Err(HarnessError::new(
                ErrorCode::SessionDeleted,
                format!(
                    "{field}: session '{session_id}' was deleted at {} (tombstone of operation {}); a deleted session's id is not reusable: send without a session_id, or with a new one",
                    utc_text(t.at),
                    t.operation_id
                ),
            )),
        }
    }

    async fn write_tombstones(&self, op: &Operation) -> Result<()> {
        for id in &op.members {
            if self
                .tombstone(id)
                .await?
                .is_some_and(|t| t.operation_id == op.snapshot.operation_id)
            {
                continue;
            }
            let t = serde_json::to_value(Tombstone {
                operation_id: op.snapshot.operation_id.clone(),
                at: now_ms(),
            })
            .map_err(|e| HarnessError::internal(e.to_string()))?;
            self.inner
                .bus
                .state_set(TOMBSTONE_SCOPE, id, t)
                .await
                .map_err(state_err)?;
        }
        Ok(())
    }

    async fn enqueue_deletion(&self, op: &Operation) -> Result<()> {
        let step =
            json!({"operation_id": op.snapshot.operation_id, "attempt": op.snapshot.attempt});
        self.inner
            .bus
            .enqueue(DELETION_QUEUE, "harness::session-deletion-step", step)
            .await
            .map_err(state_err)
    }

    /// Re-enqueues every operation a crash left `deleting` (its step may have been lost between
    /// saving the operation and enqueueing; a duplicate runs after the first and finds it done).
    pub(crate) async fn redrive_deletions(&self) -> Result<()> {
        let rows = self.state_list(OPS_SCOPE).await?;
        for (_, v) in rows {
            let Ok(op) = serde_json::from_value::<Operation>(v) else {
                continue;
            };
            if op.snapshot.status == DeletionStatus::Deleting {
                self.enqueue_deletion(&op).await?;
            }
        }
        Ok(())
    }

    /// One deletion step. Errors fail the attempt (data kept) rather than going back to the
    /// queue: a retry is the operator's decision, under a new attempt number.
    pub(crate) async fn run_deletion(&self, step: DeletionStep) -> Result<DeletionSnapshot> {
        let Some(mut op) = self.load_op(&step.operation_id).await? else {
            return Err(HarnessError::not_found(format!(
                "operation_id: no deletion '{}'",
                step.operation_id
            )));
        };
        if op.snapshot.attempt != step.attempt || op.snapshot.status != DeletionStatus::Deleting {
            // A stale or repeated step: the attempt it belonged to is over.
            return Ok(op.snapshot);
        }
        if let Err(e) = self.delete_members(&mut op).await {
            op.snapshot.status = DeletionStatus::Failed;
            op.snapshot.error = Some(e.to_string());
            tracing::warn!(operation = %op.snapshot.operation_id, attempt = op.snapshot.attempt, "session tree deletion failed: {e}");
        } else {
            op.snapshot.status = DeletionStatus::Completed;
        }
        self.save_op(&op).await?;
        self.emit_deletion(&mut op).await;
        Ok(op.snapshot)
    }

    async fn delete_members(&self, op: &mut Operation) -> Result<()> {
        self.write_tombstones(op).await?;
        let pending: Vec<String> = op
            .members
            .iter()
            .filter(|m| !op.snapshot.deleted_session_ids.contains(m))
            .cloned()
            .collect();
        for m in &pending {
            if self.load_record(m).await?.is_some_and(|r| !r.is_terminal()) {
                let req = StopRequest {
                    session_id: m.clone(),
                    turn_id: None,
                };
                if let Err(e) = Box::pin(self.stop(req)).await {
                    tracing::warn!(session = %m, "deletion could not stop a turn: {e}");
                }
            }
        }
        self.wait_ended(op, &pending).await?;
        self.tell_parent(op).await?;
        // What names a member outside its own scopes, read once for the whole operation.
        let rows = self.member_rows().await?;
        for m in pending {
            self.delete_one(&m, &rows).await?;
            crate::failpoint::hit("after_member_deleted");
            op.snapshot.deleted_session_ids.push(m);
            // Progress is durable per session: a redelivered step skips what is gone.
            self.save_op(op).await?;
        }
        let left = self.approvals_of(&op.members).await?;
        if !left.is_empty() {
            return Err(HarnessError::state(format!(
                "approvals still name deleted sessions: {}",
                left.join(", ")
            )));
        }
        Ok(())
    }

    /// Waits until no member has a turn that is still running or a call whose outcome is
    /// unknown (triggered, never settled); past the attempt's deadline, fails closed.
    async fn wait_ended(&self, op: &Operation, members: &[String]) -> Result<()> {
        loop {
            let mut busy = Vec::new();
            for m in members {
                if let Some(rec) = self.load_record(m).await? {
                    let open_call = rec
                        .calls
                        .values()
                        .any(|c| matches!(c, CallCheckpoint::Triggered { .. }));
                    if !rec.is_terminal() || open_call {
                        busy.push(m.clone());
                    }
                }
            }
            if busy.is_empty() {
                return Ok(());
            }
            if now_ms() - op.started_at > ATTEMPT_DEADLINE_MS {
                return Err(HarnessError::new(
                    ErrorCode::Timeout,
                    format!(
                        "the turns of {} did not end within {} s of the attempt; nothing of theirs was deleted",
                        busy.join(", "),
                        ATTEMPT_DEADLINE_MS / 1000
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// One model-visible message to the root's parent, when it survives: its sub-agent is gone.
    /// A running turn gets it at its next step; an idle session finds it in its transcript.
    /// Never to a parent that is itself deleted or being deleted, and the parent is not woken.
    async fn tell_parent(&self, op: &Operation) -> Result<()> {
        let Some(parent) = &op.parent_session_id else {
            return Ok(());
        };
        if self.tombstone(parent).await?.is_some() {
            return Ok(());
        }
        let exists: Option<harness_types::session::GetResponse> = self
            .call("session::get", &json!({"session_id": parent}))
            .await?;
        if exists.is_none() {
            return Ok(());
        }
        let n = op.members.len();
        let text = crate::texts::subagent_deleted(&op.snapshot.session_id, n.saturating_sub(1));
        let message = AgentMessage::user_text(text, now_ms());
        let entry_id = format!("e_{}", &op.snapshot.operation_id);
        match self.load_record(parent).await? {
            Some(rec) if !rec.is_terminal() => self.park(parent, message, &entry_id).await,
            _ => self
                .append(AppendRequest {
                    session_id: parent.clone(),
                    message: Some(message),
                    custom: None,
                    entry_id: Some(entry_id),
                    origin: Some(json!({"deletion": op.snapshot.operation_id})),
                })
                .await
                .map(|_| ()),
        }
    }

    /// The bindings, approvals and idempotency rows that name a session, by session id: shared
    /// scopes, listed once per operation rather than once per member.
    async fn member_rows(&self) -> Result<MemberRows> {
        let bus = &self.inner.bus;
        let mut rows = MemberRows::default();
        for topic in [topics::TURN_STARTED, topics::TURN_COMPLETED] {
            for b in bus.bindings(topic).await.map_err(state_err)? {
                if let Some(s) = b.config.get("session_id").and_then(Value::as_str) {
                    rows.bindings.entry(s.to_string()).or_default().push(b.id);
                }
            }
        }
        // Bindings a model of the session made (their turn's end normally removed them).
        for b in self.model_bindings().await? {
            rows.bindings.entry(b.session_id).or_default().push(b.id);
        }
        for (scope, by_session) in [
            (APPROVALS_SCOPE, &mut rows.approvals),
            (crate::IDEM_SCOPE, &mut rows.idem),
        ] {
            for (key, v) in bus.state_list(scope).await.map_err(state_err)? {
                if let Some(s) = v.get("session_id").and_then(Value::as_str) {
                    by_session.entry(s.to_string()).or_default().push(key);
                }
            }
        }
        Ok(rows)
    }

    /// Deletes everything of one session the harness keeps, then the session itself.
    async fn delete_one(&self, session_id: &str, rows: &MemberRows) -> Result<()> {
        let bus = &self.inner.bus;
        let of = |m: &HashMap<String, Vec<String>>| m.get(session_id).cloned().unwrap_or_default();
        // Bindings that follow only this session's turns.
        for id in of(&rows.bindings) {
            bus.call("engine::unregister_trigger", json!({"id": id}), None)
                .await
                .map_err(state_err)?;
        }
        // Messages queued for a next step that will never come.
        let queue = crate::steering::scope(session_id);
        for (key, _) in bus.state_list(&queue).await.map_err(state_err)? {
            bus.state_delete(&queue, &key).await.map_err(state_err)?;
        }
        for key in of(&rows.approvals) {
            bus.state_delete(APPROVALS_SCOPE, &key)
                .await
                .map_err(state_err)?;
        }
        for key in of(&rows.idem) {
            bus.state_delete(crate::IDEM_SCOPE, &key)
                .await
                .map_err(state_err)?;
        }
        if let Some(rec) = self.load_record(session_id).await? {
            // A ledger this session's turn opened goes with it; spend recorded in a surviving
            // ancestor's ledger stays there (spent is spent).
            if let Some(b) = rec
                .options
                .budget
                .as_ref()
                .filter(|b| b.ledger == rec.turn_id)
            {
                let scope = crate::budget::scope(&b.ledger);
                for (key, _) in bus.state_list(&scope).await.map_err(state_err)? {
                    bus.state_delete(&scope, &key).await.map_err(state_err)?;
                }
            }
            self.clear_signal(&rec.turn_id);
            bus.state_delete(TURN_SCOPE, session_id)
                .await
                .map_err(state_err)?;
        }
        bus.state_delete(crate::grants::SCOPE, session_id)
            .await
            .map_err(state_err)?;
        self.forget_transcript(session_id);
        let _: DeleteResponse = self
            .call(
                "session::delete",
                &DeleteRequest {
                    session_id: session_id.to_string(),
                },
            )
            .await
            .map_err(|e| {
                HarnessError::dependency(format!(
                    "session::delete of '{session_id}' did not confirm: {e}"
                ))
            })?;
        Ok(())
    }

    /// Approval rows that still name one of `members`.
    async fn approvals_of(&self, members: &[String]) -> Result<Vec<String>> {
        let rows = self.state_list(APPROVALS_SCOPE).await?;
        Ok(rows
            .into_iter()
            .filter(|(_, v)| {
                v.get("session_id")
                    .and_then(Value::as_str)
                    .is_some_and(|s| members.iter().any(|m| m == s))
            })
            .map(|(k, _)| k)
            .collect())
    }

    /// Records the snapshot on the event log and fans it out to the bindings whose filter
    /// matches, once per operation, attempt and status.
    async fn emit_deletion(&self, op: &mut Operation) {
        let s = &op.snapshot;
        let key = format!(
            "{}:{}:{}:{}",
            topics::SESSION_TREE_DELETION,
            s.operation_id,
            s.attempt,
            status_word(s.status)
        );
        let ev = crate::events::Event {
            topic: topics::SESSION_TREE_DELETION,
            dedupe_key: key,
            payload: serde_json::to_value(s).unwrap_or(Value::Null),
        };
        let admits = |config: &Value| {
            serde_json::from_value::<DeletionEventFilter>(config.clone()).is_ok_and(|f| {
                f.session_id.as_deref().is_none_or(|x| x == s.session_id)
                    && f.operation_id
                        .as_deref()
                        .is_none_or(|x| x == s.operation_id)
            })
        };
        if let Err(e) = self.emit_filtered(ev, &admits).await {
            tracing::warn!(operation = %s.operation_id, "cannot publish the deletion event: {e}");
        }
    }
}

/// Rows in shared scopes that name a member, by session id (see `member_rows`).
#[derive(Default)]
struct MemberRows {
    bindings: HashMap<String, Vec<String>>,
    approvals: HashMap<String, Vec<String>>,
    idem: HashMap<String, Vec<String>>,
}

fn status_word(s: DeletionStatus) -> &'static str {
    match s {
        DeletionStatus::Deleting => "deleting",
        DeletionStatus::Completed => "completed",
        DeletionStatus::Failed => "failed",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_operation_id_is_the_digest_of_the_root() {
        let id = operation_id("s1");
        assert_eq!(id.len(), "delete_".len() + 64);
        assert_eq!(id, operation_id("s1"));
        assert_ne!(id, operation_id("s2"));
    }

    #[test]
    fn tombstone_times_read_as_utc_dates() {
        assert_eq!(utc_text(0), "1970-01-01T00:00:00Z");
        // 2000-02-29 (a leap day of a century leap year), 12:34:56.789.
        assert_eq!(utc_text(951_827_696_789), "2000-02-29T12:34:56Z");
        assert_eq!(utc_text(1_709_251_199_000), "2024-02-29T23:59:59Z");
        assert_eq!(utc_text(1_709_251_200_000), "2024-03-01T00:00:00Z");
        assert_eq!(utc_text(4_102_444_800_000), "2100-01-01T00:00:00Z");
        assert_eq!(utc_text(-1_000), "1969-12-31T23:59:59Z");
    }

    #[test]
    fn an_operation_row_reads_back_with_its_snapshot_flat() {
        let op = Operation {
            snapshot: DeletionSnapshot {
                operation_id: "delete_x".into(),
                attempt: 2,
                session_id: "root".into(),
                status: DeletionStatus::Failed,
                deleted_session_ids: vec!["leaf".into()],
                error: Some("no".into()),
            },
            members: vec!["leaf".into(), "root".into()],
            parent_session_id: Some("p".into()),
            started_at: 5,
        };
        let v = serde_json::to_value(&op).unwrap();
        assert_eq!(v["status"], "failed");
        assert_eq!(v["attempt"], 2);
        let back: Operation = serde_json::from_value(v).unwrap();
        assert_eq!(back.snapshot, op.snapshot);
        assert_eq!(back.members, op.members);
    }
}
