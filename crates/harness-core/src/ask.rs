//! `harness::ask`: the model puts a decision with discrete options to the user. The loop answers
//! the call itself (it is never dispatched to a target, never held by a hook) and the turn ends
//! on the question: the user's next message is the answer.

use harness_types::api::{AskQuestion, AskRequest};
use serde_json::{json, Value};

pub(crate) const ASK: &str = "harness::ask";

/// Whitespace-only counts as empty; limits count characters, not bytes.
fn length(field: &str, value: &str, min: usize, max: Option<usize>) -> Result<(), String> {
    let n = value.trim().chars().count();
    if n < min {
        return Err(format!("{field} must not be empty"));
    }
    if let Some(max) = max {
        let got = value.chars().count();
        if got > max {
            return Err(format!(
                "{field} must be at most {max} characters (got {got})"
            ));
        }
    }
    Ok(())
}

fn one_line(field: &str, value: &str) -> Result<(), String> {
    if value.contains(['\n', '\r']) {
        return Err(format!("{field} must be one line (no line breaks)"));
    }
    Ok(())
}

fn check_question(i: usize, q: &AskQuestion) -> Result<(), String> {
    let at = format!("questions[{i}]");
    length(&format!("{at}.header"), &q.header, 1, Some(16))?;
    one_line(&format!("{at}.header"), &q.header)?;
    length(&format!("{at}.question"), &q.question, 1, None)?;
    let n = q.options.len();
    if !(2..=4).contains(&n) {
        return Err(format!("{at}.options must have 2 to 4 options (got {n})"));
    }
    let mut seen: Vec<&str> = Vec::with_capacity(n);
    for (j, o) in q.options.iter().enumerate() {
        let field = format!("{at}.options[{j}].label");
        length(&field, &o.label, 1, Some(80))?;
        one_line(&field, &o.label)?;
        let label = o.label.trim();
        if seen.contains(&label) {
            return Err(format!("{field} repeats the label '{label}'"));
        }
        seen.push(label);
    }
    Ok(())
}

/// Parses and checks the arguments; `Err` is the refusal text the model reads.
pub(crate) fn parse(arguments: &Value) -> Result<AskRequest, String> {
    let req: AskRequest = harness_types::parse::parse_payload(arguments.clone())
        .map_err(|e| format!("invalid harness::ask arguments: {}", e.message))?;
    let n = req.questions.len();
    if !(1..=4).contains(&n) {
        return Err(format!("questions must have 1 to 4 questions (got {n})"));
    }
    for (i, q) in req.questions.iter().enumerate() {
        check_question(i, q)?;
    }
    Ok(req)
}

/// The card the result's `details` carry: `multi_select` always present, `description` only
/// when given.
pub(crate) fn card(req: &AskRequest, question_id: &str, session_id: &str, turn_id: &str) -> Value {
    let questions: Vec<Value> = req
        .questions
        .iter()
        .map(|q| {
            let options: Vec<Value> = q
                .options
                .iter()
                .map(|o| {
                    let mut v = json!({"label": o.label.trim()});
                    if let Some(d) = &o.description {
                        v["description"] = json!(d);
                    }
                    v
                })
                .collect();
            json!({"header": q.header.trim(), "question": q.question, "multi_select": q.multi_select.unwrap_or(false), "options": options})
        })
        .collect();
    json!({"status": "awaiting_answer", "question_id": question_id, "session_id": session_id,
           "turn_id": turn_id, "questions": questions})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(header: &str, labels: &[&str]) -> Value {
        let options: Vec<Value> = labels.iter().map(|l| json!({"label": l})).collect();
        json!({"header": header, "question": "Which?", "options": options})
    }

    #[test]
    fn limits_name_the_field_and_count_characters() {
        let ok = json!({"questions": [q("Approach", &["Pause", "End"])]});
        assert!(parse(&ok).is_ok());
        let long =
            json!({"questions": [q("Approach", &["a", "b"]), q(&"h".repeat(17), &["a", "b"])]});
        assert_eq!(
            parse(&long).unwrap_err(),
            "questions[1].header must be at most 16 characters (got 17)"
        );
        // 16 characters of 2 bytes each fit.
        assert!(parse(&json!({"questions": [q(&"é".repeat(16), &["a", "b"])]})).is_ok());
        assert_eq!(
            parse(&json!({"questions": [q("   ", &["a", "b"])]})).unwrap_err(),
            "questions[0].header must not be empty"
        );
        assert!(parse(&json!({"questions": [q("H", &["a"])]}))
            .unwrap_err()
            .contains("2 to 4 options (got 1)"));
        assert!(parse(&json!({"questions": [q("H", &["a ", " a"])]}))
            .unwrap_err()
            .contains("repeats the label 'a'"));
        assert!(parse(&json!({"questions": [q("H", &["a\nb", "c"])]}))
            .unwrap_err()
            .contains("questions[0].options[0].label must be one line"));
        assert!(parse(&json!({"questions": []}))
            .unwrap_err()
            .contains("1 to 4 questions (got 0)"));
        assert!(
            parse(&json!({"questions": [q("H", &["a", "b"])], "extra": 1}))
                .unwrap_err()
                .starts_with("invalid harness::ask arguments: extra")
        );
    }

    #[test]
    fn the_card_always_says_multi_select_and_omits_absent_descriptions() {
        let req = parse(&json!({"questions": [{"header": "H", "question": "Q?",
            "options": [{"label": "a", "description": "first"}, {"label": "b"}]}]}))
        .unwrap();
        let c = card(&req, "q1", "s", "t");
        assert_eq!(c["status"], "awaiting_answer");
        assert_eq!(c["questions"][0]["multi_select"], false);
        assert_eq!(c["questions"][0]["options"][0]["description"], "first");
        assert!(c["questions"][0]["options"][1].get("description").is_none());
    }
}
