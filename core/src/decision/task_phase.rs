//! The task phase machine (upstream's phases and transitions), and the events that drive it.
//!
//! | from        | allowed next states                          |
//! |-------------|----------------------------------------------|
//! | pending     | scheduled, running, completed, failed, skipped |
//! | scheduled   | running, completed, failed, skipped          |
//! | running     | completed, failed, interrupted               |
//! | completed   | pending (restart or recurrence)              |
//! | failed      | pending (retry)                              |
//! | interrupted | pending (resume)                             |
//! | skipped     | — (terminal)                                 |
//!
//! Every change of a task's phase goes through [`transition`]; events are mapped onto the
//! table by [`apply`], which refuses what the table forbids and ignores late or repeated
//! results for finished tasks instead of failing on them.

use crate::crd::task::TaskPhase;

/// Whether the table allows moving from `from` to `to`.
pub fn allowed(from: TaskPhase, to: TaskPhase) -> bool {
    use TaskPhase::*;
    matches!(
        (from, to),
        (Pending, Scheduled | Running | Completed | Failed | Skipped)
            | (Scheduled, Running | Completed | Failed | Skipped)
            | (Running, Completed | Failed | Interrupted)
            | (Completed, Pending)
            | (Failed, Pending)
            | (Interrupted, Pending)
    )
}

/// A proposed move the table forbids.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("task cannot go from {from} to {to}: {reason}")]
pub struct TransitionError {
    /// Current phase.
    pub from: TaskPhase,
    /// Proposed phase.
    pub to: TaskPhase,
    /// Why the table forbids it, in words.
    pub reason: &'static str,
}

/// Checks a proposed move against the table.
pub fn transition(from: TaskPhase, to: TaskPhase) -> Result<TaskPhase, TransitionError> {
    if allowed(from, to) {
        return Ok(to);
    }
    let reason = match from {
        TaskPhase::Skipped => "skipped is terminal",
        TaskPhase::Completed | TaskPhase::Failed | TaskPhase::Interrupted => {
            "a finished task can only go back to pending (retry, restart or recurrence)"
        }
        TaskPhase::Running => "a running task can only complete, fail or be interrupted",
        TaskPhase::Pending | TaskPhase::Scheduled if from == to => {
            "the task is already in that phase"
        }
        TaskPhase::Pending => "a pending task cannot be interrupted before it runs",
        TaskPhase::Scheduled => "a scheduled task cannot go back to pending or be interrupted",
    };
    Err(TransitionError { from, to, reason })
}

/// Something that happened to a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskEvent {
    /// A proplet was chosen; the start message is about to be sent.
    Scheduled,
    /// The start message was sent to the proplet(s).
    Dispatched,
    /// The proplet reported a result (`ok` false when it reported an error).
    ResultReceived {
        /// Whether the result carries no error.
        ok: bool,
    },
    /// A stop was requested (delete or explicit stop) while the task ran.
    Stopped,
    /// The task's dependencies rule it out.
    Skipped,
    /// The time limit passed without a result.
    TimedOut,
    /// The dispatch itself failed permanently (invalid module source, no broker).
    DispatchFailed,
    /// A user asked to run the task again, or a recurring task reached its next tick.
    Rerun,
}

/// The outcome of applying an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// The phase changes.
    Moved {
        /// Phase before.
        from: TaskPhase,
        /// Phase after.
        to: TaskPhase,
    },
    /// Nothing to do: a duplicate or late event for a task already past it.
    Ignored {
        /// Why it is safe to ignore.
        reason: &'static str,
    },
    /// The event is not valid in the current phase.
    Rejected(TransitionError),
}

