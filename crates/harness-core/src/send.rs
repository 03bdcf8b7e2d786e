//! `harness::send`: persist the message, then seed a turn or merge into the running one.

use harness_types::api::{SendOptions, SendRequest, SendResponse, TurnStatus};
use harness_types::directory::AgentProfile;
use harness_types::message::AgentMessage;
use harness_types::session::{CreateRequest, CreateResponse, EnsureRequest, EnsureResponse};
use harness_types::{ids, now_ms, ErrorCode, HarnessError};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::fsroot;
use crate::harness::{Harness, Result};
use crate::identity::PromptFields;
use crate::interpret::{Carry, Outgoing};
use crate::machine::{Input, Seed};
use crate::record::{message_preview, Reasoning, TurnOptions, TurnRecord};
use crate::steering::QueuedMessage;
use crate::IDEM_SCOPE;

#[derive(Serialize, Deserialize)]
struct IdemRow {
    session_id: String,
    turn_id: String,
    entry_id: String,
    ts: i64,
}

/// Checks the role before the shape, so the error names what is actually wrong.
pub(crate) fn normalize_message(message: Value) -> Result<AgentMessage> {
    match message {
        Value::String(text) => Ok(AgentMessage::user_text(text, now_ms())),
        Value::Object(ref map) => {
            match map.get("role") {
                Some(Value::String(r)) if r == "user" || r == "custom" => {}
                Some(Value::String(r)) => {
                    return Err(HarnessError::new(
                        ErrorCode::InvalidMessageRole,
                        format!("message.role: '{r}' cannot be sent; use 'user' or 'custom'"),
                    ))
                }
                Some(other) => {
                    return Err(HarnessError::new(
                        ErrorCode::InvalidMessageRole,
                        format!(
                            "message.role: must be the string 'user' or 'custom' (got {other})"
                        ),
                    ))
                }
                None => {
                    return Err(HarnessError::invalid_field(
                        "message.role",
                        "missing field `role`",
                    ))
                }
            }
            // Parse the variant's own struct: an enum tagged by `role` would lose the field
            // path of an error inside it.
            let role_is_user = map.get("role") == Some(&Value::String("user".into()));
            let mut body = message.clone();
            if let Some(obj) = body.as_object_mut() {
                obj.remove("role");
            }
            let named = |e: HarnessError| HarnessError::invalid(format!("message.{}", e.message));
            let m = if role_is_user {
                let mut u: harness_types::message::UserMessage =
                    harness_types::parse::parse_payload(body).map_err(named)?;
                if u.timestamp == 0 {
                    u.timestamp = now_ms();
                }
                AgentMessage::User(u)
            } else {
                let mut c: harness_types::message::CustomMessage =
                    harness_types::parse::parse_payload(body).map_err(named)?;
                if c.timestamp == 0 {
                    c.timestamp = now_ms();
                }
                AgentMessage::Custom(c)
            };
            Ok(m)
        }
        Value::Null => Err(HarnessError::invalid_field(
            "message",
            "missing field `message`",
        )),
        other => Err(HarnessError::invalid_field(
            "message",
            format!(
                "must be a string or a message object (got {})",
                harness_types::parse::json_kind(&other)
            ),
        )),
    }
}

fn validate_options(o: &SendOptions) -> Result<()> {
    crate::identity::check_mode("options.mode", o.mode, o.system_prompt_strategy)?;
    if o.agent.as_deref() == Some("") {
        return Err(HarnessError::invalid_field(
            "options.agent",
            "must not be empty",
        ));
    }
    if o.agent.is_some() && (o.system_prompt.is_some() || o.system_prompt_strategy.is_some()) {
        return Err(crate::identity::agent_with_prompt_fields("options.agent"));
    }
    if let Some(i) = o.skills.iter().flatten().position(String::is_empty) {
        return Err(HarnessError::invalid_field(
            &format!("options.skills[{i}]"),
            "must not be empty",
        ));
    }
    if o.max_total_tokens == Some(0) {
        return Err(HarnessError::invalid_field(
            "options.max_total_tokens",
            "must be at least 1",
        ));
    }
    if let Some(c) = o.max_cost_usd {
        if !(c.is_finite() && c > 0.0) {
            return Err(HarnessError::invalid_field(
                "options.max_cost_usd",
                format!("must be a positive number of USD (got {c})"),
            ));
        }
    }
    if o.max_turns == Some(0) {
        return Err(HarnessError::invalid_field(
            "options.max_turns",
            "must be at least 1",
        ));
    }
    if let Some(r) = &o.reasoning {
        if Reasoning::parse(r).is_none() {
            return Err(HarnessError::invalid_field(
                "options.reasoning",
                format!("only \"lowest\" is accepted (got \"{r}\")"),
            ));
        }
        // "lowest" is harness choosing the effort: a send that also names one is ambiguous.
        for (given, field) in [
            (o.thinking_level.is_some(), "options.thinking_level"),
            (o.provider_options.is_some(), "options.provider_options"),
        ] {
            if given {
                return Err(HarnessError::invalid_field(
                    "options.reasoning",
                    format!("\"lowest\" chooses the effort itself and cannot be combined with {field}; remove one of them"),
                ));
            }
        }
    }
    Ok(())
}

