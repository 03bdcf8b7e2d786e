//! Sub-agents: `harness::spawn` starts a turn in a child session through the same deliver path
//! as a send. From a turn, the parent's call waits by default (pending, the turn parks) until the
//! child's turn ends and its result comes back as the call's result; `options.detach` answers at
//! once with the child's ids instead. A child can never do more than its parent allowed.

use harness_types::api::{
    FunctionPolicy, ParentLink, SendOptions, SendRequest, SessionInit, SpawnRequest, SpawnResponse,
    TurnStatus,
};
use harness_types::message::ContentBlock;
use harness_types::{now_ms, ErrorCode, HarnessError};
use serde_json::{json, Value};

use crate::dispatch::{CallEnd, PlannedCall, SPAWN};
use crate::harness::{Harness, Result};
use crate::record::{CallCheckpoint, ChildLink, TurnOptions, TurnRecord, Wait};
use crate::send::Lineage;

/// Denied to every child unless it is spawned as an orchestrator: a leaf cannot fan out.
const LEAF_WALL: &[&str] = &["harness::spawn", "harness::send"];

/// Whether a parent allow glob covers a child's (conservatively: equal, `*`, or a `prefix::*`
/// whose prefix starts the child's glob).
fn covered(parent_allow: &[String], glob: &str) -> bool {
    parent_allow.iter().any(|p| {
        p == glob
            || p == "*"
            || p.strip_suffix('*')
                .is_some_and(|prefix| prefix.ends_with("::") && glob.starts_with(prefix))
    })
}

/// The child's policy: what it asked for, narrowed to what the parent may do; deny lists add up;
/// an un-empowered parent cannot empower a child; leaves get the wall.
pub(crate) fn child_policy(
    parent: Option<&FunctionPolicy>,
    requested: Option<&FunctionPolicy>,
    orchestrator: bool,
    parentless: bool,
) -> Option<FunctionPolicy> {
    let mut policy = match (parent, requested) {
        _ if parentless => requested.cloned()?,
        (None, _) => return None,
        (Some(p), None) => p.clone(),
        (Some(p), Some(r)) => FunctionPolicy {
            allow: if r.allow.is_empty() {
                p.allow.clone()
            } else {
                r.allow
                    .iter()
                    .filter(|g| covered(&p.allow, g))
                    .cloned()
                    .collect()
            },
            deny: p.deny.iter().chain(r.deny.iter()).cloned().collect(),
            expose: r.expose,
        },
    };
    if !orchestrator {
        for w in LEAF_WALL {
            if !policy.deny.iter().any(|d| d == w) {
                policy.deny.push(w.to_string());
            }
        }
    }
    Some(policy)
}

/// The policy a sub-agent of a turn running under `parent` gets when its spawn names none:
/// the parent's, walled unless it is an orchestrator.
pub fn subagent_policy(
    parent: Option<&FunctionPolicy>,
    orchestrator: bool,
) -> Option<FunctionPolicy> {
    child_policy(parent, None, orchestrator, false)
}

/// A spawn's `display`, checked and normalized: the name trimmed (1 to 48 characters), the
/// icon from its closed set (checked when parsed), an unknown color shown as `neutral`.
fn spawn_display(
    d: &harness_types::api::SpawnDisplay,
) -> Result<harness_types::directory::Display> {
    use harness_types::directory::{Color, Display};
    let name = d.name.trim();
    let chars = name.chars().count();
    if chars == 0 || chars > 48 {
        return Err(HarnessError::invalid_field(
            "display.name",
            format!("must be 1 to 48 characters once trimmed (got {chars})"),
        ));
    }
    let color = d
        .color
        .as_deref()
        .and_then(|c| serde_json::from_value::<Color>(json!(c.trim().to_lowercase())).ok())
        .unwrap_or(Color::Neutral);
    Ok(Display {
        name: Some(name.to_string()),
        icon: d.icon,
        color: Some(color),
    })
}

