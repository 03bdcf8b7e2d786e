//! `shell::exec` runs in a kernel sandbox: real commands, real Landlock. A command cannot read
//! the harness's store or configuration (even beneath the root, even through a planted link),
//! cannot write outside the root, can work inside it, and opens no TCP connection unless the
//! operator allows it. Where the kernel cannot confine, the call is refused unless the operator
//! accepted running unconfined.

mod support;

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness_tools::{Limits, ShellPolicy};
use serde_json::{json, Value};
use support::*;

const STORE: &str = "STORE-CANARY-31337";
const CONFIG: &str = "CONFIG-CANARY-4242";

/// A rig whose data directory and configuration lie inside the root (the hard case for an
/// allow-only sandbox), plus a second pair outside it.
fn rig_with(policy: ShellPolicy, ceiling: Option<i32>) -> Rig {
    let limits = Limits {
        shell_policy: Arc::new(move || policy.clone()),
        landlock_ceiling: ceiling,
        ..Limits::default()
    };
    Rig::with_limits(limits, |dir| {
        let root = dir.join("root");
        for data in [root.join(".harness"), dir.join("data")] {
            std::fs::create_dir_all(&data).unwrap();
            std::fs::write(data.join("harness.db"), STORE).unwrap();
        }
        for config in [root.join("harness.yaml"), dir.join("harness.yaml")] {
            std::fs::write(&config, format!("# {CONFIG}\nmax_depth: 3\n")).unwrap();
        }
        std::fs::create_dir_all(root.join("src")).unwrap();
        std::fs::write(root.join("src/main.txt"), "hello\n").unwrap();
        vec![
            root.join(".harness"),
            root.join("harness.yaml"),
            dir.join("data"),
            dir.join("harness.yaml"),
        ]
    })
}

fn rig() -> Rig {
    rig_with(ShellPolicy::default(), None)
}

async fn sh(rig: &Rig, command: &str) -> Value {
    let r = rig.exec(command).await;
    assert_eq!(r["confinement"]["kind"], "landlock", "{r}");
    r
}

fn out(r: &Value) -> String {
    format!(
        "{}{}",
        r["stdout"].as_str().unwrap(),
        r["stderr"].as_str().unwrap()
    )
}

fn failed(r: &Value) -> bool {
    r["exit_code"] != 0
}

fn dir(rig: &Rig) -> PathBuf {
    std::fs::canonicalize(rig.dir.path()).unwrap()
}

#[tokio::test]
async fn the_store_and_the_config_cannot_be_read_even_beneath_the_root() {
    let rig = rig();
    let d = dir(&rig);
    for path in [
        ".harness/harness.db".to_string(),
        "harness.yaml".to_string(),
        format!("{}/data/harness.db", d.display()),
        format!("{}/harness.yaml", d.display()),
        // The rig's own store, outside every allowed tree.
        format!("{}/harness.db", d.display()),
    ] {
        let r = sh(&rig, &format!("cat '{path}'")).await;
        assert!(failed(&r), "cat {path} succeeded: {r}");
        let o = out(&r);
        assert!(!o.contains(STORE) && !o.contains(CONFIG), "{path}: {o}");
    }
    // Nor through a link planted in the root, nor by copying, nor by listing its contents.
    let r = sh(&rig, "ln -s .harness lnk && cat lnk/harness.db").await;
    assert!(failed(&r) && !out(&r).contains(STORE), "{r}");
    let r = sh(
        &rig,
        "ln -s harness.yaml conf; cat conf; cp harness.yaml src/copy; cat src/copy",
    )
    .await;
    assert!(!out(&r).contains(CONFIG), "{r}");
    // Names along the way can be listed (the root's listing is inherited by everything beneath
    // it), contents cannot: the same line the fs::* functions draw.
    let r = sh(&rig, "ls .harness && wc -c .harness/*").await;
    assert!(failed(&r) && !out(&r).contains(STORE), "{r}");
    // A hard link would carry the file into the root's rights: refused too.
    let r = sh(&rig, "ln .harness/harness.db src/hard && cat src/hard").await;
    assert!(failed(&r) && !out(&r).contains(STORE), "{r}");
    let r = sh(&rig, "grep -r CANARY . 2>/dev/null; true").await;
    assert!(!out(&r).contains(STORE) && !out(&r).contains(CONFIG), "{r}");
}

