//! The device's ephemeral "TEE key" of one KBS exchange, and the JWE the KBS wraps the
//! resource in for it: ECDH-ES+A256KW (P-256, Concat KDF with SHA-256, AES key wrap) around
//! an A256GCM content key (RFC 7516, 7518).

use base64::engine::general_purpose::URL_SAFE_NO_PAD as BASE64URL;
use base64::Engine;
use kbs_types::TeePubKey;
use ring::agreement::{self, EphemeralPrivateKey, UnparsedPublicKey, ECDH_P256};
use ring::rand::SystemRandom;
use serde::Deserialize;
use zeroize::Zeroizing;

use super::KbsError;

/// The only key management algorithm this key takes.
pub const KEY_ALG: &str = "ECDH-ES+A256KW";
const CONTENT_ALG: &str = "A256GCM";

/// A P-256 key made for one exchange; its private half is used once, to open the answer.
pub struct TeeKey {
    private: EphemeralPrivateKey,
    /// The public point, uncompressed: 0x04 ‖ x ‖ y.
    public: Vec<u8>,
}

/// A flattened JWE as the KBS sends it.
#[derive(Deserialize)]
struct Jwe {
    protected: String,
    encrypted_key: String,
    iv: String,
    ciphertext: String,
    tag: String,
    #[serde(default)]
    aad: Option<String>,
}

#[derive(Deserialize)]
struct Header {
    alg: String,
    enc: String,
    epk: Option<Epk>,
}

#[derive(Deserialize)]
struct Epk {
    crv: String,
    x: String,
    y: String,
}

fn bad(what: impl Into<String>) -> KbsError {
    KbsError::Protocol(what.into())
}

fn field(name: &str, text: &str) -> Result<Vec<u8>, KbsError> {
    BASE64URL
        .decode(text)
        .map_err(|_| bad(format!("the key's JWE field `{name}` is not base64url")))
}

impl TeeKey {
    /// A fresh key pair.
    pub fn generate() -> Result<Self, KbsError> {
        let private = EphemeralPrivateKey::generate(&ECDH_P256, &SystemRandom::new())
            .map_err(|_| bad("cannot make an ephemeral P-256 key"))?;
        let public = private
            .compute_public_key()
            .map_err(|_| bad("cannot compute the ephemeral public key"))?
            .as_ref()
            .to_vec();
        Ok(Self { private, public })
    }

    /// The public half as the KBS takes it (a JWK).
    pub fn public_jwk(&self) -> TeePubKey {
        TeePubKey::EC {
            crv: "P-256".into(),
            alg: KEY_ALG.into(),
            x: BASE64URL.encode(&self.public[1..33]),
            y: BASE64URL.encode(&self.public[33..65]),
        }
    }

