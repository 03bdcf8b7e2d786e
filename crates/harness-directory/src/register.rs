//! The `directory::*` functions on the bus: the readers, and the operator's writers
//! (`create`/`update`), which harness-core's wall refuses to every model.

use harness_bus::typed;
use harness_bus::{Bus, FunctionDef};
use harness_types::directory::{ListRequest, NameRequest};
use harness_types::HarnessError;
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::{Directory, DirectoryError, Kind, WriteRequest};

fn register_fn<Req, Resp>(
    bus: &dyn Bus,
    dir: &Directory,
    id: &str,
    description: &str,
    f: fn(&Directory, Req) -> Result<Resp, DirectoryError>,
) where
    Req: DeserializeOwned + JsonSchema + Send + 'static,
    Resp: Serialize + JsonSchema + Send + 'static,
{
    typed::register(
        bus,
        FunctionDef::new(id, description),
        dir.clone(),
        move |d: Directory, req: Req| std::future::ready(f(&d, req).map_err(HarnessError::from)),
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
            let description = format!(
                "Operator only: {verb} {what}, from the whole file (`content`) or `body` with `front_matter`; checked as a read checks it, written atomically, read by the next send. {}",
                if must_exist { "Refused when it does not exist." } else { "Refused when it exists." }
            );
            typed::register(
                bus,
                FunctionDef::new(format!("directory::{id}::{verb}"), description),
                dir.clone(),
                move |d: Directory, req: WriteRequest| {
                    std::future::ready(d.write(kind, &req, must_exist).map_err(HarnessError::from))
                },
            );
        }
    }
}
