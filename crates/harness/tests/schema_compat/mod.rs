//! The field-by-field comparison of a v1.0.6 API reference schema with one of ours, shared by
//! the engine-side check (`iii_schema.rs`) and the HTTP one (`compat_v1_0_6.rs`).
//!
//! Compatible: every property of a reference schema exists in ours with a compatible type
//! (resolving `$ref`/`definitions`, `allOf` wrappers, `oneOf`/`anyOf` variants, array items,
//! nested objects); a request of ours requires nothing the reference leaves optional; a response
//! of ours guarantees every field the reference requires. Extra optional fields are fine.
//!
//! `instances` builds requests a client of the reference could send (every property filled,
//! every enum value and union variant used by one of them), which our own schema must accept:
//! the structural comparison cannot see a narrowed pattern, bound or `additionalProperties`.
#![allow(dead_code)]

use std::collections::BTreeSet;

use serde_json::{json, Map, Value};

/// A byte-for-byte copy of the v1.0.6 API reference, kept in the repository so the check never
/// depends on a file outside it.
pub const REFERENCE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/reference/harness-api-reference.v1.0.6.json"
);

pub fn reference() -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(REFERENCE).expect("read the v1.0.6 API reference"),
    )
    .expect("the reference is JSON")
}

#[derive(Clone, Copy, PartialEq)]
pub enum Dir {
    /// Ours must accept everything the reference accepts.
    Request,
    /// Ours must produce everything the reference promises.
    Response,
}

struct Ctx<'a> {
    ref_root: &'a Value,
    our_root: &'a Value,
    dir: Dir,
    problems: Vec<String>,
    /// `$ref` pairs being compared (recursive schemas), and the depth.
    seen: std::collections::HashSet<(String, String)>,
    depth: usize,
}

/// Follows `$ref` (`#/definitions/X`) and single-element `allOf` wrappers.
fn resolve<'a>(mut s: &'a Value, root: &'a Value) -> &'a Value {
    for _ in 0..32 {
        if let Some(r) = s.get("$ref").and_then(Value::as_str) {
            let name = r.rsplit('/').next().unwrap_or_default();
            match root
                .get("definitions")
                .and_then(|d| d.get(name))
                .or_else(|| root.get("$defs").and_then(|d| d.get(name)))
            {
                Some(t) => {
                    s = t;
                    continue;
                }
                None => return s,
            }
        }
        if let Some(all) = s.get("allOf").and_then(Value::as_array) {
            if all.len() == 1 {
                s = &all[0];
                continue;
            }
        }
        return s;
    }
    s
}

fn types(s: &Value) -> Option<BTreeSet<String>> {
    match s.get("type") {
        Some(Value::String(t)) => Some([t.clone()].into()),
        Some(Value::Array(a)) => Some(
            a.iter()
                .filter_map(|t| t.as_str().map(str::to_string))
                .collect(),
        ),
        _ => None,
    }
}

fn is_any(s: &Value) -> bool {
    s == &json!(true)
        || s.as_object().is_some_and(|o| {
            o.keys()
                .all(|k| k == "description" || k == "title" || k == "default")
        })
}

fn variants(s: &Value) -> Option<&Vec<Value>> {
    s.get("oneOf")
        .or_else(|| s.get("anyOf"))
        .and_then(Value::as_array)
}

