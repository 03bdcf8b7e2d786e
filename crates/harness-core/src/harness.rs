//! The `Harness`: shared state of the loop and its typed bus helpers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use harness_bus::{Bus, BusError, BusWrite, TypedRequest};
use harness_types::api::{TurnStatus, TurnStepPayload};
use harness_types::session::*;
use harness_types::HarnessError;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::config::HarnessConfig;
use crate::context::{Window, WindowState};
use crate::locks::SessionLocks;
use crate::recent;
use crate::record::TurnRecord;
use crate::record_memo::{RecordMemo, Written};
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
    /// Transcripts of recently stepped sessions, so a step reads only what changed since the
    /// last one. A std Mutex: held only to take or put an entry, never across an await.
    pub(crate) transcripts: Mutex<TranscriptCache>,
    /// Turn records as the loop last wrote them, parsed (see `record_memo`). A std Mutex: held
    /// only to copy or put one.
    pub(crate) records: Mutex<RecordMemo>,
    /// The results `Effect::CloseOpenCalls` wrote for a turn's open calls, by turn id, waiting
    /// for the `Effect::Finalize` that always follows it: they are committed in its batch, so
    /// a crash never leaves closed calls in the transcript beside a record that still waits.
    pub(crate) closings: Mutex<HashMap<String, Vec<AppendRequest>>>,
    /// The data directory and configuration files: never grantable (`harness::filesystem::grant`).
    pub(crate) protected: std::sync::RwLock<Vec<std::path::PathBuf>>,
    /// Serializes the read-modify-write of a grants row.
    pub(crate) grants_lock: tokio::sync::Mutex<()>,
    /// Span export and metrics (`crate::trace`); set once before the runtime serves.
    pub(crate) telemetry: std::sync::OnceLock<crate::trace::Telemetry>,
}

/// The append of a custom entry `entry_id` that turn `rec` writes.
pub(crate) fn custom_append(
    rec: &TurnRecord,
    entry_id: String,
    custom_type: &str,
    data: Value,
) -> AppendRequest {
    AppendRequest {
        session_id: rec.session_id.clone(),
        message: None,
        custom: Some(CustomEntry {
            custom_type: custom_type.to_string(),
            data,
        }),
        entry_id: Some(entry_id),
        origin: Some(serde_json::json!({ "turn_id": rec.turn_id })),
    }
}

/// Sessions whose transcript stays in memory; the least recently read goes first. Enough for
/// every session a busy process steps at once, small enough that idle sessions cost nothing.
const TRANSCRIPT_CACHE_SESSIONS: usize = 256;

/// Per-session copies of the transcript with the change mark they are current to (see
/// `session::changes`). A copy is only ever a speed-up: a reader that misses it reads the
/// whole transcript, and every reader asks the store what changed, so a copy is never served
/// stale, even when another process or a direct `session::*` call wrote the session.
#[derive(Default)]
pub(crate) struct TranscriptCache {
    sessions: HashMap<String, CachedTranscript>,
    clock: u64,
}

pub(crate) struct CachedTranscript {
    pub(crate) mark: i64,
    pub(crate) entries: Arc<Vec<Entry>>,
    /// The window of the last step and the lowest entry index changed since it was built.
    window: Option<WindowState>,
    pub(crate) dirty_from: usize,
    used: u64,
}

impl CachedTranscript {
    pub(crate) fn new(mark: Option<i64>, entries: Arc<Vec<Entry>>) -> CachedTranscript {
        CachedTranscript {
            mark: mark.unwrap_or(i64::MIN),
            entries,
            window: None,
            dirty_from: 0,
            used: 0,
        }
    }
}

impl TranscriptCache {
    /// Takes the session's copy out, so the reader extends it in place (no copy of the history)
    /// while a concurrent reader of the same session, rare under the session lock, reads afresh.
    pub(crate) fn take(&mut self, session_id: &str) -> Option<CachedTranscript> {
        self.sessions.remove(session_id)
    }

