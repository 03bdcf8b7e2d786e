//! Records the real engine's wire shapes for the engine double: every engine function and
//! message the iii adapter uses, request and answer, as the engine given in `III_BIN` sends
//! them. Writes `tests/iii_engine/recorded.json`; the double (tests/iii_engine) answers with
//! exactly these shapes and refuses any engine function recorded here not.
//!
//! `III_BIN=/path/to/iii cargo test -p harness --features iii --test iii_record -- --ignored`
#![cfg(feature = "iii")]

mod iii_engine;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use iii_engine::real::{engine_bin, Client, RealEngine};
use serde_json::{json, Value};

struct Recorder {
    functions: BTreeMap<String, Vec<Value>>,
    messages: BTreeMap<String, Value>,
}

impl Recorder {
    async fn call(&mut self, c: &Client, function_id: &str, request: Value) -> Value {
        let frame = c
            .invoke_raw(function_id, request.clone())
            .await
            .unwrap_or_else(|e| panic!("{function_id}: {e:?}; received {:?}", c.received()));
        let mut example = json!({"request": request});
        match frame.get("error").filter(|e| !e.is_null()) {
            Some(e) => example["error"] = e.clone(),
            None => example["response"] = frame.get("result").cloned().unwrap_or(Value::Null),
        }
        self.functions
            .entry(function_id.to_string())
            .or_default()
            .push(example.clone());
        self.message("invocationresult", frame);
        example
    }

    fn message(&mut self, kind: &str, frame: Value) {
        self.messages.entry(kind.to_string()).or_insert(frame);
    }
}

