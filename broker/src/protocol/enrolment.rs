//! Device enrolment: bootstrap tokens and the one request/reply exchange a new device makes.
//!
//! A token is `<id>.<secret>`, the shape of Kubernetes bootstrap tokens: a 6-character id
//! anyone may see (it names the token in lists and logs) and a 16-character secret only the
//! holder knows (about 82 bits of entropy). Only a SHA-256 digest of the secret is stored.
//!
//! A device holding a token logs in with client id `enrol-<token id>-<nonce>`, username
//! `enrol-<token id>` ([`token_login_name`]: one name per token, as brokers with a static user
//! list such as NATS need), password the whole token. That login may publish only on
//! [`request_topic`]`(client id)` and subscribe only to [`reply_topic`]`(client id)` where the
//! broker tells the client id, and to its token's enrolment topics where it tells only the
//! username; either way the grant in the reply, which carries the device's new key, is sealed
//! to a one-time key of the asking device ([`super::sealed_grant`]).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Characters of a token id and secret (lower-case letters and digits).
const TOKEN_ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
/// Length of a token id.
pub const TOKEN_ID_LEN: usize = 6;
/// Length of a token secret.
pub const TOKEN_SECRET_LEN: usize = 16;
/// The client-id prefix of an enrolment login.
pub const ENROL_CLIENT_PREFIX: &str = "enrol-";
/// The topic prefix of enrolment exchanges.
pub const ENROL_TOPIC_PREFIX: &str = "propeller/enrol/";
/// The filter an operator subscribes to for every enrolment request (on external brokers).
pub const ENROL_REQUEST_FILTER: &str = "propeller/enrol/+/+/request";
/// The largest request accepted (the facts are a few hundred bytes).
pub const MAX_REQUEST_BYTES: usize = 8 * 1024;

/// A token that is not `<6 of a-z0-9>.<16 of a-z0-9>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a bootstrap token is <id>.<secret>: 6 then 16 lower-case letters or digits, as `propeller token create` prints it")]
pub struct TokenFormatError;

/// A bootstrap token as a device holds it. Its `Debug` and `Display` never show the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct BootstrapToken {
    id: String,
    secret: String,
}

impl BootstrapToken {
    /// A token from its two parts, checked like a parsed one.
    pub fn new(id: &str, secret: &str) -> Result<Self, TokenFormatError> {
        if !is_token_part(id, TOKEN_ID_LEN) || !is_token_part(secret, TOKEN_SECRET_LEN) {
            return Err(TokenFormatError);
        }
        Ok(Self {
            id: id.to_owned(),
            secret: secret.to_owned(),
        })
    }

    /// A token whose characters are drawn by `pick(n)`, which must return a uniformly random
    /// number below `n` from a cryptographic source.
    pub fn generate(mut pick: impl FnMut(usize) -> usize) -> Self {
        let mut draw = |len: usize| -> String {
            (0..len)
                .map(|_| TOKEN_ALPHABET[pick(TOKEN_ALPHABET.len()) % TOKEN_ALPHABET.len()] as char)
                .collect()
        };
        let id = draw(TOKEN_ID_LEN);
        let secret = draw(TOKEN_SECRET_LEN);
        Self { id, secret }
    }

    /// The public id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The whole token, `<id>.<secret>`, to print once or to send as a password.
    pub fn reveal(&self) -> String {
        format!("{}.{}", self.id, self.secret)
    }

    /// The digest stored in place of the secret.
    pub fn secret_digest(&self) -> String {
        secret_digest(&self.secret)
    }
}

impl FromStr for BootstrapToken {
    type Err = TokenFormatError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (id, secret) = text.trim().split_once('.').ok_or(TokenFormatError)?;
        Self::new(id, secret)
    }
}

impl fmt::Debug for BootstrapToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BootstrapToken({}.<redacted>)", self.id)
    }
}

fn is_token_part(text: &str, len: usize) -> bool {
    text.len() == len && text.bytes().all(|b| TOKEN_ALPHABET.contains(&b))
}

/// Whether `id` has the shape of a token id.
pub fn is_token_id(id: &str) -> bool {
    is_token_part(id, TOKEN_ID_LEN)
}

