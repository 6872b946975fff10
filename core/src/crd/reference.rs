//! The CRD field reference of the book (`docs/src/reference/crds.md`), rendered from the
//! same schemas as `configs/crd/`, so the two cannot drift.

use std::fmt::Write as _;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps, JSONSchemaPropsOrArray,
};

/// The reference page for `crds`: per kind, one table row per field of `spec` and `status`.
pub fn crd_reference(crds: &[CustomResourceDefinition]) -> String {
    let mut page = String::from(
        "# Custom resources\n\n\
         Generated from the types (`propeller reference --out-dir docs/src/reference`): every field \
         of each kind's `spec` and `status`, as the API server validates it. `[]` marks a list, \
         `{}` a map's values.\n",
    );
    for crd in crds {
        let names = &crd.spec.names;
        let Some(version) = crd.spec.versions.first() else {
            continue;
        };
        let _ = write!(
            page,
            "\n## {}\n\n`{}/{}`, {}",
            names.kind, crd.spec.group, version.name, crd.spec.scope
        );
        if let Some(short) = names.short_names.as_ref().filter(|s| !s.is_empty()) {
            let _ = write!(page, "; short names: `{}`", short.join("`, `"));
        }
        page.push_str(".\n\n| Field | Type | Required | Description |\n|---|---|---|---|\n");
        let root = version
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref());
        for part in ["spec", "status"] {
            let Some(schema) = root.and_then(|r| r.properties.as_ref()?.get(part)) else {
                continue;
            };
            let required = root
                .and_then(|r| r.required.as_ref())
                .is_some_and(|r| r.iter().any(|f| f == part));
            rows(&mut page, part, schema, required);
        }
    }
    page
}

/// A row for `path` and rows for everything below it.
fn rows(page: &mut String, path: &str, schema: &JSONSchemaProps, required: bool) {
    let _ = writeln!(
        page,
        "| `{path}` | {} | {} | {} |",
        type_of(schema),
        if required { "yes" } else { "" },
        cell(schema.description.as_deref().unwrap_or_default())
    );
    if let Some(properties) = &schema.properties {
        let needed = schema.required.as_deref().unwrap_or_default();
        for (name, field) in properties {
            rows(
                page,
                &format!("{path}.{name}"),
                field,
                needed.iter().any(|n| n == name),
            );
        }
    }
    if let Some(JSONSchemaPropsOrArray::Schema(item)) = &schema.items {
        if item.properties.is_some() {
            rows_below(page, &format!("{path}[]"), item);
        }
    }
    if let Some(values) = schema
        .additional_properties
        .as_ref()
        .and_then(|a| match a {
            k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSONSchemaPropsOrBool::Schema(s) => Some(s),
            _ => None,
        })
    {
        if values.properties.is_some() {
            rows_below(page, &format!("{path}{{}}"), values);
        }
    }
}

/// The rows of the fields of `schema` (a list item or a map value), under `path`.
fn rows_below(page: &mut String, path: &str, schema: &JSONSchemaProps) {
    let needed = schema.required.as_deref().unwrap_or_default();
    for (name, field) in schema.properties.iter().flatten() {
        rows(
            page,
            &format!("{path}.{name}"),
            field,
            needed.iter().any(|n| n == name),
        );
    }
}

/// `string`, `integer (int64)`, `string: a, b`, `[]object`, `map of string`.
fn type_of(schema: &JSONSchemaProps) -> String {
    let base = schema.type_.clone().unwrap_or_else(|| {
        if schema.x_kubernetes_int_or_string == Some(true) {
            "integer or string".into()
        } else {
            "any".into()
        }
    });
    let mut text = match (base.as_str(), &schema.items, &schema.additional_properties) {
        ("array", Some(JSONSchemaPropsOrArray::Schema(item)), _) => {
            format!("[]{}", type_of(item))
        }
        ("object", _, Some(_)) if schema.properties.is_none() => "map".into(),
        _ => base,
    };
    if let Some(format) = &schema.format {
        let _ = write!(text, " ({format})");
    }
    if let Some(values) = schema.enum_.as_ref().filter(|v| !v.is_empty()) {
        let values: Vec<String> = values
            .iter()
            .map(|v| match &v.0 {
                serde_json::Value::String(s) => format!("`{s}`"),
                other => format!("`{other}`"),
            })
            .collect();
        let _ = write!(text, ": {}", values.join(", "));
    }
    text
}

/// `text` on one table-cell line, with what Markdown would read as a link or HTML escaped.
fn cell(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for word in text.split_whitespace() {
        if !out.is_empty() {
            out.push(' ');
        }
        for c in word.chars() {
            match c {
                '|' | '[' | ']' => {
                    out.push('\\');
                    out.push(c);
                }
                '<' => out.push_str("&lt;"),
                '>' => out.push_str("&gt;"),
                _ => out.push(c),
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_its_spec_fields_with_their_descriptions() {
        let crds = crate::crd::all_crds();
        let page = crd_reference(&crds);
        for crd in &crds {
            let kind = &crd.spec.names.kind;
            assert!(page.contains(&format!("\n## {kind}\n")), "{kind} missing");
        }
        let row = page
            .lines()
            .find(|l| l.starts_with("| `spec.connectionConfig.mqttAddress` |"))
            .unwrap_or_else(|| panic!("no mqttAddress row:\n{page}"));
        assert!(row.contains("| string |"), "{row}");
        assert!(
            page.lines()
                .all(|l| !l.starts_with('|') || l.ends_with('|')),
            "a row spans lines"
        );
    }
}
