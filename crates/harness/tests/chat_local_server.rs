//! `harness chat` against a local server replaying what llama-cpp-python 0.3.36 really sent
//! (`crates/harness-router/tests/fixtures/llama-cpp-python-0.3.36`): a failed turn makes
//! `chat -m` exit non-zero and say why, a reply cut at `--max-output-tokens` says so, and the
//! `"*"` catalog row's context window is the one the loop budgets with.

#[path = "../../harness-router/tests/common/recorded.rs"]
#[allow(dead_code)]
mod recorded;

use std::process::Output;

use recorded::{assert_asked_without_the_digits, digits, fixture, Replay, LLAMA_CPP_PYTHON};

#[path = "common/chat_env.rs"]
mod chat_env;

use chat_env::chat_in;

const BIN: &str = env!("CARGO_BIN_EXE_harness");

/// `harness chat` on the `llamacpp` provider (see [`chat_in`]).
fn chat_command(
    dir: &std::path::Path,
    args: &[&str],
    env: &[(&str, String)],
) -> tokio::process::Command {
    let llamacpp = ["--provider", "llamacpp", "--model", "gemma-3-270m"];
    tokio::process::Command::from(chat_in(dir, &[&llamacpp[..], args].concat(), env))
}

/// The environment that points the `llamacpp` provider at `server`.
fn served_by(server: &Replay) -> [(&'static str, String); 1] {
    [("LLAMACPP_BASE_URL", format!("{}/v1", server.url))]
}

/// [`chat_command`] with its stdin, stdout and stderr piped.
fn chat_piped(
    dir: &std::path::Path,
    args: &[&str],
    env: &[(&str, String)],
) -> tokio::process::Command {
    let mut cmd = chat_command(dir, args, env);
    cmd.stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    cmd
}

async fn chat(dir: &std::path::Path, args: &[&str], env: &[(&str, String)]) -> Output {
    chat_command(dir, args, env)
        .output()
        .await
        .expect("run harness chat")
}

/// [`chat`], which must exit 0; returns what it said on stdout and on stderr.
async fn chat_ok(dir: &std::path::Path, args: &[&str], env: &[(&str, String)]) -> (String, String) {
    let out = chat(dir, args, env).await;
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "chat {args:?}: {stderr}");
    (text(&out.stdout), stderr)
}

/// [`chat`], which must fail; returns what it said on stdout and on stderr.
async fn chat_fails(
    dir: &std::path::Path,
    args: &[&str],
    env: &[(&str, String)],
) -> (String, String) {
    let out = chat(dir, args, env).await;
    let stdout = text(&out.stdout);
    assert!(!out.status.success(), "chat {args:?} succeeded: {stdout}");
    (stdout, text(&out.stderr))
}

/// A local server replaying the llama-cpp-python exchanges recorded as `names`, in order.
async fn replaying(names: &[&str]) -> Replay {
    let exchanges = names
        .iter()
        .flat_map(|name| fixture(LLAMA_CPP_PYTHON, name).exchanges)
        .collect();
    Replay::start(exchanges).await
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[tokio::test]
async fn a_failed_turn_exits_non_zero_with_the_status_the_servers_words_and_a_hint() {
    let dir = tempfile::tempdir().unwrap();
    // The base URL without `/v1`: the server answers 404 {"detail":"Not Found"}.
    let server = replaying(&["not_found_without_v1"]).await;
    let (stdout, err) = chat_fails(
        dir.path(),
        &["-m", "Say hello."],
        &[("LLAMACPP_BASE_URL", server.url.clone())],
    )
    .await;
    assert!(err.contains("the turn failed"), "{err}");
    assert!(err.contains("HTTP 404"), "{err}");
    assert!(err.contains("Not Found"), "{err}");
    assert!(err.contains(&format!("try {}/v1", server.url)), "{err}");
    assert!(err.contains("LLAMACPP_BASE_URL"), "{err}");
    assert!(stdout.contains("[turn failed:"));

    // Nothing listening on the port.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}/v1");
    let (_, err) = chat_fails(
        dir.path(),
        &["-m", "Say hello."],
        &[("LLAMACPP_BASE_URL", url.clone())],
    )
    .await;
    assert!(err.contains(&format!("nothing answers at {url}")), "{err}");
}

#[tokio::test]
async fn a_reply_cut_at_max_output_tokens_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let server = replaying(&["length_stop"]).await;
    let (stdout, err) = chat_ok(
        dir.path(),
        &[
            "-m",
            "Write a long story about the sea.",
            "--max-output-tokens",
            "8",
        ],
        &served_by(&server),
    )
    .await;
    assert!(stdout.contains("[reply cut"), "{stdout}");
    assert!(stdout.contains("--max-output-tokens 8"), "{stdout}");
    // Usage under the reply: the server reports none, so it is the router's estimate.
    assert!(
        err.contains("[usage: ") && err.contains("(estimated), $0.000000]"),
        "{err}"
    );
    let bodies = server.chat_bodies();
    assert_eq!(bodies[0]["max_tokens"], 8);
}

