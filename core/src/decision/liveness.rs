//! Proplet liveness: the phase and conditions of a proplet from what was observed about it
//! (heartbeats, goodbyes, its Deployment), and when a status write is actually due.
//!
//! External proplets: Initializing until the first heartbeat; Running while the latest
//! heartbeat is within the last-seen threshold; Offline once it is older, or at once when
//! the proplet's Last Will or a disconnect arrived after its latest heartbeat. A heartbeat
//! after that makes it Running again.
//!
//! `k8s` proplets take their phase from Deployment readiness, never from MQTT.
//!
//! Heartbeats arrive far more often than anyone needs the status rewritten, so
//! [`write_due`] coalesces them: a write is due on a phase or condition change, or when the
//! flush interval has passed since the last write; otherwise the latest heartbeat waits in
//! memory. `aliveHistory` still holds the true last ten heartbeat times.

use std::time::Duration;

use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

use super::conditions::{from_k8s_time, remove_condition, set_condition, DesiredCondition};
use crate::crd::proplet::{K8sPropletStatus, PropletPhase, PropletStatus};

/// Heartbeat times kept in `status.aliveHistory`.
pub const ALIVE_HISTORY_LEN: usize = 10;

/// Default `--last-seen-threshold`.
pub const DEFAULT_LAST_SEEN_THRESHOLD: Duration = Duration::from_secs(30);

/// What the broker told us about an external proplet since the status was last written.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExternalObservation {
    /// Heartbeat times not yet in the status, oldest first.
    pub heartbeats: Vec<DateTime<Utc>>,
    /// Latest explicit goodbye: an `"offline"` Last Will, a clean disconnect or a dropped
    /// connection, whichever the broker saw.
    pub offline_at: Option<DateTime<Utc>>,
}

/// Readiness of a `k8s` proplet's Deployment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeploymentObservation {
    /// Whether the Deployment exists yet.
    pub exists: bool,
    /// `spec.replicas` (1 when unset).
    pub desired: i32,
    /// `status.replicas`.
    pub replicas: i32,
    /// `status.readyReplicas`.
    pub ready: i32,
    /// `status.availableReplicas`.
    pub available: i32,
    /// The `Available` condition, when the Deployment reports one.
    pub available_condition: Option<bool>,
    /// True when `Progressing` is False (the rollout is stuck).
    pub stalled: bool,
}

/// Folds new heartbeats into `lastSeen` and `aliveHistory`.
pub fn record_heartbeats(status: &mut PropletStatus, heartbeats: &[DateTime<Utc>]) {
    for &at in heartbeats {
        if status.last_seen.is_none_or(|seen| at >= seen) {
            status.last_seen = Some(at);
        }
        status.alive_history.push(at);
    }
    status.alive_history.sort();
    let excess = status.alive_history.len().saturating_sub(ALIVE_HISTORY_LEN);
    status.alive_history.drain(..excess);
}

