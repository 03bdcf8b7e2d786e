//! One process per data directory, against the real binary: a second `harness serve` on a data
//! dir that another one has open stops at once and names the holder; once the holder is
//! SIGKILLed, the directory opens again (the kernel drops the lock with the process).

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// Starts `serve` on `server`'s data dir and script, and waits up to `WAIT` for it to exit.
/// `None`: it was still running (and is killed).
fn second_serve(server: &Server, port: u16) -> Option<(i32, String)> {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let mut child = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--data-dir",
        ])
        .arg(server.data_dir())
        .arg("--script")
        .arg(server.data_dir().parent().unwrap().join("script.json"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some((
                status.code().unwrap_or(-1),
                std::fs::read_to_string(&log).unwrap(),
            ));
        }
        let serving = std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("harness serving on");
        if serving || Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_on_a_data_dir_is_refused_until_the_first_is_gone() {
    let mut server = Server::start(&script(vec![text_gen(None, "hi", 0, true)]), &[]).await;
    let sent = server.send(None, "hello").await;
    let (sid, tid) = (
        sent["session_id"].as_str().unwrap().to_string(),
        sent["turn_id"].as_str().unwrap().to_string(),
    );
    server.wait_turn(&sid, &tid).await;

    let (code, log) =
        second_serve(&server, free_port()).expect("a second serve on the same data dir ran on");
    assert_ne!(code, 0, "{log}");
    assert!(log.contains("harness/store_in_use"), "{log}");
    assert!(
        log.contains(&format!("process {}", server.pid())),
        "the holder is named: {log}"
    );
    // The first one never noticed.
    server.assert_alive();
    assert_eq!(server.status(&sid).await["status"], "completed");

    // SIGKILL leaves no lock behind: the directory opens again, with what it held.
    server.restart().await;
    let again = server.send(Some(&sid), "again").await;
    let turn = again["turn_id"].as_str().unwrap().to_string();
    server.wait_turn(&sid, &turn).await;
    assert_eq!(server.transcript(&sid, false).await.len(), 4);
}
