//! The report: every phase's results, the targets they are judged against, and the two ways of
//! printing them (`json.rs`, one object; `text.rs`, the table).

use std::path::Path;

use harness_router::bench::FrameLatencyReport;
use serde_json::{json, Map, Value};

use crate::calls::{CallFsyncs, Calls};
use crate::handoff::{Fsyncs, Handoff};
use crate::idle::IdleRam;
use crate::long_session::LongSession;
use crate::overhead::Overhead;
use crate::reference::Reference;
use crate::rig::Mode;
use crate::stats::round3;
use crate::throughput::{Cell, CONCURRENCIES};

mod json;
mod text;

/// What every phase measured, in the order they ran.
pub(crate) struct Results {
    pub(crate) reference: Reference,
    pub(crate) ram: IdleRam,
    pub(crate) over: Overhead,
    pub(crate) hand: Handoff,
    pub(crate) hand_nofsync: Handoff,
    /// None on iii (nothing to count: see `Rig::fsyncs`).
    pub(crate) text_fsyncs: Option<Fsyncs>,
    pub(crate) calls: Calls,
    pub(crate) call_fsyncs: CallFsyncs,
    pub(crate) long: LongSession,
    pub(crate) router: FrameLatencyReport,
    pub(crate) cells: Vec<Cell>,
    /// Seconds the phases took, the reference included.
    pub(crate) elapsed: f64,
}

/// The results and where they were measured.
pub(crate) struct Report<'a> {
    pub(crate) mode: Mode<'a>,
    /// The filesystem type under `base`.
    pub(crate) fs: String,
    pub(crate) base: &'a Path,
    pub(crate) quick: bool,
    pub(crate) results: Results,
}

/// A figure with a target, as the JSON's `targets_met` and the table's first rows show it.
pub(crate) struct Target {
    key: &'static str,
    pub(crate) label: &'static str,
    /// None where the figure does not apply (fsync counts on iii).
    value: Option<f64>,
    unit: &'static str,
    /// The target as the table says it ("≤ 150 µs").
    target: String,
    met: Option<bool>,
}

/// Which side of its target a figure must stay on.
#[derive(Clone, Copy)]
enum Bound {
    AtMost(f64),
    AtLeast(f64),
}

impl Target {
    fn new(
        (key, label, value, unit, bound): (
            &'static str,
            &'static str,
            Option<f64>,
            &'static str,
            Bound,
        ),
    ) -> Target {
        let (sign, limit) = match bound {
            Bound::AtMost(x) => ("≤", x),
            Bound::AtLeast(x) => ("≥", x),
        };
        Target {
            key,
            label,
            value,
            unit,
            target: format!("{sign} {limit} {unit}").trim_end().to_string(),
            met: value.map(|v| match bound {
                Bound::AtMost(x) => v <= x,
                Bound::AtLeast(x) => v >= x,
            }),
        }
    }
}

/// The per-cell figures, keyed by concurrency, as the JSON holds them (the table reads them
/// back from there).
struct CellFigures {
    steps_per_sec: Map<String, Value>,
    cpu_per_step: Map<String, Value>,
    fsyncs_per_step: Map<String, Value>,
    commits_per_step: Map<String, Value>,
    store_writer: Map<String, Value>,
}

/// What the iii mode reports differently, said in the report.
const III_NOTES: &[&str] = &[
    "iii mode: every phase runs the loop and all its siblings (as `harness worker --with all`, worker name harness-bench) on an iii engine connection; calls, state, the step queue and events go through the engine",
    "fsync counts (fsyncs_per_*, fsync_turns), store commit counts and the writer's time (store_commits_per_step, store_writer) and the empty-commit yardstick (store_write_*) are null: the engine holds the loop's state and queue and gives no durability point, so there is no fsync or commit to count",
    "fsync on/off (handoff, steps/s, call_step_fsync) only switches the siblings' own SQLite (transcripts, in a temporary dir); the engine's durability is whatever it is configured with",
    "store time (store_*, overhead) is time awaiting session::*, state::*, enqueue, publish and barrier through the engine; barrier reads back the state written since the last one",
    "idle_session_bytes is this process only (loop, siblings, transcripts); the engine's memory for the sessions is not included",
    "router_* does not involve the bus: the same measurement as in-process",
];