/// A send's fields, checked before anything is read or written.
struct Checked {
    message: AgentMessage,
    options: SendOptions,
    /// The filesystem root the send names (never a child's: it has its parent's part).
    named_root: Option<fsroot::FsRoot>,
}

/// Every field check of a send. A send merged into a running turn never reaches the point
/// where options are frozen, so nothing there may swallow a bad field silently.
fn check(req: &SendRequest, child: bool) -> Result<Checked> {
    let message = normalize_message(req.message.clone())?;
    let options = req.options.clone().unwrap_or_default();
    validate_options(&options)?;
    let named_root = match (&options.filesystem_root, child) {
        (Some(p), false) => Some(fsroot::explicit("options.filesystem_root", p)?),
        _ => None,
    };
    if req.model.as_deref() == Some("") {
        return Err(HarnessError::invalid_field("model", "must not be empty"));
    }
    for (field, value) in [
        ("session_id", &req.session_id),
        ("idempotency_key", &req.idempotency_key),
    ] {
        if value.as_deref() == Some("") {
            return Err(HarnessError::invalid_field(field, "must not be empty"));
        }
    }
    Ok(Checked {
        message,
        options,
        named_root,
    })
}

/// What the lock-free path did with a send.
enum Steered {
    /// Not a running turn: the locked path decides.
    No,
    /// Parked for a turn that ended meanwhile: the new turn's first step drains it.
    Parked,
    /// Parked for the running turn, which takes it at its next step.
    Merged(SendResponse),
}

impl Harness {
    pub async fn send(&self, req: SendRequest) -> Result<SendResponse> {
        // Boxed here and at the other calls of the loop's large futures (`run`, `step`): a
        // future is moved whole into the one that awaits it, so an unboxed chain copies its
        // ~20 KB state at every level of every call.
        Box::pin(self.accept(req, None, false)).await
    }

    /// A sub-agent's first message: `lineage` gives the child its frozen options, depth and
    /// parent link instead of inheriting them from the session.
    pub(crate) async fn send_child(
        &self,
        req: SendRequest,
        lineage: Lineage,
    ) -> Result<SendResponse> {
        self.accept(req, Some(lineage), true).await
    }

