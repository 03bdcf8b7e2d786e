//! [`IiiBus`]: the Bus over one `iii-sdk` worker connection.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use async_trait::async_trait;
use harness_bus::{
    Binding, Bus, BusError, CallContext, FrameSink, FunctionDef, Handler, QueueDef, StreamingCall,
    TriggerTypeDef,
};
use iii_sdk::protocol::{RegisterTriggerInput, TriggerRequest};
use iii_sdk::runtime::{IIIConnectionState, WorkerMetadata};
use iii_sdk::trigger::{TriggerConfig, TriggerHandler};
use iii_sdk::{IIIClient, InitOptions, RegisterFunction, RegisterTriggerType, TriggerAction};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch, Mutex as AsyncMutex};

use crate::codec::{strip_decoration, unwrap_state, wrap_state};
use crate::error::{from_sdk, to_sdk, IiiError};
use crate::fence::{self, FENCED_SCOPE};
use crate::journal::Journal;
use crate::provider;

/// The internal function every queued call is delivered to (see the crate docs).
pub const DELIVER_FUNCTION: &str = "harness::queue::deliver";
/// Prefix of the per-process frame sink function (`harness::frames::<instance>`).
pub const FRAMES_PREFIX: &str = "harness::frames::";
/// The metadata key naming the frame sink of a streaming call.
const STREAM_KEY: &str = "harness_stream";
/// State scope of the dedupe rows of published events.
const PUBLISHED_SCOPE: &str = "harness_published";

const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(300);
/// A call not answered within this is logged (it is still awaited up to its timeout).
const SLOW_CALL: Duration = Duration::from_secs(10);
const FRAME_BATCH: usize = 256;
/// How long a registration the engine does not list waits before it is sent again.
const REANNOUNCE: Duration = Duration::from_secs(1);
/// How long a batch of frames may take to reach the caller's frame sink.
const FRAME_TIMEOUT: Duration = Duration::from_secs(30);

/// How the `harness-turn` queue is realised on the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueMode {
    /// `engine::queue::enqueue` when a queue provider is registered, else a standard topic.
    Auto,
    /// `TriggerAction::Enqueue` (the queue must be declared in the queue worker's config as
    /// `fifo` with `message_group_field` set to the queue's group field).
    Enqueue,
    /// Topic queue, `standard` subscriber with the queue's concurrency (groups serialised here).
    Topic,
    /// Topic queue, `fifo` subscriber: one global line (prefetch 1).
    TopicFifo,
    /// `concurrency` FIFO topics, each session always on the same one (see the crate docs).
    Shards,
}

impl std::str::FromStr for QueueMode {
    type Err = String;

    fn from_str(s: &str) -> Result<QueueMode, String> {
        Ok(match s {
            "auto" => QueueMode::Auto,
            "enqueue" => QueueMode::Enqueue,
            "topic" => QueueMode::Topic,
            "fifo" => QueueMode::TopicFifo,
            "shards" => QueueMode::Shards,
            other => {
                return Err(format!(
                    "harness/invalid_request: queue mode: '{other}' is not one of auto, enqueue, topic, fifo, shards"
                ))
            }
        })
    }
}

/// Where and how to connect.
#[derive(Clone, Debug)]
pub struct IiiOptions {
    pub url: String,
    /// The worker name the engine leases to one live connection per namespace.
    pub worker_name: String,
    /// How long to wait for the engine to accept the worker, and for its own registrations to
    /// become visible before the queue is bound.
    pub connect_timeout: Duration,
    pub queue_mode: QueueMode,
    /// How many FIFO topics carry a queue on the shards route: the steps of that many sessions
    /// can run at once. Each is a consumer the engine polls at its adapter's interval.
    pub shards: u32,
    /// The file of the write-ahead copy (see the crate docs); None keeps it in memory.
    pub journal: Option<std::path::PathBuf>,
    /// Whether to stand by while another harness worker serves the engine (a worker) or to
    /// refuse to connect (the bench, which must not wait for a deployment's worker to die).
    pub standby: bool,
    /// Whether a call this worker makes to a function it serves itself runs in-process (the
    /// default) or goes out to the engine and back (see the crate docs, *Calls to this
    /// worker's own functions*).
    pub self_calls: SelfCalls,
}

/// Where a call to one of this worker's own functions runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SelfCalls {
    /// In-process, straight to the handler, while the worker serves the function.
    InProcess,
    /// Through the engine, like any other call.
    Engine,
}

impl std::str::FromStr for SelfCalls {
    type Err = String;

    fn from_str(s: &str) -> Result<SelfCalls, String> {
        match s {
            "in-process" => Ok(SelfCalls::InProcess),
            "engine" => Ok(SelfCalls::Engine),
            other => Err(format!(
                "harness/invalid_request: self calls: '{other}' is not one of in-process, engine"
            )),
        }
    }
}

impl IiiOptions {
    pub fn new(url: impl Into<String>) -> IiiOptions {
        IiiOptions {
            url: url.into(),
            worker_name: "harness".into(),
            connect_timeout: Duration::from_secs(30),
            queue_mode: QueueMode::Auto,
            shards: 8,
            journal: None,
            standby: true,
            self_calls: SelfCalls::InProcess,
        }
    }
}

struct Local {
    def: FunctionDef,
    handler: Arc<dyn Handler>,
}

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

struct Inner {
    client: IIIClient,
    opts: IiiOptions,
    /// The runtime the handlers run on (the SDK's connection thread only relays).
    rt: tokio::runtime::Handle,
    local: RwLock<HashMap<String, Arc<Local>>>,
    trigger_types: RwLock<HashMap<String, TriggerTypeDef>>,
    /// Bindings of harness-owned trigger types, as forwarded by the engine.
    bindings: RwLock<HashMap<String, Binding>>,
    /// Caller side of streaming calls: stream id → the channel of its frames.
    streams: Mutex<HashMap<String, FrameSink>>,
    frames_fn: String,
    queues: RwLock<HashMap<String, QueueRoute>>,
    groups: Mutex<HashMap<String, Weak<AsyncMutex<()>>>>,
    reconnects: watch::Sender<u64>,
    /// Counts lost links: a call in flight when the link drops never gets its answer (the SDK
    /// keeps waiting until its timeout), so it fails at once instead.
    disconnects: watch::Sender<u64>,
    /// State written since the last barrier, `(scope, key)` → (sequence, value as stored), so
    /// the barrier can read it back.
    written: Mutex<HashMap<(String, String), (u64, Value)>>,
    write_seq: std::sync::atomic::AtomicU64,
    /// State writes sent to the engine whose answer is not back yet, per `(scope, key)`: the
    /// engine may already hold such a value while `written` does not know it yet, so a barrier
    /// reading that key back must not call the difference a loss.
    writing: Mutex<HashMap<(String, String), usize>>,
    /// While barriers run: the writes recorded after their snapshots were taken. Another task's
    /// barrier may drain a newer write of a key from `written` before this one reads the key
    /// back; this log still tells the newer write from a loss.
    recent: Mutex<Recent>,
    /// Set by [`IiiBus::open`]: public functions are announced to the engine from then on.
    opened: AtomicBool,
    /// Public functions registered before `open`, announced by it.
    held: Mutex<Vec<String>>,
    /// False while the worker cannot serve its public functions (before `open`, and from a
    /// lost link until [`IiiBus::set_ready`] after the reconnect was reconciled): they answer
    /// `harness/starting` instead of accepting work that could not run yet.
    ready: AtomicBool,
    /// False from a lost link until the reconnect was reconciled (`reconcile`); deliveries
    /// wait for it.
    settled: watch::Sender<bool>,
    /// The write-ahead copy: the last value of every key this worker wrote within
    /// [`JOURNAL_WINDOW`], as the engine acknowledged it. The engine's file store flushes every
    /// 5 s, so an engine that died may come back without them; `reconcile` writes them again.
    journal: Journal,
    /// The functions of others, as of the last registry-change notice let through (see
    /// `own_registry_change`).
    foreign: Mutex<Option<std::collections::BTreeSet<String>>>,
    /// Set by `shutdown`: the link goes away on purpose.
    closing: AtomicBool,
    /// This process's identity as a lease holder (the worker name and a per-process id).
    instance: String,
    /// The lease epoch this worker writes each session's turn record under (see `fence`).
    leases: Mutex<HashMap<String, u64>>,
    /// Set when another harness worker holds this worker's functions after a reconnect: it
    /// took the sessions over, so this one must stop serving (see [`IiiBus::deposed`]).
    deposed: watch::Sender<bool>,
    /// The functions registered here that the engine lists as this worker's (so it routes
    /// their calls here): refreshed whenever the worker reads the registry for its own
    /// functions, emptied when the link drops. See [`IiiBus::serves`].
    served: RwLock<std::collections::HashSet<String>>,
}

