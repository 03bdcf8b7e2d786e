//! Token counts per provider family.
//!
//! OpenAI's families are counted with their real BPE (`tiktoken-rs`, whose encodings are
//! compiled into the crate: nothing is downloaded). For the others no tokenizer is published, so
//! a calibrated character estimate stands in. Either count is then corrected by what the provider
//! itself reported for the previous step ([`Counter::calibrate`]): the ratio of its `usage`
//! input to our count of the same request prefix.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use harness_bus::Bus;

use harness_types::context::ModelRef;
use harness_types::message::{AgentMessage, ContentBlock};
use harness_types::router::{CountAnswer, CountRequest, ToolSpec};
use tiktoken_rs::CoreBPE;

/// Tokens of role and framing per message (OpenAI's chat format spends 3–4).
pub const PER_MESSAGE_OVERHEAD: u64 = 4;
/// An image, whatever its bytes: providers bill by size class (about a megapixel ≈ 1,600).
const IMAGE_TOKENS: u64 = 1_600;
/// Below this many counted tokens a reported usage says more about framing than about text.
const MIN_CALIBRATION_TOKENS: u64 = 256;
/// The correction is bounded: a ratio outside it means the usage was for another request.
const CORRECTION_RANGE: (f64, f64) = (0.5, 2.0);
/// Counts remembered across calls (the same history is counted at every step).
const CACHE_CAP: usize = 200_000;

/// How a family's text turns into tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Method {
    /// A real BPE.
    Bpe(&'static str),
    /// Characters per token, measured for the family.
    Estimate(&'static str, f64),
}

/// The counting method for a model, by its id first and its provider second.
pub fn method_for(model: &ModelRef) -> Method {
    let id = model.id.to_ascii_lowercase();
    let provider = model.provider.as_deref().unwrap_or("").to_ascii_lowercase();
    if let Some(t) = tiktoken_rs::tokenizer::get_tokenizer(&id) {
        return Method::Bpe(encoding_name(t));
    }
    let openai_like = ["gpt-", "o1", "o3", "o4", "chatgpt", "codex"];
    if openai_like.iter().any(|p| id.starts_with(p)) || provider == "openai" {
        // A model newer than the crate's table: the current encoding.
        return Method::Bpe("o200k_base");
    }
    if id.contains("claude") || provider == "anthropic" {
        // Claude's tokenizer is denser than cl100k on English and code.
        return Method::Estimate("anthropic", 3.5);
    }
    if id.contains("gemini") || provider == "google" || provider == "gemini" {
        return Method::Estimate("gemini", 4.0);
    }
    Method::Estimate("generic", 3.8)
}

fn encoding_name(t: tiktoken_rs::tokenizer::Tokenizer) -> &'static str {
    use tiktoken_rs::tokenizer::Tokenizer as T;
    match t {
        T::O200kHarmony => "o200k_harmony",
        T::O200kBase => "o200k_base",
        T::Cl100kBase => "cl100k_base",
        T::P50kBase => "p50k_base",
        T::P50kEdit => "p50k_edit",
        T::R50kBase | T::Gpt2 => "r50k_base",
    }
}

fn bpe(name: &str) -> &'static CoreBPE {
    match name {
        "o200k_harmony" => tiktoken_rs::o200k_harmony_singleton(),
        "cl100k_base" => tiktoken_rs::cl100k_base_singleton(),
        "p50k_base" => tiktoken_rs::p50k_base_singleton(),
        "p50k_edit" => tiktoken_rs::p50k_edit_singleton(),
        "r50k_base" => tiktoken_rs::r50k_base_singleton(),
        _ => tiktoken_rs::o200k_base_singleton(),
    }
}

/// BPE counts keyed by (encoding, text hash): a long history is re-counted at every step, and
/// encoding is the one expensive part of assembly.
fn cache() -> &'static Mutex<HashMap<u64, u64>> {
    static CACHE: OnceLock<Mutex<HashMap<u64, u64>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

