//! The standalone HTTP API that `propeller apply/get/describe/delete` use.
//!
//! It listens on loopback by default and every request needs the bearer token written to the
//! data directory on first start. Applied manifests go through the same schema and CEL
//! admission as on a cluster, so standalone accepts and rejects exactly what a cluster would;
//! a multi-document manifest is checked whole before anything is stored.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use subtle::ConstantTimeEq;

use crate::console::routes;
use crate::controller::ObjectName;
use crate::crd::task::Task;
use crate::decision::kueue::QUEUE_NAME_LABEL;
use crate::log_endpoint::{FindTask, LogParams};
use crate::manifest::{canonical_kind, describe_doc, documents, served_kinds};
use crate::task_logs::LogStore;
use crate::validation::Admission;

use super::events::EventLog;
use super::kinds::TASK;
use super::store::{Deleted, ObjectStore, StoreError};
use super::watch::{ChangeLog, Filter, Watch};

/// What the API serves from.
pub struct ApiState {
    /// The objects.
    pub store: ObjectStore,
    /// Schema and CEL checks of our kinds.
    pub admission: Admission,
    /// The bearer token clients must present.
    pub token: String,
    /// Recent events the reconcilers recorded.
    pub events: Arc<EventLog>,
    /// Renders `/metrics` (OpenMetrics text).
    pub metrics: MetricsText,
    /// Recent changes, for watches.
    pub changes: Arc<ChangeLog>,
    /// What tasks printed.
    pub logs: Arc<LogStore>,
}

/// Renders the process's metrics as OpenMetrics text when `/metrics` is asked for.
pub type MetricsText = Arc<dyn Fn() -> String + Send + Sync>;

/// An error answered as JSON `{"error": message}`.
struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(json!({ "error": self.1 }))).into_response()
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        let status = match e {
            StoreError::NotFound { .. } => StatusCode::NOT_FOUND,
            StoreError::AlreadyExists { .. } | StoreError::Conflict { .. } => StatusCode::CONFLICT,
            StoreError::Invalid(_) | StoreError::Terminating { .. } => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            StoreError::DiskFull(_) => StatusCode::INSUFFICIENT_STORAGE,
            StoreError::Io(_) => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(status, e.to_string())
    }
}

fn authorize(state: &ApiState, headers: &HeaderMap) -> Result<(), ApiError> {
    let presented = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default();
    if bool::from(presented.as_bytes().ct_eq(state.token.as_bytes())) {
        Ok(())
    } else {
        Err(ApiError(
            StatusCode::UNAUTHORIZED,
            "missing or wrong bearer token (see api-token in the data directory)".into(),
        ))
    }
}

fn kind_or_404(typed: &str) -> Result<&'static str, ApiError> {
    canonical_kind(typed).ok_or_else(|| {
        ApiError(
            StatusCode::NOT_FOUND,
            format!(
                "unknown kind {typed:?}; standalone serves {}",
                served_kinds()
            ),
        )
    })
}

/// Checks every document; returns them defaulted, or every problem found.
fn admit_all(state: &ApiState, docs: &[Value]) -> Result<Vec<Value>, Vec<String>> {
    let mut admitted = Vec::new();
    let mut problems = Vec::new();
    for (i, doc) in docs.iter().enumerate() {
        let what = describe_doc(i, doc);
        let Some(kind) = doc["kind"].as_str().and_then(canonical_kind) else {
            problems.push(format!(
                "{what}: kind {:?} is not served by standalone",
                doc["kind"].as_str().unwrap_or("")
            ));
            continue;
        };
        if doc["metadata"]["name"].as_str().is_none_or(str::is_empty) {
            problems.push(format!("{what}: metadata.name is required"));
            continue;
        }
        if matches!(kind, "Secret" | "ConfigMap") {
            admitted.push(doc.clone());
            continue;
        }
        if doc["metadata"]["labels"][QUEUE_NAME_LABEL].is_string() {
            problems.push(format!(
                "{what}: the {QUEUE_NAME_LABEL} label asks for Kueue admission, which standalone \
                 does not have (it runs every job at once); remove the label, or run the job \
                 on a Kubernetes cluster with Kueue and `propeller run --kueue`"
            ));
            continue;
        }
        let ns = doc["metadata"]["namespace"].as_str().unwrap_or("default");
        let name = doc["metadata"]["name"].as_str().unwrap_or_default();
        let old = state.store.get(kind, ns, name).ok().flatten();
        match state.admission.admit(doc, old.as_ref()) {
            Ok(defaulted) => admitted.push(defaulted),
            Err(e) => problems.push(format!("{what}: {e}")),
        }
    }
    if problems.is_empty() {
        Ok(admitted)
    } else {
        Err(problems)
    }
}

