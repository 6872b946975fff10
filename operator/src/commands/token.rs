//! `propeller token create|list|delete`, `propeller approve` and `propeller rotate`: bootstrap tokens devices
//! enrol with, and approving the devices a manual-approval token enrolled. Against the
//! standalone API by default, or the Kubernetes cluster of the kubeconfig with
//! `--kubernetes`.

use std::collections::BTreeMap;
use std::io::Read;
use std::time::Duration;

use anyhow::{bail, Context};
use chrono::{SecondsFormat, Utc};
use clap::{Args, Subcommand};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::Api;
use propeller_broker::protocol::enrolment::BootstrapToken;
use propeller_broker::protocol::parse_setting_duration;
use propeller_operator::crd::proplet::{ClientKeySource, Proplet};
use propeller_operator::decision::enrolment::{
    rotate_key, token_secret_name, Approval, TokenRecord, APPROVAL_LABEL, TOKEN_LABEL,
    TOKEN_SECRET_TYPE,
};
use propeller_operator::enrolment::STANDALONE_TOKEN_NAMESPACE;
use propeller_operator::standalone::client::ApiClient;
use serde_json::Value;

use super::standalone::ClientArgs;

/// bcrypt cost of the token hash rendered for NATS. The secret's ~82 bits, not the hash's
/// cost, bound guessing; a low cost keeps NATS's check of each enrolment login cheap.
const BROKER_HASH_COST: u32 = 6;

/// Where the tokens are kept: the standalone API, or a Kubernetes cluster.
#[derive(Args, Debug)]
pub struct Target {
    /// Use the Kubernetes cluster of the kubeconfig (as `propeller run` does) instead of
    /// the standalone API.
    #[arg(long, global = true)]
    pub kubernetes: bool,
    /// With --kubernetes: the namespace `propeller run` keeps tokens in (its
    /// --token-namespace; the chart's namespace).
    #[arg(
        long,
        env = "PROPELLER_TOKEN_NAMESPACE",
        default_value = "propeller-system",
        global = true
    )]
    pub token_namespace: String,
    #[command(flatten)]
    pub client: ClientArgs,
}

/// `propeller token …`.
#[derive(Subcommand, Debug)]
pub enum TokenCommand {
    /// Make a bootstrap token and print it, once (the token on stdout, what it allows on
    /// stderr).
    Create(CreateArgs),
    /// List the bootstrap tokens (never their secrets).
    List,
    /// Delete a bootstrap token: devices can no longer enrol with it (enrolled devices stay).
    Delete {
        /// The token's id (the part before the dot).
        id: String,
    },
}

/// Flags of `propeller token create`.
#[derive(Args, Debug)]
pub struct CreateArgs {
    /// How long the token works, e.g. `1h`, `30m`, `168h`; `0`: no expiry.
    #[arg(long, default_value = "24h")]
    pub ttl: String,
    /// How many devices it may enrol (unlimited when unset).
    #[arg(long)]
    pub uses: Option<u32>,
    /// Labels the devices' Proplets get: `k=v,k=v`.
    #[arg(long, default_value = "")]
    pub labels: String,
    /// Namespace the devices' Proplets are created in.
    #[arg(short = 'n', long, default_value = "default")]
    pub namespace: String,
    /// The devices' `{domain}` topic level.
    #[arg(long, default_value = "default-domain")]
    pub domain_id: String,
    /// The devices' `{channel}` topic level.
    #[arg(long, default_value = "default-channel")]
    pub channel_id: String,
    /// `auto`: devices get tasks once Running; `manual`: they wait for `propeller approve`.
    #[arg(long, default_value = "auto", value_parser = ["auto", "manual"])]
    pub approve: String,
    /// Allow the token over plain `tcp://` (the device must say --insecure-enrol too). Off:
    /// a token and the key it gets back cross only TLS.
    #[arg(long)]
    pub insecure_enrol: bool,
    /// What the token is for.
    #[arg(long, default_value = "")]
    pub description: String,
}

/// Runs `propeller token …`.
pub async fn run(command: TokenCommand, target: Target) -> anyhow::Result<()> {
    let store = TokenStore::open(&target).await?;
    match command {
        TokenCommand::Create(args) => create(&store, args).await,
        TokenCommand::List => list(&store).await,
        TokenCommand::Delete { id } => {
            store.delete(&token_secret_name(&id)).await?;
            println!("token {id} deleted");
            Ok(())
        }
    }
}

