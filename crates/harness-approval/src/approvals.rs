//! The gate, the list and the decision.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use harness_bus::{Bus, BusWrite};
use harness_types::api::{ResolveResponse, StatusReport};
use harness_types::now_ms;
use serde_json::{json, Value};

use crate::digest::{approval_id, digest};
use crate::error::ApprovalError;
use crate::types::*;
use crate::SCOPE;

type Result<T> = std::result::Result<T, ApprovalError>;

/// The session events of a hold and of its decision (or expiry).
pub const REQUESTED: &str = "approval::requested";
pub const DECIDED: &str = "approval::decided";

/// The approval gate over a bus. Cheap to clone; every clone shares the decision locks.
#[derive(Clone)]
pub struct Approvals {
    bus: Arc<dyn Bus>,
    /// One async lock per approval id while a decision (or a gate rewrite) is in progress. A
    /// std Mutex around the map: held only to get or drop an entry, never across an await.
    locks: Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
}

/// The approval is decided in this process right now; the gate must not rewrite it.
struct Busy;

impl Approvals {
    pub fn new(bus: Arc<dyn Bus>) -> Approvals {
        Approvals {
            bus,
            locks: Default::default(),
        }
    }

    fn lock_for(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().expect("approval locks");
        locks.entry(id.to_string()).or_default().clone()
    }

    /// Drops the lock entry when nobody else holds or waits for it.
    fn release(&self, id: &str, lock: Arc<tokio::sync::Mutex<()>>) {
        let mut locks = self.locks.lock().expect("approval locks");
        drop(lock);
        if locks.get(id).is_some_and(|l| Arc::strong_count(l) == 1) {
            locks.remove(id);
        }
    }

    async fn load(&self, id: &str) -> Result<Option<ApprovalRecord>> {
        let Some(v) = self.bus.state_get(SCOPE, id).await? else {
            return Ok(None);
        };
        match serde_json::from_value(v) {
            Ok(rec) => Ok(Some(rec)),
            Err(e) => {
                tracing::warn!(approval = %id, "unreadable approval record: {e}");
                Ok(None)
            }
        }
    }

    /// Writes the record and its event on the session's event log in one commit (on the
    /// embedded bus, one transaction), durable before anyone acts on it: a stream client sees
    /// the hold or the decision exactly when the record says so, never one without the other.
    /// The event carries no arguments (they are read with `approval::list`); its dedupe key
    /// makes a redelivered gate or decision record it once.
    async fn save_with_event(&self, rec: &ApprovalRecord, topic: &str) -> Result<()> {
        let value = serde_json::to_value(rec).map_err(|e| {
            ApprovalError::Bus(harness_bus::BusError::internal(format!(
                "cannot encode approval {}: {e}",
                rec.approval_id
            )))
        })?;
        let payload = json!({
            "session_id": rec.session_id,
            "turn_id": rec.turn_id,
            "approval_id": rec.approval_id,
            "function_call_id": rec.function_call_id,
            "function_id": rec.function_id,
            "digest": rec.digest,
            "status": rec.status.as_str(),
        });
        let dedupe_key = format!("{topic}:{}:{}", rec.approval_id, rec.digest);
        self.bus
            .commit(vec![
                BusWrite::StateSet {
                    scope: SCOPE.to_string(),
                    key: rec.approval_id.clone(),
                    value,
                },
                BusWrite::Publish {
                    topic: topic.to_string(),
                    payload,
                    dedupe_key: Some(dedupe_key),
                },
            ])
            .await?;
        self.bus.barrier().await?;
        Ok(())
    }

