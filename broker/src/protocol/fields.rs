//! Key-by-key readers and writers shared by all message types.
//!
//! Decoding goes through [`Fields`], a view of one JSON object that remembers where it sits in
//! the message, so every error names the full key path. `null` is treated as absent everywhere,
//! because Go encodes empty slices and maps as `null` and Rust encodes `None` as `null`.

use std::collections::BTreeMap;

use base64::alphabet;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use base64::Engine as _;
use serde_json::{Map, Value};

use super::error::DecodeError;

/// Standard alphabet, padding written on encode (what Go and the upstream proplet produce).
const B64_ENCODE: GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// Standard alphabet, padding optional on decode, so unpadded senders are tolerated.
const B64_DECODE: GeneralPurpose = GeneralPurpose::new(
    &alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// Encodes bytes the way every upstream component decodes them (standard, padded).
pub(crate) fn b64_encode(bytes: &[u8]) -> String {
    B64_ENCODE.encode(bytes)
}

/// Decodes standard base64, padded or not.
pub(crate) fn b64_decode(text: &str) -> Result<Vec<u8>, base64::DecodeError> {
    B64_DECODE.decode(text)
}

/// At most 32 characters of a sender's value, for error messages: enough to recognise it,
/// too little to flood a log with a huge payload.
pub(crate) fn excerpt(text: &str) -> String {
    const MAX_CHARS: usize = 32;
    match text.char_indices().nth(MAX_CHARS) {
        None => format!("{text:?}"),
        Some((cut, _)) => format!("{:?}…", text.get(..cut).unwrap_or_default()),
    }
}

/// Parses a payload into a JSON object; the size check is done by the caller.
pub(crate) fn parse_object(payload: &[u8]) -> Result<Map<String, Value>, DecodeError> {
    let value: Value = serde_json::from_slice(payload).map_err(|e| DecodeError::NotJson {
        reason: e.to_string(),
    })?;
    match value {
        Value::Object(map) => Ok(map),
        _ => Err(DecodeError::NotAnObject),
    }
}

/// A JSON object being decoded, with the key path of the object inside the message.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fields<'a> {
    obj: &'a Map<String, Value>,
    path: &'a str,
}

fn wrong(key: String, expected: &'static str) -> DecodeError {
    DecodeError::WrongType { key, expected }
}

fn invalid(key: String, reason: impl Into<String>) -> DecodeError {
    DecodeError::InvalidValue {
        key,
        reason: reason.into(),
    }
}

/// Reads a JSON number as `u64`, accepting integral floats because Go numbers pass through
/// `float64` and cJSON prints every number as a double.
pub(crate) fn number_to_u64(value: &Value) -> Option<u64> {
    if let Some(n) = value.as_u64() {
        return Some(n);
    }
    let f = value.as_f64()?;
    // 2^64 as f64; anything at or above it does not fit.
    if f.is_finite() && f >= 0.0 && f.fract() == 0.0 && f < 18_446_744_073_709_551_616.0 {
        // Exact: f is integral and in range.
        Some(f as u64)
    } else {
        None
    }
}

/// Reads a JSON number as `i64`, accepting integral floats (see [`number_to_u64`]).
pub(crate) fn number_to_i64(value: &Value) -> Option<i64> {
    if let Some(n) = value.as_i64() {
        return Some(n);
    }
    let f = value.as_f64()?;
    // [-2^63, 2^63) as f64.
    if f.fract() == 0.0 && (-9_223_372_036_854_775_808.0..9_223_372_036_854_775_808.0).contains(&f)
    {
        Some(f as i64)
    } else {
        None
    }
}

impl<'a> Fields<'a> {
    /// The top-level object of a message.
    pub(crate) fn root(obj: &'a Map<String, Value>) -> Self {
        Self { obj, path: "" }
    }

    /// A nested object found at `path` (already the full key path).
    pub(crate) fn nested(obj: &'a Map<String, Value>, path: &'a str) -> Self {
        Self { obj, path }
    }

