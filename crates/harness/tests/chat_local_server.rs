//! `harness chat` against a local server replaying what llama-cpp-python 0.3.36 really sent
//! (`crates/harness-router/tests/fixtures/llama-cpp-python-0.3.36`): a failed turn makes
//! `chat -m` exit non-zero and say why, a reply cut at `--max-output-tokens` says so, and the
//! `"*"` catalog row's context window is the one the loop budgets with.

#[path = "../../harness-router/tests/common/recorded.rs"]
#[allow(dead_code)]
mod recorded;

use std::process::Output;

use recorded::{fixture, Replay, LLAMA_CPP_PYTHON};

const BIN: &str = env!("CARGO_BIN_EXE_harness");

const PROVIDER_VARS: [&str; 12] = [
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_BASE_URL",
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "OPENAI_COMPATIBLE_BASE_URL",
    "OPENAI_COMPATIBLE_API_KEY",
    "OPENAI_COMPATIBLE_PRESET",
    "LLAMACPP_BASE_URL",
    "LLAMACPP_API_KEY",
    "HARNESS_ROUTER_CONFIG",
    "HARNESS_MODEL_CATALOG",
    "HARNESS_DATA_DIR",
];

async fn chat(dir: &std::path::Path, args: &[&str], env: &[(&str, String)]) -> Output {
    let mut cmd = tokio::process::Command::new(BIN);
    cmd.arg("chat")
        .args(["--provider", "llamacpp", "--model", "gemma-3-270m"])
        .args(args)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .args(["--durability", "normal"])
        .env("XDG_CONFIG_HOME", dir.join("config"))
        .env("HOME", dir);
    for v in PROVIDER_VARS {
        cmd.env_remove(v);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().await.expect("run harness chat")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[tokio::test]
async fn a_failed_turn_exits_non_zero_with_the_status_the_servers_words_and_a_hint() {
    let dir = tempfile::tempdir().unwrap();
    // The base URL without `/v1`: the server answers 404 {"detail":"Not Found"}.
    let f = fixture(LLAMA_CPP_PYTHON, "not_found_without_v1");
    let server = Replay::start(f.exchanges).await;
    let out = chat(
        dir.path(),
        &["-m", "Say hello."],
        &[("LLAMACPP_BASE_URL", server.url.clone())],
    )
    .await;
    assert!(!out.status.success(), "{}", text(&out.stdout));
    let err = text(&out.stderr);
    assert!(err.contains("the turn failed"), "{err}");
    assert!(err.contains("HTTP 404"), "{err}");
    assert!(err.contains("Not Found"), "{err}");
    assert!(err.contains(&format!("try {}/v1", server.url)), "{err}");
    assert!(err.contains("LLAMACPP_BASE_URL"), "{err}");
    assert!(text(&out.stdout).contains("[turn failed:"));

    // Nothing listening on the port.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}/v1");
    let out = chat(
        dir.path(),
        &["-m", "Say hello."],
        &[("LLAMACPP_BASE_URL", url.clone())],
    )
    .await;
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains(&format!("nothing answers at {url}")), "{err}");
}

#[tokio::test]
async fn a_reply_cut_at_max_output_tokens_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let f = fixture(LLAMA_CPP_PYTHON, "length_stop");
    let server = Replay::start(f.exchanges).await;
    let out = chat(
        dir.path(),
        &[
            "-m",
            "Write a long story about the sea.",
            "--max-output-tokens",
            "8",
        ],
        &[("LLAMACPP_BASE_URL", format!("{}/v1", server.url))],
    )
    .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("[reply cut"), "{stdout}");
    let bodies = server.chat_bodies();
    assert_eq!(bodies[0]["max_tokens"], 8);
}

#[tokio::test]
async fn the_catch_all_rows_context_window_is_the_one_the_loop_budgets_with() {
    let dir = tempfile::tempdir().unwrap();
    let f = fixture(LLAMA_CPP_PYTHON, "plain_stream");
    let server = Replay::start(f.exchanges).await;
    let catalog = dir.path().join("local.json");
    std::fs::write(
        &catalog,
        r#"{"models": [{"provider": "llamacpp", "id": "*", "context_window": 512}]}"#,
    )
    .unwrap();
    // ~1000 tokens: fits the shipped guess, not the 512 the override says.
    let long = "the quick brown fox jumps over the lazy dog ".repeat(90);
    let env = [
        ("LLAMACPP_BASE_URL", format!("{}/v1", server.url)),
        ("HARNESS_MODEL_CATALOG", catalog.display().to_string()),
    ];
    let out = chat(dir.path(), &["-m", &long], &env).await;
    assert!(!out.status.success(), "{}", text(&out.stdout));
    let err = text(&out.stderr);
    assert!(
        err.contains("no longer fits the model's context window"),
        "{err}"
    );
    assert!(
        server.chat_bodies().is_empty(),
        "nothing is sent that cannot fit"
    );
}

/// `--tool-choice` names the function the server must call (in the chat-completions shape, under
/// the provider's id), `--expose native` offers it as its own tool, and `--max-turns` caps the
/// steps, so a forced call is not repeated at every step.
#[tokio::test]
async fn tool_choice_expose_and_max_turns_reach_the_request() {
    let dir = tempfile::tempdir().unwrap();
    let f = fixture(LLAMA_CPP_PYTHON, "tools_forced_stream");
    let server = Replay::start(f.exchanges).await;
    let root = dir.path().join("root");
    std::fs::create_dir_all(&root).unwrap();
    let out = chat(
        dir.path(),
        &[
            "-m",
            "What is in notes.txt?",
            "--allow",
            "fs::read",
            "--expose",
            "native",
            "--tool-choice",
            "fs::read",
            "--max-turns",
            "1",
        ],
        &[("LLAMACPP_BASE_URL", format!("{}/v1", server.url))],
    )
    .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let bodies = server.chat_bodies();
    assert_eq!(bodies.len(), 1, "one step only: {bodies:?}");
    assert_eq!(
        bodies[0]["tool_choice"],
        serde_json::json!({"type": "function", "function": {"name": "fs__read"}})
    );
    let tools: Vec<&str> = bodies[0]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        tools,
        ["fs__read"],
        "native exposure of the allowed function"
    );
    // The recorded reply calls math__add: shown on stderr with its outcome (refused: not allowed).
    let err = text(&out.stderr);
    assert!(err.contains("[call math::add {"), "{err}");
    assert!(err.contains("[math::add error:"), "{err}");
    assert!(
        !text(&out.stdout).contains("[call"),
        "the reply stays alone on stdout"
    );
}
