//! Each controller written once. The Proplet, Task, PropellerJob, FederatedJob and
//! TrainingRound reconciles, and the routing of broker events to them, are generic over the
//! [`Cluster`] they run against: the API server through kube-rs (`k8s::runtime`) or the
//! embedded store (`standalone::driver`).
//!
//! ```text
//!  MQTT (embedded broker or external cluster)
//!     │ BrokerEvent
//!     ▼
//!  routing::route_event ── records the report in DriverState, never writes
//!     │ Signals::wake(Wake)
//!     ▼
//!  a kube-runtime Controller per kind (on the API server's watches, or on the store's
//!     │ reflector caches): one queue, never two reconciles of one object at once
//!     ▼
//!  proplet / task / jobs::reconcile ── reads the caches, plans with propeller-core
//!     │ Cluster::{apply_proplet, create_once, write_status, note}, executor::apply_task
//!     ▼
//!  API server | redb store  ──watch──▶ the driver's queue
//! ```
//!
//! A driver supplies the queue that calls these functions, the caches they read and the
//! writes they make; what is read, planned, written, noted and woken is decided here, once.
//! Each reconcile returns when it wants to look again ([`Next`]); failures go through one
//! [`retry_policy`].

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::crd::proplet::Proplet;
use crate::crd::task::{Task, TaskPhase};
use crate::decision::dag::Graph;
use crate::decision::liveness::DeploymentObservation;
use crate::decision::proplet::PropletPlan;
use crate::decision::scheduler::SelectorView;
use crate::decision::task::Note;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::proplet_index::Narrowed;
use executor::{JobRunner, TaskApplyError};

mod common;
pub mod executor;
#[cfg(test)]
mod fake;
pub mod finalizer;
pub mod jobs;
pub mod kinds;
pub mod kueue;
pub mod ownership;
pub mod proplet;
pub mod routing;
pub mod runner;
pub mod task;
pub mod upgrade;

#[cfg(test)]
mod reconcile_tests;

/// A resource kind of the API, `Scope` being namespaced or cluster-wide, in the typed form
/// the backends read and write.
pub trait Object<Scope>:
    kube::Resource<DynamicType = (), Scope = Scope>
    + Clone
    + Serialize
    + DeserializeOwned
    + std::fmt::Debug
    + Send
    + Sync
    + 'static
{
}

impl<K, Scope> Object<Scope> for K where
    K: kube::Resource<DynamicType = (), Scope = Scope>
        + Clone
        + Serialize
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static
{
}

/// A namespaced resource either backend stores: the six custom resources, ConfigMaps,
/// and Kueue's Workloads.
pub trait Stored: Object<k8s_openapi::NamespaceResourceScope> {}

impl<K: Object<k8s_openapi::NamespaceResourceScope>> Stored for K {}

/// A cluster-scoped kind propeller only reads (Kueue's ResourceFlavor, WorkloadPriorityClass).
pub trait ClusterScoped: Object<k8s_openapi::ClusterResourceScope> {}

impl<K: Object<k8s_openapi::ClusterResourceScope>> ClusterScoped for K {}

pub use propeller_core::object_name::ObjectName;

pub use common::{Common, CREDENTIAL_TICK};
pub use kinds::{Reconciled, Wake};

/// The settings of every kind's kube-runtime `Controller` on driver `C`.
pub fn controller_config<C: Cluster>() -> kube::runtime::controller::Config {
    kube::runtime::controller::Config::default().concurrency(C::RECONCILE_CONCURRENCY)
}

/// When a reconcile wants to look at its object again without an event (`None`: only when
/// something changes, or at the driver's slow resync).
pub type Next = Option<DateTime<Utc>>;

/// What a driver offers the controllers: its object backend, its caches, its queue and the
/// application of plans. Callers that need less ask for less: [`Backend`] (reads from and
/// conditional writes to the backend), [`CacheReads`] (what the shells observe), [`Signals`]
/// (wakes and notes).
pub trait Cluster: Backend + CacheReads + Signals {
    /// Runs `k8s` proplets' tasks as Jobs, for a backend that can.
    type Jobs: JobRunner;

