//! Hostile request bodies against the standalone API, through its real router: arbitrary
//! bytes, YAML-shaped noise, YAML bombs, and the sample manifests with one value swapped for
//! a wrong type or range. Every answer must be a client error with a message (or a success),
//! never a panic and never a server error.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use proptest::collection::vec as pvec;
use proptest::prelude::*;
use serde_json::{json, Value};
use tower::ServiceExt;

use super::api::{router, ApiState};
use super::events::EventLog;
use super::store::ObjectStore;
use super::watch::ChangeLog;
use crate::manifest::parse_manifest;
use crate::validation::Admission;

const TOKEN: &str = "hostile-test-token";

/// The API over a store in a temporary directory, and a runtime to call it on.
struct Api {
    state: Arc<ApiState>,
    runtime: tokio::runtime::Runtime,
    _dir: tempfile::TempDir,
}

/// One API for every case of a test: opening the store and compiling the CRD schemas for
/// each case would take most of the test's time.
fn shared() -> &'static Api {
    static API: std::sync::OnceLock<Api> = std::sync::OnceLock::new();
    API.get_or_init(Api::new)
}

impl Api {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let store = ObjectStore::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let changes = ChangeLog::attach(&store).unwrap_or_else(|e| panic!("{e}"));
        let state = Arc::new(ApiState {
            store,
            admission: Admission::new(),
            token: TOKEN.into(),
            events: Arc::new(EventLog::new()),
            metrics: Arc::new(String::new),
            changes,
            logs: Arc::new(crate::task_logs::LogStore::default()),
        });
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        Self {
            state,
            runtime,
            _dir: dir,
        }
    }

    /// Whether the store holds `kind` `name` in the default namespace.
    fn stores(&self, kind: &str, name: &str) -> bool {
        self.state
            .store
            .get(kind, "default", name)
            .unwrap_or_else(|e| panic!("{e}"))
            .is_some()
    }

    /// POSTs `body` to `/v1/apply`; returns the status and the JSON answer.
    fn apply(&self, body: Vec<u8>) -> (StatusCode, Value) {
        let request = Request::post("/v1/apply")
            .header("authorization", format!("Bearer {TOKEN}"))
            .body(Body::from(body))
            .unwrap_or_else(|e| panic!("{e}"));
        let app = router(self.state.clone());
        self.runtime.block_on(async move {
            let response = app.oneshot(request).await.unwrap_or_else(|e| match e {});
            let status = response.status();
            let bytes = response
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let value = serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
            (status, value)
        })
    }
}

/// A refused request must say why, as `{"error": "..."}`.
fn check_answer(status: StatusCode, answer: &Value, body: &str) -> Result<(), TestCaseError> {
    prop_assert!(
        !status.is_server_error(),
        "server error {status} for {body:?}: {answer}"
    );
    if !status.is_success() {
        prop_assert!(status.is_client_error(), "unexpected {status} for {body:?}");
        let message = answer["error"].as_str().unwrap_or_default();
        prop_assert!(!message.is_empty(), "{status} without a message: {answer}");
    }
    Ok(())
}

fn samples() -> Vec<Value> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/samples");
    let mut docs = Vec::new();
    for name in [
        "task-add.yaml",
        "task-dag.yaml",
        "task-recurring.yaml",
        "task-broadcast.yaml",
        "propellerjob.yaml",
        "federatedjob.yaml",
        "proplet-external.yaml",
        "proplet-k8s.yaml",
    ] {
        let text = std::fs::read_to_string(format!("{dir}/{name}"))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        docs.extend(parse_manifest(&text).unwrap_or_else(|e| panic!("{name}: {e}")));
    }
    docs
}

/// Every path to a value inside `value`, as JSON pointer tokens.
fn paths(value: &Value, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    let children: Vec<(String, &Value)> = match value {
        Value::Object(m) => m.iter().map(|(k, v)| (k.clone(), v)).collect(),
        Value::Array(a) => a
            .iter()
            .enumerate()
            .map(|(i, v)| (i.to_string(), v))
            .collect(),
        _ => return,
    };
    for (step, child) in children {
        prefix.push(step);
        out.push(prefix.clone());
        paths(child, prefix, out);
        prefix.pop();
    }
}