    pub(crate) fn put(&mut self, session_id: &str, mut cached: CachedTranscript) {
        self.clock += 1;
        if let Some(old) = self.sessions.get(session_id) {
            if old.mark >= cached.mark {
                return;
            }
        }
        recent::make_room(
            &mut self.sessions,
            session_id,
            TRANSCRIPT_CACHE_SESSIONS,
            |c| c.used,
        );
        cached.used = self.clock;
        self.sessions.insert(session_id.to_string(), cached);
    }

    /// The window over `entries` when they are this cache's current copy of the session (the
    /// kept window brought up to date), or `None` to build one from scratch.
    pub(crate) fn window(
        &mut self,
        session_id: &str,
        entries: &Arc<Vec<Entry>>,
        watermark: Option<&str>,
    ) -> Option<Window> {
        let c = self.sessions.get_mut(session_id)?;
        if !Arc::ptr_eq(&c.entries, entries) {
            return None;
        }
        let state = match c.window.as_mut() {
            Some(state) => {
                state.update(entries, c.dirty_from);
                state
            }
            None => c.window.insert(WindowState::build(entries)),
        };
        c.dirty_from = entries.len();
        Some(state.window(entries, watermark))
    }
}

/// A step's writes, collected in order and applied by [`Harness::commit`] as one batch. Each
/// builder mirrors the one-shot helper of the same name, with the same ids and payloads, so a
/// replayed step writes the same thing either way.
#[derive(Clone, Default)]
pub(crate) struct StepWrites {
    writes: Vec<BusWrite>,
    /// The records these writes save, for the memo once they are committed.
    records: Vec<Written>,
    /// How many of the first writes stay at the head when the finalizer puts steering rows
    /// first (see [`StepWrites::split_head`]).
    head: usize,
    /// Crash failpoints reached once these writes are committed: a write joined to a later
    /// batch reaches its failpoint when it is durable, wherever that is.
    after: Vec<&'static str>,
}

