//! The HTTP API and CLI against the real binary: bad input gets a `harness/<code>` error that names
//! the field (and changes nothing), the SSE stream resumes exactly after `Last-Event-ID`, and
//! `harness call` reports results and errors.

mod common;

use common::*;
use serde_json::{json, Value};

fn id(v: &Value, field: &str) -> String {
    v[field]
        .as_str()
        .unwrap_or_else(|| panic!("{field} missing in {v}"))
        .to_string()
}

fn assert_error(e: &ApiError, status: u16, code: &str, names: &str) {
    assert_eq!((e.status, e.code.as_str()), (status, code), "{:?}", e.body);
    assert!(
        e.message.contains(names),
        "the message {:?} should name {names:?}",
        e.message
    );
}

/// An HTTP answer that is an error: `status`, the error `code`, and a message naming `names`.
async fn assert_error_reply(resp: reqwest::Response, status: u16, code: &str, names: &str) {
    assert_eq!(resp.status(), status);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], code, "{body}");
    assert!(
        body["error"]["message"].as_str().unwrap().contains(names),
        "{body}"
    );
}

/// Sends that fail must leave no session and no turn behind.
async fn assert_untouched(server: &Server, session_id: &str) {
    assert_eq!(
        server.status(session_id).await,
        Value::Null,
        "no turn for {session_id}"
    );
    let e = server
        .err(
            "session::messages",
            json!({"session_id": session_id, "include_custom": true}),
        )
        .await;
    assert_error(&e, 404, "harness/not_found", "session_id");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input() {
    let mut server =
        Server::start(&script(vec![text_gen(None, "fine, thanks", 0, true)]), &[]).await;

    // Malformed JSON body.
    let (status, body) = server.post_raw("harness::send", "{not json").await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("harness/invalid_request")),
        "{body}"
    );
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("body:"),
        "{body}"
    );

    // Wrong types, each on a session id that must stay unknown.
    let cases: Vec<(Value, &str, &str)> = vec![
        (
            json!({"message": 5, "model": "m"}),
            "harness/invalid_request",
            "message",
        ),
        (json!({"model": "m"}), "harness/invalid_request", "message"),
        (
            json!({"message": "x", "model": "m", "options": {"max_turns": "x"}}),
            "harness/invalid_request",
            "options.max_turns",
        ),
        (
            json!({"message": "x", "model": "m", "options": {"max_turns": 0}}),
            "harness/invalid_request",
            "options.max_turns",
        ),
        (
            json!({"message": "x", "model": "m", "options": 5}),
            "harness/invalid_request",
            "options",
        ),
        (
            json!({"message": "x", "model": "m", "options": {"reasoning": "max"}}),
            "harness/invalid_request",
            "options.reasoning",
        ),
        (
            json!({"message": "x", "model": ""}),
            "harness/invalid_request",
            "model",
        ),
        (
            json!({"message": "x", "model": 7}),
            "harness/invalid_request",
            "model",
        ),
        (
            json!({"message": {"role": "assistant", "content": []}, "model": "m"}),
            "harness/invalid_message_role",
            "message.role",
        ),
        (
            json!({"message": {"role": "system", "content": []}, "model": "m"}),
            "harness/invalid_message_role",
            "message.role",
        ),
        (
            json!({"message": {"role": 5}, "model": "m"}),
            "harness/invalid_message_role",
            "message.role",
        ),
        (
            json!({"message": {"content": []}, "model": "m"}),
            "harness/invalid_request",
            "message.role",
        ),
        // A new session needs a model.
        (json!({"message": "x"}), "harness/invalid_request", "model"),
        (
            json!({"message": "x", "model": "m", "idempotency_key": ""}),
            "harness/invalid_request",
            "idempotency_key",
        ),
    ];
    for (i, (mut req, code, names)) in cases.into_iter().enumerate() {
        let sid = format!("s_bad_{i}");
        req["session_id"] = json!(sid);
        let e = server.err("harness::send", req.clone()).await;
        assert!(
            e.code == code && e.message.contains(names),
            "{req} -> {} {:?}; want {code} naming {names:?}",
            e.status,
            e.message
        );
        assert_eq!(e.status, 400, "{req}");
        assert_untouched(&server, &sid).await;
    }
    // Each refused 400 harness/invalid_request, its message naming the field.
    for (function_id, request, names) in [
        (
            "harness::send",
            json!({"message": "x", "model": "m", "session_id": 5}),
            "session_id",
        ),
        (
            "harness::send",
            json!({"message": "x", "model": "m", "session_id": ""}),
            "session_id",
        ),
        // A missing model without a session id says so (and creates nothing: no session id to
        // check).
        ("harness::send", json!({"message": "x"}), "model"),
        ("harness::status", json!({}), "session_id"),
        (
            "session::messages",
            json!({"session_id": "s_nope", "include_custom": "yes"}),
            "include_custom",
        ),
        // The internal step function cannot be called from outside.
        (
            "harness::turn",
            json!({"session_id": "s_x", "turn_id": "t_x", "step": 0}),
            "function_id",
        ),
    ] {
        let e = server.err(function_id, request.clone()).await;
        let case = format!("{function_id} {request}");
        assert_eq!(
            (e.status, e.code.as_str()),
            (400, "harness/invalid_request"),
            "{case}: {:?}",
            e.body
        );
        assert!(
            e.message.contains(names),
            "{case}: the message {:?} should name {names:?}",
            e.message
        );
    }

    // Unknown session: messages is not_found naming session_id, status is null (200).
    let e = server
        .err(
            "session::messages",
            json!({"session_id": "s_nope", "include_custom": false}),
        )
        .await;
    assert_error(&e, 404, "harness/not_found", "session_id");
    assert!(e.message.contains("s_nope"), "{:?}", e.message);
    let (status, body) = server
        .post_raw(
            "harness::status",
            json!({"session_id": "s_nope"}).to_string(),
        )
        .await;
    assert_eq!((status, body), (200, Value::Null));

    // Unknown function: 404 naming it.
    let e = server.err("nope::missing", json!({})).await;
    assert_eq!(e.status, 404, "{:?}", e.body);
    assert!(e.code.starts_with("harness/"), "{:?}", e.body);
    assert!(e.message.contains("nope::missing"), "{:?}", e.message);

    // Events: unknown session, and a Last-Event-ID that is not an id.
    let resp = server.get("/v1/sessions/s_nope/events").await;
    assert_error_reply(resp, 404, "harness/not_found", "session_id").await;

    // Still serving, and a normal send completes.
    server.assert_alive();
    let health = server.get("/healthz").await;
    assert_eq!(health.status(), 200);
    let sent = server.send(None, "how are you?").await;
    let (sid, tid) = (id(&sent, "session_id"), id(&sent, "turn_id"));
    let status = server.wait_turn(&sid, &tid).await;
    assert_eq!(
        (status["status"].as_str(), &status["result"]),
        (Some("completed"), &json!("fine, thanks"))
    );
    let resp = server
        .client
        .get(format!("{}/v1/sessions/{sid}/events", server.url()))
        .header("Last-Event-ID", "abc")
        .send()
        .await
        .unwrap();
    assert_error_reply(resp, 400, "harness/invalid_request", "Last-Event-ID").await;
    server.assert_alive();
}