    /// The send path of both: checks, dedupe, steering a running turn lock-free, then under
    /// the session lock the next turn's options and the machine.
    ///
    /// `session::ensure` is asked only when the session may not exist yet (`ensure`, or no turn
    /// record was found): a turn record is written only after its session was ensured, and
    /// deleting a session through the loop deletes its record first. A session deleted behind
    /// the loop's back (`session::delete` called directly) refuses the message's append as not
    /// found and writes nothing; the send then starts over, ensuring the session.
    async fn accept(
        &self,
        req: SendRequest,
        lineage: Option<Lineage>,
        ensure: bool,
    ) -> Result<SendResponse> {
        let checked = check(&req, lineage.is_some())?;
        if let Some(done) = self.deduplicated(&req).await? {
            return Ok(done);
        }
        self.refuse_unsendable(&req, &checked.options, lineage.as_ref())
            .await?;
        let session_id = req.session_id.clone().unwrap_or_else(ids::new_session_id);
        let entry_id = match &req.idempotency_key {
            Some(key) => ids::idempotent_user_entry(key),
            None => ids::new_entry_id(),
        };
        let parked = match self.steer(&req, &checked, &session_id, &entry_id).await? {
            Steered::Merged(response) => return self.answer_send(&req, response, entry_id).await,
            Steered::Parked => true,
            Steered::No => false,
        };
        let _guard = self.inner.locks.lock(&session_id).await;
        // Again under the lock: two sends with one key racing must not both append.
        if let Some(done) = self.deduplicated(&req).await? {
            return Ok(done);
        }
        let prev = match &req.session_id {
            Some(id) => self.load_record(id).await?,
            None => None,
        };
        if let Some(p) = prev.as_ref().filter(|p| !p.is_terminal()) {
            refuse_root_change(p, checked.named_root.as_ref())?;
        }
        // Only a plain send may go without: a child's or an agent's send names what a new
        // session is made with, and a parked message must not be parked twice.
        let ensure = ensure || prev.is_none() || parked || checked.options.agent.is_some();
        let (seed, correction, applied) = self
            .seed(&req, &checked, &session_id, prev.as_ref(), lineage)
            .await?;
        let req = match checked.options.agent {
            Some(_) => with_agent_metadata(req, &seed.options),
            None => req,
        };
        if ensure {
            self.ensure_session(&req, &session_id).await?;
        }
        let new_turn = seed.turn_id.clone();
        let steering = prev
            .as_ref()
            .is_some_and(|p| p.status == TurnStatus::Running);
        let input = Input::Send {
            parked,
            seed: Box::new(seed),
        };
        // The message, the record that answers it and the first step: one batch (see
        // `interpret.rs`, which writes them apart if the queue refuses it).
        let mut carry = Carry::sending(Outgoing {
            session_id: session_id.clone(),
            message: checked.message,
            entry_id: entry_id.clone(),
            new_turn: new_turn.clone(),
            correction,
        });
        let rec = match Box::pin(self.run(prev, input, &mut carry)).await {
            // Only when the session is indeed gone: a not-found from anything else the run did
            // (after its batch may have committed) must not send the message again.
            Err(e)
                if !ensure
                    && e.code == ErrorCode::NotFound
                    && !self.session_exists(&session_id).await? =>
            {
                tracing::info!(session = %session_id, "a send found its session gone behind the loop's back, ensuring it: {e}");
                drop(_guard);
                return Box::pin(self.accept(req, None, true)).await;
            }
            ran => ran?.ok_or_else(|| HarnessError::internal("a send left no turn record"))?,
        };
        let response = if rec.turn_id == new_turn {
            SendResponse {
                session_id,
                turn_id: new_turn,
                accepted: true,
                reasoning: applied,
                ..SendResponse::default()
            }
        } else {
            merged(&session_id, rec.turn_id, steering || parked)
        };
        self.answer_send(&req, response, entry_id).await
    }

    /// The answer of an earlier send with the same idempotency key, if one was kept.
    async fn deduplicated(&self, req: &SendRequest) -> Result<Option<SendResponse>> {
        let Some(key) = &req.idempotency_key else {
            return Ok(None);
        };
        Ok(self.idem_row(key).await?.map(|row| SendResponse {
            session_id: row.session_id,
            turn_id: row.turn_id,
            accepted: true,
            deduplicated: Some(true),
            ..SendResponse::default()
        }))
    }

    /// A deleted session or parent takes no message (a fresh id cannot be a deleted one), and
    /// a send may not change a session's identity (see [`Harness::check_identity_change`]).
    async fn refuse_unsendable(
        &self,
        req: &SendRequest,
        options: &SendOptions,
        lineage: Option<&Lineage>,
    ) -> Result<()> {
        if let Some(id) = &req.session_id {
            self.refuse_tombstoned("session_id", id).await?;
        }
        if let Some(parent) = lineage.and_then(|l| l.parent.as_ref()) {
            self.refuse_tombstoned("parent", &parent.session_id).await?;
        }
        if lineage.is_none() && (options.agent.is_some() || options.skills.is_some()) {
            self.check_identity_change(req, options).await?;
        }
        Ok(())
    }

