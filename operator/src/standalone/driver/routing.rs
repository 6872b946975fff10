//! What wakes a reconcile in standalone mode: broker events (through the shared routing),
//! stored changes and their related objects; and the credential table.

use std::sync::atomic::Ordering as AtomicOrdering;
use std::sync::Arc;

use propeller_broker::server::BrokerEvent;
use tracing::warn;

use crate::controller::Wake;
use crate::standalone::kinds::{SECRET, TASK};

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
        let secrets = |namespace: &str| match self
            .store
            .list_typed::<k8s_openapi::api::core::v1::Secret>(SECRET, Some(namespace))
        {
            Ok(secrets) => secrets.into_iter().map(Arc::new).collect(),
            Err(e) => {
                warn!(%e, "reading bootstrap tokens");
                Vec::new()
            }
        };
        self.common
            .refresh_logins(proplets.iter().map(|p| &**p), read, secrets);
    }

    /// Records a broker event and queues the object it concerns.
    pub fn route_event(&self, event: &BrokerEvent) {
        crate::controller::routing::route_event(self, event);
    }

    /// Wakes what a stored change of `changed` affects besides the object itself: its
    /// owners, and for a Task its proplet and dependents.
    pub(super) fn related(&self, changed: &Wake) {
        let name = &changed.name;
        let owners = self.cache.owners(&changed.kind, name);
        self.wakers.wake_owners_in(&name.namespace, &owners);
        match changed.kind.as_ref() {
            TASK => {
                if let Some(task) = self.cache.task(&name.namespace, &name.name) {
                    crate::controller::task::wake_related(self, &task);
                }
            }
            // Rebuilt on the next credential tick: a burst of new Proplets costs one rebuild,
            // not one per Proplet.
            SECRET => self.secrets_changed.store(true, AtomicOrdering::Relaxed),
            _ => {}
        }
    }
}
