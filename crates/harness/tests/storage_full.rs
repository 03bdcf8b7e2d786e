//! A full disk, for real: a `harness serve` whose data directory is a 3 MiB tmpfs the test
//! mounts (root only; skipped otherwise, with the reason printed). Filled up, the server
//! answers writes `507 harness/storage_full` (never 500), `/healthz` says degraded with the
//! reason, reads keep working; once the space is freed, writes succeed again by themselves,
//! `/healthz` is ok, every acknowledged send's message is in its transcript, every turn
//! completes, and the database passes `PRAGMA integrity_check` after a graceful stop.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    free_port, running_as_root, script, text_gen, text_of, Api, EventStream, Sessions, BIN, WAIT,
};
use serde_json::{json, Value};

/// A tmpfs mounted for the test; unmounted on drop, also when the test fails.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Result<Tmpfs, String> {
        std::fs::create_dir_all(at).map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
        }
        Ok(Tmpfs(at.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.0)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            // Still busy (a child that outlived a panic): detach it instead of leaking it.
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

/// The server child; SIGKILLed on drop if it was not stopped.
struct Serve {
    child: Option<Child>,
    log: PathBuf,
}

impl Serve {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, and wait for the graceful stop.
    fn stop(&mut self) {
        let mut child = self.child.take().expect("running");
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                assert!(status.success(), "serve stopped with {status}");
                return;
            }
            assert!(Instant::now() < deadline, "serve did not stop on SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- serve log ---\n{}\n---", self.log());
        }
    }
}

/// Writes zeros to `file` until the filesystem refuses more.
fn fill(file: &Path) {
    let mut f = std::fs::File::create(file).unwrap();
    let chunk = vec![0u8; 16 * 1024];
    loop {
        if let Err(e) = f.write_all(&chunk) {
            assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "filling: {e}");
            break;
        }
    }
    // Whatever fits in less than a chunk.
    while f.write_all(&[0u8; 512]).is_ok() {}
}

async fn healthz(api: &Api) -> (u16, Value) {
    let r = api.get("/healthz").await;
    (r.status().as_u16(), r.json().await.unwrap())
}

