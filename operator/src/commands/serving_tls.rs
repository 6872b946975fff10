//! The embedded broker's TLS certificate when none is given: a private CA and a server
//! certificate made once in the data directory, so `--mqtt-tls-listen` works without a PKI.
//! Devices trust the CA (`proplet join --tls-ca-cert <data>/tls/ca.pem`).

use std::path::{Path, PathBuf};

use anyhow::Context;

/// The files of a made certificate.
pub struct ServingFiles {
    /// The CA devices verify the broker with.
    pub ca: PathBuf,
    /// The server certificate chain.
    pub cert: PathBuf,
    /// Its private key (mode 0600).
    pub key: PathBuf,
}

/// The certificate in `dir` for `names` (DNS names or addresses); made when absent. An
/// existing one is kept as it is (its names included): delete the directory to make anew.
pub fn serving_files(dir: &Path, names: &[String]) -> anyhow::Result<ServingFiles> {
    let files = ServingFiles {
        ca: dir.join("ca.pem"),
        cert: dir.join("server.pem"),
        key: dir.join("server-key.pem"),
    };
    if files.ca.exists() && files.cert.exists() && files.key.exists() {
        return Ok(files);
    }
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let ca_key = KeyPair::generate().context("making the CA key")?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "propeller standalone CA");
    let ca = ca_params.self_signed(&ca_key).context("making the CA")?;
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().context("making the server key")?;
    let params = CertificateParams::new(names.to_vec())
        .with_context(|| format!("certificate names {names:?}"))?;
    let cert = params
        .signed_by(&key, &issuer)
        .context("signing the server certificate")?;
    propeller_broker::private_file::write_private(&files.key, key.serialize_pem().as_bytes())?;
    std::fs::write(&files.cert, cert.pem())
        .with_context(|| format!("writing {}", files.cert.display()))?;
    std::fs::write(&files.ca, ca.pem())
        .with_context(|| format!("writing {}", files.ca.display()))?;
    Ok(files)
}
