//! Shared helpers for the end-to-end tests: spawn and SIGKILL real `harness serve` processes,
//! call functions over HTTP, read the SSE event stream, and poll with deadlines.
//!
//! Nothing here sleeps to synchronize: every wait is a poll (or a read) bounded by a deadline,
//! and a deadline that passes fails the test with what was observed last.

#![allow(dead_code)]

use std::future::Future;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};

pub mod http_head;
pub mod process;
pub mod raw_serve;
pub mod scripts;
#[allow(unused_imports)] // each test binary uses a different part of it
pub use process::{is_terminal, Sessions, WAIT};
pub use scripts::*;

pub const BIN: &str = env!("CARGO_BIN_EXE_harness");

/// Whether the tests run as root: a few need it (a tmpfs mount) or test what root could see.
pub fn running_as_root() -> bool {
    // SAFETY: geteuid only returns a number.
    unsafe { libc::geteuid() == 0 }
}

/// A port nobody listens on right now (the child's bind is checked, see `Server::spawn`).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind 127.0.0.1:0")
        .local_addr()
        .unwrap()
        .port()
}

/// An error answer of `POST /v1/functions/{id}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: u16,
    pub code: String,
    pub message: String,
    pub body: Value,
}

/// A `harness serve` child process on a temporary data dir. Killed (SIGKILL) on drop.
pub struct Server {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
    extra: Vec<String>,
    env: Vec<(String, String)>,
    starts: u32,
    api: Api,
}

impl Server {
    /// Starts a server with this script and extra `serve` flags, and waits until it serves.
    pub async fn start(script: &Value, extra: &[&str]) -> Server {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join("script.json"),
            serde_json::to_vec_pretty(script).unwrap(),
        )
        .expect("write script");
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .expect("http client");
        let mut s = Server {
            child: None,
            port: 0,
            dir,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            env: Vec::new(),
            starts: 0,
            api: Api {
                base: String::new(),
                client,
            },
        };
        s.spawn().await;
        s
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }

    /// A handle for calls that can move into tasks (valid until the next restart).
    pub fn api(&self) -> Api {
        self.api.clone()
    }

    /// Fails the test if the process has exited (a panic, an abort).
    pub fn assert_alive(&mut self) {
        let child = self.child.as_mut().expect("server is running");
        if let Some(status) = child.try_wait().expect("try_wait") {
            panic!("harness serve exited with {status}; log:\n{}", self.log());
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("server is running").id()
    }

    /// The server's stderr over all its starts.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    async fn spawn(&mut self) {
        assert!(self.child.is_none(), "spawn while a child is running");
        for _attempt in 0..5 {
            self.starts += 1;
            let port = free_port();
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.log_path())
                .expect("open server log");
            let marker_offset = log.metadata().map(|m| m.len()).unwrap_or(0);
            let mut cmd = Command::new(BIN);
            cmd.arg("serve")
                .arg("--listen")
                .arg(format!("127.0.0.1:{port}"))
                .arg("--data-dir")
                .arg(self.data_dir())
                .arg("--script")
                .arg(self.dir.path().join("script.json"))
                .args(&self.extra)
                .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::from(log));
            let child = cmd.spawn().expect("spawn harness serve");
            self.child = Some(child);
            self.port = port;
            self.api.base = format!("http://127.0.0.1:{port}");
            // Our own child must announce the bind (another test could own a recycled port),
            // then answer /healthz.
            let deadline = Instant::now() + WAIT;
            let bound = format!("harness serving on http://127.0.0.1:{port}");
            loop {
                let log = self.log();
                let fresh = log.get(marker_offset as usize..).unwrap_or("");
                if fresh.contains(&bound) {
                    break;
                }
                if let Some(status) = self.child.as_mut().unwrap().try_wait().expect("try_wait") {
                    self.child = None;
                    if fresh.contains("cannot listen") {
                        break; // port taken meanwhile: try another
                    }
                    panic!("harness serve exited with {status} before serving; log:\n{fresh}");
                }
                assert!(
                    Instant::now() < deadline,
                    "harness serve did not start within {WAIT:?}; log:\n{fresh}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if self.child.is_none() {
                continue;
            }
            let deadline = Instant::now() + WAIT;
            loop {
                match self
                    .api
                    .client
                    .get(format!("{}/healthz", self.api.base))
                    .send()
                    .await
                {
                    Ok(r) if r.status() == 200 => return,
                    _ => {}
                }
                assert!(
                    Instant::now() < deadline,
                    "/healthz did not answer 200 within {WAIT:?}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        panic!("could not start harness serve on a free port after 5 attempts");
    }

    /// Environment for the next start(s); `None` removes the variable again.
    pub fn set_env(&mut self, key: &str, value: Option<&str>) {
        self.env.retain(|(k, _)| k != key);
        if let Some(v) = value {
            self.env.push((key.to_string(), v.to_string()));
        }
    }

    /// Starts the server with the extra flags changed (same data dir).
    pub fn set_extra(&mut self, extra: &[&str]) {
        self.extra = extra.iter().map(|s| s.to_string()).collect();
    }

    /// True once the process has exited (a failpoint killed it); reaps it.
    pub fn exited(&mut self) -> bool {
        process::exited(&mut self.child)
    }

    /// Waits until the process died at the failpoint `spec` (`<name>[:<n>]`, as set in
    /// `HARNESS_FAILPOINT`), as its log says.
    pub async fn wait_killed_at(&mut self, spec: &str) {
        let name = spec.split(':').next().unwrap_or(spec);
        wait_for("the failpoint to kill the server", WAIT, || {
            let dead = self.exited();
            async move { dead.then_some(()) }
        })
        .await;
        assert!(
            self.log()
                .contains(&format!("failpoint {name}: killing the process")),
            "the process died at the failpoint:\n{}",
            self.log()
        );
    }

    /// Starts the server again with the failpoint `name` armed, calls `function_id` (its answer
    /// may never come), waits for the process to die at the failpoint, and starts it again
    /// disarmed.
    pub async fn crash_at(&mut self, name: &str, function_id: &str, payload: Value) {
        self.kill();
        self.set_env("HARNESS_FAILPOINT", Some(name));
        self.start_again().await;
        let _ = self.try_ok(function_id, payload).await;
        self.wait_killed_at(name).await;
        self.set_env("HARNESS_FAILPOINT", None);
        self.start_again().await;
    }

    /// Starts the server again after it died on its own.
    pub async fn start_again(&mut self) {
        self.kill();
        self.spawn().await;
    }

    /// SIGKILL, then reap. Nothing of the process survives: no graceful shutdown runs.
    pub fn kill(&mut self) {
        process::kill(&mut self.child);
    }

    /// Starts the server again on the same data dir and script (on a fresh port).
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn().await;
    }
}