    /// The fast path: a running turn takes steering without the session lock, which its step
    /// may hold for as long as a function runs. The message is parked first, then the record
    /// is read again: if the turn ended in between, the locked path starts a new turn whose
    /// first step drains it.
    async fn steer(
        &self,
        req: &SendRequest,
        checked: &Checked,
        session_id: &str,
        entry_id: &str,
    ) -> Result<Steered> {
        if req.session_id.is_none()
            || self.record_status(session_id).await? != Some(TurnStatus::Running)
        {
            return Ok(Steered::No);
        }
        match self.load_record(session_id).await? {
            Some(rec) if rec.status == TurnStatus::Running => {
                refuse_root_change(&rec, checked.named_root.as_ref())?;
            }
            _ => return Ok(Steered::No),
        }
        self.park(session_id, checked.message.clone(), entry_id)
            .await?;
        Ok(
            match self
                .load_record(session_id)
                .await?
                .filter(|r| !r.is_terminal())
            {
                Some(now) => Steered::Merged(merged(session_id, now.turn_id, true)),
                None => Steered::Parked,
            },
        )
    }

    /// The turn this send would start: its frozen options (a child's come with its lineage),
    /// depth and parent; the skills correction to tell before the message; the reasoning
    /// applied. Chosen (and refused for a model the catalog does not know) before anything is
    /// kept.
    async fn seed(
        &self,
        req: &SendRequest,
        checked: &Checked,
        session_id: &str,
        prev: Option<&TurnRecord>,
        lineage: Option<Lineage>,
    ) -> Result<(
        Seed,
        Option<String>,
        Option<harness_types::api::AppliedReasoning>,
    )> {
        let options = &checked.options;
        let mut correction = None;
        let mut applied = None;
        let (mut frozen, depth, parent) = match lineage {
            Some(l) => (l.options, l.depth, l.parent),
            None => {
                let mut frozen = self.freeze_options(req, options, prev).await?;
                // A new turn on the prompt the session froze earlier: a changed skills catalog
                // is told as a user-role correction before the message, never by rewriting
                // the prompt.
                if let Some(p) = prev.filter(|p| p.is_terminal()) {
                    if frozen.system_prompt == p.options.system_prompt
                        && frozen.prompt_shape == p.options.prompt_shape
                    {
                        frozen.skills_seen = p.options.skills_seen.clone();
                        if let Some((text, now)) =
                            self.skills_catalog_correction(&p.options, &frozen).await
                        {
                            correction = Some(text);
                            frozen.skills_seen = Some(now);
                        }
                    }
                }
                if options.reasoning.is_some() {
                    applied = Some(self.lowest_reasoning(&frozen).await?);
                }
                (
                    frozen,
                    prev.map_or(0, |p| p.depth),
                    prev.and_then(|p| p.parent.clone()),
                )
            }
        };
        let turn_id = ids::new_turn_id();
        if let Some(b) = frozen.budget.as_mut().filter(|b| b.ledger.is_empty()) {
            // A root budget's ledger is the turn that set it; its sub-agents share it.
            b.ledger = turn_id.clone();
        }
        let seed = Seed {
            session_id: session_id.to_string(),
            turn_id,
            options: frozen,
            depth,
            parent,
            preview: message_preview(&checked.message.text()),
            functions_generation: prev.and_then(|p| p.functions_generation),
            now: now_ms(),
        };
        Ok((seed, correction, applied))
    }

