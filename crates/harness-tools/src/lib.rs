//! The built-in functions a model can act with: `fs::read|list|search|write|edit`,
//! `shell::exec` and `web::fetch`.
//!
//! They are ordinary functions on the bus (callable only where a turn's policy allows them).
//! The filesystem and shell functions work inside the `fs_scope` the loop stamps onto their
//! calls (the turn's root); they trust nothing else a call says about where it may reach. The
//! harness's data directory and configuration files are refused even under the root, and a
//! `shell::exec` command sees no process but its own.
//! `web::fetch` refuses loopback, private, link-local and metadata addresses unless the
//! operator allows private ones.

pub mod confine;
pub mod env;
pub mod error;
pub mod fs;
pub mod isolate;
pub mod jail;
pub mod scope;
pub mod shell;
pub mod web;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use harness_bus::typed::schema;
use harness_bus::{Bus, BusError, CallContext, FunctionDef, Handler};
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde_json::Value;

pub use confine::ShellPolicy;
pub use error::ToolError;
pub use jail::{Jail, Protected};
pub use scope::{Boundary, FsScope};

/// The functions that change something: held for approval by default in `harness chat`.
pub const MUTATING: &[&str] = &["fs::write", "fs::edit", "shell::exec"];

/// Every function this crate registers.
pub const FUNCTIONS: &[&str] = &[
    "fs::read",
    "fs::list",
    "fs::search",
    "fs::write",
    "fs::edit",
    "shell::exec",
    "web::fetch",
];

/// Caps and switches. `allow_private` is asked on every fetch, so a configuration change
/// applies to the next call.
#[derive(Clone)]
pub struct Limits {
    pub read_max_bytes: u64,
    pub write_max_bytes: u64,
    pub list_max_entries: usize,
    pub search_max_results: usize,
    pub search_max_file_bytes: u64,
    pub exec_default_timeout_ms: u64,
    pub exec_max_timeout_ms: u64,
    pub exec_max_output_bytes: usize,
    pub fetch_timeout_ms: u64,
    pub fetch_max_bytes: usize,
    pub fetch_max_redirects: u32,
    pub allow_private: Arc<dyn Fn() -> bool + Send + Sync>,
    /// How `shell::exec` is confined, asked on every call.
    pub shell_policy: Arc<dyn Fn() -> ShellPolicy + Send + Sync>,
    /// The highest Landlock ABI `shell::exec` may use (`None`: the kernel's). Below 3 nothing
    /// can be confined, so tests set 0 to take the path of a kernel without Landlock.
    pub landlock_ceiling: Option<i32>,
    /// Run each command in its own PID namespace (when the kernel can). Tests set false to
    /// take the path of a kernel without namespaces.
    pub pid_namespace: bool,
    /// The loop's `max_result_bytes` (0: no cap), asked on every call: `shell::exec` cuts its
    /// streams so that its whole result fits, rather than have the loop elide all of it.
    pub max_result_bytes: Arc<dyn Fn() -> usize + Send + Sync>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            read_max_bytes: 256 * 1024,
            write_max_bytes: 8 * 1024 * 1024,
            list_max_entries: 1000,
            search_max_results: 200,
            search_max_file_bytes: 8 * 1024 * 1024,
            exec_default_timeout_ms: 120_000,
            exec_max_timeout_ms: 600_000,
            exec_max_output_bytes: 64 * 1024,
            fetch_timeout_ms: 30_000,
            fetch_max_bytes: 2 * 1024 * 1024,
            fetch_max_redirects: 5,
            allow_private: Arc::new(|| false),
            shell_policy: Arc::new(ShellPolicy::default),
            landlock_ceiling: None,
            pid_namespace: true,
            max_result_bytes: Arc::new(|| 262_144),
        }
    }
}

/// What the functions need to know about the harness that hosts them.
#[derive(Clone, Default)]
pub struct Tools {
    /// The data directory and configuration files: never reachable.
    pub protected: Protected,
    pub limits: Limits,
}

impl Tools {
    pub fn new(protected: impl IntoIterator<Item = PathBuf>, limits: Limits) -> Tools {
        Tools {
            protected: Protected::new(protected),
            limits,
        }
    }
}

fn register_one<Req, F, Fut>(bus: &dyn Bus, tools: &Tools, id: &str, description: &str, f: F)
where
    Req: DeserializeOwned + JsonSchema + Send + 'static,
    F: Fn(Tools, Option<FsScope>, Req) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Value, ToolError>> + Send + 'static,
{
    let def = FunctionDef::new(id, description)
        .schemas(schema::<Req>(), serde_json::json!({"type": "object"}));
    let tools = tools.clone();
    let f = Arc::new(f);
    let handler = move |payload: Value, _ctx: CallContext| {
        let tools = tools.clone();
        let f = f.clone();
        async move {
            let (scope, req) = scope::split::<Req>(payload)?;
            f(tools, scope, req).await.map_err(BusError::from)
        }
    };
    bus.register_function(def, Arc::new(handler) as Arc<dyn Handler>);
}

/// Runs blocking filesystem work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ToolError> + Send + 'static,
) -> Result<T, ToolError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ToolError::Internal(e.to_string()))?
}

/// Registers an `fs::*` function: `run` works in the call's jail, off the async threads.
fn register_fs<Req>(
    bus: &dyn Bus,
    tools: &Tools,
    id: &str,
    description: &str,
    run: fn(&Jail, Req, &Limits) -> Result<Value, ToolError>,
) where
    Req: DeserializeOwned + JsonSchema + Send + 'static,
{
    register_one(bus, tools, id, description, move |t, scope, req: Req| {
        blocking(move || run(&Jail::open(scope.as_ref(), &t.protected)?, req, &t.limits))
    });
}

/// Registers every function of [`FUNCTIONS`] on `bus`.
pub fn register(bus: &dyn Bus, tools: &Tools) {
    register_fs(
        bus,
        tools,
        "fs::read",
        "Read a text file under the working root (optionally a line range). Paths are relative to the root.",
        fs::read,
    );
    register_fs(
        bus,
        tools,
        "fs::list",
        "List a directory under the working root: names, types and sizes.",
        fs::list,
    );
    register_fs(
        bus,
        tools,
        "fs::search",
        "Search files under the working root for a regular expression, line by line, honouring .gitignore and .ignore files.",
        fs::search,
    );
    register_fs(
        bus,
        tools,
        "fs::write",
        "Write a whole file under the working root (created, or replaced if it exists).",
        fs::write,
    );
    register_fs(
        bus,
        tools,
        "fs::edit",
        "Replace an exact piece of text in a file under the working root; the text must occur exactly once unless replace_all.",
        fs::edit,
    );
    register_one(
        bus,
        tools,
        "shell::exec",
        "Run a shell command (or an argv) in the working root, with a timeout and an output cap; returns exit code, stdout and stderr.",
        |t, scope, req: shell::ExecRequest| async move {
            let jail = Jail::open(scope.as_ref(), &t.protected)?;
            shell::exec(jail, req, &t.limits).await
        },
    );
    register_one(
        bus,
        tools,
        "web::fetch",
        "Fetch a public web page or API (GET or POST); HTML comes back as Markdown.",
        |t, _scope, req: web::FetchRequest| async move { web::fetch(req, &t.limits).await },
    );
}