impl std::ops::Deref for Server {
    type Target = Api;
    fn deref(&self) -> &Api {
        &self.api
    }
}

/// The HTTP side of a server: cheap to clone into tasks.
#[derive(Clone)]
pub struct Api {
    pub base: String,
    pub client: reqwest::Client,
}

impl Api {
    pub fn url(&self) -> String {
        self.base.clone()
    }

    /// A `GET` of `path` (from the root: `/healthz`) that reached the server.
    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.client
            .get(format!("{}{path}", self.url()))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
    }

    /// `POST /v1/functions/{id}` with a raw body.
    pub async fn post_raw(
        &self,
        function_id: &str,
        body: impl Into<reqwest::Body>,
    ) -> (u16, Value) {
        let resp = self
            .client
            .post(format!("{}/v1/functions/{}", self.url(), function_id))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {function_id}: {e}"));
        let status = resp.status().as_u16();
        let text = resp
            .text()
            .await
            .unwrap_or_else(|e| panic!("POST {function_id}: reading body: {e}"));
        let value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("POST {function_id}: answer is not JSON ({e}): {text:?}"));
        (status, value)
    }

    /// A call to a server that may be dying (a failpoint is armed): `None` when the request
    /// does not get an answer or the answer is not a success, instead of failing the test.
    pub async fn try_ok(&self, function_id: &str, payload: Value) -> Option<Value> {
        let resp = self
            .client
            .post(format!("{}/v1/functions/{}", self.url(), function_id))
            .header("content-type", "application/json")
            .body(payload.to_string())
            .send()
            .await
            .ok()?;
        if !resp.status().is_success() {
            return None;
        }
        resp.json().await.ok()
    }

    pub async fn call(&self, function_id: &str, payload: Value) -> Result<Value, ApiError> {
        let (status, body) = self.post_raw(function_id, payload.to_string()).await;
        if (200..300).contains(&status) {
            return Ok(body);
        }
        let code = body["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let message = body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        Err(ApiError {
            status,
            code,
            message,
            body,
        })
    }

    /// A call that must succeed.
    pub async fn ok(&self, function_id: &str, payload: Value) -> Value {
        match self.call(function_id, payload.clone()).await {
            Ok(v) => v,
            Err(e) => panic!(
                "{function_id} {payload} failed: {} {}: {}",
                e.status, e.code, e.message
            ),
        }
    }

    /// A call that must fail.
    pub async fn err(&self, function_id: &str, payload: Value) -> ApiError {
        match self.call(function_id, payload.clone()).await {
            Ok(v) => panic!("{function_id} {payload} should have failed, answered {v}"),
            Err(e) => e,
        }
    }

    /// `harness::send` of a user text with model "m" on the scripted provider.
    pub async fn send(&self, session_id: Option<&str>, text: &str) -> Value {
        let mut req = json!({"message": text, "model": "m", "provider": "scripted"});
        if let Some(s) = session_id {
            req["session_id"] = json!(s);
        }
        self.ok("harness::send", req).await
    }

    /// `harness::send` of `request` (which must be accepted); returns the session id and the
    /// turn id it answered.
    pub async fn start_turn(&self, request: Value) -> (String, String) {
        let sent = self.ok("harness::send", request).await;
        let id = |field: &str| {
            sent[field]
                .as_str()
                .unwrap_or_else(|| panic!("the send answered no {field}: {sent}"))
                .to_string()
        };
        (id("session_id"), id("turn_id"))
    }

    /// Sends `request` and waits for its turn to end; returns the turn's last status.
    pub async fn send_and_wait(&self, request: Value) -> Value {
        let (session_id, turn_id) = self.start_turn(request).await;
        self.wait_turn(&session_id, &turn_id).await
    }

    /// Sends `request`, whose turn must complete; returns the session's transcript (messages
    /// only).
    pub async fn completed_turn(&self, request: Value) -> Vec<Value> {
        let (session_id, turn_id) = self.start_turn(request).await;
        self.completed_transcript(&session_id, &turn_id).await
    }

    /// Waits until the session has an approval listed; returns the first.
    pub async fn first_approval(&self, session_id: &str) -> Value {
        wait_for("the approval to be listed", WAIT, || async {
            self.ok("approval::list", json!({ "session_id": session_id }))
                .await["approvals"]
                .as_array()
                .and_then(|a| a.first().cloned())
        })
        .await
    }

    /// Opens the session's SSE event stream, resuming after `last_event_id` when given.
    pub async fn events(&self, session_id: &str, last_event_id: Option<i64>) -> EventStream {
        EventStream::open(&self.url(), session_id, last_event_id).await
    }

    /// Reads the session's events from the start to turn `turn_id`'s turn-completed: that turn
    /// is the only one with a lifecycle there, and no entry was announced twice.
    pub async fn assert_one_clean_turn(&self, session_id: &str, turn_id: &str) {
        let events = self
            .events(session_id, None)
            .await
            .until_turn_completed(turn_id)
            .await;
        assert_eq!(check_turn_lifecycle(&events), vec![turn_id.to_string()]);
        check_entries_added_once(&events);
    }
}

