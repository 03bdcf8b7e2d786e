//! Writer batching, savepoint isolation, visibility and the durability barrier.

use std::pin::pin;
use std::sync::Arc;

use futures::poll;
use harness_store::{kv_get_in, kv_set_in, Durability, Store, StoreError};
use serde_json::json;

fn open(dir: &tempfile::TempDir, durability: Durability) -> Store {
    Store::open(&dir.path().join("nested/dir/store.db"), durability).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolved_write_is_visible_to_read() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, Durability::Normal);
    for i in 0..200 {
        store
            .write(move |c| kv_set_in(c, "s", &format!("k{i}"), &json!(i)))
            .await
            .unwrap();
        let seen = store.read(|c| kv_get_in(c, "s", &format!("k{i}"))).unwrap();
        assert_eq!(seen, Some(json!(i)));
    }
    assert!(store.path().ends_with("store.db"));
    assert_eq!(store.durability(), Durability::Normal);
}

/// Parks the writer inside an op until released, so later ops are queued into one batch.
async fn park_writer(store: &Store) -> (std::sync::mpsc::Sender<()>, tokio::task::JoinHandle<()>) {
    let (entered_tx, entered_rx) = tokio::sync::oneshot::channel::<()>();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let s = store.clone();
    let gate = tokio::spawn(async move {
        s.write(move |_| {
            let _ = entered_tx.send(());
            let _ = release_rx.recv();
            Ok(())
        })
        .await
        .unwrap();
    });
    entered_rx.await.unwrap();
    (release_tx, gate)
}

#[tokio::test]
async fn failing_op_rolls_back_only_itself() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, Durability::Normal);
    let (release, gate) = park_writer(&store).await;
    let before = store.stats().commits;

    let mut a = pin!(store.write(|c| kv_set_in(c, "s", "a", &json!(1))));
    let mut b = pin!(store.write(|c| {
        kv_set_in(c, "s", "b", &json!(2))?;
        Err::<(), _>(StoreError::Invalid("b fails after writing".into()))
    }));
    let mut p = pin!(store.write(|c| -> Result<(), StoreError> {
        kv_set_in(c, "s", "p", &json!(3))?;
        panic!("p panics after writing")
    }));
    let mut d = pin!(store.write(|c| kv_set_in(c, "s", "d", &json!(4))));
    // Polling once sends each op to the writer, which is parked: all four share the next batch.
    assert!(poll!(a.as_mut()).is_pending());
    assert!(poll!(b.as_mut()).is_pending());
    assert!(poll!(p.as_mut()).is_pending());
    assert!(poll!(d.as_mut()).is_pending());
    release.send(()).unwrap();
    gate.await.unwrap();

    assert!(a.await.is_ok());
    assert!(matches!(b.await, Err(StoreError::Invalid(m)) if m.contains("b fails")));
    assert!(matches!(p.await, Err(StoreError::Invalid(m)) if m.contains("panicked")));
    assert!(d.await.is_ok());
    assert_eq!(
        store.stats().commits,
        before + 2,
        "gate batch + one batch for a, b, p, d"
    );
    let listed: Vec<String> = store
        .kv_list("s")
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(listed, vec!["a", "d"]);
    // The writer survived the panic.
    store.kv_set("s", "after", &json!(true)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writes_are_group_committed() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, Durability::Normal);
    let base = store.stats();
    let mut tasks = Vec::new();
    for i in 0..100 {
        let s = store.clone();
        tasks.push(tokio::spawn(async move {
            s.kv_set("c", &format!("{i:03}"), &json!(i)).await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let stats = store.stats();
    assert_eq!(stats.writes - base.writes, 100);
    let commits = stats.commits - base.commits;
    assert!(
        commits < 100,
        "expected grouping, got {commits} commits for 100 writes"
    );
    assert_eq!(store.kv_list("c").unwrap().len(), 100);
}

#[tokio::test]
async fn barrier_fsyncs_in_full_mode_only_when_needed() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, Durability::Full);
    store.kv_set("s", "k", &json!(1)).await.unwrap();
    store.barrier().await.unwrap();
    assert_eq!(store.stats().fsyncs, 1);
    store.barrier().await.unwrap();
    assert_eq!(store.stats().fsyncs, 1, "nothing new committed: no fsync");
    store.kv_set("s", "k", &json!(2)).await.unwrap();
    store.barrier().await.unwrap();
    assert_eq!(store.stats().fsyncs, 2);
}

#[tokio::test]
async fn barrier_never_fsyncs_in_normal_mode() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, Durability::Normal);
    for i in 0..10 {
        store.kv_set("s", "k", &json!(i)).await.unwrap();
        store.barrier().await.unwrap();
    }
    assert_eq!(store.stats().fsyncs, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_barriers_share_fsyncs() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, Durability::Full);
    let start = Arc::new(tokio::sync::Barrier::new(100));
    let mut tasks = Vec::new();
    for i in 0..100 {
        let (s, start) = (store.clone(), start.clone());
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            s.kv_set("b", &format!("{i}"), &json!(i)).await.unwrap();
            s.barrier().await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let fsyncs = store.stats().fsyncs;
    assert!(
        (1..=25).contains(&fsyncs),
        "100 barriers took {fsyncs} fsyncs"
    );
}

#[tokio::test]
async fn calls_after_close_return_closed() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, Durability::Full);
    store.kv_set("s", "k", &json!(1)).await.unwrap();
    let clone = store.clone();
    store.close();
    assert!(matches!(
        clone.kv_set("s", "k", &json!(2)).await,
        Err(StoreError::Closed)
    ));
    assert!(matches!(clone.barrier().await, Err(StoreError::Closed)));
    // Reopening sees the committed data.
    let again = Store::open(store.path(), Durability::Full).unwrap();
    assert_eq!(again.kv_get("s", "k").unwrap(), Some(json!(1)));
}

#[tokio::test]
async fn read_closure_leaving_a_transaction_open_does_not_pin_a_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, Durability::Normal);
    store.kv_set("s", "k", &json!(1)).await.unwrap();
    store
        .read(|c| {
            c.execute_batch("BEGIN")?;
            kv_get_in(c, "s", "k")
        })
        .unwrap();
    store.kv_set("s", "k", &json!(2)).await.unwrap();
    assert_eq!(store.kv_get("s", "k").unwrap(), Some(json!(2)));
}
