//! `propeller standalone` (the reconcilers over the embedded store, with the broker and the
//! local API) and the client commands `apply`, `get`, `describe`, `delete`.

use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use propeller_broker::server::{BrokerConfig, CredentialStore};
use propeller_operator::decision::task::FinalizerTiming;
use propeller_operator::manifest::canonical_kind;
use propeller_operator::metrics::ControllerMetrics;
use propeller_operator::standalone::api::{self, ApiState, MetricsText};
use propeller_operator::standalone::client::{
    column_widths, describe, render_rows, table, table_cells, ApiClient,
};
use propeller_operator::standalone::driver::{Driver, StandaloneSettings};
use propeller_operator::standalone::events::EventLog;
use propeller_operator::standalone::store::ObjectStore;
use propeller_operator::standalone::watch::{ChangeLog, INITIAL_EVENTS_END};
use propeller_operator::validation::Admission;
use serde_json::Value;
use tracing::{info, warn};

use super::device_broker::{DeviceBroker, Logins};
use super::external_args::ExternalBrokerArgs;
use super::image_args::ImageArgs;
use super::reconcile_args::ReconcileArgs;
use propeller_operator::standalone::pull_secrets::StorePullSecrets;

/// File in the data directory holding the API's bearer token.
const TOKEN_FILE: &str = "api-token";
/// Default address of the local API.
const DEFAULT_API: &str = "127.0.0.1:7070";

/// Flags of `propeller standalone`.
#[derive(Args, Debug)]
pub struct StandaloneCommand {
    /// Where objects, statuses and the API token are kept.
    #[arg(long, env = "PROPELLER_DATA_DIR", default_value = "./propeller-data")]
    pub data_dir: PathBuf,
    /// Address of the local API that `propeller apply/get/describe/delete` use.
    #[arg(long, env = "PROPELLER_API_LISTEN", default_value = DEFAULT_API)]
    pub api_listen: SocketAddr,
    /// MQTT listener of the embedded broker.
    #[arg(long, env = "PROPELLER_MQTT_LISTEN", default_value = "127.0.0.1:1883")]
    pub mqtt_listen: SocketAddr,
    /// A TLS listener of the embedded broker too (e.g. 0.0.0.0:8883): devices enrol only
    /// over TLS unless their token allows plain TCP.
    #[arg(long, env = "PROPELLER_MQTT_TLS_LISTEN")]
    pub mqtt_tls_listen: Option<SocketAddr>,
    /// Its certificate chain (PEM); without it and --mqtt-tls-key, a private CA and a
    /// certificate are made once in <data-dir>/tls (devices trust <data-dir>/tls/ca.pem).
    #[arg(long, env = "PROPELLER_MQTT_TLS_CERT", requires = "mqtt_tls_key")]
    pub mqtt_tls_cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, env = "PROPELLER_MQTT_TLS_KEY", requires = "mqtt_tls_cert")]
    pub mqtt_tls_key: Option<PathBuf>,
    /// Names the made certificate is for besides localhost and 127.0.0.1 (the names devices
    /// dial), comma-separated.
    #[arg(long, env = "PROPELLER_MQTT_TLS_NAMES", value_delimiter = ',')]
    pub mqtt_tls_names: Vec<String>,
    /// Devices the embedded broker holds at once; sockets beyond this are closed at once.
    /// Each costs a file descriptor: keep it below `ulimit -n`.
    #[arg(long, env = "PROPELLER_MAX_CONNECTIONS", default_value_t = 10_000)]
    pub max_connections: usize,
    #[command(flatten)]
    pub external: ExternalBrokerArgs,
    #[command(flatten)]
    pub reconcile: ReconcileArgs,
    #[command(flatten)]
    pub images: ImageArgs,
    /// Also start a local proplet, apply the quickstart samples and print their progress
    /// and results (logs then go to a file in the data directory).
    #[arg(long)]
    pub demo: bool,
    /// With --demo: print the logs of propeller and the agent here instead of to files.
    #[arg(short, long)]
    pub verbose: bool,
}

/// Where the client commands find the API.
#[derive(Args, Debug, Clone)]
pub struct ClientArgs {
    /// Address of `propeller standalone`'s API.
    #[arg(long, env = "PROPELLER_API", default_value = DEFAULT_API, global = true)]
    pub server: String,
    /// Data directory of the standalone server (its api-token file is read from there).
    #[arg(
        long,
        env = "PROPELLER_DATA_DIR",
        default_value = "./propeller-data",
        global = true
    )]
    pub data_dir: PathBuf,
    /// The bearer token, instead of reading it from the data directory.
    #[arg(long, env = "PROPELLER_TOKEN", global = true)]
    pub token: Option<String>,
}

