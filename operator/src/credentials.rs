//! Who may connect to the broker, derived from Proplet resources and their Secrets.
//!
//! Pure: the caller supplies the Proplets and a way to read one Secret key, and gets the
//! credential table for the broker plus the problems to report on each Proplet's status.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use propeller_broker::server::{ChannelScope, Credential};

use crate::crd::proplet::{ClientKeySource, Proplet};

/// Decides when the credential table must be rebuilt: when the Proplets that feed it changed
/// (one added, removed, being deleted, or a new spec generation), when a Secret changed
/// (the driver calls [`RefreshGate::invalidate`]), or when `max_age` passed. Rebuilding
/// reads every referenced Secret, so it must not happen on every heartbeat-driven reconcile.
#[derive(Debug, Default)]
pub struct RefreshGate {
    last: Mutex<Option<(Vec<GateInput>, Instant)>>,
}

/// One Proplet as the gate sees it: `namespace/name` and spec generation.
type GateInput = (String, Option<i64>);

impl RefreshGate {
    /// Whether to rebuild now; remembers the inputs when it says yes.
    pub fn due<'a>(
        &self,
        proplets: impl IntoIterator<Item = &'a Proplet>,
        max_age: Duration,
    ) -> bool {
        let mut inputs: Vec<GateInput> = proplets
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .map(|p| {
                (
                    format!(
                        "{}/{}",
                        p.metadata.namespace.as_deref().unwrap_or_default(),
                        p.metadata.name.as_deref().unwrap_or_default()
                    ),
                    p.metadata.generation,
                )
            })
            .collect();
        inputs.sort();
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let fresh = last
            .as_ref()
            .is_some_and(|(seen, at)| *seen == inputs && at.elapsed() < max_age);
        if !fresh {
            *last = Some((inputs, Instant::now()));
        }
        !fresh
    }

    /// Makes the next [`RefreshGate::due`] say yes (a Secret changed).
    pub fn invalidate(&self) {
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
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
pub fn credential_table(
    proplets: &[Proplet],
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
        let key = match conn.key_source() {
            Some(ClientKeySource::Inline(key)) => Some(key.to_owned()),
            Some(ClientKeySource::Secret(selector)) => {
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
        table.insert(client_id, Credential::proplet(key).on_channel(scope));
    }
    for id in contested {
        table.remove(&id);
    }
    (table, problems)
}

/// The value of `key` in a Secret, as the API server would hand it out: `stringData`
/// (which a write merges over `data`) first, then `data`. Both drivers read keys through
/// this, whatever store the Secret came from.
pub fn secret_entry(secret: &k8s_openapi::api::core::v1::Secret, key: &str) -> Option<String> {
    if let Some(text) = secret.string_data.as_ref().and_then(|d| d.get(key)) {
        return Some(text.clone());
    }
    let bytes = secret.data.as_ref()?.get(key)?;
    String::from_utf8(bytes.0.clone()).ok()
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
        let a = proplet("a", 1);
        assert!(gate.due([&a], hour));
        assert!(
            !gate.due([&a], hour),
            "a status-only change needs no rebuild"
        );
        let a2 = proplet("a", 2);
        assert!(gate.due([&a2], hour), "a new spec generation does");
        let b = proplet("b", 1);
        assert!(gate.due([&a2, &b], hour), "a new proplet does");
        gate.invalidate();
        assert!(gate.due([&a2, &b], hour), "a Secret change does");
        assert!(gate.due([&a2, &b], Duration::ZERO), "and so does age");
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
