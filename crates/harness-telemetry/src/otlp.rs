//! OTLP/HTTP (protobuf) export of the loop's spans.
//!
//! The loop hands over finished [`SpanRecord`]s with ids it chose itself (a turn's span ids are
//! stored or derived, see `harness_core::trace`), so they bypass the SDK's tracer, which always
//! mints its own span id, and go straight to the SDK's `BatchSpanProcessor` as `SpanData`.
//!
//! Pitfall (found while choosing the client): the batch processor exports on its own thread
//! through `futures_executor::block_on`, outside any Tokio runtime. With the exporter's async
//! `reqwest-client` feature the first export panics ("there is no reactor running, must be
//! called from the context of a Tokio 1.x runtime") and `shutdown()` then fails. A blocking
//! client exports fine there, so that is the one used (`otlp_http`: reqwest's, the version the
//! workspace already links). The blocking client must also not be created or dropped on a Tokio
//! worker thread, hence the exporter is built on a plain thread.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use harness_core::trace::{AttrValue, SpanKind as Kind, SpanRecord, SpanSink};
use opentelemetry::trace::{
    Event, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue, Value};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SpanData, SpanEvents, SpanExporter, SpanLinks,
    SpanProcessor,
};
use opentelemetry_sdk::Resource;

/// Spans waiting for export at most; the overflow is dropped and counted.
pub const QUEUE_SPANS: usize = 2048;
/// Shutdown (SIGINT/SIGTERM, `chat` exit) waits this long for the queue to drain.
pub const FLUSH_CAP: Duration = Duration::from_secs(5);
/// Export failures are logged at most this often.
const WARN_EVERY: Duration = Duration::from_secs(60);
/// One export's whole HTTP exchange at most.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("harness/invalid_request: {var}: '{value}' is not supported; harness exports OTLP over http/protobuf only")]
    Protocol { var: &'static str, value: String },
    #[error("harness/invalid_request: {var}: '{value}' is not an http(s) URL")]
    Endpoint { var: &'static str, value: String },
    #[error("harness/invalid_request: OTEL_TRACES_SAMPLER: '{0}' is not one of always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off, parentbased_traceidratio")]
    Sampler(String),
    #[error("harness/internal: the OTLP exporter did not start: {0}")]
    Start(String),
}

/// Where the effective endpoint came from (`harness config show`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EndpointSource {
    Flag,
    TracesEnv,
    Env,
    ConfigFile,
}

impl EndpointSource {
    pub fn as_str(&self) -> &'static str {
        match self {
            EndpointSource::Flag => "flag --otlp-endpoint",
            EndpointSource::TracesEnv => "env OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            EndpointSource::Env => "env OTEL_EXPORTER_OTLP_ENDPOINT",
            EndpointSource::ConfigFile => "file otel_endpoint",
        }
    }
}

/// The root sampler (`OTEL_TRACES_SAMPLER`); a child always follows its parent's decision.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sampler {
    On,
    Off,
    Ratio(f64),
}

#[derive(Clone, Debug)]
pub struct OtlpConfig {
    /// The full traces URL (`…/v1/traces`).
    pub endpoint: String,
    pub source: EndpointSource,
    pub sampler: Sampler,
}

fn env(var: &str) -> Option<String> {
    std::env::var(var).ok().filter(|v| !v.trim().is_empty())
}

fn traces_url(base: &str, var: &'static str) -> Result<String, TelemetryError> {
    let b = base.trim();
    if !(b.starts_with("http://") || b.starts_with("https://")) {
        return Err(TelemetryError::Endpoint {
            var,
            value: b.to_string(),
        });
    }
    Ok(format!("{}/v1/traces", b.trim_end_matches('/')))
}

