//! Reading an FL update out of what a proplet reported: the envelope's accepted shapes,
//! the identity checks against the round, and messages that quote what was wrong.

use base64::Engine;
use propeller_broker::protocol::round_number;
use serde_json::{Map, Number, Value};

use super::{
    EnvelopeError, ExpectedUpdate, UpdateEnvelope, DEFAULT_NUM_SAMPLES, FORMAT_JSON_F64,
    LENIENT_B64, MAX_STRING_NESTING, SNIPPET_CHARS,
};

/// Turns what a proplet reported as a task's results into a checked [`UpdateEnvelope`].
///
/// Accepted shapes (each may also arrive as a JSON string holding it): the envelope object
/// itself, `{"update_envelope": …}`, `{"results": {"update_envelope": …}}`, and a whole result
/// message `{"task_id", "results": <envelope>, …}`. Omitted `job_id`, `proplet_id` and
/// `global_version` come from `expected` (as does an omitted `round_id`, since the Task already
/// pins the round); a sent `round_id`, `job_id` or `proplet_id` that disagrees with `expected`
/// is rejected. `num_samples` defaults to [`DEFAULT_NUM_SAMPLES`], `format` to
/// [`FORMAT_JSON_F64`]. `update_b64` is required and must be base64.
pub fn extract_update(
    results: &Value,
    expected: &ExpectedUpdate,
) -> Result<UpdateEnvelope, EnvelopeError> {
    let envelope = locate_envelope(results)?;
    build_envelope(&envelope, expected)
}

/// The object holding the envelope fields, wherever in `results` it sits.
pub(super) fn locate_envelope(results: &Value) -> Result<Map<String, Value>, EnvelopeError> {
    let top = to_object(results)?;
    if let Some(nested) = present(&top, "update_envelope") {
        return to_object(nested);
    }
    if top.contains_key("update_b64") {
        return Ok(top);
    }
    if let Some(inner) = present(&top, "results") {
        // A plain-text inner result ("42") is simply not an envelope; fall through to the
        // missing-field error, which says what is wrong more usefully than a parse error.
        if let Ok(inner) = to_object(inner) {
            if let Some(nested) = present(&inner, "update_envelope") {
                return to_object(nested);
            }
            if inner.contains_key("update_b64") {
                return Ok(inner);
            }
        }
    }
    Ok(top)
}

/// `value` as an object, unwrapping JSON strings that hold JSON.
pub(super) fn to_object(value: &Value) -> Result<Map<String, Value>, EnvelopeError> {
    let mut current = value.clone();
    for _ in 0..=MAX_STRING_NESTING {
        match current {
            Value::Object(map) => return Ok(map),
            Value::String(text) => {
                let trimmed = text.trim();
                if trimmed.is_empty() {
                    return Err(EnvelopeError::NotJson("the text is empty".to_owned()));
                }
                current = serde_json::from_str(trimmed)
                    .map_err(|e| EnvelopeError::NotJson(e.to_string()))?;
            }
            other => {
                return Err(EnvelopeError::NotAnObject {
                    found: json_kind(&other),
                })
            }
        }
    }
    Err(EnvelopeError::NotJson(format!(
        "JSON strings are nested more than {MAX_STRING_NESTING} levels deep"
    )))
}

/// The value under `key`, treating JSON `null` as absent.
pub(super) fn present<'a>(map: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    map.get(key).filter(|v| !v.is_null())
}

