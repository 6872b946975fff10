//! This replica's share of the objects when several replicas are active (sharding): which
//! objects it may reconcile now, and the barrier that hands a share over only after every
//! reconcile of it has finished.
//!
//! Who the members are is kept by the driver (`k8s::membership`, on Leases); what follows from
//! it is decided by `propeller_core::shard`. Every reconcile asks for its [`Turn`] first and
//! holds it to the end; a change of view waits for the turns of the old view to end before
//! the new view is acted on and announced. A replica that has not renewed its membership in
//! time is fenced: it takes no turn, and the API client refuses its writes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use propeller_core::shard::namespaces::{self, HashRange};
use propeller_core::shard::{fence_limit, fenced, may_act, Peer, ShardBy, View};
use tokio::sync::{watch, RwLockReadGuard};

use super::ObjectName;

/// A reconcile's permission to act on its object, held until it returns.
pub struct Turn<'a> {
    /// The view the turn was taken under (`None`: this replica owns every object).
    _acting: Option<RwLockReadGuard<'a, View>>,
}

impl Turn<'_> {
    /// The turn of a replica that owns every object (alone, or the leader).
    pub fn alone() -> Self {
        Self { _acting: None }
    }
}

/// What a replica knows of the others, as last computed by the membership loop.
#[derive(Debug, Default, Clone)]
struct Picture {
    acting: View,
    settled: bool,
    peers: Vec<Peer>,
}

/// How many keys' ownership [`Ownership::owns`] remembers under one picture before it starts
/// over (keys of objects deleted since the picture changed stay in until then).
const REMEMBERED_KEYS: usize = 250_000;

/// Labels of the per-kind meters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// `Proplet`, `Task`, …
    pub kind: String,
}

/// Label naming this replica.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MemberLabels {
    /// The member id (its Lease's holder).
    pub member: String,
}

/// The sharding meters on `/metrics`.
#[derive(Debug, Default)]
pub struct ShardMetrics {
    /// 1, labelled with this replica's member id.
    pub member: Family<MemberLabels, Gauge>,
    /// Members in the view this replica acts on.
    pub members: Gauge,
    /// Objects this replica owns, by kind.
    pub owned: Family<KindLabels, Gauge>,
    /// Objects in this replica's caches, by kind: every object of the kind, or with sharded
    /// watches those of its namespaces.
    pub cached: Family<KindLabels, Gauge>,
    /// Changes of the view this replica acts on.
    pub handoffs: Counter,
    /// Reconciles not run here because another replica owns the object (or may still act on
    /// it), by kind.
    pub skipped: Family<KindLabels, Counter>,
    /// 1 while this replica is fenced (its membership not renewed in time).
    pub fenced: Gauge,
}

impl ShardMetrics {
    /// Registers every meter under `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "shard_member",
            "This replica's member id",
            self.member.clone(),
        );
        registry.register(
            "shard_members",
            "Members in the view this replica acts on",
            self.members.clone(),
        );
        registry.register(
            "shard_owned",
            "Objects this replica owns, by kind",
            self.owned.clone(),
        );
        registry.register(
            "shard_cached",
            "Objects in this replica's caches, by kind",
            self.cached.clone(),
        );
        registry.register(
            "shard_handoffs",
            "Changes of the view this replica acts on",
            self.handoffs.clone(),
        );
        registry.register(
            "shard_skipped",
            "Reconciles left to the replica that owns the object",
            self.skipped.clone(),
        );
        registry.register(
            "shard_fenced",
            "1 while this replica is fenced (membership not renewed in time)",
            self.fenced.clone(),
        );
    }
}

