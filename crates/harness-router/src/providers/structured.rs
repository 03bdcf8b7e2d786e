//! The loop's provider-neutral structured-output request, `{type: "json", schema?}`, in the form
//! of OpenAI's Chat Completions `response_format` (the Responses adapter derives `text.format`
//! from that form). A value already in a provider's own form passes through unchanged.

use serde_json::{json, Value};

use crate::providers::JsonSchemaForm;

pub(crate) fn chat_completions_format(rf: &Value) -> Value {
    server_format(rf, JsonSchemaForm::Catalog)
}

/// [`chat_completions_format`] in the form a server with grammar-constrained JSON reads.
pub(crate) fn server_format(rf: &Value, form: JsonSchemaForm) -> Value {
    if rf.get("type").and_then(Value::as_str) != Some("json") {
        return rf.clone();
    }
    let schema = rf.get("schema").filter(|s| s.is_object());
    if let (JsonSchemaForm::JsonObjectSchema, Some(schema)) = (form, schema) {
        return json!({"type": "json_object", "schema": schema});
    }
    match schema {
        // Not strict: strict mode refuses schemas that leave properties optional, which a
        // caller's contract may well do; the loop validates the value itself either way.
        Some(schema) => json!({"type": "json_schema",
                               "json_schema": {"name": "result", "schema": schema, "strict": false}}),
        None => json!({"type": "json_object"}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_neutral_form_maps_to_json_schema_or_json_object() {
        let s = json!({"type": "object"});
        assert_eq!(
            chat_completions_format(&json!({"type": "json", "schema": s})),
            json!({"type": "json_schema", "json_schema": {"name": "result", "schema": {"type": "object"}, "strict": false}})
        );
        assert_eq!(
            chat_completions_format(&json!({"type": "json"})),
            json!({"type": "json_object"})
        );
        let native = json!({"type": "json_object"});
        assert_eq!(chat_completions_format(&native), native);
        // llama-cpp-python's form: the schema next to `json_object`.
        assert_eq!(
            server_format(
                &json!({"type": "json", "schema": s}),
                JsonSchemaForm::JsonObjectSchema
            ),
            json!({"type": "json_object", "schema": {"type": "object"}})
        );
    }
}
