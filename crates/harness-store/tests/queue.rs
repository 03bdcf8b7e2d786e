//! Durable FIFO queue semantics: ordering, exclusivity, parallelism, retries, dead letters,
//! leases, prompt wake-up and redelivery after a crash.

mod common;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt;
use harness_store::{
    enqueue_in, enqueue_text_in, Durability, QueueConfig, QueueHandler, QueueMessage, Queues, Store,
};
use serde_json::json;
use tokio::sync::mpsc;

const DEADLINE: Duration = Duration::from_secs(10);

fn handler<F, Fut>(f: F) -> QueueHandler
where
    F: Fn(QueueMessage) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), String>> + Send + 'static,
{
    Arc::new(move |m| f(m).boxed())
}

/// A handler that sends what `report` reads off each delivery to `tx` once the delivery runs,
/// then lets `outcome` decide it: most tests watch deliveries rather than their effects.
fn reporting<T, R, O, Fut>(tx: mpsc::UnboundedSender<T>, report: R, outcome: O) -> QueueHandler
where
    T: Send + 'static,
    R: Fn(&QueueMessage) -> T + Send + Sync + 'static,
    O: Fn(QueueMessage) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), String>> + Send + 'static,
{
    handler(move |m| {
        let (tx, seen) = (tx.clone(), report(&m));
        let decided = outcome(m);
        async move {
            let _ = tx.send(seen);
            decided.await
        }
    })
}

async fn acks(_: QueueMessage) -> Result<(), String> {
    Ok(())
}

/// Stands in for a handler that hangs: only an abort, a shutdown or a crash ends it.
async fn never_finishes(_: QueueMessage) -> Result<(), String> {
    futures::future::pending::<()>().await;
    Ok(())
}

fn setup(durability: Durability) -> (tempfile::TempDir, Store, Queues) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("q.db"), durability).unwrap();
    let queues = Queues::new(store.clone());
    (dir, store, queues)
}

fn fast(concurrency: usize, max_retries: u32) -> QueueConfig {
    QueueConfig {
        concurrency,
        max_retries,
        backoff_ms: 1,
        visibility_timeout_ms: 60_000,
    }
}

async fn recv<T>(rx: &mut mpsc::UnboundedReceiver<T>) -> T {
    tokio::time::timeout(DEADLINE, rx.recv())
        .await
        .expect("timed out waiting for the handler")
        .expect("channel closed")
}

