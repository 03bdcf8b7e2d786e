//! `router::models::*`, `reasoning: "lowest"`, catalog prices on the scripted provider, and the
//! frame-latency measurement.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use harness_bus::Bus;
use harness_router::bench::{frame_latency, FrameLatencyOptions};
use harness_router::providers::ProviderKind;
use harness_router::scripted::{Script, ScriptedProvider};
use harness_router::Router;
use harness_types::message::ContentBlock;
use harness_types::router::ChatAck;
use serde_json::{json, Value};

async fn call(bus: &harness_bus::EmbeddedBus, f: &str, payload: Value) -> Result<Value, String> {
    bus.call(f, payload, Some(Duration::from_secs(10)))
        .await
        .map_err(|e| e.to_string())
}

/// `router::models::get`'s answer to `payload`; the call must succeed.
async fn model(bus: &harness_bus::EmbeddedBus, payload: Value) -> Value {
    call(bus, "router::models::get", payload).await.unwrap()
}

#[tokio::test]
async fn models_get_and_supports_answer_from_the_catalog() {
    let router = Router::new();
    let (bus, _dir) = bus_with(&router);
    let e = model(
        &bus,
        json!({"provider": "anthropic", "id": "claude-haiku-4-5-20251001"}),
    )
    .await;
    assert_eq!(e["id"], "claude-haiku-4-5");
    assert_eq!(e["context_window"], 200000);
    assert_eq!(e["max_output_tokens"], 64000);
    assert_eq!(
        e["pricing"],
        json!({"input": 1.0, "output": 5.0, "cache_read": 0.1, "cache_write": 1.25})
    );
    assert_eq!(e["capabilities"]["thinking"], true);
    let demo = model(&bus, json!({"provider": "scripted", "id": "demo"})).await;
    assert_eq!(demo["context_window"], 200000);
    assert_eq!(demo["pricing"]["input"], 0.0);
    let none = model(&bus, json!({"id": "no-such-model"})).await;
    assert_eq!(none, Value::Null);
    for (capability, supported) in [("vision", true), ("thinking", false)] {
        let s = call(
            &bus,
            "router::models::supports",
            json!({"provider": "openai", "id": "gpt-4o", "capability": capability}),
        )
        .await
        .unwrap();
        assert_eq!(s, json!({"supported": supported}), "{capability}");
    }
    let err = call(
        &bus,
        "router::models::supports",
        json!({"provider": "openai", "id": "gpt-4o", "capability": "telepathy"}),
    )
    .await
    .unwrap_err();
    assert!(
        err.contains("capability") && err.contains("telepathy"),
        "{err}"
    );
    let err = call(&bus, "router::models::get", json!({"provider": "openai"}))
        .await
        .unwrap_err();
    assert!(err.contains("id"), "{err}");
}

#[tokio::test]
async fn models_list_keeps_the_providers_key_and_adds_the_catalog() {
    let router = Router::new();
    let (bus, _dir) = bus_with(&router);
    let script = Script::from_json(
        r#"{"generations": [{"repeat": true, "content": [{"type": "text", "text": "hi"}]}]}"#,
    )
    .unwrap();
    let shared: Arc<dyn Bus> = Arc::new(bus.clone());
    router.add_provider(Arc::new(ScriptedProvider::new(script, shared)));
    let v = call(&bus, "router::models::list", json!({})).await.unwrap();
    assert_eq!(v["providers"], json!(["scripted"]));
    let ids = strings(&v["models"], "id");
    assert!(
        ids.contains(&"claude-sonnet-4-5") && ids.contains(&"gpt-5") && ids.contains(&"demo"),
        "{ids:?}"
    );
    assert!(!ids.contains(&"*"));
    let v = call(&bus, "router::models::list", Value::Null)
        .await
        .unwrap();
    assert_eq!(v["providers"], json!(["scripted"]));

    // The scripted provider's usage is priced from the catalog (demo costs nothing).
    let ack = call(
        &bus,
        "router::chat",
        json!({"request_id": "r1", "model": "demo", "provider": "scripted",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}),
    )
    .await
    .unwrap();
    let ack: ChatAck = serde_json::from_value(ack).unwrap();
    assert_eq!(ack.usage.unwrap().cost_usd, Some(0.0));
}