    /// `approval::gate`, bound to `harness::hook::pre-trigger`: records the call as a pending
    /// approval (durably) and holds it. Idempotent for a re-delivered step: the same call with
    /// the same arguments keeps its record, and a call already decided gets its decision
    /// (`continue` / `deny`) instead of a second hold. A call whose arguments changed gets a
    /// fresh pending record (a decision quoting the old digest is then refused).
    pub async fn gate(&self, input: GateInput) -> Result<GateAnswer> {
        let call = &input.call;
        if input.session_id.is_empty() {
            return Err(ApprovalError::invalid("session_id", "must not be empty"));
        }
        if call.id.is_empty() {
            return Err(ApprovalError::invalid("call.id", "must not be empty"));
        }
        if input.turn_id.is_empty() {
            // harness::function::trigger outside a turn: nothing could ever resume it.
            return Ok(GateAnswer {
                decision: "deny".into(),
                reason: Some(format!(
                    "{} needs a human approval, and a call made outside an agent turn cannot wait for one",
                    call.function_id
                )),
                annotations: None,
            });
        }
        let id = approval_id(&input.session_id, &input.turn_id, &call.id);
        let shown = digest(&call.function_id, &call.arguments);
        let notes = Some(json!({"approval_id": id}));
        if let Some(rec) = self.load(&id).await? {
            if rec.digest == shown {
                match rec.status {
                    ApprovalStatus::Pending => return Ok(hold(notes)),
                    ApprovalStatus::Approved => {
                        return Ok(GateAnswer {
                            decision: "continue".into(),
                            reason: None,
                            annotations: notes,
                        })
                    }
                    ApprovalStatus::Denied => {
                        return Ok(GateAnswer {
                            decision: "deny".into(),
                            reason: Some(denial_text(rec.reason.as_deref())),
                            annotations: notes,
                        })
                    }
                    ApprovalStatus::Expired => {}
                }
            }
        }
        let rec = ApprovalRecord {
            approval_id: id.clone(),
            session_id: input.session_id.clone(),
            turn_id: input.turn_id.clone(),
            function_call_id: call.id.clone(),
            function_id: call.function_id.clone(),
            arguments: call.arguments.clone(),
            digest: shown,
            created_at: now_ms(),
            status: ApprovalStatus::Pending,
            decided_at: None,
            reason: None,
            resolved: None,
        };
        match self.write_unless_deciding(&rec).await? {
            Ok(()) => Ok(hold(notes)),
            // A decision for the arguments shown before is in flight; holding these new ones
            // under that decision would run what nobody saw. Refuse them instead.
            Err(Busy) => Ok(GateAnswer {
                decision: "deny".into(),
                reason: Some(format!(
                    "the arguments of {} changed while an approval decision was being made",
                    call.function_id
                )),
                annotations: notes,
            }),
        }
    }

    async fn write_unless_deciding(
        &self,
        rec: &ApprovalRecord,
    ) -> Result<std::result::Result<(), Busy>> {
        let lock = self.lock_for(&rec.approval_id);
        let out = match lock.try_lock() {
            Ok(_guard) => self.save_with_event(rec, REQUESTED).await.map(Ok),
            Err(_) => Ok(Err(Busy)),
        };
        self.release(&rec.approval_id, lock);
        out
    }

    /// `approval::list`: pending approvals of turns still waiting for them, oldest first. An
    /// approval whose turn ended is marked `expired` on the way.
    pub async fn list(&self, req: ListRequest) -> Result<ListResponse> {
        if req.session_id.as_deref() == Some("") {
            return Err(ApprovalError::invalid("session_id", "must not be empty"));
        }
        let rows = self.bus.state_list(SCOPE).await?;
        let mut pending: Vec<ApprovalRecord> = rows
            .into_iter()
            .filter_map(|(_, v)| serde_json::from_value::<ApprovalRecord>(v).ok())
            .filter(|r| r.status == ApprovalStatus::Pending)
            .filter(|r| req.session_id.as_deref().is_none_or(|s| s == r.session_id))
            .collect();
        pending.sort_by(|a, b| (a.created_at, &a.approval_id).cmp(&(b.created_at, &b.approval_id)));
        let mut statuses: HashMap<String, Liveness> = HashMap::new();
        let mut out = Vec::with_capacity(pending.len());
        for rec in pending {
            let live = match statuses.get(&rec.session_id) {
                Some(l) => l.clone(),
                None => {
                    let l = self.liveness(&rec.session_id).await;
                    statuses.insert(rec.session_id.clone(), l.clone());
                    l
                }
            };
            if live.waits_for(&rec) {
                out.push(rec);
            } else {
                self.expire(&rec.approval_id).await?;
            }
        }
        Ok(ListResponse { approvals: out })
    }

