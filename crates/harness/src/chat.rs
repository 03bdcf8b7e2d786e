//! `harness chat`: send a message, stream the reply as it arrives, repeat.

use std::io::{BufRead, Write};

use anyhow::{anyhow, Result};
use futures::StreamExt;
use harness_types::message::joined_text;
use harness_types::session::Entry;
use serde_json::{json, Value};

use crate::runtime::{Runtime, RuntimeOptions};

mod typeahead;

/// The flags of `harness chat` (the doc comments are its `--help`); the runtime's own flags
/// come beside them, see [`run`].
#[derive(clap::Args)]
pub struct ChatArgs {
    /// Send this one message, print the reply, and exit.
    #[arg(short = 'm', long = "message")]
    pub message: Option<String>,
    #[arg(long)]
    pub session: Option<String>,
    /// scripted, anthropic, openai, openai-responses, openai-compatible, ollama, llamacpp,
    /// vllm, lmstudio (default: the router config's, else whichever API key is set, else the
    /// scripted demo).
    #[arg(long)]
    pub provider: Option<String>,
    /// Default: the router config's, else the provider's catalog default (a local server's
    /// first listed model).
    #[arg(long)]
    pub model: Option<String>,
    /// Talk to a running server instead of an in-process runtime.
    #[arg(long)]
    pub url: Option<String>,
    /// Let the model call functions matching this glob (repeatable). Without it a new
    /// session is a plain chat (no functions), while a session named with --session keeps
    /// the policy of its earlier turns (printed on stderr); naming --allow replaces it.
    #[arg(long = "allow", value_name = "GLOB")]
    pub allow: Vec<String>,
    /// The most tokens one reply may take (default: the model's catalog limit, 4096 for a
    /// local server): lower it for a small model on a slow machine. A reply cut there says
    /// so.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_output_tokens: Option<u32>,
    /// Run the new session under this agent profile of the directory (`agents/NAME.md`):
    /// its prompt, preloaded functions and skills; its model unless --model is given.
    #[arg(long, value_name = "NAME")]
    pub agent: Option<String>,
    /// Make every generation call this function (sent as the provider's `tool_choice`,
    /// chat-completions shape): servers such as llama-cpp-python use tools only when one
    /// is named. Pair it with --max-turns, or the model calls it at every step. The choice
    /// sticks to the session; `auto` clears it.
    #[arg(long, value_name = "FUNCTION")]
    pub tool_choice: Option<String>,
    /// How the allowed functions are offered: `native` (one tool per function, needed by
    /// --tool-choice) or `agent_trigger` (the default: one tool plus discovery).
    #[arg(long, value_name = "MODE", value_parser = ["native", "agent_trigger"])]
    pub expose: Option<String>,
    /// Generate steps per turn (default: the configuration's default_max_turns).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_turns: Option<u32>,
}

/// Where events come from: the in-process store, or a server's SSE stream.
enum Source {
    Local { rt: Runtime, after: i64 },
    Remote { url: String },
}

impl Source {
    async fn send(&mut self, payload: Value) -> Result<Value> {
        match self {
            Source::Local { rt, after } => {
                *after = rt.store.last_event_id()?;
                let req =
                    harness_types::parse::parse_payload(payload).map_err(|e| anyhow!("{e}"))?;
                let resp = rt.harness.send(req).await.map_err(|e| anyhow!("{e}"))?;
                Ok(serde_json::to_value(resp)?)
            }
            Source::Remote { url } => {
                crate::client::call_value(url, "harness::send", &payload).await
            }
        }
    }

    /// Follows the session's events until the turn ends, printing the reply as it grows; says
    /// how it ended.
    /// Follows a turn to its end; also answers the `harness::ask` card the turn ended on.
    async fn follow(
        &mut self,
        session_id: &str,
        turn_id: &str,
        max_output: Option<u32>,
    ) -> Result<(TurnEnd, Option<Value>)> {
        let mut printer = Printer {
            max_output,
            usage: Default::default(),
            cut_reply: None,
            turn_id: turn_id.to_string(),
            printed: Default::default(),
            parked: false,
            detail: None,
            cut: false,
            card: None,
            end: TurnEnd::Open,
            announced: Default::default(),
        };
        let end = self.follow_with(&mut printer, session_id).await?;
        Ok((end, printer.card))
    }

