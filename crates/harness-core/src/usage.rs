//! Anonymous usage announcements on the durable `harness:usage` topic.
//!
//! A root session announces `harness_session_progress` when it completes its 1st, 2nd, 5th,
//! 10th, 25th and 50th root turn (with the `harness::metrics` totals of its tree at that
//! moment), and `harness_turn_failed` the first time one of its root turns ends `failed`,
//! `cancelled` or `max_turns` (once per outcome): at most 9 messages per session. Sub-agents
//! announce nothing of their own; their counts reach their root's totals.
//!
//! The payload is a closed struct ([`Announcement`]): model and provider names, counters and a
//! fixed failure class; never a session or turn id, message text, prompt, path or function id.
//! Root turns are counted from the session's transcript (in memory), so a turn with nothing to
//! announce costs one cached state read and writes nothing. The `harness_usage` row of a session
//! (milestones and outcomes announced) and the publish go in one `Bus::commit`: on the embedded
//! bus one transaction, so a crash neither repeats nor loses one (a redelivered step that finds
//! its record terminal runs this again, and the row knows what was announced); on a bus without
//! transactions the row is written first, then the publish (at most once). The totals are read
//! (`harness::metrics`, which lists the sessions) only for an announcement: at most 9 times per
//! session. Best effort: a failure is logged at debug and the turn goes on.
//!
//! Off with `usage_reporting: false`, `III_TELEMETRY_ENABLED=false|0` or
//! `HARNESS_TELEMETRY_ENABLED=false|0`: nothing is published or recorded and no row written.

use harness_bus::BusWrite;
use harness_types::api::{MetricsRequest, TurnStatus};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::harness::{Harness, Result};
use crate::record::{TurnRecord, TurnStopReason};

/// The durable topic the announcements go to.
pub const USAGE_TOPIC: &str = "harness:usage";
/// Per root session: what was counted and announced.
pub const USAGE_SCOPE: &str = "harness_usage";
/// The announcements as published, for `harness::usage::list` (an operator's audit).
pub const USAGE_LOG_SCOPE: &str = "harness_usage_log";

const MILESTONES: [u32; 6] = [1, 2, 5, 10, 25, 50];

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
struct UsageRow {
    /// Milestones announced.
    #[serde(default)]
    milestones: Vec<u32>,
    #[serde(default)]
    outcomes: Vec<String>,
}

/// One announcement: every field is listed here, nothing else can appear.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Announcement {
    /// `harness_session_progress` or `harness_turn_failed`.
    pub event: String,
    pub harness_version: String,
    pub provider: String,
    /// The model id (at most 64 characters).
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub milestone: Option<u32>,
    /// `failed`, `cancelled` or `max_turns`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<String>,
    /// The `reason` label of `harness_turns_completed_total`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_class: Option<String>,
    pub totals: UsageTotals,
    pub timestamp: i64,
}

/// The `harness::metrics` totals of the session's tree.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UsageTotals {
    pub turns: u64,
    pub function_calls: u64,
    pub function_call_errors: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cost_usd: f64,
}

/// `harness::usage::list`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UsageListRequest {}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct UsageListResponse {
    /// Oldest first.
    pub announcements: Vec<Announcement>,
}

fn switched_off(var: &str) -> bool {
    std::env::var(var)
        .map(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "false" | "0"))
        .unwrap_or(false)
}

/// Whether announcements are made at all (the config key and both opt-out variables).
pub fn enabled(usage_reporting: bool) -> bool {
    usage_reporting
        && !switched_off("III_TELEMETRY_ENABLED")
        && !switched_off("HARNESS_TELEMETRY_ENABLED")
}

fn outcome_of(rec: &TurnRecord) -> Option<&'static str> {
    match rec.status {
        TurnStatus::Failed => Some("failed"),
        TurnStatus::Cancelled => Some("cancelled"),
        _ if rec.stop_reason == Some(TurnStopReason::MaxTurns) => Some("max_turns"),
        _ => None,
    }
}

impl Harness {
    /// After a root turn's terminal write. Never fails the turn.
    pub(crate) async fn announce_usage(
        &self,
        rec: &TurnRecord,
        transcript: &mut crate::transcript::TranscriptOnce,
    ) {
        if rec.depth != 0 || rec.parent.is_some() || !enabled(self.config().usage_reporting) {
            return;
        }
        if let Err(e) = self.try_announce(rec, transcript).await {
            tracing::debug!(session = %rec.session_id, "usage announcement skipped: {e}");
        }
    }

