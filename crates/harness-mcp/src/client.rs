//! One configured server, supervised: connect, list its tools, register them on the bus, follow
//! `notifications/tools/list_changed`, and reconnect with backoff when the connection ends.
//!
//! The tools stay registered while the server is away, so what the model was offered does not
//! flicker during a restart; a call in that window answers at once with an error result saying
//! the server is reconnecting, and never waits for it. The state lives behind a std `Mutex`
//! held only to read or swap a field (never across an await): the peer is cloned out before a
//! call is sent.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use harness_bus::{Bus, BusError, CallContext, FunctionDef, Handler};
use rmcp::model::{CallToolRequestParams, ClientConfig, Implementation, ProtocolVersion, Tool};
use rmcp::service::{NotificationContext, Peer, RunningService};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use rmcp::{ClientHandler, RoleClient, ServiceExt};
use serde_json::{json, Value};
use tokio::io::AsyncBufReadExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::config::{ServerSpec, Transport};
use crate::content;
use crate::error::McpError;
use crate::names;

/// How long connecting (spawn + initialize + first tools/list) may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// Reconnection delays: the first retry after `first`, doubling up to `max`.
#[derive(Clone, Copy, Debug)]
pub struct Backoff {
    pub first: Duration,
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            first: Duration::from_millis(250),
            max: Duration::from_secs(30),
        }
    }
}

/// Variables a stdio server inherits from the harness; everything else it gets only from its
/// `env` entry, so the harness's provider keys never reach a server nobody gave them to.
const BASE_ENV: [&str; 9] = [
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL", "TERM", "TMPDIR",
];

/// What a server looks like from outside (status, tests).
#[derive(Clone, Debug, serde::Serialize)]
pub struct ServerStatus {
    pub name: String,
    pub connected: bool,
    /// The child process of a stdio server, while connected.
    pub pid: Option<u32>,
    /// Function ids registered for it, sorted.
    pub functions: Vec<String>,
    /// Successful connections so far (a reconnect counts).
    pub connections: u64,
    /// Whether the tool list of the current connection has been fetched (its functions are
    /// registered), or the attempt failed.
    pub listed: bool,
    pub last_error: Option<String>,
}

#[derive(Default)]
struct State {
    peer: Option<Peer<RoleClient>>,
    pid: Option<u32>,
    /// Function id → tool name as the server spells it.
    tools: BTreeMap<String, String>,
    connections: u64,
    /// The current connection's tool list was fetched (or failed to be).
    listed: bool,
    last_error: Option<String>,
}

pub(crate) struct Server {
    spec: ServerSpec,
    bus: Arc<dyn Bus>,
    state: Mutex<State>,
    refresh: Arc<Notify>,
    backoff: Backoff,
}

/// The client side the server talks to: only the tool-list notification matters here.
struct Client {
    refresh: Arc<Notify>,
}

impl ClientHandler for Client {
    async fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.refresh.notify_one();
    }

    fn get_info(&self) -> ClientConfig {
        // The handshake lifecycle every released server speaks; list-changed notifications
        // arrive unscoped on it.
        let mut info =
            ClientConfig::default().with_protocol_version(ProtocolVersion::LATEST_WITH_INITIALIZE);
        info.client_info = Implementation::new("harness", env!("CARGO_PKG_VERSION"));
        info
    }
}

type Running = RunningService<RoleClient, Client>;

impl Server {
    pub(crate) fn new(spec: ServerSpec, bus: Arc<dyn Bus>, backoff: Backoff) -> Arc<Server> {
        Arc::new(Server {
            spec,
            bus,
            state: Mutex::new(State::default()),
            refresh: Arc::new(Notify::new()),
            backoff,
        })
    }

    pub(crate) fn spec(&self) -> &ServerSpec {
        &self.spec
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("mcp server state lock")
    }

    pub(crate) fn status(&self) -> ServerStatus {
        let s = self.state();
        ServerStatus {
            name: self.spec.name.clone(),
            connected: s.peer.is_some(),
            pid: s.pid,
            functions: s.tools.keys().cloned().collect(),
            connections: s.connections,
            listed: s.listed,
            last_error: s.last_error.clone(),
        }
    }

