//! Task pull Secrets read from the API server when a resolution needs one (rarely: once
//! per run of a task that names a Secret), not from a cache of every Secret.

use futures::future::{BoxFuture, FutureExt};
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::Client;

use crate::oci::credentials::docker_config_of;
use crate::oci::PullSecrets;

/// Reads `kubernetes.io/dockerconfigjson` Secrets through kube-rs.
pub struct ApiPullSecrets(pub Client);

impl PullSecrets for ApiPullSecrets {
    fn docker_config<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Vec<u8>, String>> {
        async move {
            let api: Api<Secret> = Api::namespaced(self.0.clone(), namespace);
            match api.get_opt(name).await {
                Ok(Some(secret)) => docker_config_of(&secret),
                Ok(None) => Err("not found".into()),
                Err(e) => Err(format!("cannot be read: {e}")),
            }
        }
        .boxed()
    }
}
