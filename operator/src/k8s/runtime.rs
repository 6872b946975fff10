//! The Kubernetes driver at run time: a kube-rs `Controller` per kind, the broker's events
//! turned into reconcile triggers, and the state the reconcilers share.
//!
//! The MQTT side never calls the API server. The event router records what a device said
//! (liveness, results, metrics) in in-memory stores and names the object whose reconcile
//! should run; the reconcile reads the stores, plans, writes, and only then forgets what it
//! wrote. A result for a Task the cache does not know yet waits in the inbox until the Task
//! appears, when its own watch event reconciles it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Client, Resource, ResourceExt};
use propeller_broker::server::{BrokerEvent, CredentialStore, EventKind, Publisher};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tracing::{debug, info, warn};

use crate::crd::federated::{FederatedJob, TrainingRound};
use crate::crd::job::PropellerJob;
use crate::crd::proplet::{Proplet, PropletPhase};
use crate::crd::task::{Task, TaskPhase};
use crate::decision::liveness::DeploymentObservation;
use crate::decision::task::{
    active_tasks, awaits_job, observe_caches, plan as plan_task, Note, TaskSettings,
};
use crate::executor::Dispatch;
use crate::state::{lock, Concerns, DriverState};

use super::deployment::PROPLET_LABEL;
use super::patch::finalizers_patch;
use super::proplet::{
    apply as apply_proplet, plan as plan_proplet, PropletObservations, PropletSettings,
};
use super::task::{apply as apply_task, TaskWrites};
use crate::credentials::{credential_table, RefreshGate};
use crate::executor::TaskApplyError;
use crate::metrics::ControllerMetrics;
use crate::oci::Images;

/// Finalizer that lets the operator revoke a deleted Proplet's broker login.
pub const PROPLET_FINALIZER: &str = "propeller.propeller.absmach.eu/proplet-cleanup";

/// How often an object is looked at again with no event at all.
pub const RESYNC: Duration = Duration::from_secs(300);
/// How long the controllers may finish their reconciles after the stop signal.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Settings of the Kubernetes driver.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Watch only this namespace; every namespace when `None`.
    pub watch_namespace: Option<String>,
    /// Proplet plan settings.
    pub proplet: PropletSettings,
    /// Task plan settings.
    pub task: TaskSettings,
}

/// Why a reconcile failed; the controller retries with backoff.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// An API call failed.
    #[error(transparent)]
    Api(#[from] kube::Error),
    /// Applying a Task plan failed.
    #[error(transparent)]
    Task(#[from] TaskApplyError),
}

/// State shared by the reconcilers and the event router.
pub struct Shared {
    /// API client.
    pub client: Client,
    /// Driver settings.
    pub settings: Settings,
    /// Sends commands to devices.
    pub publisher: Publisher,
    /// Device reports not yet written, starts sent, scheduler rotation.
    pub state: DriverState,
    /// When the credential table needs rebuilding.
    pub credential_gate: RefreshGate,
    /// Cached Proplets.
    pub proplets: Store<Proplet>,
    /// Cached Tasks.
    pub tasks: Store<Task>,
    /// Cached Tasks that PropellerJobs created: filled by the watch that wakes their
    /// reconciles, so a reconcile sees the change that woke it.
    pub job_tasks: Store<Task>,
    /// Cached Tasks that TrainingRounds created, the same way.
    pub round_tasks: Store<Task>,
    /// Cached proplet Deployments.
    pub deployments: Store<Deployment>,
    /// Cached Secrets (proplet keys are read from here, never fetched one by one).
    pub secrets: Store<Secret>,
    /// Proplet of each MQTT client id, rebuilt with the credential table, so a heartbeat
    /// finds its Proplet without scanning all of them.
    clients: std::sync::RwLock<HashMap<String, ObjectRef<Proplet>>>,
    /// Broker logins derived from Proplets.
    pub credentials: Arc<CredentialStore>,
    /// Emits Kubernetes Events.
    pub recorder: Recorder,
    /// Asks the Task controller to reconcile a task.
    pub task_trigger: UnboundedSender<ObjectRef<Task>>,
    /// Asks the Proplet controller to reconcile a proplet.
    pub proplet_trigger: UnboundedSender<ObjectRef<Proplet>>,
    /// Asks the TrainingRound controller to reconcile a round.
    pub round_trigger: UnboundedSender<ObjectRef<TrainingRound>>,
    /// Reconcile counters.
    pub metrics: Arc<ControllerMetrics>,
    /// Registry resolution and chunk serving (`None`: OCI images are not served).
    pub images: Option<Arc<Images>>,
    /// What each Proplet's last status write returned, until the cache shows it.
    proplet_echo: std::sync::Mutex<HashMap<String, WrittenStatus>>,
    /// What the last apply wrote to each Task, until the cache shows it.
    task_echo: std::sync::Mutex<HashMap<String, TaskWrites>>,
    /// Bounds the Events published off the reconcile path (each is an API call, and
    /// kube's client opens a connection per concurrent call).
    background_events: Arc<tokio::sync::Semaphore>,
}

/// A Proplet status write the cache may not show yet.
struct WrittenStatus {
    /// The version the write was planned from: a cached object still at this version has
    /// not seen the write.
    based_on: Option<String>,
    /// The version the write produced.
    version: Option<String>,
    /// The status as written.
    status: Option<crate::crd::proplet::PropletStatus>,
}

/// Events published at once off the reconcile path.
const BACKGROUND_EVENTS: usize = 4;

fn scoped<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// The readiness figures of a proplet's Deployment.
pub fn observe_deployment(d: &Deployment) -> DeploymentObservation {
    let status = d.status.clone().unwrap_or_default();
    let condition = |type_: &str| {
        status
            .conditions
            .as_ref()
            .and_then(|cs| cs.iter().find(|c| c.type_ == type_))
            .map(|c| c.status == "True")
    };
    DeploymentObservation {
        exists: true,
        desired: d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1),
        replicas: status.replicas.unwrap_or(0),
        ready: status.ready_replicas.unwrap_or(0),
        available: status.available_replicas.unwrap_or(0),
        available_condition: condition("Available"),
        stalled: condition("Progressing") == Some(false),
    }
}

