//! What both drivers hold and do alike: the in-memory state the MQTT side records into, the
//! publisher, the plans' settings and counters; the broker's logins rebuilt from the cached
//! Proplets; the per-phase gauges; and a Proplet's load-driven wakes.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Secret;
use propeller_broker::server::{CredentialStore, Publisher};
use tracing::warn;

use super::executor::TaskEffects;
use crate::crd::proplet::Proplet;
use crate::crd::task::Task;
use crate::credentials::credential_table;
use crate::decision::proplet::PropletSettings;
use crate::decision::task::TaskSettings;
use crate::enrolment_queue::Enrolments;
use crate::key_delivery::KeyDelivery;
use crate::metrics::ControllerMetrics;
use crate::oci::Images;
use crate::state::{lock, DriverState};
use crate::task_logs::{LogSettings, LogStore};

use super::kinds::Wake;
use super::ownership::{self, Ownership};
use super::{CacheReads, ObjectName, Signals, Stored};

/// How often each driver folds Proplet and Secret changes into the broker's logins and sends
/// the Proplet wakes [`LoadWakes`] held back. A new Proplet's device can log in at most this
/// long after the Proplet is stored, and a burst of new Proplets costs one rebuild per tick,
/// not one per Proplet.
pub const CREDENTIAL_TICK: Duration = Duration::from_millis(100);

/// The parts both drivers hold the same way: the in-memory state the MQTT side records
/// into, the publisher of commands, the plans' settings and the counters.
pub struct Common {
    /// Device reports not yet written, starts sent, scheduler rotation.
    pub state: DriverState,
    /// Sends commands to devices.
    pub publisher: Publisher,
    /// Proplet plan settings.
    pub proplet: PropletSettings,
    /// Task plan settings.
    pub task: TaskSettings,
    /// Reconcile counters.
    pub metrics: Arc<ControllerMetrics>,
    /// Registry resolution and chunk serving, once attached (`None`: images are not served).
    pub images: OnceLock<Arc<Images>>,
    /// This replica's share of the objects, once attached (`None`: it owns every object).
    pub shard: OnceLock<Arc<Ownership>>,
    /// The enrolment queue, once attached (`None`: devices cannot enrol).
    pub enrolments: OnceLock<Arc<Enrolments>>,
    /// Rotated keys on their way to the devices.
    pub keys: KeyDelivery,
    /// The devices' broker logins as the driver derives them, once attached.
    pub logins: OnceLock<Arc<CredentialStore>>,
    /// Proplets woken because their load changed, merged per [`LOAD_WAKE_INTERVAL`].
    pub load_wakes: LoadWakes,
    /// What tasks printed, as their agents sent it.
    pub logs: Arc<LogStore>,
    /// Kueue admits the PropellerJobs labelled with a queue name (`propeller run --kueue`);
    /// without it such a job is held with a condition that says so.
    pub kueue: std::sync::atomic::AtomicBool,
}

impl Common {
    /// Fresh state with these settings.
    pub fn new(
        publisher: Publisher,
        proplet: PropletSettings,
        task: TaskSettings,
        metrics: Arc<ControllerMetrics>,
    ) -> Self {
        Self {
            state: DriverState::new(),
            publisher,
            proplet,
            task,
            metrics,
            images: OnceLock::new(),
            shard: OnceLock::new(),
            enrolments: OnceLock::new(),
            keys: Default::default(),
            logins: OnceLock::new(),
            kueue: Default::default(),
            load_wakes: LoadWakes::default(),
            logs: Arc::new(LogStore::new(LogSettings::default())),
        }
    }

    /// The image service, when one is attached.
    pub fn images(&self) -> Option<&Arc<Images>> {
        self.images.get()
    }

    /// The turn to reconcile `object`: at once when this replica owns every object, `None`
    /// when another replica owns it now (see [`ownership::Ownership::turn`]).
    pub async fn turn<K: Stored>(&self, object: &K) -> Option<ownership::Turn<'_>> {
        match self.shard.get() {
            None => Some(ownership::Turn::alone()),
            Some(shard) => shard.turn(&K::kind(&()), &ObjectName::of(object)).await,
        }
    }

    /// What the Task executor uses besides the backend.
    pub fn effects(&self) -> TaskEffects<'_> {
        TaskEffects {
            publisher: &self.publisher,
            ledger: &self.state.ledger,
            inbox: &self.state.inbox,
            sessions: &self.state.sessions,
        }
    }
}

