//! `context::assemble` and `context::count-tokens`: the model's context within a token budget.
//!
//! * [`count`]: tokens per provider family (a real BPE for OpenAI's, a calibrated estimate for
//!   the rest), corrected by the usage the provider reported for the previous step.
//! * [`prune`]: aged, oversized function results shortened, where the context policy allows.
//! * [`compact`]: the head summarized by the session's own model through `router::chat`.
//!
//! Assembly, in order: the history as given (a previous summary back after the opening
//! message); if it does not fit the usable budget (window − output reservation − prompt, tools
//! and the caller's overhead), pruning; if it still does not fit, compaction; if even the
//! compacted context does not fit, a `context/overflow:` error. A compaction is reported in
//! `applied` and persisted by the caller (the loop writes it as a custom entry with a
//! deterministic id), so a crash between the summary and its record costs one more summary and
//! never a message.
//!
//! Architecture invariant: the only I/O is the summarizer's `router::chat` call on the bus.

use std::borrow::Cow;
use std::sync::{Arc, Weak};
use std::time::Duration;

use harness_bus::{Bus, BusError, CallContext, FunctionDef, Handler, LocalHandler, LocalValue};
use harness_types::context::{
    Applied, AssembleCall, AssembleOptions, AssembleRequest, AssembleResponse, CountTokensRequest,
    CountTokensResponse,
};
use harness_types::message::AgentMessage;
use harness_types::parse::parse_payload;
use harness_types::router::ToolSpec;
use schemars::schema_for;
use serde::Deserialize;
use serde_json::Value;

pub mod compact;
pub mod count;
mod error;
pub mod prune;

pub use count::Counter;
pub use error::{too_large_index, ContextError, MESSAGE_TOO_LARGE_PREFIX};

/// The summarizer's `router::chat` budget.
const SUMMARY_TIMEOUT: Duration = Duration::from_secs(300);

/// `context::count-tokens`.
pub fn count_tokens(req: &CountTokensRequest) -> CountTokensResponse {
    let mut counter = Counter::new(&req.model);
    let messages: Vec<&AgentMessage> = req.messages.iter().collect();
    counter.calibrate(&messages, req.system_prompt.as_deref(), &req.tools, 0);
    CountTokensResponse {
        tokens: counter.request(&req.messages, req.system_prompt.as_deref(), &req.tools),
        counter: counter.name(),
        correction: counter.correction(),
    }
}

/// One message of the working list: its index in the request (`None` for a summary), borrowed
/// until something changes it.
struct Item<'a> {
    origin: Option<usize>,
    message: Cow<'a, AgentMessage>,
    /// The raw count of the message as sent (reused while it is borrowed).
    raw: Option<u64>,
}

impl Item<'_> {
    fn known_raw(&self) -> Option<u64> {
        self.raw
            .filter(|_| matches!(self.message, Cow::Borrowed(_)))
    }
}

