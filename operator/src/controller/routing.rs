//! From broker events to reconciles: each event is recorded in the driver state and wakes
//! the reconcile of the object it concerns; the MQTT side never writes an object itself.

use chrono::Utc;
use propeller_broker::protocol::TaskLogs;
use propeller_broker::server::{BrokerEvent, EventKind};
use tracing::{debug, warn};

use crate::crd::proplet::Proplet;
use crate::crd::task::Task;
use crate::crd::upgrade::PropletUpgrade;
use crate::decision::upgrade::rollout_of;
use crate::state::Concerns;

use super::{CacheReads, Cluster, ObjectName, Signals, Wake};

/// Handles one broker event: an image chunk request is answered, an enrolment request queued
/// for the enrolment worker; anything else is recorded,
/// then the object it concerns is woken (a routine heartbeat waits for the time its proplet's
/// last reconcile chose).
pub fn route_event<C: Cluster>(cluster: &C, event: &BrokerEvent) {
    let common = cluster.common();
    if common.images().is_some_and(|i| i.handle_request(event)) {
        return;
    }
    if common.enrolments.get().is_some_and(|e| e.submit(event)) {
        return;
    }
    if let Some(rotation) = common
        .logins
        .get()
        .and_then(|logins| common.keys.due(logins, &event.client_id))
    {
        crate::key_delivery::KeyDelivery::send(&common.publisher, rotation);
    }
    if let EventKind::Logs(batch) = &event.kind {
        keep_logs(cluster, &event.client_id, batch);
        return;
    }
    let now = Utc::now();
    match common.state.record(event, now) {
        Concerns::Proplet(client_id) => match cluster.proplet_by_client(&client_id) {
            Some(proplet) => {
                let fleet = || cluster.fleet_size();
                let waits =
                    common
                        .state
                        .heartbeat_waits(event, &proplet, &common.proplet, fleet, now);
                if !waits {
                    cluster.wake(Wake::of::<Proplet>(ObjectName::of(proplet.as_ref())));
                }
            }
            None => debug!(client = %client_id, "liveness from a client with no Proplet"),
        },
        Concerns::Task(uid) => wake_task_by_uid(cluster, &uid),
        Concerns::TasksOf(client_id) => {
            if let Some(proplet) = cluster.proplet_by_client(&client_id) {
                wake_tasks_on(cluster, &proplet);
            }
        }
        Concerns::Rejoined(client_id) => {
            if let Some(proplet) = cluster.proplet_by_client(&client_id) {
                cluster.wake(Wake::of::<Proplet>(ObjectName::of(proplet.as_ref())));
                wake_tasks_on(cluster, &proplet);
            }
        }
        Concerns::Upgrade(id) => match rollout_of(&id) {
            Some((namespace, name)) => {
                cluster.wake(Wake::of::<PropletUpgrade>(ObjectName::new(namespace, name)));
            }
            None => debug!(rollout = %id, "an upgrade report naming no rollout"),
        },
        Concerns::Nothing => {}
    }
}

/// Wakes the Task with this UID (a report for it, its image resolved); one not known yet is
/// reconciled when its own watch event comes, and finds what waits for it then.
pub fn wake_task_by_uid<C: CacheReads + Signals>(cluster: &C, uid: &str) {
    match cluster.task_by_uid(uid) {
        Some(task) => {
            let name = ObjectName::of(task.as_ref());
            debug!(task = %name, uid, "woken by a report");
            cluster.wake(Wake::of::<Task>(name));
        }
        None => debug!(task = %uid, "a task not known yet; it waits"),
    }
}

/// Wakes the tasks occupying `proplet`.
fn wake_tasks_on<C: CacheReads + Signals>(cluster: &C, proplet: &Proplet) {
    let namespace = ObjectName::of(proplet).namespace;
    for task in cluster.tasks_on(proplet) {
        cluster.wake(Wake::of::<Task>(ObjectName::new(&namespace, &task)));
    }
}

/// Keeps the lines a device sent for a task it runs; lines for any other task are dropped
/// (the broker already dropped those sent under another device's name).
fn keep_logs<C: Cluster>(cluster: &C, client_id: &str, batch: &TaskLogs) {
    let Some(task) = cluster.task_by_uid(&batch.task_id) else {
        debug!(task_id = %batch.task_id, "task output for a task not known here; dropped");
        return;
    };
    let task = cluster.newest_task(task);
    let Some(proplet) = cluster.proplet_by_client(client_id) else {
        debug!(client = %client_id, "task output from a client with no Proplet; dropped");
        return;
    };
    let (task_name, proplet_name) = (ObjectName::of(&*task), ObjectName::of(&*proplet));
    let runs_it = task_name.namespace == proplet_name.namespace
        && task.status.as_ref().is_some_and(|s| {
            s.assigned_proplet.as_deref() == Some(proplet_name.name.as_str())
                || s.broadcast_proplets.contains(&proplet_name.name)
        });
    if !runs_it {
        warn!(
            client = %client_id,
            task = %task_name,
            "task output from a device the task is not assigned to; dropped"
        );
        return;
    }
    cluster
        .common()
        .logs
        .append(&task_name, &batch.task_id, &proplet_name.name, &batch.lines);
}
