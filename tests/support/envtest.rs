#![allow(dead_code)]
//! A real Kubernetes control plane for tests: etcd and kube-apiserver (and, when asked,
//! kube-controller-manager) on ephemeral loopback ports, the kubebuilder "envtest" idea.
//!
//! Binaries come from the directory named by `KUBEBUILDER_ASSETS` (`kube-apiserver`, `etcd`,
//! optionally `kube-controller-manager`), else from the xz-compressed assets in
//! `../shared/envtest/` beside the repository, unpacked once into `target/envtest-assets/`.
//! etcd falls back to Debian's `/usr/bin/etcd`. Without assets a test is skipped with one
//! line saying how to enable it; with `CI=true` a missing asset fails the test instead.
//!
//! Every process is killed when the [`ControlPlane`] is dropped (also on panic) and, through
//! `PR_SET_PDEATHSIG`, when the test process dies, so nothing outlives its test. The test
//! admin authenticates with a static token in the group `system:masters`; other identities
//! (the operator's ServiceAccount) get kubeconfigs of their own.

use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// How long etcd and the API server get to answer `/readyz`.
const START_TIMEOUT: Duration = Duration::from_secs(90);
/// Starts tried before giving up when another process took one of the chosen ports.
const LAUNCH_ATTEMPTS: usize = 5;
const ADMIN_TOKEN: &str = "envtest-admin-token";
const CONTROLLER_MANAGER_TOKEN: &str = "envtest-controller-manager-token";

/// What a test needs besides etcd and the API server.
#[derive(Clone, Copy, Default)]
pub struct Options {
    /// Also run kube-controller-manager (garbage collector, namespace, Job, Deployment,
    /// ReplicaSet and ServiceAccount controllers).
    pub controller_manager: bool,
    /// Turn on kube-apiserver's sharded list and watch (feature gate `ShardedListAndWatch`,
    /// alpha in 1.36), for `propeller run --sharded-watches`.
    pub sharded_list_and_watch: bool,
}

/// Why a control plane did not come up; a taken port is worth another try on other ports.
enum StartFailure {
    PortTaken(String),
    Other(String),
}

/// Paths of the control-plane binaries.
struct Assets {
    apiserver: PathBuf,
    etcd: PathBuf,
    controller_manager: Option<PathBuf>,
}

/// A running control plane; everything stops when it is dropped.
pub struct ControlPlane {
    processes: Vec<(&'static str, Child)>,
    /// `https://127.0.0.1:<port>` of the API server.
    pub url: String,
    /// Kubeconfig of the test admin (`system:masters`).
    pub admin_kubeconfig: PathBuf,
    ca_path: PathBuf,
    dir: tempfile::TempDir,
}

impl ControlPlane {
    /// Starts a control plane, or returns `None` (after printing why) when the assets are
    /// missing outside CI. Panics when anything fails to start.
    pub fn start(options: Options) -> Option<Self> {
        let assets = match find_assets(options) {
            Ok(assets) => assets,
            Err(why) => {
                if std::env::var("CI").is_ok_and(|v| v == "true") {
                    panic!("real-cluster tests cannot be skipped in CI: {why}");
                }
                eprintln!(
                    "SKIPPED (no Kubernetes control plane): {why}. Set KUBEBUILDER_ASSETS to a \
                     directory with kube-apiserver and etcd, or keep ../shared/envtest beside \
                     the repository and install etcd (apt-get install etcd-server)."
                );
                return None;
            }
        };
        for attempt in 1.. {
            match Self::launch(&assets, options) {
                Ok(plane) => return Some(plane),
                Err(StartFailure::PortTaken(why)) if attempt < LAUNCH_ATTEMPTS => {
                    eprintln!("control plane start {attempt}: {why}; again on other ports");
                }
                Err(StartFailure::PortTaken(why) | StartFailure::Other(why)) => panic!("{why}"),
            }
        }
        unreachable!("the loop returns or panics")
    }