fn bpe_tokens(encoding: &'static str, text: &str) -> u64 {
    if text.is_empty() {
        return 0;
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    encoding.hash(&mut h);
    text.hash(&mut h);
    let key = h.finish();
    if let Some(n) = cache().lock().ok().and_then(|c| c.get(&key).copied()) {
        return n;
    }
    let n = bpe(encoding).encode_ordinary(text).len() as u64;
    if let Ok(mut c) = cache().lock() {
        if c.len() >= CACHE_CAP {
            c.clear();
        }
        c.insert(key, n);
    }
    n
}

/// Sessions whose message counts are remembered (see [`raw_counts`]).
const COUNTED_SESSIONS: usize = 1_024;

/// Per session: the counter's name and, by position, each message's identity and raw count.
type SessionCounts = (String, Vec<(u64, u64)>);

fn counts_cache() -> &'static Mutex<HashMap<String, SessionCounts>> {
    static CACHE: OnceLock<Mutex<HashMap<String, SessionCounts>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The raw (uncorrected) count of each message of `history`. With `identities` (one per
/// message, changed whenever the message changes) and a session, a message found at the same
/// position with the same identity as in that session's previous call is not counted again: a
/// step on a long conversation counts its new messages, not its history.
pub fn raw_counts(
    counter: &Counter,
    session: Option<&str>,
    history: &[AgentMessage],
    identities: Option<&[u64]>,
) -> Vec<u64> {
    let (Some(session), Some(ids)) = (session, identities.filter(|i| i.len() == history.len()))
    else {
        return history.iter().map(|m| counter.raw_message(m)).collect();
    };
    let name = counter.name();
    let kept = counts_cache()
        .lock()
        .ok()
        .and_then(|mut c| c.remove(session));
    let mut known = match kept {
        Some((n, known)) if n == name => known,
        _ => Vec::new(),
    };
    known.truncate(history.len());
    let mut out = Vec::with_capacity(history.len());
    for (i, (m, &id)) in history.iter().zip(ids).enumerate() {
        match known.get_mut(i) {
            Some((seen, raw)) if *seen == id => out.push(*raw),
            Some(slot) => {
                *slot = (id, counter.raw_message(m));
                out.push(slot.1);
            }
            None => {
                let raw = counter.raw_message(m);
                known.push((id, raw));
                out.push(raw);
            }
        }
    }
    if let Ok(mut c) = counts_cache().lock() {
        if c.len() >= COUNTED_SESSIONS {
            c.clear();
        }
        c.insert(session.to_string(), (name, known));
    }
    out
}

/// Texts the server counted, by [`text_key`].
pub type ServerCounts = Arc<HashMap<u64, u64>>;

fn text_key(text: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut h);
    h.finish()
}

/// Server counts remembered across calls: per model (`provider\0model`), by [`text_key`]. A
/// server that cannot count is remembered by the router (it answers `null` at once), not here.
type ServerCache = HashMap<String, HashMap<u64, u64>>;

/// Models whose server counts are remembered; past it they are all forgotten.
const COUNTED_MODELS: usize = 64;

fn server_cache() -> &'static Mutex<ServerCache> {
    static CACHE: OnceLock<Mutex<ServerCache>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// `router::count-tokens`, in process when the router shares it (no JSON either way: the
/// probe runs on every step of a session whose server cannot count); `None` when nothing
/// answers.
async fn ask_router(bus: &dyn Bus, req: CountRequest, timeout: Duration) -> Option<CountAnswer> {
    const ID: &str = "router::count-tokens";
    if let Some(local) = bus.local_handler(ID) {
        let ctx = harness_bus::CallContext::default();
        return harness_bus::local::invoke(local.as_ref(), ID, Box::new(req), ctx, timeout)
            .await
            .ok();
    }
    let payload = serde_json::to_value(&req).ok()?;
    let answer = bus.call(ID, payload, Some(timeout)).await.ok()?;
    serde_json::from_value(answer).ok()
}

/// Whether the model's server counts at all (`router::count-tokens` with no texts).
async fn server_can_count(bus: &dyn Bus, model: &ModelRef) -> bool {
    let probe = CountRequest {
        provider: model.provider.clone(),
        model: model.id.clone(),
        texts: Vec::new(),
    };
    ask_router(bus, probe, Duration::from_secs(10))
        .await
        .is_some_and(|can| can.counts.is_some())
}

/// The texts of `history` and the system prompt counted by the model's server
/// (`router::count-tokens`), each text asked once per model and then remembered; `None` when
/// the server cannot count (or nothing answers), so the estimate stands in.
pub async fn server_counts(
    bus: &dyn Bus,
    model: &ModelRef,
    history: &[AgentMessage],
    system_prompt: Option<&str>,
) -> Option<ServerCounts> {
    let model_key = format!(
        "{}\u{0}{}",
        model.provider.as_deref().unwrap_or_default(),
        model.id
    );
    let counted_before = server_cache()
        .lock()
        .ok()?
        .get(&model_key)
        .is_some_and(|m| !m.is_empty());
    // Most servers cannot count: asked before the history is walked, or every step of such a
    // session hashed and looked up every text of its history to learn it again.
    if !counted_before && !server_can_count(bus, model).await {
        return None;
    }
    let mut texts: Vec<&str> = system_prompt.into_iter().collect();
    for m in history.iter().filter(|m| m.is_model_visible()) {
        for b in m.content() {
            match b {
                ContentBlock::Text { text } => texts.push(text),
                ContentBlock::FunctionResult { content, .. } => {
                    texts.extend(content.iter().filter_map(|c| match c {
                        ContentBlock::Text { text } => Some(text.as_str()),
                        _ => None,
                    }))
                }
                _ => {}
            }
        }
    }
    let mut known = HashMap::new();
    let mut missing: Vec<(u64, &str)> = Vec::new();
    {
        let cache = server_cache().lock().ok()?;
        let counted = cache.get(&model_key);
        for t in texts.into_iter().filter(|t| !t.is_empty()) {
            let k = text_key(t);
            if known.contains_key(&k) {
                continue;
            }
            match counted.and_then(|c| c.get(&k)) {
                Some(n) => {
                    known.insert(k, *n);
                }
                None => {
                    // Marks the text as seen, so a repeated one is asked once.
                    known.insert(k, 0);
                    missing.push((k, t));
                }
            }
        }
    }
    if !missing.is_empty() {
        // A server that counted before may have gone (or been replaced by one that cannot).
        if counted_before && !server_can_count(bus, model).await {
            return None;
        }
        let req = CountRequest {
            provider: model.provider.clone(),
            model: model.id.clone(),
            texts: missing.iter().map(|(_, t)| t.to_string()).collect(),
        };
        let counts = ask_router(bus, req, Duration::from_secs(60))
            .await?
            .counts?;
        if counts.len() != missing.len() {
            return None;
        }
        let mut cache = server_cache().lock().ok()?;
        if !cache.contains_key(&model_key) && cache.len() >= COUNTED_MODELS {
            cache.clear();
        }
        let counted = cache.entry(model_key).or_default();
        if counted.len() >= CACHE_CAP {
            counted.clear();
        }
        for ((k, _), n) in missing.iter().zip(counts) {
            counted.insert(*k, n);
            known.insert(*k, n);
        }
    }
    Some(Arc::new(known))
}

/// Counts text, messages and requests for one model.
#[derive(Clone, Debug)]
pub struct Counter {
    method: Method,
    correction: f64,
    /// Texts the model's server counted: used instead of the method where present.
    server: Option<ServerCounts>,
}

impl Counter {
    pub fn new(model: &ModelRef) -> Counter {
        Counter {
            method: method_for(model),
            correction: 1.0,
            server: None,
        }
    }

    /// This counter with the server's counts of some texts (see [`server_counts`]).
    pub fn with_server(mut self, server: Option<ServerCounts>) -> Counter {
        self.server = server;
        self
    }

    /// `tiktoken:<encoding>` or `estimate:<family>`; `server+…` when the model's server
    /// counted the texts it could.
    pub fn name(&self) -> String {
        let method = match self.method {
            Method::Bpe(e) => format!("tiktoken:{e}"),
            Method::Estimate(f, _) => format!("estimate:{f}"),
        };
        match self.server {
            Some(_) => format!("server+{method}"),
            None => method,
        }
    }

    pub fn correction(&self) -> f64 {
        self.correction
    }

    /// Tokens of a text, uncorrected.
    fn raw_text(&self, text: &str) -> u64 {
        if let Some(n) = self
            .server
            .as_ref()
            .filter(|_| !text.is_empty())
            .and_then(|s| s.get(&text_key(text)))
        {
            return *n;
        }
        match self.method {
            Method::Bpe(e) => bpe_tokens(e, text),
            Method::Estimate(_, chars_per_token) => {
                // Most open models' tokenizers give every digit its own token (Gemma, Llama 2,
                // Mistral): a ratio measured on prose would count dense numbers a third of
                // what they are.
                let (digits, chars) = text.chars().fold((0u64, 0u64), |(d, c), ch| {
                    if ch.is_ascii_digit() {
                        (d + 1, c)
                    } else {
                        (d, c + 1)
                    }
                });
                digits + (chars as f64 / chars_per_token).ceil() as u64
            }
        }
    }

    fn raw_block(&self, block: &ContentBlock) -> u64 {
        match block {
            ContentBlock::Text { text } => self.raw_text(text),
            ContentBlock::Thinking { text, .. } => self.raw_text(text),
            // Opaque bytes the provider decodes itself; about four base64 characters a token.
            ContentBlock::RedactedThinking { data } => data.len().div_ceil(4) as u64,
            ContentBlock::Image { .. } => IMAGE_TOKENS,
            ContentBlock::FunctionCall {
                function_id,
                arguments,
                ..
            } => self.raw_text(function_id) + self.raw_text(&arguments.to_string()) + 3,
            ContentBlock::FunctionResult { content, .. } => {
                content.iter().map(|b| self.raw_block(b)).sum()
            }
        }
    }

    pub(crate) fn raw_message(&self, message: &AgentMessage) -> u64 {
        let body: u64 = message.content().iter().map(|b| self.raw_block(b)).sum();
        let id = match message {
            AgentMessage::FunctionResult(r) => self.raw_text(&r.function_id) + 2,
            _ => 0,
        };
        PER_MESSAGE_OVERHEAD + body + id
    }

    /// A raw count, corrected.
    pub fn apply(&self, raw: u64) -> u64 {
        (raw as f64 * self.correction).ceil() as u64
    }

    pub fn text(&self, text: &str) -> u64 {
        self.apply(self.raw_text(text))
    }

    /// Tokens of one message, corrected.
    pub fn message(&self, message: &AgentMessage) -> u64 {
        self.apply(self.raw_message(message))
    }

    /// Tokens of the system prompt and the tool declarations, corrected.
    pub fn preamble(&self, system_prompt: Option<&str>, tools: &[ToolSpec]) -> u64 {
        self.apply(self.raw_preamble(system_prompt, tools))
    }

    fn raw_preamble(&self, system_prompt: Option<&str>, tools: &[ToolSpec]) -> u64 {
        let tools: u64 = tools
            .iter()
            .map(|t| {
                self.raw_text(&t.name)
                    + self.raw_text(&t.description)
                    + self.raw_text(&t.parameters.to_string())
                    + 8
            })
            .sum();
        system_prompt.map_or(0, |p| self.raw_text(p) + PER_MESSAGE_OVERHEAD) + tools
    }

    /// Tokens of a whole request (without the caller's overhead), corrected.
    pub fn request(
        &self,
        messages: &[AgentMessage],
        system_prompt: Option<&str>,
        tools: &[ToolSpec],
    ) -> u64 {
        self.preamble(system_prompt, tools) + messages.iter().map(|m| self.message(m)).sum::<u64>()
    }

    /// Corrects the count by the usage the provider reported for the latest assistant message
    /// of `messages`: that message was generated from the same preamble and the messages before
    /// it, so `reported / counted` is how far off this counter is for this conversation.
    pub fn calibrate(
        &mut self,
        messages: &[&AgentMessage],
        system_prompt: Option<&str>,
        tools: &[ToolSpec],
        overhead: u64,
    ) {
        self.calibrate_counted(messages, &[], system_prompt, tools, overhead)
    }

    /// [`calibrate`](Counter::calibrate) with the raw counts already known for some messages
    /// (`known[i]` for `messages[i]`, where present).
    pub fn calibrate_counted(
        &mut self,
        messages: &[&AgentMessage],
        known: &[Option<u64>],
        system_prompt: Option<&str>,
        tools: &[ToolSpec],
        overhead: u64,
    ) {
        self.calibrate_by(
            messages.len(),
            |i| (messages[i], known.get(i).copied().flatten()),
            system_prompt,
            tools,
            overhead,
        )
    }

    /// [`calibrate_counted`](Counter::calibrate_counted) over `len` messages given by index
    /// (each with its raw count where known), so a caller need not collect them first.
    pub(crate) fn calibrate_by<'m>(
        &mut self,
        len: usize,
        message: impl Fn(usize) -> (&'m AgentMessage, Option<u64>),
        system_prompt: Option<&str>,
        tools: &[ToolSpec],
        overhead: u64,
    ) {
        let Some((at, reported)) = (0..len).rev().find_map(|i| match message(i).0 {
            AgentMessage::Assistant(a) => a.usage.as_ref().and_then(|u| {
                let input =
                    u.input.unwrap_or(0) + u.cache_read.unwrap_or(0) + u.cache_write.unwrap_or(0);
                (!u.estimated && input > 0).then_some((i, input))
            }),
            _ => None,
        }) else {
            return;
        };
        let counted = self.raw_preamble(system_prompt, tools)
            + (0..at)
                .map(|i| match message(i) {
                    (_, Some(raw)) => raw,
                    (m, None) => self.raw_message(m),
                })
                .sum::<u64>();
        if counted < MIN_CALIBRATION_TOKENS {
            return;
        }
        let reported = reported.saturating_sub(overhead) as f64;
        let ratio = reported / counted as f64;
        if (CORRECTION_RANGE.0..=CORRECTION_RANGE.1).contains(&ratio) {
            self.correction = ratio;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness_types::message::{AssistantMessage, Usage};

    fn model(id: &str, provider: Option<&str>) -> ModelRef {
        ModelRef {
            id: id.into(),
            provider: provider.map(str::to_string),
        }
    }

    #[test]
    fn openai_models_use_their_bpe() {
        assert_eq!(
            method_for(&model("gpt-4o", None)),
            Method::Bpe("o200k_base")
        );
        assert_eq!(
            method_for(&model("gpt-4", None)),
            Method::Bpe("cl100k_base")
        );
        // Unknown to the crate's table but an OpenAI model: the current encoding.
        assert_eq!(
            method_for(&model("gpt-99-preview", Some("openai"))),
            Method::Bpe("o200k_base")
        );
        assert!(matches!(
            method_for(&model("claude-sonnet-4-5", Some("anthropic"))),
            Method::Estimate("anthropic", _)
        ));
        assert!(matches!(
            method_for(&model("scripted", Some("scripted"))),
            Method::Estimate("generic", _)
        ));
    }

    #[test]
    fn bpe_counts_are_real_token_counts() {
        let c = Counter::new(&model("gpt-4o", None));
        // "hello world" is two tokens in o200k_base; a character estimate would say 3.
        assert_eq!(c.text("hello world"), 2);
        // Repeated text is served from the cache with the same answer.
        assert_eq!(c.text("hello world"), 2);
        let c = Counter::new(&model("gpt-4", None));
        assert_eq!(c.text("tiktoken is great!"), 6);
    }

    #[test]
    fn estimate_uses_the_family_ratio() {
        let c = Counter::new(&model("claude-x", Some("anthropic")));
        assert_eq!(c.text(&"a".repeat(35)), 10);
        let c = Counter::new(&model("local", None));
        assert_eq!(c.text(&"a".repeat(38)), 10);
    }

    fn answered(input: u64, estimated: bool) -> AgentMessage {
        AgentMessage::Assistant(AssistantMessage {
            usage: Some(Usage {
                input: Some(input),
                estimated,
                ..Usage::default()
            }),
            ..AssistantMessage::ended(vec![ContentBlock::text("ok")], "m", "p", 0)
        })
    }

    #[test]
    fn reported_usage_corrects_the_count() {
        let history = vec![
            AgentMessage::user_text("x".repeat(3800), 0),
            answered(1500, false),
            AgentMessage::user_text("y".repeat(380), 0),
        ];
        let mut c = Counter::new(&model("local", None));
        let before = c.request(&history, None, &[]);
        c.calibrate(&history.iter().collect::<Vec<_>>(), None, &[], 0);
        // Our count of the first message was 1000 + 4; the provider said 1500.
        let ratio = 1500.0 / 1004.0;
        assert!((c.correction() - ratio).abs() < 1e-9, "{}", c.correction());
        assert!(c.request(&history, None, &[]) > before);
        // An estimated usage (the router's own guess) corrects nothing.
        let mut c = Counter::new(&model("local", None));
        c.calibrate(&[&history[0], &answered(1500, true)], None, &[], 0);
        assert_eq!(c.correction(), 1.0);
        // A ratio far outside the plausible range is ignored.
        let mut c = Counter::new(&model("local", None));
        c.calibrate(&[&history[0], &answered(90_000, false)], None, &[], 0);
        assert_eq!(c.correction(), 1.0);
    }
}