    async fn try_announce(
        &self,
        rec: &TurnRecord,
        transcript: &mut crate::transcript::TranscriptOnce,
    ) -> Result<()> {
        let bus = &self.inner.bus;
        let mut row: UsageRow = match self.state_get(USAGE_SCOPE, &rec.session_id).await? {
            Some(v) => serde_json::from_value(v).unwrap_or_default(),
            None => UsageRow::default(),
        };
        let last = MILESTONES[MILESTONES.len() - 1];
        let mut events: Vec<(&'static str, Option<u32>, Option<&'static str>)> = Vec::new();
        if !row.milestones.contains(&last) {
            // The root turns so far, this one included, read from the transcript (in memory):
            // the same count however often a redelivered finalize asks.
            let turns = root_turns(&transcript.get(self, &rec.session_id).await?);
            if MILESTONES.contains(&turns) && !row.milestones.contains(&turns) {
                row.milestones.push(turns);
                events.push(("harness_session_progress", Some(turns), None));
            }
        }
        if let Some(o) = outcome_of(rec) {
            if !row.outcomes.iter().any(|x| x == o) {
                row.outcomes.push(o.to_string());
                events.push(("harness_turn_failed", None, Some(o)));
            }
        }
        // Nothing to announce: nothing is written (most root turns end here).
        if events.is_empty() {
            return Ok(());
        }
        let mut writes = vec![BusWrite::StateSet {
            scope: USAGE_SCOPE.into(),
            key: rec.session_id.clone(),
            value: serde_json::to_value(&row).map_err(internal)?,
        }];
        {
            let entries = transcript.get(self, &rec.session_id).await?;
            // A session that never spawned is its whole tree: its own transcript answers,
            // without `harness::metrics`, which lists every session to find a tree.
            let totals = if spawned(&entries) {
                let m = self
                    .metrics(MetricsRequest {
                        root_session_id: rec.session_id.clone(),
                    })
                    .await?
                    .totals
                    .counters;
                UsageTotals {
                    turns: m.turns,
                    function_calls: m.function_calls,
                    function_call_errors: m.function_call_errors,
                    input_tokens: m.input_tokens.unwrap_or(0),
                    output_tokens: m.output_tokens.unwrap_or(0),
                    cost_usd: m.cost_usd.unwrap_or(0.0),
                }
            } else {
                own_totals(&entries)
            };
            let now = harness_types::now_ms();
            for (event, milestone, outcome) in &events {
                let a = Announcement {
                    event: event.to_string(),
                    harness_version: env!("CARGO_PKG_VERSION").into(),
                    provider: rec.options.provider.clone().unwrap_or_default(),
                    model: rec.options.model.chars().take(64).collect(),
                    milestone: *milestone,
                    outcome: outcome.map(str::to_string),
                    failure_class: outcome.map(|_| crate::trace::reason_of(rec).to_string()),
                    totals: totals.clone(),
                    timestamp: now,
                };
                let payload = serde_json::to_value(&a).map_err(internal)?;
                let what = milestone
                    .map(|m| m.to_string())
                    .or(outcome.map(str::to_string))
                    .unwrap_or_default();
                let key = format!("{}/{event}/{what}", rec.session_id);
                writes.push(BusWrite::StateSet {
                    scope: USAGE_LOG_SCOPE.into(),
                    key: format!("{now:016}/{key}"),
                    value: payload.clone(),
                });
                writes.push(BusWrite::Publish {
                    topic: USAGE_TOPIC.into(),
                    payload,
                    dedupe_key: Some(format!("usage/{key}")),
                });
            }
        }
        bus.commit(writes).await.map_err(|e| e.into_harness())?;
        if let Some(o) = self.telemetry().and_then(|t| t.observer.as_ref()) {
            for (event, _, _) in &events {
                o.usage_announced(event);
            }
        }
        Ok(())
    }

    /// `harness::usage::list`: every announcement recorded here, oldest first.
    pub async fn usage_list(&self, _req: UsageListRequest) -> Result<UsageListResponse> {
        let mut rows = self.state_list(USAGE_LOG_SCOPE).await?;
        rows.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(UsageListResponse {
            announcements: rows
                .into_iter()
                .filter_map(|(_, v): (String, Value)| serde_json::from_value(v).ok())
                .collect(),
        })
    }
}

