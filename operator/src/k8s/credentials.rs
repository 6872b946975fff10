//! Who may connect to the broker, derived from Proplet resources and their Secrets.
//!
//! Pure: the caller supplies the Proplets and a way to read one Secret key, and gets the
//! credential table for the broker plus the problems to report on each Proplet's status.

use std::collections::HashMap;

use propeller_broker::server::Credential;

use crate::crd::proplet::{ClientKeySource, Proplet};

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
        let client_id = conn.client().unwrap_or(name).to_owned();
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
        table.insert(client_id, Credential::proplet(key));
    }
    for id in contested {
        table.remove(&id);
    }
    (table, problems)
}
