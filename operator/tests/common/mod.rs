//! Helpers shared by the operator's integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

/// Directory of the upstream sample manifests (`tests/fixtures/upstream-samples`, copied
/// from upstream), overridable with `PROPELLER_SAMPLES_DIR`.
pub fn upstream_samples_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("PROPELLER_SAMPLES_DIR") {
        return PathBuf::from(dir);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/upstream-samples")
}

/// Every YAML document of every file in `dir`, with the file it came from.
pub fn yaml_documents(dir: &std::path::Path) -> Vec<(String, serde_json::Value)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
            let value: serde_json::Value = serde::Deserialize::deserialize(doc)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            if !value.is_null() {
                out.push((
                    path.file_name().unwrap().to_string_lossy().into_owned(),
                    value,
                ));
            }
        }
    }
    out
}

use std::sync::{Arc, Mutex};

use http::{Method, Request, Response};
use kube::client::Body;
use serde_json::{json, Value};

/// One request the operator sent.
#[derive(Debug, Clone)]
pub struct Sent {
    pub method: Method,
    pub path: String,
    pub query: String,
    pub body: Value,
}

/// A stand-in API server: records every request and answers with the object the patch
/// produced (merge-patched onto the last known state), with a fresh resourceVersion.
pub struct FakeApi {
    sent: Arc<Mutex<Vec<Sent>>>,
    objects: Arc<Mutex<Vec<(String, Value)>>>,
}

