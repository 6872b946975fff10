//! The Task controller: observe the task's surroundings and its device's reports, plan with
//! the core, apply the plan (status, Job or starts, stops, finalizer), resolve its image,
//! record its notes, and wake what its change affects.

use std::sync::Arc;
use std::time::Instant;

use chrono::{DateTime, TimeDelta, Utc};
use propeller_broker::protocol::Channel;
use tracing::{debug, info, warn};

use super::executor::{apply_task, Dispatch, JobRunner};
use crate::crd::proplet::Proplet;
use crate::crd::task::Task;
use crate::decision::capacity::{reserve, Holder, Reservation};
use crate::decision::task::{
    awaits_job, could_take, observe_indexed, plan, proplet_scope, proplet_view, selector_of,
    stops_for_deleted, Note, PropletScope, PropletView, TaskObservations,
};

use super::{count, CacheReads, Cluster, Next, ObjectName, ReconcileError, Refusal, Signals, Wake};

/// How often a task whose start waits for its device looks again.
pub const DEVICE_WAIT: TimeDelta = TimeDelta::seconds(1);
/// How often a task that lost the race for a proplet's last slot looks again.
pub const CAPACITY_WAIT: TimeDelta = TimeDelta::seconds(1);
/// Conflicting slot writes a reservation retries before it leaves the rest to the retry
/// policy.
const SLOT_WRITE_ATTEMPTS: usize = 5;

/// Reconciles `task` as read from the driver's cache.
#[tracing::instrument(
    name = "reconcile",
    skip_all,
    fields(object.kind = "Task", object.ref = %ObjectName::of(task))
)]
pub async fn reconcile<C: Cluster>(
    cluster: &C,
    task: &Task,
    now: DateTime<Utc>,
) -> Result<Next, ReconcileError> {
    let started = Instant::now();
    let result = reconcile_once(cluster, task, now).await;
    count(cluster.common(), "task", started, &result);
    result
}

async fn reconcile_once<C: Cluster>(
    cluster: &C,
    task: &Task,
    now: DateTime<Utc>,
) -> Result<Next, ReconcileError> {
    let common = cluster.common();
    let name = ObjectName::of(task);
    let scope = proplet_scope(task);
    let mut observed = observe(cluster, task, &scope);
    common.state.complete(task, &mut observed);
    let images = common.images();
    observed.image = images.and_then(|i| i.observe(task));
    if awaits_job(task, &observed) {
        observed.job = match cluster.jobs() {
            Some(jobs) => jobs.observe_task_job(task).await?,
            None => None,
        };
    }
    let first = plan(task, &observed, &common.task, now);
    let plan = if first.no_candidates && scope == PropletScope::Candidates {
        // None could take it: plan again over the whole namespace, so that the wait says
        // why each proplet was passed over.
        observed.proplets = proplet_views(cluster, task, &PropletScope::Namespace);
        plan(task, &observed, &common.task, now)
    } else {
        first
    };
    if let Some((proplet, holders)) = reserve_slots(cluster, task, &plan.reserve, now).await? {
        debug!(task = %name, %proplet, ?holders, "the proplet is at its capacity; waiting for a slot");
        return Ok(Some(now + CAPACITY_WAIT));
    }
    let dispatch = apply_task(cluster, task, &plan).await?;
    if plan.resolve_image {
        match images {
            Some(images) => images.resolve(task),
            None => {
                warn!(task = %name, "an OCI imageUrl needs resolving, but this operator serves no images")
            }
        }
    }
    if let Some(chosen) = &plan.chosen {
        common.state.chose(&name.namespace, chosen);
    }
    for note in &plan.notes {
        if note.warning {
            warn!(task = %name, reason = note.reason, "{}", note.message);
        } else {
            info!(task = %name, reason = note.reason, "{}", note.message);
        }
        cluster.note(task, note).await;
    }
    if let Dispatch::WaitingFor(client) = dispatch {
        debug!(task = %name, %client, "start held until the device is heard from");
        return Ok(Some(now + DEVICE_WAIT));
    }
    Ok(plan.requeue_at)
}

/// Takes a slot of each proplet in `proplets` (those with a `spec.capacity`) for `task`,
/// with a write conditional on the proplet's version read from the backend (see
/// [`crate::decision::capacity`]). Returns the first proplet found full, with its holders.
async fn reserve_slots<C: Cluster>(
    cluster: &C,
    task: &Task,
    proplets: &[String],
    now: DateTime<Utc>,
) -> Result<Option<(String, Vec<String>)>, ReconcileError> {
    let name = ObjectName::of(task);
    let uid = task.metadata.uid.as_deref().unwrap_or_default();
    for proplet_name in proplets {
        let key = ObjectName::new(&name.namespace, proplet_name);
        for attempt in 1..=SLOT_WRITE_ATTEMPTS {
            // Gone since it was chosen: the dispatch fails the run, as for any assignment.
            let Some(proplet) = cluster.get::<Proplet>(&key).await? else {
                break;
            };
            let Some(capacity) = proplet.spec.capacity else {
                break;
            };
            let status = proplet.status.clone().unwrap_or_default();
            let holder = |holder: &str| slot_holder(cluster, holder, proplet_name);
            let slots = match reserve(&status.slots, capacity, uid, &name.name, now, holder) {
                Reservation::Held => break,
                Reservation::Full { holders } => return Ok(Some((proplet_name.clone(), holders))),
                Reservation::Take(slots) => slots,
            };
            let old =
                serde_json::to_value(&status).map_err(|e| ReconcileError::Backend(e.into()))?;
            let mut new = status;
            new.slots = slots;
            let new = serde_json::to_value(&new).map_err(|e| ReconcileError::Backend(e.into()))?;
            match cluster
                .write_status::<Proplet>(&proplet.metadata, &old, &new)
                .await
            {
                Ok(_) => break,
                Err(e) => {
                    let error = ReconcileError::Backend(e);
                    let conflict = error.refusal::<C>() == Some(Refusal::Conflict);
                    if !conflict || attempt == SLOT_WRITE_ATTEMPTS {
                        return Err(error);
                    }
                }
            }
        }
    }
    Ok(None)
}

