//! The web console on a cluster (`propeller run --console-listen`): the console's files and
//! the same `/v1/...` routes standalone's API has, over HTTPS, for users the API server
//! knows ([`super::user_access`]).
//!
//! Reads are checked with a SubjectAccessReview (the verb on the resource asked for) and then
//! made with propeller's own client, so a user sees exactly what RBAC lets them list, get or
//! watch. Changes (apply, delete) are made with a client that presents the user's own token:
//! the API server decides, and its refusal is what the user reads. A manifest is first
//! applied as a server-side dry run, whole, so one refused document leaves nothing applied.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock};

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Event, Secret};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, WatchEvent,
    WatchParams,
};
use kube::core::TypeMeta;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use super::log_access::{self, LogAccess};
use super::user_access::{serve_https, Permission, Refused, UserAccess};
use crate::console::routes;
use crate::controller::kinds::{for_each_kind, KindVisitor, Reconciled};
use crate::manifest::{canonical_kind, describe_doc, documents, served_kinds};
use crate::standalone::watch::INITIAL_EVENTS_END;
use crate::task_logs::LogStore;

/// The field manager of the console's server-side applies.
pub const FIELD_MANAGER: &str = "propeller-console";
/// How long one watch request to the API server lasts before it is renewed.
const WATCH_SECONDS: u32 = 290;

/// The API resource of every kind served, by kind name.
static RESOURCES: LazyLock<HashMap<String, ApiResource>> = LazyLock::new(|| {
    struct Resources(HashMap<String, ApiResource>);
    impl KindVisitor for Resources {
        fn visit<K: Reconciled>(&mut self) {
            let resource = ApiResource::erase::<K>(&());
            self.0.insert(resource.kind.clone(), resource);
        }
    }
    let mut resources = Resources(HashMap::new());
    for_each_kind(&mut resources);
    for resource in [
        ApiResource::erase::<Secret>(&()),
        ApiResource::erase::<ConfigMap>(&()),
    ] {
        resources.0.insert(resource.kind.clone(), resource);
    }
    resources.0
});

/// What the console serves from.
#[derive(Clone)]
pub struct ConsoleAccess {
    /// Checks callers; reads with propeller's client.
    pub access: UserAccess,
    /// Task output, for `/v1/logs`.
    pub logs: Arc<LogStore>,
}

/// The console's routes.
pub fn router(console: ConsoleAccess) -> Router {
    let logs = log_access::router(LogAccess {
        access: console.access.clone(),
        logs: console.logs.clone(),
    });
    crate::console::router()
        .route(routes::APPLY, post(apply))
        .route(routes::OBJECTS, get(list))
        .route(routes::OBJECT, get(get_one).delete(delete_one))
        .route(routes::EVENTS, get(events_of))
        .route(routes::WATCH, get(watch))
        .with_state(console)
        .merge(logs)
}

/// Serves the console over TLS on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, acceptor: TlsAcceptor, console: ConsoleAccess) {
    serve_https(listener, acceptor, router(console), "console").await
}

fn resource_of(typed: &str) -> Result<&'static ApiResource, Refused> {
    canonical_kind(typed)
        .and_then(|kind| RESOURCES.get(kind))
        .ok_or_else(|| {
            Refused(
                StatusCode::NOT_FOUND,
                format!(
                    "unknown kind {typed:?}; the console serves {}",
                    served_kinds()
                ),
            )
        })
}