fn merge(target: &mut Value, patch: &Value) {
    match (target.as_object_mut(), patch.as_object()) {
        (Some(t), Some(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        _ => *target = patch.clone(),
    }
}

impl FakeApi {
    pub fn start(objects: Vec<(String, Value)>) -> (kube::Client, Self) {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let sent = Arc::new(Mutex::new(Vec::new()));
        let objects = Arc::new(Mutex::new(objects));
        let (sent2, objects2) = (sent.clone(), objects.clone());
        tokio::spawn(async move {
            let mut version = 100;
            while let Some((request, respond)) = handle.next_request().await {
                let method = request.method().clone();
                let path = request.uri().path().to_owned();
                let query = request.uri().query().unwrap_or_default().to_owned();
                let bytes = request
                    .into_body()
                    .collect_bytes()
                    .await
                    .unwrap_or_default();
                let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                sent2.lock().unwrap().push(Sent {
                    method: method.clone(),
                    path: path.clone(),
                    query,
                    body: body.clone(),
                });
                version += 1;
                let mut objects = objects2.lock().unwrap();
                let (status, reply) = answer(&mut objects, &method, &path, &body, version);
                let response = Response::builder()
                    .status(status)
                    .body(Body::from(serde_json::to_vec(&reply).unwrap_or_default()))
                    .unwrap();
                respond.send_response(response);
            }
        });
        (
            kube::Client::new(service, "default"),
            Self { sent, objects },
        )
    }

    pub fn take(&self) -> Vec<Sent> {
        std::mem::take(&mut *self.sent.lock().unwrap())
    }

    pub fn object<K: serde::de::DeserializeOwned>(&self, path: &str) -> K {
        let objects = self.objects.lock().unwrap();
        let (_, v) = objects.iter().find(|(p, _)| p == path).unwrap();
        serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// Collections the fake server lists on GET.
const COLLECTIONS: &[&str] = &[
    "tasks",
    "proplets",
    "propellerjobs",
    "federatedjobs",
    "trainingrounds",
    "configmaps",
    "secrets",
    "deployments",
];

fn not_found(path: &str) -> (u16, Value) {
    (
        404,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
               "message": format!("{path} not found"), "code": 404}),
    )
}

/// What the fake API server answers: PATCH merges into the stored object, POST stores a new
/// one (409 if it exists), GET reads one object or lists a collection, anything else echoes.
fn answer(
    objects: &mut Vec<(String, Value)>,
    method: &Method,
    path: &str,
    body: &Value,
    version: u64,
) -> (u16, Value) {
    let base = path.trim_end_matches("/status").to_owned();
    if *method == Method::PATCH {
        if let Some((_, obj)) = objects.iter_mut().find(|(p, _)| *p == base) {
            let mut patch = body.clone();
            if let Some(meta) = patch.get_mut("metadata").and_then(Value::as_object_mut) {
                meta.remove("resourceVersion");
            }
            merge(obj, &patch);
            obj["metadata"]["resourceVersion"] = json!(version.to_string());
            return (200, obj.clone());
        }
        return (200, body.clone());
    }
    let last = path.rsplit('/').next().unwrap_or_default();
    if *method == Method::POST && COLLECTIONS.contains(&last) {
        let name = body["metadata"]["name"].as_str().unwrap_or_default();
        let key = format!("{path}/{name}");
        if objects.iter().any(|(p, _)| *p == key) {
            return (
                409,
                json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                       "reason": "AlreadyExists", "message": "exists", "code": 409}),
            );
        }
        let mut obj = body.clone();
        obj["metadata"]["uid"] = json!(format!("uid-{name}"));
        obj["metadata"]["resourceVersion"] = json!(version.to_string());
        objects.push((key, obj.clone()));
        return (201, obj);
    }
    if *method == Method::GET {
        if let Some((_, obj)) = objects.iter().find(|(p, _)| *p == path) {
            return (200, obj.clone());
        }
        if COLLECTIONS.contains(&last) {
            let prefix = format!("{path}/");
            let items: Vec<Value> = objects
                .iter()
                .filter(|(p, _)| p.starts_with(&prefix) && !p[prefix.len()..].contains('/'))
                .map(|(_, o)| o.clone())
                .collect();
            return (
                200,
                json!({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": version.to_string()}, "items": items}),
            );
        }
        return not_found(path);
    }
    (200, body.clone())
}

/// A watch's cache and its index, updated together as the watch updates them.
pub struct IndexedCache<I: propeller_operator::watch_index::Index>
where
    I::Object: kube::Resource + Clone + 'static,
    <I::Object as kube::Resource>::DynamicType: Eq + std::hash::Hash + Clone + Default,
{
    writer: kube::runtime::reflector::store::Writer<I::Object>,
    index: propeller_operator::watch_index::SharedIndex<I>,
}

impl<I: propeller_operator::watch_index::Index> IndexedCache<I>
where
    I::Object: kube::Resource + Clone + 'static,
    <I::Object as kube::Resource>::DynamicType: Eq + std::hash::Hash + Clone + Default,
{
    pub fn apply_watcher_event(&mut self, event: &kube::runtime::watcher::Event<I::Object>) {
        self.writer.apply_watcher_event(event);
        self.index.apply(event);
    }
}

/// The Task cache and its index.
pub type TaskCache = IndexedCache<propeller_operator::task_index::TaskIndex>;
/// The Proplet cache and its label index.
pub type PropletCache = IndexedCache<propeller_operator::proplet_index::PropletIndex>;

/// The wake queues of Tasks and Proplets, as a test reads them.
pub struct Wakes {
    /// Tasks woken.
    pub tasks: tokio::sync::mpsc::UnboundedReceiver<propeller_operator::controller::ObjectName>,
    /// Proplets woken.
    pub proplets: tokio::sync::mpsc::UnboundedReceiver<propeller_operator::controller::ObjectName>,
}

/// Shared reconciler state over a fake API, a real loopback broker, and caches holding
/// `proplets` and `tasks`; the writers let a test update the caches as a watch would.
pub struct Harness {
    pub shared: std::sync::Arc<propeller_operator::k8s::runtime::Shared>,
    pub wakes: Wakes,
    pub proplets: PropletCache,
    pub tasks: TaskCache,
    pub broker: propeller_broker::server::EmbeddedBroker,
    pub logins: Arc<propeller_broker::server::CredentialStore>,
}

impl Harness {
    pub async fn start(
        client: kube::Client,
        proplets: Vec<propeller_operator::crd::proplet::Proplet>,
        tasks: Vec<propeller_operator::crd::task::Task>,
    ) -> Self {
        use kube::runtime::{reflector, watcher};
        use propeller_operator::crd::proplet::Proplet;
        use propeller_operator::crd::task::Task;
        use propeller_operator::k8s::runtime::{Caches, Settings, Shared};
        let logins = Arc::new(propeller_broker::server::CredentialStore::new());
        let broker = propeller_broker::server::EmbeddedBroker::start(
            propeller_broker::server::BrokerConfig::loopback(),
            logins.clone(),
        )
        .await
        .unwrap_or_else(|e| panic!("broker: {e}"));
        let (proplet_reader, proplet_writer) = reflector::store();
        let mut proplet_cache = PropletCache {
            writer: proplet_writer,
            index: Default::default(),
        };
        for p in proplets {
            proplet_cache.apply_watcher_event(&watcher::Event::Apply(p));
        }
        let (task_reader, task_writer) = reflector::store();
        let mut task_cache = TaskCache {
            writer: task_writer,
            index: Default::default(),
        };
        for t in tasks {
            task_cache.apply_watcher_event(&watcher::Event::Apply(t));
        }
        let (deployments, _) = reflector::store();
        let settings = Settings {
            watch_namespace: None,
            token_namespace: "default".into(),
            kueue: false,
            proplet: propeller_operator::decision::proplet::PropletSettings {
                last_seen_threshold: std::time::Duration::from_secs(30),
                status_flush_interval: std::time::Duration::from_secs(5),
                routine_writes_per_second: 20,
            },
            task: propeller_operator::decision::task::TaskSettings {
                strategy: propeller_operator::decision::scheduler::Strategy::RoundRobin,
                default_timeout: std::time::Duration::from_secs(3600),
                running_write_delay: std::time::Duration::from_secs(1),
                finalizer: Default::default(),
            },
            logs: Default::default(),
        };
        let (wakers, mut queues) = propeller_operator::controller::kinds::wake_queues();
        let wakes = Wakes {
            tasks: queues.receiver::<Task>().unwrap(),
            proplets: queues.receiver::<Proplet>().unwrap(),
        };
        let shared = Shared::new(
            client,
            settings,
            broker.publisher(),
            logins.clone(),
            Arc::new(propeller_operator::metrics::ControllerMetrics::default()),
            None,
            Caches {
                wakers,
                proplets: proplet_reader,
                proplet_index: proplet_cache.index.clone(),
                tasks: task_reader,
                task_index: task_cache.index.clone(),
                credential_gate: Default::default(),
                deployments,
                secrets: kube::runtime::reflector::store().0,
            },
        );
        Self {
            shared: Arc::new(shared),
            wakes,
            proplets: proplet_cache,
            tasks: task_cache,
            broker,
            logins,
        }
    }
}
