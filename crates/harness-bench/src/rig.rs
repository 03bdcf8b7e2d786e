//! A phase's runtime in a temporary directory, and the driver that runs turns on it.

use std::future::Future;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use harness_bus::{Bus, BusError, CallContext, FunctionDef};
use harness_core::{Harness, HarnessConfig};
use harness_store::Durability;
use harness_types::api::{SendOptions, SendRequest};
use serde_json::{json, Value};

use crate::host::{self, Host, Opened, RigSpec};
use crate::probe::{lock, Probe, ProbeBus, StepSample};

/// Longest a bench turn may take before the bench gives up.
pub(crate) const TURN_TIMEOUT: Duration = Duration::from_secs(60);
/// Text-turn loops start a new session after this many turns (keeps transcripts short).
pub(crate) const TURNS_PER_SESSION: u32 = 20;

const TEXT_SCRIPT: &str =
    r#"{"generations": [{"repeat": true, "content": [{"type": "text", "text": "ok"}]}]}"#;
/// The no-op function the function-call phase allows (and the handoff phase's policy refuses).
pub(crate) const NOOP_FN: &str = "bench::noop";
/// What a call turn sends; any other message gets the text generation.
pub(crate) const CALL_MESSAGE: &str = "call";
/// A call turn's every generation calls `bench::noop` under a new id (`{request_id}` is the
/// step's request id), so every step runs (or refuses) one call: the turn advances until
/// `max_turns`. Other messages get "ok", as in [`TEXT_SCRIPT`].
const CALL_SCRIPT: &str = r#"{"generations": [
  {"match": {"last_user_text": "^call$"}, "repeat": true, "content": [{"type": "function_call", "id": "c_{request_id}", "function_id": "bench::noop", "arguments": {}}]},
  {"repeat": true, "content": [{"type": "text", "text": "ok"}]}]}"#;

#[derive(Clone, Copy)]
pub(crate) enum ScriptKind {
    Text,
    Calls,
}

/// Where a phase's runtime runs: the embedded bus (in-process), or an iii engine.
#[derive(Clone, Copy)]
pub(crate) enum Mode<'a> {
    Embedded,
    /// The engine's worker URL (`--iii`).
    Iii(&'a str),
}

impl Mode<'_> {
    pub(crate) fn is_iii(&self) -> bool {
        matches!(self, Mode::Iii(_))
    }
}

/// Where a phase opens its runtime: the mode and the directory of its temporary stores.
#[derive(Clone, Copy)]
pub(crate) struct At<'a> {
    pub(crate) mode: Mode<'a>,
    pub(crate) base: &'a Path,
    /// Opens the runtimes (the binary's wiring, embedded or on iii).
    pub(crate) host: &'a dyn Host,
}

pub(crate) struct Rig {
    pub(crate) opened: Opened,
    pub(crate) probe: Arc<Probe>,
    _dir: tempfile::TempDir,
}

/// Registers the in-process no-op target of the function-call phases.
pub(crate) fn register_noop(bus: &dyn Bus) {
    // In-process and instant: what a call costs beyond its target is what is measured.
    bus.register_function(
        FunctionDef::new(NOOP_FN, "harness bench: answers {\"ok\": true} at once"),
        Arc::new(|_p: Value, _ctx: CallContext| async {
            Ok::<Value, BusError>(json!({"ok": true}))
        }),
    );
}

impl Rig {
    /// Opens a phase's runtime, and the driver of its turns.
    pub(crate) async fn open(
        at: At<'_>,
        script: ScriptKind,
        durability: Durability,
    ) -> Result<(Rig, Driver)> {
        let dir = tempfile::Builder::new()
            .prefix("harness-bench-")
            .tempdir_in(at.base)
            .with_context(|| format!("cannot create a directory in {}", at.base.display()))?;
        let script_path = dir.path().join("bench-script.json");
        let text = match script {
            ScriptKind::Text => TEXT_SCRIPT,
            ScriptKind::Calls => CALL_SCRIPT,
        };
        std::fs::write(&script_path, text)
            .with_context(|| format!("cannot write {}", script_path.display()))?;
        let probe = Arc::new(Probe::default());
        let layer_probe = probe.clone();
        let spec = RigSpec {
            data_dir: dir.path().join("data"),
            script: script_path,
            durability,
            config: HarnessConfig::default(),
            register: matches!(script, ScriptKind::Calls)
                .then(|| Box::new(|bus: &dyn Bus| register_noop(bus)) as host::Register),
            layer: Box::new(move |inner| {
                Arc::new(ProbeBus {
                    inner,
                    probe: layer_probe,
                    list_names: Default::default(),
                }) as Arc<dyn Bus>
            }),
        };
        let iii = match at.mode {
            Mode::Embedded => None,
            Mode::Iii(url) => Some(url),
        };
        let opened = at.host.open(iii, spec).await?;
        let driver = Driver {
            harness: opened.harness.clone(),
            probe: probe.clone(),
        };
        let rig = Rig {
            opened,
            probe,
            _dir: dir,
        };
        Ok((rig, driver))
    }

    /// The store's fsync counter; None on iii (the engine holds the loop's state and queue and
    /// gives no durability point, so there is nothing comparable to count).
    pub(crate) fn fsyncs(&self) -> Option<u64> {
        self.store().map(|s| s.stats().fsyncs)
    }

    /// The embedded store (None on iii).
    pub(crate) fn store(&self) -> Option<&harness_store::Store> {
        self.opened.store.as_ref()
    }