impl Ctx<'_> {
    fn sub(&self) -> Self {
        Ctx {
            ref_root: self.ref_root,
            our_root: self.our_root,
            dir: self.dir,
            problems: Vec::new(),
            seen: self.seen.clone(),
            depth: self.depth,
        }
    }

    fn check(&mut self, path: &str, r: &Value, o: &Value) {
        let name = |s: &Value| {
            s.get("$ref")
                .and_then(Value::as_str)
                .map(str::to_string)
                .or_else(|| {
                    s.get("allOf")
                        .and_then(|a| a.get(0))
                        .and_then(|a| a.get("$ref"))
                        .and_then(Value::as_str)
                        .map(str::to_string)
                })
        };
        if let (Some(a), Some(b)) = (name(r), name(o)) {
            if !self.seen.insert((a, b)) {
                return; // already being compared further up: a recursive schema
            }
        }
        if self.depth > 40 {
            return;
        }
        self.depth += 1;
        self.check_inner(path, r, o);
        self.depth -= 1;
    }

    fn check_inner(&mut self, path: &str, r: &Value, o: &Value) {
        let (r, o) = (resolve(r, self.ref_root), resolve(o, self.our_root));
        if is_any(r) || is_any(o) {
            return;
        }
        // Variants: every variant of the reference is matched by one of ours.
        if let Some(rv) = variants(r) {
            let ours: Vec<Value> = match variants(o) {
                Some(v) => v.clone(),
                None => vec![o.clone()],
            };
            for (i, v) in rv.iter().enumerate() {
                let matched = ours.iter().any(|ov| {
                    let mut sub = self.sub();
                    sub.check(&format!("{path}|{i}"), v, ov);
                    sub.problems.is_empty()
                });
                if !matched {
                    self.problems.push(format!("{path}: variant {i} of the reference ({}) has no compatible variant in ours", short(v)));
                }
            }
            return;
        }
        if let (Some(ov), Some(rt)) = (variants(o), types(r)) {
            // A reference type union against ours (`["string", "null"]` vs `anyOf[enum, null]`):
            // each of its types must be taken by one of our variants. A free string of the
            // reference narrowed to our enum of its documented values passes (no enum to compare).
            if rt.len() > 1 {
                for t in &rt {
                    let mut one = r.clone();
                    one["type"] = json!(t);
                    let ok = ov.iter().any(|v| {
                        let mut sub = self.sub();
                        sub.check(path, &one, v);
                        sub.problems.is_empty()
                    });
                    if !ok {
                        self.problems.push(format!(
                            "{path}: no variant of ours takes the reference's {t}"
                        ));
                    }
                }
                return;
            }
        }
        if variants(o).is_some() {
            // A reference type against our union: one of ours must take it.
            let ok = variants(o).unwrap().iter().any(|ov| {
                let mut sub = self.sub();
                sub.check(path, r, ov);
                sub.problems.is_empty()
            });
            if !ok {
                self.problems.push(format!(
                    "{path}: no variant of ours is compatible with {}",
                    short(r)
                ));
            }
            return;
        }
        if let (Some(rt), Some(ot)) = (types(r), types(o)) {
            let widen = |t: &String, set: &BTreeSet<String>| {
                set.contains(t) || (t == "integer" && set.contains("number"))
            };
            let ok = match self.dir {
                Dir::Request => rt.iter().all(|t| widen(t, &ot)),
                Dir::Response => {
                    ot.iter().filter(|t| *t != "null").all(|t| widen(t, &rt))
                        && ot.iter().any(|t| rt.contains(t) || widen(t, &rt))
                }
            };
            if !ok {
                self.problems.push(format!(
                    "{path}: type {rt:?} in the reference, {ot:?} in ours"
                ));
            }
        }
        if let Some(re) = r.get("enum").and_then(Value::as_array) {
            if let Some(oe) = o.get("enum").and_then(Value::as_array) {
                let missing: Vec<&Value> = re
                    .iter()
                    .filter(|v| !v.is_null() && !oe.contains(v))
                    .collect();
                if self.dir == Dir::Request && !missing.is_empty() {
                    self.problems.push(format!(
                        "{path}: enum values {missing:?} of the reference are not accepted"
                    ));
                }
            }
        }
        if let Some(rp) = r.get("properties").and_then(Value::as_object) {
            let op = o.get("properties").and_then(Value::as_object);
            for (name, rs) in rp {
                match op.and_then(|p| p.get(name)) {
                    Some(os) => self.check(&format!("{path}.{name}"), rs, os),
                    None => self
                        .problems
                        .push(format!("{path}.{name}: missing in ours")),
                }
            }
            let req = |s: &Value| -> BTreeSet<String> {
                s.get("required")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            };
            let (rr, or) = (req(r), req(o));
            match self.dir {
                Dir::Request => {
                    for f in or.difference(&rr) {
                        if rp.contains_key(f) {
                            self.problems.push(format!(
                                "{path}.{f}: optional in the reference, required in ours"
                            ));
                        }
                    }
                }
                Dir::Response => {
                    for f in rr.difference(&or) {
                        self.problems.push(format!(
                            "{path}.{f}: required in the reference's response, optional in ours"
                        ));
                    }
                }
            }
        }
        if let Some(ri) = r.get("items") {
            if let Some(oi) = o.get("items") {
                self.check(&format!("{path}[]"), ri, oi);
            }
        }
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    s.chars().take(120).collect()
}