/// Refuses the request unless its caller may `verb` the resource (in `namespace`, or every
/// namespace; one object when `name` is given).
async fn check(
    console: &ConsoleAccess,
    headers: &HeaderMap,
    verbs: &[&'static str],
    resource: &ApiResource,
    namespace: Option<&str>,
    name: Option<&str>,
) -> Result<(), Refused> {
    let user = console.access.user(headers).await?;
    for &verb in verbs {
        let permission = Permission {
            verb,
            group: resource.group.clone(),
            resource: resource.plural.clone(),
            subresource: None,
            namespace: namespace.map(str::to_owned),
            name: name.map(str::to_owned),
        };
        console.access.allow(&user, permission).await?;
    }
    Ok(())
}

fn api_for(
    client: kube::Client,
    resource: &ApiResource,
    namespace: Option<&str>,
) -> Api<DynamicObject> {
    match namespace {
        Some(ns) => Api::namespaced_with(client, ns, resource),
        None => Api::all_with(client, resource),
    }
}

/// An object as the console shows it: with its kind, without the bookkeeping of field
/// managers (most of a Proplet's bytes).
fn shown(mut object: DynamicObject, resource: &ApiResource) -> Value {
    object.types = Some(TypeMeta {
        api_version: resource.api_version.clone(),
        kind: resource.kind.clone(),
    });
    object.metadata.managed_fields = None;
    serde_json::to_value(object).unwrap_or(Value::Null)
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Scope {
    namespace: Option<String>,
    name: Option<String>,
    resource_version: Option<String>,
}

async fn list(
    State(console): State<ConsoleAccess>,
    headers: HeaderMap,
    Path(kind): Path<String>,
    Query(scope): Query<Scope>,
) -> Result<Json<Value>, Refused> {
    let resource = resource_of(&kind)?;
    let namespace = scope.namespace.as_deref().filter(|n| !n.is_empty());
    check(&console, &headers, &["list"], resource, namespace, None).await?;
    let listed = api_for(console.access.client().clone(), resource, namespace)
        .list(&ListParams::default())
        .await
        .map_err(Refused::from_api)?;
    Ok(Json(Value::Array(
        listed
            .items
            .into_iter()
            .map(|o| shown(o, resource))
            .collect(),
    )))
}

async fn get_one(
    State(console): State<ConsoleAccess>,
    headers: HeaderMap,
    Path((kind, namespace, name)): Path<(String, String, String)>,
) -> Result<Json<Value>, Refused> {
    let resource = resource_of(&kind)?;
    check(
        &console,
        &headers,
        &["get"],
        resource,
        Some(&namespace),
        Some(&name),
    )
    .await?;
    let object = api_for(console.access.client().clone(), resource, Some(&namespace))
        .get(&name)
        .await
        .map_err(Refused::from_api)?;
    Ok(Json(shown(object, resource)))
}

async fn delete_one(
    State(console): State<ConsoleAccess>,
    headers: HeaderMap,
    Path((kind, namespace, name)): Path<(String, String, String)>,
) -> Result<Json<Value>, Refused> {
    let resource = resource_of(&kind)?;
    let client = console.access.client_as(&headers)?;
    let outcome = api_for(client, resource, Some(&namespace))
        .delete(&name, &DeleteParams::default())
        .await
        .map_err(Refused::from_api)?
        .map_left(|_| "deleting (waiting for finalizers)")
        .map_right(|_| "deleted")
        .into_inner();
    Ok(Json(
        json!({ "kind": resource.kind, "namespace": namespace, "name": name, "outcome": outcome }),
    ))
}

/// An object's recent Events, for a user who may get the object.
async fn events_of(
    State(console): State<ConsoleAccess>,
    headers: HeaderMap,
    Path((kind, namespace, name)): Path<(String, String, String)>,
) -> Result<Json<Value>, Refused> {
    let resource = resource_of(&kind)?;
    check(
        &console,
        &headers,
        &["get"],
        resource,
        Some(&namespace),
        Some(&name),
    )
    .await?;
    let selector = format!(
        "involvedObject.kind={},involvedObject.name={name}",
        resource.kind
    );
    let mut events = Api::<Event>::namespaced(console.access.client().clone(), &namespace)
        .list(&ListParams::default().fields(&selector))
        .await
        .map_err(Refused::from_api)?
        .items;
    events.sort_by_key(|e| {
        e.last_timestamp
            .as_ref()
            .map(|t| t.0)
            .or(e.event_time.as_ref().map(|t| t.0))
    });
    Ok(Json(Value::Array(
        events
            .into_iter()
            .map(|e| {
                let time = e
                    .last_timestamp
                    .map(|t| t.0)
                    .or(e.event_time.map(|t| t.0))
                    .or(e.metadata.creation_timestamp.map(|t| t.0));
                json!({ "type": e.type_, "reason": e.reason, "message": e.message, "time": time })
            })
            .collect(),
    )))
}

/// One watch event as a line of the watch protocol.
fn event_line(event: WatchEvent<DynamicObject>, resource: &ApiResource) -> (Bytes, Option<String>) {
    let (line, version) = match event {
        WatchEvent::Added(o) => {
            let v = o.metadata.resource_version.clone();
            (json!({ "type": "ADDED", "object": shown(o, resource) }), v)
        }
        WatchEvent::Modified(o) => {
            let v = o.metadata.resource_version.clone();
            (
                json!({ "type": "MODIFIED", "object": shown(o, resource) }),
                v,
            )
        }
        WatchEvent::Deleted(o) => {
            let v = o.metadata.resource_version.clone();
            (
                json!({ "type": "DELETED", "object": shown(o, resource) }),
                v,
            )
        }
        WatchEvent::Bookmark(b) => {
            let v = b.metadata.resource_version.clone();
            (
                json!({ "type": "BOOKMARK", "object": { "kind": resource.kind, "metadata": {
                    "resourceVersion": v, "annotations": b.metadata.annotations,
                } } }),
                Some(v),
            )
        }
        WatchEvent::Error(e) => (
            json!({ "type": "ERROR", "object": { "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": e.code, "reason": e.reason, "message": e.message } }),
            None,
        ),
    };
    let mut bytes = line.to_string().into_bytes();
    bytes.push(b'\n');
    (Bytes::from(bytes), version)
}

/// `GET /v1/watch/{kind}`: without a resourceVersion, every object as `ADDED` and a bookmark
/// marking the end of them, then changes, one JSON event per line, until the caller leaves.
async fn watch(
    State(console): State<ConsoleAccess>,
    headers: HeaderMap,
    Path(kind): Path<String>,
    Query(scope): Query<Scope>,
) -> Result<Response, Refused> {
    let resource = resource_of(&kind)?;
    let namespace = scope.namespace.clone().filter(|n| !n.is_empty());
    check(
        &console,
        &headers,
        &["list", "watch"],
        resource,
        namespace.as_deref(),
        None,
    )
    .await?;
    let api = api_for(
        console.access.client().clone(),
        resource,
        namespace.as_deref(),
    );
    let fields = scope
        .name
        .filter(|n| !n.is_empty())
        .map(|n| format!("metadata.name={n}"));
    let mut initial = Vec::new();
    let mut version = match scope.resource_version.filter(|v| !v.is_empty()) {
        Some(v) => v,
        None => {
            let mut params = ListParams::default();
            if let Some(fields) = &fields {
                params = params.fields(fields);
            }
            let listed = api.list(&params).await.map_err(Refused::from_api)?;
            let version = listed.metadata.resource_version.clone().unwrap_or_default();
            for object in listed.items {
                initial.push(event_line(WatchEvent::Added(object), resource).0);
            }
            let (end, _) = event_line(
                WatchEvent::Bookmark(kube::core::watch::Bookmark {
                    types: TypeMeta::default(),
                    metadata: kube::core::watch::BookmarkMeta {
                        resource_version: version.clone(),
                        annotations: [(INITIAL_EVENTS_END.to_owned(), "true".to_owned())].into(),
                    },
                }),
                resource,
            );
            initial.push(end);
            version
        }
    };
    let (lines, receiver) = tokio::sync::mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        for line in initial {
            if lines.send(line).await.is_err() {
                return;
            }
        }
        loop {
            let mut params = WatchParams::default().timeout(WATCH_SECONDS);
            if let Some(fields) = &fields {
                params = params.fields(fields);
            }
            let stream = match api.watch(&params, &version).await {
                Ok(stream) => stream,
                Err(e) => {
                    let (line, _) = event_line(
                        WatchEvent::Error(match e {
                            kube::Error::Api(status) => status,
                            other => Box::new(
                                kube::core::Status::failure(
                                    &other.to_string(),
                                    "ServiceUnavailable",
                                )
                                .with_code(503),
                            ),
                        }),
                        resource,
                    );
                    let _ = lines.send(line).await;
                    return;
                }
            };
            let mut stream = std::pin::pin!(stream.into_stream());
            while let Some(event) = stream.next().await {
                let Ok(event) = event else { break };
                let gone = matches!(&event, WatchEvent::Error(_));
                let (line, seen) = event_line(event, resource);
                if let Some(seen) = seen {
                    version = seen;
                }
                if lines.send(line).await.is_err() || gone {
                    return;
                }
            }
            if lines.is_closed() {
                return;
            }
        }
    });
    let body = futures::stream::unfold(receiver, |mut receiver| async move {
        let line = receiver.recv().await?;
        Some((Ok::<_, std::convert::Infallible>(line), receiver))
    });
    Ok((
        [("content-type", "application/json;stream=watch")],
        Body::from_stream(body),
    )
        .into_response())
}

