//! The double's model of the separately installed queue worker (`engine::queue::enqueue`,
//! `queue::define`, its configuration entry `queue`), answering with the shapes recorded from
//! the real one (`recorded.json`, `record_the_queue_worker_shapes`):
//!
//! - `queue::define {queue, config}` → `{changed, queue}`; a `fifo` queue without
//!   `message_group_field`, or an unknown config field, fails `invocation_failed`
//!   (`handler error: …`). Definitions are kept in `configuration::get {id: "queue"}`'s
//!   `value.queue_configs`, defaults filled in.
//! - An invocation with `action: {type: "enqueue", queue}` → `{messageReceiptId}`; to a queue
//!   not defined it fails `enqueue_error` (`invocation_failed: handler error: queue '…' is not
//!   defined; call queue::define before enqueueing`).
//! - Delivery: the target gets `data` as enqueued plus `_caller_worker_id` (the queue worker's
//!   connection). FIFO queues run one message at a time per value of `message_group_field`,
//!   groups in parallel up to `concurrency`; a message without the field is dead-lettered. A
//!   failed delivery (any error, `invocation_stopped` of a killed worker included) is retried
//!   in place after `backoff_ms · 2^(attempt-1)`, once the target is registered again, up to
//!   `max_retries` retries; then it is dead-lettered and the group moves on.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use serde_json::{json, Value};

use super::CallError;

/// The queue worker's own connection id, as `_caller_worker_id` of its deliveries.
pub const QUEUE_WORKER_ID: &str = "0000000a-0000-4000-8000-00000000000a";

const FIELDS: &[&str] = &[
    "max_retries",
    "concurrency",
    "timeout_ms",
    "type",
    "message_group_field",
    "backoff_ms",
    "poll_interval_ms",
    "redeliver_on_engine_restart",
    "max_priority",
    "priority_field",
];

pub struct Job {
    pub function_id: String,
    pub data: Value,
}

#[derive(Default)]
pub struct QueueWorker {
    /// queue → its definition, defaults filled in (as stored in the configuration entry).
    pub configs: BTreeMap<String, Value>,
    /// (queue, group) → waiting jobs, in arrival order.
    pub waiting: HashMap<(String, String), VecDeque<Job>>,
    /// (queue, group) with a delivery in flight.
    pub busy: HashSet<(String, String)>,
    pub dead_letters: Vec<(String, Value)>,
    receipts: u64,
}

fn handler_error(message: String) -> CallError {
    CallError::new("invocation_failed", format!("handler error: {message}"))
}

impl QueueWorker {
    /// `queue::define`.
    pub fn define(&mut self, data: &Value) -> Result<Value, CallError> {
        let queue = data["queue"]
            .as_str()
            .unwrap_or_default()
            .trim()
            .to_string();
        if queue.is_empty() {
            return Err(handler_error("queue name is required".into()));
        }
        let given = data.get("config").cloned().unwrap_or_else(|| json!({}));
        if let Some(bad) = given
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, _)| k)
            .find(|k| !FIELDS.contains(&k.as_str()))
        {
            return Err(CallError::new(
                "invocation_failed",
                format!("Failed to parse input: unknown field `{bad}`"),
            ));
        }
        let mut config = json!({"backoff_ms": 1000, "concurrency": 10, "max_retries": 3,
            "poll_interval_ms": 100, "redeliver_on_engine_restart": false,
            "timeout_ms": 1_800_000u64, "type": "standard"});
        for (k, v) in given.as_object().into_iter().flatten() {
            config[k.as_str()] = v.clone();
        }
        if config["type"] == "fifo" && config["message_group_field"].as_str().is_none() {
            return Err(handler_error(format!(
                "queue '{queue}' with type 'fifo' requires message_group_field"
            )));
        }
        let changed = self.configs.get(&queue) != Some(&config);
        self.configs.insert(queue.clone(), config);
        Ok(json!({"changed": changed, "queue": queue}))
    }

    /// `configuration::get {id: "queue"}`.
    pub fn configuration(&self) -> Value {
        json!({"id": "queue", "value": {"adapter": {"config": {"file_path": "./data/queue",
            "save_interval_ms": 5000, "store_method": "file_based"}, "name": "builtin"},
            "queue_configs": self.configs}})
    }

    /// The enqueue action.
    pub fn enqueue(
        &mut self,
        queue: &str,
        function_id: &str,
        data: Value,
    ) -> Result<Value, CallError> {
        let Some(config) = self.configs.get(queue) else {
            return Err(CallError::new(
                "enqueue_error",
                format!("invocation_failed: handler error: queue '{queue}' is not defined; call queue::define before enqueueing"),
            ));
        };
        self.receipts += 1;
        let receipt = format!("0000000b-0000-4000-8000-{:012x}", self.receipts);
        let group = if config["type"] == "fifo" {
            let field = config["message_group_field"].as_str().unwrap_or_default();
            match data.get(field) {
                Some(Value::String(s)) if !s.is_empty() => s.clone(),
                Some(Value::Number(n)) => n.to_string(),
                // Accepted, then dead-lettered by the consumer (as the real one does).
                _ => {
                    self.dead_letters.push((queue.to_string(), data));
                    return Ok(json!({"messageReceiptId": receipt}));
                }
            }
        } else {
            // A standard queue: every message its own group.
            receipt.clone()
        };
        self.waiting
            .entry((queue.to_string(), group))
            .or_default()
            .push_back(Job {
                function_id: function_id.to_string(),
                data,
            });
        Ok(json!({"messageReceiptId": receipt}))
    }

    /// The next deliveries to start: one per idle group, within each queue's concurrency.
    pub fn next(&mut self) -> Vec<((String, String), Job, Value)> {
        let mut out = Vec::new();
        let keys: Vec<(String, String)> = self.waiting.keys().cloned().collect();
        for key in keys {
            if self.busy.contains(&key) {
                continue;
            }
            let config = self.configs.get(&key.0).cloned().unwrap_or(Value::Null);
            let limit = config["concurrency"].as_u64().unwrap_or(10).max(1) as usize;
            if self.busy.iter().filter(|(q, _)| *q == key.0).count() >= limit {
                continue;
            }
            let Some(job) = self.waiting.get_mut(&key).and_then(VecDeque::pop_front) else {
                continue;
            };
            if self.waiting.get(&key).is_some_and(VecDeque::is_empty) {
                self.waiting.remove(&key);
            }
            self.busy.insert(key.clone());
            out.push((key, job, config));
        }
        out
    }
}