/// Polls `cond` until it holds or the deadline passes.
async fn eventually(what: &str, cond: impl Fn() -> bool) {
    let end = Instant::now() + DEADLINE;
    while !cond() {
        assert!(Instant::now() < end, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn rows(store: &Store) -> i64 {
    store
        .read(|c| Ok(c.query_row("SELECT COUNT(*) FROM queue_messages", [], |r| r.get(0))?))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_per_group_exclusive_under_concurrency() {
    let (_dir, store, queues) = setup(Durability::Full);
    queues.define("q", fast(4, 3));
    let order: Arc<Mutex<HashMap<String, Vec<i64>>>> = Arc::default();
    let active: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let violations = Arc::new(AtomicUsize::new(0));
    let (done_tx, mut done_rx) = mpsc::unbounded_channel();
    {
        let (order, active, violations) = (order.clone(), active.clone(), violations.clone());
        queues.start(
            "q",
            handler(move |m| {
                let (order, active, violations, done) = (
                    order.clone(),
                    active.clone(),
                    violations.clone(),
                    done_tx.clone(),
                );
                async move {
                    {
                        let mut a = active.lock().unwrap();
                        let n = a.entry(m.group.clone()).or_default();
                        *n += 1;
                        if *n > 1 {
                            violations.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    for _ in 0..3 {
                        tokio::task::yield_now().await;
                    }
                    order
                        .lock()
                        .unwrap()
                        .entry(m.group.clone())
                        .or_default()
                        .push(m.payload["seq"].as_i64().unwrap());
                    *active.lock().unwrap().get_mut(&m.group).unwrap() -= 1;
                    let _ = done.send(());
                    Ok(())
                }
            }),
        );
    }
    let (groups, per_group) = (8, 30);
    let mut producers = Vec::new();
    for g in 0..groups {
        let queues = queues.clone();
        producers.push(tokio::spawn(async move {
            for seq in 0..per_group {
                queues
                    .enqueue("q", &format!("g{g}"), "f", &json!({ "seq": seq }))
                    .await
                    .unwrap();
            }
        }));
    }
    for p in producers {
        p.await.unwrap();
    }
    for _ in 0..groups * per_group {
        recv(&mut done_rx).await;
    }
    assert_eq!(
        violations.load(Ordering::SeqCst),
        0,
        "two messages of one group overlapped"
    );
    let order = order.lock().unwrap().clone();
    assert_eq!(order.len(), groups as usize);
    for (g, seqs) in order.iter() {
        assert_eq!(
            *seqs,
            (0..per_group).collect::<Vec<i64>>(),
            "group {g} out of order"
        );
    }
    eventually("all acks", || queues.depth("q") == 0 && rows(&store) == 0).await;
    assert!(store.stats().fsyncs >= 1, "acks went through the barrier");
    queues.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_run_in_parallel() {
    let (_dir, _store, queues) = setup(Durability::Normal);
    // Both handlers must be inside the rendezvous at the same time to get out of it.
    let rendezvous = Arc::new(tokio::sync::Barrier::new(2));
    let (done_tx, mut done_rx) = mpsc::unbounded_channel();
    {
        let rendezvous = rendezvous.clone();
        queues.start(
            "q",
            handler(move |m| {
                let (rendezvous, done) = (rendezvous.clone(), done_tx.clone());
                async move {
                    rendezvous.wait().await;
                    let _ = done.send(m.group);
                    Ok(())
                }
            }),
        );
    }
    queues.enqueue("q", "a", "f", &json!(1)).await.unwrap();
    queues.enqueue("q", "b", "f", &json!(2)).await.unwrap();
    let mut got = vec![recv(&mut done_rx).await, recv(&mut done_rx).await];
    got.sort();
    assert_eq!(got, ["a", "b"]);
    queues.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_group_waits_for_the_in_flight_message() {
    let (_dir, _store, queues) = setup(Durability::Normal);
    let (started_tx, mut started_rx) = mpsc::unbounded_channel::<i64>();
    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
    let release_rx = Arc::new(Mutex::new(Some(release_rx)));
    queues.start(
        "q",
        reporting(
            started_tx,
            |m| m.payload.as_i64().unwrap(),
            move |m| {
                let release = release_rx.clone();
                async move {
                    if m.payload == json!(1) {
                        let rx = release.lock().unwrap().take().unwrap();
                        let _ = rx.await;
                    }
                    Ok(())
                }
            },
        ),
    );
    queues.enqueue("q", "a", "f", &json!(1)).await.unwrap();
    assert_eq!(recv(&mut started_rx).await, 1);
    queues.enqueue("q", "a", "f", &json!(2)).await.unwrap();
    // Another group flows through while message 1 is held: the dispatcher is live, yet 2 waits.
    queues.enqueue("q", "b", "f", &json!(10)).await.unwrap();
    assert_eq!(recv(&mut started_rx).await, 10);
    assert!(
        started_rx.try_recv().is_err(),
        "message 2 ran while 1 was in flight"
    );
    // Once b's ack lands: 1 in flight + 2 pending.
    eventually("b acked", || queues.depth("q") == 2).await;
    assert!(started_rx.try_recv().is_err());
    release_tx.send(()).unwrap();
    assert_eq!(recv(&mut started_rx).await, 2);
    queues.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_then_success() {
    let (_dir, store, queues) = setup(Durability::Normal);
    queues.define("q", fast(8, 3));
    let (tx, mut rx) = mpsc::unbounded_channel();
    queues.start(
        "q",
        reporting(
            tx,
            |m| m.attempt,
            |m| async move {
                if m.attempt < 3 {
                    Err(format!("fail {}", m.attempt))
                } else {
                    Ok(())
                }
            },
        ),
    );
    queues.enqueue("q", "g", "f", &json!({})).await.unwrap();
    assert_eq!(
        [
            recv(&mut rx).await,
            recv(&mut rx).await,
            recv(&mut rx).await
        ],
        [1, 2, 3]
    );
    eventually("ack", || rows(&store) == 0 && queues.depth("q") == 0).await;
    assert!(queues.dead_letters("q").unwrap().is_empty());
    queues.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_after_max_retries_then_group_moves_on() {
    let (_dir, store, queues) = setup(Durability::Normal);
    queues.define("q", fast(8, 2));
    let (tx, mut rx) = mpsc::unbounded_channel();
    queues.start(
        "q",
        reporting(
            tx,
            |m| (m.payload.as_str().unwrap().to_string(), m.attempt),
            |m| async move {
                if m.payload == json!("poison") {
                    Err("always fails".to_string())
                } else {
                    Ok(())
                }
            },
        ),
    );
    let poison = queues
        .enqueue("q", "g", "f", &json!("poison"))
        .await
        .unwrap();
    queues.enqueue("q", "g", "f", &json!("next")).await.unwrap();
    for attempt in 1..=3 {
        assert_eq!(recv(&mut rx).await, ("poison".to_string(), attempt));
    }
    assert_eq!(recv(&mut rx).await, ("next".to_string(), 1));
    let dead = queues.dead_letters("q").unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].id, dead[0].attempt), (poison, 3));
    let last_error: String = store
        .read(|c| {
            Ok(c.query_row(
                "SELECT last_error FROM queue_messages WHERE id = ?1",
                [poison],
                |r| r.get(0),
            )?)
        })
        .unwrap();
    assert_eq!(last_error, "always fails");
    eventually("ack of next", || {
        queues.depth("q") == 0 && rows(&store) == 1
    })
    .await;
    queues.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn visibility_timeout_aborts_hung_handler_and_panics_are_failures() {
    let (_dir, store, queues) = setup(Durability::Normal);
    queues.define(
        "q",
        QueueConfig {
            visibility_timeout_ms: 100,
            ..fast(8, 5)
        },
    );
    struct DropSignal(Option<tokio::sync::oneshot::Sender<()>>);
    impl Drop for DropSignal {
        fn drop(&mut self) {
            if let Some(tx) = self.0.take() {
                let _ = tx.send(());
            }
        }
    }
    let (dropped_tx, dropped_rx) = tokio::sync::oneshot::channel::<()>();
    let dropped_tx = Arc::new(Mutex::new(Some(dropped_tx)));
    let (tx, mut rx) = mpsc::unbounded_channel();
    queues.start(
        "q",
        reporting(
            tx,
            |m| (m.payload.clone(), m.attempt),
            move |m| {
                let dropped_tx = dropped_tx.clone();
                async move {
                    match (m.payload.as_str().unwrap(), m.attempt) {
                        ("hang", 1) => {
                            let _signal = DropSignal(dropped_tx.lock().unwrap().take());
                            futures::future::pending::<()>().await;
                            unreachable!()
                        }
                        ("panic", 1) => panic!("handler bug"),
                        _ => Ok(()),
                    }
                }
            },
        ),
    );
    queues.enqueue("q", "h", "f", &json!("hang")).await.unwrap();
    queues
        .enqueue("q", "p", "f", &json!("panic"))
        .await
        .unwrap();
    let mut seen = Vec::new();
    for _ in 0..4 {
        seen.push(recv(&mut rx).await);
    }
    seen.sort_by_key(|(p, a)| (p.to_string(), *a));
    assert_eq!(
        seen,
        vec![
            (json!("hang"), 1),
            (json!("hang"), 2),
            (json!("panic"), 1),
            (json!("panic"), 2)
        ]
    );
    tokio::time::timeout(DEADLINE, dropped_rx)
        .await
        .expect("hung handler was not aborted")
        .unwrap();
    eventually("acks", || rows(&store) == 0).await;
    queues.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_wakes_an_idle_dispatcher_promptly() {
    let (_dir, store, queues) = setup(Durability::Full);
    let (tx, mut rx) = mpsc::unbounded_channel();
    queues.start("q", reporting(tx, |m| (m.id, Instant::now()), acks));
    queues.enqueue("q", "g", "f", &json!(0)).await.unwrap();
    recv(&mut rx).await;
    eventually("idle", || queues.depth("q") == 0).await;

    // Idle now. A direct enqueue is picked up at once (a poll interval would show here).
    let t0 = Instant::now();
    let id = queues.enqueue("q", "g", "f", &json!(1)).await.unwrap();
    let (got, at) = recv(&mut rx).await;
    assert_eq!(got, id);
    let latency = at - t0;
    assert!(
        latency < Duration::from_millis(250),
        "wake-up took {latency:?}"
    );

    // enqueue_in inside a caller's write + wake.
    let t0 = Instant::now();
    let id = store
        .write(|c| enqueue_in(c, "q", "g2", "f", &json!(2)))
        .await
        .unwrap();
    queues.wake("q").unwrap();
    let (got, at) = recv(&mut rx).await;
    assert_eq!(got, id);
    assert!(at - t0 < Duration::from_millis(250));
    queues.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacked_messages_are_redelivered_after_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q.db");
    {
        let store = Store::open(&path, Durability::Full).unwrap();
        let queues = Queues::new(store.clone());
        for i in 0..3 {
            queues.enqueue("q", "g", "f", &json!(i)).await.unwrap();
        }
        queues
            .enqueue("q", "other", "f", &json!(100))
            .await
            .unwrap();
        assert_eq!(queues.depth("q"), 4, "enqueue before start is indexed");
        // Start with a handler that takes message 0 and never finishes; then "crash".
        let (tx, mut rx) = mpsc::unbounded_channel();
        queues.start("q", reporting(tx, |m| m.id, never_finishes));
        recv(&mut rx).await;
        recv(&mut rx).await;
        // Dropping everything without acking stands in for the process dying.
        drop(queues);
        drop(store);
    }
    let store = Store::open(&path, Durability::Full).unwrap();
    assert_eq!(rows(&store), 4, "nothing was acked");
    let queues = Queues::new(store.clone());
    let (tx, mut rx) = mpsc::unbounded_channel();
    queues.start(
        "q",
        reporting(
            tx,
            |m| (m.group.clone(), m.payload.as_i64().unwrap(), m.attempt),
            acks,
        ),
    );
    let mut got = Vec::new();
    for _ in 0..4 {
        got.push(recv(&mut rx).await);
    }
    let g: Vec<i64> = got.iter().filter(|m| m.0 == "g").map(|m| m.1).collect();
    assert_eq!(g, [0, 1, 2], "redelivered in order");
    assert!(
        got.iter().all(|m| m.2 == 1),
        "a crash is not a counted failure"
    );
    eventually("acks", || rows(&store) == 0).await;
    queues.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_leaves_in_flight_rows_for_redelivery() {
    let (_dir, store, queues) = setup(Durability::Normal);
    let (tx, mut rx) = mpsc::unbounded_channel();
    queues.start("q", reporting(tx, |m| m.id, never_finishes));
    queues.enqueue("q", "g", "f", &json!(1)).await.unwrap();
    recv(&mut rx).await;
    let t0 = Instant::now();
    queues.shutdown().await;
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "shutdown waited for a hung handler"
    );
    assert_eq!(rows(&store), 1);
    // A second start after shutdown is ignored.
    queues.start("q", handler(acks));
    assert_eq!(rows(&store), 1);
}

/// The writer hands the rows it inserts to the next wake of their queue; rows from before a
/// restart are read from the table. Either way, with two queues' ids interleaved and a write
/// that enqueued and then failed, every committed message is delivered once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_from_before_and_after_a_restart_are_each_delivered_once_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q.db");
    let both = |i: i64| {
        move |c: &harness_store::Connection| {
            enqueue_in(c, "a", "g", "f", &json!(i))?;
            enqueue_in(c, "b", "g", "f", &json!(i))?;
            Ok(())
        }
    };
    {
        let store = Store::open(&path, Durability::Normal).unwrap();
        for i in 0..3 {
            store.write(both(i)).await.unwrap();
        }
    }
    let store = Store::open(&path, Durability::Normal).unwrap();
    let queues = Queues::new(store.clone());
    let (tx, mut rx) = mpsc::unbounded_channel();
    for q in ["a", "b"] {
        queues.define(q, fast(1, 3));
        queues.start(
            q,
            reporting(
                tx.clone(),
                |m| (m.queue.clone(), m.payload.as_i64().unwrap(), m.attempt),
                acks,
            ),
        );
    }
    for i in 3..6 {
        // Rolled back whole: its rows are never delivered.
        let failed = store
            .write(move |c| {
                both(100 + i)(c)?;
                Err::<(), _>(harness_store::StoreError::Invalid("undone".into()))
            })
            .await;
        assert!(failed.is_err());
        store.write(both(i)).await.unwrap();
        queues.wake("a").unwrap();
        queues.wake("b").unwrap();
    }
    let mut got: HashMap<String, Vec<i64>> = HashMap::new();
    for _ in 0..12 {
        let (q, n, attempt) = recv(&mut rx).await;
        assert_eq!(attempt, 1);
        got.entry(q).or_default().push(n);
    }
    assert_eq!(got["a"], [0, 1, 2, 3, 4, 5]);
    assert_eq!(got["b"], [0, 1, 2, 3, 4, 5]);
    eventually("acks", || rows(&store) == 0).await;
    // Nothing is delivered twice.
    queues.wake("a").unwrap();
    queues.wake("b").unwrap();
    queues.shutdown().await;
    assert!(rx.try_recv().is_err());
}

/// Three rows of group "g" in one write: JSON 1, a payload that is not JSON, JSON 3.
fn good_bad_good(c: &harness_store::Connection) -> Result<(), harness_store::StoreError> {
    enqueue_text_in(c, "q", "g", "f", "1")?;
    enqueue_text_in(c, "q", "g", "f", "not json")?;
    enqueue_text_in(c, "q", "g", "f", "3")?;
    Ok(())
}

/// The one dead letter a row that is not JSON leaves, once the rows around it are delivered.
async fn assert_only_the_bad_row_is_dead(store: &Store, queues: &Queues) {
    eventually("the bad row dead, the good ones acked", || {
        rows(store) == 1 && queues.depth("q") == 0
    })
    .await;
    let dead = queues.dead_letters("q").unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].payload, json!("not json"), "kept as its text");
    assert_eq!(dead[0].attempt, 1, "dead at once, not retried");
    let error: String = store
        .read(|c| {
            Ok(c.query_row(
                "SELECT last_error FROM queue_messages WHERE id = ?1",
                [dead[0].id],
                |r| r.get(0),
            )?)
        })
        .unwrap();
    assert!(error.starts_with("payload is not JSON"), "{error}");
}

/// Rows the writer hands to the wake: one that is not JSON neither loses the others (they were
/// taken from the inbox before any payload was parsed) nor blocks the group behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handed_over_row_that_is_not_json_is_dead_lettered_and_the_others_delivered() {
    let (_dir, store, queues) = setup(Durability::Normal);
    queues.define("q", fast(4, 3));
    let (tx, mut rx) = mpsc::unbounded_channel();
    queues.start("q", reporting(tx, |m| m.payload.clone(), acks));
    store.write(good_bad_good).await.unwrap();
    queues.wake("q").unwrap();
    assert_eq!(recv(&mut rx).await, json!(1));
    assert_eq!(recv(&mut rx).await, json!(3));
    assert_only_the_bad_row_is_dead(&store, &queues).await;
    // The queue goes on serving what the writer hands over.
    queues.enqueue("q", "g", "f", &json!(4)).await.unwrap();
    assert_eq!(recv(&mut rx).await, json!(4));
    queues.shutdown().await;
    assert!(
        rx.try_recv().is_err(),
        "the bad row never reached the handler"
    );
}

/// The same rows read from the table (inserted before the store was opened).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_in_the_table_that_is_not_json_is_dead_lettered_and_the_others_delivered() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q.db");
    {
        let store = Store::open(&path, Durability::Normal).unwrap();
        store.write(good_bad_good).await.unwrap();
    }
    let store = Store::open(&path, Durability::Normal).unwrap();
    let queues = Queues::new(store.clone());
    queues.define("q", fast(4, 3));
    let (tx, mut rx) = mpsc::unbounded_channel();
    queues.start("q", reporting(tx, |m| m.payload.clone(), acks));
    assert_eq!(recv(&mut rx).await, json!(1));
    assert_eq!(recv(&mut rx).await, json!(3));
    assert_only_the_bad_row_is_dead(&store, &queues).await;
    queues.shutdown().await;
    assert!(
        rx.try_recv().is_err(),
        "the bad row never reached the handler"
    );
}

/// A second `Queues` on one store reads the table: it cannot take the rows the writer hands to
/// the first one, which would then never see them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_queues_on_one_store_cannot_take_the_first_ones_rows() {
    let (_dir, store, first) = setup(Durability::Normal);
    let second = Queues::new(store.clone());
    let (tx, mut rx) = mpsc::unbounded_channel();
    first.start("q", reporting(tx, |m| m.payload.clone(), acks));
    store
        .write(|c| enqueue_in(c, "q", "g", "f", &json!(1)))
        .await
        .unwrap();
    second.wake("q").unwrap();
    assert_eq!(
        second.depth("q"),
        1,
        "the second one read the row from the table"
    );
    first.wake("q").unwrap();
    assert_eq!(recv(&mut rx).await, json!(1));
    first.shutdown().await;
}

/// The `Queues` that comes after a dropped one reads the table first: rows the old one had taken
/// over from the writer but not delivered are still delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queues_after_a_dropped_one_delivers_the_rows_it_had_taken() {
    let (_dir, store, old) = setup(Durability::Normal);
    old.enqueue("q", "g", "f", &json!(1)).await.unwrap();
    assert_eq!(old.depth("q"), 1, "taken over by the old one");
    drop(old);
    let queues = Queues::new(store.clone());
    let (tx, mut rx) = mpsc::unbounded_channel();
    queues.start("q", reporting(tx, |m| m.payload.clone(), acks));
    assert_eq!(recv(&mut rx).await, json!(1));
    // And it takes over the writer's rows from then on.
    queues.enqueue("q", "g", "f", &json!(2)).await.unwrap();
    assert_eq!(recv(&mut rx).await, json!(2));
    queues.shutdown().await;
}

/// Enqueues one message in a write of its own and returns its id.
async fn enqueue_one(store: &Store, n: i64) -> i64 {
    store
        .write(move |c| enqueue_in(c, "ids", "g", "f", &json!(n)))
        .await
        .unwrap()
}

/// Queue ids are consecutive within a process (a rolled-back enqueue gives its id back), never
/// used twice, even after every row was deleted and the process killed, and the reservation in
/// `sqlite_sequence` is written once for many enqueues, not by each commit.
#[tokio::test]
async fn queue_ids_are_never_reused_and_sqlite_sequence_is_written_once_per_reservation() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q.db");
    let store = Store::open(&path, Durability::Normal).unwrap();
    let first = enqueue_one(&store, 0).await;
    let failed = store
        .write(|c| {
            enqueue_in(c, "ids", "g", "f", &json!("rolled back"))?;
            Err::<(), _>(harness_store::StoreError::Invalid("on purpose".into()))
        })
        .await;
    assert!(failed.is_err());
    store.record_wal_pages(true);
    let mut ids = vec![first];
    for n in 1..40 {
        ids.push(enqueue_one(&store, n).await);
    }
    let pages = store.wal_pages_by_table().unwrap();
    store.record_wal_pages(false);
    assert_eq!(ids, (first..first + 40).collect::<Vec<_>>(), "consecutive");
    assert!(pages.pages() >= 40, "{:?}", pages.by_table);
    assert!(
        !pages.by_table.iter().any(|(t, _)| t == "sqlite_sequence"),
        "40 commits that enqueue, none writes sqlite_sequence: {:?}",
        pages.by_table
    );

    // Every row acked (deleted), then what a SIGKILL leaves: the next id is still a new one.
    store
        .write(|c| Ok(c.execute("DELETE FROM queue_messages", [])?))
        .await
        .unwrap();
    let last = *ids.last().unwrap();
    let crashed = common::killed_copy(&path);
    store.close();
    let reopened = Store::open(&crashed, Durability::Normal).unwrap();
    let next = enqueue_one(&reopened, 99).await;
    assert!(next > last, "{next} after {last}");
    assert_eq!(enqueue_one(&reopened, 100).await, next + 1);
}
