//! `harness chat` run by a test: its data and configuration in the test's directory, and none of
//! the variables that would configure a provider from the developer's environment, so only what
//! the test sets chooses the provider.

#![allow(dead_code)] // each test binary uses a different part of it

use std::path::Path;
use std::process::Command;

pub const PROVIDER_VARS: [&str; 12] = [
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_BASE_URL",
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "OPENAI_COMPATIBLE_BASE_URL",
    "OPENAI_COMPATIBLE_API_KEY",
    "OPENAI_COMPATIBLE_PRESET",
    "LLAMACPP_BASE_URL",
    "LLAMACPP_API_KEY",
    "HARNESS_ROUTER_CONFIG",
    "HARNESS_MODEL_CATALOG",
    "HARNESS_DATA_DIR",
];

/// `harness chat <args>` with its data and configuration in `dir` and `env` set.
pub fn chat_in(dir: &Path, args: &[&str], env: &[(&str, String)]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_harness"));
    cmd.arg("chat")
        .args(args)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .args(["--durability", "normal"])
        .env("XDG_CONFIG_HOME", dir.join("config"))
        .env("HOME", dir);
    for v in PROVIDER_VARS {
        cmd.env_remove(v);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}
