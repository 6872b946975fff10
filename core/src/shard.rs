//! Sharing the objects between active replicas: who owns an object, and when a replica may
//! act on one it has just gained.
//!
//! Ownership is rendezvous (highest random weight) hashing of an object's key over the
//! members a replica acts on (its [`View`]): every member scores every key, the highest score
//! owns it, so a member joining takes only the keys it now wins and a member leaving hands
//! out only its own. The weight is the first eight bytes of SHA-256(member, key): the same in
//! every build and version, so replicas of different releases during an upgrade agree.
//!
//! Views change one replica at a time, so two replicas can briefly disagree about an owner.
//! The hand-off rule ([`may_act`]) keeps that from becoming two reconciles of one object:
//! each replica announces the view it acts on (after finishing every reconcile of the view
//! before), and a replica acts on a key only when no other live member's announcement gives
//! that member the key. A member whose announcement the others can no longer trust (its
//! membership lapsed) has stopped acting by then ([`fenced`]), so its claims are ignored.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

pub mod leader;
pub mod namespaces;

/// What a replica's share is cut by.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ShardBy {
    /// Every object on its own: its kind, namespace and name. A Task's run state (its start
    /// ledger and reported results) and a Proplet's liveness are recorded by every replica
    /// from the MQTT reports all of them receive, so nothing a reconcile needs is held by one
    /// replica only, and a job's children need not follow it. The shares are even whatever
    /// the namespaces, but every replica must watch every object.
    #[default]
    Object,
    /// Whole namespaces ([`namespaces`]): every object of a namespace (a task, its
    /// dependencies, a job and its children, the proplets they run on) has one owner, so a
    /// replica needs only its namespaces' objects and the API server can send it just those.
    /// The shares are as even as the namespaces are.
    Namespace,
}

impl ShardBy {
    /// The key `kind` `namespace`/`name` is owned by.
    pub fn key(self, kind: &str, namespace: &str, name: &str) -> String {
        match self {
            ShardBy::Object => format!("{kind}/{namespace}/{name}"),
            ShardBy::Namespace => namespaces::bucket_key(namespaces::bucket_of(namespace)),
        }
    }
}

/// The rendezvous weight of `key` for `member`.
pub fn weight(member: &str, key: &str) -> u64 {
    let mut hasher = Sha256::new();
    hasher.update(member.as_bytes());
    hasher.update([0]);
    hasher.update(key.as_bytes());
    let digest = hasher.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

/// A set of member ids, kept sorted and without repeats.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct View(Vec<String>);

impl View {
    /// The view of `members`.
    pub fn new<I: IntoIterator<Item = S>, S: Into<String>>(members: I) -> Self {
        let mut members: Vec<String> = members.into_iter().map(Into::into).collect();
        members.sort();
        members.dedup();
        Self(members)
    }

    /// The members, sorted.
    pub fn members(&self) -> &[String] {
        &self.0
    }

    /// Whether there is no member.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `member` is in the view.
    pub fn contains(&self, member: &str) -> bool {
        self.0.binary_search_by(|m| m.as_str().cmp(member)).is_ok()
    }

    /// The member that owns `key` in this view (the highest weight; equal weights go to the
    /// smaller id), `None` when the view is empty.
    pub fn owner(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .map(|m| (weight(m, key), m))
            .max_by(|(wa, ma), (wb, mb)| wa.cmp(wb).then_with(|| mb.cmp(ma)))
            .map(|(_, m)| m.as_str())
    }

    /// The view as announced on a member's Lease: the ids joined by commas.
    pub fn to_text(&self) -> String {
        self.0.join(",")
    }

    /// A view read back from [`View::to_text`]; empty segments are ignored.
    pub fn from_text(text: &str) -> Self {
        Self::new(text.split(',').map(str::trim).filter(|s| !s.is_empty()))
    }
}

/// Another live member and the view it announced acting on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// Its id.
    pub id: String,
    /// The view it acts on, as it last announced.
    pub announced: View,
}

/// Whether `me`, acting on `acting`, may reconcile `key`: it owns the key in its view, its
/// own announcement of that view is known to the others (`settled`: it has seen it come back
/// on its own watch, so everything announced before it has been seen too), and no other live
/// member's announcement still gives that member the key.
pub fn may_act(key: &str, me: &str, acting: &View, settled: bool, peers: &[Peer]) -> bool {
    settled
        && acting.owner(key) == Some(me)
        && peers
            .iter()
            .filter(|p| p.id != me)
            .all(|p| p.announced.owner(key) != Some(p.id.as_str()))
}

