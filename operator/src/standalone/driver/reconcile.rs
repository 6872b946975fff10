//! The Proplet and Task reconciles of standalone mode, and the step that runs any reconcile
//! and queues its next look.

use super::*;

impl Driver {
    /// One reconcile of `key`, in a span named as kube-runtime names its own ("reconciling
    /// object"), so both drivers' logs say which object a line is about.
    #[tracing::instrument(
        name = "reconciling object",
        skip_all,
        fields(object.kind = %key.kind, object.namespace = %key.namespace, object.name = %key.name)
    )]
    pub(super) async fn reconcile(self: &Arc<Self>, key: &Key) {
        let started = std::time::Instant::now();
        let now = Utc::now();
        let result = match key.kind.as_str() {
            PROPLET => self.reconcile_proplet(key, now).await,
            TASK => self.reconcile_task(key, now).await,
            // These reconcilers write through the blocking store calls, which wait for
            // redb's write lock and an `fsync`: keep that off the runtime threads.
            PROPELLER_JOB | FEDERATED_JOB | TRAINING_ROUND => {
                let (driver, key) = (Arc::clone(self), key.clone());
                let span = tracing::Span::current();
                tokio::task::spawn_blocking(move || {
                    span.in_scope(|| driver.reconcile_job(&key, now))
                })
                .await
                .unwrap_or_else(|e| {
                    Err(StoreError::Database(format!("the reconcile did not finish: {e}")).into())
                })
            }
            _ => Ok(None),
        };
        self.metrics
            .observe(&key.kind.to_lowercase(), started.elapsed(), result.is_ok());
        match result {
            Ok(Some(at)) => self.enqueue_at(key.clone(), at, now),
            Ok(None) => {}
            Err(DriverError::Store(StoreError::NotFound { .. })) => {}
            // Someone wrote the object since it was read: read it again now.
            Err(e) if e.is_conflict() => self.enqueue(key.clone()),
            Err(e) => {
                debug!(%e, kind = %key.kind, name = %key.name, "reconcile failed; retrying");
                self.enqueue_at(key.clone(), now + chrono::Duration::seconds(1), now);
            }
        }
    }

    pub(super) async fn reconcile_proplet(
        &self,
        key: &Key,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, DriverError> {
        // The cache holds every durable write; a write that is not durable yet makes this
        // reconcile's conditional write conflict, and it runs again at once.
        let Some(proplet) = self.cache.proplet(&key.namespace, &key.name) else {
            return Ok(None);
        };
        let client_id = proplet.client_id().to_owned();
        let map_key = format!("{}/{}", key.namespace, key.name);
        let version = proplet.metadata.resource_version.as_deref();
        let mut finalizers = proplet.metadata.finalizers.clone().unwrap_or_default();
        if proplet.metadata.deletion_timestamp.is_some() {
            self.state.liveness.forget(&client_id);
            lock(&self.state.proplet_writes).remove(&map_key);
            finalizers.retain(|f| f != PROPLET_FINALIZER);
            self.store
                .set_finalizers_async(PROPLET, &key.namespace, &key.name, finalizers, version)
                .await?;
            // The credential tick revokes its login.
            return Ok(None);
        }
        let mut version = version.map(str::to_owned);
        if !finalizers.iter().any(|f| f == PROPLET_FINALIZER) {
            finalizers.push(PROPLET_FINALIZER.to_owned());
            let updated = self
                .store
                .set_finalizers_async(
                    PROPLET,
                    &key.namespace,
                    &key.name,
                    finalizers,
                    version.as_deref(),
                )
                .await?;
            version = version_of(&updated);
        }
        let observed = PropletObservations {
            external: self.state.liveness.peek(&client_id),
            deployment: None,
            last_write: lock(&self.state.proplet_writes).get(&map_key).copied(),
            report: self.state.liveness.report(&client_id),
            task_count: i64::from(self.cache.load(&key.namespace, &key.name)),
            // The same fleet-wide budget for routine writes as in Kubernetes mode.
            fleet_size: self.cache.proplet_count(),
        };
        let plan = plan_proplet(&proplet, &observed, &self.settings.proplet, now);
        let written = proplet.status.clone().unwrap_or_default();
        if let Some(status) = plan.status.as_ref() {
            let value = serde_json::to_value(status).unwrap_or(Value::Null);
            // Batched: thousands of heartbeating proplets each write every flush interval.
            let updated = self
                .store
                .write_status_batched(
                    PROPLET,
                    &key.namespace,
                    &key.name,
                    value,
                    version.as_deref(),
                )
                .await?;
            self.own_writes.record(PROPLET, &proplet.metadata, &updated);
            self.state
                .liveness
                .clear_written(&client_id, &observed.external);
            lock(&self.state.proplet_writes).insert(map_key, now);
            let before = proplet.status.as_ref().map(|s| s.phase);
            if crate::k8s::proplet::wakes_waiting_tasks(before, status.phase) {
                for task in self.cache.tasks_in(&key.namespace) {
                    let waiting = task
                        .status
                        .as_ref()
                        .is_none_or(|s| s.phase == TaskPhase::Pending);
                    if waiting {
                        self.enqueue(Key::of(TASK, &task.metadata));
                    }
                }
            }
            if written.phase != status.phase {
                info!(proplet = %key.name, phase = %status.phase, "proplet phase");
            }
            if let Some(note) = crate::k8s::proplet::phase_change_note(before, status.phase) {
                self.events
                    .record(PROPLET, &key.namespace, &key.name, &note, now);
            }
        }
        Ok(plan.requeue_at)
    }

    pub(super) async fn reconcile_task(
        &self,
        key: &Key,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, DriverError> {
        let Some(cached) = self.cache.task(&key.namespace, &key.name) else {
            return Ok(None);
        };
        let task: &Task = &cached;
        let proplets = self.cache.proplets_in(&key.namespace);
        let mut observed = observe_indexed(
            task,
            |dep| self.cache.task_phase(&key.namespace, dep),
            || self.cache.dependency_graph(&key.namespace),
            &refs(&proplets),
            |p| {
                self.cache.load(
                    &key.namespace,
                    p.metadata.name.as_deref().unwrap_or_default(),
                )
            },
        );
        self.state.complete(task, &mut observed);
        if awaits_job(task, &observed) {
            observed.job = None;
        }
        let images = self.images.get();
        observed.image = images.and_then(|i| i.observe(task));
        let plan = plan_task(task, &observed, &self.settings.task, now);
        let writer = StoreTasks { store: &self.store };
        let dispatch =
            apply_task(&writer, task, &plan, &self.state.effects(&self.publisher)).await?;
        if plan.resolve_image {
            match images {
                Some(images) => images.resolve(task),
                None => {
                    warn!(task = %key.name, "an OCI imageUrl needs resolving, but no image service is attached")
                }
            }
        }
        if let Some(chosen) = &plan.chosen {
            self.state.chose(&key.namespace, chosen);
        }
        for note in &plan.notes {
            if note.warning {
                warn!(task = %key.name, reason = note.reason, "{}", note.message);
            } else {
                info!(task = %key.name, reason = note.reason, "{}", note.message);
            }
            self.events
                .record(TASK, &key.namespace, &key.name, note, now);
        }
        if let Dispatch::WaitingFor(client) = dispatch {
            debug!(task = %key.name, %client, "start held until the device is heard from");
            return Ok(Some(now + DEVICE_WAIT));
        }
        Ok(plan.requeue_at)
    }
}
