//! Deterministic ids.
//!
//! Every write of the loop has an id derived from `(turn_id, step)` or `(turn_id, call_id)`, so a
//! redelivered step rewrites the same entries instead of adding new ones. Ids built from
//! caller-supplied text go through [`san`], an injective escape: two different inputs can never
//! produce the same id.

/// Injective escape for ids: keeps `[A-Za-z0-9_-]`, writes every other byte as `~HH` (uppercase
/// hex), `~` included.
pub fn san(input: &str) -> String {
    let mut out = String::with_capacity(input.len());
    for b in input.bytes() {
        if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' {
            out.push(b as char);
        } else {
            out.push('~');
            out.push_str(&format!("{b:02X}"));
        }
    }
    out
}

fn random_hex() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// `t_<32 lowercase hex>`: a UUIDv7, so turn ids sort by creation time. The keys the event log
/// deduplicates on are built from them, and time-ordered keys land on the last page of their
/// index, which the turns committed together share; random ones each dirtied a page of their
/// own, two per turn (at the bench's 200 sessions that index had 9.5% of the WAL pages with
/// random turn ids, 2.0% with these).
pub fn new_turn_id() -> String {
    format!("t_{}", uuid::Uuid::now_v7().simple())
}

/// `s_<32 lowercase hex>`: a UUIDv7, like turn ids. Every transcript table and index is keyed
/// by session first; sessions made about the same time, which are the ones running together,
/// then sit side by side, so the steps committed together share index pages instead of each
/// dirtying its own (WAL pages per step at the bench's 200 sessions: 18.9 with random session
/// ids, 15.5-15.9 with these).
pub fn new_session_id() -> String {
    format!("s_{}", uuid::Uuid::now_v7().simple())
}

/// `q_<32 lowercase hex>`.
pub fn new_queue_id() -> String {
    format!("q_{}", random_hex())
}

/// `e_<32 lowercase hex>` for entries with no deterministic name.
pub fn new_entry_id() -> String {
    format!("e_{}", random_hex())
}

pub fn assistant_entry(turn_id: &str, step: u64) -> String {
    format!("e_{turn_id}_{step}_assistant")
}

/// The compaction record written by step `step` (spec §2.6).
pub fn compaction_entry(turn_id: &str, step: u64) -> String {
    format!("e_{turn_id}_{step}_compaction")
}

pub fn call_result_entry(turn_id: &str, call_id: &str) -> String {
    format!("e_{turn_id}_{}", san(call_id))
}

pub fn error_entry(turn_id: &str) -> String {
    format!("e_{turn_id}_error")
}

pub fn stopped_entry(turn_id: &str) -> String {
    format!("e_{turn_id}_stopped")
}

pub fn nudge_entry(turn_id: &str, k: u32) -> String {
    format!("e_{turn_id}_nudge_{k}")
}

pub fn max_turns_entry(turn_id: &str) -> String {
    format!("e_{turn_id}_max_turns")
}

pub fn transient_resume_entry(turn_id: &str, k: u32) -> String {
    format!("e_{turn_id}_transient_resume_{k}")
}

pub fn recovery_entry(turn_id: &str, k: u32, phase: &str) -> String {
    format!("e_{turn_id}_transient_recovery_{k}_{phase}")
}

pub fn idempotent_user_entry(key: &str) -> String {
    format!("e_idem_{}", san(key))
}

/// The `request_id` of the generation of `step`: `<turn_id>:<step>`.
pub fn request_id(turn_id: &str, step: u64) -> String {
    format!("{turn_id}:{step}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn san_keeps_safe_bytes_and_escapes_the_rest() {
        assert_eq!(san("call_1-A"), "call_1-A");
        assert_eq!(san("a:b"), "a~3Ab");
        assert_eq!(san("~"), "~7E");
        assert_eq!(san("é"), "~C3~A9");
    }

    #[test]
    fn san_is_injective_where_a_lossy_escape_collides() {
        // A lossy scheme mapping unsafe bytes to `_` would merge all of these.
        let inputs = ["a_b", "a:b", "a.b", "a~3Ab", "a b", "a~b"];
        let mut outs: Vec<String> = inputs.iter().map(|s| san(s)).collect();
        outs.sort();
        outs.dedup();
        assert_eq!(outs.len(), inputs.len());
    }

    #[test]
    fn entry_ids_are_stable() {
        assert_eq!(assistant_entry("t_1", 3), "e_t_1_3_assistant");
        assert_eq!(call_result_entry("t_1", "c:1"), "e_t_1_c~3A1");
        assert_eq!(request_id("t_1", 3), "t_1:3");
        assert!(new_turn_id().starts_with("t_") && new_turn_id().len() == 34);
    }

    fn in_creation_order(prefix: &str, new: fn() -> String) {
        let ids: Vec<String> = (0..2000).map(|_| new()).collect();
        for id in &ids {
            let hex = id.strip_prefix(prefix).expect(id);
            assert_eq!(hex.len(), 32, "{id}");
            assert!(
                hex.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
                "{id}"
            );
        }
        // Many fall in the same millisecond: the order holds within one too.
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "{prefix} out of order");
    }

    #[test]
    fn turn_and_session_ids_are_lowercase_hex_in_creation_order_and_distinct() {
        in_creation_order("t_", new_turn_id);
        in_creation_order("s_", new_session_id);
    }
}