impl OtlpConfig {
    /// The export configuration, or `None` when nothing asks for export (or
    /// `OTEL_SDK_DISABLED=true`, which wins over everything). Precedence: the flag, then
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (used as is), then `OTEL_EXPORTER_OTLP_ENDPOINT`
    /// (`/v1/traces` appended), then the config file's `otel_endpoint`.
    pub fn resolve(
        flag: Option<&str>,
        file: Option<&str>,
    ) -> Result<Option<OtlpConfig>, TelemetryError> {
        if env("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        for var in [
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ] {
            if let Some(v) = env(var) {
                if v.trim() != "http/protobuf" {
                    return Err(TelemetryError::Protocol { var, value: v });
                }
                break;
            }
        }
        let (endpoint, source) = if let Some(f) = flag.filter(|f| !f.trim().is_empty()) {
            (traces_url(f, "--otlp-endpoint")?, EndpointSource::Flag)
        } else if let Some(t) = env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
            if !(t.starts_with("http://") || t.starts_with("https://")) {
                return Err(TelemetryError::Endpoint {
                    var: "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                    value: t,
                });
            }
            (t.trim().to_string(), EndpointSource::TracesEnv)
        } else if let Some(e) = env("OTEL_EXPORTER_OTLP_ENDPOINT") {
            (
                traces_url(&e, "OTEL_EXPORTER_OTLP_ENDPOINT")?,
                EndpointSource::Env,
            )
        } else if let Some(f) = file.filter(|f| !f.trim().is_empty()) {
            (traces_url(f, "otel_endpoint")?, EndpointSource::ConfigFile)
        } else {
            return Ok(None);
        };
        Ok(Some(OtlpConfig {
            endpoint,
            source,
            sampler: sampler_from_env()?,
        }))
    }
}

fn sampler_from_env() -> Result<Sampler, TelemetryError> {
    let arg = env("OTEL_TRACES_SAMPLER_ARG")
        .and_then(|a| a.trim().parse::<f64>().ok())
        .filter(|r| (0.0..=1.0).contains(r))
        .unwrap_or(1.0);
    Ok(match env("OTEL_TRACES_SAMPLER").as_deref().map(str::trim) {
        None | Some("always_on") | Some("parentbased_always_on") => Sampler::On,
        Some("always_off") | Some("parentbased_always_off") => Sampler::Off,
        Some("traceidratio") | Some("parentbased_traceidratio") => Sampler::Ratio(arg),
        Some(other) => return Err(TelemetryError::Sampler(other.to_string())),
    })
}

/// The exporter the batch processor calls: counts what it could not deliver and warns about
/// it at most once a minute, so a receiver that is down never floods the log.
#[derive(Debug)]
struct Delivering<E> {
    inner: E,
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    /// Spans handed to the processor and not yet taken by an export.
    queued: AtomicUsize,
    dropped: AtomicU64,
    exported: AtomicU64,
    last_warn: Mutex<Option<Instant>>,
}

impl Shared {
    fn warn(&self, why: &str) {
        let mut last = self.last_warn.lock().expect("warn clock");
        if last.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
            *last = Some(Instant::now());
            tracing::warn!(
                "OTLP export failed, spans dropped (next warning in a minute at most): {why}"
            );
        }
    }
}

