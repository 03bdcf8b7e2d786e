//! `harness bench`: measures the embedded loop in-process, with the scripted provider at zero
//! latency, and prints a table (or, with `--json`, one JSON object on stdout; progress goes to
//! stderr). Every figure is printed beside the same run's physical reference (`reference.rs`:
//! one fsync and one bare SQLite commit in the bench directory), so each reads as a ratio that
//! means the same on any machine.
//!
//! The binary stays the owner of the wiring: it passes a [`Host`] that opens each phase's
//! runtime exactly as `harness serve` (or `harness worker`, with `--iii`) would. Every phase
//! opens a fresh runtime in its own temporary directory (under `--dir`, default the system temp
//! dir; fsync numbers are only meaningful on a real disk), with the bus wrapped in a
//! `ProbeBus` (`probe.rs`): a pass-through that
//!
//! * in the phases that sample steps, times every `harness::turn` delivery (one step) from
//!   handler start to handler end (the throughput cells only count steps: the probe's books
//!   would be charged to the loop);
//! * inside a step, adds up the time spent awaiting the store: `session::*` and `state::*` calls,
//!   `state_*`, `enqueue`, `publish` and `barrier` (found through a task-local set by the step's
//!   handler, so concurrent sends are never charged to a step);
//! * stamps when a step's `enqueue` returned, so the next delivery of that `(turn, step)` can
//!   compute its handoff latency;
//! * wakes the bench when a `harness::turn-completed` event has been committed.
//!
//! Methods, per metric:
//!
//! * **Loop overhead per step** (`overhead_us_*`): concurrency 1, fsync off, one text turn (one
//!   step) at a time; per step, handler wall time minus the time spent awaiting the store as
//!   above. What remains is the loop's own work: JSON (de)serialisation, context assembly, the
//!   router and scripted provider (which answer instantly), stream accumulation, locking, task
//!   hops. The store's part (its own serialisation included) is reported next to it
//!   (`store_us_p50`, `store_ops_per_step`), as is the whole step (`step_us_*`). The durable
//!   write itself (the ack's fsync) happens after the handler returns and is never in either.
//! * **Handoff** (`handoff_us_*`): turns whose script always calls a function the deny-by-default
//!   policy refuses (a new call id every step, so every step really closes one refused call),
//!   capped with `max_turns`, so each turn is 9 steps; per step ≥ 1, from the
//!   moment the previous step's `enqueue` of it returned to the moment its handler starts. That
//!   includes the previous step's return, its queue ack (a commit and, with fsync on, the fsync
//!   the queue waits for before it releases the session's next message) and two task spawns.
//!   Measured with fsync on (`handoff_us_*`, the default durability) and off
//!   (`handoff_nofsync_us_*`); `send_handoff_us_p50` is send's enqueue → step 0 (0 when step 0
//!   starts before the send's task sees its enqueue return: the queue wakes on the commit,
//!   before the writer answers).
//! * **Durable steps/s** (`steps_per_sec`): C sessions each running text turns back to back (send,
//!   wait for `turn-completed`, send again; a new session every 20 turns so transcripts stay
//!   short) for a fixed time after a short warm-up; steps/s = completed one-step turns / elapsed.
//!   The send (which persists the message and fsyncs before it answers) is part of every step.
//! * **fsyncs per text step** (`fsyncs_per_text_step`): concurrency 1, fsync on; per turn, the
//!   store's fsync counter between `send` returning and the queue being idle again (the step and
//!   its ack); the send's own fsyncs are `fsyncs_per_send`. `fsyncs_per_step` gives fsyncs /
//!   steps of each fsync-on throughput cell, sends included (group commit shares them), and
//!   `store_commits_per_step` the store's transactions, write ops and WAL pages (frames) per
//!   step of the same cells: how well the single writer groups the steps' writes and what they
//!   cost it in pages. `store_writer` gives, per cell, the share of wall time the one writer
//!   thread was busy with batches (`busy`, near 1 means it is the bound) and, within that, in
//!   its own catch-up checkpoints (`checkpoint`), which stall every session's writes, and the
//!   share the syncer thread spent in barriers' fsyncs (`syncer_busy`; all null on iii).
//! * **Function-call step** (`call_*`, `fsyncs_per_function_step`): an in-process no-op function
//!   `bench::noop` is registered on the runtime's bus and turns are sent with
//!   `functions: {allow: ["bench::*"], expose: "native"}, max_turns: 8`, against a script whose
//!   repeated generation calls it under a per-step id (`c_{request_id}`): each turn is 8 steps
//!   that each run one call, plus the step that ends the turn on `max_turns` (left out). Fsync
//!   off, concurrency 1, a new session per call turn; after each call turn the same runtime runs
//!   8 text turns (sessions of 20 turns, as above), the *paired* text steps, so both kinds are
//!   measured on the same database, interleaved in time.
//!   `call_step_us_*` is the whole step (handler wall time) of the steps that ran one call;
//!   `call_target_us_p50` is the time the step spent awaiting the `bench::noop` bus call (the
//!   target, as the loop sees it: the embedded bus's lookup and timeout included).
//!   `call_overhead_us_p50` = p50(call step − its target time) − p50(paired text step): what one
//!   call adds to a step beyond the target (policy, hooks, the `triggered` checkpoint and its
//!   barrier, the result append, the `done` checkpoint, advancing instead of finalizing). The
//!   probe's per-operation timings split it: `call_overhead_loop_us_p50` compares the steps with
//!   the store's time also taken out (p50(call − target − store) − p50(text − store)), and
//!   `call_breakdown` lists every operation's calls and mean µs per call step next to the paired
//!   text step's. A difference of medians, so the parts need not add up exactly.
//!   `fsyncs_per_function_step`: a fresh fsync-on runtime alternates turns of 8 and of 2 call
//!   steps; per turn, the store's fsync counter from `send` returning (its own fsyncs excluded)
//!   to the queue being idle and the WAL synced; the per-step figure is the slope
//!   (mean(8-step turns) − mean(2-step turns)) / 6, so the step that ends the turn and anything
//!   else paid once per turn cancel out. `fsyncs_per_function_turn` is the 8-call turn's total
//!   (its final step included); `call_step_fsync_us_p50` the whole call step with fsync on.
//! * **Router latency** (`router_*`): `harness_router::bench::frame_latency`, a local
//!   Anthropic-format SSE server on 127.0.0.1 and the Anthropic adapter pointed at it. Per frame:
//!   from the server handing an event's bytes to the socket to the parsed frame coming out of the
//!   router's frame channel, one event in flight (`router_frame_us_*`; the target applies to its
//!   p50, socket included); the same ping-pong on a raw `TcpStream` (`router_socket_us_*`) and
//!   the difference of the medians (`router_frame_added_us_p50`). Per request
//!   (`router_request_us_*`): `Router::chat` → the server has read the request, plus the
//!   server's last byte → the ack.
//! * **Long sessions** (`long_session_step_ratio`): concurrency 1, fsync off; text steps
//!   alternating between sessions of ~10 entries and of ~1,000 (filled with `session::append`,
//!   each stepped once before measuring, as a live conversation is); p50 of the whole step on
//!   the long sessions over p50 on the short ones (`long_session_overhead_ratio`: the same with
//!   the store's time taken out).
//! * **iii mode** (`--iii URL`, feature `iii` of the binary): the host opens every phase's
//!   runtime with the binary's `Runtime::open_on_bus` on an `IiiBus` connected to URL (worker name `harness-bench`), with
//!   every sibling registered (as `harness worker --with all`; their SQLite in the phase's
//!   temporary directory) and the same probe wrapped around the bus; `bench::noop` is registered
//!   on the engine too, so call steps go through it. The queue's drain is seen as steps enqueued
//!   = steps handled (the engine's depth is not visible). The fsync figures and the empty-commit
//!   yardstick are null there (the engine gives no durability point; see `III_NOTES` in `report/`); the
//!   rest is measured the same way, so the two reports compare key by key.
//! * **RAM per idle session** (`idle_session_bytes`): fsync off; N sessions with one completed
//!   turn each (64 at a time); resident set (`VmRSS`) after minus before, divided by N. Each
//!   read waits for the store's idle moment (its fold and WAL truncation, 500 ms after the last
//!   write: otherwise the figure moved with how much of a fold's tail was in memory) and follows
//!   the allocators' release of their free pages (the host's, on every runtime worker and on
//!   the store's writer thread, and `malloc_trim`): without it the figure moved by a third run
//!   to run with what mimalloc's threads happened to keep. It includes SQLite's page caches
//!   growing with the database (`idle_sqlite_heap_*_bytes`); `idle_session_marginal_bytes` is
//!   the slope over the second half only. An explicit `--idle-sessions N` is measured whole
//!   (cap 12 ms a session).
//!
//! Layout: one module per phase (`idle`, `overhead`, `handoff`, `calls`, `long_session`,
//! `router`, `throughput`), each returning its figures; `probe` and `rig` (a runtime in a
//! temporary directory and the driver of its turns) under them; `report` turns the results into
//! the JSON object or the table. [`run`] only sequences the phases. The tests (`tests/`) run
//! every phase on a tiny budget and check its figures for sanity, never for speed.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use harness_store::Durability;

