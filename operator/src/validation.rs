//! Admission as a real API server performs it, without one: the generated OpenAPI schema
//! (types, bounds, patterns, enums, unknown fields), schema defaults, then the CEL
//! `x-kubernetes-validations` rules. Standalone mode runs every applied object through
//! this, so it accepts and rejects exactly what a cluster with our CRDs would.

use std::collections::HashMap;
use std::fmt;

use base64::Engine;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::core::cel::{apply_defaults, compile_schema, CompiledSchema, Validator};
use regex::Regex;
use serde_json::{Map, Value};

use crate::crd::{all_crds, GROUP, VERSION};

/// One reason an object was refused, with the JSON path of the offending field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Dotted path such as `spec.connectionConfig.mqttQos`; empty for the whole object.
    pub path: String,
    /// What is wrong, in words a user can act on.
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// Why an object cannot be admitted.
#[derive(Debug, thiserror::Error)]
pub enum AdmissionError {
    /// The kind is not one of ours.
    #[error("unknown kind {kind:?} (expected one of {expected})")]
    UnknownKind {
        /// The kind that was given.
        kind: String,
        /// The kinds admission knows, comma-separated.
        expected: String,
    },
    /// The object violates its schema or its CEL rules.
    #[error("{kind} {name:?} is invalid: {}", join_errors(.errors))]
    Invalid {
        /// Kind of the refused object.
        kind: String,
        /// Name of the refused object.
        name: String,
        /// Every violation found, not just the first.
        errors: Vec<FieldError>,
    },
}

