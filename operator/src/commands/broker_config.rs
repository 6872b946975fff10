//! The device policy rendered as a broker's own configuration, for brokers that cannot call
//! propeller back (NATS 2.9): `propeller broker-config` prints it once from the Kubernetes
//! API; `--broker-config-file` keeps a file current from the live credential table and runs
//! a reload command after each change.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use k8s_openapi::api::core::v1::Secret;
use kube::api::ListParams;
use kube::Api;
use propeller_broker::external::nats_config::render_authorization;
use propeller_broker::private_file::write_private;
use propeller_broker::server::{load_credentials_file, Credential, CredentialStore};
use propeller_operator::crd::proplet::{ClientKeySource, Proplet};
use propeller_operator::credentials::credential_table;
use propeller_operator::credentials::token_table;
use propeller_operator::decision::enrolment::TOKEN_LABEL;
use tracing::{info, warn};

/// How often the rendered file is compared with the credential table.
const RENDER_EVERY: Duration = Duration::from_secs(1);

/// Broker configuration formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ConfigFormat {
    /// A NATS server `authorization { users: [...] }` block (include it from nats.conf).
    Nats,
}

/// Flags of `propeller broker-config`.
#[derive(Args, Debug)]
pub struct BrokerConfigCommand {
    /// The broker's configuration format.
    #[arg(long, value_enum, default_value = "nats")]
    pub format: ConfigFormat,
    /// Read Proplets of this namespace only (all namespaces when unset).
    #[arg(long, short = 'n')]
    pub namespace: Option<String>,
    /// TOML file of service clients (propeller's own login among them) to include.
    #[arg(long, env = "PROPELLER_CREDENTIALS")]
    pub credentials: Option<PathBuf>,
    /// Namespace of the bootstrap token Secrets (as `propeller run --token-namespace`): the
    /// --namespace, else the client's default namespace, when unset.
    #[arg(long, env = "PROPELLER_TOKEN_NAMESPACE")]
    pub token_namespace: Option<String>,
}

/// Prints the configuration for the Proplets (and their Secrets) of the cluster.
pub async fn print(cmd: BrokerConfigCommand) -> anyhow::Result<()> {
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API (in-cluster config or kubeconfig)")?;
    let proplets: Api<Proplet> = match &cmd.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let proplets = match proplets.list(&ListParams::default()).await {
        Ok(list) => list.items,
        // Before the chart (or configs/crd) is installed there is no Proplet kind: the
        // rendering then holds the service clients alone, enough for propeller to log in.
        Err(kube::Error::Api(status)) if status.code == 404 => {
            eprintln!(
                "warning: this cluster has no Proplet kind yet (its CRDs are not installed): \
                 rendering the service clients only; run this again once Proplets exist"
            );
            Vec::new()
        }
        Err(e) => return Err(e).context("listing Proplets"),
    };
    let mut secrets: HashMap<(String, String), Secret> = HashMap::new();
    for proplet in &proplets {
        let Some(ClientKeySource::Secret(selector)) = proplet.spec.connection_config.key_source()
        else {
            continue;
        };
        let namespace = proplet.metadata.namespace.clone().unwrap_or_default();
        let key = (namespace.clone(), selector.name.clone());
        if secrets.contains_key(&key) {
            continue;
        }
        let api: Api<Secret> = Api::namespaced(client.clone(), &namespace);
        if let Some(secret) = api
            .get_opt(&selector.name)
            .await
            .with_context(|| format!("reading Secret {namespace}/{}", selector.name))?
        {
            secrets.insert(key, secret);
        }
    }
    let read = |ns: &str, name: &str, key: &str| {
        let secret = secrets.get(&(ns.to_owned(), name.to_owned()))?;
        propeller_operator::credentials::secret_entry(secret, key)
    };
    let (table, problems) = credential_table(&proplets, read);
    for problem in problems {
        eprintln!("warning: {}: {}", problem.proplet, problem.message);
    }
    let mut entries: Vec<(String, Credential)> = table.into_iter().collect();
    if let Some(path) = &cmd.credentials {
        entries.extend(load_credentials_file(path)?);
    }
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    let token_namespace = cmd
        .token_namespace
        .clone()
        .or_else(|| cmd.namespace.clone())
        .unwrap_or_else(|| client.default_namespace().to_owned());
    let token_secrets = Api::<Secret>::namespaced(client.clone(), &token_namespace)
        .list(&ListParams::default().labels(TOKEN_LABEL))
        .await
        .with_context(|| format!("listing bootstrap tokens in {token_namespace}"))?
        .items;
    let mut tokens: Vec<_> = token_table(&token_secrets, &token_namespace)
        .into_iter()
        .collect();
    tokens.sort_by(|a, b| a.0.cmp(&b.0));
    match cmd.format {
        ConfigFormat::Nats => print!(
            "{}",
            render_authorization(&entries, &tokens, chrono::Utc::now())
        ),
    }
    Ok(())
}

/// Keeps `path` equal to the rendering of the live tables, running `reload` (a shell command)
/// after each rewrite, from the moment the proplets' table has been read. Runs until the
/// task is dropped.
pub async fn keep_rendered(
    proplets: CredentialStore,
    services: CredentialStore,
    path: PathBuf,
    reload: Option<String>,
) {
    // A restart finding the file as it would write it leaves the broker alone.
    let mut written: Option<String> = std::fs::read_to_string(&path).ok();
    // Until the driver has read the Proplets, a rendering would drop every device from the
    // broker (and a reload would disconnect them).
    while !proplets.is_loaded() {
        tokio::time::sleep(RENDER_EVERY / 10).await;
    }
    let mut rendered_at = None;
    // The end of the first rotation's grace in the last rendering: the device's rendered key
    // changes then, though the tables do not.
    let mut grace_ends: Option<chrono::DateTime<chrono::Utc>> = None;
    loop {
        let generations = (proplets.generation(), services.generation());
        let now = chrono::Utc::now();
        if rendered_at == Some(generations) && grace_ends.is_none_or(|end| now < end) {
            tokio::time::sleep(RENDER_EVERY).await;
            continue;
        }
        let mut entries = proplets.snapshot();
        entries.extend(services.snapshot());
        grace_ends = entries
            .iter()
            .filter_map(|(_, credential)| credential.previous_valid_until(now))
            .min();
        let text = render_authorization(&entries, &proplets.token_snapshot(), now);
        if written.as_deref() == Some(text.as_str()) {
            rendered_at = Some(generations);
        } else {
            match write_private(&path, text.as_bytes()) {
                Ok(()) => {
                    info!(path = %path.display(), users = entries.len(), "broker configuration written");
                    if let Some(command) = &reload {
                        run_reload(command).await;
                    }
                    written = Some(text);
                    rendered_at = Some(generations);
                }
                Err(e) => {
                    warn!(path = %path.display(), "cannot write the broker configuration: {e:#}")
                }
            }
        }
        tokio::time::sleep(RENDER_EVERY).await;
    }
}

async fn run_reload(command: &str) {
    let outcome = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(command)
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(Duration::from_secs(30), outcome).await {
        Ok(Ok(output)) if output.status.success() => info!(%command, "broker reloaded"),
        Ok(Ok(output)) => warn!(
            %command,
            status = %output.status,
            stderr = %String::from_utf8_lossy(&output.stderr).trim(),
            "the broker reload command failed"
        ),
        Ok(Err(e)) => warn!(%command, "cannot run the broker reload command: {e}"),
        Err(_) => warn!(%command, "the broker reload command took over 30 s; killed"),
    }
}
