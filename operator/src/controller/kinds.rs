//! The kinds propeller reconciles, each described once ([`Reconciled`]) and listed once
//! ([`for_each_kind`]); both drivers build their controllers, wake queues, caches and
//! standalone API names by walking that list.
//!
//! Adding a kind: its type and plan in `propeller-core`, a reconcile in this module's
//! neighbours, a `Reconciled` impl below, and one line in [`for_each_kind`].

use std::borrow::Cow;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::runtime::reflector::ObjectRef;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::crd::federated::{FederatedJob, TrainingRound};
use crate::crd::job::PropellerJob;
use crate::crd::proplet::Proplet;
use crate::crd::task::Task;
use crate::crd::upgrade::PropletUpgrade;

use super::{jobs, proplet, task, upgrade, Cluster, Next, ObjectName, ReconcileError, Stored};

/// A kind propeller reconciles: what both drivers need to run its controller.
pub trait Reconciled: Stored {
    /// The names users may type for the kind besides its own (`propeller get pjobs`), lower
    /// case.
    const ALIASES: &'static [&'static str];

    /// Whether every object of the kind is looked at again at the driver's periodic sweep
    /// (Proplets: their liveness is judged by the clock), not only when something changes.
    const SWEPT: bool = false;

    /// Reconciles `object` as of `now`; when to look again.
    fn reconcile<C: Cluster>(
        cluster: &C,
        object: Arc<Self>,
        now: DateTime<Utc>,
    ) -> impl Future<Output = Result<Next, ReconcileError>> + Send;

    /// What a change of `object` wakes on this replica when another replica owns it (and so
    /// reconciles and wakes nothing here itself).
    fn changed_elsewhere<C: Cluster>(_cluster: &C, _object: &Self) {}
}

/// Something done once per kind, for each kind's type ([`for_each_kind`]).
pub trait KindVisitor {
    /// Does it for `K`.
    fn visit<K: Reconciled>(&mut self);
}

/// Calls `visitor` with every kind propeller reconciles: the one list of them.
pub fn for_each_kind(visitor: &mut impl KindVisitor) {
    visitor.visit::<Proplet>();
    visitor.visit::<Task>();
    visitor.visit::<PropellerJob>();
    visitor.visit::<FederatedJob>();
    visitor.visit::<TrainingRound>();
    visitor.visit::<PropletUpgrade>();
}

/// The kind names ([`kube::Resource::kind`]) of every kind propeller reconciles, with the
/// names users may type for each.
pub fn kind_names() -> Vec<(String, &'static [&'static str])> {
    struct Names(Vec<(String, &'static [&'static str])>);
    impl KindVisitor for Names {
        fn visit<K: Reconciled>(&mut self) {
            self.0.push((K::kind(&()).into_owned(), K::ALIASES));
        }
    }
    let mut names = Names(Vec::new());
    for_each_kind(&mut names);
    names.0
}

impl Reconciled for Proplet {
    const ALIASES: &'static [&'static str] = &["proplet", "proplets"];
    const SWEPT: bool = true;

    async fn reconcile<C: Cluster>(
        cluster: &C,
        object: Arc<Self>,
        now: DateTime<Utc>,
    ) -> Result<Next, ReconcileError> {
        let newest = cluster.newest_proplet((*object).clone());
        proplet::reconcile(cluster, newest, now).await
    }

    fn changed_elsewhere<C: Cluster>(cluster: &C, object: &Self) {
        let phase = object.status.as_ref().map(|s| s.phase);
        let before = cluster
            .common()
            .state
            .phase_seen(&ObjectName::of(object), phase);
        proplet::wake_after_change_elsewhere(cluster, object, before);
    }
}

