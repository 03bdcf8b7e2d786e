//! `harness chat`: send a message, stream the reply as it arrives, repeat.

use std::io::{BufRead, Write};

use anyhow::{anyhow, Result};
use futures::StreamExt;
use harness_types::message::joined_text;
use harness_types::session::Entry;
use serde_json::{json, Value};

use crate::runtime::{Runtime, RuntimeOptions};

pub struct ChatArgs {
    pub message: Option<String>,
    pub session: Option<String>,
    pub provider: String,
    pub model: String,
    pub url: Option<String>,
    pub runtime: RuntimeOptions,
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

    /// Follows the session's events until the turn ends, printing the reply as it grows.
    async fn follow(&mut self, session_id: &str, turn_id: &str) -> Result<()> {
        let mut printer = Printer {
            turn_id: turn_id.to_string(),
            printed: Default::default(),
        };
        match self {
            Source::Local { rt, after } => {
                let mut changes = rt.store.subscribe_events();
                loop {
                    for row in rt.store.events_after(session_id, *after, 256)? {
                        *after = row.id;
                        let data = crate::http::event_json(&rt.sessions, &row);
                        if printer.on_event(&row.topic, &data) {
                            return Ok(());
                        }
                    }
                    changes
                        .changed()
                        .await
                        .map_err(|_| anyhow!("the runtime stopped"))?;
                }
            }
            Source::Remote { url } => {
                let endpoint = format!(
                    "{}/v1/sessions/{}/events",
                    url.trim_end_matches('/'),
                    session_id
                );
                let resp = reqwest::get(&endpoint).await?;
                if !resp.status().is_success() {
                    return Err(anyhow!("{endpoint}: HTTP {}", resp.status()));
                }
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
                                return Ok(());
                            }
                        }
                    }
                }
                Err(anyhow!("the event stream ended before the turn did"))
            }
        }
    }
}

struct Printer {
    turn_id: String,
    printed: std::collections::HashMap<String, usize>,
}

impl Printer {
    /// Prints what is new; true when the turn is over.
    fn on_event(&mut self, topic: &str, data: &Value) -> bool {
        if topic.starts_with("session::message-") {
            let Ok(entry) = serde_json::from_value::<Entry>(data["entry"].clone()) else {
                return false;
            };
            let Some(harness_types::AgentMessage::Assistant(m)) = &entry.message else {
                return false;
            };
            if !entry.entry_id.starts_with(&format!("e_{}_", self.turn_id)) {
                return false;
            }
            let text = joined_text(&m.content);
            let done = self.printed.entry(entry.entry_id.clone()).or_insert(0);
            if text.len() > *done && text.is_char_boundary(*done) {
                print!("{}", &text[*done..]);
                let _ = std::io::stdout().flush();
                *done = text.len();
            }
            return false;
        }
        if topic == "harness::turn-completed" && data["payload"]["turn_id"] == json!(self.turn_id) {
            let p = &data["payload"];
            match p["status"].as_str() {
                Some("failed") => println!(
                    "\n[turn failed: {}]",
                    p["result_error"].as_str().unwrap_or("unknown error")
                ),
                Some("cancelled") => println!("\n[stopped]"),
                _ => println!(),
            }
            return true;
        }
        false
    }
}

pub async fn run(args: ChatArgs) -> Result<()> {
    let mut source = match &args.url {
        Some(url) => Source::Remote { url: url.clone() },
        None => Source::Local {
            rt: Runtime::open(args.runtime).await?,
            after: 0,
        },
    };
    let mut session = args.session.clone();
    let interactive = args.message.is_none();
    if interactive {
        eprintln!(
            "harness chat — provider {} model {}. Type a message; /quit to leave.",
            args.provider, args.model
        );
    }
    let stdin = std::io::stdin();
    let mut pending = args.message.clone();
    loop {
        let text = match pending.take() {
            Some(t) => t,
            None if interactive => {
                eprint!("> ");
                let mut line = String::new();
                if stdin.lock().read_line(&mut line)? == 0 {
                    break;
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
        let mut payload = json!({"message": text, "model": args.model, "provider": args.provider});
        if let Some(s) = &session {
            payload["session_id"] = json!(s);
        }
        let resp = source.send(payload).await?;
        let sid = resp["session_id"].as_str().unwrap_or_default().to_string();
        let tid = resp["turn_id"].as_str().unwrap_or_default().to_string();
        if session.is_none() && interactive {
            eprintln!("(session {sid})");
        }
        session = Some(sid.clone());
        source.follow(&sid, &tid).await?;
        if !interactive {
            break;
        }
    }
    if let Source::Local { rt, .. } = &source {
        rt.shutdown().await;
    }
    Ok(())
}
