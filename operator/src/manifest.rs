//! What users name and apply through propeller's HTTP APIs (standalone's, and the console's
//! on a cluster): the kinds served with the names users type for them, and manifests.

use std::sync::LazyLock;

use serde_json::Value;

use crate::controller::kinds::kind_names;

/// Kind name of Secrets (proplet keys, bootstrap tokens).
pub const SECRET: &str = "Secret";
/// Kind name of ConfigMaps (aggregated models).
pub const CONFIG_MAP: &str = "ConfigMap";

/// Kinds served, with the names users type for them: the reconciled kinds ([`kind_names`]),
/// then the Secrets and ConfigMaps they use.
static KINDS: LazyLock<Vec<(String, &'static [&'static str])>> = LazyLock::new(|| {
    let mut kinds = kind_names();
    kinds.push((SECRET.to_owned(), &["secret", "secrets"]));
    kinds.push((CONFIG_MAP.to_owned(), &["configmap", "configmaps", "cm"]));
    kinds
});

/// The kind for what a user typed (`task`, `pjob`, `Proplets`, …).
pub fn canonical_kind(typed: &str) -> Option<&'static str> {
    let lower = typed.to_ascii_lowercase();
    KINDS
        .iter()
        .find(|(kind, names)| kind.eq_ignore_ascii_case(&lower) || names.contains(&lower.as_str()))
        .map(|(kind, _)| kind.as_str())
}

/// The kinds served, comma-separated, for messages.
pub fn served_kinds() -> String {
    KINDS
        .iter()
        .map(|(k, _)| k.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Parses a multi-document YAML (or JSON) manifest into its non-empty documents.
pub fn parse_manifest(text: &str) -> Result<Vec<Value>, String> {
    let mut docs = Vec::new();
    for (i, doc) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let value: Value = serde::Deserialize::deserialize(doc)
            .map_err(|e| format!("document {}: not valid YAML: {e}", i + 1))?;
        if !value.is_null() {
            docs.push(value);
        }
    }
    Ok(docs)
}

/// The documents of a manifest sent as a request body: UTF-8, YAML or JSON, at least one
/// document; otherwise why not, for a 400 answer.
pub fn documents(body: &[u8]) -> Result<Vec<Value>, String> {
    let text =
        std::str::from_utf8(body).map_err(|e| format!("the manifest is not UTF-8 text: {e}"))?;
    let docs = parse_manifest(text)?;
    if docs.is_empty() {
        return Err("the manifest holds no document".into());
    }
    Ok(docs)
}

/// Names document `i` (from 0) of a manifest in messages: `document 2 (Task "add")`.
pub fn describe_doc(i: usize, doc: &Value) -> String {
    format!(
        "document {} ({} {:?})",
        i + 1,
        doc["kind"].as_str().unwrap_or("?"),
        doc["metadata"]["name"].as_str().unwrap_or("?")
    )
}
