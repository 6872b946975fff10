//! Device enrolment: bootstrap tokens as stored, and what one enrolment request leads to.
//!
//! A token is kept as a Secret of type [`TOKEN_SECRET_TYPE`] named
//! `bootstrap-token-<id>` in propeller's namespace, holding the digest of its secret and its
//! settings (never the secret). [`plan_enrolment`] decides a request from the token, the
//! Proplet the same machine already has (if any), a freshly generated key and the time:
//! refuse it, create a Secret and a Proplet for a new device, or give an existing one a new
//! key. The driver applies the plan and publishes the reply.

use std::collections::BTreeMap;

use chrono::{DateTime, SecondsFormat, Utc};
use k8s_openapi::api::core::v1::{Secret, SecretKeySelector};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::ByteString;
use propeller_broker::protocol::enrolment::{
    is_token_id, EnrolGrant, EnrolRefusal, EnrolRequest, RefusalReason,
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::crd::common::secret_entry;
use crate::crd::proplet::{ConnectionConfig, Proplet, PropletSpec, PropletType};

/// The Secret type of a stored bootstrap token.
pub const TOKEN_SECRET_TYPE: &str = "propeller.absmach.eu/bootstrap-token";
/// The label every token Secret carries (value: the token id), to list them.
pub const TOKEN_LABEL: &str = "propeller.absmach.eu/bootstrap-token";
/// The label on an enrolled Proplet naming the token it enrolled with.
pub const ENROLLED_WITH_LABEL: &str = "propeller.absmach.eu/enrolled-with";
/// The label on an enrolled Proplet identifying its machine (a digest of the machine id).
pub const MACHINE_LABEL: &str = "propeller.absmach.eu/machine";
/// The label that holds a Proplet back from tasks until a person approves it (value
/// [`APPROVAL_PENDING`]); removing it, or setting any other value, approves.
pub const APPROVAL_LABEL: &str = "propeller.absmach.eu/approval";
/// The value of [`APPROVAL_LABEL`] that holds a Proplet back.
pub const APPROVAL_PENDING: &str = "pending";
/// The key of the device key in an enrolled device's Secret.
pub const DEVICE_KEY: &str = "key";

/// Whether enrolled devices get tasks at once or wait for a person.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Approval {
    /// Devices get tasks as soon as they are Running.
    #[default]
    Auto,
    /// Devices wait with [`APPROVAL_LABEL`] `pending` until approved.
    Manual,
}

/// A bootstrap token's settings and state, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenRecord {
    /// The public id.
    pub id: String,
    /// The hex SHA-256 digest of the secret.
    pub secret_digest: String,
    /// The bcrypt hash of the whole token, rendered for brokers that check passwords
    /// themselves (NATS); tokens made before it existed have none.
    pub secret_bcrypt: Option<String>,
    /// When it stops working; `None`: never.
    pub expires: Option<DateTime<Utc>>,
    /// How many devices it may enrol; `None`: any number.
    pub usage_limit: Option<u32>,
    /// How many it has enrolled.
    pub uses: u32,
    /// Labels every device it enrols gets.
    pub labels: BTreeMap<String, String>,
    /// The namespace its devices' Proplets go to.
    pub namespace: String,
    /// The `{domain}` topic level of its devices.
    pub domain_id: String,
    /// The `{channel}` topic level of its devices.
    pub channel_id: String,
    /// Whether its devices wait for approval.
    pub approval: Approval,
    /// Whether it may be used over plain TCP.
    pub insecure: bool,
    /// What it is for.
    pub description: String,
}

/// A stored token that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bootstrap token Secret {secret}: {problem}")]
pub struct TokenRecordError {
    /// The Secret's name.
    pub secret: String,
    /// What is wrong.
    pub problem: String,
}

/// The Secret name of token `id`.
pub fn token_secret_name(id: &str) -> String {
    format!("bootstrap-token-{id}")
}