#[allow(dead_code)] // The step shell adopts these as it moves to one batch per step.
impl StepWrites {
    pub(crate) fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }

    /// Puts `later`'s writes after these. A head stays one: `later`'s joins it only when
    /// every write here is head.
    pub(crate) fn extend(&mut self, later: StepWrites) {
        if self.head == self.writes.len() {
            self.head += later.head;
        }
        self.writes.extend(later.writes);
        self.records.extend(later.records);
        self.after.extend(later.after);
    }

    /// Whether a turn record is among these writes.
    pub(crate) fn saves_record(&self) -> bool {
        self.writes
            .iter()
            .any(|w| matches!(w, BusWrite::StateSetText { scope, .. } if scope == TURN_SCOPE))
    }

    /// Makes every write so far head: writes that were due before anything a later batch may
    /// put first (the step's pre-appended assistant entry, ahead of steering rows the
    /// finalizer delivers).
    pub(crate) fn mark_head(&mut self) {
        self.head = self.writes.len();
    }

    /// Splits off the head: `(head, rest)`, the failpoints and records going with the rest
    /// (they are reached once the whole batch is committed).
    pub(crate) fn split_head(mut self) -> (StepWrites, StepWrites) {
        let rest = self.writes.split_off(self.head);
        let head = StepWrites {
            writes: std::mem::take(&mut self.writes),
            head: self.head,
            ..StepWrites::default()
        };
        self.writes = rest;
        self.head = 0;
        (head, self)
    }

    /// Reaches failpoint `point` once these writes are committed.
    pub(crate) fn fail_after(&mut self, point: &'static str) {
        self.after.push(point);
    }

    /// Typed: the embedded bus hands the request to the transcript store as it is; another bus
    /// serialises it.
    fn call<Req: Serialize + Send + Sync + 'static>(&mut self, function_id: &str, req: Req) {
        self.writes.push(BusWrite::Typed {
            function_id: function_id.to_string(),
            request: TypedRequest::new(req),
        });
    }

    /// As [`Harness::append`].
    pub(crate) fn append(&mut self, req: AppendRequest) -> Result<()> {
        self.call("session::append", req);
        Ok(())
    }

    /// A custom entry of turn `rec` (see [`custom_append`]).
    pub(crate) fn append_custom(
        &mut self,
        rec: &TurnRecord,
        entry_id: String,
        custom_type: &str,
        data: Value,
    ) -> Result<()> {
        self.append(custom_append(rec, entry_id, custom_type, data))
    }

    /// As the `session::update-message` call of the stream's last write.
    pub(crate) fn update_message(&mut self, req: UpdateMessageRequest) -> Result<()> {
        self.call("session::update-message", req);
        Ok(())
    }

    /// As [`Harness::set_status`].
    pub(crate) fn set_status(
        &mut self,
        session_id: &str,
        status: SessionStatus,
        reason: Option<&str>,
    ) -> Result<()> {
        self.call(
            "session::set-status",
            SetStatusRequest {
                session_id: session_id.to_string(),
                status,
                reason: reason.map(str::to_string),
            },
        );
        Ok(())
    }

    /// As [`Harness::save_record`] (stamps `updated_at` the same way).
    pub(crate) fn save_record(&mut self, rec: &mut TurnRecord) -> Result<()> {
        rec.updated_at = harness_types::now_ms();
        let text = record_text(rec)?;
        self.records.push(Written::of(rec, &text));
        self.writes.push(BusWrite::StateSetText {
            scope: TURN_SCOPE.to_string(),
            key: rec.session_id.clone(),
            text,
        });
        Ok(())
    }

    /// A batch of just the step.
    pub(crate) fn step(rec: &TurnRecord) -> Result<StepWrites> {
        let mut batch = StepWrites::default();
        batch.enqueue_step(rec)?;
        Ok(batch)
    }

    /// The turn's current step, queued (`harness::turn`).
    pub(crate) fn enqueue_step(&mut self, rec: &TurnRecord) -> Result<()> {
        let payload = serde_json::to_value(step_payload(rec))
            .map_err(|e| HarnessError::internal(e.to_string()))?;
        self.writes.push(BusWrite::Enqueue {
            queue: TURN_QUEUE.to_string(),
            function_id: "harness::turn".to_string(),
            payload,
        });
        Ok(())
    }

    /// As `Bus::state_delete`.
    pub(crate) fn state_delete(&mut self, scope: String, key: String) {
        self.writes.push(BusWrite::StateDelete { scope, key });
    }

    /// As `Bus::publish`: an event, deduplicated by `dedupe_key`.
    pub(crate) fn publish(&mut self, topic: &str, payload: Value, dedupe_key: Option<String>) {
        self.writes.push(BusWrite::Publish {
            topic: topic.to_string(),
            payload,
            dedupe_key,
        });
    }
}

fn step_payload(rec: &TurnRecord) -> TurnStepPayload {
    TurnStepPayload {
        session_id: rec.session_id.clone(),
        turn_id: rec.turn_id.clone(),
        step: rec.step,
        message_preview: rec.message_preview.clone(),
        depth: rec.depth,
    }
}

pub(crate) type Result<T> = std::result::Result<T, HarnessError>;

