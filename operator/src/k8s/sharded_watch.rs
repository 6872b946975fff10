//! Watches of this replica's namespaces only, filtered by the API server (`--sharded-watches`:
//! sharded list and watch, KEP-5866, Kubernetes 1.36+ with the `ShardedListAndWatch` feature
//! gate).
//!
//! kube's watcher has no parameter for the API server's `shardSelector`, so the selector is
//! added to the list and watch requests by a tower layer ([`shard_selector_layer`]) under a
//! client kept for these watches. The selector follows the namespaces the replica acts on
//! (`controller::ownership`); when they change, [`sharded_watcher`] starts its watch again,
//! and the relist that follows replaces the cache with the new share's objects.

use std::sync::Arc;

use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use http::{Method, Request, Uri};
use k8s_openapi::NamespaceResourceScope;
use kube::api::Api;
use kube::client::Body;
use kube::runtime::watcher;
use kube::{Client, Resource};
use propeller_core::shard::namespaces::{selector, HashRange};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tower::util::MapRequestLayer;
use tracing::warn;

use crate::controller::ownership::Ownership;

/// Where the runtime's watches come from: the whole of each kind, or, with sharded watches,
/// this replica's namespaces only for the kinds that only their namespace's owner reads.
#[derive(Clone)]
pub struct Watches {
    client: Client,
    namespace: Option<String>,
    share: Option<(Client, Arc<Ownership>)>,
}

/// A stream of watch events, as the runtime's reflectors take them.
pub type WatchEvents<K> = BoxStream<'static, Result<watcher::Event<K>, watcher::Error>>;

impl Watches {
    /// Watches through `client` (of `namespace` only, when set); with `share`, the shares
    /// through its client (with a [`shard_selector_layer`]) following its replica's namespaces.
    pub fn new(
        client: Client,
        namespace: Option<String>,
        share: Option<(Client, Arc<Ownership>)>,
    ) -> Self {
        Self {
            client,
            namespace,
            share,
        }
    }

    /// Every object of `K`.
    pub fn whole<K>(&self, config: watcher::Config) -> WatchEvents<K>
    where
        K: Resource<Scope = NamespaceResourceScope>,
        K: Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
        K::DynamicType: Default,
    {
        watcher(self.api(&self.client), config).boxed()
    }

    /// The objects of `K` in this replica's namespaces (every one without sharded watches).
    pub fn share<K>(&self, config: watcher::Config) -> WatchEvents<K>
    where
        K: Resource<Scope = NamespaceResourceScope>,
        K: Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
        K::DynamicType: Default,
    {
        match &self.share {
            Some((client, shard)) => {
                let api = self.api::<K>(client);
                sharded_watcher(
                    move || watcher(api.clone(), config.clone()).boxed(),
                    shard.clone(),
                )
                .boxed()
            }
            None => self.whole(config),
        }
    }

    fn api<K>(&self, client: &Client) -> Api<K>
    where
        K: Resource<Scope = NamespaceResourceScope>,
        K::DynamicType: Default,
    {
        match &self.namespace {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        }
    }
}

/// The query parameter of the API server's sharded list and watch.
const SHARD_SELECTOR: &str = "shardSelector";

/// Why sharded watches cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ShardedWatchError {
    /// The API server ignored the selector.
    #[error(
        "the API server at {server} ignores shardSelector: --sharded-watches needs Kubernetes \
         1.36 or later with the feature gate ShardedListAndWatch=true on kube-apiserver; \
         turn it on there, or run without --sharded-watches"
    )]
    NotFiltered {
        /// The API server's URL.
        server: String,
    },
    /// The check itself failed.
    #[error("checking whether the API server filters by shardSelector: {0}")]
    Check(#[source] kube::Error),
}

/// Checks that the API server filters by `shardSelector`: it must refuse a malformed one as
/// an invalid shard selector (a server without the feature ignores the parameter and
/// answers). Lists at most one Lease of
/// `namespace`, which the membership already reads.
pub async fn check_api_server_filters(
    client: &Client,
    namespace: &str,
    server: &str,
) -> Result<(), ShardedWatchError> {
    let malformed = "shardRange(object.metadata.namespace, '0x0', '0x1')";
    let uri = format!(
        "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases?limit=1&{SHARD_SELECTOR}={}",
        encode(malformed)
    );
    let request = Request::builder()
        .method(Method::GET)
        .uri(uri)
        .body(Vec::new())
        .map_err(|e| ShardedWatchError::Check(kube::Error::HttpError(e)))?;
    match client.request_text(request).await {
        // 1.36.2 answers 500 for built-in kinds and 400 for custom ones, each naming it.
        Err(kube::Error::Api(status)) if status.message.contains("shard selector") => Ok(()),
        Ok(_) => Err(ShardedWatchError::NotFiltered {
            server: server.to_owned(),
        }),
        Err(e) => Err(ShardedWatchError::Check(e)),
    }
}

