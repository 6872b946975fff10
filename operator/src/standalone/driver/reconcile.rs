//! The `Controller` of each kind over the [`ObjectCache`]'s reflector stores, and the
//! reconcile functions they call: each runs the shared controller (`crate::controller`) and
//! turns its answer into an [`Action`], failures through the shared retry policy.

use kube::runtime::controller::{Action, Config, Controller};

use super::*;
use crate::controller::{
    self, retry_policy, wait_until, Next, ObjectName, ReconcileError, Retry, Stored,
};

/// The longest a plan's next look waits: the sweep and the store's changes cover the rest.
const LONGEST_WAIT: Duration = Duration::from_secs(300);

fn action(next: Next, now: chrono::DateTime<Utc>) -> Action {
    match next {
        Some(_) => Action::requeue(wait_until(next, now, LONGEST_WAIT)),
        None => Action::await_change(),
    }
}

async fn reconcile_proplet(
    proplet: Arc<Proplet>,
    driver: Arc<Driver>,
) -> Result<Action, ReconcileError> {
    let now = Utc::now();
    let next = controller::proplet::reconcile(&*driver, (*proplet).clone(), now).await?;
    Ok(action(next, now))
}

async fn reconcile_task(task: Arc<Task>, driver: Arc<Driver>) -> Result<Action, ReconcileError> {
    let now = Utc::now();
    let next = controller::task::reconcile(&*driver, &task, now).await?;
    Ok(action(next, now))
}

async fn reconcile_propeller_job(
    job: Arc<PropellerJob>,
    driver: Arc<Driver>,
) -> Result<Action, ReconcileError> {
    let now = Utc::now();
    let next = controller::jobs::reconcile_propeller_job(&*driver, &job, now).await?;
    Ok(action(next, now))
}

async fn reconcile_federated_job(
    job: Arc<FederatedJob>,
    driver: Arc<Driver>,
) -> Result<Action, ReconcileError> {
    let now = Utc::now();
    let next = controller::jobs::reconcile_federated_job(&*driver, &job, now).await?;
    Ok(action(next, now))
}

async fn reconcile_training_round(
    round: Arc<TrainingRound>,
    driver: Arc<Driver>,
) -> Result<Action, ReconcileError> {
    let now = Utc::now();
    let next = controller::jobs::reconcile_training_round(&*driver, &round, now).await?;
    Ok(action(next, now))
}

/// The shared [`retry_policy`] as kube-runtime's error policy. The cache already shows every
/// durable write, so a conflict is read again at once.
fn error_policy<K: Stored>(object: Arc<K>, error: &ReconcileError, _: Arc<Driver>) -> Action {
    match retry_policy(&K::kind(&()), &ObjectName::of(&*object), error) {
        Retry::Reread => Action::requeue(Duration::ZERO),
        Retry::Never => Action::await_change(),
        Retry::After(wait) => Action::requeue(wait),
    }
}

fn config() -> Config {
    Config::default().concurrency(MAX_CONCURRENT_RECONCILES)
}

fn stream_of<T: Send + 'static>(
    rx: UnboundedReceiver<T>,
) -> impl futures::Stream<Item = T> + Send + 'static {
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
}

/// Once at start (everything stored is looked at after a restart), then every `every`.
fn start_then_every(every: Option<Duration>) -> impl futures::Stream<Item = ()> + Send + 'static {
    let ticks = futures::stream::unfold(every, |every| async move {
        let every = every?;
        tokio::time::sleep(every).await;
        Some(((), Some(every)))
    });
    futures::stream::once(async {}).chain(ticks)
}

/// Runs the five `Controller`s until `shutdown` resolves and their reconciles in flight end.
pub(super) async fn controllers(
    driver: Arc<Driver>,
    wakes: Wakes,
    shutdown: impl std::future::Future<Output = ()> + Clone + Send + Sync + 'static,
) {
    let cache = driver.cache.clone();
    let sweep = driver.sweep.max(Duration::from_secs(1));
    // Wakes are the only trigger besides the requeues: store changes reach them through
    // the driver's routing (which leaves out its own Proplet writes).
    let proplets = Controller::for_stream(futures::stream::empty(), cache.proplet_store())
        .with_config(config())
        .reconcile_on(stream_of(wakes.proplets))
        .reconcile_all_on(start_then_every(Some(sweep)))
        .graceful_shutdown_on(shutdown.clone())
        .run(reconcile_proplet, error_policy, driver.clone());
    let tasks = Controller::for_stream(futures::stream::empty(), cache.task_store())
        .with_config(config())
        .reconcile_on(stream_of(wakes.tasks))
        .reconcile_all_on(start_then_every(None))
        .graceful_shutdown_on(shutdown.clone())
        .run(reconcile_task, error_policy, driver.clone());
    let jobs = Controller::for_stream(futures::stream::empty(), cache.propeller_job_store())
        .with_config(config())
        .reconcile_on(stream_of(wakes.propeller_jobs))
        .reconcile_all_on(start_then_every(None))
        .graceful_shutdown_on(shutdown.clone())
        .run(reconcile_propeller_job, error_policy, driver.clone());
    let federated = Controller::for_stream(futures::stream::empty(), cache.federated_job_store())
        .with_config(config())
        .reconcile_on(stream_of(wakes.federated_jobs))
        .reconcile_all_on(start_then_every(None))
        .graceful_shutdown_on(shutdown.clone())
        .run(reconcile_federated_job, error_policy, driver.clone());
    let rounds = Controller::for_stream(futures::stream::empty(), cache.training_round_store())
        .with_config(config())
        .reconcile_on(stream_of(wakes.training_rounds))
        .reconcile_all_on(start_then_every(None))
        .graceful_shutdown_on(shutdown)
        .run(reconcile_training_round, error_policy, driver);
    tokio::join!(
        drive(proplets, "proplet"),
        drive(tasks, "task"),
        drive(jobs, "propellerjob"),
        drive(federated, "federatedjob"),
        drive(rounds, "traininground"),
    );
}

/// Runs a controller's stream to its end. Failed reconciles were already logged and retried
/// by the error policy; what reaches here (a wake for an object deleted meanwhile) is
/// logged at debug.
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
