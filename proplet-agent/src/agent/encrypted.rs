//! Encrypted tasks: the module's key from the Key Broker Service after attestation, the
//! module (propeller's format, or an ocicrypt layer framed by propeller) opened in memory only. The plaintext is never written to disk nor kept in a module
//! cache, and both it and the key are wiped from memory once compiled.

use anyhow::Context;
use propeller_broker::protocol::encrypted_module::{self, EncryptedModule};
use propeller_broker::protocol::StartRequest;
use tracing::{info, warn};
use zeroize::Zeroizing;

use crate::config::Config;
use crate::kbs::{self, KbsClient};
use crate::ocicrypt;

use super::Agent;

/// The Key Broker Service client the configuration asks for: none without a KBS, or
/// without an attester (said once, with the TEE found, if any).
pub(super) fn kbs_client(config: &Config) -> anyhow::Result<Option<KbsClient>> {
    let Some(settings) = &config.kbs else {
        return Ok(None);
    };
    let Some(attester) = kbs::for_choice(settings.attester) else {
        warn!(
            kbs = settings.url,
            tee = kbs::detected_tee().unwrap_or("none"),
            "a Key Broker Service is set but no attester (PROPLET_ATTESTER): encrypted tasks will not be scheduled here"
        );
        return Ok(None);
    };
    if attester.name() == "sample" {
        warn!(
            kbs = settings.url,
            "PROPLET_ATTESTER=sample: the evidence sent to the Key Broker Service proves nothing about this device; use it for tests and development only"
        );
    }
    KbsClient::new(settings, attester)
        .map(Some)
        .context("the Key Broker Service client (PROPLET_KBS_URI)")
}

/// Why this agent cannot run the encrypted `request` (checked before anything is fetched).
pub(super) fn encrypted_problem(request: &StartRequest, can_decrypt: bool) -> Option<String> {
    if !request.encrypted {
        return None;
    }
    if !can_decrypt {
        return Some("this proplet cannot run encrypted tasks: it has no Key Broker Service (PROPLET_KBS_URI) with an attester (PROPLET_ATTESTER)".into());
    }
    if request.file.as_ref().is_some_and(|f| !f.is_empty()) {
        return Some(
            "an encrypted task's module must come by image_url, never inline in `file`".into(),
        );
    }
    match request.kbs_resource_path.as_deref() {
        None | Some("") => Some("an encrypted task needs kbsResourcePath: where its key is in the Key Broker Service (REPOSITORY/TYPE/TAG)".into()),
        Some(path) => kbs::check_path(path).err().map(|e| e.to_string()),
    }
}

impl Agent {
    /// The module of `request` to compile: `fetched` itself, or for an encrypted task
    /// `fetched` opened with the key the Key Broker Service releases to this device.
    pub(super) async fn plaintext(
        &self,
        request: &StartRequest,
        fetched: Vec<u8>,
    ) -> Result<Zeroizing<Vec<u8>>, String> {
        if !request.encrypted {
            if let Ok(EncryptedModule::OcicryptLayer { descriptor, .. }) =
                encrypted_module::parse(&fetched)
            {
                let path = ocicrypt::key_packet(&descriptor)
                    .and_then(|p| p.resource_path())
                    .unwrap_or_else(|_| "REPOSITORY/TYPE/TAG".into());
                return Err(format!("the image's layer is encrypted (ocicrypt): set `encrypted: true` and kbsResourcePath: {path} on the task"));
            }
            if encrypted_module::is_encrypted(&fetched) {
                return Err("the module is encrypted (it has the encrypted-module header): set `encrypted: true` and kbsResourcePath on the task".into());
            }
            return Ok(Zeroizing::new(fetched));
        }
        // Checked by `encrypted_problem` before the fetch.
        let (Some(client), Some(path)) = (&self.kbs, request.kbs_resource_path.as_deref()) else {
            return Err("this proplet cannot run encrypted tasks".into());
        };
        // A plain module marked encrypted is refused before the key is asked for.
        let module = encrypted_module::parse(&fetched).map_err(|e| e.to_string())?;
        // An ocicrypt layer names its key itself; it must be the one the task expects.
        let layer_key = match &module {
            EncryptedModule::Sealed(_) => None,
            EncryptedModule::OcicryptLayer { descriptor, .. } => {
                let packet = ocicrypt::key_packet(descriptor).map_err(|e| e.to_string())?;
                let named = packet.resource_path().map_err(|e| e.to_string())?;
                if named != path {
                    return Err(format!(
                        "the image's layer is encrypted under the key at {named} (its kid {}), but the task's kbsResourcePath is {path}: set kbsResourcePath: {named}",
                        packet.kid
                    ));
                }
                Some(packet)
            }
        };
        let started = std::time::Instant::now();
        let key = client
            .resource(path)
            .await
            .map_err(|e| format!("the module's key: {e}"))?;
        let exchange = started.elapsed();
        let plaintext = match (&module, &layer_key) {
            (EncryptedModule::OcicryptLayer { descriptor, layer }, Some(packet)) => {
                ocicrypt::decrypt_module(descriptor, packet, &key, layer)
                    .map_err(|e| e.to_string())?
            }
            _ => encrypted_module::open(&key, &fetched).map_err(|e| e.to_string())?,
        };
        drop(key);
        info!(
            task_id = request.id,
            kbs_resource_path = path,
            format = if layer_key.is_some() {
                "ocicrypt layer"
            } else {
                "propeller"
            },
            key_exchange_ms = exchange.as_secs_f64() * 1e3,
            "module decrypted in memory with the key from the Key Broker Service"
        );
        Ok(plaintext)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encrypted_starts_need_a_kbs_an_image_and_a_resource_path() {
        let request = StartRequest {
            id: "t".into(),
            name: "add".into(),
            image_url: Some("https://example.com/add.wasm.enc".into()),
            encrypted: true,
            kbs_resource_path: Some("default/key/add".into()),
            ..StartRequest::default()
        };
        assert_eq!(encrypted_problem(&request, true), None);
        let says = |r: &StartRequest, can: bool, what: &str| {
            let problem = encrypted_problem(r, can).unwrap_or_default();
            assert!(problem.contains(what), "{problem}");
        };
        says(&request, false, "PROPLET_KBS_URI");
        let mut inline = request.clone();
        inline.file = Some(vec![0]);
        says(&inline, true, "never inline");
        let mut pathless = request.clone();
        pathless.kbs_resource_path = None;
        says(&pathless, true, "needs kbsResourcePath");
        let mut bad = request;
        bad.kbs_resource_path = Some("default/key".into());
        says(&bad, true, "REPOSITORY/TYPE/TAG");
    }
}
