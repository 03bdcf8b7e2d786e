//! The mid-turn message queue: what a user sends while a step is running.
//!
//! A send during a running turn is written here (not to the transcript) and delivered at the
//! next step's drain, so it reaches the model after the reply it interrupted. Rows are deleted
//! only after their append succeeded, and the append is idempotent on the row's entry id, so a
//! crash mid-drain delivers each message exactly once.

use harness_types::message::AgentMessage;
use harness_types::session::AppendRequest;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::harness::{Harness, Result, StepWrites};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct QueuedMessage {
    pub id: String,
    pub session_id: String,
    pub message: AgentMessage,
    pub entry_id: String,
    #[serde(default)]
    pub origin: Option<Value>,
    pub queued_at: i64,
}

pub(crate) fn scope(session_id: &str) -> String {
    format!("harness_queue:{session_id}")
}

impl Harness {
    /// Parks a message for the next step. Keys sort by arrival.
    pub(crate) async fn queue_message(&self, row: &QueuedMessage) -> Result<()> {
        let key = format!("{:020}_{}", row.queued_at, row.id);
        let value = serde_json::to_value(row)
            .map_err(|e| harness_types::HarnessError::internal(e.to_string()))?;
        self.inner
            .bus
            .state_set(&scope(&row.session_id), &key, value)
            .await
            .map_err(|e| e.into_harness())
    }

    pub(crate) async fn queued(&self, session_id: &str) -> Result<Vec<(String, QueuedMessage)>> {
        let rows = self.state_list(&scope(session_id)).await?;
        let mut out: Vec<(String, QueuedMessage)> = rows
            .into_iter()
            .filter_map(|(k, v)| serde_json::from_value(v).ok().map(|m| (k, m)))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Appends every queued message to the transcript in arrival order, each with the removal
    /// of its row, as one write. Returns how many of them the model can see (custom messages
    /// never steer).
    pub(crate) async fn drain_queue(&self, session_id: &str, turn_id: &str) -> Result<usize> {
        let mut batch = StepWrites::default();
        let visible = self.drain_into(session_id, turn_id, &mut batch).await?;
        self.commit(batch).await?;
        Ok(visible)
    }

    /// [`Harness::drain_queue`] into `batch`: a row goes only with its append (the append is
    /// idempotent on the row's entry id), so a crash before the batch commits leaves both.
    pub(crate) async fn drain_into(
        &self,
        session_id: &str,
        turn_id: &str,
        batch: &mut StepWrites,
    ) -> Result<usize> {
        let mut visible = 0;
        for (key, row) in self.queued(session_id).await? {
            let origin = row
                .origin
                .clone()
                .unwrap_or_else(|| serde_json::json!({ "turn_id": turn_id, "queued": true }));
            if row.message.is_model_visible() {
                visible += 1;
            }
            batch.append(AppendRequest {
                session_id: session_id.to_string(),
                message: Some(row.message),
                custom: None,
                entry_id: Some(row.entry_id),
                origin: Some(origin),
            })?;
            batch.state_delete(scope(session_id), key);
        }
        Ok(visible)
    }
}
