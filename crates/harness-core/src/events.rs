//! The turn events: recorded on the bus's event log (deduplicated, so a redelivered finalizer
//! records them once) and fanned out to the bindings whose filter matches.

use harness_types::api::{TurnCompletedEvent, TurnEventFilter, TurnStartedEvent};
use serde_json::Value;

use crate::harness::{Harness, Result};
use crate::topics;

/// State scope of the events already fanned out to bindings, by the event's dedupe key.
const FANOUT_SCOPE: &str = "harness_fanout";

/// An event to deliver: its topic, the key that makes a repeat a no-op, its payload.
pub(crate) struct Event {
    pub topic: &'static str,
    pub dedupe_key: String,
    pub payload: Value,
}

/// Which bindings of its topic an event goes to, by their config.
pub(crate) type Admits<'a> = &'a (dyn Fn(&Value) -> bool + Sync);

/// Whether a binding's filter admits an event of `session_id` with this parent.
fn admits(config: &Value, session_id: &str, parent_session_id: Option<&str>) -> bool {
    let filter: TurnEventFilter = match serde_json::from_value(config.clone()) {
        Ok(f) => f,
        Err(_) => return false,
    };
    filter.session_id.as_deref().is_none_or(|s| s == session_id)
        && filter
            .parent_session_id
            .as_deref()
            .is_none_or(|p| Some(p) == parent_session_id)
}

impl Harness {
    /// Records an event and delivers it to the bindings of `topic` whose config `admits` it.
    pub(crate) async fn emit_filtered(&self, ev: Event, admits: Admits<'_>) -> Result<()> {
        self.inner
            .bus
            .publish(ev.topic, ev.payload.clone(), Some(ev.dedupe_key.clone()))
            .await
            .map_err(|e| e.into_harness())?;
        self.fan_out(ev, admits).await
    }

    /// Whether anything is bound to `topic` (an unreadable list counts as bound).
    pub(crate) async fn has_bindings(&self, topic: &str) -> bool {
        self.inner
            .bus
            .bindings(topic)
            .await
            .map_or(true, |b| !b.is_empty())
    }

    /// The deliveries of an event already recorded (for instance in a step's batch): to the
    /// bindings of its topic whose config `admits` it, once per dedupe key.
    pub(crate) async fn fan_out(&self, ev: Event, admits: Admits<'_>) -> Result<()> {
        let Event {
            topic,
            dedupe_key,
            payload,
        } = ev;
        self.fan_out_with(topic, admits, || (dedupe_key, payload))
            .await
    }

    /// [`Harness::fan_out`] with the event's dedupe key and payload built only when a binding
    /// admits it: most events have no binding, and then nothing is serialised for one.
    async fn fan_out_with(
        &self,
        topic: &'static str,
        admits: Admits<'_>,
        event: impl FnOnce() -> (String, Value),
    ) -> Result<()> {
        let bindings = match self.inner.bus.bindings(topic).await {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(topic, "cannot list bindings: {e}");
                return Ok(());
            }
        };
        let admitted: Vec<_> = bindings.into_iter().filter(|b| admits(&b.config)).collect();
        if admitted.is_empty() {
            return Ok(());
        }
        let (dedupe_key, payload) = event();
        // The event log deduplicates a republished event; the fan-out must too: a step
        // redelivered after a crash re-runs the terminal side effects, and a binding must still
        // see one event per turn. The mark is written before the deliveries (which are
        // fire-and-forget anyway), so a crash in between loses a delivery rather than doubling it.
        let bus = &self.inner.bus;
        if self.state_get(FANOUT_SCOPE, &dedupe_key).await?.is_some() {
            return Ok(());
        }
        bus.state_set(
            FANOUT_SCOPE,
            &dedupe_key,
            serde_json::json!({"at": harness_types::now_ms()}),
        )
        .await
        .map_err(|e| e.into_harness())?;
        for b in admitted {
            bus.call_void(&b.function_id, payload.clone()).await;
        }
        Ok(())
    }

    /// Deletes fan-out marks older than `older_than_ms`: a step redelivered that late is long
    /// gone, and the event log keeps its own dedupe. Returns how many went.
    pub(crate) async fn prune_fanout(&self, older_than_ms: i64) -> Result<usize> {
        let cutoff = harness_types::now_ms().saturating_sub(older_than_ms);
        let bus = &self.inner.bus;
        let mut pruned = 0;
        for (key, v) in bus
            .state_list(FANOUT_SCOPE)
            .await
            .map_err(|e| e.into_harness())?
        {
            if v.get("at")
                .and_then(Value::as_i64)
                .is_none_or(|at| at <= cutoff)
            {
                bus.state_delete(FANOUT_SCOPE, &key)
                    .await
                    .map_err(|e| e.into_harness())?;
                pruned += 1;
            }
        }
        Ok(pruned)
    }

    /// A turn event as a write of `batch`, deduplicated by topic and turn; the fan-out runs once
    /// the batch is committed ([`Harness::fan_out_turn_event`]).
    pub(crate) fn record_turn_event<E: TurnEvent>(
        &self,
        batch: &mut crate::harness::StepWrites,
        ev: &E,
    ) {
        let payload = serde_json::to_value(ev).unwrap_or(Value::Null);
        batch.publish(E::TOPIC, payload, Some(ev.dedupe_key()));
    }

    /// The deliveries of a turn event recorded by [`Harness::record_turn_event`].
    pub(crate) async fn fan_out_turn_event<E: TurnEvent>(&self, ev: E) -> Result<()> {
        let session_id = ev.session_id().to_string();
        let parent = ev.parent_session_id().map(str::to_string);
        let filter = |config: &Value| admits(config, &session_id, parent.as_deref());
        self.fan_out_with(E::TOPIC, &filter, || {
            let key = ev.dedupe_key();
            (key, serde_json::to_value(ev).unwrap_or(Value::Null))
        })
        .await
    }
}

/// `harness::turn-started` and `harness::turn-completed`: one per turn, filtered by session and
/// parent.
pub(crate) trait TurnEvent: serde::Serialize {
    const TOPIC: &'static str;
    fn turn_id(&self) -> &str;
    fn session_id(&self) -> &str;
    fn parent_session_id(&self) -> Option<&str>;

    fn dedupe_key(&self) -> String {
        format!("{}:{}", Self::TOPIC, self.turn_id())
    }
}

/// The two turn events carry the same identity fields; the parent session is read from the
/// lineage first, then from the older flat field.
macro_rules! turn_event {
    ($event:ty, $topic:expr) => {
        impl TurnEvent for $event {
            const TOPIC: &'static str = $topic;
            fn turn_id(&self) -> &str {
                &self.turn_id
            }
            fn session_id(&self) -> &str {
                &self.session_id
            }
            fn parent_session_id(&self) -> Option<&str> {
                self.parent
                    .as_ref()
                    .map(|p| p.session_id.as_str())
                    .or(self.parent_session_id.as_deref())
            }
        }
    };
}

turn_event!(TurnStartedEvent, topics::TURN_STARTED);
turn_event!(TurnCompletedEvent, topics::TURN_COMPLETED);

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn filters_match_session_and_parent() {
        assert!(admits(&json!({}), "s", None));
        assert!(admits(&json!({"session_id": "s"}), "s", None));
        assert!(!admits(&json!({"session_id": "x"}), "s", None));
        assert!(admits(&json!({"parent_session_id": "p"}), "s", Some("p")));
        assert!(!admits(&json!({"parent_session_id": "p"}), "s", None));
        assert!(!admits(&json!({"bogus": 1}), "s", None));
    }
}