    /// What `reasoning: "lowest"` applies to the turn's model, from its catalog row (the
    /// router makes the same choice when it sends the request). A model without a row is
    /// refused: there is nothing to choose from.
    async fn lowest_reasoning(
        &self,
        o: &TurnOptions,
    ) -> Result<harness_types::api::AppliedReasoning> {
        let row: Value = self
            .call(
                "router::models::get",
                &json!({"provider": o.provider, "id": o.model}),
            )
            .await?;
        if row.is_null() {
            return Err(HarnessError::invalid_field(
                "options.reasoning",
                format!(
                    "the router has no catalog row for model '{}'{}, so the lowest effort cannot be chosen",
                    o.model,
                    o.provider
                        .as_deref()
                        .map(|p| format!(" on provider '{p}'"))
                        .unwrap_or_default()
                ),
            ));
        }
        let effort = row["reasoning_efforts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .find(|e| *e != "none");
        Ok(match effort {
            Some(e) => harness_types::api::AppliedReasoning {
                thinking_level: serde_json::from_value(json!(e)).ok(),
                reasoning_effort: Some(e.to_string()),
            },
            None if row["capabilities"]["thinking"] == json!(true) => {
                harness_types::api::AppliedReasoning {
                    thinking_level: Some(harness_types::api::ThinkingLevel::Minimal),
                    reasoning_effort: None,
                }
            }
            None => harness_types::api::AppliedReasoning::default(),
        })
    }

    /// A profile names a session's identity only when the send creates it, and the skills
    /// filter does not change under a running turn. Checked before the fast path: a send
    /// merged into a running turn never reaches the point where options are frozen.
    async fn check_identity_change(&self, req: &SendRequest, o: &SendOptions) -> Result<()> {
        let Some(id) = &req.session_id else {
            return Ok(());
        };
        let Some(rec) = self.load_record(id).await? else {
            return Ok(());
        };
        if o.agent.is_some() {
            return Err(HarnessError::invalid_field(
                "options.agent",
                format!("only on a session-creating send: session '{id}' already has turns; start a new session to run under a profile"),
            ));
        }
        if o.skills.is_some() && !rec.is_terminal() {
            return Err(HarnessError::invalid_field(
                "options.skills",
                format!("cannot change while session '{id}' has a turn in progress"),
            ));
        }
        Ok(())
    }

    /// Writes the idempotency row and makes everything durable before the caller hears back.
    async fn answer_send(
        &self,
        req: &SendRequest,
        response: SendResponse,
        entry_id: String,
    ) -> Result<SendResponse> {
        if let Some(key) = &req.idempotency_key {
            let row = IdemRow {
                session_id: response.session_id.clone(),
                turn_id: response.turn_id.clone(),
                entry_id,
                ts: now_ms(),
            };
            let value =
                serde_json::to_value(row).map_err(|e| HarnessError::internal(e.to_string()))?;
            self.inner
                .bus
                .state_set(IDEM_SCOPE, key, value)
                .await
                .map_err(|e| e.into_harness())?;
        }
        // What we answer must survive a crash (and, with fsync on, a power loss).
        self.barrier().await?;
        Ok(response)
    }

    /// Parks a message in the mid-turn queue for the next step.
    pub(crate) async fn park(
        &self,
        session_id: &str,
        message: AgentMessage,
        entry_id: &str,
    ) -> Result<()> {
        self.queue_message(&QueuedMessage {
            id: ids::new_queue_id(),
            session_id: session_id.to_string(),
            message,
            entry_id: entry_id.to_string(),
            origin: None,
            queued_at: now_ms(),
        })
        .await?;
        let _ = self
            .inner
            .bus
            .publish(
                crate::topics::MESSAGE_QUEUED,
                json!({"session_id": session_id, "entry_id": entry_id, "queued_at": now_ms(), "timestamp": now_ms()}),
                None,
            )
            .await;
        Ok(())
    }

    async fn ensure_session(&self, req: &SendRequest, session_id: &str) -> Result<()> {
        let init = req.session.clone().unwrap_or_default();
        match &req.session_id {
            Some(id) => {
                let made: EnsureResponse = self
                    .call(
                        "session::ensure",
                        &EnsureRequest {
                            session_id: id.clone(),
                            title: init.title,
                            metadata: init.metadata,
                            kind: init.kind,
                        },
                    )
                    .await?;
                // Made again under an id the loop may know (the session was deleted behind its
                // back): what it cached of the old transcript is not this one's.
                if made.created {
                    self.forget_transcript(id);
                }
            }
            None => {
                self.create_session(&CreateRequest {
                    session_id: Some(session_id.to_string()),
                    title: init.title,
                    metadata: init.metadata,
                    kind: init.kind,
                })
                .await?;
            }
        }
        Ok(())
    }

    /// `session::create` of an id this send generated, retried in place on a transient error
    /// like any call; but once an attempt may have landed (it timed out, or the link dropped
    /// before its answer), "already exists" on a later attempt is that attempt's own session,
    /// not a collision: nobody else knows the fresh id.
    async fn create_session(&self, req: &CreateRequest) -> Result<()> {
        let payload =
            serde_json::to_value(req).map_err(|e| HarnessError::internal(e.to_string()))?;
        let timeout = Some(std::time::Duration::from_millis(
            self.config().session_timeout_ms,
        ));
        let mut attempt = 0;
        loop {
            match self
                .inner
                .bus
                .call("session::create", payload.clone(), timeout)
                .await
            {
                Ok(v) => {
                    let _: CreateResponse = serde_json::from_value(v).map_err(|e| {
                        HarnessError::dependency(format!(
                            "session::create answered an unexpected shape: {e}"
                        ))
                    })?;
                    return Ok(());
                }
                Err(e) if attempt > 0 && e.message.contains("already exists") => {
                    tracing::info!(session = ?req.session_id, "session::create answered late; the retry found the session it had created");
                    return Ok(());
                }
                Err(e) if e.is_transient_dependency() && attempt < 10 => {
                    attempt += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(250)).await;
                }
                Err(e) => return Err(e.into_harness()),
            }
        }
    }

