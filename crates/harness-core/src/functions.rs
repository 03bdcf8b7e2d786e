//! The `harness::*` functions on the bus, and the trigger types the loop emits.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use harness_bus::typed::{self, schema};
use harness_bus::{FunctionDef, TriggerTypeDef};
use harness_types::api::*;
use harness_types::parse::parse_payload;
use harness_types::HarnessError;
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::harness::Harness;
use crate::topics;

/// A `harness::*` function: `f` gets a handle on the harness and the parsed request.
fn register_fn<Req, Resp, F, Fut>(h: &Harness, def: FunctionDef, f: F)
where
    Req: DeserializeOwned + JsonSchema + Send + 'static,
    Resp: Serialize + JsonSchema + 'static,
    F: Fn(Harness, Req) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, HarnessError>> + Send + 'static,
{
    typed::register(h.bus().as_ref(), def, h.clone(), f);
}

/// The `harness::on-config-change` payload.
#[derive(serde::Deserialize, JsonSchema)]
struct OnConfigChange {
    /// Configuration id that changed (advisory; the handler re-fetches).
    #[serde(default)]
    id: Option<String>,
    /// The new configuration itself (every field optional, defaults for the rest; unknown keys
    /// rejected). Without it the handler asks `configuration::get {id}` when one is registered.
    #[serde(default)]
    config: Option<Value>,
}

/// The `harness::on-functions-change` payload: the advisory engine event tag.
#[derive(serde::Deserialize, JsonSchema)]
struct OnFunctionsChange {
    /// Engine event tag (advisory: nothing is read from it).
    #[serde(default)]
    #[allow(dead_code)]
    event: Option<String>,
}

#[derive(Serialize, JsonSchema)]
struct OkResponse {
    ok: bool,
}

