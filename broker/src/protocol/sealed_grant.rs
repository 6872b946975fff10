//! The enrolment grant sealed to the asking device: the device sends a one-time X25519
//! public key with its request ([`ReplyKey`]), and propeller encrypts the grant, which carries
//! the device's new key, to it with HPKE (RFC 9180: X25519, HKDF-SHA256, ChaCha20-Poly1305),
//! bound to the device's enrolment client id.
//!
//! On brokers that bind the reply topic to the asking login (the embedded broker, RabbitMQ and
//! EMQX through the callbacks) this is a second lock; on a broker whose permissions can only
//! be per token (NATS, whose users are fixed names), it is the lock: another holder of the
//! same token may see the reply, but cannot read it.

use std::fmt;

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use hpke::aead::ChaCha20Poly1305;
use hpke::kdf::HkdfSha256;
use hpke::kem::X25519HkdfSha256;
use hpke::{Deserializable, Kem, OpModeR, OpModeS, Serializable};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// HPKE's `info`: names this use, so a sealed grant means nothing elsewhere.
const INFO: &[u8] = b"propeller enrolment grant v1";

type ReplyKem = X25519HkdfSha256;

/// Why a grant could not be sealed or opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    /// The device's reply key is not a base64 X25519 public key.
    #[error("replyKey is not a base64 X25519 public key (32 bytes): update proplet")]
    BadReplyKey,
    /// The sealed grant is not base64, or does not open with this key and client id.
    #[error(
        "the grant does not open with this device's reply key (it was sealed for another request)"
    )]
    DoesNotOpen,
    /// Encryption failed.
    #[error("sealing the grant: {0}")]
    Seal(String),
}

/// A grant encrypted to one device's reply key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SealedGrant {
    /// HPKE's encapsulated key, base64.
    pub encapsulated_key: String,
    /// The grant as JSON, encrypted, base64.
    pub ciphertext: String,
}

/// A device's one-time key pair for the answer to one enrolment request.
pub struct ReplyKey {
    private: <ReplyKem as Kem>::PrivateKey,
    public: String,
}

impl ReplyKey {
    /// A fresh key pair from the operating system's random source.
    pub fn generate() -> Self {
        let (private, public) = ReplyKem::gen_keypair(&mut rand::rng());
        Self {
            private,
            public: BASE64.encode(public.to_bytes()),
        }
    }

    /// The public half, base64, for the request's `replyKey`.
    pub fn public(&self) -> &str {
        &self.public
    }

    /// Opens the grant sealed for `client_id` (the login that asked).
    pub fn open<G: DeserializeOwned>(
        &self,
        sealed: &SealedGrant,
        client_id: &str,
    ) -> Result<G, SealError> {
        let decode = |text: &str| BASE64.decode(text).map_err(|_| SealError::DoesNotOpen);
        let encapsulated =
            <ReplyKem as Kem>::EncappedKey::from_bytes(&decode(&sealed.encapsulated_key)?)
                .map_err(|_| SealError::DoesNotOpen)?;
        let plain = hpke::single_shot_open::<ChaCha20Poly1305, HkdfSha256, ReplyKem>(
            &OpModeR::Base,
            &self.private,
            &encapsulated,
            INFO,
            &decode(&sealed.ciphertext)?,
            client_id.as_bytes(),
        )
        .map_err(|_| SealError::DoesNotOpen)?;
        serde_json::from_slice(&plain).map_err(|_| SealError::DoesNotOpen)
    }
}

impl fmt::Debug for ReplyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ReplyKey({})", self.public)
    }
}

/// Checks that `reply_key` is a base64 X25519 public key.
pub fn check_reply_key(reply_key: &str) -> Result<(), SealError> {
    public_key(reply_key).map(|_| ())
}

fn public_key(reply_key: &str) -> Result<<ReplyKem as Kem>::PublicKey, SealError> {
    let bytes = BASE64
        .decode(reply_key)
        .map_err(|_| SealError::BadReplyKey)?;
    <ReplyKem as Kem>::PublicKey::from_bytes(&bytes).map_err(|_| SealError::BadReplyKey)
}

/// Seals `grant` (the enrolment grant, [`super::enrolment::EnrolGrant`]) to the device that
/// sent `reply_key` from the login `client_id`.
pub fn seal_grant<G: Serialize>(
    grant: &G,
    reply_key: &str,
    client_id: &str,
) -> Result<SealedGrant, SealError> {
    let recipient = public_key(reply_key)?;
    let plain = serde_json::to_vec(grant).map_err(|e| SealError::Seal(e.to_string()))?;
    let (encapsulated, ciphertext) =
        hpke::single_shot_seal::<ChaCha20Poly1305, HkdfSha256, ReplyKem, _>(
            &OpModeS::Base,
            &recipient,
            INFO,
            &plain,
            client_id.as_bytes(),
            &mut rand::rng(),
        )
        .map_err(|e| SealError::Seal(e.to_string()))?;
    Ok(SealedGrant {
        encapsulated_key: BASE64.encode(encapsulated.to_bytes()),
        ciphertext: BASE64.encode(ciphertext),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::protocol::enrolment::tests::sample_grant as grant;
    use crate::protocol::enrolment::EnrolGrant;

    #[test]
    fn only_the_asking_device_opens_its_grant() {
        let mine = ReplyKey::generate();
        let other = ReplyKey::generate();
        let client = "enrol-abcdef-n0nce123";
        let sealed = seal_grant(&grant(), mine.public(), client).unwrap_or_else(|e| panic!("{e}"));
        let text = serde_json::to_string(&sealed).unwrap_or_else(|e| panic!("{e}"));
        assert!(!text.contains("sekrit"), "{text}");
        assert_eq!(mine.open::<EnrolGrant>(&sealed, client), Ok(grant()));
        assert_eq!(
            other.open::<EnrolGrant>(&sealed, client),
            Err(SealError::DoesNotOpen)
        );
        assert_eq!(
            mine.open::<EnrolGrant>(&sealed, "enrol-abcdef-other123"),
            Err(SealError::DoesNotOpen),
            "a grant sealed for one login does not open as another's"
        );
        let mut tampered = sealed.clone();
        let mut bytes = BASE64
            .decode(&sealed.ciphertext)
            .unwrap_or_else(|e| panic!("{e}"));
        bytes[0] ^= 1;
        tampered.ciphertext = BASE64.encode(bytes);
        assert_eq!(
            mine.open::<EnrolGrant>(&tampered, client),
            Err(SealError::DoesNotOpen)
        );
        assert!(!format!("{mine:?}").is_empty());
    }

    #[test]
    fn a_reply_key_that_is_not_a_public_key_is_refused_with_what_to_do() {
        for bad in ["", "not base64!", "AAAA"] {
            let error = check_reply_key(bad).expect_err(bad);
            assert!(error.to_string().contains("update proplet"), "{error}");
            assert!(seal_grant(&grant(), bad, "c").is_err());
        }
        assert_eq!(check_reply_key(ReplyKey::generate().public()), Ok(()));
    }
}