/// Runs `propeller rotate proplet/NAME`: a new key in the proplet's key Secret, the old one
/// still accepted for `grace`; the connected device is sent the new key.
pub async fn rotate(
    what: &str,
    namespace: &str,
    grace: &str,
    target: Target,
) -> anyhow::Result<()> {
    let name = proplet_name(what)?;
    let grace = parse_setting_duration(grace)
        .map_err(|e| anyhow::anyhow!("--grace {grace:?}: {e}; write a duration such as 10m"))?;
    let until = Utc::now() + chrono::Duration::from_std(grace).unwrap_or(chrono::Duration::MAX);
    let store = TokenStore::open(&target).await?;
    store.rotate(namespace, name, until).await?;
    println!(
        "proplet/{name}: new key; the old one works until {}",
        until.to_rfc3339_opts(SecondsFormat::Secs, true)
    );
    Ok(())
}

/// `NAME` from `proplet/NAME` (or a bare name).
fn proplet_name(what: &str) -> anyhow::Result<&str> {
    match what.split_once('/') {
        Some(("proplet" | "proplets", name)) => Ok(name),
        Some(_) => bail!("only proplets are named here: write proplet/NAME"),
        None => Ok(what),
    }
}

/// Runs `propeller approve proplet/NAME`.
pub async fn approve(what: &str, namespace: &str, target: Target) -> anyhow::Result<()> {
    let name = proplet_name(what)?;
    let store = TokenStore::open(&target).await?;
    store.approve(namespace, name).await?;
    println!("proplet/{name} approved: it may get tasks");
    Ok(())
}

async fn create(store: &TokenStore, args: CreateArgs) -> anyhow::Result<()> {
    let ttl = parse_setting_duration(&args.ttl).map_err(|e| {
        anyhow::anyhow!(
            "--ttl {:?}: {e}; write a duration such as 1h or 30m",
            args.ttl
        )
    })?;
    let labels = parse_labels(&args.labels)?;
    let token = BootstrapToken::generate(random_below);
    let now = Utc::now();
    let record = TokenRecord {
        id: token.id().to_owned(),
        secret_digest: token.secret_digest(),
        secret_bcrypt: Some(
            bcrypt::hash(token.reveal(), BROKER_HASH_COST)
                .context("hashing the token for brokers that check it themselves")?,
        ),
        expires: (ttl > Duration::ZERO)
            .then(|| now + chrono::Duration::from_std(ttl).unwrap_or(chrono::Duration::MAX)),
        usage_limit: args.uses,
        uses: 0,
        labels,
        namespace: args.namespace,
        domain_id: args.domain_id,
        channel_id: args.channel_id,
        approval: if args.approve == "manual" {
            Approval::Manual
        } else {
            Approval::Auto
        },
        insecure: args.insecure_enrol,
        description: args.description,
    };
    store.create(&record).await?;
    println!("{}", token.reveal());
    eprintln!("{}", summary(&record));
    eprintln!(
        "This is the only time the token is shown. On a device:\n  proplet join --server mqtts://BROKER:8883 --token {}",
        token.reveal()
    );
    Ok(())
}

/// One line on what a token allows.
fn summary(token: &TokenRecord) -> String {
    let expires = token.expires.map_or("never expires".to_owned(), |t| {
        format!("expires {}", t.to_rfc3339_opts(SecondsFormat::Secs, true))
    });
    let uses = token
        .usage_limit
        .map_or(format!("{} uses of any", token.uses), |l| {
            format!("{} of {l} uses", token.uses)
        });
    format!(
        "token {}: {expires}, {uses}, devices to namespace {} on m/{}/c/{}, approval {}{}",
        token.id,
        token.namespace,
        token.domain_id,
        token.channel_id,
        match token.approval {
            Approval::Auto => "auto",
            Approval::Manual => "manual",
        },
        if token.insecure {
            ", plain tcp:// allowed"
        } else {
            ""
        }
    )
}

async fn list(store: &TokenStore) -> anyhow::Result<()> {
    let mut tokens: Vec<TokenRecord> = store
        .list()
        .await?
        .iter()
        .filter_map(|s| match TokenRecord::from_secret(s) {
            Ok(t) => Some(t),
            Err(e) => {
                eprintln!("skipped: {e}");
                None
            }
        })
        .collect();
    tokens.sort_by(|a, b| a.id.cmp(&b.id));
    let now = Utc::now();
    let mut rows = vec![vec![
        "ID".to_owned(),
        "EXPIRES".into(),
        "USES".into(),
        "NAMESPACE".into(),
        "LABELS".into(),
        "APPROVE".into(),
        "DESCRIPTION".into(),
    ]];
    for t in &tokens {
        let expires = match t.expires {
            None => "never".to_owned(),
            Some(at) if at <= now => "expired".to_owned(),
            Some(at) => at.to_rfc3339_opts(SecondsFormat::Secs, true),
        };
        rows.push(vec![
            t.id.clone(),
            expires,
            t.usage_limit
                .map_or(t.uses.to_string(), |l| format!("{}/{l}", t.uses)),
            t.namespace.clone(),
            t.labels
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(","),
            match t.approval {
                Approval::Auto => "auto".into(),
                Approval::Manual => "manual".into(),
            },
            t.description.clone(),
        ]);
    }
    let widths = propeller_operator::standalone::client::column_widths(&rows);
    print!(
        "{}",
        propeller_operator::standalone::client::render_rows(&rows, &widths)
    );
    Ok(())
}