    /// The whole object, for types that keep unknown keys.
    pub(crate) fn raw(&self) -> &'a Map<String, Value> {
        self.obj
    }

    /// The full key path of `key` inside the message.
    pub(crate) fn key(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_owned()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    /// The value at `key`, with `null` reported as absent.
    pub(crate) fn get(&self, key: &str) -> Option<&'a Value> {
        match self.obj.get(key) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }

    /// A required string (may be empty).
    pub(crate) fn req_str(&self, key: &str) -> Result<String, DecodeError> {
        match self.get(key) {
            None => Err(DecodeError::MissingKey { key: self.key(key) }),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(wrong(self.key(key), "string")),
        }
    }

    /// A required, non-empty string: ids that address something.
    pub(crate) fn req_id(&self, key: &str) -> Result<String, DecodeError> {
        let s = self.req_str(key)?;
        if s.is_empty() {
            return Err(invalid(self.key(key), "must not be empty"));
        }
        Ok(s)
    }

    /// An optional string.
    pub(crate) fn opt_str(&self, key: &str) -> Result<Option<String>, DecodeError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(wrong(self.key(key), "string")),
        }
    }

    /// A string or a number rendered as decimal text (ids that some senders emit as numbers).
    pub(crate) fn opt_text(&self, key: &str) -> Result<Option<String>, DecodeError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(Value::Number(n)) => Ok(Some(n.to_string())),
            Some(_) => Err(wrong(self.key(key), "string or number")),
        }
    }

    /// An optional boolean, defaulting when absent.
    pub(crate) fn bool_or(&self, key: &str, default: bool) -> Result<bool, DecodeError> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(wrong(self.key(key), "boolean")),
        }
    }

    /// An optional non-negative integer.
    pub(crate) fn opt_u64(&self, key: &str) -> Result<Option<u64>, DecodeError> {
        match self.get(key) {
            None => Ok(None),
            Some(v @ Value::Number(_)) => number_to_u64(v)
                .map(Some)
                .ok_or_else(|| wrong(self.key(key), "non-negative integer")),
            Some(_) => Err(wrong(self.key(key), "non-negative integer")),
        }
    }

    /// An optional non-negative integer that must fit in `u32`.
    pub(crate) fn opt_u32(&self, key: &str) -> Result<Option<u32>, DecodeError> {
        match self.opt_u64(key)? {
            None => Ok(None),
            Some(n) => u32::try_from(n)
                .map(Some)
                .map_err(|_| invalid(self.key(key), format!("{n} exceeds {}", u32::MAX))),
        }
    }

    /// A required non-negative integer that must fit in `u32`.
    pub(crate) fn req_u32(&self, key: &str) -> Result<u32, DecodeError> {
        self.opt_u32(key)?
            .ok_or_else(|| DecodeError::MissingKey { key: self.key(key) })
    }

    /// An optional signed integer.
    pub(crate) fn opt_i64(&self, key: &str) -> Result<Option<i64>, DecodeError> {
        match self.get(key) {
            None => Ok(None),
            Some(v @ Value::Number(_)) => number_to_i64(v)
                .map(Some)
                .ok_or_else(|| wrong(self.key(key), "integer")),
            Some(_) => Err(wrong(self.key(key), "integer")),
        }
    }

    /// An optional number (metrics).
    pub(crate) fn opt_f64(&self, key: &str) -> Result<Option<f64>, DecodeError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => n
                .as_f64()
                .map(Some)
                .ok_or_else(|| wrong(self.key(key), "number")),
            Some(_) => Err(wrong(self.key(key), "number")),
        }
    }

    /// An optional nested object.
    pub(crate) fn opt_object(
        &self,
        key: &str,
    ) -> Result<Option<&'a Map<String, Value>>, DecodeError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(m)),
            Some(_) => Err(wrong(self.key(key), "object")),
        }
    }

    /// A required nested object.
    pub(crate) fn req_object(&self, key: &str) -> Result<&'a Map<String, Value>, DecodeError> {
        self.opt_object(key)?
            .ok_or_else(|| DecodeError::MissingKey { key: self.key(key) })
    }

    /// A list of strings; absent or `null` is an empty list.
    pub(crate) fn str_list(&self, key: &str) -> Result<Vec<String>, DecodeError> {
        let Some(value) = self.get(key) else {
            return Ok(Vec::new());
        };
        let Value::Array(items) = value else {
            return Err(wrong(self.key(key), "array of strings"));
        };
        items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => Ok(s.clone()),
                _ => Err(wrong(format!("{}[{i}]", self.key(key)), "string")),
            })
            .collect()
    }

    /// A list of strings or numbers, numbers rendered as decimal text (`10` → `"10"`,
    /// `2.5` → `"2.5"`): task inputs, which the manager API accepts in both forms.
    pub(crate) fn text_list(&self, key: &str) -> Result<Vec<String>, DecodeError> {
        let Some(value) = self.get(key) else {
            return Ok(Vec::new());
        };
        let Value::Array(items) = value else {
            return Err(wrong(self.key(key), "array of strings or numbers"));
        };
        items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => Ok(s.clone()),
                Value::Number(n) => Ok(n.to_string()),
                _ => Err(wrong(format!("{}[{i}]", self.key(key)), "string or number")),
            })
            .collect()
    }

    /// A string-to-string map; absent or `null` is empty.
    pub(crate) fn str_map(&self, key: &str) -> Result<BTreeMap<String, String>, DecodeError> {
        let Some(obj) = self.opt_object(key)? else {
            return Ok(BTreeMap::new());
        };
        obj.iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                _ => Err(wrong(format!("{}.{k}", self.key(key)), "string")),
            })
            .collect()
    }

    /// Optional base64 bytes (standard alphabet, padding optional).
    pub(crate) fn opt_base64(&self, key: &str) -> Result<Option<Vec<u8>>, DecodeError> {
        match self.opt_str(key)? {
            None => Ok(None),
            Some(text) => b64_decode(&text)
                .map(Some)
                .map_err(|e| invalid(self.key(key), format!("not valid base64: {e}"))),
        }
    }

    /// Required base64 bytes.
    pub(crate) fn req_base64(&self, key: &str) -> Result<Vec<u8>, DecodeError> {
        self.opt_base64(key)?
            .ok_or_else(|| DecodeError::MissingKey { key: self.key(key) })
    }
}

