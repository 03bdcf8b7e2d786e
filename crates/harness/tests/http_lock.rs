//! The locked HTTP surface, against the real binary: a public bind needs a token and every
//! request then carries it; on loopback the Host header is checked (DNS rebinding) and foreign
//! browser origins refused; bodies are capped; event streams per client are bounded; no CORS
//! header is ever sent. Traffic goes to loopback only (a 0.0.0.0 bind is reached at 127.0.0.1).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, run_cli, script, text_gen, wait_for, BIN, WAIT};
use serde_json::{json, Value};

/// A `harness serve` child (demo script) on a temp data dir; killed on drop.
struct Serve {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl Serve {
    /// Starts `serve --listen <host>:<port> <args>` with `env` (a model that answers "hi") and
    /// waits for it to announce the bind.
    fn start(host: &str, args: &[&str], env: &[(&str, &str)]) -> Serve {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let script_file = dir.path().join("script.json");
        let model = script(vec![text_gen(None, "hi", 0, true)]);
        std::fs::write(&script_file, model.to_string()).unwrap();
        let log = std::fs::File::create(dir.path().join("log")).unwrap();
        let child = Command::new(BIN)
            .args(["serve", "--listen", &format!("{host}:{port}"), "--data-dir"])
            .arg(dir.path().join("data"))
            .arg("--script")
            .arg(&script_file)
            .args(args)
            .env_remove("HARNESS_TOKEN")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        let mut s = Serve { child, port, dir };
        let deadline = Instant::now() + WAIT;
        while !s.log().contains("harness serving on") {
            if let Some(status) = s.child.try_wait().unwrap() {
                panic!("serve exited with {status}: {}", s.log());
            }
            assert!(
                Instant::now() < deadline,
                "serve did not start: {}",
                s.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// One raw HTTP/1.1 request with exactly these headers; returns (status, body).
    fn raw(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
        let mut conn = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        conn.set_read_timeout(Some(WAIT)).unwrap();
        let mut req = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
        conn.write_all(req.as_bytes()).unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer).unwrap();
        let status = answer
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no status line in {answer:?}"));
        (status, answer)
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `error.code` of a JSON error answer.
fn code(answer: &str) -> String {
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or("");
    let v: Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {answer}"));
    v["error"]["code"].as_str().unwrap_or("").to_string()
}

#[test]
fn a_public_bind_without_a_token_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let data = dir.path().join("data");
    let out = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            &format!("0.0.0.0:{port}"),
            "--data-dir",
        ])
        .arg(&data)
        .env_remove("HARNESS_TOKEN")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("harness/unauthorized") && stderr.contains("--token"),
        "{stderr}"
    );
    // Refused before anything was opened.
    assert!(!data.exists());
    let (code, _, stderr) = run_cli(&[
        "serve",
        "--listen",
        &format!("0.0.0.0:{port}"),
        "--token",
        " ",
        "--data-dir",
        data.to_str().unwrap(),
    ]);
    assert_eq!(code, 1);
    assert!(stderr.contains("--token: must not be empty"), "{stderr}");
}

#[test]
fn with_a_token_every_request_needs_it() {
    let s = Serve::start("0.0.0.0", &[], &[("HARNESS_TOKEN", "tok-123")]);
    let host = format!("127.0.0.1:{}", s.port);
    for path in ["/healthz", "/v1/functions"] {
        let (status, answer) = s.raw("GET", path, &[("Host", &host)], "");
        assert_eq!(status, 401, "{answer}");
        assert_eq!(code(&answer), "harness/unauthorized");
        assert!(answer
            .to_ascii_lowercase()
            .contains("www-authenticate: bearer"));
        let (status, answer) = s.raw(
            "GET",
            path,
            &[("Host", &host), ("Authorization", "Bearer tok-124")],
            "",
        );
        assert_eq!(status, 401, "{answer}");
        let (status, answer) = s.raw(
            "GET",
            path,
            &[("Host", &host), ("Authorization", "Bearer tok-123")],
            "",
        );
        assert_eq!(status, 200, "{answer}");
    }
    // Off loopback the token is the lock: any Host is served when it is presented.
    let (status, _) = s.raw(
        "GET",
        "/healthz",
        &[
            ("Host", "harness.example:80"),
            ("Authorization", "Bearer tok-123"),
        ],
        "",
    );
    assert_eq!(status, 200);
    // The clients pass it, from the flag or the environment.
    let (rc, out, err) = run_cli(&[
        "call",
        "--url",
        &s.url(),
        "--token",
        "tok-123",
        "approval::list",
        "{}",
    ]);
    assert_eq!(rc, 0, "{err}");
    assert!(
        out.contains("approvals") || out.trim_start().starts_with('{'),
        "{out}"
    );
    let (rc, _, err) = run_cli(&["call", "--url", &s.url(), "approval::list", "{}"]);
    assert_eq!(rc, 1);
    assert!(err.contains("harness/unauthorized"), "{err}");
    let out = Command::new(BIN)
        .args(["chat", "--url", &s.url(), "-m", "hello"])
        .env("HARNESS_TOKEN", "tok-123")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "chat --url with HARNESS_TOKEN failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_token_is_also_required_on_loopback() {
    let s = Serve::start("127.0.0.1", &["--token", "loop-tok"], &[]);
    let host = format!("127.0.0.1:{}", s.port);
    assert_eq!(s.raw("GET", "/healthz", &[("Host", &host)], "").0, 401);
    let auth = [
        ("Host", host.as_str()),
        ("Authorization", "Bearer loop-tok"),
    ];
    assert_eq!(s.raw("GET", "/healthz", &auth, "").0, 200);
}

#[test]
fn a_foreign_host_or_origin_on_loopback_is_refused() {
    let s = Serve::start("127.0.0.1", &[], &[]);
    let port = s.port;
    for ok in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        format!("LOCALHOST:{port}"),
        format!("[::1]:{port}"),
    ] {
        let (status, answer) = s.raw("GET", "/healthz", &[("Host", &ok)], "");
        assert_eq!(status, 200, "Host {ok}: {answer}");
    }
    for bad in [
        format!("rebind.example:{port}"),
        "127.0.0.1".to_string(),
        format!("127.0.0.1:{}", port.wrapping_add(1)),
        format!("localhost.evil:{port}"),
    ] {
        let (status, answer) = s.raw(
            "POST",
            "/v1/functions/harness::send",
            &[("Host", &bad), ("Content-Type", "text/plain")],
            r#"{"message":"hi","model":"m"}"#,
        );
        assert_eq!(status, 403, "Host {bad}: {answer}");
        assert_eq!(code(&answer), "harness/forbidden_host");
    }
    // No Host at all (HTTP/1.0 style) is not ours either.
    let (status, _) = s.raw("GET", "/healthz", &[], "");
    assert_eq!(status, 403);
    // A page of another origin that reaches us under our own name.
    let host = format!("127.0.0.1:{port}");
    let (status, answer) = s.raw(
        "POST",
        "/v1/functions/harness::send",
        &[("Host", &host), ("Origin", "http://evil.example")],
        r#"{"message":"hi","model":"m"}"#,
    );
    assert_eq!(status, 403, "{answer}");
    assert_eq!(code(&answer), "harness/forbidden_origin");
    let same = format!("http://{host}");
    assert_eq!(
        s.raw("GET", "/healthz", &[("Host", &host), ("Origin", &same)], "")
            .0,
        200
    );
    // CORS stays closed: a preflight gets no allow headers, nor does any answer.
    let (status, answer) = s.raw(
        "OPTIONS",
        "/v1/functions/harness::send",
        &[("Host", &host), ("Access-Control-Request-Method", "POST")],
        "",
    );
    assert_eq!(status, 405, "{answer}");
    assert_eq!(code(&answer), "harness/method_not_allowed");
    for (_, answer) in [
        s.raw("OPTIONS", "/v1/functions/x", &[("Host", &host)], ""),
        s.raw("GET", "/healthz", &[("Host", &host)], ""),
        s.raw("GET", "/nowhere", &[("Host", &host)], ""),
    ] {
        assert!(
            !answer.to_ascii_lowercase().contains("access-control-"),
            "{answer}"
        );
    }
}