async fn metrics(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
) -> Result<impl IntoResponse, ApiError> {
    authorize(&state, &headers)?;
    Ok((
        [(
            axum::http::header::CONTENT_TYPE,
            propeller_broker::http::OPENMETRICS,
        )],
        (state.metrics)(),
    ))
}

async fn apply(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    authorize(&state, &headers)?;
    // Refusals of the body itself (too large, unreadable) in the API's JSON form too.
    let body = body.map_err(|rejection| ApiError(rejection.status(), rejection.body_text()))?;
    let docs = documents(&body).map_err(|e| ApiError(StatusCode::BAD_REQUEST, e))?;
    let outcome = apply_documents(&state, &docs)
        .await
        .map_err(|refused| ApiError(refused.status, refused.problems.join("\n")))?;
    Ok(Json(Value::Array(outcome)))
}

/// Why a manifest was not applied, with the HTTP status that says so.
#[derive(Debug)]
pub struct Refused {
    /// 422 for documents admission or the store refused, 507 when the disk is full, 503
    /// when the store could not be written for another I/O reason.
    pub status: StatusCode,
    /// One line per problem.
    pub problems: Vec<String>,
}

/// Admits every document, then stores them all in one transaction: nothing is stored when
/// one is refused. Returns what happened to each (`kind`, `namespace`, `name`, `action`).
pub async fn apply_documents(state: &ApiState, docs: &[Value]) -> Result<Vec<Value>, Refused> {
    let admitted = admit_all(state, docs).map_err(|problems| Refused {
        status: StatusCode::UNPROCESSABLE_ENTITY,
        problems,
    })?;
    let described: Vec<String> = admitted
        .iter()
        .enumerate()
        .map(|(i, doc)| describe_doc(i, doc))
        .collect();
    let applied = state.store.apply_all_async(admitted).await.map_err(|e| {
        let status = match *e.error {
            StoreError::DiskFull(_) => StatusCode::INSUFFICIENT_STORAGE,
            StoreError::Io(_) => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::UNPROCESSABLE_ENTITY,
        };
        let what = described
            .get(e.index)
            .map(String::as_str)
            .unwrap_or("a document");
        Refused {
            status,
            problems: vec![format!("{what}: {}; nothing was applied", e.error)],
        }
    })?;
    Ok(applied
        .iter()
        .map(|applied| {
            let o = &applied.object;
            json!({
                "kind": o["kind"], "namespace": o["metadata"]["namespace"], "name": o["metadata"]["name"],
                "action": if applied.created { "created" } else { "configured" },
            })
        })
        .collect())
}

#[derive(Deserialize)]
struct ListQuery {
    namespace: Option<String>,
}

async fn list(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
    Path(kind): Path<String>,
    Query(q): Query<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    authorize(&state, &headers)?;
    let kind = kind_or_404(&kind)?;
    Ok(Json(Value::Array(
        state.store.list(kind, q.namespace.as_deref())?,
    )))
}

