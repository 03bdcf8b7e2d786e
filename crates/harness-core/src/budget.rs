//! Budgets: `max_total_tokens` and `max_cost_usd` per turn, shared with the turn's sub-agents.
//!
//! Every turn of a tree spends from one ledger, named after the turn that set the budget: each
//! turn writes its own cumulative row (state scope `harness_budget:<ledger>`, key = turn id), so
//! turns in different sessions never race on one value, and the tree's spend is the sum of the
//! rows. Before every generation the step reserves what it could spend — the context it sends
//! plus its output cap, priced from the catalog — and refuses the generation, before the provider
//! is called, when that reservation would cross a limit. After it, the row is reconciled to what
//! the provider reported.

use harness_types::message::Usage;
use serde_json::Value;

use crate::harness::{Harness, Result};
use crate::record::TurnRecord;

/// What a generation may reserve when the turn sets no output cap.
const DEFAULT_OUTPUT_RESERVATION: u64 = 4096;

// The types live with the turn record they are stored in.
pub use harness_machine::record::{Budget, Spend};

/// USD per million tokens, from a catalog row.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Prices {
    input: f64,
    output: f64,
}

impl Prices {
    fn of(entry: &Value) -> Prices {
        let p = &entry["pricing"];
        Prices {
            input: p["input"].as_f64().unwrap_or(0.0),
            output: p["output"].as_f64().unwrap_or(0.0),
        }
    }

    fn cost(self, input: u64, output: u64) -> f64 {
        (input as f64 * self.input + output as f64 * self.output) / 1_000_000.0
    }
}

/// Whether a reservation fits: `Err` names the limit it would cross.
pub(crate) fn check(
    budget: &Budget,
    spent: Spend,
    input: u64,
    output: u64,
    prices: Prices,
) -> std::result::Result<(), String> {
    let tokens = spent.tokens + input + output;
    if let Some(max) = budget.max_total_tokens {
        if tokens > max {
            return Err(format!(
                "max_total_tokens: {} spent + {input} context + {output} output reserved = {tokens} > {max}",
                spent.tokens
            ));
        }
    }
    if let Some(max) = budget.max_cost_usd {
        let cost = spent.cost_usd + prices.cost(input, output);
        if cost > max {
            return Err(format!(
                "max_cost_usd: ${:.6} spent + ${:.6} reserved = ${cost:.6} > ${max}",
                spent.cost_usd,
                cost - spent.cost_usd
            ));
        }
    }
    Ok(())
}

pub(crate) fn scope(ledger: &str) -> String {
    format!("harness_budget:{ledger}")
}

impl Harness {
    async fn prices(&self, rec: &TurnRecord) -> Prices {
        self.catalog_entry(rec)
            .await
            .map(|entry| Prices::of(&entry))
            .unwrap_or_default()
    }

    /// The preflight before a generation that sends `context_tokens`: `Err` is the refusal.
    pub(crate) async fn budget_preflight(
        &self,
        rec: &TurnRecord,
        context_tokens: u64,
    ) -> Result<std::result::Result<(), String>> {
        let Some(budget) = &rec.options.budget else {
            return Ok(Ok(()));
        };
        let rows = self.state_list(&scope(&budget.ledger)).await?;
        let mut spent = Spend::default();
        for (turn, row) in rows {
            // This turn's own row may lag its record (a crash between the two writes).
            let s: Spend = if turn == rec.turn_id {
                rec.spent
            } else {
                serde_json::from_value(row).unwrap_or_default()
            };
            spent.tokens += s.tokens;
            spent.cost_usd += s.cost_usd;
        }
        let output = rec
            .options
            .max_output_tokens
            .map_or(DEFAULT_OUTPUT_RESERVATION, u64::from);
        let prices = self.prices(rec).await;
        Ok(check(budget, spent, context_tokens, output, prices))
    }

    /// Reconciles the turn's spend with what a generation used; writes the ledger row.
    pub(crate) async fn record_spend(&self, rec: &mut TurnRecord, usage: &Usage) -> Result<()> {
        let Some(budget) = rec.options.budget.clone() else {
            return Ok(());
        };
        let input = usage.input.unwrap_or(0) + usage.cache_read.unwrap_or(0);
        let output = usage.output.unwrap_or(0);
        let cost = match usage.cost_usd {
            Some(c) => c,
            None => self.prices(rec).await.cost(input, output),
        };
        rec.spent.tokens += input + output;
        rec.spent.cost_usd += cost;
        let row = serde_json::to_value(rec.spent).unwrap_or(Value::Null);
        self.inner
            .bus
            .state_set(&scope(&budget.ledger), &rec.turn_id, row)
            .await
            .map_err(|e| e.into_harness())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reservation_that_crosses_a_limit_is_refused_naming_it() {
        let budget = Budget {
            max_total_tokens: Some(1000),
            max_cost_usd: Some(0.01),
            ledger: "t".into(),
        };
        let prices = Prices {
            input: 2.5,
            output: 10.0,
        };
        assert!(check(&budget, Spend::default(), 100, 500, prices).is_ok());
        let e = check(
            &budget,
            Spend {
                tokens: 500,
                cost_usd: 0.0,
            },
            100,
            500,
            prices,
        )
        .unwrap_err();
        assert!(e.starts_with("max_total_tokens: 500 spent"), "{e}");
        let e = check(
            &budget,
            Spend {
                tokens: 0,
                cost_usd: 0.009,
            },
            100,
            500,
            prices,
        )
        .unwrap_err();
        assert!(e.starts_with("max_cost_usd:"), "{e}");
    }
}
