//! Queue routes: how a queue is realised on the engine (the queue worker's enqueue, a topic,
//! or FIFO shards), the delivery of a queued call under its group's lock, and publishing.

use std::collections::HashMap;
use std::sync::{Arc, MutexGuard, Weak};
use std::time::Duration;

use harness_bus::{BusError, CallContext, FunctionDef, QueueDef};
use harness_types::digest::fnv1a;
use harness_types::now_ms;
use iii_sdk::protocol::RegisterTriggerInput;
use iii_sdk::TriggerAction;
use serde_json::{json, Value};
use tokio::sync::{watch, Mutex as AsyncMutex};

use crate::bus::{IiiBus, Inner, DELIVER_FUNCTION};
use crate::calls::{Engine, DEFAULT_CALL_TIMEOUT, DELIVERY};
use crate::error::from_sdk;
use crate::options::QueueMode;
use crate::provider;

/// State scope of the dedupe rows of published events.
const PUBLISHED_SCOPE: &str = "harness_published";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    Enqueue,
    /// One topic, `standard`: the engine's consumer polls every 100 ms (fixed).
    Topic,
    /// `n` FIFO topics (`<queue>.<i>`), a group always on the same one.
    Shards(u32),
}

struct QueueRoute {
    route: Route,
    group_field: String,
    visibility: Duration,
}

/// The queues this worker defined and the locks of their groups, under one lock
/// (`Inner::queues`).
#[derive(Default)]
pub(crate) struct Queues {
    routes: HashMap<String, QueueRoute>,
    groups: HashMap<String, Weak<AsyncMutex<()>>>,
}

impl Inner {
    fn queues(&self) -> MutexGuard<'_, Queues> {
        self.queues.lock().expect("queues lock")
    }
}

impl IiiBus {
    fn group_lock(&self, key: &str) -> Arc<AsyncMutex<()>> {
        let mut queues = self.inner.queues();
        let groups = &mut queues.groups;
        if let Some(l) = groups.get(key).and_then(Weak::upgrade) {
            return l;
        }
        let l = Arc::new(AsyncMutex::new(()));
        groups.insert(key.to_string(), Arc::downgrade(&l));
        if groups.len() > 1024 && groups.len().is_power_of_two() {
            groups.retain(|_, w| w.strong_count() > 0);
        }
        l
    }

    /// `harness::queue::deliver`: runs one queued call under its group's lock.
    pub(crate) fn register_deliver(&self) {
        let me = Arc::downgrade(&self.inner);
        let def = FunctionDef::new(
            DELIVER_FUNCTION,
            "Internal: delivery target of the harness queues ({queue, function_id, payload}); runs the call under its group's lock.",
        )
        .internal();
        let handler = move |envelope: Value, _ctx: CallContext| {
            let me = me.clone();
            async move {
                let inner = me.upgrade().ok_or_else(|| {
                    BusError::new("not_connected", "the harness bus is shutting down")
                })?;
                let bus = IiiBus { inner };
                bus.deliver(envelope).await
            }
        };
        self.add_function(def, Arc::new(handler));
    }

