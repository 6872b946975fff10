//! An object's identity (`Kind/namespace/name`) and the checks on its names.

use serde_json::{Map, Value};

use crate::standalone::store::change::{Change, ChangeKind};
use crate::standalone::store::error::StoreError;

use super::DEFAULT_NAMESPACE;

/// Identity of a stored object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Key {
    pub(super) kind: String,
    pub(super) namespace: String,
    pub(super) name: String,
}

impl Key {
    pub(super) fn new(kind: &str, namespace: &str, name: &str) -> Result<Self, StoreError> {
        let namespace = if namespace.is_empty() {
            DEFAULT_NAMESPACE
        } else {
            namespace
        };
        check_segment("kind", kind)?;
        check_segment("metadata.namespace", namespace)?;
        check_segment("metadata.name", name)?;
        Ok(Self {
            kind: kind.to_owned(),
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
    }

    /// Reads the identity of a whole object, checking the shape the store relies on.
    pub(super) fn of(obj: &Value) -> Result<Self, StoreError> {
        let Some(map) = obj.as_object() else {
            return Err(StoreError::Invalid(
                "an object must be a JSON object".into(),
            ));
        };
        let kind = match map.get("kind") {
            Some(Value::String(k)) => k.as_str(),
            _ => {
                return Err(StoreError::Invalid(
                    "kind must be a non-empty string".into(),
                ))
            }
        };
        let meta = match map.get("metadata") {
            Some(Value::Object(m)) => m,
            _ => {
                return Err(StoreError::Invalid(format!(
                    "{kind}: metadata must be an object with a name"
                )))
            }
        };
        let name = match meta.get("name") {
            Some(Value::String(n)) => n.as_str(),
            _ => {
                return Err(StoreError::Invalid(format!(
                    "{kind}: metadata.name must be a non-empty string"
                )))
            }
        };
        let namespace = match meta.get("namespace") {
            None | Some(Value::Null) => "",
            Some(Value::String(n)) => n.as_str(),
            Some(_) => {
                return Err(StoreError::Invalid(format!(
                    "{kind} {name}: metadata.namespace must be a string"
                )))
            }
        };
        check_string_list(meta, "finalizers", kind, name)?;
        if let Some(refs) = meta.get("ownerReferences") {
            let ok = refs.is_null()
                || refs
                    .as_array()
                    .is_some_and(|a| a.iter().all(Value::is_object));
            if !ok {
                return Err(StoreError::Invalid(format!(
                    "{kind} {name}: metadata.ownerReferences must be a list of objects"
                )));
            }
        }
        Self::new(kind, namespace, name)
    }

    /// `Kind/namespace/name`: no part contains `/`, so the encoding is unambiguous and all
    /// objects of a kind (or of a kind and namespace) share a prefix.
    pub(super) fn encoded(&self) -> String {
        format!("{}/{}/{}", self.kind, self.namespace, self.name)
    }

    pub(super) fn decode(key: &str) -> Option<Self> {
        let mut parts = key.splitn(3, '/');
        Some(Self {
            kind: parts.next()?.to_owned(),
            namespace: parts.next()?.to_owned(),
            name: parts.next()?.to_owned(),
        })
    }

    pub(super) fn not_found(&self) -> StoreError {
        StoreError::NotFound {
            kind: self.kind.clone(),
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }

    pub(super) fn already_exists(&self) -> StoreError {
        StoreError::AlreadyExists {
            kind: self.kind.clone(),
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }

    pub(super) fn conflict(&self, expected: &str, actual: &str) -> StoreError {
        StoreError::Conflict {
            kind: self.kind.clone(),
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            expected: expected.to_owned(),
            actual: actual.to_owned(),
        }
    }

    pub(super) fn terminating(&self, refused: impl Into<String>) -> StoreError {
        StoreError::Terminating {
            kind: self.kind.clone(),
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            refused: refused.into(),
        }
    }

    pub(super) fn change(&self, kind_of_change: ChangeKind, resource_version: u64) -> Change {
        Change {
            kind: self.kind.clone(),
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            kind_of_change,
            resource_version,
        }
    }
}

pub(super) fn check_segment(what: &str, value: &str) -> Result<(), StoreError> {
    if value.is_empty() {
        return Err(StoreError::Invalid(format!("{what} must not be empty")));
    }
    if value.contains('/') || value.chars().any(char::is_control) {
        return Err(StoreError::Invalid(format!(
            "{what} {value:?} must not contain '/' or control characters"
        )));
    }
    Ok(())
}

pub(super) fn check_string_list(
    meta: &Map<String, Value>,
    field: &str,
    kind: &str,
    name: &str,
) -> Result<(), StoreError> {
    match meta.get(field) {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Array(items)) if items.iter().all(Value::is_string) => Ok(()),
        Some(_) => Err(StoreError::Invalid(format!(
            "{kind} {name}: metadata.{field} must be a list of strings"
        ))),
    }
}
