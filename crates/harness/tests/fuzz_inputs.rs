//! Bounded property tests of untrusted inputs (fixed seed and case counts: a CI run, not a
//! fuzzing campaign). Thrown at:
//! - every registered function through `POST /v1/functions/{id}` of a real server: arbitrary
//!   JSON, objects built from the function's own schema keys with arbitrary values, and bodies
//!   that are not JSON at all;
//! - the dispatch policy's globs and argument reconciliation, which are private to
//!   `harness-core`: reached through the turn, by sends with arbitrary allow/deny globs whose
//!   scripted model calls a schema'd function with arbitrary arguments;
//! - the provider SSE parser (`harness_router::sse`), with arbitrary bytes cut at arbitrary
//!   points.
//!
//! Every answer must be JSON with a `harness/<code>` error or a result, and never a 500 (a
//! documented 503/504 only with its code); the server must not die; afterwards SQLite's
//! `PRAGMA integrity_check` passes and every session still reads.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::raw_serve::RawServe;
use common::{free_port, script, BIN, WAIT};
use harness_router::sse::SseParser;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use serde_json::{json, Map, Value};

/// Cases per function; with ~38 functions, three shapes and the turns, a run takes about ten
/// seconds on a debug build.
const CASES_PER_FUNCTION: u32 = 64;
const TURN_CASES: usize = 64;

static TRIED: AtomicUsize = AtomicUsize::new(0);

fn runner(cases: u32) -> TestRunner {
    let config = Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 256,
        ..Config::default()
    };
    TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha))
}

fn string() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        Just(String::new()),
        Just("*".to_string()),
        Just("harness::*".to_string()),
        Just("{a,b".to_string()),
        Just("[!".to_string()),
        Just("../../etc/passwd".to_string()),
        Just("s_00000000000000000000000000".to_string()),
        Just("\u{0}\u{feff}\u{202e}".to_string()),
        Just("x".repeat(5000)),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("JSON numbers are finite", |f| f.is_finite())
            .prop_map(Value::from),
        string().prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((string(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// Objects with the function's own keys (so parsing gets past the first field) and arbitrary
/// values, sometimes with one extra key.
fn schema_object(keys: Vec<String>, session: String) -> impl Strategy<Value = Value> {
    let value = prop_oneof![
        3 => json_value(),
        1 => Just(Value::String(session)),
    ];
    (
        prop::collection::vec((prop::sample::select(keys), value), 0..6),
        prop::option::of((string(), json_value())),
    )
        .prop_map(|(kv, extra)| {
            let mut m: Map<String, Value> = kv.into_iter().collect();
            if let Some((k, v)) = extra {
                m.insert(k, v);
            }
            Value::Object(m)
        })
}

/// Bytes that are not one JSON document.
fn malformed_body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..256),
        json_value().prop_flat_map(|v| {
            let text = v.to_string().into_bytes();
            let len = text.len();
            (Just(text), 0..len.max(1)).prop_map(|(t, cut)| t[..cut.min(t.len())].to_vec())
        }),
        (1usize..20_000).prop_map(|depth| {
            let mut b = vec![b'['; depth];
            b.extend(std::iter::repeat_n(b']', depth));
            b
        }),
        Just(b"{\"a\": 1} trailing".to_vec()),
        Just(b"\xEF\xBB\xBF{}".to_vec()),
    ]
}

/// A `harness serve` child with a scrubbed environment (no provider keys: no traffic leaves
/// loopback).
fn serve(model: &Value, fixtures: &Value) -> RawServe {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("script.json"), model.to_string()).unwrap();
    std::fs::write(dir.path().join("fixtures.json"), fixtures.to_string()).unwrap();
    let port = free_port();
    let mut cmd = Command::new(BIN);
    cmd.args([
        "serve",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--data-dir",
    ])
    .arg(dir.path().join("data"))
    .arg("--script")
    .arg(dir.path().join("script.json"))
    .arg("--fixtures")
    .arg(dir.path().join("fixtures.json"))
    .args(["--durability", "normal"])
    .env_clear();
    RawServe::spawn(cmd, port, dir)
}