/// A send of `text`: Ok(answer) when acknowledged, Err((status, code)) otherwise.
async fn send(api: &Api, text: &str) -> Result<Value, (u16, String)> {
    let req = json!({"message": text, "model": "m", "provider": "scripted"});
    api.call("harness::send", req)
        .await
        .map_err(|e| (e.status, format!("{}: {}", e.code, e.message)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_is_named_survived_and_recovered_from() {
    if !running_as_root() {
        println!("skipped: mounting a small tmpfs needs root (euid is not 0)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let tmpfs = match Tmpfs::mount(&data, "3m") {
        Ok(t) => t,
        Err(e) => {
            println!("skipped: cannot mount a tmpfs at {}: {e}", data.display());
            return;
        }
    };
    let script_file = dir.path().join("script.json");
    std::fs::write(
        &script_file,
        // A reply streamed over a second or so: the first turns are still running (writing
        // their streamed reply, saving their steps) when the disk fills up.
        script(vec![text_gen(None, &"noted ".repeat(40), 30, true)]).to_string(),
    )
    .unwrap();
    let port = free_port();
    let log = dir.path().join("log");
    let child = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--data-dir",
        ])
        .arg(&data)
        .arg("--script")
        .arg(&script_file)
        .env_remove("HARNESS_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
        .spawn()
        .unwrap();
    let mut serve = Serve {
        child: Some(child),
        log,
    };
    let api = Api {
        base: format!("http://127.0.0.1:{port}"),
        client: reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap(),
    };
    let deadline = Instant::now() + WAIT;
    while !serve.log().contains("harness serving on") {
        assert!(Instant::now() < deadline, "serve did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(healthz(&api).await, (200, json!({"ok": true})));

    // Acknowledged sends: (session, turn, text).
    let mut acked: Vec<(String, String, String)> = Vec::new();
    let ack = |acked: &mut Vec<(String, String, String)>, v: &Value, text: &str| {
        acked.push((
            v["session_id"].as_str().unwrap().to_string(),
            v["turn_id"].as_str().unwrap().to_string(),
            text.to_string(),
        ));
    };
    for i in 0..3 {
        let text = format!("before the disk filled up {i}");
        let v = send(&api, &text).await.expect("a send with space");
        ack(&mut acked, &v, &text);
    }
    let (first_session, ..) = acked[0].clone();

    let filler = data.join("filler");
    fill(&filler);
    let mut running = 0;
    for (session, ..) in &acked {
        let status = api
            .ok("harness::status", json!({"session_id": session}))
            .await;
        running += usize::from(status["status"] == "running");
    }
    assert!(
        running > 0,
        "no turn was still running when the disk filled up"
    );
    println!("{running} turns running when the disk filled up");
    // Sends until one is refused for lack of space (the WAL may still hold some room).
    let mut refused = None;
    let deadline = Instant::now() + WAIT;
    for i in 0.. {
        let text = format!("while full {i}");
        match send(&api, &text).await {
            Ok(v) => ack(&mut acked, &v, &text),
            Err((status, code)) => {
                assert_eq!(status, 507, "a full disk is named: {code}");
                assert!(code.starts_with("harness/storage_full: "), "{code}");
                refused = Some(code);
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no send was refused on a full disk"
        );
    }
    println!("refused: {}", refused.unwrap());
    let (status, health) = healthz(&api).await;
    assert_eq!(status, 503, "{health}");
    assert_eq!(health["status"], "degraded", "{health}");
    assert!(
        health["reason"]
            .as_str()
            .unwrap_or("")
            .starts_with("harness/storage_full: "),
        "{health}"
    );
    // A second refusal: the first did not leave the server wedged into something else.
    let again = send(&api, "still full").await.unwrap_err();
    assert_eq!(again.0, 507, "{again:?}");

    // Reads keep working.
    let messages = api
        .ok(
            "session::messages",
            json!({"session_id": first_session, "limit": 100}),
        )
        .await;
    assert!(
        messages["messages"].as_array().is_some_and(|m| m
            .iter()
            .any(|e| text_of(e) == "before the disk filled up 0")),
        "{messages}"
    );
    api.ok("harness::status", json!({"session_id": first_session}))
        .await;
    let mut events = EventStream::open(&api.url(), &first_session, None).await;
    assert!(
        events
            .next_before(Instant::now() + Duration::from_secs(20))
            .await
            .is_some(),
        "the event stream reads while full"
    );
    drop(events);

    // Space returns: nothing is restarted, writes just succeed again.
    std::fs::remove_file(&filler).unwrap();
    let deadline = Instant::now() + WAIT;
    for i in 0.. {
        let text = format!("after the space returned {i}");
        match send(&api, &text).await {
            Ok(v) => {
                ack(&mut acked, &v, &text);
                break;
            }
            Err((status, code)) => assert_eq!(status, 507, "{code}"),
        }
        assert!(Instant::now() < deadline, "writes did not resume");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deadline = Instant::now() + WAIT;
    loop {
        let (status, health) = healthz(&api).await;
        if status == 200 {
            assert_eq!(health, json!({"ok": true}));
            break;
        }
        assert!(Instant::now() < deadline, "still degraded: {health}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Nothing acknowledged was lost, and every turn completes.
    for (session, turn, text) in &acked {
        let status = api.wait_turn(session, turn).await;
        assert_eq!(status["status"], "completed", "{session}: {status}");
        let transcript = api.transcript(session, false).await;
        let copies = transcript.iter().filter(|e| text_of(e) == *text).count();
        assert_eq!(
            copies, 1,
            "{session}: '{text}' {copies} times: {transcript:?}"
        );
        let replies = transcript
            .iter()
            .filter(|e| text_of(e).starts_with("noted"))
            .count();
        assert_eq!(replies, 1, "{session}: one reply each: {transcript:?}");
    }
    println!("{} acknowledged sends, all completed", acked.len());
    assert!(!serve.log().contains("harness/internal"), "{}", serve.log());

    serve.stop();
    let conn = rusqlite::Connection::open(data.join("harness.db")).unwrap();
    let check: String = conn
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(check, "ok");
    drop(conn);
    drop(serve);
    drop(tmpfs);
}