fn turn_event_filter_validator() -> harness_bus::bus::ConfigValidator {
    Arc::new(|config: &Value| {
        serde_json::from_value::<TurnEventFilter>(config.clone())
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
}

/// Registers the `harness::*` functions and the turn-event trigger types on the harness's bus.
pub fn register(h: &Harness) {
    register_fn(
        h,
        FunctionDef::new(
            "harness::send",
            "Entry point: ensure the session, persist the incoming message, and kick off a turn; returns fast (or merges into a running turn).",
        ),
        |h, req: SendRequest| async move { h.send(req).await },
    );
    register_fn(
        h,
        FunctionDef::new(
            "harness::spawn",
            "Spawn a sub-agent in a child session. From a turn the call waits for the child's result (options.detach: answer with the child's ids at once); its policy is the parent's, narrowed.",
        ),
        |h, req: SpawnRequest| async move { h.spawn(req).await },
    );
    register_fn(
        h,
        FunctionDef::new(
            crate::ask::ASK,
            "Ask the user a decision with discrete options, shown as a card: 1-4 questions, 2-4 options each (the UI adds a free-text Other). The turn ends on the question; the answer arrives as the user's next message. Only inside a model turn.",
        ),
        |_h, _req: AskRequest| async move {
            Err::<AskResponse, _>(HarnessError::invalid(crate::texts::ASK_OUTSIDE_A_TURN))
        },
    );
    register_fn(
        h,
        FunctionDef::new(
            "harness::status",
            "Read the current turn status for a session.",
        ),
        |h, req: StatusRequest| async move { h.status(req).await },
    );
    register_fn(
        h,
        FunctionDef::new(
            "harness::session-tree",
            "A session and its sub-agents' sessions, recursively, with each one's current turn and status.",
        ),
        |h, req: SessionTreeRequest| async move { h.session_tree(req).await },
    );
    register_fn(
        h,
        FunctionDef::new(
            "harness::metrics",
            "Counters over a session tree: sessions, turns, function calls and errors, tokens and cost (a sum only when every message reported it); complete once every turn of the tree has ended.",
        ),
        |h, req: MetricsRequest| async move { h.metrics(req).await },
    );
    register_fn(
        h,
        FunctionDef::new(
            "harness::usage::list",
            "Operator audit: every anonymous usage announcement this runtime recorded on harness:usage (progress milestones and first failures per root session: names, counters and a failure class, no ids or text), oldest first.",
        ),
        |h, req: crate::usage::UsageListRequest| async move { h.usage_list(req).await },
    );
    register_fn(
        h,
        FunctionDef::new(
            "harness::system-prompt::get",
            "Preview the layers of a system prompt (identity or agent profile, skills index, caller text, runtime context) without a model call: a session's frozen prompt, the prompt selected fields would freeze, or the built-in default (default_only).",
        ),
        |h, req: SystemPromptGetRequest| async move { h.system_prompt_get(req).await },
    );
    register_fn(
        h,
        FunctionDef::new(
            "harness::delete-session-tree",
            "Delete a session and every sub-agent session under it (its parent and siblings stay): cancels every member, waits for their turns to end, tells the surviving parent once, deletes child-first. Answers at once with the operation; follow harness::session-tree-deletion or poll harness::delete-session-tree-status. A failed attempt n is retried with attempt n+1.",
        ),
        |h, req: DeleteTreeRequest| async move { h.delete_session_tree(req).await },
    );
    register_fn(
        h,
        FunctionDef::new(
            "harness::delete-session-tree-status",
            "The state of a session tree deletion by operation id.",
        ),
        |h, req: DeleteTreeStatusRequest| async move { h.delete_session_tree_status(req).await },
    );
    register_fn(
        h,
        FunctionDef::new(
            "harness::session-deletion-step",
            "Internal durable deletion step (enqueued onto the harness-session-deletion queue); not called directly.",
        )
        .internal(),
        |h, req: crate::deletion::DeletionStep| async move { h.run_deletion(req).await },
    );
    register_fn(
        h,
        FunctionDef::new(
            "harness::context-policy",
            "Whether the session's (or a model's) context may prune aged, oversized function results; `set` changes it for a session (null returns it to the model's default).",
        ),
        |h, req: harness_types::context::ContextPolicyRequest| async move {
            h.context_policy(req).await
        },
    );
    register_fn(
        h,
        FunctionDef::new(
            "harness::filesystem::grant",
            "Grant a session an extra filesystem root beside its turn's root: an absolute, existing path (kept canonical) its fs::* and shell::* calls may reach from the next call on. The harness's data directory and configuration cannot be granted.",
        )
        .internal(),
        |h, req: crate::grants::GrantRequest| async move { h.filesystem_grant(req).await },
    );
    register_fn(
        h,
        FunctionDef::new(
            "harness::filesystem::grants",
            "The filesystem grants of a session.",
        )
        .internal(),
        |h, req: crate::grants::GrantsRequest| async move { h.filesystem_grants(req).await },
    );
    register_fn(
        h,
        FunctionDef::new(
            "harness::filesystem::revoke",
            "Revoke a session's filesystem grant; holds from the session's next fs::* or shell::* call.",
        )
        .internal(),
        |h, req: crate::grants::RevokeRequest| async move { h.filesystem_revoke(req).await },
    );
    register_fn(
        h,
        FunctionDef::new(
            "harness::filesystem::info",
            "The configured default filesystem root; with session_id, the root the session's turn froze and its grants.",
        )
        .internal(),
        |h, req: crate::grants::InfoRequest| async move { h.filesystem_info(req).await },
    );
    register_fn(
        h,
        FunctionDef::new(
            "harness::stop",
            "Request cancellation of an in-flight turn.",
        ),
        |h, req: StopRequest| async move { h.stop(req).await },
    );
    register_fn(
        h,
        FunctionDef::new(
            "harness::turn",
            "Internal durable loop step (enqueued onto the harness-turn queue); not called directly.",
        )
        .internal(),
        |h, req: TurnStepPayload| async move { run_step(&h, req).await },
    );
    register_fn(
        h,
        FunctionDef::new(
            "harness::function::resolve",
            "Internal: settle a pending call's result (or release a held call) and resume the parked turn.",
        )
        .internal(),
        |h, req: ResolveRequest| async move {
            crate::deferred::check_resolve(&req)?;
            h.resolve(req).await
        },
    );
    register_fn(
        h,
        FunctionDef::new(
            "harness::function::trigger",
            "Internal: run the dispatch pipeline (policy, pre-trigger hooks, target, post-trigger hooks) for one already-unwrapped call.",
        )
        .internal(),
        |h, req: FunctionTriggerRequest| async move { h.function_trigger(req).await },
    );
    register_fn(
        h,
        FunctionDef::new(
            "harness::sweep-pending",
            "Internal cron target: settle pending calls past their timeout (hook holds never expire).",
        )
        .internal(),
        |h, req: SweepRequest| async move { h.sweep_pending(req).await },
    );
    register_fn(
        h,
        FunctionDef::new(
            "harness::on-functions-change",
            "Internal: the function registry changed; later steps tell the model its fetched contracts may be stale.",
        )
        .internal(),
        |h, _req: OnFunctionsChange| async move {
            h.functions_changed();
            Ok(OkResponse { ok: true })
        },
    );
    register_fn(
        h,
        FunctionDef::new(
            "harness::on-config-change",
            "Internal: apply a changed configuration (given, or re-fetched from configuration::get); re-binds the sweep cron when sweep_expression changed.",
        )
        .internal(),
        |h, req: OnConfigChange| async move {
            let value = match req.config {
                Some(v) => Some(v),
                None => {
                    let id = req.id.unwrap_or_else(|| "harness".into());
                    match h.bus().call("configuration::get", serde_json::json!({ "id": id }), None).await {
                        Ok(v) if v.is_object() => Some(v.get("value").filter(|x| x.is_object()).cloned().unwrap_or(v)),
                        Ok(_) => None,
                        Err(e) if e.is_not_found() => None,
                        Err(e) => return Err(e.into_harness()),
                    }
                }
            };
            if let Some(v) = value {
                let config: crate::HarnessConfig = parse_payload(v).map_err(|e| HarnessError::invalid(format!("config.{}", e.message)))?;
                h.reconfigure(config).await?;
            }
            Ok(OkResponse { ok: true })
        },
    );
    h.bus().register_trigger_type(TriggerTypeDef {
        id: topics::SESSION_TREE_DELETION.into(),
        description: "A session tree deletion changed state (deleting, then completed or failed); correlate by operation_id and attempt.".into(),
        config_schema: schema::<DeletionEventFilter>(),
        validate: Some(Arc::new(|config: &Value| {
            serde_json::from_value::<DeletionEventFilter>(config.clone())
                .map(|_| ())
                .map_err(|e| e.to_string())
        })),
    });
    for t in crate::hooks::trigger_types() {
        h.bus().register_trigger_type(t);
    }
    for (id, description) in [
        (
            topics::TURN_STARTED,
            "A harness turn began executing (first loop step).",
        ),
        (
            topics::TURN_COMPLETED,
            "A harness turn reached a terminal status (completed/cancelled/failed).",
        ),
    ] {
        h.bus().register_trigger_type(TriggerTypeDef {
            id: id.into(),
            description: description.into(),
            config_schema: schema::<TurnEventFilter>(),
            validate: Some(turn_event_filter_validator()),
        });
    }
}

/// A step with in-place retries for a dependency that is (re)starting; any other error fails
/// the turn with a durable error record instead of leaving it running.
async fn run_step(h: &Harness, req: TurnStepPayload) -> Result<TurnStepResult, HarnessError> {
    let mut attempt = 0;
    let started = std::time::Instant::now();
    h.mark_step_start(&req.turn_id, req.step);
    loop {
        match Box::pin(h.step(req.clone())).await {
            Ok(r) => {
                h.observe_step(&req, crate::trace::step_outcome(&r), started);
                return Ok(r);
            }
            Err(e)
                if matches!(
                    e.code,
                    harness_types::ErrorCode::FunctionNotFound | harness_types::ErrorCode::Timeout
                ) && attempt < 10 =>
            {
                attempt += 1;
                tracing::warn!(session = %req.session_id, "step hit a transient dependency error, retrying: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => {
                tracing::error!(session = %req.session_id, turn = %req.turn_id, "step failed: {e}");
                Box::pin(h.fail_turn(&req, &e)).await?;
                h.observe_step(&req, "failed", started);
                return Ok(TurnStepResult {
                    session_id: req.session_id,
                    status: TurnStatus::Failed,
                    next_step: None,
                    skipped: false,
                });
            }
        }
    }
}
