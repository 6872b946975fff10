//! The Proplet and Task reconciles of Kubernetes mode: read the caches and the driver
//! state, plan with the core, apply through the API server; and the error policy.

use super::*;

/// Reconciles one Proplet (what the controller calls).
pub async fn reconcile_proplet(
    proplet: Arc<Proplet>,
    ctx: Arc<Shared>,
) -> Result<Action, ReconcileError> {
    let started = Instant::now();
    let result = reconcile_proplet_inner(&proplet, &ctx).await;
    ctx.metrics
        .observe("proplet", started.elapsed(), result.is_ok());
    result
}

pub(super) async fn reconcile_proplet_inner(
    proplet: &Proplet,
    ctx: &Arc<Shared>,
) -> Result<Action, ReconcileError> {
    let ns = proplet.namespace().unwrap_or_else(|| "default".into());
    let name = proplet.name_any();
    let key = format!("{ns}/{name}");
    let api: Api<Proplet> = Api::namespaced(ctx.client.clone(), &ns);
    let client_id = proplet.client_id().to_owned();
    let mut finalizers = proplet.finalizers().to_vec();
    let has_finalizer = finalizers.iter().any(|f| f == PROPLET_FINALIZER);
    if proplet.metadata.deletion_timestamp.is_some() {
        // The credential tick drops its login (the gate sees the deletion).
        ctx.state.liveness.forget(&client_id);
        lock(&ctx.state.proplet_writes).remove(&key);
        lock(&ctx.proplet_echo).remove(&key);
        if has_finalizer {
            finalizers.retain(|f| f != PROPLET_FINALIZER);
            api.patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(finalizers_patch(
                    &finalizers,
                    proplet.metadata.resource_version.as_deref(),
                )),
            )
            .await?;
        }
        return Ok(Action::await_change());
    }
    let mut proplet = proplet.clone();
    if !has_finalizer {
        finalizers.push(PROPLET_FINALIZER.to_owned());
        proplet = api
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(finalizers_patch(
                    &finalizers,
                    proplet.metadata.resource_version.as_deref(),
                )),
            )
            .await?;
    }
    let proplet = ctx.newest(&key, proplet);
    let now = Utc::now();
    let deployment_ref =
        ObjectRef::<Deployment>::new(&crate::decision::names::proplet_deployment_name(&name))
            .within(&ns);
    let observed = PropletObservations {
        external: ctx.state.liveness.peek(&client_id),
        deployment: ctx
            .deployments
            .get(&deployment_ref)
            .map(|d| observe_deployment(&d)),
        last_write: lock(&ctx.state.proplet_writes).get(&key).copied(),
        report: ctx.state.liveness.report(&client_id),
        task_count: i64::from(ctx.active_tasks(&proplet)),
        fleet_size: ctx.clients.read().unwrap_or_else(|e| e.into_inner()).len(),
    };
    let plan = plan_proplet(&proplet, &observed, &ctx.settings.proplet, now);
    if let Some(problem) = &plan.problem {
        ctx.note(
            &proplet.object_ref(&()),
            &Note {
                warning: true,
                reason: "InvalidDeployment",
                message: problem.to_string(),
            },
        )
        .await;
    }
    let written = apply_proplet(&ctx.client, &proplet, &plan).await?;
    if let Some(written) = written {
        lock(&ctx.proplet_echo).insert(
            key.clone(),
            WrittenStatus {
                based_on: proplet.metadata.resource_version.clone(),
                version: written.metadata.resource_version,
                status: written.status,
            },
        );
    }
    if let Some(status) = &plan.status {
        ctx.state
            .liveness
            .clear_written(&client_id, &observed.external);
        lock(&ctx.state.proplet_writes).insert(key, now);
        let before = proplet.status.as_ref().map(|s| s.phase);
        let fell_silent = status.phase == PropletPhase::Offline
            && before == Some(PropletPhase::Running)
            && observed.external.offline_at.is_none();
        if let (true, Some(seen)) = (fell_silent, status.last_seen) {
            let threshold = chrono::Duration::from_std(ctx.settings.proplet.last_seen_threshold)
                .unwrap_or(chrono::Duration::MAX);
            if let Some(deadline) = seen.checked_add_signed(threshold) {
                let late = |at: chrono::DateTime<Utc>| (at - deadline).as_seconds_f64();
                ctx.metrics.observe_offline(late(now), late(Utc::now()));
            }
        }
        if crate::k8s::proplet::wakes_waiting_tasks(before, status.phase) {
            for task in ctx.tasks.state() {
                let waiting = task
                    .status
                    .as_ref()
                    .is_none_or(|s| s.phase == TaskPhase::Pending);
                if task.namespace().as_deref() == Some(ns.as_str()) && waiting {
                    let _ = ctx.task_trigger.send(ObjectRef::from_obj(&*task));
                }
            }
        }
        if let Some(note) = crate::k8s::proplet::phase_change_note(before, status.phase) {
            ctx.note_in_background(proplet.object_ref(&()), note);
        }
    }
    let wait = plan
        .requeue_at
        .and_then(|at| (at - now).to_std().ok())
        .map_or(RESYNC, |d| d.min(RESYNC) + Duration::from_millis(100));
    Ok(Action::requeue(wait))
}

