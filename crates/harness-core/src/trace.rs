//! What the loop tells observers: one trace per turn (spans) and the facts metrics count.
//!
//! A durable turn outlives processes: its steps are separate queue deliveries and may run after
//! a restart, so nothing of a trace is held in memory between steps. `harness::send` stores the
//! turn's trace context in its record ([`TraceCtx`]: ids, sampling decision, start time); at
//! finalize the loop reads the turn back from its transcript (one assistant entry per
//! generation, one result entry per call, all with deterministic ids and timestamps) and builds
//! the whole span tree at once. The turn span is therefore built last, after everything under
//! it is known, which is what lets it carry the outcome of its descendants without changing a
//! span already exported. Span ids below the turn are derived from the turn span id, so a
//! child turn can name its parent's `execute_tool harness::spawn` span without asking anyone.
//!
//! With no [`SpanSink`] installed, nothing here builds a span: the send path checks one
//! `Option`, and finalize builds only the [`TurnFacts`] an observer (metrics) asks for.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use harness_types::api::{SessionTraces, TracesSummary, TurnStatus};
use harness_types::ids;
use harness_types::message::{AgentMessage, ContentBlock, StopReason, Usage};
use harness_types::session::Entry;

use crate::record::{CallCheckpoint, TurnRecord};

/// A turn's trace context, stored in its record at send (a type of the record's crate).
pub use harness_machine::record::TraceCtx;