#[tokio::test]
async fn reasoning_lowest_picks_the_least_effort_from_the_catalog() {
    let reply = || {
        Reply::Stream(vec![
            data(
                json!({"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]}),
            ),
            raw("data: [DONE]\n\n"),
        ])
    };
    let mock = Mock::start(vec![reply(), reply()]).await;
    let router = router(&mock, "openai", ProviderKind::Openai, "/v1", Some(KEY));
    let (bus, _dir) = bus_with(&router);
    let mut payload = serde_json::to_value(request("openai", "gpt-5.1", vec![user("hi")])).unwrap();
    payload["reasoning"] = json!("lowest");
    let ack = call(&bus, "router::chat", payload.clone()).await.unwrap();
    assert_eq!(ack["ok"], true, "{ack}");
    assert_eq!(mock.bodies()[0]["reasoning_effort"], "low");
    payload["model"] = json!("gpt-unknown");
    let ack = call(&bus, "router::chat", payload).await.unwrap();
    assert_eq!(ack["ok"], false);
    assert_eq!(ack["error"]["code"], "router/unknown_model");
    assert_eq!(mock.requests().len(), 1);
}

#[tokio::test]
async fn an_unconfigured_provider_fails_with_one_error_frame() {
    let router = Router::new();
    let run = chat(
        &router,
        request("anthropic", "claude-sonnet-4-5", vec![user("hi")]),
    )
    .await;
    assert_eq!(
        run.ack.error.as_ref().unwrap().code,
        "router/provider_unavailable"
    );
    assert!(run.error().2.contains("'anthropic' is not configured"));
    assert!(run.error().0.content.is_empty());
    let _ = ContentBlock::text("");
}

#[tokio::test]
async fn frame_latency_is_measured_over_a_local_socket() {
    let report = frame_latency(FrameLatencyOptions {
        frames: 200,
        warmup: 20,
        requests: 10,
    })
    .await
    .unwrap();
    assert_eq!(report.per_frame_us.samples, 200);
    assert_eq!(report.socket_baseline_us.samples, 200);
    assert_eq!(report.per_request_us.samples, 10);
    assert!(report.per_frame_us.p50 > 0.0);
    eprintln!("{}", serde_json::to_string_pretty(&report).unwrap());
}

/// In process `router::models::get` takes a `ModelRef` and answers the JSON call's row, shared;
/// a replaced catalog answers at once (no row outlives the catalog it was read from).
#[tokio::test]
async fn models_get_in_process_answers_as_over_json_and_follows_a_new_catalog() {
    let router = Router::new();
    let (bus, _dir) = bus_with(&router);
    let local = bus
        .local_handler("router::models::get")
        .expect("router::models::get has an in-process handler");
    let in_process = |provider: Option<&str>, id: &str| {
        let req = harness_types::context::ModelRef {
            id: id.to_string(),
            provider: provider.map(str::to_string),
        };
        let local = local.clone();
        async move {
            harness_bus::local::invoke::<Arc<Value>>(
                local.as_ref(),
                "router::models::get",
                Box::new(req),
                harness_bus::CallContext::default(),
                Duration::from_secs(10),
            )
            .await
            .unwrap()
        }
    };
    let asks = [
        (Some("anthropic"), "claude-haiku-4-5-20251001"),
        (Some("scripted"), "demo"),
        (Some("scripted"), "any-model"),
        (None, "no-such-model"),
    ];
    for (provider, id) in asks {
        let over_json = model(&bus, json!({"provider": provider, "id": id})).await;
        // Asked twice: the second answer is the kept one.
        for _ in 0..2 {
            assert_eq!(
                *in_process(provider, id).await,
                over_json,
                "{provider:?} {id}"
            );
        }
    }
    assert_eq!(
        model(&bus, json!({"provider": "scripted", "id": "demo"})).await["context_window"],
        200000
    );

    let smaller = router
        .catalog()
        .merged(
            &json!({"models": [{"provider": "scripted", "id": "demo", "context_window": 1000, "max_output_tokens": 500}]}),
            "test",
        )
        .unwrap();
    router.set_catalog(smaller);
    let demo = model(&bus, json!({"provider": "scripted", "id": "demo"})).await;
    assert_eq!(demo["context_window"], 1000, "{demo}");
    assert_eq!(*in_process(Some("scripted"), "demo").await, demo);
    let entry = router.model_entry(Some("scripted"), "demo").await.unwrap();
    assert_eq!(entry.context_window, 1000);
}
