//! [`IiiBus`]: the Bus over one `iii-sdk` worker connection. This module holds the connection
//! (connect, stand-by while another worker serves, the link watcher, reconcile after a
//! reconnect) and the [`Bus`] implementation, which hands each operation to the module of its
//! job: `registry` (registration), `calls`, `state` (with the write tracker), `bindings` and
//! `queue` (queue routes).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use harness_bus::{
    Binding, Bus, BusError, FunctionDef, Handler, QueueDef, StreamingCall, TriggerTypeDef,
};
use iii_sdk::runtime::{IIIConnectionState, WorkerMetadata};
use iii_sdk::{IIIClient, InitOptions};
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::bindings::Bindings;
use crate::calls::{Calls, Engine};
use crate::error::IiiError;
use crate::journal::Journal;
use crate::options::IiiOptions;
use crate::queue::Queues;
use crate::registry::Registry;
use crate::state::{Restore, Tracker, JOURNAL_WINDOW};

/// The internal function every queued call is delivered to (see the crate docs).
pub const DELIVER_FUNCTION: &str = "harness::queue::deliver";
/// Prefix of the per-process frame sink function (`harness::frames::<instance>`).
pub const FRAMES_PREFIX: &str = "harness::frames::";

/// How often a standing-by worker asks whether the serving one is still there.
const STANDBY_POLL: Duration = Duration::from_millis(200);

/// What a worker connection holds. Each job's state sits under one lock of its own
/// (`registry`, `calls.streams`, `tracker`, `bindings`, `queues`); the `link` needs none.
pub(crate) struct Inner {
    pub(crate) client: IIIClient,
    pub(crate) opts: IiiOptions,
    /// The runtime the handlers run on (the SDK's connection thread only relays).
    pub(crate) rt: tokio::runtime::Handle,
    /// This process's identity as a lease holder (the worker name and a per-process id).
    pub(crate) instance: String,
    /// The functions registered here, those held until `open`, those the engine routes here.
    pub(crate) registry: RwLock<Registry>,
    /// The caller side of streaming calls.
    pub(crate) calls: Calls,
    /// The state writes since the last barrier, those in flight, and the lease epochs.
    pub(crate) tracker: Mutex<Tracker>,
    /// The write-ahead copy: the last value of every key this worker wrote within
    /// [`JOURNAL_WINDOW`], as the engine acknowledged it. The engine's file store flushes every
    /// 5 s, so an engine that died may come back without them; `reconcile` writes them again.
    pub(crate) journal: Journal,
    /// Owned trigger types and their bindings.
    pub(crate) bindings: RwLock<Bindings>,
    /// Queue routes and group locks.
    pub(crate) queues: Mutex<Queues>,
    /// The state of the link to the engine.
    pub(crate) link: Link,
}

/// The state of the link to the engine: flags and counters, no lock.
pub(crate) struct Link {
    pub(crate) reconnects: watch::Sender<u64>,
    /// Counts lost links: a call in flight when the link drops never gets its answer (the SDK
    /// keeps waiting until its timeout), so it fails at once instead.
    pub(crate) disconnects: watch::Sender<u64>,
    /// Set by [`IiiBus::open`]: public functions are announced to the engine from then on.
    pub(crate) opened: AtomicBool,
    /// False while the worker cannot serve its public functions (before `open`, and from a
    /// lost link until [`IiiBus::set_ready`] after the reconnect was reconciled): they answer
    /// `harness/starting` instead of accepting work that could not run yet.
    pub(crate) ready: AtomicBool,
    /// False from a lost link until the reconnect was reconciled (`reconcile`); deliveries
    /// wait for it.
    pub(crate) settled: watch::Sender<bool>,
    /// Set by `shutdown`: the link goes away on purpose.
    pub(crate) closing: AtomicBool,
    /// Set when another harness worker holds this worker's functions after a reconnect: it
    /// took the sessions over, so this one must stop serving (see [`IiiBus::deposed`]).
    pub(crate) deposed: watch::Sender<bool>,
}

/// The Bus over an iii engine. Cheap to clone.
#[derive(Clone)]
pub struct IiiBus {
    pub(crate) inner: Arc<Inner>,
}