/// One finished span, in the loop's own terms; the exporter turns it into OTLP.
#[derive(Clone, Debug, PartialEq)]
pub struct SpanRecord {
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: Option<String>,
    pub parent_remote: bool,
    pub sampled: bool,
    pub name: String,
    pub kind: SpanKind,
    pub start_us: i64,
    pub end_us: i64,
    pub attributes: Vec<(&'static str, AttrValue)>,
    /// Status `ERROR`: the stable `error.type` and the public one-sentence summary.
    pub error: Option<SpanError>,
    /// Spans this one points at without being their child: (trace id, span id).
    pub links: Vec<(String, String)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    Internal,
    Client,
}

#[derive(Clone, Debug, PartialEq)]
pub enum AttrValue {
    Str(String),
    Int(i64),
    Float(f64),
    Bool(bool),
    StrList(Vec<String>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct SpanError {
    pub error_type: String,
    pub message: String,
}

/// Where finished spans go (the OTLP exporter).
pub trait SpanSink: Send + Sync {
    /// Hands over a turn's spans; never blocks on the network.
    fn export(&self, spans: Vec<SpanRecord>);
    /// The sampling decision for a new root trace.
    fn sample_root(&self, trace_id: &str) -> bool;
}

/// What metrics count; every method has a no-op default.
pub trait Observer: Send + Sync {
    /// A new turn was seeded (`root`: depth 0).
    fn turn_started(&self, _root: bool) {}
    /// A step ended: `outcome` is `advanced|finalized|parked|stale|failed`.
    fn step_finished(&self, _outcome: &'static str, _seconds: f64) {}
    /// A turn ended; the facts were read back from its transcript.
    fn turn_finished(&self, _facts: &TurnFacts) {}
    /// A usage announcement was recorded (`crate::usage`).
    fn usage_announced(&self, _event: &str) {}
}

/// The observers a runtime installs, once, before it serves.
#[derive(Clone, Default)]
pub struct Telemetry {
    pub spans: Option<Arc<dyn SpanSink>>,
    pub observer: Option<Arc<dyn Observer>>,
    /// Timings this process measured of the steps it ran (only while spans are exported).
    pub marks: MarkBook,
}

/// What this process measured of one step: wall-clock µs. A step that ran elsewhere (before a
/// restart) has none, and its spans take the transcript's timestamps instead.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepMarks {
    /// Deliveries of the step this process ran.
    pub runs: u32,
    pub start: i64,
    pub end: Option<i64>,
    pub gen_start: Option<i64>,
    pub first_chunk: Option<i64>,
    pub gen_end: Option<i64>,
    /// The hook calls of the step, in order.
    pub hooks: Vec<HookFacts>,
}

/// One hook call: `harness.hook {point}`.
#[derive(Clone, Debug, PartialEq)]
pub struct HookFacts {
    pub point: &'static str,
    pub function_id: String,
    /// `continue|deny|hold|failed|observed`.
    pub decision: &'static str,
    pub start_us: i64,
    pub end_us: i64,
}

/// Step timings by turn, bounded: a turn that never ends here (it moved to another process)
/// is forgotten once [`MARKED_TURNS`] newer ones were marked.
#[derive(Clone, Default)]
pub struct MarkBook(Arc<std::sync::Mutex<MarkInner>>);

#[derive(Default)]
struct MarkInner {
    /// Each turn's marks, with the number it was first marked under.
    turns: std::collections::HashMap<String, (u64, std::collections::BTreeMap<u64, StepMarks>)>,
    /// Turns by the number they were first marked under, oldest first. A turn taken since
    /// stays until it reaches the front or the queue is compacted: taking it is then a map
    /// removal, not a scan of every turn in flight.
    order: std::collections::VecDeque<(u64, String)>,
    next: u64,
}

const MARKED_TURNS: usize = 4096;

impl MarkInner {
    /// Whether `order`'s entry `(n, turn_id)` still names a turn being marked.
    fn live(&self, n: u64, turn_id: &str) -> bool {
        self.turns.get(turn_id).is_some_and(|(k, _)| *k == n)
    }

    fn first_mark(&mut self, turn_id: &str) {
        while self.turns.len() >= MARKED_TURNS {
            let Some((n, old)) = self.order.pop_front() else {
                break;
            };
            if self.live(n, &old) {
                self.turns.remove(&old);
            }
        }
        let n = self.next;
        self.next += 1;
        self.order.push_back((n, turn_id.to_string()));
        self.turns
            .insert(turn_id.to_string(), (n, Default::default()));
        // Taken turns pile up in the queue only until it holds twice the live ones.
        if self.order.len() > 2 * self.turns.len() + 64 {
            let order = std::mem::take(&mut self.order);
            self.order = order
                .into_iter()
                .filter(|(n, t)| self.live(*n, t))
                .collect();
        }
    }
}

impl MarkBook {
    pub(crate) fn step(&self, turn_id: &str, step: u64, f: impl FnOnce(&mut StepMarks)) {
        let mut m = self.0.lock().expect("marks lock");
        if !m.turns.contains_key(turn_id) {
            m.first_mark(turn_id);
        }
        if let Some((_, steps)) = m.turns.get_mut(turn_id) {
            f(steps.entry(step).or_default());
        }
    }

    pub(crate) fn take(&self, turn_id: &str) -> std::collections::BTreeMap<u64, StepMarks> {
        let mut m = self.0.lock().expect("marks lock");
        m.turns.remove(turn_id).map(|(_, s)| s).unwrap_or_default()
    }
}

static SPANS_BUILT: AtomicU64 = AtomicU64::new(0);

/// Wall-clock microseconds: spans and marks are timed finer than the transcript's ms.
pub fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// Span objects this process has built: stays 0 with no exporter configured.
pub fn spans_built() -> u64 {
    SPANS_BUILT.load(Ordering::Relaxed)
}

tokio::task_local! {
    /// The W3C `traceparent` the HTTP request carried, seen by `harness::send` in the same task.
    static TRACEPARENT: String;
}

/// Runs `f` with the caller's `traceparent` visible to a `harness::send` it calls in-task.
pub async fn with_traceparent<F: std::future::Future>(traceparent: String, f: F) -> F::Output {
    TRACEPARENT.scope(traceparent, f).await
}

/// `00-<32 hex>-<16 hex>-<2 hex>`: (trace id, span id, sampled). Anything else, or all-zero
/// ids, is not a parent (the turn starts a new trace; never an error).
pub fn parse_traceparent(v: &str) -> Option<(String, String, bool)> {
    let parts: Vec<&str> = v.trim().split('-').collect();
    let [version, trace, span, flags] = parts.as_slice() else {
        return None;
    };
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    if !hex(version, 2) || *version == "ff" || !hex(trace, 32) || !hex(span, 16) || !hex(flags, 2) {
        return None;
    }
    if trace.bytes().all(|b| b == b'0') || span.bytes().all(|b| b == b'0') {
        return None;
    }
    let sampled = u8::from_str_radix(flags, 16).ok()? & 1 == 1;
    Some((trace.to_string(), span.to_string(), sampled))
}

fn random_hex(len: usize) -> String {
    // `e_<32 hex>`: a v4 UUID, random enough for trace and span ids.
    let mut s = ids::new_entry_id().split_off(2);
    s.truncate(len);
    s
}

/// A span id below `turn_span_id`, the same on every process that asks (so a parent's spawn
/// span id is known to its child, and a redelivered step names its span as before).
pub fn derived_span_id(turn_span_id: &str, what: &str) -> String {
    let d = harness_types::digest::sha256(format!("{turn_span_id}/{what}").as_bytes());
    let mut out = String::with_capacity(16);
    for b in &d[..8] {
        out.push_str(&format!("{b:02x}"));
    }
    if out == "0000000000000000" {
        out.replace_range(15..16, "1");
    }
    out
}

/// The span id of the `execute_tool` span of call `call_id` in the turn whose span is
/// `turn_span_id`.
pub fn call_span_id(turn_span_id: &str, call_id: &str) -> String {
    derived_span_id(turn_span_id, &format!("call/{call_id}"))
}

/// A new trace, or the caller's (`traceparent`), or the parent turn's (`parent` = the
/// parent's context and the spawn call's id).
pub(crate) fn seed_ctx(
    sink: &dyn SpanSink,
    parent: Option<(&TraceCtx, &str)>,
    now: i64,
) -> TraceCtx {
    let turn_span_id = random_hex(16);
    if let Some((p, call_id)) = parent {
        return TraceCtx {
            trace_id: p.trace_id.clone(),
            parent_span_id: Some(call_span_id(&p.turn_span_id, call_id)),
            remote_parent: false,
            sampled: p.sampled,
            turn_span_id,
            started_at_ms: now,
        };
    }
    let caller = TRACEPARENT
        .try_with(|v| v.clone())
        .ok()
        .and_then(|v| parse_traceparent(&v));
    match caller {
        Some((trace_id, span_id, sampled)) => TraceCtx {
            trace_id,
            turn_span_id,
            parent_span_id: Some(span_id),
            remote_parent: true,
            sampled,
            started_at_ms: now,
        },
        None => {
            let trace_id = random_hex(32);
            TraceCtx {
                sampled: sink.sample_root(&trace_id),
                trace_id,
                turn_span_id,
                parent_span_id: None,
                remote_parent: false,
                started_at_ms: now,
            }
        }
    }
}

// --- the facts of a finished turn ------------------------------------------------------------

/// A finished turn as read back from its record and transcript.
#[derive(Clone, Debug)]
pub struct TurnFacts {
    pub root: bool,
    pub status: TurnStatus,
    /// From the closed set of `harness_turns_completed_total{reason}`.
    pub reason: &'static str,
    /// The failure's code and public summary, for a failed turn.
    pub failure: Option<(String, String)>,
    pub started_us: i64,
    pub ended_us: i64,
    pub steps: Vec<StepFacts>,
    /// A sub-agent whose parent turn had ended before it did (a detached spawn): its outcome
    /// cannot reach the parent's spans, which are exported already.
    pub parent_ended: bool,
}

#[derive(Clone, Debug)]
pub struct StepFacts {
    pub index: u64,
    pub start_us: i64,
    pub end_us: i64,
    /// From the end of the previous step to this one's start, both measured here: the queue's
    /// handoff.
    pub handoff_us: Option<i64>,
    /// This process ran the step after an earlier delivery of it had generated already (or
    /// twice itself): a redelivery after a crash or a timeout.
    pub redelivered: bool,
    /// The step wrote a compaction record (its context was summarized).
    pub compacted: bool,
    /// The hook calls this process ran for the step.
    pub hooks: Vec<HookFacts>,
    pub generation: Option<GenFacts>,
    pub calls: Vec<CallFacts>,
}

#[derive(Clone, Debug)]
pub struct GenFacts {
    pub start_us: i64,
    pub end_us: i64,
    pub provider: String,
    pub model: String,
    pub usage: Option<Usage>,
    pub finish_reason: &'static str,
    /// `auth_expired|rate_limited|context_overflow|transient|permanent`.
    pub error_kind: Option<&'static str>,
    /// Measured by this process (none for a generation that ran before a restart).
    pub time_to_first_chunk_us: Option<i64>,
}

#[derive(Clone, Debug)]
pub struct CallFacts {
    pub call_id: String,
    pub function_id: String,
    pub start_us: i64,
    pub end_us: i64,
    /// `ok|error|held|interrupted`.
    pub outcome: &'static str,
    /// A spawn's child turn: its session and how it ended.
    pub child: Option<ChildFacts>,
}

#[derive(Clone, Debug)]
pub struct ChildFacts {
    pub session_id: String,
    pub turn_id: String,
    /// The child's failure code when its turn failed.
    pub failed: Option<String>,
}

fn finish_reason(s: StopReason) -> &'static str {
    match s {
        StopReason::End => "stop",
        StopReason::Length => "length",
        StopReason::FunctionCall => "tool_call",
        StopReason::Error => "error",
        StopReason::Aborted => "aborted",
        #[allow(unreachable_patterns)]
        _ => "other",
    }
}

/// `harness_turns_completed_total{reason}` for a terminal record.
pub fn reason_of(rec: &TurnRecord) -> &'static str {
    match rec.status {
        TurnStatus::Cancelled => "stopped",
        TurnStatus::Failed => {
            let f = rec.failure_cause();
            if let Some(kind) = f.kind {
                return match kind.as_str() {
                    "auth_expired" => "provider_auth",
                    "rate_limited" => "provider_rate_limited",
                    "transient" => "provider_transient",
                    "permanent" => "provider_permanent",
                    "context_overflow" => "context_overflow",
                    _ => "other",
                };
            }
            let code = f.code.strip_prefix("harness.").unwrap_or(&f.code);
            const KNOWN: [&str; 6] = [
                "budget_exceeded",
                "context_overflow",
                "context_compaction_failed",
                "output_contract_invalid",
                "timeout",
                "internal",
            ];
            if let Some(k) = KNOWN.iter().find(|k| **k == code) {
                return k;
            }
            if code.starts_with("turn_internal") {
                "internal"
            } else {
                "other"
            }
        }
        _ => match rec.stop_reason {
            Some(crate::record::TurnStopReason::MaxTurns) => "max_turns",
            None => "none",
        },
    }
}

/// Reads a finished turn back from its transcript. `child_of` answers how a spawned child's
/// turn ended (its record), looked up by the caller.
pub(crate) fn facts(
    rec: &TurnRecord,
    started_us: i64,
    ended_us: i64,
    entries: &[Entry],
    marks: &std::collections::BTreeMap<u64, StepMarks>,
    children: &dyn Fn(&str, &str) -> Option<ChildFacts>,
) -> TurnFacts {
    // Only the turn's own entries (`e_<turn>_…`) are looked up: indexing the whole session
    // cost every turn of a long session its history.
    let ours = |id: &str| {
        id.strip_prefix("e_")
            .and_then(|r| r.strip_prefix(rec.turn_id.as_str()))
            .is_some_and(|r| r.starts_with('_'))
    };
    let by_id: std::collections::HashMap<&str, &Entry> = entries
        .iter()
        .filter(|e| ours(&e.entry_id))
        .map(|e| (e.entry_id.as_str(), e))
        .collect();
    let assistant = |n: u64| {
        by_id
            .get(ids::assistant_entry(&rec.turn_id, n).as_str())
            .and_then(|e| match &e.message {
                Some(AgentMessage::Assistant(m)) => Some(m),
                _ => None,
            })
    };
    let mut steps = Vec::new();
    let mut start = started_us;
    for n in 0..=rec.step {
        let a = assistant(n);
        let mark = marks.get(&n);
        if let Some(mk) = mark {
            start = mk.start.clamp(started_us, ended_us.max(started_us));
        }
        // Measured here, the step had found its answer already written: a redelivery.
        let redelivered =
            mark.is_some_and(|mk| mk.runs > 1 || a.is_some_and(|m| m.timestamp * 1000 < mk.start));
        let next_gen = assistant(n + 1).map(|m| m.timestamp * 1000);
        let mut calls = Vec::new();
        let mut generation = None;
        let mut end = start;
        if let Some(m) = a {
            let measured = mark.filter(|_| !redelivered);
            let gen_start = measured
                .and_then(|mk| mk.gen_start)
                .unwrap_or(m.timestamp * 1000)
                .clamp(start, ended_us.max(start));
            let mut results = Vec::new();
            for b in &m.content {
                let ContentBlock::FunctionCall {
                    id, function_id, ..
                } = b
                else {
                    continue;
                };
                let result = by_id
                    .get(ids::call_result_entry(&rec.turn_id, id).as_str())
                    .and_then(|e| match &e.message {
                        Some(AgentMessage::FunctionResult(r)) => Some(r),
                        _ => None,
                    });
                results.push((id, function_id, result));
            }
            // The generation ended no later than the first thing recorded after it.
            let mut gen_end = next_gen.unwrap_or(ended_us).min(ended_us);
            for (_, _, r) in &results {
                if let Some(r) = r {
                    gen_end = gen_end.min(r.timestamp * 1000);
                }
            }
            let gen_end = measured
                .and_then(|mk| mk.gen_end)
                .unwrap_or(gen_end)
                .clamp(gen_start, ended_us.max(gen_start));
            end = gen_end;
            for (id, function_id, r) in results {
                let checkpoint = rec.calls.get(id.as_str());
                let child = checkpoint
                    .and_then(|c| c.child())
                    .and_then(|l| children(&l.session_id, &l.turn_id));
                let (outcome, call_end) = match (r, checkpoint) {
                    (Some(r), _) => (
                        if r.is_error { "error" } else { "ok" },
                        (r.timestamp * 1000).max(gen_end),
                    ),
                    (None, Some(CallCheckpoint::Pending { .. })) => ("held", ended_us),
                    (None, _) => ("interrupted", ended_us),
                };
                // A call that waited (a spawn, an approval) ends when settled, later than its
                // step; the step itself ends with what it did at once.
                if next_gen.is_none_or(|t| call_end <= t) {
                    end = end.max(call_end);
                }
                calls.push(CallFacts {
                    call_id: id.clone(),
                    function_id: function_id.clone(),
                    start_us: gen_end,
                    end_us: call_end.max(gen_end),
                    outcome,
                    child,
                });
            }
            generation = Some(GenFacts {
                start_us: gen_start,
                end_us: gen_end,
                provider: m.provider.clone(),
                model: m.model.clone(),
                usage: m.usage.clone(),
                finish_reason: finish_reason(m.stop_reason),
                error_kind: m.error_kind.map(|k| k.as_str()),
                time_to_first_chunk_us: measured
                    .and_then(|mk| Some(mk.first_chunk? - mk.gen_start?))
                    .filter(|d| *d >= 0),
            });
        }
        match mark.and_then(|mk| mk.end) {
            Some(e) if n != rec.step => end = end.max(e.min(ended_us)),
            _ if n == rec.step => end = ended_us.max(end),
            _ => {
                if let Some(t) = next_gen {
                    end = end.min(t.max(start));
                }
            }
        }
        let compacted = by_id.contains_key(ids::compaction_entry(&rec.turn_id, n).as_str());
        let handoff_us = n
            .checked_sub(1)
            .and_then(|p| marks.get(&p))
            .and_then(|p| Some(mark?.start - p.end?))
            .filter(|d| *d >= 0);
        steps.push(StepFacts {
            hooks: mark.map(|mk| mk.hooks.clone()).unwrap_or_default(),
            handoff_us,
            index: n,
            start_us: start,
            end_us: end.max(start),
            redelivered,
            compacted,
            generation,
            calls,
        });
        start = end.max(start);
    }
    TurnFacts {
        parent_ended: false,
        root: rec.depth == 0,
        status: rec.status,
        reason: reason_of(rec),
        failure: (rec.status == TurnStatus::Failed).then(|| {
            let f = rec.failure_cause();
            (f.code, f.summary)
        }),
        started_us,
        ended_us,
        steps,
    }
}

// --- spans -----------------------------------------------------------------------------------

/// The provider as the GenAI conventions name it.
fn provider_name(p: &str) -> String {
    match p {
        "anthropic" => "anthropic".into(),
        "openai" | "openai-responses" | "openai_responses" => "openai".into(),
        other => other.replace('-', "_"),
    }
}

fn str_attr(k: &'static str, v: impl Into<String>) -> (&'static str, AttrValue) {
    (k, AttrValue::Str(v.into()))
}

fn int_attr(k: &'static str, v: i64) -> (&'static str, AttrValue) {
    (k, AttrValue::Int(v))
}

/// The span tree of a finished turn, turn span last. Errors are stamped upwards: a failed
/// generation, call or child turn marks its step and the turn with the first failure's type.
pub(crate) fn spans(ctx: &TraceCtx, rec: &TurnRecord, f: &TurnFacts) -> Vec<SpanRecord> {
    let agent = rec
        .options
        .agent
        .as_ref()
        .map(|a| a.name.clone())
        .unwrap_or_else(|| "harness".to_string());
    let mut out = Vec::new();
    let span = |span_id: String, parent: &str, name: String, kind, start, end| SpanRecord {
        trace_id: ctx.trace_id.clone(),
        span_id,
        parent_span_id: Some(parent.to_string()),
        parent_remote: false,
        sampled: ctx.sampled,
        name,
        kind,
        start_us: start,
        end_us: end,
        attributes: Vec::new(),
        error: None,
        links: Vec::new(),
    };
    let mut first_error: Option<SpanError> = None;
    let mut error_spans: i64 = 0;
    let mut tokens = (0i64, 0i64);
    let mut cost = 0f64;
    for s in &f.steps {
        let step_id = derived_span_id(&ctx.turn_span_id, &format!("step/{}", s.index));
        let mut step = span(
            step_id.clone(),
            &ctx.turn_span_id,
            format!("harness.step {}", s.index),
            SpanKind::Internal,
            s.start_us,
            s.end_us,
        );
        step.attributes
            .push(int_attr("harness.step.index", s.index as i64));
        step.attributes
            .push(("harness.step.redelivered", AttrValue::Bool(s.redelivered)));
        let mut step_error: Option<SpanError> = None;
        let mut note = |e: &SpanError, step_error: &mut Option<SpanError>| {
            error_spans += 1;
            if step_error.is_none() {
                *step_error = Some(e.clone());
            }
            if first_error.is_none() {
                first_error = Some(e.clone());
            }
        };
        if let Some(g) = &s.generation {
            let mut c = span(
                derived_span_id(&ctx.turn_span_id, &format!("context/{}", s.index)),
                &step_id,
                "harness.context.assemble".into(),
                SpanKind::Internal,
                s.start_us,
                g.start_us,
            );
            if let Some(i) = g.usage.as_ref().and_then(|u| u.input) {
                c.attributes
                    .push(int_attr("harness.context.input_tokens", i as i64));
            }
            c.attributes
                .push(("harness.context.compacted", AttrValue::Bool(s.compacted)));
            out.push(c);
            let provider = provider_name(&g.provider);
            let mut chat = span(
                derived_span_id(&ctx.turn_span_id, &format!("chat/{}", s.index)),
                &step_id,
                format!("chat {}", g.model),
                if provider == "scripted" {
                    SpanKind::Internal
                } else {
                    SpanKind::Client
                },
                g.start_us,
                g.end_us,
            );
            let a = &mut chat.attributes;
            a.push(str_attr("gen_ai.operation.name", "chat"));
            a.push(str_attr("gen_ai.provider.name", provider));
            a.push(str_attr("gen_ai.request.model", g.model.clone()));
            a.push(str_attr("gen_ai.response.model", g.model.clone()));
            a.push(("gen_ai.request.stream", AttrValue::Bool(true)));
            if let Some(t) = g.time_to_first_chunk_us {
                a.push((
                    "gen_ai.response.time_to_first_chunk",
                    AttrValue::Float(t as f64 / 1_000_000.0),
                ));
            }
            if let Some(m) = rec.options.max_output_tokens {
                a.push(int_attr("gen_ai.request.max_tokens", m as i64));
            }
            a.push((
                "gen_ai.response.finish_reasons",
                AttrValue::StrList(vec![g.finish_reason.to_string()]),
            ));
            if let Some(u) = &g.usage {
                let pairs = [
                    ("gen_ai.usage.input_tokens", u.input),
                    ("gen_ai.usage.output_tokens", u.output),
                    ("gen_ai.usage.cache_read.input_tokens", u.cache_read),
                    ("gen_ai.usage.cache_creation.input_tokens", u.cache_write),
                    ("gen_ai.usage.reasoning.output_tokens", u.reasoning),
                ];
                for (k, v) in pairs {
                    if let Some(v) = v {
                        a.push(int_attr(k, v as i64));
                    }
                }
                tokens.0 += u.input.unwrap_or(0) as i64;
                tokens.1 += u.output.unwrap_or(0) as i64;
                if let Some(c) = u.cost_usd {
                    cost += c;
                    a.push(("harness.cost_usd", AttrValue::Float(c)));
                }
                a.push(("harness.usage.estimated", AttrValue::Bool(u.estimated)));
            }
            if let Some(kind) = g.error_kind {
                let e = SpanError {
                    error_type: kind.to_string(),
                    message: format!("the provider failed ({kind})"),
                };
                note(&e, &mut step_error);
                chat.error = Some(e);
            }
            out.push(chat);
        }
        for c in &s.calls {
            let mut call = span(
                call_span_id(&ctx.turn_span_id, &c.call_id),
                &step_id,
                format!("execute_tool {}", c.function_id),
                SpanKind::Internal,
                c.start_us,
                c.end_us,
            );
            let a = &mut call.attributes;
            a.push(str_attr("gen_ai.operation.name", "execute_tool"));
            a.push(str_attr("gen_ai.tool.name", c.function_id.clone()));
            a.push(str_attr("gen_ai.tool.call.id", c.call_id.clone()));
            a.push(str_attr("gen_ai.tool.type", "function"));
            a.push(str_attr("harness.call.outcome", c.outcome));
            let failed_child = c.child.as_ref().and_then(|ch| ch.failed.clone());
            let e = match (&failed_child, c.outcome) {
                (Some(code), _) => Some(SpanError {
                    error_type: code.clone(),
                    message: "the sub-agent's turn failed".into(),
                }),
                (None, "error") => Some(SpanError {
                    error_type: "harness.call_error".into(),
                    message: format!("{} answered an error", c.function_id),
                }),
                _ => None,
            };
            if let Some(e) = e {
                note(&e, &mut step_error);
                call.error = Some(e);
            }
            out.push(call);
        }
        for (i, h) in s.hooks.iter().enumerate() {
            let mut hook = span(
                derived_span_id(&ctx.turn_span_id, &format!("hook/{}/{i}", s.index)),
                &step_id,
                format!("harness.hook {}", h.point),
                SpanKind::Internal,
                h.start_us,
                h.end_us,
            );
            hook.attributes
                .push(str_attr("harness.hook.point", h.point));
            hook.attributes
                .push(str_attr("harness.hook.function", h.function_id.clone()));
            hook.attributes
                .push(str_attr("harness.hook.decision", h.decision));
            if h.decision == "failed" {
                let e = SpanError {
                    error_type: "harness.hook_failed".into(),
                    message: format!("hook {} failed", h.function_id),
                };
                note(&e, &mut step_error);
                hook.error = Some(e);
            }
            out.push(hook);
        }
        if let Some(e) = step_error {
            error_spans += 1;
            step.error = Some(e);
        }
        out.push(step);
    }
    let mut turn = SpanRecord {
        trace_id: ctx.trace_id.clone(),
        span_id: ctx.turn_span_id.clone(),
        parent_span_id: ctx.parent_span_id.clone(),
        parent_remote: ctx.remote_parent,
        sampled: ctx.sampled,
        name: format!("invoke_agent {agent}"),
        kind: SpanKind::Internal,
        start_us: f.started_us,
        end_us: f.ended_us.max(f.started_us),
        attributes: Vec::new(),
        error: None,
        links: Vec::new(),
    };
    let a = &mut turn.attributes;
    a.push(str_attr("gen_ai.operation.name", "invoke_agent"));
    a.push(str_attr("gen_ai.agent.name", agent));
    a.push(str_attr("gen_ai.conversation.id", rec.session_id.clone()));
    a.push(str_attr("iii.session.id", rec.session_id.clone()));
    a.push(str_attr("harness.turn.id", rec.turn_id.clone()));
    a.push(str_attr("harness.turn.status", status_str(rec.status)));
    a.push(int_attr("harness.turn.steps", f.steps.len() as i64));
    a.push(int_attr("harness.turn.depth", rec.depth as i64));
    a.push(int_attr("gen_ai.usage.input_tokens", tokens.0));
    a.push(int_attr("gen_ai.usage.output_tokens", tokens.1));
    a.push(("harness.cost_usd", AttrValue::Float(cost)));
    if let Some(p) = &rec.parent {
        a.push(str_attr("harness.parent.session_id", p.session_id.clone()));
        a.push(str_attr("harness.parent.turn_id", p.turn_id.clone()));
    }
    if f.parent_ended {
        a.push(("harness.parent_already_ended", AttrValue::Bool(true)));
        if let Some(parent) = &ctx.parent_span_id {
            turn.links.push((ctx.trace_id.clone(), parent.clone()));
        }
    }
    // The turn's own failure names the error; else the first failure under it.
    let own = f.failure.as_ref().map(|(code, summary)| SpanError {
        error_type: code.clone(),
        message: summary.clone(),
    });
    if let Some(e) = own.or(first_error) {
        error_spans += 1;
        turn.attributes
            .push(int_attr("harness.trace.error_span_count", error_spans));
        turn.error = Some(e);
    }
    out.push(turn);
    SPANS_BUILT.fetch_add(out.len() as u64, Ordering::Relaxed);
    out
}

fn status_str(s: TurnStatus) -> &'static str {
    match s {
        TurnStatus::Running => "running",
        TurnStatus::AwaitingFunctions => "awaiting_functions",
        TurnStatus::Completed => "completed",
        TurnStatus::Cancelled => "cancelled",
        TurnStatus::Failed => "failed",
    }
}

