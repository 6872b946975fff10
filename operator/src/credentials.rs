//! Who may connect to the broker, derived from Proplet resources and their Secrets.
//!
//! Pure: the caller supplies the Proplets and a way to read one Secret key, and gets the
//! credential table for the broker plus the problems to report on each Proplet's status.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Secret;
use propeller_broker::server::{ChannelScope, Credential, TokenCredential};
use tracing::warn;

use crate::crd::proplet::{ClientKeySource, Proplet};
use crate::decision::enrolment::{TokenRecord, TOKEN_SECRET_TYPE};

/// Decides when the credential table must be rebuilt: after a change of its inputs (a
/// Proplet added, removed, being deleted or given a new spec generation, see
/// [`changes_credentials`]; a Secret changed), each counted by the driver with
/// [`RefreshGate::invalidate`] once its cache shows it, or when `max_age` passed. Rebuilding
/// reads every Proplet and referenced Secret, so it must not follow status writes and
/// heartbeats; and the check itself costs the same for ten proplets or a hundred thousand.
#[derive(Debug, Default)]
pub struct RefreshGate {
    changes: AtomicU64,
    built: Mutex<Option<(u64, Instant)>>,
}

impl RefreshGate {
    /// Counts one change of the table's inputs; call it after the cache shows the change.
    pub fn invalidate(&self) {
        self.changes.fetch_add(1, Ordering::SeqCst);
    }

    /// Whether to rebuild now; when it says yes, the changes counted so far are taken as
    /// built (the caller reads its cache after this).
    pub fn due(&self, max_age: Duration) -> bool {
        let changes = self.changes.load(Ordering::SeqCst);
        let mut built = self.built.lock().unwrap_or_else(|e| e.into_inner());
        let fresh = built
            .as_ref()
            .is_some_and(|(seen, at)| *seen == changes && at.elapsed() < max_age);
        if !fresh {
            *built = Some((changes, Instant::now()));
        }
        !fresh
    }
}

/// Whether `new`, replacing `old` (`None`: a new Proplet), changes the credential table:
/// status writes and heartbeats do not.
pub fn changes_credentials(old: Option<&Proplet>, new: &Proplet) -> bool {
    old.is_none_or(|old| {
        old.metadata.generation != new.metadata.generation
            || old.metadata.deletion_timestamp.is_some()
                != new.metadata.deletion_timestamp.is_some()
    })
}

/// Why a Proplet has no broker credential.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CredentialProblem {
    /// `namespace/name` of the Proplet.
    pub proplet: String,
    /// What is wrong, without any secret value.
    pub message: String,
}

/// Builds the broker's credential table. A Proplet's client id is `connectionConfig.clientId`
/// (or its upstream alias), else the Proplet's name. Two Proplets claiming one client id are
/// both refused, since either could impersonate the other.
pub fn credential_table<'a>(
    proplets: impl IntoIterator<Item = &'a Proplet>,
    read_secret: impl Fn(&str, &str, &str) -> Option<String>,
) -> (HashMap<String, Credential>, Vec<CredentialProblem>) {
    let mut table: HashMap<String, Credential> = HashMap::new();
    let mut owners: HashMap<String, String> = HashMap::new();
    let mut problems = Vec::new();
    let mut contested = Vec::new();
    for proplet in proplets {
        let (Some(name), Some(namespace)) = (
            proplet.metadata.name.as_deref(),
            proplet.metadata.namespace.as_deref(),
        ) else {
            continue;
        };
        let who = format!("{namespace}/{name}");
        let conn = &proplet.spec.connection_config;
        let client_id = proplet.client_id().to_owned();
        let mut previous = None;
        let key = match conn.key_source() {
            Some(ClientKeySource::Inline(key)) => Some(key.to_owned()),
            Some(ClientKeySource::Secret(selector)) => {
                previous = previous_key(|key| read_secret(namespace, &selector.name, key));
                let found = read_secret(namespace, &selector.name, &selector.key);
                if found.is_none() {
                    problems.push(CredentialProblem {
                        proplet: who.clone(),
                        message: format!(
                            "Secret {}/{} has no key {:?}; the proplet cannot log in",
                            namespace, selector.name, selector.key
                        ),
                    });
                }
                found
            }
            None => {
                problems.push(CredentialProblem {
                    proplet: who.clone(),
                    message: "no clientKey or clientKeySecretRef; the proplet cannot log in".into(),
                });
                None
            }
        };
        let Some(key) = key.filter(|k| !k.is_empty()) else {
            continue;
        };
        if let Some(first) = owners.get(&client_id) {
            problems.push(CredentialProblem {
                proplet: who.clone(),
                message: format!(
                    "client id {client_id:?} is also claimed by {first}; neither may log in"
                ),
            });
            contested.push(client_id);
            continue;
        }
        owners.insert(client_id.clone(), who);
        let scope = ChannelScope {
            domain: conn.domain().map(str::to_owned),
            channel: conn.channel_id.clone(),
        };
        let mut credential = Credential::proplet(key).on_channel(scope);
        if let Some((old, until)) = previous {
            credential = credential.with_previous(old, until);
        }
        table.insert(client_id, credential);
    }
    for id in contested {
        table.remove(&id);
    }
    (table, problems)
}