#[tokio::test]
async fn the_store_and_the_config_cannot_be_changed() {
    let rig = rig();
    let root = rig.root();
    for command in [
        ": > harness.yaml",
        "echo evil >> harness.yaml",
        "rm -f harness.yaml",
        "mv harness.yaml src/moved.yaml",
        "truncate -s 0 .harness/harness.db",
        "rm -rf .harness",
        "mv .harness src/stolen",
        "echo x > .harness/harness.db-journal",
        "mkdir .harness/sub",
    ] {
        let r = sh(&rig, command).await;
        assert!(failed(&r), "{command} succeeded: {r}");
    }
    assert_eq!(
        std::fs::read_to_string(root.join(".harness/harness.db")).unwrap(),
        STORE
    );
    assert!(std::fs::read_to_string(root.join("harness.yaml"))
        .unwrap()
        .contains(CONFIG));
    assert!(!root.join(".harness/harness.db-journal").exists());
    assert!(!root.join(".harness/sub").exists());
    assert!(!root.join("src/stolen").exists() && !root.join("src/moved.yaml").exists());
}

#[tokio::test]
async fn writes_land_only_beneath_the_root() {
    let rig = rig();
    let root = rig.root();
    let outside = rig.outside();
    let r = sh(
        &rig,
        "echo edited >> src/main.txt && mkdir -p src/a/b && echo x > src/a/b/c && rm src/a/b/c && echo kept > src/new.txt",
    )
    .await;
    assert_eq!(r["exit_code"], 0, "{r}");
    assert_eq!(
        std::fs::read_to_string(root.join("src/main.txt")).unwrap(),
        "hello\nedited\n"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("src/new.txt")).unwrap(),
        "kept\n"
    );
    for command in [
        format!("echo x > '{}/new.txt'", outside.display()),
        format!("echo x >> '{}/secret.txt'", outside.display()),
        format!("rm '{}/secret.txt'", outside.display()),
        format!("mkdir '{}/made'", outside.display()),
        "echo x > /etc/harness-confine-probe".to_string(),
        // A link made inside the root leads nowhere the root's rights reach.
        format!(
            "ln -s '{}' src/out && echo x > src/out/via-link.txt",
            outside.display()
        ),
        format!("echo x > '{}/escape.txt'", dir(&rig).display()),
    ] {
        let r = sh(&rig, &command).await;
        assert!(failed(&r), "{command} succeeded: {r}");
    }
    assert!(!outside.join("new.txt").exists());
    assert!(!outside.join("made").exists());
    assert!(!outside.join("via-link.txt").exists());
    assert!(!Path::new("/etc/harness-confine-probe").exists());
    assert!(!dir(&rig).join("escape.txt").exists());
    assert_eq!(
        std::fs::read_to_string(outside.join("secret.txt")).unwrap(),
        "TOP SECRET\n"
    );
    // Reading outside the root and the system is refused as well.
    let r = sh(&rig, &format!("cat '{}/secret.txt'", outside.display())).await;
    assert!(failed(&r) && !out(&r).contains("TOP SECRET"), "{r}");
    // The harness itself is not confined.
    std::fs::write(outside.join("by-the-harness.txt"), "free").unwrap();
}

/// With nothing protected beneath it, the root's top level is writable too.
#[tokio::test]
async fn a_root_without_protected_paths_is_writable_at_its_top() {
    let rig = Rig::new();
    let r = sh(
        &rig,
        "echo top > top.txt && mkdir d && mv top.txt d/ && cat d/top.txt",
    )
    .await;
    assert_eq!(r["stdout"], "top\n", "{r}");
}

#[tokio::test]
async fn ordinary_commands_run_with_a_private_temporary_directory() {
    let rig = rig();
    let r = sh(
        &rig,
        "ls; printf 'b\\na\\nb\\n' | sort | uniq | wc -l; cat src/main.txt | tr a-z A-Z; \
         echo t > \"$TMPDIR/x\" && cat \"$TMPDIR/x\"; echo \"$TMPDIR\" > src/tmpdir; \
         test \"$HOME\" = \"$TMPDIR\" && echo home-ok; head -c 4 /dev/urandom | wc -c; \
         sh -c 'echo nested' 2>/dev/null",
    )
    .await;
    assert_eq!(r["exit_code"], 0, "{r}");
    let o = r["stdout"].as_str().unwrap();
    for expected in [
        "harness.yaml",
        "src",
        "2\n",
        "HELLO\n",
        "t\n",
        "home-ok\n",
        "4\n",
        "nested\n",
    ] {
        assert!(o.contains(expected), "missing {expected:?} in {o}");
    }
    // The temporary directory was private to the call and is gone after it.
    let tmp = std::fs::read_to_string(rig.root().join("src/tmpdir")).unwrap();
    let tmp = tmp.trim();
    assert!(tmp.contains("harness-shell-"), "{tmp}");
    assert!(!Path::new(tmp).exists(), "{tmp} outlived the call");
}

