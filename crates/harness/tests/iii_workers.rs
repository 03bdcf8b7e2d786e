//! Several `harness worker` processes on one engine (the double, or a real engine with
//! `III_BIN`): one serves, the others stand by and take the sessions over when it dies; a
//! turn record written by a worker that lost its session is refused (the fence).
#![cfg(feature = "iii")]

mod iii_engine;
#[path = "common/iii_scenarios.rs"]
mod iii_scenarios;
#[path = "common/scripts.rs"]
mod scripts;

use std::time::{Duration, Instant};

use harness_bus::Bus;
use harness_iii::{IiiBus, IiiOptions, FENCED_SCOPE, LEASE_SCOPE};
use iii_engine::worker::{Sessions, WorkerProc};
use iii_engine::Engine;
use iii_scenarios::{start_slow_work, wait_until};
use scripts::*;
use serde_json::json;

/// Two workers on one engine, sharing a data dir: the second stands by while the first
/// serves. The first is SIGKILLed in the middle of a function call; the second takes the
/// sessions over and finishes the turn within 5 s: the call ran once and is closed once (as
/// interrupted), the user's message is there once, and a session the first worker finished
/// before is still readable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_worker_s_turns_are_finished_by_the_standby_within_5s_and_nothing_runs_twice() {
    let engine = Engine::start().await;
    let fx = slow_work(10_000);
    let extra = fx.args();
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let mut first = WorkerProc::start(
        &engine,
        &slow_work_script(vec![text_gen(Some("hello"), "Earlier answer.", 0, true)]),
        &extra,
    )
    .await;
    let second = WorkerProc::standby(&engine, &first, &extra).await;
    assert!(
        !second.log().contains("harness worker registered on"),
        "the second worker stands by while the first serves"
    );

    // A finished session, served by the first worker.
    let done = engine.send_and_wait("s_before", "hello", &[]).await;
    assert_eq!(done["status"], "completed", "{done}");

    let turn_id = start_slow_work(&engine, &fx, "s_takeover").await;
    let killed_at = Instant::now();
    first.kill();
    let status = engine.wait_turn("s_takeover", &turn_id).await;
    let took = killed_at.elapsed();
    eprintln!("the standby finished the turn {took:?} after the SIGKILL");
    assert_eq!(status["status"], "completed", "{status}");
    assert!(
        took < Duration::from_secs(5),
        "the standby finished the turn in {took:?}"
    );
    assert!(
        second.log().contains("harness worker registered on"),
        "{}",
        second.log()
    );
    let entries = engine.transcript("s_takeover", false).await;
    assert_slow_work_interrupted(&fx, &entries);
    let users = user_texts(&entries).len();
    assert_eq!(users, 1, "{}", render(&entries));
    // Nothing the first worker finished is lost.
    let before = engine.transcript("s_before", false).await;
    assert_eq!(before.len(), 2, "{}", render(&before));
    assert_eq!(text_of(&before[1]), "Earlier answer.");
    // The second worker now holds the session's lease, above the first one's epoch.
    let lease = engine.state(LEASE_SCOPE, "s_takeover").await.unwrap();
    assert!(lease["epoch"].as_u64().unwrap() >= 2, "{lease}");
    assert!(
        lease["holder"]
            .as_str()
            .is_some_and(|h| h.starts_with("harness-")),
        "{lease}"
    );
}

/// Options for a bus of the test's own on `engine`, named `worker_name`.
fn bus_options(engine: &Engine, worker_name: &str) -> IiiOptions {
    let mut opts = IiiOptions::new(engine.url.clone());
    opts.worker_name = worker_name.into();
    opts
}

/// A bus of the test's own on `engine`, named `worker_name`.
async fn connect_bus(engine: &Engine, worker_name: &str) -> IiiBus {
    IiiBus::connect(bus_options(engine, worker_name))
        .await
        .expect("connect")
}

/// A worker that lost a session to another holds a lower lease epoch: its next write of the
/// turn record is refused (`harness/fenced`) and readers keep seeing the newer holder's record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_worker_s_turn_record_write_is_refused() {
    let engine = Engine::start().await;
    let mut opts = bus_options(&engine, "fence-test-a");
    opts.connect_timeout = Duration::from_secs(30);
    let stale = IiiBus::connect(opts).await.expect("connect");
    stale
        .state_set(FENCED_SCOPE, "s_fence", json!({"step": 1, "by": "a"}))
        .await
        .expect("the holder writes");
    assert_eq!(
        stale.state_get(FENCED_SCOPE, "s_fence").await.unwrap(),
        Some(json!({"step": 1, "by": "a"}))
    );
    // Another worker takes the session over: a higher epoch from the lease row, its record in
    // that epoch's slot (as its bus would write them).
    let taken = engine
        .ok(
            "state::update",
            json!({"scope": LEASE_SCOPE, "key": "s_fence", "ops": [
                {"type": "increment", "path": "epoch", "by": 1},
                {"type": "set", "path": "holder", "value": "someone-else"},
                {"type": "set", "path": "_harness_key", "value": "s_fence"}]}),
        )
        .await;
    let epoch = taken["new_value"]["epoch"].as_u64().unwrap();
    assert_eq!(epoch, 2, "{taken}");
    engine
        .ok(
            "state::update",
            json!({"scope": FENCED_SCOPE, "key": "s_fence", "ops": [
                {"type": "set", "path": "_harness_key", "value": "s_fence"},
                {"type": "set", "path": format!("_harness_epoch_{epoch:020}"), "value": {"step": 2, "by": "b"}}]}),
        )
        .await;
    let refused = stale
        .state_set(FENCED_SCOPE, "s_fence", json!({"step": 2, "by": "a"}))
        .await
        .expect_err("the stale worker's write is refused");
    assert_eq!(refused.code, "harness/fenced", "{refused:?}");
    assert_eq!(
        stale.state_get(FENCED_SCOPE, "s_fence").await.unwrap(),
        Some(json!({"step": 2, "by": "b"})),
        "readers see the newer holder's record"
    );
    let listed = stale.state_list(FENCED_SCOPE).await.unwrap();
    assert_eq!(
        listed,
        vec![("s_fence".to_string(), json!({"step": 2, "by": "b"}))]
    );
    // The refused slot was removed again; the newer holder's is the only one left.
    let stored = engine.state(FENCED_SCOPE, "s_fence").await.unwrap();
    let slots: Vec<&String> = stored
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| k.starts_with("_harness_epoch_"))
        .collect();
    assert_eq!(slots.len(), 1, "{stored}");
    stale.shutdown().await;
}