impl Common {
    /// Rebuilds the broker's logins from the live `proplets` and their Secrets (as `read`
    /// finds an entry: namespace, Secret name, key), sends the keys of rotations that
    /// appeared, and, when devices may enrol, the bootstrap tokens among `secrets` (the
    /// Secrets of the token namespace, or more).
    pub fn refresh_logins<'a>(
        &self,
        proplets: impl IntoIterator<Item = &'a Proplet>,
        read: impl Fn(&str, &str, &str) -> Option<String>,
        secrets: impl FnOnce(&str) -> Vec<Arc<Secret>>,
    ) {
        let Some(logins) = self.logins.get() else {
            return;
        };
        let live = proplets
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none());
        let (table, problems) = credential_table(live, read);
        for problem in problems {
            warn!(proplet = %problem.proplet, "{}", problem.message);
        }
        logins.replace_all(table);
        for rotation in self.keys.new_rotations(logins) {
            KeyDelivery::send(&self.publisher, rotation);
        }
        if let Some(enrolments) = self.enrolments.get() {
            let namespace = &enrolments.token_namespace;
            let secrets = secrets(namespace);
            let tokens = crate::credentials::token_table(secrets.iter().map(|s| &**s), namespace);
            logins.replace_tokens(tokens);
        }
    }

    /// Sets the per-phase gauges, and with sharing the objects this replica owns, from the
    /// cached `proplets` and `tasks`.
    pub fn count_phases<'a>(
        &self,
        proplets: impl Iterator<Item = &'a Proplet> + Clone,
        tasks: impl Iterator<Item = &'a Task> + Clone,
    ) {
        self.metrics.count_phases(proplets.clone(), tasks.clone());
        if let Some(shard) = self.shard.get() {
            shard.count_owned("Proplet", proplets.map(ObjectName::of));
            shard.count_owned("Task", tasks.map(ObjectName::of));
        }
    }

    /// Wakes the Proplet `proplet`, whose load may have changed, through `signals`: at once,
    /// unless it was woken for that less than [`LOAD_WAKE_INTERVAL`] ago; then at the next
    /// [`Common::wake_held`], once. In a burst its tasks change hundreds of times a second,
    /// its `taskCount` is written at most once per flush interval anyway, and a reconcile
    /// per change cost a burst about a tenth of its speed. Heartbeats and other device
    /// events still wake it at once.
    pub fn wake_for_load(&self, signals: &impl Signals, proplet: ObjectName) {
        if self.load_wakes.now_or_later(&proplet, Instant::now()) {
            signals.wake(Wake::of::<Proplet>(proplet));
        }
    }

    /// Sends the load-driven wakes held back since the last call, and wakes the proplets
    /// whose silence deadline passed with no heartbeat (each driver's [`CREDENTIAL_TICK`]).
    pub fn wake_held<C: CacheReads + Signals>(&self, cluster: &C) {
        for proplet in self.load_wakes.due(Instant::now()) {
            cluster.wake(Wake::of::<Proplet>(proplet));
        }
        let threshold = chrono::Duration::from_std(self.proplet.last_seen_threshold)
            .unwrap_or(chrono::Duration::MAX);
        for client in self.state.liveness.silent(chrono::Utc::now(), threshold) {
            if let Some(proplet) = cluster.proplet_by_client(&client) {
                cluster.wake(Wake::of::<Proplet>(ObjectName::of(proplet.as_ref())));
            }
        }
    }
}

/// The shortest time between two load-driven wake-ups of one Proplet.
pub const LOAD_WAKE_INTERVAL: Duration = Duration::from_millis(100);

/// When each Proplet was last woken because one of its tasks changed, and the Proplets whose
/// next such wake-up waits for the tick (see [`Common::wake_for_load`]).
#[derive(Default)]
pub struct LoadWakes(Mutex<(HashMap<ObjectName, Instant>, HashSet<ObjectName>)>);

impl LoadWakes {
    /// Whether the Proplet `key` may be woken now; if not, it is woken by [`LoadWakes::due`]
    /// later.
    fn now_or_later(&self, key: &ObjectName, now: Instant) -> bool {
        let mut wakes = lock(&self.0);
        let (last, held) = &mut *wakes;
        if held.contains(key) {
            return false;
        }
        match last.get(key) {
            Some(at) if now.duration_since(*at) < LOAD_WAKE_INTERVAL => {
                held.insert(key.clone());
                false
            }
            _ => {
                last.insert(key.clone(), now);
                true
            }
        }
    }

    /// The held wake-ups, to send now.
    fn due(&self, now: Instant) -> Vec<ObjectName> {
        let mut wakes = lock(&self.0);
        let (last, held) = &mut *wakes;
        let due: Vec<ObjectName> = held.drain().collect();
        for key in &due {
            last.insert(key.clone(), now);
        }
        // Forget Proplets not woken for a while, so the map follows the fleet.
        last.retain(|_, at| now.duration_since(*at) < Duration::from_secs(60));
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_wakes_of_one_proplet_are_merged_within_the_interval_and_none_is_lost() {
        let wakes = LoadWakes::default();
        let p = ObjectName::new("default", "p");
        let q = ObjectName::new("default", "q");
        let t0 = Instant::now();
        assert!(wakes.now_or_later(&p, t0), "the first wake goes at once");
        assert!(
            wakes.now_or_later(&q, t0),
            "another proplet is not held back"
        );
        assert!(!wakes.now_or_later(&p, t0 + Duration::from_millis(10)));
        assert!(!wakes.now_or_later(&p, t0 + Duration::from_millis(20)));
        assert_eq!(wakes.due(t0 + Duration::from_millis(100)), vec![p.clone()]);
        assert!(wakes.due(t0 + Duration::from_millis(200)).is_empty());
        assert!(wakes.now_or_later(&p, t0 + LOAD_WAKE_INTERVAL * 3));
    }
}
