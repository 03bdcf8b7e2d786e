//! What an OpenAI-compatible server accepts, as data.
//!
//! Servers that all claim "OpenAI-compatible" differ in what they do with the same request: one
//! rejects `"content": null` on an assistant message that replays a function call, one ignores
//! `tools` unless `tool_choice` names a function, one never sends usage in a stream. So the adapter does not guess per server in code: each preset carries
//! [`WireCaps`], a provider entry of the router config (`providers.<id>.wire`) and a catalog row
//! (`"wire"`, for one model) may override any field, and the request builder only reads the
//! result.
//!
//! | preset | `tool_choice` | `stream_with_tools` | `stream_usage` | `content_null` | `window_probe` | `tokenize` | `json_schema` |
//! |---|---|---|---|---|---|---|---|
//! | `openai` | `omit` | yes | yes | yes | no | `none` | `catalog` |
//! | `openai-compatible` (any server) | `auto` | yes | yes | no | no | `none` | `catalog` |
//! | `ollama` | `omit` | yes | yes | no | no | `none` | `catalog` |
//! | `llamacpp` | `auto` | yes | no | no | yes | `llamacpp` | `json_object_schema` |
//! | `vllm` | `auto` | yes | yes | yes | yes | `vllm` | `json_schema` |
//! | `lmstudio` | `auto` | yes | yes | no | no | `none` | `catalog` |

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What to send as `tool_choice` when tools are offered and the caller chose nothing
/// (`provider_options.<id>.tool_choice` always wins).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ToolChoice {
    /// Leave the field out: the server's default is "the model decides".
    Omit,
    /// `"tool_choice": "auto"`: servers that only look at `tools` when this is set.
    Auto,
}

/// Where a server counts tokens with the model's own tokenizer (the context budget then uses
/// its counts instead of an estimate).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Tokenize {
    /// The server cannot count: the family estimate, corrected by reported usage.
    None,
    /// llama-cpp-python's `POST /extras/tokenize/count`, else llama.cpp's `POST /tokenize`
    /// (the `llamacpp` preset serves both servers; the one that answers is remembered).
    Llamacpp,
    /// vLLM's `POST /tokenize`.
    Vllm,
}

/// How a server constrains a reply to a JSON schema (an output contract's native mode).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum JsonSchemaForm {
    /// As the catalog row says (`structured_output`), sent in OpenAI's `json_schema` form;
    /// without it the model gets a `submit_result` tool instead.
    Catalog,
    /// The server constrains by grammar and takes OpenAI's `{"type": "json_schema"}`.
    JsonSchema,
    /// The server constrains by grammar and takes `{"type": "json_object", "schema": ...}`
    /// (llama-cpp-python answers `json_schema` with a 500; llama.cpp reads both).
    JsonObjectSchema,
}

/// What a server accepts on the Chat Completions wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct WireCaps {
    pub tool_choice: ToolChoice,
    /// The server streams a reply when tools are offered; when false such a request is sent
    /// with `stream: false` and its one JSON answer becomes the same frames.
    pub stream_with_tools: bool,
    /// The server honours `stream_options.include_usage` (when false the field is not sent;
    /// either way a reply without usage gets an estimate marked `estimated`).
    pub stream_usage: bool,
    /// The server accepts `"content": null` on an assistant message that only carries function
    /// calls; when false an empty string is sent (leaving the field out breaks some chat
    /// templates).
    pub content_null: bool,
    /// The server reports its context window (`/v1/models` metadata or `/props`): asked once
    /// when the catalog only has a catch-all row for the model.
    pub window_probe: bool,
    /// Where the server counts tokens.
    pub tokenize: Tokenize,
    /// How the server constrains a reply to a schema.
    pub json_schema: JsonSchemaForm,
}

/// Any subset of [`WireCaps`], laid over a preset's (config entry, catalog row).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WirePatch {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_with_tools: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_usage: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_null: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_probe: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenize: Option<Tokenize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json_schema: Option<JsonSchemaForm>,
}

impl WireCaps {
    /// OpenAI itself.
    pub const OPENAI: WireCaps = WireCaps {
        tool_choice: ToolChoice::Omit,
        stream_with_tools: true,
        stream_usage: true,
        content_null: true,
        window_probe: false,
        tokenize: Tokenize::None,
        json_schema: JsonSchemaForm::Catalog,
    };

    /// A server nothing is known about: the forms every server tried accepts.
    pub const COMPATIBLE: WireCaps = WireCaps {
        tool_choice: ToolChoice::Auto,
        stream_with_tools: true,
        stream_usage: true,
        content_null: false,
        window_probe: false,
        tokenize: Tokenize::None,
        json_schema: JsonSchemaForm::Catalog,
    };

    /// The caps of a preset (or of `openai-compatible` for any other id).
    pub fn of_preset(id: &str) -> WireCaps {
        match id {
            "ollama" => WireCaps {
                tool_choice: ToolChoice::Omit,
                ..WireCaps::COMPATIBLE
            },
            // Recorded from llama-cpp-python 0.3.36 (tests/fixtures/llama-cpp-python-0.3.36):
            // usage never comes in a stream and `content: null` is a validation error (500).
            // Tools are only honoured with a `tool_choice` naming a function (streamed or not);
            // `"auto"` is sent for llama.cpp's own server, which reads it.
            "llamacpp" => WireCaps {
                tool_choice: ToolChoice::Auto,
                stream_with_tools: true,
                stream_usage: false,
                content_null: false,
                window_probe: true,
                tokenize: Tokenize::Llamacpp,
                json_schema: JsonSchemaForm::JsonObjectSchema,
            },
            "vllm" => WireCaps {
                content_null: true,
                window_probe: true,
                tokenize: Tokenize::Vllm,
                json_schema: JsonSchemaForm::JsonSchema,
                ..WireCaps::COMPATIBLE
            },
            _ => WireCaps::COMPATIBLE,
        }
    }

    /// These caps with `patch` laid over.
    pub fn with(self, patch: Option<&WirePatch>) -> WireCaps {
        let Some(p) = patch else { return self };
        WireCaps {
            tool_choice: p.tool_choice.unwrap_or(self.tool_choice),
            stream_with_tools: p.stream_with_tools.unwrap_or(self.stream_with_tools),
            stream_usage: p.stream_usage.unwrap_or(self.stream_usage),
            content_null: p.content_null.unwrap_or(self.content_null),
            window_probe: p.window_probe.unwrap_or(self.window_probe),
            tokenize: p.tokenize.unwrap_or(self.tokenize),
            json_schema: p.json_schema.unwrap_or(self.json_schema),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_patch_overrides_only_what_it_names() {
        let caps = WireCaps::of_preset("llamacpp").with(Some(&WirePatch {
            stream_with_tools: Some(false),
            ..WirePatch::default()
        }));
        assert!(!caps.stream_with_tools);
        assert!(!caps.content_null && !caps.stream_usage);
        assert_eq!(WireCaps::of_preset("gpu-box"), WireCaps::COMPATIBLE);
        assert!(WireCaps::of_preset("vllm").content_null);
        assert_eq!(WireCaps::of_preset("ollama").tool_choice, ToolChoice::Omit);
    }
}