/// Phase and conditions of an external proplet at `now`.
///
/// Returns the instant at which the phase will next change by itself (the proplet going
/// Offline when no further heartbeat arrives), so the driver can requeue exactly then.
pub fn evaluate_external(
    status: &mut PropletStatus,
    observation: &ExternalObservation,
    threshold: Duration,
    generation: Option<i64>,
    now: DateTime<Utc>,
) -> Option<DateTime<Utc>> {
    record_heartbeats(status, &observation.heartbeats);
    let threshold_c = chrono::Duration::from_std(threshold).unwrap_or(chrono::Duration::MAX);
    // A disconnect already written stays in force until a new heartbeat arrives; the
    // observation that reported it is cleared once written.
    let written_disconnect = (observation.heartbeats.is_empty()
        && status.phase == PropletPhase::Offline)
        .then(|| {
            status
                .conditions
                .iter()
                .find(|c| c.type_ == "Connected" && c.reason == "PropletDisconnected")
                .and_then(|c| from_k8s_time(&c.last_transition_time))
        })
        .flatten();
    let gone_at = observation
        .offline_at
        .filter(|off| status.last_seen.is_none_or(|seen| *off >= seen))
        .or(written_disconnect);
    let offline = || {
        DesiredCondition::new(
            "Ready",
            false,
            "PropletOffline",
            "external proplet is offline",
        )
    };
    // (phase, Connected condition (None removes it), Ready condition, next self-change)
    let (phase, connected, ready, next_change) = match (status.last_seen, gone_at) {
        (None, _) => (
            PropletPhase::Initializing,
            None,
            DesiredCondition::new(
                "Ready",
                false,
                "PropletInitializing",
                "waiting for the first heartbeat",
            ),
            None,
        ),
        (Some(_), Some(off)) => (
            PropletPhase::Offline,
            Some(DesiredCondition::new(
                "Connected",
                false,
                "PropletDisconnected",
                format!("the proplet disconnected at {}", off.to_rfc3339()),
            )),
            offline(),
            None,
        ),
        (Some(seen), None) => {
            let deadline = seen
                .checked_add_signed(threshold_c)
                .unwrap_or(DateTime::<Utc>::MAX_UTC);
            if now > deadline {
                let message = format!(
                    "no heartbeat since {} (threshold {}s)",
                    seen.to_rfc3339(),
                    threshold.as_secs()
                );
                let connected =
                    DesiredCondition::new("Connected", false, "HeartbeatMissed", message);
                (PropletPhase::Offline, Some(connected), offline(), None)
            } else {
                // The message is stable between heartbeats so that liveness alone never
                // forces a write (upstream's "last seen Xs ago" did).
                (
                    PropletPhase::Running,
                    Some(DesiredCondition::new(
                        "Connected",
                        true,
                        "HeartbeatCurrent",
                        "heartbeats arrive within the threshold",
                    )),
                    DesiredCondition::new(
                        "Ready",
                        true,
                        "PropletReady",
                        "external proplet is connected",
                    ),
                    Some(deadline),
                )
            }
        }
    };
    match connected {
        Some(c) => {
            set_condition(&mut status.conditions, &c, generation, now);
        }
        None => {
            remove_condition(&mut status.conditions, "Connected");
        }
    }
    set_condition(&mut status.conditions, &ready, generation, now);
    status.phase = phase;
    status.alive = phase == PropletPhase::Running;
    set_healthy(status, generation, now);
    next_change
}

/// Phase and conditions of a `k8s` proplet from its Deployment.
pub fn evaluate_k8s(
    status: &mut PropletStatus,
    deployment: &DeploymentObservation,
    generation: Option<i64>,
    now: DateTime<Utc>,
) {
    let d = deployment;
    let desired = d.desired.max(0);
    let (phase, ready) = if !d.exists {
        (
            PropletPhase::Initializing,
            DesiredCondition::new(
                "Ready",
                false,
                "DeploymentMissing",
                "the Deployment is being created",
            ),
        )
    } else if d.ready == desired && d.ready > 0 {
        (
            PropletPhase::Running,
            DesiredCondition::new(
                "Ready",
                true,
                "DeploymentReady",
                format!("all {desired} replicas are ready"),
            ),
        )
    } else if desired == 0 {
        (
            PropletPhase::Initializing,
            DesiredCondition::new("Ready", false, "ScaledToZero", "spec.k8s.replicas is 0"),
        )
    } else if d.ready > 0 {
        (
            PropletPhase::Initializing,
            DesiredCondition::new(
                "Ready",
                false,
                "DeploymentPartiallyReady",
                format!("{}/{} replicas ready", d.ready, desired),
            ),
        )
    } else if d.replicas > 0 {
        (
            PropletPhase::Initializing,
            DesiredCondition::new(
                "Ready",
                false,
                "DeploymentNotReady",
                format!("{} replicas exist but none are ready", d.replicas),
            ),
        )
    } else {
        (
            PropletPhase::Initializing,
            DesiredCondition::new(
                "Ready",
                false,
                "DeploymentScalingUp",
                "scaling up from zero replicas",
            ),
        )
    };
    set_condition(&mut status.conditions, &ready, generation, now);
    let connected = if d.available > 0 {
        DesiredCondition::new(
            "Connected",
            true,
            "PodAvailable",
            format!("{} pods available", d.available),
        )
    } else {
        DesiredCondition::new(
            "Connected",
            false,
            "NoPodAvailable",
            "no proplet pod is available",
        )
    };
    set_condition(&mut status.conditions, &connected, generation, now);
    status.phase = phase;
    status.alive = phase == PropletPhase::Running;
    status.k8s_status = Some(K8sPropletStatus {
        ready_replicas: d.ready,
        available_replicas: d.available,
    });
    let healthy = if d.stalled {
        DesiredCondition::new(
            "Healthy",
            false,
            "DeploymentStalled",
            "the rollout is not progressing",
        )
    } else if d.available_condition == Some(false) {
        DesiredCondition::new(
            "Healthy",
            false,
            "DeploymentNotAvailable",
            "the Deployment reports it is not available",
        )
    } else {
        DesiredCondition::new(
            "Healthy",
            true,
            "DeploymentAvailable",
            "the Deployment is available",
        )
    };
    if d.exists {
        set_condition(&mut status.conditions, &healthy, generation, now);
    }
}

