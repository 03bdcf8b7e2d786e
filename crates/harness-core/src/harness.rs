//! The `Harness`: shared state of the loop and its typed bus helpers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use harness_bus::{Bus, BusError, QueueDef};
use harness_types::api::TurnStepPayload;
use harness_types::session::*;
use harness_types::HarnessError;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::config::HarnessConfig;
use crate::locks::SessionLocks;
use crate::record::TurnRecord;
use crate::{TURN_QUEUE, TURN_SCOPE};

/// The loop. Cheap to clone; every clone shares the same locks and signals.
#[derive(Clone)]
pub struct Harness {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) bus: Arc<dyn Bus>,
    /// Swapped whole by `harness::on-config-change`; readers take an `Arc` and never hold the
    /// lock across an await.
    pub(crate) config: std::sync::RwLock<Arc<HarnessConfig>>,
    pub(crate) locks: SessionLocks,
    /// In-process cancel signals of running turns, by turn id. A std Mutex: held only to insert,
    /// fire or remove a token.
    pub(crate) signals: Mutex<HashMap<String, CancellationToken>>,
    /// Bumped by `harness::on-functions-change`: the function registry changed.
    pub(crate) functions_generation: std::sync::atomic::AtomicU64,
    /// Until when the judge is skipped after a failure (process-wide).
    pub(crate) judge_paused_until: Mutex<Option<std::time::Instant>>,
}

pub(crate) type Result<T> = std::result::Result<T, HarnessError>;

fn bus_err(e: BusError) -> HarnessError {
    e.into_harness()
}

impl Harness {
    pub fn new(bus: Arc<dyn Bus>, config: HarnessConfig) -> Harness {
        Harness {
            inner: Arc::new(Inner {
                bus,
                config: std::sync::RwLock::new(Arc::new(config)),
                locks: SessionLocks::default(),
                signals: Mutex::new(HashMap::new()),
                judge_paused_until: Mutex::new(None),
                functions_generation: std::sync::atomic::AtomicU64::new(1),
            }),
        }
    }

    pub fn bus(&self) -> &Arc<dyn Bus> {
        &self.inner.bus
    }

    pub fn config(&self) -> Arc<HarnessConfig> {
        self.inner.config.read().expect("config lock").clone()
    }

    /// Applies a new configuration; re-binds the sweep when its expression changed.
    pub async fn reconfigure(&self, config: HarnessConfig) -> Result<()> {
        let old = self.config();
        *self.inner.config.write().expect("config lock") = Arc::new(config);
        if old.sweep_expression != self.config().sweep_expression {
            self.ensure_sweep().await?;
        }
        Ok(())
    }

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
        self.ensure_sweep().await?;
        self.follow_registry().await;
        self.redrive_running().await?;
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

