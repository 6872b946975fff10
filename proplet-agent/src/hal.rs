//! The `elastic:hal@0.1.0` host interfaces that mean something on a plain Linux device.
//!
//! Upstream's proplet links a hardware abstraction layer into every component; guests built
//! against it (the `hal_test` and `attestation_test` samples) fail to link without it. This
//! agent offers the parts a Linux host can answer truthfully: platform information, hashing,
//! key generation, the system clock and secure random bytes. Attestation answers with an error
//! that says there is no TEE here, instead of pretending or failing at link time.

use wasmtime::component::{ComponentType, Lift, Linker, Lower};

/// Interface names, as guests import them.
const PLATFORM: &str = "elastic:hal/platform@0.1.0";
const CRYPTO: &str = "elastic:hal/crypto@0.1.0";
const CLOCK: &str = "elastic:hal/clock@0.1.0";
const RANDOM: &str = "elastic:hal/random@0.1.0";
const ATTESTATION: &str = "elastic:hal/attestation@0.1.0";

/// Largest buffer of random bytes one call may ask for.
const MAX_RANDOM_BYTES: u32 = 1024 * 1024;

/// What `attestation` answers on a device without a trusted execution environment.
pub const NO_TEE: &str = "no TEE platform available for attestation";

#[derive(ComponentType, Lower)]
#[component(record)]
struct PlatformInfo {
    #[component(name = "platform-type")]
    platform_type: String,
    version: String,
}

#[derive(ComponentType, Lower)]
#[component(record)]
struct CapabilityInfo {
    #[component(name = "feature-name")]
    feature_name: String,
    supported: bool,
    version: String,
}

#[allow(
    dead_code,
    reason = "variants are made by `Lift` from the guest's value"
)]
#[derive(ComponentType, Lift, Lower, Clone, Copy, Debug, PartialEq)]
#[component(enum)]
#[repr(u8)]
enum HashAlgorithm {
    #[component(name = "sha256")]
    Sha256,
    #[component(name = "sha512")]
    Sha512,
    #[component(name = "blake3")]
    Blake3,
}

#[derive(ComponentType, Lower)]
#[component(record)]
struct KeyPair {
    #[component(name = "public-key")]
    public_key: Vec<u8>,
    #[component(name = "private-key")]
    private_key: Vec<u8>,
}

#[derive(ComponentType, Lower)]
#[component(record)]
struct SystemTime {
    seconds: u64,
    nanoseconds: u32,
}

/// Adds the HAL interfaces to `linker`; every store type can use them (they keep no state).
pub fn add_to_linker<T: 'static>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    let mut platform = linker.instance(PLATFORM)?;
    platform.func_wrap("get-platform-info", |_, (): ()| Ok((platform_info(),)))?;
    platform.func_wrap("list-capabilities", |_, (): ()| Ok((capabilities(),)))?;

    let mut crypto = linker.instance(CRYPTO)?;
    crypto.func_wrap("hash", |_, (data, algorithm): (Vec<u8>, HashAlgorithm)| {
        Ok((Ok::<_, String>(hash(&data, algorithm)),))
    })?;
    crypto.func_wrap("generate-keypair", |_, (): ()| Ok((generate_keypair(),)))?;

    let mut clock = linker.instance(CLOCK)?;
    clock.func_wrap("get-system-time", |_, (): ()| Ok((system_time(),)))?;

    let mut random = linker.instance(RANDOM)?;
    // Both names exist in the wild: `hal_test` imports the first, `attestation_test` the second.
    random.func_wrap("get-random-bytes", |_, (length,): (u32,)| {
        Ok((random_bytes(length),))
    })?;
    random.func_wrap("get-secure-random", |_, (length,): (u32,)| {
        Ok((random_bytes(length),))
    })?;

    let mut attestation = linker.instance(ATTESTATION)?;
    attestation.func_wrap("attestation", |_, (_report_data,): (Vec<u8>,)| {
        Ok((Err::<Vec<u8>, String>(NO_TEE.to_owned()),))
    })?;
    Ok(())
}

