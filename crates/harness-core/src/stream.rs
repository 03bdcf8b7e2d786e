//! One generation: call `router::chat`, fold its frames into the pre-appended assistant entry
//! with coalesced `session::update-message` writes, and end with exactly one outcome.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use harness_types::fold::FrameFold;
use harness_types::message::{AssistantMessage, ContentBlock, ErrorKind, StopReason};
use harness_types::router::{
    ChatAck, ChatAckError, ChatCall, ChatExtras, ChatRequest, Frame, FrameTap,
};
use harness_types::session::{UpdateMessageRequest, UpdateMessageResponse};
use harness_types::HarnessError;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::first_write::FirstWrite;
use crate::harness::{Harness, Result, StepWrites};

/// How a generation ended.
pub(crate) struct Generation {
    pub message: AssistantMessage,
    /// Set when the provider failed; the message holds the partial output.
    pub error: Option<GenerationError>,
}

pub(crate) use crate::record::GenerationError;

impl Generation {
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }

    /// True when something the user could see was streamed before the failure.
    pub fn has_partial(&self) -> bool {
        self.message.content.iter().any(|b| match b {
            ContentBlock::Text { text } | ContentBlock::Thinking { text, .. } => {
                !text.trim().is_empty()
            }
            _ => true,
        })
    }
}

/// The answer as it streams: its blocks (one fold for the router and the loop) and its usage.
struct Accumulator {
    content: Vec<ContentBlock>,
    fold: FrameFold,
    usage: Option<harness_types::message::Usage>,
}

impl Accumulator {
    /// True when the content changed, so a partial write is due.
    fn apply(&mut self, frame: &Frame) -> bool {
        if let Frame::Usage { usage } = frame {
            self.usage = Some(usage.clone());
            return false;
        }
        self.fold.apply(&mut self.content, frame)
    }
}

/// A generation's frames: typed from the router in process, JSON from any other.
enum Frames {
    Typed(tokio::sync::mpsc::UnboundedReceiver<Frame>),
    Json(tokio::sync::mpsc::UnboundedReceiver<Value>),
}

impl Frames {
    /// The next frame (a JSON one that does not parse is skipped); `None` once the stream
    /// ended. Cancel-safe: nothing is taken off the channel without being answered.
    async fn next(&mut self) -> Option<Frame> {
        match self {
            Frames::Typed(rx) => rx.recv().await,
            Frames::Json(rx) => loop {
                if let Ok(frame) = serde_json::from_value::<Frame>(rx.recv().await?) {
                    return Some(frame);
                }
            },
        }
    }
}

/// `router::chat`'s answer as it arrived: typed in process, JSON (parsed only when read)
/// otherwise.
enum Acked {
    Typed(Box<ChatAck>),
    Json(Value),
}

impl Acked {
    fn error(self) -> Option<ChatAckError> {
        match self {
            Acked::Typed(ack) => ack.error,
            Acked::Json(v) => serde_json::from_value::<ChatAck>(v).ok()?.error,
        }
    }
}

type AckFuture =
    Pin<Box<dyn Future<Output = std::result::Result<Acked, harness_bus::BusError>> + Send>>;

impl Harness {
    async fn write_stream(
        &self,
        session_id: &str,
        entry_id: &str,
        message: &AssistantMessage,
        details: Option<Value>,
    ) -> Result<()> {
        let _: UpdateMessageResponse = self
            .call(
                "session::update-message",
                &stream_update(session_id, entry_id, message, details),
            )
            .await?;
        Ok(())
    }