/// The caches a [`Shared`] reads.
pub struct Caches {
    /// Proplets.
    pub proplets: Store<Proplet>,
    /// Tasks.
    pub tasks: Store<Task>,
    /// Tasks carrying a PropellerJob's label.
    pub job_tasks: Store<Task>,
    /// Tasks carrying a TrainingRound's label.
    pub round_tasks: Store<Task>,
    /// Proplet Deployments.
    pub deployments: Store<Deployment>,
    /// Secrets (proplet keys).
    pub secrets: Store<Secret>,
}

/// The receiving ends of the reconcile triggers.
pub struct Triggers {
    /// Tasks to reconcile.
    pub tasks: UnboundedReceiver<ObjectRef<Task>>,
    /// Proplets to reconcile.
    pub proplets: UnboundedReceiver<ObjectRef<Proplet>>,
    /// Rounds to reconcile.
    pub rounds: UnboundedReceiver<ObjectRef<TrainingRound>>,
}

impl Shared {
    /// Fresh shared state over `caches`, with empty stores and new trigger channels.
    pub fn new(
        client: Client,
        settings: Settings,
        publisher: Publisher,
        credentials: Arc<CredentialStore>,
        metrics: Arc<ControllerMetrics>,
        reporter: Option<String>,
        caches: Caches,
    ) -> (Self, Triggers) {
        let (task_tx, task_rx) = unbounded_channel();
        let (proplet_tx, proplet_rx) = unbounded_channel();
        let (round_tx, round_rx) = unbounded_channel();
        let shared = Shared {
            recorder: Recorder::new(
                client.clone(),
                Reporter {
                    controller: "propeller".into(),
                    instance: reporter,
                },
            ),
            client,
            settings,
            publisher,
            state: DriverState::new(),
            credential_gate: RefreshGate::default(),
            proplets: caches.proplets,
            tasks: caches.tasks,
            job_tasks: caches.job_tasks,
            round_tasks: caches.round_tasks,
            deployments: caches.deployments,
            secrets: caches.secrets,
            clients: std::sync::RwLock::new(HashMap::new()),
            credentials,
            task_trigger: task_tx,
            proplet_trigger: proplet_tx,
            round_trigger: round_tx,
            metrics,
            images: None,
            proplet_echo: std::sync::Mutex::new(HashMap::new()),
            task_echo: std::sync::Mutex::new(HashMap::new()),
            background_events: Arc::new(tokio::sync::Semaphore::new(BACKGROUND_EVENTS)),
        };
        let triggers = Triggers {
            tasks: task_rx,
            proplets: proplet_rx,
            rounds: round_rx,
        };
        (shared, triggers)
    }

