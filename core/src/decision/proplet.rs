//! The Proplet reconcile step: a pure plan from (proplet, observations, now). The drivers
//! apply it (the Kubernetes one by server-side apply of the Deployment and a status patch).

use std::time::Duration;

use chrono::{DateTime, Utc};
use k8s_openapi::api::apps::v1::Deployment;

use crate::crd::common::{MetricsSample, PropletResources};
use crate::crd::proplet::{Proplet, PropletMetadata, PropletPhase, PropletStatus, PropletType};
use crate::decision::liveness::{
    evaluate_external, evaluate_k8s, significant_change, write_due, DeploymentObservation,
    ExternalObservation,
};

use super::deployment::{proplet_deployment, DeploymentError};

/// Operator settings that shape the Proplet plan.
#[derive(Debug, Clone, Copy)]
pub struct PropletSettings {
    /// An external proplet is Offline once its latest heartbeat is older than this.
    pub last_seen_threshold: Duration,
    /// Heartbeat-only changes are written at most this often.
    pub status_flush_interval: Duration,
    /// Heartbeat-only writes per second across all proplets (0: no cap). Each proplet's
    /// refresh interval stretches to its fair share of this budget, so a large fleet's
    /// refreshes cannot saturate the API server and delay the writes that matter (a proplet
    /// going Offline), which are never capped.
    pub routine_writes_per_second: u32,
}

impl PropletSettings {
    /// How often one proplet's heartbeat-only changes are written in a fleet of
    /// `fleet_size`: the flush interval, or longer when the fleet's share of the routine
    /// budget is smaller.
    pub fn routine_interval(&self, fleet_size: usize) -> Duration {
        if self.routine_writes_per_second == 0 {
            return self.status_flush_interval;
        }
        let share =
            Duration::from_secs_f64(fleet_size as f64 / f64::from(self.routine_writes_per_second));
        share.max(self.status_flush_interval)
    }
}

/// The Event a written phase change deserves, in both drivers: going Offline (a warning)
/// and coming back; not a new proplet's first status nor its first Running (a fleet of
/// 10,000 coming up would cost as many Event writes).
pub fn phase_change_note(
    before: Option<PropletPhase>,
    after: PropletPhase,
) -> Option<crate::decision::task::Note> {
    // A proplet's first status (Initializing, or Running for a ready Deployment) and its first
    // Running are how it starts, not changes worth an Event.
    let first_running = after == PropletPhase::Running
        && before.is_none_or(|phase| phase == PropletPhase::Initializing);
    let first_status = before.is_none();
    (before != Some(after) && !first_running && !first_status).then(|| {
        crate::decision::task::Note {
            warning: after == PropletPhase::Offline,
            reason: "PhaseChanged",
            message: format!("proplet is now {after}"),
        }
    })
}

/// Whether a written phase change gives the Tasks waiting for a proplet their chance.
pub fn wakes_waiting_tasks(before: Option<PropletPhase>, after: PropletPhase) -> bool {
    after == PropletPhase::Running && before != Some(PropletPhase::Running)
}

/// Whether a phase change wakes the tasks occupying the proplet: it went Offline from
/// Running, which starts a daemon's `offlineTolerationSeconds`.
pub fn wakes_occupants(before: Option<PropletPhase>, after: PropletPhase) -> bool {
    after == PropletPhase::Offline && before == Some(PropletPhase::Running)
}

/// The condition that says whether a proplet enrolled with a manual-approval token may get
/// tasks.
pub const APPROVED: &str = "Approved";

/// Whether a status write approves a proplet that was waiting (its tasks get their chance).
pub fn approval_granted(before: Option<&PropletStatus>, after: &PropletStatus) -> bool {
    let approved = |s: &PropletStatus| super::conditions::is_true(&s.conditions, APPROVED);
    let waited = before.is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == APPROVED && c.status == "False")
    });
    waited && approved(after)
}

/// Sets [`APPROVED`] on a proplet that enrolled with a token (or carries the approval
/// label): False while the label holds it back, True once it is gone. Proplets added by
/// hand get no such condition.
fn evaluate_approval(
    proplet: &Proplet,
    status: &mut PropletStatus,
    generation: Option<i64>,
    now: DateTime<Utc>,
) {
    use super::enrolment::{APPROVAL_LABEL, APPROVAL_PENDING, ENROLLED_WITH_LABEL};
    let labels = proplet.metadata.labels.as_ref();
    let label = |key: &str| labels.and_then(|l| l.get(key)).map(String::as_str);
    let pending = label(APPROVAL_LABEL) == Some(APPROVAL_PENDING);
    let tracked = pending
        || status.conditions.iter().any(|c| c.type_ == APPROVED)
        || label(ENROLLED_WITH_LABEL).is_some();
    if !tracked {
        return;
    }
    let condition = if pending {
        super::conditions::DesiredCondition::new(
            APPROVED,
            false,
            "AwaitingApproval",
            format!(
                "Pending approval: gets no tasks until `propeller approve proplet/{}` (or the label {APPROVAL_LABEL} is removed)",
                proplet.metadata.name.as_deref().unwrap_or_default()
            ),
        )
    } else {
        super::conditions::DesiredCondition::new(APPROVED, true, "Approved", "may get tasks")
    };
    super::conditions::set_condition(&mut status.conditions, &condition, generation, now);
}

