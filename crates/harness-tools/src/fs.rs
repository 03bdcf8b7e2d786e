//! `fs::read`, `fs::list`, `fs::search`, `fs::write`, `fs::edit`: files under the turn's root.

use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;

use rustix::fs::{AtFlags, FileType};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::{Result, ToolError};
use crate::jail::{self, Jail};
use crate::Limits;

fn default_dot() -> String {
    ".".into()
}

fn default_true() -> bool {
    true
}

/// `fs::read`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadRequest {
    /// File to read, relative to the root (or absolute under it).
    pub path: String,
    /// First line to return, 1-based (default 1).
    #[serde(default)]
    pub start_line: Option<u64>,
    /// Last line to return, inclusive (default: the end, within the size cap).
    #[serde(default)]
    pub end_line: Option<u64>,
    /// At most this many bytes of content (default and upper bound: the configured cap).
    #[serde(default)]
    pub max_bytes: Option<u64>,
}

pub fn read(jail: &Jail, req: ReadRequest, limits: &Limits) -> Result<Value> {
    let start = req.start_line.unwrap_or(1);
    if start == 0 {
        return Err(ToolError::invalid(
            "start_line",
            "lines are numbered from 1",
        ));
    }
    if let Some(end) = req.end_line {
        if end < start {
            return Err(ToolError::invalid(
                "end_line",
                format!("{end} is before start_line {start}"),
            ));
        }
    }
    let cap = req
        .max_bytes
        .unwrap_or(limits.read_max_bytes)
        .clamp(1, limits.read_max_bytes);
    let (file, real) = jail.open_file("path", &req.path, false)?;
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mut reader = BufReader::new(file);
    let mut out: Vec<u8> = Vec::new();
    let mut line_no = 0u64;
    let mut last = start.saturating_sub(1);
    let mut truncated = false;
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let n = reader
            .read_until(b'\n', &mut buf)
            .map_err(|e| io("path", &req.path, e))?;
        if n == 0 {
            break;
        }
        line_no += 1;
        if line_no < start {
            continue;
        }
        if req.end_line.is_some_and(|end| line_no > end) {
            break;
        }
        if out.len() as u64 + buf.len() as u64 > cap {
            let room = cap.saturating_sub(out.len() as u64) as usize;
            out.extend_from_slice(&buf[..room.min(buf.len())]);
            truncated = true;
            break;
        }
        out.extend_from_slice(&buf);
        last = line_no;
    }
    let text = String::from_utf8_lossy(&out).into_owned();
    let mut note = String::new();
    if truncated {
        note = format!(
            "\n[truncated at {cap} bytes after line {last}; read on with start_line {}]",
            last + 1
        );
    }
    Ok(json!({
        "content": [{"type": "text", "text": format!("{text}{note}")}],
        "path": jail.shown(&real),
        "start_line": start,
        "end_line": last,
        "size_bytes": size,
        "truncated": truncated,
    }))
}

/// `fs::list`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListRequest {
    /// Directory to list (default: the root).
    #[serde(default = "default_dot")]
    pub path: String,
}

pub fn list(jail: &Jail, req: ListRequest, limits: &Limits) -> Result<Value> {
    let (dir, real) = jail.open_dir("path", &req.path)?;
    let mut entries = Vec::new();
    let reader = rustix::fs::Dir::read_from(&dir).map_err(|e| io("path", &req.path, e))?;
    let mut total = 0usize;
    for entry in reader {
        let entry = entry.map_err(|e| io("path", &req.path, e))?;
        let name = std::ffi::OsStr::from_bytes(entry.file_name().to_bytes());
        if !jail::visible_name(name) || jail.protected().covers(&real.join(name)) {
            continue;
        }
        total += 1;
        if entries.len() >= limits.list_max_entries {
            continue;
        }
        let stat = rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW).ok();
        let kind = stat
            .as_ref()
            .map(|s| FileType::from_raw_mode(s.st_mode))
            .unwrap_or(FileType::Unknown);
        let mut row = json!({"name": name.to_string_lossy(), "type": kind_name(kind)});
        if kind == FileType::RegularFile {
            row["size"] = json!(stat.map(|s| s.st_size).unwrap_or(0));
        }
        entries.push(row);
    }
    entries.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
    Ok(json!({
        "path": jail.shown(&real),
        "entries": entries,
        "total": total,
        "truncated": total > limits.list_max_entries,
    }))
}