// --- the loop's hooks ------------------------------------------------------------------------

/// `harness_steps_total{outcome}` for a step's answer.
pub(crate) fn step_outcome(r: &harness_types::api::TurnStepResult) -> &'static str {
    if r.skipped {
        "stale"
    } else if r.status == TurnStatus::AwaitingFunctions {
        "parked"
    } else if r.next_step.is_some() {
        "advanced"
    } else {
        "finalized"
    }
}

// --- the `harness::metrics` summary ----------------------------------------------------------

/// A session's spans as the export would build them, counted from its transcript alone: per
/// turn a turn span, per generation a step, a context and a chat span, per call an
/// `execute_tool` span; errors as [`spans`] stamps them.
pub(crate) fn session_traces(session_id: &str, entries: &[Entry]) -> SessionTraces {
    use std::collections::{BTreeMap, HashMap, HashSet};
    #[derive(Default)]
    struct Turn {
        spans: u64,
        errors: u64,
        failed: bool,
        /// Generations (by entry) with a failure in them: their step spans are stamped.
        failed_steps: HashSet<String>,
        calls: HashMap<String, String>,
        first: Option<i64>,
        last: i64,
    }
    impl Turn {
        fn stamp(&mut self, at: i64) {
            self.first = Some(self.first.map_or(at, |f| f.min(at)));
            self.last = self.last.max(at);
        }
    }
    let mut turns: BTreeMap<String, Turn> = BTreeMap::new();
    for e in entries {
        let Some(tid) = e
            .origin
            .as_ref()
            .and_then(|o| o.get("turn_id"))
            .and_then(serde_json::Value::as_str)
        else {
            continue;
        };
        let t = turns.entry(tid.to_string()).or_default();
        match &e.message {
            Some(AgentMessage::Assistant(m)) => {
                t.stamp(m.timestamp);
                t.spans += 3;
                for b in &m.content {
                    if let ContentBlock::FunctionCall { id, .. } = b {
                        t.spans += 1;
                        t.calls.insert(id.clone(), e.entry_id.clone());
                    }
                }
                if m.error_kind.is_some() {
                    t.errors += 1;
                    t.failed_steps.insert(e.entry_id.clone());
                }
            }
            Some(AgentMessage::FunctionResult(r)) => {
                t.stamp(r.timestamp);
                if r.is_error {
                    t.errors += 1;
                    if let Some(step) = t.calls.get(&r.function_call_id).cloned() {
                        t.failed_steps.insert(step);
                    }
                }
            }
            Some(AgentMessage::User(u)) => t.stamp(u.timestamp),
            _ => {}
        }
        if e.entry_id == ids::error_entry(tid) {
            t.failed = true;
        }
    }
    let mut out = SessionTraces {
        session_id: session_id.to_string(),
        ..Default::default()
    };
    for t in turns.values() {
        out.turns += 1;
        out.span_count += 1 + t.spans;
        let stamped = t.failed_steps.len() as u64;
        out.error_span_count += t.errors + stamped + u64::from(t.failed || t.errors > 0);
        out.duration_ms += (t.last - t.first.unwrap_or(t.last)).max(0) as u64;
    }
    out
}

/// The tree's summary; `sessions` root first (as `harness::metrics` walks them).
pub(crate) fn traces_summary(sessions: Vec<SessionTraces>) -> TracesSummary {
    TracesSummary {
        trace_count: sessions.first().map_or(0, |r| r.turns),
        span_count: sessions.iter().map(|s| s.span_count).sum(),
        error_span_count: sessions.iter().map(|s| s.error_span_count).sum(),
        duration_ms: sessions.first().map_or(0, |r| r.duration_ms),
        by_session: sessions,
    }
}

#[cfg(test)]
mod tests;
