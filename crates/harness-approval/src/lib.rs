//! The approval gate: `approval::gate`, `approval::list`, `approval::decide`.
//!
//! A sibling of the loop, spoken to only through a `dyn Bus`. [`install`] registers the three
//! functions and binds `approval::gate` to `harness::hook::pre-trigger` for the configured
//! function globs. When the loop is about to run a matching call, the gate writes a pending
//! approval durably (state scope [`SCOPE`]) and answers `hold`: the call is checkpointed pending
//! and the turn parks in `awaiting_functions`, holding no step, for as long as it takes (hook
//! holds never time out) and across restarts.
//!
//! `approval::list` shows the pending approvals with the exact arguments and their `digest`.
//! `approval::decide {approval_id, decision: approve|deny, digest, reason?}` settles one through
//! `harness::function::resolve`: approve → `execute` (the rest of the pre-trigger chain, the
//! target, post-trigger, the result; the turn resumes), deny → `deliver` an `is_error` result
//! "denied by the approver: <reason>". A decision must quote the digest it was shown and is
//! consumed once: other arguments, or a second decision, are refused.
//!
//! The gate binds at a high priority ([`GATE_PRIORITY`]) so it runs after the hooks that rewrite
//! arguments: what it shows is what runs. (A hook bound after it could still rewrite them.)

mod approvals;
mod digest;
mod error;
mod types;

use std::sync::Arc;

use globset::Glob;
use harness_bus::typed::{self, schema};
use harness_bus::{Bus, BusError, CallContext, FunctionDef, Handler};
use harness_types::parse::parse_payload;
use serde_json::{json, Value};

pub use approvals::{Approvals, DECIDED, REQUESTED};
pub use digest::{approval_id, digest};
pub use error::ApprovalError;
pub use types::*;

pub const GATE: &str = "approval::gate";
pub const LIST: &str = "approval::list";
pub const DECIDE: &str = "approval::decide";
pub const PRUNE: &str = "approval::prune";
/// The hook point the gate is bound to.
pub const PRE_TRIGGER: &str = "harness::hook::pre-trigger";
/// State scope of the approval records, keyed by `approval_id`.
pub const SCOPE: &str = "approvals";
/// Late in the pre-trigger chain: argument rewriters (priority 0 by default) run first.
pub const GATE_PRIORITY: i64 = 1_000_000;

/// `approval::decide` also reads who calls it (the call's context), which the typed
/// registration does not pass on: it is the one function registered by hand.
fn register_decide(bus: &dyn Bus, approvals: &Approvals) {
    let def = FunctionDef::new(
        DECIDE,
        "Approve (run the held call) or deny (deliver a denial) one pending approval; quote the digest you were shown. Consumed once.",
    )
    .schemas(schema::<DecideRequest>(), schema::<DecideResponse>())
    .internal();
    let approvals = approvals.clone();
    let handler = move |payload: Value, ctx: CallContext| {
        let approvals = approvals.clone();
        async move {
            let req: DecideRequest = parse_payload(payload)?;
            if ctx
                .metadata
                .get("function_call_id")
                .is_some_and(|v| !v.is_null())
            {
                // The loop puts the call id in the metadata of a model's function call.
                return Err(ApprovalError::invalid(
                    "approval_id",
                    "approvals are decided by a person, not by an agent's function call",
                )
                .into());
            }
            let resp = approvals.decide(req).await?;
            serde_json::to_value(resp).map_err(|e| BusError::internal(e.to_string()))
        }
    };
    bus.register_function(def, Arc::new(handler) as Arc<dyn Handler>);
}

/// Registers `approval::*` on `bus` and makes `approval::gate` the pre-trigger hook for
/// `functions` (globs), idempotently: bindings persist across restarts, so an existing binding
/// with the same globs is kept, one with other globs is replaced (the new one is bound first, so
/// no call slips through in between), and an empty `functions` removes the binding while
/// keeping `approval::list` / `approval::decide` so approvals left from an earlier run can
/// still be decided. Call it after the `harness::*` functions are registered (the hook trigger
/// types must exist) and before the loop starts taking steps.
pub async fn install(
    bus: Arc<dyn Bus>,
    functions: Vec<String>,
) -> Result<Approvals, ApprovalError> {
    for (i, g) in functions.iter().enumerate() {
        if g.trim().is_empty() {
            return Err(ApprovalError::invalid(
                format!("functions[{i}]"),
                "must not be empty",
            ));
        }
        Glob::new(g).map_err(|e| {
            ApprovalError::invalid(
                format!("functions[{i}]"),
                format!("invalid glob '{g}': {e}"),
            )
        })?;
    }
    let approvals = Approvals::new(bus.clone());
    typed::register(
        bus.as_ref(),
        FunctionDef::new(
            GATE,
            "Pre-trigger hook: records the call as a pending approval, durably, and holds it until approval::decide.",
        )
        .internal(),
        approvals.clone(),
        |a, req: GateInput| async move { a.gate(req).await },
    );
    typed::register(
        bus.as_ref(),
        FunctionDef::new(
            LIST,
            "Pending approvals (optionally of one session), oldest first, with the exact arguments and their digest.",
        )
        .internal(),
        approvals.clone(),
        |a, req: ListRequest| async move { a.list(req).await },
    );
    register_decide(bus.as_ref(), &approvals);
    typed::register(
        bus.as_ref(),
        FunctionDef::new(
            PRUNE,
            "Retention: delete decided and expired approvals decided at least older_than_ms ago (the loop's sweep calls it); pending ones stay.",
        )
        .internal(),
        approvals.clone(),
        |a, req: PruneRequest| async move { a.prune(req).await },
    );
    ensure_binding(bus.as_ref(), functions).await?;
    Ok(approvals)
}

async fn ensure_binding(bus: &dyn Bus, functions: Vec<String>) -> Result<(), ApprovalError> {
    let existing: Vec<harness_bus::Binding> = bus
        .bindings(PRE_TRIGGER)
        .await?
        .into_iter()
        .filter(|b| b.function_id == GATE)
        .collect();
    let wanted = json!({"functions": functions, "priority": GATE_PRIORITY});
    let mut keep = if functions.is_empty() {
        None
    } else {
        existing
            .iter()
            .find(|b| b.config == wanted)
            .map(|b| b.id.clone())
    };
    if keep.is_none() && !functions.is_empty() {
        let out = bus
            .call(
                "engine::register_trigger",
                json!({"trigger_type": PRE_TRIGGER, "function_id": GATE, "config": wanted}),
                None,
            )
            .await?;
        keep = out["id"].as_str().map(str::to_string);
    }
    for b in existing {
        if Some(&b.id) != keep.as_ref() {
            bus.call("engine::unregister_trigger", json!({"id": b.id}), None)
                .await?;
        }
    }
    Ok(())
}