    async fn follow_with(&mut self, printer: &mut Printer, session_id: &str) -> Result<TurnEnd> {
        // The turn may be parked already (the session's earlier events are not replayed here).
        if !answer_approvals(self.caller(), session_id).await? {
            return Ok(TurnEnd::Open);
        }
        match self {
            Source::Local { rt, after } => {
                let mut changes = rt.store.subscribe_events();
                loop {
                    for row in rt.store.events_after(session_id, *after, 256)? {
                        *after = row.id;
                        let data = crate::http::event_json(&rt.sessions, &row);
                        if printer.on_event(&row.topic, &data) {
                            return Ok(printer.end.clone());
                        }
                        if printer.take_parked()
                            && !answer_approvals(Caller::Local(rt), session_id).await?
                        {
                            return Ok(TurnEnd::Open);
                        }
                    }
                    changes
                        .changed()
                        .await
                        .map_err(|_| anyhow!("the runtime stopped"))?;
                }
            }
            Source::Remote { url } => {
                let resp = crate::client::session_events(url, session_id).await?;
                let mut body = resp.bytes_stream();
                let mut buf = String::new();
                let (mut topic, mut data) = (String::new(), String::new());
                while let Some(chunk) = body.next().await {
                    buf.push_str(&String::from_utf8_lossy(&chunk?));
                    while let Some(pos) = buf.find('\n') {
                        let line = buf[..pos].trim_end_matches('\r').to_string();
                        buf.drain(..=pos);
                        if let Some(v) = line.strip_prefix("event:") {
                            topic = v.trim().to_string();
                        } else if let Some(v) = line.strip_prefix("data:") {
                            data.push_str(v.trim_start());
                        } else if line.is_empty() && !data.is_empty() {
                            let value: Value = serde_json::from_str(&data).unwrap_or(Value::Null);
                            data.clear();
                            if printer.on_event(&topic, &value) {
                                return Ok(printer.end.clone());
                            }
                            if printer.take_parked()
                                && !answer_approvals(Caller::Remote(url), session_id).await?
                            {
                                return Ok(TurnEnd::Open);
                            }
                        }
                    }
                }
                Err(anyhow!("the event stream ended before the turn did"))
            }
        }
    }
}

/// The function policy a session keeps from an earlier run, as a line for stderr (`None` when
/// it allows nothing or cannot be read).
async fn earlier_policy(source: &Source, session_id: &str) -> Option<String> {
    let record = source
        .caller()
        .call(
            "state::get",
            json!({"scope": harness_core::TURN_SCOPE, "key": session_id}),
        )
        .await
        .ok()?;
    let policy = &record["options"]["functions"];
    let allow: Vec<&str> = policy["allow"]
        .as_array()?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    if allow.is_empty() {
        return None;
    }
    let expose = policy["expose"].as_str().unwrap_or("agent_trigger");
    Some(format!(
        "harness chat: session {session_id} keeps the function policy of an earlier run: --allow {} (expose {expose}); name --allow to replace it",
        allow.join(" --allow ")
    ))
}

/// Ctrl-C in the chat: while a reply streams, the first press stops the turn (`harness::stop`)
/// and the chat goes on; a second press, or one at the prompt, quits.
#[derive(Clone)]
struct Interrupt {
    /// The session whose turn is followed, and the presses since it started.
    following: std::sync::Arc<std::sync::Mutex<(Option<String>, u32)>>,
}

/// Where `harness::stop` goes (a clone of the source's way in, usable from the signal task).
#[derive(Clone)]
enum Stopper {
    Local(harness_bus::EmbeddedBus),
    Remote(String),
}

/// The process's Ctrl-C (SIGINT), as one stream for its life.
struct Interrupts {
    #[cfg(unix)]
    signal: Option<tokio::signal::unix::Signal>,
}

impl Interrupts {
    fn new() -> Interrupts {
        Interrupts {
            #[cfg(unix)]
            signal: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).ok(),
        }
    }

    /// The next Ctrl-C; `false` once none can come (the handler could not be installed).
    async fn recv(&mut self) -> bool {
        #[cfg(unix)]
        return match &mut self.signal {
            Some(signal) => signal.recv().await.is_some(),
            None => false,
        };
        #[cfg(not(unix))]
        return tokio::signal::ctrl_c().await.is_ok();
    }
}