/// A watch started by `start` (through a client with a [`shard_selector_layer`] following
/// `shard`'s namespaces), started again whenever they change so that its relist brings the
/// new share's objects; it ends when the ranges' sender is gone.
///
/// A controller runs a reconcile only for an object its cache holds, and a relist's objects
/// reach the cache all at once when the relist is complete, after their events: so once a
/// restarted watch's relist is complete, `shard` is asked to have every object looked at
/// again ([`Ownership::look_again`]), or the new share's objects would wait for their next
/// change.
pub fn sharded_watcher<T>(
    start: impl Fn() -> WatchEvents<T> + Send + 'static,
    shard: Arc<Ownership>,
) -> impl Stream<Item = Result<watcher::Event<T>, watcher::Error>> + Send + 'static
where
    T: Send + 'static,
{
    struct State<F, T> {
        start: F,
        shard: Arc<Ownership>,
        ranges: watch::Receiver<Vec<HashRange>>,
        current: Option<WatchEvents<T>>,
        restarted: bool,
    }
    let ranges = shard.namespace_ranges();
    let state = State {
        start,
        shard,
        ranges,
        current: None,
        restarted: false,
    };
    futures::stream::unfold(state, |mut state| async move {
        loop {
            let events = match state.current.as_mut() {
                Some(events) => events,
                None => {
                    state.ranges.mark_unchanged();
                    state.current.insert((state.start)())
                }
            };
            tokio::select! {
                changed = state.ranges.changed() => {
                    changed.ok()?;
                    state.current = None;
                    state.restarted = true;
                }
                event = events.next() => {
                    let event = event?;
                    if state.restarted && matches!(event, Ok(watcher::Event::InitDone)) {
                        state.restarted = false;
                        state.shard.look_again();
                    }
                    return Some((event, state));
                }
            }
        }
    })
}

/// Adds the `shardSelector` of the current share (`share`) to every GET: the lists and
/// watches of the client it is layered under.
pub fn shard_selector_layer(
    share: watch::Receiver<Vec<HashRange>>,
) -> MapRequestLayer<impl Fn(Request<Body>) -> Request<Body> + Clone> {
    MapRequestLayer::new(move |mut request: Request<Body>| {
        add_selector(&mut request, &share.borrow());
        request
    })
}

/// Adds the selector of `share` to `request` if it is a GET.
fn add_selector<B>(request: &mut Request<B>, share: &[HashRange]) {
    if request.method() != Method::GET {
        return;
    }
    match with_selector(request.uri(), &selector(share)) {
        Ok(uri) => *request.uri_mut() = uri,
        // Not seen: the path and query come from a valid URI, the selector is form-encoded.
        Err(error) => warn!(%error, uri = %request.uri(), "cannot add the shard selector"),
    }
}

/// `uri` with `shardSelector=selector` added to its query.
fn with_selector(uri: &Uri, selector: &str) -> Result<Uri, http::Error> {
    let path = uri.path();
    let param = format!("{SHARD_SELECTOR}={}", encode(selector));
    let path_and_query = match uri.query() {
        Some(query) if !query.is_empty() => format!("{path}?{query}&{param}"),
        _ => format!("{path}?{param}"),
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(path_and_query.parse()?);
    Ok(Uri::from_parts(parts)?)
}

fn encode(text: &str) -> String {
    form_urlencoded::byte_serialize(text.as_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_selector_is_added_to_the_query() {
        let uri: Uri = "/apis/g/v1/tasks?watch=true&resourceVersion=5"
            .parse()
            .unwrap_or_else(|e| panic!("{e}"));
        let out = with_selector(&uri, "shardRange(object.metadata.namespace, '0x0', '0x1')")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            out.to_string(),
            "/apis/g/v1/tasks?watch=true&resourceVersion=5&shardSelector=\
             shardRange%28object.metadata.namespace%2C+%270x0%27%2C+%270x1%27%29"
        );
        let bare: Uri = "/apis/g/v1/tasks".parse().unwrap_or_else(|e| panic!("{e}"));
        let out = with_selector(&bare, "x").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(out.to_string(), "/apis/g/v1/tasks?shardSelector=x");
    }

    #[test]
    fn reads_carry_the_current_share_and_writes_do_not() {
        let request = |method: Method| {
            Request::builder()
                .method(method)
                .uri("/apis/g/v1/tasks?watch=true")
                .body(())
                .unwrap_or_else(|e| panic!("{e}"))
        };
        let mut nothing = request(Method::GET);
        add_selector(&mut nothing, &[]);
        let nothing = nothing.uri().to_string();
        assert!(nothing.contains("%270xffffffffffffffff%27"), "{nothing}");
        let half = [HashRange {
            start: 0,
            end: 1 << 63,
        }];
        let mut read = request(Method::GET);
        add_selector(&mut read, &half);
        let read = read.uri().to_string();
        assert!(
            read.ends_with("%270x0000000000000000%27%2C+%270x8000000000000000%27%29"),
            "{read}"
        );
        let mut write = request(Method::PATCH);
        add_selector(&mut write, &half);
        assert_eq!(write.uri().to_string(), "/apis/g/v1/tasks?watch=true");
    }
}
