//! Start-up: the queues the loop runs on, the sweep's binding, following the registry, and
//! the recovery of what a crash left (`recover.rs`).

use harness_bus::QueueDef;
use harness_types::HarnessError;

use crate::harness::{Harness, Result};
use crate::TURN_QUEUE;

impl Harness {
    /// Ensures the `harness-turn` queue (failing loudly if it cannot be) and redrives turns a
    /// crash left `running` without a queued step. Call after `register`.
    pub async fn start(&self) -> Result<()> {
        let c = self.config();
        self.inner
            .bus
            .define_queue(QueueDef {
                queue: TURN_QUEUE.into(),
                message_group_field: "session_id".into(),
                concurrency: c.queue_concurrency,
                max_retries: 3,
                backoff_ms: 1000,
                visibility_timeout_ms: c.step_visibility_timeout_ms,
            })
            .await
            .map_err(|e| {
                HarnessError::dependency(format!("cannot ensure the {TURN_QUEUE} queue: {e}"))
            })?;
        self.inner
            .bus
            .define_queue(QueueDef {
                queue: crate::DELETION_QUEUE.into(),
                message_group_field: "operation_id".into(),
                concurrency: 2,
                max_retries: 3,
                backoff_ms: 1000,
                // A step waits up to its attempt's deadline (120 s) for turns to end.
                visibility_timeout_ms: 180_000,
            })
            .await
            .map_err(|e| {
                HarnessError::dependency(format!(
                    "cannot ensure the {} queue: {e}",
                    crate::DELETION_QUEUE
                ))
            })?;
        self.ensure_sweep().await?;
        self.follow_registry().await;
        self.redrive_running().await?;
        self.redrive_deletions().await?;
        // A model's binding ends with its turn; one a crash left behind goes now.
        if let Err(e) = self.sweep_model_bindings().await {
            tracing::warn!("could not sweep the bindings of ended turns: {e}");
        }
        // Settle what a crash may have left waiting (children that ended, expired calls).
        self.sweep_pending(Default::default()).await.map(|_| ())
    }

    /// On an engine that announces registry changes (`engine::functions-available`), binds
    /// `harness::on-functions-change` to it once; elsewhere there is nothing to follow.
    async fn follow_registry(&self) {
        let bus = &self.inner.bus;
        let bound = bus
            .bindings("engine::functions-available")
            .await
            .map(|b| {
                b.iter()
                    .any(|b| b.function_id == "harness::on-functions-change")
            })
            .unwrap_or(false);
        if !bound {
            let _ = bus
                .call(
                    "engine::register_trigger",
                    serde_json::json!({"trigger_type": "engine::functions-available", "function_id": "harness::on-functions-change", "config": {}}),
                    self.session_timeout(),
                )
                .await;
        }
    }

    /// Binds `harness::sweep-pending` to the `cron` trigger with the configured expression,
    /// replacing a binding with another expression (new first, then the old one goes).
    pub(crate) async fn ensure_sweep(&self) -> Result<()> {
        let bus = &self.inner.bus;
        let expression = self.config().sweep_expression.clone();
        let existing: Vec<harness_bus::Binding> = bus
            .bindings("cron")
            .await
            .map_err(|e| e.into_harness())?
            .into_iter()
            .filter(|b| b.function_id == "harness::sweep-pending")
            .collect();
        let mut keep = existing
            .iter()
            .any(|b| b.config["expression"] == expression);
        if !keep {
            bus.call(
                "engine::register_trigger",
                serde_json::json!({"trigger_type": "cron", "function_id": "harness::sweep-pending", "config": {"expression": expression}}),
                self.session_timeout(),
            )
            .await
            .map_err(|e| HarnessError::invalid(format!("sweep_expression: {}", e.message)))?;
            keep = true;
        }
        for b in existing {
            if keep && b.config["expression"] != expression {
                let _ = bus
                    .call(
                        "engine::unregister_trigger",
                        serde_json::json!({"id": b.id}),
                        self.session_timeout(),
                    )
                    .await;
            }
        }
        Ok(())
    }
}
