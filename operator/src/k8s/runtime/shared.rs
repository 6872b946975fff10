//! What the Kubernetes reconcilers share: the client, the caches of the watches, the
//! driver state, the wake queues, and the memory of this process's own writes.

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Secret;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::Client;
use propeller_broker::server::{CredentialStore, Publisher};
use tracing::debug;

use crate::controller::kinds::Wakers;
use crate::controller::Common;
use crate::crd::proplet::Proplet;
use crate::crd::task::Task;
use crate::credentials::RefreshGate;
use crate::decision::task::Note;
use crate::k8s::task_job::KubeJobs;
use crate::metrics::ControllerMetrics;
use crate::own_writes::OwnWrites;
use crate::proplet_index::SharedPropletIndex;
use crate::task_index::SharedTaskIndex;

use super::{Settings, RESYNC};

/// State shared by the reconcilers and the event router.
pub struct Shared {
    /// API client.
    pub client: Client,
    /// What both drivers hold alike: driver state, publisher, plan settings, counters, images.
    pub common: Common,
    /// Runs `k8s` proplets' tasks as Jobs.
    pub(super) jobs: KubeJobs,
    /// When the credential table needs rebuilding.
    pub credential_gate: Arc<RefreshGate>,
    /// Cached Proplets.
    pub proplets: Store<Proplet>,
    /// The cached Proplets by label.
    pub proplet_index: SharedPropletIndex,
    /// Cached Tasks.
    pub tasks: Store<Task>,
    /// The cached Tasks by UID, by the proplet they occupy and by dependency.
    pub task_index: SharedTaskIndex,
    /// Cached proplet Deployments.
    pub deployments: Store<Deployment>,
    /// Cached Secrets (proplet keys are read from here, never fetched one by one).
    pub secrets: Store<Secret>,
    /// Proplet of each MQTT client id, rebuilt with the credential table, so a heartbeat
    /// finds its Proplet without scanning all of them.
    pub(super) clients: std::sync::RwLock<HashMap<String, ObjectRef<Proplet>>>,
    /// Broker logins derived from Proplets.
    pub credentials: Arc<CredentialStore>,
    /// Emits Kubernetes Events.
    pub recorder: Recorder,
    /// Every kind's wake queue.
    pub wakers: Wakers,
    /// What each Proplet's last status write returned, until the cache shows it.
    pub(super) proplet_writes: OwnWrites<Proplet>,
    /// What the last apply wrote to each Task, until the cache shows it.
    pub(super) task_writes: OwnWrites<Task>,
    /// Bounds the Events published off the reconcile path (each is an API call, and
    /// kube's client opens a connection per concurrent call).
    pub(super) background_events: Arc<tokio::sync::Semaphore>,
}

/// Events published at once off the reconcile path.
pub(super) const BACKGROUND_EVENTS: usize = 4;

/// The caches a [`Shared`] reads, and the wake queues their watches feed.
pub struct Caches {
    /// Every kind's wake queue.
    pub wakers: Wakers,
    /// Proplets.
    pub proplets: Store<Proplet>,
    /// The index of `proplets`, fed by the same watch.
    pub proplet_index: SharedPropletIndex,
    /// Tasks.
    pub tasks: Store<Task>,
    /// The index of `tasks`, fed by the same watch.
    pub task_index: SharedTaskIndex,
    /// Counts the watched Proplet changes that alter the credential table (the Secret
    /// watch adds its own).
    pub credential_gate: Arc<RefreshGate>,
    /// Proplet Deployments.
    pub deployments: Store<Deployment>,
    /// Secrets (proplet keys).
    pub secrets: Store<Secret>,
}

impl Shared {
    /// Fresh shared state over `caches`, waking reconciles through their wake queues.
    pub fn new(
        client: Client,
        settings: Settings,
        publisher: Publisher,
        credentials: Arc<CredentialStore>,
        metrics: Arc<ControllerMetrics>,
        reporter: Option<String>,
        caches: Caches,
    ) -> Self {
        let shared = Shared {
            recorder: Recorder::new(
                client.clone(),
                Reporter {
                    controller: "propeller".into(),
                    instance: reporter,
                },
            ),
            jobs: KubeJobs::new(client.clone()),
            client,
            common: Common {
                logs: settings.logs.clone(),
                ..Common::new(publisher, settings.proplet, settings.task, metrics)
            },
            credential_gate: caches.credential_gate,
            proplets: caches.proplets,
            proplet_index: caches.proplet_index,
            tasks: caches.tasks,
            task_index: caches.task_index,
            deployments: caches.deployments,
            secrets: caches.secrets,
            clients: std::sync::RwLock::new(HashMap::new()),
            credentials,
            wakers: caches.wakers,
            proplet_writes: OwnWrites::default(),
            task_writes: OwnWrites::default(),
            background_events: Arc::new(tokio::sync::Semaphore::new(BACKGROUND_EVENTS)),
        };
        let _ = shared.common.logins.set(shared.credentials.clone());
        shared
    }

    pub(super) fn proplet_by_client(&self, client_id: &str) -> Option<Arc<Proplet>> {
        let indexed = self
            .clients
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(client_id)
            .cloned();
        match indexed.and_then(|r| self.proplets.get(&r)) {
            Some(p) if p.client_id() == client_id => Some(p),
            // Not indexed yet (the table is rebuilt on a tick): look through all of them.
            _ => self.proplets.find(|p| p.client_id() == client_id),
        }
    }

    pub(super) fn task_by_uid(&self, uid: &str) -> Option<Arc<Task>> {
        let (namespace, name) = self.task_index.read().by_uid(uid)?.clone();
        self.tasks.get(&ObjectRef::new(&name).within(&namespace))
    }

    /// Publishes `note` as an Event about `reference` (a failure is logged, not returned).
    pub(super) async fn publish_note(
        recorder: &Recorder,
        reference: &k8s_openapi::api::core::v1::ObjectReference,
        note: &Note,
    ) {
        let event = Event {
            type_: if note.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: note.reason.to_owned(),
            note: Some(note.message.chars().take(1000).collect()),
            action: "Reconcile".to_owned(),
            secondary: None,
        };
        if let Err(e) = recorder.publish(&event, reference).await {
            debug!(%e, reason = note.reason, "could not record an event");
        }
    }

    /// Rebuilds the broker's credential table and the client index from the cached
    /// Proplets and Secrets, when either changed (or at least every [`RESYNC`]).
    pub fn refresh_credentials(&self) {
        if !self.credential_gate.due(RESYNC) {
            return;
        }
        let proplets = self.proplets.state();
        let read = |ns: &str, name: &str, key: &str| {
            let secret = self.secrets.get(&ObjectRef::new(name).within(ns))?;
            crate::credentials::secret_entry(&secret, key)
        };
        // Every cached Secret: the token table keeps those of the token namespace.
        let secrets = |_: &str| self.secrets.state();
        self.common
            .refresh_logins(proplets.iter().map(|p| &**p), read, secrets);
        let index = proplets
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .map(|p| (p.client_id().to_owned(), ObjectRef::from_obj(&**p)))
            .collect();
        *self.clients.write().unwrap_or_else(|e| e.into_inner()) = index;
    }
}