fn total(items: &[Item<'_>], counter: &Counter) -> u64 {
    items
        .iter()
        .map(|i| match i.known_raw() {
            Some(raw) => counter.apply(raw),
            None => counter.message(&i.message),
        })
        .sum()
}

/// `context::assemble`. `bus` is where the summarizer is asked; without one, a history that
/// does not fit after pruning is an overflow.
pub async fn assemble(
    bus: Option<&dyn Bus>,
    mut req: AssembleRequest,
) -> Result<AssembleResponse, ContextError> {
    let messages = std::mem::take(&mut req.messages);
    assemble_over(bus, &messages, req).await
}

/// [`assemble`] over a history the caller keeps (`req.messages` is ignored): nothing is copied
/// unless pruning or compaction changes it.
pub async fn assemble_over(
    bus: Option<&dyn Bus>,
    history: &[AgentMessage],
    req: AssembleRequest,
) -> Result<AssembleResponse, ContextError> {
    assemble_known(bus, history, None, req).await
}

/// [`assemble_over`] with an identity per message (see [`AssembleCall::identities`]): the
/// counts of messages already seen in this session are reused.
pub async fn assemble_known(
    bus: Option<&dyn Bus>,
    history: &[AgentMessage],
    identities: Option<&[u64]>,
    req: AssembleRequest,
) -> Result<AssembleResponse, ContextError> {
    let o = req.options;
    // The server's own counts where it can give them (cached per text, so a step asks only
    // for its new messages); else the family estimate.
    let server = match bus {
        Some(bus) => {
            count::server_counts(bus, &req.model, history, req.system_prompt.as_deref()).await
        }
        None => None,
    };
    let mut counter = Counter::new(&req.model).with_server(server);
    let raws = count::raw_counts(&counter, o.lease_key.as_deref(), history, identities);
    let usable = o.context_window.saturating_sub(o.max_output_tokens);
    let now = harness_types::now_ms();
    if let Some(fit) = fits_as_sent(
        &counter,
        history,
        &raws,
        &o,
        (req.system_prompt.as_ref(), &req.tools),
        usable,
        now,
    ) {
        return Ok(fit);
    }
    let model = req.model;
    let sent = history.len();
    let mut items: Vec<Item<'_>> = history
        .iter()
        .enumerate()
        .filter(|(_, m)| m.is_model_visible())
        .map(|(i, message)| Item {
            origin: Some(i),
            message: Cow::Borrowed(message),
            raw: raws.get(i).copied(),
        })
        .collect();
    // Every message as sent is model-visible: a fit can be answered `unchanged`.
    let as_sent = items.len() == sent;
    // The opening message is always kept; a previous summary goes right after it.
    let pinned = usize::from(matches!(
        items.first().map(|i| i.message.as_ref()),
        Some(AgentMessage::User(_))
    ));
    if let Some(prev) = &o.previous_summary {
        items.insert(
            pinned,
            Item {
                origin: None,
                message: Cow::Owned(compact::summary_message(&prev.summary, now)),
                raw: None,
            },
        );
    }
    let working: Vec<&AgentMessage> = items.iter().map(|i| i.message.as_ref()).collect();
    let known: Vec<Option<u64>> = items.iter().map(Item::known_raw).collect();
    counter.calibrate_counted(
        &working,
        &known,
        req.system_prompt.as_deref(),
        &req.tools,
        o.request_overhead_tokens,
    );
    drop(working);
    let preamble =
        counter.preamble(req.system_prompt.as_deref(), &req.tools) + o.request_overhead_tokens;
    let budget = usable.saturating_sub(preamble);
    let initial = total(&items, &counter);
    let mut applied = Applied {
        initial_token_count: initial + preamble,
        reused_summary: o.previous_summary.is_some(),
        ..Applied::default()
    };
    let respond =
        |items: Vec<Item<'_>>, tokens: u64, applied: Applied, counter: &Counter| AssembleResponse {
            system_prompt: req.system_prompt.clone(),
            messages: items.into_iter().map(|i| i.message.into_owned()).collect(),
            unchanged: false,
            token_count: tokens + preamble,
            usable,
            effective_max_output_tokens: o.max_output_tokens,
            applied,
            counter: Some(counter.name()),
            correction: Some(counter.correction()),
        };
    if preamble <= usable && initial <= budget {
        // The caller rebuilds this context itself (its list, the summary put back where
        // `summary_position` says), so a fit is not serialized back.
        if as_sent {
            let mut resp = respond(Vec::new(), initial, applied, &counter);
            resp.unchanged = true;
            return Ok(resp);
        }
        return Ok(respond(items, initial, applied, &counter));
    }
    let mut tokens = initial;
    if o.prune_function_results {
        let mut messages: Vec<AgentMessage> =
            items.iter().map(|i| i.message.as_ref().clone()).collect();
        applied.pruned_results = prune::prune(&mut messages, &counter);
        for (item, m) in items.iter_mut().zip(messages) {
            item.message = Cow::Owned(m);
        }
        tokens = total(&items, &counter);
        if preamble <= usable && tokens <= budget {
            return Ok(respond(items, tokens, applied, &counter));
        }
    }
    let overflow = |needs: u64| {
        ContextError::Overflow(format!(
            "the conversation needs ~{needs} tokens but model '{}' has {usable} usable",
            model.id
        ))
    };
    // A user message that cannot fit even alone would be sent again at every step (and every
    // later send) and fail each time: it is refused, naming its size and the window.
    let too_large = items
        .iter()
        .filter(|i| matches!(i.message.as_ref(), AgentMessage::User(_)))
        .filter_map(|i| Some((i.origin?, counter.message(&i.message))))
        .find(|(_, t)| *t > budget);
    if let (Some((index, tokens)), true) = (too_large, preamble <= usable) {
        return Err(ContextError::MessageTooLarge {
            index,
            tokens,
            model: model.id.clone(),
            window: o.context_window,
            usable: budget,
        });
    }
    if preamble > usable {
        return Err(ContextError::Overflow(format!(
            "the system prompt, tools and request framing alone need ~{preamble} tokens but model '{}' has {usable} usable",
            model.id
        )));
    }
    let Some(bus) = bus.filter(|_| !o.no_compaction) else {
        return Err(overflow(tokens + preamble));
    };
    let reserve = compact::summary_reserve(budget);
    let pinned_tokens: u64 = items[..pinned]
        .iter()
        .map(|i| counter.message(&i.message))
        .sum();
    let first = pinned + usize::from(o.previous_summary.is_some());
    let target = budget.saturating_sub(pinned_tokens + reserve) / 2;
    let messages: Vec<AgentMessage> = items.iter().map(|i| i.message.as_ref().clone()).collect();
    let Some(at) = compact::tail_start(&messages, first, target, &counter) else {
        return Err(ContextError::Overflow(format!(
            "nothing is left to summarize and the latest exchange alone needs ~{} tokens; model '{}' has {usable} usable",
            tokens + preamble,
            model.id
        )));
    };
    let head = &messages[first..at];
    let head_tokens: u64 = messages[pinned..at]
        .iter()
        .map(|m| counter.message(m))
        .sum();
    let input = compact::summarizer_input(
        o.previous_summary.as_ref().map(|p| p.summary.as_str()),
        head,
        budget.saturating_sub(reserve),
        &counter,
    );
    let request_id = o
        .summary_request_id
        .clone()
        .unwrap_or_else(|| format!("context:{}", harness_types::ids::new_turn_id()));
    let (summary, summary_usage) = compact::summarize(
        bus,
        &model,
        o.lease_key.clone(),
        request_id,
        input,
        reserve,
        SUMMARY_TIMEOUT,
    )
    .await?;
    let tail_origin = items[at].origin;
    let mut kept: Vec<Item> = items.drain(..pinned).collect();
    kept.push(Item {
        origin: None,
        message: Cow::Owned(compact::summary_message(&summary, now)),
        raw: None,
    });
    kept.extend(items.drain(..).skip(at - pinned));
    let tokens = total(&kept, &counter);
    if tokens > budget {
        return Err(ContextError::Overflow(format!(
            "even the compacted conversation needs ~{} tokens but model '{}' has {usable} usable",
            tokens + preamble,
            model.id
        )));
    }
    applied.compacted = true;
    applied.summary = Some(summary);
    applied.summary_usage = summary_usage;
    applied.tail_start_index = tail_origin;
    applied.tokens_before = Some(initial + preamble);
    applied.summarized_head_tokens = Some(head_tokens);
    Ok(respond(kept, tokens, applied, &counter))
}

