//! A real iii engine for the end-to-end tests, when one is given: `III_BIN=/path/to/iii`.
//!
//! The engine runs in a temporary directory with the workers the harness needs (state on
//! files, the queue, pub/sub, cron, configuration), its worker endpoint on a free loopback
//! port, telemetry and update checks off. The test talks to it through [`Client`], a plain
//! worker connection speaking the engine's JSON frames (as the double's clients do).
//!
//! With `III_QUEUE_BIN=/path/to/queue` as well, the separately installed queue worker runs next
//! to the engine (the engine's built-in `iii-queue` is left out of its config: the two cannot
//! both own `durable:subscriber`), so `engine::queue::enqueue` is registered and the harness
//! worker takes the enqueue route. It stays up across engine restarts and reconnects by itself,
//! as it would in a deployment.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};
use tokio_tungstenite::tungstenite::Message as Ws;

use super::{lists, CallError};

/// The engine binary to run, if the environment names one.
pub fn engine_bin() -> Option<PathBuf> {
    std::env::var_os("III_BIN")
        .map(PathBuf::from)
        .filter(|p| !p.as_os_str().is_empty())
}

/// The queue worker binary to run next to the engine, if the environment names one.
pub fn queue_bin() -> Option<PathBuf> {
    std::env::var_os("III_QUEUE_BIN")
        .map(PathBuf::from)
        .filter(|p| !p.as_os_str().is_empty())
}

/// The configuration the end-to-end tests run the engine with (also what README documents
/// for `harness worker`). With a separate queue worker the built-in `iii-queue` block is left
/// out.
pub fn config(port: u16, separate_queue: bool) -> String {
    let text = config_text(port);
    if !separate_queue {
        return text;
    }
    let start = text.find("  - name: iii-queue").expect("iii-queue block");
    let end = text.find("  - name: iii-pubsub").expect("iii-pubsub block");
    format!("{}{}", &text[..start], &text[end..])
}

fn config_text(port: u16) -> String {
    format!(
        r#"workers:
  - name: iii-worker-manager
    config:
      host: 127.0.0.1
      port: {port}
  - name: iii-state
    config:
      adapter:
        name: kv
        config:
          store_method: file_based
          file_path: ./data/state_store.db
  - name: iii-queue
    config:
      adapter:
        name: builtin
        config:
          store_method: file_based
          file_path: ./data/queue_store
  - name: iii-pubsub
    config:
      adapter:
        name: local
  - name: iii-cron
    config:
      adapter:
        name: kv
  - name: configuration
    config:
      adapter:
        name: fs
        config:
          directory: ./config
"#
    )
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A running engine process. SIGKILLed on drop.
pub struct RealEngine {
    bin: PathBuf,
    dir: tempfile::TempDir,
    pub port: u16,
    child: Mutex<Option<Child>>,
    /// The separately installed queue worker (`III_QUEUE_BIN`), when given.
    queue_bin: Option<PathBuf>,
    queue: Mutex<Option<Child>>,
}

impl RealEngine {
    pub async fn start(bin: &Path) -> RealEngine {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let queue_bin = queue_bin();
        std::fs::write(
            dir.path().join("config.yaml"),
            config(port, queue_bin.is_some()),
        )
        .expect("write config");
        let e = RealEngine {
            bin: bin.to_path_buf(),
            dir,
            port,
            child: Mutex::new(None),
            queue_bin,
            queue: Mutex::new(None),
        };
        e.spawn().await;
        e
    }

    pub fn url(&self) -> String {
        format!("ws://127.0.0.1:{}", self.port)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    async fn spawn(&self) {
        let child = self.spawn_logged(
            Command::new(&self.bin).args(["--config", "config.yaml", "--no-update-check"]),
            "engine.log",
        );
        *self.child.lock().unwrap() = Some(child);
        // Up once its built-ins answer.
        self.wait_listed(
            json!({}),
            |_| true,
            "the iii engine did not come up",
            || self.log(),
        )
        .await;
        self.ensure_queue_worker().await;
    }

    /// Polls a fresh connection's `engine::functions::list` of `request` until it answers and
    /// `ready` holds of the answer; after a minute fails with `what` and the log `log` reads.
    async fn wait_listed(
        &self,
        request: Value,
        ready: impl Fn(&Value) -> bool,
        what: &str,
        log: impl Fn() -> String,
    ) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(c) = Client::connect(&self.url()).await {
                let listed = c.call("engine::functions::list", request.clone()).await;
                c.close();
                if listed.is_ok_and(|l| ready(&l)) {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "{what}; log:\n{}", log());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Starts `cmd` in the engine's directory, its output appended to `log_name` there.
    fn spawn_logged(&self, cmd: &mut Command, log_name: &str) -> std::process::Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(log_name))
            .expect("process log");
        cmd.current_dir(self.dir.path())
            .env("III_TELEMETRY_ENABLED", "false")
            .env(
                "RUST_LOG",
                std::env::var("III_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().expect("log")))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {log_name}'s process: {e}"))
    }

    /// True when the separately installed queue worker runs next to the engine.
    pub fn has_queue_worker(&self) -> bool {
        self.queue_bin.is_some()
    }

    /// Starts the queue worker once (it reconnects to a restarted engine by itself) and waits
    /// until the engine lists its `engine::queue::enqueue`.
    async fn ensure_queue_worker(&self) {
        let Some(bin) = &self.queue_bin else {
            return;
        };
        {
            let mut q = self.queue.lock().unwrap();
            if q.is_none() {
                let child =
                    self.spawn_logged(Command::new(bin).arg("--url").arg(self.url()), "queue.log");
                *q = Some(child);
            }
        }
        self.wait_listed(
            json!({"prefix": "engine::queue::", "include_internal": true}),
            |l| lists(l, "functions", "function_id", "engine::queue::enqueue"),
            "the queue worker did not register engine::queue::enqueue",
            || self.queue_log(),
        )
        .await;
    }

    pub fn queue_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("queue.log")).unwrap_or_default()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("engine.log")).unwrap_or_default()
    }

    /// SIGKILL, then reap.
    pub fn kill(&self) {
        if let Some(mut c) = self.child.lock().unwrap().take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGKILL and start again on the same directory (what its stores flushed survives).
    pub async fn restart(&self) {
        self.kill();
        self.spawn().await;
    }
}