/// What the driver knows about a proplet beyond the object itself.
/// How long the first status of an enrolled device waits for the device to be heard.
pub const FIRST_CONTACT_WAIT: Duration = Duration::from_secs(10);

/// An enrolled device logs in the moment it has its key: until it is heard, or
/// [`FIRST_CONTACT_WAIT`] after its Proplet was created, its first status waits (the time
/// returned), so that one write says Running instead of two saying Initializing, then Running.
fn awaiting_first_contact(
    proplet: &Proplet,
    observed: &ExternalObservation,
    now: DateTime<Utc>,
) -> Option<DateTime<Utc>> {
    let enrolled = proplet
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(super::enrolment::ENROLLED_WITH_LABEL));
    if !enrolled || proplet.status.is_some() || !observed.heartbeats.is_empty() {
        return None;
    }
    let created = super::conditions::from_k8s_time(proplet.metadata.creation_timestamp.as_ref()?)?;
    let until = created + chrono::Duration::from_std(FIRST_CONTACT_WAIT).ok()?;
    (now < until).then_some(until)
}

#[derive(Debug, Clone, Default)]
pub struct PropletObservations {
    /// Broker events not yet reflected in the status (external proplets).
    pub external: ExternalObservation,
    /// The watched Deployment (`k8s` proplets); `None` when it does not exist.
    pub deployment: Option<DeploymentObservation>,
    /// When this driver last wrote the status.
    pub last_write: Option<DateTime<Utc>>,
    /// The latest description and figures the device reported.
    pub report: DeviceReport,
    /// Tasks scheduled or running on the proplet now (`status.taskCount`).
    pub task_count: i64,
    /// How many proplets the driver holds (they share the routine-write budget).
    pub fleet_size: usize,
}

/// The latest description and resource figures a device reported; each replaces the last.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeviceReport {
    /// From discovery or a heartbeat that carried metadata.
    pub metadata: Option<PropletMetadata>,
    /// From the latest heartbeat or proplet-metrics message.
    pub metrics: Option<MetricsSample>,
    /// Memory the device has free, from its total memory and memory use.
    pub available: Option<PropletResources>,
}

/// What to do for one proplet now.
#[derive(Debug, Clone, PartialEq)]
pub struct PropletPlan {
    /// The Deployment to apply (`k8s` proplets).
    pub deployment: Option<Deployment>,
    /// The status to write, when a write is due.
    pub status: Option<PropletStatus>,
    /// When to look again without any new event.
    pub requeue_at: Option<DateTime<Utc>>,
    /// When an external proplet shown Running goes Offline unless heard from again. The
    /// driver watches this deadline and reconciles only if it passes in silence: a heartbeat
    /// meanwhile moves it without a reconcile.
    pub offline_at: Option<DateTime<Utc>>,
    /// Why the Deployment could not be built, for an Event and the log.
    pub problem: Option<DeploymentError>,
    /// The status write only refreshes heartbeat figures: it may be put off when the API
    /// server is busy, unlike a phase or condition change.
    pub routine: bool,
}

impl PropletPlan {
    /// Asks for another look at `at` at the latest.
    pub fn look_again_by(&mut self, at: DateTime<Utc>) {
        self.requeue_at = Some(self.requeue_at.map_or(at, |t| t.min(at)));
    }
}