/// The key a rotation replaced and until when it works, from a key Secret's
/// [`PREVIOUS_KEY`] and [`PREVIOUS_KEY_UNTIL`] entries (see `propeller rotate`).
fn previous_key(
    read: impl Fn(&str) -> Option<String>,
) -> Option<(String, chrono::DateTime<chrono::Utc>)> {
    let key = read(PREVIOUS_KEY).filter(|k| !k.is_empty())?;
    let until = chrono::DateTime::parse_from_rfc3339(read(PREVIOUS_KEY_UNTIL)?.trim()).ok()?;
    Some((key, until.with_timezone(&chrono::Utc)))
}

/// The entry of a device's key Secret that keeps the key a rotation replaced.
pub const PREVIOUS_KEY: &str = "previous-key";
/// The entry that says until when (RFC 3339) [`PREVIOUS_KEY`] still works.
pub const PREVIOUS_KEY_UNTIL: &str = "previous-key-until";

pub use crate::crd::common::secret_entry;

/// The broker's token table from the Secrets of `namespace`: each stored token's digest and
/// whether it may be used over plain TCP. A Secret that does not read as a token is logged
/// and left out.
pub fn token_table<'a>(
    secrets: impl IntoIterator<Item = &'a Secret>,
    namespace: &str,
) -> HashMap<String, TokenCredential> {
    secrets
        .into_iter()
        .filter(|s| s.type_.as_deref() == Some(TOKEN_SECRET_TYPE))
        .filter(|s| s.metadata.namespace.as_deref().unwrap_or("default") == namespace)
        .filter(|s| s.metadata.deletion_timestamp.is_none())
        .filter_map(|s| match TokenRecord::from_secret(s) {
            Ok(token) => Some((
                token.id.clone(),
                TokenCredential::new(token.secret_digest, !token.insecure)
                    .with_bcrypt(token.secret_bcrypt),
            )),
            Err(e) => {
                warn!("{e}");
                None
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn proplet(name: &str, generation: i64) -> Proplet {
        serde_json::from_value(json!({
            "apiVersion": "propeller.propeller.absmach.eu/v1", "kind": "Proplet",
            "metadata": {"name": name, "namespace": "ns", "generation": generation},
            "spec": {"type": "external", "connectionConfig": {"mqttAddress": "tcp://x:1",
                     "domainId": "d", "channelId": "c", "clientId": name, "clientKey": "k"}}
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn the_table_is_rebuilt_only_when_its_inputs_change() {
        let gate = RefreshGate::default();
        let hour = Duration::from_secs(3600);
        assert!(gate.due(hour), "the first table");
        assert!(!gate.due(hour), "nothing changed");
        gate.invalidate();
        assert!(gate.due(hour), "a counted change");
        assert!(!gate.due(hour), "counted once");
        assert!(gate.due(Duration::ZERO), "age");

        let a = proplet("a", 1);
        assert!(changes_credentials(None, &a), "a new proplet");
        let mut status_only = a.clone();
        status_only.status = Some(Default::default());
        assert!(
            !changes_credentials(Some(&a), &status_only),
            "a status write"
        );
        assert!(
            changes_credentials(Some(&a), &proplet("a", 2)),
            "a new spec generation"
        );
        let mut deleting = a.clone();
        deleting.metadata.deletion_timestamp =
            serde_json::from_value(json!("2026-11-26T00:00:00Z")).ok();
        assert!(changes_credentials(Some(&a), &deleting), "a deletion begun");
    }

    #[test]
    fn a_secret_key_is_read_string_data_first_as_the_api_server_merges_it() {
        let secret: k8s_openapi::api::core::v1::Secret =
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "k"},
                "data": {"key": "b2xk", "only-data": "ZnJvbS1kYXRh"},
                "stringData": {"key": "new"}
            }))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(secret_entry(&secret, "key").as_deref(), Some("new"));
        assert_eq!(
            secret_entry(&secret, "only-data").as_deref(),
            Some("from-data")
        );
        assert_eq!(secret_entry(&secret, "missing"), None);
    }
}