    /// The registry generation steps compare against what a turn last acknowledged.
    pub(crate) fn functions_generation(&self) -> u64 {
        self.inner
            .functions_generation
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn functions_changed(&self) {
        self.inner
            .functions_generation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Binds `harness::sweep-pending` to the `cron` trigger with the configured expression,
    /// replacing a binding with another expression (new first, then the old one goes).
    async fn ensure_sweep(&self) -> Result<()> {
        let bus = &self.inner.bus;
        let expression = self.config().sweep_expression.clone();
        let existing: Vec<harness_bus::Binding> = bus
            .bindings("cron")
            .await
            .map_err(bus_err)?
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

    /// Re-enqueues the current step of every `running` record. A crash between persisting a
    /// record and enqueueing its step would otherwise strand the turn; a step that was in fact
    /// still queued runs once and the duplicate is dropped by the stale guard.
    async fn redrive_running(&self) -> Result<()> {
        let records = self
            .inner
            .bus
            .state_list(TURN_SCOPE)
            .await
            .map_err(bus_err)?;
        let mut redriven = 0;
        for (_, value) in records {
            let Ok(rec) = serde_json::from_value::<TurnRecord>(value) else {
                continue;
            };
            if !rec.is_terminal() && self.recover(&rec.session_id).await? {
                redriven += 1;
            }
        }
        if redriven > 0 {
            tracing::info!(redriven, "re-enqueued the current step of running turns");
        }
        Ok(())
    }

    /// A turn a crash may have left without a queued step: a running one gets its current step
    /// again; a parked one whose release was cut gets the interrupted result for a call left
    /// `triggered` (it may have run, once) and runs on if nothing is pending. Returns whether a
    /// step was enqueued.
    async fn recover(&self, session_id: &str) -> Result<bool> {
        let _guard = self.inner.locks.lock(session_id).await;
        let Some(rec) = self.load_record(session_id).await? else {
            return Ok(false);
        };
        let t = crate::machine::next(Some(rec), crate::machine::Input::Recover)
            .map_err(crate::step::illegal)?;
        let Some(mut rec) = t.record else {
            return Ok(false);
        };
        let mut enqueued = false;
        for effect in t.effects {
            enqueued |= effect == crate::machine::Effect::EnqueueStep;
            let closing = matches!(effect, crate::machine::Effect::CloseInterrupted(_));
            self.apply(&mut rec, effect).await?;
            if closing {
                enqueued |= self.resume_if_settled(&mut rec).await?;
            }
        }
        Ok(enqueued)
    }

    // --- typed bus helpers ---------------------------------------------------------------

    fn session_timeout(&self) -> Option<Duration> {
        Some(Duration::from_millis(self.config().session_timeout_ms))
    }

    /// Calls a function with retries for transient dependency failures (a sibling restarting).
    pub(crate) async fn call<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        function_id: &str,
        req: &Req,
    ) -> Result<Resp> {
        let payload =
            serde_json::to_value(req).map_err(|e| HarnessError::internal(e.to_string()))?;
        let mut attempt = 0;
        loop {
            match self
                .inner
                .bus
                .call(function_id, payload.clone(), self.session_timeout())
                .await
            {
                Ok(v) => {
                    return serde_json::from_value(v).map_err(|e| {
                        HarnessError::dependency(format!(
                            "{function_id} answered an unexpected shape: {e}"
                        ))
                    })
                }
                Err(e) if e.is_transient_dependency() && attempt < 10 => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(e) => return Err(bus_err(e)),
            }
        }
    }

    pub(crate) async fn load_record(&self, session_id: &str) -> Result<Option<TurnRecord>> {
        let v = self
            .inner
            .bus
            .state_get(TURN_SCOPE, session_id)
            .await
            .map_err(bus_err)?;
        match v {
            None => Ok(None),
            Some(v) => serde_json::from_value(v).map(Some).map_err(|e| {
                HarnessError::state(format!("turn record of '{session_id}' is unreadable: {e}"))
            }),
        }
    }

    pub(crate) async fn save_record(&self, rec: &mut TurnRecord) -> Result<()> {
        rec.updated_at = harness_types::now_ms();
        let v = serde_json::to_value(&*rec).map_err(|e| HarnessError::internal(e.to_string()))?;
        self.inner
            .bus
            .state_set(TURN_SCOPE, &rec.session_id, v)
            .await
            .map_err(bus_err)
    }

    pub(crate) async fn enqueue_step(&self, rec: &TurnRecord) -> Result<()> {
        let payload = TurnStepPayload {
            session_id: rec.session_id.clone(),
            turn_id: rec.turn_id.clone(),
            step: rec.step,
            message_preview: rec.message_preview.clone(),
            depth: rec.depth,
        };
        let payload =
            serde_json::to_value(payload).map_err(|e| HarnessError::internal(e.to_string()))?;
        let mut attempt = 0;
        loop {
            match self
                .inner
                .bus
                .enqueue(TURN_QUEUE, "harness::turn", payload.clone())
                .await
            {
                Ok(()) => return Ok(()),
                Err(e) if attempt < 5 => {
                    attempt += 1;
                    tracing::warn!(session = %rec.session_id, "enqueue failed, retrying: {e}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(bus_err(e)),
            }
        }
    }

    pub(crate) async fn barrier(&self) -> Result<()> {
        self.inner.bus.barrier().await.map_err(bus_err)
    }

    pub(crate) async fn append(&self, req: AppendRequest) -> Result<AppendResponse> {
        self.call("session::append", &req).await
    }

    pub(crate) async fn append_custom(
        &self,
        session_id: &str,
        entry_id: String,
        custom_type: &str,
        data: Value,
        turn_id: &str,
    ) -> Result<AppendResponse> {
        self.append(AppendRequest {
            session_id: session_id.to_string(),
            message: None,
            custom: Some(CustomEntry {
                custom_type: custom_type.to_string(),
                data,
            }),
            entry_id: Some(entry_id),
            origin: Some(serde_json::json!({ "turn_id": turn_id })),
        })
        .await
    }

    pub(crate) async fn set_status(
        &self,
        session_id: &str,
        status: SessionStatus,
        reason: Option<&str>,
    ) -> Result<()> {
        let _: SetStatusResponse = self
            .call(
                "session::set-status",
                &SetStatusRequest {
                    session_id: session_id.to_string(),
                    status,
                    reason: reason.map(str::to_string),
                },
            )
            .await?;
        Ok(())
    }

    /// Every entry of the session (custom records included), paging through `session::messages`.
    pub(crate) async fn transcript(&self, session_id: &str) -> Result<Vec<Entry>> {
        let mut out = Vec::new();
        let mut cursor = None;
        loop {
            let page: MessagesResponse = self
                .call(
                    "session::messages",
                    &MessagesRequest {
                        session_id: session_id.to_string(),
                        include_custom: true,
                        limit: Some(500),
                        cursor,
                        after_entry_id: None,
                    },
                )
                .await?;
            out.extend(page.messages);
            match page.next_cursor {
                Some(c) => cursor = Some(c),
                None => return Ok(out),
            }
        }
    }

    pub(crate) fn judge_paused(&self) -> bool {
        let until = self
            .inner
            .judge_paused_until
            .lock()
            .expect("judge pause lock");
        until.is_some_and(|t| std::time::Instant::now() < t)
    }

    pub(crate) fn pause_judge(&self) {
        *self
            .inner
            .judge_paused_until
            .lock()
            .expect("judge pause lock") = Some(std::time::Instant::now() + Duration::from_secs(30));
    }

    // --- cancel signals ----------------------------------------------------------------------

    pub(crate) fn signal(&self, turn_id: &str) -> CancellationToken {
        let mut signals = self.inner.signals.lock().expect("signals lock");
        signals.entry(turn_id.to_string()).or_default().clone()
    }

    pub(crate) fn fire_signal(&self, turn_id: &str) {
        let signals = self.inner.signals.lock().expect("signals lock");
        if let Some(token) = signals.get(turn_id) {
            token.cancel();
        }
    }

    pub(crate) fn clear_signal(&self, turn_id: &str) {
        self.inner
            .signals
            .lock()
            .expect("signals lock")
            .remove(turn_id);
    }
}
