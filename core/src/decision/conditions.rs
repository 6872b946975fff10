//! Kubernetes-style conditions: `lastTransitionTime` moves only when the status flips, so
//! tools that watch conditions see real transitions and not every reconcile.

use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// Converts our clock's instant into the API's timestamp type.
pub fn to_k8s_time(t: DateTime<Utc>) -> Time {
    let ts = k8s_openapi::jiff::Timestamp::new(t.timestamp(), t.timestamp_subsec_nanos() as i32)
        .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
    Time(ts)
}

/// Converts the API's timestamp into our clock's instant (`None` beyond chrono's range).
pub fn from_k8s_time(t: &Time) -> Option<DateTime<Utc>> {
    DateTime::<Utc>::from_timestamp(
        t.0.as_second(),
        u32::try_from(t.0.subsec_nanosecond()).unwrap_or(0),
    )
}

/// A condition the decision core wants to be present.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredCondition {
    /// Condition type, e.g. `Ready`.
    pub type_: &'static str,
    /// True or False.
    pub status: bool,
    /// CamelCase machine-readable reason (some are another controller's, e.g. Kueue's).
    pub reason: std::borrow::Cow<'static, str>,
    /// Human explanation.
    pub message: String,
}

impl DesiredCondition {
    /// Shorthand constructor.
    pub fn new(
        type_: &'static str,
        status: bool,
        reason: impl Into<std::borrow::Cow<'static, str>>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            type_,
            status,
            reason: reason.into(),
            message: message.into(),
        }
    }
}

/// What changed when a condition was applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConditionChange {
    /// Nothing differs.
    None,
    /// Only the message or observed generation changed.
    Detail,
    /// The status or reason changed (or the condition is new): a real transition.
    Transition,
}

fn status_str(status: bool) -> &'static str {
    if status {
        "True"
    } else {
        "False"
    }
}

/// Sets a condition, keeping `lastTransitionTime` unless the status flips.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    desired: &DesiredCondition,
    generation: Option<i64>,
    now: DateTime<Utc>,
) -> ConditionChange {
    let status = status_str(desired.status);
    if let Some(existing) = conditions.iter_mut().find(|c| c.type_ == desired.type_) {
        let flipped = existing.status != status;
        let reason_changed = existing.reason != desired.reason;
        let detail =
            existing.message != desired.message || existing.observed_generation != generation;
        if flipped {
            existing.last_transition_time = to_k8s_time(now);
        }
        existing.status = status.to_string();
        existing.reason = desired.reason.to_string();
        existing.message = desired.message.clone();
        existing.observed_generation = generation;
        if flipped || reason_changed {
            ConditionChange::Transition
        } else if detail {
            ConditionChange::Detail
        } else {
            ConditionChange::None
        }
    } else {
        conditions.push(Condition {
            type_: desired.type_.to_string(),
            status: status.to_string(),
            reason: desired.reason.to_string(),
            message: desired.message.clone(),
            observed_generation: generation,
            last_transition_time: to_k8s_time(now),
        });
        ConditionChange::Transition
    }
}

/// Removes a condition by type; returns whether one was removed.
pub fn remove_condition(conditions: &mut Vec<Condition>, type_: &str) -> bool {
    let before = conditions.len();
    conditions.retain(|c| c.type_ != type_);
    before != conditions.len()
}

/// Whether a condition of this type is currently True.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    conditions
        .iter()
        .any(|c| c.type_ == type_ && c.status == "True")
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn t(s: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_800_000_000 + s, 0).unwrap()
    }

    #[test]
    fn transition_time_moves_only_when_status_flips() {
        let mut c = Vec::new();
        let up = DesiredCondition::new("Ready", true, "PropletReady", "connected");
        assert_eq!(
            set_condition(&mut c, &up, Some(1), t(0)),
            ConditionChange::Transition
        );
        let again = DesiredCondition::new("Ready", true, "PropletReady", "still connected");
        assert_eq!(
            set_condition(&mut c, &again, Some(1), t(10)),
            ConditionChange::Detail
        );
        assert_eq!(c[0].last_transition_time, to_k8s_time(t(0)));
        assert_eq!(
            set_condition(&mut c, &again, Some(1), t(20)),
            ConditionChange::None
        );
        let down = DesiredCondition::new("Ready", false, "PropletOffline", "gone");
        assert_eq!(
            set_condition(&mut c, &down, Some(1), t(30)),
            ConditionChange::Transition
        );
        assert_eq!(c[0].last_transition_time, to_k8s_time(t(30)));
        assert_eq!(c[0].status, "False");
        assert_eq!(c.len(), 1);
        assert!(!is_true(&c, "Ready"));
        assert!(remove_condition(&mut c, "Ready"));
        assert!(c.is_empty());
    }

    #[test]
    fn a_reason_change_is_a_transition_without_moving_the_time() {
        let mut c = Vec::new();
        set_condition(
            &mut c,
            &DesiredCondition::new("Scheduled", false, "NoCandidates", "x"),
            None,
            t(0),
        );
        let change = set_condition(
            &mut c,
            &DesiredCondition::new("Scheduled", false, "DependencyPending", "y"),
            None,
            t(5),
        );
        assert_eq!(change, ConditionChange::Transition);
        assert_eq!(c[0].last_transition_time, to_k8s_time(t(0)));
    }
}
