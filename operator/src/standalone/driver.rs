//! The standalone driver: the same controllers as on Kubernetes (`crate::controller`), run by
//! kube-runtime's `Controller`s over the embedded store.
//!
//! Each kind has a `Controller` built with `Controller::for_stream` on the [`ObjectCache`]'s
//! reflector store, so queueing, de-duplication, never two reconciles of one object at once,
//! requeue timers and bounded concurrency are kube-runtime's, as in Kubernetes mode. What
//! wakes a reconcile comes from three places: store changes (with their related objects: a
//! task's owner, dependents and proplet), broker events (recorded in the driver state first;
//! the MQTT side never writes the store), and the requeue times the plans ask for, plus a
//! periodic sweep of proplets.

use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use propeller_broker::server::{BrokerEvent, CredentialStore, Publisher};
use tokio::sync::mpsc::UnboundedReceiver;
use tracing::{info, warn};

use crate::controller::kinds::{for_each_kind, wake_queues, KindVisitor, WakeQueues, Wakers};
use crate::controller::{Common, ObjectName, Reconciled, Wake, CREDENTIAL_TICK};
use crate::decision::proplet::PropletSettings;
use crate::decision::task::TaskSettings;
use crate::metrics::ControllerMetrics;
use crate::oci::Images;

use super::cache::ObjectCache;
use super::events::EventLog;
use super::store::{ObjectStore, StoreError};

mod cluster;
mod reconcile;
mod routing;

use crate::own_writes::OwnWrites;
use crate::standalone::kinds::PROPLET;
use crate::task_logs::{LogSettings, LogStore};

/// Secrets are watched here, so the table only needs an age limit as a safety net.
const CREDENTIAL_MAX_AGE: Duration = Duration::from_secs(300);

/// Settings of the standalone driver.
#[derive(Debug, Clone)]
pub struct StandaloneSettings {
    /// Proplet plan settings.
    pub proplet: PropletSettings,
    /// Task plan settings.
    pub task: TaskSettings,
    /// How often every proplet is looked at without events.
    pub sweep: Duration,
    /// How much task output is kept.
    pub logs: LogSettings,
}

/// The standalone reconcilers and their shared state.
pub struct Driver {
    store: ObjectStore,
    /// What both drivers hold alike: driver state, publisher, plan settings, counters, images.
    common: Common,
    /// How often every proplet is looked at without events.
    sweep: Duration,
    credentials: Arc<CredentialStore>,
    wakers: Wakers,
    events: Arc<EventLog>,
    cache: Arc<ObjectCache>,
    /// The cache's credential epoch and the time of the last rebuild.
    /// A Secret changed since the last credential rebuild.
    secrets_changed: AtomicBool,
    /// The latest version each Proplet's reconcile wrote itself. Its change is not a reason
    /// to reconcile again: the Proplet plan already asked for its next look (the offline
    /// check, a deferred flush). Task plans still rely on seeing their own writes (the time
    /// limit is planned from the written start), so Tasks are not recorded.
    proplet_writes: OwnWrites<()>,
}

impl Driver {
    /// A driver over `store`, publishing through `publisher`; the returned queues are for
    /// [`Driver::run`]. Fails if the store cannot be read.
    pub fn new(
        store: ObjectStore,
        publisher: Publisher,
        settings: StandaloneSettings,
        credentials: Arc<CredentialStore>,
        metrics: Arc<ControllerMetrics>,
        events: Arc<EventLog>,
    ) -> Result<(Arc<Self>, WakeQueues), StoreError> {
        let (wakers, queues) = wake_queues();
        let cache = ObjectCache::attach(&store)?;
        let driver = Arc::new(Self {
            store,
            common: Common {
                logs: Arc::new(LogStore::new(settings.logs)),
                ..Common::new(publisher, settings.proplet, settings.task, metrics)
            },
            sweep: settings.sweep,
            credentials,
            wakers,
            events,
            cache,
            secrets_changed: AtomicBool::new(false),
            proplet_writes: OwnWrites::default(),
        });
        let _ = driver.common.logins.set(driver.credentials.clone());
        Ok((driver, queues))
    }