fn platform_info() -> PlatformInfo {
    PlatformInfo {
        platform_type: format!("{}-{}", std::env::consts::OS, std::env::consts::ARCH),
        version: crate::upgrade::AGENT_VERSION.to_owned(),
    }
}

fn capabilities() -> Vec<CapabilityInfo> {
    let version = "0.1.0".to_owned();
    let feature = |name: &str, supported: bool| CapabilityInfo {
        feature_name: name.to_owned(),
        supported,
        version: version.clone(),
    };
    vec![
        feature("platform", true),
        feature("crypto", true),
        feature("clock", true),
        feature("random", true),
        feature("attestation", false),
    ]
}

fn hash(data: &[u8], algorithm: HashAlgorithm) -> Vec<u8> {
    use sha2::Digest;
    match algorithm {
        HashAlgorithm::Sha256 => sha2::Sha256::digest(data).to_vec(),
        HashAlgorithm::Sha512 => sha2::Sha512::digest(data).to_vec(),
        HashAlgorithm::Blake3 => blake3::hash(data).as_bytes().to_vec(),
    }
}

/// An Ed25519 key pair: the private key as its PKCS#8 document, the public key raw.
fn generate_keypair() -> Result<KeyPair, String> {
    use ring::signature::KeyPair as _;
    let rng = ring::rand::SystemRandom::new();
    let pkcs8 = ring::signature::Ed25519KeyPair::generate_pkcs8(&rng)
        .map_err(|_| "the system random source failed".to_owned())?;
    let pair = ring::signature::Ed25519KeyPair::from_pkcs8(pkcs8.as_ref())
        .map_err(|_| "generated key was rejected".to_owned())?;
    Ok(KeyPair {
        public_key: pair.public_key().as_ref().to_vec(),
        private_key: pkcs8.as_ref().to_vec(),
    })
}

fn system_time() -> Result<SystemTime, String> {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|_| "the system clock is before 1970".to_owned())?;
    Ok(SystemTime {
        seconds: since.as_secs(),
        nanoseconds: since.subsec_nanos(),
    })
}

fn random_bytes(length: u32) -> Result<Vec<u8>, String> {
    use ring::rand::SecureRandom;
    if length > MAX_RANDOM_BYTES {
        return Err(format!(
            "{length} random bytes asked for; at most {MAX_RANDOM_BYTES} per call"
        ));
    }
    let mut bytes = vec![0u8; length as usize];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| "the system random source failed".to_owned())?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_match_known_digests() {
        let hex = |b: Vec<u8>| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        assert_eq!(
            hex(hash(b"hello", HashAlgorithm::Sha256)),
            "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
        );
        assert_eq!(hash(b"hello", HashAlgorithm::Sha512).len(), 64);
        assert_eq!(
            hex(hash(b"hello", HashAlgorithm::Blake3)),
            "ea8f163db38682925e4491c5e58d4bb3506ef8c14eb78a86e908c5624a67200f"
        );
    }

    #[test]
    fn random_is_bounded_and_random() {
        assert!(random_bytes(MAX_RANDOM_BYTES + 1).is_err());
        let (a, b) = (random_bytes(32), random_bytes(32));
        assert_eq!(a.as_ref().map(Vec::len), Ok(32));
        assert_ne!(a, b);
    }

    #[test]
    fn keypair_signs_and_verifies() {
        use ring::signature::{Ed25519KeyPair, UnparsedPublicKey, ED25519};
        let Ok(pair) = generate_keypair() else {
            panic!("key generation failed")
        };
        let Ok(signer) = Ed25519KeyPair::from_pkcs8(&pair.private_key) else {
            panic!("private key is not PKCS#8")
        };
        let signature = signer.sign(b"task");
        assert!(UnparsedPublicKey::new(&ED25519, &pair.public_key)
            .verify(b"task", signature.as_ref())
            .is_ok());
    }
}
