//! The Bus: everything the turn loop does outside itself goes through this interface.
//!
//! It is modelled on the iii engine: functions are called by id (plainly, or streaming frames for
//! `router::chat`), registered with request/response JSON Schemas; trigger types are registered
//! and bound to functions through the `engine::register_trigger` / `engine::unregister_trigger`
//! functions; steps are enqueued on a named FIFO queue grouped by a payload field; state is the
//! `state::*` functions.
//!
//! [`embedded::EmbeddedBus`] implements it in-process over SQLite. The iii implementation lives in
//! its own crate. Architecture invariant: nothing that uses a `dyn Bus` may know which one it has.

pub mod bus;
mod cron;
pub mod embedded;
mod engine_functions;
pub mod error;
pub mod local;
pub mod typed;

pub use bus::{
    commit_one_by_one, Binding, Bus, BusWrite, CallContext, FrameSink, FunctionDef, Handler,
    HandlerFuture, QueueDef, StreamingCall, TriggerTypeDef, TypedRequest,
};
pub use embedded::{EmbeddedBus, TxAnswer, TxHandler, TxPrepare, TxPrepareTyped, TxValue, TxWrite};
pub use engine_functions::listed_function_ids;
pub use error::{BusCode, BusError};
pub use local::{LocalFuture, LocalHandler, LocalValue};
