//! The loop's side of telemetry: the methods that give a turn its trace context, time its
//! steps and hand a finished turn to the observers. What is built from that (facts, spans) is
//! `trace.rs`, which knows nothing of the [`Harness`]; that is what keeps `harness.rs` (whose
//! struct holds the installed [`crate::trace::Telemetry`]) and `trace.rs` from importing each
//! other.

use harness_types::api::TurnStatus;

use crate::harness::Harness;
use crate::record::TurnRecord;
use crate::trace::{facts, now_us, seed_ctx, spans, ChildFacts, HookFacts, MarkBook};

impl Harness {
    /// Gives a new turn its trace context when spans are exported (nothing otherwise), and
    /// counts it.
    pub(crate) async fn seed_trace(&self, rec: &mut TurnRecord) {
        let Some(t) = self.telemetry() else {
            return;
        };
        if let Some(o) = &t.observer {
            o.turn_started(rec.depth == 0);
        }
        let Some(sink) = &t.spans else {
            return;
        };
        if rec.trace.is_some() {
            return;
        }
        // A sub-agent's turn joins its parent's trace under the spawn call's span, when that
        // turn is the one that spawned it.
        let mut parent = None;
        if let Some(link) = &rec.parent {
            if let Ok(Some(p)) = self.load_record(&link.session_id).await {
                if p.turn_id == link.turn_id {
                    parent = p.trace.map(|c| (c, link.function_call_id.clone()));
                }
            }
        }
        let now = harness_types::now_ms();
        rec.trace = Some(seed_ctx(
            sink.as_ref(),
            parent.as_ref().map(|(c, id)| (c, id.as_str())),
            now,
        ));
    }

    /// Where step timings go; `None` when nothing observes turns (nothing measured).
    fn marks(&self) -> Option<&MarkBook> {
        self.telemetry()
            .filter(|t| t.spans.is_some() || t.observer.is_some())
            .map(|t| &t.marks)
    }

    /// A step delivery starts in this process.
    pub(crate) fn mark_step_start(&self, turn_id: &str, step: u64) {
        if let Some(m) = self.marks() {
            let now = now_us();
            m.step(turn_id, step, |s| {
                s.runs += 1;
                s.start = now;
                s.end = None;
            });
        }
    }

    /// A generation of request `turn_id:step` ran from `start` (first content at `first`) until
    /// now.
    pub(crate) fn mark_generation(&self, request_id: &str, start: i64, first: Option<i64>) {
        let Some(m) = self.marks() else { return };
        let Some((turn_id, step)) = request_id.rsplit_once(':') else {
            return;
        };
        let Ok(step) = step.parse() else { return };
        let now = now_us();
        m.step(turn_id, step, |s| {
            s.gen_start = Some(start);
            s.first_chunk = first;
            s.gen_end = Some(now);
        });
    }

    /// A hook call of the turn and step its envelope names (none: not a turn's hook).
    pub(crate) fn mark_hook(&self, envelope: &serde_json::Value, hook: HookFacts) {
        let Some(m) = self.marks() else { return };
        let (Some(turn_id), Some(step)) = (envelope["turn_id"].as_str(), envelope["step"].as_u64())
        else {
            return;
        };
        m.step(turn_id, step, |s| s.hooks.push(hook));
    }

    /// Whether generations are timed (telemetry is installed).
    pub(crate) fn marking(&self) -> bool {
        self.marks().is_some()
    }

    pub(crate) fn observe_step(
        &self,
        payload: &harness_types::api::TurnStepPayload,
        outcome: &'static str,
        started: std::time::Instant,
    ) {
        let t = self.telemetry();
        if let Some(o) = t.and_then(|t| t.observer.as_ref()) {
            o.step_finished(outcome, started.elapsed().as_secs_f64());
        }
        if let Some(m) = self.marks() {
            // A turn this step finalized has had its marks taken; a stale delivery may be a
            // duplicate of a step still running here, whose marks must stay. What a stale
            // delivery after the end adds is forgotten with the oldest marks.
            if !matches!(outcome, "finalized" | "stale" | "failed") {
                let now = now_us();
                m.step(&payload.turn_id, payload.step, |s| s.end = Some(now));
            }
        }
    }

    /// After a turn's terminal write: its facts to the observer, its spans to the sink. Best
    /// effort: a failed read is logged and the turn is not affected.
    pub(crate) async fn observe_finished(
        &self,
        rec: &TurnRecord,
        transcript: &mut crate::transcript::TranscriptOnce,
    ) {
        let Some(t) = self.telemetry() else {
            return;
        };
        let ctx = rec
            .trace
            .as_ref()
            .filter(|c| c.sampled && t.spans.is_some());
        if ctx.is_none() && t.observer.is_none() {
            return;
        }
        let entries = match transcript.get(self, &rec.session_id).await {
            Ok(e) => e,
            Err(e) => {
                tracing::debug!(session = %rec.session_id, "telemetry: transcript unreadable: {e}");
                return;
            }
        };
        let mut children = std::collections::HashMap::new();
        for c in rec.calls.values() {
            let Some(link) = c.child() else { continue };
            if let Ok(Some(child)) = self.load_record(&link.session_id).await {
                if child.turn_id == link.turn_id {
                    let failed =
                        (child.status == TurnStatus::Failed).then(|| child.failure_cause().code);
                    children.insert(
                        (link.session_id.clone(), link.turn_id.clone()),
                        ChildFacts {
                            session_id: link.session_id.clone(),
                            turn_id: link.turn_id.clone(),
                            failed,
                        },
                    );
                }
            }
        }
        let started = ctx.map_or(rec.created_at, |c| c.started_at_ms) * 1000;
        let lookup = |s: &str, t: &str| children.get(&(s.to_string(), t.to_string())).cloned();
        let marks = t.marks.take(&rec.turn_id);
        let mut f = facts(rec, started, now_us(), &entries, &marks, &lookup);
        if let (Some(link), Some(_)) = (&rec.parent, ctx) {
            f.parent_ended = match self.load_record(&link.session_id).await {
                Ok(Some(p)) => p.turn_id != link.turn_id || p.is_terminal(),
                _ => true,
            };
        }
        if let Some(o) = &t.observer {
            o.turn_finished(&f);
        }
        if let (Some(c), Some(sink)) = (ctx, &t.spans) {
            sink.export(spans(c, rec, &f));
        }
    }
}