pub use host::{Host, Opened, RigSpec};

mod calls;
mod handoff;
mod host;
mod idle;
mod long_session;
mod overhead;
mod plan;
mod probe;
mod reference;
mod report;
mod rig;
mod router;
mod stats;
#[cfg(test)]
mod tests;
mod throughput;

use plan::Plan;
use report::{Report, Results};
use rig::{At, Mode};
use stats::{fs_type, progress};

#[derive(Args, Clone)]
pub struct BenchArgs {
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// A shorter run (under 30 s).
    #[arg(long)]
    pub quick: bool,
    /// Run every phase on an iii engine (its worker URL, e.g. ws://127.0.0.1:49134) instead of
    /// the embedded bus: the loop and all its siblings register on it as `harness worker --with
    /// all` would. Needs a build with `--features iii`.
    #[arg(long, value_name = "URL")]
    pub iii: Option<String>,
    /// Where the temporary stores go (default: the system temp dir). Use a real disk: fsync on
    /// tmpfs costs nothing.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Sessions for the idle-RAM measurement (default 10000; 2000 with --quick).
    #[arg(long)]
    pub idle_sessions: Option<usize>,
    /// Measured seconds per throughput cell (default 5; 1.2 with --quick).
    #[arg(long)]
    pub cell_secs: Option<f64>,
}

