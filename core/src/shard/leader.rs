//! Leader election on one Lease: the group of one. A candidate takes the Lease when it is
//! free, or when the holder's renewal has not changed for the Lease's duration *as this
//! candidate has watched it* (its own clock, so machines' clocks that differ do not matter);
//! the holder renews it every third of the duration and stops acting once it has gone
//! [`super::fence_limit`] without a successful renewal ([`super::fenced`]), before any
//! candidate can see the Lease expire.

use std::time::{Duration, Instant};

/// The leader Lease as read from the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRecord {
    /// `holderIdentity` (`None` or empty: free).
    pub holder: Option<String>,
    /// `renewTime` as written.
    pub renewal: Option<String>,
    /// `leaseDurationSeconds`.
    pub duration: Duration,
}

/// What a replica does next with the leader Lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaderStep {
    /// No Lease exists: create it, held by this replica.
    Create,
    /// The Lease is free, or its holder has stopped renewing: take it (a write conditional on
    /// the version read, so two candidates cannot both win).
    Take,
    /// This replica holds it: renew.
    Renew,
    /// Another replica holds it; ask again later.
    Wait {
        /// The holder.
        holder: String,
        /// How long until its Lease expires if it renews no more.
        expires_in: Duration,
    },
}

/// The holder's last renewal as this replica has seen it, and since when.
#[derive(Debug, Clone, Default)]
pub struct HolderSighting {
    seen: Option<(String, Option<String>, Instant)>,
}

/// The next step of replica `me` given the Lease as just read (`None`: it does not exist).
pub fn next_step(
    me: &str,
    lease: Option<&LeaseRecord>,
    sighting: &mut HolderSighting,
    now: Instant,
) -> LeaderStep {
    let Some(lease) = lease else {
        return LeaderStep::Create;
    };
    let holder = match lease.holder.as_deref() {
        None | Some("") => return LeaderStep::Take,
        Some(holder) if holder == me => return LeaderStep::Renew,
        Some(holder) => holder,
    };
    let seen_at = match &sighting.seen {
        Some((h, renewal, at)) if h == holder && *renewal == lease.renewal => *at,
        _ => {
            sighting.seen = Some((holder.to_owned(), lease.renewal.clone(), now));
            now
        }
    };
    let expires_at = seen_at + lease.duration;
    match expires_at.checked_duration_since(now) {
        Some(left) if !left.is_zero() => LeaderStep::Wait {
            holder: holder.to_owned(),
            expires_in: left,
        },
        _ => LeaderStep::Take,
    }
}

/// How often the holder renews: every third of the duration, so one renewal may fail before
/// the fence.
pub fn renew_every(duration: Duration) -> Duration {
    duration / 3
}

/// How often a candidate reads the Lease again: often enough to take it soon after it
/// expires, at most every 2 s.
pub fn retry_every(duration: Duration) -> Duration {
    (duration / 5).clamp(Duration::from_millis(200), Duration::from_secs(2))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held_by(holder: &str, renewal: &str) -> LeaseRecord {
        LeaseRecord {
            holder: Some(holder.into()),
            renewal: Some(renewal.into()),
            duration: Duration::from_secs(15),
        }
    }

    #[test]
    fn a_missing_lease_is_created_a_free_one_taken_and_an_own_one_renewed() {
        let now = Instant::now();
        let mut seen = HolderSighting::default();
        assert_eq!(next_step("a", None, &mut seen, now), LeaderStep::Create);
        let free = LeaseRecord {
            holder: Some(String::new()),
            ..held_by("x", "t0")
        };
        assert_eq!(
            next_step("a", Some(&free), &mut seen, now),
            LeaderStep::Take
        );
        assert_eq!(
            next_step("a", Some(&held_by("a", "t0")), &mut seen, now),
            LeaderStep::Renew
        );
    }

    #[test]
    fn a_holder_is_waited_for_until_its_renewal_stays_unchanged_for_the_duration() {
        let start = Instant::now();
        let mut seen = HolderSighting::default();
        let at = |s: u64| start + Duration::from_secs(s);
        assert_eq!(
            next_step("a", Some(&held_by("b", "t0")), &mut seen, at(0)),
            LeaderStep::Wait {
                holder: "b".into(),
                expires_in: Duration::from_secs(15)
            }
        );
        // The holder renewed at 10 s: the 15 s count from when that renewal was seen.
        assert!(matches!(
            next_step("a", Some(&held_by("b", "t1")), &mut seen, at(10)),
            LeaderStep::Wait { .. }
        ));
        assert!(matches!(
            next_step("a", Some(&held_by("b", "t1")), &mut seen, at(24)),
            LeaderStep::Wait { expires_in, .. } if expires_in == Duration::from_secs(1)
        ));
        assert_eq!(
            next_step("a", Some(&held_by("b", "t1")), &mut seen, at(25)),
            LeaderStep::Take
        );
        // A new holder starts the count again.
        assert!(matches!(
            next_step("a", Some(&held_by("c", "t1")), &mut seen, at(26)),
            LeaderStep::Wait { .. }
        ));
    }

    #[test]
    fn the_holder_fences_itself_before_a_candidate_can_take_the_lease() {
        // The holder's last successful renewal was sent at 0; a candidate saw it at the
        // earliest then. The holder stops acting at the fence limit, the candidate takes the
        // Lease no sooner than a whole duration later.
        let duration = Duration::from_secs(15);
        let sent = Instant::now();
        let limit = super::super::fence_limit(duration);
        assert!(limit + renew_every(duration) / 2 < duration);
        assert!(!super::super::fenced(
            Some(sent),
            limit,
            sent + limit - Duration::from_millis(1)
        ));
        assert!(super::super::fenced(Some(sent), limit, sent + limit));
        let mut seen = HolderSighting::default();
        assert!(matches!(
            next_step("a", Some(&held_by("b", "t0")), &mut seen, sent),
            LeaderStep::Wait { .. }
        ));
        assert!(matches!(
            next_step("a", Some(&held_by("b", "t0")), &mut seen, sent + limit),
            LeaderStep::Wait { .. }
        ));
    }
}
