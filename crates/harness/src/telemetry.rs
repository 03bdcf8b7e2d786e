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

/// `harness worker --metrics-listen ADDR`: `GET /metrics` alone, on its own listener (a worker
/// has no API listener). Loopback only: this listener checks no token.
#[cfg_attr(not(feature = "iii"), allow(dead_code))]
pub async fn serve_metrics(
    listen: std::net::SocketAddr,
    installed: Installed,
) -> Result<tokio::task::JoinHandle<()>> {
    if !listen.ip().is_loopback() {
        anyhow::bail!(
            "harness/invalid_request: --metrics-listen {listen}: not a loopback address; this listener has no token, put a proxy in front to expose it"
        );
    }
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {listen}: {e}"))?;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let installed = installed.clone();
            async move {
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        harness_telemetry::Metrics::CONTENT_TYPE,
                    )],
                    installed.render(),
                )
            }
        }),
    );
    eprintln!("metrics on http://{}/metrics", listener.local_addr()?);
    Ok(tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!("the metrics listener stopped: {e}");
        }
    }))
}

/// Refreshes the gauges that need a read of the store (sessions by status, pending approvals)
/// every 10 s in the background, so a scrape never waits on SQLite.
pub fn refresh_gauges(
    bus: std::sync::Arc<dyn harness_bus::Bus>,
    installed: Installed,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(10));
        loop {
            tick.tick().await;
            if let Err(e) = refresh_once(bus.as_ref(), &installed).await {
                tracing::debug!("metrics: gauges not refreshed: {e}");
            }
        }
    })
}

async fn refresh_once(bus: &dyn harness_bus::Bus, installed: &Installed) -> Result<()> {
    use harness_types::session::{ListResponse, SessionStatus};
    let mut counts = [0usize; 4];
    let mut cursor: Option<String> = None;
    loop {
        let page = bus
            .call(
                "session::list",
                serde_json::json!({"limit": 500, "cursor": cursor}),
                None,
            )
            .await?;
        let page: ListResponse = serde_json::from_value(page)?;
        for s in &page.sessions {
            counts[match s.status {
                SessionStatus::Idle => 0,
                SessionStatus::Working => 1,
                SessionStatus::Done => 2,
                SessionStatus::Error => 3,
            }] += 1;
        }
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    installed.metrics.set_sessions(&[
        ("idle", counts[0]),
        ("working", counts[1]),
        ("done", counts[2]),
        ("error", counts[3]),
    ]);
    // Without the approval functions (a worker that left them to others) the gauge stays 0.
    if let Ok(v) = bus
        .call("approval::list", serde_json::json!({}), None)
        .await
    {
        let n = v["approvals"].as_array().map_or(0, Vec::len);
        installed.metrics.set_approvals_pending(n);
    }
    Ok(())
}