impl Reconciled for Task {
    const ALIASES: &'static [&'static str] = &["task", "tasks"];

    async fn reconcile<C: Cluster>(
        cluster: &C,
        object: Arc<Self>,
        now: DateTime<Utc>,
    ) -> Result<Next, ReconcileError> {
        let newest = cluster.newest_task(object);
        task::reconcile(cluster, &newest, now).await
    }

    fn changed_elsewhere<C: Cluster>(cluster: &C, object: &Self) {
        let finished = object
            .status
            .as_ref()
            .is_some_and(|s| s.phase.is_terminal())
            && !object.spec.is_recurring;
        if finished || object.metadata.deletion_timestamp.is_some() {
            // Its owner finished it: what this replica heard for it is not needed, and kept
            // it would be reported as late results if this replica takes the task over.
            cluster
                .common()
                .state
                .forget_task(object.metadata.uid.as_deref().unwrap_or_default());
        }
    }
}

impl Reconciled for PropellerJob {
    const ALIASES: &'static [&'static str] = &["propellerjob", "propellerjobs", "pjob", "pjobs"];

    async fn reconcile<C: Cluster>(
        cluster: &C,
        object: Arc<Self>,
        now: DateTime<Utc>,
    ) -> Result<Next, ReconcileError> {
        jobs::reconcile_propeller_job(cluster, &object, now).await
    }
}

impl Reconciled for FederatedJob {
    const ALIASES: &'static [&'static str] = &["federatedjob", "federatedjobs", "fjob"];

    async fn reconcile<C: Cluster>(
        cluster: &C,
        object: Arc<Self>,
        now: DateTime<Utc>,
    ) -> Result<Next, ReconcileError> {
        jobs::reconcile_federated_job(cluster, &object, now).await
    }
}

impl Reconciled for TrainingRound {
    const ALIASES: &'static [&'static str] = &["traininground", "trainingrounds"];

    async fn reconcile<C: Cluster>(
        cluster: &C,
        object: Arc<Self>,
        now: DateTime<Utc>,
    ) -> Result<Next, ReconcileError> {
        jobs::reconcile_training_round(cluster, &object, now).await
    }
}

impl Reconciled for PropletUpgrade {
    const ALIASES: &'static [&'static str] = &["propletupgrade", "propletupgrades", "pupgrade"];

    async fn reconcile<C: Cluster>(
        cluster: &C,
        object: Arc<Self>,
        now: DateTime<Utc>,
    ) -> Result<Next, ReconcileError> {
        upgrade::reconcile(cluster, &object, now).await
    }
}

/// A reconcile to run: of the object `name` of kind `kind`, asked for by another reconcile,
/// a broker event or a change of a related object.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Wake {
    /// The kind ([`kube::Resource::kind`]).
    pub kind: Cow<'static, str>,
    /// The object.
    pub name: ObjectName,
}

impl Wake {
    /// The reconcile of `name`, of kind `K`.
    pub fn of<K: Reconciled>(name: ObjectName) -> Self {
        Self {
            kind: K::kind(&()),
            name,
        }
    }

    /// The reconcile of `name`, of the kind named `kind` (from an owner reference or a
    /// stored change; a kind propeller does not reconcile wakes nothing).
    pub fn named(kind: &str, name: ObjectName) -> Self {
        Self {
            kind: Cow::Owned(kind.to_owned()),
            name,
        }
    }
}

/// The sending ends of every kind's wake queue.
#[derive(Clone)]
pub struct Wakers(HashMap<String, UnboundedSender<ObjectName>>);

/// The receiving ends, which the drivers hand to each kind's `Controller`.
pub struct WakeQueues(HashMap<String, UnboundedReceiver<ObjectName>>);

/// A wake queue for every kind ([`for_each_kind`]).
pub fn wake_queues() -> (Wakers, WakeQueues) {
    struct Channels(Wakers, WakeQueues);
    impl KindVisitor for Channels {
        fn visit<K: Reconciled>(&mut self) {
            let (tx, rx) = unbounded_channel();
            let kind = K::kind(&()).into_owned();
            self.0 .0.insert(kind.clone(), tx);
            self.1 .0.insert(kind, rx);
        }
    }
    let mut channels = Channels(Wakers(HashMap::new()), WakeQueues(HashMap::new()));
    for_each_kind(&mut channels);
    (channels.0, channels.1)
}

