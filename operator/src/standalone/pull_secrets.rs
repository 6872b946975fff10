//! Task pull Secrets read from the embedded store.

use futures::future::{BoxFuture, FutureExt};
use k8s_openapi::api::core::v1::Secret;

use super::kinds::SECRET;
use super::store::ObjectStore;
use crate::oci::credentials::docker_config_of;
use crate::oci::PullSecrets;

/// Reads `kubernetes.io/dockerconfigjson` Secrets applied with `propeller apply`.
pub struct StorePullSecrets(pub ObjectStore);

impl PullSecrets for StorePullSecrets {
    fn docker_config<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Vec<u8>, String>> {
        async move {
            let store = self.0.clone();
            let (ns, name) = (namespace.to_owned(), name.to_owned());
            let found =
                tokio::task::spawn_blocking(move || store.get_typed::<Secret>(SECRET, &ns, &name))
                    .await
                    .map_err(|e| e.to_string())?
                    .map_err(|e| format!("cannot be read: {e}"))?;
            match found {
                Some(secret) => docker_config_of(&secret),
                None => Err("not found".into()),
            }
        }
        .boxed()
    }
}
