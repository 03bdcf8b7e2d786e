//! The turn's filesystem root: named by a send (absolute, existing), sticky for the session,
//! the configured default for a new session, and stamped onto every `fs::*` / `shell::*` call
//! over whatever the model wrote.

mod support;

use std::sync::{Arc, Mutex};

use harness_types::api::{ExposeMode, FunctionPolicy, SendOptions, TurnStatus};
use serde_json::{json, Value};
use support::*;

fn script() -> Value {
    json!({"generations": [
        {"match": {"last_user_text": "^read"}, "content": [
            {"type": "function_call", "id": "c1", "function_id": "fs::read",
             "arguments": {"path": "a", "fs_scope": {"root": "/", "grants": [], "boundary": "workspace"}}},
            {"type": "function_call", "id": "c2", "function_id": "web::fetch",
             "arguments": {"url": "http://example.org"}}
        ]},
        {"match": {"last_user_text": "^again"}, "content": [
            {"type": "function_call", "id": "c3", "function_id": "fs::read", "arguments": {"path": "b"}}
        ]},
        {"match": {"last_user_text": "^elsewhere"}, "content": [
            {"type": "function_call", "id": "c4", "function_id": "fs::read", "arguments": {"path": "c"}}
        ]},
        {"match": {"last_user_text": "^slow"}, "content": [
            {"type": "function_call", "id": "s1", "function_id": "slow::wait", "arguments": {}}
        ]},
        {"repeat": true, "content": [{"type": "text", "text": "done"}]}
    ]})
}

fn send_with(
    text: &str,
    session: Option<&str>,
    root: Option<&str>,
) -> harness_types::api::SendRequest {
    let mut req = send(text);
    req.session_id = session.map(str::to_string);
    req.options = Some(SendOptions {
        functions: Some(FunctionPolicy {
            allow: vec!["*".into()],
            deny: vec![],
            expose: ExposeMode::Native,
        }),
        filesystem_root: root.map(str::to_string),
        ..Default::default()
    });
    req
}

struct Seen {
    fs: Arc<Mutex<Vec<Value>>>,
    web: Arc<Mutex<Vec<Value>>>,
}

fn targets(rt: &Rt) -> Seen {
    let fs = Arc::new(Mutex::new(Vec::new()));
    let web = Arc::new(Mutex::new(Vec::new()));
    let (f, w) = (fs.clone(), web.clone());
    rt.register("fs::read", None, move |p| {
        f.lock().unwrap().push(p);
        json!({"ok": true})
    });
    rt.register("web::fetch", None, move |p| {
        w.lock().unwrap().push(p);
        json!({"ok": true})
    });
    Seen { fs, web }
}

async fn run(rt: &Rt, req: harness_types::api::SendRequest) -> String {
    let (r, s) = rt.run(req).await;
    assert_eq!(s.status, TurnStatus::Completed, "{s:?}");
    r.session_id
}

#[tokio::test]
async fn a_named_root_is_stamped_kept_for_the_session_and_the_default_applies_to_new_ones() {
    let dir = tempfile::tempdir().unwrap();
    let real = std::fs::canonicalize(dir.path())
        .unwrap()
        .display()
        .to_string();
    let rt = runtime(script(), config()).await;
    let seen = targets(&rt);
    let sid = run(
        &rt,
        send_with("read it", None, Some(dir.path().to_str().unwrap())),
    )
    .await;
    let workspace = json!({"root": real, "grants": [], "boundary": "workspace"});
    assert_eq!(
        seen.fs.lock().unwrap()[0]["fs_scope"],
        workspace,
        "the model's '/' was overwritten"
    );
    assert_eq!(
        seen.web.lock().unwrap()[0].get("fs_scope"),
        None,
        "only scoped functions are stamped"
    );
    // The next send names no root: the session keeps its own.
    run(&rt, send_with("again", Some(&sid), None)).await;
    assert_eq!(seen.fs.lock().unwrap()[1]["fs_scope"], workspace);
    // A new session without a root gets the configured default (null: the working directory).
    run(&rt, send_with("elsewhere", None, None)).await;
    let cwd = std::fs::canonicalize(std::env::current_dir().unwrap()).unwrap();
    assert_eq!(
        seen.fs.lock().unwrap()[2]["fs_scope"],
        json!({"root": cwd.display().to_string(), "grants": [], "boundary": "configured_roots"})
    );
}

