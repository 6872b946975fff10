//! Reading and editing the metadata of a stored object (JSON).

use chrono::{SecondsFormat, Utc};
use serde_json::{Map, Value};

use crate::standalone::store::error::StoreError;

use super::NOT_DESIRED_STATE;

pub(super) fn now_rfc3339() -> String {
    Utc::now().to_rfc3339_opts(SecondsFormat::Secs, true)
}

pub(super) fn meta(obj: &Value) -> Option<&Map<String, Value>> {
    obj.get("metadata").and_then(Value::as_object)
}

/// Runs `f` on the metadata map, creating it if missing. Does nothing to a non-object,
/// which the store never holds ([`Key::of`] refuses them).
pub(super) fn edit_meta(obj: &mut Value, f: impl FnOnce(&mut Map<String, Value>)) {
    if let Value::Object(map) = obj {
        let meta = map
            .entry("metadata")
            .or_insert_with(|| Value::Object(Map::new()));
        if !meta.is_object() {
            *meta = Value::Object(Map::new());
        }
        if let Value::Object(meta) = meta {
            f(meta);
        }
    }
}

pub(super) fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    meta(obj).and_then(|m| m.get(field)).and_then(Value::as_str)
}

pub(super) fn resource_version(obj: &Value) -> &str {
    meta_str(obj, "resourceVersion").unwrap_or_default()
}

pub(super) fn uid(obj: &Value) -> &str {
    meta_str(obj, "uid").unwrap_or_default()
}

/// Null or `[]`: an absent list, as the API server stores it.
pub(super) fn is_empty_list(v: &Value) -> bool {
    v.is_null() || v.as_array().is_some_and(Vec::is_empty)
}

pub(super) fn is_terminating(obj: &Value) -> bool {
    meta(obj)
        .and_then(|m| m.get("deletionTimestamp"))
        .is_some_and(|t| !t.is_null())
}

pub(super) fn finalizers(obj: &Value) -> Vec<String> {
    meta(obj)
        .and_then(|m| m.get("finalizers"))
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

pub(super) fn set_finalizer_list(obj: &mut Value, list: &[String]) {
    edit_meta(obj, |meta| {
        if list.is_empty() {
            meta.remove("finalizers");
        } else {
            meta.insert(
                "finalizers".into(),
                Value::Array(list.iter().cloned().map(Value::String).collect()),
            );
        }
    });
}

/// The uids of an object's owners.
pub(super) fn owner_uids(obj: &Value) -> impl Iterator<Item = &str> {
    meta(obj)
        .and_then(|m| m.get("ownerReferences"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|r| r.get("uid").and_then(Value::as_str))
}

/// Everything of an object but `apiVersion`, `kind`, `metadata` and `status`: what a
/// change of bumps `metadata.generation`.
pub(super) fn desired_state(obj: &Value) -> Map<String, Value> {
    obj.as_object()
        .map(|m| {
            m.iter()
                .filter(|(k, _)| !NOT_DESIRED_STATE.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .unwrap_or_default()
}

/// The resourceVersion a client sent, if any (an empty string means none).
pub(super) fn given_version(obj: &Value) -> Result<Option<String>, StoreError> {
    match meta(obj).and_then(|m| m.get("resourceVersion")) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Number(n)) => Ok(Some(n.to_string())),
        Some(_) => Err(StoreError::Invalid(
            "metadata.resourceVersion must be a string".into(),
        )),
    }
}