    fn active_tasks(&self, proplet: &Proplet) -> u32 {
        let tasks = self.tasks.state();
        active_tasks(proplet, tasks.iter().map(|t| &**t))
    }

    fn proplet_by_client(&self, client_id: &str) -> Option<Arc<Proplet>> {
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

    fn task_by_uid(&self, uid: &str) -> Option<Arc<Task>> {
        self.tasks.find(|t| t.metadata.uid.as_deref() == Some(uid))
    }

    async fn note(&self, reference: &k8s_openapi::api::core::v1::ObjectReference, note: &Note) {
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
        if let Err(e) = self.recorder.publish(&event, reference).await {
            debug!(%e, reason = note.reason, "could not record an event");
        }
    }

    /// Records `note` without holding up the caller: the Event is published by a task of its
    /// own, at most [`BACKGROUND_EVENTS`] at once. A proplet's phase change is written first
    /// and its Event follows, so 1,000 proplets going Offline together are not each held
    /// for two API calls.
    fn note_in_background(
        self: &Arc<Self>,
        reference: k8s_openapi::api::core::v1::ObjectReference,
        note: Note,
    ) {
        let ctx = self.clone();
        tokio::spawn(async move {
            let Ok(_slot) = ctx.background_events.clone().acquire_owned().await else {
                return;
            };
            ctx.note(&reference, &note).await;
        });
    }

    /// The cached `proplet`, or, when the cache has not yet seen this driver's last status
    /// write to it, the cached object with that write's status and version. Without this,
    /// a reconcile right after a write planned from the old status and wrote (and noted)
    /// the same change again.
    fn newest(&self, key: &str, proplet: Proplet) -> Proplet {
        let mut echo = lock(&self.proplet_echo);
        match echo.get(key) {
            Some(w) if w.based_on == proplet.metadata.resource_version => {
                let mut newer = proplet;
                newer.metadata.resource_version = w.version.clone();
                newer.status = w.status.clone();
                newer
            }
            Some(_) => {
                echo.remove(key);
                proplet
            }
            None => proplet,
        }
    }

    /// The cached `task`, or what this driver last wrote to it when the cache still shows a
    /// version those writes replaced.
    fn newest_task(&self, task: Arc<Task>) -> Arc<Task> {
        let key = object_key(&*task);
        let mut echo = lock(&self.task_echo);
        let Some(writes) = echo.get(&key) else {
            return task;
        };
        let cached = task.metadata.resource_version.as_deref();
        if cached.is_some_and(|v| writes.superseded.iter().any(|s| s == v))
            && writes.latest.metadata.uid == task.metadata.uid
        {
            return Arc::new(writes.latest.clone());
        }
        echo.remove(&key);
        task
    }

    fn remember_task_writes(&self, task: &Task, writes: TaskWrites) {
        let key = object_key(task);
        lock(&self.task_echo).insert(key, writes);
    }

    /// Rebuilds the broker's credential table and the client index from the cached
    /// Proplets and Secrets, when either changed (or at least every [`RESYNC`]).
    pub fn refresh_credentials(&self) {
        let cached = self.proplets.state();
        if !self
            .credential_gate
            .due(cached.iter().map(|p| &**p), RESYNC)
        {
            return;
        }
        let proplets: Vec<Proplet> = cached
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .map(|p| (**p).clone())
            .collect();
        let read = |ns: &str, name: &str, key: &str| {
            let secret = self.secrets.get(&ObjectRef::new(name).within(ns))?;
            crate::credentials::secret_entry(&secret, key)
        };
        let (table, problems) = credential_table(&proplets, read);
        for problem in problems {
            warn!(proplet = %problem.proplet, "{}", problem.message);
        }
        self.credentials.replace_all(table);
        let index = proplets
            .iter()
            .map(|p| (p.client_id().to_owned(), ObjectRef::from_obj(p)))
            .collect();
        *self.clients.write().unwrap_or_else(|e| e.into_inner()) = index;
    }
}

/// `namespace/name`: how the driver's per-object memories are keyed.
fn object_key(object: &impl ResourceExt) -> String {
    format!(
        "{}/{}",
        object.namespace().unwrap_or_else(|| "default".into()),
        object.name_any()
    )
}

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

async fn reconcile_proplet_inner(
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
        if super::proplet::wakes_waiting_tasks(before, status.phase) {
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
        if let Some(note) = super::proplet::phase_change_note(before, status.phase) {
            ctx.note_in_background(proplet.object_ref(&()), note);
        }
    }
    let wait = plan
        .requeue_at
        .and_then(|at| (at - now).to_std().ok())
        .map_or(RESYNC, |d| d.min(RESYNC) + Duration::from_millis(100));
    Ok(Action::requeue(wait))
}

/// How often the credential table is rebuilt when Proplets or Secrets changed: a new
/// device can log in this long after its Proplet is stored, and a burst of new Proplets
/// costs one rebuild per tick, not one per Proplet.
const CREDENTIAL_TICK: Duration = Duration::from_millis(100);

/// Reconciles of one kind that run at once. kube's client speaks HTTP/1.1, so every
/// concurrent API call is a TLS connection of its own: unbounded, a resync of 10,000
/// Proplets opened thousands (handshakes on both sides, descriptors exhausted).
const RECONCILE_CONCURRENCY: u16 = 32;

fn bounded() -> kube::runtime::controller::Config {
    kube::runtime::controller::Config::default().concurrency(RECONCILE_CONCURRENCY)
}

/// How often a task whose start waits for its device looks again.
const DEVICE_WAIT: Duration = Duration::from_secs(1);

/// Reconciles one Task (what the controller calls).
pub async fn reconcile_task(task: Arc<Task>, ctx: Arc<Shared>) -> Result<Action, ReconcileError> {
    let started = Instant::now();
    let task = ctx.newest_task(task);
    let result = reconcile_task_inner(&task, &ctx).await;
    ctx.metrics
        .observe("task", started.elapsed(), result.is_ok());
    result
}

async fn reconcile_task_inner(task: &Task, ctx: &Shared) -> Result<Action, ReconcileError> {
    let ns = task.namespace().unwrap_or_else(|| "default".into());
    let all_tasks = ctx.tasks.state();
    let task_refs: Vec<&Task> = all_tasks.iter().map(|t| &**t).collect();
    let proplet_cache = ctx.proplets.state();
    let proplet_refs: Vec<&Proplet> = proplet_cache.iter().map(|p| &**p).collect();
    let mut observed = observe_caches(task, &task_refs, &proplet_refs);
    ctx.state.complete(task, &mut observed);
    observed.image = ctx.images.as_ref().and_then(|i| i.observe(task));
    if awaits_job(task, &observed) {
        observed.job = super::task_job::observe(&ctx.client, task).await?;
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
    fn is_conflict(&self) -> bool {
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

fn error_policy<K: kube::Resource>(
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
                let heartbeat = matches!(event.kind, EventKind::Heartbeat(_));
                let fleet = ctx.clients.read().unwrap_or_else(|e| e.into_inner()).len();
                let routine = ctx.settings.proplet.routine_interval(fleet);
                if !(heartbeat && ctx.state.heartbeat_waits(&p, &client_id, routine, now)) {
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
fn trigger_tasks_of(ctx: &Shared, client_id: &str) {
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

fn trigger_task(ctx: &Shared, uid: &str) {
    match ctx.task_by_uid(uid) {
        Some(task) => {
            let _ = ctx.task_trigger.send(ObjectRef::from_obj(&*task));
        }
        None => debug!(task = %uid, "report for a task not in the cache yet; it waits"),
    }
}

/// Everything `run` needs from the caller.
pub struct Runtime {
    /// API client.
    pub client: Client,
    /// Driver settings.
    pub settings: Settings,
    /// The embedded broker's publisher.
    pub publisher: Publisher,
    /// The embedded broker's events.
    pub events: UnboundedReceiver<BrokerEvent>,
    /// The credential store the broker consults for proplets.
    pub credentials: Arc<CredentialStore>,
    /// Reconcile counters.
    pub metrics: Arc<ControllerMetrics>,
    /// Name reported on Events.
    pub reporter: String,
    /// How often every proplet is re-evaluated without events (the liveliness interval).
    pub resync: Duration,
    /// Registry resolution and chunk serving.
    pub images: Option<Arc<Images>>,
}

/// The Tasks carrying `label`: a cache, and the stream of changes (already applied to that
/// cache) for the controller that owns them.
fn labelled_tasks(
    client: &Client,
    namespace: Option<&str>,
    label: &str,
) -> (
    Store<Task>,
    impl futures::Stream<Item = Result<Task, watcher::Error>> + Send + 'static,
) {
    let (reader, writer) = reflector::store::<Task>();
    let events = reflector::reflector(
        writer,
        watcher(
            scoped::<Task>(client, namespace),
            watcher::Config::default().labels(label),
        ),
    )
    .touched_objects()
    .default_backoff();
    (reader, events)
}

/// Runs the Proplet and Task controllers and the event router until `shutdown` resolves.
pub async fn run(
    rt: Runtime,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + Clone + 'static,
) {
    let ns = rt.settings.watch_namespace.clone();
    let client = rt.client.clone();
    let (deployment_reader, deployment_writer) = reflector::store::<Deployment>();
    let deployment_stream = reflector::reflector(
        deployment_writer,
        watcher(
            scoped::<Deployment>(&client, ns.as_deref()),
            watcher::Config::default().labels(PROPLET_LABEL),
        ),
    )
    .applied_objects()
    .default_backoff();
    // Proplet keys come from a watched Secret cache: reading each Secret whenever the
    // Proplet set changed cost N GETs per new Proplet.
    let (secret_reader, secret_writer) = reflector::store::<Secret>();
    let secret_stream = reflector::reflector(
        secret_writer,
        watcher(
            scoped::<Secret>(&client, ns.as_deref()),
            watcher::Config::default(),
        ),
    )
    .default_backoff();
    let proplet_controller = Controller::new(
        scoped::<Proplet>(&client, ns.as_deref()),
        watcher::Config::default(),
    )
    .with_config(bounded())
    .owns_stream(deployment_stream);
    // A task on a `k8s` proplet finishes when its Job does: the Job's changes (it is owned
    // by the Task) wake the Task's reconcile.
    let task_controller = Controller::new(
        scoped::<Task>(&client, ns.as_deref()),
        watcher::Config::default(),
    )
    .with_config(bounded())
    .owns(
        scoped::<Job>(&client, ns.as_deref()),
        watcher::Config::default().labels(super::task_job::TASK_LABEL),
    );
    // A job's or round's reconcile reads its Tasks from the cache of the watch that woke it.
    // Read from the Task controller's cache instead, a reconcile woken by a Task's completion
    // could run before that other watch delivered it, plan from the Task still running, and
    // wait for the next resync (a round stayed at 1 of 2 updates for minutes).
    let (job_tasks, job_task_events) = labelled_tasks(
        &client,
        ns.as_deref(),
        crate::decision::propeller_job::JOB_LABEL,
    );
    let (round_tasks, round_task_events) = labelled_tasks(
        &client,
        ns.as_deref(),
        crate::decision::federated::ROUND_LABEL,
    );
    let caches = Caches {
        proplets: proplet_controller.store(),
        tasks: task_controller.store(),
        job_tasks,
        round_tasks,
        deployments: deployment_reader,
        secrets: secret_reader,
    };
    let (shared, triggers) = Shared::new(
        client.clone(),
        rt.settings,
        rt.publisher,
        rt.credentials,
        rt.metrics,
        Some(rt.reporter),
        caches,
    );
    let mut shared = shared;
    shared.images = rt.images;
    let shared = Arc::new(shared);
    if let Some(images) = &shared.images {
        let weak = Arc::downgrade(&shared);
        images.on_resolved(move |uid| {
            if let Some(shared) = weak.upgrade() {
                trigger_task(&shared, uid);
            }
        });
    }
    let router = tokio::spawn(route_events(rt.events, shared.clone()));
    let secrets = {
        let shared = shared.clone();
        tokio::spawn(async move {
            let mut events = std::pin::pin!(secret_stream);
            while let Some(event) = events.next().await {
                match event {
                    Ok(_) => shared.credential_gate.invalidate(),
                    Err(e) => warn!(%e, "watching Secrets"),
                }
            }
        })
    };
    let credential_tick = {
        let shared = shared.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(CREDENTIAL_TICK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                shared.refresh_credentials();
            }
        })
    };
    let gauges = {
        let shared = shared.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                count_phases(&shared);
                prune_echoes(&shared);
            }
        })
    };
    let liveness_tick = {
        let shared = shared.clone();
        let every = rt.resync.max(Duration::from_secs(1));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                trigger_overdue(&shared, Utc::now());
            }
        })
    };
    // The whole fleet is reconciled only at the slow resync: a safety net, not the way
    // liveness is kept.
    let ticks = futures::stream::unfold(tokio::time::interval(RESYNC), |mut tick| async move {
        tick.tick().await;
        Some(((), tick))
    });
    let proplets = proplet_controller
        .reconcile_on(tokio_stream_of(triggers.proplets))
        .reconcile_all_on(ticks)
        .graceful_shutdown_on(shutdown.clone())
        .run(reconcile_proplet, error_policy, shared.clone());
    let tasks = task_controller
        .reconcile_on(tokio_stream_of(triggers.tasks))
        .graceful_shutdown_on(shutdown.clone())
        .run(reconcile_task, error_policy, shared.clone());
    let jobs = Controller::new(
        scoped::<PropellerJob>(&client, ns.as_deref()),
        watcher::Config::default(),
    )
    .with_config(bounded())
    // Only the Tasks a job created (they carry its label): every other Task's writes would
    // be sent to this watch too, for nothing.
    .owns_stream(job_task_events)
    .graceful_shutdown_on(shutdown.clone())
    .run(
        super::jobs::reconcile_propeller_job,
        error_policy,
        shared.clone(),
    );
    let federated = Controller::new(
        scoped::<FederatedJob>(&client, ns.as_deref()),
        watcher::Config::default(),
    )
    .with_config(bounded())
    .owns(
        scoped::<TrainingRound>(&client, ns.as_deref()),
        watcher::Config::default(),
    )
    .graceful_shutdown_on(shutdown.clone())
    .run(
        super::jobs::reconcile_federated_job,
        error_policy,
        shared.clone(),
    );
    let rounds = Controller::new(
        scoped::<TrainingRound>(&client, ns.as_deref()),
        watcher::Config::default(),
    )
    .with_config(bounded())
    .owns_stream(round_task_events)
    .reconcile_on(tokio_stream_of(triggers.rounds))
    .graceful_shutdown_on(shutdown.clone())
    .run(
        super::jobs::reconcile_training_round,
        error_policy,
        shared.clone(),
    );
    info!("controllers running");
    let controllers = async {
        tokio::join!(
            drive(proplets, "proplet"),
            drive(tasks, "task"),
            drive(jobs, "propellerjob"),
            drive(federated, "federatedjob"),
            drive(rounds, "traininground"),
        )
    };
    // A controller whose caches never filled (the API server unreachable since the start)
    // holds its queued work until they do, and its graceful shutdown with it: past the grace
    // period the process stops anyway, well inside a pod's termination grace period.
    let overdue = async {
        shutdown.clone().await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    tokio::select! {
        _ = controllers => {}
        _ = overdue => warn!(
            grace = ?SHUTDOWN_GRACE,
            "controllers still busy after the stop signal (is the API server reachable?); stopping anyway"
        ),
    }
    router.abort();
    secrets.abort();
    credential_tick.abort();
    liveness_tick.abort();
    gauges.abort();
    info!("controllers stopped");
}

