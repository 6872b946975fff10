//! Registry credentials from Docker config JSON, the format of `kubernetes.io/dockerconfigjson`
//! Secrets (`.dockerconfigjson`), of `~/.docker/config.json` and of `kubectl create secret
//! docker-registry`.

use std::collections::BTreeMap;

use base64::Engine;
use oci_client::secrets::RegistryAuth;
use serde::Deserialize;

/// The key of the config in a `kubernetes.io/dockerconfigjson` Secret.
pub const DOCKER_CONFIG_KEY: &str = ".dockerconfigjson";

/// The Docker config of a Secret, or why it is not a usable pull Secret.
pub fn docker_config_of(secret: &k8s_openapi::api::core::v1::Secret) -> Result<Vec<u8>, String> {
    secret
        .data
        .as_ref()
        .and_then(|d| d.get(DOCKER_CONFIG_KEY))
        .map(|b| b.0.clone())
        .ok_or_else(|| {
            format!(
                "has no {DOCKER_CONFIG_KEY} key (type {}; expected kubernetes.io/dockerconfigjson)",
                secret.type_.as_deref().unwrap_or("Opaque")
            )
        })
}

#[derive(Debug, Default, Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: BTreeMap<String, AuthEntry>,
}

#[derive(Debug, Default, Deserialize)]
struct AuthEntry {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
    #[serde(default, rename = "identitytoken")]
    identity_token: Option<String>,
    #[serde(default, rename = "registrytoken")]
    registry_token: Option<String>,
}

/// Logins by registry host, parsed from one or more Docker configs.
#[derive(Debug, Clone, Default)]
pub struct RegistryLogins {
    by_host: BTreeMap<String, RegistryAuth>,
}

/// The host a Docker config key names: `https://index.docker.io/v1/` and `docker.io` both
/// mean Docker Hub; a scheme and path are dropped.
fn host_of(key: &str) -> String {
    let without_scheme = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    let host = without_scheme
        .split('/')
        .next()
        .unwrap_or(without_scheme)
        .to_ascii_lowercase();
    match host.as_str() {
        "index.docker.io" | "registry-1.docker.io" | "docker.io" => "docker.io".into(),
        _ => host,
    }
}

impl RegistryLogins {
    /// Parses a Docker config JSON document.
    pub fn parse(json: &[u8]) -> Result<Self, String> {
        let config: DockerConfig =
            serde_json::from_slice(json).map_err(|e| format!("not a Docker config JSON: {e}"))?;
        let mut by_host = BTreeMap::new();
        for (key, entry) in config.auths {
            let auth = entry_auth(&entry).map_err(|e| format!("entry {key:?}: {e}"))?;
            by_host.insert(host_of(&key), auth);
        }
        Ok(Self { by_host })
    }

    /// Adds `other`'s logins, replacing those for the same hosts.
    pub fn merge(&mut self, other: &Self) {
        for (host, auth) in &other.by_host {
            self.by_host.insert(host.clone(), auth.clone());
        }
    }

    /// The login for `registry` (as `Reference::resolve_registry` names it), or anonymous.
    pub fn for_registry(&self, registry: &str) -> RegistryAuth {
        self.by_host
            .get(&host_of(registry))
            .cloned()
            .unwrap_or(RegistryAuth::Anonymous)
    }
}

fn entry_auth(entry: &AuthEntry) -> Result<RegistryAuth, String> {
    if let Some(token) = entry.registry_token.as_ref().filter(|t| !t.is_empty()) {
        return Ok(RegistryAuth::Bearer(token.clone()));
    }
    if let (Some(user), Some(pass)) = (&entry.username, &entry.password) {
        if !user.is_empty() {
            return Ok(RegistryAuth::Basic(user.clone(), pass.clone()));
        }
    }
    if let Some(encoded) = entry.auth.as_ref().filter(|a| !a.is_empty()) {
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(encoded.trim())
            .map_err(|e| format!("`auth` is not base64: {e}"))?;
        let text = String::from_utf8(decoded).map_err(|_| "`auth` is not UTF-8".to_owned())?;
        let (user, pass) = text
            .split_once(':')
            .ok_or_else(|| "`auth` is not user:password".to_owned())?;
        return Ok(RegistryAuth::Basic(user.to_owned(), pass.to_owned()));
    }
    if let Some(token) = entry.identity_token.as_ref().filter(|t| !t.is_empty()) {
        // An identity token is a refresh token for the registry's token service; registries
        // that issue one accept it as the password of the user `<token>`.
        return Ok(RegistryAuth::Basic("<token>".into(), token.clone()));
    }
    Err("no `auth`, `username`/`password` or token".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn basic(auth: &RegistryAuth) -> Option<(&str, &str)> {
        match auth {
            RegistryAuth::Basic(u, p) => Some((u, p)),
            _ => None,
        }
    }

    #[test]
    fn kubectl_style_configs_give_basic_logins_per_host() -> Result<(), String> {
        // `kubectl create secret docker-registry` writes both forms.
        let json = br#"{"auths":{"127.0.0.1:5000":{"username":"ci","password":"s3cret","auth":"Y2k6czNjcmV0"},
                        "https://index.docker.io/v1/":{"auth":"aHViOnB3"}}}"#;
        let logins = RegistryLogins::parse(json)?;
        assert_eq!(
            basic(&logins.for_registry("127.0.0.1:5000")),
            Some(("ci", "s3cret"))
        );
        assert_eq!(
            basic(&logins.for_registry("docker.io")),
            Some(("hub", "pw"))
        );
        assert_eq!(
            basic(&logins.for_registry("index.docker.io")),
            Some(("hub", "pw"))
        );
        assert!(matches!(
            logins.for_registry("ghcr.io"),
            RegistryAuth::Anonymous
        ));
        Ok(())
    }

    #[test]
    fn malformed_configs_say_what_is_wrong() {
        let err = RegistryLogins::parse(b"{\"auths\":{\"r\":{\"auth\":\"!!\"}}}").err();
        assert!(err.is_some_and(|e| e.contains("base64") && e.contains("\"r\"")));
        assert!(RegistryLogins::parse(b"\"text\"").is_err());
        assert!(RegistryLogins::parse(b"{\"auths\":{\"r\":{}}}").is_err());
    }

    #[test]
    fn later_configs_override_earlier_ones() -> Result<(), String> {
        let mut base =
            RegistryLogins::parse(br#"{"auths":{"r":{"username":"a","password":"1"}}}"#)?;
        base.merge(&RegistryLogins::parse(
            br#"{"auths":{"r":{"username":"b","password":"2"}}}"#,
        )?);
        assert_eq!(basic(&base.for_registry("r")), Some(("b", "2")));
        Ok(())
    }
}
