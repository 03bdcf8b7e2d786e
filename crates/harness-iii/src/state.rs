//! State: `state::*` through the engine, the turn record's fenced slots and leases, the
//! write-ahead copy given back after an engine lost writes, and the write tracker the
//! barrier reads back.

use std::collections::HashMap;
use std::sync::{Arc, MutexGuard};
use std::time::Duration;

use harness_bus::BusError;
use serde_json::{json, Value};

use crate::bus::{IiiBus, Inner};
use crate::calls::Engine;
use crate::codec::{strip_decoration, unwrap_state, wrap_state};
use crate::fence::{self, FENCED_SCOPE};

/// How long a write stays in the write-ahead copy: the engine's flush interval (5 s) with a
/// wide margin for a flush that ran late on a loaded machine.
pub(crate) const JOURNAL_WINDOW: Duration = Duration::from_secs(30);

/// Sessions whose lease epoch a worker keeps in memory (see `IiiBus::lease_epoch`).
const MAX_CACHED_LEASES: usize = 16_384;

/// Which writes of the write-ahead copy [`IiiBus::restore`] gives back.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Restore {
    /// Every one the engine does not hold as written (after a reconnect of this process).
    Everything,
    /// Only what cannot overwrite another worker's newer write (at start-up).
    Lost,
}

type StateKey = (String, String);

/// What this worker knows of its own state writes, under one lock (`Inner::tracker`).
#[derive(Default)]
pub(crate) struct Tracker {
    /// State written since the last barrier, `(scope, key)` → (sequence, value as stored), so
    /// the barrier can read it back.
    written: HashMap<StateKey, (u64, Value)>,
    /// The sequence of the next recorded write.
    next_seq: u64,
    /// State writes sent to the engine whose answer is not back yet, per `(scope, key)`: the
    /// engine may already hold such a value while `written` does not know it yet, so a barrier
    /// reading that key back must not call the difference a loss.
    writing: HashMap<StateKey, usize>,
    /// While barriers run, per running barrier: the lowest sequence in its snapshot.
    floors: Vec<u64>,
    /// While barriers run: `(sequence, (scope, key))` of the writes recorded after their
    /// snapshots were taken. Another task's barrier may drain a newer write of a key from
    /// `written` before this one reads the key back; this log still tells the newer write from
    /// a loss.
    log: Vec<(u64, StateKey)>,
    /// The lease epoch this worker writes each session's turn record under (see `fence`).
    leases: HashMap<String, u64>,
}

impl Tracker {
    /// Forgets every lease epoch (another worker took the sessions over).
    pub(crate) fn forget_leases(&mut self) {
        self.leases.clear();
    }

    /// A barrier whose snapshot started at `floor` ended: the log keeps only what a running
    /// barrier may still need.
    fn barrier_done(&mut self, floor: u64) {
        if let Some(i) = self.floors.iter().position(|f| *f == floor) {
            self.floors.swap_remove(i);
        }
        match self.floors.iter().min().copied() {
            None => self.log.clear(),
            Some(min) => self.log.retain(|(s, _)| *s > min),
        }
    }

    /// A write of `id` is no longer in flight (recorded or failed).
    fn write_done(&mut self, id: &StateKey) {
        if let Some(n) = self.writing.get_mut(id) {
            *n -= 1;
            if *n == 0 {
                self.writing.remove(id);
            }
        }
    }

    /// Whether a write of `id` newer than `seq` was recorded or is still in flight.
    fn newer(&self, id: &StateKey, seq: u64) -> bool {
        self.written.get(id).is_some_and(|(s, _)| *s > seq)
            || self.writing.contains_key(id)
            || self.log.iter().any(|(s, k)| *s > seq && k == id)
    }
}

impl Inner {
    pub(crate) fn tracker(&self) -> MutexGuard<'_, Tracker> {
        self.tracker.lock().expect("tracker lock")
    }
}

