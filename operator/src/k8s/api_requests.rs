//! Counts propeller's requests to the API server, by verb, resource and answer, with a tower
//! layer under kube's `Client`: what the `propeller_apiserver_requests_total` meter shows
//! (the write rate a busy fleet puts on the API server, and its refusals).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{Method, Request, Response};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tower::{BoxError, Layer, Service};

use crate::metrics::ApiRequestLabels;

/// The layer: wraps the client's service in [`CountedService`].
#[derive(Clone)]
pub struct ApiRequestsLayer {
    requests: Family<ApiRequestLabels, Counter>,
}

impl ApiRequestsLayer {
    /// Counts into `requests` (see [`crate::metrics::ControllerMetrics::api_requests`]).
    pub fn new(requests: Family<ApiRequestLabels, Counter>) -> Self {
        Self { requests }
    }
}

impl<S> Layer<S> for ApiRequestsLayer {
    type Service = CountedService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        CountedService {
            inner,
            requests: self.requests.clone(),
        }
    }
}

/// The client's service, counted.
#[derive(Clone)]
pub struct CountedService<S> {
    inner: S,
    requests: Family<ApiRequestLabels, Counter>,
}

/// The verb of a request as the API server's audit log names it.
fn verb(method: &Method, query: Option<&str>) -> &'static str {
    let watching = query.is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"));
    match *method {
        Method::GET if watching => "watch",
        Method::GET => "get",
        Method::POST => "create",
        Method::PUT => "update",
        Method::PATCH => "patch",
        Method::DELETE => "delete",
        _ => "other",
    }
}

/// The resource a request path names: `tasks`, `tasks/status`, `leases`, `events`, …
fn resource(path: &str) -> String {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    // /api/v1/... or /apis/GROUP/VERSION/...
    let rest = match parts.first() {
        Some(&"api") => parts.get(2..),
        Some(&"apis") => parts.get(3..),
        _ => None,
    }
    .unwrap_or_default();
    let rest = match rest {
        ["namespaces", _, tail @ ..] if !tail.is_empty() => tail,
        other => other,
    };
    match rest {
        [] => "discovery".to_owned(),
        [kind] | [kind, _] => (*kind).to_owned(),
        [kind, _, sub, ..] => format!("{kind}/{sub}"),
    }
}

type BoxedResponse<R> = Pin<Box<dyn Future<Output = Result<R, BoxError>> + Send>>;

impl<S, B, R> Service<Request<B>> for CountedService<S>
where
    S: Service<Request<B>, Response = Response<R>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = Response<R>;
    type Error = BoxError;
    type Future = BoxedResponse<Response<R>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let uri = request.uri();
        let verb = verb(request.method(), uri.query());
        let resource = resource(uri.path());
        let requests = self.requests.clone();
        let response = self.inner.call(request);
        Box::pin(async move {
            let answered = response.await.map_err(Into::into);
            let code = match &answered {
                Ok(response) => response.status().as_u16().to_string(),
                Err(_) => "error".to_owned(),
            };
            requests
                .get_or_create(&ApiRequestLabels {
                    verb: verb.to_owned(),
                    resource,
                    code,
                })
                .inc();
            answered
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_name_their_resource_and_subresource() {
        for (path, expected) in [
            (
                "/apis/propeller.propeller.absmach.eu/v1/namespaces/a/tasks/add/status",
                "tasks/status",
            ),
            (
                "/apis/propeller.propeller.absmach.eu/v1/namespaces/a/tasks/add",
                "tasks",
            ),
            (
                "/apis/propeller.propeller.absmach.eu/v1/proplets",
                "proplets",
            ),
            ("/api/v1/namespaces/a/events", "events"),
            ("/api/v1/namespaces/a", "namespaces"),
            (
                "/apis/coordination.k8s.io/v1/namespaces/s/leases/x",
                "leases",
            ),
            ("/version", "discovery"),
        ] {
            assert_eq!(resource(path), expected, "{path}");
        }
    }

    #[test]
    fn a_get_with_watch_is_a_watch() {
        assert_eq!(verb(&Method::GET, Some("watch=true&rv=1")), "watch");
        assert_eq!(verb(&Method::GET, Some("limit=5")), "get");
        assert_eq!(verb(&Method::PATCH, None), "patch");
    }
}
