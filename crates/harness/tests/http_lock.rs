//! The locked HTTP surface, against the real binary: a public bind needs a token and every
//! request then carries it; on loopback the Host header is checked (DNS rebinding) and foreign
//! browser origins refused; bodies are capped; event streams per client are bounded; no CORS
//! header is ever sent. Exactly one Host is accepted, an absolute-form target is checked like
//! Host, a connection that never finishes its headers is closed, and connections per client
//! are capped. Traffic goes to loopback only (a 0.0.0.0 bind is reached at 127.0.0.1).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::http_head::content_length;
use common::raw_serve::RawServe;
use common::{free_port, run_cli, script, text_gen, wait_for, BIN, WAIT};
use serde_json::{json, Value};

/// Starts `serve --listen <host>:<port> <args>` with `env` (a model that answers "hi") and waits
/// for it to announce the bind.
fn serve(host: &str, args: &[&str], env: &[(&str, &str)]) -> RawServe {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let script_file = dir.path().join("script.json");
    let model = script(vec![text_gen(None, "hi", 0, true)]);
    std::fs::write(&script_file, model.to_string()).unwrap();
    let mut cmd = serve_command(host, port, &dir.path().join("data"));
    cmd.arg("--script")
        .arg(&script_file)
        .args(args)
        .envs(env.iter().copied());
    RawServe::spawn(cmd, port, dir)
}

/// `harness serve --listen <host>:<port> --data-dir <data>`, with no token from the test's
/// environment.
fn serve_command(host: &str, port: u16, data: &Path) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(["serve", "--listen", &format!("{host}:{port}"), "--data-dir"])
        .arg(data)
        .env_remove("HARNESS_TOKEN");
    cmd
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
    let port = free_port();
    let data = dir.path().join("data");
    let out = serve_command("0.0.0.0", port, &data)
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
fn connection_bounds_of_zero_refuse_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    for (flag, named) in [
        (
            "--max-connections-per-client",
            "--max-connections-per-client: must be at least 1",
        ),
        (
            "--header-read-timeout-ms",
            "--header-read-timeout-ms: must be at least 1",
        ),
    ] {
        let (code, _, stderr) = run_cli(&[
            "serve",
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
            flag,
            "0",
            "--data-dir",
            data.to_str().unwrap(),
        ]);
        assert_eq!(code, 1, "{stderr}");
        assert!(
            stderr.contains("harness/invalid_request") && stderr.contains(named),
            "{stderr}"
        );
    }
    assert!(!data.exists(), "refused before anything was opened");
}

#[test]
fn with_a_token_every_request_needs_it() {
    let s = serve("0.0.0.0", &[], &[("HARNESS_TOKEN", "tok-123")]);
    let host = format!("127.0.0.1:{}", s.port);
    for path in ["/healthz", "/v1/functions"] {
        for (authorization, want) in [
            (None, 401),
            (Some("Bearer tok-124"), 401),
            (Some("Bearer tok-123"), 200),
        ] {
            let mut headers = vec![("Host", host.as_str())];
            headers.extend(authorization.map(|a| ("Authorization", a)));
            let (status, answer) = s.raw("GET", path, &headers, "");
            assert_eq!(status, want, "{path} with {authorization:?}: {answer}");
            if want == 401 {
                assert_eq!(code(&answer), "harness/unauthorized");
                assert!(answer
                    .to_ascii_lowercase()
                    .contains("www-authenticate: bearer"));
            }
        }
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
    let s = serve("127.0.0.1", &["--token", "loop-tok"], &[]);
    let host = format!("127.0.0.1:{}", s.port);
    assert_eq!(s.raw("GET", "/healthz", &[("Host", &host)], "").0, 401);
    let auth = [
        ("Host", host.as_str()),
        ("Authorization", "Bearer loop-tok"),
    ];
    assert_eq!(s.raw("GET", "/healthz", &auth, "").0, 200);
}

/// A `harness::send` with exactly these headers is refused 403 with `want` as its code.
fn assert_send_refused(s: &RawServe, headers: &[(&str, &str)], want: &str) {
    let (status, answer) = s.raw(
        "POST",
        "/v1/functions/harness::send",
        headers,
        r#"{"message":"hi","model":"m"}"#,
    );
    assert_eq!(status, 403, "{headers:?}: {answer}");
    assert_eq!(code(&answer), want, "{headers:?}");
}

#[test]
fn a_foreign_host_or_origin_on_loopback_is_refused() {
    let s = serve("127.0.0.1", &[], &[]);
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
        assert_send_refused(
            &s,
            &[("Host", &bad), ("Content-Type", "text/plain")],
            "harness/forbidden_host",
        );
    }
    // No Host at all (HTTP/1.0 style) is not ours either.
    let (status, _) = s.raw("GET", "/healthz", &[], "");
    assert_eq!(status, 403);
    // A page of another origin that reaches us under our own name.
    let host = format!("127.0.0.1:{port}");
    assert_send_refused(
        &s,
        &[("Host", &host), ("Origin", "http://evil.example")],
        "harness/forbidden_origin",
    );
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
    let s = serve("127.0.0.1", &["--max-body-bytes", "1024"], &[]);
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
    let (status, answer) = s
        .api()
        .post_raw(
            "harness::status",
            json!({"session_id": "s_small"}).to_string(),
        )
        .await;
    assert_ne!(status, 413, "{answer}");
}

