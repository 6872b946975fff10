//! The numeric layouts of model vectors (JSON f64 arrays, little-endian f32, f32 deltas):
//! decoding an update and encoding a result.

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde_json::{Number, Value};

use crate::decision::aggregation::extraction::snippet;

use super::{
    AggregationError, UpdateEnvelope, FORMAT_F32_DELTA, FORMAT_F32_LE, FORMAT_JSON_F64, LENIENT_B64,
};

/// The numeric layouts FedAvg can read and write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum VectorFormat {
    JsonF64,
    F32Le,
}

impl VectorFormat {
    pub(super) fn from_name(name: &str) -> Option<Self> {
        let name = name.trim();
        if name.eq_ignore_ascii_case(FORMAT_JSON_F64) {
            Some(Self::JsonF64)
        } else if name.eq_ignore_ascii_case(FORMAT_F32_LE)
            || name.eq_ignore_ascii_case(FORMAT_F32_DELTA)
        {
            Some(Self::F32Le)
        } else {
            None
        }
    }
}

/// Base64 of a JSON array of `values`, the `json-f64` payload. Non-finite values have no JSON
/// form and are written as `null`, which [`decode_vector`] then rejects.
pub fn encode_json_f64(values: &[f64]) -> String {
    let array = Value::Array(
        values
            .iter()
            .map(|v| Number::from_f64(*v).map_or(Value::Null, Value::Number))
            .collect(),
    );
    STANDARD.encode(array.to_string())
}

/// Base64 of `values` as raw little-endian `f32`, the `f32-le`/`f32-delta` payload.
pub fn encode_f32_le(values: &[f32]) -> String {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    STANDARD.encode(bytes)
}

/// Reads a JSON array of numbers with correctly rounded parsing.
///
/// serde_json's default float parser may be off by an ulp, so a vector written by
/// [`encode_json_f64`] would not read back bit-identical and an aggregate of equal vectors could
/// drift from its inputs. The grammar is strict JSON (`-?(0|[1-9]d*)(.d+)?([eE][+-]?d+)?`);
/// numbers beyond the `f64` range read as infinite and are rejected by the caller.
pub(super) fn parse_number_array(bytes: &[u8]) -> Result<Vec<f64>, String> {
    let text = std::str::from_utf8(bytes).map_err(|e| format!("not UTF-8 text ({e})"))?;
    let inner = text
        .trim_matches(is_json_space)
        .strip_prefix('[')
        .and_then(|t| t.strip_suffix(']'))
        .ok_or_else(|| "expected a JSON array of numbers".to_owned())?;
    if inner.trim_matches(is_json_space).is_empty() {
        return Ok(Vec::new());
    }
    inner
        .split(',')
        .enumerate()
        .map(|(index, token)| {
            let token = token.trim_matches(is_json_space);
            if is_json_number(token) {
                token
                    .parse::<f64>()
                    .map_err(|e| format!("element {index} ({:?}): {e}", snippet(token)))
            } else {
                Err(format!(
                    "element {index} is not a number: {:?}",
                    snippet(token)
                ))
            }
        })
        .collect()
}

pub(super) fn is_json_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\r')
}

/// Whether `token` matches the JSON number grammar exactly.
pub(super) fn is_json_number(token: &str) -> bool {
    let digits = |s: &str| s.bytes().take_while(u8::is_ascii_digit).count();
    let rest = token.strip_prefix('-').unwrap_or(token);
    let int_len = digits(rest);
    if int_len == 0 || (int_len > 1 && rest.starts_with('0')) {
        return false;
    }
    let mut rest = rest.get(int_len..).unwrap_or("");
    if let Some(frac) = rest.strip_prefix('.') {
        let frac_len = digits(frac);
        if frac_len == 0 {
            return false;
        }
        rest = frac.get(frac_len..).unwrap_or("");
    }
    if let Some(exp) = rest.strip_prefix(['e', 'E']) {
        let exp = exp.strip_prefix(['+', '-']).unwrap_or(exp);
        let exp_len = digits(exp);
        if exp_len == 0 {
            return false;
        }
        rest = exp.get(exp_len..).unwrap_or("");
    }
    rest.is_empty()
}

/// The raw bytes of an update, with errors naming the proplet.
pub(super) fn decode_bytes(env: &UpdateEnvelope) -> Result<Vec<u8>, AggregationError> {
    let cleaned: String = env
        .update_b64
        .chars()
        .filter(|c| !c.is_ascii_whitespace())
        .collect();
    LENIENT_B64
        .decode(cleaned)
        .map_err(|e| AggregationError::InvalidBase64 {
            proplet_id: env.proplet_id.clone(),
            reason: e.to_string(),
        })
}

/// The numbers in an update, read according to its format, so callers and tests can check
/// updates and aggregates numerically. Fails on formats FedAvg cannot read, bad base64, bad
/// payloads, empty vectors and non-finite values.
pub fn decode_vector(env: &UpdateEnvelope) -> Result<Vec<f64>, AggregationError> {
    let format = env.effective_format();
    let kind =
        VectorFormat::from_name(format).ok_or_else(|| AggregationError::UnsupportedFormat {
            format: snippet(format),
        })?;
    let bytes = decode_bytes(env)?;
    let values = match kind {
        VectorFormat::JsonF64 => {
            parse_number_array(&bytes).map_err(|reason| AggregationError::InvalidJsonPayload {
                proplet_id: env.proplet_id.clone(),
                reason,
            })?
        }
        VectorFormat::F32Le => {
            let (chunks, rest) = bytes.as_chunks::<4>();
            if !rest.is_empty() {
                return Err(AggregationError::InvalidF32Length {
                    proplet_id: env.proplet_id.clone(),
                    len: bytes.len(),
                });
            }
            chunks
                .iter()
                .map(|c| f64::from(f32::from_le_bytes(*c)))
                .collect()
        }
    };
    if values.is_empty() {
        return Err(AggregationError::EmptyVector {
            proplet_id: env.proplet_id.clone(),
        });
    }
    if let Some(index) = values.iter().position(|v| !v.is_finite()) {
        return Err(AggregationError::NonFinite {
            proplet_id: env.proplet_id.clone(),
            index,
        });
    }
    Ok(values)
}