impl Results {
    fn cell(&self, concurrency: usize, fsync: bool) -> Option<&Cell> {
        self.cells
            .iter()
            .find(|x| x.concurrency == concurrency && x.fsync == fsync)
    }

    /// Steps/s of a cell (0 if it did not run).
    fn rate(&self, concurrency: usize, fsync: bool) -> f64 {
        self.cell(concurrency, fsync).map_or(0.0, Cell::rate)
    }

    /// Process CPU µs per step of a cell (0 if it did not run).
    fn cpu(&self, concurrency: usize, fsync: bool) -> f64 {
        self.cell(concurrency, fsync)
            .map_or(0.0, |x| x.cpu_us as f64 / x.steps.max(1) as f64)
    }

    fn cell_figures(&self) -> CellFigures {
        let mut f = CellFigures {
            steps_per_sec: Map::new(),
            cpu_per_step: Map::new(),
            fsyncs_per_step: Map::new(),
            commits_per_step: Map::new(),
            store_writer: Map::new(),
        };
        for c in CONCURRENCIES {
            let key = c.to_string();
            f.steps_per_sec.insert(
                key.clone(),
                json!({"fsync": self.rate(c, true).round(), "nofsync": self.rate(c, false).round()}),
            );
            f.cpu_per_step.insert(
                key.clone(),
                json!({"fsync": self.cpu(c, true).round(), "nofsync": self.cpu(c, false).round()}),
            );
            if let Some(cell) = self.cell(c, true) {
                f.fsyncs_per_step
                    .insert(key.clone(), opt(cell.fsyncs_per_step(), round3));
                f.commits_per_step.insert(key.clone(), cell.store_json());
                f.store_writer.insert(key, cell.writer_json());
            }
        }
        f
    }
}

impl Report<'_> {
    pub(crate) fn targets(&self) -> Vec<Target> {
        use Bound::{AtLeast, AtMost};
        let r = &self.results;
        // Through an engine a handoff is an enqueue and a delivery, two hops away: its own target.
        let handoff = if self.mode.is_iii() { 5000.0 } else { 1000.0 };
        [
            (
                "overhead_us_p50",
                "loop overhead per step, p50",
                Some(r.over.steps.outside_store.p50),
                "µs",
                AtMost(150.0),
            ),
            (
                "handoff_us_p50",
                "step→step handoff, p50 (fsync on)",
                Some(r.hand.step.p50),
                "µs",
                AtMost(handoff),
            ),
            (
                "steps_per_sec.200.fsync",
                "durable steps/s, 200 sessions, fsync on",
                Some(r.rate(200, true)),
                "/s",
                AtLeast(10_000.0),
            ),
            (
                "fsyncs_per_text_step",
                "fsyncs per text step",
                r.text_fsyncs.as_ref().map(|f| f.per_step),
                "",
                AtMost(1.0),
            ),
            (
                "fsyncs_per_function_step",
                "fsyncs per function step",
                r.call_fsyncs.per_step,
                "",
                AtMost(2.0),
            ),
            (
                "router_frame_us_p50",
                "router, socket bytes → frame in the loop, p50",
                Some(r.router.per_frame_us.p50),
                "µs",
                AtMost(50.0),
            ),
            (
                "long_session_step_ratio",
                "step on a 1,000-entry session vs a 10-entry one, p50",
                Some(r.long.step_ratio()),
                "×",
                AtMost(1.5),
            ),
            (
                "idle_session_bytes",
                "RAM per idle session",
                Some(r.ram.bytes_per_session()),
                "B",
                AtMost(4096.0),
            ),
        ]
        .into_iter()
        .map(Target::new)
        .collect()
    }

    fn build(&self) -> &'static str {
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    }

    fn cores(&self) -> usize {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    }
}

/// A figure that may not apply in this mode: a number, or null.
fn opt(x: Option<f64>, round: fn(f64) -> f64) -> Value {
    x.map(|v| json!(round(v))).unwrap_or(Value::Null)
}