/// Runs a controller's stream to its end. Failed reconciles were already logged and
/// retried by `error_policy`; what reaches here (watch errors included) is logged at debug.
async fn drive<T, E: std::fmt::Display>(
    stream: impl futures::Stream<Item = Result<T, E>>,
    controller: &'static str,
) {
    stream
        .for_each(|r| async move {
            if let Err(e) = r {
                debug!(%e, controller, "controller stream");
            }
        })
        .await;
}

fn tokio_stream_of<T: Send + 'static>(
    rx: UnboundedReceiver<T>,
) -> impl futures::Stream<Item = T> + Send {
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16) -> kube::Error {
        let status: kube::core::Status =
            serde_json::from_value(serde_json::json!({"code": code, "reason": "Conflict"}))
                .unwrap_or_else(|e| panic!("{e}"));
        kube::Error::Api(Box::new(status))
    }

    #[test]
    fn a_conflict_is_told_apart_from_other_failures_however_it_arrives() {
        assert!(ReconcileError::Api(api_error(409)).is_conflict());
        assert!(!ReconcileError::Api(api_error(500)).is_conflict());
        let through_a_plan =
            ReconcileError::Task(TaskApplyError::Backend(Box::new(api_error(409))));
        assert!(through_a_plan.is_conflict());
        assert!(!ReconcileError::Task(TaskApplyError::NoJobs("t".into())).is_conflict());
    }
}