impl Interrupt {
    /// Installs the handler for the rest of the process.
    fn install(stopper: Stopper) -> Interrupt {
        let me = Interrupt {
            following: Default::default(),
        };
        let state = me.following.clone();
        // One listener for the life of the process, made before anything can be interrupted:
        // a Ctrl-C that comes while the stop of the first is still on its way is kept for the
        // next `recv`, where a listener made anew each time (`ctrl_c()`) would never see it.
        let mut interrupts = Interrupts::new();
        tokio::spawn(async move {
            loop {
                if !interrupts.recv().await {
                    return;
                }
                let stop = {
                    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
                    s.1 += 1;
                    s.0.clone().filter(|_| s.1 == 1)
                };
                let Some(session_id) = stop else {
                    eprintln!();
                    typeahead::release();
                    std::process::exit(130);
                };
                eprintln!("\n[stopping the reply; Ctrl-C again quits]");
                // In a task of its own: the next Ctrl-C (to quit) is read while this one waits.
                let stopper = stopper.clone();
                tokio::spawn(async move {
                    let payload = json!({ "session_id": session_id });
                    let stopped = match &stopper {
                        Stopper::Local(bus) => {
                            use harness_bus::Bus;
                            bus.call("harness::stop", payload, None)
                                .await
                                .map_err(|e| anyhow!("{e}"))
                        }
                        Stopper::Remote(url) => {
                            crate::client::call_value(url, "harness::stop", &payload).await
                        }
                    };
                    if let Err(e) = stopped {
                        eprintln!("[could not stop the reply: {e}]");
                    }
                });
            }
        });
        me
    }

    fn follow(&self, session_id: Option<&str>) {
        let mut s = self.following.lock().unwrap_or_else(|e| e.into_inner());
        *s = (session_id.map(str::to_string), 0);
    }
}

/// How a followed turn ended, as `harness chat` reports it.
#[derive(Clone, Debug, PartialEq)]
enum TurnEnd {
    /// Still open: the chat stopped following (stdin ended at an approval).
    Open,
    Completed,
    Cancelled,
    /// The public sentence, and the diagnostic of the turn's error record when there is one.
    Failed(String),
}

struct Printer {
    /// `--max-output-tokens`, to say which limit cut a reply.
    max_output: Option<u32>,
    /// The usage of each reply of the turn, by entry id (shown when the turn ends).
    usage: std::collections::BTreeMap<String, harness_types::message::Usage>,
    /// A reply of this turn that was cut after some of it was shown (its entry id): the next
    /// reply resumes it, and is marked so it does not read as glued to the cut part.
    cut_reply: Option<String>,
    turn_id: String,
    printed: std::collections::HashMap<String, usize>,
    /// Set when the session parked for function results (approvals may be waiting).
    parked: bool,
    /// The diagnostic of the turn's error record (written before the turn's terminal event).
    detail: Option<String>,
    /// The last reply of the turn stopped at the output limit.
    cut: bool,
    /// The `harness::ask` card the turn ended on.
    card: Option<Value>,
    end: TurnEnd,
    /// Function calls and results already shown.
    announced: std::collections::HashSet<String>,
}

impl Printer {
    fn take_parked(&mut self) -> bool {
        std::mem::take(&mut self.parked)
    }

