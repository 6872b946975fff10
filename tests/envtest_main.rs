//! `propeller-envtest`: a local Kubernetes control plane (etcd, kube-apiserver, optionally
//! kube-controller-manager) for trying the operator and for the Kubernetes-mode benchmarks,
//! from the same harness the tests use. It installs the CRDs, the `propeller-system`
//! namespace, the operator's ServiceAccount and `configs/rbac`, writes the kubeconfig of a
//! cluster admin to `<dir>/admin.kubeconfig` and runs until it is interrupted.

#[path = "support/envtest.rs"]
mod envtest;
#[path = "support/signal.rs"]
mod signal;

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Parser;
use envtest::{ControlPlane, Options};

/// Starts a local control plane and keeps it running until Ctrl-C or SIGTERM.
#[derive(Parser, Debug)]
struct Args {
    /// Where to write the kubeconfigs (created if missing).
    #[arg(long, default_value = "envtest")]
    dir: PathBuf,
    /// Also run kube-controller-manager (garbage collection, Jobs, Deployments).
    #[arg(long)]
    controller_manager: bool,
    /// Turn on the API server's sharded list and watch (for `propeller run --sharded-watches`).
    #[arg(long)]
    sharded_list_and_watch: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // A kubeconfig left by an earlier run would look ready before this one is.
    let _ = std::fs::remove_file(args.dir.join("admin.kubeconfig"));
    let Some(cp) = ControlPlane::start(Options {
        controller_manager: args.controller_manager,
        sharded_list_and_watch: args.sharded_list_and_watch,
    }) else {
        bail!("no control-plane binaries (see the line above)");
    };
    cp.install_crds();
    cp.install_operator_rbac();
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let admin = args.dir.join("admin.kubeconfig");
    std::fs::copy(&cp.admin_kubeconfig, &admin).context("writing the admin kubeconfig")?;
    // The kubeconfig names the control plane's CA inside its temporary directory.
    println!("control plane ready at {}", cp.url);
    println!("admin kubeconfig: {}", admin.display());
    println!("stop with Ctrl-C");
    signal::wait_for_signal();
    drop(cp);
    let _ = std::fs::remove_file(admin);
    Ok(())
}
