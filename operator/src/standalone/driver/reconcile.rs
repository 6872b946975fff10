//! The `Controller` of each kind over the [`ObjectCache`]'s reflector stores, calling the
//! shared reconciles and error policy (`crate::controller::runner`).

use kube::runtime::controller::{Config, Controller};

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;

use crate::controller::runner::{
    drive, error_policy, reconcile_federated_job, reconcile_propeller_job, reconcile_proplet,
    reconcile_task, reconcile_training_round, stream_of,
};

use super::{Driver, Wakes, MAX_CONCURRENT_RECONCILES};

fn config() -> Config {
    Config::default().concurrency(MAX_CONCURRENT_RECONCILES)
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
