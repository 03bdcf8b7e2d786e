//! Per-session maps kept to a bound by dropping the entry used least recently (the loop's
//! transcript cache and record memo).

use std::collections::HashMap;

/// Makes room for one more session in `map`, bounded at `bound`: when `session_id` is new and
/// the map is full, drops the entry whose `stamp` (a use counter) is lowest. A linear scan:
/// it runs only when a session new to a full map arrives, over a few hundred entries.
pub(crate) fn make_room<V>(
    map: &mut HashMap<String, V>,
    session_id: &str,
    bound: usize,
    stamp: impl Fn(&V) -> u64,
) {
    if map.len() < bound || map.contains_key(session_id) {
        return;
    }
    if let Some(oldest) = map
        .iter()
        .min_by_key(|(_, v)| stamp(v))
        .map(|(k, _)| k.clone())
    {
        map.remove(&oldest);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_session_in_a_full_map_drops_the_least_recently_used_and_a_known_one_drops_none() {
        let mut map: HashMap<String, u64> = [("a", 3), ("b", 1), ("c", 2)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        make_room(&mut map, "a", 3, |v| *v);
        assert_eq!(map.len(), 3, "a session already there needs no room");
        make_room(&mut map, "d", 4, |v| *v);
        assert_eq!(map.len(), 3, "not full");
        make_room(&mut map, "d", 3, |v| *v);
        assert!(!map.contains_key("b") && map.len() == 2, "{map:?}");
    }
}
