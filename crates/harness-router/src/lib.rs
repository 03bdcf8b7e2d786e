//! `router::*`: one streaming chat interface over many model providers.
//!
//! `router::chat` takes a [`ChatRequest`](harness_types::router::ChatRequest), streams
//! [`Frame`](harness_types::router::Frame)s to the caller while the provider answers, and returns
//! a [`ChatAck`](harness_types::router::ChatAck). Exactly one terminal frame (`done` or `error`)
//! ends every stream, whatever happened. `router::abort {request_id}` cancels a generation in
//! flight.
//!
//! Providers implement [`Provider`]; the [`scripted`] provider replays a JSON script and drives
//! tests, benchmarks and demos.

mod router;
pub mod scripted;

pub use router::{register, FrameWriter, Provider, ProviderError, Router};