    /// Prints what is new; true when the turn is over.
    fn on_event(&mut self, topic: &str, data: &Value) -> bool {
        if topic == "session::status-changed"
            && data["payload"]["reason"] == json!("awaiting functions")
        {
            self.parked = true;
            return false;
        }
        if topic.starts_with("session::message-") {
            let Ok(entry) = serde_json::from_value::<Entry>(data["entry"].clone()) else {
                return false;
            };
            if let Some(line) = written_by_call(&entry) {
                // Written by one of this turn's function calls: shown as that, never as the
                // model's reply or the user's words.
                if entry.entry_id.starts_with(&format!("w_{}_", self.turn_id))
                    && self.announced.insert(format!("w:{}", entry.entry_id))
                {
                    eprintln!("{line}");
                }
                return false;
            }
            if !entry.entry_id.starts_with(&format!("e_{}_", self.turn_id)) {
                return false;
            }
            if let Some(c) = entry.custom.as_ref().filter(|c| c.custom_type == "error") {
                self.detail = c.data["detail"].as_str().map(str::to_string);
                return false;
            }
            if let Some(harness_types::AgentMessage::FunctionResult(r)) = &entry.message {
                if r.details["status"] == "awaiting_answer" && self.card.is_none() {
                    print!("{}", render_card(&r.details));
                    self.card = Some(r.details.clone());
                } else if self.announced.insert(format!("r:{}", r.function_call_id)) {
                    let outcome = if r.is_error { "error" } else { "ok" };
                    eprintln!(
                        "[{} {outcome}: {}]",
                        r.function_id,
                        clip(&joined_text(&r.content), 160)
                    );
                }
                return false;
            }
            let Some(harness_types::AgentMessage::Assistant(m)) = &entry.message else {
                return false;
            };
            self.cut = m.stop_reason == harness_types::message::StopReason::Length;
            if let Some(u) = &m.usage {
                self.usage.insert(entry.entry_id.clone(), u.clone());
            }
            let text = joined_text(&m.content);
            if !text.is_empty()
                && self
                    .cut_reply
                    .as_ref()
                    .is_some_and(|cut| *cut != entry.entry_id)
            {
                self.cut_reply = None;
                print!("\n[the reply above was cut off; resumed:]\n");
            }
            if m.stop_reason == harness_types::message::StopReason::Error && !text.is_empty() {
                self.cut_reply = Some(entry.entry_id.clone());
            }
            let done = self.printed.entry(entry.entry_id.clone()).or_insert(0);
            if text.len() > *done && text.is_char_boundary(*done) {
                print!("{}", &text[*done..]);
                let _ = std::io::stdout().flush();
                *done = text.len();
            }
            // What the model asks to run, once each, on stderr (the reply stays alone on stdout).
            for block in &m.content {
                if let harness_types::message::ContentBlock::FunctionCall {
                    id,
                    function_id,
                    arguments,
                    ..
                } = block
                {
                    // A call still streaming carries `_partial`: shown once it is whole.
                    if arguments.get("_partial").is_none()
                        && self.announced.insert(format!("c:{id}"))
                    {
                        eprintln!("[call {function_id} {}]", clip(&arguments.to_string(), 160));
                    }
                }
            }
            return false;
        }
        if topic == "harness::turn-completed" && data["payload"]["turn_id"] == json!(self.turn_id) {
            let p = &data["payload"];
            if let Some(line) = usage_line(self.usage.values()) {
                // The reply on stdout has no newline yet: in a terminal the line would be glued
                // to its last word.
                eprintln!("\n{line}");
            }
            if p["reason"] == "max_turns" {
                println!(
                    "\n[stopped at the turn's max_turns limit: send another message to go on]"
                );
            }
            self.end = match p["status"].as_str() {
                Some("failed") => {
                    let summary = p["result_error"].as_str().unwrap_or("unknown error");
                    // The event's `failure` has the cause in parts; a server without it put
                    // the hint inside the error record's detail.
                    let failure = &p["failure"];
                    let detail = failure["detail"]
                        .as_str()
                        .map(str::to_string)
                        .or_else(|| self.detail.clone());
                    let why = match detail {
                        Some(d) => format!(
                            "{summary} {}",
                            harness_router::error::explained(&d, failure["hint"].as_str())
                        ),
                        None => summary.to_string(),
                    };
                    println!("\n[turn failed: {why}]");
                    TurnEnd::Failed(why)
                }
                Some("cancelled") => {
                    println!("\n[stopped]");
                    TurnEnd::Cancelled
                }
                _ if self.cut => {
                    // Without a cap of the user's, the limit was what the window left after
                    // the prompt: a bigger cap would not help there.
                    match self.max_output {
                        None => println!("\n[reply cut: it filled what the context window leaves after the prompt; cap replies with --max-output-tokens N, or start a new session for more room]"),
                        Some(n) => println!("\n[reply cut at the output limit: --max-output-tokens {n}, or what the context window left after the prompt if that was less]"),
                    }
                    TurnEnd::Completed
                }
                _ => {
                    // A JSON result (an output contract) is shown as the value it is.
                    match &p["result"] {
                        v @ (Value::Object(_) | Value::Array(_)) => {
                            println!("\n{}", serde_json::to_string_pretty(v).unwrap_or_default())
                        }
                        _ => println!(),
                    }
                    TurnEnd::Completed
                }
            };
            return true;
        }
        false
    }
}

/// The usage of a turn's replies, summed: tokens in and out, `estimated` when any reply's was
/// (a server that reports none), and the cost when every reply was priced.
fn usage_line<'a>(
    replies: impl Iterator<Item = &'a harness_types::message::Usage>,
) -> Option<String> {
    let (mut input, mut output, mut cost, mut estimated, mut any) =
        (0u64, 0u64, Some(0.0f64), false, false);
    for u in replies {
        any = true;
        input += u.input.unwrap_or(0) + u.cache_read.unwrap_or(0) + u.cache_write.unwrap_or(0);
        output += u.output.unwrap_or(0);
        estimated |= u.estimated;
        cost = cost.zip(u.cost_usd).map(|(a, b)| a + b);
    }
    if !any {
        return None;
    }
    let cost = cost.map_or_else(|| "cost unknown".to_string(), |c| format!("${c:.6}"));
    let marker = if estimated { " (estimated)" } else { "" };
    Some(format!(
        "[usage: {input} in, {output} out tokens{marker}, {cost}]"
    ))
}

