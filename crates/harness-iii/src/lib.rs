//! The harness [`Bus`](harness_bus::Bus) over an iii engine, through the `iii-sdk` crate.
//!
//! `harness worker --engine ws://…` builds the same loop and siblings as `harness serve`, on an
//! [`IiiBus`] instead of the embedded bus. Nothing in the loop knows which bus it has.
//!
//! # How each Bus operation maps onto the engine
//!
//! | Bus | on iii |
//! |---|---|
//! | `call`, `call_with_metadata`, `call_void` | `invokefunction` through the engine (`trigger`, action none / `void`); the metadata rides in the invocation's `metadata` sidecar. A plain call to a function this worker serves runs in-process (below) |
//! | `call_streaming` (`router::chat`) | a plain invocation whose metadata names a **frame sink**: `harness::frames::<instance>`, an internal function this worker registers. The callee's side of this crate sends its frames there in order (one batch in flight at a time) and finishes sending before it answers, so every frame is in the caller's channel before the result is. In-process (below), the handler's frames go straight into the caller's channel |
//! | `register_function` | `registerfunction` with the request/response JSON Schemas; a repeated id replaces the handler locally (the SDK would panic) |
//! | `register_trigger_type` | `registertriggertype` (the harness owns the hook points and the turn events); the engine forwards every binding of those types to this worker (`registertrigger`), also the ones made with `engine::register_trigger`, and replays them when the type is registered again after a reconnect or a restart |
//! | `bindings(type)` | the forwarded bindings for harness-owned types; `engine::registered-triggers::list` for the engine's (`cron`, …) |
//! | `define_queue`, `enqueue` | `TriggerAction::Enqueue{queue}` when a queue provider (`engine::queue::enqueue`) is registered; otherwise the engine's topic queues: `iii::durable::publish {topic, data}` to `<queue>` (or to FIFO shards `<queue>.<i>`), with `durable:subscriber` bindings owned by this worker |
//! | `publish` | `iii::durable::publish {topic, data}`, deduplicated through `state::set` on `harness_published` (its `old_value` tells a repeat) |
//! | `barrier` | nothing: the engine gives no durability point (see below) |
//! | `state_*` | `state::get/set/delete/list`; `state::list` answers values without keys, so every value is stored with its key inside (`_harness_key`) and read back without it |
//!
//! Every payload the engine routes carries `_caller_worker_id`; it is removed before a handler
//! sees the payload, so strict request parsing (`harness/invalid_request` naming the field) keeps
//! working.
//!
//! # Calls to this worker's own functions
//!
//! A plain call (`call`, `call_with_metadata`, `call_streaming`; no trigger action) to a
//! function this worker serves runs in-process: with `--with all` that is most of a step's
//! calls (the transcript store, the context manager, the router, the frame sink, fixtures),
//! which the engine would only route straight back here, and some of which it now and then
//! never answered (`docs/iii-engine.md`, *Measured*). The handler gets what the engine would
//! have delivered: the same payload (the engine's `_caller_worker_id` is stripped before any
//! handler sees a routed payload, so nothing depends on it), the same metadata (a streaming
//! call's frame sink taken out), the same `harness/starting` gate; it runs as its own task, as
//! a routed call's handler does, and the caller gets the same timeout and errors. Fencing is
//! unchanged: it lives in the state writes (`fence`), which still go to the engine.
//!
//! "Serves" means: the engine lists the function under this worker's name (read whenever the
//! worker waits for its registrations, and again after every reconnect), the link is up and
//! reconciled, the worker is not deposed and not shutting down, and a public `harness::*`
//! function only once [`IiiBus::open`] made it callable and the worker is ready. In any other
//! case the call goes through the engine exactly as before (a function still held back is
//! `function_not_found` there, another worker's function is its answer). Inside a queued step a
//! lost link still ends the step where it stands, whichever way its call went. Trigger actions
//! (enqueue, void) always go through the engine, and so does everything whose meaning is the
//! engine's (`engine::*`, `state::*`, other workers' functions). `IiiOptions::self_calls`
//! (`harness worker --self-calls engine`) sends these calls through the engine too. A call to
//! one of this worker's own functions that goes through the engine is logged at debug level.
//!
//! # Start-up
//!
//! [`IiiBus::connect`] registers the internal functions (the queue's delivery target, the frame
//! sink) at once; the siblings and the loop register theirs; the loop ensures the turn queue.
//! The public `harness::*` functions are held back until [`IiiBus::open`]: a function is
//! callable on the engine as soon as it is registered, and a `harness::send` accepted before the
//! queue exists would fail its turn. Until then (and from a lost link until the reconnect is
//! reconciled) a public function that is reached anyway answers `harness/starting`. Waiting
//! for the engine to list the worker's own functions asks with `include_internal: true`: the
//! engine hides functions registered with `metadata.internal` otherwise.
//!
//! # Queue ordering
//!
//! Steps are queued wrapped in an envelope `{<group field>: …, queue, function_id, payload}` and
//! delivered to the internal function `harness::queue::deliver`, which runs them under an
//! in-process per-group lock (the group is `session_id` on `harness-turn`). Routes:
//!
//! - **Enqueue** (`TriggerAction::Enqueue`) when a queue provider (`engine::queue::enqueue`,
//!   the separately installed queue worker) is registered. The queue must be defined there as
//!   `fifo` grouped by the queue's group field: a matching definition in the queue worker's
//!   configuration (`configuration::get {id: "queue"}`) is kept, a missing one is declared
//!   with `queue::define`, a conflicting one stops the start naming the block to set
//!   (`provider`). The queue worker groups the steps of a session itself; the per-group lock
//!   here then never waits.
//! - **Topic** (the default without a provider): one `standard` `durable:subscriber` with the
//!   queue's concurrency; the engine polls it every 100 ms whatever the config says, so a
//!   handoff costs ~50-100 ms. Sessions run in parallel; the per-group lock orders a session.
//! - **FIFO shards** (`--queue-mode shards`): `--queue-shards` topics `harness-turn.<i>`,
//!   each with a `fifo` `durable:subscriber`; a session always publishes to the same shard
//!   (FNV-1a of its id), so its steps are ordered by the engine and shards run in parallel. The
//!   engine's topic queues have no message groups (a `fifo` subscriber is one line), so this is
//!   the closest to "FIFO grouped by session" the engine offers; two sessions on one shard wait
//!   for each other. A `fifo` consumer polls at the queue adapter's `poll_interval_ms` (default
//!   100): set it to 1-2 ms for a handoff of a few ms (see README, `harness worker`).
//!   Only that many sessions run a step at once: on two loaded cores, 200 busy sessions on 8
//!   shards left a turn waiting over 60 s behind the others of its shard, which is why this is
//!   not the default.
//!
//! A duplicate (a redelivery, a redrive) waits for the group lock and is then dropped by the
//! exact `(turn_id, step)` stale guard.
//!
//! # What holds on iii, and what a lost write costs
//!
//! The engine's state has no compare-and-swap and its file store flushes every 5 s: a write made
//! in the last seconds before the engine dies (SIGKILL or SIGTERM) can vanish. So:
//!
//! - **Several harness workers, one serving.** The engine leases every function id to one live
//!   worker per namespace, so the harness surface (and the queue's delivery target) is served
//!   by one worker at a time. [`IiiBus::connect`] therefore stands by while another harness
//!   worker owns `harness::queue::deliver` (polling `engine::functions::info` every 200 ms) and
//!   takes over when that worker's connection is gone: it registers everything, and the loop's
//!   redrive picks the running turns up (a call in flight is closed as interrupted). Each
//!   worker needs its own worker name (the engine leases names too).
//! - **Fenced turn records.** Turn records are read-modify-written under the session's
//!   in-process lock; across workers they are fenced (see `fence`): each session's record is
//!   written under a lease epoch, minted by an atomic `state::update` increment of its
//!   `harness_lease` row when a worker first writes it, one slot per epoch, the newest slot
//!   read. A worker that lost the session (its link dropped and another took over) writes into
//!   an older slot nobody reads and gets `harness/fenced`; after such a reconnect it finds its
//!   functions held by another worker and reports itself deposed ([`IiiBus::deposed`]). Other
//!   scopes (steering rows, idempotency rows, fan-out marks) are not fenced: they are written
//!   by the serving worker only.
//! - **A harness worker crash** (the engine keeps running): nothing is lost. The queue
//!   invocation fails (`invocation_stopped`), the restarted worker redrives every `running` turn,
//!   a redelivered step that finds its call `triggered` records "interrupted" and never runs the
//!   target again (tested with SIGKILL mid-call, `tests/iii_e2e.rs`).
//! - **A lost link** (the engine died or the network dropped) ends every step this worker is
//!   running where it stands, as a crash of the worker would: the step's task is aborted, so
//!   nothing it had not written yet gets written (no generation is failed, no call is closed as
//!   timed out). After the reconnect the step is redriven: a `triggered` call is closed as
//!   interrupted (it ran at most once), a generation without its `generated` mark is asked again.
//!   [`IiiBus::shutdown`] ends the calls in flight the same way, and a call made after it
//!   fails at once (`not_connected`): the SDK drops what is sent once it is shut down and
//!   would leave the call waiting out its timeout.
//! - **An engine crash inside its flush window: the write-ahead copy.** Every state write this
//!   worker made in the last 30 s is kept (the last value per key, as the engine acknowledged
//!   it). After a reconnect, before any step runs again, [`IiiBus::reconcile`] reads each of
//!   them back and writes again what the engine lost; then the loop redrives. So a turn record
//!   and its call checkpoints survive an engine SIGKILL (tested with the engine's flush held
//!   back, `an_engine_crash_inside_its_flush_window_…`). The copy is a SQLite file beside the
//!   worker (`IiiOptions::journal`; `harness worker` puts it in its data dir), so a worker
//!   killed together with the engine gives it back when it starts again (tested:
//!   `a_worker_killed_with_the_engine_…`). At start-up only what cannot overwrite another
//!   worker's newer write is given back (turn-record slots, and values the engine no longer
//!   has at all). Without the file (or with it lost too) a lost turn record costs the turn,
//!   never a side effect (next point).
//! - **The checkpoint is read back before dispatch.** [`IiiBus::barrier`] cannot make anything
//!   durable; it reads back every value written since the last barrier and fails with
//!   `harness/state` when the engine no longer holds it, so a `triggered` checkpoint lost before
//!   the target runs stops the dispatch instead of running a call nobody recorded.
//! - **A lost turn record costs the turn, never a side effect.** A step or a release that finds
//!   no record is stale and does nothing (a held call is not run); the session takes the next
//!   message as a new turn (tested: `a_lost_turn_record_never_runs_a_held_call...`).
//! - **Bindings.** The engine keeps `engine::register_trigger` bindings in memory only. The
//!   worker acts on the bindings the engine forwards for its trigger types; after every
//!   reconnect it drops those the engine no longer lists (so a hook never runs twice and a
//!   forgotten deny hook stops denying), and the loop re-binds what it owns (the sweep cron,
//!   the registry-change notice) when it redrives.
//! - **Registry-change notices.** The engine polls its registry every 5 s and announces any
//!   change to `engine::functions-available` bindings, with the whole list. A notice whose only
//!   change is this worker's own registrations (or another harness worker's frame sink) is
//!   answered without reaching the loop, so a (re)starting worker never tells running turns
//!   that the functions changed.
//! - Published events are at least once across an engine crash (their dedupe rows are state
//!   too).
//! - **Redelivery.** The engine does not return in-flight jobs to a topic queue when a worker
//!   dies; the failed invocation is retried with backoff and may reach the dead-letter queue
//!   while no worker is up. The loop does not depend on it: at start and after every reconnect
//!   (see [`IiiBus::reconnects`]) it re-enqueues the current step of every `running` turn.

mod bindings;
mod bus;
mod calls;
mod codec;
mod error;
mod fence;
mod journal;
mod options;
mod provider;
mod queue;
mod registry;
mod state;

pub use bus::{IiiBus, DELIVER_FUNCTION, FRAMES_PREFIX};
pub use codec::{strip_decoration, unwrap_state, wrap_state, STATE_KEY_FIELD};
pub use error::IiiError;
pub use fence::{FENCED_SCOPE, LEASE_SCOPE};
pub use options::{IiiOptions, QueueMode, SelfCalls};

/// The `iii-sdk` version this crate is built and tested against.
pub const SDK_VERSION: &str = "0.25.0";