    /// How long a reconcile that asks for no next look waits anyway (the slow resync of a
    /// driver whose watches can miss nothing else); `None`: until a change.
    const RESYNC: Option<std::time::Duration>;

    /// How long a reconcile whose write conflicted waits before its object is read again:
    /// until the driver's cache can show the newer version.
    const CONFLICT_REREAD: std::time::Duration;

    /// Reconciles of one kind that run at once: what the backend bears, not a preference
    /// (see each driver's value).
    const RECONCILE_CONCURRENCY: u16;

    /// The parts both drivers hold alike.
    fn common(&self) -> &Common;

    /// Applies a Proplet plan's writes: its Deployment (`k8s` proplets) and its status.
    fn apply_proplet(
        &self,
        proplet: &Proplet,
        plan: &PropletPlan,
    ) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// The backend's Job runner; `None` where there are no Jobs (the embedded store).
    fn jobs(&self) -> Option<&Self::Jobs>;
}

/// An error of the object backend (API server or embedded store).
pub type BackendError = Box<dyn std::error::Error + Send + Sync>;

/// The object backend (the API server, or the embedded store): reads that bypass the caches
/// and writes conditional on the version an object was read at.
pub trait Backend: Send + Sync {
    /// What `error`, one of this backend's, says to the retry policy (`None`: a failure to
    /// retry later).
    fn refusal(error: &(dyn std::error::Error + Send + Sync + 'static)) -> Option<Refusal>;

    /// The object `name` of kind `K`, read from the backend (not a cache).
    fn get<K: Stored>(
        &self,
        name: &ObjectName,
    ) -> impl Future<Output = Result<Option<K>, BackendError>> + Send;

    /// The cluster-scoped object `name` of kind `K` (Kueue's ResourceFlavors and priority
    /// classes), read from the backend; `None` where the backend has no such kind.
    fn get_cluster_scoped<K: ClusterScoped>(
        &self,
        name: &str,
    ) -> impl Future<Output = Result<Option<K>, BackendError>> + Send;

    /// Every object of kind `K` in `namespace`, read from the backend.
    fn list<K: Stored>(
        &self,
        namespace: &str,
    ) -> impl Future<Output = Result<Vec<K>, BackendError>> + Send;

    /// Creates `object` unless it exists already (a retried reconcile created it).
    fn create_once<K: Stored>(
        &self,
        object: &K,
    ) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// Replaces `object` whole but its status (its data, spec, labels and annotations),
    /// conditionally on the version it was read at (a newer one: a conflict).
    fn replace<K: Stored>(
        &self,
        object: &K,
    ) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// Replaces the status `old` (as written) of the `K` named by `meta` with `new`,
    /// conditionally on `meta`'s resourceVersion; returns the new version.
    fn write_status<K: Stored>(
        &self,
        meta: &ObjectMeta,
        old: &Value,
        new: &Value,
    ) -> impl Future<Output = Result<Option<String>, BackendError>> + Send;

    /// Sets the finalizers of the `K` named by `meta` to exactly `finalizers`, conditionally
    /// on `meta`'s resourceVersion; returns the new version.
    fn set_finalizers<K: Stored>(
        &self,
        meta: &ObjectMeta,
        finalizers: &[String],
    ) -> impl Future<Output = Result<Option<String>, BackendError>> + Send;

    /// Deletes the `K` named by `meta`, conditionally on its uid and resourceVersion (a
    /// newer version: a conflict); one already gone is no error.
    fn delete<K: Stored>(
        &self,
        meta: &ObjectMeta,
    ) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// Sets the finalizers, then replaces the status (see [`Backend::write_status`]), as one
    /// write where the backend can (the embedded store's transaction; the API server needs
    /// two calls, the second conditional on the first's version).
    fn set_finalizers_and_status<K: Stored>(
        &self,
        meta: &ObjectMeta,
        finalizers: &[String],
        old: &Value,
        new: &Value,
    ) -> impl Future<Output = Result<Option<String>, BackendError>> + Send {
        async move {
            let version = self.set_finalizers::<K>(meta, finalizers).await?;
            let written = ObjectMeta {
                resource_version: version,
                ..meta.clone()
            };
            self.write_status::<K>(&written, old, new).await
        }
    }
}

/// What the shells read from the driver's caches and indexes (never the backend).
pub trait CacheReads: Send + Sync {
    /// The newest `proplet` this process knows: the cached one, or what its last write left
    /// when the cache has not caught up yet.
    fn newest_proplet(&self, proplet: Proplet) -> Proplet {
        proplet
    }

    /// The newest `task` this process knows (see [`CacheReads::newest_proplet`]).
    fn newest_task(&self, task: Arc<Task>) -> Arc<Task> {
        task
    }

    /// The readiness of a `k8s` proplet's Deployment, if the backend has Deployments.
    fn deployment_of(&self, proplet: &Proplet) -> Option<DeploymentObservation>;

    /// Tasks occupying `proplet` (scheduled or running on it).
    fn load_of(&self, proplet: &Proplet) -> u32;

    /// Names of the tasks occupying `proplet`.
    fn tasks_on(&self, proplet: &Proplet) -> Vec<String>;

    /// Proplets known to this process.
    fn fleet_size(&self) -> usize;

    /// The Proplet whose device logs in as `client_id`.
    fn proplet_by_client(&self, client_id: &str) -> Option<Arc<Proplet>>;

    /// The Task with this UID.
    fn task_by_uid(&self, uid: &str) -> Option<Arc<Task>>;

    /// The Tasks of `namespace`.
    fn tasks_in(&self, namespace: &str) -> Vec<Arc<Task>>;

    /// Every Proplet.
    fn proplets(&self) -> Vec<Arc<Proplet>>;

    /// Names of the Tasks of `namespace` that depend on `name`.
    fn dependents(&self, name: &ObjectName) -> Vec<String>;

    /// The Proplets of `namespace`.
    fn proplets_in(&self, namespace: &str) -> Vec<Arc<Proplet>>;

    /// Which proplets of `namespace` `selector` can match by the label index (the one it
    /// names, or those carrying its labels): a superset of the candidates, found without
    /// passing over the whole namespace; the scheduler's rules still apply to each.
    fn narrow_proplets(&self, namespace: &str, selector: &SelectorView) -> Narrowed;

    /// The Proplets of `namespace` that `selector` can match by the label index (see
    /// [`CacheReads::narrow_proplets`]).
    fn proplets_for(&self, namespace: &str, selector: &SelectorView) -> Vec<Arc<Proplet>> {
        match self.narrow_proplets(namespace, selector) {
            Narrowed::Whole => self.proplets_in(namespace),
            Narrowed::Only(names) => names
                .iter()
                .filter_map(|n| self.proplet(&ObjectName::new(namespace, n)))
                .collect(),
        }
    }

    /// One Proplet.
    fn proplet(&self, name: &ObjectName) -> Option<Arc<Proplet>>;

    /// The phase of Task `name`, if it exists.
    fn task_phase(&self, name: &ObjectName) -> Option<TaskPhase>;

    /// The dependency graph of the Tasks of `namespace`.
    fn dependency_graph(&self, namespace: &str) -> Graph;
}

/// Asking for reconciles, and recording what happened for people.
pub trait Signals: Send + Sync {
    /// Asks for a reconcile.
    fn wake(&self, wake: Wake);

    /// Records `note` on `object` (a Kubernetes Event, or standalone's event log).
    fn note<K: Stored>(&self, object: &K, note: &Note) -> impl Future<Output = ()> + Send;

    /// Records `note` without holding up the caller.
    fn note_later<K: Stored>(&self, object: &K, note: Note);
}

/// Why a reconcile failed; it is retried (see [`retry_policy`]).
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// The backend refused a write or could not be reached.
    #[error("{0}")]
    Backend(BackendError),
    /// Applying a Task plan failed.
    #[error(transparent)]
    Task(#[from] TaskApplyError),
}

impl From<BackendError> for ReconcileError {
    fn from(e: BackendError) -> Self {
        ReconcileError::Backend(e)
    }
}

impl ReconcileError {
    /// The backend's error inside, if the backend failed.
    pub fn backend(&self) -> Option<&(dyn std::error::Error + Send + Sync + 'static)> {
        match self {
            ReconcileError::Backend(e) | ReconcileError::Task(TaskApplyError::Backend(e)) => {
                Some(e.as_ref())
            }
            ReconcileError::Task(_) => None,
        }
    }

    /// How `C`'s backend refused, when it did (see [`Backend::refusal`]).
    pub fn refusal<C: Cluster>(&self) -> Option<Refusal> {
        self.backend().and_then(C::refusal)
    }
}

/// A backend's refusal the retry policy acts on; each driver recognises its own errors
/// ([`Backend::refusal`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A conditional write lost to a newer version of the object (the API server's 409
    /// Conflict, the store's conflict): routine under load, answered by reading it again.
    Conflict,
    /// The object is gone (deleted while it was reconciled): nothing to retry.
    Gone,
}

/// What to do after a failed reconcile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Read the object again as soon as the driver's cache can show the newer version.
    Reread,
    /// Nothing: the object is gone.
    Never,
    /// Try again after this long.
    After(Duration),
}