impl ClientArgs {
    /// The API client these arguments name.
    pub(crate) fn client(&self) -> anyhow::Result<ApiClient> {
        let token = match &self.token {
            Some(t) => t.clone(),
            None => {
                let path = self.data_dir.join(TOKEN_FILE);
                std::fs::read_to_string(&path)
                    .with_context(|| {
                        format!(
                            "reading the API token {} (start `propeller standalone` first, or pass --token / --data-dir)",
                            path.display()
                        )
                    })?
                    .trim()
                    .to_owned()
            }
        };
        Ok(ApiClient::new(self.server.clone(), token))
    }
}

/// The API token, created (owner-only) on first start.
fn token(dir: &Path) -> anyhow::Result<String> {
    let path = dir.join(TOKEN_FILE);
    if let Ok(existing) = std::fs::read_to_string(&path) {
        return Ok(existing.trim().to_owned());
    }
    let token = super::random::random_hex(24)?;
    propeller_broker::private_file::write_private(&path, token.as_bytes())?;
    Ok(token)
}

/// Runs standalone mode until Ctrl-C.
pub async fn run(cmd: StandaloneCommand) -> anyhow::Result<()> {
    propeller_broker::private_file::create_private_dir(&cmd.data_dir)?;
    let store = ObjectStore::open(&cmd.data_dir)
        .with_context(|| format!("opening the store in {}", cmd.data_dir.display()))?;
    let token = token(&cmd.data_dir)?;
    let logins = Logins {
        proplets: Arc::new(CredentialStore::new()),
        services: CredentialStore::new(),
    };
    let mut tls_ca = None;
    let tls = match cmd.mqtt_tls_listen {
        None => None,
        Some(listen) => {
            let (cert_path, key_path) = match (&cmd.mqtt_tls_cert, &cmd.mqtt_tls_key) {
                (Some(cert), Some(key)) => (cert.clone(), key.clone()),
                _ => {
                    let mut names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
                    names.extend(cmd.mqtt_tls_names.iter().cloned());
                    let files =
                        super::serving_tls::serving_files(&cmd.data_dir.join("tls"), &names)?;
                    tls_ca = Some(files.ca);
                    (files.cert, files.key)
                }
            };
            Some(propeller_broker::server::TlsSettings {
                listen,
                cert_path,
                key_path,
                client_ca_path: None,
            })
        }
    };
    let config = BrokerConfig {
        tcp_listen: Some(cmd.mqtt_listen),
        tls,
        max_connections: cmd.max_connections,
        ..BrokerConfig::default()
    };
    let mut broker = DeviceBroker::start(config, cmd.external.plan(None, None)?, &logins).await?;
    let mqtt = broker
        .device_address()
        .context("the broker has no TCP listener")?;
    let events = broker
        .take_events()
        .context("broker event stream unavailable")?;
    let settings = StandaloneSettings {
        proplet: cmd.reconcile.proplet(),
        task: cmd.reconcile.task(FinalizerTiming::FirstReconcile),
        // A safety net only: each proplet has its own timer for the offline check.
        sweep: cmd
            .reconcile
            .last_seen_threshold
            .max(cmd.reconcile.liveliness_interval),
        logs: cmd.reconcile.logs(),
    };
    let events_log = EventLog::attach(&store);
    let controller_metrics = Arc::new(ControllerMetrics::default());
    // Standalone always runs the controllers.
    controller_metrics.leader.set(1);
    let (driver, queue) = Driver::new(
        store.clone(),
        broker.publisher(),
        settings,
        logins.proplets.clone(),
        controller_metrics.clone(),
        events_log.clone(),
    )
    .context("reading the store")?;
    let images = cmd.images.images(
        &cmd.data_dir.join("images"),
        broker.publisher(),
        Arc::new(StorePullSecrets(store.clone())),
    )?;
    let image_metrics = images.metrics().clone();
    driver.attach_images(images);
    driver.attach_enrolments(propeller_operator::enrolment::STANDALONE_TOKEN_NAMESPACE.to_owned());
    let mut registry = prometheus_client::registry::Registry::with_prefix("propeller");
    controller_metrics.register(&mut registry);
    broker.register(&mut registry);
    store.metrics().register(&mut registry);
    image_metrics.register(&mut registry);
    let metrics: MetricsText = {
        let driver = driver.clone();
        Arc::new(move || {
            driver.count_phases();
            let mut text = String::new();
            if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &registry) {
                tracing::warn!(%e, "cannot encode the metrics");
            }
            text
        })
    };
    let api_listener = tokio::net::TcpListener::bind(cmd.api_listen)
        .await
        .with_context(|| format!("binding the API address {}", cmd.api_listen))?;
    let api_addr = api_listener.local_addr()?;
    let api_state = Arc::new(ApiState {
        store: store.clone(),
        admission: Admission::new(),
        token,
        events: events_log,
        metrics,
        changes: ChangeLog::attach(&store).context("watching the store")?,
        logs: propeller_operator::controller::Cluster::common(&*driver)
            .logs
            .clone(),
    });
    let api_task = tokio::spawn(api::serve(api_listener, api_state.clone()));
    println!("propeller standalone: data in {}", cmd.data_dir.display());
    match broker.listen_addr() {
        Some(addr) => println!("  mqtt listening on {addr}"),
        None => println!("  mqtt: external broker {mqtt}"),
    }
    if let Some(addr) = broker.tls_addr() {
        match &tls_ca {
            Some(ca) => println!(
                "  mqtts listening on {addr} (devices trust {})",
                ca.display()
            ),
            None => println!("  mqtts listening on {addr}"),
        }
    }
    if let Some(addr) = broker.callback_addr() {
        println!("  auth callbacks on http://{addr}");
    }
    println!(
        "  api listening on http://{api_addr} (token in {})",
        cmd.data_dir.join(TOKEN_FILE).display()
    );
    println!(
        "  console on http://{api_addr}{} (sign in with that token)",
        propeller_operator::console::PATH
    );

    let mut agent = None;
    if cmd.demo {
        if !cmd.verbose {
            println!(
                "  logs in {} (-v prints them here)",
                cmd.data_dir.join(super::demo::LOG_FILE).display()
            );
        }
        agent = Some(super::demo::start(&api_state, &mqtt, &cmd.data_dir, cmd.verbose).await?);
        tokio::spawn(super::demo::narrate(
            store.clone(),
            api_addr,
            cmd.data_dir.clone(),
        ));
    }
    let shutdown = async {
        super::signals::terminated().await;
        info!("stopping");
    };
    driver.run(queue, events, shutdown).await;
    if let Some(mut child) = agent {
        let _ = child.kill().await;
    }
    api_task.abort();
    broker.shutdown();
    Ok(())
}