/// Whether a member whose last successful renewal was sent at `renewed` must stop acting at
/// `now`: it has not renewed for `limit`, which is shorter than its Lease's duration by a
/// margin, so it stops before any other member can see its Lease expire.
pub fn fenced(renewed: Option<Instant>, limit: Duration, now: Instant) -> bool {
    renewed.is_none_or(|at| now.saturating_duration_since(at) >= limit)
}

/// How long a member may go without a successful renewal before it fences itself: two thirds
/// of the Lease's duration, so at a renewal every third of it, one renewal may fail.
pub fn fence_limit(lease_duration: Duration) -> Duration {
    lease_duration * 2 / 3
}

/// One member's Lease as a replica has seen it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sighting {
    /// The member's renewal stamp as written (its `renewTime`).
    pub renewal: String,
    /// When this replica first saw that renewal, by its own clock: a Lease expires a
    /// duration after its last renewal was *seen*, so clocks that differ between machines
    /// do not matter.
    pub seen_at: Instant,
    /// The Lease's duration.
    pub duration: Duration,
    /// The view the member announced.
    pub announced: View,
}

/// The members' Leases as this replica has seen them.
#[derive(Debug, Clone, Default)]
pub struct Sightings(BTreeMap<String, Sighting>);

impl Sightings {
    /// Records `member`'s Lease as now read; the sighting time moves only when its renewal
    /// stamp changed.
    pub fn observe(
        &mut self,
        member: &str,
        renewal: &str,
        duration: Duration,
        announced: View,
        now: Instant,
    ) {
        match self.0.get_mut(member) {
            Some(seen) if seen.renewal == renewal => {
                seen.duration = duration;
                seen.announced = announced;
            }
            _ => {
                self.0.insert(
                    member.to_owned(),
                    Sighting {
                        renewal: renewal.to_owned(),
                        seen_at: now,
                        duration,
                        announced,
                    },
                );
            }
        }
    }

    /// Forgets `member` (its Lease was deleted: it left).
    pub fn forget(&mut self, member: &str) {
        self.0.remove(member);
    }

    /// Keeps only the members in `present` (a full relist).
    pub fn retain(&mut self, present: &[String]) {
        self.0.retain(|m, _| present.contains(m));
    }

    /// The sighting of `member`.
    pub fn get(&self, member: &str) -> Option<&Sighting> {
        self.0.get(member)
    }

    /// The members whose Lease has not expired at `now`, with their announcements.
    pub fn live(&self, now: Instant) -> Vec<Peer> {
        self.0
            .iter()
            .filter(|(_, s)| now.saturating_duration_since(s.seen_at) < s.duration)
            .map(|(id, s)| Peer {
                id: id.clone(),
                announced: s.announced.clone(),
            })
            .collect()
    }
}