/// How long a failed reconcile waits before its retry.
pub const RETRY_AFTER_FAILURE: Duration = Duration::from_secs(2);

/// The one error policy of both drivers: a conflict is read again at once, a deleted object
/// is left alone, anything else is logged and retried after [`RETRY_AFTER_FAILURE`].
pub fn retry_policy(
    kind: &str,
    object: &ObjectName,
    error: &ReconcileError,
    refusal: Option<Refusal>,
) -> Retry {
    match refusal {
        Some(Refusal::Gone) => {
            tracing::debug!(kind, %object, "the object was deleted while it was reconciled");
            return Retry::Never;
        }
        Some(Refusal::Conflict) => {
            tracing::debug!(kind, %object, "the object changed while it was reconciled; reconciling it again");
            return Retry::Reread;
        }
        None => {}
    }
    tracing::warn!(kind, %object, %error, "reconcile failed; retrying in {}s", RETRY_AFTER_FAILURE.as_secs());
    Retry::After(RETRY_AFTER_FAILURE)
}

/// How long until `next`, from `now`, capped at `resync` (`resync` when there is none; a
/// moment when it has passed), plus a margin so the look falls after the deadline.
pub fn wait_until(next: Next, now: DateTime<Utc>, resync: Duration) -> Duration {
    next.map_or(resync, |at| {
        (at - now).to_std().unwrap_or_default().min(resync) + Duration::from_millis(100)
    })
}