/// The answer for a history whose every message is model-visible and which fits as sent
/// (`unchanged`), from the messages' raw counts alone; `None` when it does not, and the full
/// assembly runs. This is every step of a conversation that fits: the working list of
/// [`assemble_known`] (a copy of each message's slot) is built only when something must change,
/// so a step on a long history costs a pass over its counts, not a copy of it.
fn fits_as_sent(
    counter: &Counter,
    history: &[AgentMessage],
    raws: &[u64],
    o: &AssembleOptions,
    (system_prompt, tools): (Option<&String>, &[ToolSpec]),
    usable: u64,
    now: i64,
) -> Option<AssembleResponse> {
    if raws.len() != history.len() || !history.iter().all(AgentMessage::is_model_visible) {
        return None;
    }
    // The working list is the history with a previous summary right after the opening message.
    let summary = o
        .previous_summary
        .as_ref()
        .map(|p| compact::summary_message(&p.summary, now));
    let pinned = usize::from(matches!(history.first(), Some(AgentMessage::User(_))));
    let at = |i: usize| -> (&AgentMessage, Option<u64>) {
        match (&summary, i.cmp(&pinned)) {
            (Some(s), std::cmp::Ordering::Equal) => (s, None),
            (Some(_), std::cmp::Ordering::Greater) => (&history[i - 1], Some(raws[i - 1])),
            _ => (&history[i], Some(raws[i])),
        }
    };
    // Calibrated apart: when this does not fit, the full assembly calibrates its own list.
    let mut counter = counter.clone();
    let system_prompt_text = system_prompt.map(String::as_str);
    counter.calibrate_by(
        history.len() + usize::from(summary.is_some()),
        at,
        system_prompt_text,
        tools,
        o.request_overhead_tokens,
    );
    let preamble = counter.preamble(system_prompt_text, tools) + o.request_overhead_tokens;
    let initial = raws.iter().map(|&raw| counter.apply(raw)).sum::<u64>()
        + summary.as_ref().map_or(0, |s| counter.message(s));
    if preamble > usable || initial > usable - preamble {
        return None;
    }
    Some(AssembleResponse {
        system_prompt: system_prompt.cloned(),
        messages: Vec::new(),
        unchanged: true,
        token_count: initial + preamble,
        usable,
        effective_max_output_tokens: o.max_output_tokens,
        applied: Applied {
            initial_token_count: initial + preamble,
            reused_summary: o.previous_summary.is_some(),
            ..Applied::default()
        },
        counter: Some(counter.name()),
        correction: Some(counter.correction()),
    })
}