impl TokenRecord {
    /// The Secret that stores this token in `namespace`.
    pub fn to_secret(&self, namespace: &str) -> Secret {
        let mut data = BTreeMap::new();
        let mut put = |key: &str, value: String| {
            data.insert(key.to_owned(), ByteString(value.into_bytes()));
        };
        put("token-id", self.id.clone());
        put("secret-digest", self.secret_digest.clone());
        if let Some(hash) = &self.secret_bcrypt {
            put("secret-bcrypt", hash.clone());
        }
        if let Some(expires) = self.expires {
            put(
                "expiration",
                expires.to_rfc3339_opts(SecondsFormat::Secs, true),
            );
        }
        if let Some(limit) = self.usage_limit {
            put("usage-limit", limit.to_string());
        }
        put("uses", self.uses.to_string());
        put("labels", encode_labels(&self.labels));
        put("namespace", self.namespace.clone());
        put("domain-id", self.domain_id.clone());
        put("channel-id", self.channel_id.clone());
        put(
            "approve",
            match self.approval {
                Approval::Auto => "auto",
                Approval::Manual => "manual",
            }
            .into(),
        );
        put("insecure", self.insecure.to_string());
        put("description", self.description.clone());
        Secret {
            metadata: ObjectMeta {
                name: Some(token_secret_name(&self.id)),
                namespace: Some(namespace.to_owned()),
                labels: Some(BTreeMap::from([(TOKEN_LABEL.to_owned(), self.id.clone())])),
                ..ObjectMeta::default()
            },
            type_: Some(TOKEN_SECRET_TYPE.to_owned()),
            data: Some(data),
            ..Secret::default()
        }
    }

    /// Reads a token from its Secret.
    pub fn from_secret(secret: &Secret) -> Result<Self, TokenRecordError> {
        let name = secret.metadata.name.clone().unwrap_or_default();
        let fail = |problem: String| TokenRecordError {
            secret: name.clone(),
            problem,
        };
        if secret.type_.as_deref() != Some(TOKEN_SECRET_TYPE) {
            return Err(fail(format!("its type is not {TOKEN_SECRET_TYPE}")));
        }
        let field = |key: &str| secret_entry(secret, key);
        let required = |key: &str| field(key).ok_or_else(|| fail(format!("no {key}")));
        let id = required("token-id")?;
        if !is_token_id(&id) {
            return Err(fail(format!("token-id {id:?} is not 6 of a-z0-9")));
        }
        let number = |key: &str| -> Result<Option<u32>, TokenRecordError> {
            field(key)
                .map(|v| {
                    v.trim()
                        .parse::<u32>()
                        .map_err(|_| fail(format!("{key} {v:?} is not a count")))
                })
                .transpose()
        };
        let expires = field("expiration")
            .map(|v| {
                DateTime::parse_from_rfc3339(v.trim())
                    .map(|t| t.with_timezone(&Utc))
                    .map_err(|e| fail(format!("expiration {v:?}: {e}")))
            })
            .transpose()?;
        let approval = match field("approve").as_deref().map(str::trim) {
            None | Some("auto") => Approval::Auto,
            Some("manual") => Approval::Manual,
            Some(other) => return Err(fail(format!("approve {other:?} is not auto or manual"))),
        };
        Ok(Self {
            id,
            secret_digest: required("secret-digest")?,
            secret_bcrypt: field("secret-bcrypt"),
            expires,
            usage_limit: number("usage-limit")?,
            uses: number("uses")?.unwrap_or(0),
            labels: decode_labels(&field("labels").unwrap_or_default()),
            namespace: field("namespace").unwrap_or_else(|| "default".into()),
            domain_id: required("domain-id")?,
            channel_id: required("channel-id")?,
            approval,
            insecure: field("insecure").as_deref().map(str::trim) == Some("true"),
            description: field("description").unwrap_or_default(),
        })
    }

    /// Why the token cannot enrol a device now, if it cannot. `new_device`: whether the
    /// request would take a use (a machine enrolling again does not).
    pub fn refusal(&self, now: DateTime<Utc>, new_device: bool) -> Option<EnrolRefusal> {
        if let Some(expires) = self.expires {
            if now >= expires {
                return Some(EnrolRefusal {
                    reason: RefusalReason::Expired,
                    message: format!(
                        "bootstrap token {} expired at {}; ask for a new one (`propeller token create`)",
                        self.id,
                        expires.to_rfc3339_opts(SecondsFormat::Secs, true)
                    ),
                });
            }
        }
        if new_device && self.usage_limit.is_some_and(|limit| self.uses >= limit) {
            return Some(EnrolRefusal {
                reason: RefusalReason::UsedUp,
                message: format!(
                    "bootstrap token {} has enrolled the {} devices it was made for; ask for a new one (`propeller token create --uses N`)",
                    self.id,
                    self.usage_limit.unwrap_or_default()
                ),
            });
        }
        None
    }
}