    /// Streams one generation into `entry_id`. Bus failures (no router, a dropped link) are step
    /// errors; provider failures are a `Generation` with `error` set. The entry's final write is
    /// added to `last`, not written: the caller commits it with its next batch. `first`, the
    /// step's held first write, is committed once its time is up or before the first partial
    /// write, whichever comes first (`first_write.rs`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn generate(
        &self,
        req: ChatRequest,
        extras: ChatExtras,
        session_id: &str,
        entry_id: &str,
        cancel: CancellationToken,
        first: &mut FirstWrite,
        last: &mut StepWrites,
    ) -> Result<Generation> {
        let c = self.config();
        let model = req.model.clone();
        let provider = req.provider.clone().unwrap_or_default();
        let request_id = req.request_id.clone();
        // Timed only while telemetry is installed (`crate::trace`).
        let gen_start = self.marking().then(crate::trace::now_us);
        let mut first_chunk = None;
        let timeout = Duration::from_millis(c.router_timeout_ms);
        let (mut frames, result): (Frames, AckFuture) =
            match self.inner.bus.local_handler("router::chat") {
                // In-process: the conversation moves to the router and the frames come back as
                // they are, neither turned into JSON.
                Some(local) => {
                    let (tx, frames) = tokio::sync::mpsc::unbounded_channel();
                    let tap = FrameTap::new(move |frame| {
                        let _ = tx.send(frame);
                    });
                    let result = Box::pin(async move {
                        let ack = harness_bus::local::invoke::<ChatAck>(
                            local.as_ref(),
                            "router::chat",
                            Box::new(ChatCall {
                                request: req,
                                extras,
                                frames: Some(tap),
                            }),
                            harness_bus::CallContext::default(),
                            timeout,
                        )
                        .await?;
                        Ok(Acked::Typed(Box::new(ack)))
                    });
                    (Frames::Typed(frames), result)
                }
                None => {
                    let payload = extras
                        .payload(&req)
                        .map_err(|e| HarnessError::internal(e.to_string()))?;
                    let call = self
                        .inner
                        .bus
                        .call_streaming("router::chat", payload, Some(timeout))
                        .await
                        .map_err(|e| e.into_harness())?;
                    let result = call.result;
                    (
                        Frames::Json(call.frames),
                        Box::pin(async move { result.await.map(Acked::Json) }),
                    )
                }
            };
        let coalesce = Duration::from_millis(c.stream_coalesce_ms);
        let mut acc = Accumulator {
            content: Vec::new(),
            fold: FrameFold::default(),
            usage: None,
        };
        let mut terminal: Option<Frame> = None;
        let mut last_write = Instant::now();
        let mut dirty = false;
        let mut abort_sent = false;
        let mut result = Some(result);
        let mut ack: Option<std::result::Result<Acked, harness_bus::BusError>> = None;
        let due = tokio::time::sleep_until(first.until());
        tokio::pin!(due);
        loop {
            tokio::select! {
                _ = &mut due, if first.is_held() => {
                    self.release_first(first).await?;
                }
                frame = frames.next() => {
                    let Some(frame) = frame else { break };
                    if frame.is_terminal() {
                        terminal = Some(frame);
                        continue;
                    }
                    if acc.apply(&frame) {
                        if gen_start.is_some() && first_chunk.is_none() {
                            first_chunk = Some(crate::trace::now_us());
                        }
                        dirty = true;
                        if last_write.elapsed() >= coalesce {
                            self.release_first(first).await?;
                            let partial = partial_message(&acc, &model, &provider);
                            self.write_stream(session_id, entry_id, &partial, None).await?;
                            last_write = Instant::now();
                            dirty = false;
                        }
                    }
                }
                r = async { result.as_mut().expect("result polled after completion").await }, if result.is_some() => {
                    result = None;
                    ack = Some(r);
                }
                _ = cancel.cancelled(), if !abort_sent => {
                    abort_sent = true;
                    // Best effort: the provider stops and sends its terminal frame.
                    let _ = self.inner.bus.call("router::abort", json!({"request_id": request_id}), Some(Duration::from_secs(2))).await;
                }
            }
        }
        let ack = match ack {
            Some(a) => a,
            None => match result {
                Some(r) => r.await,
                None => Err(harness_bus::BusError::internal(
                    "router::chat ended without an answer",
                )),
            },
        };
        let _ = dirty;
        let gen = match (terminal, ack) {
            (Some(Frame::Done { mut message }), _) => {
                if message.usage.is_none() {
                    message.usage = acc.usage.clone();
                }
                Generation {
                    message,
                    error: None,
                }
            }
            (
                Some(Frame::Error {
                    error,
                    error_kind,
                    error_message,
                }),
                ack,
            ) => {
                let acked = ack.ok().and_then(Acked::error);
                let mut message = error;
                if message.content.is_empty() {
                    message.content = acc.content.clone();
                }
                let error = match acked {
                    // The ack has the parts apart: the diagnostic without the hint, the hint,
                    // the status and the provider's words.
                    Some(e) => GenerationError {
                        message: e.detail.unwrap_or(error_message),
                        code: e.code,
                        kind: error_kind,
                        provider: crate::record::ProviderAnswer {
                            provider_status: e.status,
                            provider_message: e.provider_message,
                            hint: e.hint,
                        },
                    },
                    None => GenerationError {
                        code: format!("llm.{}", error_kind.as_str()),
                        kind: error_kind,
                        message: error_message,
                        provider: Default::default(),
                    },
                };
                Generation {
                    message,
                    error: Some(error),
                }
            }
            (_, Err(e)) if !e.is_not_found() && e.code != "timeout" => {
                return Err(e.into_harness());
            }
            (_, outcome) => {
                // No terminal frame: a rejected call is permanent, a frame-less answer transient.
                let (kind, why) = match outcome {
                    Err(e) => (ErrorKind::Transient, e.to_string()),
                    Ok(_) => (
                        ErrorKind::Transient,
                        "the router answered without a terminal frame".to_string(),
                    ),
                };
                let mut message = partial_message(&acc, &model, &provider);
                message.stop_reason = StopReason::Error;
                Generation {
                    message,
                    error: Some(GenerationError {
                        code: format!("llm.{}", kind.as_str()),
                        kind,
                        message: why,
                        provider: Default::default(),
                    }),
                }
            }
        };
        let mut final_message = gen.message.clone();
        if cancel.is_cancelled() && gen.ok() {
            final_message.stop_reason = StopReason::Aborted;
        }
        let details = gen
            .error
            .as_ref()
            .map(|e| json!({"error_kind": e.kind, "error_message": e.message}));
        // The final content goes with the step's next commit (see `StepCtx::pending`): one
        // store round trip less per step, and the answer lands atomically with what the step
        // decides on it.
        last.update_message(stream_update(session_id, entry_id, &final_message, details))?;
        if let Some(start) = gen_start {
            self.mark_generation(&request_id, start, first_chunk);
        }
        Ok(Generation {
            message: final_message,
            error: gen.error,
        })
    }
}

fn partial_message(acc: &Accumulator, model: &str, provider: &str) -> AssistantMessage {
    AssistantMessage {
        content: acc.content.clone(),
        model: model.to_string(),
        provider: provider.to_string(),
        stop_reason: StopReason::End,
        usage: acc.usage.clone(),
        error_kind: None,
        error_message: None,
        native_stop_reason: None,
        warnings: None,
        timestamp: harness_types::now_ms(),
    }
}

/// The write of a streamed answer's content (partial or final) into its entry.
fn stream_update(
    session_id: &str,
    entry_id: &str,
    message: &AssistantMessage,
    details: Option<Value>,
) -> UpdateMessageRequest {
    UpdateMessageRequest {
        session_id: session_id.to_string(),
        entry_id: entry_id.to_string(),
        content: message.content.clone(),
        usage: message.usage.clone(),
        stop_reason: Some(message.stop_reason),
        details,
        origin: None,
        expected_revision: None,
    }
}
