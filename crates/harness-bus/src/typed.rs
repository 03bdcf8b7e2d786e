//! The one way to make a bus function out of a typed Rust function (as a web framework turns an
//! `async fn(State, Json<Req>) -> Json<Resp>` into a route): the payload is parsed strictly into
//! `Req` (an unknown or malformed field is refused by name), the answer is `Resp` as JSON, and the
//! function's schemas are taken from the two types, so what a caller is told and what the handler
//! accepts cannot drift apart.

use std::future::Future;
use std::sync::Arc;

use harness_types::parse::parse_payload;
use schemars::{schema_for, JsonSchema};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::bus::{Bus, CallContext, FunctionDef, Handler};
use crate::error::BusError;
use crate::local::{take, LocalHandler, LocalValue};

/// The JSON Schema of `T`, as function definitions carry it.
pub fn schema<T: JsonSchema>() -> Value {
    serde_json::to_value(schema_for!(T)).unwrap_or(Value::Null)
}

/// Registers `f` as the function `def` (its schemas set from `Req` and `Resp`): each call clones
/// `state` and hands it the parsed request.
pub fn register<S, Req, Resp, E, F, Fut>(bus: &dyn Bus, def: FunctionDef, state: S, f: F)
where
    S: Clone + Send + Sync + 'static,
    Req: DeserializeOwned + JsonSchema + Send + 'static,
    Resp: Serialize + JsonSchema + 'static,
    E: Into<BusError>,
    F: Fn(S, Req) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, E>> + Send + 'static,
{
    let def = def.schemas(schema::<Req>(), schema::<Resp>());
    bus.register_function(def, handler(state, f));
}

/// As [`register`], and in-process callers may also pass `Req` and take `Resp` as they are, with
/// no JSON either way (the loop reads `session::changes` on every step).
pub fn register_with_local<S, Req, Resp, E, F, Fut>(bus: &dyn Bus, def: FunctionDef, state: S, f: F)
where
    S: Clone + Send + Sync + 'static,
    Req: DeserializeOwned + JsonSchema + Send + 'static,
    Resp: Serialize + JsonSchema + Send + 'static,
    E: Into<BusError>,
    F: Fn(S, Req) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, E>> + Send + 'static,
{
    let def = def.schemas(schema::<Req>(), schema::<Resp>());
    let f = Arc::new(f);
    let function_id = def.function_id.clone();
    let json = {
        let f = f.clone();
        handler(state.clone(), move |state, req| f(state, req))
    };
    let local = move |payload: LocalValue, _ctx: CallContext| {
        let (state, f) = (state.clone(), f.clone());
        let req = take::<Req>(&function_id, payload);
        async move {
            let resp = f(state, req?).await.map_err(Into::into)?;
            Ok(Box::new(resp) as LocalValue)
        }
    };
    bus.register_function_with_local(def, json, Arc::new(local) as Arc<dyn LocalHandler>);
}

/// The JSON side of [`register`] alone, for a function whose schemas are written by hand or
/// whose in-process side answers another type than its JSON one.
pub fn handler<S, Req, Resp, E, F, Fut>(state: S, f: F) -> Arc<dyn Handler>
where
    S: Clone + Send + Sync + 'static,
    Req: DeserializeOwned + Send + 'static,
    Resp: Serialize + 'static,
    E: Into<BusError>,
    F: Fn(S, Req) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, E>> + Send + 'static,
{
    let f = Arc::new(f);
    Arc::new(move |payload: Value, _ctx: CallContext| {
        let (state, f) = (state.clone(), f.clone());
        async move {
            let req: Req = parse_payload(payload)?;
            let resp = f(state, req).await.map_err(Into::into)?;
            serde_json::to_value(resp).map_err(|e| BusError::internal(e.to_string()))
        }
    })
}