impl Drop for RealEngine {
    fn drop(&mut self) {
        self.kill();
        if let Some(mut q) = self.queue.lock().unwrap().take() {
            let _ = q.kill();
            let _ = q.wait();
        }
    }
}

static NEXT_CLIENT: AtomicU64 = AtomicU64::new(0);

type Local = Arc<dyn Fn(Value) -> Result<Value, CallError> + Send + Sync>;

struct ClientInner {
    tx: mpsc::UnboundedSender<Ws>,
    pending: Mutex<HashMap<String, oneshot::Sender<Value>>>,
    local: Mutex<HashMap<String, Local>>,
    /// Every frame the engine sent, in order.
    received: Mutex<Vec<Value>>,
    ids: AtomicU64,
}

/// A worker connection speaking the engine's frames directly: calls functions, offers
/// test-side functions, and keeps what the engine sent.
#[derive(Clone)]
pub struct Client {
    inner: Arc<ClientInner>,
}

impl Client {
    pub async fn connect(url: &str) -> Result<Client, String> {
        let (ws, _) = tokio_tungstenite::connect_async(url)
            .await
            .map_err(|e| e.to_string())?;
        let (mut sink, mut stream) = ws.split();
        let (tx, mut rx) = mpsc::unbounded_channel::<Ws>();
        let inner = Arc::new(ClientInner {
            tx,
            pending: Mutex::new(HashMap::new()),
            local: Mutex::new(HashMap::new()),
            received: Mutex::new(Vec::new()),
            ids: AtomicU64::new(1),
        });
        tokio::spawn(async move {
            while let Some(m) = rx.recv().await {
                let close = matches!(m, Ws::Close(_));
                if sink.send(m).await.is_err() || close {
                    break;
                }
            }
            let _ = sink.close().await;
        });
        let weak = Arc::downgrade(&inner);
        tokio::spawn(async move {
            while let Some(Ok(frame)) = stream.next().await {
                let Some(inner) = weak.upgrade() else { return };
                let text = match frame {
                    Ws::Text(t) => t.to_string(),
                    Ws::Binary(b) => String::from_utf8_lossy(&b).into_owned(),
                    Ws::Close(_) => break,
                    _ => continue,
                };
                let Ok(msg) = serde_json::from_str::<Value>(&text) else {
                    continue;
                };
                inner.received.lock().unwrap().push(msg.clone());
                match msg["type"].as_str() {
                    Some("invocationresult") => {
                        let id = msg["invocation_id"].as_str().unwrap_or_default();
                        if let Some(tx) = inner.pending.lock().unwrap().remove(id) {
                            let _ = tx.send(msg);
                        }
                    }
                    Some("invokefunction") => {
                        let f = msg["function_id"].as_str().unwrap_or_default();
                        let local = inner.local.lock().unwrap().get(f).cloned();
                        // Functions registered by hand (`send`) are answered by the test, if
                        // ever.
                        let Some(l) = local else { continue };
                        let r = l(msg["data"].clone());
                        if let Some(id) = msg["invocation_id"].as_str() {
                            let mut out = json!({"type": "invocationresult", "invocation_id": id, "function_id": f});
                            match r {
                                Ok(v) => out["result"] = v,
                                Err(e) => {
                                    out["error"] = json!({"code": e.code, "message": e.message})
                                }
                            }
                            let _ = inner.tx.send(Ws::Text(out.to_string().into()));
                        }
                    }
                    Some("ping") => {
                        let _ = inner
                            .tx
                            .send(Ws::Text(json!({"type": "pong"}).to_string().into()));
                    }
                    _ => {}
                }
            }
        });
        let c = Client { inner };
        // As the SDK does on connect: the engine files a connection's registrations under a
        // namespace that arrives with this call (and holds them up to 5 s without it).
        c.send(
            json!({"type": "invokefunction", "function_id": "engine::workers::register",
            // The engine leases a worker name to one live connection per namespace (a second
            // gets `registrationrejected`, WORKER_NAMESPACE_CONFLICT): one name per client.
            "data": {"name": format!("harness-tests-{}-{}", std::process::id(), NEXT_CLIENT.fetch_add(1, Ordering::SeqCst)),
                "description": "the end-to-end tests' client"},
            "action": {"type": "void"}}),
        );
        Ok(c)
    }