/// The hex SHA-256 digest of a token secret. The secret has about 82 bits of entropy, so a
/// fast digest is enough: guessing is bounded by the secret, not by the digest's cost.
pub fn secret_digest(secret: &str) -> String {
    let digest = Sha256::digest(secret.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `password` (a whole token) is the token `id` whose secret digests to `digest`.
/// Compares in time independent of where the digests differ.
pub fn token_matches(id: &str, digest: &str, password: &str) -> bool {
    let Ok(token) = password.parse::<BootstrapToken>() else {
        return false;
    };
    let candidate = token.secret_digest();
    let same_len = candidate.len() == digest.len();
    let differences = candidate
        .bytes()
        .zip(digest.bytes())
        .fold(0u8, |acc, (a, b)| acc | (a ^ b));
    token.id == id && same_len && differences == 0
}

/// The token id and nonce an enrolment client id names: `enrol-<id>-<nonce>`.
fn enrol_client_parts(client_id: &str) -> Option<(&str, &str)> {
    let rest = client_id.strip_prefix(ENROL_CLIENT_PREFIX)?;
    let (id, nonce) = rest.split_once('-')?;
    let nonce_ok =
        (8..=32).contains(&nonce.len()) && nonce.bytes().all(|b| b.is_ascii_alphanumeric());
    (is_token_id(id) && nonce_ok).then_some((id, nonce))
}

/// The token id an enrolment client id names: `enrol-<id>-<nonce>`.
pub fn enrol_client_token_id(client_id: &str) -> Option<&str> {
    enrol_client_parts(client_id).map(|(id, _)| id)
}

/// The username every enrolment login of token `id` gives: `enrol-<id>`.
pub fn token_login_name(id: &str) -> String {
    format!("{ENROL_CLIENT_PREFIX}{id}")
}

/// The token id a token login name ([`token_login_name`]) names.
pub fn token_login_token_id(username: &str) -> Option<&str> {
    username
        .strip_prefix(ENROL_CLIENT_PREFIX)
        .filter(|id| is_token_id(id))
}

/// Which leg of the exchange a topic is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnrolLeg {
    /// The device's request (it publishes).
    Request,
    /// propeller's reply (the device subscribes).
    Reply,
}

/// Whether the enrolment login `login` may use `topic` as `leg`: given its client id
/// (`enrol-<id>-<nonce>`), exactly its own topic; given only its username (`enrol-<id>`,
/// when the broker does not say the client id), any exchange of its token.
pub fn enrol_topic_allowed(login: &str, topic: &str, leg: EnrolLeg) -> bool {
    let suffix = match leg {
        EnrolLeg::Request => "/request",
        EnrolLeg::Reply => "/reply",
    };
    let Some((id, nonce)) = topic
        .strip_prefix(ENROL_TOPIC_PREFIX)
        .and_then(|rest| rest.strip_suffix(suffix))
        .and_then(|rest| rest.split_once('/'))
    else {
        return false;
    };
    let asked = enrol_client_id(id, nonce);
    if enrol_client_parts(&asked).is_none() {
        return false;
    }
    match enrol_client_parts(login) {
        Some(_) => login == asked,
        None => token_login_token_id(login) == Some(id),
    }
}

/// The client id an enrolling device uses for token `id`, with its own random `nonce`.
pub fn enrol_client_id(id: &str, nonce: &str) -> String {
    format!("{ENROL_CLIENT_PREFIX}{id}-{nonce}")
}

/// Where the device at `client_id` publishes its request:
/// `propeller/enrol/<token id>/<nonce>/request` (two topic levels, so that a broker whose
/// permissions are per-level patterns, such as NATS, can grant a token its own subtree).
pub fn request_topic(client_id: &str) -> String {
    enrol_topic(client_id, "request")
}

/// Where the answer to `client_id` is published: `propeller/enrol/<token id>/<nonce>/reply`.
pub fn reply_topic(client_id: &str) -> String {
    enrol_topic(client_id, "reply")
}

fn enrol_topic(client_id: &str, leg: &str) -> String {
    match enrol_client_parts(client_id) {
        Some((id, nonce)) => format!("{ENROL_TOPIC_PREFIX}{id}/{nonce}/{leg}"),
        // Not an enrolment client: a topic no login may use.
        None => format!("{ENROL_TOPIC_PREFIX}invalid/{leg}"),
    }
}

/// The client id of a request topic (`propeller/enrol/<token id>/<nonce>/request`).
pub fn request_topic_client(topic: &str) -> Option<String> {
    let rest = topic
        .strip_prefix(ENROL_TOPIC_PREFIX)?
        .strip_suffix("/request")?;
    let (id, nonce) = rest.split_once('/')?;
    let client = enrol_client_id(id, nonce);
    enrol_client_parts(&client).is_some().then_some(client)
}

/// The prefix of the topics that carry a device's rotated key.
pub const KEY_TOPIC_PREFIX: &str = "propeller/keys/";

/// Where propeller sends `client_id` its new key after `propeller rotate`; only that device
/// may subscribe to it.
pub fn key_topic(client_id: &str) -> String {
    format!("{KEY_TOPIC_PREFIX}{client_id}")
}

/// A device's new key, sent over its authenticated session; the old key keeps working until
/// `previous_valid_until`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KeyRotation {
    /// The device's client id.
    pub client_id: String,
    /// The new key.
    pub client_key: String,
    /// When the old key stops working (RFC 3339).
    pub previous_valid_until: String,
}