/// What a finished child hands back to the call that waited for it.
pub(crate) fn child_outcome(child: &TurnRecord) -> (Vec<ContentBlock>, bool, Value) {
    match child.status {
        TurnStatus::Completed => {
            let result = child.result.clone().unwrap_or(Value::Null);
            let text = match &result {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            (vec![ContentBlock::text(text)], false, result)
        }
        status => {
            let reason = child
                .result_error
                .clone()
                .unwrap_or_else(|| format!("the sub-agent's turn ended {}", status.as_str()));
            (
                vec![ContentBlock::text(format!(
                    "the sub-agent's turn {}: {reason}",
                    status.as_str()
                ))],
                true,
                json!({"error": status.as_str(), "message": reason}),
            )
        }
    }
}

impl Harness {
    /// `harness::spawn` called directly (no parent turn): the child's policy is exactly what the
    /// request names (none = deny all), walled unless it is an orchestrator.
    pub async fn spawn(&self, req: SpawnRequest) -> Result<SpawnResponse> {
        self.seed_child(req, None).await
    }

    async fn seed_child(
        &self,
        req: SpawnRequest,
        parent: Option<(&TurnRecord, &str)>,
    ) -> Result<SpawnResponse> {
        let o = req.options.clone().unwrap_or_default();
        let display = req.display.as_ref().map(spawn_display).transpose()?;
        // Only a spawn called directly names one: from a turn the parent is the turn, never an
        // argument. A self-parent is dropped (its events would name it as its own child).
        let display_parent = match (&req.parent_session_id, parent) {
            (Some(p), None) if p.is_empty() => {
                return Err(HarnessError::invalid_field(
                    "parent_session_id",
                    "must not be empty",
                ))
            }
            (Some(p), None) if req.session_id.as_ref() != Some(p) => Some(p.clone()),
            _ => None,
        };
        crate::identity::check_mode("options.mode", o.mode, o.system_prompt_strategy)?;
        let mut reused = false;
        if let (Some((p, _)), Some(id)) = (parent, &req.session_id) {
            // Only the caller's own tree may be reused: its own session (the task merges into
            // its own turn) or a sub-agent it started. Anything else belongs to someone else.
            reused = *id == p.session_id || self.owned_child(id, &p.session_id).await?;
        }
        let parent_opts = parent.map(|(p, _)| &*p.options);
        let prompt_named = o.system_prompt.is_some() || o.system_prompt_strategy.is_some();
        if req.agent.is_some() && prompt_named {
            return Err(crate::identity::agent_with_prompt_fields("agent"));
        }
        if req.agent.as_deref() == Some("") {
            return Err(HarnessError::invalid_field("agent", "must not be empty"));
        }
        // A spawn naming no profile continues the parent turn's (re-resolved, so the child gets
        // its own preloaded blocks), unless its own prompt fields shed it.
        let agent_name = req.agent.clone().or_else(|| {
            (!prompt_named)
                .then(|| parent_opts.and_then(|p| p.agent.as_ref().map(|a| a.name.clone())))
                .flatten()
        });
        let (profile, profile_model) = self.named_profile("agent", agent_name.as_deref()).await?;
        let (model, provider) = match (&req.model, parent_opts) {
            (Some(m), _) if !m.is_empty() => (m.clone(), req.provider.clone()),
            // Never the parent's provider on the profile's (possibly foreign) model.
            (None, _) if profile_model.is_some() => {
                let (m, p) = profile_model.clone().unwrap_or_default();
                (m, req.provider.clone().or(p))
            }
            (None, Some(p)) => (
                p.model.clone(),
                req.provider.clone().or_else(|| p.provider.clone()),
            ),
            _ => {
                return Err(HarnessError::invalid_field(
                    "model",
                    "required when the spawn has no parent turn to inherit one from",
                ))
            }
        };
        let default_turns = self.config().default_max_turns;
        let default_functions = self.config().default_functions.clone();
        let max_turns = match parent {
            Some((p, _)) => o
                .max_turns
                .unwrap_or(default_turns)
                .min(p.options.max_turns.saturating_sub(p.turn_count))
                .max(1),
            None => o.max_turns.unwrap_or(default_turns).max(1),
        };
        let skills = o.skills.clone().filter(|s| !s.is_empty());
        let frozen = self
            .fresh_prompt(crate::identity::PromptFields {
                custom: o.system_prompt.as_deref(),
                strategy: o.system_prompt_strategy.unwrap_or_default(),
                agent: profile.as_ref(),
                skills: skills.as_deref(),
                skills_field: "options.skills",
                mode: o.mode,
            })
            .await?;
        let options = TurnOptions {
            model,
            provider,
            system_prompt: frozen.system_prompt,
            max_turns,
            max_output_tokens: o
                .max_output_tokens
                .or(parent_opts.and_then(|p| p.max_output_tokens)),
            thinking_level: o
                .thinking_level
                .or(profile.as_ref().and_then(|p| p.reasoning_effort))
                .or(parent_opts.and_then(|p| p.thinking_level)),
            provider_options: None,
            output: o.output.clone().unwrap_or_default(),
            max_validation_retries: o
                .max_validation_retries
                .or(Some(self.config().max_validation_retries)),
            // A child spends from its parent's budget and can never widen it.
            budget: parent_opts.and_then(|p| p.budget.clone()),
            functions: child_policy(
                parent_opts.and_then(|p| p.functions.as_ref()),
                // A parentless spawn that names no policy gets the operator's baseline.
                o.functions.as_ref().or(match parent {
                    None => default_functions.as_ref(),
                    Some(_) => None,
                }),
                o.orchestrator == Some(true),
                parent.is_none(),
            ),
            metadata: None,
            max_transient_resumes: self.config().max_transient_resumes,
            reasoning: None,
            filesystem: child_root(o.filesystem_root.as_deref(), parent_opts)?,
            agent: frozen.agent,
            skills,
            prompt_shape: frozen.shape,
            mode: o.mode.filter(|m| *m != harness_types::api::Mode::Agent),
            display: display.clone(),
            // The child's own fan-out: what the spawn asks, never more than the operator allows.
            max_children: o.max_children,
            skills_seen: None,
            display_parent_session_id: display_parent.clone(),
        };
        let depth = parent.map_or(0, |(p, _)| p.depth + 1);
        let link = parent.map(|(p, call_id)| ParentLink {
            session_id: p.session_id.clone(),
            turn_id: p.turn_id.clone(),
            function_call_id: call_id.to_string(),
        });
        let mut metadata = json!({
            "parent_session_id": link.as_ref().map(|l| &l.session_id).or(display_parent.as_ref()),
            "parent_turn_id": link.as_ref().map(|l| &l.turn_id),
            "function_call_id": link.as_ref().map(|l| &l.function_call_id),
            "depth": depth,
            "spawned_by": if parent.is_some() { "agent" } else { "caller" },
        });
        if let Some(d) = &display {
            metadata["subagent_display"] = json!(d);
        }
        let send = SendRequest {
            session_id: req.session_id.clone(),
            message: req.task.clone(),
            model: Some(options.model.clone()),
            provider: options.provider.clone(),
            idempotency_key: None,
            session: Some(SessionInit {
                // Applied only when the send creates the session: a reused one keeps its title.
                title: display.as_ref().and_then(|d| d.name.clone()),
                metadata: Some(metadata),
                kind: Some("subagent".into()),
            }),
            options: Some(SendOptions::default()),
        };
        let out = self
            .send_child(
                send,
                Lineage {
                    options,
                    depth,
                    parent: link,
                },
            )
            .await?;
        Ok(SpawnResponse {
            child_session_id: out.session_id,
            child_turn_id: out.turn_id,
            reused: reused.then_some(true),
        })
    }

    /// Whether `session_id` is an existing sub-agent of `parent_session_id`; `false` when it does
    /// not exist yet. Refuses a session another tree owns, naming the owner.
    async fn owned_child(&self, session_id: &str, parent_session_id: &str) -> Result<bool> {
        let found: Option<harness_types::session::GetResponse> = self
            .call("session::get", &json!({"session_id": session_id}))
            .await?;
        let Some(found) = found else {
            return Ok(false);
        };
        let owner = found
            .meta
            .metadata
            .get("parent_session_id")
            .and_then(Value::as_str);
        if owner == Some(parent_session_id) {
            return Ok(true);
        }
        let whose = match owner {
            Some(o) => format!("belongs to the agent tree of session '{o}'"),
            None => "is a top-level session of its own".to_string(),
        };
        Err(HarnessError::invalid_field(
            "session_id",
            format!(
                "session '{session_id}' {whose}; a turn may reuse only its own session or a sub-agent it started"
            ),
        ))
    }

    /// The spawn path of a call from a turn: guards, the child, then either a pending call the
    /// child's end resolves, or (detached) an answer with the child's ids at once.
    pub(crate) async fn spawn_from_call(
        &self,
        rec: &mut TurnRecord,
        call: &PlannedCall,
        arguments: Value,
        origin: Value,
    ) -> Result<CallEnd> {
        let refuse = |code: ErrorCode, text: String| {
            (
                vec![ContentBlock::text(text.clone())],
                json!({"error": code.as_str(), "message": text}),
            )
        };
        // serde stops at the first unknown field; a model that misspelt `task` is told both.
        let missing_task = arguments.get("task").is_none();
        let req: SpawnRequest = match harness_types::parse::parse_payload(arguments) {
            Ok(r) => r,
            Err(e) => {
                let why = if missing_task && !e.message.starts_with("task:") {
                    format!("task: missing field `task`; {}", e.message)
                } else {
                    e.message
                };
                let (c, d) = refuse(ErrorCode::InvalidRequest, crate::texts::spawn_invalid(&why));
                self.append_result(rec, call, c, d, true, origin).await?;
                return Ok(CallEnd::Closed);
            }
        };
        let max_depth = self.config().max_depth;
        if rec.depth + 1 > max_depth {
            let (c, d) = refuse(
                ErrorCode::SpawnDepthExceeded,
                crate::texts::spawn_too_deep(rec.depth + 1, max_depth),
            );
            self.append_result(rec, call, c, d, true, origin).await?;
            return Ok(CallEnd::Closed);
        }
        let created = rec.calls.values().filter(|c| c.child().is_some()).count() as u32;
        let max_children = rec
            .options
            .max_children
            .map_or(self.config().max_children, |m| {
                m.min(self.config().max_children)
            });
        if created >= max_children {
            let (c, d) = refuse(
                ErrorCode::SpawnFanoutExceeded,
                crate::texts::spawn_fanout(created, max_children),
            );
            self.append_result(rec, call, c, d, true, origin).await?;
            return Ok(CallEnd::Closed);
        }
        // A task for the caller's own session merges into its own running turn: there is no
        // child to wait for, so it answers at once like a detached spawn.
        let own = req.session_id.as_deref() == Some(rec.session_id.as_str());
        let detach = own || req.options.as_ref().and_then(|o| o.detach) == Some(true);
        let timeout = req.options.as_ref().and_then(|o| o.pending_timeout_ms);
        let parent = rec.clone();
        let child = match self.seed_child(req, Some((&parent, &call.id))).await {
            Ok(c) => c,
            Err(e) => {
                let (c, d) = refuse(e.code, crate::texts::spawn_failed(&e.to_string()));
                self.append_result(rec, call, c, d, true, origin).await?;
                return Ok(CallEnd::Closed);
            }
        };
        if detach {
            let reused = child.reused == Some(true);
            let mut text = json!({"child_session_id": child.child_session_id, "child_turn_id": child.child_turn_id}).to_string();
            if own {
                text.push_str(crate::texts::SPAWN_MERGED);
            } else if reused {
                text.push_str(crate::texts::SPAWN_REUSED);
            }
            let details = json!({"child_session_id": child.child_session_id, "child_turn_id": child.child_turn_id, "detached": true, "reused": reused});
            self.append_result(
                rec,
                call,
                vec![ContentBlock::text(text)],
                details,
                false,
                origin,
            )
            .await?;
            // The own session is no child: it is neither stopped with this turn nor counted.
            if let Some(CallCheckpoint::Done { child: link, .. }) =
                rec.calls.get_mut(&call.id).filter(|_| !own)
            {
                *link = Some(ChildLink {
                    session_id: child.child_session_id,
                    turn_id: child.child_turn_id,
                });
            }
            self.save_record(rec).await?;
            return Ok(CallEnd::Closed);
        }
        let cp = CallCheckpoint::Pending {
            function_id: SPAWN.to_string(),
            since: Some(now_ms()),
            timeout_ms: timeout,
            wait: Wait::Child {
                child: ChildLink {
                    session_id: child.child_session_id,
                    turn_id: child.child_turn_id,
                },
                origin: Some(origin),
            },
        };
        rec.calls.insert(call.id.clone(), cp);
        self.save_record(rec).await?;
        Ok(CallEnd::Held)
    }

    /// A child's end: hand its outcome to the parent's waiting call, outside the child's lock
    /// (the parent's lock is taken by the resolve). If this is lost in a crash, the sweep (and
    /// every start) settles the call from the child's record.
    pub(crate) async fn answer_parent(&self, child: &TurnRecord) {
        let Some(parent) = &child.parent else { return };
        let (content, is_error, details) = child_outcome(child);
        self.inner
            .bus
            .call_void(
                "harness::function::resolve",
                json!({"session_id": parent.session_id, "turn_id": parent.turn_id, "function_call_id": parent.function_call_id,
                       "action": "deliver", "content": content, "is_error": is_error, "details": details}),
            )
            .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(allow: &[&str], deny: &[&str]) -> FunctionPolicy {
        FunctionPolicy {
            allow: allow.iter().map(|s| s.to_string()).collect(),
            deny: deny.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_child_never_gets_more_than_its_parent() {
        let parent = p(&["shell::*", "web::fetch"], &["shell::rm"]);
        let child = child_policy(
            Some(&parent),
            Some(&p(&["shell::fs::*", "db::*", "*"], &["web::fetch"])),
            false,
            false,
        )
        .unwrap();
        assert_eq!(
            child.allow,
            vec!["shell::fs::*".to_string()],
            "uncovered globs are dropped, a wider `*` too"
        );
        assert_eq!(
            child.deny,
            vec!["shell::rm", "web::fetch", "harness::spawn", "harness::send"]
        );
        let inherited = child_policy(Some(&parent), None, true, false).unwrap();
        assert_eq!(
            (inherited.allow, inherited.deny),
            (parent.allow.clone(), parent.deny.clone()),
            "an orchestrator has no wall"
        );
        assert_eq!(
            child_policy(None, Some(&p(&["*"], &[])), false, false),
            None,
            "an un-empowered parent cannot empower"
        );
        let all = child_policy(
            Some(&p(&["shell::*"], &[])),
            Some(&p(&["*"], &[])),
            false,
            false,
        )
        .unwrap();
        assert!(
            all.allow.is_empty(),
            "a requested * under shell::* collapses to nothing"
        );
    }

    #[test]
    fn parentless_spawns_take_exactly_what_they_name() {
        assert_eq!(child_policy(None, None, false, true), None);
        let named = child_policy(None, Some(&p(&["a::*"], &[])), false, true).unwrap();
        assert_eq!(
            (named.allow, named.deny.len()),
            (vec!["a::*".to_string()], 2)
        );
    }
}

/// A child's root: the one its spawn names, else its parent's. From a turn the named root must
/// lie under the parent's, so a model cannot widen its reach by spawning.
fn child_root(
    named: Option<&str>,
    parent: Option<&TurnOptions>,
) -> Result<Option<crate::fsroot::FsRoot>> {
    let Some(path) = named else {
        return Ok(parent.and_then(|p| p.filesystem.clone()));
    };
    let root = crate::fsroot::explicit("options.filesystem_root", path)?;
    if let Some(p) = parent {
        if !p
            .filesystem
            .as_ref()
            .is_some_and(|pr| crate::fsroot::within(&root, pr))
        {
            return Err(HarnessError::invalid_field(
                "options.filesystem_root",
                format!(
                    "'{path}' is not under the parent's root ({}); a sub-agent can only be given part of it",
                    p.filesystem.as_ref().map_or("none", |r| r.root.as_str())
                ),
            ));
        }
    }
    Ok(Some(root))
}

#[cfg(test)]
mod root_tests {
    use super::*;

    #[test]
    fn a_child_gets_its_parents_root_or_a_part_of_it_never_more() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("sub")).unwrap();
        let parent_root = crate::fsroot::explicit("r", dir.path().to_str().unwrap()).unwrap();
        let parent = TurnOptions {
            filesystem: Some(parent_root.clone()),
            ..TurnOptions::default()
        };
        assert_eq!(child_root(None, Some(&parent)).unwrap(), Some(parent_root));
        let sub = dir.path().join("sub");
        let got = child_root(Some(sub.to_str().unwrap()), Some(&parent))
            .unwrap()
            .unwrap();
        assert!(got.root.ends_with("/sub"), "{got:?}");
        let e = child_root(Some("/"), Some(&parent)).unwrap_err();
        assert!(
            e.message
                .starts_with("options.filesystem_root: '/' is not under the parent's root"),
            "{e}"
        );
        let rootless = TurnOptions::default();
        assert!(child_root(Some(sub.to_str().unwrap()), Some(&rootless)).is_err());
        // A direct spawn (the operator) names any existing absolute directory.
        assert!(child_root(Some("/"), None).unwrap().is_some());
    }
}
