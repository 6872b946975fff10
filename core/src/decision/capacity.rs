//! A proplet's `spec.capacity`, held across replicas. Before a task's assignment is written,
//! the driver takes one of the proplet's slots (`status.slots`, by task UID) with a write
//! conditional on the proplet's version, read from the backend: of two replicas racing for
//! the last slot one write conflicts, reads again and finds the proplet full. (Each
//! replica's scheduler also skips proplets its caches show full; the slots are what holds
//! while those caches lag.)
//!
//! Slots are given back lazily: a reservation that needs room drops the slots of tasks that
//! finished, and of tasks not seen on the proplet for [`SLOT_GRACE`] (deleted, or gone
//! elsewhere after a failed start). So a finished task costs no write of its own.

use std::collections::BTreeMap;

use chrono::{DateTime, TimeDelta, Utc};

use crate::crd::proplet::SlotHolder;

/// How long a slot whose task is not (or not yet) seen running on the proplet is kept: the
/// replica that took it may not have written the assignment yet, or this replica's cache
/// may not show it yet.
pub const SLOT_GRACE: TimeDelta = TimeDelta::seconds(30);

/// What the reserving driver knows of a slot holder, from its caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// Scheduled or running on this proplet.
    Occupies,
    /// Finished (a terminal phase).
    Finished,
    /// Pending, or on another proplet.
    Elsewhere,
    /// Not in the cache: deleted, or created too recently to show.
    Unknown,
}

/// The outcome of one reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reservation {
    /// The task holds a slot already (a retried reconcile took it).
    Held,
    /// Write these slots (the task's added, released ones dropped), conditionally on the
    /// version they were read at.
    Take(BTreeMap<String, SlotHolder>),
    /// Every slot is held by a task still using it.
    Full {
        /// The names of the tasks holding them.
        holders: Vec<String>,
    },
}

/// Takes a slot of a proplet with `capacity` whose slots are `slots`, for task `name`
/// (`uid`) at `now`; `holder` says what the driver knows of each holder by UID.
pub fn reserve(
    slots: &BTreeMap<String, SlotHolder>,
    capacity: u32,
    uid: &str,
    name: &str,
    now: DateTime<Utc>,
    holder: impl Fn(&str) -> Holder,
) -> Reservation {
    if slots.contains_key(uid) {
        return Reservation::Held;
    }
    let mut kept: BTreeMap<String, SlotHolder> = slots
        .iter()
        .filter(|(id, slot)| !released(holder(id), slot.since, now))
        .map(|(id, slot)| (id.clone(), slot.clone()))
        .collect();
    if kept.len() >= capacity as usize {
        return Reservation::Full {
            holders: kept.values().map(|slot| slot.task.clone()).collect(),
        };
    }
    kept.insert(
        uid.to_owned(),
        SlotHolder {
            task: name.to_owned(),
            since: now,
        },
    );
    Reservation::Take(kept)
}

fn released(holder: Holder, since: DateTime<Utc>, now: DateTime<Utc>) -> bool {
    match holder {
        Holder::Finished => true,
        Holder::Occupies => false,
        Holder::Elsewhere | Holder::Unknown => now - since >= SLOT_GRACE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn at(s: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 3, 14, 10, 0, s)
            .single()
            .unwrap_or_else(|| panic!("invalid test time"))
    }

    fn slots(held: &[(&str, u32)]) -> BTreeMap<String, SlotHolder> {
        held.iter()
            .map(|(uid, since)| {
                (
                    (*uid).to_owned(),
                    SlotHolder {
                        task: format!("task-{uid}"),
                        since: at(*since),
                    },
                )
            })
            .collect()
    }

    #[test]
    fn a_free_slot_is_taken_and_a_held_one_is_not_taken_twice() {
        let taken = reserve(&slots(&[("a", 0)]), 2, "b", "task-b", at(5), |_| {
            Holder::Occupies
        });
        assert_eq!(taken, Reservation::Take(slots(&[("a", 0), ("b", 5)])));
        let again = reserve(
            &slots(&[("a", 0), ("b", 5)]),
            2,
            "b",
            "task-b",
            at(6),
            |_| Holder::Occupies,
        );
        assert_eq!(again, Reservation::Held);
    }

    #[test]
    fn a_full_proplet_names_the_tasks_holding_it() {
        let full = reserve(&slots(&[("a", 0)]), 1, "b", "task-b", at(5), |_| {
            Holder::Occupies
        });
        assert_eq!(
            full,
            Reservation::Full {
                holders: vec!["task-a".to_owned()]
            }
        );
    }

    #[test]
    fn finished_holders_give_their_slot_back_at_once_others_after_the_grace() {
        let holder = |uid: &str| match uid {
            "done" => Holder::Finished,
            "young" | "old" => Holder::Unknown,
            _ => Holder::Elsewhere,
        };
        // At 20 s: `done` is released, `young` (taken at 10 s) is within the grace.
        let now = at(20);
        let taken = reserve(
            &slots(&[("done", 0), ("young", 10)]),
            2,
            "new",
            "task-new",
            now,
            holder,
        );
        assert_eq!(
            taken,
            Reservation::Take(slots(&[("new", 20), ("young", 10)]))
        );
        // A slot not seen used for the grace period is released too.
        let later = at(10) + SLOT_GRACE;
        let taken = reserve(&slots(&[("old", 10)]), 1, "new", "task-new", later, holder);
        assert!(matches!(taken, Reservation::Take(s) if s.len() == 1 && s.contains_key("new")));
    }
}