    fn launch(assets: &Assets, options: Options) -> Result<Self, StartFailure> {
        // etcd's fsyncs are the slowest part of the API server; a RAM disk when there is one.
        let base = Path::new("/dev/shm");
        let dir = if base.is_dir() {
            tempfile::Builder::new().prefix("envtest-").tempdir_in(base)
        } else {
            tempfile::Builder::new().prefix("envtest-").tempdir()
        }
        .expect("control plane temp dir");
        let root = dir.path().to_path_buf();
        let (etcd_client, etcd_peer, api_port) = (free_port(), free_port(), free_port());

        let (ca_pem, cert_pem, key_pem) = serving_certificate();
        let ca_path = write(&root, "ca.crt", &ca_pem);
        let cert_path = write(&root, "apiserver.crt", &cert_pem);
        let key_path = write(&root, "apiserver.key", &key_pem);
        let sa_key = rcgen::KeyPair::generate().expect("service-account key");
        let sa_key_path = write(&root, "service-account.key", &sa_key.serialize_pem());
        let sa_pub_path = write(&root, "service-account.pub", &sa_key.public_key_pem());
        let tokens = write(
            &root,
            "tokens.csv",
            &format!(
                "{ADMIN_TOKEN},envtest-admin,1,\"system:masters\"\n\
                 {CONTROLLER_MANAGER_TOKEN},system:kube-controller-manager,2\n"
            ),
        );

        let mut plane = ControlPlane {
            processes: Vec::new(),
            url: format!("https://127.0.0.1:{api_port}"),
            admin_kubeconfig: root.join("admin.kubeconfig"),
            ca_path,
            dir,
        };
        plane.write_kubeconfig(&plane.admin_kubeconfig.clone(), ADMIN_TOKEN, "default");

        let etcd_url = format!("http://127.0.0.1:{etcd_client}");
        let peer_url = format!("http://127.0.0.1:{etcd_peer}");
        let mut etcd = Command::new(&assets.etcd);
        etcd.arg("--name=envtest")
            .arg(format!("--data-dir={}", root.join("etcd").display()))
            .arg(format!("--listen-client-urls={etcd_url}"))
            .arg(format!("--advertise-client-urls={etcd_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=envtest={peer_url}"));
        plane.spawn("etcd", etcd);

        let mut apiserver = Command::new(&assets.apiserver);
        apiserver
            .arg(format!("--etcd-servers={etcd_url}"))
            .arg("--bind-address=127.0.0.1")
            .arg("--advertise-address=127.0.0.1")
            .arg(format!("--secure-port={api_port}"))
            .arg("--endpoint-reconciler-type=none")
            .arg(format!("--cert-dir={}", root.join("certs").display()))
            .arg(format!("--tls-cert-file={}", cert_path.display()))
            .arg(format!("--tls-private-key-file={}", key_path.display()))
            .arg(format!("--client-ca-file={}", plane.ca_path.display()))
            .arg(format!("--token-auth-file={}", tokens.display()))
            .arg("--authorization-mode=RBAC")
            .arg(format!(
                "--service-account-key-file={}",
                sa_pub_path.display()
            ))
            .arg(format!(
                "--service-account-signing-key-file={}",
                sa_key_path.display()
            ))
            .arg("--service-account-issuer=https://kubernetes.default.svc")
            .arg("--service-cluster-ip-range=10.96.0.0/16");
        if options.sharded_list_and_watch {
            apiserver.arg("--feature-gates=ShardedListAndWatch=true");
        }
        plane.spawn("kube-apiserver", apiserver);
        plane.wait_ready()?;

        if options.controller_manager {
            let binary = assets
                .controller_manager
                .as_ref()
                .expect("find_assets checked the controller manager");
            let kubeconfig = root.join("controller-manager.kubeconfig");
            plane.write_kubeconfig(&kubeconfig, CONTROLLER_MANAGER_TOKEN, "kube-system");
            let mut cm = Command::new(binary);
            cm.arg(format!("--kubeconfig={}", kubeconfig.display()))
                .arg("--leader-elect=false")
                .arg("--bind-address=127.0.0.1")
                .arg(format!("--secure-port={}", free_port()))
                .arg(format!("--cert-dir={}", root.join("cm-certs").display()))
                .arg(format!(
                    "--service-account-private-key-file={}",
                    sa_key_path.display()
                ))
                .arg(format!("--root-ca-file={}", plane.ca_path.display()))
                .arg("--use-service-account-credentials=true")
                .arg(
                    "--controllers=garbagecollector,namespace,job,deployment,replicaset,\
                     serviceaccount-token,serviceaccount",
                );
            plane.spawn("kube-controller-manager", cm);
        }
        Ok(plane)
    }

