//! Finished tasks that go: a task with `ttlSecondsAfterFinished` is deleted that long after
//! it finished, as a Job is. The deletion is conditional on the version the plan was made
//! from, so a rerun asked meanwhile keeps the task.

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::crd::task::{Task, TaskStatus};

use super::{later, look_again_by, TaskPlan};

/// When `task`, whose status is `written`, is to be deleted: `None` when it keeps (no TTL,
/// not finished, or a kind of task whose life something else decides).
pub(super) fn expires_at(task: &Task, written: &TaskStatus) -> Option<DateTime<Utc>> {
    let ttl = task.spec.ttl_seconds_after_finished?;
    let decided_elsewhere = task.spec.is_recurring
        || task.spec.daemon
        || task
            .spec
            .workflow_id
            .as_deref()
            .is_some_and(|w| !w.is_empty())
        || task
            .metadata
            .owner_references
            .as_ref()
            .is_some_and(|o| !o.is_empty());
    if decided_elsewhere || !written.phase.is_terminal() {
        return None;
    }
    let finished = written.finished_at?;
    Some(later(
        finished,
        Duration::from_secs(u64::try_from(ttl).ok()?),
    ))
}

/// Deletes a finished task whose TTL has passed, if the plan writes nothing first (what it
/// writes is read at the next reconcile, which deletes it then); otherwise looks again then.
pub(super) fn delete_if_expired(
    task: &Task,
    written: &TaskStatus,
    now: DateTime<Utc>,
    plan: &mut TaskPlan,
) {
    let Some(at) = expires_at(task, written) else {
        return;
    };
    if now >= at && plan.status.is_none() && plan.finalizer.is_none() {
        plan.delete = true;
    } else {
        look_again_by(plan, at);
    }
}

#[cfg(test)]
mod tests {
    use super::super::{plan, FinalizerTiming, Strategy, TaskSettings};
    use crate::crd::task::{Task, TaskPhase, TaskSpec, TaskStatus};
    use crate::decision::task_observations::TaskObservations;
    use chrono::{TimeZone, Utc};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    fn finished_task(ttl: Option<i64>) -> Task {
        let mut task = Task::new(
            "t",
            TaskSpec {
                ttl_seconds_after_finished: ttl,
                ..TaskSpec::default()
            },
        );
        task.metadata.namespace = Some("default".into());
        task.metadata.uid = Some("u".into());
        task.status = Some(TaskStatus {
            phase: TaskPhase::Completed,
            finished_at: Some(Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap()),
            created_at: Some(Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap()),
            ..TaskStatus::default()
        });
        task
    }

    fn settings() -> TaskSettings {
        TaskSettings {
            strategy: Strategy::RoundRobin,
            default_timeout: std::time::Duration::from_secs(3600),
            running_write_delay: std::time::Duration::from_secs(1),
            finalizer: FinalizerTiming::default(),
        }
    }

    fn plan_at(task: &Task, seconds: i64) -> super::TaskPlan {
        let now =
            Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap() + chrono::Duration::seconds(seconds);
        // A first plan may fill in what a status lacks; the deletion is decided once the
        // status is as written.
        let mut task = task.clone();
        let first = plan(&task, &TaskObservations::default(), &settings(), now);
        if let Some(status) = first.status {
            task.status = Some(status);
        }
        if first.finalizer.is_some() {
            task.metadata.finalizers = Some(vec![crate::crd::task::TASK_FINALIZER.to_owned()]);
        }
        plan(&task, &TaskObservations::default(), &settings(), now)
    }

    #[test]
    fn a_finished_task_is_deleted_once_its_ttl_has_passed_and_looked_at_then_before() {
        let task = finished_task(Some(60));
        let early = plan_at(&task, 30);
        assert!(!early.delete);
        assert_eq!(
            early.requeue_at,
            Some(Utc.with_ymd_and_hms(2026, 1, 1, 0, 1, 0).unwrap())
        );
        let due = plan_at(&task, 60);
        assert!(due.delete, "{due:#?}");
        assert!(!plan_at(&finished_task(None), 3600).delete);
    }

    #[test]
    fn tasks_whose_life_something_else_decides_are_not_deleted() {
        let mut running = finished_task(Some(0));
        if let Some(status) = running.status.as_mut() {
            status.phase = TaskPhase::Running;
            status.finished_at = None;
        }
        assert!(!plan_at(&running, 10).delete);
        let mut daemon = finished_task(Some(0));
        daemon.spec.daemon = true;
        assert!(!plan_at(&daemon, 10).delete);
        let mut in_workflow = finished_task(Some(0));
        in_workflow.spec.workflow_id = Some("wf".into());
        assert!(!plan_at(&in_workflow, 10).delete);
        let mut owned = finished_task(Some(0));
        owned.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "propeller.propeller.absmach.eu/v1".into(),
            kind: "PropellerJob".into(),
            name: "j".into(),
            uid: "j".into(),
            ..OwnerReference::default()
        }]);
        assert!(!plan_at(&owned, 10).delete);
    }
}