impl Sessions for Api {
    async fn status(&self, session_id: &str) -> Value {
        self.ok("harness::status", json!({ "session_id": session_id }))
            .await
    }

    async fn messages(&self, request: Value) -> Value {
        self.ok("session::messages", request).await
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            let log = self.log();
            let tail: String = {
                let lines: Vec<&str> = log.lines().collect();
                lines[lines.len().saturating_sub(60)..].join("\n")
            };
            eprintln!(
                "--- harness serve log (last 60 lines, {} starts) ---\n{tail}\n---",
                self.starts
            );
        }
    }
}

/// A server whose model writes `/a` through `fx::write` (call `c1`) when the user says
/// "write…" and then says "done writing", with every `fx::*` call held for approval.
pub async fn approved_write_server() -> (Fixtures, Server) {
    let fx = Fixtures::new(json!([{"id": "fx::write", "response": {"ok": true}}]));
    let script = script(vec![
        json!({"match": {"last_user_text": "write"},
               "content": [{"type": "function_call", "id": "c1", "function_id": "fx::write", "arguments": {"path": "/a"}}]}),
        text_gen(None, "done writing", 0, true),
    ]);
    let mut extra = fx.args();
    extra.extend(["--approve".to_string(), "fx::*".to_string()]);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let server = Server::start(&script, &extra).await;
    (fx, server)
}

/// Polls `f` until it returns `Some`, failing after `timeout` with `what`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// --- SSE ------------------------------------------------------------------------------------