fn parse_labels(text: &str) -> anyhow::Result<BTreeMap<String, String>> {
    let mut labels = BTreeMap::new();
    for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((key, value)) = pair.split_once('=') else {
            bail!("--labels {pair:?}: write key=value pairs separated by commas");
        };
        let valid = |s: &str, max: usize| {
            s.len() <= max
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
        };
        if key.is_empty() || !valid(key, 253) || !valid(value, 63) || value.contains('/') {
            bail!("--labels {pair:?}: keys and values are letters, digits, '-', '_' and '.' (a key may have a prefix/)");
        }
        labels.insert(key.to_owned(), value.to_owned());
    }
    Ok(labels)
}

/// A uniformly random number below `n`, from the kernel.
fn random_below(n: usize) -> usize {
    // Rejection sampling over one byte: `n` is the token alphabet's size (36).
    let limit = 256 - 256 % n.max(1);
    loop {
        let mut byte = [0u8; 1];
        if std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut byte))
            .is_err()
        {
            // No kernel randomness: stop rather than make a guessable token.
            eprintln!("propeller: cannot read /dev/urandom; no token was made");
            std::process::exit(1);
        }
        if usize::from(byte[0]) < limit {
            return usize::from(byte[0]) % n.max(1);
        }
    }
}

/// The backend the token commands write to.
enum TokenStore {
    Standalone(ApiClient),
    Kubernetes {
        client: kube::Client,
        namespace: String,
    },
}

impl TokenStore {
    async fn open(target: &Target) -> anyhow::Result<Self> {
        if target.kubernetes {
            let client = kube::Client::try_default()
                .await
                .context("connecting to the cluster of the kubeconfig")?;
            Ok(Self::Kubernetes {
                client,
                namespace: target.token_namespace.clone(),
            })
        } else {
            Ok(Self::Standalone(target.client.client()?))
        }
    }

    async fn create(&self, token: &TokenRecord) -> anyhow::Result<()> {
        match self {
            Self::Standalone(api) => {
                let mut value = serde_json::to_value(token.to_secret(STANDALONE_TOKEN_NAMESPACE))?;
                value["apiVersion"] = "v1".into();
                value["kind"] = "Secret".into();
                api.request("POST", "/v1/apply", Some(&value.to_string()))
                    .await
                    .context("storing the token")?;
            }
            Self::Kubernetes { client, namespace } => {
                let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
                secrets
                    .create(&PostParams::default(), &token.to_secret(namespace))
                    .await
                    .with_context(|| format!("creating the token's Secret in {namespace}"))?;
            }
        }
        Ok(())
    }

    async fn list(&self) -> anyhow::Result<Vec<Secret>> {
        match self {
            Self::Standalone(api) => {
                let listed = api
                    .request(
                        "GET",
                        &format!("/v1/objects/Secret?namespace={STANDALONE_TOKEN_NAMESPACE}"),
                        None,
                    )
                    .await
                    .context("listing tokens")?;
                let all: Vec<Secret> = match listed {
                    Value::Array(items) => items
                        .into_iter()
                        .filter_map(|v| serde_json::from_value(v).ok())
                        .collect(),
                    _ => Vec::new(),
                };
                Ok(all
                    .into_iter()
                    .filter(|s| s.type_.as_deref() == Some(TOKEN_SECRET_TYPE))
                    .collect())
            }
            Self::Kubernetes { client, namespace } => {
                let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
                Ok(secrets
                    .list(&ListParams::default().labels(TOKEN_LABEL))
                    .await
                    .with_context(|| format!("listing the token Secrets of {namespace}"))?
                    .items)
            }
        }
    }

