//! The Prometheus registry behind `GET /metrics`: one per runtime, never the process-global
//! default (the in-process tests run several servers in one process, which must count apart).
//!
//! Every label comes from a closed set or is bounded: no session or turn id, no text. Provider
//! names outside the known set count as `other`; models and functions take at most
//! [`MAX_NAMES`] distinct values each, after which a new one counts as `other` /
//! `unregistered` (the model's own output names functions, so it must not mint labels).

use std::collections::HashSet;
use std::sync::Mutex;

use harness_core::trace::{Observer, TurnFacts};
use prometheus::{
    core::Collector, exponential_buckets, CounterVec, Encoder, HistogramOpts, HistogramVec,
    IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Distinct models, and distinct functions, a registry labels by name.
pub const MAX_NAMES: usize = 64;

const PROVIDERS: [&str; 10] = [
    "anthropic",
    "openai",
    "openai-responses",
    "openai-compatible",
    "ollama",
    "llamacpp",
    "vllm",
    "lmstudio",
    "scripted",
    "other",
];

pub struct Metrics {
    registry: Registry,
    turns_started: IntCounterVec,
    turns_completed: IntCounterVec,
    steps: IntCounterVec,
    step_duration: HistogramVec,
    generation_duration: HistogramVec,
    generation_errors: IntCounterVec,
    time_to_first_chunk: HistogramVec,
    handoff: HistogramVec,
    tokens: IntCounterVec,
    cost: CounterVec,
    calls: IntCounterVec,
    call_duration: HistogramVec,
    http: IntCounterVec,
    spans_dropped: IntCounter,
    spans_built: IntCounter,
    usage: IntCounterVec,
    queue_depth: IntGaugeVec,
    sessions: IntGaugeVec,
    approvals_pending: IntGauge,
    event_streams_open: IntGauge,
    models: Mutex<HashSet<String>>,
    functions: Mutex<HashSet<String>>,
}

/// Registers a metric with `r` and hands it back. Both can only fail on a definition of ours
/// (a bad name, a name registered twice), so they panic at startup rather than miscount.
fn registered<M: Collector + Clone + 'static>(r: &Registry, metric: prometheus::Result<M>) -> M {
    let m = metric.expect("metric definition");
    r.register(Box::new(m.clone()))
        .expect("metric registered once");
    m
}

fn counter(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    registered(r, IntCounterVec::new(Opts::new(name, help), labels))
}

fn histogram(r: &Registry, name: &str, help: &str, labels: &[&str], b: Vec<f64>) -> HistogramVec {
    registered(
        r,
        HistogramVec::new(HistogramOpts::new(name, help).buckets(b), labels),
    )
}

/// 1 ms … 32 s, doubling.
fn seconds() -> Vec<f64> {
    exponential_buckets(0.001, 2.0, 16).expect("buckets")
}

