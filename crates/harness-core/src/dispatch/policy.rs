//! The fail-closed dispatch policy.

use globset::{Glob, GlobSet, GlobSetBuilder};
use harness_types::api::FunctionPolicy;

/// Functions no policy can open to a model: they would let it drive the loop itself.
const NEVER_CALLABLE: &[&str] = &["harness::turn"];

/// A compiled dispatch policy. Absent, an empty allow list, or any invalid glob deny everything;
/// a deny match beats an allow match; `*` spans `::` (globset's default, no path separator).
pub(crate) struct Policy {
    sets: Option<(GlobSet, GlobSet)>,
}

fn compile(globs: &[String]) -> Option<GlobSet> {
    let mut b = GlobSetBuilder::new();
    for g in globs {
        b.add(Glob::new(g).ok()?);
    }
    b.build().ok()
}

impl Policy {
    pub(crate) fn new(p: Option<&FunctionPolicy>) -> Policy {
        let sets = p
            .filter(|p| !p.allow.is_empty())
            .and_then(|p| Some((compile(&p.allow)?, compile(&p.deny)?)));
        Policy { sets }
    }

    /// False when nothing at all can be called (then no tools are sent).
    pub(crate) fn any(&self) -> bool {
        self.sets.is_some()
    }

    pub(crate) fn allows(&self, function_id: &str) -> bool {
        // The control-plane wall stands above every policy: a model never sees these offered.
        if NEVER_CALLABLE.contains(&function_id) || super::wall::operator_only(function_id) {
            return false;
        }
        match &self.sets {
            Some((allow, deny)) => allow.is_match(function_id) && !deny.is_match(function_id),
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(allow: &[&str], deny: &[&str]) -> Policy {
        Policy::new(Some(&FunctionPolicy {
            allow: allow.iter().map(|s| s.to_string()).collect(),
            deny: deny.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }))
    }

    #[test]
    fn absent_policy_denies_everything() {
        assert!(!Policy::new(None).allows("a::b"));
        assert!(!Policy::new(None).any());
    }

    #[test]
    fn empty_allow_denies_everything() {
        assert!(!policy(&[], &[]).allows("a::b"));
        assert!(!policy(&[], &["x"]).any());
    }

    #[test]
    fn deny_wins_over_allow() {
        assert!(!policy(&["shell::*"], &["shell::fs::*"]).allows("shell::fs::read"));
        assert!(policy(&["shell::*"], &["shell::fs::*"]).allows("shell::exec"));
        assert!(!policy(&["a::b"], &["a::b"]).allows("a::b"));
    }

    #[test]
    fn an_invalid_glob_anywhere_denies_everything() {
        assert!(!policy(&["shell::*", "[bad"], &[]).allows("shell::x"));
        assert!(!policy(&["*"], &["{unclosed"]).allows("anything"));
        assert!(!policy(&["*"], &["{unclosed"]).any());
    }

    #[test]
    fn star_spans_double_colons() {
        assert!(policy(&["*"], &[]).allows("shell::fs::read"));
        assert!(policy(&["shell::*"], &[]).allows("shell::fs::read"));
        assert!(!policy(&["shell::*"], &[]).allows("fs::read"));
        assert!(policy(&["*::read"], &[]).allows("shell::fs::read"));
        assert!(policy(&["weather::{now,forecast}"], &[]).allows("weather::now"));
        assert!(policy(&["weather::?ow"], &[]).allows("weather::now"));
    }

    #[test]
    fn the_loop_step_is_never_callable() {
        assert!(!policy(&["*"], &[]).allows("harness::turn"));
    }
}
