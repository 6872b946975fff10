//! When a scheduled task may run: the first run waits for the schedule's first tick (upstream
//! ran it at once), a recurring task goes back to pending at each later tick, and a broken
//! schedule or time zone is reported instead of being ignored.

use chrono::{DateTime, Utc};

use super::cron::{parse_timezone, CronSchedule};
use crate::crd::task::{TaskPhase, TaskSpec, TaskStatus};

/// What a task's schedule says right now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScheduleGate {
    /// No schedule: the task runs when its other conditions allow.
    Unscheduled,
    /// Not yet: wait until `next_run` (also the value for `status.nextRun`).
    Wait {
        /// The tick to wait for.
        next_run: DateTime<Utc>,
    },
    /// The tick has come: run now; `following` is the tick after it, if any.
    Due {
        /// The next tick after this run, for `status.nextRun` of a recurring task.
        following: Option<DateTime<Utc>>,
    },
    /// The schedule never fires again (e.g. `0 0 30 2 *`).
    Exhausted,
    /// The schedule or the time zone is invalid; the message says which and why.
    Invalid(String),
}

fn parse(spec: &TaskSpec) -> Result<Option<(CronSchedule, chrono_tz::Tz)>, String> {
    let Some(expr) = spec.schedule.as_deref() else {
        return Ok(None);
    };
    let schedule = CronSchedule::parse(expr).map_err(|e| format!("spec.schedule: {e}"))?;
    let tz = parse_timezone(&spec.timezone).map_err(|e| format!("spec.timezone: {e}"))?;
    Ok(Some((schedule, tz)))
}

/// Decides whether a pending task with a schedule may be dispatched at `now`.
///
/// `created` is when the task (or its current run) started waiting: the first tick strictly
/// after it is the first run. `status.nextRun`, when already set, is honoured as computed.
pub fn gate(
    spec: &TaskSpec,
    status: &TaskStatus,
    created: DateTime<Utc>,
    now: DateTime<Utc>,
) -> ScheduleGate {
    let (schedule, tz) = match parse(spec) {
        Ok(Some(parsed)) => parsed,
        Ok(None) => return ScheduleGate::Unscheduled,
        Err(message) => return ScheduleGate::Invalid(message),
    };
    let next_run = match status.next_run {
        Some(t) => t,
        None => match schedule.next_after(created, tz) {
            Some(t) => t,
            None => return ScheduleGate::Exhausted,
        },
    };
    if now < next_run {
        ScheduleGate::Wait { next_run }
    } else {
        let following = spec
            .is_recurring
            .then(|| schedule.next_after(now.max(next_run), tz))
            .flatten();
        ScheduleGate::Due { following }
    }
}

/// For a finished recurring task: when it goes back to pending. `None` when the task does
/// not recur, is not finished, or the schedule is exhausted or invalid.
pub fn rerun_at(spec: &TaskSpec, status: &TaskStatus, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
    if !spec.is_recurring || !matches!(status.phase, TaskPhase::Completed | TaskPhase::Failed) {
        return None;
    }
    let (schedule, tz) = parse(spec).ok().flatten()?;
    let after = status.finished_at.unwrap_or(now);
    Some(
        status
            .next_run
            .filter(|t| *t > after)
            .unwrap_or(schedule.next_after(after, tz)?),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn at(h: u32, m: u32, s: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 22, h, m, s).unwrap()
    }

    fn scheduled(expr: &str, recurring: bool) -> TaskSpec {
        TaskSpec {
            name: "t".into(),
            schedule: Some(expr.into()),
            is_recurring: recurring,
            timezone: "UTC".into(),
            ..TaskSpec::default()
        }
    }

    #[test]
    fn a_scheduled_task_first_runs_at_its_first_tick() {
        let spec = scheduled("*/5 * * * *", true);
        let status = TaskStatus::default();
        assert_eq!(
            gate(&spec, &status, at(10, 2, 0), at(10, 2, 1)),
            ScheduleGate::Wait {
                next_run: at(10, 5, 0)
            }
        );
        assert_eq!(
            gate(&spec, &status, at(10, 2, 0), at(10, 5, 0)),
            ScheduleGate::Due {
                following: Some(at(10, 10, 0))
            }
        );
    }

    #[test]
    fn a_one_shot_scheduled_task_has_no_following_run() {
        let spec = scheduled("30 10 * * *", false);
        assert_eq!(
            gate(&spec, &TaskStatus::default(), at(9, 0, 0), at(10, 30, 5)),
            ScheduleGate::Due { following: None }
        );
    }

    #[test]
    fn an_unscheduled_task_is_not_gated() {
        let spec = TaskSpec {
            name: "t".into(),
            ..TaskSpec::default()
        };
        assert_eq!(
            gate(&spec, &TaskStatus::default(), at(0, 0, 0), at(0, 0, 0)),
            ScheduleGate::Unscheduled
        );
    }

    #[test]
    fn invalid_cron_and_timezone_are_reported() {
        let spec = scheduled("61 * * * *", true);
        let ScheduleGate::Invalid(msg) =
            gate(&spec, &TaskStatus::default(), at(0, 0, 0), at(0, 0, 0))
        else {
            panic!()
        };
        assert!(
            msg.starts_with("spec.schedule: invalid cron expression"),
            "{msg}"
        );
        let mut spec = scheduled("0 * * * *", true);
        spec.timezone = "Mars/Olympus".into();
        let ScheduleGate::Invalid(msg) =
            gate(&spec, &TaskStatus::default(), at(0, 0, 0), at(0, 0, 0))
        else {
            panic!()
        };
        assert!(
            msg.starts_with("spec.timezone:") && msg.contains("Mars/Olympus"),
            "{msg}"
        );
    }

    #[test]
    fn the_timezone_shifts_the_tick() {
        let mut spec = scheduled("0 9 * * *", false);
        spec.timezone = "Europe/Berlin".into();
        // 09:00 in Berlin (UTC+1 in November) is 08:00 UTC.
        assert_eq!(
            gate(&spec, &TaskStatus::default(), at(0, 0, 0), at(1, 0, 0)),
            ScheduleGate::Wait {
                next_run: at(8, 0, 0)
            }
        );
    }

    #[test]
    fn an_impossible_schedule_is_exhausted() {
        let spec = scheduled("0 0 30 2 *", true);
        assert_eq!(
            gate(&spec, &TaskStatus::default(), at(0, 0, 0), at(0, 0, 0)),
            ScheduleGate::Exhausted
        );
    }

    #[test]
    fn a_finished_recurring_task_reruns_at_the_next_tick() {
        let spec = scheduled("*/5 * * * *", true);
        let status = TaskStatus {
            phase: TaskPhase::Completed,
            finished_at: Some(at(10, 6, 0)),
            ..TaskStatus::default()
        };
        assert_eq!(rerun_at(&spec, &status, at(10, 7, 0)), Some(at(10, 10, 0)));
        let failed = TaskStatus {
            phase: TaskPhase::Failed,
            ..status.clone()
        };
        assert_eq!(
            rerun_at(&spec, &failed, at(10, 7, 0)),
            Some(at(10, 10, 0)),
            "failed runs recur too"
        );
        let running = TaskStatus {
            phase: TaskPhase::Running,
            ..status.clone()
        };
        assert_eq!(rerun_at(&spec, &running, at(10, 7, 0)), None);
        assert_eq!(
            rerun_at(&scheduled("*/5 * * * *", false), &status, at(10, 7, 0)),
            None
        );
    }
}
