//! Encrypted modules as devices receive them, in one of two versions after a common magic.
//!
//! Version 1 is propeller's own format: a Wasm module or component sealed with AES-256-GCM
//! under a 32-byte key that a Key Broker Service releases only to devices that pass
//! attestation (the task's `kbsResourcePath`).
//!
//! ```text
//! offset  size  field
//! 0       8     magic "\0pwenc\r\n" (a Wasm binary starts "\0asm": the two never mix up)
//! 8       1     format version, 1 = AES-256-GCM
//! 9       12    nonce (random per encryption)
//! 21      n     ciphertext
//! 21+n    16    authentication tag
//! ```
//!
//! The 21-byte header is the additional authenticated data: a changed version or nonce fails
//! the tag like a changed ciphertext. `propeller encrypt` writes this format.
//!
//! Version 2 carries an OCI layer encrypted by ocicrypt (Confidential Containers' tools) as
//! the registry holds it, with what its manifest says of it: propeller frames it, the agent
//! unwraps its key and decrypts it.
//!
//! ```text
//! 0       8     magic
//! 8       1     format version, 2 = ocicrypt layer
//! 9       4     m, the descriptor's length (big-endian)
//! 13      m     the layer's descriptor: JSON {"mediaType": …, "annotations": {…}}
//! 13+m    n     the encrypted layer
//! ```

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use zeroize::Zeroizing;

/// The first bytes of every encrypted module.
pub const MAGIC: [u8; 8] = *b"\0pwenc\r\n";
/// Format version 1: propeller's AES-256-GCM module.
pub const VERSION_AES_256_GCM: u8 = 1;
/// Format version 2: an ocicrypt-encrypted OCI layer with its descriptor.
pub const VERSION_OCICRYPT_LAYER: u8 = 2;
/// The key length the format needs.
pub const KEY_LEN: usize = 32;
const NONCE_LEN: usize = 12;
const TAG_LEN: usize = 16;
const HEADER_LEN: usize = MAGIC.len() + 1 + NONCE_LEN;

/// Why a module could not be sealed or opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModuleCryptoError {
    /// The key is not 32 bytes.
    #[error("the key is {0} bytes; an encrypted module needs a 32-byte (AES-256) key")]
    KeyLength(usize),
    /// The bytes do not start with the format's magic.
    #[error("the module is not encrypted (it lacks the encrypted-module header); encrypt it with `propeller encrypt`, or drop `encrypted: true` from the task")]
    NotEncrypted,
    /// A version this build does not read.
    #[error("encrypted-module format version {0} is not known to this proplet (it reads versions 1 and 2); update proplet")]
    UnknownVersion(u8),
    /// Shorter than a header and a tag.
    #[error("the encrypted module is truncated ({0} bytes)")]
    Truncated(usize),
    /// Beyond what AES-GCM seals under one nonce.
    #[error("the module is too large to encrypt ({0} bytes)")]
    TooLarge(usize),
    /// The tag does not match: another key, or altered bytes.
    #[error("the module does not decrypt with the key from the Key Broker Service (authentication tag mismatch): the key at kbsResourcePath is not the one it was encrypted with, or the module was altered")]
    WrongKey,
    /// A version 2 descriptor that is not the JSON propeller writes.
    #[error("the encrypted layer's descriptor is damaged: {0}")]
    BadDescriptor(String),
}

/// What an OCI manifest says of an encrypted layer: enough for a device to decrypt it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LayerDescriptor {
    /// The layer's media type, e.g. `application/vnd.oci.image.layer.v1.tar+gzip+encrypted`.
    pub media_type: String,
    /// The layer's annotations, where ocicrypt puts the wrapped keys and cipher options.
    #[serde(default)]
    pub annotations: std::collections::BTreeMap<String, String>,
}

