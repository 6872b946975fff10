//! Runs the shared admission table (`tests/fixtures/admission-cases.yaml`) through the
//! client-side validator, and checks that every CEL rule of the CRDs in `configs/crd/` has
//! at least one accepted and one refused case in it. The same table is applied to a real
//! kube-apiserver by the server-side dry-run test, so the two judge the same objects.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use propeller_operator::crd::{GROUP, VERSION};
use propeller_operator::validation::Admission;
use serde::Deserialize;
use serde_json::Value;

/// The `rule` of a case that is about the OpenAPI schema rather than a CEL rule.
const SCHEMA_RULE: &str = "schema";

/// What a case expects admission to do with its object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Expect {
    /// The object is admitted.
    Accepted,
    /// The object is refused, with `message` in the refusal.
    Refused,
}

/// One entry of the admission table.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AdmissionCase {
    /// Unique kebab-case name; also the object's `metadata.name`.
    name: String,
    /// Message of the CEL rule the case is about, or `schema`.
    rule: String,
    /// Whether the object must be accepted or refused.
    expect: Expect,
    /// Substring every refusal must contain (refused cases only).
    message: Option<String>,
    /// The complete resource to admit.
    object: Value,
}

impl AdmissionCase {
    /// The object's kind, or "" when it has none.
    fn kind(&self) -> &str {
        self.object
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or_default()
    }
}

/// Repository root, one level above the operator crate.
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Reads the admission table at `path`.
fn load_cases(path: &Path) -> Vec<AdmissionCase> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

/// The shared admission table.
fn shared_cases() -> Vec<AdmissionCase> {
    load_cases(&repo_root().join("tests/fixtures/admission-cases.yaml"))
}

/// Every CEL rule of the CRDs in `configs/crd/`, as kind → rule messages (the rule text
/// where a rule has no message, as the API server reports it then).
fn crd_rules() -> BTreeMap<String, BTreeSet<String>> {
    let dir = repo_root().join("configs/crd");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    let mut rules: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
            let crd = Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            if crd.get("kind").and_then(Value::as_str) != Some("CustomResourceDefinition") {
                continue;
            }
            let kind = crd
                .pointer("/spec/names/kind")
                .and_then(Value::as_str)
                .unwrap_or_else(|| panic!("{}: CRD without spec.names.kind", path.display()))
                .to_string();
            let messages = rules.entry(kind).or_default();
            for version in crd
                .pointer("/spec/versions")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                if let Some(schema) = version.pointer("/schema/openAPIV3Schema") {
                    collect_rule_messages(schema, messages);
                }
            }
        }
    }
    rules
}

