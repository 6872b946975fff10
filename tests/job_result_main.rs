//! `propeller-job-result`: the workload of the in-cluster tests' Job pods. It reports a
//! result the way a user's container may (each of the places the operator reads a `k8s`
//! task's result from), then exits with the code it is told, or outlives a deadline.
//!
//!   propeller-job-result SOURCE VALUE [--exit CODE] [--sleep SECONDS]
//!
//! SOURCE: job-annotation, pod-annotation, configmap, secret (the Job's `<job>-result`
//! object, key `result`), termination-message, or none. The Job is the pod's `job-name`
//! label; the namespace and credentials are the pod's ServiceAccount's.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams, PostParams};

const RESULT_ANNOTATION: &str = "propeller.propeller.absmach.eu/result";

#[derive(Parser, Debug)]
struct Args {
    /// Where to put the result.
    #[arg(value_parser = ["job-annotation", "pod-annotation", "configmap", "secret", "termination-message", "none"])]
    source: String,
    /// The result.
    value: String,
    /// Exit code after reporting.
    #[arg(long, default_value_t = 0)]
    exit: i32,
    /// Seconds to sleep after reporting, before exiting.
    #[arg(long, default_value_t = 0)]
    sleep: u64,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    rustls::crypto::ring::default_provider()
        .install_default()
        .map_err(|_| anyhow::anyhow!("a TLS provider was already installed"))?;
    if args.source == "termination-message" {
        std::fs::write("/dev/termination-log", &args.value)
            .context("writing /dev/termination-log")?;
    } else if args.source != "none" {
        report(&args.source, &args.value).await?;
    }
    if args.sleep > 0 {
        // As PID 1 the process has no default SIGTERM action: stop on it, as a workload
        // should, instead of waiting out the pod's grace period.
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("SIGTERM handler")?;
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(args.sleep)) => {}
            _ = term.recv() => std::process::exit(143),
        }
    }
    std::process::exit(args.exit);
}

async fn report(source: &str, value: &str) -> anyhow::Result<()> {
    let client = kube::Client::try_default()
        .await
        .context("in-cluster configuration")?;
    let namespace = client.default_namespace().to_owned();
    let pod_name = std::env::var("HOSTNAME").context("HOSTNAME (the pod's name) is unset")?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let pod = pods.get(&pod_name).await.context("reading my pod")?;
    let Some(job) = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get("job-name"))
        .cloned()
    else {
        bail!("pod {pod_name} has no job-name label: not run by a Job");
    };
    let annotate = serde_json::json!({"metadata": {"annotations": {RESULT_ANNOTATION: value}}});
    let params = PatchParams::default();
    let object = |name: String| ObjectMeta {
        name: Some(name),
        namespace: Some(namespace.clone()),
        ..ObjectMeta::default()
    };
    let entry = BTreeMap::from([("result".to_owned(), value.to_owned())]);
    match source {
        "job-annotation" => {
            let jobs: Api<Job> = Api::namespaced(client, &namespace);
            jobs.patch(&job, &params, &Patch::Merge(&annotate))
                .await
                .context("annotating the Job")?;
        }
        "pod-annotation" => {
            pods.patch(&pod_name, &params, &Patch::Merge(&annotate))
                .await
                .context("annotating the pod")?;
        }
        "configmap" => {
            let maps: Api<ConfigMap> = Api::namespaced(client, &namespace);
            let map = ConfigMap {
                metadata: object(format!("{job}-result")),
                data: Some(entry),
                ..ConfigMap::default()
            };
            maps.create(&PostParams::default(), &map)
                .await
                .context("creating the result ConfigMap")?;
        }
        "secret" => {
            let secrets: Api<Secret> = Api::namespaced(client, &namespace);
            let secret = Secret {
                metadata: object(format!("{job}-result")),
                string_data: Some(entry),
                ..Secret::default()
            };
            secrets
                .create(&PostParams::default(), &secret)
                .await
                .context("creating the result Secret")?;
        }
        other => bail!("unknown result source {other}"),
    }
    Ok(())
}
