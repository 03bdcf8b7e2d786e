//! Wires `harness_telemetry` into a runtime: the OTLP exporter when an endpoint is configured,
//! and the per-runtime Prometheus registry.

use anyhow::Result;
use harness_core::{Harness, HarnessConfig};
use harness_telemetry::{Installed, OtlpConfig};

/// Installs span export (when `OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT` or `otel_endpoint` names a
/// receiver and `OTEL_SDK_DISABLED` is not `true`) and a fresh metrics registry on `harness`.
pub fn install(harness: &Harness, config: &HarnessConfig) -> Result<Installed> {
    let otlp = OtlpConfig::resolve(None, config.otel_endpoint.as_deref())?;
    if let Some(c) = &otlp {
        tracing::info!(endpoint = %c.endpoint, source = c.source.as_str(), "exporting turn traces over OTLP/HTTP");
    }
    Ok(harness_telemetry::install(harness, otlp.as_ref())?)
}