#[tokio::test]
async fn oversized_bodies_are_refused_with_413() {
    let s = Serve::start("127.0.0.1", &["--max-body-bytes", "1024"], &[]);
    let big = json!({"session_id": "x".repeat(2000)}).to_string();
    let client = reqwest::Client::new();
    // Declared length.
    let resp = client
        .post(format!("{}/v1/functions/harness::status", s.url()))
        .body(big.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 413);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "harness/too_large");
    // Chunked: no length to check up front; the body itself is cut off. Sent over a raw socket:
    // the server answers and closes as soon as the cap is crossed, and a client still writing
    // the rest would see a reset instead of the answer waiting in its receive buffer.
    let mut conn = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    conn.set_read_timeout(Some(WAIT)).unwrap();
    let head = format!("POST /v1/functions/harness::status HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n", s.port);
    conn.write_all(head.as_bytes()).unwrap();
    for c in big.as_bytes().chunks(100) {
        let chunk = format!("{:x}\r\n{}\r\n", c.len(), String::from_utf8_lossy(c));
        if conn.write_all(chunk.as_bytes()).is_err() {
            break; // the server already answered and closed
        }
    }
    let _ = conn.write_all(b"0\r\n\r\n");
    let mut answer = Vec::new();
    let _ = conn.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("harness/too_large"), "{answer}");
    // Under the cap, the same call is answered normally.
    let resp = client
        .post(format!("{}/v1/functions/harness::status", s.url()))
        .body(json!({"session_id": "s_small"}).to_string())
        .send()
        .await
        .unwrap();
    assert_ne!(resp.status(), 413);
}

#[tokio::test]
async fn event_streams_per_client_are_bounded() {
    let s = Serve::start("127.0.0.1", &["--max-streams-per-client", "2"], &[]);
    let client = reqwest::Client::new();
    let sent: Value = client
        .post(format!("{}/v1/functions/harness::send", s.url()))
        .body(json!({"message": "hello", "model": "m", "provider": "scripted"}).to_string())
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let sid = sent["session_id"].as_str().expect("session_id").to_string();
    let events = format!("{}/v1/sessions/{sid}/events", s.url());
    let first = client.get(&events).send().await.unwrap();
    let second = client.get(&events).send().await.unwrap();
    assert_eq!(
        (first.status().as_u16(), second.status().as_u16()),
        (200, 200)
    );
    let third = client.get(&events).send().await.unwrap();
    assert_eq!(third.status(), 429);
    let body: Value = third.json().await.unwrap();
    assert_eq!(body["error"]["code"], "harness/too_many_streams");
    // Closing one frees its slot (the server notices the disconnect).
    drop(first);
    let reopened = wait_for("a freed stream slot", WAIT, || {
        let client = client.clone();
        let events = events.clone();
        async move {
            let r = client.get(&events).send().await.ok()?;
            (r.status() == 200).then_some(r)
        }
    })
    .await;
    drop((second, reopened));
}