fn kind_name(kind: FileType) -> &'static str {
    match kind {
        FileType::RegularFile => "file",
        FileType::Directory => "dir",
        FileType::Symlink => "symlink",
        _ => "other",
    }
}

/// `fs::search`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SearchRequest {
    /// Regular expression (Rust regex syntax), matched per line.
    pub pattern: String,
    /// Directory or file to search (default: the root).
    #[serde(default = "default_dot")]
    pub path: String,
    /// Only files matching this glob (e.g. `*.rs`); `!` excludes.
    #[serde(default)]
    pub glob: Option<String>,
    #[serde(default)]
    pub case_insensitive: bool,
    /// Also search hidden files and directories.
    #[serde(default)]
    pub hidden: bool,
    /// At most this many matching lines (default and upper bound: the configured cap).
    #[serde(default)]
    pub max_results: Option<usize>,
}

/// Lines longer than this are cut in results (minified files would flood the context).
const MAX_LINE_CHARS: usize = 400;

pub fn search(jail: &Jail, req: SearchRequest, limits: &Limits) -> Result<Value> {
    use grep_regex::RegexMatcherBuilder;
    use grep_searcher::{sinks::Lossy, BinaryDetection, SearcherBuilder};

    let matcher = RegexMatcherBuilder::new()
        .case_insensitive(req.case_insensitive)
        .build(&req.pattern)
        .map_err(|e| ToolError::invalid("pattern", e))?;
    let cap = req
        .max_results
        .unwrap_or(limits.search_max_results)
        .clamp(1, limits.search_max_results);
    let (start_fd, start_real) = {
        let (id, rel) = jail.relative("path", &req.path)?;
        jail.open_at("path", &req.path, (id, &rel), rustix::fs::OFlags::RDONLY)?
    };
    drop(start_fd);
    let mut walker = ignore::WalkBuilder::new(&start_real);
    walker
        .follow_links(false)
        // .gitignore counts even outside a git checkout: a scratch folder's ignores hold too.
        .require_git(false)
        .hidden(!req.hidden);
    if let Some(glob) = &req.glob {
        let mut ob = ignore::overrides::OverrideBuilder::new(&start_real);
        ob.add(glob).map_err(|e| ToolError::invalid("glob", e))?;
        walker.overrides(ob.build().map_err(|e| ToolError::invalid("glob", e))?);
    }
    let protected = jail.protected().clone();
    walker.filter_entry(move |e| !protected.covers(e.path()));
    let mut searcher = SearcherBuilder::new()
        .line_number(true)
        .binary_detection(BinaryDetection::quit(0))
        .build();
    let mut matches = Vec::new();
    let mut files = 0usize;
    let mut truncated = false;
    'walk: for entry in walker.build() {
        let Ok(entry) = entry else { continue };
        if !entry.file_type().is_some_and(|t| t.is_file()) {
            continue;
        }
        // The walk lists names by path; each file is opened through the jail, so a directory
        // swapped for a symlink mid-walk cannot lead the read outside the root.
        let shown = jail.shown(entry.path());
        let Ok((file, _)) = jail.open_file("path", &entry.path().display().to_string(), false)
        else {
            continue;
        };
        if file
            .metadata()
            .is_ok_and(|m| m.len() > limits.search_max_file_bytes)
        {
            continue;
        }
        files += 1;
        let mut hit_cap = false;
        let sink = Lossy(|line_number, line: &str| {
            if matches.len() >= cap {
                hit_cap = true;
                return Ok(false);
            }
            let line = line.trim_end_matches(['\n', '\r']);
            let text: String = line.chars().take(MAX_LINE_CHARS).collect();
            matches.push(json!({"path": shown, "line": line_number, "text": text}));
            Ok(true)
        });
        let _ = searcher.search_file(&matcher, &file, sink);
        if hit_cap {
            truncated = true;
            break 'walk;
        }
    }
    let mut text = String::new();
    for m in &matches {
        text.push_str(&format!(
            "{}:{}:{}\n",
            m["path"].as_str().unwrap_or(""),
            m["line"],
            m["text"].as_str().unwrap_or("")
        ));
    }
    if matches.is_empty() {
        text.push_str("no matches");
    }
    if truncated {
        text.push_str(&format!(
            "[stopped at {cap} matches; narrow the pattern, path or glob]"
        ));
    }
    Ok(json!({
        "content": [{"type": "text", "text": text}],
        "matches": matches,
        "files_searched": files,
        "truncated": truncated,
    }))
}