    /// Runs until `stop` is cancelled: connect, serve, reconnect. On stop the tools are
    /// unregistered and the connection (and a stdio child) closed.
    pub(crate) async fn supervise(self: Arc<Self>, stop: CancellationToken) {
        let mut delay = self.backoff.first;
        let mut failures: u32 = 0;
        loop {
            let attempt = tokio::select! {
                _ = stop.cancelled() => break,
                r = tokio::time::timeout(CONNECT_TIMEOUT, self.connect(stop.child_token())) => r,
            };
            let running = match attempt {
                Ok(Ok(running)) => running,
                Ok(Err(e @ McpError::Refused { .. })) => {
                    // Permanent: retrying would only start it again.
                    tracing::error!(server = %self.spec.name, "{e}");
                    self.state().last_error = Some(e.to_string());
                    stop.cancelled().await;
                    break;
                }
                Ok(Err(e)) => {
                    self.failed(&e.to_string(), failures);
                    failures += 1;
                    if !self.wait(&stop, &mut delay).await {
                        break;
                    }
                    continue;
                }
                Err(_) => {
                    let e = McpError::Start {
                        server: self.spec.name.clone(),
                        message: format!("no answer within {}s", CONNECT_TIMEOUT.as_secs()),
                    };
                    self.failed(&e.to_string(), failures);
                    failures += 1;
                    if !self.wait(&stop, &mut delay).await {
                        break;
                    }
                    continue;
                }
            };
            if failures > 0 {
                tracing::info!(server = %self.spec.name, "mcp server connected after {failures} failed attempts");
            }
            failures = 0;
            delay = self.backoff.first;
            let pid = running.1;
            let why = self.serve(running, &stop).await;
            if let Some(pid) = pid {
                stop_group(pid);
            }
            {
                let mut s = self.state();
                s.peer = None;
                s.pid = None;
            }
            if stop.is_cancelled() {
                break;
            }
            tracing::warn!(server = %self.spec.name, "mcp server connection ended ({why}); reconnecting");
            self.state().last_error = Some(format!("connection ended ({why})"));
            if !self.wait(&stop, &mut delay).await {
                break;
            }
        }
        let ids: Vec<String> = std::mem::take(&mut self.state().tools)
            .into_keys()
            .collect();
        for id in &ids {
            self.bus.unregister_function(id);
        }
        if !ids.is_empty() {
            self.functions_changed().await;
        }
    }

    /// The first failure is reported loudly, once; repeats go to the debug log so a server
    /// that stays broken does not flood it.
    fn failed(&self, message: &str, failures: u32) {
        if failures == 0 {
            tracing::error!(server = %self.spec.name, "{message}; retrying with backoff");
        } else {
            tracing::debug!(server = %self.spec.name, attempt = failures + 1, "{message}");
        }
        self.state().last_error = Some(message.to_string());
    }

    /// Sleeps `delay` (then doubles it); false when stopped meanwhile.
    async fn wait(&self, stop: &CancellationToken, delay: &mut Duration) -> bool {
        let d = *delay;
        *delay = (*delay * 2).min(self.backoff.max);
        tokio::select! {
            _ = stop.cancelled() => false,
            _ = tokio::time::sleep(d) => true,
        }
    }