    /// Waits until every step message is acked (its fsync included). On iii: until every step
    /// enqueued on `harness-turn` has been handled (the engine's queue depth is not visible).
    pub(crate) async fn queue_idle(&self) -> Result<()> {
        let deadline = Instant::now() + TURN_TIMEOUT;
        loop {
            let busy = match &self.opened.queue_depth {
                Some(depth) => depth() > 0,
                None => {
                    self.probe.steps_handled.load(Ordering::SeqCst)
                        < self.probe.steps_enqueued.load(Ordering::SeqCst)
                }
            };
            if !busy {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "the step queue did not drain within {} s",
                    TURN_TIMEOUT.as_secs()
                );
            }
            tokio::time::sleep(Duration::from_micros(50)).await;
        }
    }

    /// [`Rig::queue_idle`], then a barrier: the last ack's fsync (which runs beside the next
    /// step, off the handoff) has finished, so the fsync counter is settled. Costs no fsync when
    /// everything committed is already synced. (On iii only the queue wait.)
    pub(crate) async fn settle(&self) -> Result<()> {
        self.queue_idle().await?;
        match self.store() {
            Some(store) => store
                .barrier()
                .await
                .map_err(|e| anyhow!("store barrier: {e}")),
            None => Ok(()),
        }
    }

    /// Runs `measured` with every step sampled, and returns what it returned with the samples
    /// of its steps, once the queue has drained of them.
    pub(crate) async fn sampled<T>(
        &self,
        measured: impl Future<Output = Result<T>>,
    ) -> Result<(T, Vec<StepSample>)> {
        self.queue_idle().await?;
        self.probe.sample_steps.store(true, Ordering::Relaxed);
        let out = measured.await?;
        self.queue_idle().await?;
        self.probe.sample_steps.store(false, Ordering::Relaxed);
        Ok((out, std::mem::take(&mut *lock(&self.probe.steps))))
    }

    pub(crate) async fn close(self) {
        (self.opened.close)().await;
    }
}

/// What a worker task needs to run turns.
#[derive(Clone)]
pub(crate) struct Driver {
    pub(crate) harness: Harness,
    pub(crate) probe: Arc<Probe>,
}

impl Driver {
    pub(crate) async fn send(
        &self,
        session: Option<String>,
        options: Option<SendOptions>,
    ) -> Result<(String, String)> {
        self.send_message(session, "hi", options).await
    }

    pub(crate) async fn send_message(
        &self,
        session: Option<String>,
        message: &str,
        options: Option<SendOptions>,
    ) -> Result<(String, String)> {
        let new = session.is_none();
        let resp = self
            .harness
            .send(SendRequest {
                session_id: session,
                message: json!(message),
                model: new.then(|| "bench".to_string()),
                provider: new.then(|| "scripted".to_string()),
                options,
                ..SendRequest::default()
            })
            .await
            .map_err(|e| anyhow!("harness::send failed: {e}"))?;
        Ok((resp.session_id, resp.turn_id))
    }

    /// One turn, start to `turn-completed`; returns the session id.
    pub(crate) async fn turn(
        &self,
        session: Option<String>,
        options: Option<SendOptions>,
    ) -> Result<String> {
        let (session_id, turn_id) = self.send(session, options).await?;
        self.probe.wait(&turn_id).await?;
        Ok(session_id)
    }

    /// A call turn ([`CALL_MESSAGE`]) in a new session, start to `turn-completed`; returns the
    /// turn id.
    pub(crate) async fn call_turn(&self, options: Option<SendOptions>) -> Result<String> {
        let (_, turn_id) = self.send_message(None, CALL_MESSAGE, options).await?;
        self.probe.wait(&turn_id).await?;
        Ok(turn_id)
    }

    /// Text turns back to back until `deadline` (or `max_turns`); returns the turns completed.
    pub(crate) async fn text_loop(&self, deadline: Instant, max_turns: u64) -> Result<u64> {
        let mut sessions = TextSessions::default();
        let mut done = 0;
        while done < max_turns && Instant::now() < deadline {
            let turn_id = sessions.send(self).await?;
            self.probe.wait(&turn_id).await?;
            done += 1;
        }
        Ok(done)
    }
}

/// Where the next text turn goes: a new session every [`TURNS_PER_SESSION`] turns, so
/// transcripts stay short.
#[derive(Default)]
pub(crate) struct TextSessions {
    session: Option<String>,
    turns: u32,
}

impl TextSessions {
    /// Sends the next text turn; returns its turn id.
    pub(crate) async fn send(&mut self, d: &Driver) -> Result<String> {
        let (session_id, turn_id) = d.send(self.session.take(), None).await?;
        self.turns += 1;
        if self.turns < TURNS_PER_SESSION {
            self.session = Some(session_id);
        } else {
            self.turns = 0;
        }
        Ok(turn_id)
    }
}

/// Runs `n` text-loop workers until `deadline`; returns the turns they completed.
pub(crate) async fn run_workers(
    d: &Driver,
    n: usize,
    deadline: Instant,
    max_turns_each: u64,
) -> Result<u64> {
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let d = d.clone();
        tasks.spawn(async move { d.text_loop(deadline, max_turns_each).await });
    }
    let mut total = 0;
    while let Some(r) = tasks.join_next().await {
        total += r.context("bench worker panicked")??;
    }
    Ok(total)
}
