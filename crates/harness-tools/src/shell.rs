//! `shell::exec`: one command in the root, in its own process group, with a scrubbed
//! environment, a timeout and an output cap.
//!
//! The command runs in a Landlock sandbox ([`crate::confine`]): it writes only beneath the root
//! and a private temporary directory, reads the system and the root, never the harness's data
//! directory or configuration, and opens no TCP connection unless the operator allows it. On a
//! kernel that cannot enforce that, the call is refused unless the operator accepted running
//! unconfined (`shell_exec_unconfined`). It is still held for approval by default in
//! `harness chat`, and no credential the harness holds is passed to it.

use std::collections::BTreeMap;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::Stdio;
use std::time::{Duration, Instant};

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::confine::{self, Unavailable};
use crate::env;
use crate::error::{Result, ToolError};
use crate::jail::Jail;
use crate::Limits;

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// A shell command line, run by `/bin/sh -c`. Give this or `argv`.
    #[serde(default)]
    pub command: Option<String>,
    /// The program and its arguments, run without a shell. Give this or `command`.
    #[serde(default)]
    pub argv: Option<Vec<String>>,
    /// Working directory, relative to the root (default: the root).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Milliseconds before the whole process group is killed (default and upper bound: the
    /// configured limits).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Extra environment variables (credential-like names are refused).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Text written to the command's standard input.
    #[serde(default)]
    pub stdin: Option<String>,
}

/// Kills the process group when dropped: on a timeout, when the call is abandoned (the turn
/// was stopped, the dispatch timed out), and after the command exits (nothing it started in
/// the background outlives the call).
struct Group(i32);

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: killpg only sends a signal; the group id is the one the child was made
        // leader of, and signalling a group that is already gone is a harmless ESRCH.
        unsafe {
            libc::killpg(self.0, libc::SIGKILL);
        }
    }
}