impl Wakers {
    /// Queues `wake` (once, however often it is asked for before it runs); `false` when its
    /// kind is not reconciled or the controllers stopped.
    pub fn send(&self, wake: Wake) -> bool {
        self.0
            .get(wake.kind.as_ref())
            .is_some_and(|queue| queue.send(wake.name).is_ok())
    }

    /// Wakes the owners of the object `meta` describes that are of a kind propeller
    /// reconciles (a Task's PropellerJob or TrainingRound, a round's FederatedJob): their
    /// plans read their children, so a child's change is theirs to act on.
    pub fn wake_owners(&self, meta: &ObjectMeta) {
        let namespace = meta.namespace.as_deref().unwrap_or("default");
        self.wake_owners_in(
            namespace,
            meta.owner_references.as_deref().unwrap_or_default(),
        );
    }

    /// Wakes `owners`, of objects in `namespace`, that are of a kind propeller reconciles.
    pub fn wake_owners_in(&self, namespace: &str, owners: &[OwnerReference]) {
        for owner in owners {
            self.send(Wake::named(
                &owner.kind,
                ObjectName::new(namespace, &owner.name),
            ));
        }
    }
}

impl WakeQueues {
    /// The receiving end of `K`'s queue itself (`None` when taken already).
    pub fn receiver<K: Reconciled>(&mut self) -> Option<UnboundedReceiver<ObjectName>> {
        self.0.remove(K::kind(&()).as_ref())
    }

    /// The wakes of kind `K`, as the object references a `Controller` reconciles (empty when
    /// taken already).
    pub fn take<K: Reconciled>(
        &mut self,
    ) -> impl futures::Stream<Item = ObjectRef<K>> + Send + 'static {
        use futures::StreamExt as _;
        let wakes = match self.receiver::<K>() {
            Some(rx) => futures::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|name| (name, rx))
            })
            .left_stream(),
            None => futures::stream::empty().right_stream(),
        };
        wakes.map(|name: ObjectName| ObjectRef::new(&name.name).within(&name.namespace))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_a_queue_and_a_wake_reaches_only_its_own_kind() {
        let (wakers, mut queues) = wake_queues();
        let names = kind_names();
        assert_eq!(names.len(), 6);
        let round = ObjectName::new("ns", "r");
        assert!(wakers.send(Wake::of::<TrainingRound>(round.clone())));
        assert!(!wakers.send(Wake::named("ConfigMap", round.clone())));
        let mut rounds = Box::pin(queues.take::<TrainingRound>());
        let mut tasks = Box::pin(queues.take::<Task>());
        use futures::FutureExt as _;
        use futures::StreamExt as _;
        assert_eq!(
            rounds.next().now_or_never().flatten(),
            Some(ObjectRef::new("r").within("ns"))
        );
        assert!(tasks.next().now_or_never().is_none(), "nothing for Tasks");
    }

    #[test]
    fn a_childs_change_wakes_its_reconciled_owners_only() {
        let (wakers, mut queues) = wake_queues();
        let owner = |kind: &str, name: &str| {
            k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                kind: kind.into(),
                name: name.into(),
                ..Default::default()
            }
        };
        let meta = ObjectMeta {
            namespace: Some("ns".into()),
            owner_references: Some(vec![owner("PropellerJob", "j"), owner("Deployment", "d")]),
            ..Default::default()
        };
        wakers.wake_owners(&meta);
        use futures::FutureExt as _;
        use futures::StreamExt as _;
        let mut jobs = Box::pin(queues.take::<PropellerJob>());
        assert_eq!(
            jobs.next().now_or_never().flatten(),
            Some(ObjectRef::new("j").within("ns"))
        );
    }
}