/// `k=v,k=v`, sorted.
fn encode_labels(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn decode_labels(text: &str) -> BTreeMap<String, String> {
    text.split(',')
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .filter(|(k, _)| !k.is_empty())
        .collect()
}

/// The value of [`MACHINE_LABEL`] for a machine id: a digest, so any machine id fits a
/// label value and the id itself is not spread around.
pub fn machine_label(machine_id: &str) -> String {
    let digest = Sha256::digest(machine_id.trim().as_bytes());
    digest.iter().take(16).map(|b| format!("{b:02x}")).collect()
}

/// What a request leads to.
#[derive(Debug, Clone)]
pub enum EnrolPlan {
    /// Answer with this refusal; write nothing.
    Refuse(EnrolRefusal),
    /// A new device: take one of the token's uses, create `secret` then `proplet`, answer
    /// with `grant`.
    Create {
        /// The device's key.
        secret: Box<Secret>,
        /// Its Proplet.
        proplet: Box<Proplet>,
        /// The answer.
        grant: EnrolGrant,
    },
    /// A machine that has a Proplet already: replace the key in `secret` (its Proplet's key
    /// Secret, as read) and answer with `grant`. No use is taken.
    Rotate {
        /// The Secret with the new key, to write over the stored one.
        secret: Box<Secret>,
        /// The answer.
        grant: EnrolGrant,
    },
}

/// A machine's existing Proplet and the Secret its key is in.
#[derive(Debug, Clone, Copy)]
pub struct Enrolled<'a> {
    /// The Proplet labelled with the machine.
    pub proplet: &'a Proplet,
    /// Its key Secret (`None`: missing, it is made again).
    pub secret: Option<&'a Secret>,
}

