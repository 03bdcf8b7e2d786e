//! `harness chat` provider selection, end to end through the binary: a named provider without
//! credentials says what to set, no configuration falls back to the scripted demo, and an
//! OpenAI-compatible server configured from the environment answers a real chat (a local server
//! replaying the Chat Completions stream).

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::Output;

#[path = "common/chat_env.rs"]
mod chat_env;
#[path = "common/http_head.rs"]
mod http_head;

use chat_env::chat_in;
use http_head::content_length;

fn chat(dir: &std::path::Path, args: &[&str], env: &[(&str, String)]) -> Output {
    chat_in(dir, args, env).output().expect("run harness chat")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn a_named_provider_without_its_key_says_which_variable_to_set() {
    let dir = tempfile::tempdir().unwrap();
    let out = chat(dir.path(), &["-m", "hi", "--provider", "anthropic"], &[]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("set ANTHROPIC_API_KEY"), "{err}");
    let out = chat(dir.path(), &["-m", "hi", "--provider", "openai"], &[]);
    assert!(text(&out.stderr).contains("set OPENAI_API_KEY"));
    let out = chat(
        dir.path(),
        &["-m", "hi", "--provider", "openai-compatible"],
        &[],
    );
    assert!(text(&out.stderr).contains("OPENAI_COMPATIBLE_BASE_URL"));
}

#[test]
fn without_any_provider_the_scripted_demo_answers_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let out = chat(dir.path(), &["-m", "hello"], &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("harness demo"),
        "{}",
        text(&out.stdout)
    );
    assert!(
        text(&out.stderr).contains("scripted demo"),
        "{}",
        text(&out.stderr)
    );
}

/// Serves one Chat Completions stream, then stops.
fn one_stream_server() -> (String, std::thread::JoinHandle<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    let handle = std::thread::spawn(move || {
        let (mut sock, _) = listener.accept().unwrap();
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let body_start = loop {
            let n = sock.read(&mut chunk).unwrap();
            buf.extend_from_slice(&chunk[..n]);
            if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break p + 4;
            }
        };
        let head = String::from_utf8_lossy(&buf[..body_start]).to_ascii_lowercase();
        let len = content_length(&head).unwrap_or(0);
        while buf.len() < body_start + len {
            let n = sock.read(&mut chunk).unwrap();
            buf.extend_from_slice(&chunk[..n]);
        }
        let mut sse = String::new();
        for piece in ["Hello from ", "the local server."] {
            sse.push_str(&format!(
                "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{piece}\"}},\"finish_reason\":null}}]}}\n\n"
            ));
        }
        sse.push_str("data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n");
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{sse}",
            sse.len()
        );
        sock.write_all(resp.as_bytes()).unwrap();
        String::from_utf8_lossy(&buf[body_start..]).into_owned()
    });
    (url, handle)
}

#[test]
fn an_openai_compatible_server_from_the_environment_answers_the_chat() {
    let dir = tempfile::tempdir().unwrap();
    let (url, server) = one_stream_server();
    let out = chat(
        dir.path(),
        &["-m", "hi", "--model", "llama3.2:3b"],
        &[("OPENAI_COMPATIBLE_BASE_URL", url)],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("Hello from the local server."),
        "{}",
        text(&out.stdout)
    );
    let body: serde_json::Value = serde_json::from_str(&server.join().unwrap()).unwrap();
    assert_eq!(body["model"], "llama3.2:3b");
    assert_eq!(body["stream"], true);
}