/// `fs::write`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteRequest {
    /// File to write, relative to the root (or absolute under it). Replaced if it exists.
    pub path: String,
    /// The whole new content.
    pub content: String,
    /// Create missing parent directories (default true).
    #[serde(default = "default_true")]
    pub create_dirs: bool,
}

pub fn write(jail: &Jail, req: WriteRequest, limits: &Limits) -> Result<Value> {
    if req.content.len() as u64 > limits.write_max_bytes {
        return Err(ToolError::invalid(
            "content",
            format!(
                "{} bytes is more than the {} bytes a write may carry",
                req.content.len(),
                limits.write_max_bytes
            ),
        ));
    }
    let (mut file, real, created) = jail.create_file("path", &req.path, req.create_dirs)?;
    file.set_len(0).map_err(|e| io("path", &req.path, e))?;
    file.write_all(req.content.as_bytes())
        .and_then(|_| file.sync_data())
        .map_err(|e| io("path", &req.path, e))?;
    let shown = jail.shown(&real);
    Ok(json!({
        "content": [{"type": "text", "text": format!("{} {shown} ({} bytes)", if created { "created" } else { "wrote" }, req.content.len())}],
        "path": shown,
        "bytes": req.content.len(),
        "created": created,
    }))
}

/// `fs::edit`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EditRequest {
    /// File to edit.
    pub path: String,
    /// Exact text to replace; must occur exactly once unless `replace_all`.
    pub old: String,
    /// Replacement text.
    pub new: String,
    /// Replace every occurrence instead of requiring a unique one.
    #[serde(default)]
    pub replace_all: bool,
}

pub fn edit(jail: &Jail, req: EditRequest, limits: &Limits) -> Result<Value> {
    if req.old.is_empty() {
        return Err(ToolError::invalid("old", "must not be empty"));
    }
    let (mut file, real) = jail.open_file("path", &req.path, true)?;
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    if size > limits.write_max_bytes {
        return Err(io(
            "path",
            &req.path,
            format!(
                "{size} bytes is more than an edit handles ({})",
                limits.write_max_bytes
            ),
        ));
    }
    let mut text = String::new();
    file.read_to_string(&mut text)
        .map_err(|e| io("path", &req.path, format!("not UTF-8 text: {e}")))?;
    let count = text.matches(req.old.as_str()).count();
    let shown = jail.shown(&real);
    if count == 0 {
        return Err(ToolError::Match(format!(
            "old: not found in {shown} (0 matches); read the file and copy the text exactly, whitespace included"
        )));
    }
    if count > 1 && !req.replace_all {
        return Err(ToolError::Match(format!(
            "old: matches {count} times in {shown}; include more surrounding text so it matches once, or set replace_all"
        )));
    }
    let updated = text.replace(req.old.as_str(), &req.new);
    file.seek(SeekFrom::Start(0))
        .and_then(|_| file.set_len(0))
        .and_then(|_| file.write_all(updated.as_bytes()))
        .and_then(|_| file.sync_data())
        .map_err(|e| io("path", &req.path, e))?;
    Ok(json!({
        "content": [{"type": "text", "text": format!("edited {shown}: {count} replacement{}", if count == 1 { "" } else { "s" })}],
        "path": shown,
        "replacements": count,
    }))
}

fn io(field: &'static str, path: &str, e: impl std::fmt::Display) -> ToolError {
    ToolError::Io {
        field,
        path: path.to_string(),
        why: e.to_string(),
    }
}