/// The view a member should act on: every live member, itself included unless fenced (then
/// nothing: a fenced member acts on no object).
pub fn target_view(me: &str, live: &[Peer], is_fenced: bool) -> View {
    if is_fenced {
        return View::default();
    }
    View::new(
        live.iter()
            .map(|p| p.id.as_str())
            .chain(std::iter::once(me)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn keys(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| ShardBy::Object.key("Task", "default", &format!("t-{i}")))
            .collect()
    }

    #[test]
    fn the_weight_is_the_same_in_every_build() {
        // SHA-256("a\0b") starts with these eight bytes: a fixed value, not a seeded hash.
        assert_eq!(weight("a", "b"), 0x59b2_71ae_1bbc_b1d3);
        assert_ne!(weight("a", "b"), weight("b", "a"));
    }

    #[test]
    fn three_members_own_about_a_third_each() {
        let view = View::new(["propeller-0", "propeller-1", "propeller-2"]);
        let mut owned: BTreeMap<&str, usize> = BTreeMap::new();
        for key in keys(3_000) {
            *owned
                .entry(view.owner(&key).unwrap_or_default())
                .or_default() += 1;
        }
        assert_eq!(owned.len(), 3, "{owned:?}");
        for (member, n) in owned {
            assert!((850..=1_150).contains(&n), "{member} owns {n} of 3,000");
        }
    }

    #[test]
    fn a_joining_member_takes_only_what_it_wins_and_a_leaving_one_hands_out_only_its_own() {
        let three = View::new(["a", "b", "c"]);
        let four = View::new(["a", "b", "c", "d"]);
        let two = View::new(["a", "c"]);
        for key in keys(2_000) {
            let before = three.owner(&key);
            let joined = four.owner(&key);
            assert!(joined == before || joined == Some("d"), "{key}");
            let left = two.owner(&key);
            if before != Some("b") {
                assert_eq!(left, before, "{key} moved though its owner stayed");
            }
        }
    }

    #[test]
    fn views_round_trip_through_their_announcement() {
        let view = View::new(["b", "a", "b"]);
        assert_eq!(view.to_text(), "a,b");
        assert_eq!(View::from_text("a,b"), view);
        assert_eq!(View::from_text(""), View::default());
        assert_eq!(View::from_text(" b , a ,"), view);
        assert_eq!(View::default().owner("x"), None);
    }

    #[test]
    fn a_gained_key_waits_until_its_previous_owner_announced_it_away() {
        let old = View::new(["a", "b"]);
        let new = View::new(["a", "b", "c"]);
        let moved = keys(500)
            .into_iter()
            .find(|k| new.owner(k) == Some("c") && old.owner(k) == Some("a"))
            .unwrap_or_else(|| panic!("no key moves from a to c"));
        let a_still_old = [Peer {
            id: "a".into(),
            announced: old.clone(),
        }];
        assert!(!may_act(&moved, "c", &new, true, &a_still_old));
        let a_moved_on = [Peer {
            id: "a".into(),
            announced: new.clone(),
        }];
        assert!(may_act(&moved, "c", &new, true, &a_moved_on));
        // Not before c's own announcement came back to it.
        assert!(!may_act(&moved, "c", &new, false, &a_moved_on));
        // a itself lets go as soon as it acts on the new view.
        assert!(!may_act(&moved, "a", &new, true, &[]));
    }

    #[test]
    fn a_lapsed_member_is_ignored_and_a_fenced_one_acts_on_nothing() {
        let start = Instant::now();
        let mut seen = Sightings::default();
        let lease = Duration::from_secs(15);
        seen.observe("a", "t1", lease, View::new(["a", "b"]), start);
        seen.observe("b", "t1", lease, View::new(["a", "b"]), start);
        let later = start + Duration::from_secs(10);
        seen.observe("b", "t2", lease, View::new(["a", "b"]), later);
        // The same stamp read again does not renew a.
        seen.observe("a", "t1", lease, View::new(["a", "b"]), later);
        let ids = |peers: Vec<Peer>| peers.into_iter().map(|p| p.id).collect::<Vec<_>>();
        assert_eq!(ids(seen.live(start + Duration::from_secs(14))), ["a", "b"]);
        assert_eq!(ids(seen.live(start + Duration::from_secs(15))), ["b"]);
        let live = seen.live(start + Duration::from_secs(15));
        assert_eq!(target_view("c", &live, false), View::new(["b", "c"]));
        assert_eq!(target_view("c", &live, true), View::default());
        seen.forget("b");
        assert!(seen.live(later).iter().all(|p| p.id != "b"));
    }

    #[test]
    fn a_member_fences_itself_before_the_others_see_its_lease_expire() {
        let lease = Duration::from_secs(15);
        let limit = fence_limit(lease);
        assert_eq!(limit, Duration::from_secs(10));
        let sent = Instant::now();
        assert!(!fenced(Some(sent), limit, sent + Duration::from_secs(9)));
        assert!(fenced(Some(sent), limit, sent + Duration::from_secs(10)));
        assert!(fenced(None, limit, sent));
        // The others start counting when they see the renewal, never before it was sent.
        let mut seen = Sightings::default();
        seen.observe("a", "t1", lease, View::new(["a"]), sent);
        assert!(!seen.live(sent + limit).is_empty());
    }

    proptest! {
        /// Whatever the members' announcements, two members never both may act on one key
        /// when each announced the view it acts on (the protocol's invariant).
        #[test]
        fn no_key_is_acted_on_by_two_members(
            views in proptest::collection::vec(proptest::sample::subsequence(vec!["a", "b", "c", "d"], 1..=4), 4),
            key in "[a-z]{1,8}",
        ) {
            let members = ["a", "b", "c", "d"];
            let announced: Vec<View> = views.iter().map(|v| View::new(v.iter().copied())).collect();
            let peers: Vec<Peer> = members
                .iter()
                .zip(&announced)
                .map(|(id, view)| Peer { id: (*id).into(), announced: view.clone() })
                .collect();
            let acting: Vec<&str> = members
                .iter()
                .zip(&announced)
                .filter(|(id, view)| may_act(&key, id, view, true, &peers))
                .map(|(id, _)| *id)
                .collect();
            prop_assert!(acting.len() <= 1, "{acting:?} all act on {key}");
        }
    }
}
