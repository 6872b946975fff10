//! Kubernetes mode's task log endpoint (`propeller run --logs-listen`): HTTPS only, and every
//! caller checked by the API server ([`super::user_access`]): they must be allowed `get` on
//! the `tasks/log` subresource of the Task. Lines are served as in standalone
//! ([`crate::log_endpoint`]).

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use kube::api::Api;
use propeller_core::object_name::ObjectName;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use super::user_access::{serve_https, Permission, Refused, UserAccess, GROUP};
use crate::console::routes;
use crate::crd::task::Task;
use crate::log_endpoint::{FindTask, LogParams};
use crate::task_logs::LogStore;

/// What the endpoint serves from.
#[derive(Clone)]
pub struct LogAccess {
    /// Checks callers, and reads Tasks.
    pub access: UserAccess,
    /// The lines kept.
    pub logs: Arc<LogStore>,
}

/// The endpoint's routes.
pub fn router(access: LogAccess) -> Router {
    Router::new()
        .route(routes::LOGS, get(task_log))
        .with_state(access)
}

/// Serves `access` over TLS on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, acceptor: TlsAcceptor, access: LogAccess) {
    serve_https(listener, acceptor, router(access), "log endpoint").await
}

/// `GET /v1/logs/{namespace}/{name}`, for a caller the API server allows `get tasks/log`.
async fn task_log(
    State(state): State<LogAccess>,
    headers: HeaderMap,
    Path((namespace, name)): Path<(String, String)>,
    Query(params): Query<LogParams>,
) -> Result<Response, Refused> {
    let user = state.access.user(&headers).await?;
    state
        .access
        .allow(
            &user,
            Permission {
                verb: "get",
                group: GROUP.to_owned(),
                resource: "tasks".to_owned(),
                subresource: Some("log"),
                namespace: Some(namespace.clone()),
                name: Some(name.clone()),
            },
        )
        .await?;
    let client = state.access.client().clone();
    let find: FindTask = Arc::new(move |name: ObjectName| {
        let api: Api<Task> = Api::namespaced(client.clone(), &name.namespace);
        Box::pin(async move { api.get_opt(&name.name).await.ok().flatten() })
    });
    Ok(crate::log_endpoint::respond(
        state.logs.clone(),
        find,
        ObjectName::new(&namespace, &name),
        params,
    )
    .await)
}
