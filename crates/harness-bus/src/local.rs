//! In-process calls without JSON: a function registered on the embedded bus may carry, beside
//! its JSON handler, a handler that takes and answers the request's own Rust type.
//!
//! Why: the loop calls `context::assemble` and `router::chat` with the whole conversation on
//! every step. Turned into a `serde_json::Value` and parsed back on the other side, that costs
//! more than the rest of the step and grows with the history. When caller and callee share a
//! process the value moves instead. Where no local handler exists (an iii engine, a function
//! replaced by `register_function`), the caller uses the JSON call, so behaviour never depends
//! on which path ran.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::time::Duration;

use futures::FutureExt;

use crate::bus::CallContext;
use crate::error::BusError;

/// A request or answer moved in-process.
pub type LocalValue = Box<dyn Any + Send>;

pub type LocalFuture = Pin<Box<dyn Future<Output = Result<LocalValue, BusError>> + Send + 'static>>;

/// The typed side of a function: takes the request's Rust type, answers the response's.
pub trait LocalHandler: Send + Sync + 'static {
    fn call(&self, payload: LocalValue, ctx: CallContext) -> LocalFuture;
}

impl<F, Fut> LocalHandler for F
where
    F: Fn(LocalValue, CallContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<LocalValue, BusError>> + Send + 'static,
{
    fn call(&self, payload: LocalValue, ctx: CallContext) -> LocalFuture {
        Box::pin((self)(payload, ctx))
    }
}

/// Takes a local request of type `T`, or says what arrived instead.
pub fn take<T: 'static>(function_id: &str, payload: LocalValue) -> Result<T, BusError> {
    payload.downcast::<T>().map(|b| *b).map_err(|_| {
        BusError::internal(format!(
            "{function_id}: the in-process request is not a {}",
            std::any::type_name::<T>()
        ))
    })
}

/// Calls `handler` with `payload` under `timeout`, as the JSON path would (a panic fails the
/// call, not the caller), and takes its answer as `R`.
pub async fn invoke<R: 'static>(
    handler: &dyn LocalHandler,
    function_id: &str,
    payload: LocalValue,
    ctx: CallContext,
    timeout: Duration,
) -> Result<R, BusError> {
    let fut = AssertUnwindSafe(handler.call(payload, ctx)).catch_unwind();
    match tokio::time::timeout(timeout, fut).await {
        Err(_) => Err(BusError::timeout(function_id, timeout.as_millis() as u64)),
        Ok(Err(_panic)) => Err(BusError::internal(format!(
            "{function_id} panicked while handling the call"
        ))),
        Ok(Ok(result)) => result.and_then(|answer| {
            answer.downcast::<R>().map(|b| *b).map_err(|_| {
                BusError::internal(format!(
                    "{function_id}: the in-process answer is not a {}",
                    std::any::type_name::<R>()
                ))
            })
        }),
    }
}