    async fn idem_row(&self, key: &str) -> Result<Option<IdemRow>> {
        let v = self.state_get(IDEM_SCOPE, key).await?;
        let ttl_ms = self.config().idem_ttl_secs.saturating_mul(1000) as i64;
        // An expired row no longer dedupes even before the sweep has pruned it.
        Ok(v.and_then(|v| serde_json::from_value::<IdemRow>(v).ok())
            .filter(|row| now_ms().saturating_sub(row.ts) < ttl_ms))
    }

    /// Deletes idempotency rows older than `idem_ttl_secs` (and rows that no longer parse);
    /// returns how many went. Run by the sweep.
    pub(crate) async fn prune_idempotency(&self) -> Result<usize> {
        let ttl_ms = self.config().idem_ttl_secs.saturating_mul(1000) as i64;
        let now = now_ms();
        let rows = self.state_list(IDEM_SCOPE).await?;
        let mut pruned = 0;
        for (key, value) in rows {
            let expired = serde_json::from_value::<IdemRow>(value)
                .map(|row| now.saturating_sub(row.ts) >= ttl_ms)
                .unwrap_or(true);
            if expired {
                self.inner
                    .bus
                    .state_delete(IDEM_SCOPE, &key)
                    .await
                    .map_err(|e| e.into_harness())?;
                pruned += 1;
            }
        }
        Ok(pruned)
    }

    /// The profile `name` names (`field` in errors), and its model with its provider.
    pub(crate) async fn named_profile(
        &self,
        field: &str,
        name: Option<&str>,
    ) -> Result<(Option<AgentProfile>, Option<(String, Option<String>)>)> {
        let Some(name) = name else {
            return Ok((None, None));
        };
        let profile = self.agent_profile(field, name).await?;
        let model = profile.model.clone().map(|m| (m, profile.provider.clone()));
        Ok((Some(profile), model))
    }

