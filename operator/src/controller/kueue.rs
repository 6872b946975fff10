//! A Kueue-managed PropellerJob's Workload: read it (and the flavors and priority class it
//! names), apply what [`crate::decision::kueue::plan`] decides, and say whether the job may
//! run.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use chrono::{DateTime, Utc};

use crate::crd::job::PropellerJob;
use crate::crd::kueue::{ResourceFlavor, Workload, WorkloadPriorityClass};
use crate::decision::conditions::DesiredCondition;
use crate::decision::kueue::{
    admitted_flavors, plan, priority_class, workload_name, KueuePlan, QUEUE_NAME_LABEL,
    QUOTA_RESERVED,
};
use crate::decision::propeller_job::{Gate, JobObservation};

use super::{Cluster, ObjectName, ReconcileError};

/// Applies the Workload side of `job`'s admission; what it means for the job.
pub async fn admit<C: Cluster>(
    cluster: &C,
    job: &PropellerJob,
    observed: &JobObservation,
    now: DateTime<Utc>,
) -> Result<KueuePlan, ReconcileError> {
    if !cluster.common().kueue.load(Ordering::Relaxed) {
        return Ok(disabled());
    }
    let name = ObjectName::new(
        job.metadata.namespace.as_deref().unwrap_or("default"),
        &workload_name(job),
    );
    let workload = cluster.get::<Workload>(&name).await?;
    let priority = match (&workload, priority_class(job)) {
        (None, Some(class)) => cluster
            .get_cluster_scoped::<WorkloadPriorityClass>(class)
            .await?
            .map(|found| (class, found.value)),
        _ => None,
    };
    let mut node_labels = BTreeMap::new();
    for flavor in workload.iter().flat_map(admitted_flavors) {
        if let Some(found) = cluster
            .get_cluster_scoped::<ResourceFlavor>(&flavor)
            .await?
        {
            node_labels.extend(found.spec.node_labels);
        }
    }
    let plan = plan(
        job,
        workload.as_ref(),
        &node_labels,
        observed.runs_out(),
        priority,
        now,
    );
    if let Some(created) = &plan.create {
        cluster.create_once(created).await?;
    }
    if let (Some(workload), Some(new)) = (&workload, &plan.workload_status) {
        let old = workload.status.clone().unwrap_or_default();
        let json = |s| serde_json::to_value(s).unwrap_or_default();
        cluster
            .write_status::<Workload>(&workload.metadata, &json(&old), &json(new))
            .await?;
    }
    Ok(plan)
}

/// A labelled job on a propeller started without `--kueue`: held, saying how to go on.
fn disabled() -> KueuePlan {
    let message = format!(
        "the job has the {QUEUE_NAME_LABEL} label but propeller runs without Kueue \
         admission; start it with --kueue (Helm: kueue.enabled=true), or remove the label"
    );
    KueuePlan {
        create: None,
        workload_status: None,
        gate: Gate::Held {
            reason: "KueueDisabled".to_owned(),
            message: message.clone(),
        },
        quota: DesiredCondition::new(QUOTA_RESERVED, false, "KueueDisabled", message),
    }
}
