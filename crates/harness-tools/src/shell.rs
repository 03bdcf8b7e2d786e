//! `shell::exec`: one command in the root, in its own process group, with a scrubbed
//! environment, a timeout and an output cap.
//!
//! The command runs in its own PID and mount namespaces with a fresh `/proc`, without
//! capabilities ([`crate::isolate`]), so it sees no other process: not the harness's
//! environment, memory or descriptors, not another process's environment or command line. It
//! also runs in a Landlock sandbox ([`crate::confine`]): it writes only beneath the root and a
//! private temporary directory, reads the system and the root, never the harness's data
//! directory or configuration, and opens no TCP connection unless the operator allows it. On
//! a kernel that cannot enforce either, the call is refused unless the operator accepted
//! running unconfined (`shell_exec_unconfined`). It is still held for approval by default in
//! `harness chat`, and no credential the harness holds is in its environment ([`crate::env`]);
//! the result names the variables it kept and those removed, never a value.
//!
//! Output: each stream keeps its first and last halves of `exec_max_output_bytes`, and the
//! result is cut further, in each stream's middle, until all of it (text and details) fits the
//! loop's `max_result_bytes`, which [`crate::Limits`] passes in: a result over the cap would be
//! elided whole by the loop, and the model would see nothing of either stream. The cap is read
//! from the live configuration through `Limits` (as the shell policy is) rather than stamped
//! on each request, since a model must not be able to raise it.

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
use crate::isolate;
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
    let ns = if limits.pid_namespace {
        isolate::available()
    } else {
        Err("PID namespaces are turned off".to_string())
    };
    let ns = match ns {
        Ok(mode) => Some(mode),
        Err(why) if policy.unconfined => {
            tracing::warn!(
                "shell::exec runs without a private PID namespace (shell_exec_unconfined): {why}"
            );
            None
        }
        Err(why) => {
            return Err(ToolError::SandboxUnavailable(format!(
                "a private PID namespace cannot be made, so a command could read other processes' environments: {why}"
            )))
        }
    };
    let sandbox = match confine::prepare(&jail, &policy, limits.landlock_ceiling, ns.is_some())? {
        Ok(sandbox) => Some(sandbox),
        Err(Unavailable::Kernel(why)) if policy.unconfined => {
            tracing::warn!("shell::exec runs without Landlock (shell_exec_unconfined): {why}");
            None
        }
        Err(Unavailable::Kernel(why)) => return Err(ToolError::SandboxUnavailable(why)),
    };
    let plan = isolate::Plan::new(ns, sandbox.as_ref().map(|s| (s.raw_fd(), s.proc_access())));

    let environment = env::scrubbed(&policy.scrub_env);
    let mut cmd = std::process::Command::new(&program);
    cmd.args(&args)
        .current_dir(&cwd)
        .env_clear()
        .envs(environment.vars.iter().map(|(k, v)| (k, v)))
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
    }
    // Even unconfined, a command of a root harness gets no capability and no new privileges.
    // SAFETY: isolate::child makes system calls only, on the plan prepared above (no
    // allocation, no locks), as the child of a multi-threaded process must until exec; the
    // rule set's descriptor stays open in the parent until spawn returns, so the child
    // inherits it.
    unsafe {
        cmd.pre_exec(move || isolate::child(&plan));
    }
    let mut kept: Vec<String> = environment
        .vars
        .iter()
        .map(|(k, _)| k.to_string_lossy().into_owned())
        .chain(req.env.keys().cloned())
        .collect();
    if sandbox.is_some() {
        kept.extend(["TMPDIR".to_string(), "HOME".to_string()]);
    }
    kept.sort();
    kept.dedup();
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
    let out = match tokio::time::timeout(drain, stdout).await {
        Ok(Ok(v)) => v,
        _ => Captured::default(),
    };
    let err = match tokio::time::timeout(drain, stderr).await {
        Ok(Ok(v)) => v,
        _ => Captured::default(),
    };
    let exit_code = status.and_then(|s| s.code());
    let signal = status.and_then(|s| s.signal());
    let mut head = String::new();
    if timed_out {
        head.push_str(&format!(
            "timed out after {} ms; the command and every process it started were killed\n",
            timeout.as_millis()
        ));
    } else if let Some(code) = exit_code {
        head.push_str(&format!("exit code {code}\n"));
    } else if let Some(sig) = signal {
        head.push_str(&format!("killed by signal {sig}\n"));
    }
    let confinement = json!({
        "kind": match (&sandbox, ns) {
            (Some(_), _) => "landlock",
            (None, Some(_)) => "namespaces",
            (None, None) => "none",
        },
        "abi": sandbox.as_ref().map(|s| s.abi),
        "network": sandbox.is_none() || policy.allow_network,
        "pid_namespace": ns.is_some(),
        "user_namespace": ns == Some(isolate::Mode::User),
        "proc": if ns.is_some() { "private" } else { "host" },
        "capabilities": if plan.drops_capabilities() { "dropped" } else { "none held" },
    });
    let fixed = json!({
        "is_error": timed_out || exit_code != Some(0),
        "exit_code": exit_code,
        "signal": signal,
        "timed_out": timed_out,
        "cwd": jail.shown(&cwd),
        "confinement": confinement,
        "env": {"kept": kept, "removed": environment.removed},
        "duration_ms": started.elapsed().as_millis() as u64,
    });
    let max = (limits.max_result_bytes)();
    Ok(fit(
        &head,
        fixed,
        [("stdout", out.view()), ("stderr", err.view())],
        max,
    ))
}

