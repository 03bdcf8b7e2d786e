//! `harness bench` (being written).

use anyhow::Result;

#[derive(clap::Args, Clone)]
pub struct BenchArgs {
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// A shorter run (under 30 s).
    #[arg(long)]
    pub quick: bool,
}

pub async fn run(_args: BenchArgs) -> Result<()> {
    anyhow::bail!("harness bench is not built yet")
}