/// Adds the message of every `x-kubernetes-validations` entry under `schema` to `out`.
fn collect_rule_messages(schema: &Value, out: &mut BTreeSet<String>) {
    match schema {
        Value::Object(map) => {
            for (key, child) in map {
                if key == "x-kubernetes-validations" {
                    for rule in child.as_array().into_iter().flatten() {
                        let message = rule
                            .get("message")
                            .or_else(|| rule.get("rule"))
                            .and_then(Value::as_str)
                            .expect("a validation rule has a rule");
                        out.insert(message.to_string());
                    }
                } else {
                    collect_rule_messages(child, out);
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|i| collect_rule_messages(i, out)),
        _ => {}
    }
}

/// Admits `object`, or says why not (the error lists every refusal).
fn admit(admission: &Admission, object: &Value) -> Result<(), String> {
    admission
        .admit(object, None)
        .map(drop)
        .map_err(|e| e.to_string())
}

/// Whether `name` is lower-case words of letters and digits joined by single '-'.
fn is_kebab_case(name: &str) -> bool {
    !name.is_empty()
        && name.split('-').all(|w| {
            !w.is_empty()
                && w.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        })
}

#[test]
fn every_case_is_judged_as_the_table_says() {
    let admission = Admission::new();
    let cases = shared_cases();
    let mut mismatches = Vec::new();
    for case in &cases {
        match (case.expect, admit(&admission, &case.object)) {
            (Expect::Accepted, Ok(())) => {}
            (Expect::Accepted, Err(errors)) => mismatches.push(format!(
                "{}: expected accepted, was refused:\n    {}",
                case.name,
                errors.replace('\n', "\n    ")
            )),
            (Expect::Refused, Ok(())) => mismatches.push(format!(
                "{}: expected refused with {:?}, was accepted",
                case.name,
                case.message.as_deref().unwrap_or_default()
            )),
            (Expect::Refused, Err(errors)) => {
                let expected = case.message.as_deref().unwrap_or_default();
                if !errors.contains(expected) {
                    mismatches.push(format!(
                        "{}: refused, but without {expected:?}:\n    {}",
                        case.name,
                        errors.replace('\n', "\n    ")
                    ));
                }
            }
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} admission cases were judged otherwise than the table says:\n{}",
        mismatches.len(),
        cases.len(),
        mismatches.join("\n")
    );
}

#[test]
fn every_cel_rule_has_an_accepted_and_a_refused_case() {
    let rules = crd_rules();
    assert!(
        rules.values().map(BTreeSet::len).sum::<usize>() > 0,
        "no CEL rules found in configs/crd"
    );
    let cases = shared_cases();
    let covered = |kind: &str, rule: &str, expect: Expect| {
        cases
            .iter()
            .any(|c| c.kind() == kind && c.rule == rule && c.expect == expect)
    };
    let mut missing = Vec::new();
    for (kind, messages) in &rules {
        for message in messages {
            for expect in [Expect::Accepted, Expect::Refused] {
                if !covered(kind, message, expect) {
                    missing.push(format!("{kind}: no {expect:?} case for {message:?}"));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "CEL rules without cases in tests/fixtures/admission-cases.yaml:\n{}",
        missing.join("\n")
    );
}

/// The table's own invariants: what makes a case usable against a real API server, and what
/// makes the coverage check above mean something (a refused case counts for a rule only if
/// it expects that rule's whole message, so it cannot pass by failing for another reason).
#[test]
fn cases_are_complete_objects_tagged_with_real_rules() {
    let rules = crd_rules();
    let cases = shared_cases();
    let api_version = format!("{GROUP}/{VERSION}");
    let mut problems = Vec::new();
    let mut names = BTreeSet::new();
    for case in &cases {
        let name = &case.name;
        let mut problem = |p: String| problems.push(format!("{name}: {p}"));
        if !is_kebab_case(name) {
            problem("name is not kebab-case".into());
        }
        if !names.insert(name.as_str()) {
            problem("name is not unique".into());
        }
        let object = &case.object;
        if object.get("apiVersion").and_then(Value::as_str) != Some(api_version.as_str()) {
            problem(format!("apiVersion is not {api_version}"));
        }
        if object.pointer("/metadata/name").and_then(Value::as_str) != Some(name.as_str()) {
            problem("metadata.name differs from the case name".into());
        }
        if object
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            != Some("default")
        {
            problem("metadata.namespace is not \"default\"".into());
        }
        if !object.get("spec").is_some_and(Value::is_object) {
            problem("object has no spec".into());
        }
        let Some(kind_rules) = rules.get(case.kind()) else {
            problem(format!("kind {:?} has no CRD in configs/crd", case.kind()));
            continue;
        };
        let is_cel = case.rule != SCHEMA_RULE;
        if is_cel && !kind_rules.contains(&case.rule) {
            problem(format!(
                "rule {:?} is not a CEL rule message of {}",
                case.rule,
                case.kind()
            ));
        }
        match (case.expect, case.message.as_deref()) {
            (Expect::Accepted, Some(_)) => problem("accepted case has a message".into()),
            (Expect::Refused, None | Some("")) => problem("refused case has no message".into()),
            (Expect::Refused, Some(m)) if is_cel && m != case.rule => {
                problem("refused CEL case's message is not its rule's message".into())
            }
            _ => {}
        }
    }
    assert!(
        problems.is_empty(),
        "malformed cases in tests/fixtures/admission-cases.yaml:\n{}",
        problems.join("\n")
    );
}