impl<E: SpanExporter> SpanExporter for Delivering<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len();
        self.shared.queued.fetch_sub(n, Ordering::AcqRel);
        match self.inner.export(batch).await {
            Ok(()) => {
                self.shared.exported.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(e) => {
                self.shared.dropped.fetch_add(n as u64, Ordering::Relaxed);
                self.shared.warn(&e.to_string());
            }
        }
        // Reported here, once a minute; the processor's own error log would repeat per batch.
        Ok(())
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP span sink the loop exports through.
pub struct OtlpSink {
    processor: BatchSpanProcessor,
    shared: Arc<Shared>,
    sampler: Sampler,
    scope: InstrumentationScope,
}

impl OtlpSink {
    pub fn start(cfg: &OtlpConfig) -> Result<OtlpSink, TelemetryError> {
        let endpoint = cfg.endpoint.clone();
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        let processor = std::thread::spawn(move || {
            let client = crate::otlp_http::BlockingHttp::new(EXPORT_TIMEOUT)
                .map_err(|e| TelemetryError::Start(e.to_string()))?;
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_http_client(client)
                .with_protocol(Protocol::HttpBinary)
                .with_endpoint(endpoint)
                .with_timeout(EXPORT_TIMEOUT)
                .build()
                .map_err(|e| TelemetryError::Start(e.to_string()))?;
            let batch = BatchConfigBuilder::default()
                .with_max_queue_size(QUEUE_SPANS)
                .with_scheduled_delay(Duration::from_millis(500))
                .build();
            let mut processor = BatchSpanProcessor::builder(Delivering {
                inner: exporter,
                shared: s,
            })
            .with_batch_config(batch)
            .build();
            processor.set_resource(&resource());
            Ok::<_, TelemetryError>(processor)
        })
        .join()
        .map_err(|_| TelemetryError::Start("the exporter thread panicked".into()))??;
        Ok(OtlpSink {
            processor,
            shared,
            sampler: cfg.sampler,
            scope: InstrumentationScope::builder("harness")
                .with_version(env!("CARGO_PKG_VERSION"))
                .build(),
        })
    }

    /// Spans lost: queue overflow or a failed export.
    pub fn dropped(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }

    /// Drains the queue, waiting at most [`FLUSH_CAP`]. Blocking: call off the async threads.
    pub fn shutdown(&self) {
        if let Err(e) = self.processor.shutdown_with_timeout(FLUSH_CAP) {
            tracing::warn!("OTLP flush at shutdown: {e}");
        }
    }
}

/// `service.name` (`OTEL_SERVICE_NAME`, default `harness`), `service.version`,
/// `service.instance.id`, and `OTEL_RESOURCE_ATTRIBUTES`.
fn resource() -> Resource {
    let mut b = Resource::builder();
    if env("OTEL_SERVICE_NAME").is_none() {
        b = b.with_service_name("harness");
    }
    let instance = harness_types::ids::new_entry_id().split_off(2);
    b.with_attributes([
        KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
        KeyValue::new("service.instance.id", instance),
    ])
    .build()
}

fn time(us: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_micros(us.max(0) as u64)
}

fn hex_id<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn value(v: &AttrValue) -> Value {
    match v {
        AttrValue::Str(s) => Value::from(s.clone()),
        AttrValue::Int(i) => Value::I64(*i),
        AttrValue::Float(f) => Value::F64(*f),
        AttrValue::Bool(b) => Value::Bool(*b),
        AttrValue::StrList(l) => Value::Array(opentelemetry::Array::String(
            l.iter().map(|s| s.clone().into()).collect(),
        )),
    }
}

impl OtlpSink {
    fn span_data(&self, s: SpanRecord) -> Option<SpanData> {
        span_data(s, &self.scope)
    }
}

/// A loop span as the SDK's `SpanData`; `None` for ids that are not hex of the right length.
fn span_data(s: SpanRecord, scope: &InstrumentationScope) -> Option<SpanData> {
    let trace_id = TraceId::from_bytes(hex_id::<16>(&s.trace_id)?);
    let links: Vec<(TraceId, SpanId)> = s
        .links
        .iter()
        .filter_map(|(t, sp)| {
            Some((
                TraceId::from_bytes(hex_id::<16>(t)?),
                SpanId::from_bytes(hex_id::<8>(sp)?),
            ))
        })
        .collect();
    let span_id = SpanId::from_bytes(hex_id::<8>(&s.span_id)?);
    let parent = s
        .parent_span_id
        .as_deref()
        .and_then(hex_id::<8>)
        .map(SpanId::from_bytes)
        .unwrap_or(SpanId::INVALID);
    let mut attributes: Vec<KeyValue> = s
        .attributes
        .iter()
        .map(|(k, v)| KeyValue::new(*k, value(v)))
        .collect();
    let mut events = SpanEvents::default();
    let mut span_links = SpanLinks::default();
    span_links.links = links
        .into_iter()
        .map(|(t, sp)| {
            opentelemetry::trace::Link::with_context(SpanContext::new(
                t,
                sp,
                TraceFlags::SAMPLED,
                false,
                TraceState::default(),
            ))
        })
        .collect();
    let status = match &s.error {
        Some(e) => {
            attributes.push(KeyValue::new("error.type", e.error_type.clone()));
            events.events.push(Event::new(
                "exception",
                time(s.end_us),
                vec![
                    KeyValue::new("exception.type", e.error_type.clone()),
                    KeyValue::new("exception.message", e.message.clone()),
                ],
                0,
            ));
            Status::error(e.message.clone())
        }
        None => Status::Unset,
    };
    Some(SpanData {
        span_context: SpanContext::new(
            trace_id,
            span_id,
            TraceFlags::SAMPLED,
            false,
            TraceState::default(),
        ),
        parent_span_id: parent,
        parent_span_is_remote: s.parent_remote,
        span_kind: match s.kind {
            Kind::Internal => SpanKind::Internal,
            Kind::Client => SpanKind::Client,
        },
        name: Cow::Owned(s.name),
        start_time: time(s.start_us),
        end_time: time(s.end_us.max(s.start_us)),
        attributes,
        dropped_attributes_count: 0,
        events,
        links: span_links,
        status,
        instrumentation_scope: scope.clone(),
    })
}

impl SpanSink for OtlpSink {
    fn export(&self, spans: Vec<SpanRecord>) {
        for s in spans {
            // Bounded: past the queue's size the span is dropped here, counted, never waited for.
            if self.shared.queued.fetch_add(1, Ordering::AcqRel) >= QUEUE_SPANS {
                self.shared.queued.fetch_sub(1, Ordering::AcqRel);
                self.shared.dropped.fetch_add(1, Ordering::Relaxed);
                self.shared.warn("the export queue is full");
                continue;
            }
            match self.span_data(s) {
                Some(d) => self.processor.on_end(d),
                None => {
                    self.shared.queued.fetch_sub(1, Ordering::AcqRel);
                }
            }
        }
    }

    fn sample_root(&self, trace_id: &str) -> bool {
        sample(self.sampler, trace_id)
    }
}

fn sample(sampler: Sampler, trace_id: &str) -> bool {
    match sampler {
        Sampler::On => true,
        Sampler::Off => false,
        Sampler::Ratio(r) => {
            // The low 8 bytes of the id against the ratio, as the SDK's ratio sampler does.
            let low = trace_id
                .get(16..32)
                .and_then(|h| u64::from_str_radix(h, 16).ok())
                .unwrap_or(0);
            (low >> 1) < ((r * (1u64 << 63) as f64) as u64)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness_core::trace::SpanError;

    #[test]
    fn a_base_endpoint_gets_the_traces_path_and_anything_but_http_is_refused() {
        assert_eq!(
            traces_url("http://127.0.0.1:4318/", "x").unwrap(),
            "http://127.0.0.1:4318/v1/traces"
        );
        let e = traces_url("127.0.0.1:4318", "--otlp-endpoint").unwrap_err();
        assert!(e
            .to_string()
            .starts_with("harness/invalid_request: --otlp-endpoint:"));
    }

    #[test]
    fn the_ratio_sampler_keeps_about_its_share() {
        let ids: Vec<String> = (0..2000u64)
            .map(|i| format!("{:016x}{:016x}", i, i.wrapping_mul(0x9e37_79b9_7f4a_7c15)))
            .collect();
        let kept = |s| ids.iter().filter(|id| sample(s, id)).count();
        assert_eq!(kept(Sampler::On), 2000);
        assert_eq!(kept(Sampler::Off), 0);
        assert_eq!(kept(Sampler::Ratio(0.0)), 0);
        let quarter = kept(Sampler::Ratio(0.25));
        assert!((350..650).contains(&quarter), "{quarter}");
    }

    #[test]
    fn a_failed_span_is_an_error_with_its_type_and_an_exception_event() {
        let scope = InstrumentationScope::builder("harness").build();
        let span = SpanRecord {
            trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
            span_id: "00f067aa0ba902b7".into(),
            parent_span_id: None,
            parent_remote: false,
            sampled: true,
            name: "chat demo".into(),
            kind: Kind::Client,
            start_us: 1_000_000,
            end_us: 1_250_000,
            attributes: vec![("gen_ai.request.model", AttrValue::Str("demo".into()))],
            error: Some(SpanError {
                error_type: "rate_limited".into(),
                message: "The provider is rate limiting requests.".into(),
            }),
            links: vec![],
        };
        let d = span_data(span.clone(), &scope).unwrap();
        assert_eq!(d.span_kind, SpanKind::Client);
        assert_eq!(d.parent_span_id, SpanId::INVALID);
        assert!(matches!(d.status, Status::Error { .. }));
        assert!(d
            .attributes
            .iter()
            .any(|kv| kv.key.as_str() == "error.type" && kv.value.as_str() == "rate_limited"));
        assert_eq!(d.events.events.len(), 1);
        assert_eq!(d.events.events[0].name, "exception");
        assert_eq!(
            d.end_time.duration_since(d.start_time).unwrap(),
            Duration::from_millis(250)
        );
        let bad = SpanRecord {
            span_id: "not-hex".into(),
            ..span
        };
        assert!(span_data(bad, &scope).is_none());
    }
}
