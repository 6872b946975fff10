//! A real OCI registry for tests: Debian's `docker-registry` (the CNCF distribution registry)
//! on a loopback port, optionally behind htpasswd auth, with artifacts pushed by `oci-client`.
//!
//! Without the binary a test says how to install it and skips; with `CI=true` it fails.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use oci_client::client::{
    Certificate, CertificateEncoding, ClientConfig, ClientProtocol, Config, ImageLayer,
};
use oci_client::manifest::OciImageManifest;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};

use super::Running;

const BINARY: &str = "/usr/bin/docker-registry";

/// A running registry; stopped when dropped.
pub struct Registry {
    process: Running,
    /// Access-log lines read so far.
    log: std::sync::Mutex<Vec<String>>,
    _dir: tempfile::TempDir,
    /// `127.0.0.1:port`.
    pub host: String,
    login: Option<(String, String)>,
    /// The CA that signed its serving certificate, when it speaks TLS.
    pub ca_pem: Option<String>,
}

/// How a pushed artifact is laid out.
pub enum Layout {
    /// The CNCF Wasm artifact: `application/vnd.wasm.config.v0+json` config, one
    /// `application/wasm` layer.
    WasmArtifact,
    /// An `oras push` of a plain file: empty config, one layer of a generic type.
    PlainFile,
    /// A container-image-like artifact: image config, one gzip tar layer.
    ContainerImage,
}

impl Registry {
    /// Starts a registry, with basic auth for `login` when given; `None` (after saying why)
    /// when `docker-registry` is not installed outside CI.
    pub fn start(login: Option<(&str, &str)>) -> Option<Self> {
        Self::start_with(login, false)
    }

    /// A registry serving HTTPS with a certificate from a private CA ([`Registry::ca_pem`]).
    pub fn start_tls() -> Option<Self> {
        Self::start_with(None, true)
    }