/// Runs the bench; `host` opens each phase's runtime (the binary's own wiring).
pub async fn run(args: BenchArgs, host: &dyn Host) -> Result<()> {
    if let Some(url) = &args.iii {
        host.check_iii(url)?;
    }
    let mode = match &args.iii {
        Some(url) => Mode::Iii(url),
        None => Mode::Embedded,
    };
    let plan = Plan::new(&args);
    let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&base).with_context(|| format!("cannot create {}", base.display()))?;
    let fs = fs_type(&base).unwrap_or_else(|| "unknown".into());
    if fs == "tmpfs" || fs == "ramfs" {
        eprintln!(
            "bench: warning: {} is on {fs}: fsync costs nothing there; use --dir on a real disk",
            base.display()
        );
    }
    if let Mode::Iii(url) = mode {
        progress!("iii mode: every phase connects to {url}");
    }
    let at = At {
        mode,
        base: &base,
        host,
    };
    let results = measure(at, &plan).await?;
    let report = Report {
        mode,
        fs,
        base: &base,
        quick: args.quick,
        results,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report.json()?)?);
    } else {
        print!("{}", report.text());
    }
    Ok(())
}

/// Every phase in turn, each in a fresh runtime; each phase's headline goes to stderr as soon
/// as it is measured (on an iii engine a later phase can fail, and the report comes only at
/// the end).
async fn measure(at: At<'_>, plan: &Plan) -> Result<Results> {
    let started = Instant::now();
    progress!("physical reference (fsync and bare SQLite commits in the bench directory)");
    let reference = reference::measure(at.base)?;
    let ram = idle::idle_ram(at, plan).await?;
    let over = overhead::overhead(at, plan).await?;
    let hand = handoff::handoff(at, plan, Durability::Full).await?;
    let hand_nofsync = handoff::handoff(at, plan, Durability::Normal).await?;
    // Nothing to count on iii (see `Rig::fsyncs`).
    let text_fsyncs = match at.mode {
        Mode::Embedded => Some(handoff::fsyncs(at, plan).await?),
        Mode::Iii(_) => None,
    };
    let calls = calls::function_calls(at, plan).await?;
    let call_fsyncs = calls::call_fsyncs(at, plan).await?;
    let long = long_session::long_session(at, plan).await?;
    let router = router::router_latency(plan).await?;
    let cells = throughput::cells(at, plan).await?;
    Ok(Results {
        reference,
        ram,
        over,
        hand,
        hand_nofsync,
        text_fsyncs,
        calls,
        call_fsyncs,
        long,
        router,
        cells,
        elapsed: started.elapsed().as_secs_f64(),
    })
}
