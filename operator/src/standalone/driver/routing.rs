//! What wakes a reconcile in standalone mode: broker events (through the shared routing),
//! stored changes and their related objects (a Proplet's load-driven wake-ups merged per
//! [`LOAD_WAKE_INTERVAL`]); and the credential table.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering as AtomicOrdering;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use propeller_broker::server::BrokerEvent;
use tracing::warn;

use crate::controller::{ObjectName, Wake};
use crate::crd::proplet::Proplet;
use crate::crd::task::Task;
use crate::credentials::credential_table;
use crate::standalone::kinds::{SECRET, TASK};
use crate::state::lock;

use super::{Driver, CREDENTIAL_MAX_AGE};

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
    pub(super) fn wake_for_load(&self, proplet: ObjectName) {
        if self.load_wakes.now_or_later(&proplet, Instant::now()) {
            self.wake(Wake::of::<Proplet>(proplet));
        }
    }

    /// Wakes what a stored change of `changed` affects besides the object itself: its
    /// owners, and for a Task its proplet and dependents.
    pub(super) fn related(&self, changed: &Wake) {
        let name = &changed.name;
        if let Some(meta) = self.cache.meta(&changed.kind, name) {
            self.wakers.wake_owners(&meta);
        }
        match changed.kind.as_ref() {
            TASK => {
                let assigned = self
                    .cache
                    .task(&name.namespace, &name.name)
                    .and_then(|task| {
                        task.status
                            .as_ref()
                            .and_then(|s| s.assigned_proplet.clone())
                    });
                if let Some(proplet) = assigned {
                    self.wake_for_load(ObjectName::new(&name.namespace, &proplet));
                }
                for other in self.cache.dependents(&name.namespace, &name.name) {
                    self.wake(Wake::of::<Task>(ObjectName::new(&name.namespace, &other)));
                }
            }
            // Rebuilt on the next credential tick: a burst of new Proplets costs one rebuild,
            // not one per Proplet.
            SECRET => self.secrets_changed.store(true, AtomicOrdering::Relaxed),
            _ => {}
        }
    }
}

/// The shortest time between two load-driven wake-ups of one Proplet.
pub(super) const LOAD_WAKE_INTERVAL: Duration = Duration::from_millis(100);

/// When each Proplet was last woken because one of its tasks changed, and the Proplets whose
/// next such wake-up waits for the tick (see [`Driver::wake_for_load`]).
#[derive(Default)]
pub(super) struct LoadWakes(Mutex<(HashMap<ObjectName, Instant>, HashSet<ObjectName>)>);

impl LoadWakes {
    /// Whether the Proplet `key` may be woken now; if not, it is woken by [`LoadWakes::due`]
    /// later.
    pub(super) fn now_or_later(&self, key: &ObjectName, now: Instant) -> bool {
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
    pub(super) fn due(&self, now: Instant) -> Vec<ObjectName> {
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