/// Maps an event onto the phase table.
pub fn apply(phase: TaskPhase, event: TaskEvent) -> Applied {
    use TaskPhase::*;
    let target = match event {
        TaskEvent::Scheduled => Scheduled,
        TaskEvent::Dispatched => Running,
        TaskEvent::ResultReceived { ok: true } => Completed,
        TaskEvent::ResultReceived { ok: false }
        | TaskEvent::TimedOut
        | TaskEvent::DispatchFailed => Failed,
        TaskEvent::Stopped => Interrupted,
        TaskEvent::Skipped => Skipped,
        TaskEvent::Rerun => Pending,
    };
    match (phase, event) {
        (p, TaskEvent::ResultReceived { .. }) if p.is_terminal() => {
            return Applied::Ignored {
                reason: "the task already finished; a repeated or late result changes nothing",
            }
        }
        (p, TaskEvent::Stopped | TaskEvent::TimedOut) if p.is_terminal() => {
            return Applied::Ignored {
                reason: "the task already finished",
            }
        }
        (Running, TaskEvent::Dispatched) => {
            return Applied::Ignored {
                reason: "the task is already running",
            }
        }
        (Scheduled, TaskEvent::Scheduled) => {
            return Applied::Ignored {
                reason: "the task is already scheduled",
            }
        }
        (Pending, TaskEvent::Rerun) => {
            return Applied::Ignored {
                reason: "the task is already waiting to run",
            }
        }
        _ => {}
    }
    match transition(phase, target) {
        Ok(to) => Applied::Moved { from: phase, to },
        Err(e) => Applied::Rejected(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use TaskPhase::*;

    /// The transition table, written out independently of [`allowed`].
    const TABLE: &[(TaskPhase, &[TaskPhase])] = &[
        (Pending, &[Scheduled, Running, Completed, Failed, Skipped]),
        (Scheduled, &[Running, Completed, Failed, Skipped]),
        (Running, &[Completed, Failed, Interrupted]),
        (Completed, &[Pending]),
        (Failed, &[Pending]),
        (Interrupted, &[Pending]),
        (Skipped, &[]),
    ];

    #[test]
    fn every_cell_of_the_seed_table() {
        for (from, allowed_to) in TABLE {
            for to in TaskPhase::ALL {
                let expected = allowed_to.contains(&to);
                assert_eq!(allowed(*from, to), expected, "{from} -> {to}");
                match transition(*from, to) {
                    Ok(p) => {
                        assert!(expected);
                        assert_eq!(p, to);
                    }
                    Err(e) => {
                        assert!(!expected, "{from} -> {to} refused: {e}");
                        assert_eq!((e.from, e.to), (*from, to));
                        assert!(!e.reason.is_empty());
                    }
                }
            }
        }
    }

    #[test]
    fn rejections_explain_themselves() {
        let e = transition(Skipped, Pending).unwrap_err();
        assert_eq!(
            e.to_string(),
            "task cannot go from skipped to pending: skipped is terminal"
        );
        let e = transition(Pending, Interrupted).unwrap_err();
        assert!(e
            .to_string()
            .contains("cannot be interrupted before it runs"));
        let e = transition(Completed, Running).unwrap_err();
        assert!(e.reason.contains("only go back to pending"));
    }

    #[test]
    fn the_normal_life_of_a_task() {
        assert_eq!(
            apply(Pending, TaskEvent::Dispatched),
            Applied::Moved {
                from: Pending,
                to: Running
            }
        );
        assert_eq!(
            apply(Running, TaskEvent::ResultReceived { ok: true }),
            Applied::Moved {
                from: Running,
                to: Completed
            }
        );
        assert_eq!(
            apply(Completed, TaskEvent::Rerun),
            Applied::Moved {
                from: Completed,
                to: Pending
            }
        );
        assert_eq!(
            apply(Running, TaskEvent::Stopped),
            Applied::Moved {
                from: Running,
                to: Interrupted
            }
        );
        assert_eq!(
            apply(Running, TaskEvent::TimedOut),
            Applied::Moved {
                from: Running,
                to: Failed
            }
        );
        assert_eq!(
            apply(Pending, TaskEvent::Skipped),
            Applied::Moved {
                from: Pending,
                to: Skipped
            }
        );
        assert_eq!(
            apply(Interrupted, TaskEvent::Rerun),
            Applied::Moved {
                from: Interrupted,
                to: Pending
            }
        );
    }

    #[test]
    fn results_for_finished_tasks_are_ignored() {
        for p in [Completed, Failed, Skipped, Interrupted] {
            for ok in [true, false] {
                assert!(matches!(
                    apply(p, TaskEvent::ResultReceived { ok }),
                    Applied::Ignored { .. }
                ));
            }
        }
    }

    #[test]
    fn invalid_events_are_rejected_not_applied() {
        assert!(matches!(
            apply(Skipped, TaskEvent::Rerun),
            Applied::Rejected(_)
        ));
        assert!(matches!(
            apply(Pending, TaskEvent::Stopped),
            Applied::Rejected(_)
        ));
        assert!(matches!(
            apply(Running, TaskEvent::Skipped),
            Applied::Rejected(_)
        ));
        assert!(matches!(
            apply(Running, TaskEvent::Rerun),
            Applied::Rejected(_)
        ));
    }

    fn any_event() -> impl Strategy<Value = TaskEvent> {
        prop_oneof![
            Just(TaskEvent::Scheduled),
            Just(TaskEvent::Dispatched),
            any::<bool>().prop_map(|ok| TaskEvent::ResultReceived { ok }),
            Just(TaskEvent::Stopped),
            Just(TaskEvent::Skipped),
            Just(TaskEvent::TimedOut),
            Just(TaskEvent::DispatchFailed),
            Just(TaskEvent::Rerun),
        ]
    }

    proptest! {
        #[test]
        fn no_event_sequence_produces_an_illegal_transition(events in proptest::collection::vec(any_event(), 0..64)) {
            let mut phase = Pending;
            for e in events {
                match apply(phase, e) {
                    Applied::Moved { from, to } => {
                        prop_assert_eq!(from, phase);
                        prop_assert!(allowed(from, to), "{} -> {} via {:?}", from, to, e);
                        phase = to;
                    }
                    Applied::Ignored { .. } | Applied::Rejected(_) => {}
                }
            }
        }

        #[test]
        fn repeated_results_are_idempotent(first in any::<bool>(), later in proptest::collection::vec(any::<bool>(), 1..8)) {
            let Applied::Moved { to: finished, .. } = apply(Running, TaskEvent::ResultReceived { ok: first }) else {
                panic!("first result must move a running task");
            };
            for ok in later {
                prop_assert!(matches!(apply(finished, TaskEvent::ResultReceived { ok }), Applied::Ignored { .. }), "result after {} not ignored", finished);
            }
        }
    }
}