    fn spawn(&mut self, name: &'static str, mut cmd: Command) {
        let log = std::fs::File::create(self.dir.path().join(format!("{name}.log")))
            .expect("control plane log file");
        let log_err = log.try_clone().expect("log file handle");
        cmd.stdin(Stdio::null()).stdout(log).stderr(log_err);
        pdeathsig(&mut cmd);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        self.processes.push((name, child));
    }

    /// The last lines a control-plane process logged, for failure messages.
    pub fn log_tail(&self, name: &str) -> String {
        let text = std::fs::read_to_string(self.dir.path().join(format!("{name}.log")))
            .unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    fn wait_ready(&mut self) -> Result<(), StartFailure> {
        let started = Instant::now();
        loop {
            let out = self.kubectl().args(["get", "--raw", "/readyz"]).output();
            if out.as_ref().is_ok_and(|o| o.status.success()) {
                return Ok(());
            }
            for (name, child) in &mut self.processes {
                if let Ok(Some(status)) = child.try_wait() {
                    let name = *name;
                    let log = self.log_tail(name);
                    let why = format!("{name} exited ({status}):\n{log}");
                    return Err(if log.contains("address already in use") {
                        StartFailure::PortTaken(why)
                    } else {
                        StartFailure::Other(why)
                    });
                }
            }
            if started.elapsed() > START_TIMEOUT {
                return Err(StartFailure::Other(format!(
                    "kube-apiserver not ready within {START_TIMEOUT:?}:\n{}",
                    self.log_tail("kube-apiserver")
                )));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Writes a kubeconfig for a bearer token with `namespace` as its default.
    pub fn write_kubeconfig(&self, path: &Path, token: &str, namespace: &str) {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: envtest\n  cluster:\n    \
             server: {}\n    certificate-authority: {}\nusers:\n- name: user\n  user:\n    \
             token: {token}\ncontexts:\n- name: envtest\n  context:\n    cluster: envtest\n    \
             user: user\n    namespace: {namespace}\ncurrent-context: envtest\n",
            self.url,
            self.ca_path.display()
        );
        std::fs::write(path, text).expect("write kubeconfig");
    }

    /// A kubeconfig for `serviceaccount` in `namespace`, with a token from the TokenRequest
    /// API: the identity a Pod of that account would have.
    pub fn service_account_kubeconfig(&self, namespace: &str, serviceaccount: &str) -> PathBuf {
        let token = self.kubectl_ok(&[
            "-n",
            namespace,
            "create",
            "token",
            serviceaccount,
            "--duration=2h",
        ]);
        let path = self
            .dir
            .path()
            .join(format!("{namespace}-{serviceaccount}.kubeconfig"));
        self.write_kubeconfig(&path, token.trim(), namespace);
        path
    }

    /// `kubectl` as the test admin.
    pub fn kubectl(&self) -> Command {
        let mut cmd = Command::new("kubectl");
        cmd.arg("--kubeconfig").arg(&self.admin_kubeconfig);
        cmd.current_dir(repo_root());
        cmd
    }

    /// Runs `kubectl` as the admin; its stdout, or a panic with its stderr.
    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        let out = self.kubectl().args(args).output().expect("run kubectl");
        assert!(
            out.status.success(),
            "kubectl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs `kubectl` as the admin with `input` on stdin.
    pub fn kubectl_stdin(&self, args: &[&str], input: &str) -> Output {
        let mut cmd = self.kubectl();
        cmd.args(args);
        output_with_input(cmd, input)
    }

    /// Installs the CRDs from `configs/crd` and waits until the API serves them.
    pub fn install_crds(&self) {
        self.kubectl_ok(&["apply", "--server-side", "-k", "configs/crd"]);
        self.kubectl_ok(&[
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd",
            "--all",
        ]);
    }

    /// What the operator needs besides the CRDs: the `propeller-system` namespace, its
    /// ServiceAccount and the RBAC of `configs/rbac`.
    pub fn install_operator_rbac(&self) {
        self.kubectl_ok(&[
            "apply",
            "-f",
            "configs/deploy/namespace.yaml",
            "-f",
            "configs/deploy/service_account.yaml",
        ]);
        self.kubectl_ok(&["apply", "-k", "configs/rbac"]);
    }

    /// A directory for the test's own files, removed with the control plane.
    pub fn scratch(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        // Newest first: the controller manager and the API server before etcd.
        for (_, child) in self.processes.iter_mut().rev() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn find_assets(options: Options) -> Result<Assets, String> {
    let dir = match std::env::var_os("KUBEBUILDER_ASSETS") {
        Some(dir) => PathBuf::from(dir),
        None => unpack_shared_assets()?,
    };
    let apiserver = dir.join("kube-apiserver");
    if !apiserver.is_file() {
        return Err(format!("{} not found", apiserver.display()));
    }
    let etcd = [dir.join("etcd"), PathBuf::from("/usr/bin/etcd")]
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| format!("no etcd in {} nor /usr/bin/etcd", dir.display()))?;
    let controller_manager = Some(dir.join("kube-controller-manager")).filter(|p| p.is_file());
    if options.controller_manager && controller_manager.is_none() {
        return Err(format!("no kube-controller-manager in {}", dir.display()));
    }
    if Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_err()
    {
        return Err("kubectl is not on PATH".into());
    }
    Ok(Assets {
        apiserver,
        etcd,
        controller_manager,
    })
}

/// The real `helm`: on PATH, in `$KUBEBUILDER_ASSETS`, or unpacked from
/// `../shared/envtest/helm.xz`; `None` when there is none.
pub fn helm_binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("helm"))
            .find(|p| p.is_file())
    }) {
        return Some(path);
    }
    let dir = match std::env::var_os("KUBEBUILDER_ASSETS") {
        Some(dir) => PathBuf::from(dir),
        None => unpack_shared_assets().ok()?,
    };
    Some(dir.join("helm")).filter(|p| p.is_file())
}

/// Unpacks `../shared/envtest/*.xz` into `target/envtest-assets` once; the directory.
fn unpack_shared_assets() -> Result<PathBuf, String> {
    let shared = repo_root().join("../shared/envtest");
    if !shared.join("kube-apiserver.xz").is_file() {
        return Err(format!(
            "KUBEBUILDER_ASSETS is unset and {} has no kube-apiserver.xz",
            shared.display()
        ));
    }
    let out = repo_root().join("target/envtest-assets");
    std::fs::create_dir_all(&out).map_err(|e| format!("creating {}: {e}", out.display()))?;
    for name in ["kube-apiserver", "kube-controller-manager", "helm"] {
        let target = out.join(name);
        let packed = shared.join(format!("{name}.xz"));
        if target.is_file() || !packed.is_file() {
            continue;
        }
        // Unpack beside the target and rename: test processes may race to do this.
        let partial = out.join(format!(".{name}.{}", std::process::id()));
        let file = std::fs::File::create(&partial).map_err(|e| e.to_string())?;
        let status = Command::new("xz")
            .arg("-dc")
            .arg(&packed)
            .stdout(file)
            .status()
            .map_err(|e| format!("running xz: {e}"))?;
        if !status.success() {
            return Err(format!("xz -dc {} failed", packed.display()));
        }
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| e.to_string())?;
        std::fs::rename(&partial, &target).map_err(|e| e.to_string())?;
    }
    Ok(out)
}

/// Runs `cmd` with `input` on its stdin; its output.
pub fn output_with_input(mut cmd: Command, input: &str) -> Output {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(input.as_bytes())
        .expect("write the command's input");
    child.wait_with_output().expect("the command's output")
}

/// A CA and a serving certificate for 127.0.0.1 and localhost, as PEM (ca, cert, key).
pub fn serving_certificate() -> (String, String, String) {
    serving_certificate_for(&["127.0.0.1", "localhost"])
}

/// A CA and a serving certificate for `names` (addresses or DNS names), as PEM (ca, cert, key).
pub fn serving_certificate_for(names: &[&str]) -> (String, String, String) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "envtest-ca");
    let ca = ca_params.self_signed(&ca_key).expect("CA certificate");
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().expect("serving key");
    let params = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
        .expect("serving params");
    let cert = params
        .signed_by(&key, &issuer)
        .expect("serving certificate");
    (ca.pem(), cert.pem(), key.serialize_pem())
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write control plane file");
    path
}