impl IiiBus {
    /// Connects a worker to the engine and waits until the engine accepted it. Must be called
    /// inside a tokio runtime: handlers run on it.
    ///
    /// The engine leases every function id to one live worker per namespace, so while another
    /// harness worker serves this engine this one stands by (connected, registering nothing)
    /// and takes over once that worker's functions are gone (see the crate docs).
    pub async fn connect(opts: IiiOptions) -> Result<IiiBus, IiiError> {
        let metadata = WorkerMetadata {
            name: opts.worker_name.clone(),
            description: Some("harness: the durable agent turn loop (harness::*)".into()),
            ..WorkerMetadata::default()
        };
        let client = iii_sdk::register_worker(
            &opts.url,
            InitOptions {
                metadata: Some(metadata),
                ..InitOptions::default()
            },
        );
        if let Err(e) = client.wait_until_registered(opts.connect_timeout).await {
            client.shutdown_async().await;
            return Err(IiiError::Connect {
                url: opts.url.clone(),
                why: e.to_string(),
            });
        }
        let journal = match Journal::open(opts.journal.as_deref(), JOURNAL_WINDOW) {
            Ok(j) => j,
            Err(e) => {
                client.shutdown_async().await;
                return Err(e);
            }
        };
        let (reconnects, _) = watch::channel(0);
        let (disconnects, _) = watch::channel(0);
        let bus = IiiBus {
            inner: Arc::new(Inner {
                client,
                rt: tokio::runtime::Handle::current(),
                instance: format!("{}#{}", opts.worker_name, uuid::Uuid::new_v4().simple()),
                registry: RwLock::new(Registry::default()),
                calls: Calls::new(),
                tracker: Mutex::new(Tracker::default()),
                journal,
                bindings: RwLock::new(Bindings::default()),
                queues: Mutex::new(Queues::default()),
                link: Link {
                    reconnects,
                    disconnects,
                    opened: AtomicBool::new(false),
                    ready: AtomicBool::new(false),
                    settled: watch::channel(true).0,
                    closing: AtomicBool::new(false),
                    deposed: watch::channel(false).0,
                },
                opts,
            }),
        };
        let fail = |why: String| IiiError::Connect {
            url: bus.inner.opts.url.clone(),
            why,
        };
        if let Err(e) = bus.stand_by().await {
            bus.inner.client.shutdown_async().await;
            return Err(fail(e.to_string()));
        }
        // A worker killed together with the engine comes back to an engine that may have lost
        // its last writes: give them back before anything runs.
        if let Err(e) = bus.restore(Restore::Lost).await {
            bus.inner.client.shutdown_async().await;
            return Err(fail(format!("restoring the write-ahead copy: {e}")));
        }
        bus.register_deliver();
        bus.register_frames_sink();
        match bus.wait_owner(DELIVER_FUNCTION).await {
            Ok(Some(owner)) if owner != bus.inner.opts.worker_name => {
                bus.inner.client.shutdown_async().await;
                return Err(fail(format!(
                    "harness worker '{owner}' took this engine's harness functions at the same moment; start this one again to stand by"
                )));
            }
            Ok(_) => {}
            Err(e) => {
                bus.inner.client.shutdown_async().await;
                return Err(fail(e.to_string()));
            }
        }
        bus.watch_connection();
        Ok(bus)
    }