/// How an entry a function call wrote is shown: `[written by call <id> (<function>)] <text>`;
/// `None` for the loop's own entries.
fn written_by_call(entry: &Entry) -> Option<String> {
    let by = entry
        .origin
        .as_ref()?
        .get(harness_core::provenance::WRITTEN_BY)?;
    let text = match (&entry.message, &entry.custom) {
        (Some(m), _) => m.text(),
        (None, Some(c)) => format!("[{}] {}", c.custom_type, c.data),
        (None, None) => String::new(),
    };
    Some(format!(
        "[written by call {} ({})] {}",
        by["function_call_id"].as_str().unwrap_or("?"),
        by["function_id"].as_str().unwrap_or("?"),
        clip(&text, 160)
    ))
}

/// The provider and model: the flags, else the router config, else whichever key is set, else
/// the scripted demo (said on stderr). A named provider that is not configured fails with what
/// to set.
async fn choose(args: &ChatArgs) -> Result<(String, String)> {
    if args.url.is_some() {
        // The server has its own providers; only the model default can be looked up here.
        let provider = args.provider.clone().unwrap_or_else(|| "scripted".into());
        let model = match &args.model {
            Some(m) => m.clone(),
            None if provider == "scripted" => "demo".into(),
            None => harness_router::Catalog::builtin()
                .default_model(&provider)
                .ok_or_else(|| anyhow!("name a model for provider '{provider}' with --model"))?,
        };
        return Ok((provider, model));
    }
    let setup = harness_router::Setup::from_env().map_err(|e| anyhow!("{e}"))?;
    let c = setup
        .choose(args.provider.as_deref(), args.model.as_deref())
        .await
        .map_err(|e| anyhow!(e))?;
    if let Some(note) = &c.note {
        eprintln!("harness chat: {note}");
    }
    Ok((c.provider, c.model))
}

/// What the in-process chat holds for a yes/no: every built-in tool that changes something
/// (`fs::write`, `fs::edit`, `shell::exec`), so a first run asks before anything changes, plus
/// whatever `--approve` names.
fn held_for_approval(approve: &[String]) -> Vec<String> {
    let mut globs: Vec<String> = harness_tools::MUTATING
        .iter()
        .map(|s| s.to_string())
        .collect();
    for g in approve {
        if !globs.contains(g) {
            globs.push(g.clone());
        }
    }
    globs
}

/// How long an in-process chat waits for the configured MCP servers before the first message.
const MCP_START_WAIT: std::time::Duration = std::time::Duration::from_secs(20);