    async fn connect(&self, ct: CancellationToken) -> Result<(Running, Option<u32>), McpError> {
        let start = |message: String| McpError::Start {
            server: self.spec.name.clone(),
            message,
        };
        let client = Client {
            refresh: self.refresh.clone(),
        };
        let (running, pid) = match &self.spec.transport {
            Transport::Stdio {
                command,
                args,
                env,
                cwd,
            } => {
                let mut cmd = tokio::process::Command::new(command);
                cmd.args(args).env_clear();
                for key in BASE_ENV {
                    if let Some(v) = std::env::var_os(key) {
                        cmd.env(key, v);
                    }
                }
                cmd.envs(env);
                if let Some(dir) = cwd {
                    cmd.current_dir(dir);
                }
                let mut cmd = process_wrap::tokio::CommandWrap::from(cmd);
                #[cfg(unix)]
                cmd.wrap(process_wrap::tokio::ProcessGroup::leader());
                let (transport, stderr) = TokioChildProcess::builder(cmd)
                    .stderr(Stdio::piped())
                    .spawn()
                    .map_err(|e| start(format!("cannot run '{command}': {e}")))?;
                let pid = transport.id();
                if let Some(stderr) = stderr {
                    let name = self.spec.name.clone();
                    tokio::spawn(async move {
                        let mut lines = tokio::io::BufReader::new(stderr).lines();
                        while let Ok(Some(line)) = lines.next_line().await {
                            tracing::info!(target: "harness_mcp::stderr", server = %name, "{line}");
                        }
                    });
                }
                let running = client
                    .serve_with_ct(transport, ct)
                    .await
                    .map_err(|e| start(e.to_string()))?;
                (running, pid)
            }
            Transport::Http { url, headers } => {
                let mut custom = std::collections::HashMap::new();
                for (k, v) in headers {
                    // Checked when the configuration was read.
                    let name = http::HeaderName::from_bytes(k.as_bytes())
                        .map_err(|e| start(format!("header {k}: {e}")))?;
                    let value = http::HeaderValue::from_str(v)
                        .map_err(|e| start(format!("header {k}: {e}")))?;
                    custom.insert(name, value);
                }
                let config = StreamableHttpClientTransportConfig::with_uri(url.as_str())
                    .custom_headers(custom);
                let http =
                    crate::http::Http::new().map_err(|e| start(format!("no HTTP client: {e}")))?;
                let transport = StreamableHttpClientTransport::with_client(http, config);
                let running = client
                    .serve_with_ct(transport, ct)
                    .await
                    .map_err(|e| start(e.to_string()))?;
                (running, None)
            }
        };
        if let Some(info) = running.peer().peer_info() {
            if info.server_info.as_ref().map(|i| i.name.as_str())
                == Some(crate::server::SERVER_NAME)
            {
                running.cancellation_token().cancel();
                return Err(McpError::Refused {
                    server: self.spec.name.clone(),
                    message: "it is a harness MCP server (`harness mcp`); its tools send messages and decide approvals, which no model may reach".into(),
                });
            }
        }
        {
            let mut s = self.state();
            s.peer = Some(running.peer().clone());
            s.pid = pid;
            s.connections += 1;
            s.listed = false;
            s.last_error = None;
        }
        Ok((running, pid))
    }

    /// Serves one connection until it ends or `stop`; answers why it ended.
    async fn serve(
        self: &Arc<Self>,
        (running, _pid): (Running, Option<u32>),
        stop: &CancellationToken,
    ) -> String {
        let peer = running.peer().clone();
        if let Err(e) = self.refresh_tools(&peer).await {
            tracing::warn!(server = %self.spec.name, "tools/list failed: {e}");
        }
        self.state().listed = true;
        let cancel = running.cancellation_token();
        let mut ended = Box::pin(running.waiting());
        loop {
            tokio::select! {
                _ = stop.cancelled() => {
                    cancel.cancel();
                    let _ = ended.await;
                    return "stopped".into();
                }
                r = &mut ended => {
                    return match r {
                        Ok(reason) => format!("{reason:?}").to_lowercase(),
                        Err(e) => e.to_string(),
                    };
                }
                _ = self.refresh.notified() => {
                    if let Err(e) = self.refresh_tools(&peer).await {
                        tracing::warn!(server = %self.spec.name, "tools/list after list_changed failed: {e}");
                    }
                }
            }
        }
    }

    /// Lists the server's tools and makes the registry match: new and changed tools
    /// (re)registered, vanished ones removed; `harness::on-functions-change` when the set of
    /// ids changed.
    async fn refresh_tools(self: &Arc<Self>, peer: &Peer<RoleClient>) -> Result<(), McpError> {
        let tools = peer.list_all_tools().await.map_err(|e| McpError::Request {
            server: self.spec.name.clone(),
            message: format!("tools/list: {e}"),
        })?;
        let by_name: BTreeMap<String, Tool> =
            tools.into_iter().map(|t| (t.name.to_string(), t)).collect();
        let assigned = names::assign(&self.spec.name, by_name.keys().cloned());
        let old: Vec<String> = self.state().tools.keys().cloned().collect();
        for (id, name) in &assigned {
            let tool = &by_name[name];
            let mut def = FunctionDef::new(
                id.clone(),
                tool.description.as_deref().unwrap_or_default().to_string(),
            );
            def.request_schema = Some(Value::Object((*tool.input_schema).clone()));
            if let Some(out) = &tool.output_schema {
                def.response_schema = Some(Value::Object((**out).clone()));
            }
            def.metadata = json!({"mcp": {"server": self.spec.name, "tool": name}});
            let handler = ToolHandler {
                server: Arc::downgrade(self),
                function_id: id.clone(),
            };
            self.bus.register_function(def, Arc::new(handler));
        }
        for id in old.iter().filter(|id| !assigned.contains_key(*id)) {
            self.bus.unregister_function(id);
        }
        let changed = !old.iter().eq(assigned.keys());
        self.state().tools = assigned;
        tracing::info!(server = %self.spec.name, tools = by_name.len(), "mcp tools registered");
        if changed {
            self.functions_changed().await;
        }
        Ok(())
    }