    /// Resolves the options the next turn would run with. Explicit fields win; omitted ones are
    /// inherited from the previous turn (model, provider, policy, prompt, reasoning).
    async fn freeze_options(
        &self,
        req: &SendRequest,
        o: &SendOptions,
        prev: Option<&TurnRecord>,
    ) -> Result<TurnOptions> {
        let prev_opts = prev.map(|p| &p.options);
        let (profile, profile_model) = self
            .named_profile("options.agent", o.agent.as_deref())
            .await?;
        let (model, provider) = match (&req.model, prev_opts) {
            (Some(m), _) if m.is_empty() => {
                return Err(HarnessError::invalid_field("model", "must not be empty"))
            }
            (Some(m), p) => (
                m.clone(),
                req.provider
                    .clone()
                    .or_else(|| p.filter(|p| &p.model == m).and_then(|p| p.provider.clone())),
            ),
            // The profile's model when the send names none; its provider goes with it.
            (None, _) if profile_model.is_some() => {
                let (m, p) = profile_model.clone().unwrap_or_default();
                (m, req.provider.clone().or(p))
            }
            // A record written after a lost one has no model to inherit.
            (None, Some(p)) if !p.model.is_empty() => (
                p.model.clone(),
                req.provider.clone().or_else(|| p.provider.clone()),
            ),
            (None, _) => {
                return Err(HarnessError::invalid_field(
                    "model",
                    match &req.session_id {
                        Some(id) => format!(
                            "required: session '{id}' has no previous turn to inherit a model from"
                        ),
                        None => "required when the send creates a session".to_string(),
                    },
                ))
            }
        };
        // The skills filter is sticky; an explicit empty list resets it to every skill.
        let skills = match &o.skills {
            Some(names) if names.is_empty() => None,
            Some(names) => Some(names.clone()),
            None => prev_opts.and_then(|p| p.skills.clone()),
        };
        // The prompt is sticky: omitted prompt fields inherit the prior turn's resolved prompt
        // (and profile) verbatim; naming one, or a profile, resolves fresh. The mode is sticky
        // on its own: a send naming only `mode` swaps the paragraph heading the inherited
        // prompt, and a fresh prompt keeps the previous mode unless the send names one.
        let named = o.system_prompt.is_some() || o.system_prompt_strategy.is_some();
        let mode = o
            .mode
            .or_else(|| prev_opts.and_then(|p| p.mode))
            .filter(|m| *m != harness_types::api::Mode::Agent);
        let (system_prompt, prompt_shape, agent, mode) = match prev_opts {
            Some(p) if !named && profile.is_none() => {
                let reindexed = match o.skills {
                    Some(_) => self.reindexed(p, skills.as_deref()).await?,
                    None => None,
                };
                let (text, shape) = match reindexed {
                    Some((text, shape)) => (Some(text), Some(shape)),
                    None => (p.system_prompt.clone(), p.prompt_shape),
                };
                let (text, shape) = if o.mode.is_some() {
                    crate::prompt::remode(text, shape, p.mode, mode)
                        .map_err(|why| HarnessError::invalid_field("options.mode", why))?
                } else {
                    (text, shape)
                };
                (text, shape, p.agent.clone(), mode)
            }
            _ => {
                // An inherited mode cannot head a prompt this send disables.
                let mode = mode.filter(|_| {
                    o.system_prompt_strategy
                        != Some(harness_types::api::SystemPromptStrategy::Disabled)
                });
                let f = self
                    .fresh_prompt(PromptFields {
                        custom: o.system_prompt.as_deref(),
                        strategy: o.system_prompt_strategy.unwrap_or_default(),
                        agent: profile.as_ref(),
                        skills: skills.as_deref(),
                        skills_field: "options.skills",
                        mode,
                    })
                    .await?;
                (f.system_prompt, f.shape, f.agent, mode)
            }
        };
        let profile_effort = profile.as_ref().and_then(|p| p.reasoning_effort);
        // Reasoning is sticky as a whole: naming any of its fields resolves it fresh; a
        // profile's effort applies when the send names none.
        let (thinking_level, provider_options, reasoning) = if o.thinking_level.is_none()
            && o.provider_options.is_none()
            && o.reasoning.is_none()
        {
            if profile_effort.is_some() {
                (profile_effort, None, None)
            } else {
                prev_opts.map_or((None, None, None), |p| {
                    (p.thinking_level, p.provider_options.clone(), p.reasoning)
                })
            }
        } else {
            (
                o.thinking_level,
                o.provider_options
                    .clone()
                    .filter(|v| v.as_object().is_none_or(|m| !m.is_empty())),
                o.reasoning.as_deref().and_then(Reasoning::parse),
            )
        };
        Ok(TurnOptions {
            model,
            provider,
            system_prompt,
            max_turns: o.max_turns.unwrap_or(self.config().default_max_turns),
            max_output_tokens: o
                .max_output_tokens
                .or(prev_opts.and_then(|p| p.max_output_tokens)),
            thinking_level,
            provider_options,
            output: o.output.clone().unwrap_or_default(),
            max_validation_retries: o
                .max_validation_retries
                .or(Some(self.config().max_validation_retries)),
            // The ledger is named once the turn id is known (below).
            budget: (o.max_total_tokens.is_some() || o.max_cost_usd.is_some()).then(|| {
                crate::budget::Budget {
                    max_total_tokens: o.max_total_tokens,
                    max_cost_usd: o.max_cost_usd,
                    ledger: String::new(),
                }
            }),
            // Explicit, else sticky, else (for an identity picked to do something) the
            // configured baseline, else deny all.
            functions: o
                .functions
                .clone()
                .or_else(|| prev_opts.and_then(|p| p.functions.clone()))
                .or_else(|| {
                    profile
                        .as_ref()
                        .and_then(|_| self.config().default_functions.clone())
                }),
            metadata: o.metadata.clone(),
            max_transient_resumes: self.config().max_transient_resumes,
            reasoning,
            // Sticky like the policy: a named root wins, else the session keeps its own; only
            // a session's first turn takes the configured default.
            filesystem: match &o.filesystem_root {
                Some(p) => Some(fsroot::explicit("options.filesystem_root", p)?),
                None => match prev_opts {
                    Some(p) => p.filesystem.clone(),
                    None => fsroot::configured(self.config().default_filesystem_root.as_deref()),
                },
            },
            agent,
            skills,
            prompt_shape,
            mode,
            display: None,
            max_children: None,
            skills_seen: None,
            display_parent_session_id: None,
        })
    }
}

