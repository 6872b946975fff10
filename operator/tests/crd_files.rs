//! The CRDs kept in `configs/crd/` are exactly what the types generate, and the schemas are
//! bounded so that a real API server's CEL cost estimator accepts the rules.

use propeller_operator::crd::{all_crds, crd_file_name, crd_yaml};
use propeller_operator::validation::Admission;
use serde_json::Value;

#[test]
fn configs_crd_matches_the_types() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/crd");
    for crd in all_crds() {
        let path = dir.join(crd_file_name(&crd));
        let on_disk = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!("{}: {e}; run `cargo run -p propeller-operator --bin propeller -- crd --out-dir configs/crd`", path.display())
        });
        assert!(
            on_disk == crd_yaml(&crd).unwrap(),
            "{} drifted from the types; regenerate with `cargo run -p propeller-operator --bin propeller -- crd --out-dir configs/crd`",
            path.display()
        );
    }
}

#[test]
fn crds_have_the_upstream_names_and_subresources() {
    let crds = all_crds();
    let names: Vec<_> = crds
        .iter()
        .map(|c| c.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "proplets.propeller.propeller.absmach.eu",
            "tasks.propeller.propeller.absmach.eu",
            "propellerjobs.propeller.propeller.absmach.eu",
            "federatedjobs.propeller.propeller.absmach.eu",
            "trainingrounds.propeller.propeller.absmach.eu",
            "propletupgrades.propeller.propeller.absmach.eu",
        ]
    );
    for crd in &crds {
        assert_eq!(crd.spec.scope, "Namespaced");
        let v = &crd.spec.versions[0];
        assert_eq!(v.name, "v1");
        assert!(v.served && v.storage);
        assert!(v.subresources.as_ref().unwrap().status.is_some());
    }
    assert_eq!(
        crds[2].spec.names.short_names,
        Some(vec!["pjob".to_string()])
    );
    let columns = |i: usize| -> Vec<(String, String)> {
        crds[i].spec.versions[0]
            .additional_printer_columns
            .as_ref()
            .unwrap()
            .iter()
            .map(|c| (c.name.clone(), c.json_path.clone()))
            .collect()
    };
    assert_eq!(
        columns(0).iter().map(|c| c.0.as_str()).collect::<Vec<_>>(),
        [
            "Type",
            "Phase",
            "Ready",
            "Tasks",
            "Replicas",
            "Last Seen",
            "Age"
        ]
    );
    assert_eq!(
        columns(1).iter().map(|c| c.0.as_str()).collect::<Vec<_>>(),
        [
            "Phase",
            "Mode",
            "Proplet",
            "Start Time",
            "Finish Time",
            "Preferred Type",
            "Age"
        ]
    );
    assert_eq!(
        columns(2).iter().map(|c| c.0.as_str()).collect::<Vec<_>>(),
        // Upstream's, with the Suspended and (wide) Quota conditions of Kueue admission.
        [
            "Phase",
            "Mode",
            "Tasks",
            "Completed",
            "Failed",
            "Suspended",
            "Quota",
            "Age"
        ]
    );
    assert_eq!(
        columns(3).iter().map(|c| c.0.as_str()).collect::<Vec<_>>(),
        ["Phase", "Current Round", "Completed Rounds", "Age"]
    );
    assert_eq!(
        columns(4),
        [
            ("Phase".to_string(), ".status.phase".to_string()),
            ("Job".to_string(), ".spec.federatedJobRef.name".to_string()),
            ("Updates".to_string(), ".status.updatesReceived".to_string()),
            (
                "Required".to_string(),
                ".status.updatesRequired".to_string()
            ),
            ("Age".to_string(), ".metadata.creationTimestamp".to_string()),
        ]
    );
}

/// Walks a schema and reports every string, list and map without an upper bound.
fn unbounded(schema: &Value, path: &str, out: &mut Vec<String>) {
    let ty = schema.get("type").and_then(Value::as_str);
    let bounded_string = schema.get("maxLength").is_some()
        || schema.get("enum").is_some()
        || schema.get("format").and_then(Value::as_str) == Some("date-time");
    match ty {
        Some("string") if !bounded_string => out.push(path.to_string()),
        Some("array") if schema.get("maxItems").is_none() => out.push(path.to_string()),
        Some("object")
            if schema.get("additionalProperties").is_some()
                && schema.get("maxProperties").is_none() =>
        {
            out.push(path.to_string())
        }
        _ => {}
    }
    if let Some(props) = schema.get("properties").and_then(Value::as_object) {
        for (k, v) in props {
            unbounded(v, &format!("{path}.{k}"), out);
        }
    }
    if let Some(items) = schema.get("items") {
        unbounded(items, &format!("{path}[]"), out);
    }
    if let Some(add) = schema.get("additionalProperties").filter(|a| a.is_object()) {
        unbounded(add, &format!("{path}{{}}"), out);
    }
}

#[test]
fn every_string_list_and_map_in_a_spec_with_cel_rules_is_bounded() {
    let admission = Admission::new();
    let mut missing = Vec::new();
    for kind in [
        "Proplet",
        "Task",
        "PropellerJob",
        "FederatedJob",
        "TrainingRound",
    ] {
        let schema = admission.schema(kind).unwrap();
        unbounded(
            &schema["properties"]["spec"],
            &format!("{kind}.spec"),
            &mut missing,
        );
    }
    // Fields of embedded Kubernetes types (SecretKeySelector, LocalObjectReference) are
    // generated by k8s-openapi; they are tiny strings outside any CEL comprehension.
    missing.retain(|p| {
        !p.ends_with("SecretRef.key")
            && !p.ends_with("SecretRef.name")
            && !p.ends_with("federatedJobRef.name")
    });
    assert!(missing.is_empty(), "unbounded schema nodes: {missing:#?}");
}

