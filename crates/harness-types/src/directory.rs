//! `directory::*` wire types: agent profiles, skills and system prompts as the directory serves
//! them, already resolved (an agent's `extends` chain composed root-first).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::api::ThinkingLevel;

/// `directory::*::get`: one entry by name (a file stem or a skill folder; never a path).
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NameRequest {
    pub name: String,
}

/// `directory::*::list`: no fields.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListRequest {}

/// The closed icon set of a profile's (or a sub-agent's) display.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Icon {
    Agent,
    Code,
    Search,
    Terminal,
    Database,
    Test,
    Review,
    Docs,
    Design,
}

/// The closed color set of a display.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Color {
    Neutral,
    Blue,
    Purple,
    Teal,
    Green,
    Amber,
    Rose,
}

/// How clients show an agent; never affects routing or execution.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Display {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub icon: Option<Icon>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub color: Option<Color>,
}

/// `directory::agents::get`: a profile with its `extends` chain resolved.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct AgentProfile {
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_effort: Option<ThinkingLevel>,
    /// The bodies of the chain, root first, joined by a blank line.
    pub system_prompt: String,
    /// Preloaded function ids (the chain's, root first, without repeats).
    #[serde(default)]
    pub functions: Vec<String>,
    /// Preloaded skill names (the chain's, root first, without repeats).
    #[serde(default)]
    pub skills: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display: Option<Display>,
    /// The `extends` chain, root first, ending with this profile.
    pub chain: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct AgentSummary {
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display: Option<Display>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct AgentList {
    pub agents: Vec<AgentSummary>,
    /// Profiles left out because their file is malformed: one bad file never hides the rest.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<SkippedFile>,
}

/// A directory file a list left out, and why (`directory::agents::get` of it says the same).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SkippedFile {
    /// Relative to the directory root, e.g. `agents/a.md`.
    pub file: String,
    /// The error a read of it gives, naming the field at fault.
    pub reason: String,
}

/// A skill's index line: what the model reads before it decides to fetch the body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SkillSummary {
    pub name: String,
    pub description: String,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SkillList {
    pub skills: Vec<SkillSummary>,
}

/// `directory::skills::get`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Skill {
    pub name: String,
    pub description: String,
    pub body: String,
}

/// `directory::system-prompts::get`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SystemPrompt {
    pub name: String,
    pub body: String,
}