/// Every difference between a reference schema `r` and ours `o`, each naming its path.
pub fn compare(name: &str, dir: Dir, r: &Value, o: &Value) -> Vec<String> {
    let mut ctx = Ctx {
        ref_root: r,
        our_root: o,
        dir,
        problems: Vec::new(),
        seen: Default::default(),
        depth: 0,
    };
    ctx.check(name, r, o);
    ctx.problems
}

/// Values the reference documents in prose for a free string property (by property name):
/// a client of the reference sends those, and `instances` uses them instead of an arbitrary
/// string.
pub type Documented<'a> = &'a [(&'a str, &'a [&'a str])];

/// The widest fan-out of a schema: its largest enum or union, so that `instances` uses each
/// value and variant at least once.
fn spread(s: &Value, root: &Value, depth: usize, documented: Documented) -> usize {
    if depth > 12 {
        return 1;
    }
    let s = resolve(s, root);
    let mut n = documented.iter().map(|(_, v)| v.len()).max().unwrap_or(1);
    if let Some(e) = s.get("enum").and_then(Value::as_array) {
        n = n.max(e.len());
    }
    if let Some(v) = variants(s) {
        n = n.max(v.len());
        for v in v {
            n = n.max(spread(v, root, depth + 1, documented));
        }
    }
    if let Some(p) = s.get("properties").and_then(Value::as_object) {
        for v in p.values() {
            n = n.max(spread(v, root, depth + 1, documented));
        }
    }
    if let Some(i) = s.get("items") {
        n = n.max(spread(i, root, depth + 1, documented));
    }
    n
}

/// Requests a client of the reference could send: instance `k` takes enum value `k` and union
/// variant `k` (modulo their count) everywhere, and fills every property it knows.
pub fn instances(schema: &Value, documented: Documented) -> Vec<Value> {
    (0..spread(schema, schema, 0, documented))
        .map(|k| instance(schema, schema, k, 0, documented))
        .collect()
}

fn instance(s: &Value, root: &Value, k: usize, depth: usize, documented: Documented) -> Value {
    let s = resolve(s, root);
    if let Some(c) = s.get("const") {
        return c.clone();
    }
    if let Some(e) = s.get("enum").and_then(Value::as_array) {
        let values: Vec<&Value> = e.iter().filter(|v| !v.is_null()).collect();
        if !values.is_empty() {
            return values[k % values.len()].clone();
        }
    }
    if let Some(v) = variants(s) {
        let usable: Vec<&Value> = v
            .iter()
            .filter(|v| resolve(v, root).get("type") != Some(&json!("null")))
            .collect();
        if !usable.is_empty() {
            return instance(usable[k % usable.len()], root, k, depth + 1, documented);
        }
    }
    let ty = match s.get("type") {
        Some(Value::String(t)) => t.clone(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_str)
            .find(|t| *t != "null")
            .unwrap_or("null")
            .to_string(),
        _ if s.get("properties").is_some() => "object".into(),
        _ => "string".into(),
    };
    match ty.as_str() {
        "object" => {
            let mut out = Map::new();
            let required: BTreeSet<&str> = s
                .get("required")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            if let Some(props) = s.get("properties").and_then(Value::as_object) {
                for (name, p) in props {
                    // Deep in a recursive schema only what is required, so it ends.
                    if depth > 6 && !required.contains(name.as_str()) {
                        continue;
                    }
                    let value = match documented.iter().find(|(n, _)| n == name) {
                        Some((_, values)) => json!(values[k % values.len()]),
                        None => instance(p, root, k, depth + 1, documented),
                    };
                    out.insert(name.clone(), value);
                }
            }
            Value::Object(out)
        }
        "array" => match s.get("items") {
            Some(i) if depth <= 6 => json!([instance(i, root, k, depth + 1, documented)]),
            _ => json!([]),
        },
        "integer" => json!(s.get("minimum").and_then(Value::as_u64).unwrap_or(0).max(1)),
        "number" => json!(1.5),
        "boolean" => json!(k.is_multiple_of(2)),
        "null" => Value::Null,
        _ => json!("x"),
    }
}

/// Why our schema refuses `instance`, or `None` when it accepts it.
pub fn refusal(ours: &Value, instance: &Value) -> Option<String> {
    let validator = match jsonschema::validator_for(ours) {
        Ok(v) => v,
        Err(e) => return Some(format!("our schema does not compile: {e}")),
    };
    let errors: Vec<String> = validator
        .iter_errors(instance)
        .take(3)
        .map(|e| format!("at '{}': {e}", e.instance_path().as_str()))
        .collect();
    (!errors.is_empty()).then(|| errors.join("; "))
}
