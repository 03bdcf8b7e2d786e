//! The web console in a real browser: headless Chromium driven over W3C WebDriver.
//!
//! Runs when `chromium` and `chromedriver` are on PATH (or `HARNESS_CHROMIUM` /
//! `HARNESS_CHROMEDRIVER` name them); otherwise every test prints the skip line and passes,
//! unless `HARNESS_REQUIRE_BROWSER=1`, under which a missing browser fails (CI cannot go green
//! by skipping). Run one browser at a time: `-- --test-threads=1`.
//!
//! The WebDriver client is the ~100 lines below on `std::net` (HTTP/1.0 to chromedriver on
//! loopback), not fantoccini: it adds no dependency (fantoccini pulls hyper-util, a TLS stack
//! choice and its own futures plumbing), and a synchronous client lets a failing test dump the
//! page from `Drop`. The same client talks to `harness serve`, which each test starts on a port
//! it keeps across a restart (the page's origin must not change).
//!
//! Each scenario writes a PNG per step to `target/console-screenshots/<test>/NN-step.png`, and
//! on failure the page's outerHTML and the browser console log next to them.
//!
//! Nothing sleeps to synchronize: every wait polls the page or the API against a deadline. The
//! one fixed pause (`stop_stops`) observes that nothing changes after the turn ended.

#[path = "common/http_head.rs"]
mod http_head;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use http_head::content_length;
use serde_json::{json, Value};

/// The binary under test; `HARNESS_CONSOLE_TEST_BIN` overrides it (a target directory shared
/// by several checkouts can hold another checkout's build at the uplifted path).
fn bin() -> String {
    std::env::var("HARNESS_CONSOLE_TEST_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_harness").to_string())
}
const WAIT: Duration = Duration::from_secs(30);
const SKIP: &str = "console browser tests skipped: chromium/chromedriver not found (apt-get install chromium chromium-driver)";

// --- finding the browser --------------------------------------------------------------------

fn on_path(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    for dir in std::env::split_paths(&path) {
        for n in names {
            let p = dir.join(n);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

/// `(chromium, chromedriver)`, or `None` (after printing the skip line) when this machine has
/// none and the browser is not required.
fn browser_binaries() -> Option<(PathBuf, PathBuf)> {
    let chromium = std::env::var_os("HARNESS_CHROMIUM")
        .map(PathBuf::from)
        .or_else(|| on_path(&["chromium", "chromium-browser", "google-chrome"]));
    let driver = std::env::var_os("HARNESS_CHROMEDRIVER")
        .map(PathBuf::from)
        .or_else(|| on_path(&["chromedriver"]));
    match (chromium, driver) {
        (Some(c), Some(d)) if c.is_file() && d.is_file() => Some((c, d)),
        _ => {
            if std::env::var("HARNESS_REQUIRE_BROWSER").as_deref() == Ok("1") {
                panic!("HARNESS_REQUIRE_BROWSER=1 but {SKIP}");
            }
            // Straight to the process's stderr: libtest captures `eprintln!` of a passing test,
            // and the skip must be visible in a plain `cargo test` run.
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| {
                let _ = writeln!(std::io::stderr(), "{SKIP}");
            });
            None
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

// --- a tiny HTTP client (loopback only) ------------------------------------------------------

struct Reply {
    status: u16,
    body: Vec<u8>,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body[..self.body.len().min(500)])
            )
        })
    }
}

fn http(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> std::io::Result<Reply> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut req =
        format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    let body = body.unwrap_or(b"");
    if method != "GET" && method != "DELETE" {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes())?;
    s.write_all(body)?;
    // chromedriver keeps the connection open whatever the request says: read exactly the
    // declared length (or up to the last chunk) instead of waiting for the close.
    let mut raw = Vec::new();
    let mut buf = [0u8; 65536];
    let cut = loop {
        if let Some(cut) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            break cut;
        }
        let n = s.read(&mut buf)?;
        if n == 0 {
            return Err(std::io::Error::other("closed before the header end"));
        }
        raw.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&raw[..cut]).to_ascii_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let length = content_length(&head);
    let chunked = head.contains("transfer-encoding: chunked");
    let mut body = raw[cut + 4..].to_vec();
    loop {
        let done = match length {
            Some(n) => body.len() >= n,
            None if chunked => body.ends_with(b"0\r\n\r\n"),
            None => false,
        };
        if done {
            break;
        }
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&buf[..n]);
    }
    if chunked {
        body = dechunk(&body);
    }
    Ok(Reply { status, body })
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(nl) = b.windows(2).position(|w| w == b"\r\n") {
        let n = usize::from_str_radix(String::from_utf8_lossy(&b[..nl]).trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.extend_from_slice(&b[nl + 2..(nl + 2 + n).min(b.len())]);
        b = &b[(nl + 4 + n).min(b.len())..];
    }
    out
}

fn b64decode(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        _ => 63,
    };
    let bytes: Vec<u8> = s
        .bytes()
        .filter(|c| c.is_ascii_alphanumeric() || *c == b'+' || *c == b'/')
        .collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let v: Vec<u32> = chunk.iter().map(|c| val(*c) as u32).collect();
        let n = v.iter().fold(0u32, |acc, x| (acc << 6) | x) << (6 * (4 - v.len()));
        out.push((n >> 16) as u8);
        if v.len() > 2 {
            out.push((n >> 8) as u8);
        }
        if v.len() > 3 {
            out.push(n as u8);
        }
    }
    out
}

// --- harness serve ------------------------------------------------------------------------

/// A `harness serve` child on a port it keeps across restarts.
struct Harness {
    port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
    args: Vec<String>,
    env: Vec<(String, String)>,
    token: Option<String>,
}

impl Harness {
    fn start(script: &Value, extra: &[&str], env: &[(&str, &str)]) -> Harness {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("script.json"), script.to_string()).unwrap();
        let token = extra
            .iter()
            .position(|a| *a == "--token")
            .map(|i| extra[i + 1].to_string());
        let mut h = Harness {
            port: free_port(),
            dir,
            child: None,
            args: extra.iter().map(|s| s.to_string()).collect(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            token,
        };
        h.spawn();
        h
    }

    /// A server whose model answers "hi" to "hello".
    fn saying_hi(extra: &[&str]) -> Harness {
        Harness::replying("hello", "hi", 0, extra)
    }

    /// A harness whose model answers a user text matching `matcher` with `text`, streamed a
    /// chunk every `chunk_delay_ms`.
    fn replying(matcher: &str, text: &str, chunk_delay_ms: u64, extra: &[&str]) -> Harness {
        Harness::start(
            &json!({"generations": [text_gen(matcher, text, chunk_delay_ms)]}),
            extra,
            &[],
        )
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.path("server.log")).unwrap_or_default()
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.path("server.log"))
            .unwrap();
        let mark = log.metadata().unwrap().len() as usize;
        let child = Command::new(bin())
            .arg("serve")
            .arg("--listen")
            .arg(format!("127.0.0.1:{}", self.port))
            .arg("--data-dir")
            .arg(self.path("data"))
            .arg("--script")
            .arg(self.path("script.json"))
            .arg("--stream-coalesce-ms")
            .arg("0")
            .args(&self.args)
            .env_remove("ANTHROPIC_API_KEY")
            .env_remove("OPENAI_API_KEY")
            .env_remove("HARNESS_TOKEN")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        self.child = Some(child);
        let want = format!("console: http://127.0.0.1:{}/", self.port);
        let deadline = Instant::now() + WAIT;
        while !self.log()[mark..].contains(&want) {
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("harness serve exited with {st}:\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "no console line:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/", self.port)
    }

    fn call(&self, function_id: &str, payload: Value) -> (u16, Value) {
        let auth = self.token.as_ref().map(|t| format!("Bearer {t}"));
        let mut headers = vec![];
        if let Some(a) = &auth {
            headers.push(("Authorization", a.as_str()));
        }
        let r = http(
            self.port,
            "POST",
            &format!("/v1/functions/{function_id}"),
            &headers,
            Some(payload.to_string().as_bytes()),
        )
        .unwrap_or_else(|e| panic!("{function_id}: {e}"));
        (r.status, r.json())
    }

    fn ok(&self, function_id: &str, payload: Value) -> Value {
        let (status, v) = self.call(function_id, payload.clone());
        assert_eq!(status, 200, "{function_id} {payload}: {v}");
        v
    }

    /// The texts of the session's user messages, oldest first.
    fn user_texts(&self, sid: &str) -> Vec<String> {
        self.messages(sid)
            .iter()
            .filter(|e| e["message"]["role"] == "user")
            .map(text_of)
            .collect()
    }

    fn messages(&self, sid: &str) -> Vec<Value> {
        let v = self.ok(
            "session::messages",
            json!({"session_id": sid, "limit": 500}),
        );
        v["messages"].as_array().cloned().unwrap_or_default()
    }

    /// The session's events so far (the stream is read until it goes quiet at its end).
    fn events(&self, sid: &str) -> Vec<Value> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(400)))
            .unwrap();
        let auth = self
            .token
            .as_ref()
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        write!(
            s,
            "GET /v1/sessions/{sid}/events HTTP/1.0\r\nHost: 127.0.0.1:{}\r\n{auth}\r\n",
            self.port
        )
        .unwrap();
        let mut raw = Vec::new();
        let mut buf = [0u8; 65536];
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => raw.extend_from_slice(&buf[..n]),
                Err(_) => break, // quiet: everything stored has been sent
            }
        }
        String::from_utf8_lossy(&raw)
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str(d).ok())
            .collect()
    }

    fn wait_status(&self, sid: &str, want: &[&str]) -> Value {
        poll("turn status", || {
            let (st, s) = self.call("harness::status", json!({"session_id": sid}));
            (st == 200 && want.contains(&s["status"].as_str().unwrap_or(""))).then_some(s)
        })
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!("--- harness serve log ---\n{}", self.log());
        }
    }
}

