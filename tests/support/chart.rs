//! The chart installed on a real node (`knode`) as users install it: the images built from
//! our Dockerfiles, helm and kubectl run in a scratch workspace with the book's steps, and
//! the stages of a long test printed with their times.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::image;
use super::knode::{self, Node};
use super::repo_root;

/// The namespace the book installs the chart in.
pub const NAMESPACE: &str = "propeller-system";
/// The Job pods' workload image.
pub const RESULT_WORKLOAD: &str = "localhost/propeller-job-result:t1";

/// The commands between `<!-- in-cluster:NAME:begin -->` and its end marker in the book.
pub fn readme_steps(name: &str) -> String {
    super::doc_blocks(&format!("in-cluster:{name}")).concat()
}

/// Where helm and kubectl run: a scratch directory that sees the repository's `configs/`.
pub struct Workspace {
    dir: tempfile::TempDir,
    helm: PathBuf,
}

impl Workspace {
    pub fn new(helm: PathBuf) -> Self {
        let dir = tempfile::tempdir().expect("scratch dir");
        std::os::unix::fs::symlink(repo_root().join("configs"), dir.path().join("configs"))
            .expect("link configs");
        Workspace { dir, helm }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Runs shell commands (the book's steps) with kubectl, helm and propeller on the node.
    pub fn run(&self, node: &Node, script: &str) -> String {
        self.run_with(node, script, false)
    }

    /// [`Workspace::run`], printing when each command began (bash's trace, seconds since
    /// the epoch) to show where the time went.
    pub fn run_timed(&self, node: &Node, script: &str) -> String {
        self.run_with(node, script, true)
    }

    fn run_with(&self, node: &Node, script: &str, timed: bool) -> String {
        let traced;
        let script = if timed {
            traced = format!("PS4='+ $EPOCHREALTIME '\nset -x\n{script}\nset +x");
            &traced
        } else {
            script
        };
        let helm_dir = self.helm.parent().expect("helm dir");
        // helm, then propeller and proplet as built for this run, then the system's tools.
        let path = format!(
            "{}:{}:{}",
            helm_dir.display(),
            bin_dir().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let home = self.path().join("helm-home");
        let out = Command::new("bash")
            .args(["-euo", "pipefail", "-c", script])
            .current_dir(self.path())
            .env("KUBECONFIG", &node.kubeconfig)
            .env("PATH", path)
            .env("HELM_CACHE_HOME", home.join("cache"))
            .env("HELM_CONFIG_HOME", home.join("config"))
            .env("HELM_DATA_HOME", home.join("data"))
            .output()
            .expect("run bash");
        assert!(
            out.status.success(),
            "these steps failed:\n{script}\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if timed {
            for line in String::from_utf8_lossy(&out.stderr).lines() {
                if line.starts_with("+ ") {
                    eprintln!("{line}");
                }
            }
        }
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }
}

/// A stage of the run, printed with its duration.
pub fn stage<T>(name: &str, f: impl FnOnce() -> T) -> T {
    eprintln!("=== {name}");
    let began = Instant::now();
    let value = f();
    eprintln!("=== {name}: done in {:.1} s", began.elapsed().as_secs_f64());
    value
}

/// The directory of the binaries this test run uses (`target/debug`).
pub fn bin_dir() -> PathBuf {
    let mut dir = std::env::current_exe().expect("test path");
    dir.pop();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir
}

/// Builds the three images from the binaries the test run uses and imports them.
pub fn build_images(node: &Node, scratch: &Path) {
    let kit = knode::kit();
    let bin = |name: &str| bin_dir().join(name);
    let empty = scratch.join("empty-dir");
    std::fs::create_dir_all(&empty).expect("empty dir");
    let images: [(&str, &str, BTreeMap<&str, PathBuf>); 2] = [
        (
            "configs/docker/propeller.Dockerfile",
            "localhost/propeller:t1",
            BTreeMap::from([("/out/propeller", bin("propeller"))]),
        ),
        (
            "configs/docker/proplet.Dockerfile",
            "localhost/proplet:t1",
            BTreeMap::from([("/out/proplet", bin("proplet")), ("/out/state", empty)]),
        ),
    ];
    for (dockerfile, reference, sources) in images {
        let archive = scratch.join(format!("{}.tar", reference.replace(['/', ':'], "_")));
        image::build(
            &kit,
            &repo_root().join(dockerfile),
            &sources,
            reference,
            &archive,
        )
        .unwrap_or_else(|e| panic!("building {reference}: {e}"));
        node.import_image(&archive);
        let _ = std::fs::remove_file(&archive);
    }
    // The Job pods' workload: a test program, not one of ours to ship.
    let archive = scratch.join("job-result.tar");
    image::build_program(
        &kit,
        &bin("propeller-job-result"),
        RESULT_WORKLOAD,
        &archive,
    )
    .unwrap_or_else(|e| panic!("building {RESULT_WORKLOAD}: {e}"));
    node.import_image(&archive);
}

/// One line per operator pod, oldest first, of `fields` (a jsonpath within an item, e.g.
/// `{.metadata.name} {.status.podIP}`).
fn operator_pod_lines(node: &Node, fields: &str) -> Vec<String> {
    node.kubectl_ok(&[
        "-n",
        NAMESPACE,
        "get",
        "pods",
        "-l",
        "app.kubernetes.io/component=operator",
        "--sort-by=.metadata.creationTimestamp",
        "-o",
        &format!("jsonpath={{range .items[*]}}{fields}{{\"\\n\"}}{{end}}"),
    ])
    .lines()
    .map(str::to_owned)
    .collect()
}

/// The pod names of the operator, newest first.
pub fn operator_pods(node: &Node) -> Vec<String> {
    let mut names = operator_pod_lines(node, "{.metadata.name}");
    names.reverse();
    names
}

/// The operator pods' IP addresses by pod name (pods without one yet left out).
pub fn operator_pod_ips(node: &Node) -> BTreeMap<String, String> {
    operator_pod_lines(node, "{.metadata.name} {.status.podIP}")
        .into_iter()
        .filter_map(|l| {
            let (name, ip) = l.split_once(' ')?;
            (!ip.is_empty()).then(|| (name.to_owned(), ip.to_owned()))
        })
        .collect()
}

/// The workspace and a started node with our images, or `None` (after one SKIPPED line)
/// without the node kit, root or helm outside CI; under `CI=true` those are failures.
pub fn node_with_images() -> Option<(Workspace, Node)> {
    if let Some(why) = knode::unavailable() {
        assert!(
            std::env::var("CI").is_err(),
            "CI=true needs the in-cluster suite: {why}"
        );
        eprintln!("SKIPPED: {why}");
        return None;
    }
    let Some(helm) = super::envtest::helm_binary() else {
        assert!(std::env::var("CI").is_err(), "CI=true needs helm");
        eprintln!("SKIPPED: no helm (neither on PATH nor ../shared/envtest/helm.xz)");
        return None;
    };
    let work = Workspace::new(helm);
    let node = stage("node up", Node::start);
    eprintln!("node Ready after {:.1} s", node.started_in.as_secs_f64());
    stage("images from the Dockerfiles", || {
        build_images(&node, work.path())
    });
    Some((work, node))
}

/// Waits up to `limit` until nothing of the release is left in its namespace (pods included:
/// they take up to their grace period to go), then checks that its cluster-wide RBAC is gone.
pub fn assert_release_gone(node: &Node, limit: Duration) {
    let began = Instant::now();
    loop {
        let left = node.kubectl_ok(&[
            "get",
            "deployments,services,serviceaccounts,roles,rolebindings,configmaps,secrets,leases,poddisruptionbudgets,pods",
            "-n",
            NAMESPACE,
            "-o",
            "name",
        ]);
        let left: Vec<&str> = left
            .lines()
            .filter(|l| {
                // Kubernetes' own: every namespace has these.
                !l.ends_with("/default")
                    && !l.ends_with("/kube-root-ca.crt")
                    && !l.contains("openshift-service-ca")
            })
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(began.elapsed() < limit, "left in {NAMESPACE}: {left:?}");
        std::thread::sleep(Duration::from_millis(500));
    }
    let cluster_wide = node.kubectl_ok(&[
        "get",
        "clusterroles,clusterrolebindings",
        "-l",
        "app.kubernetes.io/instance=propeller",
        "-o",
        "name",
    ]);
    assert!(cluster_wide.is_empty(), "left: {cluster_wide}");
}
