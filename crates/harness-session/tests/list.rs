//! `session::list` answers what a list view shows without a request per session: the preview,
//! the latest model and provider, the parent of a sub-agent, and the cost of the session's tree.

mod common;

use common::create;
use harness_session::SessionStore;
use harness_types::message::{AgentMessage, AssistantMessage, ContentBlock, Usage};
use harness_types::session::*;
use serde_json::json;

async fn add(s: &SessionStore, sid: &str, message: AgentMessage) {
    common::add(s, sid, None, message).await;
}

fn reply(model: &str, provider: &str, cost: f64) -> AgentMessage {
    AgentMessage::Assistant(AssistantMessage {
        usage: Some(Usage {
            cost_usd: Some(cost),
            ..Default::default()
        }),
        ..AssistantMessage::ended(vec![ContentBlock::text("ok")], model, provider, 1)
    })
}

#[tokio::test]
async fn list_entries_carry_preview_model_parent_and_tree_cost() {
    let dir = tempfile::tempdir().unwrap();
    let s = common::open(&dir.path().join("t.db")).await;
    create(&s, "s_root", json!({})).await;
    create(&s, "s_child", json!({"parent_session_id": "s_root"})).await;
    create(&s, "s_grandchild", json!({"parent_session_id": "s_child"})).await;
    create(&s, "s_empty", json!({})).await;
    let long = "é".repeat(100);
    add(&s, "s_root", AgentMessage::user_text(long.clone(), 1)).await;
    add(&s, "s_root", reply("first", "scripted", 0.25)).await;
    add(&s, "s_root", AgentMessage::user_text("second question", 2)).await;
    add(&s, "s_root", reply("second", "openai", 0.5)).await;
    add(&s, "s_child", AgentMessage::user_text("task", 1)).await;
    add(&s, "s_child", reply("m", "scripted", 1.0)).await;
    add(&s, "s_grandchild", reply("m", "scripted", 2.0)).await;

    let list = s.list(&ListRequest::default()).unwrap();
    let by = |id: &str| {
        list.sessions
            .iter()
            .find(|m| m.session_id == id)
            .unwrap_or_else(|| panic!("{id} listed"))
            .clone()
    };
    let root = by("s_root");
    assert_eq!(
        root.preview.as_deref(),
        Some(&long[..160]),
        "80 characters, not bytes"
    );
    assert_eq!(root.preview.as_ref().unwrap().chars().count(), 80);
    assert_eq!(
        (root.model.as_deref(), root.provider.as_deref()),
        (Some("second"), Some("openai")),
        "the latest assistant message's"
    );
    assert_eq!(root.parent_session_id, None);
    assert_eq!(root.cost_usd, Some(3.75), "root + child + grandchild");
    let child = by("s_child");
    assert_eq!(child.parent_session_id.as_deref(), Some("s_root"));
    assert_eq!(child.cost_usd, Some(3.0));
    let empty = by("s_empty");
    assert_eq!((empty.preview, empty.model), (None, None));
    assert_eq!(empty.cost_usd, Some(0.0));
    // The single-session read stays as it was.
    assert_eq!(s.get("s_root").unwrap().unwrap().preview, None);
}
