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
use std::time::{Duration, Instant};

use futures::FutureExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::reflector::ObjectRef;
use propeller_broker::server::{BrokerEvent, CredentialStore, Publisher};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tracing::{info, warn};

use crate::controller::Common;
use crate::crd::federated::{FederatedJob, TrainingRound};
use crate::crd::job::PropellerJob;
use crate::crd::proplet::Proplet;
use crate::crd::task::Task;
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
mod writer;

use routing::LoadWakes;
use writer::*;

use super::kinds::{FEDERATED_JOB, PROPELLER_JOB, PROPLET, TASK, TRAINING_ROUND};
/// Kind name of ConfigMaps (aggregated models).
pub const CONFIG_MAP: &str = "ConfigMap";

/// Secrets are watched here, so the table only needs an age limit as a safety net.
const CREDENTIAL_MAX_AGE: Duration = Duration::from_secs(300);

/// How often Proplet and Secret changes are folded into the broker's credential table. A
/// new Proplet's device can log in at most this long after the Proplet is stored. Proplet
/// wake-ups held back by [`LoadWakes`] are sent on the same tick.
const CREDENTIAL_TICK: Duration = Duration::from_millis(100);

/// Reconciles of one kind in flight at once. They mostly wait for the store's group commit,
/// so several share each `fsync`.
pub const MAX_CONCURRENT_RECONCILES: u16 = 64;

/// Settings of the standalone driver.
#[derive(Debug, Clone)]
pub struct StandaloneSettings {
    /// Proplet plan settings.
    pub proplet: PropletSettings,
    /// Task plan settings.
    pub task: TaskSettings,
    /// How often every proplet is looked at without events.
    pub sweep: Duration,
}

/// One object to reconcile.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    /// Kind.
    pub kind: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl Key {
    fn new(kind: &str, namespace: &str, name: &str) -> Self {
        Self {
            kind: kind.to_owned(),
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        }
    }

    fn of(kind: &str, meta: &ObjectMeta) -> Self {
        Self::new(
            kind,
            meta.namespace.as_deref().unwrap_or("default"),
            meta.name.as_deref().unwrap_or_default(),
        )
    }
}

/// Where wakes go: one `Controller` per kind.
struct WakeSenders {
    proplets: UnboundedSender<ObjectRef<Proplet>>,
    tasks: UnboundedSender<ObjectRef<Task>>,
    propeller_jobs: UnboundedSender<ObjectRef<PropellerJob>>,
    federated_jobs: UnboundedSender<ObjectRef<FederatedJob>>,
    training_rounds: UnboundedSender<ObjectRef<TrainingRound>>,
}

/// The receiving ends of the wakes, which [`Driver::run`] hands to the `Controller`s.
pub struct Wakes {
    proplets: UnboundedReceiver<ObjectRef<Proplet>>,
    tasks: UnboundedReceiver<ObjectRef<Task>>,
    propeller_jobs: UnboundedReceiver<ObjectRef<PropellerJob>>,
    federated_jobs: UnboundedReceiver<ObjectRef<FederatedJob>>,
    training_rounds: UnboundedReceiver<ObjectRef<TrainingRound>>,
}

fn wake_channels() -> (WakeSenders, Wakes) {
    let (proplets, proplets_rx) = unbounded_channel();
    let (tasks, tasks_rx) = unbounded_channel();
    let (propeller_jobs, propeller_jobs_rx) = unbounded_channel();
    let (federated_jobs, federated_jobs_rx) = unbounded_channel();
    let (training_rounds, training_rounds_rx) = unbounded_channel();
    (
        WakeSenders {
            proplets,
            tasks,
            propeller_jobs,
            federated_jobs,
            training_rounds,
        },
        Wakes {
            proplets: proplets_rx,
            tasks: tasks_rx,
            propeller_jobs: propeller_jobs_rx,
            federated_jobs: federated_jobs_rx,
            training_rounds: training_rounds_rx,
        },
    )
}

