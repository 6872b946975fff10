//! The fence on a sharded replica's API client: a tower layer under kube's `Client` that
//! refuses every write (any method but GET) while the replica's membership is lapsed, so a
//! replica that was paused or cut off past its renewal limit cannot write after another
//! replica may have taken its objects, whatever reconcile was in flight. It also names the
//! replica in the User-Agent, which the API server records as the field manager of every
//! write, so each object shows which replica wrote it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use http::header::{HeaderValue, USER_AGENT};
use http::{Method, Request, Response};
use tower::{BoxError, Layer, Service};

use crate::controller::ownership::Ownership;

/// A write refused because this replica is fenced.
#[derive(Debug, thiserror::Error)]
#[error("this replica's membership Lease was not renewed in time: writes wait until it is")]
pub struct Fenced;

/// The layer: wraps the client's service in [`FencedService`].
#[derive(Clone)]
pub struct FenceLayer {
    shard: Arc<Ownership>,
    agent: HeaderValue,
}

impl FenceLayer {
    /// A fence following `shard`'s membership; the User-Agent names the member.
    pub fn new(shard: Arc<Ownership>) -> Self {
        let agent = HeaderValue::from_str(&format!("propeller@{}", shard.me()))
            .unwrap_or_else(|_| HeaderValue::from_static("propeller"));
        Self { shard, agent }
    }
}

impl<S> Layer<S> for FenceLayer {
    type Service = FencedService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        FencedService {
            inner,
            shard: self.shard.clone(),
            agent: self.agent.clone(),
        }
    }
}

/// The client's service behind the fence.
#[derive(Clone)]
pub struct FencedService<S> {
    inner: S,
    shard: Arc<Ownership>,
    agent: HeaderValue,
}

type BoxedResponse<R> = Pin<Box<dyn Future<Output = Result<R, BoxError>> + Send>>;

impl<S, B, R> Service<Request<B>> for FencedService<S>
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

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        request.headers_mut().insert(USER_AGENT, self.agent.clone());
        if request.method() != Method::GET && self.shard.is_fenced(Instant::now()) {
            return Box::pin(async { Err(Box::new(Fenced) as BoxError) });
        }
        let response = self.inner.call(request);
        Box::pin(async move { response.await.map_err(Into::into) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tower::ServiceExt;

    async fn send(shard: &Arc<Ownership>, method: Method) -> Result<String, BoxError> {
        let (service, mut handle) = tower_test::mock::pair::<Request<String>, Response<String>>();
        let service = FenceLayer::new(shard.clone()).layer(service);
        let request = Request::builder()
            .method(method)
            .uri("/apis/x")
            .body(String::new())
            .unwrap_or_else(|e| panic!("{e}"));
        let answer = tokio::spawn(async move {
            if let Some((request, reply)) = handle.next_request().await {
                let agent = request
                    .headers()
                    .get(USER_AGENT)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                reply.send_response(Response::new(agent));
            }
        });
        let result = service.oneshot(request).await.map(Response::into_body);
        answer.abort();
        result
    }

    #[tokio::test]
    async fn a_fenced_replica_reads_but_cannot_write_and_every_request_names_it() {
        let shard = Arc::new(Ownership::new(
            "propeller-1",
            Duration::from_secs(15),
            propeller_core::shard::ShardBy::Object,
        ));
        // Never renewed: fenced.
        assert!(send(&shard, Method::GET).await.is_ok());
        let refused = send(&shard, Method::PATCH)
            .await
            .err()
            .unwrap_or_else(|| panic!("a fenced PATCH went through"));
        assert!(
            refused.to_string().contains("not renewed in time"),
            "{refused}"
        );
        shard.renewed(Instant::now()).await;
        let agent = send(&shard, Method::PATCH)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(agent, "propeller@propeller-1");
    }
}