/// How many times [`Harness::commit_scheduling`] tries, and the pause between tries (about
/// 2.5 s in all).
const SCHEDULE_ATTEMPTS: u32 = 6;
const SCHEDULE_PAUSE: Duration = Duration::from_millis(500);

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
                transcripts: Mutex::new(TranscriptCache::default()),
                records: Mutex::new(RecordMemo::default()),
                closings: Mutex::new(HashMap::new()),
                protected: std::sync::RwLock::new(Vec::new()),
                grants_lock: tokio::sync::Mutex::new(()),
                telemetry: std::sync::OnceLock::new(),
            }),
        }
    }

    /// Paths no filesystem grant may reach (the data directory, configuration files); kept
    /// canonical where they exist.
    pub fn set_protected_paths(&self, paths: impl IntoIterator<Item = std::path::PathBuf>) {
        let paths = paths
            .into_iter()
            .filter(|p| p.is_absolute())
            .map(|p| std::fs::canonicalize(&p).unwrap_or(p))
            .collect();
        *self.inner.protected.write().expect("protected lock") = paths;
    }

    pub(crate) fn protected_paths(&self) -> Vec<std::path::PathBuf> {
        self.inner.protected.read().expect("protected lock").clone()
    }

    /// Installs span export and metrics; the first call wins (a runtime installs them once,
    /// before it serves).
    pub fn set_telemetry(&self, telemetry: crate::trace::Telemetry) {
        let _ = self.inner.telemetry.set(telemetry);
    }

    pub(crate) fn telemetry(&self) -> Option<&crate::trace::Telemetry> {
        self.inner.telemetry.get()
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

    // --- typed bus helpers ---------------------------------------------------------------

    pub(crate) fn session_timeout(&self) -> Option<Duration> {
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

    /// The values of `scope` with their keys.
    pub(crate) async fn state_list(&self, scope: &str) -> Result<Vec<(String, Value)>> {
        self.inner.bus.state_list(scope).await.map_err(bus_err)
    }

    /// The state value under `scope` / `key`, if any.
    pub(crate) async fn state_get(&self, scope: &str, key: &str) -> Result<Option<Value>> {
        self.inner.bus.state_get(scope, key).await.map_err(bus_err)
    }

    pub(crate) async fn load_record(&self, session_id: &str) -> Result<Option<TurnRecord>> {
        // As text, parsed straight into the record: the record is written as text too (see
        // `record_text`), and the store's cache hands over its own copy of that text. The text
        // the loop last wrote is not parsed again (see `record_memo`).
        let Some(text) = self.stored_record(session_id).await? else {
            return Ok(None);
        };
        let memo = self.records().get(session_id, &text);
        if let Some(rec) = memo {
            debug_assert_eq!(
                serde_json::from_str::<TurnRecord>(&text).ok().as_ref(),
                Some(&rec),
                "a memoized record reads back equal to its text"
            );
            return Ok(Some(rec));
        }
        parse_record(session_id, &text).map(Some)
    }

    /// The status of a session's turn record, without reading the rest of it: a send asks
    /// whether a turn runs before anything else, and an ended turn's record is not memoized.
    pub(crate) async fn record_status(&self, session_id: &str) -> Result<Option<TurnStatus>> {
        #[derive(serde::Deserialize)]
        struct StatusOnly {
            status: TurnStatus,
        }
        let Some(text) = self.stored_record(session_id).await? else {
            return Ok(None);
        };
        if let Some(status) = self.records().status(session_id, &text) {
            return Ok(Some(status));
        }
        match serde_json::from_str::<StatusOnly>(&text) {
            Ok(s) => Ok(Some(s.status)),
            // The whole read says what is wrong with it.
            Err(_) => parse_record(session_id, &text).map(|r| Some(r.status)),
        }
    }

    /// A session's turn record as the store holds it.
    async fn stored_record(&self, session_id: &str) -> Result<Option<Arc<str>>> {
        self.inner
            .bus
            .state_get_text(TURN_SCOPE, session_id)
            .await
            .map_err(bus_err)
    }

    pub(crate) async fn save_record(&self, rec: &mut TurnRecord) -> Result<()> {
        rec.updated_at = harness_types::now_ms();
        let text = record_text(rec)?;
        let written = Written::of(rec, &text);
        self.inner
            .bus
            .state_set_text(TURN_SCOPE, &rec.session_id, text)
            .await
            .map_err(bus_err)?;
        self.remember([written]);
        Ok(())
    }

    fn records(&self) -> std::sync::MutexGuard<'_, RecordMemo> {
        self.inner.records.lock().expect("record memo lock")
    }

    /// Puts records the store now holds into the memo.
    fn remember(&self, written: impl IntoIterator<Item = Written>) {
        let mut memo = self.records();
        for w in written {
            memo.put(w);
        }
    }

    /// Commits `first`, a batch that schedules a turn's next step, retrying with the batch
    /// `again` builds: a store or queue that refuses for a moment (a busy disk, an engine
    /// restarting) must not leave the turn waiting for the next start. Every write of such a
    /// batch is idempotent by its id (the record is written whole, entries by id, a second
    /// copy of a step is dropped as stale), so a retry after a batch a bus without transactions
    /// applied in part writes nothing twice. The one retry policy of the loop's scheduling.
    pub(crate) async fn commit_scheduling(
        &self,
        session_id: &str,
        first: StepWrites,
        mut again: impl FnMut() -> Result<StepWrites>,
    ) -> Result<()> {
        let mut batch = first;
        let mut attempt = 1;
        loop {
            match self.commit(batch).await {
                Ok(_) => return Ok(()),
                Err(e) if attempt < SCHEDULE_ATTEMPTS => {
                    tracing::warn!(session = %session_id, attempt, "a turn's next step could not be written, retrying: {e}");
                    tokio::time::sleep(SCHEDULE_PAUSE).await;
                    attempt += 1;
                    batch = again()?;
                }
                Err(e) => {
                    tracing::error!(session = %session_id, attempt, "a turn's next step could not be written, giving up: {e}");
                    return Err(e);
                }
            }
        }
    }

    /// Applies a step's writes as one batch: on the embedded bus one transaction (all or
    /// nothing), elsewhere one write after another in order (see `Bus::commit`). Not durable
    /// on its own: the queue's ack barrier (or an explicit [`Harness::barrier`]) is the fsync.
    pub(crate) async fn commit(&self, writes: StepWrites) -> Result<Vec<Value>> {
        if writes.writes.is_empty() {
            return Ok(Vec::new());
        }
        let answers = self
            .inner
            .bus
            .commit(writes.writes)
            .await
            .map_err(bus_err)?;
        self.remember(writes.records);
        for point in writes.after {
            crate::failpoint::hit(point);
        }
        Ok(answers)
    }

    pub(crate) async fn barrier(&self) -> Result<()> {
        self.inner.bus.barrier().await.map_err(bus_err)
    }

    pub(crate) async fn append(&self, req: AppendRequest) -> Result<AppendResponse> {
        self.call("session::append", &req).await
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

/// A turn record from the text the store keeps, parsed straight into the struct.
fn parse_record(session_id: &str, text: &str) -> Result<TurnRecord> {
    serde_json::from_str::<TurnRecord>(text).map_err(|e| {
        HarnessError::state(format!("turn record of '{session_id}' is unreadable: {e}"))
    })
}

/// The turn record as the JSON text the store keeps, serialised straight from the struct: it is
/// written two or three times a step, and a `Value` tree in between cost more than the text.
fn record_text(rec: &TurnRecord) -> Result<String> {
    serde_json::to_string(rec).map_err(|e| HarnessError::internal(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transcript::tests::entry;

    #[test]
    fn the_cache_keeps_the_newest_copy_and_drops_the_least_recently_read() {
        let mut cache = TranscriptCache::default();
        let copy =
            |mark: i64, entries: Vec<Entry>| CachedTranscript::new(Some(mark), Arc::new(entries));
        cache.put("a", copy(5, vec![entry(1, 0)]));
        // An older read finishing late never replaces a newer copy.
        cache.put("a", copy(3, Vec::new()));
        let c = cache.take("a").unwrap();
        assert_eq!((c.mark, c.entries.len()), (5, 1));
        assert!(cache.take("a").is_none(), "taken out while being extended");
        for i in 0..TRANSCRIPT_CACHE_SESSIONS + 1 {
            cache.put(&format!("s{i}"), copy(1, Vec::new()));
        }
        assert_eq!(cache.sessions.len(), TRANSCRIPT_CACHE_SESSIONS);
        assert!(
            cache.take("s0").is_none(),
            "the least recently read went first"
        );
        assert!(cache
            .take(&format!("s{TRANSCRIPT_CACHE_SESSIONS}"))
            .is_some());
    }
}
