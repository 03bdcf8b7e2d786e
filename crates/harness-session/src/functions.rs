//! The `session::*` functions on a bus.

use std::future::Future;
use std::sync::Arc;

use harness_bus::typed;
use harness_bus::{Bus, EmbeddedBus, FunctionDef, TxAnswer, TxValue, TxWrite, TypedRequest};
use harness_store::{Connection, StoreError};
use harness_types::parse::parse_payload;
use harness_types::session::*;
use harness_types::HarnessError;
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::store::{set_status_in, update_message_in, PreparedAppend, SessionStore};

/// A `session::*` function, hidden from default discovery, callable in-process without JSON.
fn register_one<Req, Resp, F, Fut>(
    bus: &dyn Bus,
    sessions: &SessionStore,
    id: &str,
    description: &str,
    f: F,
) where
    Req: DeserializeOwned + JsonSchema + Send + 'static,
    Resp: Serialize + JsonSchema + Send + 'static,
    F: Fn(SessionStore, Req) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, HarnessError>> + Send + 'static,
{
    let def = FunctionDef::new(id, description).internal();
    typed::register_with_local(bus, def, sessions.clone(), f);
}

/// Registers `session::create`, `ensure`, `get`, `append`, `update-message`, `messages`,
/// `changes`, `set-status`, `delete` and `list` on `bus`.
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
        "session::changes",
        "Entries appended or updated after a change mark (for readers that cache the transcript).",
        |s, req: ChangesRequest| async move { Ok(s.changes(&req)?) },
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
        "session::delete",
        "Delete a session and its transcript; deleted=false when there was no such session.",
        |s, req: DeleteRequest| async move { Ok(s.delete(req).await?) },
    );
    register_one(
        bus,
        sessions,
        "session::list",
        "List sessions.",
        |s, req: ListRequest| async move { Ok(s.list(&req)?) },
    );
}

/// A transcript write run inside a batch: its answer and the event it inserted.
type TxRun<P, Resp> =
    Arc<dyn Fn(&Connection, &P) -> Result<(Resp, Option<i64>), StoreError> + Send + Sync>;

/// Registers `id`'s prepared in-transaction form: the payload is parsed (and the write
/// prepared) on the caller's thread; the writer thread only runs `run`.
fn register_tx<Req, P, Resp>(
    bus: &EmbeddedBus,
    id: &str,
    prepare: fn(Req) -> Result<P, StoreError>,
    run: TxRun<P, Resp>,
) where
    Req: DeserializeOwned + Clone + Send + Sync + 'static,
    P: Send + 'static,
    Resp: Serialize + Send + 'static,
{
    let write = Arc::new(move |req: Req| -> Result<TxWrite, StoreError> {
        let prepared = prepare(req)?;
        let run = run.clone();
        Ok(Box::new(move |conn: &Connection| {
            let (resp, event) = run(conn, &prepared)?;
            Ok(TxAnswer {
                answer: TxValue::later(resp),
                event,
            })
        }))
    });
    let typed = write.clone();
    bus.register_prepared_typed(
        id,
        Arc::new(move |payload: Value| {
            let req: Req =
                parse_payload(payload).map_err(|e| StoreError::Invalid(e.to_string()))?;
            write(req)
        }),
        // The loop's own writes arrive typed: no JSON on the way to the writer.
        Arc::new(move |request: TypedRequest| match request.take::<Req>() {
            Ok(req) => typed(req).map_err(Err),
            Err(other) => Err(Ok(other)),
        }),
    );
}

/// Registers the in-transaction forms of the transcript writes (`session::append`,
/// `update-message`, `set-status`) on the embedded bus, so a `Bus::commit` batch that writes
/// the transcript together with the turn record, events and the next step is one transaction.
/// Only when `sessions` lives in the bus's own store (the batch runs on that store's writer).
pub fn register_transactional(bus: &EmbeddedBus, sessions: &SessionStore) {
    if bus.store().path() != sessions.store().path() {
        tracing::debug!("harness-session: transcript in another store; batches fall back to one write at a time");
        return;
    }
    register_tx(
        bus,
        "session::append",
        |req: AppendRequest| {
            PreparedAppend::new(req).map_err(|e| StoreError::Invalid(e.to_string()))
        },
        Arc::new({
            let log = sessions.change_log().clone();
            move |conn, prepared: &PreparedAppend| prepared.run(conn, &log)
        }),
    );
    register_tx(
        bus,
        "session::update-message",
        |req: UpdateMessageRequest| Ok(req),
        Arc::new({
            let log = sessions.change_log().clone();
            move |conn, req: &UpdateMessageRequest| update_message_in(conn, req, &log)
        }),
    );
    register_tx(
        bus,
        "session::set-status",
        |req: SetStatusRequest| Ok(req),
        Arc::new({
            let statuses = sessions.statuses().clone();
            move |conn, req: &SetStatusRequest| set_status_in(conn, req, &statuses)
        }),
    );
}
