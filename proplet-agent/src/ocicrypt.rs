//! Layers encrypted by ocicrypt with the `attestation-agent` key provider, the format
//! Confidential Containers' tools (`skopeo copy --encryption-key provider:attestation-agent:…`
//! with `coco_keyprovider`) give an image: read in memory, never written anywhere.
//!
//! - The layer's annotation `org.opencontainers.image.enc.keys.provider.attestation-agent`
//!   holds, base64, a key packet: `{"kid": "kbs:///REPO/TYPE/TAG", "wrapped_data", "iv",
//!   "wrap_type": "A256GCM"}`. `kid` names the key-encryption key in the Key Broker Service.
//! - `wrapped_data` opened with that key (AES-256-GCM, or AES-256-CTR) is the layer's private
//!   options: `{"symkey", "digest", "cipheroptions": {"nonce"}}`.
//! - The layer is AES-256-CTR under `symkey` and `nonce`; the public options (annotation
//!   `org.opencontainers.image.enc.pubopts`) hold an HMAC-SHA256 of the ciphertext under the
//!   same key, checked before anything is decrypted.
//! - The plaintext is the layer ocicrypt was given: a tar (gzip-compressed when the media type
//!   says `+gzip`) whose one `.wasm` file is the module.

use std::collections::BTreeMap;
use std::io::Read;

use aes_gcm::aead::{Aead, KeyInit};
use aes_gcm::{Aes256Gcm, Nonce};
use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use ctr::cipher::{KeyIvInit, StreamCipher};
use hmac::{Hmac, Mac};
use propeller_broker::protocol::encrypted_module::LayerDescriptor;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

/// The annotation holding the key packets of the `attestation-agent` key provider.
pub const KEY_PROVIDER_ANNOTATION: &str =
    "org.opencontainers.image.enc.keys.provider.attestation-agent";
/// The annotation holding the layer cipher's public options.
pub const PUBLIC_OPTIONS_ANNOTATION: &str = "org.opencontainers.image.enc.pubopts";
/// The prefix of every annotation that wraps a layer key (one per key provider or scheme).
const KEYS_ANNOTATION_PREFIX: &str = "org.opencontainers.image.enc.keys.";
/// The only layer cipher ocicrypt defines.
const LAYER_CIPHER: &str = "AES_256_CTR_HMAC_SHA256";
/// The most a layer may inflate to (a compressed tar is opened in memory).
pub const MAX_PLAINTEXT_BYTES: u64 = 512 << 20;

/// Why an ocicrypt layer could not be read. Each names its cause for the task's error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OcicryptError {
    /// No key packet of the `attestation-agent` provider.
    #[error("the layer's key is not wrapped for the attestation-agent key provider (its key annotations: {0}); encrypt it with `provider:attestation-agent` (coco_keyprovider)")]
    NoKeyPacket(String),
    /// An annotation that is not what ocicrypt writes.
    #[error("the layer's {what} is malformed: {reason}")]
    Malformed {
        /// Which annotation or field.
        what: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A `kid` that is not a KBS resource URI.
    #[error("the layer's key id {0:?} is not a KBS resource URI (kbs:///REPOSITORY/TYPE/TAG)")]
    BadKeyId(String),
    /// The key-encryption key does not open the wrapped key.
    #[error("the layer's key does not unwrap with the key from the Key Broker Service at {0} (authentication tag mismatch): that resource is not the key the image was encrypted with")]
    WrongKey(String),
    /// A cipher this proplet does not implement.
    #[error("the layer is encrypted with {0}; this proplet reads {LAYER_CIPHER}")]
    UnknownCipher(String),
    /// The HMAC over the ciphertext does not match.
    #[error("the encrypted layer was altered (its HMAC does not match)")]
    Altered,
    /// The decrypted layer is not the one the private options name.
    #[error("the decrypted layer's digest is {found}, not {expected}")]
    DigestMismatch {
        /// From the private options.
        expected: String,
        /// Of the plaintext.
        found: String,
    },
    /// The decrypted layer holds no single Wasm file.
    #[error("the decrypted layer {0}")]
    NoModule(String),
}