fn pointer(path: &[String]) -> String {
    path.iter()
        .map(|p| format!("/{}", p.replace('~', "~0").replace('/', "~1")))
        .collect()
}

fn wrong_value() -> impl Strategy<Value = Value> {
    prop::sample::select(vec![
        Value::Null,
        json!(true),
        json!(-1),
        json!(0),
        json!(i64::MIN),
        json!(u64::MAX),
        json!(1e300),
        json!(-0.5),
        json!(""),
        json!("x".repeat(300)),
        json!("../../etc/passwd"),
        json!("a/b"),
        json!("UPPER_case!"),
        json!("not base64 !!"),
        json!("-1s"),
        json!("* * * * * * *"),
        json!([]),
        json!([null, 1, "a"]),
        json!({}),
        json!({"unexpected": {"deep": [1]}}),
    ])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Arbitrary bytes (often not UTF-8) and YAML-shaped noise as the body of `apply`.
    #[test]
    fn arbitrary_apply_bodies_get_a_client_error_with_a_message(
        bodies in pvec(prop_oneof![
            pvec(any::<u8>(), 0..200),
            "[a-z:{}\\[\\],&*!|>'\"#\\- \n0-9]{0,120}".prop_map(String::into_bytes),
            "(kind: (Task|Secret|Proplet|Nope)\n)?(metadata: \\{name: [a-z/]{0,5}\\}\n)?(spec: [\\[{a-z:0-9, }\\]]{0,30}\n)?(---\n)?"
                .prop_map(String::into_bytes),
        ], 1..8),
    ) {
        let api = shared();
        for body in bodies {
            let text = String::from_utf8_lossy(&body).into_owned();
            let (status, answer) = api.apply(body);
            check_answer(status, &answer, &text)?;
        }
    }

    /// A sample manifest with one value (anywhere: metadata, spec, list items) replaced or
    /// removed: applied, or refused with a 4xx naming the field when it is in the spec.
    #[test]
    fn samples_with_one_wrong_value_are_refused_by_field(
        edits in pvec((any::<prop::sample::Index>(), any::<prop::sample::Index>(),
                       prop::option::weighted(0.85, wrong_value())), 1..6),
    ) {
        let api = shared();
        let docs = samples();
        for (which, at, replacement) in edits {
            let mut doc = docs[which.index(docs.len())].clone();
            let mut all = Vec::new();
            paths(&doc, &mut Vec::new(), &mut all);
            let path = all[at.index(all.len())].clone();
            let (parent, last) = path.split_at(path.len() - 1);
            match doc.pointer_mut(&pointer(parent)) {
                Some(Value::Object(m)) => match &replacement {
                    Some(v) => { m.insert(last[0].clone(), v.clone()); }
                    None => { m.remove(&last[0]); }
                },
                Some(Value::Array(a)) => {
                    let i: usize = last[0].parse().unwrap_or(0);
                    match &replacement {
                        Some(v) => a[i] = v.clone(),
                        None => { a.remove(i); }
                    }
                }
                _ => {}
            }
            let body = doc.to_string();
            let (status, answer) = api.apply(body.clone().into_bytes());
            check_answer(status, &answer, &body)?;
            let is_spec_leaf = path.len() >= 2 && path[0] == "spec" && doc["kind"] != "Secret";
            if status == StatusCode::UNPROCESSABLE_ENTITY && is_spec_leaf {
                let message = answer["error"].as_str().unwrap_or_default();
                // Admission names the field (`spec.inputs[0]`, `spec.connectionConfig`), or,
                // for a rule across fields, the field it is written on (removing a
                // participant is refused as `spec.kOfN: kOfN cannot be greater than…`).
                prop_assert!(
                    message.contains("spec.") || message.contains("spec:")
                        || message.contains("spec "),
                    "changed {} but the error does not name it: {}", pointer(&path), message
                );
            }
        }
    }
}