    fn start_with(login: Option<(&str, &str)>, tls: bool) -> Option<Self> {
        if !Path::new(BINARY).exists() {
            let why = format!("{BINARY} missing (apt-get install docker-registry)");
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("registry tests cannot be skipped in CI: {why}");
            }
            eprintln!("skipping: {why}");
            return None;
        }
        let dir = tempfile::tempdir().expect("registry dir");
        let port = super::envtest::free_port();
        let host = format!("127.0.0.1:{port}");
        let auth = match login {
            Some((user, pass)) => {
                let hash = bcrypt::hash(pass, 4).expect("bcrypt");
                std::fs::write(dir.path().join("htpasswd"), format!("{user}:{hash}\n"))
                    .expect("htpasswd");
                format!(
                    "auth:\n  htpasswd:\n    realm: propeller-test\n    path: {}\n",
                    dir.path().join("htpasswd").display()
                )
            }
            None => String::new(),
        };
        let ca_pem = tls.then(|| {
            let (ca, cert, key) = super::envtest::serving_certificate();
            std::fs::write(dir.path().join("cert.pem"), cert).expect("cert");
            std::fs::write(dir.path().join("key.pem"), key).expect("key");
            ca
        });
        let tls_config = if tls {
            format!(
                "  tls:\n    certificate: {}\n    key: {}\n",
                dir.path().join("cert.pem").display(),
                dir.path().join("key.pem").display()
            )
        } else {
            String::new()
        };
        let config = format!(
            "version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {host}\n{tls_config}{auth}",
            dir.path().join("data").display()
        );
        let config_path: PathBuf = dir.path().join("config.yml");
        std::fs::write(&config_path, config).expect("registry config");
        let mut cmd = Command::new(BINARY);
        cmd.arg("serve").arg(&config_path);
        let process = Running::spawn(cmd);
        let deadline = Instant::now() + super::WAIT;
        while std::net::TcpStream::connect(&host).is_err() {
            assert!(
                Instant::now() < deadline,
                "registry on {host} did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(Self {
            process,
            log: std::sync::Mutex::default(),
            _dir: dir,
            host,
            login: login.map(|(u, p)| (u.to_owned(), p.to_owned())),
            ca_pem,
        })
    }

    /// How many GETs of blob `digest` the registry has answered so far.
    pub fn blob_gets(&self, digest: &str) -> usize {
        let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        log.extend(self.process.stderr.try_iter());
        log.extend(self.process.stdout.try_iter());
        let uri = format!("/blobs/{digest}");
        log.iter()
            .filter(|l| l.contains("response completed") && l.contains("method=GET"))
            .filter(|l| l.contains(&uri))
            .count()
    }

    fn auth(&self) -> RegistryAuth {
        match &self.login {
            Some((u, p)) => RegistryAuth::Basic(u.clone(), p.clone()),
            None => RegistryAuth::Anonymous,
        }
    }

    fn client(&self) -> Client {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let (protocol, extra_root_certificates) = match &self.ca_pem {
            Some(ca) => (
                ClientProtocol::Https,
                vec![Certificate {
                    encoding: CertificateEncoding::Pem,
                    data: ca.clone().into_bytes(),
                }],
            ),
            None => (ClientProtocol::Http, Vec::new()),
        };
        Client::new(ClientConfig {
            protocol,
            extra_root_certificates,
            ..ClientConfig::default()
        })
    }

    /// Pushes `bytes` as `repo:tag` in `layout`; returns the manifest digest.
    pub fn push(&self, repo_tag: &str, bytes: &[u8], layout: Layout) -> String {
        let reference: Reference = format!("{}/{repo_tag}", self.host).parse().expect("ref");
        let (config, layer_type) = match layout {
            Layout::WasmArtifact => (
                Config::new(
                    br#"{"architecture":"wasm","os":"wasip1","layerDigests":[]}"#.to_vec(),
                    "application/vnd.wasm.config.v0+json".into(),
                    None,
                ),
                "application/wasm",
            ),
            Layout::PlainFile => (
                Config::new(
                    b"{}".to_vec(),
                    "application/vnd.oci.empty.v1+json".into(),
                    None,
                ),
                "application/vnd.oci.image.layer.v1.tar",
            ),
            Layout::ContainerImage => (
                Config::oci_v1(br#"{"architecture":"amd64","os":"linux"}"#.to_vec(), None),
                "application/vnd.oci.image.layer.v1.tar+gzip",
            ),
        };
        let layers = vec![ImageLayer::new(bytes.to_vec(), layer_type.into(), None)];
        let manifest = OciImageManifest::build(&layers, &config, None);
        self.push_manifest(&reference, &layers, config, manifest)
    }

    /// Pushes `layers`, `config` and `manifest` as `reference`; returns the digest the
    /// registry gives the manifest back under.
    fn push_manifest(
        &self,
        reference: &Reference,
        layers: &[ImageLayer],
        config: Config,
        manifest: OciImageManifest,
    ) -> String {
        let auth = self.auth();
        runtime().block_on(async {
            let client = self.client();
            client
                .push(reference, layers, config, &auth, Some(manifest))
                .await
                .expect("push");
            let (_, digest) = client
                .pull_image_manifest(reference, &auth)
                .await
                .expect("pull back the manifest");
            digest
        })
    }

    /// Pushes the image of OCI layout `dir` tagged `tag` (its `index.json` entry named so) as
    /// `repo_tag`, with the layers' media types and annotations as they are; returns the
    /// manifest digest.
    pub fn push_layout(&self, repo_tag: &str, dir: &Path, tag: &str) -> String {
        let read = |digest: &str| {
            let hex = digest.trim_start_matches("sha256:");
            std::fs::read(dir.join("blobs/sha256").join(hex)).expect("a blob of the layout")
        };
        let index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("index.json")).expect("index.json"))
                .expect("index.json is JSON");
        let entry = index["manifests"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == tag)
            .expect("the tag in index.json");
        let manifest: OciImageManifest =
            serde_json::from_slice(&read(entry["digest"].as_str().expect("digest")))
                .expect("an OCI manifest");
        let config = Config::new(
            read(&manifest.config.digest),
            manifest.config.media_type.clone(),
            None,
        );
        let layers: Vec<ImageLayer> = manifest
            .layers
            .iter()
            .map(|l| ImageLayer::new(read(&l.digest), l.media_type.clone(), l.annotations.clone()))
            .collect();
        let reference: Reference = format!("{}/{repo_tag}", self.host).parse().expect("ref");
        self.push_manifest(&reference, &layers, config, manifest)
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// A Wasm module exporting `add(i32, i32) -> i32`, padded with a custom section to at least
/// `size` bytes.
pub fn add_module(size: usize) -> Vec<u8> {
    let pad = "x".repeat(size);
    wat::parse_str(format!(
        r#"(module (func (export "add") (param i32 i32) (result i32) local.get 0 local.get 1 i32.add)
             (@custom "padding" "{pad}"))"#
    ))
    .expect("wat")
}

/// A `kubernetes.io/dockerconfigjson` Secret manifest granting `user`/`pass` on `host`.
pub fn pull_secret_manifest(name: &str, host: &str, user: &str, pass: &str) -> String {
    use base64::Engine as _;
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pass}"));
    let config = format!(
        r#"{{"auths":{{"{host}":{{"username":"{user}","password":"{pass}","auth":"{auth}"}}}}}}"#
    );
    let encoded = base64::engine::general_purpose::STANDARD.encode(config);
    format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\ntype: kubernetes.io/dockerconfigjson\ndata:\n  .dockerconfigjson: {encoded}\n"
    )
}