/// This replica's membership and the objects it may act on.
#[derive(Debug)]
pub struct Ownership {
    me: String,
    shard_by: ShardBy,
    acting: tokio::sync::RwLock<View>,
    picture: RwLock<Picture>,
    /// Whether this replica may act on each key under the current picture: [`may_act`]
    /// hashes the key once per member of every announced view, and the gauges ask for every
    /// cached object every few seconds. Emptied whenever the picture changes.
    remembered: Mutex<HashMap<String, bool>>,
    renewed: Mutex<Option<Instant>>,
    /// Why the last renewal failed, until one succeeds (for `/readyz`).
    renewal_error: Mutex<Option<String>>,
    fence_limit: Duration,
    reshuffles: watch::Sender<u64>,
    /// With [`ShardBy::Namespace`]: the hash ranges of the namespaces this replica acts on.
    namespaces: watch::Sender<Vec<HashRange>>,
    metrics: Arc<ShardMetrics>,
}

impl Ownership {
    /// A replica `me` whose membership Lease lasts `lease_duration`, sharing by `shard_by`; it
    /// acts on nothing until its first renewal and its first view.
    pub fn new(me: &str, lease_duration: Duration, shard_by: ShardBy) -> Self {
        let metrics = Arc::new(ShardMetrics::default());
        metrics
            .member
            .get_or_create(&MemberLabels {
                member: me.to_owned(),
            })
            .set(1);
        metrics.fenced.set(1);
        Self {
            me: me.to_owned(),
            shard_by,
            acting: tokio::sync::RwLock::new(View::default()),
            picture: RwLock::new(Picture::default()),
            remembered: Mutex::new(HashMap::new()),
            renewed: Mutex::new(None),
            renewal_error: Mutex::new(None),
            fence_limit: fence_limit(lease_duration),
            reshuffles: watch::channel(0).0,
            namespaces: watch::channel(Vec::new()).0,
            metrics,
        }
    }

    /// This replica's member id.
    pub fn me(&self) -> &str {
        &self.me
    }

    /// What the shares are cut by.
    pub fn shard_by(&self) -> ShardBy {
        self.shard_by
    }

    /// With [`ShardBy::Namespace`], the hash ranges of the namespaces this replica acts on,
    /// following each change of view (empty otherwise, and before the first view).
    pub fn namespace_ranges(&self) -> watch::Receiver<Vec<HashRange>> {
        self.namespaces.subscribe()
    }

    /// Whether `namespace` is among those this replica acts on (always with
    /// [`ShardBy::Object`], where every replica watches every namespace).
    pub fn watches_namespace(&self, namespace: &str) -> bool {
        self.shard_by == ShardBy::Object || namespaces::covers(&self.namespaces.borrow(), namespace)
    }

    /// The meters.
    pub fn metrics(&self) -> &Arc<ShardMetrics> {
        &self.metrics
    }

    /// Records a successful renewal whose request was sent at `sent_at`. After a lapse
    /// (the replica was paused or cut off past its limit) it first waits for every reconcile
    /// begun before the lapse to end, their writes still refused, so none of them writes
    /// into a share another replica took meanwhile.
    pub async fn renewed(&self, sent_at: Instant) {
        if self.is_fenced(Instant::now()) && !self.acting().is_empty() {
            self.switch(View::default()).await;
        }
        let mut renewed = self.renewed.lock().unwrap_or_else(|e| e.into_inner());
        if renewed.is_none_or(|at| at < sent_at) {
            *renewed = Some(sent_at);
        }
        drop(renewed);
        *self.renewal_error.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.metrics.fenced.set(0);
    }

    /// Records a successful renewal of the leader Lease this replica holds (a leader is a
    /// group of one): as [`Ownership::renewed`], then, if it had stopped acting (at the start,
    /// or after a lapse), it acts on every object again and has them all looked at.
    pub async fn lead(&self, sent_at: Instant) {
        self.renewed(sent_at).await;
        if self.acting().is_empty() {
            let alone = View::new([self.me.as_str()]);
            self.switch(alone.clone()).await;
            self.observe(Vec::new(), Some(&alone), Instant::now());
        }
    }

    /// Records why a renewal failed (said by `/readyz` while fenced).
    pub fn renewal_failed(&self, error: String) {
        *self.renewal_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(error);
    }