    /// Deletes decided and expired approvals decided at least `older_than_ms` ago (a row that
    /// no longer parses goes too); pending ones always stay. A redelivered gate call finds its
    /// decision for as long as the retention lasts, which outlives any step's redelivery.
    pub async fn prune(&self, req: PruneRequest) -> Result<PruneResponse> {
        let cutoff = now_ms().saturating_sub(i64::try_from(req.older_than_ms).unwrap_or(i64::MAX));
        let mut pruned = 0;
        for (key, v) in self.bus.state_list(SCOPE).await? {
            let old = match serde_json::from_value::<ApprovalRecord>(v) {
                Ok(rec) => {
                    rec.status != ApprovalStatus::Pending
                        && rec.decided_at.unwrap_or(rec.created_at) <= cutoff
                }
                Err(_) => true,
            };
            if !old {
                continue;
            }
            let lock = self.lock_for(&key);
            let out = match lock.try_lock() {
                Ok(_guard) => self.bus.state_delete(SCOPE, &key).await.map(|_| true),
                Err(_) => Ok(false), // being decided right now: not old
            };
            self.release(&key, lock);
            if out? {
                pruned += 1;
            }
        }
        Ok(PruneResponse { pruned })
    }

    /// Marks a pending approval expired (under its lock, re-reading it first).
    async fn expire(&self, id: &str) -> Result<()> {
        let lock = self.lock_for(id);
        let out = async {
            let Ok(_guard) = lock.try_lock() else {
                return Ok(()); // being decided right now: the decision settles it
            };
            let Some(mut rec) = self.load(id).await? else {
                return Ok(());
            };
            if rec.status != ApprovalStatus::Pending {
                return Ok(());
            }
            rec.status = ApprovalStatus::Expired;
            rec.decided_at = Some(now_ms());
            rec.reason = Some("the turn ended before a decision".into());
            self.save_with_event(&rec, DECIDED).await
        }
        .await;
        self.release(id, lock);
        out
    }

    /// What `harness::status` says about a session's turn. Unknown (the call failed) counts as
    /// live: listing never hides an approval because a dependency hiccupped.
    async fn liveness(&self, session_id: &str) -> Liveness {
        match self
            .bus
            .call("harness::status", json!({"session_id": session_id}), None)
            .await
        {
            Ok(Value::Null) => Liveness::Gone,
            Ok(v) => match serde_json::from_value::<StatusReport>(v) {
                Ok(s) if s.status.is_terminal() => Liveness::Gone,
                Ok(s) => Liveness::Turn(s.turn_id.unwrap_or_default()),
                Err(_) => Liveness::Unknown,
            },
            Err(e) => {
                tracing::debug!(session = %session_id, "harness::status failed: {e}");
                Liveness::Unknown
            }
        }
    }

    /// `approval::decide`. Refuses an unknown approval, a second decision, a digest other than
    /// the one shown, and an approval whose turn ended. Then resolves the held call (approve:
    /// `execute`; deny: `deliver` an error result) and only then records the decision: a crash
    /// in between leaves the approval pending, and deciding again gets `resolved: false` from
    /// the resolve (the call is already settled) and records it.
    pub async fn decide(&self, req: DecideRequest) -> Result<DecideResponse> {
        if req.approval_id.is_empty() {
            return Err(ApprovalError::invalid("approval_id", "must not be empty"));
        }
        if req.digest.is_empty() {
            return Err(ApprovalError::invalid(
                "digest",
                "must not be empty: quote the digest of the approval as it was shown",
            ));
        }
        let lock = self.lock_for(&req.approval_id);
        let out = {
            let _guard = lock.lock().await;
            self.decide_locked(&req).await
        };
        self.release(&req.approval_id, lock);
        out
    }