/// `POST /v1/apply`: every document applied server-side with the caller's token, after a
/// dry run of all of them passed.
async fn apply(
    State(console): State<ConsoleAccess>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<Value>, Refused> {
    let client = console.access.client_as(&headers)?;
    let docs = documents(&body).map_err(|e| Refused(StatusCode::BAD_REQUEST, e))?;
    let mut targets = Vec::new();
    for (i, doc) in docs.iter().enumerate() {
        let what = describe_doc(i, doc);
        let resource = doc["kind"]
            .as_str()
            .and_then(canonical_kind)
            .and_then(|kind| RESOURCES.get(kind))
            .ok_or_else(|| {
                Refused(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    format!("{what}: the console applies only {}", served_kinds()),
                )
            })?;
        let name = doc["metadata"]["name"]
            .as_str()
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                Refused(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    format!("{what}: metadata.name is required"),
                )
            })?
            .to_owned();
        let namespace = doc["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_owned();
        let mut doc = doc.clone();
        doc["metadata"]["namespace"] = json!(namespace);
        targets.push((what, resource, namespace, name, doc));
    }
    let dry_run = PatchParams::apply(FIELD_MANAGER).dry_run();
    for (what, resource, namespace, name, doc) in &targets {
        api_for(client.clone(), resource, Some(namespace))
            .patch(name, &dry_run, &Patch::Apply(doc))
            .await
            .map_err(|e| {
                let Refused(status, message) = Refused::from_api(e);
                Refused(status, format!("{what}: {message}; nothing was applied"))
            })?;
    }
    let mut applied = Vec::new();
    for (what, resource, namespace, name, doc) in &targets {
        let api = api_for(client.clone(), resource, Some(namespace));
        let existed = api.get_metadata_opt(name).await.ok().flatten().is_some();
        api.patch(name, &PatchParams::apply(FIELD_MANAGER), &Patch::Apply(doc))
            .await
            .map_err(|e| {
                let Refused(status, message) = Refused::from_api(e);
                Refused(status, format!("{what}: {message}"))
            })?;
        applied.push(json!({
            "kind": resource.kind, "namespace": namespace, "name": name,
            "action": if existed { "configured" } else { "created" },
        }));
    }
    Ok(Json(Value::Array(applied)))
}