/// A worker that is the only one writing a session takes its lease once and keeps writing
/// under it; its own older slots are pruned, and a barrier reading the record back finds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_holder_writes_under_one_epoch_and_its_barrier_finds_its_writes() {
    let engine = Engine::start().await;
    let bus = connect_bus(&engine, "fence-test-holder").await;
    for step in 0..3 {
        bus.state_set(FENCED_SCOPE, "s_hold", json!({ "step": step }))
            .await
            .expect("write");
    }
    bus.barrier().await.expect("the barrier finds the record");
    let lease = engine.state(LEASE_SCOPE, "s_hold").await.unwrap();
    assert_eq!(lease["epoch"], 1, "{lease}");
    assert_eq!(lease["holder"].as_str(), Some(bus.instance()));
    assert_eq!(
        bus.state_get(FENCED_SCOPE, "s_hold").await.unwrap(),
        Some(json!({"step": 2}))
    );
    bus.state_delete(FENCED_SCOPE, "s_hold").await.unwrap();
    assert_eq!(bus.state_get(FENCED_SCOPE, "s_hold").await.unwrap(), None);
    bus.shutdown().await;
}

/// A worker that connects while the engine still holds a previous connection of the same
/// worker name (a restart, or the bench's next phase) would have its registrations refused
/// (`FUNCTION_NAMESPACE_CONFLICT`) and then find none of them listed: it waits for that
/// connection to go, then registers and starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_waits_for_a_lingering_connection_of_its_own_name_before_registering() {
    let engine = Engine::start().await;
    if engine.is_real() {
        // A real engine leases the worker name itself to one connection: the second one is
        // refused as a whole (`WORKER_NAMESPACE_CONFLICT`, docs/iii-engine.md), not per function.
        return;
    }
    let mut opts = bus_options(&engine, "reannounce-test");
    opts.connect_timeout = Duration::from_secs(10);
    let old = IiiBus::connect(opts.clone()).await.expect("connect");
    let next = tokio::spawn(IiiBus::connect(opts));
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !next.is_finished(),
        "the engine still lists the old connection's functions"
    );
    old.shutdown().await;
    let started = Instant::now();
    let bus = next.await.unwrap().expect("the second connection starts");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "started {:?} after the old connection closed",
        started.elapsed()
    );
    assert_eq!(bus.state_get("reannounce", "k").await.unwrap(), None);
    bus.shutdown().await;
}

/// A call made on a bus that was shut down fails at once (the SDK would drop it without a word
/// and the call would wait out its timeout, logging "no answer from the iii engine").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_on_a_closed_bus_fails_at_once() {
    let engine = Engine::start().await;
    let bus = connect_bus(&engine, "closed-bus-test").await;
    assert_eq!(bus.state_get("closed_bus", "k").await.unwrap(), None);
    bus.shutdown().await;
    let started = Instant::now();
    let err = bus.state_get("closed_bus", "k").await.unwrap_err();
    assert_eq!(err.code, "not_connected", "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(1), "{err:?}");
}

/// The serving worker's link drops (the double closes it) and the standby takes the sessions
/// over; when the first worker's SDK reconnects it finds its functions held by the other one:
/// it stops (exits with an error saying so) instead of serving next to it, and the sessions
/// keep working on the standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_lost_its_link_while_another_took_over_stops_serving() {
    let engine = Engine::start().await;
    if engine.is_real() {
        return; // closing one worker's connection from the engine side is the double's
    }
    let script = script(vec![text_gen(None, "Answered.", 0, true)]);
    let mut first = WorkerProc::start(&engine, &script, &[]).await;
    let second = WorkerProc::standby(&engine, &first, &[]).await;
    engine.send_and_wait("s_link", "hi", &[]).await;
    assert_eq!(engine.drop_workers("harness"), 1);
    second.wait_serving(Duration::from_secs(10)).await;
    wait_until("the first worker to stop", || first.exited()).await;
    assert!(
        first
            .log()
            .contains("took this worker's functions and sessions over"),
        "{}",
        first.log()
    );
    let status = engine.send_and_wait("s_link", "again", &[]).await;
    assert_eq!(status["status"], "completed", "{status}");
    let lease = engine.state(LEASE_SCOPE, "s_link").await.unwrap();
    assert_eq!(
        lease["epoch"], 2,
        "the standby took the session's lease: {lease}"
    );
}
