//! Kubernetes mode's task log endpoint (`propeller run --logs-listen`): HTTPS only, and every
//! request authenticated and authorised by the API server, the way the kubelet's log
//! endpoint checks its callers. The caller's bearer token goes through a TokenReview; the
//! user it names must be allowed `get` on the `tasks/log` subresource of the Task (a
//! SubjectAccessReview). No token: 401; a token the API server does not accept: 401; a user
//! without that permission: 403. Lines are served as in standalone
//! ([`crate::log_endpoint`]).

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, UserInfo};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use propeller_core::object_name::ObjectName;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, warn};

use crate::crd::task::Task;
use crate::log_endpoint::{FindTask, LogParams};
use crate::task_logs::LogStore;

/// The API group of propeller's resources, as a SubjectAccessReview names it.
const GROUP: &str = "propeller.propeller.absmach.eu";

/// What the endpoint serves from.
#[derive(Clone)]
pub struct LogAccess {
    /// Reviews tokens and permissions, and reads Tasks.
    pub client: kube::Client,
    /// The lines kept.
    pub logs: Arc<LogStore>,
}

/// Why a request was refused.
struct Refused(StatusCode, String);

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        (self.0, axum::Json(serde_json::json!({ "error": self.1 }))).into_response()
    }
}

/// The endpoint's routes.
pub fn router(access: LogAccess) -> Router {
    Router::new()
        .route("/v1/logs/{namespace}/{name}", get(task_log))
        .with_state(access)
}

/// Serves `access` over TLS on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, acceptor: TlsAcceptor, access: LogAccess) {
    let app = router(access);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                warn!(%e, "log endpoint: cannot accept a connection");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let (acceptor, app) = (acceptor.clone(), app.clone());
        tokio::spawn(async move {
            let tls = match acceptor.accept(stream).await {
                Ok(tls) => tls,
                Err(e) => {
                    debug!(%peer, %e, "log endpoint: TLS handshake failed");
                    return;
                }
            };
            let service = hyper::service::service_fn(move |request| {
                tower::ServiceExt::oneshot(app.clone(), request)
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                .await
            {
                debug!(%peer, %e, "log endpoint: connection ended");
            }
        });
    }
}

/// `GET /v1/logs/{namespace}/{name}`, for a caller the API server allows `get tasks/log`.
async fn task_log(
    State(access): State<LogAccess>,
    headers: HeaderMap,
    Path((namespace, name)): Path<(String, String)>,
    Query(params): Query<LogParams>,
) -> Result<Response, Refused> {
    let token = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            Refused(
                StatusCode::UNAUTHORIZED,
                "a bearer token is required (for example `kubectl create token NAME`)".into(),
            )
        })?;
    let user = authenticate(&access.client, token).await?;
    authorize(&access.client, &user, &namespace, &name).await?;
    let client = access.client.clone();
    let find: FindTask = Arc::new(move |name: ObjectName| {
        let api: Api<Task> = Api::namespaced(client.clone(), &name.namespace);
        Box::pin(async move { api.get_opt(&name.name).await.ok().flatten() })
    });
    Ok(crate::log_endpoint::respond(
        access.logs.clone(),
        find,
        ObjectName::new(&namespace, &name),
        params,
    )
    .await)
}

/// The user `token` belongs to, as the API server's TokenReview says.
async fn authenticate(client: &kube::Client, token: &str) -> Result<UserInfo, Refused> {
    let review = TokenReview {
        spec: TokenReviewSpec {
            token: Some(token.to_owned()),
            audiences: None,
        },
        ..TokenReview::default()
    };
    let reviewed = Api::<TokenReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .map_err(|e| {
            warn!(%e, "log endpoint: the TokenReview failed");
            Refused(
                StatusCode::SERVICE_UNAVAILABLE,
                "the API server could not review the token; try again".into(),
            )
        })?;
    let status = reviewed.status.unwrap_or_default();
    match (status.authenticated, status.user) {
        (Some(true), Some(user)) => Ok(user),
        _ => Err(Refused(
            StatusCode::UNAUTHORIZED,
            "the API server does not accept this token".into(),
        )),
    }
}

/// Whether `user` may `get` the `log` subresource of Task `namespace/name`.
async fn authorize(
    client: &kube::Client,
    user: &UserInfo,
    namespace: &str,
    name: &str,
) -> Result<(), Refused> {
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: user.username.clone(),
            groups: user.groups.clone(),
            uid: user.uid.clone(),
            extra: user.extra.clone(),
            resource_attributes: Some(ResourceAttributes {
                group: Some(GROUP.to_owned()),
                resource: Some("tasks".to_owned()),
                subresource: Some("log".to_owned()),
                verb: Some("get".to_owned()),
                namespace: Some(namespace.to_owned()),
                name: Some(name.to_owned()),
                ..ResourceAttributes::default()
            }),
            ..SubjectAccessReviewSpec::default()
        },
        ..SubjectAccessReview::default()
    };
    let reviewed = Api::<SubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .map_err(|e| {
            warn!(%e, "log endpoint: the SubjectAccessReview failed");
            Refused(
                StatusCode::SERVICE_UNAVAILABLE,
                "the API server could not review the permission; try again".into(),
            )
        })?;
    let who = user.username.clone().unwrap_or_default();
    match reviewed.status {
        Some(status) if status.allowed => Ok(()),
        _ => Err(Refused(
            StatusCode::FORBIDDEN,
            format!(
                "{who} may not get tasks/log of {namespace}/{name} (grant the verb get on the resource tasks/log of {GROUP})"
            ),
        )),
    }
}