#[tokio::test]
async fn the_catch_all_rows_context_window_is_the_one_the_loop_budgets_with() {
    let dir = tempfile::tempdir().unwrap();
    let server = replaying(&["plain_stream"]).await;
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
    let (_, err) = chat_fails(dir.path(), &["-m", &long], &env).await;
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
    let server = replaying(&["tools_forced_stream"]).await;
    let root = dir.path().join("root");
    std::fs::create_dir_all(&root).unwrap();
    let (stdout, err) = chat_ok(
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
        &served_by(&server),
    )
    .await;
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
    assert!(err.contains("[call math::add {"), "{err}");
    assert!(err.contains("[math::add error:"), "{err}");
    assert!(!stdout.contains("[call"), "the reply stays alone on stdout");
    // The turn ended at its one step: said, not silent.
    assert!(
        stdout.contains("[stopped at the turn's max_turns limit"),
        "{stdout}"
    );
}

/// `chat` reading its messages from stdin, as a person types them.
async fn chat_typed(
    dir: &std::path::Path,
    args: &[&str],
    env: &[(&str, String)],
    typed: &str,
) -> Output {
    use tokio::io::AsyncWriteExt;
    let mut child = chat_piped(dir, args, env)
        .spawn()
        .expect("run harness chat");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(typed.as_bytes()).await.unwrap();
    drop(stdin);
    child.wait_with_output().await.unwrap()
}

/// A session whose first message is over a 2,048-token server's window: that turn is refused
/// with the message's size (the server's own count) and the window, nothing is sent to the
/// model, and the next "Say hi." of the same session completes without it, asking for no more
/// output than the window leaves.
#[tokio::test]
async fn a_dense_first_message_is_refused_and_the_next_message_of_the_session_completes() {
    let dir = tempfile::tempdir().unwrap();
    let mut exchanges = fixture(LLAMA_CPP_PYTHON, "tokenize_count_short").exchanges;
    exchanges.extend(fixture(LLAMA_CPP_PYTHON, "tokenize_count_digits").exchanges);
    exchanges.extend(fixture(LLAMA_CPP_PYTHON, "plain_stream").exchanges);
    let reply: String = exchanges[2]
        .body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    let server = Replay::start(exchanges).await;
    let env = served_by(&server);
    let args = ["--context-window", "2048"];

    // As a one-shot command: a failure, said with the size and the window.
    let (_, err) = chat_fails(dir.path(), &[&args[..], &["-m", &digits()]].concat(), &env).await;
    assert!(err.contains("context/message_too_large"), "{err}");
    assert!(
        err.contains("~3005 tokens") && err.contains("2048-token window"),
        "{err}"
    );
    assert!(
        server.chat_bodies().is_empty(),
        "nothing was sent to the model"
    );

    // Typed into one session: the refusal, then "Say hi." answered.
    let typed = format!("{}\nSay hi.\n/quit\n", digits());
    let out = chat_typed(dir.path(), &args, &env, &typed).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("context/message_too_large"), "{stdout}");
    assert!(stdout.contains(reply.trim()), "{stdout}");
    assert_asked_without_the_digits(&server.chat_bodies());
}

