//! `router::*`: one streaming chat interface over many model providers.
//!
//! `router::chat` takes a [`ChatRequest`](harness_types::router::ChatRequest), streams
//! [`Frame`](harness_types::router::Frame)s to the caller while the provider answers, and returns
//! a [`ChatAck`](harness_types::router::ChatAck). Exactly one terminal frame (`done` or `error`)
//! ends every stream, whatever happened. `router::abort {request_id}` cancels a generation in
//! flight; `router::models::list|get|supports` answer from the model [`catalog`].
//!
//! Providers implement [`Provider`]. The HTTP ones ([`providers`]: Anthropic Messages, OpenAI
//! Chat Completions and Responses, OpenAI-compatible local servers) are thin adapters over one
//! shared driver (`http.rs`: request, retries before output, [`sse`] parsing, error
//! classification, abort); the [`scripted`] provider replays a JSON script and drives tests,
//! benchmarks and demos. [`bench::frame_latency`] measures the router's own latency.
//!
//! Module map: `router.rs` (registry, `FrameWriter`, bus functions), `catalog.rs`, `error.rs`
//! (classification, redaction), `retry.rs`, `names.rs` (function id ↔ tool name), `sse.rs`,
//! `http.rs`, `providers/` (one file per API, `mod.rs` for configuration), `scripted.rs`,
//! `bench.rs`.

pub mod bench;
pub mod catalog;
pub mod error;
mod http;
pub mod names;
pub mod providers;
pub mod retry;
mod router;
pub mod scripted;
pub mod sse;

pub use catalog::{Capability, Catalog, ModelEntry, Pricing};
pub use error::{ProviderError, RouterError};
pub use providers::{register_from_env, Setup};
pub use router::{
    register, CacheIntent, ChatContext, ChatExtras, CountAnswer, CountRequest, FrameWriter,
    Provider, Router, SystemSection,
};
