//! The harness turn loop.
//!
//! A message arrives through [`Harness::send`]; it is persisted, a turn record is seeded, and
//! step 0 is enqueued on the `harness-turn` queue. Each step ([`Harness::step`]) drains steering
//! messages, assembles the context, streams one generation into a pre-appended assistant entry,
//! closes the function calls the model made, and either advances (enqueues the next step) or
//! finalizes the turn. Every write has a deterministic id, so a redelivered step rewrites the
//! same entries instead of adding new ones.
//!
//! Architecture invariant: this crate performs I/O only through a `dyn Bus`. It does not know
//! whether it runs embedded or on an iii engine.

mod ask;
mod budget;
mod config;
mod context;
mod context_policy;
mod deferred;
mod deletion;
mod dispatch;
mod events;
pub mod failpoint;
mod finalize;
mod first_write;
mod fsroot;
mod functions;
pub mod grants;
mod harness;
mod hooks;
mod identity;
#[cfg(test)]
mod import_loops;
mod interpret;
mod locks;
mod observe;
// The machines and the record live in `harness-machine`; their old paths stay.
pub(crate) use harness_machine::{machine, output, record};

/// Every text the loop writes for a person or the model to read.
pub use harness_machine::texts;
mod prompt;
mod recent;
mod record_memo;
mod recover;
mod retention;
mod send;
mod spawn;
mod start;
mod status;
mod steering;
mod step;
mod stop;
mod stream;
pub mod trace;
mod transcript;
mod tree;
pub mod usage;

pub use config::{CallReconciliation, ConfigError, HarnessConfig};
pub use deletion::DELETION_QUEUE;
pub use dispatch::{model_verdict, provenance, wall};
pub use functions::register;
pub use harness::Harness;
pub use prompt::IDENTITY;
pub use record::{
    CallCheckpoint, CallState, ChildLink, FailedCall, Failure, FailurePhase, Hold, HoldPoint,
    Reasoning, TurnOptions, TurnRecord, TurnStopReason, Wait,
};
pub use spawn::subagent_policy;

/// The queue every step runs on: FIFO per `session_id`, sessions in parallel.
pub const TURN_QUEUE: &str = "harness-turn";
/// State scope of the turn records (one per session, keyed by session id).
pub const TURN_SCOPE: &str = "harness_turn";
/// State scope of idempotency rows.
pub const IDEM_SCOPE: &str = "harness_idem";

/// Topics (trigger types) of the events the loop emits.
pub mod topics {
    pub const TURN_STARTED: &str = "harness::turn-started";
    pub const TURN_COMPLETED: &str = "harness::turn-completed";
    pub const MESSAGE_QUEUED: &str = "harness::message-queued";
    pub const SESSION_TREE_DELETION: &str = "harness::session-tree-deletion";
}
