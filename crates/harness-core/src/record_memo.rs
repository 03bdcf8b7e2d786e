//! Turn records kept parsed beside the text they were written as.
//!
//! A step reads its session's record back three or four times, each time just after the loop
//! wrote it; parsing that text was ~8 % of the loop's CPU by profile (issue 34). The memo keeps
//! the last record the loop wrote for a session with its exact text, and a read whose text from
//! the store is that text copies the record instead of parsing it. It is a memo of a pure
//! function (text → record), never a second copy of the truth: every read still asks the store
//! for the text, so a record written by another process, a direct state write or a failed
//! commit only costs a parse.

use std::collections::HashMap;

use crate::recent;
use crate::record::TurnRecord;
use harness_types::api::TurnStatus;

/// Sessions whose last written record stays parsed; the least recently written goes first.
/// Enough for every session a busy process steps at once, small enough that idle sessions
/// cost nothing.
const RECORD_MEMO_SESSIONS: usize = 256;

#[derive(Default)]
pub(crate) struct RecordMemo {
    by_session: HashMap<String, Memo>,
    clock: u64,
}

struct Memo {
    text: String,
    /// Boxed (a record is ~1.7 KB inline): an empty slot of the map stays small.
    record: Box<TurnRecord>,
    written: u64,
}

/// A record the loop wrote, for [`RecordMemo::put`] once the write is made.
#[derive(Clone)]
pub(crate) enum Written {
    /// Kept parsed beside its text.
    Keep {
        text: String,
        record: Box<TurnRecord>,
    },
    /// Not kept, and any older copy of the session's record dropped.
    Forget { session_id: String },
}

impl Written {
    /// `rec` as written in `text`: kept when reading `text` back gives a record equal to `rec`
    /// and the turn still runs.
    ///
    /// The text reads back equal unless it holds a `null`: an `Option` holding JSON null reads
    /// back as `None`, and a field written as null without its skip may read back as its default.
    /// Such a record (rare: a function that answered null, say) is simply parsed on its next
    /// read; a `null` inside a string only costs that parse too. An ended turn's record is read
    /// once more at most (by the next send) and would otherwise sit in memory for every idle
    /// session the memo has room for.
    pub(crate) fn of(rec: &TurnRecord, text: &str) -> Written {
        if rec.is_terminal() || text.contains("null") {
            Written::Forget {
                session_id: rec.session_id.clone(),
            }
        } else {
            Written::Keep {
                text: text.to_string(),
                record: Box::new(rec.clone()),
            }
        }
    }
}

impl RecordMemo {
    /// A copy of the record `text` parses to, when `text` is what the loop last wrote for the
    /// session. A copy, not the kept one: half of a step's reads only look (whether a turn
    /// runs, its options) and the next read wants the record again.
    pub(crate) fn get(&self, session_id: &str, text: &str) -> Option<TurnRecord> {
        let memo = self.by_session.get(session_id)?;
        (memo.text == text).then(|| (*memo.record).clone())
    }

    /// The status of the record `text` parses to, when `text` is what the loop last wrote.
    pub(crate) fn status(&self, session_id: &str, text: &str) -> Option<TurnStatus> {
        let memo = self.by_session.get(session_id)?;
        (memo.text == text).then_some(memo.record.status)
    }

    pub(crate) fn put(&mut self, written: Written) {
        let (text, record) = match written {
            Written::Keep { text, record } => (text, record),
            Written::Forget { session_id } => {
                self.by_session.remove(&session_id);
                return;
            }
        };
        self.clock += 1;
        recent::make_room(
            &mut self.by_session,
            &record.session_id,
            RECORD_MEMO_SESSIONS,
            |m| m.written,
        );
        self.by_session.insert(
            record.session_id.clone(),
            Memo {
                text,
                record,
                written: self.clock,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(session_id: &str, step: u64) -> TurnRecord {
        let text = format!(
            r#"{{"turn_id":"t-{session_id}","session_id":"{session_id}","status":"running","step":{step},"options":{{"model":"m","max_turns":4}}}}"#
        );
        serde_json::from_str(&text).unwrap()
    }

    fn written(rec: &TurnRecord) -> (String, Written) {
        let text = serde_json::to_string(rec).unwrap();
        let w = Written::of(rec, &text);
        (text, w)
    }

    #[test]
    fn a_read_of_the_text_last_written_gets_the_record_and_any_other_text_is_parsed() {
        let mut memo = RecordMemo::default();
        let rec = record("s1", 3);
        let (text, w) = written(&rec);
        memo.put(w);
        assert_eq!(memo.get("s1", &text), Some(rec.clone()));
        assert_eq!(memo.get("s1", &text), Some(rec), "read again");

        // The store holds other text (another writer, a failed commit): no record.
        let other = serde_json::to_string(&record("s1", 4)).unwrap();
        assert_eq!(memo.get("s1", &other), None);
        assert_eq!(memo.get("s2", &text), None, "another session's record");
        // The status alone, on the same terms.
        assert_eq!(memo.status("s1", &text), Some(TurnStatus::Running));
        assert_eq!(memo.status("s1", &other), None);
        assert_eq!(memo.status("s2", &text), None);
    }

    #[test]
    fn a_record_that_would_not_read_back_equal_or_whose_turn_ended_is_not_kept() {
        let mut memo = RecordMemo::default();
        let running = record("s1", 1);
        let (text, w) = written(&running);
        memo.put(w);

        let mut null_result = running.clone();
        null_result.result = Some(serde_json::Value::Null);
        let null_text = serde_json::to_string(&null_result).unwrap();
        let back: TurnRecord = serde_json::from_str(&null_text).unwrap();
        assert_ne!(back, null_result, "Some(null) reads back as None");
        memo.put(Written::of(&null_result, &null_text));
        assert_eq!(memo.get("s1", &null_text), None);
        assert_eq!(memo.get("s1", &text), None, "the older copy is dropped too");

        memo.put(written(&running).1);
        let mut ended = running;
        ended.status = harness_types::api::TurnStatus::Completed;
        let (ended_text, w) = written(&ended);
        memo.put(w);
        assert_eq!(memo.get("s1", &ended_text), None);
        assert!(
            memo.by_session.is_empty(),
            "an ended turn's record is not kept"
        );
    }

    #[test]
    fn the_memo_keeps_a_bounded_number_of_sessions_dropping_the_least_recently_written() {
        let mut memo = RecordMemo::default();
        let mut texts = Vec::new();
        for i in 0..RECORD_MEMO_SESSIONS + 1 {
            let (text, w) = written(&record(&format!("s{i}"), 1));
            memo.put(w);
            texts.push(text);
        }
        assert_eq!(memo.by_session.len(), RECORD_MEMO_SESSIONS);
        assert!(memo.get("s0", &texts[0]).is_none(), "the oldest went first");
        assert!(memo.get("s1", &texts[1]).is_some());
    }
}
