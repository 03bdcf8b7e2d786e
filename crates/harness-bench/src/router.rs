//! Router latency: a local SSE server and the Anthropic adapter pointed at it (no bus involved).

use std::time::Duration;

use anyhow::{bail, Context, Result};
use harness_router::bench::FrameLatencyReport;

use crate::plan::Plan;
use crate::stats::progress;

/// Longest the router measurement may take before the bench gives up.
const ROUTER_TIMEOUT: Duration = Duration::from_secs(60);

pub(crate) async fn router_latency(plan: &Plan) -> Result<FrameLatencyReport> {
    progress!(
        "router latency ({} frames, {} requests over a local SSE server)",
        plan.router.frames,
        plan.router.requests
    );
    match tokio::time::timeout(
        ROUTER_TIMEOUT,
        harness_router::bench::frame_latency(plan.router.clone()),
    )
    .await
    {
        Ok(report) => report.context("router frame latency"),
        Err(_) => bail!(
            "the router measurement did not finish within {} s",
            ROUTER_TIMEOUT.as_secs()
        ),
    }
}
