//! Real-process crash: a child process writes and enqueues as fast as it can and reports each
//! resolved call on stdout; the parent SIGKILLs it mid-stream and checks that every reported
//! write survived and every reported enqueue is either still queued or was handled.

mod common;

use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::sync::Arc;

use futures::FutureExt;
use harness_store::{Durability, Queues, Store};
use serde_json::json;

const CHILD_ENV: &str = "HARNESS_STORE_CRASH_CHILD_DB";

/// The child's body; a no-op when run as an ordinary test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_child() {
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return;
    };
    let store = Store::open(path.as_ref(), Durability::Full).unwrap();
    let queues = Queues::new(store.clone());
    queues.start(
        "q",
        Arc::new(|m| {
            async move {
                println!("handled {}", m.id);
                Ok(())
            }
            .boxed()
        }),
    );
    let mut writers = Vec::new();
    for w in 0..8 {
        let (store, queues) = (store.clone(), queues.clone());
        writers.push(tokio::spawn(async move {
            for i in 0u64.. {
                let key = format!("{w}-{i}");
                store.kv_set("crash", &key, &json!(i)).await.unwrap();
                println!("wrote {key}");
                let id = queues
                    .enqueue("q", &format!("g{w}"), "f", &json!(i))
                    .await
                    .unwrap();
                println!("enqueued {id}");
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
}

#[test]
fn sigkill_loses_no_resolved_write_or_enqueue() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("crash.db");
    let mut child = common::spawn_child("crash_child", CHILD_ENV, &db);
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let (mut wrote, mut enqueued, mut handled) = (Vec::new(), Vec::new(), HashSet::new());
    for line in stdout.lines() {
        let line = line.unwrap();
        if let Some(key) = line.strip_prefix("wrote ") {
            wrote.push(key.to_string());
        } else if let Some(id) = line.strip_prefix("enqueued ") {
            enqueued.push(id.parse::<i64>().unwrap());
        } else if let Some(id) = line.strip_prefix("handled ") {
            handled.insert(id.parse::<i64>().unwrap());
        }
        // SIGKILL (on Unix) mid-stream, then keep reading what the child printed before dying:
        // a message can be reported handled (and acked) after its "enqueued" line was read.
        if wrote.len() == 2000 {
            child.kill().unwrap();
        }
    }
    child.wait().unwrap();
    assert!(wrote.len() >= 2000, "child died early");

    let store = Store::open(&db, Durability::Full).unwrap();
    for key in &wrote {
        assert!(
            store.kv_get("crash", key).unwrap().is_some(),
            "lost write {key}"
        );
    }
    let queued: HashSet<i64> = store
        .read(|c| {
            let mut stmt = c.prepare("SELECT id FROM queue_messages WHERE queue = 'q'")?;
            let ids = stmt
                .query_map([], |r| r.get(0))?
                .collect::<Result<_, _>>()?;
            Ok(ids)
        })
        .unwrap();
    for id in &enqueued {
        assert!(
            queued.contains(id) || handled.contains(id),
            "lost message {id}"
        );
    }
}