/// A loopback port that was free a moment ago, for a server that must be told its port.
///
/// It comes from below the kernel's ephemeral range: a port the kernel hands out for
/// `bind(0)` may be taken by any outgoing connection before the server binds it (etcd failed
/// that way in CI), while ports below the range are only ever taken by an explicit bind.
pub fn free_port() -> u16 {
    reserve_port().port
}

/// A port from [`free_port`]'s range, kept bound until [`ReservedPort::release`]: for a port
/// a server is told about long before the process that listens on it starts (RabbitMQ's auth
/// backend URL names a callback port half a minute before propeller binds it), so no other
/// test can pick it in between.
pub fn reserve_port() -> ReservedPort {
    use std::hash::{BuildHasher, Hasher};
    let (low, _) = ephemeral_port_range();
    let floor: u16 = 10_000;
    let span = low.saturating_sub(floor).max(1);
    for _ in 0..1_000 {
        // RandomState is seeded per process and per call: a cheap random number.
        let random = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        let port = floor + (random % u64::from(span)) as u16;
        if let Ok(listener) = TcpListener::bind(("127.0.0.1", port)) {
            return ReservedPort {
                port,
                holder: std::sync::Mutex::new(Some(listener)),
            };
        }
    }
    let listener = TcpListener::bind("127.0.0.1:0").expect("ephemeral port");
    ReservedPort {
        port: listener.local_addr().expect("bound address").port(),
        holder: std::sync::Mutex::new(Some(listener)),
    }
}

/// A loopback port held by a listener of this test until released.
pub struct ReservedPort {
    pub port: u16,
    holder: std::sync::Mutex<Option<TcpListener>>,
}

impl ReservedPort {
    /// Closes the holding listener (once; later calls do nothing) so the server about to
    /// start can bind the port; the port.
    pub fn release(&self) -> u16 {
        if let Ok(mut holder) = self.holder.lock() {
            holder.take();
        }
        self.port
    }
}

/// The kernel's range for automatically chosen local ports (Linux's default when unreadable).
fn ephemeral_port_range() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| {
            let mut bounds = text.split_whitespace().map(|n| n.parse::<u16>().ok());
            Some((bounds.next()??, bounds.next()??))
        })
        .unwrap_or((32_768, 60_999))
}

/// Makes the kernel kill `cmd`'s process when the thread that started it dies, so a test
/// killed by its runner (timeout, SIGKILL) leaves no servers behind.
pub fn pdeathsig(cmd: &mut Command) {
    pdeathsig_with(cmd, libc::SIGKILL);
}

/// [`pdeathsig`] with another signal, for a process that must clean up after itself.
pub fn pdeathsig_with(cmd: &mut Command, signal: libc::c_int) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, signal) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// The repository root (this crate's parent).
fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}