/// Builds a JSON object key by key, so each encoder states exactly which keys it writes.
#[derive(Debug, Default)]
pub(crate) struct ObjectBuilder {
    map: Map<String, Value>,
}

impl ObjectBuilder {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Starts from existing keys (kept unknown keys); later `put`s override them.
    pub(crate) fn from_map(map: Map<String, Value>) -> Self {
        Self { map }
    }

    /// Always writes the key.
    pub(crate) fn put(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.map.insert(key.to_owned(), value.into());
        self
    }

    /// Writes the key only when the value is present.
    pub(crate) fn put_opt<T: Into<Value>>(self, key: &str, value: Option<T>) -> Self {
        match value {
            Some(v) => self.put(key, v),
            None => self,
        }
    }

    /// Writes a string list, always (an empty list as `[]`).
    pub(crate) fn put_strs(self, key: &str, items: &[String]) -> Self {
        let list: Vec<Value> = items.iter().cloned().map(Value::String).collect();
        self.put(key, Value::Array(list))
    }

    /// Writes a string list only when it is not empty.
    pub(crate) fn put_strs_nonempty(self, key: &str, items: &[String]) -> Self {
        if items.is_empty() {
            self
        } else {
            self.put_strs(key, items)
        }
    }

    /// Writes a string map only when it is not empty.
    pub(crate) fn put_str_map_nonempty(self, key: &str, map: &BTreeMap<String, String>) -> Self {
        if map.is_empty() {
            return self;
        }
        let obj: Map<String, Value> = map
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect();
        self.put(key, Value::Object(obj))
    }