/// One server-sent event: the `id:` and `event:` fields and the parsed `data:` JSON.
#[derive(Debug, Clone)]
pub struct SseEvent {
    pub id: Option<String>,
    pub event: Option<String>,
    pub data: Value,
}

impl SseEvent {
    pub fn event_id(&self) -> i64 {
        self.data["id"]
            .as_i64()
            .expect("event data has an integer id")
    }
    pub fn topic(&self) -> &str {
        self.data["topic"].as_str().unwrap_or_default()
    }
    pub fn payload(&self) -> &Value {
        &self.data["payload"]
    }
}

/// A session's SSE stream, read by a background task into a channel.
pub struct EventStream {
    rx: tokio::sync::mpsc::UnboundedReceiver<Result<SseEvent, String>>,
    task: tokio::task::JoinHandle<()>,
}

impl EventStream {
    pub async fn open(url: &str, session_id: &str, last_event_id: Option<i64>) -> EventStream {
        EventStream::open_url(
            &format!("{url}/v1/sessions/{session_id}/events"),
            last_event_id,
        )
        .await
    }

    /// Opens an events URL as is (to pass query parameters).
    pub async fn open_url(url: &str, last_event_id: Option<i64>) -> EventStream {
        // No overall timeout: the stream is open-ended; every read below has a deadline.
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        let mut req = client.get(url).header("accept", "text/event-stream");
        if let Some(id) = last_event_id {
            req = req.header("Last-Event-ID", id.to_string());
        }
        let resp = req
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {url}: {e}"));
        assert_eq!(resp.status(), 200, "GET {url}: {:?}", resp.text().await);
        let ctype = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        assert!(
            ctype.starts_with("text/event-stream"),
            "content-type {ctype:?}"
        );
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            let mut body = resp.bytes_stream();
            let mut buf: Vec<u8> = Vec::new();
            let (mut id, mut event, mut data) = (None::<String>, None::<String>, None::<String>);
            while let Some(chunk) = body.next().await {
                let chunk = match chunk {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = tx.send(Err(format!("stream broke: {e}")));
                        return;
                    }
                };
                buf.extend_from_slice(&chunk);
                while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = buf.drain(..=nl).collect();
                    let line = String::from_utf8_lossy(&line);
                    let line = line.trim_end_matches(['\n', '\r']);
                    if line.is_empty() {
                        if let Some(d) = data.take() {
                            let parsed = serde_json::from_str::<Value>(&d)
                                .map(|data| SseEvent {
                                    id: id.take(),
                                    event: event.take(),
                                    data,
                                })
                                .map_err(|e| format!("data is not JSON ({e}): {d}"));
                            if tx.send(parsed).is_err() {
                                return;
                            }
                        }
                        id = None;
                        event = None;
                        continue;
                    }
                    if line.starts_with(':') {
                        continue; // comment / keep-alive
                    }
                    let (field, value) = match line.split_once(':') {
                        Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                        None => (line, ""),
                    };
                    match field {
                        "id" => id = Some(value.to_string()),
                        "event" => event = Some(value.to_string()),
                        "data" => match &mut data {
                            Some(d) => {
                                d.push('\n');
                                d.push_str(value);
                            }
                            None => data = Some(value.to_string()),
                        },
                        _ => {}
                    }
                }
            }
            let _ = tx.send(Err("stream ended".into()));
        });
        EventStream { rx, task }
    }

    /// The next event, or None if none arrives before `deadline`.
    pub async fn next_before(&mut self, deadline: Instant) -> Option<SseEvent> {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, self.rx.recv()).await {
            Ok(Some(Ok(ev))) => {
                // The SSE framing and the JSON agree.
                assert_eq!(
                    ev.id.as_deref(),
                    Some(ev.event_id().to_string().as_str()),
                    "id: field vs data.id"
                );
                assert_eq!(
                    ev.event.as_deref(),
                    Some(ev.topic()),
                    "event: field vs data.topic"
                );
                Some(ev)
            }
            Ok(Some(Err(e))) => panic!("event stream: {e}"),
            Ok(None) => panic!("event stream task ended"),
            Err(_) => None,
        }
    }

    /// Reads events until one satisfies `stop` (included), failing after `timeout`.
    pub async fn until(
        &mut self,
        timeout: Duration,
        mut stop: impl FnMut(&SseEvent) -> bool,
    ) -> Vec<SseEvent> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::new();
        loop {
            match self.next_before(deadline).await {
                Some(ev) => {
                    let done = stop(&ev);
                    out.push(ev);
                    if done {
                        return out;
                    }
                }
                None => panic!(
                    "no matching event within {timeout:?}; got {} events: {:?}",
                    out.len(),
                    out.iter()
                        .map(|e| (e.event_id(), e.topic().to_string()))
                        .collect::<Vec<_>>()
                ),
            }
        }
    }

    /// Reads until the `harness::turn-completed` of `turn_id` (included).
    pub async fn until_turn_completed(&mut self, turn_id: &str) -> Vec<SseEvent> {
        self.until(WAIT, |e| {
            e.topic() == "harness::turn-completed" && e.payload()["turn_id"] == json!(turn_id)
        })
        .await
    }
}