/// An encrypted module taken apart by version.
#[derive(Debug, PartialEq, Eq)]
pub enum EncryptedModule<'a> {
    /// Version 1, to [`open`] with the key at the task's `kbsResourcePath`.
    Sealed(&'a [u8]),
    /// Version 2: an ocicrypt layer and its descriptor.
    OcicryptLayer {
        /// The media type and annotations from the manifest.
        descriptor: LayerDescriptor,
        /// The layer's bytes as the registry holds them.
        layer: &'a [u8],
    },
}

/// Frames an ocicrypt-encrypted layer with its descriptor (version 2).
pub fn frame_ocicrypt_layer(descriptor: &LayerDescriptor, layer: &[u8]) -> Vec<u8> {
    let json = serde_json::to_vec(descriptor).unwrap_or_default();
    let mut framed = Vec::with_capacity(MAGIC.len() + 5 + json.len() + layer.len());
    framed.extend_from_slice(&MAGIC);
    framed.push(VERSION_OCICRYPT_LAYER);
    framed.extend_from_slice(&u32::try_from(json.len()).unwrap_or(u32::MAX).to_be_bytes());
    framed.extend_from_slice(&json);
    framed.extend_from_slice(layer);
    framed
}

/// Reads the version of an encrypted module and, for version 2, its descriptor.
pub fn parse(bytes: &[u8]) -> Result<EncryptedModule<'_>, ModuleCryptoError> {
    if !is_encrypted(bytes) {
        return Err(ModuleCryptoError::NotEncrypted);
    }
    match bytes.get(MAGIC.len()).copied() {
        Some(VERSION_AES_256_GCM) => Ok(EncryptedModule::Sealed(bytes)),
        Some(VERSION_OCICRYPT_LAYER) => {
            let rest = &bytes[MAGIC.len() + 1..];
            let (len, rest) = rest
                .split_first_chunk::<4>()
                .ok_or(ModuleCryptoError::Truncated(bytes.len()))?;
            let len = usize::try_from(u32::from_be_bytes(*len)).unwrap_or(usize::MAX);
            if rest.len() < len {
                return Err(ModuleCryptoError::Truncated(bytes.len()));
            }
            let (json, layer) = rest.split_at(len);
            let descriptor = serde_json::from_slice(json)
                .map_err(|e| ModuleCryptoError::BadDescriptor(e.to_string()))?;
            Ok(EncryptedModule::OcicryptLayer { descriptor, layer })
        }
        Some(other) => Err(ModuleCryptoError::UnknownVersion(other)),
        None => Err(ModuleCryptoError::Truncated(bytes.len())),
    }
}

/// Whether `bytes` start like an encrypted module.
pub fn is_encrypted(bytes: &[u8]) -> bool {
    bytes.starts_with(&MAGIC)
}

fn cipher(key: &[u8]) -> Result<Aes256Gcm, ModuleCryptoError> {
    Aes256Gcm::new_from_slice(key).map_err(|_| ModuleCryptoError::KeyLength(key.len()))
}

/// Seals `module` under `key` with a fresh random nonce.
pub fn seal(key: &[u8], module: &[u8]) -> Result<Vec<u8>, ModuleCryptoError> {
    let cipher = cipher(key)?;
    let nonce: [u8; NONCE_LEN] = rand::random();
    let mut header = Vec::with_capacity(HEADER_LEN + module.len() + TAG_LEN);
    header.extend_from_slice(&MAGIC);
    header.push(VERSION_AES_256_GCM);
    header.extend_from_slice(&nonce);
    let sealed = cipher
        .encrypt(
            Nonce::from_slice(&nonce),
            Payload {
                msg: module,
                aad: &header,
            },
        )
        .map_err(|_| ModuleCryptoError::TooLarge(module.len()))?;
    header.extend_from_slice(&sealed);
    Ok(header)
}