/// `propeller apply -f FILE|DIR|-`.
pub async fn apply(client: &ClientArgs, file: &Path) -> anyhow::Result<()> {
    let mut texts = Vec::new();
    if file == Path::new("-") {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .context("reading the manifest from stdin")?;
        texts.push(("stdin".to_owned(), text));
    } else if file.is_dir() {
        let mut paths: Vec<PathBuf> = std::fs::read_dir(file)
            .with_context(|| format!("reading {}", file.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.extension()
                    .is_some_and(|x| x == "yaml" || x == "yml" || x == "json")
            })
            .collect();
        paths.sort();
        for p in paths {
            let text =
                std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
            texts.push((p.display().to_string(), text));
        }
    } else {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        texts.push((file.display().to_string(), text));
    }
    let api = client.client()?;
    for (source, text) in texts {
        let outcome = api
            .request("POST", "/v1/apply", Some(&text))
            .await
            .with_context(|| format!("applying {source}"))?;
        for o in outcome.as_array().into_iter().flatten() {
            println!(
                "{}/{} {}",
                o["kind"].as_str().unwrap_or_default().to_lowercase(),
                o["name"].as_str().unwrap_or_default(),
                o["action"].as_str().unwrap_or_default()
            );
        }
    }
    Ok(())
}

fn kind_of(typed: &str) -> anyhow::Result<&'static str> {
    canonical_kind(typed).with_context(|| format!("unknown kind {typed:?}"))
}

