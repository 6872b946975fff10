//! Every upstream sample manifest of our kinds parses into our types and passes the
//! generated schema and its CEL rules, including the one upstream itself rejected.

mod common;

use propeller_operator::crd::{FederatedJob, PropellerJob, Proplet, Task, TrainingRound, GROUP};
use propeller_operator::validation::Admission;

/// Admits and parses every document of our group in `dir` (and `subdirs`); returns how many.
fn admit_all(dirs: &[std::path::PathBuf]) -> usize {
    let admission = Admission::new();
    let mut ours = 0;
    for dir in dirs {
        for (file, doc) in &common::yaml_documents(dir) {
            let api_version = doc["apiVersion"].as_str().unwrap_or_default();
            if !api_version.starts_with(GROUP) {
                continue;
            }
            ours += 1;
            let defaulted = admission
                .admit(doc, None)
                .unwrap_or_else(|e| panic!("{file}: {e}"));
            let kind = doc["kind"].as_str().unwrap();
            let parsed = match kind {
                "Proplet" => serde_json::from_value::<Proplet>(defaulted).map(|_| ()),
                "Task" => serde_json::from_value::<Task>(defaulted).map(|_| ()),
                "PropellerJob" => serde_json::from_value::<PropellerJob>(defaulted).map(|_| ()),
                "FederatedJob" => serde_json::from_value::<FederatedJob>(defaulted).map(|_| ()),
                "TrainingRound" => serde_json::from_value::<TrainingRound>(defaulted).map(|_| ()),
                other => panic!("{file}: unexpected kind {other}"),
            };
            parsed.unwrap_or_else(|e| panic!("{file}: does not parse as {kind}: {e}"));
        }
    }
    ours
}

#[test]
fn every_upstream_sample_of_our_kinds_is_admitted_and_parses() {
    // 4 Proplets, 16 Tasks, 1 PropellerJob, 1 FederatedJob.
    assert_eq!(
        admit_all(&[common::upstream_samples_dir()]),
        22,
        "expected every upstream sample of our kinds to be checked"
    );
}

#[test]
fn our_own_samples_pass_the_schema_and_every_cel_rule() {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../configs/samples");
    let checked = admit_all(&[root.clone(), root.join("quickstart")]);
    // samples/ holds 9 objects of our kinds; quickstart/ adds a Proplet, a Task and a
    // PropellerJob.
    assert_eq!(checked, 12, "sample objects of our kinds");
}

#[test]
fn integer_inputs_that_upstream_rejected_are_accepted_and_sent_as_strings() {
    let admission = Admission::new();
    let docs = common::yaml_documents(&common::upstream_samples_dir());
    let (_, doc) = docs
        .iter()
        .find(|(f, _)| f == "propeller_v1_task_with_image.yaml")
        .expect("sample present");
    assert_eq!(doc["spec"]["inputs"], serde_json::json!([10, 89]));
    let task: Task = serde_json::from_value(admission.admit(doc, None).unwrap()).unwrap();
    let wire: Vec<String> = task
        .spec
        .inputs
        .iter()
        .map(|i| match i {
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n) => n.to_string(),
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(s) => s.clone(),
        })
        .collect();
    assert_eq!(wire, vec!["10", "89"]);
}

#[test]
fn defaults_match_the_seed() {
    let admission = Admission::new();
    let docs = common::yaml_documents(&common::upstream_samples_dir());
    let (_, doc) = docs
        .iter()
        .find(|(f, _)| f == "propeller_v1_task.yaml")
        .unwrap();
    let task: Task = serde_json::from_value(admission.admit(doc, None).unwrap()).unwrap();
    assert_eq!(task.spec.priority, 50);
    assert_eq!(task.spec.timezone, "UTC");
    assert_eq!(
        task.spec.preferred_proplet_type,
        propeller_operator::crd::task::PreferredPropletType::Any
    );
}