impl Metrics {
    pub fn new() -> Metrics {
        let r = Registry::new();
        let build = registered(
            &r,
            IntGaugeVec::new(
                Opts::new(
                    "harness_build_info",
                    "The running harness build (always 1).",
                ),
                &["version"],
            ),
        );
        build.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        let spans_dropped = registered(
            &r,
            IntCounter::new(
                "harness_otel_spans_dropped_total",
                "Spans lost on the way to the OTLP receiver (queue full or export failed).",
            ),
        );
        let spans_built = registered(
            &r,
            IntCounter::new(
                "harness_otel_spans_built_total",
                "Span objects this process has built (0 while no OTLP endpoint is configured).",
            ),
        );
        let cost = registered(
            &r,
            CounterVec::new(
                Opts::new(
                    "harness_cost_usd_total",
                    "What generations cost, in US dollars (provider-reported or priced from the catalog).",
                ),
                &["provider", "model"],
            ),
        );
        let gauge = |name: &str, help: &str| registered(&r, IntGauge::new(name, help));
        let gauges = |name: &str, help: &str, label: &str| {
            registered(&r, IntGaugeVec::new(Opts::new(name, help), &[label]))
        };
        let queue_depth = gauges(
            "harness_queue_depth",
            "Messages of a queue not yet acknowledged (in flight included).",
            "queue",
        );
        let sessions = gauges(
            "harness_sessions",
            "Sessions by status (refreshed in the background at most every 10 s).",
            "status",
        );
        let approvals_pending = gauge(
            "harness_approvals_pending",
            "Calls held for a human approval (refreshed in the background at most every 10 s).",
        );
        let event_streams_open = gauge(
            "harness_event_streams_open",
            "Session event streams (SSE) open now.",
        );
        Metrics {
            queue_depth,
            sessions,
            approvals_pending,
            event_streams_open,
            turns_started: counter(
                &r,
                "harness_turns_started_total",
                "Turns seeded.",
                &["kind"],
            ),
            turns_completed: counter(
                &r,
                "harness_turns_completed_total",
                "Turns that reached a terminal status, by status and reason.",
                &["status", "reason"],
            ),
            steps: counter(
                &r,
                "harness_steps_total",
                "Durable steps run, by outcome.",
                &["outcome"],
            ),
            step_duration: histogram(
                &r,
                "harness_step_duration_seconds",
                "Wall time of one durable step.",
                &[],
                seconds(),
            ),
            generation_duration: histogram(
                &r,
                "harness_generation_duration_seconds",
                "Wall time of one generation, as the transcript recorded it.",
                &["provider", "model"],
                seconds(),
            ),
            time_to_first_chunk: histogram(
                &r,
                "harness_generation_time_to_first_chunk_seconds",
                "From the request to the first streamed content of a generation.",
                &["provider", "model"],
                seconds(),
            ),
            handoff: histogram(
                &r,
                "harness_step_handoff_seconds",
                "From the end of a step to the start of the turn's next one (the queue's handoff).",
                &[],
                // 10 µs … 20 s, doubling: a handoff is usually well under a millisecond.
                exponential_buckets(0.00001, 2.0, 22).expect("buckets"),
            ),
            generation_errors: counter(
                &r,
                "harness_generation_errors_total",
                "Generations the provider ended with an error, by class.",
                &["provider", "model", "kind"],
            ),
            tokens: counter(
                &r,
                "harness_tokens_total",
                "Tokens the providers reported, by type.",
                &["provider", "model", "type"],
            ),
            cost,
            calls: counter(
                &r,
                "harness_function_calls_total",
                "Function calls the model made, by outcome.",
                &["function", "outcome"],
            ),
            call_duration: histogram(
                &r,
                "harness_function_call_duration_seconds",
                "Wall time from dispatch to result of a function call.",
                &["function"],
                seconds(),
            ),
            http: counter(
                &r,
                "harness_http_requests_total",
                "HTTP requests answered, by route template and status code.",
                &["route", "code"],
            ),
            usage: counter(
                &r,
                "harness_usage_announcements_total",
                "Anonymous usage announcements recorded, by event.",
                &["event"],
            ),
            spans_dropped,
            spans_built,
            registry: r,
            models: Mutex::new(HashSet::new()),
            functions: Mutex::new(HashSet::new()),
        }
    }

    /// The classic text exposition format 0.0.4.
    pub fn render(&self) -> String {
        let built = harness_core::trace::spans_built();
        if built > self.spans_built.get() {
            self.spans_built.inc_by(built - self.spans_built.get());
        }
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding into a Vec");
        String::from_utf8(out).expect("the text format is UTF-8")
    }

    pub const CONTENT_TYPE: &'static str = "text/plain; version=0.0.4; charset=utf-8";

    /// `queue` is one of the loop's own queues (`harness-turn`, `harness-session-deletion`).
    pub fn set_queue_depth(&self, queue: &'static str, depth: usize) {
        self.queue_depth
            .with_label_values(&[queue])
            .set(depth as i64);
    }

