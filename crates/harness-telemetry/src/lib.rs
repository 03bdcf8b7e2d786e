//! Observability of the harness loop: the OTLP/HTTP span exporter (`otlp`) and the Prometheus
//! registry behind `/metrics` (`metrics`). The loop itself (`harness_core::trace`) decides what
//! a span or a count is; this crate only carries them out of the process.

pub mod metrics;
pub mod otlp;
mod otlp_http;

use std::sync::Arc;

pub use metrics::Metrics;
pub use otlp::{EndpointSource, OtlpConfig, OtlpSink, TelemetryError};

/// What a runtime installed: the registry (always) and the exporter (when configured).
#[derive(Clone)]
pub struct Installed {
    pub metrics: Arc<Metrics>,
    pub otlp: Option<Arc<OtlpSink>>,
}

/// Starts the exporter when `otlp` is given and installs it and a fresh registry on `harness`.
pub fn install(
    harness: &harness_core::Harness,
    otlp: Option<&OtlpConfig>,
) -> Result<Installed, TelemetryError> {
    let metrics = Arc::new(Metrics::new());
    let sink = otlp.map(OtlpSink::start).transpose()?.map(Arc::new);
    harness.set_telemetry(harness_core::trace::Telemetry {
        spans: sink
            .clone()
            .map(|s| s as Arc<dyn harness_core::trace::SpanSink>),
        observer: Some(metrics.clone() as Arc<dyn harness_core::trace::Observer>),
        marks: Default::default(),
    });
    Ok(Installed {
        metrics,
        otlp: sink,
    })
}

impl Installed {
    /// The scrape body.
    pub fn render(&self) -> String {
        if let Some(s) = &self.otlp {
            self.metrics.spans_dropped_now(s.dropped());
        }
        self.metrics.render()
    }

    /// Flushes queued spans (at most 5 s).
    pub async fn shutdown(&self) {
        if let Some(s) = self.otlp.clone() {
            let _ = tokio::task::spawn_blocking(move || s.shutdown()).await;
        }
    }
}