    /// The worker name the engine lists as the owner of `function_id` (None: nobody has it).
    async fn owner_of(&self, function_id: &str) -> Result<Option<String>, BusError> {
        match self.engine(Engine::FunctionInfo(function_id)).await {
            Ok(info) => Ok(info["worker_name"].as_str().map(str::to_string)),
            Err(e) if e.code == "NOT_FOUND" => Ok(None),
            Err(e) => Err(e),
        }
    }
    /// Waits while another harness worker serves this engine: the engine would refuse this
    /// worker's registrations of the same ids (`FUNCTION_NAMESPACE_CONFLICT`). Its functions
    /// vanish as soon as its connection is gone (a crash closes it at once).
    async fn stand_by(&self) -> Result<(), BusError> {
        let mut announced = false;
        let deadline = tokio::time::Instant::now() + self.inner.opts.connect_timeout;
        loop {
            match self.owner_of(DELIVER_FUNCTION).await? {
                // A previous connection under this same name (a restart the engine has not
                // seen close yet, or the bench's previous phase) still holds the functions: the
                // engine would refuse this connection's registrations, so wait for it to go.
                Some(owner) if owner == self.inner.opts.worker_name => {
                    if tokio::time::Instant::now() >= deadline {
                        return Err(BusError::new(
                            "harness/dependency",
                            format!("another connection of harness worker '{owner}' still holds this engine's harness functions"),
                        ));
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Some(owner) if owner != self.inner.opts.worker_name => {
                    if !self.inner.opts.standby {
                        return Err(BusError::new(
                            "harness/dependency",
                            format!("harness worker '{owner}' serves this engine (the engine gives each function to one worker)"),
                        ));
                    }
                    if !announced {
                        tracing::warn!(%owner, "another harness worker serves this engine; standing by to take its sessions over");
                        eprintln!("harness worker standing by: '{owner}' serves this engine");
                        announced = true;
                    }
                    tokio::time::sleep(STANDBY_POLL).await;
                }
                _ => {
                    if announced {
                        tracing::warn!(
                            "the serving harness worker is gone; taking its sessions over"
                        );
                    }
                    return Ok(());
                }
            }
        }
    }

    /// Waits until the engine lists `function_id` with its owner's worker name, and answers
    /// that name. A function whose worker has not named itself yet (its registrations can
    /// reach the engine before `engine::workers::register`) is listed under an empty name:
    /// that says nothing about who owns it yet, so the wait goes on.
    async fn wait_owner(&self, function_id: &str) -> Result<Option<String>, BusError> {
        let deadline = tokio::time::Instant::now() + self.inner.opts.connect_timeout;
        loop {
            if let Some(owner) = self.owner_of(function_id).await? {
                if !owner.is_empty() {
                    return Ok(Some(owner));
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return Ok(None);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Becomes true when, after a reconnect, another harness worker holds this worker's
    /// functions: it took the sessions over (and fences this worker's turn-record writes), so
    /// this worker must stop; started again, it stands by.
    pub fn deposed(&self) -> watch::Receiver<bool> {
        self.inner.link.deposed.subscribe()
    }

    /// This process's lease-holder identity.
    pub fn instance(&self) -> &str {
        &self.inner.instance
    }

    /// The engine URL this bus is connected to.
    pub fn url(&self) -> &str {
        &self.inner.opts.url
    }

    /// Announces the public functions held back since `connect` (the `harness::*` surface), once
    /// the caller can serve them (queue ensured, siblings registered, redrive done), and waits
    /// until the engine lists every function of this worker.
    pub async fn open(&self) -> Result<(), BusError> {
        self.inner.link.opened.store(true, Ordering::SeqCst);
        self.announce_held();
        self.inner.link.ready.store(true, Ordering::SeqCst);
        self.wait_registered().await?;
        self.remember_foreign().await
    }

    /// Marks the worker able (or unable) to serve its public functions; see `Link::ready`.
    pub fn set_ready(&self, ready: bool) {
        self.inner.link.ready.store(ready, Ordering::SeqCst);
    }

    /// Counts the reconnects of the worker connection. After one, the engine has failed the
    /// invocations that were in flight (`invocation_stopped`); the caller should redrive
    /// (`Harness::start` is idempotent and re-enqueues the current step of running turns).
    pub fn reconnects(&self) -> watch::Receiver<u64> {
        self.inner.link.reconnects.subscribe()
    }

    /// Closes the worker connection (registrations vanish from the engine).
    pub async fn shutdown(&self) {
        // Closing the link on purpose is not losing it: the watcher stops before the state
        // changes (it used to log "lost the link" for every bus the bench closed).
        self.inner.link.closing.store(true, Ordering::SeqCst);
        self.inner.client.shutdown_async().await;
        // The SDK answers nothing once shut down (it drops what is sent then without a word,
        // and leaves the calls in flight waiting): those calls end now, as on a lost link.
        self.inner.link.disconnects.send_modify(|n| *n += 1);
    }

    fn watch_connection(&self) {
        let weak = Arc::downgrade(&self.inner);
        self.inner.rt.spawn(async move {
            let mut was_connected = true;
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let Some(inner) = weak.upgrade() else { return };
                if inner.link.closing.load(Ordering::SeqCst) {
                    return;
                }
                let connected =
                    inner.client.get_connection_state() == IIIConnectionState::Connected;
                if connected && !was_connected {
                    tracing::warn!(url = %inner.opts.url, "reconnected to the iii engine; registrations were replayed, reconciling");
                    let bus = IiiBus { inner: inner.clone() };
                    drop(inner);
                    // Another harness worker may have taken the functions (and the sessions)
                    // over while the link was down: then this one must not touch a thing.
                    if let Ok(Some(owner)) = bus.wait_owner(DELIVER_FUNCTION).await {
                        if owner != bus.inner.opts.worker_name {
                            tracing::error!(%owner, "another harness worker took this worker's functions and sessions over while the link was down; stopping");
                            bus.inner.tracker().forget_leases();
                            bus.inner.link.deposed.send_replace(true);
                            return;
                        }
                    }
                    if let Err(e) = bus.reconcile().await {
                        tracing::error!("reconciling with the iii engine failed: {e}");
                    }
                    bus.inner.link.settled.send_replace(true);
                    bus.inner.link.reconnects.send_modify(|n| *n += 1);
                    was_connected = true;
                    continue;
                }
                if !connected && was_connected {
                    inner.link.ready.store(false, Ordering::SeqCst);
                    inner.link.settled.send_replace(false);
                    // Whatever the engine routes here after the reconnect is read again.
                    inner.registry_mut().forget_served();
                    tracing::warn!(url = %inner.opts.url, "lost the link to the iii engine; failing the calls in flight");
                    inner.link.disconnects.send_modify(|n| *n += 1);
                }
                was_connected = connected;
            }
        });
    }

    /// Waits until a reconnect was reconciled (at once when the link never dropped).
    pub(crate) async fn settled(&self) {
        let mut settled = self.inner.link.settled.subscribe();
        let _ = settled.wait_for(|s| *s).await;
    }

    /// After a reconnect: gives the engine back the writes it lost (the write-ahead copy),
    /// and makes the bindings this worker acts on exactly the ones the engine still has (an
    /// engine restart forgets every binding; the ones it still has are forwarded again).
    pub async fn reconcile(&self) -> Result<(), BusError> {
        self.restore(Restore::Everything).await?;
        self.reconcile_bindings().await?;
        // Which of this worker's functions the engine routes here again (the SDK replayed the
        // registrations); until then their calls went through the engine.
        let listed = self
            .engine(Engine::Functions(json!({"include_internal": true})))
            .await?;
        self.note_served(&listed);
        Ok(())
    }
}

#[async_trait]
impl Bus for IiiBus {
    async fn call_with_metadata(
        &self,
        function_id: &str,
        payload: Value,
        timeout: Option<Duration>,
        metadata: Value,
    ) -> Result<Value, BusError> {
        let metadata = (!metadata.is_null()).then_some(metadata);
        self.invoke(function_id, payload, timeout, metadata, None)
            .await
    }

    async fn call_streaming(
        &self,
        function_id: &str,
        payload: Value,
        timeout: Option<Duration>,
    ) -> Result<StreamingCall, BusError> {
        self.stream_call(function_id, payload, timeout).await
    }

    async fn call_void(&self, function_id: &str, payload: Value) {
        self.fire(function_id, payload).await
    }

    fn register_function(&self, def: FunctionDef, handler: Arc<dyn Handler>) {
        self.add_function(def, handler)
    }

    fn register_trigger_type(&self, def: TriggerTypeDef) {
        self.add_trigger_type(def)
    }

    async fn bindings(&self, trigger_type: &str) -> Result<Vec<Binding>, BusError> {
        self.list_bindings(trigger_type).await
    }

    async fn define_queue(&self, def: QueueDef) -> Result<(), BusError> {
        self.ensure_queue(def).await
    }

    async fn enqueue(
        &self,
        queue: &str,
        function_id: &str,
        payload: Value,
    ) -> Result<(), BusError> {
        self.enqueue_call(queue, function_id, payload).await
    }

    async fn publish(
        &self,
        topic: &str,
        payload: Value,
        dedupe_key: Option<String>,
    ) -> Result<(), BusError> {
        self.publish_event(topic, payload, dedupe_key).await
    }

    /// The engine offers no durability point (its file store flushes every 5 s), so this
    /// cannot make anything durable. What it does: read back every state value written through
    /// this bus since the last barrier and fail (`harness/state`) if the engine no longer holds
    /// it, so a checkpoint lost before the side effect (an engine restart between the write and
    /// the dispatch) stops the dispatch. See the crate docs for what remains.
    async fn barrier(&self) -> Result<(), BusError> {
        self.check_written().await
    }

    async fn state_get(&self, scope: &str, key: &str) -> Result<Option<Value>, BusError> {
        self.get_state(scope, key).await
    }

    async fn state_set(&self, scope: &str, key: &str, value: Value) -> Result<(), BusError> {
        self.set_state(scope, key, value).await
    }

    async fn state_delete(&self, scope: &str, key: &str) -> Result<(), BusError> {
        self.delete_state(scope, key).await
    }

    async fn state_list(&self, scope: &str) -> Result<Vec<(String, Value)>, BusError> {
        self.list_state(scope).await
    }
}
