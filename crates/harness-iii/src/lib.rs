//! The harness [`Bus`](harness_bus::Bus) over an iii engine, through the `iii-sdk` crate.
//!
//! `harness worker --engine ws://…` builds the same loop and siblings as `harness serve`, on an
//! [`IiiBus`] instead of the embedded bus. Nothing in the loop knows which bus it has.
//!
//! # How each Bus operation maps onto the engine
//!
//! | Bus | on iii |
//! |---|---|
//! | `call`, `call_with_metadata`, `call_void` | `invokefunction` through the engine (`trigger`, action none / `void`); the metadata rides in the invocation's `metadata` sidecar |
//! | `call_streaming` (`router::chat`) | a plain invocation whose metadata names a **frame sink**: `harness::frames::<instance>`, an internal function this worker registers. The callee's side of this crate sends its frames there in order (one batch in flight at a time) and finishes sending before it answers, so every frame is in the caller's channel before the result is |
//! | `register_function` | `registerfunction` with the request/response JSON Schemas; a repeated id replaces the handler locally (the SDK would panic) |
//! | `register_trigger_type` | `registertriggertype` (the harness owns the hook points and the turn events); the engine forwards every binding of those types to this worker (`registertrigger`), also the ones made with `engine::register_trigger`, and replays them when the type is registered again after a reconnect or a restart |
//! | `bindings(type)` | the forwarded bindings for harness-owned types; `engine::registered-triggers::list` for the engine's (`cron`, …) |
//! | `define_queue`, `enqueue` | `TriggerAction::Enqueue{queue}` when a queue provider (`engine::queue::enqueue`) is registered; otherwise the engine's topic queue: `iii::durable::publish {topic, data}` and a `durable:subscriber` binding owned by this worker |
//! | `publish` | `iii::durable::publish {topic, data}`, deduplicated through `state::set` on `harness_published` (its `old_value` tells a repeat) |
//! | `barrier` | nothing: the engine gives no durability point (see below) |
//! | `state_*` | `state::get/set/delete/list`; `state::list` answers values without keys, so every value is stored with its key inside (`_harness_key`) and read back without it |
//!
//! Every payload the engine routes carries `_caller_worker_id`; it is removed before a handler
//! sees the payload, so strict request parsing (`harness/invalid_request` naming the field) keeps
//! working.
//!
//! # Queue ordering
//!
//! Steps are queued wrapped in an envelope `{<group field>: …, queue, function_id, payload}` and
//! delivered to the internal function `harness::queue::deliver`, which runs them under an
//! in-process per-group lock (the group is `session_id` on `harness-turn`). The engine's topic
//! queue has no message groups: `fifo` there is one global line (prefetch 1), so one slow step would
//! hold every other session. The default is therefore a `standard` subscriber with the configured
//! concurrency, and the per-group lock gives what the loop needs: one step of a session at a time,
//! sessions in parallel. The loop keeps at most one live step per session; a duplicate (a
//! redelivery, a redrive) waits for the lock and is then dropped by the exact `(turn_id, step)`
//! stale guard. `--queue-mode fifo` selects the global FIFO for deployments that want it.
//!
//! # What holds on iii, and what a lost write costs
//!
//! The engine's state has no compare-and-swap and its file store flushes every 5 s: a write made
//! in the last seconds before the engine dies (SIGKILL or SIGTERM) can vanish. So:
//!
//! - **One harness worker per session set.** Turn records are read-modify-written under the
//!   session's in-process lock; two harness workers serving the same sessions would race (no
//!   CAS). The worker registers under one worker name (`harness`), which the engine leases to one
//!   live connection per namespace.
//! - **A harness worker crash** (the engine keeps running): nothing is lost. The queue
//!   invocation fails (`invocation_stopped`), the restarted worker redrives every `running` turn,
//!   a redelivered step that finds its call `triggered` records "interrupted" and never runs the
//!   target again (tested with SIGKILL mid-call, `tests/iii_e2e.rs`).
//! - **The checkpoint is read back before dispatch.** [`IiiBus::barrier`] cannot make anything
//!   durable; it reads back every value written since the last barrier and fails with
//!   `harness/state` when the engine no longer holds it, so a `triggered` checkpoint lost before
//!   the target runs (an engine restart in between) stops the dispatch instead of running a call
//!   nobody recorded.
//! - **An engine crash within ~5 s after a dispatch** is the one window this cannot close: the
//!   `triggered` checkpoint may vanish after the target ran, and a replay of that step (the
//!   transcript, in the harness's own store with `--with session`, still holds the model's
//!   request) could dispatch the call again. Every dispatch carries `function_call_id` in its
//!   metadata so a target can deduplicate; a deployment that needs strict at-most-once across
//!   engine crashes needs a state adapter that persists each write before it answers.
//! - **A lost turn record costs the turn, never a side effect.** A step or a release that finds
//!   no record is stale and does nothing (a held call is not run); the session takes the next
//!   message as a new turn (tested: `a_lost_turn_record_never_runs_a_held_call...`). The turn
//!   then has no terminal record; `harness::status` shows no turn for it.
//! - Published events are at least once across an engine crash (their dedupe rows are state too).
//! - **Redelivery.** The engine does not return in-flight jobs to a topic queue when a worker
//!   dies; the failed invocation is retried with backoff and may reach the dead-letter queue
//!   while no worker is up. The loop does not depend on it: at start and after every reconnect
//!   (see [`IiiBus::reconnects`]) it re-enqueues the current step of every `running` turn. Calls
//!   this worker had in flight when the link dropped fail at once with `timeout` (outcome
//!   unknown) instead of waiting for an answer the engine will never route back.

mod bus;
mod codec;
mod error;

pub use bus::{IiiBus, IiiOptions, QueueMode, DELIVER_FUNCTION, FRAMES_PREFIX};
pub use codec::{strip_decoration, unwrap_state, wrap_state, STATE_KEY_FIELD};
pub use error::IiiError;

/// The `iii-sdk` version this crate is built and tested against.
pub const SDK_VERSION: &str = "0.25.0";