/// Shape errors inside a message object should name the inner field (`message.content`,
/// `message.content[0].text`), as `parse_payload` documents; a JSON array is not a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_message_shape_names_the_inner_field() {
    let server = Server::start(&script(vec![text_gen(None, "ok", 0, true)]), &[]).await;
    let cases: Vec<(Value, &str)> = vec![
        (
            json!({"session_id": "s_b1", "model": "m", "message": {"role": "user"}}),
            "message.content",
        ),
        (
            json!({"session_id": "s_b2", "model": "m", "message": {"role": "user", "content": "hi"}}),
            "message.content",
        ),
        (
            json!({"session_id": "s_b3", "model": "m", "message": {"role": "user", "content": [{"type": "text", "text": 3}]}}),
            // Content blocks are tagged by `type`; the error names the block.
            "message.content[0]",
        ),
    ];
    for (req, names) in cases {
        let e = server.err("harness::send", req.clone()).await;
        assert_eq!(e.code, "harness/invalid_request");
        assert!(
            e.message.starts_with(names),
            "{req} -> {:?}; want it to name {names}",
            e.message
        );
    }
    // A request is a JSON object; an array must not be read positionally into the fields.
    let (status, body) = server
        .post_raw("harness::send", r#"["s_arr", "hi", "m", "scripted"]"#)
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(server.status("s_arr").await, Value::Null);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_resume() {
    let script = script(vec![text_gen(
        None,
        "one two three four five six seven",
        20,
        true,
    )]);
    let server = Server::start(&script, &["--stream-coalesce-ms", "0"]).await;
    let sent = server.send(None, "hello").await;
    let (sid, tid) = (id(&sent, "session_id"), id(&sent, "turn_id"));
    assert_eq!(server.wait_turn(&sid, &tid).await["status"], "completed");

    // The whole history of the completed turn, from the start.
    let all = server
        .events(&sid, None)
        .await
        .until_turn_completed(&tid)
        .await;
    assert!(all.len() >= 4, "{all:?}");
    assert_eq!(check_turn_lifecycle(&all), vec![tid.clone()]);
    assert!(
        all.windows(2).all(|w| w[0].event_id() < w[1].event_id()),
        "ids increase"
    );
    assert!(
        all.iter().all(|e| e.payload()["session_id"] == json!(sid)),
        "only this session's events"
    );
    let key = |e: &SseEvent| e.data.clone();

    // Resume after the 2nd event, by Last-Event-ID or by the query parameter: exactly the
    // events after it, same ids, same data.
    let second = all[1].event_id();
    let url = format!("{}/v1/sessions/{sid}/events?after={second}", server.url());
    for (how, mut stream) in [
        ("Last-Event-ID", server.events(&sid, Some(second)).await),
        ("?after=", EventStream::open_url(&url, None).await),
    ] {
        let resumed = stream.until_turn_completed(&tid).await;
        assert_eq!(
            resumed.iter().map(key).collect::<Vec<_>>(),
            all[2..].iter().map(key).collect::<Vec<_>>(),
            "resuming after event {second} by {how}"
        );
    }

    // Resuming after the last event replays nothing: the first event is the next turn's.
    let last = all.last().unwrap().event_id();
    let mut tail = server.events(&sid, Some(last)).await;
    let next = server.send(Some(&sid), "again").await;
    let t2 = id(&next, "turn_id");
    let fresh = tail.until_turn_completed(&t2).await;
    assert!(
        fresh.iter().all(|e| e.event_id() > last),
        "nothing at or before {last} is replayed"
    );
    assert_eq!(
        fresh[0].topic(),
        "session::message-added",
        "the new user message comes first: {:?}",
        fresh[0].data
    );
    assert_eq!(check_turn_lifecycle(&fresh), vec![t2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn call_cli() {
    let server = Server::start(&script(vec![text_gen(None, "from the cli", 0, true)]), &[]).await;
    let url = server.url();
    let cli = |args: Vec<String>| {
        tokio::task::spawn_blocking(move || {
            run_cli(&args.iter().map(String::as_str).collect::<Vec<_>>())
        })
    };

    let (code, out, err) = cli(vec![
        "call".into(),
        "harness::status".into(),
        r#"{"session_id":"nope"}"#.into(),
        "--url".into(),
        url.clone(),
    ])
    .await
    .unwrap();
    // A session that does not exist is an error of the command, not a `null` status.
    assert_ne!(code, 0, "stdout: {out}");
    assert!(out.trim().is_empty(), "stdout: {out}");
    assert!(
        err.contains("harness/not_found: no session 'nope'"),
        "{err}"
    );

    // A send through the CLI prints the JSON answer; the turn completes.
    let (code, out, err) = cli(vec![
        "call".into(),
        "harness::send".into(),
        r#"{"message":"hi","model":"m","provider":"scripted"}"#.into(),
        "--url".into(),
        url.clone(),
    ])
    .await
    .unwrap();
    assert_eq!(code, 0, "stderr: {err}");
    let sent: Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {out}"));
    let status = server
        .wait_turn(&id(&sent, "session_id"), &id(&sent, "turn_id"))
        .await;
    assert_eq!(status["result"], json!("from the cli"));

    // Errors exit non-zero with the `harness/<code>` on stderr and nothing on stdout.
    let failing: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["harness::send", r#"{"message":5,"model":"m"}"#],
            "harness/invalid_request: message",
        ),
        (
            vec![
                "harness::send",
                r#"{"message":{"role":"assistant","content":[]},"model":"m"}"#,
            ],
            "harness/invalid_message_role",
        ),
        (
            vec![
                "session::messages",
                r#"{"session_id":"nope","include_custom":false}"#,
            ],
            "harness/not_found",
        ),
        (vec!["nope::missing", "{}"], "harness/function_not_found"),
        (
            vec!["harness::status", "{not json"],
            "harness/invalid_request",
        ),
    ];
    for (args, want) in failing {
        let mut full: Vec<String> = vec!["call".into()];
        full.extend(args.iter().map(|s| s.to_string()));
        full.extend(["--url".to_string(), url.clone()]);
        let (code, out, err) = cli(full).await.unwrap();
        assert_ne!(code, 0, "{args:?} should fail; stdout {out}");
        assert!(
            err.contains(want),
            "{args:?}: stderr {err:?} should contain {want:?}"
        );
        assert!(out.trim().is_empty(), "{args:?}: stdout {out:?}");
    }

    // No server there: non-zero, says it cannot reach it.
    let nobody = format!("http://127.0.0.1:{}", free_port());
    let (code, _, err) = cli(vec![
        "call".into(),
        "harness::status".into(),
        r#"{"session_id":"x"}"#.into(),
        "--url".into(),
        nobody,
    ])
    .await
    .unwrap();
    assert_ne!(code, 0);
    assert!(err.contains("cannot reach"), "{err}");
}