fn join_errors(errors: &[FieldError]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

struct KindSchema {
    schema: Value,
    compiled: CompiledSchema,
}

/// Validates and defaults objects of our six kinds against their generated CRDs.
pub struct Admission {
    kinds: HashMap<String, KindSchema>,
    patterns: std::sync::Mutex<HashMap<String, Option<Regex>>>,
    cel: Validator,
}

impl Default for Admission {
    fn default() -> Self {
        Self::new()
    }
}

impl Admission {
    /// Builds the validator from the CRDs the types generate.
    pub fn new() -> Self {
        Self::from_crds(all_crds())
    }

    /// Builds the validator from explicit CRDs (for example ones read from `configs/crd/`).
    pub fn from_crds(crds: Vec<CustomResourceDefinition>) -> Self {
        let mut kinds = HashMap::new();
        for crd in crds {
            let kind = crd.spec.names.kind.clone();
            let schema = crd
                .spec
                .versions
                .first()
                .and_then(|v| v.schema.as_ref())
                .and_then(|s| s.open_api_v3_schema.as_ref())
                .and_then(|s| serde_json::to_value(s).ok())
                .unwrap_or(Value::Null);
            let compiled = compile_schema(&schema);
            kinds.insert(kind, KindSchema { schema, compiled });
        }
        Self {
            kinds,
            patterns: std::sync::Mutex::new(HashMap::new()),
            cel: Validator::new(),
        }
    }

    /// The OpenAPI schema of a kind, if it is one of ours.
    pub fn schema(&self, kind: &str) -> Option<&Value> {
        self.kinds.get(kind).map(|k| &k.schema)
    }

    /// Checks `object` (a whole resource: apiVersion, kind, metadata, spec) as a create, or
    /// as an update of `old`, and returns it with schema defaults applied.
    ///
    /// Status is not validated here: like the API server, admission of the main resource
    /// ignores status, which only reconcilers write.
    pub fn admit(&self, object: &Value, old: Option<&Value>) -> Result<Value, AdmissionError> {
        let kind = object
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let name = object
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let Some(entry) = self.kinds.get(&kind) else {
            let mut known: Vec<&str> = self.kinds.keys().map(String::as_str).collect();
            known.sort_unstable();
            return Err(AdmissionError::UnknownKind {
                kind,
                expected: known.join(", "),
            });
        };
        let mut errors = Vec::new();
        let expected_api_version = format!("{GROUP}/{VERSION}");
        match object.get("apiVersion").and_then(Value::as_str) {
            Some(v) if v == expected_api_version => {}
            other => errors.push(FieldError {
                path: "apiVersion".into(),
                message: format!(
                    "must be {expected_api_version:?}, got {:?}",
                    other.unwrap_or_default()
                ),
            }),
        }
        check_metadata(object, &mut errors);
        let mut candidate = object.clone();
        if let Some(map) = candidate.as_object_mut() {
            map.remove("status");
        }
        self.check(&entry.schema, &candidate, "", &mut errors);
        let defaulted = apply_defaults(&entry.schema, &candidate);
        if errors.is_empty() {
            let old_clean = old.map(|o| {
                let mut o = o.clone();
                if let Some(map) = o.as_object_mut() {
                    map.remove("status");
                }
                o
            });
            if let Err(cel_errors) =
                self.cel
                    .validate_compiled(&entry.compiled, &defaulted, old_clean.as_ref())
            {
                for e in cel_errors.iter() {
                    errors.push(FieldError {
                        path: e.field_path.trim_start_matches('.').to_string(),
                        message: e.message.clone(),
                    });
                }
            }
        }
        if errors.is_empty() {
            Ok(defaulted)
        } else {
            Err(AdmissionError::Invalid { kind, name, errors })
        }
    }

    fn pattern_matches(&self, pattern: &str, value: &str) -> bool {
        let Ok(mut cache) = self.patterns.lock() else {
            return false;
        };
        let re = cache
            .entry(pattern.to_string())
            .or_insert_with(|| Regex::new(pattern).ok());
        re.as_ref().is_some_and(|re| re.is_match(value))
    }

    fn check(&self, schema: &Value, value: &Value, path: &str, errors: &mut Vec<FieldError>) {
        let err = |errors: &mut Vec<FieldError>, message: String| {
            errors.push(FieldError {
                path: path.to_string(),
                message,
            })
        };
        if value.is_null() {
            if schema.get("nullable").and_then(Value::as_bool) != Some(true)
                && schema.get("type").is_some()
            {
                err(errors, "must not be null".into());
            }
            return;
        }
        let preserve = schema
            .get("x-kubernetes-preserve-unknown-fields")
            .and_then(Value::as_bool)
            == Some(true);
        let int_or_string = schema
            .get("x-kubernetes-int-or-string")
            .and_then(Value::as_bool)
            == Some(true);
        if int_or_string {
            if !(value.is_i64() || value.is_u64() || value.is_string()) {
                err(
                    errors,
                    format!("must be an integer or a string, got {}", type_name(value)),
                );
                return;
            }
        } else if let Some(ty) = schema.get("type").and_then(Value::as_str) {
            let ok = match ty {
                "object" => value.is_object(),
                "array" => value.is_array(),
                "string" => value.is_string(),
                "boolean" => value.is_boolean(),
                "integer" => value.is_i64() || value.is_u64(),
                "number" => value.is_number(),
                _ => true,
            };
            if !ok {
                err(
                    errors,
                    format!("must be of type {ty}, got {}", type_name(value)),
                );
                return;
            }
        }
        if let Some(allowed) = schema.get("enum").and_then(Value::as_array) {
            if !allowed.contains(value) {
                let list = allowed
                    .iter()
                    .map(|v| v.to_string())
                    .collect::<Vec<_>>()
                    .join(", ");
                err(
                    errors,
                    format!("unsupported value {value}: must be one of {list}"),
                );
            }
        }
        match value {
            Value::String(s) => self.check_string(schema, s, path, errors),
            Value::Number(n) => check_number(schema, n, path, errors),
            Value::Array(items) => {
                if let Some(max) = schema.get("maxItems").and_then(Value::as_u64) {
                    if items.len() as u64 > max {
                        err(
                            errors,
                            format!("must have at most {max} items, got {}", items.len()),
                        );
                    }
                }
                if let Some(min) = schema.get("minItems").and_then(Value::as_u64) {
                    if (items.len() as u64) < min {
                        err(
                            errors,
                            format!("must have at least {min} items, got {}", items.len()),
                        );
                    }
                }
                if let Some(item_schema) = schema.get("items") {
                    for (i, item) in items.iter().enumerate() {
                        self.check(item_schema, item, &format!("{path}[{i}]"), errors);
                    }
                }
            }
            Value::Object(map) => self.check_object(schema, map, path, preserve, errors),
            Value::Bool(_) | Value::Null => {}
        }
    }

    fn check_string(&self, schema: &Value, s: &str, path: &str, errors: &mut Vec<FieldError>) {
        let mut err = |message: String| {
            errors.push(FieldError {
                path: path.to_string(),
                message,
            })
        };
        let len = s.chars().count() as u64;
        if let Some(max) = schema.get("maxLength").and_then(Value::as_u64) {
            if len > max {
                err(format!(
                    "may not be longer than {max} characters, got {len}"
                ));
            }
        }
        if let Some(min) = schema.get("minLength").and_then(Value::as_u64) {
            if len < min {
                err(format!("must be at least {min} characters long"));
            }
        }
        if let Some(pattern) = schema.get("pattern").and_then(Value::as_str) {
            if !self.pattern_matches(pattern, s) {
                // A refused inline module can be megabytes long: quote only its start.
                let shown: String = s.chars().take(64).collect();
                let ellipsis = if shown.len() < s.len() { "..." } else { "" };
                err(format!(
                    "{shown:?}{ellipsis} does not match the expected format {pattern:?}"
                ));
            }
        }
        match schema.get("format").and_then(Value::as_str) {
            Some("byte") if base64::engine::general_purpose::STANDARD.decode(s).is_err() => {
                err("must be base64-encoded bytes".to_string());
            }
            Some("date-time") if chrono::DateTime::parse_from_rfc3339(s).is_err() => {
                err(format!("{s:?} is not an RFC 3339 date-time"));
            }
            _ => {}
        }
    }

    fn check_object(
        &self,
        schema: &Value,
        map: &Map<String, Value>,
        path: &str,
        preserve: bool,
        errors: &mut Vec<FieldError>,
    ) {
        let join = |key: &str| {
            if path.is_empty() {
                key.to_string()
            } else {
                format!("{path}.{key}")
            }
        };
        if let Some(max) = schema.get("maxProperties").and_then(Value::as_u64) {
            if map.len() as u64 > max {
                errors.push(FieldError {
                    path: path.to_string(),
                    message: format!("must have at most {max} entries, got {}", map.len()),
                });
            }
        }
        if let Some(required) = schema.get("required").and_then(Value::as_array) {
            for key in required.iter().filter_map(Value::as_str) {
                if !map.contains_key(key) {
                    errors.push(FieldError {
                        path: join(key),
                        message: "Required value".to_string(),
                    });
                }
            }
        }
        let properties = schema.get("properties").and_then(Value::as_object);
        let additional = schema.get("additionalProperties").filter(|a| a.is_object());
        for (key, child) in map {
            if let Some(prop) = properties.and_then(|p| p.get(key)) {
                self.check(prop, child, &join(key), errors);
            } else if let Some(additional) = additional {
                self.check(additional, child, &join(key), errors);
            } else if !preserve && (properties.is_some() || path.is_empty()) {
                // The root's type fields and metadata are checked elsewhere; every other
                // object is closed.
                if !(path.is_empty() && matches!(key.as_str(), "metadata" | "apiVersion" | "kind"))
                {
                    errors.push(FieldError {
                        path: join(key),
                        message: "unknown field".to_string(),
                    });
                }
            }
        }
    }
}

fn check_number(schema: &Value, n: &serde_json::Number, path: &str, errors: &mut Vec<FieldError>) {
    let Some(v) = n.as_f64() else { return };
    if let Some(max) = schema.get("maximum").and_then(Value::as_f64) {
        if v > max {
            errors.push(FieldError {
                path: path.to_string(),
                message: format!("must be less than or equal to {max}, got {n}"),
            });
        }
    }
    if let Some(min) = schema.get("minimum").and_then(Value::as_f64) {
        if v < min {
            errors.push(FieldError {
                path: path.to_string(),
                message: format!("must be greater than or equal to {min}, got {n}"),
            });
        }
    }
    if schema.get("format").and_then(Value::as_str) == Some("int32")
        && (v > f64::from(i32::MAX) || v < f64::from(i32::MIN))
    {
        errors.push(FieldError {
            path: path.to_string(),
            message: format!("{n} does not fit in a 32-bit integer"),
        });
    }
}

fn check_metadata(object: &Value, errors: &mut Vec<FieldError>) {
    let name = object.pointer("/metadata/name").and_then(Value::as_str);
    match name {
        None | Some("") => errors.push(FieldError {
            path: "metadata.name".into(),
            message: "Required value: name is required".into(),
        }),
        Some(n) if !is_dns1123_subdomain(n) => errors.push(FieldError {
            path: "metadata.name".into(),
            message: format!(
                "{n:?} is not a valid name: lower-case letters, digits, '-' and '.', starting and ending with a letter or digit, at most 253 characters"
            ),
        }),
        Some(_) => {}
    }
    if let Some(ns) = object
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
    {
        if !ns.is_empty() && !is_dns1123_label(ns) {
            errors.push(FieldError {
                path: "metadata.namespace".into(),
                message: format!("{ns:?} is not a valid namespace name"),
            });
        }
    }
}

fn is_dns1123_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_dns1123_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns1123_label)
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_f64() => "number",
        Value::Number(_) => "integer",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}
