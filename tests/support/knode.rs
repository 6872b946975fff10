//! A real single-node Kubernetes cluster for the in-cluster tests: `node-up.sh` from
//! `../shared/envtest/node` (kubelet, containerd, kube-proxy, cluster DNS beside the API
//! server), started fresh for each run and stopped by pid.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::repo_root;

/// The longest a node may live: a test that hangs does not keep it past this.
const LIFETIME: Duration = Duration::from_secs(40 * 60);

/// The node kit directory (`$KNODE_HOME` or `../shared/envtest/node`).
pub fn kit() -> PathBuf {
    std::env::var_os("KNODE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("../shared/envtest/node"))
}

/// Why this machine cannot start a node, if it cannot.
pub fn unavailable() -> Option<String> {
    let kit = kit();
    if !kit.join("node-up.sh").is_file() {
        return Some(format!("no node kit at {}", kit.display()));
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("the node needs root (bridges, cgroups, iptables)".into());
    }
    for tool in ["containerd", "runc", "dnsmasq", "etcd", "kubectl", "ctr"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            return Some(format!(
                "{tool} is missing (scripts/test.sh installs the node's packages)"
            ));
        }
    }
    None
}

/// A running node; stopped (and its host state removed) when dropped.
pub struct Node {
    child: Child,
    pub kubeconfig: PathBuf,
    pub work_dir: PathBuf,
    pub node_ip: String,
    pub started_in: Duration,
}

impl Node {
    /// Starts a node and waits until it is Ready (node-up.sh's own wait).
    pub fn start() -> Self {
        let began = Instant::now();
        let mut cmd = Command::new("timeout");
        cmd.arg("--signal=TERM")
            .arg(LIFETIME.as_secs().to_string())
            .arg(kit().join("node-up.sh"))
            .env("ENVTEST_DIR", repo_root().join("../shared/envtest"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // SIGTERM, not SIGKILL, if the test process dies: node-up.sh then removes its
        // bridge, rules and mounts.
        super::envtest::pdeathsig_with(&mut cmd, libc::SIGTERM);
        let mut child = cmd.spawn().expect("start node-up.sh");
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("{line}");
                if let Some(path) = line.strip_prefix("export KUBECONFIG=") {
                    let _ = tx.send(PathBuf::from(path));
                }
            }
        });
        let kubeconfig = match rx.recv_timeout(Duration::from_secs(240)) {
            Ok(path) => path,
            Err(_) => {
                let _ = child.kill();
                panic!("the node was not Ready within 240 s (node-up.sh output above)");
            }
        };
        let work_dir = kubeconfig.parent().expect("work dir").to_path_buf();
        let mut node = Node {
            child,
            kubeconfig,
            work_dir,
            node_ip: String::new(),
            started_in: began.elapsed(),
        };
        node.node_ip = node.kubectl_ok(&[
            "get",
            "node",
            "-o",
            "jsonpath={.items[0].status.addresses[?(@.type==\"InternalIP\")].address}",
        ]);
        node
    }

    /// containerd's socket.
    pub fn containerd_socket(&self) -> PathBuf {
        self.work_dir.join("containerd/containerd.sock")
    }

    /// Imports a `docker save` archive into the node's image store.
    pub fn import_image(&self, archive: &Path) {
        let out = Command::new("ctr")
            .arg("-a")
            .arg(self.containerd_socket())
            .args(["-n", "k8s.io", "images", "import"])
            .arg(archive)
            .output()
            .expect("run ctr");
        assert!(
            out.status.success(),
            "ctr import {}: {}",
            archive.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub fn kubectl(&self) -> Command {
        let mut cmd = Command::new("kubectl");
        cmd.env("KUBECONFIG", &self.kubeconfig);
        cmd
    }

    /// Runs kubectl; panics with its output unless it succeeds; stdout trimmed.
    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        let out = self.kubectl().args(args).output().expect("run kubectl");
        assert!(
            out.status.success(),
            "kubectl {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// Runs kubectl with `input` on stdin.
    pub fn kubectl_stdin(&self, args: &[&str], input: &str) -> Output {
        let mut cmd = self.kubectl();
        cmd.args(args);
        super::envtest::output_with_input(cmd, input)
    }

    /// Applies a manifest given as text; panics on failure.
    pub fn apply(&self, manifest: &str) {
        let out = self.kubectl_stdin(&["apply", "-f", "-"], manifest);
        assert!(
            out.status.success(),
            "kubectl apply: {}{}\n{manifest}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Polls `jsonpath` of an object until `accept` takes it; its value, or a panic naming
    /// the last value after `limit`.
    pub fn wait_for(
        &self,
        object: &[&str],
        jsonpath: &str,
        limit: Duration,
        accept: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + limit;
        let mut last;
        loop {
            let mut args = vec!["get"];
            args.extend_from_slice(object);
            let path = format!("jsonpath={jsonpath}");
            args.extend(["-o", &path]);
            let out = self.kubectl().args(&args).output().expect("run kubectl");
            if out.status.success() {
                last = String::from_utf8_lossy(&out.stdout).trim().to_owned();
                if accept(&last) {
                    return last;
                }
            } else {
                last = String::from_utf8_lossy(&out.stderr).trim().to_owned();
            }
            assert!(
                Instant::now() < deadline,
                "{} {jsonpath}: still {last:?} after {limit:?}",
                object.join(" ")
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// The logs of a component (`kubelet`, `containerd`, ...), for failure messages.
    pub fn log_tail(&self, component: &str, lines: usize) -> String {
        let text = std::fs::read_to_string(self.work_dir.join(format!("logs/{component}.log")))
            .unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // SIGTERM to `timeout`, which passes it on; node-up.sh then cleans up its host
        // state (1-20 s). SIGKILL only if that hangs: it would leave the state behind.
        // SAFETY: kill on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(90);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
