//! Prints the router's frame latency over a local SSE server:
//! `cargo run --release -p harness-router --example frame_latency`.

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let report = harness_router::bench::frame_latency(Default::default()).await?;
    println!(
        "{}",
        serde_json::to_string_pretty(&report).map_err(std::io::Error::other)?
    );
    Ok(())
}
