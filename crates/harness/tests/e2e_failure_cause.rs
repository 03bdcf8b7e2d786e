//! A failed turn's cause reaches API clients: against a local server whose base URL lacks
//! `/v1` (it answers 404 to everything), `harness::status` and `harness::turn-completed` carry
//! the failure's code, the provider's status and words, and the hint `harness chat` prints,
//! the same after a restart, and the provider's API key appears nowhere.

mod common;

use common::*;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Not shaped like a key: only the configured-secret redaction can catch it.
const KEY: &str = "marker7f3a9c2e1b55d0";

/// A server that answers every request `404` with a body repeating the credentials it got, as
/// careless servers do. Returns its base URL (no `/v1`) and the number of requests it saw.
async fn echoing_404() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                // The headers, then as much body as they announce.
                let head_end = loop {
                    match conn.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                    if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break p + 4;
                    }
                };
                let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
                let header = |name: &str| {
                    head.lines().find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.trim()
                            .eq_ignore_ascii_case(name)
                            .then(|| v.trim().to_string())
                    })
                };
                let length: usize = header("content-length")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                while buf.len() < head_end + length {
                    match conn.read(&mut chunk).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let auth = header("authorization").unwrap_or_default();
                let key = auth.trim_start_matches("Bearer ").to_string();
                let body = json!({
                    "detail": format!("Not Found (you sent '{auth}'; key {key})")
                })
                .to_string();
                let answer = format!(
                    "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(answer.as_bytes()).await;
                let _ = conn.shutdown().await;
            });
        }
    });
    (url, seen)
}

fn assert_no_key(what: &str, text: &str) {
    assert!(!text.contains(KEY), "the API key appears in {what}: {text}");
}

/// The parts of a failure both the status and the event must carry.
fn assert_cause(what: &str, failure: &Value, url: &str) {
    assert_eq!(failure["code"], "router/not_found", "{what}: {failure}");
    assert_eq!(failure["phase"], "generation", "{what}: {failure}");
    assert_eq!(failure["kind"], "permanent", "{what}: {failure}");
    assert_eq!(failure["retryable"], false, "{what}: {failure}");
    assert_eq!(failure["provider_status"], 404, "{what}: {failure}");
    let words = failure["provider_message"].as_str().unwrap_or_default();
    assert!(
        words.starts_with("Not Found (you sent '[redacted]'; key [redacted])"),
        "{what}: the provider's words, redacted: {failure}"
    );
    let hint = failure["hint"].as_str().unwrap_or_default();
    assert!(
        hint.starts_with(&format!(
            "OpenAI-compatible servers serve under /v1: try {url}/v1 as the base URL"
        )),
        "{what}: {failure}"
    );
    assert!(hint.contains("LLAMACPP_BASE_URL"), "{what}: {failure}");
    let detail = failure["detail"].as_str().unwrap_or_default();
    assert!(
        detail.starts_with("HTTP 404: Not Found"),
        "{what}: {failure}"
    );
    assert!(
        !detail.contains(hint),
        "the hint is its own field: {failure}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_turns_cause_is_on_status_and_turn_completed_and_survives_a_restart() {
    let (url, seen) = echoing_404().await;
    let mut server = Server::start(&script(vec![]), &[]).await;
    let config = tempfile::tempdir().unwrap();
    server.set_env("LLAMACPP_BASE_URL", Some(&url));
    server.set_env("LLAMACPP_API_KEY", Some(KEY));
    // No router config of the machine running the test.
    server.set_env("XDG_CONFIG_HOME", Some(config.path().to_str().unwrap()));
    server.set_env("HOME", Some(config.path().to_str().unwrap()));
    server.restart().await;

    let sid = "s_cause";
    let sent = server
        .ok(
            "harness::send",
            json!({"session_id": sid, "message": "Say hello.", "model": "gemma-3-270m",
                   "provider": "llamacpp"}),
        )
        .await;
    let turn_id = sent["turn_id"].as_str().unwrap().to_string();
    // From the session's first event on (the stream replays what was logged already).
    let mut events = server.events(sid, None).await;
    let seen_events = events.until_turn_completed(&turn_id).await;
    let completed = seen_events.last().unwrap().payload().clone();
    assert!(
        seen.load(std::sync::atomic::Ordering::SeqCst) >= 1,
        "the provider was asked"
    );

    assert_eq!(completed["status"], "failed", "{completed}");
    assert_eq!(
        completed["result_error"], "The provider rejected this request.",
        "the public sentence stays: {completed}"
    );
    assert_cause("turn-completed", &completed["failure"], &url);

    let status = server.status(sid).await;
    assert_eq!(status["status"], "failed", "{status}");
    assert_eq!(status["result_error"], completed["result_error"]);
    assert_cause("harness::status", &status["failure"], &url);
    assert_eq!(
        status["failure"], completed["failure"],
        "one cause, both places"
    );

    // Durable: the same after a restart.
    server.restart().await;
    let again = server.status(sid).await;
    assert_eq!(again["failure"], status["failure"], "{again}");

    // The key is nowhere: status, events, transcript (with the error record), the log.
    assert_no_key("harness::status", &again.to_string());
    for ev in &seen_events {
        assert_no_key(ev.topic(), &ev.data.to_string());
    }
    let transcript = server.transcript(sid, true).await;
    let error_record = transcript
        .iter()
        .find(|e| e["custom"]["custom_type"] == "error")
        .unwrap_or_else(|| panic!("an error record: {transcript:?}"));
    assert_eq!(error_record["custom"]["data"]["provider_status"], 404);
    assert_eq!(
        error_record["custom"]["data"]["hint"],
        status["failure"]["hint"]
    );
    assert_no_key("the transcript", &Value::Array(transcript).to_string());
    assert_no_key("the server log", &server.log());
}