    pub(crate) fn build(self) -> Value {
        Value::Object(self.map)
    }
}

/// Serialises a JSON value; `Value`'s `Display` cannot fail.
pub(crate) fn to_bytes(value: &Value) -> Vec<u8> {
    value.to_string().into_bytes()
}

/// A JSON number from an `f64`; non-finite values (which JSON cannot carry) become `null`.
pub(crate) fn f64_value(f: f64) -> Value {
    serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => Map::new(),
        }
    }

    #[test]
    fn excerpts_are_short() {
        assert_eq!(excerpt("abc"), "\"abc\"");
        let long = "é".repeat(100);
        assert_eq!(excerpt(&long), format!("{:?}…", "é".repeat(32)));
    }

    #[test]
    fn null_counts_as_absent() {
        let m = obj(json!({"a": null}));
        let f = Fields::root(&m);
        assert_eq!(
            f.req_str("a"),
            Err(DecodeError::MissingKey { key: "a".into() })
        );
        assert_eq!(f.opt_str("a"), Ok(None));
        assert_eq!(f.str_list("a"), Ok(vec![]));
        assert_eq!(f.bool_or("a", true), Ok(true));
    }

    #[test]
    fn nested_paths_name_the_full_key() {
        let m = obj(json!({"interval": "x", "list": ["a", 1], "env": {"K": 2}}));
        let f = Fields::nested(&m, "monitoring_profile");
        assert_eq!(
            f.opt_u64("interval"),
            Err(DecodeError::WrongType {
                key: "monitoring_profile.interval".into(),
                expected: "non-negative integer"
            })
        );
        assert_eq!(
            f.str_list("list"),
            Err(DecodeError::WrongType {
                key: "monitoring_profile.list[1]".into(),
                expected: "string"
            })
        );
        assert_eq!(
            f.str_map("env"),
            Err(DecodeError::WrongType {
                key: "monitoring_profile.env.K".into(),
                expected: "string"
            })
        );
    }

    #[test]
    fn integral_floats_are_integers() {
        assert_eq!(number_to_u64(&json!(16660000000.0)), Some(16_660_000_000));
        assert_eq!(number_to_u64(&json!(1.5)), None);
        assert_eq!(number_to_u64(&json!(-1)), None);
        assert_eq!(number_to_u64(&json!(1e30)), None);
        assert_eq!(number_to_i64(&json!(-50.0)), Some(-50));
        assert_eq!(number_to_i64(&json!(1e30)), None);
    }

    #[test]
    fn text_list_renders_numbers_as_decimal_text() {
        let m = obj(json!({"inputs": [10, 2.5, "7", -3]}));
        assert_eq!(
            Fields::root(&m).text_list("inputs"),
            Ok(vec!["10".into(), "2.5".into(), "7".into(), "-3".into()])
        );
        let bad = obj(json!({"inputs": [true]}));
        assert_eq!(
            Fields::root(&bad).text_list("inputs"),
            Err(DecodeError::WrongType {
                key: "inputs[0]".into(),
                expected: "string or number"
            })
        );
    }

    #[test]
    fn base64_accepts_missing_padding_and_rejects_garbage() {
        let m = obj(json!({"a": "AGFzbQ==", "b": "AGFzbQ", "c": "!!"}));
        let f = Fields::root(&m);
        assert_eq!(f.opt_base64("a"), Ok(Some(b"\0asm".to_vec())));
        assert_eq!(f.opt_base64("b"), Ok(Some(b"\0asm".to_vec())));
        assert!(matches!(
            f.opt_base64("c"),
            Err(DecodeError::InvalidValue { ref key, .. }) if key == "c"
        ));
    }
}