    /// Tells the loop its registry changed (embedded, nothing else announces it). Absent in a
    /// runtime without the loop; that is not an error.
    async fn functions_changed(&self) {
        if let Err(e) = self
            .bus
            .call(
                "harness::on-functions-change",
                json!({"event": "mcp_tools_changed"}),
                Some(Duration::from_secs(10)),
            )
            .await
        {
            tracing::debug!(server = %self.spec.name, "harness::on-functions-change: {e}");
        }
    }

    /// One `tools/call`, answered as a harness function result; never an `Err`, so the model
    /// always reads what went wrong.
    async fn call(&self, function_id: &str, arguments: Value) -> Value {
        let name = &self.spec.name;
        let (peer, tool, last_error) = {
            let s = self.state();
            (
                s.peer.clone(),
                s.tools.get(function_id).cloned(),
                s.last_error.clone(),
            )
        };
        let Some(tool) = tool else {
            return content::error(format!(
                "mcp server '{name}' no longer offers {function_id}"
            ));
        };
        let Some(peer) = peer else {
            let why = last_error.map(|e| format!(": {e}")).unwrap_or_default();
            return content::error(format!(
                "mcp server '{name}' is not connected{why}; the harness is reconnecting, try again shortly"
            ));
        };
        let arguments = match arguments {
            Value::Object(map) => Some(map),
            Value::Null => None,
            other => {
                return content::error(format!(
                    "arguments of {function_id} must be an object, got {other}"
                ))
            }
        };
        let mut params = CallToolRequestParams::new(tool.clone());
        if let Some(args) = arguments {
            params = params.with_arguments(args);
        }
        match tokio::time::timeout(self.spec.call_timeout, peer.call_tool(params)).await {
            Ok(Ok(result)) => match serde_json::to_value(&result) {
                Ok(wire) => content::from_wire(&wire),
                Err(e) => content::error(format!("mcp server '{name}': unreadable result: {e}")),
            },
            Ok(Err(e)) => content::error(format!("mcp server '{name}': tool '{tool}' failed: {e}")),
            Err(_) => content::error(format!(
                "mcp server '{name}': tool '{tool}' gave no answer within {} ms",
                self.spec.call_timeout.as_millis()
            )),
        }
    }
}

/// Stops whatever is left of a stdio server's process group once its connection is over. The
/// transport closes the server's stdin and lets it exit on its own; what it started (`npx`'s
/// `node`, a helper) would outlive it. Done right after the end, while the group id still
/// names that group.
fn stop_group(pgid: u32) {
    #[cfg(unix)]
    {
        let Ok(pgid) = i32::try_from(pgid) else {
            return;
        };
        // SAFETY: killpg(2) has no memory effects; ESRCH (group already gone) is fine.
        unsafe {
            libc::killpg(pgid, libc::SIGKILL);
        }
    }
    #[cfg(not(unix))]
    let _ = pgid;
}

/// The bus handler of one `mcp::<server>::<tool>`. Holds the server weakly: a server removed
/// from the configuration must not be kept alive by a registration some bus still has.
struct ToolHandler {
    server: std::sync::Weak<Server>,
    function_id: String,
}

impl Handler for ToolHandler {
    fn call(&self, payload: Value, _ctx: CallContext) -> harness_bus::HandlerFuture {
        let server = self.server.upgrade();
        let function_id = self.function_id.clone();
        Box::pin(async move {
            match server {
                Some(server) => Ok::<Value, BusError>(server.call(&function_id, payload).await),
                None => Ok(content::error(format!(
                    "{function_id}: its mcp server is no longer configured"
                ))),
            }
        })
    }
}