/// Opens an encrypted module with `key`; the plaintext is wiped from memory when dropped.
pub fn open(key: &[u8], sealed: &[u8]) -> Result<Zeroizing<Vec<u8>>, ModuleCryptoError> {
    if !is_encrypted(sealed) {
        return Err(ModuleCryptoError::NotEncrypted);
    }
    if sealed.len() < HEADER_LEN + TAG_LEN {
        return Err(ModuleCryptoError::Truncated(sealed.len()));
    }
    let version = sealed[MAGIC.len()];
    if version != VERSION_AES_256_GCM {
        return Err(ModuleCryptoError::UnknownVersion(version));
    }
    let cipher = cipher(key)?;
    let (header, body) = sealed.split_at(HEADER_LEN);
    let nonce = &header[MAGIC.len() + 1..];
    cipher
        .decrypt(
            Nonce::from_slice(nonce),
            Payload {
                msg: body,
                aad: header,
            },
        )
        .map(Zeroizing::new)
        .map_err(|_| ModuleCryptoError::WrongKey)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODULE: &[u8] = b"\0asm\x01\0\0\0 a module";

    #[test]
    fn a_sealed_module_opens_with_its_key_only() {
        let key = [7u8; 32];
        let sealed = seal(&key, MODULE).unwrap();
        assert!(is_encrypted(&sealed) && !is_encrypted(MODULE));
        assert_eq!(sealed.len(), HEADER_LEN + MODULE.len() + TAG_LEN);
        assert_eq!(open(&key, &sealed).unwrap().as_slice(), MODULE);
        assert_eq!(open(&[8u8; 32], &sealed), Err(ModuleCryptoError::WrongKey));
        // Two seals of one module differ (fresh nonces).
        assert_ne!(seal(&key, MODULE).unwrap(), sealed);
    }

    #[test]
    fn every_altered_byte_fails_the_tag() {
        let key = [7u8; 32];
        let sealed = seal(&key, MODULE).unwrap();
        for i in MAGIC.len() + 1..sealed.len() {
            let mut altered = sealed.clone();
            altered[i] ^= 1;
            assert_eq!(
                open(&key, &altered),
                Err(ModuleCryptoError::WrongKey),
                "{i}"
            );
        }
    }

    #[test]
    fn bad_inputs_are_named() {
        let key = [7u8; 32];
        assert_eq!(open(&key, MODULE), Err(ModuleCryptoError::NotEncrypted));
        assert_eq!(
            seal(&[1u8; 16], MODULE),
            Err(ModuleCryptoError::KeyLength(16))
        );
        let mut sealed = seal(&key, MODULE).unwrap();
        assert_eq!(
            open(&key, &sealed[..HEADER_LEN + 3]),
            Err(ModuleCryptoError::Truncated(HEADER_LEN + 3))
        );
        sealed[MAGIC.len()] = 3;
        assert_eq!(
            open(&key, &sealed),
            Err(ModuleCryptoError::UnknownVersion(3))
        );
        assert_eq!(parse(&sealed), Err(ModuleCryptoError::UnknownVersion(3)));
    }

    #[test]
    fn an_ocicrypt_layer_travels_with_its_descriptor() {
        let descriptor = LayerDescriptor {
            media_type: "application/vnd.oci.image.layer.v1.tar+gzip+encrypted".into(),
            annotations: [("org.opencontainers.image.enc.pubopts".into(), "e30=".into())].into(),
        };
        let framed = frame_ocicrypt_layer(&descriptor, b"ciphertext");
        assert!(is_encrypted(&framed));
        assert_eq!(
            parse(&framed),
            Ok(EncryptedModule::OcicryptLayer {
                descriptor: descriptor.clone(),
                layer: b"ciphertext"
            })
        );
        assert!(matches!(
            parse(&framed[..framed.len() - 11]),
            Err(ModuleCryptoError::Truncated(_))
        ));
        assert!(matches!(
            parse(&framed[..12]),
            Err(ModuleCryptoError::Truncated(_))
        ));
        let key = [7u8; 32];
        let sealed = seal(&key, MODULE).unwrap();
        assert_eq!(parse(&sealed), Ok(EncryptedModule::Sealed(&sealed)));
        assert_eq!(parse(MODULE), Err(ModuleCryptoError::NotEncrypted));
    }
}
