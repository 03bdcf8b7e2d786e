//! A `harness worker` child process connected to the engine double, and the harness calls the
//! tests make through the engine (as any other client of the engine would).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{CallError, Engine};

#[path = "../common/process.rs"]
mod process;

#[allow(unused_imports)] // each test binary uses a different part of it
pub use process::{Sessions, WAIT};

pub const BIN: &str = env!("CARGO_BIN_EXE_harness");

/// A `harness worker --with all` on a temporary data dir. Killed (SIGKILL) on drop.
pub struct WorkerProc {
    child: Option<Child>,
    dir: tempfile::TempDir,
    engine_url: String,
    extra: Vec<String>,
    env: Vec<(String, String)>,
    starts: u32,
    /// Where the data dir and the script are (this worker's own dir, or another worker's when
    /// it shares that one's store: see [`WorkerProc::standby`]).
    home: PathBuf,
    /// The log line that tells the worker is up.
    ready_line: &'static str,
}

impl WorkerProc {
    pub async fn start(engine: &Engine, script: &Value, extra: &[&str]) -> WorkerProc {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("script.json"), script.to_string()).expect("write script");
        let home = dir.path().to_path_buf();
        let mut w = WorkerProc {
            child: None,
            dir,
            engine_url: engine.url.clone(),
            extra: named(extra, "harness"),
            env: Vec::new(),
            starts: 0,
            home,
            ready_line: "harness worker registered on",
        };
        w.spawn().await;
        w
    }

    /// A second `harness worker` on the same engine, data dir and script as `serving`, started
    /// while `serving` is up: it stands by (returns once it says so) and takes over when
    /// `serving` is gone.
    pub async fn standby(engine: &Engine, serving: &WorkerProc, extra: &[&str]) -> WorkerProc {
        let mut w = WorkerProc {
            child: None,
            dir: tempfile::tempdir().expect("tempdir"),
            engine_url: engine.url.clone(),
            extra: named(extra, "harness-standby"),
            env: Vec::new(),
            starts: 0,
            home: serving.home.clone(),
            ready_line: "harness worker standing by",
        };
        w.spawn().await;
        w.ready_line = "harness worker registered on";
        w
    }

    /// Waits until this worker logs that it registered (a standby that took over).
    pub async fn wait_serving(&self, within: Duration) {
        let deadline = Instant::now() + within;
        while !self.log().contains("harness worker registered on") {
            assert!(
                Instant::now() < deadline,
                "the worker did not take over within {within:?}; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn dir(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("worker.log")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    pub fn set_env(&mut self, key: &str, value: Option<&str>) {
        self.env.retain(|(k, _)| k != key);
        if let Some(v) = value {
            self.env.push((key.to_string(), v.to_string()));
        }
    }

    async fn spawn(&mut self) {
        assert!(self.child.is_none(), "spawn while a child is running");
        self.starts += 1;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("open worker log");
        let offset = log.metadata().map(|m| m.len()).unwrap_or(0) as usize;
        let child = Command::new(BIN)
            .arg("worker")
            .arg("--engine")
            .arg(&self.engine_url)
            .arg("--with")
            .arg("all")
            .arg("--data-dir")
            .arg(self.home.join("data"))
            .arg("--script")
            .arg(self.home.join("script.json"))
            .args(&self.extra)
            .env("HARNESS_LOG", "warn,harness_iii=debug")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("spawn harness worker");
        self.child = Some(child);
        let deadline = Instant::now() + WAIT;
        loop {
            let log = self.log();
            let fresh = log.get(offset..).unwrap_or("");
            if fresh.contains(self.ready_line) {
                return;
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().expect("try_wait") {
                self.child = None;
                panic!("harness worker exited with {status} before registering; log:\n{fresh}");
            }
            assert!(
                Instant::now() < deadline,
                "harness worker did not register within {WAIT:?}; log:\n{fresh}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL, then reap.
    pub fn kill(&mut self) {
        process::kill(&mut self.child);
    }

    /// True once the process has exited on its own (a failpoint); reaps it.
    pub fn exited(&mut self) -> bool {
        process::exited(&mut self.child)
    }

    /// Starts the worker again on the same data dir and script.
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn().await;
    }
}

/// The arguments with `--worker-name NAME` unless they name the worker already (the tests
/// find a worker's connection on the double by its name).
fn named(extra: &[&str], name: &str) -> Vec<String> {
    let mut out: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    if !extra.contains(&"--worker-name") {
        out.extend(["--worker-name".to_string(), name.to_string()]);
    }
    out
}

impl Drop for WorkerProc {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            eprintln!(
                "--- harness worker log (last 80 lines, {} starts) ---\n{}\n---",
                self.starts,
                lines[lines.len().saturating_sub(80)..].join("\n")
            );
        }
    }
}

impl Engine {
    /// `harness::send` of a user text with model "m" on the scripted provider, allowed the
    /// functions `allow` names; returns the turn id.
    pub async fn send(&self, session_id: &str, text: &str, allow: &[&str]) -> String {
        let mut req = json!({"session_id": session_id, "message": text, "model": "m", "provider": "scripted"});
        if !allow.is_empty() {
            req["options"] = json!({"functions": {"allow": allow, "expose": "native"}});
        }
        let sent = self.ok("harness::send", req).await;
        sent["turn_id"]
            .as_str()
            .unwrap_or_else(|| panic!("the send answered no turn_id: {sent}"))
            .to_string()
    }

    /// [`Engine::send`], then waits for the turn to end; returns its last status.
    pub async fn send_and_wait(&self, session_id: &str, text: &str, allow: &[&str]) -> Value {
        let turn_id = self.send(session_id, text, allow).await;
        self.wait_turn(session_id, &turn_id).await
    }

    /// Polls until the session's turn has this status.
    pub async fn wait_status(&self, session_id: &str, status: &str) -> Value {
        let deadline = Instant::now() + WAIT;
        loop {
            let s = self.status(session_id).await;
            if s["status"] == json!(status) {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "{session_id} never reached {status}; last status {s}"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

impl Sessions for Engine {
    /// `harness::status`, retried while the worker is (re)starting.
    async fn status(&self, session_id: &str) -> Value {
        let deadline = Instant::now() + WAIT;
        loop {
            match self
                .call("harness::status", json!({ "session_id": session_id }))
                .await
            {
                Ok(v) => return v,
                Err(e) if transient(&e) && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(e) => panic!("harness::status: {}: {}", e.code, e.message),
            }
        }
    }

    async fn messages(&self, request: Value) -> Value {
        self.ok("session::messages", request).await
    }
}

pub fn transient(e: &CallError) -> bool {
    matches!(
        e.code.as_str(),
        "function_not_found"
            | "invocation_stopped"
            | "timeout"
            | "harness/starting"
            // A real engine's answer to a call routed to a worker whose connection just died.
            | "channel_send_failed"
    )
}