/// Registers `context::assemble` and `context::count-tokens` on `bus`. The summarizer calls
/// back into the same bus; the handler holds it weakly so the bus does not own itself.
pub fn register(bus: Arc<dyn Bus>) {
    let weak: Weak<dyn Bus> = Arc::downgrade(&bus);
    let assemble_handler = move |payload: Value, _ctx: CallContext| {
        let weak = weak.clone();
        async move {
            // The strict parser names a bad field; a well-formed request (every step's) skips
            // its bookkeeping and is read in place.
            let req = match AssembleRequest::deserialize(&payload) {
                Ok(req) => req,
                Err(_) => parse_payload::<AssembleRequest>(payload)?,
            };
            let bus = weak.upgrade();
            let resp = assemble(bus.as_deref(), req)
                .await
                .map_err(BusError::from)?;
            serde_json::to_value(resp).map_err(|e| BusError::internal(e.to_string()))
        }
    };
    let weak: Weak<dyn Bus> = Arc::downgrade(&bus);
    let local = move |payload: LocalValue, _ctx: CallContext| {
        let weak = weak.clone();
        async move {
            let call: AssembleCall = harness_bus::local::take("context::assemble", payload)?;
            let bus = weak.upgrade();
            let resp = assemble_known(
                bus.as_deref(),
                &call.messages,
                call.identities.as_deref().map(Vec::as_slice),
                call.request,
            )
            .await
            .map_err(BusError::from)?;
            Ok(Box::new(resp) as LocalValue)
        }
    };
    bus.register_function_with_local(
        FunctionDef::new(
            "context::assemble",
            "Assemble the model's context within the token budget: counted per provider family, \
             aged oversized function results pruned where allowed, the head summarized when it does not fit.",
        )
        .schemas(
            serde_json::to_value(schema_for!(AssembleRequest)).unwrap_or(Value::Null),
            serde_json::to_value(schema_for!(AssembleResponse)).unwrap_or(Value::Null),
        )
        .internal(),
        Arc::new(assemble_handler) as Arc<dyn Handler>,
        Arc::new(local) as Arc<dyn LocalHandler>,
    );
    let count_handler = |payload: Value, _ctx: CallContext| async move {
        let req: CountTokensRequest = parse_payload(payload)?;
        serde_json::to_value(count_tokens(&req)).map_err(|e| BusError::internal(e.to_string()))
    };
    bus.register_function(
        FunctionDef::new(
            "context::count-tokens",
            "Count the tokens of a request for a model (its provider family's tokenizer or a calibrated estimate).",
        )
        .schemas(
            serde_json::to_value(schema_for!(CountTokensRequest)).unwrap_or(Value::Null),
            serde_json::to_value(schema_for!(CountTokensResponse)).unwrap_or(Value::Null),
        )
        .internal(),
        Arc::new(count_handler) as Arc<dyn Handler>,
    );
}

#[cfg(test)]
mod fixtures;
#[cfg(test)]
mod tests;
