//! The queue provider route: declaring a harness queue in the queue worker.
//!
//! `TriggerAction::Enqueue{queue}` only works for a queue the queue worker has defined (its
//! `queue_configs`, stored in the configuration worker under id `queue`). The harness needs
//! its queues FIFO grouped by its group field, so at start it reads that configuration: a
//! matching definition is kept as the operator tuned it, a missing one is declared through
//! `queue::define`, and a conflicting one (or no way to declare it) stops the start with the
//! exact block the operator must add.

use serde_json::{json, Value};

use harness_bus::QueueDef;

/// The configuration id the queue worker stores its settings under.
pub(crate) const QUEUE_CONFIG_ID: &str = "queue";
/// The queue worker's function that declares (and persists) a named queue.
pub(crate) const DEFINE_FUNCTION: &str = "queue::define";
/// How often the queue worker's consumer looks again for a delayed retry. A new message
/// wakes it at once; the upstream builtin transport polls at this interval instead, so keep it
/// small (each poll is a lock and a map lookup in the queue worker).
pub(crate) const POLL_INTERVAL_MS: u64 = 5;

/// What the stored configuration says about one queue.
#[derive(Debug, PartialEq)]
pub(crate) enum Declared {
    /// Not in `queue_configs` (or no configuration stored yet).
    Missing,
    /// Declared FIFO on the right group field.
    Fits,
    /// Declared otherwise: what it says, for the error.
    Conflicts(String),
}

/// Reads `configuration::get {id: "queue"}`'s answer (`{value: {queue_configs: {…}}, …}`).
pub(crate) fn declared(config: &Value, def: &QueueDef) -> Declared {
    let Some(q) = config
        .get("value")
        .and_then(|v| v.get("queue_configs"))
        .and_then(|c| c.get(&def.queue))
    else {
        return Declared::Missing;
    };
    if q.get("redeliver_on_engine_restart") != Some(&Value::Bool(true)) {
        tracing::warn!(
            queue = %def.queue,
            "the queue worker's declaration lacks redeliver_on_engine_restart: true; a step in flight when the engine restarts holds its session until timeout_ms"
        );
    }
    let kind = q.get("type").and_then(Value::as_str).unwrap_or("standard");
    let field = q.get("message_group_field").and_then(Value::as_str);
    if kind == "fifo" && field == Some(def.message_group_field.as_str()) {
        Declared::Fits
    } else {
        Declared::Conflicts(format!(
            "type: {kind}, message_group_field: {}",
            field.unwrap_or("(none)")
        ))
    }
}

/// The `queue::define` request for `def`.
pub(crate) fn define_request(def: &QueueDef) -> Value {
    json!({
        "queue": def.queue,
        "config": {
            "type": "fifo",
            "message_group_field": def.message_group_field,
            "concurrency": def.concurrency.max(1),
            "max_retries": def.max_retries,
            "backoff_ms": def.backoff_ms,
            "timeout_ms": def.visibility_timeout_ms.max(1000),
            "poll_interval_ms": POLL_INTERVAL_MS,
            // A delivery in flight when the engine restarts never gets its answer: without
            // this the group (the session) waits out `timeout_ms`. Delivering a step twice
            // is safe here (the loop's exact (turn_id, step) stale guard drops the repeat).
            "redeliver_on_engine_restart": true,
        }
    })
}

/// What the operator must add to the queue worker's configuration for `def`.
pub(crate) fn required_block(def: &QueueDef) -> String {
    format!(
        "queue_configs:\n  {}:\n    type: fifo\n    message_group_field: {}\n    concurrency: {}\n    redeliver_on_engine_restart: true",
        def.queue,
        def.message_group_field,
        def.concurrency.max(1)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def() -> QueueDef {
        QueueDef {
            queue: "harness-turn".into(),
            message_group_field: "session_id".into(),
            concurrency: 16,
            max_retries: 3,
            backoff_ms: 1000,
            visibility_timeout_ms: 600_000,
        }
    }

    #[test]
    fn a_fifo_definition_on_the_group_field_fits_whatever_its_tuning() {
        let config = json!({"id": "queue", "value": {"queue_configs": {"harness-turn":
            {"type": "fifo", "message_group_field": "session_id", "concurrency": 3}}}});
        assert_eq!(declared(&config, &def()), Declared::Fits);
    }

    #[test]
    fn a_standard_or_otherwise_grouped_definition_conflicts() {
        let standard = json!({"value": {"queue_configs": {"harness-turn": {"type": "standard"}}}});
        assert_eq!(
            declared(&standard, &def()),
            Declared::Conflicts("type: standard, message_group_field: (none)".into())
        );
        let other = json!({"value": {"queue_configs": {"harness-turn":
            {"type": "fifo", "message_group_field": "turn_id"}}}});
        assert!(matches!(declared(&other, &def()), Declared::Conflicts(_)));
    }

    #[test]
    fn no_stored_configuration_or_no_entry_is_missing() {
        assert_eq!(declared(&json!({"value": null}), &def()), Declared::Missing);
        assert_eq!(
            declared(&json!({"value": {"queue_configs": {}}}), &def()),
            Declared::Missing
        );
    }

    #[test]
    fn the_definition_is_fifo_grouped_with_the_step_deadline_as_timeout() {
        let r = define_request(&def());
        assert_eq!(r["queue"], "harness-turn");
        assert_eq!(r["config"]["type"], "fifo");
        assert_eq!(r["config"]["message_group_field"], "session_id");
        assert_eq!(r["config"]["timeout_ms"], 600_000);
        assert_eq!(r["config"]["redeliver_on_engine_restart"], true);
        assert!(required_block(&def()).contains("message_group_field: session_id"));
    }
}