/// The standalone reconcilers and their shared state.
pub struct Driver {
    store: ObjectStore,
    /// What both drivers hold alike: driver state, publisher, plan settings, counters, images.
    common: Common,
    /// How often every proplet is looked at without events.
    sweep: Duration,
    credentials: Arc<CredentialStore>,
    wake: WakeSenders,
    events: Arc<EventLog>,
    cache: Arc<ObjectCache>,
    /// The cache's credential epoch and the time of the last rebuild.
    /// A Secret changed since the last credential rebuild.
    secrets_changed: AtomicBool,
    own_writes: OwnWrites,
    load_wakes: LoadWakes,
}

impl Driver {
    /// A driver over `store`, publishing through `publisher`; the returned [`Wakes`] are for
    /// [`Driver::run`]. Fails if the store cannot be read.
    pub fn new(
        store: ObjectStore,
        publisher: Publisher,
        settings: StandaloneSettings,
        credentials: Arc<CredentialStore>,
        metrics: Arc<ControllerMetrics>,
        events: Arc<EventLog>,
    ) -> Result<(Arc<Self>, Wakes), StoreError> {
        let (wake, wakes) = wake_channels();
        let cache = ObjectCache::attach(&store)?;
        let driver = Arc::new(Self {
            store,
            common: Common::new(publisher, settings.proplet, settings.task, metrics),
            sweep: settings.sweep,
            credentials,
            wake,
            events,
            cache,
            secrets_changed: AtomicBool::new(false),
            own_writes: OwnWrites::default(),
            load_wakes: LoadWakes::default(),
        });
        let _ = driver.common.logins.set(driver.credentials.clone());
        Ok((driver, wakes))
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

    /// Asks for `key` to be reconciled (once, however often it is asked before it runs).
    pub fn enqueue(&self, key: Key) {
        fn at<K: kube::Resource<DynamicType = ()>>(key: &Key) -> ObjectRef<K> {
            ObjectRef::new(&key.name).within(&key.namespace)
        }
        // A closed channel means the controllers stopped: nothing to wake.
        let _ = match key.kind.as_str() {
            PROPLET => self.wake.proplets.send(at(&key)).is_ok(),
            TASK => self.wake.tasks.send(at(&key)).is_ok(),
            PROPELLER_JOB => self.wake.propeller_jobs.send(at(&key)).is_ok(),
            FEDERATED_JOB => self.wake.federated_jobs.send(at(&key)).is_ok(),
            TRAINING_ROUND => self.wake.training_rounds.send(at(&key)).is_ok(),
            _ => false,
        };
    }

    /// Sets the per-phase gauges of Proplets and Tasks from the cache (on each scrape).
    pub fn count_phases(&self) {
        let proplets = self.cache.proplets();
        let tasks = self.cache.tasks();
        self.common.metrics.count_phases(
            proplets.iter().map(Arc::as_ref),
            tasks.iter().map(Arc::as_ref),
        );
    }

    /// Runs the reconcilers until `shutdown` resolves, then lets the ones in flight finish.
    pub async fn run(
        self: Arc<Self>,
        wakes: Wakes,
        mut events: UnboundedReceiver<BrokerEvent>,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        self.refresh_credentials(true);
        let shutdown = shutdown.shared();
        let controllers = tokio::spawn(reconcile::controllers(
            self.clone(),
            wakes,
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
                        let key = Key::new(&change.kind, &change.namespace, &change.name);
                        self.related(&key);
                        if !self.own_writes.is_own(&key, change.resource_version) {
                            self.enqueue(key);
                        }
                    }
                    // Missed changes: look at everything again.
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                        self.enqueue_everything()
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                },
                _ = credential_tick.tick() => {
                    for key in self.load_wakes.due(Instant::now()) {
                        self.enqueue(key);
                    }
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

    fn enqueue_everything(&self) {
        fn keys<K: kube::Resource>(kind: &str, objects: Vec<Arc<K>>) -> Vec<Key> {
            objects.iter().map(|o| Key::of(kind, o.meta())).collect()
        }
        let all = [
            keys(PROPLET, self.cache.proplets()),
            keys(TASK, self.cache.tasks()),
            keys(PROPELLER_JOB, self.cache.propeller_job_store().state()),
            keys(FEDERATED_JOB, self.cache.federated_job_store().state()),
            keys(TRAINING_ROUND, self.cache.training_round_store().state()),
        ];
        for key in all.into_iter().flatten() {
            self.enqueue(key);
        }
    }
}