/// How long a write stays in the write-ahead copy: the engine's flush interval (5 s) with a
/// wide margin for a flush that ran late on a loaded machine.
const JOURNAL_WINDOW: Duration = Duration::from_secs(30);

/// Which writes of the write-ahead copy [`IiiBus::restore`] gives back.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Restore {
    /// Every one the engine does not hold as written (after a reconnect of this process).
    Everything,
    /// Only what cannot overwrite another worker's newer write (at start-up).
    Lost,
}

/// Sessions whose lease epoch a worker keeps in memory (see `IiiBus::lease_epoch`).
const MAX_CACHED_LEASES: usize = 16_384;

/// How often a standing-by worker asks whether the serving one is still there.
const STANDBY_POLL: Duration = Duration::from_millis(200);

#[derive(Default)]
struct Recent {
    /// Per running barrier: the lowest sequence in its snapshot.
    floors: Vec<u64>,
    /// `(sequence, (scope, key))` of writes recorded while a barrier ran.
    log: Vec<(u64, (String, String))>,
}

/// The Bus over an iii engine. Cheap to clone.
#[derive(Clone)]
pub struct IiiBus {
    inner: Arc<Inner>,
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
                local: RwLock::new(HashMap::new()),
                trigger_types: RwLock::new(HashMap::new()),
                bindings: RwLock::new(HashMap::new()),
                streams: Mutex::new(HashMap::new()),
                frames_fn: format!("{FRAMES_PREFIX}{}", uuid::Uuid::new_v4().simple()),
                queues: RwLock::new(HashMap::new()),
                groups: Mutex::new(HashMap::new()),
                reconnects,
                disconnects,
                written: Mutex::new(HashMap::new()),
                write_seq: std::sync::atomic::AtomicU64::new(0),
                writing: Mutex::new(HashMap::new()),
                recent: Mutex::new(Recent::default()),
                opened: AtomicBool::new(false),
                held: Mutex::new(Vec::new()),
                ready: AtomicBool::new(false),
                settled: watch::channel(true).0,
                journal,
                foreign: Mutex::new(None),
                closing: AtomicBool::new(false),
                instance: format!("{}#{}", opts.worker_name, uuid::Uuid::new_v4().simple()),
                leases: Mutex::new(HashMap::new()),
                deposed: watch::channel(false).0,
                served: RwLock::new(std::collections::HashSet::new()),
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
        match self
            .invoke(
                "engine::functions::info",
                json!({ "function_id": function_id }),
                Some(Duration::from_secs(10)),
                None,
                None,
            )
            .await
        {
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
        self.inner.deposed.subscribe()
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
        self.inner.opened.store(true, Ordering::SeqCst);
        let held: Vec<String> = std::mem::take(&mut *self.inner.held.lock().expect("held lock"));
        for id in held {
            let def = self
                .inner
                .local
                .read()
                .expect("local lock")
                .get(&id)
                .map(|l| l.def.clone());
            if let Some(def) = def {
                self.announce(&id, &def);
            }
        }
        self.inner.ready.store(true, Ordering::SeqCst);
        self.wait_registered().await?;
        self.remember_foreign().await
    }

    /// Takes the registry as it is now as the baseline of registry-change notices.
    async fn remember_foreign(&self) -> Result<(), BusError> {
        let listed = self
            .list_functions(json!({"include_internal": true}))
            .await?;
        let notice = json!({"event": "functions_changed", "functions": listed["functions"]});
        own_registry_change(&self.inner, &notice);
        Ok(())
    }

    /// Marks the worker able (or unable) to serve its public functions; see `Inner::ready`.
    pub fn set_ready(&self, ready: bool) {
        self.inner.ready.store(ready, Ordering::SeqCst);
    }

    /// Counts the reconnects of the worker connection. After one, the engine has failed the
    /// invocations that were in flight (`invocation_stopped`); the caller should redrive
    /// (`Harness::start` is idempotent and re-enqueues the current step of running turns).
    pub fn reconnects(&self) -> watch::Receiver<u64> {
        self.inner.reconnects.subscribe()
    }

    /// Closes the worker connection (registrations vanish from the engine).
    pub async fn shutdown(&self) {
        // Closing the link on purpose is not losing it: the watcher stops before the state
        // changes (it used to log "lost the link" for every bus the bench closed).
        self.inner.closing.store(true, Ordering::SeqCst);
        self.inner.client.shutdown_async().await;
        // The SDK answers nothing once shut down (it drops what is sent then without a word,
        // and leaves the calls in flight waiting): those calls end now, as on a lost link.
        self.inner.disconnects.send_modify(|n| *n += 1);
    }