#[tokio::test]
async fn a_command_cannot_signal_the_harness() {
    let rig = rig();
    let pid = std::process::id();
    let r = sh(&rig, &format!("kill -0 {pid}")).await;
    assert!(failed(&r), "the command could signal the harness: {r}");
    // Its own processes it can.
    let r = sh(&rig, "sleep 5 & kill $! && wait $!; echo done").await;
    assert!(out(&r).contains("done"), "{r}");
}

/// Accepts one connection within `wait`, if any comes.
fn accepted(listener: &TcpListener, wait: Duration) -> bool {
    listener.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + wait;
    while Instant::now() < deadline {
        if let Ok((mut s, _)) = listener.accept() {
            let mut buf = String::new();
            let _ = s.set_nonblocking(false);
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let _ = s.read_to_string(&mut buf);
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[tokio::test]
async fn tcp_is_denied_unless_the_operator_allows_it() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let connect = format!("bash -c 'echo hi > /dev/tcp/127.0.0.1/{port}'");

    let rig = rig();
    let r = sh(&rig, &connect).await;
    assert!(failed(&r), "{r}");
    assert_eq!(r["confinement"]["network"], false);
    assert!(!accepted(&listener, Duration::from_millis(300)));

    let rig = rig_with(
        ShellPolicy {
            allow_network: true,
            ..ShellPolicy::default()
        },
        None,
    );
    let r = sh(&rig, &connect).await;
    assert_eq!(r["exit_code"], 0, "{r}");
    assert_eq!(r["confinement"]["network"], true);
    assert!(accepted(&listener, Duration::from_secs(5)));
    // Still confined on the filesystem.
    let r = sh(&rig, "cat harness.yaml").await;
    assert!(failed(&r) && !out(&r).contains(CONFIG), "{r}");
}

#[tokio::test]
async fn a_kernel_that_cannot_confine_refuses_unless_unconfined_is_accepted() {
    // No Landlock at all.
    let rig = rig_with(ShellPolicy::default(), Some(0));
    let e = rig.err("shell::exec", json!({"command": "echo hi"})).await;
    assert_eq!(e.code, "harness/sandbox_unavailable", "{e}");
    assert!(e.message.contains("shell_exec_unconfined"), "{e}");
    // Filesystem confinement but no network control, while the policy denies TCP.
    let rig = rig_with(ShellPolicy::default(), Some(3));
    let e = rig.err("shell::exec", json!({"command": "echo hi"})).await;
    assert_eq!(e.code, "harness/sandbox_unavailable", "{e}");
    assert!(e.message.contains("shell_exec_allow_network"), "{e}");
    // ... which is enough once the network is allowed.
    let rig = rig_with(
        ShellPolicy {
            allow_network: true,
            ..ShellPolicy::default()
        },
        Some(3),
    );
    let r = sh(&rig, "cat harness.yaml").await;
    assert_eq!(r["confinement"]["abi"], 3);
    assert!(failed(&r) && !out(&r).contains(CONFIG), "{r}");
    // The operator accepted running unconfined: it runs, says so, and really is unconfined.
    let rig = rig_with(
        ShellPolicy {
            unconfined: true,
            ..ShellPolicy::default()
        },
        Some(0),
    );
    let r = rig.exec("cat harness.yaml").await;
    assert_eq!(r["confinement"]["kind"], "namespaces", "{r}");
    assert!(out(&r).contains(CONFIG), "{r}");
}

/// Without a private PID namespace a command could read every process's environment through
/// `/proc`: refused like a kernel without Landlock, unless the operator accepted that.
#[tokio::test]
async fn no_pid_namespace_refuses_unless_unconfined_is_accepted() {
    let limits = |unconfined: bool| Limits {
        shell_policy: Arc::new(move || ShellPolicy {
            unconfined,
            ..ShellPolicy::default()
        }),
        pid_namespace: false,
        ..Limits::default()
    };
    let rig = support::Rig::with_limits(limits(false), |_| Vec::new());
    let e = rig.err("shell::exec", json!({"command": "echo hi"})).await;
    assert_eq!(e.code, "harness/sandbox_unavailable", "{e}");
    assert!(e.message.contains("PID namespace"), "{e}");
    assert!(e.message.contains("shell_exec_unconfined"), "{e}");
    let rig = support::Rig::with_limits(limits(true), |_| Vec::new());
    let r = rig.exec("echo hi").await;
    assert_eq!(r["stdout"], "hi\n");
    assert_eq!(r["confinement"]["kind"], "landlock", "{r}");
    assert_eq!(r["confinement"]["pid_namespace"], false, "{r}");
    assert_eq!(r["confinement"]["proc"], "host", "{r}");
    // Nothing confines it at all: still no capability left to a command of a root harness.
    let rig = support::Rig::with_limits(
        Limits {
            landlock_ceiling: Some(0),
            ..limits(true)
        },
        |_| Vec::new(),
    );
    let r = rig.exec("grep -E '^Cap(Eff|Bnd)' /proc/self/status").await;
    assert_eq!(r["confinement"]["kind"], "none", "{r}");
    // SAFETY: geteuid only returns a number.
    if unsafe { libc::geteuid() } == 0 {
        assert_eq!(r["confinement"]["capabilities"], "dropped", "{r}");
        let shown = out(&r);
        assert_eq!(shown.lines().count(), 2, "{r}");
        for line in shown.lines() {
            assert!(line.ends_with("0000000000000000"), "{line}");
        }
    }
}

/// An operator's extra read path (a toolchain, say) is readable and executable, not writable,
/// and a protected path beneath it stays unreadable.
#[tokio::test]
async fn extra_read_paths_are_readable_not_writable() {
    let shared = tempfile::tempdir().unwrap();
    let shared_path = std::fs::canonicalize(shared.path()).unwrap();
    std::fs::write(shared_path.join("tool.sh"), "echo tool-ran\n").unwrap();
    std::fs::create_dir_all(shared_path.join("private")).unwrap();
    std::fs::write(shared_path.join("private/harness.db"), STORE).unwrap();
    let policy = ShellPolicy {
        read_paths: vec![shared_path.clone()],
        ..ShellPolicy::default()
    };
    let limits = Limits {
        shell_policy: Arc::new(move || policy.clone()),
        ..Limits::default()
    };
    let protect = shared_path.join("private");
    let rig = Rig::with_limits(limits, move |_| vec![protect]);
    let s = shared_path.display();
    let r = sh(&rig, &format!("sh '{s}/tool.sh'")).await;
    assert_eq!(r["stdout"], "tool-ran\n", "{r}");
    let r = sh(&rig, &format!("echo x >> '{s}/tool.sh'")).await;
    assert!(failed(&r), "{r}");
    let r = sh(&rig, &format!("cat '{s}/private/harness.db'")).await;
    assert!(failed(&r) && !out(&r).contains(STORE), "{r}");
    assert_eq!(
        std::fs::read_to_string(shared_path.join("tool.sh")).unwrap(),
        "echo tool-ran\n"
    );
}

/// A session's grant adds read and write beneath it, and nothing beside it.
#[tokio::test]
async fn a_grant_is_writable_and_its_neighbours_are_not() {
    let rig = rig();
    let outside = rig.outside();
    let shared = outside.join("shared");
    std::fs::create_dir_all(&shared).unwrap();
    std::fs::write(shared.join("in.txt"), "granted\n").unwrap();
    let grants = vec![shared.clone()];
    let run = |command: String| {
        let rig = &rig;
        let grants = grants.clone();
        async move {
            let r = rig
                .ok_granted("shell::exec", json!({ "command": command }), &grants)
                .await;
            assert_eq!(r["confinement"]["kind"], "landlock", "{r}");
            r
        }
    };
    let r = run(format!(
        "cat '{0}/in.txt' && echo written > '{0}/out.txt' && mkdir '{0}/made'",
        shared.display()
    ))
    .await;
    assert_eq!(r["exit_code"], 0, "{r}");
    assert!(out(&r).contains("granted"), "{r}");
    assert_eq!(
        std::fs::read_to_string(shared.join("out.txt")).unwrap(),
        "written\n"
    );
    assert!(shared.join("made").is_dir());
    // The cwd may be the grant, by its absolute path.
    let r = rig
        .ok_granted(
            "shell::exec",
            json!({"command": "pwd && echo here > here.txt", "cwd": shared.display().to_string()}),
            &grants,
        )
        .await;
    assert_eq!(r["exit_code"], 0, "{r}");
    assert!(shared.join("here.txt").exists());
    for command in [
        format!("echo x > '{}/beside.txt'", outside.display()),
        format!("cat '{}/secret.txt'", outside.display()),
        format!("echo x > '{}/../up.txt'", shared.display()),
    ] {
        let r = run(command.clone()).await;
        assert!(failed(&r), "{command} succeeded: {r}");
        assert!(!out(&r).contains("TOP SECRET"), "{r}");
    }
    assert!(!outside.join("beside.txt").exists());
    assert!(!outside.join("up.txt").exists());
    // Without the grant the same write is refused.
    let r = sh(&rig, &format!("echo x > '{}/again.txt'", shared.display())).await;
    assert!(failed(&r), "{r}");
    assert!(!shared.join("again.txt").exists());
}