/// Manifests built to exhaust the parser: alias expansion ("billion laughs"), deep nesting,
/// a huge document count. Each is refused (or applied) with a message, in bounded memory.
#[test]
fn yaml_bombs_are_refused_with_a_message() {
    let api = Api::new();
    let mut laughs = String::from(
        "a: &a [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]\n",
    );
    for (name, prev) in ["b", "c", "d", "e", "f", "g", "h", "i"]
        .iter()
        .zip(["a", "b", "c", "d", "e", "f", "g", "h"])
    {
        laughs.push_str(&format!("{name}: &{name} [*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev}]\n"));
    }
    let cases = [
        ("billion laughs", laughs),
        ("deep flow nesting", "[".repeat(100_000)),
        (
            "deep block nesting",
            (0..2_000)
                .map(|i| format!("{}k:\n", " ".repeat(i)))
                .collect(),
        ),
        ("many empty documents", "---\n".repeat(50_000)),
        ("a tag", "!!binary kind: Task".into()),
        ("a number too large", "kind: 1e99999\n".into()),
    ];
    for (what, body) in cases {
        let (status, answer) = api.apply(body.clone().into_bytes());
        assert!(status.is_client_error(), "{what}: {status} {answer}");
        let message = answer["error"].as_str().unwrap_or_default();
        assert!(!message.is_empty(), "{what}: no message");
        println!(
            "{what}: {status} {}",
            message.chars().take(120).collect::<String>()
        );
    }
}

/// The decoding function on its own: any text parses or says which document is wrong.
#[test]
fn parse_manifest_errors_name_the_document() {
    for (text, document) in [
        ("kind: Task\n---\n: : :\n", "document 2"),
        ("[unclosed", "document 1"),
        ("a: b\n---\nc: d\n---\n\tbad", "document 3"),
    ] {
        match parse_manifest(text) {
            Ok(docs) => panic!("{text:?} parsed as {docs:?}"),
            Err(e) => assert!(e.contains(document), "{text:?}: {e}"),
        }
    }
}

/// Standalone has no Kueue: a job asking for a queue is refused with what to do, and
/// nothing of the request is stored.
#[test]
fn a_kueue_queue_label_is_refused_with_what_to_do() {
    let api = Api::new();
    let body = "apiVersion: propeller.propeller.absmach.eu/v1\nkind: PropellerJob\nmetadata:\n  name: queued\n  labels: {kueue.x-k8s.io/queue-name: lq}\nspec:\n  name: queued\n  tasks: []\n";
    let (status, answer) = api.apply(body.as_bytes().to_vec());
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{answer}");
    let message = answer["error"].as_str().unwrap_or_default();
    assert!(
        message.contains("kueue.x-k8s.io/queue-name") && message.contains("remove the label"),
        "{message}"
    );
    assert!(!api.stores("PropellerJob", "queued"));
}

/// Every route wants the bearer token: without one, with a wrong one, or with the right
/// one in another scheme, a request is refused with 401 and stores nothing.
#[test]
fn requests_without_the_right_bearer_token_are_refused() {
    let api = Api::new();
    let body = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: sneaky\ndata: {a: b}\n";
    for header in [
        None,
        Some("Bearer wrong-token".to_owned()),
        Some(format!("Basic {TOKEN}")),
        Some(format!("Bearer {TOKEN}x")),
    ] {
        for (method, path) in [
            ("POST", "/v1/apply"),
            ("GET", "/v1/objects/task"),
            ("GET", "/v1/watch/task"),
            ("GET", "/metrics"),
        ] {
            let mut request = Request::builder().method(method).uri(path);
            if let Some(header) = &header {
                request = request.header("authorization", header);
            }
            let request = request
                .body(Body::from(body))
                .unwrap_or_else(|e| panic!("{e}"));
            let app = router(api.state.clone());
            let status = api.runtime.block_on(async move {
                app.oneshot(request)
                    .await
                    .unwrap_or_else(|e| match e {})
                    .status()
            });
            assert_eq!(
                status,
                StatusCode::UNAUTHORIZED,
                "{method} {path} with {header:?}"
            );
        }
    }
    assert!(!api.stores("ConfigMap", "sneaky"));
}
