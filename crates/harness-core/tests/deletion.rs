//! `harness::delete-session-tree`: cancel, wait, tell the parent, delete child-first; tombstones,
//! idempotent repeats, failed attempts kept and retried under the next attempt number.

mod support;

use std::time::{Duration, Instant};

use harness_bus::Bus;
use harness_types::api::{
    DeleteTreeRequest, DeleteTreeStatusRequest, DeletionSnapshot, DeletionStatus, TurnStatus,
};
use serde_json::json;
use support::*;

fn delete(session_id: &str, attempt: Option<u32>) -> DeleteTreeRequest {
    DeleteTreeRequest {
        session_id: session_id.into(),
        attempt,
    }
}

async fn children(rt: &Rt, session_id: &str) -> Vec<String> {
    rt.tree(session_id)
        .await
        .children
        .into_iter()
        .map(|c| c.session_id)
        .collect()
}

async fn wait_done(rt: &Rt, operation_id: &str) -> DeletionSnapshot {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = rt
            .harness
            .delete_session_tree_status(DeleteTreeStatusRequest {
                operation_id: operation_id.into(),
            })
            .await
            .unwrap();
        if s.status != DeletionStatus::Deleting {
            return s;
        }
        assert!(Instant::now() < deadline, "deletion never ended: {s:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn session_exists(rt: &Rt, session_id: &str) -> bool {
    rt.sessions.get(session_id).unwrap().is_some()
}

#[tokio::test]
async fn deleting_a_finished_child_tells_the_parent_once_and_tombstones_the_id() {
    let (rt, r) = trip_with_one_child().await;
    let kids = children(&rt, &r.session_id).await;
    assert_eq!(kids.len(), 1);
    let child = &kids[0];

    let first = rt
        .harness
        .delete_session_tree(delete(child, None))
        .await
        .unwrap();
    assert_eq!(first.attempt, 1);
    assert_eq!(first.session_id, *child);
    assert!(first.operation_id.starts_with("delete_"));
    let done = wait_done(&rt, &first.operation_id).await;
    assert_eq!(done.status, DeletionStatus::Completed, "{done:?}");
    assert_eq!(done.deleted_session_ids, vec![child.clone()]);
    assert!(!session_exists(&rt, child));
    assert!(rt.status(child).await.is_none(), "the turn record went too");
    assert!(session_exists(&rt, &r.session_id), "the parent stays");
    assert!(children(&rt, &r.session_id).await.is_empty());

    // The parent reads one message about it, and its turn was not restarted.
    let notes: Vec<String> = rt
        .messages(&r.session_id)
        .into_iter()
        .filter(|(role, t)| role == "user" && t.contains("deleted sub-agent session"))
        .map(|(_, t)| t)
        .collect();
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(notes[0].contains(child.as_str()));
    assert_eq!(
        rt.status(&r.session_id).await.unwrap().turn_id.as_deref(),
        Some(r.turn_id.as_str())
    );

    // A repeat returns the same operation; a wrong attempt is refused by name.
    let again = rt
        .harness
        .delete_session_tree(delete(child, None))
        .await
        .unwrap();
    assert_eq!(again, done);
    let e = rt
        .harness
        .delete_session_tree(delete(child, Some(2)))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("attempt"), "{e}");
    let notes_after = rt
        .messages(&r.session_id)
        .into_iter()
        .filter(|(_, t)| t.contains("deleted sub-agent session"))
        .count();
    assert_eq!(notes_after, 1, "a repeat tells the parent nothing new");

    // The id is not reusable.
    let mut reuse = send("hello again");
    reuse.session_id = Some(child.clone());
    let e = rt.harness.send(reuse).await.unwrap_err();
    assert!(e.to_string().contains("session_id: session"), "{e}");
    assert!(e.to_string().contains("not reusable"), "{e}");

    // The event log has the snapshot, deleting then completed.
    let statuses: Vec<String> = rt
        .topics(child)
        .into_iter()
        .filter(|(t, _)| t == "harness::session-tree-deletion")
        .map(|(_, p)| p["status"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(statuses, ["deleting", "completed"]);
}

#[tokio::test]
async fn deleting_a_running_tree_cancels_every_member_and_deletes_children_first() {
    let rt = runtime(
        json!({"generations": [
            spawn_gen("^plan the trip", json!({"task": "find flights to Oslo"})),
            // The child streams slowly: the parent is parked on it when the deletion comes.
            text(Some("^find flights"), &"slow ".repeat(400), 20),
            text(None, "Booked", 0)
        ]}),
        config(),
    )
    .await;
    let r = rt.send(orchestrating("plan the trip")).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let child = loop {
        if let Some(c) = children(&rt, &r.session_id).await.into_iter().next() {
            if rt
                .status(&c)
                .await
                .is_some_and(|s| s.status == TurnStatus::Running)
            {
                break c;
            }
        }
        assert!(Instant::now() < deadline, "the child never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let op = rt
        .harness
        .delete_session_tree(delete(&r.session_id, None))
        .await
        .unwrap();
    // Admission closed at once: nothing new reaches a member.
    let mut late = send("one more thing");
    late.session_id = Some(child.clone());
    assert!(rt.harness.send(late).await.is_err());

    let done = wait_done(&rt, &op.operation_id).await;
    assert_eq!(done.status, DeletionStatus::Completed, "{done:?}");
    assert_eq!(
        done.deleted_session_ids,
        vec![child.clone(), r.session_id.clone()],
        "children before their parents"
    );
    assert!(!session_exists(&rt, &child));
    assert!(!session_exists(&rt, &r.session_id));
    assert!(rt.status(&r.session_id).await.is_none());
}

#[tokio::test]
async fn a_failed_attempt_keeps_the_data_and_is_retried_under_the_next_attempt() {
    let rt = replying("hi").await;
    let (r, _) = rt.run(send("hello")).await;

    // The transcript store refuses to confirm the delete: the attempt fails, data kept.
    rt.register("session::delete", None, |_| json!({"gone": "maybe"}));
    let op = rt
        .harness
        .delete_session_tree(delete(&r.session_id, None))
        .await
        .unwrap();
    let failed = wait_done(&rt, &op.operation_id).await;
    assert_eq!(failed.status, DeletionStatus::Failed);
    assert!(
        failed
            .error
            .as_deref()
            .unwrap_or("")
            .contains("did not confirm"),
        "{failed:?}"
    );
    assert!(failed.deleted_session_ids.is_empty());
    assert!(session_exists(&rt, &r.session_id), "fail closed: data kept");

    // A retry must name the next attempt.
    let e = rt
        .harness
        .delete_session_tree(delete(&r.session_id, None))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("retry with attempt 2"), "{e}");
    harness_session::register(&rt.bus, &rt.sessions);
    let retry = rt
        .harness
        .delete_session_tree(delete(&r.session_id, Some(2)))
        .await
        .unwrap();
    assert_eq!(retry.attempt, 2);
    let done = wait_done(&rt, &op.operation_id).await;
    assert_eq!(done.status, DeletionStatus::Completed, "{done:?}");
    assert_eq!(done.attempt, 2);
    assert!(!session_exists(&rt, &r.session_id));
}

#[tokio::test]
async fn bad_requests_name_their_field() {
    let rt = replying("hi").await;
    for (session_id, attempt, names) in [
        ("nobody", None, "session_id: unknown session"),
        ("", None, "session_id"),
        ("x", Some(0), "attempt"),
    ] {
        let e = rt
            .harness
            .delete_session_tree(delete(session_id, attempt))
            .await
            .unwrap_err();
        assert!(e.to_string().contains(names), "{session_id:?}: {e}");
    }
    let e = rt
        .bus
        .call(
            "harness::delete-session-tree",
            json!({"session_id": "x", "force": true}),
            None,
        )
        .await
        .unwrap_err();
    assert!(e.to_string().contains("force"), "{e}");
}

/// A send to a session with a turn record skips `session::ensure` (the record proves the
/// session was ensured). A session deleted behind the loop's back (`session::delete` called
/// directly, which leaves the record) refuses that send's append, and the send starts over,
/// ensuring it: the session is made again and holds, and shows the model, the new message only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_ensures_its_session_only_when_it_may_be_missing() {
    let rt = replying("done").await;
    let sessions = rt.sessions.clone();
    let ensured = rt.register_async("session::ensure", None, move |p| {
        let sessions = sessions.clone();
        async move {
            let made = sessions.ensure(serde_json::from_value(p).unwrap()).await;
            serde_json::to_value(made.unwrap()).unwrap()
        }
    });
    let to = |text: &str| harness_types::api::SendRequest {
        session_id: Some("s_ensure".into()),
        ..send(text)
    };
    let count = || ensured.load(std::sync::atomic::Ordering::SeqCst);

    let (_, s) = rt.run(to("first")).await;
    assert_eq!(s.status, TurnStatus::Completed);
    assert_eq!(count(), 1, "no record yet: ensured");
    let (_, s) = rt.run(to("second")).await;
    assert_eq!(s.status, TurnStatus::Completed);
    assert_eq!(count(), 1, "a record: not asked again");

    rt.ok("session::delete", json!({"session_id": "s_ensure"}))
        .await;
    assert!(!session_exists(&rt, "s_ensure"));
    assert!(rt.turn_record("s_ensure").await.is_some(), "left behind");
    let (r, s) = rt.run(to("third")).await;
    assert_eq!(s.status, TurnStatus::Completed);
    assert_eq!(count(), 2, "the refused append sent it back to ensure");
    assert!(session_exists(&rt, "s_ensure"));
    // The model saw the new session's message only, nothing the loop cached of the old one.
    let last = rt.recorder.seen.lock().unwrap().last().cloned().unwrap();
    let seen: Vec<String> = last.messages.iter().map(|m| m.text()).collect();
    assert_eq!(seen, ["third"]);
    let messages = rt.messages(&r.session_id);
    assert_eq!(
        messages,
        [
            ("user".to_string(), "third".to_string()),
            ("assistant".to_string(), "done".to_string())
        ]
    );
}