    /// Ids of the functions registered through this bus, sorted.
    pub fn local_function_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .inner
            .local
            .read()
            .expect("local lock")
            .keys()
            .cloned()
            .collect();
        ids.sort();
        ids
    }

    fn watch_connection(&self) {
        let weak = Arc::downgrade(&self.inner);
        self.inner.rt.spawn(async move {
            let mut was_connected = true;
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let Some(inner) = weak.upgrade() else { return };
                if inner.closing.load(Ordering::SeqCst) {
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
                            bus.inner.leases.lock().expect("leases lock").clear();
                            bus.inner.deposed.send_replace(true);
                            return;
                        }
                    }
                    if let Err(e) = bus.reconcile().await {
                        tracing::error!("reconciling with the iii engine failed: {e}");
                    }
                    bus.inner.settled.send_replace(true);
                    bus.inner.reconnects.send_modify(|n| *n += 1);
                    was_connected = true;
                    continue;
                }
                if !connected && was_connected {
                    inner.ready.store(false, Ordering::SeqCst);
                    inner.settled.send_replace(false);
                    // Whatever the engine routes here after the reconnect is read again.
                    inner.served.write().expect("served lock").clear();
                    tracing::warn!(url = %inner.opts.url, "lost the link to the iii engine; failing the calls in flight");
                    inner.disconnects.send_modify(|n| *n += 1);
                }
                was_connected = connected;
            }
        });
    }

    /// Waits until a reconnect was reconciled (at once when the link never dropped).
    async fn settled(&self) {
        let mut settled = self.inner.settled.subscribe();
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
            .list_functions(json!({"include_internal": true}))
            .await?;
        self.note_served(&listed);
        Ok(())
    }

    /// Gives the engine back what it lost of the writes in the write-ahead copy. After a
    /// reconnect of this process everything that differs is written again (this worker was
    /// serving, nobody else wrote). At start-up the copy may be older than another worker's
    /// writes (it served the sessions while this one was down): then only a turn-record slot
    /// (which never hides a newer holder's) and a value the engine no longer has at all are
    /// written again.
    async fn restore(&self, what: Restore) -> Result<(), BusError> {
        let writes = self.inner.journal.recent();
        let mut restored = 0;
        for ((scope, key), value) in writes {
            let held = self
                .invoke(
                    "state::get",
                    json!({"scope": scope, "key": key}),
                    Some(Duration::from_secs(30)),
                    None,
                    None,
                )
                .await?;
            let held = strip_decoration(held);
            if comparable(&scope, held.clone()) == value {
                continue;
            }
            // At start-up, an unfenced value the engine still has may be another worker's
            // newer write: only a value it lost entirely is given back.
            let lost_entirely = held.is_null() && !value.is_null();
            if what == Restore::Lost && scope != FENCED_SCOPE && !lost_entirely {
                continue;
            }
            if scope == FENCED_SCOPE && !value.is_null() {
                // Only this worker's own slot is written again: a newer holder's stays newest.
                let epoch = value["epoch"].as_u64().unwrap_or(0);
                self.invoke(
                    "state::update",
                    fence::write_request(&scope, &key, epoch, &value["record"]),
                    Some(Duration::from_secs(30)),
                    None,
                    None,
                )
                .await?;
            } else if value.is_null() {
                self.invoke(
                    "state::delete",
                    json!({"scope": scope, "key": key}),
                    Some(Duration::from_secs(30)),
                    None,
                    None,
                )
                .await?;
            } else {
                self.invoke(
                    "state::set",
                    json!({"scope": scope, "key": key, "value": value}),
                    Some(Duration::from_secs(30)),
                    None,
                    None,
                )
                .await?;
            }
            restored += 1;
        }
        if restored > 0 {
            tracing::warn!(restored, "the iii engine had lost state this worker wrote; written again from the write-ahead copy");
        }
        Ok(())
    }

    /// Makes the bindings this worker acts on exactly the ones the engine still has.
    async fn reconcile_bindings(&self) -> Result<(), BusError> {
        let owned: Vec<String> = self
            .inner
            .trigger_types
            .read()
            .expect("trigger types lock")
            .keys()
            .cloned()
            .collect();
        for trigger_type in owned {
            let listed = self
                .invoke(
                    "engine::registered-triggers::list",
                    json!({"trigger_type": trigger_type, "include_internal": true}),
                    Some(Duration::from_secs(30)),
                    None,
                    None,
                )
                .await?;
            let present: std::collections::HashSet<String> = listed["registered_triggers"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|t| t["trigger_type"] == json!(trigger_type))
                .filter_map(|t| t["id"].as_str().map(str::to_string))
                .collect();
            let mut bindings = self.inner.bindings.write().expect("bindings lock");
            let before = bindings.len();
            bindings.retain(|id, b| b.trigger_type != trigger_type || present.contains(id));
            let forgotten = before - bindings.len();
            if forgotten > 0 {
                tracing::warn!(%trigger_type, forgotten, "the iii engine no longer has some bindings; forgotten here too");
            }
        }
        Ok(())
    }

    // --- calls ------------------------------------------------------------------------------

    async fn invoke(
        &self,
        function_id: &str,
        payload: Value,
        timeout: Option<Duration>,
        metadata: Option<Value>,
        action: Option<TriggerAction>,
    ) -> Result<Value, BusError> {
        let timeout = timeout.unwrap_or(DEFAULT_CALL_TIMEOUT);
        let ms = timeout.as_millis() as u64;
        if self.inner.closing.load(Ordering::SeqCst) {
            // A step still running on a bus that was shut down (the bench closes one per
            // phase): the SDK would drop the call without a word and wait out its timeout.
            if let Ok(lose) = DELIVERY.try_with(Arc::clone) {
                let _ = lose.send(true);
                return std::future::pending().await;
            }
            return Err(BusError::new(
                "not_connected",
                format!("{function_id}: this worker's link to the iii engine was shut down"),
            ));
        }
        // A plain call to a function this worker serves runs here: the engine would only route
        // it straight back (and now and then never answered such a call; docs/iii-engine.md).
        // Trigger actions (enqueue, void) keep going through the engine.
        if action.is_none() && self.serves(function_id) {
            return self
                .in_process(function_id, payload, timeout, metadata, None)
                .await;
        }
        let mut lost = self.inner.disconnects.subscribe();
        lost.borrow_and_update();
        let delivery = DELIVERY.try_with(Arc::clone).ok();
        if action.is_none()
            && self
                .inner
                .local
                .read()
                .expect("local lock")
                .contains_key(function_id)
        {
            tracing::debug!(function = %function_id, self_calls = ?self.inner.opts.self_calls, "a call to this worker's own function goes through the engine");
        }
        let req = TriggerRequest {
            function_id: function_id.to_string(),
            payload,
            action,
            timeout_ms: Some(ms),
        };
        let call = async {
            let call = async {
                match metadata {
                    Some(m) => self.inner.client.trigger(req.metadata(m)).await,
                    None => self.inner.client.trigger(req).await,
                }
            };
            tokio::pin!(call);
            // An unanswered call is otherwise silent until its timeout (300 s by default):
            // say which one it is.
            tokio::select! {
                r = &mut call => r,
                _ = tokio::time::sleep(SLOW_CALL) => {
                    tracing::warn!(function = %function_id, "no answer from the iii engine after {} s; still waiting (timeout {ms} ms)", SLOW_CALL.as_secs());
                    call.await
                }
            }
        };
        if let Some(lose) = delivery {
            // Never hand the step an error it would act on (close the call as timed out, fail
            // the generation): the delivery is ended where it stands (see `deliver`).
            let result = tokio::select! {
                r = call => r,
                _ = lost.changed() => Err(iii_sdk::Error::NotConnected),
            };
            return match result {
                Err(iii_sdk::Error::NotConnected) => {
                    let _ = lose.send(true);
                    std::future::pending().await
                }
                r => r.map_err(|e| from_sdk(function_id, ms, e)),
            };
        }
        tokio::select! {
            result = call => result.map_err(|e| from_sdk(function_id, ms, e)),
            // The answer is lost with the link: the outcome is unknown, as after a timeout (which
            // the loop treats as transient).
            _ = lost.changed() => Err(BusError::new(
                "timeout",
                format!("{function_id}: the link to the iii engine dropped during the call; its outcome is unknown"),
            )),
        }
    }

    /// Runs a function registered here, in-process, on the bus's runtime (a panic fails the
    /// call, not the caller).
    async fn run_local(
        inner: &Arc<Inner>,
        function_id: &str,
        payload: Value,
        ctx: CallContext,
    ) -> Result<Value, BusError> {
        let local = inner
            .local
            .read()
            .expect("local lock")
            .get(function_id)
            .cloned()
            .ok_or_else(|| BusError::function_not_found(function_id))?;
        let fut = local.handler.call(payload, ctx);
        match inner.rt.spawn(fut).await {
            Ok(r) => r,
            Err(_) => Err(BusError::internal(format!(
                "{function_id} panicked while handling the call"
            ))),
        }
    }

    /// Whether a call to `function_id` runs in-process (see the crate docs): this worker
    /// registered it, the engine lists it as this worker's (so it would route the call right
    /// back here), and the worker serves right now — link up and reconciled, not deposed, not
    /// closing, and a public function only once it is open and ready. Otherwise the call goes
    /// through the engine, which answers exactly as before (`function_not_found` for a function
    /// still held back, `harness/starting`, the answer of the worker that owns it, ...).
    fn serves(&self, function_id: &str) -> bool {
        let inner = &self.inner;
        if inner.opts.self_calls != SelfCalls::InProcess
            || inner.closing.load(Ordering::SeqCst)
            || *inner.deposed.borrow()
            || !*inner.settled.borrow()
            || !inner
                .served
                .read()
                .expect("served lock")
                .contains(function_id)
        {
            return false;
        }
        let gated = match inner.local.read().expect("local lock").get(function_id) {
            Some(l) => held(&l.def),
            None => return false,
        };
        if gated && !(inner.opened.load(Ordering::SeqCst) && inner.ready.load(Ordering::SeqCst)) {
            return false;
        }
        inner.client.get_connection_state() == IIIConnectionState::Connected
    }

    /// Takes an `engine::functions::list` answer as the set of this worker's functions the
    /// engine routes here (listed under this worker's name).
    fn note_served(&self, listed: &Value) {
        let name = self.inner.opts.worker_name.as_str();
        let ours: std::collections::HashSet<String> = {
            let local = self.inner.local.read().expect("local lock");
            listed["functions"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|f| f["worker_name"].as_str() == Some(name))
                .filter_map(|f| f["function_id"].as_str())
                .filter(|id| local.contains_key(*id))
                .map(str::to_string)
                .collect()
        };
        *self.inner.served.write().expect("served lock") = ours;
    }

    /// [`IiiBus::call_in_process`] as the caller sees it: inside a delivery, as for a routed
    /// call, a lost link ends the delivery where it stands rather than handing the step an
    /// answer it would act on (see `invoke`).
    async fn in_process(
        &self,
        function_id: &str,
        payload: Value,
        timeout: Duration,
        metadata: Option<Value>,
        frames: Option<FrameSink>,
    ) -> Result<Value, BusError> {
        let mut lost = self.inner.disconnects.subscribe();
        lost.borrow_and_update();
        let call = self.call_in_process(function_id, payload, timeout, metadata, frames);
        let Ok(lose) = DELIVERY.try_with(Arc::clone) else {
            return call.await;
        };
        tokio::select! {
            r = call => r,
            _ = lost.changed() => {
                let _ = lose.send(true);
                std::future::pending().await
            }
        }
    }

    /// A call to a function this worker serves, run in-process: the handler gets what the
    /// engine would have delivered (`serve`: the same payload without decoration, the same
    /// metadata, the same gate) and runs as a routed call's handler does, as its own task that
    /// outlives a caller who stopped waiting. The caller's side is a routed call's: the same
    /// timeout and error. A streaming call's frames go straight to the caller's channel.
    async fn call_in_process(
        &self,
        function_id: &str,
        payload: Value,
        timeout: Duration,
        metadata: Option<Value>,
        frames: Option<FrameSink>,
    ) -> Result<Value, BusError> {
        let gated = match self
            .inner
            .local
            .read()
            .expect("local lock")
            .get(function_id)
        {
            Some(l) => held(&l.def),
            None => return Err(BusError::function_not_found(function_id)),
        };
        let serve = IiiBus::serve(&self.inner, function_id, gated, payload, metadata, frames);
        match tokio::time::timeout(timeout, serve).await {
            Ok(r) => r,
            Err(_) => Err(BusError::timeout(function_id, timeout.as_millis() as u64)),
        }
    }

    /// Serves one call of a function registered here, as the engine delivers it (payload and
    /// metadata as routed; a streaming caller's frames are forwarded to its frame sink) or
    /// in-process (`frames`: the caller's own channel).
    async fn serve(
        inner: &Arc<Inner>,
        function_id: &str,
        gated: bool,
        payload: Value,
        metadata: Option<Value>,
        frames: Option<FrameSink>,
    ) -> Result<Value, BusError> {
        if gated && !inner.ready.load(Ordering::SeqCst) {
            return Err(starting());
        }
        let payload = strip_decoration(payload);
        if own_registry_change(inner, &payload) {
            return Ok(json!({"ok": true}));
        }
        let mut metadata = metadata.map(strip_decoration).unwrap_or(Value::Null);
        let stream = metadata.as_object_mut().and_then(|m| m.remove(STREAM_KEY));
        let (frames, forwarder) = match (frames, stream) {
            (Some(sink), _) => (Some(sink), None),
            (None, Some(s)) => match (s["function_id"].as_str(), s["stream_id"].as_str()) {
                (Some(f), Some(id)) => {
                    let (sink, task) =
                        IiiBus::frame_forwarder(inner, f.to_string(), id.to_string());
                    (Some(sink), Some(task))
                }
                _ => (None, None),
            },
            (None, None) => (None, None),
        };
        let ctx = CallContext { frames, metadata };
        let result = IiiBus::run_local(inner, function_id, payload, ctx).await;
        // Every frame reaches the caller before the answer does.
        if let Some(task) = forwarder {
            let _ = task.await;
        }
        result
    }

    // --- streaming frames -------------------------------------------------------------------

    /// The caller's end: frames of every streaming call this process made arrive here.
    fn register_frames_sink(&self) {
        let weak = Arc::downgrade(&self.inner);
        let def = FunctionDef::new(
            self.inner.frames_fn.clone(),
            "Internal: receives the streamed frames of this harness worker's streaming calls ({stream_id, seq, frames}).",
        )
        .internal();
        let handler = move |payload: Value, _ctx: CallContext| {
            let weak = weak.clone();
            async move {
                let Some(inner) = weak.upgrade() else {
                    return Ok(json!({"accepted": false}));
                };
                let stream_id = payload["stream_id"].as_str().unwrap_or_default();
                let sink = inner
                    .streams
                    .lock()
                    .expect("streams lock")
                    .get(stream_id)
                    .cloned();
                let Some(sink) = sink else {
                    return Ok(json!({"accepted": false}));
                };
                for frame in payload["frames"].as_array().cloned().unwrap_or_default() {
                    let _ = sink.send(frame);
                }
                Ok(json!({"accepted": true}))
            }
        };
        self.register_function(def, Arc::new(handler));
    }

    /// The callee's end: a sink whose frames are sent, in order, to the caller's frame function.
    /// Returns the sink and the task that drains it (awaited before the call answers).
    fn frame_forwarder(
        inner: &Arc<Inner>,
        target: String,
        stream_id: String,
    ) -> (FrameSink, tokio::task::JoinHandle<()>) {
        let (tx, mut rx) = mpsc::unbounded_channel::<Value>();
        let bus = IiiBus {
            inner: inner.clone(),
        };
        let task = inner.rt.spawn(async move {
            let mut seq: u64 = 0;
            let mut alive = true;
            while let Some(first) = rx.recv().await {
                let mut batch = vec![first];
                while batch.len() < FRAME_BATCH {
                    match rx.try_recv() {
                        Ok(f) => batch.push(f),
                        Err(_) => break,
                    }
                }
                if !alive {
                    continue;
                }
                let payload = json!({"stream_id": stream_id, "seq": seq, "frames": batch});
                let sent = if bus.serves(&target) {
                    // This worker's own frame sink (a streaming call it made that went
                    // through the engine): no need to go out and back for the frames.
                    bus.call_in_process(&target, payload, FRAME_TIMEOUT, None, None)
                        .await
                        .map_err(|e| e.to_string())
                } else {
                    let req = TriggerRequest {
                        function_id: target.clone(),
                        payload,
                        action: None,
                        timeout_ms: Some(FRAME_TIMEOUT.as_millis() as u64),
                    };
                    bus.inner.client.trigger(req).await.map_err(|e| e.to_string())
                };
                match sent {
                    Ok(v) if v["accepted"] == json!(false) => alive = false,
                    Ok(_) => seq += 1,
                    Err(e) => {
                        tracing::warn!(%target, "frame sink unreachable, dropping the rest of the stream: {e}");
                        alive = false;
                    }
                }
            }
        });
        (tx, task)
    }

    // --- queues -----------------------------------------------------------------------------

    fn group_lock(&self, key: &str) -> Arc<AsyncMutex<()>> {
        let mut groups = self.inner.groups.lock().expect("groups lock");
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
    fn register_deliver(&self) {
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
        self.register_function(def, Arc::new(handler));
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
            let queues = self.inner.queues.read().expect("queues lock");
            match queues.get(&queue) {
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
        let local = self
            .inner
            .local
            .read()
            .expect("local lock")
            .get(&function_id)
            .cloned();
        let mut lost = self.inner.disconnects.subscribe();
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
                self.enqueue(&queue, &function_id, again)
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

    /// Waits until every function registered here is listed by the engine (registration is
    /// fire-and-forget: a call racing it gets `function_not_found`).
    async fn wait_registered(&self) -> Result<(), BusError> {
        let deadline = tokio::time::Instant::now() + self.inner.opts.connect_timeout;
        let mut announce_again = tokio::time::Instant::now() + REANNOUNCE;
        loop {
            let listed = self
                .list_functions(json!({"include_internal": true}))
                .await?;
            self.note_served(&listed);
            let present: std::collections::HashSet<String> = listed["functions"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|f| f["function_id"].as_str().map(str::to_string))
                .collect();
            let held = self.inner.held.lock().expect("held lock").clone();
            let missing: Vec<String> = self
                .local_function_ids()
                .into_iter()
                .filter(|id| !present.contains(id) && !held.contains(id))
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= announce_again {
                // The engine refuses a registration while another connection still holds the
                // id (`FUNCTION_NAMESPACE_CONFLICT`: a previous connection of this same worker
                // name it has not dropped yet) and nothing sends it again: send it again.
                let defs: Vec<(String, FunctionDef)> = {
                    let local = self.inner.local.read().expect("local lock");
                    missing
                        .iter()
                        .filter_map(|id| local.get(id).map(|l| (id.clone(), l.def.clone())))
                        .collect()
                };
                tracing::debug!(
                    missing = defs.len(),
                    "registering the functions the engine does not list again"
                );
                for (id, def) in defs {
                    self.announce(&id, &def);
                }
                announce_again = tokio::time::Instant::now() + REANNOUNCE;
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(BusError::new(
                    "registration_timeout",
                    format!(
                        "the engine does not list {} of this worker's functions: {}",
                        missing.len(),
                        missing.join(", ")
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `engine::functions::list`. Always with `include_internal: true` at the call sites: the
    /// engine hides functions registered with `metadata.internal` unless asked, and most of ours
    /// are internal.
    async fn list_functions(&self, request: Value) -> Result<Value, BusError> {
        self.invoke(
            "engine::functions::list",
            request,
            Some(Duration::from_secs(10)),
            None,
            None,
        )
        .await
    }

    async fn engine_has_function(&self, function_id: &str) -> Result<bool, BusError> {
        let prefix = function_id
            .rsplit_once("::")
            .map(|(p, _)| format!("{p}::"))
            .unwrap_or_default();
        let listed = self
            .list_functions(json!({"prefix": prefix, "include_internal": true}))
            .await?;
        Ok(listed["functions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|f| f["function_id"] == json!(function_id)))
    }

    /// The enqueue route needs `def.queue` defined in the queue worker as FIFO grouped by its
    /// group field (see `provider`): kept when it is, declared with `queue::define` when it
    /// is missing, refused when it is declared otherwise or cannot be declared.
    async fn declare_in_provider(&self, def: &QueueDef) -> Result<(), BusError> {
        let wanted = provider::required_block(def);
        let stored = self
            .invoke(
                "configuration::get",
                json!({"id": provider::QUEUE_CONFIG_ID}),
                Some(Duration::from_secs(10)),
                None,
                None,
            )
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
                .invoke(
                    provider::DEFINE_FUNCTION,
                    provider::define_request(def),
                    Some(Duration::from_secs(30)),
                    None,
                    None,
                )
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
        let types = self
            .invoke(
                "engine::triggers::list",
                json!({"include_internal": true}),
                Some(Duration::from_secs(10)),
                None,
                None,
            )
            .await?;
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
                .invoke(
                    "engine::registered-triggers::list",
                    json!({"trigger_type": "durable:subscriber", "function_id": DELIVER_FUNCTION}),
                    Some(Duration::from_secs(10)),
                    None,
                    None,
                )
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
}

// --- harness-owned trigger types -----------------------------------------------------------

thread_local! {
    static CONFIG_SCHEMA: RefCell<Value> = const { RefCell::new(Value::Bool(true)) };
}

/// A schema type whose schema is whatever [`CONFIG_SCHEMA`] holds when the SDK asks: the SDK
/// takes a trigger type's config schema only from a type, ours are values.
struct DynSchema;

impl serde::Serialize for DynSchema {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_unit()
    }
}

impl schemars::JsonSchema for DynSchema {
    fn schema_name() -> String {
        "TriggerConfig".into()
    }
    fn is_referenceable() -> bool {
        false
    }
    fn json_schema(_gen: &mut schemars::gen::SchemaGenerator) -> schemars::schema::Schema {
        CONFIG_SCHEMA.with(|s| {
            let mut v = s.borrow().clone();
            if let Value::Object(m) = &mut v {
                m.remove("$schema");
            }
            serde_json::from_value(v).unwrap_or(schemars::schema::Schema::Bool(true))
        })
    }
}

/// Receives the engine's forwarding of bindings of one harness-owned trigger type.
struct BindingSink {
    inner: Weak<Inner>,
    trigger_type: String,
}

#[async_trait]
impl TriggerHandler for BindingSink {
    async fn register_trigger(&self, config: TriggerConfig) -> Result<(), iii_sdk::Error> {
        let Some(inner) = self.inner.upgrade() else {
            return Ok(());
        };
        let validate = inner
            .trigger_types
            .read()
            .expect("trigger types lock")
            .get(&self.trigger_type)
            .and_then(|t| t.validate.clone());
        let cfg = if config.config.is_null() {
            json!({})
        } else {
            config.config
        };
        if let Some(validate) = validate {
            validate(&cfg).map_err(|why| iii_sdk::Error::Remote {
                code: "harness/invalid_request".into(),
                message: format!("config: {why}"),
                stacktrace: None,
            })?;
        }
        let binding = Binding {
            id: config.id.clone(),
            trigger_type: self.trigger_type.clone(),
            function_id: config.function_id,
            config: cfg,
            metadata: strip_decoration(config.metadata.unwrap_or_else(|| json!({}))),
        };
        tracing::debug!(binding = %binding.id, trigger_type = %binding.trigger_type, function = %binding.function_id, "binding forwarded by the engine");
        inner
            .bindings
            .write()
            .expect("bindings lock")
            .insert(config.id, binding);
        Ok(())
    }

    async fn unregister_trigger(&self, config: TriggerConfig) -> Result<(), iii_sdk::Error> {
        if let Some(inner) = self.inner.upgrade() {
            inner
                .bindings
                .write()
                .expect("bindings lock")
                .remove(&config.id);
        }
        Ok(())
    }
}

// --- the Bus -------------------------------------------------------------------------------

impl IiiBus {
    /// Registers one local function with the engine (`registerfunction`).
    fn announce(&self, id: &str, def: &FunctionDef) {
        let id = id.to_string();
        let weak = Arc::downgrade(&self.inner);
        let fid = id.clone();
        let gated = held(def);
        let handler = move |payload: Value, metadata: Option<Value>| {
            let weak = weak.clone();
            let fid = fid.clone();
            async move {
                let inner = weak.upgrade().ok_or(iii_sdk::Error::NotConnected)?;
                IiiBus::serve(&inner, &fid, gated, payload, metadata, None)
                    .await
                    .map_err(to_sdk)
            }
        };
        let mut reg = RegisterFunction::new_async(handler).description(def.description.clone());
        if let Some(s) = def.request_schema.clone() {
            reg = reg.request_format(s);
        }
        if let Some(s) = def.response_schema.clone() {
            reg = reg.response_format(s);
        }
        if !def.metadata.is_null() {
            reg = reg.metadata(def.metadata.clone());
        }
        self.inner.client.register_function(id, reg);
    }
}

#[async_trait]
impl Bus for IiiBus {
    async fn call(
        &self,
        function_id: &str,
        payload: Value,
        timeout: Option<Duration>,
    ) -> Result<Value, BusError> {
        self.invoke(function_id, payload, timeout, None, None).await
    }

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
        let (tx, rx) = mpsc::unbounded_channel();
        if self.serves(function_id) {
            // The handler's frames go straight into the caller's channel.
            let bus = self.clone();
            let function_id = function_id.to_string();
            let timeout = timeout.unwrap_or(DEFAULT_CALL_TIMEOUT);
            let result = Box::pin(async move {
                // A routed streaming call's metadata, once its frame sink is taken out.
                let metadata = Some(json!({}));
                bus.in_process(&function_id, payload, timeout, metadata, Some(tx))
                    .await
            });
            return Ok(StreamingCall { frames: rx, result });
        }
        let stream_id = uuid::Uuid::new_v4().simple().to_string();
        self.inner
            .streams
            .lock()
            .expect("streams lock")
            .insert(stream_id.clone(), tx);
        let bus = self.clone();
        let function_id = function_id.to_string();
        let metadata =
            json!({STREAM_KEY: {"function_id": self.inner.frames_fn, "stream_id": stream_id}});
        let result = Box::pin(async move {
            let r = bus
                .invoke(&function_id, payload, timeout, Some(metadata), None)
                .await;
            // The callee finished sending its frames before it answered: closing the channel
            // now loses nothing and ends the reader's loop.
            bus.inner
                .streams
                .lock()
                .expect("streams lock")
                .remove(&stream_id);
            r
        });
        Ok(StreamingCall { frames: rx, result })
    }

    async fn call_void(&self, function_id: &str, payload: Value) {
        if let Err(e) = self
            .invoke(function_id, payload, None, None, Some(TriggerAction::Void))
            .await
        {
            tracing::warn!(function = %function_id, "fire-and-forget call failed: {e}");
        }
    }

    fn register_function(&self, def: FunctionDef, handler: Arc<dyn Handler>) {
        let id = def.function_id.clone();
        let replaced = self
            .inner
            .local
            .write()
            .expect("local lock")
            .insert(
                id.clone(),
                Arc::new(Local {
                    def: def.clone(),
                    handler,
                }),
            )
            .is_some();
        if replaced {
            // The engine already routes this id here; the new handler is picked up per call.
            return;
        }
        if held(&def) && !self.inner.opened.load(Ordering::SeqCst) {
            // Public until the worker can serve it: announced by `open`.
            self.inner.held.lock().expect("held lock").push(id);
            return;
        }
        self.announce(&id, &def);
    }
    fn register_trigger_type(&self, def: TriggerTypeDef) {
        let id = def.id.clone();
        let fresh = self
            .inner
            .trigger_types
            .write()
            .expect("trigger types lock")
            .insert(id.clone(), def.clone())
            .is_none();
        if !fresh {
            return;
        }
        let sink = BindingSink {
            inner: Arc::downgrade(&self.inner),
            trigger_type: id.clone(),
        };
        CONFIG_SCHEMA.with(|s| *s.borrow_mut() = def.config_schema.clone());
        #[allow(deprecated)]
        self.inner.client.register_trigger_type_without_warning(
            RegisterTriggerType::new(id, def.description.clone(), sink)
                .trigger_request_format::<DynSchema>(),
        );
    }

    async fn bindings(&self, trigger_type: &str) -> Result<Vec<Binding>, BusError> {
        let owned = self
            .inner
            .trigger_types
            .read()
            .expect("trigger types lock")
            .contains_key(trigger_type);
        let mut out: Vec<Binding> = if owned {
            let bindings = self.inner.bindings.read().expect("bindings lock");
            bindings
                .values()
                .filter(|b| b.trigger_type == trigger_type)
                .cloned()
                .collect()
        } else {
            let listed = self
                .invoke(
                    "engine::registered-triggers::list",
                    json!({"trigger_type": trigger_type, "include_internal": true}),
                    Some(Duration::from_secs(30)),
                    None,
                    None,
                )
                .await?;
            listed["registered_triggers"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|t| t["trigger_type"] == json!(trigger_type))
                .map(|t| Binding {
                    id: t["id"].as_str().unwrap_or_default().to_string(),
                    trigger_type: trigger_type.to_string(),
                    function_id: t["function_id"].as_str().unwrap_or_default().to_string(),
                    config: t.get("config").cloned().unwrap_or_else(|| json!({})),
                    metadata: t.get("metadata").cloned().unwrap_or_else(|| json!({})),
                })
                .collect()
        };
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    async fn define_queue(&self, def: QueueDef) -> Result<(), BusError> {
        if self
            .inner
            .queues
            .read()
            .expect("queues lock")
            .contains_key(&def.queue)
        {
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
        self.inner.queues.write().expect("queues lock").insert(
            def.queue.clone(),
            QueueRoute {
                route,
                group_field: def.message_group_field.clone(),
                visibility: Duration::from_millis(def.visibility_timeout_ms.max(1000)),
            },
        );
        Ok(())
    }

    async fn enqueue(
        &self,
        queue: &str,
        function_id: &str,
        payload: Value,
    ) -> Result<(), BusError> {
        let (route, group_field) = {
            let queues = self.inner.queues.read().expect("queues lock");
            let q = queues
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
                .invoke(
                    "iii::durable::publish",
                    json!({"topic": topic, "data": envelope}),
                    Some(Duration::from_secs(30)),
                    None,
                    None,
                )
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

    async fn publish(
        &self,
        topic: &str,
        payload: Value,
        dedupe_key: Option<String>,
    ) -> Result<(), BusError> {
        if let Some(key) = dedupe_key {
            let out = self
                .invoke(
                    "state::set",
                    json!({"scope": PUBLISHED_SCOPE, "key": key, "value": {"topic": topic, "at": now_ms()}}),
                    Some(Duration::from_secs(30)),
                    None,
                    None,
                )
                .await?;
            if !out["old_value"].is_null() {
                return Ok(());
            }
        }
        self.invoke(
            "iii::durable::publish",
            json!({"topic": topic, "data": payload}),
            Some(Duration::from_secs(30)),
            None,
            None,
        )
        .await
        .map(|_| ())
    }

    /// The engine offers no durability point (its file store flushes every 5 s), so this
    /// cannot make anything durable. What it does: read back every state value written through
    /// this bus since the last barrier and fail (`harness/state`) if the engine no longer holds
    /// it, so a checkpoint lost before the side effect (an engine restart between the write and
    /// the dispatch) stops the dispatch. See the crate docs for what remains.
    async fn barrier(&self) -> Result<(), BusError> {
        let (snapshot, _running) = {
            let mut w = self.inner.written.lock().expect("written lock");
            let snapshot: Vec<((String, String), (u64, Value))> = w.drain().collect();
            let floor = snapshot
                .iter()
                .map(|(_, (s, _))| *s)
                .min()
                .unwrap_or(u64::MAX);
            self.inner
                .recent
                .lock()
                .expect("recent lock")
                .floors
                .push(floor);
            (
                snapshot,
                BarrierRunning {
                    inner: self.inner.clone(),
                    floor,
                },
            )
        };
        for ((scope, key), (seq, value)) in snapshot {
            let stored = self
                .invoke(
                    "state::get",
                    json!({"scope": scope, "key": key}),
                    Some(Duration::from_secs(30)),
                    None,
                    None,
                )
                .await?;
            if comparable(&scope, strip_decoration(stored)) == value {
                continue;
            }
            // A newer write of the same key (another task), recorded or still in flight, is not
            // a loss (the newer one is checked by a later barrier).
            let id = (scope.clone(), key.clone());
            let newer = self
                .inner
                .written
                .lock()
                .expect("written lock")
                .get(&id)
                .is_some_and(|(s, _)| *s > seq)
                || self
                    .inner
                    .writing
                    .lock()
                    .expect("writing lock")
                    .contains_key(&id)
                || self
                    .inner
                    .recent
                    .lock()
                    .expect("recent lock")
                    .log
                    .iter()
                    .any(|(s, k)| *s > seq && *k == id);
            if !newer {
                return Err(BusError::new(
                    "harness/state",
                    format!("state {scope}/{key}: the engine lost a write before the durability point (did it restart?)"),
                ));
            }
        }
        Ok(())
    }

    async fn state_get(&self, scope: &str, key: &str) -> Result<Option<Value>, BusError> {
        let v = self
            .invoke(
                "state::get",
                json!({"scope": scope, "key": key}),
                Some(Duration::from_secs(30)),
                None,
                None,
            )
            .await?;
        if v.is_null() {
            return Ok(None);
        }
        let v = strip_decoration(v);
        if scope == FENCED_SCOPE {
            if let Some((_, record)) = fence::read(&v) {
                return Ok(Some(record));
            }
            if fence::is_empty_slots(&v) {
                return Ok(None);
            }
        }
        Ok(Some(unwrap_state(v).1))
    }

    async fn state_set(&self, scope: &str, key: &str, value: Value) -> Result<(), BusError> {
        if scope == FENCED_SCOPE {
            return self.fenced_set(key, value).await;
        }
        let stored = wrap_state(key, value);
        let _writing = self.writing(scope, key);
        self.invoke(
            "state::set",
            json!({"scope": scope, "key": key, "value": stored}),
            Some(Duration::from_secs(30)),
            None,
            None,
        )
        .await?;
        self.record_write(scope, key, stored);
        Ok(())
    }

    async fn state_delete(&self, scope: &str, key: &str) -> Result<(), BusError> {
        let _writing = self.writing(scope, key);
        self.invoke(
            "state::delete",
            json!({"scope": scope, "key": key}),
            Some(Duration::from_secs(30)),
            None,
            None,
        )
        .await?;
        self.record_write(scope, key, Value::Null);
        Ok(())
    }

    async fn state_list(&self, scope: &str) -> Result<Vec<(String, Value)>, BusError> {
        let v = self
            .invoke(
                "state::list",
                json!({"scope": scope}),
                Some(Duration::from_secs(30)),
                None,
                None,
            )
            .await?;
        let mut out = Vec::new();
        for item in v.as_array().cloned().unwrap_or_default() {
            let item = strip_decoration(item);
            if scope == FENCED_SCOPE {
                if let Some((key, record)) = fence::read(&item) {
                    match key {
                        Some(k) => out.push((k, record)),
                        None => {
                            tracing::warn!(scope, "skipping a state value stored without its key")
                        }
                    }
                    continue;
                }
                if fence::is_empty_slots(&item) {
                    continue;
                }
            }
            match unwrap_state(item) {
                (Some(k), v) => out.push((k, v)),
                (None, _) => tracing::warn!(scope, "skipping a state value stored without its key"),
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }
}

tokio::task_local! {
    /// Set while a queued call runs in `deliver`: lets `invoke` end the whole delivery on a
    /// lost link instead of failing one call of it.
    static DELIVERY: Arc<watch::Sender<bool>>;
}

/// True for an `engine::functions-available` notice (`{event: "functions_changed", functions:
/// [{function_id, ..}]}`) whose only changes are this worker's own registrations or another
/// harness worker's frame sink: the engine polls its registry every 5 s and announces whatever
/// changed, including what a (re)starting harness worker registered, which is no news to a
/// running turn. Every other notice passes and becomes the new baseline.
fn own_registry_change(inner: &Inner, payload: &Value) -> bool {
    let local = inner.local.read().expect("local lock");
    let mut last = inner.foreign.lock().expect("foreign lock");
    no_news(|id| local.contains_key(id), &mut last, payload)
}

/// The decision of [`own_registry_change`]: `is_own` tells this worker's functions.
fn no_news(
    is_own: impl Fn(&str) -> bool,
    last: &mut Option<std::collections::BTreeSet<String>>,
    payload: &Value,
) -> bool {
    if payload["event"] != json!("functions_changed") {
        return false;
    }
    let Some(functions) = payload["functions"].as_array() else {
        return false;
    };
    let foreign: std::collections::BTreeSet<String> = functions
        .iter()
        .filter_map(|f| f["function_id"].as_str())
        .filter(|id| !is_own(id) && !id.starts_with(FRAMES_PREFIX))
        .map(str::to_string)
        .collect();
    let same = last.as_ref() == Some(&foreign);
    *last = Some(foreign);
    same
}

/// A stored value as the write-ahead copy and the barrier compare it: a fenced turn record by
/// its newest slot (pruning older slots changes nothing), anything else as stored.
fn comparable(scope: &str, stored: Value) -> Value {
    if scope == FENCED_SCOPE {
        return fence::effective(&stored);
    }
    stored
}

/// The topic of shard `i` of a queue.
fn shard_topic(queue: &str, i: u32) -> String {
    format!("{queue}.{i}")
}

/// FNV-1a: the shard of a group must be the same in every worker process and every build.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Public functions of the harness surface wait for [`IiiBus::open`]; internal ones (the queue's
/// delivery target, the frame sink, hook and cron targets) and siblings are needed to get there.
fn held(def: &FunctionDef) -> bool {
    def.function_id.starts_with("harness::") && !def.is_internal()
}

/// The answer of a public function while the worker cannot serve it yet.
fn starting() -> BusError {
    BusError::new(
        "harness/starting",
        "the harness worker is starting (ensuring its queue, siblings and bindings on the engine); retry shortly",
    )
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A barrier in progress (see `Inner::recent`); dropping it prunes the log.
struct BarrierRunning {
    inner: Arc<Inner>,
    floor: u64,
}

impl Drop for BarrierRunning {
    fn drop(&mut self) {
        let mut r = self.inner.recent.lock().expect("recent lock");
        if let Some(i) = r.floors.iter().position(|f| *f == self.floor) {
            r.floors.swap_remove(i);
        }
        match r.floors.iter().min().copied() {
            None => r.log.clear(),
            Some(min) => r.log.retain(|(s, _)| *s > min),
        }
    }
}

/// Marks a state write in flight until dropped (see `Inner::writing`).
struct Writing {
    inner: Arc<Inner>,
    id: (String, String),
}

impl Drop for Writing {
    fn drop(&mut self) {
        let mut w = self.inner.writing.lock().expect("writing lock");
        if let Some(n) = w.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                w.remove(&self.id);
            }
        }
    }
}

impl IiiBus {
    /// Marks a write of `(scope, key)` in flight; dropped after it was recorded (or failed).
    fn writing(&self, scope: &str, key: &str) -> Writing {
        let id = (scope.to_string(), key.to_string());
        *self
            .inner
            .writing
            .lock()
            .expect("writing lock")
            .entry(id.clone())
            .or_insert(0) += 1;
        Writing {
            inner: self.inner.clone(),
            id,
        }
    }

    fn record_write(&self, scope: &str, key: &str, stored: Value) {
        self.inner.journal.record(scope, key, &stored);
        let seq = self
            .inner
            .write_seq
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let id = (scope.to_string(), key.to_string());
        self.inner
            .written
            .lock()
            .expect("written lock")
            .insert(id.clone(), (seq, stored));
        let mut r = self.inner.recent.lock().expect("recent lock");
        if !r.floors.is_empty() {
            r.log.push((seq, id));
        }
    }

    /// The epoch this worker writes `session_id`'s turn record under: taken once per session
    /// (an atomic increment of its lease row), above every slot the record already holds (a
    /// lease row the engine lost in a crash must not hand out an epoch already used).
    async fn lease_epoch(&self, session_id: &str) -> Result<u64, BusError> {
        if let Some(e) = self
            .inner
            .leases
            .lock()
            .expect("leases lock")
            .get(session_id)
        {
            return Ok(*e);
        }
        let held = self
            .invoke(
                "state::get",
                json!({"scope": FENCED_SCOPE, "key": session_id}),
                Some(Duration::from_secs(30)),
                None,
                None,
            )
            .await?;
        let floor = fence::epochs(&held).last().copied().unwrap_or(0);
        let mut taken = self
            .invoke(
                "state::update",
                fence::take_lease_request(session_id, &self.inner.instance),
                Some(Duration::from_secs(30)),
                None,
                None,
            )
            .await?;
        let mut epoch = taken["new_value"]["epoch"].as_u64().unwrap_or(0);
        if epoch <= floor {
            let mut req = fence::take_lease_request(session_id, &self.inner.instance);
            req["ops"][0]["by"] = json!(floor + 1 - epoch);
            taken = self
                .invoke(
                    "state::update",
                    req,
                    Some(Duration::from_secs(30)),
                    None,
                    None,
                )
                .await?;
            epoch = taken["new_value"]["epoch"].as_u64().unwrap_or(0);
        }
        if epoch == 0 {
            return Err(BusError::new(
                "harness/state",
                format!("lease of session '{session_id}': the engine answered no epoch: {taken}"),
            ));
        }
        let previous = taken["old_value"]["holder"].as_str().unwrap_or_default();
        if !previous.is_empty() && previous != self.inner.instance {
            tracing::info!(session = %session_id, epoch, %previous, "took the session's lease over");
        }
        let mut leases = self.inner.leases.lock().expect("leases lock");
        // Forgetting an epoch costs only a new one on the session's next write (this worker's
        // older slot is pruned then), so the map is simply emptied when it grows large.
        if leases.len() >= MAX_CACHED_LEASES {
            leases.clear();
        }
        leases.insert(session_id.to_string(), epoch);
        Ok(epoch)
    }

    /// Writes a turn record in this worker's slot; refused (`harness/fenced`) when a newer
    /// holder's slot is there (see `fence`).
    async fn fenced_set(&self, key: &str, value: Value) -> Result<(), BusError> {
        let epoch = self.lease_epoch(key).await?;
        let _writing = self.writing(FENCED_SCOPE, key);
        let out = self
            .invoke(
                "state::update",
                fence::write_request(FENCED_SCOPE, key, epoch, &value),
                Some(Duration::from_secs(30)),
                None,
                None,
            )
            .await?;
        let epochs = fence::epochs(&out["new_value"]);
        let newest = epochs.last().copied().unwrap_or(0);
        if newest > epoch {
            self.inner.leases.lock().expect("leases lock").remove(key);
            // The refused slot is never read; removing it keeps the value small.
            let _ = self
                .invoke(
                    "state::update",
                    fence::prune_request(FENCED_SCOPE, key, &[epoch]),
                    Some(Duration::from_secs(30)),
                    None,
                    None,
                )
                .await;
            tracing::warn!(session = %key, epoch, newest, "turn record write refused: another harness worker holds the session");
            return Err(BusError::new(
                "harness/fenced",
                format!("turn record of '{key}': another harness worker took the session over (epoch {newest} > {epoch}); this worker's write was refused"),
            ));
        }
        let older: Vec<u64> = epochs.into_iter().filter(|e| *e < epoch).collect();
        if !older.is_empty() {
            let _ = self
                .invoke(
                    "state::update",
                    fence::prune_request(FENCED_SCOPE, key, &older),
                    Some(Duration::from_secs(30)),
                    None,
                    None,
                )
                .await;
        }
        self.record_write(FENCED_SCOPE, key, fence::written(epoch, &value));
        Ok(())
    }

    /// Every function registered here, with its schemas (what the engine was told).
    pub fn function_defs(&self) -> Vec<FunctionDef> {
        let local = self.inner.local.read().expect("local lock");
        let mut defs: Vec<FunctionDef> = local.values().map(|l| l.def.clone()).collect();
        defs.sort_by(|a, b| a.function_id.cmp(&b.function_id));
        defs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn notice(ids: &[&str]) -> Value {
        json!({"event": "functions_changed", "functions": ids.iter().map(|id| json!({"function_id": id, "namespace": "default"})).collect::<Vec<_>>()})
    }

    #[test]
    fn a_registry_change_made_only_of_harness_registrations_is_no_news() {
        let own = |id: &str| id.starts_with("harness::") || id.starts_with("session::");
        let mut last = None;
        // The baseline taken at open.
        assert!(!no_news(own, &mut last, &notice(&["state::get", "f::a"])));
        // The worker (re)registered its own functions, another worker its frame sink.
        assert!(no_news(
            own,
            &mut last,
            &notice(&[
                "state::get",
                "f::a",
                "harness::send",
                "session::append",
                "harness::frames::0af3"
            ])
        ));
        // Someone else's function appeared: news, and the new baseline.
        assert!(!no_news(
            own,
            &mut last,
            &notice(&["state::get", "f::a", "f::b", "harness::send"])
        ));
        assert!(no_news(
            own,
            &mut last,
            &notice(&["state::get", "f::a", "f::b"])
        ));
        // One went away: news too.
        assert!(!no_news(own, &mut last, &notice(&["state::get", "f::b"])));
        // Anything that is not the engine's notice passes untouched.
        assert!(!no_news(own, &mut last, &json!({"session_id": "s"})));
    }
}