/// Decides one enrolment request. `token`: the token the login named (`None`: deleted);
/// `existing`: the Proplet this machine has in the token's namespace; `fresh_key`: a new
/// random key.
pub fn plan_enrolment(
    token: Option<&TokenRecord>,
    token_id: &str,
    request: Result<&EnrolRequest, &str>,
    existing: Option<Enrolled<'_>>,
    fresh_key: &str,
    now: DateTime<Utc>,
) -> EnrolPlan {
    let Some(token) = token else {
        return EnrolPlan::Refuse(EnrolRefusal {
            reason: RefusalReason::UnknownToken,
            message: format!(
                "bootstrap token {token_id} does not exist (it was deleted); ask for a new one (`propeller token create`)"
            ),
        });
    };
    let request = match request {
        Ok(request) if !request.machine_id.trim().is_empty() => request,
        Ok(_) => return EnrolPlan::Refuse(EnrolRefusal {
            reason: RefusalReason::BadRequest,
            message:
                "the request has no machineId; the agent reads /etc/machine-id (or --machine-id)"
                    .into(),
        }),
        Err(problem) => {
            return EnrolPlan::Refuse(EnrolRefusal {
                reason: RefusalReason::BadRequest,
                message: format!("the enrolment request could not be read: {problem}"),
            })
        }
    };
    if let Some(refusal) = token.refusal(now, existing.is_none()) {
        return EnrolPlan::Refuse(refusal);
    }
    if let Some(existing) = existing {
        let proplet = existing.proplet;
        let name = proplet.metadata.name.clone().unwrap_or_default();
        let conn = &proplet.spec.connection_config;
        let secret_name = conn
            .client_key_secret_ref
            .as_ref()
            .map(|s| s.name.clone())
            .unwrap_or_else(|| key_secret_name(&name));
        let mut secret = existing
            .secret
            .cloned()
            .unwrap_or_else(|| key_secret(&secret_name, &token.namespace, "", &name));
        secret.string_data = None;
        secret
            .data
            .get_or_insert_with(BTreeMap::new)
            .insert(DEVICE_KEY.into(), ByteString(fresh_key.as_bytes().to_vec()));
        let pending = proplet
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(APPROVAL_LABEL))
            .is_some_and(|v| v == APPROVAL_PENDING);
        return EnrolPlan::Rotate {
            secret: Box::new(secret),
            grant: EnrolGrant {
                client_id: proplet.client_id().to_owned(),
                client_key: fresh_key.to_owned(),
                domain_id: conn.domain().unwrap_or(&token.domain_id).to_owned(),
                channel_id: conn.channel_id.clone(),
                namespace: token.namespace.clone(),
                rotated: true,
                pending_approval: pending,
            },
        };
    }
    let machine = machine_label(&request.machine_id);
    let name = device_name(&request.hostname, &machine);
    let secret_name = key_secret_name(&name);
    let mut labels = token.labels.clone();
    labels.insert(ENROLLED_WITH_LABEL.into(), token.id.clone());
    labels.insert(MACHINE_LABEL.into(), machine);
    for (key, value) in [
        ("kubernetes.io/arch", &request.arch),
        ("kubernetes.io/os", &request.os),
        ("kubernetes.io/hostname", &request.hostname),
    ] {
        if let Some(value) = label_value(value) {
            labels.insert(key.into(), value);
        }
    }
    if token.approval == Approval::Manual {
        labels.insert(APPROVAL_LABEL.into(), APPROVAL_PENDING.into());
    }
    let mut annotations = BTreeMap::new();
    annotations.insert(
        "propeller.absmach.eu/enrolled".to_owned(),
        format!(
            "{} with token {} (agent {}, {} CPUs, {} bytes of memory)",
            now.to_rfc3339_opts(SecondsFormat::Secs, true),
            token.id,
            if request.agent_version.is_empty() {
                "unknown"
            } else {
                &request.agent_version
            },
            request.cpus,
            request.memory_bytes
        ),
    );
    let proplet = Proplet {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(token.namespace.clone()),
            labels: Some(labels),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        },
        spec: PropletSpec {
            type_: PropletType::External,
            k8s: None,
            external: None,
            resources: None,
            connection_config: ConnectionConfig {
                mqtt_address: if request.server.is_empty() {
                    "unknown".to_owned()
                } else {
                    request.server.clone()
                },
                domain_id: Some(token.domain_id.clone()),
                tenant_id: None,
                channel_id: token.channel_id.clone(),
                client_id: Some(name.clone()),
                entity_id: None,
                client_key: None,
                api_key: None,
                client_key_secret_ref: Some(SecretKeySelector {
                    name: secret_name.clone(),
                    key: DEVICE_KEY.into(),
                    optional: None,
                }),
                api_key_secret_ref: None,
                mqtt_qos: 0,
                mqtt_timeout: "30s".into(),
            },
            capacity: None,
        },
        status: None,
    };
    EnrolPlan::Create {
        secret: Box::new(key_secret(&secret_name, &token.namespace, fresh_key, &name)),
        proplet: Box::new(proplet),
        grant: EnrolGrant {
            client_id: name,
            client_key: fresh_key.to_owned(),
            domain_id: token.domain_id.clone(),
            channel_id: token.channel_id.clone(),
            namespace: token.namespace.clone(),
            rotated: false,
            pending_approval: token.approval == Approval::Manual,
        },
    }
}

/// `secret` (a device's key Secret) with `fresh` as its key `entry`, and the key it had kept
/// as `previous-key` until `until` (`propeller rotate`: both work during the grace period).
/// `None` when the Secret has no key to replace.
pub fn rotate_key(
    secret: &Secret,
    entry: &str,
    fresh: &str,
    until: DateTime<Utc>,
) -> Option<Secret> {
    let old = secret_entry(secret, entry).filter(|k| !k.is_empty())?;
    let mut rotated = secret.clone();
    let mut data = rotated.data.take().unwrap_or_default();
    for (key, value) in rotated.string_data.take().unwrap_or_default() {
        data.insert(key, ByteString(value.into_bytes()));
    }
    data.insert(entry.to_owned(), ByteString(fresh.as_bytes().to_vec()));
    data.insert("previous-key".into(), ByteString(old.into_bytes()));
    data.insert(
        "previous-key-until".into(),
        ByteString(
            until
                .to_rfc3339_opts(SecondsFormat::Secs, true)
                .into_bytes(),
        ),
    );
    rotated.data = Some(data);
    Some(rotated)
}