#[test]
fn every_cel_rule_compiles_and_passes_the_cost_estimate() {
    use kube::core::cel::{analyze_rule, cel::Program, compile_schema, ScopeContext};
    let admission = Admission::new();
    let mut warnings = Vec::new();
    let mut rules = 0;
    for kind in [
        "Proplet",
        "Task",
        "PropellerJob",
        "FederatedJob",
        "TrainingRound",
    ] {
        let mut stack = vec![admission.schema(kind).unwrap().clone()];
        while let Some(node) = stack.pop() {
            if let Some(list) = node
                .get("x-kubernetes-validations")
                .and_then(Value::as_array)
            {
                let local = compile_schema(&node);
                for rule in list {
                    let text = rule["rule"].as_str().unwrap();
                    rules += 1;
                    assert!(Program::compile(text).is_ok(), "{text} does not compile");
                    for w in analyze_rule(text, &local, ScopeContext::CrdValidation) {
                        warnings.push(format!("{kind}: {text}: {}", w.message));
                    }
                }
            }
            if let Some(props) = node.get("properties").and_then(Value::as_object) {
                stack.extend(props.values().cloned());
            }
            if let Some(items) = node.get("items") {
                stack.push(items.clone());
            }
        }
    }
    assert!(rules >= 12, "expected at least 12 CEL rules, found {rules}");
    assert!(warnings.is_empty(), "{warnings:#?}");
}

/// The book's generated pages (`docs/src/reference/crds.md`, `propeller.md`) are what
/// `propeller reference` writes from the types and the flags.
#[test]
fn the_books_reference_pages_match_the_types_and_flags() {
    let fresh = tempfile::tempdir().expect("temp dir");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_propeller"))
        .args(["reference", "--out-dir"])
        .arg(fresh.path())
        .output()
        .expect("running propeller reference");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let book = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/src/reference");
    for page in ["crds.md", "propeller.md"] {
        let generated = std::fs::read_to_string(fresh.path().join(page)).expect("generated page");
        let kept = std::fs::read_to_string(book.join(page)).unwrap_or_default();
        assert!(
            kept == generated,
            "docs/src/reference/{page} is not what the code generates; rewrite it with `cargo run -p propeller-operator --bin propeller -- reference`"
        );
    }
}

/// The verbs `role` (a ClusterRole's YAML) grants on `resource` of our API group.
fn verbs_on(role: &Value, resource: &str) -> Vec<String> {
    let group = "propeller.propeller.absmach.eu";
    let mut verbs = Vec::new();
    for rule in role["rules"].as_array().into_iter().flatten() {
        let in_group = rule["apiGroups"]
            .as_array()
            .is_some_and(|g| g.iter().any(|g| g == group));
        let names = rule["resources"]
            .as_array()
            .is_some_and(|r| r.iter().any(|r| r == resource));
        if in_group && names {
            verbs.extend(
                rule["verbs"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|v| v.as_str().map(str::to_owned)),
            );
        }
    }
    verbs
}

/// A kind added to `all_crds()` is one the operator watches and writes: both roles it is
/// installed with (the plain RBAC and the Helm chart's) must grant it, or the first watch
/// fails on a real cluster with a 403.
#[test]
fn both_operator_roles_grant_every_kind() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let plain = std::fs::read_to_string(root.join("configs/rbac/cluster_role.yaml")).unwrap();
    // The chart's template with its Helm directives left out is plain YAML.
    let chart: String =
        std::fs::read_to_string(root.join("configs/helm/propeller/templates/clusterrole.yaml"))
            .unwrap()
            .lines()
            .filter(|l| !l.contains("{{"))
            .collect::<Vec<_>>()
            .join("\n");
    for (file, text) in [
        ("cluster_role.yaml", plain),
        ("the chart's clusterrole.yaml", chart),
    ] {
        let role: Value = serde_yaml_ng::from_str(&text).unwrap();
        for crd in all_crds() {
            let plural = &crd.spec.names.plural;
            let missing = |resource: &str, wanted: &[&str]| -> Vec<String> {
                let granted = verbs_on(&role, resource);
                wanted
                    .iter()
                    .filter(|v| !granted.iter().any(|g| g == *v))
                    .map(|v| format!("{v} on {resource}"))
                    .collect()
            };
            let mut absent = missing(plural, &["get", "list", "watch", "patch", "update"]);
            absent.extend(missing(&format!("{plural}/status"), &["patch", "update"]));
            absent.extend(missing(&format!("{plural}/finalizers"), &["update"]));
            assert!(absent.is_empty(), "{file} does not grant {absent:?}");
        }
    }
}

/// The chart's Kueue rules (under `kueue.enabled`) are `configs/kueue`'s, rule for rule.
#[test]
fn the_charts_kueue_rules_are_the_plain_ones() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let plain: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(root.join("configs/kueue/cluster_role.yaml")).unwrap(),
    )
    .unwrap();
    let template =
        std::fs::read_to_string(root.join("configs/helm/propeller/templates/clusterrole.yaml"))
            .unwrap();
    let section = template
        .split_once("{{- if .Values.kueue.enabled }}")
        .and_then(|(_, rest)| rest.split_once("{{- end }}"))
        .map(|(section, _)| section)
        .expect("a kueue.enabled section in the chart's ClusterRole");
    let chart: Value = serde_yaml_ng::from_str(section).unwrap();
    assert_eq!(chart, plain["rules"]);
}