    async fn decide_locked(&self, req: &DecideRequest) -> Result<DecideResponse> {
        let Some(mut rec) = self.load(&req.approval_id).await? else {
            return Err(ApprovalError::invalid(
                "approval_id",
                format!("no approval '{}'", req.approval_id),
            ));
        };
        match rec.status {
            ApprovalStatus::Pending => {}
            ApprovalStatus::Expired => {
                return Err(ApprovalError::invalid(
                    "approval_id",
                    format!(
                        "expired: turn {} of session {} ended before a decision",
                        rec.turn_id, rec.session_id
                    ),
                ))
            }
            decided => {
                return Err(ApprovalError::invalid(
                    "approval_id",
                    format!("already decided ({})", decided.as_str()),
                ))
            }
        }
        if rec.digest != req.digest {
            return Err(ApprovalError::invalid(
                "digest",
                format!(
                    "the arguments changed since they were shown (the approval is bound to {}, the decision quotes {})",
                    rec.digest, req.digest
                ),
            ));
        }
        if !self.liveness(&rec.session_id).await.waits_for(&rec) {
            let out = Err(ApprovalError::invalid(
                "approval_id",
                format!(
                    "expired: turn {} of session {} is no longer waiting for it",
                    rec.turn_id, rec.session_id
                ),
            ));
            rec.status = ApprovalStatus::Expired;
            rec.decided_at = Some(now_ms());
            rec.reason = Some("the turn ended before a decision".into());
            self.save_with_event(&rec, DECIDED).await?;
            return out;
        }
        let reason = req
            .reason
            .as_deref()
            .map(str::trim)
            .filter(|r| !r.is_empty());
        let mut resolve = json!({
            "session_id": rec.session_id,
            "turn_id": rec.turn_id,
            "function_call_id": rec.function_call_id,
        });
        match req.decision {
            Decision::Approve => resolve["action"] = json!("execute"),
            Decision::Deny => {
                let text = denial_text(reason);
                resolve["action"] = json!("deliver");
                resolve["is_error"] = json!(true);
                resolve["content"] = json!([{"type": "text", "text": text}]);
                resolve["details"] = json!({
                    "error": "approval_denied",
                    "approval_id": rec.approval_id,
                    "function_id": rec.function_id,
                    "reason": reason,
                });
            }
        }
        let answer = self
            .bus
            .call("harness::function::resolve", resolve, None)
            .await?;
        let answer: ResolveResponse = serde_json::from_value(answer.clone()).map_err(|e| {
            ApprovalError::Bus(harness_bus::BusError::internal(format!(
                "harness::function::resolve answered {answer}: {e}"
            )))
        })?;
        rec.status = match req.decision {
            Decision::Approve => ApprovalStatus::Approved,
            Decision::Deny => ApprovalStatus::Denied,
        };
        rec.decided_at = Some(now_ms());
        rec.reason = reason.map(str::to_string);
        rec.resolved = Some(answer.resolved);
        self.save_with_event(&rec, DECIDED).await?;
        Ok(DecideResponse {
            decided: true,
            approval_id: rec.approval_id,
            status: rec.status,
            resolved: answer.resolved,
            turn_resumed: answer.turn_resumed,
        })
    }
}

fn hold(annotations: Option<Value>) -> GateAnswer {
    GateAnswer {
        decision: "hold".into(),
        reason: None,
        annotations,
    }
}

fn denial_text(reason: Option<&str>) -> String {
    format!(
        "denied by the approver: {}",
        reason.unwrap_or("no reason given")
    )
}

/// Whether a session's turn can still be resolved.
#[derive(Clone, Debug)]
enum Liveness {
    /// No turn record, or the turn is terminal.
    Gone,
    /// This turn is not terminal.
    Turn(String),
    /// `harness::status` could not say.
    Unknown,
}

impl Liveness {
    fn waits_for(&self, rec: &ApprovalRecord) -> bool {
        match self {
            Liveness::Gone => false,
            Liveness::Turn(t) => *t == rec.turn_id,
            Liveness::Unknown => true,
        }
    }
}