impl fmt::Debug for KeyRotation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyRotation")
            .field("client_id", &self.client_id)
            .field("client_key", &"<redacted>")
            .field("previous_valid_until", &self.previous_valid_until)
            .finish()
    }
}

/// What a device tells about itself when it enrols.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct EnrolRequest {
    /// A stable id of the machine (`/etc/machine-id`); the same machine enrolling again gets
    /// its existing Proplet with a new key, not a second one.
    pub machine_id: String,
    /// The host name.
    pub hostname: String,
    /// The CPU architecture in Kubernetes' words (`amd64`, `arm64`, `arm`).
    pub arch: String,
    /// The operating system (`linux`).
    pub os: String,
    /// Total memory, bytes.
    #[serde(default)]
    pub memory_bytes: u64,
    /// Logical CPUs.
    #[serde(default)]
    pub cpus: u32,
    /// The agent's version.
    #[serde(default)]
    pub agent_version: String,
    /// The broker address the device enrolled through (kept in its Proplet).
    #[serde(default)]
    pub server: String,
    /// The device's one-time public key the grant is sealed to
    /// ([`super::sealed_grant::ReplyKey`]), base64.
    #[serde(default)]
    pub reply_key: String,
}

/// Reads an enrolment request's payload, bounded by [`MAX_REQUEST_BYTES`]; the error says
/// what is wrong, for the refusal sent back.
pub fn decode_request(payload: &[u8]) -> Result<Box<EnrolRequest>, String> {
    if payload.len() > MAX_REQUEST_BYTES {
        return Err(format!(
            "the request is {} bytes; at most {MAX_REQUEST_BYTES} are accepted",
            payload.len()
        ));
    }
    let request = serde_json::from_slice::<EnrolRequest>(payload).map_err(|e| e.to_string())?;
    super::sealed_grant::check_reply_key(&request.reply_key).map_err(|e| e.to_string())?;
    Ok(Box::new(request))
}

/// The answer to an enrolment request: with the grant in the clear as propeller decides it,
/// and with a [`super::sealed_grant::SealedGrant`] on the wire ([`SealedReply`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum EnrolReply<G = EnrolGrant> {
    /// Enrolled: the credentials to write and use from now on.
    Enrolled(G),
    /// Refused, with the reason to show the user.
    Refused(EnrolRefusal),
}

/// The answer as it crosses the broker: the grant sealed to the asking device.
pub type SealedReply = EnrolReply<super::sealed_grant::SealedGrant>;

/// What an enrolled device needs to connect as itself.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EnrolGrant {
    /// The device's client id (its Proplet's name).
    pub client_id: String,
    /// Its key (the MQTT password).
    pub client_key: String,
    /// The `{domain}` topic level.
    pub domain_id: String,
    /// The `{channel}` topic level.
    pub channel_id: String,
    /// The namespace its Proplet is in.
    pub namespace: String,
    /// Whether this replaced the key of a Proplet the machine had (a re-enrolment).
    #[serde(default)]
    pub rotated: bool,
    /// Whether the Proplet waits for a person's approval before it gets tasks.
    #[serde(default)]
    pub pending_approval: bool,
}

