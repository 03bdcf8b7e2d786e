//! An incremental Server-Sent Events parser (the WHATWG `text/event-stream` rules).
//!
//! Providers stream their answers as SSE over a chunked HTTP body, and chunk boundaries fall
//! anywhere: inside a line, inside a UTF-8 sequence, between the `\r` and `\n` of a CRLF. The
//! parser therefore buffers bytes and only decodes complete lines. It follows the standard: lines
//! end with CRLF, LF or CR; `:` starts a comment; `field: value` drops one leading space; several
//! `data` lines join with `\n`; a blank line dispatches the event; an event with no data is not
//! dispatched; a trailing event without its blank line is discarded at the end of the stream.

/// One dispatched event.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field; empty means the default type `message`.
    pub event: String,
    pub data: String,
    pub id: Option<String>,
}

/// A line longer than this is treated as a broken stream, not buffered forever.
const MAX_LINE: usize = 32 << 20;

/// Feeds bytes in, takes events out.
#[derive(Debug, Default)]
pub struct SseParser {
    /// Bytes of the line being read (no terminator).
    line: Vec<u8>,
    /// The previous chunk ended with `\r`: a leading `\n` in the next one belongs to it.
    after_cr: bool,
    /// At the very start of the stream (a UTF-8 BOM is skipped there).
    started: bool,
    event: String,
    data: String,
    has_data: bool,
    id: Option<String>,
}

/// The stream broke the parser's limits.
#[derive(Debug, thiserror::Error)]
#[error("an SSE line exceeded {MAX_LINE} bytes")]
pub struct SseError;

impl SseParser {
    pub fn new() -> Self {
        SseParser::default()
    }

    /// Parses `chunk`, appending every event it completes to `out`.
    pub fn push(&mut self, mut chunk: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        if !self.started && !chunk.is_empty() {
            self.started = true;
            if let Some(rest) = chunk.strip_prefix(b"\xEF\xBB\xBF") {
                chunk = rest;
            }
        }
        if self.after_cr {
            self.after_cr = false;
            if let Some(rest) = chunk.strip_prefix(b"\n") {
                chunk = rest;
            }
        }
        while let Some(pos) = chunk.iter().position(|&b| b == b'\n' || b == b'\r') {
            let terminator = chunk[pos];
            if self.line.is_empty() {
                self.line_done(&chunk[..pos], out);
            } else {
                self.line.extend_from_slice(&chunk[..pos]);
                let line = std::mem::take(&mut self.line);
                self.line_done(&line, out);
                self.line = line;
                self.line.clear();
            }
            chunk = &chunk[pos + 1..];
            if terminator == b'\r' {
                match chunk.first() {
                    Some(b'\n') => chunk = &chunk[1..],
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
        }
        if self.line.len() + chunk.len() > MAX_LINE {
            return Err(SseError);
        }
        self.line.extend_from_slice(chunk);
        Ok(())
    }

    /// True when the parser holds a partial line or an undispatched event: the stream stopped
    /// in the middle of something.
    pub fn mid_event(&self) -> bool {
        !self.line.is_empty() || self.has_data || !self.event.is_empty()
    }

    fn line_done(&mut self, line: &[u8], out: &mut Vec<SseEvent>) {
        if line.is_empty() {
            if self.has_data {
                out.push(SseEvent {
                    event: std::mem::take(&mut self.event),
                    data: std::mem::take(&mut self.data),
                    id: self.id.clone(),
                });
            }
            self.event.clear();
            self.data.clear();
            self.has_data = false;
            return;
        }
        if line[0] == b':' {
            return;
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        let value = String::from_utf8_lossy(value);
        match field {
            b"data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(&value);
                self.has_data = true;
            }
            b"event" => {
                self.event.clear();
                self.event.push_str(&value);
            }
            b"id" if !value.contains('\0') => self.id = Some(value.into_owned()),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_in_pieces(input: &[u8], piece: usize) -> Vec<SseEvent> {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        for c in input.chunks(piece.max(1)) {
            p.push(c, &mut out).unwrap();
        }
        out
    }

    #[test]
    fn events_survive_any_chunking() {
        let input = "event: message_start\ndata: {\"a\":1}\n\n: comment\r\nevent: delta\r\ndata: first\r\ndata:second\r\n\r\ndata: é€😀\r\r";
        let whole = parse_in_pieces(input.as_bytes(), input.len());
        assert_eq!(whole.len(), 3);
        assert_eq!(whole[0].event, "message_start");
        assert_eq!(whole[0].data, "{\"a\":1}");
        assert_eq!(whole[1].event, "delta");
        assert_eq!(whole[1].data, "first\nsecond");
        assert_eq!(whole[2].event, "");
        assert_eq!(whole[2].data, "é€😀");
        for piece in 1..input.len() {
            assert_eq!(
                parse_in_pieces(input.as_bytes(), piece),
                whole,
                "piece {piece}"
            );
        }
    }

    #[test]
    fn no_data_no_event_and_a_trailing_event_waits_for_its_blank_line() {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        p.push(
            b"\xEF\xBB\xBFevent: ping\n\nid: 7\ndata: x\n\ndata: tail",
            &mut out,
        )
        .unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].data, "x");
        assert_eq!(out[0].id.as_deref(), Some("7"));
        assert!(p.mid_event());
        p.push(b"\n\n", &mut out).unwrap();
        assert_eq!(out.len(), 2);
        assert!(!p.mid_event());
    }

    #[test]
    fn a_field_without_colon_and_an_empty_data_line_count() {
        let out = parse_in_pieces(b"data\n\ndata:\ndata:\n\n", 3);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].data, "");
        assert_eq!(out[1].data, "\n");
    }
}