/// A barrier in progress (see `Tracker::log`); dropping it prunes the log.
struct BarrierRunning {
    inner: Arc<Inner>,
    floor: u64,
}

impl Drop for BarrierRunning {
    fn drop(&mut self) {
        self.inner.tracker().barrier_done(self.floor);
    }
}

/// Marks a state write in flight until dropped (see `Tracker::writing`).
struct Writing {
    inner: Arc<Inner>,
    id: StateKey,
}

impl Drop for Writing {
    fn drop(&mut self) {
        self.inner.tracker().write_done(&self.id);
    }
}

/// A stored value as the write-ahead copy and the barrier compare it: a fenced turn record by
/// its newest slot (pruning older slots changes nothing), anything else as stored.
fn comparable(scope: &str, stored: Value) -> Value {
    if scope == FENCED_SCOPE {
        return fence::effective(&stored);
    }
    stored
}

impl IiiBus {
    /// Gives the engine back what it lost of the writes in the write-ahead copy. After a
    /// reconnect of this process everything that differs is written again (this worker was
    /// serving, nobody else wrote). At start-up the copy may be older than another worker's
    /// writes (it served the sessions while this one was down): then only a turn-record slot
    /// (which never hides a newer holder's) and a value the engine no longer has at all are
    /// written again.
    pub(crate) async fn restore(&self, what: Restore) -> Result<(), BusError> {
        let writes = self.inner.journal.recent();
        let mut restored = 0;
        for ((scope, key), value) in writes {
            let held = self
                .engine(Engine::StateGet {
                    scope: &scope,
                    key: &key,
                })
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
                self.engine(Engine::StateUpdate(fence::write_request(
                    &scope,
                    &key,
                    epoch,
                    &value["record"],
                )))
                .await?;
            } else if value.is_null() {
                self.engine(Engine::StateDelete {
                    scope: &scope,
                    key: &key,
                })
                .await?;
            } else {
                self.engine(Engine::StateSet {
                    scope: &scope,
                    key: &key,
                    value,
                })
                .await?;
            }
            restored += 1;
        }
        if restored > 0 {
            tracing::warn!(restored, "the iii engine had lost state this worker wrote; written again from the write-ahead copy");
        }
        Ok(())
    }

    // --- the Bus's state -------------------------------------------------------------------

    /// The engine offers no durability point (its file store flushes every 5 s), so this
    /// cannot make anything durable. What it does: read back every state value written through
    /// this bus since the last barrier and fail (`harness/state`) if the engine no longer holds
    /// it, so a checkpoint lost before the side effect (an engine restart between the write and
    /// the dispatch) stops the dispatch. See the crate docs for what remains.
    pub(crate) async fn check_written(&self) -> Result<(), BusError> {
        let (snapshot, _running) = {
            let mut t = self.inner.tracker();
            let snapshot: Vec<(StateKey, (u64, Value))> = t.written.drain().collect();
            let floor = snapshot
                .iter()
                .map(|(_, (s, _))| *s)
                .min()
                .unwrap_or(u64::MAX);
            t.floors.push(floor);
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
                .engine(Engine::StateGet {
                    scope: &scope,
                    key: &key,
                })
                .await?;
            if comparable(&scope, strip_decoration(stored)) == value {
                continue;
            }
            // A newer write of the same key (another task), recorded or still in flight, is not
            // a loss (the newer one is checked by a later barrier).
            let id = (scope.clone(), key.clone());
            let newer = self.inner.tracker().newer(&id, seq);
            if !newer {
                return Err(BusError::new(
                    "harness/state",
                    format!("state {scope}/{key}: the engine lost a write before the durability point (did it restart?)"),
                ));
            }
        }
        Ok(())
    }

    pub(crate) async fn get_state(
        &self,
        scope: &str,
        key: &str,
    ) -> Result<Option<Value>, BusError> {
        let v = self.engine(Engine::StateGet { scope, key }).await?;
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

    pub(crate) async fn set_state(
        &self,
        scope: &str,
        key: &str,
        value: Value,
    ) -> Result<(), BusError> {
        if scope == FENCED_SCOPE {
            return self.fenced_set(key, value).await;
        }
        let stored = wrap_state(key, value);
        let _writing = self.writing(scope, key);
        self.engine(Engine::StateSet {
            scope,
            key,
            value: stored.clone(),
        })
        .await?;
        self.record_write(scope, key, stored);
        Ok(())
    }

    pub(crate) async fn delete_state(&self, scope: &str, key: &str) -> Result<(), BusError> {
        let _writing = self.writing(scope, key);
        self.engine(Engine::StateDelete { scope, key }).await?;
        self.record_write(scope, key, Value::Null);
        Ok(())
    }

    pub(crate) async fn list_state(&self, scope: &str) -> Result<Vec<(String, Value)>, BusError> {
        let v = self.engine(Engine::StateList { scope }).await?;
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

    /// Marks a write of `(scope, key)` in flight; dropped after it was recorded (or failed).
    fn writing(&self, scope: &str, key: &str) -> Writing {
        let id = (scope.to_string(), key.to_string());
        *self.inner.tracker().writing.entry(id.clone()).or_insert(0) += 1;
        Writing {
            inner: self.inner.clone(),
            id,
        }
    }

    fn record_write(&self, scope: &str, key: &str, stored: Value) {
        self.inner.journal.record(scope, key, &stored);
        let id = (scope.to_string(), key.to_string());
        let mut t = self.inner.tracker();
        let seq = t.next_seq;
        t.next_seq += 1;
        t.written.insert(id.clone(), (seq, stored));
        if !t.floors.is_empty() {
            t.log.push((seq, id));
        }
    }

    /// The epoch this worker writes `session_id`'s turn record under: taken once per session
    /// (an atomic increment of its lease row), above every slot the record already holds (a
    /// lease row the engine lost in a crash must not hand out an epoch already used).
    async fn lease_epoch(&self, session_id: &str) -> Result<u64, BusError> {
        let cached = self.inner.tracker().leases.get(session_id).copied();
        if let Some(e) = cached {
            return Ok(e);
        }
        let held = self
            .engine(Engine::StateGet {
                scope: FENCED_SCOPE,
                key: session_id,
            })
            .await?;
        let floor = fence::epochs(&held).last().copied().unwrap_or(0);
        let mut taken = self
            .engine(Engine::StateUpdate(fence::take_lease_request(
                session_id,
                &self.inner.instance,
            )))
            .await?;
        let mut epoch = taken["new_value"]["epoch"].as_u64().unwrap_or(0);
        if epoch <= floor {
            let mut req = fence::take_lease_request(session_id, &self.inner.instance);
            req["ops"][0]["by"] = json!(floor + 1 - epoch);
            taken = self.engine(Engine::StateUpdate(req)).await?;
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
        let mut t = self.inner.tracker();
        let leases = &mut t.leases;
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
            .engine(Engine::StateUpdate(fence::write_request(
                FENCED_SCOPE,
                key,
                epoch,
                &value,
            )))
            .await?;
        let epochs = fence::epochs(&out["new_value"]);
        let newest = epochs.last().copied().unwrap_or(0);
        if newest > epoch {
            self.inner.tracker().leases.remove(key);
            // The refused slot is never read; removing it keeps the value small.
            let _ = self
                .engine(Engine::StateUpdate(fence::prune_request(
                    FENCED_SCOPE,
                    key,
                    &[epoch],
                )))
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
                .engine(Engine::StateUpdate(fence::prune_request(
                    FENCED_SCOPE,
                    key,
                    &older,
                )))
                .await;
        }
        self.record_write(FENCED_SCOPE, key, fence::written(epoch, &value));
        Ok(())
    }
}