/// A wrapped layer key, as the `attestation-agent` key provider writes it.
#[derive(Debug, Deserialize)]
pub struct KeyPacket {
    /// The KBS resource URI of the key-encryption key.
    pub kid: String,
    wrapped_data: String,
    iv: String,
    #[serde(default)]
    wrap_type: String,
}

impl KeyPacket {
    /// The `REPOSITORY/TYPE/TAG` of the key-encryption key in the Key Broker Service.
    pub fn resource_path(&self) -> Result<String, OcicryptError> {
        let bad = || OcicryptError::BadKeyId(self.kid.clone());
        // kbs:///R/T/G, kbs://HOST/R/T/G, HOST/R/T/G or /R/T/G: the last three segments.
        let rest = self.kid.strip_prefix("kbs://").unwrap_or(&self.kid);
        let segments: Vec<&str> = rest.split('/').collect();
        match segments.as_slice() {
            [.., repository, kind, tag]
                if [repository, kind, tag].iter().all(|s| !s.is_empty()) =>
            {
                Ok(format!("{repository}/{kind}/{tag}"))
            }
            _ => Err(bad()),
        }
    }
}

/// The first key packet of the `attestation-agent` provider in `descriptor`.
pub fn key_packet(descriptor: &LayerDescriptor) -> Result<KeyPacket, OcicryptError> {
    let Some(packets) = descriptor.annotations.get(KEY_PROVIDER_ANNOTATION) else {
        let others: Vec<&str> = descriptor
            .annotations
            .keys()
            .filter_map(|k| k.strip_prefix(KEYS_ANNOTATION_PREFIX))
            .collect();
        return Err(OcicryptError::NoKeyPacket(if others.is_empty() {
            "none".into()
        } else {
            others.join(", ")
        }));
    };
    let first = packets.split(',').next().unwrap_or_default();
    let json = decode("key packet", first)?;
    serde_json::from_slice(&json).map_err(|e| OcicryptError::Malformed {
        what: "key packet",
        reason: e.to_string(),
    })
}