/// What the caches say of the task `uid` holding a slot of proplet `proplet`.
fn slot_holder<C: CacheReads + Signals>(cluster: &C, uid: &str, proplet: &str) -> Holder {
    let Some(task) = cluster.task_by_uid(uid) else {
        return Holder::Unknown;
    };
    match task.status.as_ref() {
        Some(s) if s.phase.is_terminal() => Holder::Finished,
        _ if crate::decision::task::occupies(&task, proplet) => Holder::Occupies,
        _ => Holder::Elsewhere,
    }
}

/// What `task`'s plan reads of its surroundings, from the driver's caches and indexes, with
/// the proplets of `scope`.
fn observe<C: Cluster>(cluster: &C, task: &Task, scope: &PropletScope) -> TaskObservations {
    let name = ObjectName::of(task);
    let namespace = &name.namespace;
    observe_indexed(
        task,
        |dependency| cluster.task_phase(&ObjectName::new(namespace, dependency)),
        || cluster.dependency_graph(namespace),
        proplet_views(cluster, task, scope),
    )
}

/// The proplets of `scope` as the plan sees them: while the task may be scheduled, only
/// those that could take it are copied into views (a fleet of thousands costs a pass over
/// the cache, not thousands of copies); else the ones its run occupies, looked up by name.
fn proplet_views<C: Cluster>(cluster: &C, task: &Task, scope: &PropletScope) -> Vec<PropletView> {
    let namespace = ObjectName::of(task).namespace;
    let proplets: Vec<Arc<Proplet>> = match scope {
        PropletScope::Candidates => {
            let selector = selector_of(task);
            let mut some = cluster.proplets_for(&namespace, &selector);
            some.retain(|p| could_take(task, &selector, p));
            some
        }
        PropletScope::Namespace => cluster.proplets_in(&namespace),
        // A daemon's plan reads whether its proplet went Offline, which this process may
        // have just written and its cache not yet shown: its own newer write is read.
        PropletScope::Named(names) => names
            .iter()
            .filter_map(|n| cluster.proplet(&ObjectName::new(&namespace, n)))
            .map(|p| {
                if task.spec.daemon {
                    Arc::new(cluster.newest_proplet((*p).clone()))
                } else {
                    p
                }
            })
            .collect(),
    };
    proplets
        .iter()
        .map(|p| proplet_view(p, cluster.load_of(p)))
        .collect()
}

/// What a change of `task`, once its driver's cache shows it, wakes besides the task and
/// its owners: its dependents once it has finished, and the proplet it occupies (its load
/// changed; see [`Common::wake_for_load`]). Both drivers call it for every change they see,
/// their own writes and other replicas' alike.
///
/// [`Common::wake_for_load`]: super::Common::wake_for_load
pub fn wake_related<C: Cluster>(cluster: &C, task: &Task) {
    let name = ObjectName::of(task);
    let status = task.status.as_ref();
    if status.is_some_and(|s| s.phase.is_terminal()) {
        for dependent in cluster.dependents(&name) {
            cluster.wake(Wake::of::<Task>(ObjectName::new(
                &name.namespace,
                &dependent,
            )));
        }
    }
    if let Some(proplet) = status.and_then(|s| s.assigned_proplet.as_deref()) {
        cluster
            .common()
            .wake_for_load(cluster, ObjectName::new(&name.namespace, proplet));
    }
}

/// Acts on `task`'s deletion as the driver's watch showed it (its last state): forgets what
/// this process recorded for it and, when this replica owns it and it went without the
/// finalizer while its run was out (a run younger than the running-write delay under
/// [`crate::decision::task::FinalizerTiming::WhileRunning`]), stops the run on its devices.
pub async fn deleted<C: Cluster>(cluster: &C, task: &Task) {
    let common = cluster.common();
    common
        .state
        .forget_task(task.metadata.uid.as_deref().unwrap_or_default());
    let mut targets: Vec<String> = task
        .status
        .iter()
        .flat_map(|s| s.assigned_proplet.iter().chain(&s.broadcast_proplets))
        .cloned()
        .collect();
    targets.sort_unstable();
    targets.dedup();
    if targets.is_empty() {
        return;
    }
    let Some(_turn) = common.turn(task).await else {
        return;
    };
    let observed = TaskObservations {
        proplets: proplet_views(cluster, task, &PropletScope::Named(targets)),
        ..TaskObservations::default()
    };
    let stops = stops_for_deleted(task, &observed);
    if stops.is_empty() {
        return;
    }
    let name = ObjectName::of(task);
    for stop in &stops {
        let sent = match Channel::new(stop.domain.clone(), stop.channel.clone()) {
            Ok(channel) => common
                .publisher
                .stop(&channel, &stop.request)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = sent {
            warn!(task = %name, error = %e, "the task was deleted while it ran; its stop could not be sent");
        }
    }
    let note = Note {
        warning: false,
        reason: "Stopped",
        message: "the task was deleted while it ran; stop sent".to_owned(),
    };
    info!(task = %name, reason = note.reason, "{}", note.message);
    cluster.note(task, &note).await;
}
