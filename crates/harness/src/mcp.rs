//! `harness mcp`: the harness served as an MCP server on stdin/stdout, for editors and other
//! agents. In-process by default (the same runtime `serve` opens), or the front of a running
//! server with `--url`. Stdout carries the protocol, so everything else goes to stderr.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Result};
use harness_bus::{Bus, EmbeddedBus};
use harness_mcp::server::{CallFuture, Caller, HarnessServer};
use harness_types::error::error_chain;
use serde_json::{json, Value};

use crate::runtime::{Runtime, RuntimeOptions};

/// How long the start-up probe of `--url` waits for an answer. A harness answers it at once; a
/// client that started `harness mcp` should learn within seconds that nothing answers there,
/// rather than find every tool missing.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

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
struct Remote {
    /// The URL as given, without its query or fragment or a trailing `/`.
    base: String,
    /// The URL as errors and logs show it: no userinfo, query or fragment, which may carry
    /// a credential.
    shown: String,
    http: reqwest::Client,
}

impl Remote {
    fn new(url: &str) -> Result<Remote> {
        let mut parsed = reqwest::Url::parse(url)
            .map_err(|e| anyhow!("harness/invalid_request: --url: not a URL: {e}"))?;
        // The API's paths go below it, and take no query.
        parsed.set_query(None);
        parsed.set_fragment(None);
        let base = parsed.as_str().trim_end_matches('/').to_string();
        let shown = crate::client::shown_url(&base);
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(anyhow!(
                "harness/invalid_request: --url: {shown}: must be an http:// or https:// URL"
            ));
        }
        // No redirects: the token must not follow an answer to another host.
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| anyhow!("harness/internal: HTTP client: {e}"))?;
        Ok(Remote { base, shown, http })
    }

    /// One function call; an error is a `harness/<code>: <message>` text. A transport failure
    /// names `shown`, never the URL as given.
    async fn post(
        &self,
        function_id: &str,
        payload: &Value,
        timeout: Option<Duration>,
    ) -> Result<Value, String> {
        let endpoint = format!("{}/v1/functions/{function_id}", self.base);
        let mut request = crate::client::authorize(self.http.post(endpoint)).json(payload);
        if let Some(timeout) = timeout {
            request = request.timeout(timeout);
        }
        let shown = &self.shown;
        let failed = |e: reqwest::Error| {
            if e.is_timeout() {
                format!(
                    "harness/timeout: {shown}: no answer within {} s",
                    timeout.unwrap_or_default().as_secs()
                )
            } else {
                format!(
                    "harness/dependency: {shown}: {}",
                    error_chain(&e.without_url())
                )
            }
        };
        let response = request.send().await.map_err(failed)?;
        let status = response.status();
        let body = response.bytes().await.map_err(failed)?;
        let Ok(body) = serde_json::from_slice::<Value>(&body) else {
            return Err(format!(
                "harness/dependency: {shown}: answered HTTP {status} with a body that is not \
                 JSON; is it a harness server (`harness serve`)?"
            ));
        };
        if status.is_success() {
            return Ok(body);
        }
        let code = body["error"]["code"].as_str().unwrap_or("harness/internal");
        let message = body["error"]["message"].as_str().unwrap_or("(no message)");
        Err(format!("{code}: {message}"))
    }

    /// Whether a harness answers at the URL (and takes the token): one call of a function every
    /// harness has, under [`PROBE_TIMEOUT`].
    async fn probe(&self) -> Result<()> {
        let answer = self
            .post(
                "engine::functions::info",
                &json!({"function_id": "harness::send"}),
                Some(PROBE_TIMEOUT),
            )
            .await;
        match answer {
            Ok(Value::Object(_)) => Ok(()),
            Ok(other) => Err(anyhow!(
                "harness/dependency: {}: answered {other} for harness::send; is it a harness \
                 server (`harness serve`)?",
                self.shown
            )),
            // Transport failures name the URL already; a refusal by the server does not.
            Err(e) if e.contains(&self.shown) => Err(anyhow!("{e}")),
            Err(e) => Err(anyhow!("{e} (from {})", self.shown)),
        }
    }
}

impl Caller for Remote {
    fn call<'a>(&'a self, function_id: &'a str, payload: Value) -> CallFuture<'a> {
        Box::pin(async move { self.post(function_id, &payload, None).await })
    }
}

pub async fn run(url: Option<String>, opts: RuntimeOptions, approve: Vec<String>) -> Result<()> {
    if let Some(url) = url {
        let remote = Remote::new(&url)?;
        // Without it, a wrong URL would start a server with no tools, whose every call then
        // blames the tool rather than the URL.
        remote.probe().await?;
        let shown = remote.shown.clone();
        let server = HarnessServer::new(Arc::new(remote)).await;
        eprintln!(
            "harness mcp: serving {} over stdio for {shown}",
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
