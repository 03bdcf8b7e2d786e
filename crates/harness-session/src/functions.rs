//! The `session::*` functions on a bus.

use std::future::Future;
use std::sync::Arc;

use harness_bus::{Bus, BusError, CallContext, FunctionDef, Handler};
use harness_types::parse::parse_payload;
use harness_types::session::*;
use harness_types::HarnessError;
use schemars::{schema_for, JsonSchema};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::store::SessionStore;

fn schema<T: JsonSchema>() -> Value {
    serde_json::to_value(schema_for!(T)).unwrap_or(Value::Null)
}

fn register_one<Req, Resp, F, Fut>(
    bus: &dyn Bus,
    sessions: &SessionStore,
    id: &str,
    description: &str,
    f: F,
) where
    Req: DeserializeOwned + JsonSchema + Send + 'static,
    Resp: Serialize + JsonSchema + 'static,
    F: Fn(SessionStore, Req) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, HarnessError>> + Send + 'static,
{
    let def = FunctionDef::new(id, description)
        .schemas(schema::<Req>(), schema::<Resp>())
        .internal();
    let sessions = sessions.clone();
    let f = Arc::new(f);
    let handler = move |payload: Value, _ctx: CallContext| {
        let sessions = sessions.clone();
        let f = f.clone();
        async move {
            let req: Req = parse_payload(payload)?;
            let resp = f(sessions, req).await?;
            serde_json::to_value(resp).map_err(|e| BusError::internal(e.to_string()))
        }
    };
    bus.register_function(def, Arc::new(handler) as Arc<dyn Handler>);
}

/// Registers `session::create`, `ensure`, `get`, `append`, `update-message`, `messages`,
/// `set-status` and `list` on `bus`.
pub fn register(bus: &dyn Bus, sessions: &SessionStore) {
    register_one(
        bus,
        sessions,
        "session::create",
        "Create a session.",
        |s, req: CreateRequest| async move { Ok(s.create(req).await?) },
    );
    register_one(
        bus,
        sessions,
        "session::ensure",
        "Create the session if it does not exist (title/metadata apply on creation only).",
        |s, req: EnsureRequest| async move { Ok(s.ensure(req).await?) },
    );
    register_one(
        bus,
        sessions,
        "session::get",
        "Read a session's metadata; null when unknown.",
        |s, req: SessionRef| async move { Ok(s.get(&req.session_id)?.map(|meta| GetResponse { meta })) },
    );
    register_one(
        bus,
        sessions,
        "session::append",
        "Append a message or custom record; idempotent on entry_id.",
        |s, req: AppendRequest| async move { Ok(s.append(req).await?) },
    );
    register_one(
        bus,
        sessions,
        "session::update-message",
        "Replace a message's content wholesale (streaming writes).",
        |s, req: UpdateMessageRequest| async move { Ok(s.update_message(req).await?) },
    );
    register_one(
        bus,
        sessions,
        "session::messages",
        "One page of the transcript, oldest first.",
        |s, req: MessagesRequest| async move { Ok(s.messages(&req)?) },
    );
    register_one(
        bus,
        sessions,
        "session::set-status",
        "Set the coarse session status (idle|working|done|error).",
        |s, req: SetStatusRequest| async move { Ok(s.set_status(req).await?) },
    );
    register_one(
        bus,
        sessions,
        "session::list",
        "List sessions.",
        |s, req: ListRequest| async move { Ok(s.list(&req)?) },
    );
}