impl fmt::Debug for EnrolGrant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EnrolGrant")
            .field("client_id", &self.client_id)
            .field("client_key", &"<redacted>")
            .field("domain_id", &self.domain_id)
            .field("channel_id", &self.channel_id)
            .field("namespace", &self.namespace)
            .field("rotated", &self.rotated)
            .field("pending_approval", &self.pending_approval)
            .finish()
    }
}

/// A refused enrolment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EnrolRefusal {
    /// The reason, for programs and metrics.
    pub reason: RefusalReason,
    /// What happened and what to do, for the person at the device.
    pub message: String,
}

/// Why an enrolment was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RefusalReason {
    /// The token's time ran out.
    Expired,
    /// The token's uses are spent.
    UsedUp,
    /// No such token (deleted, or never made).
    UnknownToken,
    /// The request could not be read.
    BadRequest,
    /// The token asks for TLS and the device came over plain TCP.
    NeedsTls,
    /// The operator could not store the device (the message says why); try again.
    Unavailable,
}

impl RefusalReason {
    /// A stable label for metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Expired => "expired",
            Self::UsedUp => "used_up",
            Self::UnknownToken => "unknown_token",
            Self::BadRequest => "bad_request",
            Self::NeedsTls => "needs_tls",
            Self::Unavailable => "unavailable",
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn counter() -> impl FnMut(usize) -> usize {
        let mut n = 0;
        move |_| {
            n += 7;
            n
        }
    }

    #[test]
    fn a_token_round_trips_and_never_shows_its_secret() {
        let token = BootstrapToken::generate(counter());
        let text = token.reveal();
        assert_eq!(text.len(), TOKEN_ID_LEN + 1 + TOKEN_SECRET_LEN);
        let parsed: BootstrapToken = text.parse().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(parsed, token);
        let shown = format!("{token:?}");
        assert!(!shown.contains(&text[TOKEN_ID_LEN + 1..]), "{shown}");
        assert!(shown.contains(token.id()));
    }

    #[test]
    fn malformed_tokens_are_refused_with_the_expected_shape() {
        for bad in [
            "",
            "abcdef",
            "abcdef.",
            "ABCDEF.0123456789abcdef",
            "abcde.0123456789abcdef",
            "abcdef.0123456789abcde",
            "abcdef.0123456789abcdeg0",
            "abcdef-0123456789abcdef",
        ] {
            let error = bad.parse::<BootstrapToken>().expect_err(bad);
            assert!(error.to_string().contains("propeller token create"));
        }
        assert!(" abcdef.0123456789abcdef\n"
            .parse::<BootstrapToken>()
            .is_ok());
    }

    #[test]
    fn only_the_right_secret_of_the_right_id_matches_the_digest() {
        let token: BootstrapToken = "abcdef.0123456789abcdef"
            .parse()
            .unwrap_or_else(|e| panic!("{e}"));
        let digest = token.secret_digest();
        assert_eq!(digest.len(), 64);
        assert!(token_matches("abcdef", &digest, "abcdef.0123456789abcdef"));
        assert!(!token_matches("abcdef", &digest, "abcdef.0123456789abcdee"));
        assert!(!token_matches("abcdeg", &digest, "abcdef.0123456789abcdef"));
        assert!(!token_matches("abcdef", &digest, "not a token"));
        assert!(!token_matches("abcdef", "", "abcdef.0123456789abcdef"));
    }

