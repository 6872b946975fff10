//! A kube-runtime `Controller` for every kind ([`for_each_kind`]) on the API server's
//! watches: Proplets and Tasks on the watches `run` prepared for them (with their indexes,
//! Deployments and Jobs), every other kind on a plain watch of its own.

use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::{FutureExt as _, StreamExt as _};
use kube::runtime::controller::Controller;
use kube::runtime::reflector;
use kube::runtime::{watcher, WatchStreamExt};
use kube::Resource;

use crate::controller::kinds::{KindVisitor, Reconciled, WakeQueues, Wakers};
use crate::controller::ownership::Ownership;
use crate::controller::runner::{drive, error_policy, reconcile};
use crate::k8s::sharded_watch::Watches;

use super::shared::Shared;
use super::{bounded, RESYNC};

/// The `Controller`s `run` built itself, by kind, taken by [`Controllers`] in their turn.
#[derive(Default)]
pub(super) struct Prepared(HashMap<String, Box<dyn Any + Send>>);

impl Prepared {
    /// Keeps `controller` for its kind.
    pub(super) fn add<K: Reconciled>(&mut self, controller: Controller<K>) {
        self.0
            .insert(K::kind(&()).into_owned(), Box::new(controller));
    }

    fn take<K: Reconciled>(&mut self) -> Option<Controller<K>> {
        let prepared = self.0.remove(K::kind(&()).as_ref())?;
        prepared.downcast::<Controller<K>>().ok().map(|c| *c)
    }
}

/// Builds and starts each kind's `Controller` (a [`KindVisitor`]).
pub(super) struct Controllers<'a, S> {
    pub(super) watches: &'a Watches,
    pub(super) prepared: Prepared,
    pub(super) queues: &'a mut WakeQueues,
    pub(super) wakers: &'a Wakers,
    pub(super) shard: Option<&'a Arc<Ownership>>,
    pub(super) shared: Arc<Shared>,
    pub(super) shutdown: S,
    /// The controllers' streams, each run to its end.
    pub(super) running: Vec<BoxFuture<'static, ()>>,
}

impl<S> KindVisitor for Controllers<'_, S>
where
    S: std::future::Future<Output = ()> + Send + Sync + Clone + 'static,
{
    fn visit<K: Reconciled>(&mut self) {
        let controller = self
            .prepared
            .take::<K>()
            .unwrap_or_else(|| controller_of::<K>(self.watches, self.wakers.clone()));
        let controller = reshuffled(controller, self.shard).reconcile_on(self.queues.take::<K>());
        // Such a kind is reconciled whole at the slow resync too: a safety net, not the way
        // its liveness is kept.
        let controller = if K::SWEPT {
            controller.reconcile_all_on(every(RESYNC))
        } else {
            controller
        };
        let stream = controller.graceful_shutdown_on(self.shutdown.clone()).run(
            reconcile::<K, Shared>,
            error_policy,
            self.shared.clone(),
        );
        let kind = K::kind(&()).into_owned();
        self.running
            .push(async move { drive(stream, &kind).await }.boxed());
    }
}

/// A tick every `period`, the first after one period.
fn every(period: std::time::Duration) -> impl futures::Stream<Item = ()> + Send + 'static {
    futures::stream::unfold(tokio::time::interval(period), |mut tick| async move {
        tick.tick().await;
        Some(((), tick))
    })
    .skip(1)
}

/// `controller`, also looking at every object again whenever this replica's share may have
/// grown (a view change, a previous owner letting go).
fn reshuffled<K: Reconciled>(
    controller: Controller<K>,
    shard: Option<&Arc<Ownership>>,
) -> Controller<K> {
    match shard {
        Some(shard) => controller.reconcile_all_on(shard.reshuffles()),
        None => controller,
    }
}

/// A controller of `K` on its share's watch, with its own cache; each change wakes the
/// changed object's owners once the cache shows it.
pub(super) fn controller_of<K: Reconciled>(watches: &Watches, wakers: Wakers) -> Controller<K> {
    let (reader, writer) = reflector::store::<K>();
    let events = reflector::reflector(writer, watches.share::<K>(watcher::Config::default()))
        .inspect(move |event| {
            if let Ok(event) = event {
                wake_owners(&wakers, event);
            }
        })
        .applied_objects();
    Controller::for_stream(events, reader).with_config(bounded())
}

/// Wakes the owners of the objects a watch event applied or deleted.
pub(super) fn wake_owners<K: Resource>(wakers: &Wakers, event: &watcher::Event<K>) {
    match event {
        watcher::Event::Apply(object)
        | watcher::Event::InitApply(object)
        | watcher::Event::Delete(object) => wakers.wake_owners(object.meta()),
        watcher::Event::Init | watcher::Event::InitDone => {}
    }
}
