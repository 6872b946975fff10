//! A kube-runtime `Controller` for every kind ([`for_each_kind`]) over the [`ObjectCache`]'s
//! reflector stores, calling the shared reconcile and error policy
//! (`crate::controller::runner`).
//!
//! [`ObjectCache`]: crate::standalone::cache::ObjectCache

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{FutureExt as _, StreamExt as _};
use kube::runtime::controller::Controller;

use crate::controller::kinds::{for_each_kind, KindVisitor, Reconciled, WakeQueues};
use crate::controller::runner::{drive, error_policy, reconcile};

use super::Driver;

/// Once at start (everything stored is looked at after a restart), then every `every`.
fn start_then_every(every: Option<Duration>) -> impl futures::Stream<Item = ()> + Send + 'static {
    let ticks = futures::stream::unfold(every, |every| async move {
        let every = every?;
        tokio::time::sleep(every).await;
        Some(((), Some(every)))
    });
    futures::stream::once(async {}).chain(ticks)
}

/// Builds and starts each kind's `Controller` (a [`KindVisitor`]).
struct Controllers<S> {
    driver: Arc<Driver>,
    queues: WakeQueues,
    shutdown: S,
    running: Vec<BoxFuture<'static, ()>>,
}

impl<S> KindVisitor for Controllers<S>
where
    S: std::future::Future<Output = ()> + Clone + Send + Sync + 'static,
{
    fn visit<K: Reconciled>(&mut self) {
        // Wakes are the only trigger besides the requeues and the sweep: store changes reach
        // them through the driver's routing (which leaves out its own Proplet writes).
        let sweep = K::SWEPT.then(|| self.driver.sweep.max(Duration::from_secs(1)));
        let stream =
            Controller::for_stream(futures::stream::empty(), self.driver.cache.store::<K>())
                .with_config(crate::controller::controller_config::<Driver>())
                .reconcile_on(self.queues.take::<K>())
                .reconcile_all_on(start_then_every(sweep))
                .graceful_shutdown_on(self.shutdown.clone())
                .run(reconcile::<K, Driver>, error_policy, self.driver.clone());
        let kind = K::kind(&()).into_owned();
        self.running
            .push(async move { drive(stream, &kind).await }.boxed());
    }
}

/// Runs every kind's `Controller` until `shutdown` resolves and their reconciles in flight
/// end.
pub(super) async fn controllers(
    driver: Arc<Driver>,
    queues: WakeQueues,
    shutdown: impl std::future::Future<Output = ()> + Clone + Send + Sync + 'static,
) {
    let mut controllers = Controllers {
        driver,
        queues,
        shutdown,
        running: Vec::new(),
    };
    for_each_kind(&mut controllers);
    futures::future::join_all(controllers.running).await;
}