#[tokio::test]
async fn with_the_default_off_a_rootless_turn_stamps_no_scope_at_all() {
    let rt = runtime(
        script(),
        harness_core::HarnessConfig {
            default_filesystem_root: Some("off".into()),
            ..config()
        },
    )
    .await;
    let seen = targets(&rt);
    run(&rt, send_with("read it", None, None)).await;
    assert_eq!(
        seen.fs.lock().unwrap()[0],
        json!({"path": "a"}),
        "the model's own fs_scope is removed, so the function refuses for want of a root"
    );
}

#[tokio::test]
async fn bad_roots_are_refused_by_field_and_a_live_turn_keeps_its_root() {
    let dir = tempfile::tempdir().unwrap();
    let other = tempfile::tempdir().unwrap();
    let rt = runtime(script(), config()).await;
    for (root, why) in [
        ("relative/dir", "is not an absolute path"),
        ("/no/such/directory/anywhere", "No such file"),
    ] {
        let e = rt
            .harness
            .send(send_with("read", None, Some(root)))
            .await
            .unwrap_err();
        assert!(e.message.starts_with("options.filesystem_root:"), "{e}");
        assert!(e.message.contains(why), "{e}");
    }
    let file = dir.path().join("f");
    std::fs::write(&file, "x").unwrap();
    let e = rt
        .harness
        .send(send_with("read", None, Some(file.to_str().unwrap())))
        .await
        .unwrap_err();
    assert!(e.message.contains("not a directory"), "{e}");

    let (release, held) = tokio::sync::watch::channel(false);
    rt.register_async("slow::wait", None, move |_| {
        let mut held = held.clone();
        async move {
            let _ = held.wait_for(|go| *go).await;
            json!({"ok": true})
        }
    });
    let r = rt
        .send(send_with("slow", None, Some(dir.path().to_str().unwrap())))
        .await;
    // While the call runs, a send naming another root is refused, not merged silently.
    let e = rt
        .harness
        .send(send_with(
            "more",
            Some(&r.session_id),
            Some(other.path().to_str().unwrap()),
        ))
        .await
        .unwrap_err();
    assert!(e.message.starts_with("options.filesystem_root:"), "{e}");
    assert!(e.message.contains("live turn"), "{e}");
    // Naming the same root is fine.
    rt.send(send_with(
        "more",
        Some(&r.session_id),
        Some(dir.path().to_str().unwrap()),
    ))
    .await;
    release.send_replace(true);
    rt.wait_terminal(&r.session_id, &r.turn_id).await;
}

/// A scoped call that fails with arguments its schema accepts gets no diagnosis: the stamped
/// `fs_scope` is the loop's, never a field the model is told to fix.
#[tokio::test]
async fn a_failed_scoped_call_is_not_told_to_fix_the_stamped_scope() {
    let script = json!({"generations": [
        {"match": {"last_user_text": "^read"}, "content": [
            {"type": "function_call", "id": "c1", "function_id": "fs::read", "arguments": {"path": "missing.txt"}},
            {"type": "function_call", "id": "c2", "function_id": "fs::read", "arguments": {"path": "x", "lines": 3}}
        ]},
        {"repeat": true, "content": [{"type": "text", "text": "done"}]}
    ]});
    let rt = runtime(script, config()).await;
    let schema = json!({"type": "object", "required": ["path"],
        "properties": {"path": {"type": "string"}}, "additionalProperties": false});
    rt.register("fs::read", Some(schema), |_| {
        json!({"content": [{"type": "text", "text": "tools/not_found: path: does not exist"}], "is_error": true})
    });
    let dir = tempfile::tempdir().unwrap();
    let root = std::fs::canonicalize(dir.path()).unwrap();
    let session = run(
        &rt,
        send_with("read it", None, Some(root.to_str().unwrap())),
    )
    .await;
    let texts: Vec<String> = rt
        .results(&session)
        .iter()
        .map(|m| harness_types::message::joined_text(&m.content))
        .collect();
    assert_eq!(texts.len(), 2, "{texts:?}");
    assert!(!texts[0].contains("[harness]"), "{}", texts[0]);
    // A field the model did write wrong is still named, and the scope is not.
    assert!(texts[1].contains("`lines` not accepted"), "{}", texts[1]);
    assert!(!texts[1].contains("fs_scope"), "{}", texts[1]);
}