fn set_healthy(status: &mut PropletStatus, generation: Option<i64>, now: DateTime<Utc>) {
    let healthy = match status.phase {
        PropletPhase::Running => DesiredCondition::new(
            "Healthy",
            true,
            "Operating",
            "the proplet reports no errors",
        ),
        PropletPhase::Offline => {
            DesiredCondition::new("Healthy", false, "PropletOffline", "the proplet is offline")
        }
        PropletPhase::Initializing => {
            DesiredCondition::new("Healthy", false, "PropletInitializing", "no heartbeat yet")
        }
    };
    set_condition(&mut status.conditions, &healthy, generation, now);
}

/// Whether the status must be written now, or the change may wait for the flush interval.
///
/// Due when the phase, `alive`, the task count, the metadata or any condition's status or
/// reason differ from what was last written; otherwise (only `lastSeen`, `aliveHistory`,
/// metrics or messages moved) when `flush_interval` has passed since `last_write`.
pub fn write_due(
    written: &PropletStatus,
    desired: &PropletStatus,
    last_write: Option<DateTime<Utc>>,
    flush_interval: Duration,
    now: DateTime<Utc>,
) -> bool {
    if written == desired {
        return false;
    }
    if significant_change(written, desired) {
        return true;
    }
    let Some(last) = last_write else { return true };
    let flush = chrono::Duration::from_std(flush_interval).unwrap_or(chrono::Duration::MAX);
    last.checked_add_signed(flush).is_none_or(|due| now >= due)
}

/// Whether the status changed in a way a user or the scheduler acts on (phase, `alive`,
/// metadata, Deployment state, generation, a condition's status or reason, resources
/// becoming known or unknown), rather than only the figures heartbeats refresh
/// (`lastSeen`, `aliveHistory`, metrics, messages, the free memory a device reports).
///
/// Free memory moves with every heartbeat that carries metrics: counted as significant,
/// a real agent's every heartbeat was a status write.
pub fn significant_change(written: &PropletStatus, desired: &PropletStatus) -> bool {
    written.phase != desired.phase
        || written.alive != desired.alive
        || written.metadata != desired.metadata
        || written.k8s_status != desired.k8s_status
        || written.available_resources.is_some() != desired.available_resources.is_some()
        || written.observed_generation != desired.observed_generation
        || condition_transitions(&written.conditions, &desired.conditions)
}

/// Whether a heartbeat from an external proplet can leave its reconcile to the time that
/// reconcile already chose (its Offline deadline): true when the status already shows it
/// Running, the heartbeat brings no new description, and its routine refresh (`lastSeen`,
/// figures) is not due before `now` (the last write was less than `routine_interval` ago).
///
/// Reconciling on every heartbeat made a fleet of 10,000 cost 1,000 reconciles a second,
/// among which the deadlines of the proplets that fell silent had to wait their turn.
pub fn heartbeat_can_wait(
    status: Option<&PropletStatus>,
    reported: Option<&crate::crd::proplet::PropletMetadata>,
    last_write: Option<DateTime<Utc>>,
    routine_interval: Duration,
    now: DateTime<Utc>,
) -> bool {
    let interval = chrono::Duration::from_std(routine_interval).unwrap_or(chrono::Duration::MAX);
    let refresh_waits = last_write
        .and_then(|at| at.checked_add_signed(interval))
        .is_some_and(|due| now < due);
    refresh_waits
        && status.is_some_and(|s| {
            s.phase == PropletPhase::Running
                && reported.is_none_or(|m| s.metadata.as_ref() == Some(m))
        })
}