pub(super) fn build_envelope(
    map: &Map<String, Value>,
    expected: &ExpectedUpdate,
) -> Result<UpdateEnvelope, EnvelopeError> {
    let update_b64 =
        optional_string(map, "update_b64")?.ok_or(EnvelopeError::MissingField("update_b64"))?;
    let cleaned: String = update_b64
        .chars()
        .filter(|c| !c.is_ascii_whitespace())
        .collect();
    LENIENT_B64
        .decode(&cleaned)
        .map_err(|e| EnvelopeError::InvalidField {
            field: "update_b64",
            reason: format!("not base64 ({e})"),
        })?;

    let round_id = match present(map, "round_id") {
        None => expected.round,
        Some(value) => {
            let sent = round_from_value(value)?;
            if expected.round != 0 && sent != expected.round {
                return Err(EnvelopeError::Mismatch {
                    field: "round_id",
                    expected: expected.round.to_string(),
                    got: sent.to_string(),
                });
            }
            sent
        }
    };

    let job_id = checked_identity(map, "job_id", &expected.job_id)?;
    let proplet_id = checked_identity(map, "proplet_id", &expected.proplet_id)?;
    let global_version =
        optional_string(map, "global_version")?.unwrap_or_else(|| expected.global_version.clone());
    let task_id = optional_string(map, "task_id")?.unwrap_or_default();
    let num_samples = match present(map, "num_samples") {
        None => DEFAULT_NUM_SAMPLES,
        Some(value) => count_from_value(value)?,
    };
    let metrics = match present(map, "metrics") {
        None => None,
        Some(Value::Object(m)) => Some(m.clone()),
        Some(other) => {
            return Err(EnvelopeError::InvalidField {
                field: "metrics",
                reason: format!("expected an object, got a {}", json_kind(other)),
            })
        }
    };
    let format = optional_string(map, "format")?.unwrap_or_else(|| FORMAT_JSON_F64.to_owned());

    Ok(UpdateEnvelope {
        task_id,
        job_id,
        round_id,
        global_version,
        proplet_id,
        num_samples,
        update_b64: cleaned,
        metrics,
        format: Some(format),
    })
}

/// A string field that must agree with the round's expectation when both are known, comes
/// from the round when the sender omitted it, and must end up non-empty.
pub(super) fn checked_identity(
    map: &Map<String, Value>,
    field: &'static str,
    expected: &str,
) -> Result<String, EnvelopeError> {
    match optional_string(map, field)? {
        Some(sent) if !expected.is_empty() && sent != expected => Err(EnvelopeError::Mismatch {
            field,
            expected: snippet(expected),
            got: snippet(&sent),
        }),
        Some(sent) => Ok(sent),
        None if expected.is_empty() => Err(EnvelopeError::MissingField(field)),
        None => Ok(expected.to_owned()),
    }
}

/// A trimmed string field; absent, `null` and blank all read as `None`.
pub(super) fn optional_string(
    map: &Map<String, Value>,
    field: &'static str,
) -> Result<Option<String>, EnvelopeError> {
    match present(map, field) {
        None => Ok(None),
        Some(Value::String(s)) => {
            let trimmed = s.trim();
            Ok((!trimmed.is_empty()).then(|| trimmed.to_owned()))
        }
        Some(other) => Err(EnvelopeError::InvalidField {
            field,
            reason: format!("expected a string, got a {}", json_kind(other)),
        }),
    }
}

pub(super) fn round_from_value(value: &Value) -> Result<u64, EnvelopeError> {
    let parsed = match value {
        Value::Number(n) => whole_number(n),
        Value::String(s) => round_number(s),
        _ => None,
    };
    parsed.ok_or_else(|| EnvelopeError::InvalidField {
        field: "round_id",
        reason: format!(
            "{} is not a round number (expected 1, \"1\", \"round-1\" or \"r1\")",
            describe(value)
        ),
    })
}

pub(super) fn count_from_value(value: &Value) -> Result<u64, EnvelopeError> {
    let parsed = match value {
        Value::Number(n) => whole_number(n),
        Value::String(s) => s.trim().parse::<u64>().ok(),
        _ => None,
    };
    parsed.ok_or_else(|| EnvelopeError::InvalidField {
        field: "num_samples",
        reason: format!("{} is not a non-negative whole number", describe(value)),
    })
}

/// A JSON number as a `u64` when it is a non-negative whole number (`3` or `3.0`).
pub(super) fn whole_number(n: &Number) -> Option<u64> {
    if let Some(u) = n.as_u64() {
        return Some(u);
    }
    let f = n.as_f64()?;
    // 2^64 as f64; anything at or above it does not fit.
    let limit = 18_446_744_073_709_551_616.0_f64;
    if f.is_finite() && f >= 0.0 && f < limit && f.fract() == 0.0 {
        // In range and whole, so the conversion is exact.
        Some(f as u64)
    } else {
        None
    }
}

pub(super) fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// A short rendering of a sender's value for an error message.
pub(super) fn describe(value: &Value) -> String {
    match value {
        Value::String(s) => format!("{:?}", snippet(s)),
        Value::Number(n) => n.to_string(),
        other => json_kind(other).to_owned(),
    }
}

/// `text` cut to [`SNIPPET_CHARS`] characters, so hostile input cannot flood logs.
pub(super) fn snippet(text: &str) -> String {
    let mut chars = text.chars();
    let mut out: String = chars.by_ref().take(SNIPPET_CHARS).collect();
    if chars.next().is_some() {
        out.push('…');
    }
    out
}
