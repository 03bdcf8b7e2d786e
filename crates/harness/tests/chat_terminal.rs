//! `harness chat` in a real terminal (tmux): what is typed while a reply streams is held until
//! the reply ends, then shown after the prompt and sent as the next message.

#[path = "../../harness-router/tests/common/recorded.rs"]
#[allow(dead_code)]
mod recorded;

use std::path::Path;
use std::time::{Duration, Instant};

use recorded::{fixture, Replay, LLAMA_CPP_PYTHON};

#[path = "common/chat_env.rs"]
mod chat_env;

use chat_env::PROVIDER_VARS;

const BIN: &str = env!("CARGO_BIN_EXE_harness");

/// A tmux server of the test's own (its socket in the temp dir), killed when dropped.
struct Tmux {
    socket: std::path::PathBuf,
}

impl Tmux {
    fn run(&self, args: &[&str]) -> String {
        let out = std::process::Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("tmux runs (install tmux)");
        assert!(
            out.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn screen(&self) -> String {
        self.run(&["capture-pane", "-p", "-J", "-S", "-200", "-t", "chat"])
    }

    /// Waits for the screen to satisfy `ok`; the screen it saw.
    fn wait_for(&self, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let screen = self.screen();
            if ok(&screen) {
                return screen;
            }
            assert!(Instant::now() < deadline, "{what}; the screen:\n{screen}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = std::process::Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .arg("kill-server")
            .output();
    }
}

fn quoted(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn start(dir: &Path, server: &Replay) -> Tmux {
    let mut command = String::from("env");
    for v in PROVIDER_VARS {
        command.push_str(&format!(" -u {v}"));
    }
    let data = dir.join("data");
    let config = dir.join("config");
    command.push_str(&format!(
        " HOME={} XDG_CONFIG_HOME={} LLAMACPP_BASE_URL={} {} chat --provider llamacpp --model gemma-3-270m --data-dir {} --durability normal",
        quoted(&dir.to_string_lossy()),
        quoted(&config.to_string_lossy()),
        quoted(&format!("{}/v1", server.url)),
        quoted(BIN),
        quoted(&data.to_string_lossy()),
    ));
    // Kept open after the chat ends, so a failure still shows what it printed.
    command.push_str("; sleep 600");
    let tmux = Tmux {
        socket: dir.join("tmux.sock"),
    };
    tmux.run(&[
        "new-session",
        "-d",
        "-s",
        "chat",
        "-x",
        "200",
        "-y",
        "50",
        &command,
    ]);
    tmux
}

#[tokio::test(flavor = "multi_thread")]
async fn what_is_typed_while_a_reply_streams_waits_for_the_reply_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let mut exchanges = fixture(LLAMA_CPP_PYTHON, "plain_stream").exchanges;
    exchanges.extend(fixture(LLAMA_CPP_PYTHON, "multi_turn_stream").exchanges);
    // Slow enough that the reply is still streaming while the next line is typed.
    let server = Replay::start_paced(exchanges, Duration::from_millis(150)).await;
    let tmux = start(dir.path(), &server);
    tmux.wait_for("the chat's prompt", |s| s.contains("> "));
    tmux.run(&["send-keys", "-t", "chat", "-l", "Say hello."]);
    tmux.run(&["send-keys", "-t", "chat", "Enter"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.chat_bodies().is_empty() {
        assert!(Instant::now() < deadline, "no request: {}", tmux.screen());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Typed with a slip corrected, while the reply streams.
    tmux.run(&["send-keys", "-t", "chat", "-l", "What is my namx"]);
    tmux.run(&["send-keys", "-t", "chat", "BSpace"]);
    tmux.run(&["send-keys", "-t", "chat", "-l", "e?"]);
    let screen = tmux.wait_for("the typed text after the next prompt", |s| {
        s.lines().any(|l| l.starts_with("> What is my name?"))
    });
    assert!(
        server.chat_bodies().len() == 1,
        "sent before Enter: {screen}"
    );
    // Once on the screen: after the prompt, never inside the reply.
    assert_eq!(screen.matches("namx").count(), 0, "{screen}");
    assert_eq!(screen.matches("What is my").count(), 1, "{screen}");
    let reply = screen
        .split("> Say hello.")
        .nth(1)
        .and_then(|r| r.split("> What is my name?").next())
        .unwrap_or_else(|| panic!("no reply between the prompts: {screen}"));
    assert!(
        reply.lines().any(|l| !l.trim().is_empty()),
        "no reply shown: {screen}"
    );
    // Enter sends the held line as the next message.
    tmux.run(&["send-keys", "-t", "chat", "Enter"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.chat_bodies().len() < 2 {
        assert!(
            Instant::now() < deadline,
            "no second request: {}",
            tmux.screen()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let body = &server.chat_bodies()[1];
    let last = body["messages"]
        .as_array()
        .and_then(|m| m.last())
        .cloned()
        .unwrap_or_default();
    assert_eq!(last["role"], "user", "{body}");
    assert_eq!(last["content"], "What is my name?", "{body}");
}