fn poll<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

// --- chromedriver and the browser ---------------------------------------------------------

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// One Chromium at a time, whatever `--test-threads` says (a browser and its driver take about
/// 1 GB; two at once on a 2-core machine also skew the timing budgets).
static ONE_BROWSER: std::sync::Mutex<()> = std::sync::Mutex::new(());

struct Browser {
    _turn: std::sync::MutexGuard<'static, ()>,
    port: u16,
    driver: Child,
    session: String,
    shots: PathBuf,
    step: u32,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// A fresh headless Chromium for scenario `name`, or `None` when the tier is skipped.
    fn open(name: &str) -> Option<Browser> {
        let (chromium, driver_bin) = browser_binaries()?;
        // A test that failed while holding the lock poisoned it; the next one still runs.
        let turn = ONE_BROWSER
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let port = free_port();
        let driver = Command::new(driver_bin)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        poll("chromedriver ready", || {
            let r = http(port, "GET", "/status", &[], None).ok()?;
            (r.json()["value"]["ready"] == json!(true)).then_some(())
        });
        let profile = tempfile::tempdir().unwrap();
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:loggingPrefs": {"browser": "ALL"},
            "goog:chromeOptions": {
                "binary": chromium,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--disable-quic", "--no-first-run", "--disable-background-networking",
                         "--disable-component-update", "--disable-sync", "--window-size=1280,800",
                         format!("--user-data-dir={}", profile.path().display())]
            }
        }}});
        let r = http(
            port,
            "POST",
            "/session",
            &[],
            Some(caps.to_string().as_bytes()),
        )
        .expect("new session");
        let v = r.json();
        let session = v["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session: {v}"))
            .to_string();
        let shots = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../target/console-screenshots")
            .join(name);
        let _ = std::fs::remove_dir_all(&shots);
        std::fs::create_dir_all(&shots).unwrap();
        eprintln!("screenshots: {}", shots.display());
        Some(Browser {
            _turn: turn,
            port,
            driver,
            session,
            shots,
            step: 0,
            _profile: profile,
        })
    }

    fn cmd(&self, method: &str, path: &str, body: Value) -> Value {
        let path = format!("/session/{}{path}", self.session);
        let body = body.to_string();
        let r = http(
            self.port,
            method,
            &path,
            &[],
            (method == "POST").then_some(body.as_bytes()),
        )
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let v = r.json();
        assert_eq!(r.status, 200, "{method} {path} {body}: {v}");
        v["value"].clone()
    }

    fn goto(&self, url: &str) {
        self.cmd("POST", "/url", json!({ "url": url }));
    }

    fn refresh(&self) {
        self.cmd("POST", "/refresh", json!({}));
    }

    /// Runs `body` as a function body in the page (`arguments` available) and returns its value.
    fn js(&self, body: &str, args: Value) -> Value {
        self.cmd(
            "POST",
            "/execute/sync",
            json!({"script": body, "args": args}),
        )
    }

    /// Polls a JS expression until it is truthy; returns its value.
    fn wait(&self, what: &str, expr: &str) -> Value {
        let script = format!("return ({expr});");
        let deadline = Instant::now() + WAIT;
        loop {
            let v = self.js(&script, json!([]));
            if !(v.is_null() || v == json!(false) || v == json!("") || v == json!(0)) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what} ({expr})"
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    fn find(&self, css: &str) -> String {
        let v = self.cmd(
            "POST",
            "/element",
            json!({"using": "css selector", "value": css}),
        );
        v[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("{css}: {v}"))
            .to_string()
    }

    /// Runs an element command on what `css` names. The page re-renders as events arrive, so an
    /// element found a moment ago can be replaced before the command lands: then it is found
    /// again.
    fn on_element(&self, css: &str, command: &str, body: Value) {
        for _ in 0..5 {
            let id = self.find(css);
            let path = format!("/session/{}/element/{id}/{command}", self.session);
            let body = body.to_string();
            let r = http(self.port, "POST", &path, &[], Some(body.as_bytes())).expect(command);
            if r.status == 200 {
                return;
            }
            let v = r.json();
            assert_eq!(
                v["value"]["error"], "stale element reference",
                "{command} {css}: {v}"
            );
        }
        panic!("{command} {css}: the element kept being replaced");
    }

    fn click(&self, css: &str) {
        self.on_element(css, "click", json!({}));
    }

    fn type_into(&self, css: &str, text: &str) {
        self.on_element(css, "value", json!({ "text": text }));
    }

    /// Sets a `<select>` the way a person does (the value, then a change event).
    fn select(&self, css: &str, value: &str) {
        self.js(
            "const s = document.querySelector(arguments[0]); s.value = arguments[1]; \
             s.dispatchEvent(new Event('change', {bubbles: true}));",
            json!([css, value]),
        );
    }

    /// Presses a key on the focused element (W3C actions).
    fn press(&self, key: &str) {
        self.cmd(
            "POST",
            "/actions",
            json!({"actions": [{"type": "key", "id": "kb", "actions": [
                {"type": "keyDown", "value": key}, {"type": "keyUp", "value": key}]}]}),
        );
    }

    fn text(&self, css: &str) -> String {
        self.js(
            "const e = document.querySelector(arguments[0]); return e ? e.textContent : null;",
            json!([css]),
        )
        .as_str()
        .unwrap_or("")
        .to_string()
    }

    /// Saves a screenshot as the next step's PNG; returns its bytes.
    fn shot(&mut self, step: &str) -> Vec<u8> {
        self.step += 1;
        let png = b64decode(self.cmd("GET", "/screenshot", json!({})).as_str().unwrap());
        std::fs::write(
            self.shots.join(format!("{:02}-{step}.png", self.step)),
            &png,
        )
        .unwrap();
        png
    }

    fn element_shot(&mut self, css: &str, step: &str) -> Vec<u8> {
        self.step += 1;
        let id = self.find(css);
        let png = b64decode(
            self.cmd("GET", &format!("/element/{id}/screenshot"), json!({}))
                .as_str()
                .unwrap(),
        );
        std::fs::write(
            self.shots.join(format!("{:02}-{step}.png", self.step)),
            &png,
        )
        .unwrap();
        png
    }

    /// Opens the console and waits until its picker is filled (the catalog answered).
    fn open_console(&self, h: &Harness) {
        self.goto(&h.url());
        self.wait(
            "the model picker",
            "document.querySelectorAll('#model option').length > 0",
        );
    }

    /// Types a message into the composer and sends it with the Send button.
    fn send(&self, text: &str) {
        self.type_into("#message", text);
        self.wait("Send enabled", "!document.getElementById('send').disabled");
        self.click("#send");
    }

    /// Sends `text` and waits until the reply has streamed more than `chars` characters; the
    /// session's id.
    fn send_until_partial(&self, text: &str, chars: usize) -> String {
        self.send(text);
        self.wait("a partial reply", &format!("{LAST_REPLY}.length > {chars}"));
        self.session_id()
    }

    fn session_id(&self) -> String {
        self.wait(
            "a session in the address bar",
            "decodeURIComponent((/#session=(.+)$/.exec(location.hash) || [])[1] || '')",
        )
        .as_str()
        .unwrap()
        .to_string()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let path = format!("/session/{}/execute/sync", self.session);
            let body = json!({"script": "return document.documentElement.outerHTML", "args": []})
                .to_string();
            if let Ok(r) = http(self.port, "POST", &path, &[], Some(body.as_bytes())) {
                if let Ok(v) = serde_json::from_slice::<Value>(&r.body) {
                    let _ = std::fs::write(
                        self.shots.join("failure.html"),
                        v["value"].as_str().unwrap_or(""),
                    );
                }
            }
            let path = format!("/session/{}/se/log", self.session);
            if let Ok(r) = http(
                self.port,
                "POST",
                &path,
                &[],
                Some(br#"{"type":"browser"}"#),
            ) {
                let _ = std::fs::write(self.shots.join("console.log"), &r.body);
            }
            self.step += 1;
            if let Ok(r) = http(
                self.port,
                "GET",
                &format!("/session/{}/screenshot", self.session),
                &[],
                None,
            ) {
                if let Ok(v) = serde_json::from_slice::<Value>(&r.body) {
                    let png = b64decode(v["value"].as_str().unwrap_or(""));
                    let _ = std::fs::write(self.shots.join("failure.png"), png);
                }
            }
            eprintln!("console failure artifacts in {}", self.shots.display());
        }
        let _ = http(
            self.port,
            "DELETE",
            &format!("/session/{}", self.session),
            &[],
            None,
        );
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

// --- scripts ------------------------------------------------------------------------------

fn words(n: usize, tag: &str) -> String {
    (1..=n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn text_gen(matcher: &str, text: &str, chunk_delay_ms: u64) -> Value {
    json!({"match": {"last_user_text": matcher}, "repeat": true, "chunk_delay_ms": chunk_delay_ms,
           "content": [{"type": "text", "text": text}]})
}

fn call_gen(matcher: &str, id: &str, function_id: &str, arguments: Value) -> Value {
    json!({"match": {"last_user_text": matcher},
           "content": [{"type": "function_call", "id": id, "function_id": function_id, "arguments": arguments}]})
}

fn once_text(matcher: &str, text: &str) -> Value {
    json!({"match": {"last_user_text": matcher}, "content": [{"type": "text", "text": text}]})
}

/// The transcript as the page shows it: `(entry_id, role, text)` per rendered entry.
fn rendered(b: &Browser) -> Vec<(String, String, String)> {
    let v = b.js(
        "return [...document.querySelectorAll('#transcript article.entry')].map(e => \
           [e.dataset.entry, e.dataset.role || '', \
            [...e.querySelectorAll(':scope > .text')].map(t => t.textContent).join('')]);",
        json!([]),
    );
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r[0].as_str().unwrap().to_string(),
                r[1].as_str().unwrap().to_string(),
                r[2].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn text_of(entry: &Value) -> String {
    entry["message"]["content"]
        .as_array()
        .map(|bs| {
            bs.iter()
                .filter(|b| b["type"] == "text")
                .filter_map(|b| b["text"].as_str())
                .collect::<String>()
        })
        .unwrap_or_default()
}

/// The stored transcript's user and assistant entries as `(entry_id, role, text)`.
fn stored(h: &Harness, sid: &str) -> Vec<(String, String, String)> {
    h.messages(sid)
        .iter()
        .filter(|e| matches!(e["message"]["role"].as_str(), Some("user" | "assistant")))
        .map(|e| {
            (
                e["entry_id"].as_str().unwrap().to_string(),
                e["message"]["role"].as_str().unwrap().to_string(),
                text_of(e),
            )
        })
        .collect()
}

/// The text of the newest assistant entry the page shows.
const LAST_REPLY: &str = "(() => { const a = [...document.querySelectorAll('#transcript article.role-assistant .text')]; \
     return a.length ? a[a.length - 1].textContent : ''; })()";

// --- scenarios ------------------------------------------------------------------------------

#[test]
fn chat_streams_and_switches_model() {
    let Some(mut b) = Browser::open("chat_streams_and_switches_model") else {
        return;
    };
    let reply = words(24, "w");
    let dir = tempfile::tempdir().unwrap();
    let catalog = dir.path().join("catalog.json");
    std::fs::write(
        &catalog,
        json!({"models": [{"provider": "scripted", "id": "demo-two", "name": "Scripted two",
                           "context_window": 100000}]})
        .to_string(),
    )
    .unwrap();
    let h = Harness::start(
        &json!({"generations": [text_gen("hello", &reply, 150)]}),
        &[],
        &[("HARNESS_MODEL_CATALOG", catalog.to_str().unwrap())],
    );
    b.open_console(&h);
    b.shot("empty");
    b.select("#provider", "scripted");
    b.select("#model", "demo");
    b.send("hello");
    // The reply grows over at least three screenshots.
    let mut lengths: Vec<usize> = Vec::new();
    while lengths.len() < 3 {
        let now = b
            .wait(
                "the reply to grow",
                &format!(
                    "(() => {{ const t = {LAST_REPLY}; return t.length > {} ? t : ''; }})()",
                    lengths.last().copied().unwrap_or(0)
                ),
            )
            .as_str()
            .unwrap()
            .len();
        assert!(
            now < reply.len() || lengths.len() == 2,
            "streamed, not whole"
        );
        lengths.push(now);
        b.shot(&format!("growing-{}", lengths.len()));
    }
    assert!(lengths.windows(2).all(|w| w[0] < w[1]), "{lengths:?}");
    let sid = b.session_id();
    b.wait(
        "the full reply",
        &format!("{LAST_REPLY} === {}", json!(reply)),
    );
    h.wait_status(&sid, &["completed"]);
    b.shot("first-reply");

    // Another model of the catalog, same session.
    b.select("#model", "demo-two");
    b.send("hello again");
    b.wait(
        "a second reply",
        "document.querySelectorAll('#transcript article.role-assistant').length === 2",
    );
    poll("the second turn", || {
        let msgs = h.messages(&sid);
        let assistants: Vec<&Value> = msgs
            .iter()
            .filter(|e| e["message"]["role"] == "assistant")
            .collect();
        (assistants.len() == 2 && text_of(assistants[1]) == reply).then_some(())
    });
    let msgs = h.messages(&sid);
    let models: Vec<&str> = msgs
        .iter()
        .filter(|e| e["message"]["role"] == "assistant")
        .map(|e| e["message"]["model"].as_str().unwrap())
        .collect();
    assert_eq!(models, vec!["demo", "demo-two"]);
    b.wait(
        "the usage line names demo-two",
        "[...document.querySelectorAll('#transcript article.role-assistant .usage')].pop().textContent.includes('demo-two')",
    );
    let list = h.ok("session::list", json!({}));
    assert_eq!(list["sessions"].as_array().unwrap().len(), 1, "{list}");
    // The list follows the session: one row, done, on the model it last used.
    b.wait(
        "the list row done on demo-two",
        "(() => { const r = document.querySelectorAll('#session-list .session-item');            return r.length === 1 && r[0].textContent.includes('done') && r[0].textContent.includes('demo-two'); })()",
    );
    b.shot("second-model");

    // A provider without its key: its models are shown, disabled, with the reason.
    b.select("#provider", "anthropic");
    let opts = b.js(
        "return [...document.querySelectorAll('#model option')].map(o => [o.disabled, o.textContent]);",
        json!([]),
    );
    let opts = opts.as_array().unwrap();
    assert!(!opts.is_empty());
    for o in opts {
        assert_eq!(o[0], json!(true), "{o}");
        assert!(
            o[1].as_str()
                .unwrap()
                .contains("no ANTHROPIC_API_KEY in the server's environment"),
            "{o}"
        );
    }
    assert!(b.text("#model-note").contains("ANTHROPIC_API_KEY"));
    b.type_into("#message", "not sent");
    assert_eq!(
        b.js("return document.getElementById('send').disabled", json!([])),
        json!(true)
    );
    b.shot("anthropic-disabled");
}

#[test]
fn reload_mid_stream_resumes() {
    let Some(mut b) = Browser::open("reload_mid_stream_resumes") else {
        return;
    };
    let reply = words(30, "r");
    let h = Harness::replying("hello", &reply, 100, &[]);
    b.open_console(&h);
    let sid = b.send_until_partial("hello", 10);
    b.shot("before-reload");
    b.refresh();
    b.wait(
        "the full reply after the reload",
        &format!("{LAST_REPLY} === {}", json!(reply)),
    );
    h.wait_status(&sid, &["completed"]);
    b.shot("after-reload");
    b.wait(
        "the page to settle",
        "document.getElementById('conn').dataset.state === 'live'",
    );
    assert_eq!(rendered(&b), stored(&h, &sid), "no duplicate, no gap");
}

#[test]
fn server_restart_resumes_stream() {
    let Some(mut b) = Browser::open("server_restart_resumes_stream") else {
        return;
    };
    let reply = words(40, "s");
    let mut h = Harness::replying("hello", &reply, 150, &[]);
    b.open_console(&h);
    let sid = b.send_until_partial("hello", 10);
    h.kill();
    b.wait(
        "the page to say reconnecting",
        "['reconnecting', 'gone'].includes(document.getElementById('conn').dataset.state)",
    );
    assert!(b.text("#conn").contains("reconnecting") || b.text("#conn").contains("gone"));
    b.shot("reconnecting");
    h.restart();
    b.wait(
        "live again",
        "document.getElementById('conn').dataset.state === 'live'",
    );
    h.wait_status(&sid, &["completed"]);
    b.wait(
        "the finished reply",
        &format!("{LAST_REPLY} === {}", json!(reply)),
    );
    b.shot("resumed");
    let shown = rendered(&b);
    let mut ids: Vec<&String> = shown.iter().map(|r| &r.0).collect();
    ids.dedup();
    assert_eq!(ids.len(), shown.len(), "no entry rendered twice");
    assert_eq!(shown, stored(&h, &sid));
}

fn fixtures(dir: &Path) -> (PathBuf, PathBuf) {
    let file = dir.join("fixtures.json");
    std::fs::write(
        &file,
        json!({"functions": [
            {"id": "fixture::write", "description": "writes a file (test fixture)",
             "response": {"written": true}},
            {"id": "fixture::ok", "description": "answers", "response": {"ok": 1}, "delay_ms": 120},
            {"id": "fixture::fail", "description": "fails", "response": {"code": "fixture/broken"},
             "is_error": true, "delay_ms": 60}
        ]})
        .to_string(),
    )
    .unwrap();
    (file, dir.join("invocations.jsonl"))
}

/// A server with the test fixture functions of [`fixtures`], which log each run, written to
/// `dir`; with `approve`, each of their calls waits for an approval. The server and the log.
fn with_fixtures(script: &Value, dir: &Path, approve: bool) -> (Harness, PathBuf) {
    let (fx, log) = fixtures(dir);
    let mut args = vec![
        "--fixtures",
        fx.to_str().unwrap(),
        "--fixture-log",
        log.to_str().unwrap(),
    ];
    if approve {
        args.extend(["--approve", "fixture::*"]);
    }
    (Harness::start(script, &args, &[]), log)
}

fn invocations(log: &Path) -> Vec<Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn approval_card_approve_and_deny() {
    let Some(mut b) = Browser::open("approval_card_approve_and_deny") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let args1 = json!({"path": "/tmp/notes.txt", "text": "first <b>line</b>"});
    let args2 = json!({"path": "/etc/passwd", "text": "second"});
    let script = json!({"generations": [
        call_gen("write one", "c1", "fixture::write", args1.clone()),
        once_text("write one", "wrote one"),
        call_gen("write two", "c2", "fixture::write", args2.clone()),
        once_text("write two", "did not write two"),
    ]});
    let (h, log) = with_fixtures(&script, dir.path(), true);
    b.open_console(&h);
    b.type_into("#allow", "fixture::*");
    b.send("write one");
    let sid = b.session_id();
    let held = poll("the hold", || {
        let a = h.ok("approval::list", json!({ "session_id": sid }));
        a["approvals"].as_array().unwrap().first().cloned()
    });
    let since = Instant::now();
    b.wait(
        "the approval card",
        "document.querySelector('.approval-card .approve')",
    );
    assert!(
        since.elapsed() < Duration::from_secs(1),
        "the card appeared {:?} after the hold was listed",
        since.elapsed()
    );
    let shown_args: Value = serde_json::from_str(&b.text(".approval-card .approval-args")).unwrap();
    assert_eq!(shown_args, args1);
    assert_eq!(
        b.text(".approval-card .approval-digest"),
        held["digest"].as_str().unwrap()
    );
    b.shot("card");
    b.click(".approval-card button.approve");
    b.wait(
        "the approved result",
        "document.querySelector('[data-result=\"c1\"] .kind-ok')",
    );
    h.wait_status(&sid, &["completed"]);
    b.wait("the final reply", &format!("{LAST_REPLY} === 'wrote one'"));
    b.shot("approved");
    // The waterfall shades the approval wait inside the held call's bar.
    b.click(".turn-head button");
    b.wait(
        "the approval wait in the waterfall",
        "document.querySelector('.wf-row[data-kind=\"execute_tool\"] .wf-wait')",
    );
    b.shot("approval-wait");
    b.click("#drawer-close");
    let inv = invocations(&log);
    assert_eq!(inv.len(), 1, "{inv:?}");
    assert_eq!(inv[0]["function_call_id"], "c1");
    assert_eq!(inv[0]["arguments"], args1);

    b.send("write two");
    b.wait(
        "the second card",
        "document.querySelector('[data-call=\"c2\"] .approval-card .deny')",
    );
    b.type_into("[data-call=\"c2\"] .deny-reason", "not that file");
    b.shot("second-card");
    b.click("[data-call=\"c2\"] .approval-card button.deny");
    b.wait(
        "the denied result",
        "document.querySelector('[data-result=\"c2\"] .kind-denied')",
    );
    assert!(b
        .text("[data-result=\"c2\"]")
        .contains("denied by the approver: not that file"));
    h.wait_status(&sid, &["completed"]);
    b.shot("denied");
    assert_eq!(invocations(&log).len(), 1, "a denied call never runs");
}

#[test]
fn ask_card_answers() {
    let Some(mut b) = Browser::open("ask_card_answers") else {
        return;
    };
    let ask = json!({"questions": [
        {"header": "Approach", "question": "How should I proceed?", "options": [
            {"label": "Pause", "description": "wait for you"},
            {"label": "End the turn", "description": "stop here"}]},
        {"header": "Channels", "question": "Where should I post?", "multi_select": true, "options": [
            {"label": "Console"}, {"label": "Slack"}, {"label": "Email"}]},
        {"header": "Name", "question": "What is the report called?", "options": [
            {"label": "Weekly"}, {"label": "Monthly"}]}
    ]});
    let script = json!({"generations": [
        call_gen("plan", "q1", "harness::ask", ask),
        once_text("plan", "asked"),
        text_gen("Approach", "thanks for the answers", 0),
    ]});
    let h = Harness::start(&script, &[], &[]);
    b.open_console(&h);
    b.type_into("#allow", "harness::ask");
    b.send("plan the report");
    let sid = b.session_id();
    b.wait(
        "the ask card",
        "document.querySelector('.ask-card:not(.answered)')",
    );
    let send_disabled = "document.querySelector('.ask-card .ask-send').disabled";
    assert_eq!(
        b.js(&format!("return {send_disabled}"), json!([])),
        json!(true)
    );
    // Radios for a single choice, checkboxes for a multi-select, descriptions, an Other field.
    assert_eq!(
        b.js("return document.querySelectorAll('.ask-card fieldset')[0].querySelectorAll('input[type=radio]').length", json!([])),
        json!(2)
    );
    assert_eq!(
        b.js("return document.querySelectorAll('.ask-card fieldset')[1].querySelectorAll('input[type=checkbox]').length", json!([])),
        json!(3)
    );
    assert!(b.text(".ask-card").contains("stop here"));
    b.shot("card");
    let label = |q: usize, text: &str| {
        b.js(
            "const fs = document.querySelectorAll('.ask-card fieldset')[arguments[0]]; \
             const l = [...fs.querySelectorAll('label')].find(l => l.textContent === arguments[1]); \
             return l.getAttribute('for');",
            json!([q, text]),
        )
        .as_str()
        .unwrap()
        .to_string()
    };
    b.click(&format!("#{}", label(0, "End the turn")));
    assert_eq!(
        b.js(&format!("return {send_disabled}"), json!([])),
        json!(true)
    );
    b.click(&format!("#{}", label(1, "Console")));
    b.click(&format!("#{}", label(1, "Slack")));
    assert_eq!(
        b.js(&format!("return {send_disabled}"), json!([])),
        json!(true)
    );
    b.type_into(&format!("#{}", label(2, "Other")), "Quarterly");
    assert_eq!(
        b.js(&format!("return {send_disabled}"), json!([])),
        json!(false)
    );
    b.shot("complete");
    b.click(".ask-card .ask-send");
    b.wait(
        "the card answered",
        "document.querySelector('.ask-card.answered fieldset[disabled]')",
    );
    h.wait_status(&sid, &["completed"]);
    b.wait(
        "the reply to the answer",
        &format!("{LAST_REPLY} === 'thanks for the answers'"),
    );
    b.shot("answered");
    let users = h.user_texts(&sid);
    assert_eq!(
        users.last().unwrap(),
        "Approach: End the turn\nChannels: Console, Slack\nName: Quarterly"
    );
    assert!(b.text(".ask-card").contains("answered"));
}

#[test]
fn stop_stops() {
    let Some(mut b) = Browser::open("stop_stops") else {
        return;
    };
    let reply = words(60, "z");
    let h = Harness::replying("slow", &reply, 200, &[]);
    b.open_console(&h);
    let sid = b.send_until_partial("slow please", 12);
    b.wait("the Stop button", "!document.getElementById('stop').hidden");
    b.click("#stop");
    let s = h.wait_status(&sid, &["cancelled", "completed", "failed"]);
    assert_eq!(s["status"], "cancelled", "{s}");
    b.wait(
        "the turn shown cancelled",
        "document.querySelector('.turn-status.status-cancelled')",
    );
    b.wait("Stop gone", "document.getElementById('stop').hidden");
    let first = b.element_shot("#transcript", "stopped");
    let text_then = b.js(&format!("return {LAST_REPLY}"), json!([]));
    // Observing that nothing more arrives needs time to pass; this pause synchronizes nothing.
    std::thread::sleep(Duration::from_secs(1));
    let second = b.element_shot("#transcript", "one-second-later");
    assert_eq!(b.js(&format!("return {LAST_REPLY}"), json!([])), text_then);
    assert!(first == second, "the transcript changed after the stop");
    let shown = text_then.as_str().unwrap().to_string();
    assert!(
        shown.len() < reply.len(),
        "the remaining chunks never render"
    );
    let stored_text = text_of(
        h.messages(&sid)
            .iter()
            .rev()
            .find(|e| e["message"]["role"] == "assistant")
            .unwrap(),
    );
    assert_eq!(shown, stored_text);
    // The event log records the stop as a cancelled turn. (The loop writes the aborted reply's
    // last revision a moment after `turn-completed`; what that update carries is the text already
    // shown, which the screenshots above compare.)
    let events = h.events(&sid);
    let done = events
        .iter()
        .find(|e| e["topic"] == "harness::turn-completed")
        .expect("turn-completed");
    assert_eq!(done["payload"]["status"], "cancelled");
}

#[test]
fn subagent_tree_and_child() {
    let Some(mut b) = Browser::open("subagent_tree_and_child") else {
        return;
    };
    let script = json!({"generations": [
        call_gen("delegate", "sp1", "harness::spawn", json!({"task": "child task: count to three"})),
        text_gen("child task", "one two three", 0),
        once_text("delegate", "delegated"),
    ]});
    let h = Harness::start(&script, &[], &[]);
    b.open_console(&h);
    b.type_into("#allow", "harness::spawn");
    b.send("delegate this");
    let sid = b.session_id();
    let child = b
        .wait(
            "the spawn's child link",
            "(document.querySelector('[data-child]') || {dataset: {}}).dataset.child",
        )
        .as_str()
        .unwrap()
        .to_string();
    h.wait_status(&child, &["completed"]);
    b.click("#tree-open");
    b.wait(
        "the child in the tree",
        &format!("document.querySelector('[data-tree-session=\"{child}\"]')"),
    );
    let row = b.text(&format!("[data-tree-session=\"{child}\"]"));
    assert!(row.contains("depth 1"), "{row}");
    b.wait(
        "the child's status",
        &format!("document.querySelector('[data-tree-session=\"{child}\"] .tree-meta').textContent.includes('completed')"),
    );
    b.shot("tree");
    b.click(&format!("[data-tree-session=\"{child}\"] > button"));
    b.wait(
        "the child's transcript",
        &format!("{LAST_REPLY} === 'one two three'"),
    );
    assert!(!b.text("#breadcrumb").is_empty());
    assert_eq!(
        b.js(
            "return document.getElementById('composer').hidden && !document.getElementById('read-only-note').hidden",
            json!([])
        ),
        json!(true),
        "a child's transcript is read-only"
    );
    b.shot("child");
    b.click("#breadcrumb button.crumb");
    b.wait(
        "back on the parent",
        &format!("decodeURIComponent(location.hash) === '#session={sid}' && document.querySelector('[data-child]')"),
    );
    assert_eq!(
        b.js(
            "return document.getElementById('breadcrumb').hidden",
            json!([])
        ),
        json!(true)
    );
    assert_eq!(
        b.js(
            "return document.getElementById('composer').hidden",
            json!([])
        ),
        json!(false),
        "the parent's composer is back"
    );
    b.shot("parent-again");
    // The parent's waterfall nests the child's own turn under the spawn.
    b.click(".turn-head button");
    b.wait(
        "the waterfall",
        "document.querySelector('.wf-row[data-kind=\"invoke_agent\"]')",
    );
    b.click(".wf-expand");
    b.wait(
        "the child's turn nested",
        "document.querySelectorAll('.wf-row[data-kind=\"turn\"]').length === 2",
    );
    let labels = b.js(
        "return [...document.querySelectorAll('.wf-row[data-kind=\"turn\"] .wf-label')].map(l => l.textContent);",
        json!([]),
    );
    assert!(
        labels[1].as_str().unwrap().contains("sub-agent turn"),
        "{labels}"
    );
    b.shot("nested-waterfall");
}

#[test]
fn waterfall_matches_events() {
    let Some(mut b) = Browser::open("waterfall_matches_events") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let script = json!({"generations": [
        {"match": {"last_user_text": "trace"}, "chunk_delay_ms": 30, "content": [
            {"type": "text", "text": "calling two functions now"},
            {"type": "function_call", "id": "f1", "function_id": "fixture::ok", "arguments": {}},
            {"type": "function_call", "id": "f2", "function_id": "fixture::fail", "arguments": {}}]},
        {"match": {"last_user_text": "trace"}, "chunk_delay_ms": 30, "content": [{"type": "text", "text": "done with both"}]},
    ]});
    let (h, _) = with_fixtures(&script, dir.path(), false);
    b.open_console(&h);
    b.type_into("#allow", "fixture::*");
    b.send("trace it");
    let sid = b.session_id();
    let st = h.wait_status(&sid, &["completed"]);
    let turn = st["turn_id"].as_str().unwrap().to_string();
    b.wait(
        "the final reply",
        &format!("{LAST_REPLY} === 'done with both'"),
    );
    b.click(".turn-head button");
    b.wait("the waterfall", "document.querySelector('.waterfall')");
    b.shot("waterfall");
    // The expected durations, from the event log's at_ms alone.
    let events = h.events(&sid);
    let msgs = h.messages(&sid);
    let at = |topic: &str, entry: &str, last: bool| -> i64 {
        let mut it = events.iter().filter(|e| {
            e["payload"]["entry_id"] == entry && e["topic"].as_str().unwrap().starts_with(topic)
        });
        let v = if last { it.next_back() } else { it.next() };
        v.unwrap_or_else(|| panic!("{topic} of {entry}"))["at_ms"]
            .as_i64()
            .unwrap()
    };
    let assistants: Vec<&Value> = msgs
        .iter()
        .filter(|e| e["message"]["role"] == "assistant" && e["origin"]["turn_id"] == json!(turn))
        .collect();
    let mut want_gens = Vec::new();
    let mut gen_end = Vec::new();
    for a in &assistants {
        let id = a["entry_id"].as_str().unwrap();
        let start = at("session::message-added", id, false);
        let end = at("session::message-", id, true);
        want_gens.push(end - start);
        gen_end.push(end);
    }
    let mut want_calls = Vec::new();
    for call in ["f1", "f2"] {
        let r = msgs
            .iter()
            .find(|e| e["message"]["function_call_id"] == call)
            .unwrap();
        let added = at(
            "session::message-added",
            r["entry_id"].as_str().unwrap(),
            false,
        );
        want_calls.push(added - gen_end[0]);
    }
    let rows = b.js(
        "return [...document.querySelectorAll('.wf-row')].map(r => [r.dataset.kind, Number(r.dataset.duration), !!r.dataset.error, r.querySelector('.wf-label').textContent]);",
        json!([]),
    );
    let rows = rows.as_array().unwrap().clone();
    let of = |kind: &str| -> Vec<Value> { rows.iter().filter(|r| r[0] == kind).cloned().collect() };
    let gens = of("chat");
    assert_eq!(
        gens.len(),
        assistants.len(),
        "one bar per generation: {rows:?}"
    );
    for (g, want) in gens.iter().zip(&want_gens) {
        assert!((g[1].as_i64().unwrap() - want).abs() <= 1, "{g} vs {want}");
    }
    let calls = of("execute_tool");
    assert_eq!(calls.len(), 2, "one bar per call: {rows:?}");
    for (c, want) in calls.iter().zip(&want_calls) {
        assert!((c[1].as_i64().unwrap() - want).abs() <= 1, "{c} vs {want}");
    }
    assert_eq!(calls[0][2], json!(false), "fixture::ok is not an error");
    assert_eq!(calls[1][2], json!(true), "fixture::fail is red");
    b.click("#wf-errors-only");
    let visible = b.js(
        "return [...document.querySelectorAll('.wf-row')].filter(r => r.offsetParent !== null).map(r => r.dataset.kind);",
        json!([]),
    );
    assert_eq!(visible, json!(["execute_tool"]), "errors only");
    b.shot("errors-only");
}

#[test]
fn system_prompt_preview() {
    let Some(mut b) = Browser::open("system_prompt_preview") else {
        return;
    };
    let h = Harness::saying_hi(&[]);
    b.open_console(&h);
    // On a new chat the drawer previews what a session would start with.
    b.click("#prompt-open");
    b.wait(
        "the drawer",
        "document.querySelector('#drawer:not([hidden]) .layer')",
    );
    let preview = h.ok(
        "harness::system-prompt::get",
        json!({"selected_prompt": {}}),
    );
    let shown = b.js(
        "return [...document.querySelectorAll('#drawer .layer h3')].map(h => h.textContent);",
        json!([]),
    );
    let want: Vec<Value> = preview["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["label"].clone())
        .collect();
    assert_eq!(shown, json!(want));
    b.shot("new-chat-drawer");
    b.click("#drawer-close");
    b.send("hello");
    let sid = b.session_id();
    h.wait_status(&sid, &["completed"]);
    b.click("#prompt-open");
    b.wait(
        "the drawer",
        "document.querySelector('#drawer:not([hidden]) .layer')",
    );
    b.shot("drawer");
    let want = h.ok("harness::system-prompt::get", json!({ "session_id": sid }));
    let want: Vec<Value> = want["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["label"].clone())
        .collect();
    let shown = b.js(
        "return [...document.querySelectorAll('#drawer .layer h3')].map(h => h.textContent);",
        json!([]),
    );
    assert_eq!(shown, json!(want));
    assert!(b.text("#drawer").contains("sha256:"), "the surface digest");
    b.press("\u{E00C}"); // Escape closes the drawer
    b.wait(
        "the drawer closed",
        "document.getElementById('drawer').hidden",
    );
}

#[test]
fn costs_shown() {
    let Some(mut b) = Browser::open("costs_shown") else {
        return;
    };
    let script = json!({"generations": [
        {"match": {"last_user_text": "price"}, "repeat": true, "content": [{"type": "text", "text": "that costs"}],
         "usage": {"input": 1200, "output": 340, "cache_read": 50, "cost_usd": 0.0123}}
    ]});
    let h = Harness::start(&script, &[], &[]);
    b.open_console(&h);
    b.send("price one");
    let sid = b.session_id();
    h.wait_status(&sid, &["completed"]);
    b.send("price two");
    poll("the second turn", || {
        let n = h
            .messages(&sid)
            .iter()
            .filter(|e| e["message"]["role"] == "assistant")
            .count();
        (n == 2).then_some(())
    });
    h.wait_status(&sid, &["completed"]);
    let msgs = h.messages(&sid);
    let usages: Vec<Value> = msgs
        .iter()
        .filter(|e| e["message"]["role"] == "assistant")
        .map(|e| e["message"]["usage"].clone())
        .collect();
    b.wait(
        "two usage lines",
        "document.querySelectorAll('#transcript .usage').length === 2",
    );
    let lines = b.js(
        "return [...document.querySelectorAll('#transcript .usage')].map(u => u.textContent);",
        json!([]),
    );
    for (line, u) in lines.as_array().unwrap().iter().zip(&usages) {
        let line = line.as_str().unwrap();
        assert!(line.contains(&format!("in {}", u["input"])), "{line} {u}");
        assert!(line.contains(&format!("out {}", u["output"])), "{line} {u}");
        assert!(
            line.contains(&format!("${:.4}", u["cost_usd"].as_f64().unwrap())),
            "{line} {u}"
        );
    }
    // Per turn, the sum of its replies (one each here).
    let turn_costs = b.js(
        "return [...document.querySelectorAll('#transcript .turn-cost')].map(t => t.textContent);",
        json!([]),
    );
    let want: Vec<String> = usages
        .iter()
        .map(|u| format!("turn ${:.4}", u["cost_usd"].as_f64().unwrap()))
        .collect();
    assert_eq!(turn_costs, json!(want));
    let metrics = h.ok("harness::metrics", json!({ "root_session_id": sid }));
    let total = metrics["totals"]["cost_usd"].as_f64().unwrap();
    b.wait(
        "the session total",
        &format!(
            "Math.abs(Number(document.getElementById('totals').dataset.cost) - {total}) < 1e-12"
        ),
    );
    assert!(b.text("#totals").contains(&format!("${total:.4}")));
    assert_eq!(
        b.text("#queued"),
        "",
        "a send that started its own turn is not queued"
    );
    b.shot("costs");
}

#[test]
fn hostile_text_is_inert() {
    let Some(mut b) = Browser::open("hostile_text_is_inert") else {
        return;
    };
    let long = "x".repeat(10_000);
    let hostile = format!(
        "<script>window.__pwned = 1</script> <img src=x onerror=\"window.__pwned = 2\"> \
         [click me](javascript:window.__pwned=3) **bold** `<b>code</b>`\n\n{long}"
    );
    let h = Harness::replying("hostile", &hostile, 0, &[]);
    b.open_console(&h);
    let before = b.js(
        "return document.querySelectorAll('img, script, iframe, a').length",
        json!([]),
    );
    b.send("hostile please");
    let sid = b.session_id();
    h.wait_status(&sid, &["completed"]);
    b.wait(
        "the hostile text shown as text",
        "document.querySelector('#transcript').textContent.includes('<script>window.__pwned = 1</script>')",
    );
    b.shot("inert");
    assert_eq!(
        b.js("return typeof window.__pwned", json!([])),
        json!("undefined")
    );
    assert_eq!(
        b.js(
            "return document.querySelectorAll('img, script, iframe, a').length",
            json!([])
        ),
        before,
        "no element injected"
    );
    assert_eq!(
        b.js("return document.querySelectorAll('#transcript img, #transcript script, #transcript a, #transcript b').length", json!([])),
        json!(0)
    );
    // The 10,000-character line wraps inside the transcript instead of widening the page.
    let widths = b.js(
        "const t = document.getElementById('transcript'); return [t.scrollWidth, t.clientWidth];",
        json!([]),
    );
    assert!(
        widths[0].as_i64().unwrap() <= widths[1].as_i64().unwrap() + 1,
        "{widths}"
    );
    assert!(b
        .text("#transcript")
        .contains("click me (javascript:window.__pwned=3)"));
}

#[test]
fn token_flow() {
    let Some(mut b) = Browser::open("token_flow") else {
        return;
    };
    let token = "console-test-token-7";
    let h = Harness::replying("hello", "streamed with a token", 50, &["--token", token]);
    b.goto(&h.url());
    b.wait(
        "the token form",
        "!document.getElementById('token-form').hidden",
    );
    assert_eq!(
        b.js(
            "return document.getElementById('token-input').type",
            json!([])
        ),
        json!("password")
    );
    assert!(
        b.text("#conn").contains("token required"),
        "{}",
        b.text("#conn")
    );
    b.shot("token-form");
    // The form: a wrong token keeps it up, the right one logs in.
    b.type_into("#token-input", "wrong");
    b.click("#token-form button");
    b.wait(
        "the form again",
        "!document.getElementById('token-form').hidden",
    );
    b.type_into("#token-input", token);
    b.click("#token-form button");
    b.wait(
        "the model picker",
        "document.querySelectorAll('#model option').length > 0",
    );
    assert_eq!(
        b.js(
            "return document.getElementById('token-form').hidden",
            json!([])
        ),
        json!(true)
    );
    // The fragment, in a tab that holds no token yet.
    b.js("sessionStorage.clear();", json!([]));
    b.goto("about:blank");
    b.goto(&format!("{}#token={token}", h.url()));
    b.wait(
        "the model picker",
        "document.querySelectorAll('#model option').length > 0",
    );
    assert!(
        !b.js("return location.href", json!([]))
            .as_str()
            .unwrap()
            .contains(token),
        "the token left the address bar"
    );
    assert_eq!(
        b.js(
            "return document.getElementById('token-form').hidden",
            json!([])
        ),
        json!(true)
    );
    b.send("hello");
    let sid = b.session_id();
    b.wait(
        "the reply over the authorized stream",
        &format!("{LAST_REPLY} === 'streamed with a token'"),
    );
    b.wait(
        "live",
        "document.getElementById('conn').dataset.state === 'live'",
    );
    h.wait_status(&sid, &["completed"]);
    b.shot("logged-in");
    assert!(!h.log().contains(token), "the token is never logged");
}

#[test]
fn keyboard_and_names() {
    let Some(mut b) = Browser::open("keyboard_and_names") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let script = json!({"generations": [
        call_gen("write", "k1", "fixture::write", json!({"path": "/tmp/k"})),
        once_text("write", "ok"),
    ]});
    let (h, _) = with_fixtures(&script, dir.path(), true);
    b.open_console(&h);
    b.type_into("#allow", "fixture::*");
    b.send("write it");
    b.wait(
        "the approval card",
        "document.querySelector('.approval-card .approve')",
    );
    b.wait("Stop", "!document.getElementById('stop').hidden");
    // Every control has an accessible name; headings do not skip a level.
    let unnamed = b.js(
        "const name = (e) => (e.getAttribute('aria-label') || '').trim() || \
           (e.id && [...document.querySelectorAll('label')].some(l => l.htmlFor === e.id && l.textContent.trim())) || \
           (e.closest('label') && e.closest('label').textContent.trim()) || \
           (e.tagName === 'BUTTON' && e.textContent.trim()); \
         return [...document.querySelectorAll('button, input, select, textarea')].filter(e => !name(e)).map(e => e.outerHTML);",
        json!([]),
    );
    assert_eq!(unnamed, json!([]), "controls without a name");
    let imgs = b.js(
        "return [...document.querySelectorAll('img')].filter(i => !i.hasAttribute('alt')).length",
        json!([]),
    );
    assert_eq!(imgs, json!(0));
    let levels = b.js(
        "return [...document.querySelectorAll('h1,h2,h3,h4,h5,h6')].map(h => Number(h.tagName[1]));",
        json!([]),
    );
    let levels: Vec<i64> = levels
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect();
    assert_eq!(levels[0], 1);
    for w in levels.windows(2) {
        assert!(w[1] <= w[0] + 1, "heading levels {levels:?}");
    }
    assert!(b.text(".approval-card .approve").len() > 1);
    assert_eq!(
        b.js(
            "return document.querySelector('.approval-card .approve').getAttribute('aria-label')",
            json!([])
        ),
        json!("Approve fixture::write")
    );
    // Tab from the top reaches the controls in order (Send is enabled once there is text).
    b.type_into("#message", "draft");
    b.js(
        "document.activeElement && document.activeElement.blur(); window.scrollTo(0, 0);",
        json!([]),
    );
    let mut seen: Vec<String> = Vec::new();
    for _ in 0..60 {
        b.press("\u{E004}");
        let id = b.js(
            "const e = document.activeElement; return e ? (e.id || e.className || e.tagName) : '';",
            json!([]),
        );
        seen.push(id.as_str().unwrap_or("").to_string());
    }
    // One full cycle, from the first control of the page.
    let top = seen
        .iter()
        .position(|s| s == "approvals-badge" || s == "new-chat")
        .expect("the cycle reaches the top of the page");
    let seen: Vec<String> = seen[top..].to_vec();
    let pos = |name: &str| {
        seen.iter()
            .position(|s| s == name || s.split(' ').any(|c| c == name))
            .unwrap_or_else(|| panic!("Tab never reached {name}: {seen:?}"))
    };
    let (approve, deny, provider, model, message, stop, send) = (
        pos("approve"),
        pos("deny"),
        pos("provider"),
        pos("model"),
        pos("message"),
        pos("stop"),
        pos("send"),
    );
    assert!(approve < deny && deny < provider, "{seen:?}");
    assert!(
        provider < model && model < message && message < stop && stop < send,
        "{seen:?}"
    );
    b.shot("keyboard");
    // Usable at 360 px: nothing wider than the window, the composer still there.
    b.cmd("POST", "/window/rect", json!({"width": 360, "height": 800}));
    b.wait("the narrow layout", "window.innerWidth <= 360");
    let overflow = b.js(
        "return [document.documentElement.scrollWidth, window.innerWidth,                  document.getElementById('message').getBoundingClientRect().width]",
        json!([]),
    );
    assert!(
        overflow[0].as_f64().unwrap() <= overflow[1].as_f64().unwrap(),
        "horizontal overflow at 360 px: {overflow}"
    );
    assert!(overflow[2].as_f64().unwrap() > 200.0, "{overflow}");
    b.shot("narrow");
}

/// The budget: a 1,000-message session's first render within 1 s, and never all rows at once.
#[test]
fn long_session_renders_within_a_second_and_in_pages() {
    let Some(mut b) = Browser::open("long_session_renders_within_a_second_and_in_pages") else {
        return;
    };
    let h = Harness::saying_hi(&["--durability", "normal"]);
    let sid = h.ok("session::create", json!({}))["session_id"]
        .as_str()
        .unwrap()
        .to_string();
    for i in 0..1000 {
        let message = if i % 2 == 0 {
            json!({"role": "user", "content": [{"type": "text", "text": format!("question {i}")}]})
        } else {
            json!({"role": "assistant", "content": [{"type": "text", "text": format!("answer {i} with **some** `markdown`")}],
                   "model": "demo", "provider": "scripted", "stop_reason": "end",
                   "usage": {"input": 10, "output": 5, "cost_usd": 0.0}})
        };
        h.ok(
            "session::append",
            json!({"session_id": sid, "message": message}),
        );
    }
    b.goto(&format!("{}#session={sid}", h.url()));
    let ms = b
        .wait(
            "the newest entries rendered",
            "document.querySelector('#transcript article[data-seq=\"1000\"]') ? performance.now() : 0",
        )
        .as_f64()
        .unwrap();
    b.shot("rendered");
    eprintln!("first render of a 1,000-message session: {ms:.0} ms after navigation");
    assert!(ms <= 1000.0, "first render of 1,000 messages took {ms} ms");
    let count = b.js(
        "return document.querySelectorAll('#transcript article.entry').length",
        json!([]),
    );
    assert_eq!(
        count,
        json!(200),
        "only the newest 200 entries are rendered"
    );
    // Scrolling to the top loads the next page of older entries.
    b.js(
        "document.getElementById('transcript').scrollTop = 0;",
        json!([]),
    );
    b.wait(
        "the next page",
        "document.querySelectorAll('#transcript article.entry').length === 400",
    );
    assert_eq!(
        b.js(
            "return document.querySelector('#transcript article.entry').dataset.seq",
            json!([])
        ),
        json!("601")
    );
}

/// What bad input gets: an unknown `#session=`, a blank message, a body over the server's cap.
#[test]
fn bad_input_is_named_not_swallowed() {
    let Some(mut b) = Browser::open("bad_input_is_named_not_swallowed") else {
        return;
    };
    let h = Harness::saying_hi(&["--max-body-bytes", "2048"]);
    b.goto(&format!("{}#session=s_nope", h.url()));
    b.wait(
        "the unknown session named",
        "(document.querySelector('#transcript .missing') || {}).textContent",
    );
    assert!(b.text("#transcript .missing").contains("no session s_nope"));
    b.shot("unknown-session");
    b.click("#transcript .missing button");
    b.wait(
        "a new chat",
        "document.getElementById('chat-title').textContent === 'New chat'",
    );
    b.type_into("#message", "   \n  ");
    assert_eq!(
        b.js("return document.getElementById('send').disabled", json!([])),
        json!(true),
        "whitespace only: Send stays disabled"
    );
    let big = "y".repeat(3000);
    b.js(
        "const m = document.getElementById('message'); m.value = arguments[0]; \
         m.dispatchEvent(new Event('input', {bubbles: true}));",
        json!([big]),
    );
    b.click("#send");
    b.wait(
        "the 413 at the composer",
        "document.getElementById('composer-error').textContent.includes('harness/too_large')",
    );
    assert_eq!(
        b.js("return document.getElementById('message').value", json!([])),
        json!(big),
        "the text is kept"
    );
    b.shot("too-large");
    let list = h.ok("session::list", json!({}));
    assert_eq!(list["sessions"], json!([]), "nothing was sent");
}

/// An entry a model wrote through `session::append` is shown as that call's.
#[test]
fn an_entry_a_call_wrote_names_its_call() {
    let Some(mut b) = Browser::open("an_entry_a_call_wrote_names_its_call") else {
        return;
    };
    let note = json!({"role": "assistant", "content": [{"type": "text", "text": "a note to self"}],
                      "model": "m", "provider": "scripted", "stop_reason": "end"});
    let script = json!({"generations": [
        {"match": {"last_user_text": "^note"}, "content": [
            {"type": "function_call", "id": "n2", "function_id": "session::append",
             "arguments": {"session_id": "s_written", "message": note}}]},
        once_text("^note", "Noted."),
    ]});
    let h = Harness::start(&script, &[], &[]);
    h.ok("session::create", json!({"session_id": "s_written"}));
    b.goto(&format!("{}#session=s_written", h.url()));
    b.wait(
        "the model picker",
        "document.querySelectorAll('#model option').length > 0",
    );
    b.type_into("#allow", "session::append");
    b.send("note this");
    h.wait_status("s_written", &["completed"]);
    b.wait("the reply", &format!("{LAST_REPLY} === 'Noted.'"));
    let written = b.wait(
        "the written entry",
        "(() => { const e = [...document.querySelectorAll('#transcript article.written')]\
           .find(a => a.textContent.includes('a note to self')); \
           return e ? e.querySelector('.provenance').textContent : ''; })()",
    );
    assert_eq!(written, json!("✎ written by call n2 (session::append)"));
    b.shot("written");
}

/// Past `--max-streams-per-client` the page says so and retries, and goes live once a slot is
/// free.
#[test]
fn too_many_streams_is_said_and_retried() {
    let Some(mut b) = Browser::open("too_many_streams_is_said_and_retried") else {
        return;
    };
    let h = Harness::saying_hi(&["--max-streams-per-client", "1"]);
    b.open_console(&h);
    b.send("hello");
    let sid = b.session_id();
    b.wait(
        "live",
        "document.getElementById('conn').dataset.state === 'live'",
    );
    let first = b.cmd("GET", "/window", json!({}));
    let second = b.cmd("POST", "/window/new", json!({"type": "tab"}));
    b.cmd(
        "POST",
        "/window",
        json!({"handle": second["handle"].as_str().unwrap()}),
    );
    b.goto(&format!("{}#session={sid}", h.url()));
    b.wait(
        "the refusal said",
        "document.getElementById('conn').dataset.state === 'too_many'",
    );
    assert!(
        b.text("#conn").contains("retrying every 5 s"),
        "{}",
        b.text("#conn")
    );
    b.shot("too-many");
    // Close the first tab: its stream frees the slot, and the retry gets it.
    b.cmd(
        "POST",
        "/window",
        json!({"handle": first.as_str().unwrap()}),
    );
    b.cmd("DELETE", "/window", json!({}));
    b.cmd(
        "POST",
        "/window",
        json!({"handle": second["handle"].as_str().unwrap()}),
    );
    b.wait(
        "live again",
        "document.getElementById('conn').dataset.state === 'live'",
    );
    b.wait("the reply", &format!("{LAST_REPLY} === 'hi'"));
    b.shot("live");
}

/// A message sent while a turn runs is shown as queued, and is delivered to the turn.
#[test]
fn a_message_sent_mid_turn_is_queued() {
    let Some(mut b) = Browser::open("a_message_sent_mid_turn_is_queued") else {
        return;
    };
    let h = Harness::start(
        &json!({"generations": [
            text_gen("^slow", &words(30, "q"), 150),
            text_gen("steer", "steered", 0),
        ]}),
        &[],
        &[],
    );
    b.open_console(&h);
    let sid = b.send_until_partial("slow please", 5);
    b.send("steer it");
    b.wait(
        "the queued note",
        "document.getElementById('composer-error').textContent.includes('queued')",
    );
    b.wait(
        "the message listed as queued",
        "document.getElementById('queued').textContent === '◷ queued: steer it'",
    );
    b.shot("queued");
    poll("the steering message delivered", || {
        let users = h.user_texts(&sid);
        users.iter().any(|u| u == "steer it").then_some(())
    });
    b.wait("the steered reply", &format!("{LAST_REPLY} === 'steered'"));
    b.wait(
        "the queue empty once delivered",
        "document.getElementById('queued').textContent === ''",
    );
    b.shot("steered");
}

/// The session list: newest first, filtered by text, and "failed only" keeps the failed ones;
/// a failed turn shows its error.
#[test]
fn session_list_filters_and_failures() {
    let Some(mut b) = Browser::open("session_list_filters_and_failures") else {
        return;
    };
    let script = json!({"generations": [
        {"match": {"last_user_text": "^break"}, "repeat": true,
         "error": {"kind": "permanent", "message": "the model refused the request"}},
        text_gen("hello", "hi", 0),
    ]});
    let h = Harness::start(&script, &[], &[]);
    b.open_console(&h);
    b.send("hello there");
    let ok = b.session_id();
    h.wait_status(&ok, &["completed"]);
    b.click("#new-chat");
    b.send("break it");
    b.wait(
        "a second session",
        &format!("!location.hash.includes('{ok}') && location.hash.includes('session=')"),
    );
    let bad = b.session_id();
    h.wait_status(&bad, &["failed"]);
    b.wait(
        "the failed turn shown",
        "document.querySelector('.turn-status.status-failed')",
    );
    assert!(b
        .text("#transcript")
        .contains("the model refused the request"));
    let rows =
        "[...document.querySelectorAll('#session-list .session-item')].map(r => r.dataset.session)";
    b.wait(
        "both sessions listed, newest first, the failed one as error",
        &format!(
            "JSON.stringify({rows}) === JSON.stringify(['{bad}', '{ok}']) && \
                  document.querySelector('[data-session=\"{bad}\"]').textContent.includes('error')"
        ),
    );
    b.shot("both");
    b.click("#failed-only");
    assert_eq!(b.js(&format!("return {rows}"), json!([])), json!([bad]));
    b.click("#failed-only");
    b.type_into("#filter", "hello");
    assert_eq!(b.js(&format!("return {rows}"), json!([])), json!([ok]));
    b.shot("filtered");
}
