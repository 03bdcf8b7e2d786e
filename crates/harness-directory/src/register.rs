//! The `directory::*` functions on the bus: the readers, and the operator's writers
//! (`create`/`update`), which harness-core's wall refuses to every model.

use std::sync::Arc;

use harness_bus::{Bus, BusError, CallContext, FunctionDef, Handler};
use harness_types::directory::{ListRequest, NameRequest};
use harness_types::parse::parse_payload;
use harness_types::HarnessError;
use schemars::{schema_for, JsonSchema};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::{Directory, DirectoryError, Kind, WriteRequest};

fn schema<T: JsonSchema>() -> Value {
    serde_json::to_value(schema_for!(T)).unwrap_or(Value::Null)
}

fn register_fn<Req, Resp>(
    bus: &dyn Bus,
    dir: &Directory,
    id: &str,
    description: &str,
    f: fn(&Directory, Req) -> Result<Resp, DirectoryError>,
) where
    Req: DeserializeOwned + JsonSchema + Send + 'static,
    Resp: Serialize + JsonSchema + 'static,
{
    let dir = dir.clone();
    let handler = move |payload: Value, _ctx: CallContext| {
        let dir = dir.clone();
        async move {
            let req: Req = parse_payload(payload)?;
            let resp = f(&dir, req).map_err(HarnessError::from)?;
            serde_json::to_value(resp).map_err(|e| BusError::internal(e.to_string()))
        }
    };
    bus.register_function(
        FunctionDef::new(id, description).schemas(schema::<Req>(), schema::<Resp>()),
        Arc::new(handler) as Arc<dyn Handler>,
    );
}

/// Registers `directory::agents::list|get`, `directory::skills::list|get`,
/// `directory::system-prompts::get`, and `directory::{system-prompts,agents,skills}::
/// {create,update}` on `bus`.
pub fn register(bus: &dyn Bus, dir: &Directory) {
    register_fn(
        bus,
        dir,
        "directory::agents::list",
        "Agent profiles in the directory: name, description, display; a malformed profile file is left out and named in `skipped` with its reason.",
        |d, _: ListRequest| d.agents(),
    );
    register_fn(
        bus,
        dir,
        "directory::agents::get",
        "One agent profile with its extends chain resolved root first: prompt, model, reasoning effort, preloaded functions and skills, display.",
        |d, r: NameRequest| d.agent(&r.name),
    );
    register_fn(
        bus,
        dir,
        "directory::skills::list",
        "Skills in the directory: name and description of each.",
        |d, _: ListRequest| d.skills(),
    );
    register_fn(
        bus,
        dir,
        "directory::skills::get",
        "One skill's instructions by name (from the skills index in your system prompt).",
        |d, r: NameRequest| d.skill(&r.name),
    );
    register_fn(
        bus,
        dir,
        "directory::system-prompts::get",
        "A system prompt of the directory by name (`default` replaces the built-in identity).",
        |d, r: NameRequest| d.system_prompt(&r.name),
    );
    for kind in [Kind::SystemPrompt, Kind::Agent, Kind::Skill] {
        let (id, what) = match kind {
            Kind::SystemPrompt => (
                "system-prompts",
                "a system prompt (`default` replaces the built-in identity)",
            ),
            Kind::Agent => ("agents", "an agent profile"),
            Kind::Skill => ("skills", "a skill"),
        };
        for (verb, must_exist) in [("create", false), ("update", true)] {
            let dir = dir.clone();
            let handler = move |payload: Value, _ctx: CallContext| {
                let dir = dir.clone();
                async move {
                    let req: WriteRequest = parse_payload(payload)?;
                    let resp = dir
                        .write(kind, &req, must_exist)
                        .map_err(HarnessError::from)?;
                    serde_json::to_value(resp).map_err(|e| BusError::internal(e.to_string()))
                }
            };
            let description = format!(
                "Operator only: {verb} {what}, from the whole file (`content`) or `body` with `front_matter`; checked as a read checks it, written atomically, read by the next send. {}",
                if must_exist { "Refused when it does not exist." } else { "Refused when it exists." }
            );
            bus.register_function(
                FunctionDef::new(format!("directory::{id}::{verb}"), description)
                    .schemas(schema::<WriteRequest>(), schema::<crate::WriteResponse>()),
                Arc::new(handler) as Arc<dyn Handler>,
            );
        }
    }
}
