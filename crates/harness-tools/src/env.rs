//! The environment a command gets: the harness's own, minus every credential it could hold.
//!
//! A variable goes when its name looks like a credential ([`is_secret`]: `*_KEY`, `*_TOKEN`,
//! `*_SECRET`, `*_PASSWORD`, `*_PAT`, `*CREDENTIAL*`, every `HARNESS_*`, ...), when its value
//! is a URL that carries a password (`scheme://user:pass@host`), or when the operator's
//! `shell_exec_scrub_env` names it (a name or a glob with `*` and `?`).

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
    // A personal access token (`GITHUB_PAT`).
    "PAT",
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
    if upper.starts_with("HARNESS_")
        || upper == "HARNESS"
        || SECRET_NAMES.contains(&upper.as_str())
        || upper.contains("CREDENTIAL")
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

/// Whether `value` holds a URL with a password in it (`postgres://app:hunter2@db/app`).
pub fn value_is_secret(value: &str) -> bool {
    let mut rest = value;
    while let Some(at) = rest.find("://") {
        let after = &rest[at + 3..];
        let end = after
            .find(|c: char| matches!(c, '/' | '?' | '#' | ',' | ';') || c.is_whitespace())
            .unwrap_or(after.len());
        let authority = &after[..end];
        if let Some((userinfo, _host)) = authority.rsplit_once('@') {
            if userinfo
                .split_once(':')
                .is_some_and(|(_, password)| !password.is_empty())
            {
                return true;
            }
        }
        rest = after;
    }
    false
}

/// Whether `name` matches the glob `pattern` (`*` any run, `?` one character), ignoring ASCII
/// case: `My_Token` and `MY_TOKEN` are the same credential to whoever reads them.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let p: Vec<char> = pattern.chars().map(|c| c.to_ascii_uppercase()).collect();
    let n: Vec<char> = name.chars().map(|c| c.to_ascii_uppercase()).collect();
    // Iterative matching with one backtrack point: the last `*` seen.
    let (mut pi, mut ni) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ni));
            pi += 1;
        } else if let Some((sp, sn)) = star {
            pi = sp + 1;
            ni = sn + 1;
            star = Some((sp, sn + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

/// The environment a command gets, and the names of what was taken out.
#[derive(Debug, Default)]
pub struct Scrubbed {
    pub vars: Vec<(OsString, OsString)>,
    /// Names only, sorted: never a value.
    pub removed: Vec<String>,
}

/// `vars` without credentials: names that look like one, values that carry a password, and
/// names the operator listed.
pub fn scrub(
    vars: impl IntoIterator<Item = (OsString, OsString)>,
    operator: &[String],
) -> Scrubbed {
    let mut out = Scrubbed::default();
    for (k, v) in vars {
        let name = k.to_string_lossy();
        if is_secret(&name)
            || value_is_secret(&v.to_string_lossy())
            || operator.iter().any(|p| glob_match(p, &name))
        {
            out.removed.push(name.into_owned());
        } else {
            out.vars.push((k, v));
        }
    }
    out.removed.sort();
    out
}

/// The harness's own environment, scrubbed.
pub fn scrubbed(operator: &[String]) -> Scrubbed {
    scrub(std::env::vars_os(), operator)
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

    fn names(s: &Scrubbed) -> Vec<String> {
        s.vars
            .iter()
            .map(|(k, _)| k.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn the_scrub_removes_by_pattern_value_and_operator_list() {
        let vars: Vec<(OsString, OsString)> = [
            ("GITHUB_PAT", "ghp_canary"),
            ("MY_CREDENTIALS_FILE", "/etc/creds"),
            ("CREDENTIALFILE", "/etc/creds"),
            ("DEPLOY_KEY", "k"),
            ("SOME_TOKEN", "t"),
            ("APP_SECRET", "s"),
            ("SMTP_PASSWORD", "p"),
            (
                "UPSTREAM",
                "https://deploy:hunter2@git.example.org/repo.git",
            ),
            ("MIRRORS", "http://a.example, ftp://u:pw@b.example/x"),
            ("CORP_VAULT_ADDR", "https://vault.example"),
            ("Internal_Thing", "x"),
            ("ACME_ID", "x"),
            ("PATH", "/usr/bin"),
            ("HOME", "/root"),
            ("PLAIN_URL", "https://user@example.org/x"),
            ("BLANK_USERINFO_URL", "https://user:@example.org/x"),
            ("PATTERN", "PATTERNLESS"),
            ("PATH_EXTRA", "/opt/bin"),
        ]
        .iter()
        .map(|(k, v)| (OsString::from(k), OsString::from(v)))
        .collect();
        let operator = vec![
            "CORP_*".to_string(),
            "internal_thing".into(),
            "ACME_?D".into(),
        ];
        let s = scrub(vars, &operator);
        let mut removed = vec![
            "ACME_ID",
            "APP_SECRET",
            "CORP_VAULT_ADDR",
            "CREDENTIALFILE",
            "DEPLOY_KEY",
            "GITHUB_PAT",
            "Internal_Thing",
            "MIRRORS",
            "MY_CREDENTIALS_FILE",
            "SMTP_PASSWORD",
            "SOME_TOKEN",
            "UPSTREAM",
        ];
        removed.sort();
        assert_eq!(s.removed, removed);
        assert_eq!(
            names(&s),
            vec![
                "PATH",
                "HOME",
                "PLAIN_URL",
                "BLANK_USERINFO_URL",
                "PATTERN",
                "PATH_EXTRA"
            ]
        );
    }

    #[test]
    fn globs_match_whole_names() {
        for (p, n, want) in [
            ("CORP_*", "CORP_X", true),
            ("CORP_*", "CORP_", true),
            ("CORP_*", "XCORP_X", false),
            ("*_ID", "ACME_ID", true),
            ("*_ID", "ACME_IDX", false),
            ("A?C", "ABC", true),
            ("A?C", "AC", false),
            ("*", "ANY", true),
            ("a*b*c", "AXXBYYC", true),
            ("a*b*c", "AXXBYY", false),
            ("EXACT", "exact", true),
            ("EXACT", "EXACTLY", false),
        ] {
            assert_eq!(glob_match(p, n), want, "{p} vs {n}");
        }
    }
}