    /// Why this replica is fenced at `now`, or `None` when it may act: how long since its
    /// last successful renewal, against what limit, and the last renewal's error.
    pub fn fence_reason(&self, now: Instant) -> Option<String> {
        let renewed = *self.renewed.lock().unwrap_or_else(|e| e.into_inner());
        if !fenced(renewed, self.fence_limit, now) {
            return None;
        }
        self.metrics.fenced.set(1);
        let since = match renewed {
            None => "not renewed yet".to_owned(),
            Some(at) => format!(
                "not renewed for {:.1} s (limit {:.1} s)",
                now.saturating_duration_since(at).as_secs_f64(),
                self.fence_limit.as_secs_f64()
            ),
        };
        let error = self
            .renewal_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        Some(match error {
            Some(error) => format!("the Lease was {since}: {error}; acting on nothing until it is"),
            None => format!("the Lease was {since}; acting on nothing until it is"),
        })
    }

    /// Whether this replica must not act or write at `now`.
    pub fn is_fenced(&self, now: Instant) -> bool {
        let renewed = *self.renewed.lock().unwrap_or_else(|e| e.into_inner());
        fenced(renewed, self.fence_limit, now)
    }

    /// The view this replica acts on.
    pub fn acting(&self) -> View {
        self.read_picture().acting.clone()
    }

    /// Whether this replica owns `kind` `name` now (for counting; a reconcile takes a
    /// [`Turn`] instead).
    pub fn owns(&self, kind: &str, name: &ObjectName) -> bool {
        if self.is_fenced(Instant::now()) {
            return false;
        }
        let key = self.shard_by.key(kind, &name.namespace, &name.name);
        // Held while remembering, so the answer is the picture's it was computed from: a
        // change of picture empties the memory under the write lock.
        let picture = self.read_picture();
        let mut remembered = self.remembered.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(owned) = remembered.get(&key) {
            return *owned;
        }
        let owned = may_act(
            &key,
            &self.me,
            &picture.acting,
            picture.settled,
            &picture.peers,
        );
        if remembered.len() >= REMEMBERED_KEYS {
            remembered.clear();
        }
        remembered.insert(key, owned);
        owned
    }

