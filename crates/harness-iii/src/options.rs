//! How the worker connects: [`IiiOptions`], the queue route it asks for, where self-calls run.

use std::time::Duration;

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
