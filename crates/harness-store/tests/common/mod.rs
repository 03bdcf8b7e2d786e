//! Helpers shared by the store's test files.

#![allow(dead_code)] // each test binary uses a different part of it

use futures::poll;
use harness_store::Store;

/// The keys of a kv scope, in the store's order.
pub fn kv_keys(store: &Store, scope: &str) -> Vec<String> {
    store
        .kv_list(scope)
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .collect()
}

/// Parks the writer inside an op until released, so later ops are queued into one batch.
pub async fn park_writer(
    store: &Store,
) -> (std::sync::mpsc::Sender<()>, tokio::task::JoinHandle<()>) {
    let (entered_tx, entered_rx) = tokio::sync::oneshot::channel::<()>();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let s = store.clone();
    let gate = tokio::spawn(async move {
        // Not unwrapped: the ops queued behind the gate may run in its transaction (see
        // `one_batch`), and one that loses that transaction loses the gate's write with it.
        let _ = s
            .write(move |_| {
                let _ = entered_tx.send(());
                let _ = release_rx.recv();
                Ok(())
            })
            .await;
    });
    entered_rx.await.unwrap();
    (release_tx, gate)
}

/// Queues `ops` behind a parked writer so that they all run in one batch, then releases it.
pub async fn one_batch<T>(
    store: &Store,
    ops: Vec<std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + '_>>>,
) -> Vec<T> {
    let (release, gate) = park_writer(store).await;
    let before = store.stats().commits;
    let mut ops = ops;
    for op in ops.iter_mut() {
        assert!(poll!(op.as_mut()).is_pending());
    }
    release.send(()).unwrap();
    gate.await.unwrap();
    let mut out = Vec::new();
    for op in ops {
        out.push(op.await);
    }
    // Every op was queued before the gate's op returned, so they all run in one transaction:
    // the gate's own (a batch takes in what arrived while it ran, unless it ran for longer
    // than the writer lets a batch grow) or the next one.
    let commits = store.stats().commits - before;
    assert!(
        commits == 1 || commits == 2,
        "the gate's batch and every op in one or two transactions, not {commits}"
    );
    out
}

/// Runs this test binary's `child` test alone in a process of its own, with `env` naming its
/// database `db`, its stdout piped to the caller (what it reports) and its stderr dropped: the
/// process a crash test SIGKILLs.
pub fn spawn_child(child: &str, env: &str, db: &std::path::Path) -> std::process::Child {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args([child, "--exact", "--nocapture", "--test-threads=1"])
        .env(env, db)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

/// A copy of the database at `path` and its WAL as they are now, beside it: what a SIGKILL
/// of the process writing it would leave (committed, nothing folded or checkpointed since).
pub fn killed_copy(path: &std::path::Path) -> std::path::PathBuf {
    let copy = path.with_extension("killed.db");
    std::fs::copy(path, &copy).unwrap();
    let wal = |p: &std::path::Path| {
        let mut s = p.as_os_str().to_owned();
        s.push("-wal");
        std::path::PathBuf::from(s)
    };
    std::fs::copy(wal(path), wal(&copy)).unwrap();
    copy
}