    /// The turn to reconcile `kind` `name`, if this replica may act on it now; `None` (and
    /// counted) when another replica owns it or may still be acting on it.
    pub async fn turn(&self, kind: &str, name: &ObjectName) -> Option<Turn<'_>> {
        let acting = self.acting.read().await;
        if self.owns(kind, name) {
            return Some(Turn {
                _acting: Some(acting),
            });
        }
        self.metrics
            .skipped
            .get_or_create(&KindLabels {
                kind: kind.to_owned(),
            })
            .inc();
        None
    }

    /// Acts on `view` from now on: waits until every reconcile that took its turn under the
    /// previous view has returned, so that what this replica gives up is no longer touched
    /// once the new view is announced.
    pub async fn switch(&self, view: View) {
        let mut acting = self.acting.write().await;
        *acting = view.clone();
        let mut picture = self.write_picture();
        self.forget_owners();
        picture.acting = view.clone();
        // Not settled until the announcement of this view has come back on the watch.
        picture.settled = false;
        drop(picture);
        if self.shard_by == ShardBy::Namespace {
            self.namespaces
                .send_replace(namespaces::owned_ranges(&view, &self.me));
        }
        drop(acting);
        self.metrics.handoffs.inc();
        self.metrics
            .members
            .set(i64::try_from(view.members().len()).unwrap_or(i64::MAX));
        self.reshuffle();
    }

    /// Records the other live members' announcements and whether this replica's own
    /// announcement of its view has come back; wakes every object's reconcile when that
    /// changes what this replica may act on.
    pub fn observe(&self, peers: Vec<Peer>, own_announcement: Option<&View>, now: Instant) {
        let is_fenced = self.is_fenced(now);
        self.metrics.fenced.set(i64::from(is_fenced));
        let mut picture = self.write_picture();
        let settled = own_announcement == Some(&picture.acting) && !picture.acting.is_empty();
        let peers: Vec<Peer> = peers.into_iter().filter(|p| p.id != self.me).collect();
        if picture.settled == settled && picture.peers == peers {
            return;
        }
        self.forget_owners();
        picture.settled = settled;
        picture.peers = peers;
        drop(picture);
        self.reshuffle();
    }

    /// A stream that yields whenever what this replica may act on may have grown: the
    /// controllers then look at every object again (`Controller::reconcile_all_on`).
    pub fn reshuffles(&self) -> impl futures::Stream<Item = ()> + Send + 'static {
        let mut changes = self.reshuffles.subscribe();
        changes.mark_unchanged();
        futures::stream::unfold(changes, |mut changes| async move {
            changes.changed().await.ok()?;
            Some(((), changes))
        })
    }

    /// Counts the objects of `kind` in this replica's cache (`names`) and those it owns.
    pub fn count_owned(&self, kind: &str, names: impl Iterator<Item = ObjectName>) {
        let (mut cached, mut owned) = (0usize, 0usize);
        for name in names {
            cached += 1;
            owned += usize::from(self.owns(kind, &name));
        }
        let labels = KindLabels {
            kind: kind.to_owned(),
        };
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.metrics
            .cached
            .get_or_create(&labels)
            .set(count(cached));
        self.metrics.owned.get_or_create(&labels).set(count(owned));
    }

    /// Has every object looked at again, as after a change of view (a cache that has just
    /// taken in objects, whose own events came before it held them).
    pub fn look_again(&self) {
        self.reshuffle();
    }

    fn reshuffle(&self) {
        self.reshuffles.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn read_picture(&self) -> std::sync::RwLockReadGuard<'_, Picture> {
        self.picture.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write_picture(&self) -> std::sync::RwLockWriteGuard<'_, Picture> {
        self.picture.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Forgets what [`Ownership::owns`] remembered; called with the picture's write lock
    /// held, as the picture changes.
    fn forget_owners(&self) {
        self.remembered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    fn names(n: usize) -> Vec<ObjectName> {
        (0..n)
            .map(|i| ObjectName::new("default", &format!("t-{i}")))
            .collect()
    }

    #[tokio::test]
    async fn sharing_by_namespace_watches_exactly_the_namespaces_it_owns() {
        let view = View::new(["a", "b"]);
        let a = Ownership::new("a", Duration::from_secs(15), ShardBy::Namespace);
        assert!(a.namespace_ranges().borrow().is_empty(), "no view yet");
        assert!(!a.watches_namespace("default"));
        a.renewed(Instant::now()).await;
        a.switch(view.clone()).await;
        a.observe(
            vec![Peer {
                id: "b".into(),
                announced: view.clone(),
            }],
            Some(&view),
            Instant::now(),
        );
        let mut owned_somewhere = 0;
        for i in 0..40 {
            let namespace = format!("ns-{i}");
            let owns = a.owns("Task", &ObjectName::new(&namespace, "t"));
            assert_eq!(owns, a.watches_namespace(&namespace), "{namespace}");
            // Every kind of one namespace has the same owner.
            assert_eq!(owns, a.owns("Proplet", &ObjectName::new(&namespace, "p")));
            owned_somewhere += usize::from(owns);
        }
        assert!(
            (5..35).contains(&owned_somewhere),
            "a owns {owned_somewhere} of 40 namespaces"
        );
        let object = Ownership::new("a", Duration::from_secs(15), ShardBy::Object);
        assert!(
            object.watches_namespace("any"),
            "sharing by object watches everything"
        );
    }

    #[tokio::test]
    async fn nothing_is_owned_before_the_first_renewal_and_announcement() {
        let shard = Ownership::new("a", Duration::from_secs(15), ShardBy::Object);
        let name = ObjectName::new("default", "t");
        assert!(shard.turn("Task", &name).await.is_none());
        shard.renewed(Instant::now()).await;
        shard.switch(View::new(["a"])).await;
        assert!(shard.turn("Task", &name).await.is_none(), "not settled yet");
        shard.observe(Vec::new(), Some(&View::new(["a"])), Instant::now());
        assert!(shard.turn("Task", &name).await.is_some());
    }

    #[tokio::test]
    async fn a_switch_waits_for_the_turns_taken_under_the_old_view() {
        let shard = Arc::new(Ownership::new(
            "a",
            Duration::from_secs(15),
            ShardBy::Object,
        ));
        shard.renewed(Instant::now()).await;
        shard.switch(View::new(["a"])).await;
        shard.observe(Vec::new(), Some(&View::new(["a"])), Instant::now());
        let name = ObjectName::new("default", "t");
        let turn = shard.turn("Task", &name).await;
        assert!(turn.is_some());
        let switching = {
            let shard = shard.clone();
            tokio::spawn(async move { shard.switch(View::new(["a", "b"])).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!switching.is_finished(), "switched while a turn was held");
        drop(turn);
        tokio::time::timeout(Duration::from_secs(5), switching)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(shard.acting(), View::new(["a", "b"]));
    }

    #[tokio::test]
    async fn two_replicas_share_the_objects_without_overlap_and_a_fenced_one_owns_nothing() {
        let now = Instant::now();
        let view = View::new(["a", "b"]);
        let a = Ownership::new("a", Duration::from_secs(15), ShardBy::Object);
        let b = Ownership::new("b", Duration::from_secs(15), ShardBy::Object);
        for (me, other) in [(&a, "b"), (&b, "a")] {
            me.renewed(now).await;
            me.switch(view.clone()).await;
            let peer = Peer {
                id: other.into(),
                announced: view.clone(),
            };
            me.observe(vec![peer], Some(&view), now);
        }
        let names = names(400);
        let owned_a = names.iter().filter(|n| a.owns("Task", n)).count();
        let owned_b = names.iter().filter(|n| b.owns("Task", n)).count();
        assert_eq!(owned_a + owned_b, 400);
        assert!(names
            .iter()
            .all(|n| !(a.owns("Task", n) && b.owns("Task", n))));
        assert!((150..=250).contains(&owned_a), "a owns {owned_a} of 400");
        let mut reshuffles = Box::pin(a.reshuffles());
        // Past the fence limit without a renewal: nothing, and told so.
        assert!(a.is_fenced(now + Duration::from_secs(10)));
        a.observe(Vec::new(), Some(&view), now);
        assert!(
            tokio::time::timeout(Duration::from_secs(1), reshuffles.next())
                .await
                .is_ok(),
            "a change of peers reshuffles"
        );
    }

    #[tokio::test]
    async fn what_is_owned_follows_each_change_of_view_and_of_peers() {
        let now = Instant::now();
        let a = Ownership::new("a", Duration::from_secs(15), ShardBy::Object);
        a.renewed(now).await;
        let alone = View::new(["a"]);
        a.switch(alone.clone()).await;
        a.observe(Vec::new(), Some(&alone), now);
        let names = names(200);
        assert!(names.iter().all(|n| a.owns("Task", n)), "alone, a owns all");
        // b joins: a's view gives b about half, asked again after a was asked under the old
        // view (the answers it remembered are not reused).
        let both = View::new(["a", "b"]);
        a.switch(both.clone()).await;
        a.observe(Vec::new(), Some(&both), now);
        let now_owned: Vec<bool> = names.iter().map(|n| a.owns("Task", n)).collect();
        let expected: Vec<bool> = names
            .iter()
            .map(|n| both.owner(&ShardBy::Object.key("Task", &n.namespace, &n.name)) == Some("a"))
            .collect();
        assert_eq!(now_owned, expected);
        assert!(now_owned.iter().any(|o| !o), "b took some");
        // b still announces the old view ["b"]: a keeps off what b claims there (everything).
        let peer = Peer {
            id: "b".into(),
            announced: View::new(["b"]),
        };
        a.observe(vec![peer], Some(&both), now);
        assert!(names.iter().all(|n| !a.owns("Task", n)));
    }
}