    async fn deliver(&self, envelope: Value) -> Result<Value, BusError> {
        let queue = envelope["queue"].as_str().unwrap_or_default().to_string();
        let function_id = envelope["function_id"]
            .as_str()
            .ok_or_else(|| BusError::new("harness/invalid_request", "function_id: required"))?
            .to_string();
        let payload = envelope.get("payload").cloned().unwrap_or(Value::Null);
        let again = payload.clone();
        let (group_field, visibility, shard) = {
            match self.inner.queues().routes.get(&queue) {
                Some(q) => (
                    q.group_field.clone(),
                    q.visibility,
                    matches!(q.route, Route::Shards(_)),
                ),
                None => (String::new(), DEFAULT_CALL_TIMEOUT, false),
            }
        };
        let group = match payload.get(&group_field) {
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
            None => String::new(),
        };
        // After a reconnect nothing runs until the engine was given back what it lost: a step
        // reading a turn record the engine rolled back could replay an older step.
        self.settled().await;
        let lock = self.group_lock(&format!("{queue}\u{0}{group}"));
        let _held = lock.lock().await;
        let local = self.inner.local(&function_id);
        let mut lost = self.inner.link.disconnects.subscribe();
        lost.borrow_and_update();
        let (lose, mut lost_here) = watch::channel(false);
        let me = self.clone();
        let fid = function_id.clone();
        let run = DELIVERY.scope(Arc::new(lose), async move {
            match local {
                Some(local) => local.handler.call(payload, CallContext::default()).await,
                None => me.invoke(&fid, payload, Some(visibility), None, None).await,
            }
        });
        // The step runs as its own task so a lost link can end it where it stands, exactly as
        // a crash of this worker would: nothing it has not written yet gets written, and the
        // redriven step finds what it checkpointed (a `triggered` call is closed as
        // interrupted, a generation without its `generated` mark is asked again).
        let mut task = self.inner.rt.spawn(run);
        let link_lost = || {
            BusError::new(
                "not_connected",
                format!("{function_id}: the link to the iii engine dropped; the step resumes after the reconnect"),
            )
        };
        let outcome = tokio::select! {
            r = &mut task => match r {
                Ok(r) => r,
                Err(_) => return Err(BusError::internal(format!("{function_id} panicked while handling the call"))),
            },
            _ = lost.changed() => {
                task.abort();
                return Err(link_lost());
            }
            // Only a loss counts: the sender is dropped (closed) when the task ends normally.
            Ok(_) = lost_here.wait_for(|l| *l) => {
                task.abort();
                return Err(link_lost());
            }
            _ = tokio::time::sleep(visibility) => {
                task.abort();
                return Err(BusError::timeout(&function_id, visibility.as_millis() as u64));
            }
        };
        match outcome {
            Ok(_) => Ok(json!({"ok": true})),
            // A retry by the engine would hold a FIFO shard through its backoff: the call is
            // queued again at the back of its shard instead (the loop keeps one live step per
            // session, so this cannot overtake another step of the session).
            Err(e) if e.is_transient_dependency() && e.code != "not_connected" && shard => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                tracing::warn!(function = %function_id, "queued call failed transiently, queued again: {e}");
                self.enqueue_call(&queue, &function_id, again)
                    .await
                    .map(|_| json!({"ok": false, "requeued": true}))
            }
            Err(e) if e.is_transient_dependency() => Err(e),
            // A permanent failure (a step of a session this worker's store does not know) would
            // fail again on every retry: it is acknowledged, and the loop's redrive (at start and
            // after every reconnect) is what picks a running turn up again.
            Err(e) => {
                tracing::warn!(function = %function_id, "queued call failed, not retried: {e}");
                Ok(json!({"ok": false, "error": {"code": e.code, "message": e.message}}))
            }
        }
    }

    /// The enqueue route needs `def.queue` defined in the queue worker as FIFO grouped by its
    /// group field (see `provider`): kept when it is, declared with `queue::define` when it
    /// is missing, refused when it is declared otherwise or cannot be declared.
    async fn declare_in_provider(&self, def: &QueueDef) -> Result<(), BusError> {
        let wanted = provider::required_block(def);
        let stored = self
            .engine(Engine::Configuration(provider::QUEUE_CONFIG_ID))
            .await;
        let declared = match &stored {
            Ok(config) => provider::declared(config, def),
            // Nothing stored yet (the queue worker seeds it on its first start).
            Err(e) if e.code.to_string().eq_ignore_ascii_case("not_found") => {
                provider::Declared::Missing
            }
            Err(e) => return Err(e.clone()),
        };
        match declared {
            provider::Declared::Fits => return Ok(()),
            provider::Declared::Conflicts(what) => {
                return Err(BusError::new(
                    "harness/dependency",
                    format!(
                        "the queue worker declares '{}' as {what}; the harness needs it FIFO grouped by {}. Change it in the queue worker's configuration (id '{}') to:\n{wanted}",
                        def.queue,
                        def.message_group_field,
                        provider::QUEUE_CONFIG_ID
                    ),
                ))
            }
            provider::Declared::Missing => {}
        }
        // `queue::define` refuses while the queue worker is applying another change: a few
        // tries, then the operator is told what to add.
        let mut last = None;
        for attempt in 0..5u64 {
            match self
                .engine(Engine::DefineQueue(provider::define_request(def)))
                .await
            {
                Ok(answer) => {
                    tracing::info!(queue = %def.queue, %answer, "queue declared in the queue worker");
                    return Ok(());
                }
                Err(e) if e.is_not_found() => {
                    last = Some(e);
                    break;
                }
                Err(e) => {
                    last = Some(e);
                    tokio::time::sleep(Duration::from_millis(200 * (attempt + 1))).await;
                }
            }
        }
        let why = last
            .map(|e| format!("{}: {}", e.code, e.message))
            .unwrap_or_default();
        Err(BusError::new(
            "harness/dependency",
            format!(
                "cannot declare '{}' in the queue worker ({}: {why}); add to the queue worker's configuration (id '{}'):\n{wanted}",
                def.queue,
                provider::DEFINE_FUNCTION,
                provider::QUEUE_CONFIG_ID
            ),
        ))
    }

    /// Binds `harness::queue::deliver` to each of `topics` as a `durable:subscriber`, and waits
    /// until the engine lists every binding.
    async fn bind_topics(
        &self,
        def: &QueueDef,
        topics: &[String],
        fifo: bool,
    ) -> Result<(), BusError> {
        let types = self.engine(Engine::TriggerTypes).await?;
        let has_subscriber = types["triggers"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|t| t["id"] == json!("durable:subscriber"));
        if !has_subscriber {
            return Err(BusError::new(
                "harness/dependency",
                "the engine offers neither engine::queue::enqueue nor the durable:subscriber trigger type",
            ));
        }
        let queue_config = json!({
            "type": if fifo { "fifo" } else { "standard" },
            "maxRetries": def.max_retries,
            "concurrency": if fifo { 1 } else { def.concurrency.max(1) },
            "visibilityTimeout": def.visibility_timeout_ms,
            "backoffType": "exponential",
            "backoffDelayMs": def.backoff_ms,
        });
        for topic in topics {
            #[allow(deprecated)]
            self.inner
                .client
                .register_trigger(RegisterTriggerInput::new(
                    "durable:subscriber",
                    DELIVER_FUNCTION,
                    json!({"topic": topic, "queue_config": queue_config}),
                ))
                .map_err(|e| from_sdk("durable:subscriber", 0, e))?;
        }
        // Registration is fire-and-forget: confirm the engine holds the binding.
        let deadline = tokio::time::Instant::now() + self.inner.opts.connect_timeout;
        loop {
            let listed = self
                .engine(Engine::RegisteredTriggers(
                    json!({"trigger_type": "durable:subscriber", "function_id": DELIVER_FUNCTION}),
                ))
                .await?;
            let bound: std::collections::HashSet<&str> = listed["registered_triggers"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|t| t["function_id"] == json!(DELIVER_FUNCTION))
                .filter_map(|t| t["config"]["topic"].as_str())
                .collect();
            if topics.iter().all(|t| bound.contains(t.as_str())) {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(BusError::new(
                    "harness/dependency",
                    format!(
                        "the durable:subscriber bindings of queue '{}' did not appear on the engine",
                        def.queue
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // --- the Bus's queues --------------------------------------------------------------------

    /// `Bus::define_queue`.
    pub(crate) async fn ensure_queue(&self, def: QueueDef) -> Result<(), BusError> {
        if self.inner.queues().routes.contains_key(&def.queue) {
            return Ok(());
        }
        // Consumers first: the engine must route to every function of this worker before a step
        // can be delivered.
        self.wait_registered().await?;
        let shards = self
            .inner
            .opts
            .shards
            .clamp(1, def.concurrency.max(1) as u32);
        let route = match self.inner.opts.queue_mode {
            QueueMode::Enqueue => Route::Enqueue,
            QueueMode::Topic => Route::Topic,
            QueueMode::TopicFifo => Route::Shards(1),
            QueueMode::Shards => Route::Shards(shards),
            QueueMode::Auto => {
                // Not the shards by default: their handoff is the adapter's poll interval, but
                // only `shards` sessions run a step at once, and at 200 busy sessions on two
                // cores the bench saw a turn wait over 60 s behind the others of its shard.
                if self.engine_has_function("engine::queue::enqueue").await? {
                    Route::Enqueue
                } else {
                    Route::Topic
                }
            }
        };
        match route {
            Route::Enqueue => self.declare_in_provider(&def).await?,
            Route::Topic => {
                self.bind_topics(&def, std::slice::from_ref(&def.queue), false)
                    .await?
            }
            Route::Shards(n) => {
                let topics: Vec<String> = (0..n).map(|i| shard_topic(&def.queue, i)).collect();
                self.bind_topics(&def, &topics, true).await?
            }
        }
        tracing::info!(queue = %def.queue, ?route, "queue ensured on the iii engine");
        self.inner.queues().routes.insert(
            def.queue.clone(),
            QueueRoute {
                route,
                group_field: def.message_group_field.clone(),
                visibility: Duration::from_millis(def.visibility_timeout_ms.max(1000)),
            },
        );
        Ok(())
    }

    /// `Bus::enqueue`.
    pub(crate) async fn enqueue_call(
        &self,
        queue: &str,
        function_id: &str,
        payload: Value,
    ) -> Result<(), BusError> {
        let (route, group_field) = {
            let queues = self.inner.queues();
            let q = queues
                .routes
                .get(queue)
                .ok_or_else(|| BusError::internal(format!("queue '{queue}' is not defined")))?;
            (q.route, q.group_field.clone())
        };
        let topic = match route {
            Route::Shards(n) => {
                let group = match payload.get(&group_field) {
                    Some(Value::String(s)) => s.clone(),
                    Some(other) => other.to_string(),
                    None => String::new(),
                };
                // The shard of a group must be the same in every worker process and build.
                shard_topic(
                    queue,
                    (fnv1a(group.as_bytes()) % u64::from(n.max(1))) as u32,
                )
            }
            _ => queue.to_string(),
        };
        let mut envelope = json!({"queue": queue, "function_id": function_id});
        if let Some(g) = payload.get(&group_field) {
            envelope[group_field.as_str()] = g.clone();
        }
        envelope["payload"] = payload;
        match route {
            Route::Topic | Route::Shards(_) => self
                .engine(Engine::Publish {
                    topic: &topic,
                    data: envelope,
                })
                .await
                .map(|_| ()),
            Route::Enqueue => self
                .invoke(
                    DELIVER_FUNCTION,
                    envelope,
                    Some(Duration::from_secs(30)),
                    None,
                    Some(TriggerAction::Enqueue {
                        queue: queue.to_string(),
                    }),
                )
                .await
                .map(|_| ()),
        }
    }

    /// `Bus::publish`.
    pub(crate) async fn publish_event(
        &self,
        topic: &str,
        payload: Value,
        dedupe_key: Option<String>,
    ) -> Result<(), BusError> {
        if let Some(key) = dedupe_key {
            let out = self
                .engine(Engine::StateSet {
                    scope: PUBLISHED_SCOPE,
                    key: &key,
                    value: json!({"topic": topic, "at": now_ms()}),
                })
                .await?;
            if !out["old_value"].is_null() {
                return Ok(());
            }
        }
        self.engine(Engine::Publish {
            topic,
            data: payload,
        })
        .await
        .map(|_| ())
    }
}

/// The topic of shard `i` of a queue.
fn shard_topic(queue: &str, i: u32) -> String {
    format!("{queue}.{i}")
}