/// The Secret holding device `proplet`'s key.
fn key_secret(name: &str, namespace: &str, key: &str, proplet: &str) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([(
                "propeller.absmach.eu/proplet".to_owned(),
                proplet.to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([(
            DEVICE_KEY.to_owned(),
            ByteString(key.as_bytes().to_vec()),
        )])),
        ..Secret::default()
    }
}

fn key_secret_name(proplet: &str) -> String {
    format!("{proplet}-key")
}

/// A DNS-1123 name from the host name and the machine digest: `<host>-<8 hex>`.
fn device_name(hostname: &str, machine: &str) -> String {
    let mut host: String = hostname
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    host.truncate(40);
    let host = host.trim_matches('-');
    let host = if host.is_empty() { "device" } else { host };
    format!("{host}-{}", &machine[..8.min(machine.len())])
}

/// `value` as a label value (63 characters of `[A-Za-z0-9._-]`, alphanumeric at both ends),
/// or `None` when nothing of it is left.
fn label_value(value: &str) -> Option<String> {
    let mut cleaned: String = value
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect();
    cleaned.truncate(63);
    let cleaned = cleaned.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    (!cleaned.is_empty()).then(|| cleaned.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2026-11-27T12:00:00Z")
            .map(|t| t.with_timezone(&Utc))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn token() -> TokenRecord {
        TokenRecord {
            id: "abcdef".into(),
            secret_digest: "00".repeat(32),
            secret_bcrypt: Some("$2b$06$h".into()),
            expires: Some(now() + chrono::Duration::hours(1)),
            usage_limit: Some(2),
            uses: 0,
            labels: BTreeMap::from([("site".into(), "lab".into())]),
            namespace: "fleet".into(),
            domain_id: "d".into(),
            channel_id: "c".into(),
            approval: Approval::Auto,
            insecure: false,
            description: "the lab's Pis".into(),
        }
    }

    fn request() -> EnrolRequest {
        EnrolRequest {
            machine_id: "0123456789abcdef0123456789abcdef".into(),
            hostname: "Pi_Kitchen.local".into(),
            arch: "arm64".into(),
            os: "linux".into(),
            memory_bytes: 4 << 30,
            cpus: 4,
            agent_version: "0.1.0".into(),
            server: "mqtts://b:8883".into(),
            reply_key: String::new(),
        }
    }

    fn plan(token: Option<&TokenRecord>, existing: Option<Enrolled<'_>>) -> EnrolPlan {
        let request = request();
        plan_enrolment(token, "abcdef", Ok(&request), existing, "fresh", now())
    }

    fn refused(plan: EnrolPlan) -> RefusalReason {
        match plan {
            EnrolPlan::Refuse(r) => {
                assert!(r.message.contains("abcdef") || r.message.contains("machineId"));
                r.reason
            }
            other => panic!("not refused: {other:?}"),
        }
    }

    #[test]
    fn a_token_survives_its_secret_unchanged() {
        let mut token = token();
        token.approval = Approval::Manual;
        token.usage_limit = None;
        let secret = token.to_secret("propeller-system");
        assert_eq!(
            secret.metadata.name.as_deref(),
            Some("bootstrap-token-abcdef")
        );
        assert_eq!(TokenRecord::from_secret(&secret), Ok(token));
        let mut wrong = secret.clone();
        wrong.type_ = Some("Opaque".into());
        assert!(TokenRecord::from_secret(&wrong).is_err());
    }

    #[test]
    fn a_new_machine_gets_a_proplet_with_the_tokens_labels_and_its_facts() {
        let EnrolPlan::Create {
            secret,
            proplet,
            grant,
        } = plan(Some(&token()), None)
        else {
            panic!("not created");
        };
        let name = proplet.metadata.name.clone().unwrap_or_default();
        assert!(name.starts_with("pi-kitchen-local-"), "{name}");
        assert_eq!(grant.client_id, name);
        assert_eq!(grant.client_key, "fresh");
        assert_eq!(grant.namespace, "fleet");
        assert!(!grant.rotated && !grant.pending_approval);
        let labels = proplet.metadata.labels.clone().unwrap_or_default();
        assert_eq!(labels.get("site").map(String::as_str), Some("lab"));
        assert_eq!(
            labels.get("kubernetes.io/arch").map(String::as_str),
            Some("arm64")
        );
        assert_eq!(
            labels.get(ENROLLED_WITH_LABEL).map(String::as_str),
            Some("abcdef")
        );
        assert_eq!(
            labels.get(MACHINE_LABEL),
            Some(&machine_label(&request().machine_id))
        );
        let key = secret
            .data
            .as_ref()
            .and_then(|d| d.get(DEVICE_KEY))
            .map(|b| b.0.clone());
        assert_eq!(key.as_deref(), Some(&b"fresh"[..]));
        let selector = proplet.spec.connection_config.client_key_secret_ref.clone();
        assert_eq!(selector.map(|s| s.name), secret.metadata.name.clone());
    }

    #[test]
    fn manual_approval_holds_the_new_proplet_back() {
        let mut token = token();
        token.approval = Approval::Manual;
        let EnrolPlan::Create { proplet, grant, .. } = plan(Some(&token), None) else {
            panic!("not created");
        };
        assert!(grant.pending_approval);
        let labels = proplet.metadata.labels.unwrap_or_default();
        assert_eq!(
            labels.get(APPROVAL_LABEL).map(String::as_str),
            Some(APPROVAL_PENDING)
        );
    }

    #[test]
    fn expired_used_up_deleted_and_unreadable_are_refused_with_the_reason() {
        let mut expired = token();
        expired.expires = Some(now());
        assert_eq!(refused(plan(Some(&expired), None)), RefusalReason::Expired);
        let mut used = token();
        used.uses = 2;
        assert_eq!(refused(plan(Some(&used), None)), RefusalReason::UsedUp);
        assert_eq!(refused(plan(None, None)), RefusalReason::UnknownToken);
        let bad = plan_enrolment(
            Some(&token()),
            "abcdef",
            Err("expected value at line 1"),
            None,
            "k",
            now(),
        );
        let EnrolPlan::Refuse(r) = bad else {
            panic!("accepted")
        };
        assert_eq!(r.reason, RefusalReason::BadRequest);
        assert!(r.message.contains("expected value"));
    }

    #[test]
    fn the_same_machine_again_rotates_its_key_without_a_use_even_when_used_up() {
        let EnrolPlan::Create {
            secret, proplet, ..
        } = plan(Some(&token()), None)
        else {
            panic!("not created");
        };
        let mut used = token();
        used.uses = 2;
        let existing = Enrolled {
            proplet: &proplet,
            secret: Some(&secret),
        };
        let EnrolPlan::Rotate {
            secret: rotated,
            grant,
        } = plan(Some(&used), Some(existing))
        else {
            panic!("not rotated");
        };
        assert!(grant.rotated);
        assert_eq!(
            grant.client_id,
            proplet.metadata.name.clone().unwrap_or_default()
        );
        assert_eq!(rotated.metadata.name, secret.metadata.name);
        let mut expired = token();
        expired.expires = Some(now() - chrono::Duration::seconds(1));
        assert_eq!(
            refused(plan(Some(&expired), Some(existing))),
            RefusalReason::Expired
        );
    }

    #[test]
    fn a_rotation_keeps_the_old_key_until_the_grace_ends() {
        let secret = key_secret("pi-key", "fleet", "old", "pi");
        let until = now() + chrono::Duration::minutes(10);
        let rotated = rotate_key(&secret, DEVICE_KEY, "new", until).expect("rotated");
        let data = rotated.data.unwrap_or_default();
        let text = |k: &str| {
            data.get(k)
                .map(|b| String::from_utf8_lossy(&b.0).into_owned())
        };
        assert_eq!(text(DEVICE_KEY).as_deref(), Some("new"));
        assert_eq!(text("previous-key").as_deref(), Some("old"));
        assert_eq!(
            text("previous-key-until").as_deref(),
            Some("2026-11-27T12:10:00Z")
        );
        let empty = key_secret("pi-key", "fleet", "", "pi");
        assert!(rotate_key(&empty, DEVICE_KEY, "new", until).is_none());
    }

    #[test]
    fn names_and_label_values_stay_valid_for_any_host() {
        assert_eq!(device_name("", "0123456789"), "device-01234567");
        assert_eq!(device_name("--Ünïcode--", "ab"), "n-code-ab");
        assert_eq!(label_value("a b/c"), Some("a-b-c".into()));
        assert_eq!(label_value("!!!"), None);
        assert_eq!(label_value(&"x".repeat(80)).map(|v| v.len()), Some(63));
    }
}