/// `propeller get KIND [NAME] [-o wide|yaml|json] [-w]`.
pub async fn get(
    client: &ClientArgs,
    kind: &str,
    name: Option<&str>,
    namespace: &str,
    output: Option<&str>,
    watch: bool,
) -> anyhow::Result<()> {
    let kind = kind_of(kind)?;
    if !matches!(output, None | Some("wide" | "yaml" | "json")) {
        bail!(
            "unknown output format {:?}; use wide, yaml or json",
            output.unwrap_or_default()
        );
    }
    let api = client.client()?;
    if watch {
        return watch_objects(&api, kind, name, namespace, output).await;
    }
    let objects: Vec<Value> = match name {
        Some(n) => vec![
            api.request("GET", &format!("/v1/objects/{kind}/{namespace}/{n}"), None)
                .await?,
        ],
        None => api
            .request(
                "GET",
                &format!("/v1/objects/{kind}?namespace={namespace}"),
                None,
            )
            .await?
            .as_array()
            .cloned()
            .unwrap_or_default(),
    };
    let text = match output {
        Some("yaml") => objects
            .iter()
            .map(|o| serde_yaml_ng::to_string(o).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("---\n"),
        Some("json") => {
            let value = if name.is_some() && objects.len() == 1 {
                objects[0].clone()
            } else {
                Value::Array(objects.clone())
            };
            serde_json::to_string_pretty(&value).unwrap_or_default() + "\n"
        }
        _ => table(kind, &objects, output == Some("wide"), chrono::Utc::now()),
    };
    print!("{text}");
    Ok(())
}

/// Prints objects as the watch stream delivers them: the current ones as a table once the
/// initial events end, then one line per change, as `kubectl get -w` does. A dropped
/// connection resumes from the last resourceVersion seen; an expired one lists again.
async fn watch_objects(
    api: &ApiClient,
    kind: &str,
    name: Option<&str>,
    namespace: &str,
    output: Option<&str>,
) -> anyhow::Result<()> {
    use std::io::Write as _;
    let wide = output == Some("wide");
    let mut from: Option<String> = None;
    let mut initial: Vec<Value> = Vec::new();
    let mut listing = true;
    let mut widths: Vec<usize> = Vec::new();
    loop {
        let mut path = format!("/v1/watch/{kind}?namespace={namespace}");
        if let Some(n) = name {
            path.push_str(&format!("&name={n}"));
        }
        if let Some(v) = &from {
            path.push_str(&format!("&resourceVersion={v}"));
        }
        let mut stream = match api.stream(&path).await {
            Ok(stream) => stream,
            Err(e @ propeller_operator::standalone::client::ClientError::Connect { .. })
                if from.is_some() =>
            {
                eprintln!("{e}; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        while let Some(line) = stream.next_line().await? {
            let event: Value = serde_json::from_str(&line)
                .with_context(|| format!("watch event is not JSON: {line}"))?;
            let object = &event["object"];
            if let Some(v) = object["metadata"]["resourceVersion"].as_str() {
                from = Some(v.to_owned());
            }
            match event["type"].as_str().unwrap_or_default() {
                "BOOKMARK" => {
                    let end = &object["metadata"]["annotations"][INITIAL_EVENTS_END];
                    if listing && end == "true" {
                        listing = false;
                        let now = chrono::Utc::now();
                        match output {
                            Some("json" | "yaml") => {
                                for o in &initial {
                                    print!("{}", render_one(o, output));
                                }
                            }
                            _ => {
                                let rows = table_cells(kind, &initial, wide, now);
                                widths = column_widths(&rows);
                                print!("{}", render_rows(&rows, &widths));
                            }
                        }
                        initial.clear();
                        let _ = std::io::stdout().flush();
                    }
                }
                "ERROR" if object["code"] == 410 => {
                    eprintln!("watch expired ({}); listing again", object["message"]);
                    from = None;
                    listing = true;
                    break;
                }
                "ERROR" => bail!("watch failed: {}", object["message"]),
                _ if listing => initial.push(object.clone()),
                _ => {
                    let text = match output {
                        Some("json" | "yaml") => render_one(object, output),
                        _ => {
                            let rows = table_cells(
                                kind,
                                std::slice::from_ref(object),
                                wide,
                                chrono::Utc::now(),
                            );
                            render_rows(&rows[1..], &widths)
                        }
                    };
                    print!("{text}");
                    let _ = std::io::stdout().flush();
                }
            }
        }
        eprintln!("watch connection closed; reconnecting");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

fn render_one(object: &Value, output: Option<&str>) -> String {
    match output {
        Some("yaml") => format!(
            "---\n{}",
            serde_yaml_ng::to_string(object).unwrap_or_default()
        ),
        _ => serde_json::to_string_pretty(object).unwrap_or_default() + "\n",
    }
}

/// `propeller describe KIND NAME`.
pub async fn describe_one(
    client: &ClientArgs,
    kind: &str,
    name: &str,
    namespace: &str,
) -> anyhow::Result<()> {
    let kind = kind_of(kind)?;
    let api = client.client()?;
    let obj = api
        .request(
            "GET",
            &format!("/v1/objects/{kind}/{namespace}/{name}"),
            None,
        )
        .await?;
    let events = api
        .request(
            "GET",
            &format!("/v1/events/{kind}/{namespace}/{name}"),
            None,
        )
        .await?;
    print!(
        "{}",
        describe(
            &obj,
            events.as_array().map(Vec::as_slice).unwrap_or_default()
        )
    );
    Ok(())
}

/// `propeller delete KIND NAME`.
pub async fn delete(
    client: &ClientArgs,
    kind: &str,
    name: &str,
    namespace: &str,
) -> anyhow::Result<()> {
    let kind = kind_of(kind)?;
    let outcome = client
        .client()?
        .request(
            "DELETE",
            &format!("/v1/objects/{kind}/{namespace}/{name}"),
            None,
        )
        .await?;
    println!(
        "{}/{} {}",
        kind.to_lowercase(),
        name,
        outcome["outcome"].as_str().unwrap_or("deleted")
    );
    if outcome["outcome"].as_str().is_some_and(|o| o != "deleted") {
        warn!("the object waits for its controller to finish cleaning up");
    }
    Ok(())
}