/// Runs `harness chat`; an in-process runtime opens with `runtime`, holding for approval the
/// mutating tools and whatever `approve` (`--approve`) names.
pub async fn run(args: ChatArgs, runtime: RuntimeOptions, approve: Vec<String>) -> Result<()> {
    let (provider, model) = choose(&args).await?;
    let mut source = match &args.url {
        Some(url) => Source::Remote { url: url.clone() },
        None => {
            let rt = Runtime::open(runtime, held_for_approval(&approve)).await?;
            // The configured MCP servers connect in the background: give them a moment, so the
            // first message is not sent before their tools exist.
            if !rt.mcp.settled(MCP_START_WAIT).await {
                eprintln!(
                    "harness chat: an MCP server is still starting after {}s; going on without its tools for now",
                    MCP_START_WAIT.as_secs()
                );
            }
            Source::Local { rt, after: 0 }
        }
    };
    let mut session = args.session.clone();
    let interactive = args.message.is_none();
    if interactive {
        eprintln!(
            "harness chat — provider {provider} model {model}. Type a message; /quit to leave."
        );
    }
    // A profile that names its own model runs on it unless `--model` says otherwise: the
    // sends then leave model and provider out, and the session keeps the profile's.
    let mut send_model = true;
    if let (Some(name), None) = (&args.agent, &args.model) {
        let profile = source
            .caller()
            .call("directory::agents::get", json!({ "name": name }))
            .await
            .map_err(|e| anyhow!("--agent {name}: {e}"))?;
        if let Some(m) = profile["model"].as_str() {
            send_model = false;
            if interactive {
                eprintln!("harness chat — agent {name} runs on its own model {m}");
            }
        }
    }
    let interrupt = Interrupt::install(match &source {
        Source::Local { rt, .. } => Stopper::Local(rt.bus.clone()),
        Source::Remote { url } => Stopper::Remote(url.clone()),
    });
    if let Some(function) = args.tool_choice.as_deref().filter(|f| *f != "auto") {
        check_tool_choice(&source, &args.allow, args.expose.as_deref(), function).await?;
    }
    let mut agent = args.agent.clone();
    // A session named with `--session` keeps the function policy of its earlier turns when this
    // run names none: said once, so it does not act unseen.
    let mut resumed_session = args.session.is_some();
    let stdin = std::io::stdin();
    let mut pending = args.message.clone();
    loop {
        let text = match pending.take() {
            Some(t) => t,
            None if interactive => {
                eprint!("> ");
                // Typed during the reply: shown now, after the prompt, as if typed here.
                let mut line = String::new();
                match typeahead::take() {
                    Some((typed, true)) => {
                        eprintln!("{typed}");
                        line = typed;
                    }
                    Some((start, false)) => {
                        eprint!("{start}");
                        let mut rest = String::new();
                        if stdin.lock().read_line(&mut rest)? == 0 && start.is_empty() {
                            break;
                        }
                        line = start + &rest;
                    }
                    None => {
                        if stdin.lock().read_line(&mut line)? == 0 {
                            break;
                        }
                    }
                }
                let line = line.trim().to_string();
                if line == "/quit" || line == "/exit" {
                    break;
                }
                if line.is_empty() {
                    continue;
                }
                line
            }
            None => break,
        };
        // Held from before the request goes out until the reply has ended.
        let held = interactive.then(typeahead::Held::new);
        let mut payload = json!({"message": text});
        if send_model {
            payload["model"] = json!(model);
            payload["provider"] = json!(provider);
        }
        if let Some(s) = &session {
            payload["session_id"] = json!(s);
        }
        if !args.allow.is_empty() {
            payload["options"] = json!({"functions": {"allow": args.allow}});
            if let Some(expose) = &args.expose {
                payload["options"]["functions"]["expose"] = json!(expose);
            }
        }
        // Only the session-creating send names the profile; later ones inherit it.
        if let Some(name) = agent.take() {
            payload["options"]["agent"] = json!(name);
        }
        if let Some(n) = args.max_output_tokens {
            payload["options"]["max_output_tokens"] = json!(n);
        }
        if let Some(n) = args.max_turns {
            payload["options"]["max_turns"] = json!(n);
        }
        if let Some(function) = &args.tool_choice {
            payload["options"]["provider_options"] = forced_tool(&provider, function);
        }
        let resp = source.send(payload).await?;
        let sid = resp["session_id"].as_str().unwrap_or_default().to_string();
        let tid = resp["turn_id"].as_str().unwrap_or_default().to_string();
        if session.is_none() && interactive {
            eprintln!("(session {sid})");
        }
        session = Some(sid.clone());
        if resumed_session && args.allow.is_empty() {
            resumed_session = false;
            if let Some(line) = earlier_policy(&source, &sid).await {
                eprintln!("{line}");
            }
        }
        interrupt.follow(Some(&sid));
        let followed = source.follow(&sid, &tid, args.max_output_tokens).await;
        drop(held);
        interrupt.follow(None);
        let (end, card) = followed?;
        if let (Some(card), true) = (card, interactive) {
            // The answer to the card is the next message, one line per question.
            match ask_card(&card)? {
                Some(answer) => pending = Some(answer),
                None => break,
            }
            continue;
        }
        if !interactive {
            if let Source::Local { rt, .. } = &source {
                rt.shutdown().await;
            }
            // A one-shot chat is a command: a turn that failed is a failed command.
            return match end {
                TurnEnd::Failed(why) => Err(anyhow!("the turn failed: {why}")),
                _ => Ok(()),
            };
        }
    }
    if let Source::Local { rt, .. } = &source {
        rt.shutdown().await;
    }
    Ok(())
}

// --- approvals: shown when the followed turn parks, answered y/n on stdin ---------------------

/// Where `approval::*` is called: the in-process bus or the server.
enum Caller<'a> {
    Local(&'a Runtime),
    Remote(&'a str),
}

impl Source {
    fn caller(&self) -> Caller<'_> {
        match self {
            Source::Local { rt, .. } => Caller::Local(rt),
            Source::Remote { url } => Caller::Remote(url),
        }
    }
}

impl Caller<'_> {
    async fn call(&self, function_id: &str, payload: Value) -> Result<Value> {
        match self {
            Caller::Local(rt) => {
                use harness_bus::Bus;
                rt.bus
                    .call(function_id, payload, None)
                    .await
                    .map_err(|e| anyhow!("{e}"))
            }
            Caller::Remote(url) => crate::client::call_value(url, function_id, &payload).await,
        }
    }
}

/// One line from stdin; `None` at end of input.
async fn read_answer() -> Result<Option<String>> {
    tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        let n = std::io::stdin().lock().read_line(&mut line)?;
        Ok::<_, std::io::Error>((n > 0).then_some(line))
    })
    .await?
    .map_err(Into::into)
}

