//! What the session store's tests share: opening a store on a file, and the typed requests they
//! send again and again.
#![allow(dead_code)] // each test file uses its own part

use harness_session::SessionStore;
use harness_store::{Durability, Store};
use harness_types::message::{AgentMessage, ContentBlock, Usage};
use harness_types::session::*;
use serde_json::Value;

/// A session store on the database file `path`.
pub async fn open(path: &std::path::Path) -> SessionStore {
    let store = Store::open(path, Durability::Normal).unwrap();
    SessionStore::open(store).await.unwrap()
}

pub async fn create(s: &SessionStore, sid: &str, metadata: Value) {
    s.create(CreateRequest {
        session_id: Some(sid.into()),
        metadata: Some(metadata),
        ..Default::default()
    })
    .await
    .unwrap();
}

/// Appends `message` (as entry `entry_id` when given); the entry's `seq`.
pub async fn add(
    s: &SessionStore,
    sid: &str,
    entry_id: Option<&str>,
    message: AgentMessage,
) -> i64 {
    s.append(AppendRequest {
        session_id: sid.into(),
        message: Some(message),
        custom: None,
        entry_id: entry_id.map(Into::into),
        origin: None,
    })
    .await
    .unwrap()
    .seq
}

/// An update that sets entry `entry_id`'s content to `text` (and its usage, when given).
pub fn edit(sid: &str, entry_id: &str, text: &str, usage: Option<Usage>) -> UpdateMessageRequest {
    UpdateMessageRequest {
        session_id: sid.into(),
        entry_id: entry_id.into(),
        content: vec![ContentBlock::text(text)],
        usage,
        stop_reason: None,
        details: None,
        expected_revision: None,
        origin: None,
    }
}

/// Runs test `name` of the running test binary as a child process (a real one, to be killed),
/// with its database path `db` in the environment variable `env` and its stdout piped.
pub fn spawn_child(name: &str, env: &str, db: &std::path::Path) -> std::process::Child {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(env, db)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}