    async fn delete(&self, name: &str) -> anyhow::Result<()> {
        match self {
            Self::Standalone(api) => {
                api.request(
                    "DELETE",
                    &format!("/v1/objects/Secret/{STANDALONE_TOKEN_NAMESPACE}/{name}"),
                    None,
                )
                .await
                .with_context(|| format!("deleting {name}"))?;
            }
            Self::Kubernetes { client, namespace } => {
                let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
                secrets
                    .delete(name, &DeleteParams::default())
                    .await
                    .with_context(|| format!("deleting Secret {namespace}/{name}"))?;
            }
        }
        Ok(())
    }

    async fn rotate(
        &self,
        namespace: &str,
        name: &str,
        until: chrono::DateTime<Utc>,
    ) -> anyhow::Result<()> {
        let fresh = super::random::random_hex(32)?;
        let proplet: Proplet = match self {
            Self::Standalone(api) => serde_json::from_value(
                api.request(
                    "GET",
                    &format!("/v1/objects/Proplet/{namespace}/{name}"),
                    None,
                )
                .await
                .with_context(|| format!("reading proplet {namespace}/{name}"))?,
            )?,
            Self::Kubernetes { client, .. } => {
                Api::<Proplet>::namespaced(client.clone(), namespace)
                    .get(name)
                    .await
                    .with_context(|| format!("reading proplet {namespace}/{name}"))?
            }
        };
        let Some(ClientKeySource::Secret(selector)) = proplet.spec.connection_config.key_source()
        else {
            bail!("proplet {namespace}/{name} has its key written inline (clientKey); only a key in a Secret (clientKeySecretRef) can be rotated");
        };
        let secret: Secret = match self {
            Self::Standalone(api) => serde_json::from_value(
                api.request(
                    "GET",
                    &format!("/v1/objects/Secret/{namespace}/{}", selector.name),
                    None,
                )
                .await
                .with_context(|| format!("reading Secret {namespace}/{}", selector.name))?,
            )?,
            Self::Kubernetes { client, .. } => Api::<Secret>::namespaced(client.clone(), namespace)
                .get(&selector.name)
                .await
                .with_context(|| format!("reading Secret {namespace}/{}", selector.name))?,
        };
        let rotated = rotate_key(&secret, &selector.key, &fresh, until).with_context(|| {
            format!(
                "Secret {namespace}/{} has no key {:?} to replace",
                selector.name, selector.key
            )
        })?;
        match self {
            Self::Standalone(api) => {
                let mut value = serde_json::to_value(&rotated)?;
                value["apiVersion"] = "v1".into();
                value["kind"] = "Secret".into();
                api.request("POST", "/v1/apply", Some(&value.to_string()))
                    .await
                    .context("storing the new key")?;
            }
            Self::Kubernetes { client, .. } => {
                Api::<Secret>::namespaced(client.clone(), namespace)
                    .replace(&selector.name, &PostParams::default(), &rotated)
                    .await
                    .context("storing the new key")?;
            }
        }
        Ok(())
    }

    async fn approve(&self, namespace: &str, name: &str) -> anyhow::Result<()> {
        match self {
            Self::Standalone(api) => {
                let mut proplet = api
                    .request(
                        "GET",
                        &format!("/v1/objects/Proplet/{namespace}/{name}"),
                        None,
                    )
                    .await
                    .with_context(|| format!("reading proplet {namespace}/{name}"))?;
                if let Some(labels) = proplet["metadata"]["labels"].as_object_mut() {
                    labels.remove(APPROVAL_LABEL);
                }
                if let Some(meta) = proplet["metadata"].as_object_mut() {
                    meta.remove("managedFields");
                }
                proplet.as_object_mut().map(|o| o.remove("status"));
                api.request("POST", "/v1/apply", Some(&proplet.to_string()))
                    .await
                    .with_context(|| format!("approving proplet {namespace}/{name}"))?;
            }
            Self::Kubernetes { client, .. } => {
                let proplets: Api<Proplet> = Api::namespaced(client.clone(), namespace);
                let patch = serde_json::json!({"metadata": {"labels": {APPROVAL_LABEL: null}}});
                proplets
                    .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .with_context(|| format!("approving proplet {namespace}/{name}"))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_checked_and_read() {
        let labels = parse_labels("site=lab, tier=edge").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(labels.get("site").map(String::as_str), Some("lab"));
        assert_eq!(labels.len(), 2);
        for bad in ["site", "site=a b", "=x", "k=v/w"] {
            assert!(parse_labels(bad).is_err(), "{bad}");
        }
        assert!(parse_labels("").map(|l| l.is_empty()).unwrap_or(false));
    }

    #[test]
    fn random_numbers_stay_below_the_bound() {
        for _ in 0..1000 {
            assert!(random_below(36) < 36);
        }
    }
}
