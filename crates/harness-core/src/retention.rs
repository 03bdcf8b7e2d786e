//! Retention the sweep runs beside the idempotency keys (`send.rs`), on the same window.

use harness_types::now_ms;
use serde_json::json;

use crate::harness::{Harness, Result};
use crate::record::TurnRecord;

impl Harness {
    /// Retention beyond idempotency keys, on the same window (`idem_ttl_secs`): fan-out marks,
    /// the budget ledgers of turns that ended that long ago, and decided approvals (through
    /// `approval::prune`, when the approval gate is installed).
    pub(crate) async fn prune_scratch(&self, records: &[(String, TurnRecord)]) -> Result<usize> {
        let ttl_ms = self.config().idem_ttl_secs.saturating_mul(1000) as i64;
        let cutoff = now_ms().saturating_sub(ttl_ms);
        let mut pruned = self.prune_fanout(ttl_ms).await?;
        let bus = &self.inner.bus;
        // A detached sub-agent may still spend from a ledger whose turn ended long ago.
        let live: std::collections::HashSet<&str> = records
            .iter()
            .map(|(_, r)| r)
            .filter(|r| !r.is_terminal())
            .filter_map(|r| r.options.budget.as_ref().map(|b| b.ledger.as_str()))
            .collect();
        for (_, rec) in records {
            // A ledger is named after the turn that opened it; it is done once that turn is.
            let owned = rec
                .options
                .budget
                .as_ref()
                .filter(|b| b.ledger == rec.turn_id && !live.contains(b.ledger.as_str()));
            if let (Some(b), true) = (owned, rec.is_terminal() && rec.updated_at <= cutoff) {
                let scope = crate::budget::scope(&b.ledger);
                for (key, _) in bus.state_list(&scope).await.map_err(|e| e.into_harness())? {
                    bus.state_delete(&scope, &key)
                        .await
                        .map_err(|e| e.into_harness())?;
                    pruned += 1;
                }
            }
        }
        match bus
            .call(
                "approval::prune",
                json!({"older_than_ms": ttl_ms.max(0)}),
                None,
            )
            .await
        {
            Ok(v) => pruned += v["pruned"].as_u64().unwrap_or(0) as usize,
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(e.into_harness()),
        }
        Ok(pruned)
    }
}
