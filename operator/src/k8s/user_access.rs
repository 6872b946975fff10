//! Who a caller of propeller's HTTPS endpoints on a cluster is, and what they may do, as the
//! API server says: the way the kubelet checks callers of its endpoints. The caller's bearer
//! token goes through a TokenReview; the user it names through a SubjectAccessReview for
//! each resource asked for. No token: 401; a token the API server does not accept (or an
//! anonymous user): 401; a user without the permission: 403. Answers are kept briefly, keyed
//! by the token's SHA-256 (never the token), so a live page does not cost two reviews per
//! request.
//!
//! Changes go through a client that presents the caller's own token: the API server decides
//! and its refusal is passed on word for word.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, UserInfo};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, warn};

use crate::state::lock;

/// The API group of propeller's resources, as a SubjectAccessReview names it.
pub const GROUP: &str = "propeller.propeller.absmach.eu";
/// How long an accepted token's user is remembered.
const USER_TTL: Duration = Duration::from_secs(30);
/// How long a permission decision is remembered.
const DECISION_TTL: Duration = Duration::from_secs(10);
/// Entries kept at most in each memory; it is emptied when full.
const MEMORY_LIMIT: usize = 10_000;

/// Why a request was refused, answered as JSON `{"error": message}`.
#[derive(Debug)]
pub struct Refused(pub StatusCode, pub String);

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        (self.0, axum::Json(serde_json::json!({ "error": self.1 }))).into_response()
    }
}

impl Refused {
    /// The API server's own refusal of a request made with the caller's token.
    pub fn from_api(e: kube::Error) -> Self {
        match e {
            kube::Error::Api(status) => Refused(
                StatusCode::from_u16(status.code).unwrap_or(StatusCode::BAD_GATEWAY),
                status.message,
            ),
            other => {
                warn!(%other, "a request to the API server failed");
                Refused(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("the API server could not be asked: {other}; try again"),
                )
            }
        }
    }
}

/// What is asked for: a verb on a resource (of propeller's group unless `group` says).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Permission {
    /// `get`, `list`, `watch`, …
    pub verb: &'static str,
    /// The API group ("" for the core group).
    pub group: String,
    /// The resource's plural name, e.g. `tasks`.
    pub resource: String,
    /// A subresource, e.g. `log`.
    pub subresource: Option<&'static str>,
    /// The namespace; none for every namespace.
    pub namespace: Option<String>,
    /// One object's name.
    pub name: Option<String>,
}

impl Permission {
    fn describe(&self) -> String {
        let resource = match self.subresource {
            Some(sub) => format!("{}/{sub}", self.resource),
            None => self.resource.clone(),
        };
        let group = if self.group.is_empty() {
            "the core group".to_owned()
        } else {
            self.group.clone()
        };
        let scope = match (&self.namespace, &self.name) {
            (Some(ns), Some(name)) => format!(" {ns}/{name}"),
            (Some(ns), None) => format!(" in namespace {ns}"),
            (None, _) => " in every namespace".to_owned(),
        };
        format!(
            "{} {resource}{scope} (grant the verb {} on {resource} of {group})",
            self.verb, self.verb
        )
    }
}

type TokenDigest = [u8; 32];

/// Answers kept for a while, at most [`MEMORY_LIMIT`] of them (emptied when full).
struct Recent<K, V> {
    ttl: Duration,
    entries: Mutex<HashMap<K, (V, Instant)>>,
}

impl<K: std::hash::Hash + Eq, V: Clone> Recent<K, V> {
    fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            entries: Mutex::default(),
        }
    }

    /// The answer kept for `key`, if it is younger than the time to keep it.
    fn get(&self, key: &K) -> Option<V> {
        lock(&self.entries)
            .get(key)
            .filter(|(_, at)| at.elapsed() < self.ttl)
            .map(|(value, _)| value.clone())
    }

    fn keep(&self, key: K, value: V) {
        let mut entries = lock(&self.entries);
        if entries.len() >= MEMORY_LIMIT {
            entries.clear();
        }
        entries.insert(key, (value, Instant::now()));
    }
}

/// Checks callers with the API server, remembering answers briefly.
#[derive(Clone)]
pub struct UserAccess {
    /// Propeller's own client: makes the reviews.
    client: kube::Client,
    /// How to reach the API server, for clients that present a caller's token.
    config: Option<kube::Config>,
    users: Arc<Recent<TokenDigest, UserInfo>>,
    decisions: Arc<Recent<(String, Permission), ()>>,
}

