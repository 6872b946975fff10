//! From broker events to reconciles: each event is recorded in the driver state and wakes
//! the reconcile of the object it concerns, never calling the API server itself.

use super::*;

/// Routes broker events into the stores and triggers until the event stream ends.
pub async fn route_events(mut events: UnboundedReceiver<BrokerEvent>, ctx: Arc<Shared>) {
    while let Some(event) = events.recv().await {
        route_event(&event, &ctx);
    }
}

/// The liveness tick: triggers the proplets shown Running whose latest heartbeat (pending
/// or written) is older than the threshold. Each proplet's reconcile already requeues at its
/// own deadline, so this only catches a missed one; reconciling the whole fleet every tick
/// instead queued those deadlines behind 10,000 reconciles (Offline seen 4.5 s late at the
/// median). Returns how many were triggered.
pub fn trigger_overdue(ctx: &Shared, now: chrono::DateTime<Utc>) -> usize {
    let threshold = chrono::Duration::from_std(ctx.settings.proplet.last_seen_threshold)
        .unwrap_or(chrono::Duration::MAX);
    let mut triggered = 0;
    for proplet in ctx.proplets.state() {
        let Some(status) = proplet.status.as_ref() else {
            continue;
        };
        if status.phase != PropletPhase::Running {
            continue;
        }
        let seen = ctx
            .state
            .liveness
            .last_heartbeat(proplet.client_id())
            .max(status.last_seen);
        let overdue = seen
            .and_then(|at| at.checked_add_signed(threshold))
            .is_some_and(|deadline| deadline <= now);
        if overdue {
            let _ = ctx.proplet_trigger.send(ObjectRef::from_obj(&*proplet));
            triggered += 1;
        }
    }
    triggered
}

/// Handles one broker event: record it, then trigger the object it concerns.
pub fn route_event(event: &BrokerEvent, ctx: &Shared) {
    if let Some(images) = &ctx.images {
        if images.handle_request(event) {
            return;
        }
    }
    let now = Utc::now();
    match ctx.state.record(event, now) {
        Concerns::Proplet(client_id) => match ctx.proplet_by_client(&client_id) {
            Some(p) => {
                let fleet = || ctx.clients.read().unwrap_or_else(|e| e.into_inner()).len();
                if !ctx
                    .state
                    .heartbeat_waits(event, &p, &ctx.settings.proplet, fleet, now)
                {
                    let _ = ctx.proplet_trigger.send(ObjectRef::from_obj(&*p));
                }
            }
            None => debug!(client = %client_id, "liveness from a client with no Proplet"),
        },
        Concerns::Task(uid) => trigger_task(ctx, &uid),
        Concerns::TasksOf(client_id) => trigger_tasks_of(ctx, &client_id),
        Concerns::Rejoined(client_id) => {
            if let Some(p) = ctx.proplet_by_client(&client_id) {
                let _ = ctx.proplet_trigger.send(ObjectRef::from_obj(&*p));
            }
            trigger_tasks_of(ctx, &client_id);
        }
        Concerns::Nothing => {}
    }
}

/// Triggers the tasks that occupy the proplet with MQTT client id `client_id`.
pub(super) fn trigger_tasks_of(ctx: &Shared, client_id: &str) {
    if let Some(p) = ctx.proplet_by_client(client_id) {
        let name = p.name_any();
        for task in ctx.tasks.state() {
            if task.namespace() == p.namespace() && crate::decision::task::occupies(&task, &name) {
                let _ = ctx.task_trigger.send(ObjectRef::from_obj(&*task));
            }
        }
    }
}

/// Forgets remembered writes the cache has caught up with, or whose object is gone (a
/// reconcile forgets its own entry, but a deleted object is not reconciled again).
pub fn prune_echoes(ctx: &Shared) {
    lock(&ctx.task_echo).retain(|key, writes| {
        let Some((ns, name)) = key.split_once('/') else {
            return false;
        };
        ctx.tasks
            .get(&ObjectRef::new(name).within(ns))
            .and_then(|t| t.metadata.resource_version.clone())
            .is_some_and(|v| writes.superseded.contains(&v))
    });
    lock(&ctx.proplet_echo).retain(|key, written| {
        let Some((ns, name)) = key.split_once('/') else {
            return false;
        };
        ctx.proplets
            .get(&ObjectRef::new(name).within(ns))
            .is_some_and(|p| p.metadata.resource_version == written.based_on)
    });
}

/// Sets the per-phase gauges from the caches.
pub fn count_phases(ctx: &Shared) {
    let proplets = ctx.proplets.state();
    let tasks = ctx.tasks.state();
    ctx.metrics
        .count_phases(proplets.iter().map(|p| &**p), tasks.iter().map(|t| &**t));
}

pub(super) fn trigger_task(ctx: &Shared, uid: &str) {
    match ctx.task_by_uid(uid) {
        Some(task) => {
            let _ = ctx.task_trigger.send(ObjectRef::from_obj(&*task));
        }
        None => debug!(task = %uid, "report for a task not in the cache yet; it waits"),
    }
}