#[derive(Deserialize)]
struct PrivateOptions {
    symkey: String,
    #[serde(default)]
    digest: String,
    cipheroptions: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct PublicOptions {
    cipher: String,
    hmac: String,
}

/// The Wasm module in an ocicrypt `layer`, decrypted with the key-encryption key `kek` the
/// Key Broker Service released at `packet`'s resource path.
pub fn decrypt_module(
    descriptor: &LayerDescriptor,
    packet: &KeyPacket,
    kek: &[u8],
    layer: &[u8],
) -> Result<Zeroizing<Vec<u8>>, OcicryptError> {
    let private = unwrap_private_options(packet, kek)?;
    let options: PrivateOptions =
        serde_json::from_slice(&private).map_err(|e| OcicryptError::Malformed {
            what: "private options",
            reason: e.to_string(),
        })?;
    let symkey = Zeroizing::new(decode("symkey", &options.symkey)?);
    let public = public_options(descriptor)?;
    if public.cipher != LAYER_CIPHER {
        return Err(OcicryptError::UnknownCipher(public.cipher));
    }
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(&symkey).map_err(|e| malformed("symkey", e))?;
    mac.update(layer);
    mac.verify_slice(&decode("HMAC", &public.hmac)?)
        .map_err(|_| OcicryptError::Altered)?;
    let nonce = decode(
        "nonce",
        options
            .cipheroptions
            .get("nonce")
            .map_or("", String::as_str),
    )?;
    let mut cipher = ctr::Ctr128BE::<aes::Aes256>::new_from_slices(&symkey, &nonce)
        .map_err(|e| malformed("symkey or nonce", e))?;
    let mut plain = Zeroizing::new(layer.to_vec());
    cipher.apply_keystream(&mut plain);
    if !options.digest.is_empty() {
        let found = format!("sha256:{:x}", Sha256::digest(plain.as_slice()));
        if found != options.digest {
            return Err(OcicryptError::DigestMismatch {
                expected: options.digest,
                found,
            });
        }
    }
    module_of_layer(&descriptor.media_type, plain)
}

fn unwrap_private_options(
    packet: &KeyPacket,
    kek: &[u8],
) -> Result<Zeroizing<Vec<u8>>, OcicryptError> {
    let wrapped = decode("wrapped key", &packet.wrapped_data)?;
    let iv = decode("key packet's iv", &packet.iv)?;
    let path = packet.resource_path()?;
    match packet.wrap_type.as_str() {
        "A256GCM" | "" => {
            if iv.len() != 12 {
                return Err(malformed("key packet's iv", "not 12 bytes"));
            }
            let cipher = Aes256Gcm::new_from_slice(kek)
                .map_err(|_| malformed("key from the Key Broker Service", "not 32 bytes"))?;
            cipher
                .decrypt(Nonce::from_slice(&iv), wrapped.as_slice())
                .map(Zeroizing::new)
                .map_err(|_| OcicryptError::WrongKey(path))
        }
        // No authentication: a wrong key shows as private options that do not parse.
        "A256CTR" => {
            let mut cipher = ctr::Ctr128BE::<aes::Aes256>::new_from_slices(kek, &iv)
                .map_err(|e| malformed("key or iv", e))?;
            let mut plain = Zeroizing::new(wrapped);
            cipher.apply_keystream(&mut plain);
            if serde_json::from_slice::<serde::de::IgnoredAny>(&plain).is_err() {
                return Err(OcicryptError::WrongKey(path));
            }
            Ok(plain)
        }
        other => Err(malformed(
            "key packet's wrap_type",
            format!("{other:?} (A256GCM or A256CTR)"),
        )),
    }
}

fn public_options(descriptor: &LayerDescriptor) -> Result<PublicOptions, OcicryptError> {
    let encoded = descriptor
        .annotations
        .get(PUBLIC_OPTIONS_ANNOTATION)
        .ok_or_else(|| malformed("public options", "the annotation is missing"))?;
    serde_json::from_slice(&decode("public options", encoded)?)
        .map_err(|e| malformed("public options", e))
}

/// The one `.wasm` file of a decrypted layer (or the layer itself when it is a Wasm binary).
fn module_of_layer(
    media_type: &str,
    plain: Zeroizing<Vec<u8>>,
) -> Result<Zeroizing<Vec<u8>>, OcicryptError> {
    if plain.starts_with(b"\0asm") {
        return Ok(plain);
    }
    let base = media_type.strip_suffix("+encrypted").unwrap_or(media_type);
    let tar = if base.ends_with("+gzip") || plain.starts_with(&[0x1f, 0x8b]) {
        let mut inflated = Zeroizing::new(Vec::new());
        flate2::read::GzDecoder::new(plain.as_slice())
            .take(MAX_PLAINTEXT_BYTES + 1)
            .read_to_end(&mut inflated)
            .map_err(|e| OcicryptError::NoModule(format!("is not gzip data ({e})")))?;
        if inflated.len() as u64 > MAX_PLAINTEXT_BYTES {
            return Err(OcicryptError::NoModule(format!(
                "inflates past {} MiB",
                MAX_PLAINTEXT_BYTES >> 20
            )));
        }
        inflated
    } else {
        plain
    };
    let mut modules = Vec::new();
    let mut archive = tar::Archive::new(tar.as_slice());
    let entries = archive
        .entries()
        .map_err(|e| OcicryptError::NoModule(format!("is not a tar archive ({e})")))?;
    for entry in entries {
        let mut entry =
            entry.map_err(|e| OcicryptError::NoModule(format!("is a damaged tar ({e})")))?;
        let path = entry
            .path()
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        if !entry.header().entry_type().is_file() || !path.ends_with(".wasm") {
            continue;
        }
        let mut module = Zeroizing::new(Vec::new());
        entry
            .read_to_end(&mut module)
            .map_err(|e| OcicryptError::NoModule(format!("has an unreadable {path} ({e})")))?;
        modules.push((path, module));
    }
    match modules.len() {
        1 => Ok(modules.remove(0).1),
        0 => Err(OcicryptError::NoModule(
            "holds no .wasm file; put the module in the image as one .wasm file".into(),
        )),
        _ => Err(OcicryptError::NoModule(format!(
            "holds {} .wasm files ({}); a task runs exactly one",
            modules.len(),
            modules
                .iter()
                .map(|(p, _)| p.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

fn decode(what: &'static str, text: &str) -> Result<Vec<u8>, OcicryptError> {
    STANDARD.decode(text.trim()).map_err(|e| malformed(what, e))
}

fn malformed(what: &'static str, reason: impl ToString) -> OcicryptError {
    OcicryptError::Malformed {
        what,
        reason: reason.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODULE: &[u8] = b"\0asm\x01\0\0\0";

    /// A layer made the way ocicrypt and the attestation-agent key provider make one (the
    /// fixture from their real tools is in the integration tests).
    fn encrypted_layer(kek: &[u8; 32], tar_gz: &[u8]) -> (LayerDescriptor, Vec<u8>) {
        let symkey = [3u8; 32];
        let nonce = [4u8; 16];
        let mut layer = tar_gz.to_vec();
        ctr::Ctr128BE::<aes::Aes256>::new(&symkey.into(), &nonce.into())
            .apply_keystream(&mut layer);
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&symkey).unwrap();
        mac.update(&layer);
        let hmac = mac.finalize().into_bytes();
        let private = serde_json::json!({
            "symkey": STANDARD.encode(symkey),
            "digest": format!("sha256:{:x}", Sha256::digest(tar_gz)),
            "cipheroptions": {"nonce": STANDARD.encode(nonce)},
        });
        let iv = [5u8; 12];
        let wrapped = Aes256Gcm::new_from_slice(kek)
            .unwrap()
            .encrypt(Nonce::from_slice(&iv), private.to_string().as_bytes())
            .unwrap();
        let packet = serde_json::json!({
            "kid": "kbs:///default/key/image", "wrapped_data": STANDARD.encode(wrapped),
            "iv": STANDARD.encode(iv), "wrap_type": "A256GCM",
        });
        let public = serde_json::json!({
            "cipher": LAYER_CIPHER, "hmac": STANDARD.encode(hmac), "cipheroptions": {},
        });
        let descriptor = LayerDescriptor {
            media_type: "application/vnd.oci.image.layer.v1.tar+gzip+encrypted".into(),
            annotations: [
                (
                    KEY_PROVIDER_ANNOTATION.to_string(),
                    STANDARD.encode(packet.to_string()),
                ),
                (
                    PUBLIC_OPTIONS_ANNOTATION.to_string(),
                    STANDARD.encode(public.to_string()),
                ),
            ]
            .into(),
        };
        (descriptor, layer)
    }

    fn tar_gz(files: &[(&str, &[u8])]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        for (name, bytes) in files {
            let mut header = tar::Header::new_gnu();
            header.set_size(bytes.len() as u64);
            header.set_mode(0o644);
            header.set_cksum();
            builder.append_data(&mut header, name, *bytes).unwrap();
        }
        let tar = builder.into_inner().unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &tar).unwrap();
        gz.finish().unwrap()
    }

    #[test]
    fn the_module_comes_out_of_an_encrypted_gzip_tar_layer() {
        let kek = [9u8; 32];
        let (descriptor, layer) = encrypted_layer(&kek, &tar_gz(&[("add.wasm", MODULE)]));
        let packet = key_packet(&descriptor).unwrap();
        assert_eq!(packet.resource_path().unwrap(), "default/key/image");
        let module = decrypt_module(&descriptor, &packet, &kek, &layer).unwrap();
        assert_eq!(module.as_slice(), MODULE);
    }

    /// The image skopeo and coco_keyprovider encrypted (scripts/make-ocicrypt-fixture.sh).
    #[test]
    fn the_layer_their_tools_encrypted_opens_with_its_key() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/ocicrypt-add");
        let blob = |digest: &str| {
            std::fs::read(
                dir.join("blobs/sha256")
                    .join(digest.trim_start_matches("sha256:")),
            )
            .unwrap()
        };
        let index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("index.json")).unwrap()).unwrap();
        let manifest: serde_json::Value =
            serde_json::from_slice(&blob(index["manifests"][0]["digest"].as_str().unwrap()))
                .unwrap();
        let layer = &manifest["layers"][0];
        let descriptor: LayerDescriptor = serde_json::from_value(layer.clone()).unwrap();
        let kek = STANDARD
            .decode(std::fs::read_to_string(dir.join("kek.b64")).unwrap().trim())
            .unwrap();
        let packet = key_packet(&descriptor).unwrap();
        assert_eq!(packet.resource_path().unwrap(), "default/key/ocicrypt-add");
        let bytes = blob(layer["digest"].as_str().unwrap());
        let module = decrypt_module(&descriptor, &packet, &kek, &bytes).unwrap();
        assert!(module.starts_with(b"\0asm"));
        assert!(matches!(
            decrypt_module(&descriptor, &packet, &[0u8; 32], &bytes),
            Err(OcicryptError::WrongKey(_))
        ));
    }

    #[test]
    fn a_wrong_key_or_an_altered_layer_is_named() {
        let kek = [9u8; 32];
        let (descriptor, mut layer) = encrypted_layer(&kek, &tar_gz(&[("add.wasm", MODULE)]));
        let packet = key_packet(&descriptor).unwrap();
        let err = decrypt_module(&descriptor, &packet, &[1u8; 32], &layer).unwrap_err();
        assert_eq!(err, OcicryptError::WrongKey("default/key/image".into()));
        layer[10] ^= 1;
        let err = decrypt_module(&descriptor, &packet, &kek, &layer).unwrap_err();
        assert_eq!(err, OcicryptError::Altered);
    }

    #[test]
    fn a_layer_needs_exactly_one_wasm_file() {
        let kek = [9u8; 32];
        for (files, says) in [
            (vec![("README", &b"hi"[..])], "no .wasm"),
            (
                vec![("a.wasm", MODULE), ("b.wasm", MODULE)],
                "2 .wasm files",
            ),
        ] {
            let (descriptor, layer) = encrypted_layer(&kek, &tar_gz(&files));
            let packet = key_packet(&descriptor).unwrap();
            let err = decrypt_module(&descriptor, &packet, &kek, &layer).unwrap_err();
            assert!(err.to_string().contains(says), "{err}");
        }
    }

    #[test]
    fn key_ids_and_foreign_providers_are_read_or_refused_by_name() {
        let packet = |kid: &str| KeyPacket {
            kid: kid.into(),
            wrapped_data: String::new(),
            iv: String::new(),
            wrap_type: String::new(),
        };
        for kid in ["kbs:///r/t/g", "kbs://kbs.example:8080/r/t/g", "/r/t/g"] {
            assert_eq!(packet(kid).resource_path().unwrap(), "r/t/g", "{kid}");
        }
        assert!(packet("kbs:///r/t").resource_path().is_err());
        let jwe = LayerDescriptor {
            media_type: "application/vnd.oci.image.layer.v1.tar+encrypted".into(),
            annotations: [("org.opencontainers.image.enc.keys.jwe".into(), "x".into())].into(),
        };
        let err = key_packet(&jwe).unwrap_err().to_string();
        assert!(
            err.contains("jwe") && err.contains("attestation-agent"),
            "{err}"
        );
    }
}