/// What a command wrote to one stream: the first half of the capture cap, the last half, and
/// how much it wrote in all.
#[derive(Default)]
struct Captured {
    head: Vec<u8>,
    tail: std::collections::VecDeque<u8>,
    total: u64,
}

impl Captured {
    fn view(&self) -> View {
        let tail: Vec<u8> = self.tail.iter().copied().collect();
        let kept = (self.head.len() + tail.len()) as u64;
        if kept == self.total {
            let mut all = self.head.clone();
            all.extend_from_slice(&tail);
            let all = String::from_utf8_lossy(&all).into_owned();
            return View {
                head: all,
                tail: String::new(),
                total: self.total,
            };
        }
        View {
            head: lossy_head(&self.head),
            tail: lossy_tail(&tail),
            total: self.total,
        }
    }
}

/// The text before a cut, without a character the cut split.
fn lossy_head(b: &[u8]) -> String {
    let mut end = b.len();
    // Back over an incomplete UTF-8 sequence at the end (at most 3 bytes).
    for back in 1..=3.min(b.len()) {
        let byte = b[b.len() - back];
        if byte & 0xc0 == 0xc0 {
            let need = if byte >= 0xf0 {
                4
            } else if byte >= 0xe0 {
                3
            } else {
                2
            };
            if back < need {
                end = b.len() - back;
            }
            break;
        }
        if byte & 0x80 == 0 {
            break;
        }
    }
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// The text after a cut, without a character the cut split.
fn lossy_tail(b: &[u8]) -> String {
    let start = b
        .iter()
        .take(3)
        .take_while(|byte| *byte & 0xc0 == 0x80)
        .count();
    String::from_utf8_lossy(&b[start..]).into_owned()
}

/// One stream as shown: `head`, a cut (when `tail` or the total says so), `tail`.
#[derive(Clone, Debug, Default)]
struct View {
    head: String,
    tail: String,
    total: u64,
}

impl View {
    fn kept(&self) -> usize {
        self.head.len() + self.tail.len()
    }

    fn cut(&self) -> u64 {
        self.total.saturating_sub(self.kept() as u64)
    }

    /// At most `keep` bytes of it: the first half and the last half, on character boundaries.
    fn shrink(&self, keep: usize) -> View {
        if keep >= self.kept() {
            return self.clone();
        }
        if self.cut() == 0 && !self.tail.is_empty() {
            // Whole so far: one text to cut in two.
            let whole = View {
                head: format!("{}{}", self.head, self.tail),
                tail: String::new(),
                total: self.total,
            };
            return whole.shrink(keep);
        }
        let (head, tail) = if self.cut() == 0 {
            (self.head.as_str(), self.head.as_str())
        } else {
            (self.head.as_str(), self.tail.as_str())
        };
        let tail_keep = (keep - keep / 2).min(tail.len());
        let head_keep = (keep - tail_keep).min(head.len());
        let mut h = head_keep;
        while !head.is_char_boundary(h) {
            h -= 1;
        }
        let mut t = tail.len() - tail_keep;
        while !tail.is_char_boundary(t) {
            t += 1;
        }
        View {
            head: head[..h].to_string(),
            tail: tail[t..].to_string(),
            total: self.total,
        }
    }

    /// The stream as the model reads it, the cut named where it is.
    fn render(&self, name: &str) -> String {
        let cut = self.cut();
        if cut == 0 {
            return format!("{}{}", self.head, self.tail);
        }
        let mut s = self.head.clone();
        if !s.is_empty() && !s.ends_with('\n') {
            s.push('\n');
        }
        let from = self.head.len() as u64;
        if self.kept() == 0 {
            s.push_str(&format!("[... all {cut} bytes of {name} cut ...]\n"));
            return s;
        }
        s.push_str(&format!(
            "[... {cut} bytes of {name} cut here (bytes {from} to {} of {}); the first {from} and the last {} bytes are shown ...]\n",
            from + cut,
            self.total,
            self.tail.len()
        ));
        s.push_str(&self.tail);
        s
    }
}

/// The serialized size the loop measures against `max_result_bytes`: the content blocks, and
/// the whole value (which it keeps as the result's details).
fn measured(v: &Value) -> usize {
    serde_json::to_string(&v["content"]).map_or(0, |s| s.len())
        + serde_json::to_string(v).map_or(0, |s| s.len())
}

/// The result; `copies`: the streams also as fields of their own (left out only when even the
/// frame of the result does not fit).
fn assemble(head: &str, fixed: &Value, streams: &[(&str, View); 2], copies: bool) -> Value {
    let mut text = head.to_string();
    let mut v = fixed.clone();
    for (name, view) in streams {
        let shown = view.render(name);
        if !shown.is_empty() {
            text.push_str(&format!("--- {name} ---\n{shown}"));
            if !shown.ends_with('\n') {
                text.push('\n');
            }
        }
        v[*name] = if copies { json!(shown) } else { json!(null) };
        v[format!("{name}_truncated_bytes")] = json!(view.cut());
    }
    v["content"] = json!([{"type": "text", "text": text}]);
    v
}

/// The result, its streams cut in the middle until the whole of it fits `max` (less a margin
/// for what the loop may add: a note, a hook's annotation). The loop elides a result that is
/// too large whole, so a cut here is what keeps both ends of the output in front of the model.
fn fit(head: &str, mut fixed: Value, streams: [(&str, View); 2], max: usize) -> Value {
    let full = assemble(head, &fixed, &streams, true);
    if max == 0 {
        return full;
    }
    let target = max.saturating_sub((max / 16).max(128));
    if measured(&full) <= target {
        return full;
    }
    let empty = [
        (streams[0].0, streams[0].1.shrink(0)),
        (streams[1].0, streams[1].1.shrink(0)),
    ];
    // Even the frame does not fit (a small cap): the variable names go first (their counts
    // stay), then the streams' own fields (the text keeps them).
    if measured(&assemble(head, &fixed, &empty, true)) > target {
        let kept = fixed["env"]["kept"].as_array().map_or(0, Vec::len);
        let removed = fixed["env"]["removed"].as_array().map_or(0, Vec::len);
        fixed["env"] = json!({"kept_count": kept, "removed_count": removed});
    }
    let copies = measured(&assemble(head, &fixed, &empty, true)) <= target;
    if !copies {
        fixed["streams"] = json!("in content only, to fit max_result_bytes");
    }
    // Each kept byte appears up to four times (the text in content and in details, the
    // stream's own field), escaped: each stream's share is estimated, then corrected until the
    // whole fits.
    let copies_n = if copies { 4.0 } else { 2.0 };
    let frame = measured(&assemble(head, &fixed, &empty, copies));
    let room = target.saturating_sub(frame) as f64;
    let weight = |v: &View| -> f64 {
        let n = v.kept().max(1);
        let escaped = serde_json::to_string(&format!("{}{}", v.head, v.tail))
            .map_or(n + 2, |s| s.len())
            .saturating_sub(2);
        copies_n * (escaped.max(1) as f64 / n as f64).max(1.0)
    };
    let (w0, w1) = (weight(&streams[0].1), weight(&streams[1].1));
    let need0 = streams[0].1.kept() as f64 * w0;
    let need1 = streams[1].1.kept() as f64 * w1;
    // Half the room each; what one stream does not need goes to the other.
    let c0 = need0.min(room - need1.min(room / 2.0));
    let c1 = need1.min(room - c0);
    let mut keep = [(c0 / w0) as usize, (c1 / w1) as usize];
    loop {
        let shrunk = [
            (streams[0].0, streams[0].1.shrink(keep[0])),
            (streams[1].0, streams[1].1.shrink(keep[1])),
        ];
        let v = assemble(head, &fixed, &shrunk, copies);
        let size = measured(&v);
        if size <= target || keep == [0, 0] {
            return v;
        }
        let over = size - target;
        let total = (keep[0] + keep[1]).max(1);
        for k in keep.iter_mut() {
            let share = (over * *k).div_ceil(total) / 2 + 16;
            *k = k.saturating_sub(share);
        }
    }
}

/// Reads a pipe to its end, keeping the first and the last half of `cap` bytes (the start of a
/// run and its end, where the errors are) and counting all of it.
async fn capture<R: AsyncRead + Unpin>(pipe: Option<R>, cap: usize) -> Captured {
    let mut c = Captured::default();
    let Some(mut pipe) = pipe else {
        return c;
    };
    let head_cap = cap / 2;
    let tail_cap = cap - head_cap;
    let mut buf = [0u8; 8192];
    loop {
        match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                c.total += n as u64;
                let room = head_cap.saturating_sub(c.head.len()).min(n);
                c.head.extend_from_slice(&buf[..room]);
                for &b in &buf[room..n] {
                    if c.tail.len() == tail_cap {
                        c.tail.pop_front();
                    }
                    if tail_cap > 0 {
                        c.tail.push_back(b);
                    }
                }
            }
        }
    }
    c
}