/// Where a child turn sits: its frozen options, its depth and the call waiting for it.
#[derive(Clone, Debug)]
pub(crate) struct Lineage {
    pub options: TurnOptions,
    pub depth: u32,
    pub parent: Option<harness_types::api::ParentLink>,
}

/// A send into a live turn cannot move its root: the turn's calls were stamped with the old
/// one, and a root changes only with a new turn. Refused by name rather than dropped.
fn refuse_root_change(live: &TurnRecord, named: Option<&fsroot::FsRoot>) -> Result<()> {
    match named {
        Some(root) if live.options.filesystem.as_ref().map(|r| &r.root) != Some(&root.root) => {
            Err(HarnessError::invalid_field(
                "options.filesystem_root",
                format!(
                    "session '{}' has a live turn working in {}; a root changes only with a new turn (send it after this one ends)",
                    live.session_id,
                    live.options
                        .filesystem
                        .as_ref()
                        .map_or("no root".to_string(), |r| format!("'{}'", r.root))
                ),
            ))
        }
        _ => Ok(()),
    }
}

/// A session created under a profile records what it froze of it, for clients that render
/// established sessions.
fn with_agent_metadata(mut req: SendRequest, frozen: &TurnOptions) -> SendRequest {
    let Some(agent) = &frozen.agent else {
        return req;
    };
    let mut init = req.session.take().unwrap_or_default();
    let mut metadata = match init.metadata.take() {
        Some(Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    };
    metadata.insert(
        "agent".into(),
        json!({
            "name": agent.name,
            "chain": agent.chain,
            "display": agent.display,
            "model": frozen.model,
            "thinking_level": frozen.thinking_level,
        }),
    );
    init.metadata = Some(Value::Object(metadata));
    req.session = Some(init);
    req
}

fn merged(session_id: &str, turn_id: String, queued: bool) -> SendResponse {
    SendResponse {
        session_id: session_id.to_string(),
        turn_id,
        accepted: true,
        merged: Some(true),
        queued: queued.then_some(true),
        ..SendResponse::default()
    }
}

#[cfg(test)]
mod steer_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use harness_types::message::UserMessage;
    use serde_json::json;

    #[test]
    fn roles_other_than_user_and_custom_are_refused_by_name() {
        let err = normalize_message(json!({"role": "assistant", "content": []})).unwrap_err();
        assert_eq!(err.code, ErrorCode::InvalidMessageRole);
        assert!(err.message.starts_with("message.role:"), "{err}");
        let err = normalize_message(json!({"role": "wizard"})).unwrap_err();
        assert_eq!(err.code, ErrorCode::InvalidMessageRole);
        let err = normalize_message(json!(5)).unwrap_err();
        assert!(
            err.to_string().contains("message: must be a string"),
            "{err}"
        );
    }

    #[test]
    fn a_malformed_user_message_names_the_inner_field() {
        let err =
            normalize_message(json!({"role": "user", "content": [{"type": "text", "text": 3}]}))
                .unwrap_err();
        assert_eq!(err.code, ErrorCode::InvalidRequest);
        assert!(
            err.message.starts_with("message.content[0]: invalid type"),
            "{err}"
        );
        let err = normalize_message(json!({"role": "user"})).unwrap_err();
        assert!(
            err.message.starts_with("message.content: missing field")
                || err.message.contains("missing field `content`"),
            "{err}"
        );
    }

    #[test]
    fn strings_become_user_text() {
        let m = normalize_message(json!("hi")).unwrap();
        assert!(matches!(m, AgentMessage::User(UserMessage { .. })));
        assert_eq!(m.text(), "hi");
    }
}
