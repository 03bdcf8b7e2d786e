//! `harness mcp`: the harness served as an MCP server on stdin/stdout, for editors and other
//! agents. In-process by default (the same runtime `serve` opens), or the front of a running
//! server with `--url`. Stdout carries the protocol, so everything else goes to stderr.

use std::sync::Arc;

use anyhow::Result;
use harness_bus::{Bus, EmbeddedBus};
use harness_mcp::server::{CallFuture, Caller, HarnessServer};
use serde_json::Value;

use crate::runtime::{Runtime, RuntimeOptions};

/// Calls through the in-process bus, as the operator.
struct Local(EmbeddedBus);

impl Caller for Local {
    fn call<'a>(&'a self, function_id: &'a str, payload: Value) -> CallFuture<'a> {
        Box::pin(async move {
            self.0
                .call(function_id, payload, None)
                .await
                .map_err(|e| e.to_string())
        })
    }
}

/// Calls a running server's HTTP API (with `--token` when given).
struct Remote(String);

impl Caller for Remote {
    fn call<'a>(&'a self, function_id: &'a str, payload: Value) -> CallFuture<'a> {
        Box::pin(async move {
            crate::client::call_value(&self.0, function_id, &payload)
                .await
                .map_err(|e| format!("{e:#}"))
        })
    }
}

pub async fn run(url: Option<String>, opts: RuntimeOptions, approve: Vec<String>) -> Result<()> {
    if let Some(url) = url {
        let server = HarnessServer::new(Arc::new(Remote(url.clone()))).await;
        eprintln!(
            "harness mcp: serving {} over stdio for {url}",
            server.tool_names().join(", ")
        );
        server.serve_stdio().await?;
        return Ok(());
    }
    let data_dir = opts.data_dir.clone();
    let rt = Runtime::open(opts, approve).await?;
    let server = HarnessServer::new(Arc::new(Local(rt.bus.clone()))).await;
    eprintln!(
        "harness mcp: serving {} over stdio (data dir {})",
        server.tool_names().join(", "),
        data_dir.display()
    );
    let served = server.serve_stdio().await;
    rt.shutdown().await;
    served.map_err(Into::into)
}