pub async fn exec(jail: Jail, req: ExecRequest, limits: &Limits) -> Result<Value> {
    let (program, args): (String, Vec<String>) = match (&req.command, &req.argv) {
        (Some(c), None) => {
            if c.trim().is_empty() {
                return Err(ToolError::invalid("command", "must not be empty"));
            }
            ("/bin/sh".into(), vec!["-c".into(), c.clone()])
        }
        (None, Some(argv)) => match argv.split_first() {
            Some((p, rest)) if !p.is_empty() => (p.clone(), rest.to_vec()),
            _ => return Err(ToolError::invalid("argv", "must name a program")),
        },
        (Some(_), Some(_)) => {
            return Err(ToolError::invalid(
                "argv",
                "give either command or argv, not both",
            ))
        }
        (None, None) => {
            return Err(ToolError::invalid(
                "command",
                "missing field `command` (or `argv`)",
            ))
        }
    };
    for name in req.env.keys() {
        if env::is_secret(name) {
            return Err(ToolError::invalid(
                &format!("env.{name}"),
                "looks like a credential; the harness never passes credentials to commands",
            ));
        }
    }
    let cwd_arg = req.cwd.clone().unwrap_or_else(|| ".".into());
    let (cwd_fd, cwd) = jail.open_dir("cwd", &cwd_arg)?;
    drop(cwd_fd);
    let timeout = Duration::from_millis(
        req.timeout_ms
            .unwrap_or(limits.exec_default_timeout_ms)
            .clamp(1, limits.exec_max_timeout_ms),
    );

    let policy = (limits.shell_policy)();
    let sandbox = match confine::prepare(&jail, &policy, limits.landlock_ceiling)? {
        Ok(sandbox) => Some(sandbox),
        Err(Unavailable::Kernel(why)) if policy.unconfined => {
            tracing::warn!("shell::exec runs unconfined (shell_exec_unconfined): {why}");
            None
        }
        Err(Unavailable::Kernel(why)) => return Err(ToolError::SandboxUnavailable(why)),
    };

    let mut cmd = std::process::Command::new(&program);
    cmd.args(&args)
        .current_dir(&cwd)
        .env_clear()
        .envs(env::scrubbed())
        .envs(&req.env)
        .stdin(if req.stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own group, so a timeout or a stop reaches every process it started.
        .process_group(0);
    if let Some(sandbox) = &sandbox {
        // The home and temporary directory it may write to; the user's own home is not.
        cmd.env("TMPDIR", sandbox.tmp.path())
            .env("HOME", sandbox.tmp.path());
        let fd = sandbox.raw_fd();
        // SAFETY: restrict_child makes system calls only (no allocation, no locks), as the
        // child of a multi-threaded process must until exec; `fd` stays open in the parent
        // until spawn returns, so the child inherits it.
        unsafe {
            cmd.pre_exec(move || confine::restrict_child(fd));
        }
    }
    let mut cmd = tokio::process::Command::from(cmd);
    let started = Instant::now();
    let mut child = cmd.spawn().map_err(|e| ToolError::Io {
        field: if req.command.is_some() {
            "command"
        } else {
            "argv"
        },
        path: program.clone(),
        why: e.to_string(),
    })?;
    let pid = child.id().map(|p| p as i32).unwrap_or(0);
    let group = (pid > 0).then_some(Group(pid));
    if let (Some(input), Some(mut stdin)) = (req.stdin.clone(), child.stdin.take()) {
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            let _ = stdin.write_all(input.as_bytes()).await;
        });
    }
    let cap = limits.exec_max_output_bytes;
    let stdout = tokio::spawn(capture(child.stdout.take(), cap));
    let stderr = tokio::spawn(capture(child.stderr.take(), cap));
    let status = tokio::time::timeout(timeout, child.wait()).await;
    let timed_out = status.is_err();
    // Ends what is left of the group (all of it on a timeout; background stragglers after a
    // normal exit), so the pipes close and the readers finish.
    drop(group);
    let status = match status {
        Ok(s) => Some(s.map_err(|e| ToolError::Internal(e.to_string()))?),
        Err(_) => child.wait().await.ok(),
    };
    // A process that left the group (setsid) may still hold a pipe: wait for it a moment only.
    let drain = Duration::from_secs(2);
    let (out, out_dropped) = match tokio::time::timeout(drain, stdout).await {
        Ok(Ok(v)) => v,
        _ => (String::new(), 0),
    };
    let (err, err_dropped) = match tokio::time::timeout(drain, stderr).await {
        Ok(Ok(v)) => v,
        _ => (String::new(), 0),
    };
    let exit_code = status.and_then(|s| s.code());
    let signal = status.and_then(|s| s.signal());
    let mut text = String::new();
    if timed_out {
        text.push_str(&format!(
            "timed out after {} ms; the command and every process it started were killed\n",
            timeout.as_millis()
        ));
    } else if let Some(code) = exit_code {
        text.push_str(&format!("exit code {code}\n"));
    } else if let Some(sig) = signal {
        text.push_str(&format!("killed by signal {sig}\n"));
    }
    for (name, body, dropped) in [("stdout", &out, out_dropped), ("stderr", &err, err_dropped)] {
        if body.is_empty() && dropped == 0 {
            continue;
        }
        text.push_str(&format!("--- {name} ---\n{body}"));
        if !body.ends_with('\n') {
            text.push('\n');
        }
        if dropped > 0 {
            text.push_str(&format!("[{dropped} more bytes of {name} not shown]\n"));
        }
    }
    let is_error = timed_out || exit_code != Some(0);
    Ok(json!({
        "content": [{"type": "text", "text": text}],
        "is_error": is_error,
        "exit_code": exit_code,
        "signal": signal,
        "timed_out": timed_out,
        "stdout": out,
        "stderr": err,
        "stdout_truncated_bytes": out_dropped,
        "stderr_truncated_bytes": err_dropped,
        "cwd": jail.shown(&cwd),
        "confinement": match &sandbox {
            Some(s) => json!({"kind": "landlock", "abi": s.abi, "network": policy.allow_network}),
            None => json!({"kind": "none"}),
        },
        "duration_ms": started.elapsed().as_millis() as u64,
    }))
}

/// Reads a pipe to its end, keeping the first `cap` bytes and counting the rest.
async fn capture<R: AsyncRead + Unpin>(pipe: Option<R>, cap: usize) -> (String, u64) {
    let Some(mut pipe) = pipe else {
        return (String::new(), 0);
    };
    let mut kept = Vec::new();
    let mut dropped = 0u64;
    let mut buf = [0u8; 8192];
    loop {
        match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let room = cap.saturating_sub(kept.len()).min(n);
                kept.extend_from_slice(&buf[..room]);
                dropped += (n - room) as u64;
            }
        }
    }
    (String::from_utf8_lossy(&kept).into_owned(), dropped)
}