    /// Opens the KBS's answer (`body`, a flattened JWE made for this key).
    pub fn open(self, body: &[u8]) -> Result<Zeroizing<Vec<u8>>, KbsError> {
        let jwe: Jwe = serde_json::from_slice(body)
            .map_err(|e| bad(format!("the resource is not a JWE: {e}")))?;
        let header: Header = serde_json::from_slice(&field("protected", &jwe.protected)?)
            .map_err(|e| bad(format!("the JWE's protected header: {e}")))?;
        if header.alg != KEY_ALG || header.enc != CONTENT_ALG {
            return Err(bad(format!(
                "the KBS wrapped the key with {}/{}; this proplet asked for {KEY_ALG}/{CONTENT_ALG}",
                header.alg, header.enc
            )));
        }
        let epk = header
            .epk
            .ok_or_else(|| bad("the JWE's header has no `epk`"))?;
        if epk.crv != "P-256" {
            return Err(bad(format!("the JWE's `epk` is on curve {}", epk.crv)));
        }
        let mut peer = vec![4u8];
        peer.extend(field("epk.x", &epk.x)?);
        peer.extend(field("epk.y", &epk.y)?);
        let kek = agreement::agree_ephemeral(
            self.private,
            &UnparsedPublicKey::new(&ECDH_P256, &peer),
            key_encryption_key,
        )
        .map_err(|_| bad("the JWE's `epk` is not a P-256 point"))??;
        let wrapped = field("encrypted_key", &jwe.encrypted_key)?;
        let content_key = Zeroizing::new(
            aes_kw::KekAes256::from(*kek)
                .unwrap_vec(&wrapped)
                .map_err(|_| bad("the content key does not unwrap with this exchange's key"))?,
        );
        // RFC 7516 §5.2: the protected header as sent, then `.aad` when there is one.
        let mut aad = jwe.protected.clone().into_bytes();
        if let Some(extra) = &jwe.aad {
            aad.push(b'.');
            aad.extend_from_slice(extra.as_bytes());
        }
        let iv: [u8; 12] = field("iv", &jwe.iv)?
            .try_into()
            .map_err(|_| bad("the JWE's `iv` is not 12 bytes"))?;
        let mut sealed = Zeroizing::new(field("ciphertext", &jwe.ciphertext)?);
        sealed.extend(field("tag", &jwe.tag)?);
        let key = ring::aead::UnboundKey::new(&ring::aead::AES_256_GCM, &content_key)
            .map_err(|_| bad("the content key is not 32 bytes"))?;
        let plain = ring::aead::LessSafeKey::new(key)
            .open_in_place(
                ring::aead::Nonce::assume_unique_for_key(iv),
                ring::aead::Aad::from(&aad),
                sealed.as_mut_slice(),
            )
            .map_err(|_| bad("the resource does not decrypt (JWE authentication tag mismatch)"))?;
        Ok(Zeroizing::new(plain.to_vec()))
    }
}

/// The AES-256 key-wrapping key from the shared secret `z`: Concat KDF (NIST SP 800-56A)
/// with SHA-256, AlgorithmID = the `alg`, empty PartyUInfo and PartyVInfo, 256 bits.
fn key_encryption_key(z: &[u8]) -> Result<Zeroizing<[u8; 32]>, KbsError> {
    let mut other_info = Vec::new();
    other_info.extend_from_slice(&(KEY_ALG.len() as u32).to_be_bytes());
    other_info.extend_from_slice(KEY_ALG.as_bytes());
    other_info.extend_from_slice(&0u32.to_be_bytes());
    other_info.extend_from_slice(&0u32.to_be_bytes());
    other_info.extend_from_slice(&256u32.to_be_bytes());
    let mut kek = Zeroizing::new([0u8; 32]);
    concat_kdf::derive_key_into::<sha2::Sha256>(z, &other_info, kek.as_mut_slice())
        .map_err(|_| bad("the key derivation failed"))?;
    Ok(kek)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_public_key_is_a_p256_jwk() {
        let key = TeeKey::generate().unwrap();
        let jwk = serde_json::to_value(key.public_jwk()).unwrap();
        assert_eq!(jwk["kty"], "EC");
        assert_eq!(jwk["crv"], "P-256");
        assert_eq!(jwk["alg"], KEY_ALG);
        for coordinate in ["x", "y"] {
            let bytes = BASE64URL.decode(jwk[coordinate].as_str().unwrap()).unwrap();
            assert_eq!(bytes.len(), 32, "{coordinate}");
        }
    }

    #[test]
    fn an_answer_in_another_scheme_is_refused_by_name() {
        let header = BASE64URL.encode(br#"{"alg":"RSA-OAEP-256","enc":"A256GCM"}"#);
        let body = format!(
            r#"{{"protected":"{header}","encrypted_key":"","iv":"","ciphertext":"","tag":""}}"#
        );
        let error = TeeKey::generate()
            .unwrap()
            .open(body.as_bytes())
            .err()
            .unwrap();
        assert!(error.to_string().contains("RSA-OAEP-256"), "{error}");
        let error = TeeKey::generate().unwrap().open(b"<html>").err().unwrap();
        assert!(error.to_string().contains("not a JWE"), "{error}");
    }
}