    /// Serves OCI images to devices and resolves Tasks' `imageUrl`s with `images`; a
    /// finished resolution queues its Task.
    pub fn attach_images(self: &Arc<Self>, images: Arc<Images>) {
        let driver = Arc::downgrade(self);
        images.on_resolved(move |uid| {
            if let Some(driver) = driver.upgrade() {
                crate::controller::routing::wake_task_by_uid(&*driver, uid);
            }
        });
        let _ = self.common.images.set(images);
    }

    /// Answers devices' enrolment requests with the bootstrap tokens kept in
    /// `token_namespace`; before [`Driver::run`], so the first credential table has them.
    pub fn attach_enrolments(self: &Arc<Self>, token_namespace: String) {
        let enrolments = crate::enrolment::start(self, token_namespace);
        let _ = self.common.enrolments.set(enrolments);
    }

    /// The store the driver writes.
    pub fn store(&self) -> &ObjectStore {
        &self.store
    }

    /// Asks for `wake`'s reconcile (once, however often it is asked before it runs).
    pub fn wake(&self, wake: Wake) {
        // A closed queue means the controllers stopped: nothing to wake.
        self.wakers.send(wake);
    }

    /// Sets the per-phase gauges of Proplets and Tasks from the cache (on each scrape).
    pub fn count_phases(&self) {
        let view = self.cache.view();
        self.common.count_phases(view.proplets(), view.tasks());
    }

    /// Runs the reconcilers until `shutdown` resolves, then lets the ones in flight finish.
    pub async fn run(
        self: Arc<Self>,
        queues: WakeQueues,
        mut events: UnboundedReceiver<BrokerEvent>,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        self.refresh_credentials(true);
        let shutdown = shutdown.shared();
        let controllers = tokio::spawn(reconcile::controllers(
            self.clone(),
            queues,
            shutdown.clone(),
        ));
        let mut changes = self.store.subscribe();
        let mut credential_tick = tokio::time::interval(CREDENTIAL_TICK);
        let mut shutdown = std::pin::pin!(shutdown);
        info!("standalone reconcilers running");
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                Some(event) = events.recv() => self.route_event(&event),
                change = changes.recv() => match change {
                    Ok(change) => {
                        let name = ObjectName::new(&change.namespace, &change.name);
                        let wake = Wake::named(&change.kind, name);
                        self.related(&wake);
                        let own = wake.kind == PROPLET
                            && self
                                .proplet_writes
                                .is_own(&wake.name, &change.resource_version.to_string());
                        if !own {
                            self.wake(wake);
                        }
                    }
                    // Missed changes: look at everything again.
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                        self.wake_everything()
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                },
                _ = credential_tick.tick() => {
                    self.common.wake_held(&*self);
                    self.common
                        .state
                        .inbox
                        .prune_unknown_reports(|uid| self.cache.task_by_uid(uid).is_some());
                    let secrets = self
                        .secrets_changed
                        .swap(false, AtomicOrdering::Relaxed);
                    self.refresh_credentials(secrets);
                }
            }
        }
        if let Err(e) = controllers.await {
            warn!(error = %e, "the controllers ended abnormally");
        }
        info!("standalone reconcilers stopped");
    }

    /// Wakes every cached object of every kind.
    fn wake_everything(&self) {
        struct Everything<'a>(&'a Driver);
        impl KindVisitor for Everything<'_> {
            fn visit<K: Reconciled>(&mut self) {
                for object in self.0.cache.store::<K>().state() {
                    self.0.wake(Wake::of::<K>(ObjectName::of(&*object)));
                }
            }
        }
        for_each_kind(&mut Everything(self));
    }
}