fn condition_transitions(written: &[Condition], desired: &[Condition]) -> bool {
    if written.len() != desired.len() {
        return true;
    }
    desired.iter().any(|d| {
        written
            .iter()
            .find(|w| w.type_ == d.type_)
            .is_none_or(|w| w.status != d.status || w.reason != d.reason)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::common::find_condition;
    use chrono::TimeZone;

    const THRESHOLD: Duration = Duration::from_secs(30);

    fn t(s: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_800_000_000 + s, 0).unwrap()
    }

    fn cond<'a>(s: &'a PropletStatus, ty: &str) -> Option<(&'a str, &'a str)> {
        find_condition(&s.conditions, ty).map(|c| (c.status.as_str(), c.reason.as_str()))
    }

    fn heartbeat(s: &mut PropletStatus, at: i64, now: i64) -> Option<DateTime<Utc>> {
        let obs = ExternalObservation {
            heartbeats: vec![t(at)],
            offline_at: None,
        };
        evaluate_external(s, &obs, THRESHOLD, Some(1), t(now))
    }

    fn tick(s: &mut PropletStatus, now: i64) {
        evaluate_external(
            s,
            &ExternalObservation::default(),
            THRESHOLD,
            Some(1),
            t(now),
        );
    }

    #[test]
    fn initializing_running_offline_running() {
        let mut s = PropletStatus::default();
        tick(&mut s, 0);
        assert_eq!(s.phase, PropletPhase::Initializing);
        assert!(!s.alive);
        assert_eq!(cond(&s, "Ready"), Some(("False", "PropletInitializing")));
        assert_eq!(cond(&s, "Connected"), None);

        let next = heartbeat(&mut s, 1, 1);
        assert_eq!(s.phase, PropletPhase::Running);
        assert!(s.alive);
        assert_eq!(
            next,
            Some(t(31)),
            "requeue exactly when the threshold passes"
        );
        assert_eq!(cond(&s, "Ready"), Some(("True", "PropletReady")));
        assert_eq!(cond(&s, "Connected"), Some(("True", "HeartbeatCurrent")));
        assert_eq!(cond(&s, "Healthy"), Some(("True", "Operating")));

        tick(&mut s, 31);
        assert_eq!(
            s.phase,
            PropletPhase::Running,
            "exactly at the threshold still counts"
        );
        tick(&mut s, 32);
        assert_eq!(s.phase, PropletPhase::Offline);
        assert!(!s.alive);
        assert_eq!(cond(&s, "Connected"), Some(("False", "HeartbeatMissed")));
        assert_eq!(cond(&s, "Ready"), Some(("False", "PropletOffline")));

        heartbeat(&mut s, 40, 40);
        assert_eq!(s.phase, PropletPhase::Running);
    }

    #[test]
    fn a_last_will_makes_it_offline_at_once_and_a_later_heartbeat_revives_it() {
        let mut s = PropletStatus::default();
        heartbeat(&mut s, 0, 0);
        let obs = ExternalObservation {
            heartbeats: vec![],
            offline_at: Some(t(5)),
        };
        evaluate_external(&mut s, &obs, THRESHOLD, None, t(5));
        assert_eq!(s.phase, PropletPhase::Offline);
        assert_eq!(
            cond(&s, "Connected"),
            Some(("False", "PropletDisconnected"))
        );
        // A heartbeat after the goodbye wins; one from before it does not.
        let obs = ExternalObservation {
            heartbeats: vec![t(3)],
            offline_at: Some(t(5)),
        };
        evaluate_external(&mut s, &obs, THRESHOLD, None, t(6));
        assert_eq!(s.phase, PropletPhase::Offline);
        let obs = ExternalObservation {
            heartbeats: vec![t(7)],
            offline_at: Some(t(5)),
        };
        evaluate_external(&mut s, &obs, THRESHOLD, None, t(7));
        assert_eq!(s.phase, PropletPhase::Running);
    }

    #[test]
    fn alive_history_keeps_the_true_last_ten() {
        let mut s = PropletStatus::default();
        let beats: Vec<_> = (0..25).map(t).collect();
        record_heartbeats(&mut s, &beats[..7]);
        record_heartbeats(&mut s, &beats[7..]);
        assert_eq!(s.alive_history, beats[15..].to_vec());
        assert_eq!(s.last_seen, Some(t(24)));
        // An out-of-order, older heartbeat does not move lastSeen back.
        record_heartbeats(&mut s, &[t(20)]);
        assert_eq!(s.last_seen, Some(t(24)));
        assert_eq!(s.alive_history.len(), ALIVE_HISTORY_LEN);
    }

    #[test]
    fn k8s_phase_follows_deployment_readiness() {
        let mut s = PropletStatus::default();
        let mut d = DeploymentObservation {
            exists: true,
            desired: 2,
            replicas: 0,
            ..Default::default()
        };
        evaluate_k8s(&mut s, &d, Some(2), t(0));
        assert_eq!(
            (s.phase, cond(&s, "Ready")),
            (
                PropletPhase::Initializing,
                Some(("False", "DeploymentScalingUp"))
            )
        );
        d.replicas = 2;
        evaluate_k8s(&mut s, &d, Some(2), t(1));
        assert_eq!(cond(&s, "Ready"), Some(("False", "DeploymentNotReady")));
        d.ready = 1;
        d.available = 1;
        evaluate_k8s(&mut s, &d, Some(2), t(2));
        assert_eq!(
            cond(&s, "Ready"),
            Some(("False", "DeploymentPartiallyReady"))
        );
        d.ready = 2;
        d.available = 2;
        d.available_condition = Some(true);
        evaluate_k8s(&mut s, &d, Some(2), t(3));
        assert_eq!(s.phase, PropletPhase::Running);
        assert_eq!(cond(&s, "Ready"), Some(("True", "DeploymentReady")));
        assert_eq!(cond(&s, "Connected"), Some(("True", "PodAvailable")));
        assert_eq!(cond(&s, "Healthy"), Some(("True", "DeploymentAvailable")));
        assert_eq!(
            s.k8s_status,
            Some(K8sPropletStatus {
                ready_replicas: 2,
                available_replicas: 2
            })
        );
        d.stalled = true;
        evaluate_k8s(&mut s, &d, Some(2), t(4));
        assert_eq!(cond(&s, "Healthy"), Some(("False", "DeploymentStalled")));
        let missing = DeploymentObservation::default();
        evaluate_k8s(&mut s, &missing, Some(2), t(5));
        assert_eq!(cond(&s, "Ready"), Some(("False", "DeploymentMissing")));
    }

    #[test]
    fn heartbeats_cost_at_most_one_write_per_flush_interval() {
        let flush = Duration::from_secs(10);
        let mut written = PropletStatus::default();
        heartbeat(&mut written, 0, 0);
        let mut last_write = t(0);
        let mut desired = written.clone();
        let mut writes = 0;
        // A heartbeat every second for a minute, no phase change.
        for sec in 1..=60 {
            heartbeat(&mut desired, sec, sec);
            if write_due(&written, &desired, Some(last_write), flush, t(sec)) {
                writes += 1;
                written = desired.clone();
                last_write = t(sec);
            }
        }
        assert_eq!(writes, 6, "one write per 10 s flush interval over 60 s");
        assert_eq!(written.alive_history.len(), ALIVE_HISTORY_LEN);
    }

    #[test]
    fn free_memory_moving_with_each_heartbeat_waits_for_the_flush_interval() {
        use crate::crd::common::PropletResources;
        let flush = Duration::from_secs(10);
        let free = |bytes: &str| {
            Some(PropletResources {
                memory: Some(bytes.to_owned()),
                ..PropletResources::default()
            })
        };
        let mut written = PropletStatus::default();
        heartbeat(&mut written, 0, 0);
        let mut desired = written.clone();
        desired.available_resources = free("1000");
        assert!(
            write_due(&written, &desired, Some(t(0)), flush, t(1)),
            "resources becoming known are written at once"
        );
        written = desired.clone();
        heartbeat(&mut desired, 2, 2);
        desired.available_resources = free("990");
        assert!(!write_due(&written, &desired, Some(t(1)), flush, t(2)));
        assert!(write_due(&written, &desired, Some(t(1)), flush, t(11)));
    }

    #[test]
    fn only_a_running_proplet_with_nothing_new_to_say_lets_a_heartbeat_wait() {
        use crate::crd::proplet::PropletMetadata;
        let interval = Duration::from_secs(60);
        let mut running = PropletStatus::default();
        heartbeat(&mut running, 0, 0);
        assert_eq!(running.phase, PropletPhase::Running);
        let wait = |s: Option<&PropletStatus>, m: Option<&PropletMetadata>, now: i64| {
            heartbeat_can_wait(s, m, Some(t(0)), interval, t(now))
        };
        assert!(wait(Some(&running), None, 10));
        assert!(
            !wait(Some(&running), None, 60),
            "the routine refresh is due: reconcile now"
        );
        assert!(
            !heartbeat_can_wait(Some(&running), None, None, interval, t(10)),
            "nothing written by this operator yet"
        );
        let described = PropletMetadata {
            hostname: Some("pi-1".into()),
            ..PropletMetadata::default()
        };
        assert!(
            !wait(Some(&running), Some(&described), 10),
            "a new description is written now"
        );
        running.metadata = Some(described.clone());
        assert!(wait(Some(&running), Some(&described), 10));
        let mut offline = running.clone();
        tick(&mut offline, 40);
        assert_eq!(offline.phase, PropletPhase::Offline);
        assert!(!wait(Some(&offline), None, 41), "back to Running now");
        assert!(!wait(None, None, 10), "no status yet: Running now");
        assert!(!wait(Some(&PropletStatus::default()), None, 10));
    }

    #[test]
    fn a_phase_change_is_written_at_once() {
        let flush = Duration::from_secs(10);
        let mut written = PropletStatus::default();
        heartbeat(&mut written, 0, 0);
        let mut desired = written.clone();
        tick(&mut desired, 31);
        assert_eq!(desired.phase, PropletPhase::Offline);
        assert!(write_due(&written, &desired, Some(t(30)), flush, t(31)));
        assert!(
            !write_due(&written, &written.clone(), Some(t(0)), flush, t(1000)),
            "nothing changed, nothing to write"
        );
    }

    #[test]
    fn a_written_disconnect_holds_until_the_next_heartbeat() {
        let threshold = Duration::from_secs(30);
        let t0 = Utc.with_ymd_and_hms(2026, 11, 22, 10, 0, 0).unwrap();
        let mut status = PropletStatus::default();
        let beat = ExternalObservation {
            heartbeats: vec![t0],
            offline_at: None,
        };
        evaluate_external(&mut status, &beat, threshold, None, t0);
        assert_eq!(status.phase, PropletPhase::Running);
        let gone = ExternalObservation {
            heartbeats: vec![],
            offline_at: Some(t0 + chrono::Duration::seconds(1)),
        };
        evaluate_external(
            &mut status,
            &gone,
            threshold,
            None,
            t0 + chrono::Duration::seconds(1),
        );
        assert_eq!(status.phase, PropletPhase::Offline);
        // The disconnect was written and cleared from the observations: still Offline.
        let nothing = ExternalObservation::default();
        evaluate_external(
            &mut status,
            &nothing,
            threshold,
            None,
            t0 + chrono::Duration::seconds(2),
        );
        assert_eq!(status.phase, PropletPhase::Offline);
        // A new heartbeat brings it back.
        let back = ExternalObservation {
            heartbeats: vec![t0 + chrono::Duration::seconds(3)],
            offline_at: None,
        };
        evaluate_external(
            &mut status,
            &back,
            threshold,
            None,
            t0 + chrono::Duration::seconds(3),
        );
        assert_eq!(status.phase, PropletPhase::Running);
    }
}