/// Turns of a session that reached its transcript (each wrote at least its message), by the
/// turn id their entries carry.
fn root_turns(entries: &[harness_types::session::Entry]) -> u32 {
    let mut seen = std::collections::HashSet::new();
    for e in entries {
        if !matches!(
            e.message,
            Some(harness_types::message::AgentMessage::User(_))
                | Some(harness_types::message::AgentMessage::Assistant(_))
        ) {
            continue;
        }
        if let Some(t) = e
            .origin
            .as_ref()
            .and_then(|o| o.get("turn_id"))
            .and_then(Value::as_str)
        {
            seen.insert(t);
        }
    }
    seen.len() as u32
}

/// Whether the session's model ever called `harness::spawn` (natively or through
/// `agent_trigger`): then it may have sub-agents.
fn spawned(entries: &[harness_types::session::Entry]) -> bool {
    use harness_types::message::{AgentMessage, ContentBlock};
    entries.iter().any(|e| match &e.message {
        Some(AgentMessage::Assistant(m)) => m.content.iter().any(|b| {
            matches!(b, ContentBlock::FunctionCall { function_id, arguments, .. }
                if function_id == "harness::spawn"
                    || arguments.get("function_id").and_then(Value::as_str) == Some("harness::spawn"))
        }),
        _ => false,
    })
}

/// How many function calls an assistant message makes: what the metrics count per turn.
pub(crate) fn calls_made(a: &harness_types::message::AssistantMessage) -> u64 {
    use harness_types::message::ContentBlock;
    a.content
        .iter()
        .filter(|b| matches!(b, ContentBlock::FunctionCall { .. }))
        .count() as u64
}

/// The `harness::metrics` counters of one session, from its transcript: each assistant message
/// a turn, its function calls, the `is_error` results; a token or cost sum only when every
/// observation reported it (else 0, as `harness::metrics` answers none), a compaction's
/// summary included.
fn own_totals(entries: &[harness_types::session::Entry]) -> UsageTotals {
    use harness_types::message::{AgentMessage, Usage};
    let mut t = UsageTotals::default();
    let (mut input, mut output, mut cost) = (Some(0u64), Some(0u64), Some(0f64));
    let add =
        |u: &Usage, input: &mut Option<u64>, output: &mut Option<u64>, cost: &mut Option<f64>| {
            *input = input.zip(u.input).map(|(a, b)| a + b);
            *output = output.zip(u.output).map(|(a, b)| a + b);
            *cost = cost.zip(u.cost_usd).map(|(a, b)| a + b);
        };
    for e in entries {
        match &e.message {
            Some(AgentMessage::Assistant(a)) => {
                t.turns += 1;
                t.function_calls += calls_made(a);
                add(
                    &a.usage.clone().unwrap_or_default(),
                    &mut input,
                    &mut output,
                    &mut cost,
                );
            }
            Some(AgentMessage::FunctionResult(r)) if r.is_error => t.function_call_errors += 1,
            None => {
                let usage = e
                    .custom
                    .as_ref()
                    .filter(|c| c.custom_type == harness_types::context::COMPACTION_ENTRY)
                    .and_then(|c| c.data.get("usage"))
                    .and_then(|u| serde_json::from_value::<Usage>(u.clone()).ok());
                if let Some(u) = usage {
                    add(&u, &mut input, &mut output, &mut cost);
                }
            }
            _ => {}
        }
    }
    t.input_tokens = input.unwrap_or(0);
    t.output_tokens = output.unwrap_or(0);
    t.cost_usd = cost.unwrap_or(0.0);
    t
}

fn internal(e: serde_json::Error) -> harness_types::HarnessError {
    harness_types::HarnessError::internal(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_announcement_has_no_room_for_ids_or_text() {
        let a = Announcement {
            event: "harness_session_progress".into(),
            harness_version: "0.1.0".into(),
            provider: "scripted".into(),
            model: "demo".into(),
            milestone: Some(1),
            outcome: None,
            failure_class: None,
            totals: UsageTotals::default(),
            timestamp: 1,
        };
        let mut v = serde_json::to_value(&a).unwrap();
        let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
        assert_eq!(
            keys,
            [
                "event",
                "harness_version",
                "provider",
                "model",
                "milestone",
                "totals",
                "timestamp"
            ]
        );
        v["session_id"] = "s_1".into();
        assert!(serde_json::from_value::<Announcement>(v).is_err());
    }
}