async fn get_one(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
    Path((kind, ns, name)): Path<(String, String, String)>,
) -> Result<Json<Value>, ApiError> {
    authorize(&state, &headers)?;
    let kind = kind_or_404(&kind)?;
    state.store.get(kind, &ns, &name)?.map(Json).ok_or_else(|| {
        ApiError(
            StatusCode::NOT_FOUND,
            format!("{kind} {ns}/{name} not found"),
        )
    })
}

async fn delete_one(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
    Path((kind, ns, name)): Path<(String, String, String)>,
) -> Result<Json<Value>, ApiError> {
    authorize(&state, &headers)?;
    let kind = kind_or_404(&kind)?;
    let outcome = match state.store.delete_async(kind, &ns, &name).await? {
        Deleted::Removed(_) => "deleted",
        Deleted::Pending(_) => "deleting (waiting for finalizers)",
    };
    Ok(Json(
        json!({ "kind": kind, "namespace": ns, "name": name, "outcome": outcome }),
    ))
}

async fn events_of(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
    Path((kind, ns, name)): Path<(String, String, String)>,
) -> Result<Json<Value>, ApiError> {
    authorize(&state, &headers)?;
    let kind = kind_or_404(&kind)?;
    Ok(Json(
        serde_json::to_value(state.events.of(kind, &ns, &name)).unwrap_or(Value::Null),
    ))
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WatchQuery {
    namespace: Option<String>,
    name: Option<String>,
    resource_version: Option<String>,
}

/// `GET /v1/watch/{kind}`: one JSON watch event per line until the client goes away.
async fn watch(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
    Path(kind): Path<String>,
    Query(q): Query<WatchQuery>,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let kind = kind_or_404(&kind)?;
    let from = match q.resource_version.as_deref().filter(|v| !v.is_empty()) {
        Some(v) => Some(v.parse::<u64>().map_err(|_| {
            ApiError(
                StatusCode::BAD_REQUEST,
                format!("resourceVersion {v:?} is not a number"),
            )
        })?),
        None => None,
    };
    let filter = Filter {
        kind: kind.to_owned(),
        namespace: q.namespace.filter(|n| !n.is_empty()),
        name: q.name.filter(|n| !n.is_empty()),
    };
    let watch = Watch::start(state.store.clone(), state.changes.clone(), filter, from)?;
    let lines = futures::stream::unfold(watch, |mut watch| async move {
        let line = watch.next_line().await?;
        Some((Ok::<_, std::convert::Infallible>(line), watch))
    });
    Ok((
        [("content-type", "application/json;stream=watch")],
        axum::body::Body::from_stream(lines),
    )
        .into_response())
}

/// `GET /v1/logs/{namespace}/{name}`: what the Task printed (see [`crate::log_endpoint`]).
async fn task_log(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
    Path((namespace, name)): Path<(String, String)>,
    Query(params): Query<LogParams>,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let store = state.store.clone();
    let find: FindTask = Arc::new(move |name: ObjectName| {
        let task = store
            .get_typed::<Task>(TASK, &name.namespace, &name.name)
            .ok()
            .flatten();
        Box::pin(std::future::ready(task))
    });
    Ok(crate::log_endpoint::respond(
        state.logs.clone(),
        find,
        ObjectName::new(&namespace, &name),
        params,
    )
    .await)
}

/// The API's routes, and the web console that uses them.
pub fn router(state: Arc<ApiState>) -> Router {
    crate::console::router()
        .route(routes::APPLY, post(apply))
        .route("/metrics", get(metrics))
        .route(routes::OBJECTS, get(list))
        .route(routes::OBJECT, get(get_one).delete(delete_one))
        .route(routes::EVENTS, get(events_of))
        .route(routes::WATCH, get(watch))
        .route(routes::LOGS, get(task_log))
        .with_state(state)
}

/// Serves the API on `listener` until the task is dropped.
pub async fn serve(listener: tokio::net::TcpListener, state: Arc<ApiState>) -> std::io::Result<()> {
    axum::serve(listener, router(state)).await
}
