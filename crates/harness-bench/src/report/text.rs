//! The report as a table (`harness bench` without `--json`): every figure with its target, if
//! it has one, and what it is worth in this run's physical reference.

use std::collections::HashMap;
use std::fmt::Write as _;

use serde_json::{Map, Value};

use super::{Report, III_NOTES};
use crate::calls::{FUNCTION_MAX_TURNS, FUNCTION_SHORT_MAX_TURNS};
use crate::rig::{Mode, NOOP_FN, TURNS_PER_SESSION};
use crate::throughput::CONCURRENCIES;

/// One row of the table: label, value, target, met (the last two empty on information rows).
type Row = (String, String, String, String);

fn us(x: f64) -> String {
    format!("{x:.1} µs")
}

/// Two times, as "a / b".
fn us_pair(a: f64, b: f64) -> String {
    format!("{} / {}", us(a), us(b))
}

fn na() -> String {
    "n/a".to_string()
}

/// `x` in units of a reference, as the table's last column says it.
fn times(x: f64, unit: &str, reference: f64) -> String {
    if reference > 0.0 {
        format!("{:.1} × {unit}", x / reference)
    } else {
        na()
    }
}

fn info(label: impl Into<String>, value: String) -> Row {
    (label.into(), value, String::new(), String::new())
}

/// One row per concurrency of a per-cell figure; null (on iii) reads n/a.
fn per_cell(
    figures: &Map<String, Value>,
    label: impl Fn(usize) -> String,
    show: impl Fn(&Value) -> String,
) -> Vec<Row> {
    CONCURRENCIES
        .iter()
        .filter_map(|c| {
            let v = figures.get(&c.to_string())?;
            Some(info(label(*c), if v.is_null() { na() } else { show(v) }))
        })
        .collect()
}