impl Drop for EventStream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A child process (a helper the test runs beside the harness) SIGKILLed and reaped when the
/// guard drops, also when the test fails.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs the `harness` binary with these arguments; returns (exit code, stdout, stderr).
pub fn run_cli(args: &[&str]) -> (i32, String, String) {
    outcome(
        Command::new(BIN)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run harness"),
    )
}

/// Fails unless every one of `needles` stands in `text`, naming the first that does not.
pub fn assert_contains_all(text: &str, needles: &[&str]) {
    for needle in needles {
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }
}

/// A finished process's exit code (-1 when a signal ended it), stdout and stderr as text.
pub fn outcome(out: std::process::Output) -> (i32, String, String) {
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `cmd` with `stdin` as its whole input (then closed); returns what it printed.
pub fn output_with_stdin(cmd: &mut Command, stdin: &str) -> std::process::Output {
    use std::io::Write;
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {:?}: {e}", cmd.get_program()));
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(stdin.as_bytes())
        .expect("write stdin");
    child.wait_with_output().expect("wait for the process")
}

pub fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

// --- invariant checks on one session's event stream ------------------------------------------

/// Invariants 3 and 5 as seen from outside: on one session's stream, `harness::turn-started` and
/// `harness::turn-completed` alternate (never two turns open at once), every turn starts once and
/// completes at most once (exactly once unless it is the last, still open one). Returns the turn
/// ids in order of start.
pub fn check_turn_lifecycle(events: &[SseEvent]) -> Vec<String> {
    let mut turns: Vec<String> = Vec::new();
    let mut open: Option<String> = None;
    let mut completed = std::collections::HashSet::new();
    let trace = || {
        events
            .iter()
            .filter(|e| e.topic().starts_with("harness::turn-"))
            .map(|e| format!("{} {} {}", e.event_id(), e.topic(), e.payload()["turn_id"]))
            .collect::<Vec<_>>()
            .join("\n")
    };
    for e in events {
        let turn = e.payload()["turn_id"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        match e.topic() {
            "harness::turn-started" => {
                assert!(
                    open.is_none(),
                    "turn {turn} started while {open:?} was still open:\n{}",
                    trace()
                );
                assert!(
                    !turns.contains(&turn),
                    "turn {turn} started twice:\n{}",
                    trace()
                );
                turns.push(turn.clone());
                open = Some(turn);
            }
            "harness::turn-completed" => {
                assert!(
                    completed.insert(turn.clone()),
                    "turn {turn} completed twice:\n{}",
                    trace()
                );
                assert_eq!(
                    open.as_deref(),
                    Some(turn.as_str()),
                    "turn {turn} completed but was not the open turn:\n{}",
                    trace()
                );
                open = None;
            }
            _ => {}
        }
    }
    turns
}

/// Invariant 2 as seen from outside: every entry is added once (a replayed step rewrites its
/// entries; it does not add them again).
pub fn check_entries_added_once(events: &[SseEvent]) {
    let mut seen = std::collections::HashMap::new();
    for e in events
        .iter()
        .filter(|e| e.topic() == "session::message-added")
    {
        let id = e.payload()["entry_id"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if let Some(first) = seen.insert(id.clone(), e.event_id()) {
            panic!(
                "entry {id} added twice (events {first} and {})",
                e.event_id()
            );
        }
    }
}

/// The events of one turn's `turn-completed`.
pub fn completions_of<'a>(events: &'a [SseEvent], turn_id: &str) -> Vec<&'a SseEvent> {
    events
        .iter()
        .filter(|e| {
            e.topic() == "harness::turn-completed" && e.payload()["turn_id"] == json!(turn_id)
        })
        .collect()
}
