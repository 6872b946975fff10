//! Status writes as JSON merge patches that carry only what changed.
//!
//! A merge patch of a whole status would leave fields the new status no longer has (they are
//! skipped when empty, not written as `null`), so the patch names removed fields as `null`.
//! It also carries `metadata.resourceVersion`, which makes the write conditional: a reconcile
//! planned from a stale object gets a conflict instead of overwriting newer state.

use serde::Serialize;
use serde_json::{json, Map, Value};

/// The merge patch turning `old` into `new` in `status`, conditional on `resource_version`
/// when given. Nested objects are diffed too, so a key a map no longer has (a released slot
/// of `status.slots`) is written as `null`; arrays are replaced whole.
pub fn status_patch<T: Serialize>(old: &T, new: &T, resource_version: Option<&str>) -> Value {
    let old = serde_json::to_value(old).unwrap_or(Value::Null);
    let new = serde_json::to_value(new).unwrap_or(Value::Null);
    let diff = match (&old, &new) {
        (Value::Object(old), Value::Object(new)) => Value::Object(object_diff(old, new)),
        _ => new,
    };
    with_version(json!({ "status": diff }), resource_version)
}

/// The merge patch (RFC 7386) turning object `old` into `new`.
fn object_diff(old: &Map<String, Value>, new: &Map<String, Value>) -> Map<String, Value> {
    let mut diff = Map::new();
    for (key, value) in new {
        match (old.get(key), value) {
            (Some(before), _) if before == value => {}
            (Some(Value::Object(before)), Value::Object(after)) => {
                diff.insert(key.clone(), Value::Object(object_diff(before, after)));
            }
            _ => {
                diff.insert(key.clone(), value.clone());
            }
        }
    }
    for key in old.keys() {
        if !new.contains_key(key) {
            diff.insert(key.clone(), Value::Null);
        }
    }
    diff
}

/// A patch of `metadata.finalizers` to exactly `finalizers`, conditional on the version.
pub fn finalizers_patch(finalizers: &[String], resource_version: Option<&str>) -> Value {
    with_version(
        json!({ "metadata": { "finalizers": finalizers } }),
        resource_version,
    )
}

fn with_version(mut patch: Value, resource_version: Option<&str>) -> Value {
    if let (Some(rv), Some(obj)) = (resource_version, patch.as_object_mut()) {
        let meta = obj
            .entry("metadata")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Some(meta) = meta.as_object_mut() {
            meta.insert("resourceVersion".into(), Value::String(rv.to_owned()));
        }
    }
    patch
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removed_fields_become_null_and_unchanged_ones_are_left_out() {
        let old = json!({"phase": "running", "error": "x", "runCount": 1});
        let new = json!({"phase": "pending", "runCount": 1});
        assert_eq!(
            status_patch(&old, &new, Some("7")),
            json!({"metadata": {"resourceVersion": "7"}, "status": {"phase": "pending", "error": null}})
        );
    }

    #[test]
    fn a_key_a_nested_map_lost_becomes_null_and_arrays_are_replaced() {
        let old = json!({"slots": {"a": {"task": "x"}, "b": {"task": "y"}}, "history": [1, 2]});
        let new = json!({"slots": {"b": {"task": "y"}, "c": {"task": "z"}}, "history": [2]});
        assert_eq!(
            status_patch(&old, &new, None),
            json!({"status": {"slots": {"a": null, "c": {"task": "z"}}, "history": [2]}})
        );
    }

    #[test]
    fn finalizer_patch_is_conditional() {
        let p = finalizers_patch(&["a".into()], Some("3"));
        assert_eq!(
            p,
            json!({"metadata": {"finalizers": ["a"], "resourceVersion": "3"}})
        );
        assert_eq!(
            finalizers_patch(&[], None),
            json!({"metadata": {"finalizers": []}})
        );
    }
}