/// How often a task whose start waits for its device looks again.
pub(super) const DEVICE_WAIT: Duration = Duration::from_secs(1);

/// Reconciles one Task (what the controller calls).
pub async fn reconcile_task(task: Arc<Task>, ctx: Arc<Shared>) -> Result<Action, ReconcileError> {
    let started = Instant::now();
    let task = ctx.newest_task(task);
    let result = reconcile_task_inner(&task, &ctx).await;
    ctx.metrics
        .observe("task", started.elapsed(), result.is_ok());
    result
}

pub(super) async fn reconcile_task_inner(
    task: &Task,
    ctx: &Shared,
) -> Result<Action, ReconcileError> {
    let ns = task.namespace().unwrap_or_else(|| "default".into());
    let all_tasks = ctx.tasks.state();
    let task_refs: Vec<&Task> = all_tasks.iter().map(|t| &**t).collect();
    let proplet_cache = ctx.proplets.state();
    let proplet_refs: Vec<&Proplet> = proplet_cache.iter().map(|p| &**p).collect();
    let mut observed = observe_caches(task, &task_refs, &proplet_refs);
    ctx.state.complete(task, &mut observed);
    observed.image = ctx.images.as_ref().and_then(|i| i.observe(task));
    if awaits_job(task, &observed) {
        observed.job = crate::k8s::task_job::observe(&ctx.client, task).await?;
    }
    let now = Utc::now();
    let plan = plan_task(task, &observed, &ctx.settings.task, now);
    let (dispatch, writes) =
        apply_task(&ctx.client, task, &plan, &ctx.state.effects(&ctx.publisher)).await?;
    if let Some(writes) = writes {
        ctx.remember_task_writes(task, writes);
    }
    if plan.resolve_image {
        match &ctx.images {
            Some(images) => images.resolve(task),
            None => {
                warn!(task = %task.name_any(), "an OCI imageUrl needs resolving, but this operator serves no images")
            }
        }
    }
    if let Some(chosen) = &plan.chosen {
        ctx.state.chose(&ns, chosen);
    }
    let reference = task.object_ref(&());
    for note in &plan.notes {
        ctx.note(&reference, note).await;
    }
    // Also when the cached object is already terminal (its own watch event): a dependent
    // triggered right after the write may have read the cache before it had the new phase.
    let finished = plan
        .status
        .as_ref()
        .or(task.status.as_ref())
        .is_some_and(|s| s.phase.is_terminal());
    if finished {
        // Dependents may run now, and the proplet has one task less.
        let name = task.name_any();
        for other in &all_tasks {
            if other.namespace().as_deref() == Some(ns.as_str())
                && other.spec.depends_on.contains(&name)
            {
                let _ = ctx.task_trigger.send(ObjectRef::from_obj(&**other));
            }
        }
    }
    if plan.status.is_some() {
        for proplet in observed.proplets.iter().filter(|p| {
            plan.starts.iter().any(|s| s.proplet == p.candidate.name)
                || task.status.as_ref().is_some_and(|s| {
                    s.assigned_proplet.as_deref() == Some(p.candidate.name.as_str())
                })
        }) {
            let _ = ctx
                .proplet_trigger
                .send(ObjectRef::new(&proplet.candidate.name).within(&ns));
        }
    }
    if let Dispatch::WaitingFor(client) = dispatch {
        debug!(task = %task.name_any(), %client, "start held until the device is heard from");
        return Ok(Action::requeue(DEVICE_WAIT));
    }
    let wait = plan
        .requeue_at
        .and_then(|at| (at - now).to_std().ok())
        .map_or(RESYNC, |d| d.min(RESYNC) + Duration::from_millis(100));
    Ok(Action::requeue(wait))
}

impl ReconcileError {
    /// Whether the API server refused a write because the object changed since it was read
    /// (409 Conflict): routine under load, answered by reading it again.
    pub(super) fn is_conflict(&self) -> bool {
        let conflict =
            |e: &kube::Error| matches!(e, kube::Error::Api(status) if status.code == 409);
        match self {
            ReconcileError::Api(e) => conflict(e),
            ReconcileError::Task(TaskApplyError::Backend(e)) => {
                e.downcast_ref::<kube::Error>().is_some_and(conflict)
            }
            ReconcileError::Task(_) => false,
        }
    }
}

pub(super) fn error_policy<K: kube::Resource>(
    object: Arc<K>,
    error: &ReconcileError,
    _: Arc<Shared>,
) -> Action {
    let name = object.meta().name.as_deref().unwrap_or_default();
    if error.is_conflict() {
        debug!(object = %name, "the object changed while it was reconciled; reconciling it again");
        return Action::requeue(Duration::from_millis(200));
    }
    warn!(object = %name, %error, "reconcile failed; retrying in 2 s");
    Action::requeue(Duration::from_secs(2))
}