#[tokio::test]
async fn event_streams_per_client_are_bounded() {
    let s = serve("127.0.0.1", &["--max-streams-per-client", "2"], &[]);
    let sent = s.api().send(None, "hello").await;
    let client = reqwest::Client::new();
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

/// One request on an open keep-alive connection; returns (status, whole answer). Reads exactly
/// the answer (by its Content-Length), so the connection can carry the next request.
fn keep_alive(conn: &mut TcpStream, host: &str, path: &str) -> (u16, String) {
    conn.write_all(format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .unwrap();
    let mut answer = Vec::new();
    let mut byte = [0u8; 1];
    while !answer.ends_with(b"\r\n\r\n") {
        let n = conn.read(&mut byte).unwrap();
        assert_eq!(
            n,
            1,
            "closed mid-head: {}",
            String::from_utf8_lossy(&answer)
        );
        answer.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&answer).to_ascii_lowercase();
    let length = content_length(&head).unwrap_or_else(|| panic!("no content-length in {head}"));
    let mut body = vec![0u8; length];
    conn.read_exact(&mut body).unwrap();
    answer.extend(body);
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer.split(' ').nth(1).unwrap().parse().unwrap();
    (status, answer)
}

/// Whether the server closed `conn` (EOF or reset) before `deadline`; what it sent meanwhile.
fn closed_before(conn: &mut TcpStream, deadline: Instant) -> (bool, String) {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return (false, String::from_utf8_lossy(&got).into_owned());
        }
        conn.set_read_timeout(Some(left)).unwrap();
        match conn.read(&mut buf) {
            Ok(0) => return (true, String::from_utf8_lossy(&got).into_owned()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return (true, String::from_utf8_lossy(&got).into_owned())
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => panic!("read: {e}"),
        }
    }
}

#[test]
fn two_host_headers_are_refused_before_anything_else() {
    let s = serve("127.0.0.1", &["--token", "tok-2h"], &[]);
    let host = format!("127.0.0.1:{}", s.port);
    // Both ours, no token: the duplicate is named first, before the token is even looked at.
    for second in [host.clone(), "evil.example".to_string()] {
        let (status, answer) = s.raw("GET", "/healthz", &[("Host", &host), ("Host", &second)], "");
        assert_eq!(status, 400, "{answer}");
        assert_eq!(code(&answer), "harness/invalid_request");
        assert!(answer.contains("Host: sent 2 times"), "{answer}");
    }
    let auth = [("Host", host.as_str()), ("Authorization", "Bearer tok-2h")];
    assert_eq!(s.raw("GET", "/healthz", &auth, "").0, 200);
}

#[test]
fn an_absolute_form_target_is_checked_like_host() {
    let s = serve("127.0.0.1", &[], &[]);
    let port = s.port;
    let host = format!("127.0.0.1:{port}");
    let foreign = (403, "harness/forbidden_host");
    for (target, (want, want_code)) in [
        // Another host in the target, ours in Host.
        ("http://evil.example/healthz".to_string(), foreign),
        (format!("http://evil.example:{port}/v1/functions"), foreign),
        (
            format!("http://127.0.0.1:{}/healthz", port.wrapping_add(1)),
            foreign,
        ),
        (format!("http://user@127.0.0.1:{port}/healthz"), foreign),
        // Ours in both, but not the same name: they must agree.
        (
            format!("http://localhost:{port}/healthz"),
            (400, "harness/invalid_request"),
        ),
    ] {
        let (status, answer) = s.raw("GET", &target, &[("Host", &host)], "");
        assert_eq!(status, want, "{target}: {answer}");
        assert_eq!(code(&answer), want_code, "{target}");
        assert!(answer.contains("request target"), "{answer}");
    }
    // Agreeing with Host: served like the origin form.
    for path in ["/healthz", "/v1/functions"] {
        let (status, answer) = s.raw(
            "GET",
            &format!("http://{host}{path}"),
            &[("Host", &host)],
            "",
        );
        assert_eq!(status, 200, "{path}: {answer}");
    }
    let (status, answer) = s.raw(
        "POST",
        &format!("http://LOCALHOST:{port}/v1/functions/nowhere::at_all"),
        &[("Host", &format!("localhost:{port}"))],
        "{}",
    );
    assert_eq!(status, 404, "reached the bus: {answer}");
    assert_eq!(code(&answer), "harness/function_not_found");
}

#[test]
fn a_connection_that_never_finishes_its_headers_is_closed() {
    let s = serve("127.0.0.1", &["--header-read-timeout-ms", "700"], &[]);
    let host = format!("127.0.0.1:{}", s.port);
    let mut slow = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    let opened = Instant::now();
    slow.write_all(format!("GET /healthz HTTP/1.1\r\nHost: {host}\r\nX-Slow: ").as_bytes())
        .unwrap();
    // Meanwhile the server answers everyone else.
    assert_eq!(s.raw("GET", "/healthz", &[("Host", &host)], "").0, 200);
    let (closed, sent) = closed_before(&mut slow, opened + Duration::from_secs(20));
    assert!(closed, "still open after 20 s");
    let after = opened.elapsed();
    assert!(
        after >= Duration::from_millis(600),
        "closed after {after:?}, before the timeout"
    );
    assert!(
        !sent.contains(" 200 "),
        "answered a request it never got: {sent}"
    );
    // A client that sends its whole head in time is served on a fresh connection.
    assert_eq!(s.raw("GET", "/healthz", &[("Host", &host)], "").0, 200);
    // A keep-alive connection left idle is waiting for a head too.
    let mut idle = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    idle.set_read_timeout(Some(WAIT)).unwrap();
    assert_eq!(keep_alive(&mut idle, &host, "/healthz").0, 200);
    let served = Instant::now();
    let (closed, _) = closed_before(&mut idle, served + Duration::from_secs(20));
    assert!(closed, "an idle keep-alive connection stayed open");
    assert!(served.elapsed() >= Duration::from_millis(600));
}

#[test]
fn connections_per_client_are_capped() {
    let s = serve(
        "127.0.0.1",
        &[
            "--max-connections-per-client",
            "3",
            "--header-read-timeout-ms",
            "60000",
        ],
        &[],
    );
    let host = format!("127.0.0.1:{}", s.port);
    let connect = || {
        let c = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
        c.set_read_timeout(Some(WAIT)).unwrap();
        c
    };
    // Three open connections, each served (so each holds its slot).
    let mut open: Vec<TcpStream> = (0..3).map(|_| connect()).collect();
    for c in &mut open {
        assert_eq!(keep_alive(c, &host, "/healthz").0, 200);
    }
    // The fourth is answered 429 at once and closed.
    let mut extra = connect();
    let (closed, answer) = closed_before(&mut extra, Instant::now() + Duration::from_secs(10));
    assert!(closed, "the extra connection stayed open: {answer}");
    assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
    assert_eq!(code(&answer), "harness/too_many_connections");
    // The three are still served.
    for c in &mut open {
        assert_eq!(keep_alive(c, &host, "/v1/functions").0, 200);
    }
    // A freed slot can be used again (once the server has seen the close).
    drop(open.pop());
    let deadline = Instant::now() + WAIT;
    loop {
        let mut c = connect();
        c.write_all(format!("GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
            .unwrap();
        let mut first = [0u8; 12];
        c.read_exact(&mut first).unwrap();
        if &first == b"HTTP/1.1 200" {
            break;
        }
        assert_eq!(&first, b"HTTP/1.1 429", "unexpected answer");
        assert!(Instant::now() < deadline, "the freed slot never came back");
    }
}

#[test]
fn sigterm_stops_the_server_even_with_an_event_stream_open() {
    let mut s = serve("127.0.0.1", &[], &[]);
    let host = format!("127.0.0.1:{}", s.port);
    let (status, answer) = s.raw(
        "POST",
        "/v1/functions/harness::send",
        &[("Host", &host)],
        r#"{"message":"hello","model":"m","provider":"scripted"}"#,
    );
    assert_eq!(status, 200, "{answer}");
    let body = answer.split("\r\n\r\n").nth(1).unwrap();
    let sid = serde_json::from_str::<Value>(body).unwrap()["session_id"]
        .as_str()
        .unwrap()
        .to_string();
    // An event stream never ends by itself: shutdown must not wait for it forever.
    let mut stream = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    stream
        .write_all(
            format!("GET /v1/sessions/{sid}/events HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes(),
        )
        .unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let mut first = [0u8; 12];
    stream.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = s.child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "serve did not stop: {}", s.log());
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}: {}", s.log());
    assert!(s.log().contains("harness stopped"), "{}", s.log());
    // The stream was closed, not left hanging.
    let (closed, _) = closed_before(&mut stream, Instant::now() + Duration::from_secs(10));
    assert!(closed);
}
