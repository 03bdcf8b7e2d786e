//! The environment a command gets: the harness's own, minus every credential it could hold.

use std::ffi::OsString;

/// Name segments (split on `_`) that mark a variable as a credential.
const SECRET_SEGMENTS: &[&str] = &[
    "KEY",
    "APIKEY",
    "TOKEN",
    "SECRET",
    "SECRETS",
    "PASSWORD",
    "PASSWD",
    "PASS",
    "CREDENTIAL",
    "CREDENTIALS",
    "AUTH",
    "COOKIE",
    "SESSION",
];

/// Whole names that carry access without looking like it.
const SECRET_NAMES: &[&str] = &[
    // An ssh agent signs for whoever can reach its socket.
    "SSH_AUTH_SOCK",
    "GPG_AGENT_INFO",
    "DATABASE_URL",
    "NETRC",
    "PGPASSFILE",
    "KUBECONFIG",
    "DOCKER_CONFIG",
    "GOOGLE_APPLICATION_CREDENTIALS",
];

/// Whether a variable named `name` may hold a credential: every `HARNESS_*` variable (tokens,
/// the data directory, router configuration), provider keys (`*_API_KEY`, `*_KEY`), tokens,
/// secrets and passwords, and the few names in [`SECRET_NAMES`].
pub fn is_secret(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    if upper.starts_with("HARNESS_") || upper == "HARNESS" || SECRET_NAMES.contains(&upper.as_str())
    {
        return true;
    }
    upper.split(['_', '-', '.']).any(|seg| {
        SECRET_SEGMENTS.contains(&seg)
            || seg.ends_with("APIKEY")
            || seg.ends_with("TOKEN")
            || seg.ends_with("SECRET")
            || seg.ends_with("PASSWORD")
    })
}

/// The harness's environment without the variables [`is_secret`] names.
pub fn scrubbed() -> Vec<(OsString, OsString)> {
    std::env::vars_os()
        .filter(|(k, _)| !is_secret(&k.to_string_lossy()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credential_names_are_recognised_and_ordinary_ones_kept() {
        for name in [
            "ANTHROPIC_API_KEY",
            "OPENAI_API_KEY",
            "OPENAI_COMPATIBLE_API_KEY",
            "MY_ANTHROPIC_KEY",
            "HARNESS_TOKEN",
            "HARNESS_DATA_DIR",
            "GITHUB_TOKEN",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
            "DB_PASSWORD",
            "PGPASSWORD",
            "npm_config__authToken",
            "SSH_AUTH_SOCK",
            "SLACK_BOT_TOKEN",
            "client_secret",
        ] {
            assert!(is_secret(name), "{name} should be scrubbed");
        }
        for name in [
            "PATH",
            "HOME",
            "LANG",
            "TERM",
            "USER",
            "SHELL",
            "TMPDIR",
            "CARGO_HOME",
            "RUST_LOG",
            "KEYBOARD_LAYOUT",
        ] {
            assert!(!is_secret(name), "{name} should be kept");
        }
    }
}