/// Calls of functions as raw bytes, each answer parsed.
trait Calls {
    /// POST raw bytes to a function; (status, parsed JSON body).
    fn post(&self, function_id: &str, body: &[u8]) -> (u16, Value);

    fn call(&self, function_id: &str, payload: &Value) -> (u16, Value) {
        self.post(function_id, payload.to_string().as_bytes())
    }
}

impl Calls for RawServe {
    fn post(&self, function_id: &str, body: &[u8]) -> (u16, Value) {
        TRIED.fetch_add(1, Ordering::Relaxed);
        let host = format!("127.0.0.1:{}", self.port);
        let headers = [
            ("Host", host.as_str()),
            ("Content-Type", "application/json"),
        ];
        let (status, answer) = self.raw(
            "POST",
            &format!("/v1/functions/{function_id}"),
            &headers,
            body,
        );
        let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
        // Every answer here has a length; a chunked one would need de-chunking.
        assert!(
            !head
                .to_ascii_lowercase()
                .contains("transfer-encoding: chunked"),
            "{head}"
        );
        let value = serde_json::from_str(body)
            .unwrap_or_else(|e| panic!("{function_id}: answer is not JSON ({e}): {answer}"));
        (status, value)
    }
}

/// A documented answer: a result, or a JSON error whose code matches its status.
fn check_answer(
    function_id: &str,
    input: &str,
    status: u16,
    body: &Value,
) -> Result<(), TestCaseError> {
    if status == 200 {
        return Ok(());
    }
    let code = body["error"]["code"].as_str().unwrap_or("");
    prop_assert!(
        code.starts_with("harness/") && body["error"]["message"].is_string(),
        "{function_id} {input}: {status} without a harness error: {body}"
    );
    let documented = match status {
        400 | 404 | 413 => true,
        503 => code == "harness/dependency",
        504 => code == "harness/timeout",
        _ => false,
    };
    prop_assert!(
        documented,
        "{function_id} {input}: undocumented {status}: {body}"
    );
    Ok(())
}

fn truncate(s: &str) -> String {
    s.chars().take(300).collect()
}

