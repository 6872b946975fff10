//! Propeller's encrypted-module format: a Wasm module or component sealed with AES-256-GCM
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
//! the tag like a changed ciphertext. `propeller encrypt` writes this format; the agent reads
//! it.

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use zeroize::Zeroizing;

/// The first bytes of every encrypted module.
pub const MAGIC: [u8; 8] = *b"\0pwenc\r\n";
/// The only format version: AES-256-GCM.
pub const VERSION_AES_256_GCM: u8 = 1;
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
    #[error("encrypted-module format version {0} is not known to this proplet (it reads version 1); update proplet")]
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
        sealed[MAGIC.len()] = 2;
        assert_eq!(
            open(&key, &sealed),
            Err(ModuleCryptoError::UnknownVersion(2))
        );
    }
}
