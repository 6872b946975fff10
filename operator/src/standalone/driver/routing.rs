//! What wakes a reconcile in standalone mode: broker events (through the shared routing),
//! stored changes and their related objects (a Proplet's load-driven wake-ups merged per
//! [`LOAD_WAKE_INTERVAL`]); and the credential table.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering as AtomicOrdering;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use propeller_broker::server::BrokerEvent;
use tracing::warn;

use crate::crd::federated::TrainingRound;
use crate::credentials::credential_table;
use crate::standalone::kinds::{PROPLET, SECRET, TASK, TRAINING_ROUND};
use crate::state::lock;

use super::{Driver, Key, CREDENTIAL_MAX_AGE};

impl Driver {
    /// Rebuilds the broker's credential table from the stored Proplets and Secrets when the
    /// Proplets changed (the cache counts those changes, see
    /// [`crate::credentials::changes_credentials`]), when `force`d (a Secret changed) or
    /// when the table is older than [`CREDENTIAL_MAX_AGE`].
    pub fn refresh_credentials(&self, force: bool) {
        if force {
            self.cache.credential_gate().invalidate();
        }
        if !self.cache.credential_gate().due(CREDENTIAL_MAX_AGE) {
            return;
        }
        let proplets = self.cache.proplets();
        let read = |ns: &str, name: &str, key: &str| -> Option<String> {
            let secret = self.store.get(SECRET, ns, name).ok()??;
            let secret = serde_json::from_value(secret).ok()?;
            crate::credentials::secret_entry(&secret, key)
        };
        let live = proplets
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .map(|p| &**p);
        let (table, problems) = credential_table(live, read);
        for problem in problems {
            warn!(proplet = %problem.proplet, "{}", problem.message);
        }
        self.credentials.replace_all(table);
        for rotation in self.common.keys.new_rotations(&self.credentials) {
            crate::key_delivery::KeyDelivery::send(&self.common.publisher, rotation);
        }
        if let Some(enrolments) = self.common.enrolments.get() {
            let namespace = &enrolments.token_namespace;
            match self
                .store
                .list_typed::<k8s_openapi::api::core::v1::Secret>(SECRET, Some(namespace))
            {
                Ok(secrets) => self
                    .credentials
                    .replace_tokens(crate::enrolment::token_table(&secrets, namespace)),
                Err(e) => warn!(%e, "reading bootstrap tokens"),
            }
        }
    }

    /// Records a broker event and queues the object it concerns.
    pub fn route_event(&self, event: &BrokerEvent) {
        crate::controller::routing::route_event(self, event);
    }

    /// Wakes a Proplet whose load may have changed: at once, unless it was woken for that
    /// less than [`LOAD_WAKE_INTERVAL`] ago; then on the next tick, once. In a burst its tasks
    /// change hundreds of times a second, its `taskCount` is written at most once per flush
    /// interval anyway, and a reconcile per change cost the burst about a tenth of its speed.
    /// Heartbeats and other device events still wake it at once.
    pub(super) fn wake_for_load(&self, key: Key) {
        if self.load_wakes.now_or_later(&key, Instant::now()) {
            self.enqueue(key);
        }
    }

    /// Queues what a stored change affects besides the object itself.
    pub(super) fn related(&self, key: &Key) {
        match key.kind.as_str() {
            TASK => {
                if let Some(task) = self.cache.task(&key.namespace, &key.name) {
                    for owner in task.metadata.owner_references.iter().flatten() {
                        self.enqueue(Key::new(&owner.kind, &key.namespace, &owner.name));
                    }
                    if let Some(proplet) = task
                        .status
                        .as_ref()
                        .and_then(|s| s.assigned_proplet.clone())
                    {
                        self.wake_for_load(Key::new(PROPLET, &key.namespace, &proplet));
                    }
                }
                for other in self.cache.dependents(&key.namespace, &key.name) {
                    self.enqueue(Key::new(TASK, &key.namespace, &other));
                }
            }
            // Rebuilt on the next credential tick: a burst of new Proplets costs one rebuild,
            // not one per Proplet.
            SECRET => self.secrets_changed.store(true, AtomicOrdering::Relaxed),
            TRAINING_ROUND => {
                if let Ok(Some(round)) =
                    self.store
                        .get_typed::<TrainingRound>(TRAINING_ROUND, &key.namespace, &key.name)
                {
                    for owner in round.metadata.owner_references.iter().flatten() {
                        self.enqueue(Key::new(&owner.kind, &key.namespace, &owner.name));
                    }
                }
            }
            _ => {}
        }
    }
}

/// The shortest time between two load-driven wake-ups of one Proplet.
pub(super) const LOAD_WAKE_INTERVAL: Duration = Duration::from_millis(100);

/// When each Proplet was last woken because one of its tasks changed, and the Proplets whose
/// next such wake-up waits for the tick (see [`Driver::wake_for_load`]).
#[derive(Default)]
pub(super) struct LoadWakes(Mutex<(HashMap<Key, Instant>, HashSet<Key>)>);

impl LoadWakes {
    /// Whether `key` may be woken now; if not, it is woken by [`LoadWakes::due`] later.
    pub(super) fn now_or_later(&self, key: &Key, now: Instant) -> bool {
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
    pub(super) fn due(&self, now: Instant) -> Vec<Key> {
        let mut wakes = lock(&self.0);
        let (last, held) = &mut *wakes;
        let due: Vec<Key> = held.drain().collect();
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
        let p = Key::new(PROPLET, "default", "p");
        let q = Key::new(PROPLET, "default", "q");
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