async fn wait_frame(c: &Client, what: &str, f: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(m) = c.received().into_iter().find(|m| f(m)) {
            return m;
        }
        assert!(Instant::now() < deadline, "no {what} from the engine");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real engine: III_BIN=/path/to/iii"]
async fn record_the_engine_shapes() {
    let Some(bin) = engine_bin() else {
        panic!("set III_BIN to an iii engine binary");
    };
    let version = std::process::Command::new(&bin)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let engine = RealEngine::start(&bin).await;
    let a = Client::connect(&engine.url()).await.unwrap();
    let mut r = Recorder {
        functions: BTreeMap::new(),
        messages: BTreeMap::new(),
    };
    let registered = wait_frame(&a, "workerregistered", |m| m["type"] == "workerregistered").await;
    r.message("workerregistered", registered);
    // Sent fire-and-forget, as the SDK does (Client::connect): the engine does not answer it
    // even when asked with an invocation id.
    r.functions.insert(
        "engine::workers::register".into(),
        vec![json!({"request": {"name": "harness-tests", "description": "the end-to-end tests' client"},
            "action": {"type": "void"}, "response": null})],
    );

    // A function of this connection, internal, and one public.
    a.send(json!({"type": "registerfunction", "id": "rec::internal", "description": "internal", "metadata": {"internal": true},
        "request_format": {"type": "object"}, "response_format": {"type": "object"}}));
    a.register("rec::echo", |v| Ok(json!({"echo": v})));
    tokio::time::sleep(Duration::from_millis(300)).await;

    r.call(&a, "engine::functions::list", json!({})).await;
    r.call(
        &a,
        "engine::functions::list",
        json!({"include_internal": true}),
    )
    .await;
    r.call(
        &a,
        "engine::functions::list",
        json!({"prefix": "engine::queue::", "include_internal": true}),
    )
    .await;
    r.call(
        &a,
        "engine::functions::info",
        json!({"function_id": "rec::internal"}),
    )
    .await;
    r.call(
        &a,
        "engine::functions::info",
        json!({"function_id": "rec::echo"}),
    )
    .await;
    r.call(
        &a,
        "engine::functions::info",
        json!({"function_ids": ["rec::internal", "rec::echo", "rec::nothing"]}),
    )
    .await;
    r.call(
        &a,
        "engine::functions::info",
        json!({"function_id": "rec::nothing"}),
    )
    .await;
    r.call(
        &a,
        "engine::triggers::list",
        json!({"include_internal": true}),
    )
    .await;

    // State, as the adapter stores it (the key inside the value).
    r.call(&a, "state::get", json!({"scope": "rec", "key": "k"}))
        .await;
    r.call(
        &a,
        "state::set",
        json!({"scope": "rec", "key": "k", "value": {"_harness_key": "k", "v": 1}}),
    )
    .await;
    r.call(
        &a,
        "state::set",
        json!({"scope": "rec", "key": "k", "value": {"_harness_key": "k", "v": 2}}),
    )
    .await;
    r.call(&a, "state::get", json!({"scope": "rec", "key": "k"}))
        .await;
    r.call(&a, "state::list", json!({"scope": "rec"})).await;
    r.call(&a, "state::delete", json!({"scope": "rec", "key": "k"}))
        .await;
    r.call(&a, "state::delete", json!({"scope": "rec", "key": "k"}))
        .await;
    r.call(&a, "state::get", json!({"scope": 5})).await;
    // Atomic updates, as the fenced turn records use them: a lease taken (an increment), a
    // slot written, one removed.
    r.call(
        &a,
        "state::update",
        json!({"scope": "rec_lease", "key": "s", "ops": [
        {"type": "increment", "path": "epoch", "by": 1},
        {"type": "set", "path": "holder", "value": "w1"},
        {"type": "set", "path": "_harness_key", "value": "s"}]}),
    )
    .await;
    r.call(
        &a,
        "state::update",
        json!({"scope": "rec_lease", "key": "s", "ops": [
        {"type": "increment", "path": "epoch", "by": 1},
        {"type": "set", "path": "holder", "value": "w2"},
        {"type": "set", "path": "_harness_key", "value": "s"}]}),
    )
    .await;
    r.call(
        &a,
        "state::update",
        json!({"scope": "rec_turn", "key": "s", "ops": [
        {"type": "set", "path": "_harness_key", "value": "s"},
        {"type": "set", "path": "_harness_epoch_00000000000000000001", "value": {"step": 1}},
        {"type": "remove", "path": "_harness_epoch_00000000000000000000"}]}),
    )
    .await;

    // A second connection registering an id the first one owns: only that registration is
    // refused, the connection stays.
    let other = Client::connect(&engine.url()).await.unwrap();
    other.send(
        json!({"type": "registerfunction", "id": "rec::echo", "description": "a second owner"}),
    );
    let refused = wait_frame(&other, "registrationrejected", |m| {
        m["type"] == "registrationrejected"
    })
    .await;
    r.message("registrationrejected", refused);
    other.close();

    // A worker-owned trigger type: bindings made through the engine are forwarded to it.
    a.send(
        json!({"type": "registertriggertype", "id": "rec::point", "description": "a hook point",
        "trigger_request_format": {"type": "object"}}),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let bound = r
        .call(&a, "engine::register_trigger", json!({"trigger_type": "rec::point", "function_id": "rec::echo", "config": {"priority": 1}, "metadata": {"m": 1}}))
        .await;
    let forwarded = wait_frame(&a, "registertrigger", |m| m["type"] == "registertrigger").await;
    r.message("registertrigger", forwarded.clone());
    a.send(json!({"type": "triggerregistrationresult", "id": forwarded["id"], "trigger_type": "rec::point", "function_id": "rec::echo"}));
    r.call(
        &a,
        "engine::registered-triggers::list",
        json!({"trigger_type": "rec::point", "include_internal": true}),
    )
    .await;
    let id = bound["response"]["id"].clone();
    r.call(&a, "engine::unregister_trigger", json!({"id": id}))
        .await;
    let unbound = wait_frame(&a, "unregistertrigger", |m| {
        m["type"] == "unregistertrigger"
    })
    .await;
    r.message("unregistertrigger", unbound);
    r.call(&a, "engine::unregister_trigger", json!({"id": id}))
        .await;

    // The topic queue: a subscriber bound by this connection, a publish, the delivery.
    a.register("rec::consume", |_| Ok(json!({"ok": true})));
    a.send(json!({"type": "registertrigger", "id": "rec-sub", "trigger_type": "durable:subscriber", "function_id": "rec::consume",
        "config": {"topic": "rec-topic", "queue_config": {"type": "standard", "maxRetries": 3, "concurrency": 4, "visibilityTimeout": 30000, "backoffType": "exponential", "backoffDelayMs": 1000}}}));
    tokio::time::sleep(Duration::from_millis(300)).await;
    r.call(
        &a,
        "engine::registered-triggers::list",
        json!({"trigger_type": "durable:subscriber", "function_id": "rec::consume"}),
    )
    .await;
    r.call(
        &a,
        "iii::durable::publish",
        json!({"topic": "rec-topic", "data": {"session_id": "s1", "n": 1}}),
    )
    .await;
    let delivered = wait_frame(&a, "a topic delivery", |m| {
        m["type"] == "invokefunction" && m["function_id"] == "rec::consume"
    })
    .await;
    r.message("invokefunction", delivered);
    r.call(&a, "iii::durable::publish", json!({"data": {}}))
        .await;

    // Cron and the registry-change notice (the engine polls its registry every 5 s).
    r.call(&a, "engine::register_trigger", json!({"trigger_type": "cron", "function_id": "rec::echo", "config": {"expression": "0 * * * * *"}}))
        .await;
    r.call(
        &a,
        "engine::registered-triggers::list",
        json!({"trigger_type": "cron", "include_internal": true}),
    )
    .await;
    a.register("rec::changes", |_| Ok(json!({"ok": true})));
    r.call(&a, "engine::register_trigger", json!({"trigger_type": "engine::functions-available", "function_id": "rec::changes", "config": {}}))
        .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    a.register("rec::late", |_| Ok(json!({})));
    let notice = wait_frame(&a, "a functions-available notice", |m| {
        m["type"] == "invokefunction" && m["function_id"] == "rec::changes"
    })
    .await;
    r.message("functions-available", notice);

    // Configuration (the harness reads its own entry), missing here.
    r.call(&a, "configuration::get", json!({"id": "harness"}))
        .await;

    // Errors: an unknown function; a call whose worker disconnects mid-call.
    r.call(&a, "rec::nothing", json!({})).await;
    let b = Client::connect(&engine.url()).await.unwrap();
    b.send(json!({"type": "registerfunction", "id": "rec::hang", "description": "never answers"}));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let a2 = a.clone();
    let stopped = tokio::spawn(async move { a2.invoke_raw("rec::hang", json!({})).await });
    let asked = wait_frame(&b, "the routed call", |m| {
        m["type"] == "invokefunction" && m["function_id"] == "rec::hang"
    })
    .await;
    r.message("invokefunction(routed)", asked);
    b.close();
    let frame = stopped.await.unwrap().unwrap();
    r.functions
        .entry("(a worker that disconnects mid-call)".into())
        .or_default()
        .push(json!({"request": {}, "error": frame["error"]}));

    let out = json!({
        "engine_version": version,
        "recorded_with": "tests/iii_record.rs against the engine binary in III_BIN",
        "functions": r.functions,
        "messages": r.messages,
    });
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/iii_engine/recorded.json");
    std::fs::write(&path, serde_json::to_string_pretty(&out).unwrap() + "\n").unwrap();
    eprintln!(
        "recorded {} functions from {version} into {}",
        out["functions"].as_object().unwrap().len(),
        path.display()
    );
}

/// Records the queue worker's shapes (`III_QUEUE_BIN` next to the engine in `III_BIN`): the
/// enqueue action's answer and errors, `queue::define`, the queue worker's configuration entry,
/// and the frame a queued call is delivered with (first delivery and a retry). Merged into
/// `recorded.json` next to the engine's shapes.
///
/// `III_BIN=… III_QUEUE_BIN=… cargo test -p harness --features iii --test iii_record -- --ignored record_the_queue_worker_shapes`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real engine and queue worker: III_BIN=… III_QUEUE_BIN=…"]
async fn record_the_queue_worker_shapes() {
    assert!(
        engine_bin().is_some() && iii_engine::real::queue_bin().is_some(),
        "set III_BIN and III_QUEUE_BIN"
    );
    let engine = RealEngine::start(&engine_bin().unwrap()).await;
    let a = Client::connect(&engine.url()).await.unwrap();
    wait_frame(&a, "workerregistered", |m| m["type"] == "workerregistered").await;
    let mut r = Recorder {
        functions: BTreeMap::new(),
        messages: BTreeMap::new(),
    };
    r.call(&a, "configuration::get", json!({"id": "queue"}))
        .await;
    let def = json!({"queue": "rec-fifo", "config": {"type": "fifo", "message_group_field": "g",
        "max_retries": 2, "backoff_ms": 50, "poll_interval_ms": 5, "concurrency": 4, "timeout_ms": 5000}});
    r.call(&a, "queue::define", def.clone()).await;
    r.call(&a, "queue::define", def).await;
    r.call(
        &a,
        "queue::define",
        json!({"queue": "rec-bad", "config": {"type": "fifo"}}),
    )
    .await;
    r.call(
        &a,
        "queue::define",
        json!({"queue": "rec-bad", "config": {"type": "fifo", "message_group_field": "g", "wat": 1}}),
    )
    .await;
    r.call(&a, "configuration::get", json!({"id": "queue"}))
        .await;

    // A target that fails its first delivery, then succeeds.
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let s2 = seen.clone();
    a.register("rec::queued", move |_| {
        if s2.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            Err(iii_engine::CallError {
                code: "rec/flaky".into(),
                message: "first delivery fails".into(),
            })
        } else {
            Ok(json!({"ok": true}))
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut example = |name: &str, request: Value, frame: &Value| {
        let mut e = json!({"request": request});
        match frame.get("error").filter(|e| !e.is_null()) {
            Some(err) => e["error"] = err.clone(),
            None => e["response"] = frame.get("result").cloned().unwrap_or(Value::Null),
        }
        r.functions.entry(name.into()).or_default().push(e);
    };
    let enqueue = json!({"type": "enqueue", "queue": "rec-fifo"});
    let sent_at = Instant::now();
    let frame = a
        .invoke_action("rec::queued", json!({"g": "s1", "n": 1}), enqueue.clone())
        .await
        .unwrap();
    example(
        "(enqueue action)",
        json!({"function_id": "rec::queued", "data": {"g": "s1", "n": 1}, "action": enqueue}),
        &frame,
    );
    let frame = a
        .invoke_action(
            "rec::queued",
            json!({"n": 2}),
            json!({"type": "enqueue", "queue": "rec-fifo"}),
        )
        .await
        .unwrap();
    example(
        "(enqueue action)",
        json!({"function_id": "rec::queued", "data": {"n": 2}, "action": {"type": "enqueue", "queue": "rec-fifo"}}),
        &frame,
    );
    let frame = a
        .invoke_action(
            "rec::queued",
            json!({"g": "s1"}),
            json!({"type": "enqueue", "queue": "rec-undefined"}),
        )
        .await
        .unwrap();
    example(
        "(enqueue action)",
        json!({"function_id": "rec::queued", "data": {"g": "s1"}, "action": {"type": "enqueue", "queue": "rec-undefined"}}),
        &frame,
    );
    let first = wait_frame(&a, "the queued delivery", |m| {
        m["type"] == "invokefunction" && m["function_id"] == "rec::queued"
    })
    .await;
    r.message("invokefunction(queued)", first);
    let deadline = Instant::now() + Duration::from_secs(20);
    let retry = loop {
        let deliveries: Vec<Value> = a
            .received()
            .into_iter()
            .filter(|m| m["type"] == "invokefunction" && m["function_id"] == "rec::queued")
            .collect();
        if deliveries.len() >= 2 {
            break deliveries[1].clone();
        }
        assert!(Instant::now() < deadline, "no redelivery after a failure");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let retried_after = sent_at.elapsed().as_millis() as u64;
    r.message("invokefunction(queued retry)", retry);
    r.functions
        .entry("(queued delivery that failed once)".into())
        .or_default()
        .push(json!({"request": {}, "response": {"deliveries": seen.load(std::sync::atomic::Ordering::SeqCst), "redelivered_within_ms": retried_after}}));

    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/iii_engine/recorded.json");
    let mut out: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    out["queue_worker"] = json!(
        "the queue worker (iii-hq/workers queue/, built from its public source) in III_QUEUE_BIN, by record_the_queue_worker_shapes"
    );
    for (k, v) in r.functions {
        let list = out["functions"][k.as_str()]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let mut list: Vec<Value> = list
            .into_iter()
            .filter(|e| {
                !(v.contains(e) || (k == "configuration::get" && e["request"]["id"] == "queue"))
            })
            .collect();
        // The SDK's Rust backtrace of a handler error says nothing about the wire.
        list.extend(v.into_iter().map(|mut e| {
            if let Some(err) = e.get_mut("error").and_then(Value::as_object_mut) {
                err.remove("stacktrace");
            }
            e
        }));
        out["functions"][k.as_str()] = Value::Array(list);
    }
    for (k, v) in r.messages {
        if k != "invocationresult" {
            out["messages"][k.as_str()] = v;
        }
    }
    std::fs::write(&path, serde_json::to_string_pretty(&out).unwrap() + "\n").unwrap();
}