    /// Sessions by status: `idle`, `working`, `done`, `error`.
    pub fn set_sessions(&self, by_status: &[(&'static str, usize)]) {
        for (status, n) in by_status {
            self.sessions.with_label_values(&[*status]).set(*n as i64);
        }
    }

    pub fn set_approvals_pending(&self, n: usize) {
        self.approvals_pending.set(n as i64);
    }

    pub fn set_event_streams_open(&self, n: usize) {
        self.event_streams_open.set(n as i64);
    }

    pub fn http_request(&self, route: &str, code: u16) {
        self.http
            .with_label_values(&[route, &code.to_string()])
            .inc();
    }

    /// Brings the dropped-span counter up to the exporter's own count.
    pub fn spans_dropped_now(&self, total: u64) {
        let seen = self.spans_dropped.get();
        if total > seen {
            self.spans_dropped.inc_by(total - seen);
        }
    }

    fn bounded(set: &Mutex<HashSet<String>>, name: &str, other: &str) -> String {
        let ok = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.:/@".contains(&b));
        if !ok {
            return other.to_string();
        }
        let mut s = set.lock().expect("label set");
        if s.contains(name) || s.len() < MAX_NAMES {
            s.insert(name.to_string());
            name.to_string()
        } else {
            other.to_string()
        }
    }

    fn provider(p: &str) -> &'static str {
        PROVIDERS
            .iter()
            .find(|k| **k == p.replace('_', "-"))
            .copied()
            .unwrap_or("other")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Observer for Metrics {
    fn usage_announced(&self, event: &str) {
        let event = match event {
            "harness_session_progress" | "harness_turn_failed" => event,
            _ => "other",
        };
        self.usage.with_label_values(&[event]).inc();
    }

    fn turn_started(&self, root: bool) {
        self.turns_started
            .with_label_values(&[if root { "root" } else { "subagent" }])
            .inc();
    }

    fn step_finished(&self, outcome: &'static str, seconds: f64) {
        self.steps.with_label_values(&[outcome]).inc();
        self.step_duration
            .with_label_values::<&str>(&[])
            .observe(seconds);
    }

    fn turn_finished(&self, f: &TurnFacts) {
        let status = match f.status {
            harness_types::api::TurnStatus::Completed => "completed",
            harness_types::api::TurnStatus::Cancelled => "cancelled",
            _ => "failed",
        };
        self.turns_completed
            .with_label_values(&[status, f.reason])
            .inc();
        for s in &f.steps {
            if let Some(h) = s.handoff_us {
                self.handoff
                    .with_label_values::<&str>(&[])
                    .observe(h as f64 / 1e6);
            }
            if let Some(g) = &s.generation {
                let provider = Metrics::provider(&g.provider);
                let model = Metrics::bounded(&self.models, &g.model, "other");
                let l = [provider, model.as_str()];
                self.generation_duration
                    .with_label_values(&l)
                    .observe((g.end_us - g.start_us).max(0) as f64 / 1e6);
                if let Some(t) = g.time_to_first_chunk_us {
                    self.time_to_first_chunk
                        .with_label_values(&l)
                        .observe(t as f64 / 1e6);
                }
                if let Some(kind) = g.error_kind {
                    self.generation_errors
                        .with_label_values(&[provider, &model, kind])
                        .inc();
                }
                if let Some(u) = &g.usage {
                    for (t, v) in [
                        ("input", u.input),
                        ("output", u.output),
                        ("cache_read", u.cache_read),
                        ("cache_write", u.cache_write),
                        ("reasoning", u.reasoning),
                    ] {
                        if let Some(v) = v.filter(|v| *v > 0) {
                            self.tokens
                                .with_label_values(&[provider, &model, t])
                                .inc_by(v);
                        }
                    }
                    if let Some(c) = u.cost_usd.filter(|c| c.is_finite() && *c > 0.0) {
                        self.cost.with_label_values(&l).inc_by(c);
                    }
                }
            }
            for c in &s.calls {
                let function = Metrics::bounded(&self.functions, &c.function_id, "unregistered");
                self.calls.with_label_values(&[&function, c.outcome]).inc();
                if c.outcome != "held" && c.outcome != "interrupted" {
                    self.call_duration
                        .with_label_values(&[&function])
                        .observe((c.end_us - c.start_us).max(0) as f64 / 1e6);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_past_the_bound_and_malformed_ones_share_one_label() {
        let m = Metrics::new();
        for i in 0..MAX_NAMES {
            assert_eq!(
                Metrics::bounded(&m.models, &format!("model-{i}"), "other"),
                format!("model-{i}")
            );
        }
        assert_eq!(
            Metrics::bounded(&m.models, "one-too-many", "other"),
            "other"
        );
        assert_eq!(Metrics::bounded(&m.models, "model-3", "other"), "model-3");
        assert_eq!(
            Metrics::bounded(&m.functions, "has \"quotes\" and spaces", "unregistered"),
            "unregistered"
        );
        assert_eq!(Metrics::provider("openai_compatible"), "openai-compatible");
        assert_eq!(Metrics::provider("made-up"), "other");
    }

    #[test]
    fn registries_count_apart() {
        let a = Metrics::new();
        let b = Metrics::new();
        a.turn_started(true);
        assert!(a
            .render()
            .contains("harness_turns_started_total{kind=\"root\"} 1"));
        assert!(!b
            .render()
            .contains("harness_turns_started_total{kind=\"root\"}"));
    }
}