/// Counts one reconcile of `kind` that started at `started`.
pub(crate) fn count<T>(
    common: &Common,
    kind: &str,
    started: Instant,
    result: &Result<T, ReconcileError>,
) {
    common
        .metrics
        .observe(kind, started.elapsed(), result.is_ok());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflicts_are_read_again_deletions_left_and_the_rest_retried_later() {
        let name = ObjectName::new("default", "t");
        let error = ReconcileError::Task(TaskApplyError::NoJobs("t".into()));
        let cases = [
            (Some(Refusal::Conflict), Retry::Reread),
            (Some(Refusal::Gone), Retry::Never),
            (None, Retry::After(RETRY_AFTER_FAILURE)),
        ];
        for (refusal, expected) in cases {
            assert_eq!(retry_policy("Task", &name, &error, refusal), expected);
        }
    }

    #[test]
    fn the_next_look_is_capped_at_the_resync_and_never_in_the_past() {
        let now = Utc::now();
        let resync = Duration::from_secs(300);
        assert_eq!(wait_until(None, now, resync), resync);
        assert_eq!(
            wait_until(Some(now + chrono::Duration::seconds(5)), now, resync),
            Duration::from_millis(5_100)
        );
        assert_eq!(
            wait_until(Some(now + chrono::Duration::hours(1)), now, resync),
            resync + Duration::from_millis(100)
        );
        // A time already past (the plan was slow): at once, not at the resync.
        assert_eq!(
            wait_until(Some(now - chrono::Duration::seconds(1)), now, resync),
            Duration::from_millis(100)
        );
    }
}