/// Shows every pending approval of the session and asks y/N for each; the answer is sent with
/// the digest that was shown. False when stdin ended: the approval is left pending.
async fn answer_approvals(caller: Caller<'_>, session_id: &str) -> Result<bool> {
    let _open = typeahead::Opened::new();
    let listed = match caller
        .call("approval::list", json!({ "session_id": session_id }))
        .await
    {
        Ok(v) => v,
        Err(e) => {
            eprintln!("[cannot list approvals: {e}]");
            return Ok(true);
        }
    };
    for a in listed["approvals"].as_array().cloned().unwrap_or_default() {
        let id = a["approval_id"].as_str().unwrap_or_default();
        let arguments =
            serde_json::to_string_pretty(&a["arguments"]).unwrap_or_else(|_| "null".into());
        println!(
            "\n[approval needed] call {} of {} with arguments:",
            a["function_call_id"].as_str().unwrap_or_default(),
            a["function_id"].as_str().unwrap_or_default(),
        );
        for line in arguments.lines() {
            println!("    {line}");
        }
        print!("Approve? [y/N] ");
        let _ = std::io::stdout().flush();
        let Some(answer) = read_answer().await? else {
            println!(
                "\n[no answer: approval {id} stays pending; decide it with `harness call approval::decide`]"
            );
            return Ok(false);
        };
        if !std::io::IsTerminal::is_terminal(&std::io::stdin()) {
            println!("{}", answer.trim()); // a terminal echoed it already
        }
        let yes = matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes");
        let mut decision = json!({"approval_id": id, "digest": a["digest"],
                                  "decision": if yes { "approve" } else { "deny" }});
        if !yes {
            decision["reason"] = json!("denied in harness chat");
        }
        match caller.call("approval::decide", decision).await {
            Ok(_) if yes => println!("[approved]"),
            Ok(_) => println!("[denied]"),
            Err(e) => println!("[approval {id} not decided: {e}]"),
        }
    }
    Ok(true)
}

// --- harness::ask: the card a turn ended on, answered on stdin --------------------------------

/// The card as numbered options per question; the UI's own "Other" is the last number.
fn render_card(card: &Value) -> String {
    let mut out = String::from("\n");
    for q in card["questions"].as_array().into_iter().flatten() {
        let multi = q["multi_select"] == json!(true);
        out.push_str(&format!(
            "\n[{}] {}{}\n",
            q["header"].as_str().unwrap_or_default(),
            q["question"].as_str().unwrap_or_default(),
            if multi {
                " (one or more, e.g. 1,3)"
            } else {
                ""
            }
        ));
        let options = q["options"].as_array().cloned().unwrap_or_default();
        for (i, o) in options.iter().enumerate() {
            out.push_str(&format!(
                "  {}. {}",
                i + 1,
                o["label"].as_str().unwrap_or_default()
            ));
            if let Some(d) = o["description"].as_str() {
                out.push_str(&format!(" — {d}"));
            }
            out.push('\n');
        }
        out.push_str(&format!(
            "  {}. Other (type your answer)\n",
            options.len() + 1
        ));
    }
    out
}

/// One question's answer line from what the user typed: option numbers (several when the
/// question allows it), or free text for "Other".
fn answer_line(question: &Value, typed: &str) -> String {
    let header = question["header"].as_str().unwrap_or_default();
    let options: Vec<&str> = question["options"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|o| o["label"].as_str())
        .collect();
    let multi = question["multi_select"] == json!(true);
    let picks: Option<Vec<&str>> = typed
        .split(',')
        .map(|t| {
            let n: usize = t.trim().parse().ok()?;
            options.get(n.checked_sub(1)?).copied()
        })
        .collect();
    let value = match picks {
        Some(p) if !p.is_empty() && (multi || p.len() == 1) => p.join(", "),
        _ => typed.trim().to_string(),
    };
    format!("{header}: {value}")
}

/// Asks each question of the card on stdin; `None` when stdin ended.
fn ask_card(card: &Value) -> Result<Option<String>> {
    let mut lines = Vec::new();
    for q in card["questions"].as_array().into_iter().flatten() {
        eprint!("{} > ", q["header"].as_str().unwrap_or_default());
        let mut line = String::new();
        if std::io::stdin().lock().read_line(&mut line)? == 0 {
            return Ok(None);
        }
        lines.push(answer_line(q, &line));
    }
    Ok(Some(lines.join("\n")))
}

/// `text` on one line, at most `max` characters.
fn clip(text: &str, max: usize) -> String {
    let line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match line.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &line[..at]),
        None => line,
    }
}

