//! Per-session filesystem grants: `harness::filesystem::{grant,grants,revoke,info}` on the bus,
//! their refusals, the stamping of a session's grants onto its scoped calls (read per call, so a
//! revoke holds from the next one), and their deletion with the session tree.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use harness_bus::Bus;
use harness_types::api::{ExposeMode, FunctionPolicy, SendOptions};
use serde_json::{json, Value};
use support::*;

fn script() -> Value {
    json!({"generations": [
        {"match": {"last_user_text": "^read"}, "content": [
            {"type": "function_call", "id": "c1", "function_id": "fs::read",
             "arguments": {"path": "a", "fs_scope": {"root": "/", "grants": ["/"], "boundary": "workspace"}}}
        ]},
        {"match": {"last_user_text": "^again"}, "content": [
            {"type": "function_call", "id": "c2", "function_id": "fs::read", "arguments": {"path": "b"}}
        ]},
        {"repeat": true, "content": [{"type": "text", "text": "done"}]}
    ]})
}

fn send_in(text: &str, session: &str, root: &str) -> harness_types::api::SendRequest {
    let mut req = send(text);
    req.session_id = Some(session.to_string());
    req.options = Some(SendOptions {
        functions: Some(FunctionPolicy {
            allow: vec!["*".into()],
            deny: vec![],
            expose: ExposeMode::Native,
        }),
        filesystem_root: Some(root.to_string()),
        ..Default::default()
    });
    req
}

async fn call(rt: &Rt, id: &str, payload: Value) -> Result<Value, String> {
    rt.bus
        .call(id, payload, Some(Duration::from_secs(10)))
        .await
        .map_err(|e| e.to_string())
}

/// `harness::filesystem::grant` of `path` to `session`, which must succeed.
async fn grant(rt: &Rt, session: &str, path: &str) -> Value {
    let payload = json!({"session_id": session, "path": path});
    call(rt, "harness::filesystem::grant", payload)
        .await
        .unwrap()
}

/// `harness::filesystem::revoke` of `path` from `session`, which must succeed.
async fn revoke(rt: &Rt, session: &str, path: &str) -> Value {
    let payload = json!({"session_id": session, "path": path});
    call(rt, "harness::filesystem::revoke", payload)
        .await
        .unwrap()
}

/// `harness::filesystem::<what>` (`grants`, `info`) of `session`.
async fn fs_read(rt: &Rt, what: &str, session: &str) -> Value {
    let id = format!("harness::filesystem::{what}");
    call(rt, &id, json!({ "session_id": session }))
        .await
        .unwrap()
}

fn real(p: &std::path::Path) -> String {
    std::fs::canonicalize(p).unwrap().display().to_string()
}

#[tokio::test]
async fn grant_list_revoke_round_trip_and_refusals() {
    let rt = runtime(script(), config()).await;
    let base = tempfile::tempdir().unwrap();
    let data = base.path().join("data");
    let shared = base.path().join("shared");
    std::fs::create_dir_all(data.join("sessions")).unwrap();
    std::fs::create_dir_all(&shared).unwrap();
    rt.harness.set_protected_paths([data.clone()]);

    let g = grant(&rt, "s1", &shared.join(".").display().to_string()).await;
    assert_eq!(g["path"], real(&shared), "kept canonical");
    assert_eq!(g["created"], true);
    let again = grant(&rt, "s1", &real(&shared)).await;
    assert_eq!(
        again["created"], false,
        "a second grant of the same path is a no-op"
    );
    let list = fs_read(&rt, "grants", "s1").await;
    let paths = strings(&list["grants"], "path");
    assert_eq!(paths, vec![real(&shared).as_str()]);
    let other = fs_read(&rt, "grants", "s2").await;
    assert_eq!(other["grants"], json!([]), "grants are per session");
    let info = fs_read(&rt, "info", "s1").await;
    assert_eq!(info["grants"][0]["path"], real(&shared));
    assert!(info["default_root"].is_string(), "{info}");
    let info = call(&rt, "harness::filesystem::info", json!({}))
        .await
        .unwrap();
    assert_eq!(info["grants"], json!([]));

    // Refusals, each naming its field.
    let refused = |payload: Value, starts: &'static str| {
        let rt = &rt;
        async move {
            let e = call(rt, "harness::filesystem::grant", payload)
                .await
                .unwrap_err();
            assert!(e.contains(starts), "{e}");
            e
        }
    };
    refused(
        json!({"session_id": "s1", "path": "relative/dir"}),
        "path: 'relative/dir' is not an absolute path",
    )
    .await;
    refused(
        json!({"session_id": "s1", "path": "/no/such/dir/for/grants"}),
        "path: '/no/such/dir/for/grants':",
    )
    .await;
    for p in [
        data.clone(),
        data.join("sessions"),
        base.path().to_path_buf(),
    ] {
        let e = refused(
            json!({"session_id": "s1", "path": p.display().to_string()}),
            "cannot be granted",
        )
        .await;
        assert!(e.starts_with("harness/invalid_request: path:"), "{e}");
    }
    refused(
        json!({"session_id": "s1", "path": real(&shared), "mode": "rw"}),
        "mode",
    )
    .await;
    let e = call(
        &rt,
        "harness::filesystem::revoke",
        json!({"session_id": "s1", "path": real(&shared), "force": true}),
    )
    .await
    .unwrap_err();
    assert!(e.contains("force"), "{e}");

    let r = revoke(&rt, "s1", &real(&shared)).await;
    assert_eq!(r["revoked"], true);
    assert_eq!(r["grants"], json!([]));
    let r = revoke(&rt, "s1", &real(&shared)).await;
    assert_eq!(r["revoked"], false);
    assert_eq!(
        rt.bus
            .state_get("harness_filesystem_grants", "s1")
            .await
            .unwrap(),
        None,
        "an empty row is removed"
    );
}

#[tokio::test]
async fn the_sessions_grants_are_stamped_per_call_and_deleted_with_the_session() {
    let rt = runtime(script(), config()).await;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    rt.register("fs::read", None, move |p| {
        s.lock().unwrap().push(p);
        json!({"ok": true})
    });
    let root = tempfile::tempdir().unwrap();
    let shared = tempfile::tempdir().unwrap();
    let root_s = root.path().to_str().unwrap();

    let run = |text: &'static str| {
        let rt = &rt;
        async move {
            rt.run(send_in(text, "g1", root_s)).await;
        }
    };
    grant(&rt, "g1", &shared.path().display().to_string()).await;
    run("read one").await;
    assert_eq!(
        seen.lock().unwrap()[0]["fs_scope"],
        json!({"root": real(root.path()), "grants": [real(shared.path())], "boundary": "workspace"}),
        "the session's grants, not the model's '/'"
    );
    let info = fs_read(&rt, "info", "g1").await;
    assert_eq!(info["root"]["root"], real(root.path()));

    revoke(&rt, "g1", &real(shared.path())).await;
    run("again").await;
    assert_eq!(seen.lock().unwrap()[1]["fs_scope"]["grants"], json!([]));

    grant(&rt, "g1", &shared.path().display().to_string()).await;
    rt.delete_tree("g1").await;
    assert_eq!(
        rt.bus
            .state_get("harness_filesystem_grants", "g1")
            .await
            .unwrap(),
        None,
        "the grants row went with the session"
    );
}