impl UserAccess {
    /// Checks with `client`; `config` (the API server's address and CA) makes the callers'
    /// clients for changes, which are refused when it is absent.
    pub fn new(client: kube::Client, config: Option<kube::Config>) -> Self {
        Self {
            client,
            config,
            users: Arc::new(Recent::new(USER_TTL)),
            decisions: Arc::new(Recent::new(DECISION_TTL)),
        }
    }

    /// Propeller's own client.
    pub fn client(&self) -> &kube::Client {
        &self.client
    }

    /// The bearer token of a request.
    pub fn bearer(headers: &HeaderMap) -> Result<&str, Refused> {
        headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                Refused(
                    StatusCode::UNAUTHORIZED,
                    "a bearer token is required (for example `kubectl create token NAME`)".into(),
                )
            })
    }

    /// The user a request's token belongs to, as a TokenReview says.
    pub async fn user(&self, headers: &HeaderMap) -> Result<UserInfo, Refused> {
        let token = Self::bearer(headers)?;
        let digest: TokenDigest = Sha256::digest(token.as_bytes()).into();
        if let Some(user) = self.users.get(&digest) {
            return Ok(user);
        }
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_owned()),
                audiences: None,
            },
            ..TokenReview::default()
        };
        let reviewed = Api::<TokenReview>::all(self.client.clone())
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| {
                warn!(%e, "the TokenReview failed");
                Refused(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the API server could not review the token; try again".into(),
                )
            })?;
        let status = reviewed.status.unwrap_or_default();
        let user = match (status.authenticated, status.user) {
            (Some(true), Some(user)) if user.username.as_deref() != Some("system:anonymous") => {
                user
            }
            _ => {
                return Err(Refused(
                    StatusCode::UNAUTHORIZED,
                    "the API server does not accept this token".into(),
                ))
            }
        };
        self.users.keep(digest, user.clone());
        Ok(user)
    }

    /// Whether `user` has `permission`, as a SubjectAccessReview says.
    pub async fn allow(&self, user: &UserInfo, permission: Permission) -> Result<(), Refused> {
        let who = user.username.clone().unwrap_or_default();
        let key = (who.clone(), permission);
        if self.decisions.get(&key).is_some() {
            return Ok(());
        }
        let permission = &key.1;
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username.clone(),
                groups: user.groups.clone(),
                uid: user.uid.clone(),
                extra: user.extra.clone(),
                resource_attributes: Some(ResourceAttributes {
                    group: Some(permission.group.clone()),
                    resource: Some(permission.resource.clone()),
                    subresource: permission.subresource.map(str::to_owned),
                    verb: Some(permission.verb.to_owned()),
                    namespace: permission.namespace.clone(),
                    name: permission.name.clone(),
                    ..ResourceAttributes::default()
                }),
                ..SubjectAccessReviewSpec::default()
            },
            ..SubjectAccessReview::default()
        };
        let reviewed = Api::<SubjectAccessReview>::all(self.client.clone())
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| {
                warn!(%e, "the SubjectAccessReview failed");
                Refused(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the API server could not review the permission; try again".into(),
                )
            })?;
        if !reviewed.status.is_some_and(|s| s.allowed) {
            return Err(Refused(
                StatusCode::FORBIDDEN,
                format!("{who} may not {}", permission.describe()),
            ));
        }
        self.decisions.keep(key, ());
        Ok(())
    }

    /// A client that presents the request's own token, for changes the API server authorises.
    pub fn client_as(&self, headers: &HeaderMap) -> Result<kube::Client, Refused> {
        let token = Self::bearer(headers)?;
        let mut config = self.config.clone().ok_or_else(|| {
            Refused(
                StatusCode::NOT_IMPLEMENTED,
                "this endpoint makes no changes".into(),
            )
        })?;
        config.auth_info = kube::config::AuthInfo {
            token: Some(token.to_owned().into()),
            ..kube::config::AuthInfo::default()
        };
        kube::Client::try_from(config).map_err(|e| {
            Refused(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("cannot make a client for the request: {e}"),
            )
        })
    }
}

/// Serves `app` over TLS on `listener` until the task is dropped; `what` names the endpoint
/// in logs.
pub async fn serve_https(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    app: Router,
    what: &'static str,
) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                warn!(%e, what, "cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (acceptor, app) = (acceptor.clone(), app.clone());
        tokio::spawn(async move {
            let tls = match acceptor.accept(stream).await {
                Ok(tls) => tls,
                Err(e) => {
                    debug!(%peer, %e, what, "TLS handshake failed");
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
                debug!(%peer, %e, what, "connection ended");
            }
        });
    }
}
