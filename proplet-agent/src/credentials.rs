//! The credentials an enrolled device keeps in its state directory's `credentials.toml`
//! (mode 0600, written atomically): its client id and key, and after a rotation the key it
//! replaced until that stops working.

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};

/// The file, in the state directory, that holds an enrolled device's credentials.
pub const CREDENTIALS_FILE: &str = "credentials.toml";

/// What a device keeps after enrolling: enough to connect as itself.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Credentials {
    /// The broker it enrolled through.
    pub mqtt_address: String,
    /// The CA bundle that verified the broker, when it was given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_ca_cert: Option<PathBuf>,
    /// `{domain}`.
    pub domain_id: String,
    /// `{channel}`.
    pub channel_id: String,
    /// Its client id (its Proplet's name).
    pub client_id: String,
    /// Its key.
    pub client_key: String,
    /// Its Proplet's namespace.
    pub namespace: String,
    /// After a rotation, the key the current one replaced, while it still works.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_client_key: Option<String>,
    /// Until when `previous_client_key` works.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_key_until: Option<chrono::DateTime<chrono::Utc>>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("mqtt_address", &self.mqtt_address)
            .field("client_id", &self.client_id)
            .field("client_key", &"<redacted>")
            .finish()
    }
}

/// Why stored credentials could not be read.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {problem}")]
pub struct CredentialsError {
    /// The file.
    pub path: String,
    /// What is wrong.
    pub problem: String,
}

/// The credentials stored in `state_dir`, if the device enrolled.
pub fn load(state_dir: &Path) -> Result<Option<Credentials>, CredentialsError> {
    let path = state_dir.join(CREDENTIALS_FILE);
    let fail = |problem: String| CredentialsError {
        path: path.display().to_string(),
        problem,
    };
    match std::fs::read_to_string(&path) {
        Ok(text) => toml::from_str(&text).map(Some).map_err(|e| {
            fail(format!(
                "{e}; remove the file and enrol again (`proplet join`)"
            ))
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(fail(e.to_string())),
    }
}

/// Writes `credentials` to `state_dir` atomically with mode 0600
/// ([`propeller_broker::private_file::write_private`]: run as root into a directory another
/// user owns, the packaged service's, the file is given to that user).
pub fn save(state_dir: &Path, credentials: &Credentials) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(state_dir)
        .with_context(|| format!("creating the state directory {}", state_dir.display()))?;
    let text = toml::to_string(credentials).context("encoding the credentials")?;
    let path = state_dir.join(CREDENTIALS_FILE);
    propeller_broker::private_file::write_private(&path, text.as_bytes())?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn credentials_are_written_0600_atomically_and_read_back() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        assert!(load(dir.path()).unwrap_or_else(|e| panic!("{e}")).is_none());
        let credentials = Credentials {
            mqtt_address: "mqtts://b:8883".into(),
            tls_ca_cert: Some("/etc/proplet/ca.pem".into()),
            domain_id: "d".into(),
            channel_id: "c".into(),
            client_id: "pi-1".into(),
            client_key: "k".into(),
            namespace: "default".into(),
            previous_client_key: Some("old".into()),
            previous_key_until: Some(chrono::Utc::now()),
        };
        let path = save(dir.path(), &credentials).unwrap_or_else(|e| panic!("{e}"));
        let mode = std::fs::metadata(&path)
            .unwrap_or_else(|e| panic!("{e}"))
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let read = load(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(read, Some(credentials.clone()));
        assert!(!format!("{credentials:?}").contains("\"k\""));
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap_or_else(|e| panic!("{e}"))
            .filter_map(|e| e.ok())
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names.len(), 1, "no temporary file left: {names:?}");
        std::fs::write(&path, "not toml [").unwrap_or_else(|e| panic!("{e}"));
        let error = load(dir.path()).expect_err("garbage");
        assert!(error.to_string().contains("proplet join"), "{error}");
    }
}