impl Report<'_> {
    pub(crate) fn text(&self) -> String {
        let rows = self.rows();
        let vs = self.versus();
        let rows: Vec<(Row, String)> = rows
            .into_iter()
            .map(|row| {
                let r = vs.get(&row.0).cloned().unwrap_or_default();
                (row, r)
            })
            .collect();
        let mut out = String::new();
        self.header(&mut out);
        let widths = rows.iter().fold((6, 5, 6), |(a, b, c), (r, _)| {
            (
                a.max(r.0.chars().count()),
                b.max(r.1.chars().count()),
                c.max(r.2.chars().count()),
            )
        });
        let _ = writeln!(
            out,
            "{}  {}  {}  met  vs reference",
            pad("metric", widths.0),
            pad("value", widths.1),
            pad("target", widths.2)
        );
        let _ = writeln!(out, "{}", "-".repeat(widths.0 + widths.1 + widths.2 + 24));
        for ((label, value, target, met), r) in &rows {
            let _ = writeln!(
                out,
                "{}  {}  {}  {}  {r}",
                pad(label, widths.0),
                pad(value, widths.1),
                pad(target, widths.2),
                pad(met, 3)
            );
        }
        self.breakdowns(&mut out);
        self.footer(&mut out);
        out
    }

    /// Where and how it ran, and the physical reference.
    fn header(&self, out: &mut String) {
        let r = &self.results;
        let where_ = match self.mode {
            Mode::Embedded => format!("in-process, store on {}", self.fs),
            Mode::Iii(url) => format!(
                "iii engine at {url} (loop + all siblings as its worker; their SQLite on {})",
                self.fs
            ),
        };
        let _ = writeln!(
            out,
            "harness bench: {where_}, scripted provider at zero latency, {} build, {} cores, {:.0} s{}",
            self.build(),
            self.cores(),
            r.elapsed,
            if self.quick { " (--quick)" } else { "" }
        );
        if self.mode.is_iii() {
            for note in III_NOTES {
                let _ = writeln!(out, "  note: {note}");
            }
        }
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "physical reference (this run, {}): fsync {} p50; bare SQLite commit {} with its fsync, {} without (the \"commit\" below)",
            self.base.display(),
            us(r.reference.fsync_us),
            us(r.reference.commit_us),
            us(r.reference.commit_nosync_us)
        );
        let _ = writeln!(out);
    }

    /// The targets first, then every other figure.
    fn rows(&self) -> Vec<Row> {
        let r = &self.results;
        let (over, hand, hand_nofsync, calls, router) =
            (&r.over.steps, &r.hand, &r.hand_nofsync, &r.calls, &r.router);
        let mut rows: Vec<Row> = self
            .targets()
            .iter()
            .map(|t| {
                let value = match (t.value, t.unit) {
                    (None, _) => na(),
                    (Some(v), "µs") => us(v),
                    (Some(v), "/s") => format!("{v:.0} /s"),
                    (Some(v), "B") => format!("{v:.0} B"),
                    (Some(v), "×") => format!("{v:.2} ×"),
                    (Some(v), _) => format!("{v:.3}"),
                };
                let met = match t.met {
                    Some(true) => "yes",
                    Some(false) => "NO",
                    None => "n/a",
                };
                (t.label.into(), value, t.target.clone(), met.into())
            })
            .collect();
        rows.extend([
            info("loop overhead per step, p99", us(over.outside_store.p99)),
            info(
                "whole step (store included), p50 / p99",
                us_pair(over.whole.p50, over.whole.p99),
            ),
            info(
                "store time per step, p50 (ops per step)",
                format!("{} ({:.1})", us(over.store.p50), over.store_ops),
            ),
            info(
                "one empty store commit, p50 (back to back / after 1 ms idle)",
                r.over
                    .empty_commit
                    .as_ref()
                    .map_or_else(na, |c| us_pair(c.back_to_back.p50, c.after_idle.p50)),
            ),
            info("step→step handoff, p99 (fsync on)", us(hand.step.p99)),
            info(
                "step→step handoff, p50 / p99 (fsync off)",
                us_pair(hand_nofsync.step.p50, hand_nofsync.step.p99),
            ),
            info("send → step 0 handoff, p50 (fsync on)", us(hand.send.p50)),
            info(
                "one turn at concurrency 1: wall / process CPU (fsync off)",
                us_pair(r.over.wall_per_turn_us, r.over.cpu_per_turn_us),
            ),
        ]);
        rows.extend(CONCURRENCIES.iter().map(|&c| {
            info(
                format!("durable steps/s, {c} sessions (fsync on / off)"),
                format!("{:.0} / {:.0}", r.rate(c, true), r.rate(c, false)),
            )
        }));
        rows.extend(CONCURRENCIES.iter().map(|&c| {
            info(
                format!("process CPU per step, {c} sessions (fsync on / off)"),
                us_pair(r.cpu(c, true), r.cpu(c, false)),
            )
        }));
        rows.extend([
            info(
                format!("function-call step, whole, p50 / p99 (fsync off, {FUNCTION_MAX_TURNS} calls a turn)"),
                us_pair(calls.calls.whole.p50, calls.calls.whole.p99),
            ),
            info(
                "overhead per call excl. target, p50 (vs paired text step)",
                format!(
                    "{} ({} − {})",
                    us(calls.overhead_p50()),
                    us(calls.net.whole.p50),
                    us(calls.text.whole.p50)
                ),
            ),
            info(
                "  of it outside the store, p50 (call − target − store vs text − store)",
                us(calls.overhead_loop_p50()),
            ),
            info(
                "  store per step, p50 (ops): call step / text step",
                format!(
                    "{} ({:.1}) / {} ({:.1})",
                    us(calls.calls.store.p50),
                    calls.calls.store_ops,
                    us(calls.text.store.p50),
                    calls.text.store_ops
                ),
            ),
            info(
                format!("time in the target ({NOOP_FN} bus call), p50"),
                us(calls.target_p50),
            ),
            info(
                "function-call step, whole, p50 (fsync on)",
                us(r.call_fsyncs.step_p50),
            ),
            info(
                format!("fsyncs per function turn ({FUNCTION_MAX_TURNS} calls + final step, send excluded)"),
                r.call_fsyncs
                    .per_turn
                    .map(|v| format!("{v:.3}"))
                    .unwrap_or_else(na),
            ),
            info(
                "router, socket bytes → frame, p99",
                us(router.per_frame_us.p99),
            ),
            info(
                "raw socket baseline per frame, p50 / p99",
                us_pair(router.socket_baseline_us.p50, router.socket_baseline_us.p99),
            ),
            info(
                "router added per frame over the raw socket, p50",
                us(router.added_per_frame_p50_us),
            ),
            info(
                "router per request (request out + ack back), p50 / p99",
                us_pair(router.per_request_us.p50, router.per_request_us.p99),
            ),
            info(
                "fsyncs per send",
                r.text_fsyncs
                    .as_ref()
                    .map(|f| format!("{:.3}", f.per_send))
                    .unwrap_or_else(na),
            ),
        ]);
        let cells = r.cell_figures();
        rows.extend(per_cell(
            &cells.fsyncs_per_step,
            |c| format!("fsyncs per step incl. send, {c} sessions"),
            |v| v.to_string(),
        ));
        rows.extend(per_cell(
            &cells.commits_per_step,
            |c| format!("store commits / write ops / WAL pages per step incl. send, {c} sessions (fsync on)"),
            |v| format!("{} / {} / {}", v["commits"], v["writes"], v["wal_pages"]),
        ));
        rows.extend(per_cell(
            &cells.commits_per_step,
            |c| {
                format!(
                    "WAL bytes per step and its pages by table or index, {c} sessions (fsync on)"
                )
            },
            |v| {
                let tables = v["wal_pages_by_table"]
                    .as_object()
                    .map(|t| {
                        t.iter()
                            .map(|(name, n)| format!("{name} {n}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    })
                    .unwrap_or_default();
                format!("{} B: {tables}", v["wal_bytes"])
            },
        ));
        rows.extend(per_cell(
            &cells.store_writer,
            |c| format!("store writer busy / in its own checkpoints / syncer in fsyncs, share of wall time, {c} sessions (fsync on)"),
            |v| format!("{} / {} / {}", v["busy"], v["checkpoint"], v["syncer_busy"]),
        ));
        rows.extend([
            info(
                format!(
                    "RAM per idle session, marginal (2nd half of {})",
                    r.ram.sessions()
                ),
                format!("{:.0} B", r.ram.marginal_bytes()),
            ),
            info(
                "step on a 1,000-entry session vs a 10-entry one, store time taken out, p50",
                format!("{:.2} ×", r.long.overhead_ratio()),
            ),
        ]);
        rows
    }

    /// The reference column, by row label: what each figure is worth in this run's physical
    /// units.
    fn versus(&self) -> HashMap<String, String> {
        let r = &self.results;
        let (over, hand, calls, long) = (&r.over.steps, &r.hand.step, &r.calls, &r.long);
        let commit = r.reference.commit_nosync_us;
        let fsync_us = r.reference.fsync_us;
        let per_fsync =
            |c: usize| format!("{:.1} per fsync time", r.rate(c, true) * fsync_us / 1e6);
        let empty_commit_p50 = r
            .over
            .empty_commit
            .as_ref()
            .map_or(0.0, |c| c.back_to_back.p50);
        let mut vs: HashMap<String, String> = [
            (
                "loop overhead per step, p50",
                times(over.outside_store.p50, "commit", commit),
            ),
            (
                "loop overhead per step, p99",
                times(over.outside_store.p99, "commit", commit),
            ),
            (
                "step→step handoff, p50 (fsync on)",
                times(hand.p50, "fsync", fsync_us),
            ),
            (
                "step→step handoff, p99 (fsync on)",
                times(hand.p99, "fsync", fsync_us),
            ),
            ("durable steps/s, 200 sessions, fsync on", per_fsync(200)),
            (
                "whole step (store included), p50 / p99",
                times(over.whole.p50, "commit", commit),
            ),
            (
                "store time per step, p50 (ops per step)",
                times(over.store.p50, "commit", commit),
            ),
            (
                "one empty store commit, p50 (back to back / after 1 ms idle)",
                times(empty_commit_p50, "commit", commit),
            ),
            (
                "step→step handoff, p50 / p99 (fsync off)",
                times(r.hand_nofsync.step.p50, "commit", commit),
            ),
            (
                "one turn at concurrency 1: wall / process CPU (fsync off)",
                times(r.over.cpu_per_turn_us, "commit (CPU)", commit),
            ),
            (
                "function-call step, whole, p50 (fsync on)",
                times(r.call_fsyncs.step_p50, "fsync", fsync_us),
            ),
            (
                "step on a 1,000-entry session vs a 10-entry one, p50",
                us_pair(long.long.whole.p50, long.short.whole.p50),
            ),
        ]
        .into_iter()
        .map(|(label, v)| (label.to_string(), v))
        .collect();
        for c in CONCURRENCIES {
            vs.insert(
                format!("durable steps/s, {c} sessions (fsync on / off)"),
                per_fsync(c),
            );
        }
        vs.insert(
            format!("function-call step, whole, p50 / p99 (fsync off, {FUNCTION_MAX_TURNS} calls a turn)"),
            times(calls.calls.whole.p50, "commit", commit),
        );
        vs
    }

    /// Where a step's and a call step's time goes, operation by operation.
    fn breakdowns(&self, out: &mut String) {
        let r = &self.results;
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "where a step's time goes (concurrency 1, fsync off; mean per step):"
        );
        for (title, rows) in [
            (
                "store (subtracted from the overhead)",
                &r.over.store_breakdown,
            ),
            (
                "timed loop calls (part of the overhead)",
                &r.over.loop_breakdown,
            ),
        ] {
            let _ = writeln!(out, "  {title}:");
            for (op, mean) in rows {
                let _ = writeln!(
                    out,
                    "    {}  {:>4.1} calls  {:>8.1} µs",
                    pad(op, 36),
                    mean.calls,
                    mean.us
                );
            }
        }
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "where a function-call step's time goes (fsync off; mean per step; paired text step beside it):"
        );
        for row in &r.calls.breakdown {
            let _ = writeln!(
                out,
                "    {}  {:>4.1} calls  {:>8.1} µs   text step: {:>4.1} calls  {:>8.1} µs{}",
                pad(&row.op, 36),
                row.call.calls,
                row.call.us,
                row.text.calls,
                row.text.us,
                if row.store {
                    "  (store)"
                } else if row.op == NOOP_FN {
                    "  (target)"
                } else {
                    ""
                }
            );
        }
    }

    /// How each kind of figure is measured, in one line each.
    fn footer(&self, out: &mut String) {
        let _ = writeln!(out);
        for line in [
            "overhead: concurrency 1, fsync off; step handler time minus time awaiting the store.".to_string(),
            "handoff: previous step's enqueue → next step's start, in 9-step turns; includes the queue ack (and its fsync).".to_string(),
            format!("function call: {NOOP_FN} (in-process no-op) at every step of max_turns {FUNCTION_MAX_TURNS} turns; overhead = p50(call step − target) − p50(text steps run alongside)."),
            format!("fsyncs per function step: (fsyncs of a {FUNCTION_MAX_TURNS}-call turn − of a {FUNCTION_SHORT_MAX_TURNS}-call turn) / {}, sends excluded.", FUNCTION_MAX_TURNS - FUNCTION_SHORT_MAX_TURNS),
            "router: local Anthropic-format SSE server; server writes an event → parsed frame out of the router, one in flight; baseline: a raw TcpStream.".to_string(),
            format!("steps/s: one text turn = one step, send included; a new session every {TURNS_PER_SESSION} turns."),
            "idle RAM: VmRSS delta (after malloc_trim) over sessions with one completed turn each; includes SQLite page caches.".to_string(),
        ] {
            let _ = writeln!(out, "{line}");
        }
    }
}

fn pad(s: &str, w: usize) -> String {
    format!("{s}{}", " ".repeat(w.saturating_sub(s.chars().count())))
}