    fn fresh_id(&self) -> String {
        let n = self.inner.ids.fetch_add(1, Ordering::SeqCst);
        format!("{:08x}-1111-4000-8000-{:012x}", std::process::id(), n)
    }

    pub fn send(&self, frame: Value) {
        let _ = self.inner.tx.send(Ws::Text(frame.to_string().into()));
    }

    /// Invokes a function and returns the engine's `invocationresult` frame as sent.
    pub async fn invoke_raw(&self, function_id: &str, data: Value) -> Result<Value, CallError> {
        let id = self.fresh_id();
        let (tx, rx) = oneshot::channel();
        self.inner.pending.lock().unwrap().insert(id.clone(), tx);
        self.send(json!({"type": "invokefunction", "invocation_id": id, "function_id": function_id, "data": data}));
        match tokio::time::timeout(Duration::from_secs(60), rx).await {
            Ok(Ok(frame)) => Ok(frame),
            _ => Err(CallError {
                code: "timeout".into(),
                message: format!("{function_id}: no answer in 60 s"),
            }),
        }
    }

    /// Invokes a function with an `action` (`{"type": "enqueue", "queue": …}`) and returns the
    /// engine's `invocationresult` frame as sent.
    pub async fn invoke_action(
        &self,
        function_id: &str,
        data: Value,
        action: Value,
    ) -> Result<Value, CallError> {
        let id = self.fresh_id();
        let (tx, rx) = oneshot::channel();
        self.inner.pending.lock().unwrap().insert(id.clone(), tx);
        self.send(json!({"type": "invokefunction", "invocation_id": id, "function_id": function_id, "data": data, "action": action}));
        match tokio::time::timeout(Duration::from_secs(60), rx).await {
            Ok(Ok(frame)) => Ok(frame),
            _ => Err(CallError {
                code: "timeout".into(),
                message: format!("{function_id}: no answer in 60 s"),
            }),
        }
    }

    pub async fn call(&self, function_id: &str, data: Value) -> Result<Value, CallError> {
        let frame = self.invoke_raw(function_id, data).await?;
        match frame.get("error").filter(|e| !e.is_null()) {
            Some(e) => Err(CallError {
                code: e["code"].as_str().unwrap_or("invocation_failed").into(),
                message: e["message"].as_str().unwrap_or_default().into(),
            }),
            None => Ok(frame.get("result").cloned().unwrap_or(Value::Null)),
        }
    }

    /// Offers a function on this connection.
    pub fn register(
        &self,
        function_id: &str,
        f: impl Fn(Value) -> Result<Value, CallError> + Send + Sync + 'static,
    ) {
        self.inner
            .local
            .lock()
            .unwrap()
            .insert(function_id.to_string(), Arc::new(f));
        self.send(json!({"type": "registerfunction", "id": function_id, "description": "test-side function"}));
    }

    pub fn received(&self) -> Vec<Value> {
        self.inner.received.lock().unwrap().clone()
    }

    /// Closes the connection (the engine then drops what this client registered).
    pub fn close(&self) {
        let _ = self.inner.tx.send(Ws::Close(None));
    }
}