/// `--tool-choice` must name a function the model is offered, checked before anything is sent:
/// a server handed a choice it was not offered answers with an error that blames something else,
/// or ignores it. Offered means registered, matched by `--allow` (and by no `--deny`-like wall
/// the server keeps: those are refused again, per request, by the router), and offered natively
/// (`--expose native`; otherwise the model sees only `agent_trigger`).
async fn check_tool_choice(
    source: &Source,
    allow: &[String],
    expose: Option<&str>,
    function: &str,
) -> Result<()> {
    let refuse = |why: String| {
        Err(anyhow!(
            "harness/invalid_request: --tool-choice {function}: {why}"
        ))
    };
    if allow.is_empty() {
        return refuse(
            "no function is offered to the model: name it with --allow (and --expose native)"
                .into(),
        );
    }
    let mut globs = globset::GlobSetBuilder::new();
    for g in allow {
        let glob = globset::Glob::new(g)
            .map_err(|e| anyhow!("harness/invalid_request: --allow {g}: {e}"))?;
        globs.add(glob);
    }
    let globs = globs
        .build()
        .map_err(|e| anyhow!("harness/invalid_request: --allow: {e}"))?;
    let native = expose == Some("native");
    if !native {
        if function == "agent_trigger" {
            return Ok(());
        }
        return refuse(
            "functions are offered through agent_trigger unless --expose native is given; offered: agent_trigger".into(),
        );
    }
    // A server that does not list its functions to this caller: the router still refuses a
    // choice the request does not offer, per request.
    let Ok(list) = source
        .caller()
        .call("engine::functions::list", json!({}))
        .await
    else {
        return Ok(());
    };
    let mut offered: Vec<&str> = harness_bus::listed_function_ids(&list)
        .filter(|id| globs.is_match(id))
        .collect();
    offered.sort_unstable();
    offered.dedup();
    if offered.contains(&function) {
        return Ok(());
    }
    let shown = if offered.is_empty() {
        format!(
            "--allow {} matches no registered function",
            allow.join(" --allow ")
        )
    } else {
        format!("offered: {}", offered.join(", "))
    };
    refuse(format!("not a function offered to the model; {shown}"))
}

/// `provider_options` that make every generation call `function` (OpenAI chat-completions
/// shape, under the provider's id): the only way some local servers use tools at all. `auto`
/// clears them.
fn forced_tool(provider: &str, function: &str) -> Value {
    // Provider options are sticky per session: `auto` clears them, so the model decides again.
    if function == "auto" {
        return json!({});
    }
    let name = harness_router::names::encode(function);
    json!({provider: {"tool_choice": {"type": "function", "function": {"name": name}}}})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn question(multi: bool) -> Value {
        json!({"header": "Channels", "question": "Where?", "multi_select": multi,
               "options": [{"label": "Console"}, {"label": "Slack", "description": "team"}, {"label": "Mail"}]})
    }

    #[test]
    fn the_usage_line_sums_the_replies_and_says_when_it_is_an_estimate() {
        use harness_types::message::Usage;
        assert_eq!(usage_line([].iter()), None);
        let a = Usage {
            input: Some(100),
            output: Some(20),
            cost_usd: Some(0.001),
            ..Usage::default()
        };
        let b = Usage {
            input: Some(150),
            cache_read: Some(50),
            output: Some(30),
            cost_usd: Some(0.002),
            estimated: true,
            ..Usage::default()
        };
        assert_eq!(
            usage_line([a.clone(), b].iter()).unwrap(),
            "[usage: 300 in, 50 out tokens (estimated), $0.003000]"
        );
        let unpriced = Usage {
            cost_usd: None,
            ..a.clone()
        };
        assert_eq!(
            usage_line([a, unpriced].iter()).unwrap(),
            "[usage: 200 in, 40 out tokens, cost unknown]"
        );
    }

    #[test]
    fn an_answer_is_one_line_per_question_as_the_seed_describes() {
        assert_eq!(answer_line(&question(false), "2\n"), "Channels: Slack");
        assert_eq!(
            answer_line(&question(true), "1, 2"),
            "Channels: Console, Slack"
        );
        // Several picks on a single-choice question, an "Other" number or words: the text as typed.
        assert_eq!(answer_line(&question(false), "1,2"), "Channels: 1,2");
        assert_eq!(
            answer_line(&question(false), "by pigeon"),
            "Channels: by pigeon"
        );
        assert_eq!(answer_line(&question(false), "4"), "Channels: 4");
        let shown = render_card(&json!({"questions": [question(true)]}));
        assert!(shown.contains("[Channels] Where? (one or more"), "{shown}");
        assert!(shown.contains("  2. Slack — team"), "{shown}");
        assert!(shown.contains("  4. Other (type your answer)"), "{shown}");
    }
}