    #[test]
    fn enrolment_client_ids_and_topics_name_the_token() {
        let client = enrol_client_id("abcdef", "n0nce123");
        assert_eq!(enrol_client_token_id(&client), Some("abcdef"));
        assert_eq!(
            request_topic(&client),
            "propeller/enrol/abcdef/n0nce123/request"
        );
        assert_eq!(
            request_topic_client(&request_topic(&client)),
            Some(client.clone())
        );
        assert_eq!(request_topic_client(&reply_topic(&client)), None);
        assert_eq!(enrol_client_token_id("enrol-abcdef-short"), None);
        assert_eq!(enrol_client_token_id("enrol-abcdef-has/slash"), None);
        assert_eq!(enrol_client_token_id("pi-kitchen"), None);
        assert_eq!(
            request_topic_client("propeller/enrol/abcdef/n0nce123/x/request"),
            None
        );
        assert_eq!(token_login_name("abcdef"), "enrol-abcdef");
        assert_eq!(token_login_token_id("enrol-abcdef"), Some("abcdef"));
        assert_eq!(token_login_token_id(&client), None);
        assert_eq!(token_login_token_id("enrol-ABCDEF"), None);
    }

    #[test]
    fn a_login_uses_its_own_exchange_or_with_only_its_username_its_tokens() {
        let mine = "propeller/enrol/abcdef/n0nce123/reply";
        let sibling = "propeller/enrol/abcdef/other123/reply";
        let foreign = "propeller/enrol/zzzzzz/n0nce123/reply";
        let client = "enrol-abcdef-n0nce123";
        assert!(enrol_topic_allowed(client, mine, EnrolLeg::Reply));
        assert!(!enrol_topic_allowed(client, sibling, EnrolLeg::Reply));
        assert!(!enrol_topic_allowed(client, mine, EnrolLeg::Request));
        assert!(enrol_topic_allowed(
            client,
            "propeller/enrol/abcdef/n0nce123/request",
            EnrolLeg::Request
        ));
        assert!(enrol_topic_allowed("enrol-abcdef", mine, EnrolLeg::Reply));
        assert!(enrol_topic_allowed(
            "enrol-abcdef",
            sibling,
            EnrolLeg::Reply
        ));
        assert!(!enrol_topic_allowed(
            "enrol-abcdef",
            foreign,
            EnrolLeg::Reply
        ));
        for bad in [
            "propeller/enrol/abcdef/+/reply",
            "propeller/enrol/abcdef/#",
            "propeller/enrol/abcdef/n0nce123/x/reply",
            "propeller/enrol/abcdef/short/reply",
        ] {
            assert!(
                !enrol_topic_allowed("enrol-abcdef", bad, EnrolLeg::Reply),
                "{bad}"
            );
        }
        assert!(!enrol_topic_allowed("pi-1", mine, EnrolLeg::Reply));
    }

    #[test]
    fn a_request_without_a_reply_key_is_refused_with_what_to_do() {
        let request =
            serde_json::json!({"machineId": "m", "hostname": "h", "arch": "amd64", "os": "linux"});
        let error = decode_request(request.to_string().as_bytes()).expect_err("no reply key");
        assert!(error.contains("update proplet"), "{error}");
        let key = crate::protocol::sealed_grant::ReplyKey::generate();
        let mut with_key = request;
        with_key["replyKey"] = key.public().into();
        let decoded =
            decode_request(with_key.to_string().as_bytes()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(decoded.reply_key, key.public());
    }

    /// A grant for tests, its key `sekrit`.
    pub(crate) fn sample_grant() -> EnrolGrant {
        EnrolGrant {
            client_id: "pi-1".into(),
            client_key: "sekrit".into(),
            domain_id: "d".into(),
            channel_id: "c".into(),
            namespace: "default".into(),
            rotated: false,
            pending_approval: false,
        }
    }

    #[test]
    fn replies_keep_their_wire_shape_and_hide_the_key_from_logs() {
        let grant = EnrolGrant {
            pending_approval: true,
            ..sample_grant()
        };
        let json = serde_json::to_value(EnrolReply::Enrolled(grant.clone()))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(json["enrolled"]["clientKey"], "sekrit");
        assert_eq!(json["enrolled"]["pendingApproval"], true);
        assert!(!format!("{grant:?}").contains("sekrit"));
        let refused: EnrolReply = serde_json::from_value(serde_json::json!(
            {"refused": {"reason": "used-up", "message": "m"}}
        ))
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            refused,
            EnrolReply::Refused(EnrolRefusal {
                reason: RefusalReason::UsedUp,
                message: "m".into()
            })
        );
    }
}