#[test]
fn random_and_malformed_inputs_break_nothing() {
    // The turn half: a model that calls `fixture::typed` with arbitrary arguments.
    let mut gen = runner(1);
    let mut turn_args = Vec::new();
    for i in 0..TURN_CASES {
        let v = json_value().new_tree(&mut gen).unwrap().current();
        // Also the shapes reconciliation repairs: stringified JSON where the schema wants
        // structure, and near-miss objects.
        turn_args.push(match i % 4 {
            0 => v,
            1 => Value::String(json!({"n": i, "tags": ["a"], "nested": v}).to_string()),
            2 => json!({"n": i.to_string(), "mode": "a", "tags": "[\"x\"]"}),
            _ => json!({"n": i.to_string(), "mode": v, "tags": json!(["x", v]).to_string(),
                        "nested": json!({"flag": "true"}).to_string()}),
        });
    }
    let mut generations: Vec<Value> = turn_args
        .iter()
        .enumerate()
        .map(|(i, args)| {
            json!({"match": {"last_user_text": format!("case-{i}")}, "repeat": true,
                   "content": [{"type": "function_call", "id": "c_{request_id}", "function_id": "fixture::typed", "arguments": args}]})
        })
        .collect();
    generations.push(json!({"repeat": true, "content": [{"type": "text", "text": "done"}]}));
    let fixtures = json!({"functions": [{
        "id": "fixture::typed",
        "request_schema": {"type": "object", "required": ["n"], "additionalProperties": false, "properties": {
            "n": {"type": "integer"},
            "mode": {"type": "string", "enum": ["a", "b"]},
            "tags": {"type": "array", "items": {"type": "string"}},
            "nested": {"type": "object", "properties": {"flag": {"type": "boolean"}}}
        }},
        "response": {"ok": true}
    }]});
    let mut server = serve(&script(generations), &fixtures);

    // A real session, so arbitrary payloads also reach existing state.
    let (status, sent) = server.call(
        "harness::send",
        &json!({"message": "hello", "model": "m", "provider": "scripted"}),
    );
    assert_eq!(status, 200, "{sent}");
    let session = sent["session_id"].as_str().unwrap().to_string();

    TRIED.fetch_add(1, Ordering::Relaxed);
    let catalog = get_json(server.port, "/v1/functions");
    let defs = catalog["functions"].as_array().cloned().unwrap_or_default();
    assert!(
        defs.len() >= 30,
        "expected the whole catalog, got {}",
        defs.len()
    );

    for def in &defs {
        let id = def["function_id"].as_str().unwrap().to_string();
        let keys: Vec<String> = def["request_schema"]["properties"]
            .as_object()
            .map(|p| p.keys().cloned().collect())
            .unwrap_or_default();
        let shape = if keys.is_empty() {
            json_value().boxed()
        } else {
            prop_oneof![json_value(), schema_object(keys, session.clone())].boxed()
        };
        let result = runner(CASES_PER_FUNCTION).run(&shape, |payload| {
            let (status, body) = server.call(&id, &payload);
            check_answer(&id, &truncate(&payload.to_string()), status, &body)
        });
        if let Err(e) = result {
            panic!("{id}: {e}\nlog tail:\n{}", tail(&server.log()));
        }
        let result = runner(CASES_PER_FUNCTION / 3).run(&malformed_body(), |bytes| {
            let (status, body) = server.post(&id, &bytes);
            // An empty body is `{}` and a few random bytes are a JSON document after all.
            let is_json = bytes.iter().all(u8::is_ascii_whitespace)
                || serde_json::from_slice::<Value>(&bytes).is_ok();
            if is_json {
                return check_answer(&id, &String::from_utf8_lossy(&bytes), status, &body);
            }
            prop_assert_eq!(
                status,
                400,
                "{}: malformed body answered {}: {}",
                id,
                status,
                body
            );
            prop_assert_eq!(
                body["error"]["code"].as_str(),
                Some("harness/invalid_request")
            );
            Ok(())
        });
        if let Err(e) = result {
            panic!("{id}: {e}");
        }
        server.assert_alive();
    }

    // Policies and reconciliation, through turns.
    let globs = prop::collection::vec(
        prop_oneof![
            string(),
            Just("fixture::*".to_string()),
            Just("fixture::typed".to_string())
        ],
        0..4,
    );
    let turns = std::cell::RefCell::new(Vec::new());
    let result = runner(TURN_CASES as u32).run(
        &(0..TURN_CASES, globs.clone(), globs),
        |(case, allow, deny)| {
            let payload = json!({"message": format!("case-{case}"), "model": "m", "provider": "scripted",
                                 "options": {"max_turns": 3, "functions": {"allow": allow, "deny": deny}}});
            let (status, body) = server.call("harness::send", &payload);
            check_answer("harness::send", &truncate(&payload.to_string()), status, &body)?;
            if status == 200 {
                turns.borrow_mut().push((
                    body["session_id"].as_str().unwrap_or("").to_string(),
                    body["turn_id"].as_str().unwrap_or("").to_string(),
                ));
            }
            Ok(())
        },
    );
    if let Err(e) = result {
        panic!("{e}");
    }
    let turns = turns.into_inner();
    assert!(!turns.is_empty(), "no send was accepted");
    for (sid, turn_id) in &turns {
        let deadline = Instant::now() + WAIT;
        loop {
            let (status, s) = server.call("harness::status", &json!({"session_id": sid}));
            assert_eq!(status, 200, "{s}");
            let done = s["turn_id"] != json!(turn_id)
                || matches!(
                    s["status"].as_str(),
                    Some("completed" | "failed" | "cancelled")
                );
            if done {
                break;
            }
            assert!(Instant::now() < deadline, "turn {turn_id} never ended: {s}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    server.assert_alive();
    // The turns reached what they were meant to: repairs, dispatches and policy refusals.
    let mut transcripts = String::new();
    for (sid, _) in &turns {
        let (_, m) = server.call(
            "session::messages",
            &json!({"session_id": sid, "include_custom": true, "limit": 500}),
        );
        transcripts.push_str(&m.to_string());
    }
    assert!(
        transcripts.contains("was parsed before dispatch"),
        "no reconciliation repair happened"
    );
    assert!(
        transcripts.contains(r#"{\"ok\":true}"#),
        "no repaired call was dispatched"
    );
    assert!(transcripts.contains("policy_denied"), "no call was denied");

    // Every session still reads.
    let mut cursor: Option<String> = None;
    let mut sessions = Vec::new();
    loop {
        let mut req = json!({"limit": 100});
        if let Some(c) = &cursor {
            req["cursor"] = json!(c);
        }
        let (status, page) = server.call("session::list", &req);
        assert_eq!(status, 200, "{page}");
        for s in page["sessions"].as_array().cloned().unwrap_or_default() {
            sessions.push(
                s["id"]
                    .as_str()
                    .or(s["session_id"].as_str())
                    .unwrap_or("")
                    .to_string(),
            );
        }
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
    }
    assert!(
        sessions.len() > turns.len() / 2,
        "sessions: {}",
        sessions.len()
    );
    for sid in &sessions {
        let (status, m) = server.call(
            "session::messages",
            &json!({"session_id": sid, "include_custom": true, "limit": 500}),
        );
        assert_eq!(status, 200, "session {sid} no longer reads: {m}");
        let (status, s) = server.call("harness::status", &json!({"session_id": sid}));
        assert!(
            status == 200 || status == 404,
            "status of {sid}: {status} {s}"
        );
    }

    // Crash-consistent: the file is checked after a SIGKILL.
    let db = server.dir.path().join("data").join("harness.db");
    server.kill();
    let conn = rusqlite::Connection::open(&db).unwrap();
    let check: String = conn
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(check, "ok");
    println!(
        "fuzz: {} HTTP inputs across {} functions and {} turns; integrity ok; {} sessions read",
        TRIED.load(Ordering::Relaxed),
        defs.len(),
        turns.len(),
        sessions.len()
    );
}

fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

fn get_json(port: u16, path: &str) -> Value {
    let mut conn = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        conn,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    let body = answer.split_once("\r\n\r\n").map(|x| x.1).unwrap_or("");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("GET {path}: {e}: {answer}"))
}

/// The provider stream parser: any bytes, cut anywhere, parse to the same events as in one
/// piece, without a panic.
#[test]
fn the_sse_parser_takes_any_bytes_cut_anywhere() {
    let bytes = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..512),
        prop::collection::vec(
            prop_oneof![
                Just(b"data: ".to_vec()),
                Just(b"event: x".to_vec()),
                Just(b"id: 7".to_vec()),
                Just(b":c".to_vec()),
                Just(b"\r\n".to_vec()),
                Just(b"\n".to_vec()),
                Just(b"\r".to_vec()),
                Just(b"\xEF\xBB\xBF".to_vec()),
                Just("é😀".as_bytes().to_vec()),
                prop::collection::vec(any::<u8>(), 0..8),
            ],
            0..64
        )
        .prop_map(|parts| parts.concat()),
    ];
    let input = (
        bytes,
        prop::collection::vec(any::<prop::sample::Index>(), 0..8),
    );
    let tried = std::cell::Cell::new(0usize);
    runner(512)
        .run(&input, |(bytes, cuts)| {
            tried.set(tried.get() + 1);
            let mut whole = Vec::new();
            let mut p = SseParser::new();
            p.push(&bytes, &mut whole).unwrap();
            let mut cuts: Vec<usize> = cuts.iter().map(|i| i.index(bytes.len() + 1)).collect();
            cuts.sort_unstable();
            let mut pieces = Vec::new();
            let mut p = SseParser::new();
            let mut at = 0;
            for cut in cuts.into_iter().chain([bytes.len()]) {
                p.push(&bytes[at..cut], &mut pieces).unwrap();
                at = cut;
            }
            prop_assert_eq!(whole, pieces);
            Ok(())
        })
        .unwrap();
    println!("fuzz: {} SSE inputs", tried.get());
}