/// Decides the proplet's Deployment and status at `now`.
pub fn plan(
    proplet: &Proplet,
    observed: &PropletObservations,
    settings: &PropletSettings,
    now: DateTime<Utc>,
) -> PropletPlan {
    let written = proplet.status.clone().unwrap_or_default();
    let mut desired = written.clone();
    let generation = proplet.metadata.generation;
    let mut plan = PropletPlan {
        deployment: None,
        status: None,
        requeue_at: None,
        offline_at: None,
        problem: None,
        routine: false,
    };
    match proplet.spec.type_ {
        PropletType::K8s => {
            match proplet_deployment(proplet) {
                Ok(deployment) => plan.deployment = Some(deployment),
                Err(problem) => plan.problem = Some(problem),
            }
            let deployment = observed.deployment.unwrap_or_default();
            evaluate_k8s(&mut desired, &deployment, generation, now);
        }
        PropletType::External => {
            if let Some(until) = awaiting_first_contact(proplet, &observed.external, now) {
                plan.look_again_by(until);
                return plan;
            }
            plan.offline_at = evaluate_external(
                &mut desired,
                &observed.external,
                settings.last_seen_threshold,
                generation,
                now,
            );
        }
    }
    evaluate_approval(proplet, &mut desired, generation, now);
    let report = &observed.report;
    if report.metadata.is_some() {
        desired.metadata = report.metadata.clone();
    }
    if report.metrics.is_some() {
        desired.latest_metrics = report.metrics.clone();
    }
    match proplet.spec.type_ {
        PropletType::K8s => {
            let spec = proplet.spec.resources.as_ref();
            let quantity = |key: &str| spec.and_then(|r| r.get(key)).map(|q| q.0.clone());
            let from_spec = PropletResources {
                cpu: quantity("cpu"),
                memory: quantity("memory"),
                ..PropletResources::default()
            };
            if from_spec != PropletResources::default() {
                desired.available_resources = Some(from_spec);
            }
        }
        PropletType::External => {
            if report.available.is_some() {
                desired.available_resources = report.available.clone();
            }
        }
    }
    desired.observed_generation = generation;
    // Load moves with every task transition: like heartbeat figures it is written at most
    // once per flush interval, so a burst of tasks does not become a burst of writes.
    desired.task_count = observed.task_count;
    let routine_interval = settings.routine_interval(observed.fleet_size);
    if write_due(
        &written,
        &desired,
        observed.last_write,
        routine_interval,
        now,
    ) {
        plan.routine = !significant_change(&written, &desired);
        plan.status = Some(desired);
    } else if written != desired {
        let flush = chrono::Duration::from_std(routine_interval).unwrap_or(chrono::Duration::MAX);
        if let Some(due) = observed
            .last_write
            .and_then(|at| at.checked_add_signed(flush))
        {
            plan.look_again_by(due);
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phase_changes_note_offline_and_returns_but_not_a_first_running() {
        use PropletPhase::{Initializing, Offline, Running};
        assert!(phase_change_note(None, Running).is_none());
        assert!(phase_change_note(None, Initializing).is_none());
        assert!(phase_change_note(Some(Initializing), Running).is_none());
        let offline = phase_change_note(Some(Running), Offline).expect("offline noted");
        assert!(offline.warning);
        assert_eq!(offline.message, "proplet is now Offline");
        let back = phase_change_note(Some(Offline), Running).expect("return noted");
        assert!(!back.warning);
        assert!(phase_change_note(Some(Running), Running).is_none());
        assert!(wakes_waiting_tasks(None, Running));
        assert!(wakes_waiting_tasks(Some(Offline), Running));
        assert!(!wakes_waiting_tasks(Some(Running), Running));
        assert!(!wakes_waiting_tasks(Some(Running), Offline));
        assert!(wakes_occupants(Some(Running), Offline));
        assert!(!wakes_occupants(Some(Initializing), Offline));
        assert!(!wakes_occupants(Some(Offline), Running));
    }

    #[test]
    fn an_enrolled_devices_first_status_waits_for_the_device_and_says_running() {
        let created = Utc::now();
        let proplet = |enrolled: bool| -> Proplet {
            let labels = if enrolled {
                serde_json::json!({ super::super::enrolment::ENROLLED_WITH_LABEL: "abcdef" })
            } else {
                serde_json::json!({})
            };
            serde_json::from_value(serde_json::json!({
                "apiVersion": "propeller.absmach.eu/v1alpha1",
                "kind": "Proplet",
                "metadata": {
                    "name": "pi-1", "namespace": "default", "labels": labels,
                    "creationTimestamp": created.to_rfc3339(),
                },
                "spec": { "type": "external", "connectionConfig": { "mqttAddress": "tcp://b:1883", "channelId": "c" } },
            }))
            .unwrap_or_else(|e| panic!("{e}"))
        };
        let settings = PropletSettings {
            last_seen_threshold: Duration::from_secs(30),
            status_flush_interval: Duration::from_secs(5),
            routine_writes_per_second: 0,
        };
        let unheard = PropletObservations::default();
        let soon = created + chrono::Duration::seconds(1);
        let waiting = plan(&proplet(true), &unheard, &settings, soon);
        assert_eq!(waiting.status, None, "no Initializing write");
        let wait = chrono::Duration::from_std(FIRST_CONTACT_WAIT).unwrap_or_default();
        assert_eq!(waiting.requeue_at, Some(created + wait));
        let heard = PropletObservations {
            external: ExternalObservation {
                heartbeats: vec![soon],
                offline_at: None,
            },
            ..PropletObservations::default()
        };
        let first = plan(&proplet(true), &heard, &settings, soon);
        assert_eq!(
            first.status.map(|s| s.phase),
            Some(PropletPhase::Running),
            "the first write says Running"
        );
        let late = plan(&proplet(true), &unheard, &settings, created + wait);
        assert_eq!(
            late.status.map(|s| s.phase),
            Some(PropletPhase::Initializing),
            "a device not heard within the wait is shown waiting"
        );
        let by_hand = plan(&proplet(false), &unheard, &settings, soon);
        assert!(
            by_hand.status.is_some(),
            "a Proplet made by hand is written at once"
        );
    }
}