/// `--tool-choice` must name a function the model is offered: checked before anything is sent,
/// and the error says what is offered.
#[tokio::test]
async fn a_tool_choice_nothing_offers_exits_non_zero_before_any_request() {
    let dir = tempfile::tempdir().unwrap();
    let server = replaying(&["plain_stream"]).await;
    let env = served_by(&server);
    let cases: [(&[&str], &str); 3] = [
        (
            &["--allow", "fs::*", "--expose", "native"],
            "offered: fs::edit, fs::list, fs::read",
        ),
        (&["--allow", "fs::*"], "unless --expose native"),
        (&[], "name it with --allow"),
    ];
    for (extra, says) in cases {
        let args = [&["-m", "Say hi.", "--tool-choice", "fs:read"][..], extra].concat();
        let (_, err) = chat_fails(dir.path(), &args, &env).await;
        assert!(err.contains("--tool-choice fs:read"), "{err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(!err.contains("context"), "{err}");
    }
    assert!(server.asked().is_empty(), "{:?}", server.asked());
}

/// Ctrl-C while a reply streams stops that reply and the chat goes on; a second one quits.
#[tokio::test]
async fn ctrl_c_stops_the_reply_and_a_second_one_quits() {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let f = fixture(LLAMA_CPP_PYTHON, "plain_stream");
    // Slow enough that the reply is still streaming when the signal comes.
    let server = Replay::start_paced(f.exchanges, std::time::Duration::from_millis(400)).await;
    let env = served_by(&server);
    let mut child = chat_piped(dir.path(), &[], &env).spawn().unwrap();
    let pid = child.id().unwrap().to_string();
    let mut stdin = child.stdin.take().unwrap();
    let mut err = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let mut out = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let interrupt = |pid: String| async move {
        let status = tokio::process::Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .await
            .unwrap();
        assert!(status.success());
    };
    stdin.write_all(b"Say hello.\n").await.unwrap();
    stdin.flush().await.unwrap();
    // Signalled once the request is at the server, whose reply streams slowly.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while server.chat_bodies().is_empty() {
        assert!(std::time::Instant::now() < deadline, "no request was sent");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    interrupt(pid.clone()).await;
    let mut said = String::new();
    loop {
        let next = tokio::time::timeout(std::time::Duration::from_secs(20), out.next_line())
            .await
            .expect("the chat said nothing more");
        let Ok(Some(line)) = next else { break };
        said.push_str(&line);
        said.push('\n');
        if line.contains("[stopped]") {
            break;
        }
    }
    assert!(said.contains("[stopped]"), "stdout: {said}");
    // Still running: the prompt came back. A second Ctrl-C there quits.
    interrupt(pid).await;
    let status = tokio::time::timeout(std::time::Duration::from_secs(20), child.wait())
        .await
        .expect("the chat quit")
        .unwrap();
    assert_eq!(status.code(), Some(130));
    let mut stderr = String::new();
    while let Ok(Some(line)) = err.next_line().await {
        stderr.push_str(&line);
        stderr.push('\n');
    }
    assert!(
        stderr.contains("[stopping the reply; Ctrl-C again quits]"),
        "{stderr}"
    );
}

/// A reply the server cut and the loop resumed is shown with a mark between the cut part and
/// its continuation.
#[tokio::test]
async fn a_resumed_reply_is_marked_where_it_was_cut() {
    let dir = tempfile::tempdir().unwrap();
    let server = replaying(&["interrupted_by_second_request"]).await;
    let (stdout, _) = chat_ok(
        dir.path(),
        &[
            "-m",
            "Count from 1 to 200, one number per line.",
            "--max-output-tokens",
            "300",
        ],
        &served_by(&server),
    )
    .await;
    let (cut, resumed) = stdout
        .split_once("[the reply above was cut off; resumed:]")
        .unwrap_or_else(|| panic!("no mark: {stdout}"));
    assert!(
        !cut.trim().is_empty() && !resumed.trim().is_empty(),
        "{stdout}"
    );
    assert_eq!(server.chat_bodies().len(), 2);
}

/// A session resumed with `--session` and no `--allow` keeps the policy of its earlier run: the
/// chat says so instead of letting it act unseen.
#[tokio::test]
async fn a_policy_kept_from_an_earlier_run_is_said() {
    let dir = tempfile::tempdir().unwrap();
    let server = replaying(&["plain_stream", "multi_turn_stream"]).await;
    let env = served_by(&server);
    let out = chat_typed(
        dir.path(),
        &["--allow", "fs::read"],
        &env,
        "Say hello.\n/quit\n",
    )
    .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(!err.contains("earlier run"), "{err}");
    let sid = err
        .split("(session ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .unwrap_or_else(|| panic!("no session id: {err}"))
        .to_string();
    let (_, err) = chat_ok(
        dir.path(),
        &["-m", "What is my name?", "--session", &sid],
        &env,
    )
    .await;
    assert!(
        err.contains(&format!(
            "session {sid} keeps the function policy of an earlier run: --allow fs::read"
        )),
        "{err}"
    );
}

/// `chat --help` says what a run without `--allow` really does: a new session allows nothing, a
/// resumed one keeps its earlier policy.
#[tokio::test]
async fn the_allow_help_says_a_resumed_session_keeps_its_policy() {
    let out = tokio::process::Command::new(BIN)
        .args(["chat", "--help"])
        .output()
        .await
        .unwrap();
    assert!(out.status.success());
    let help = text(&out.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    let allow = help
        .split("--allow <GLOB>")
        .nth(1)
        .unwrap_or_else(|| panic!("no --allow: {help}"));
    assert!(!allow.contains("default none"), "{allow}");
    assert!(
        allow.contains("--session keeps the policy of its earlier turns"),
        "{allow}"
    );
}
