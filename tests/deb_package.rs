//! The Debian package of the agent (`scripts/build-deb.sh`, cargo-deb), installed for real on
//! this machine: `dpkg -i`, what the package sets up (the user, the state directory, the
//! conffile and its group, the enabled unit), `systemd-analyze verify` of the unit, lintian,
//! a reinstall (the upgrade path of the maintainer scripts), `dpkg -r` (the conffile stays)
//! and `dpkg -P` (nothing of the package stays but the system user, which Debian leaves).
//! Then the arm64 and armhf packages, from the dev-profile cross binaries of
//! `scripts/build-agent-cross.sh`: unpacked, their agent run with `--version` under qemu-user
//! and enrolled with `proplet join` against a real standalone server over TLS.
//!
//! The amd64 package wraps the dev-profile `proplet` the test suite runs (scripts/test.sh
//! builds it; `PROPLET_DEB=/path/to.deb` tests a package built elsewhere instead). Needs root,
//! dpkg, systemd-analyze and lintian (scripts/test.sh installs them); without them the test
//! prints one SKIPPED line and passes, except under `CI=true`, where that is a failure. The
//! arm packages are skipped when the cross binaries are absent, except with
//! `PROPELLER_QEMU_AGENTS=required` (as .ci/run sets).
//!
//! It installs and purges the package `proplet` system-wide, so it must not run beside a
//! real installation: a `proplet` package already there is purged first (an earlier run of
//! this test that was killed leaves one).

mod support;

use std::collections::BTreeSet;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

use support::enrol::TlsServer;
use support::repo_root;

const CONFFILE: &str = "/etc/proplet/proplet.toml";
const UNIT: &str = "/usr/lib/systemd/system/proplet.service";
const STATE_DIR: &str = "/var/lib/proplet";
/// The `WantedBy=multi-user.target` link that enabling the unit makes.
const WANTS_LINK: &str = "/etc/systemd/system/multi-user.target.wants/proplet.service";

/// Lintian's warnings that stay, with the reason each does. Any other warning fails the test,
/// and so does any error (`--fail-on error`); info tags are printed only.
const LINTIAN_ACCEPTED: &[(&str, &str)] = &[(
    "initial-upload-closes-no-bugs",
    "the package is not uploaded to Debian, so its first changelog entry has no ITP bug to close",
)];

/// The architectures besides amd64: Debian's name, the Rust target, qemu-user and its sysroot.
const CROSS: [(&str, &str, &str, &str); 2] = [
    (
        "arm64",
        "aarch64-unknown-linux-gnu",
        "qemu-aarch64",
        "/usr/aarch64-linux-gnu",
    ),
    (
        "armhf",
        "armv7-unknown-linux-gnueabihf",
        "qemu-arm",
        "/usr/arm-linux-gnueabihf",
    ),
];

fn ci() -> bool {
    std::env::var("CI").is_ok()
}

/// One SKIPPED line, or a failure under `CI=true`.
fn skip(why: &str) {
    assert!(!ci(), "CI=true needs the Debian package test: {why}");
    eprintln!("SKIPPED: {why}");
}

fn on_path(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool} >/dev/null 2>&1")])
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs `cmd`, prints it and its output, and returns the output.
fn run(cmd: &mut Command) -> Output {
    let shown = format!("{cmd:?}");
    let out = cmd.output().unwrap_or_else(|e| panic!("run {shown}: {e}"));
    eprintln!(
        "$ {shown}\n{}{}[{}]",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        out.status
    );
    out
}

/// Runs `cmd`, which must succeed; returns its stdout.
fn ok(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(out.status.success(), "{cmd:?} failed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn cmd(program: &str, args: &[&str]) -> Command {
    let mut c = Command::new(program);
    c.args(args);
    c
}

fn stage<T>(name: &str, f: impl FnOnce() -> T) -> T {
    eprintln!("== {name}");
    let began = Instant::now();
    let out = f();
    eprintln!("== {name}: done in {:.1} s", began.elapsed().as_secs_f64());
    out
}

/// The target directory the test suite's binaries are in (target/debug/deps/<test> -> target).
fn target_dir() -> PathBuf {
    let mut dir = std::env::current_exe().expect("test executable path");
    dir.pop();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir.pop();
    dir
}

/// `scripts/build-deb.sh --no-build ARCH...` with the dev profile; the packages' paths.
fn build_debs(arches: &[&str]) -> Vec<PathBuf> {
    let out = ok(Command::new(repo_root().join("scripts/build-deb.sh"))
        .arg("--no-build")
        .args(arches)
        .current_dir(repo_root())
        .env("AGENT_PROFILE", "dev")
        .env("CARGO_TARGET_DIR", target_dir()));
    let debs: Vec<PathBuf> = out.lines().map(PathBuf::from).collect();
    assert_eq!(
        debs.len(),
        arches.len(),
        "one package per architecture: {out}"
    );
    for (deb, arch) in debs.iter().zip(arches) {
        assert!(deb.is_file(), "{} is not a file", deb.display());
        let name = deb.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        assert!(
            name.starts_with("proplet_") && name.ends_with(&format!("_{arch}.deb")),
            "{name}"
        );
    }
    debs
}

/// The package's status (`ii`, `rc`, ...), or None when dpkg does not know it.
fn status() -> Option<String> {
    let out = Command::new("dpkg-query")
        .args(["-W", "-f=${db:Status-Abbrev}", "proplet"])
        .output()
        .expect("run dpkg-query");
    let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    (out.status.success() && !text.is_empty()).then_some(text)
}

/// The user proplet's passwd fields (name, x, uid, gid, gecos, home, shell).
fn passwd() -> Option<Vec<String>> {
    let out = Command::new("getent")
        .args(["passwd", "proplet"])
        .output()
        .expect("run getent");
    out.status.success().then(|| {
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .split(':')
            .map(str::to_owned)
            .collect()
    })
}

fn group_exists() -> bool {
    Command::new("getent")
        .args(["group", "proplet"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Purges the package when dropped, and removes the user and group the package made when
/// the test began without them, so a failing run leaves the machine as it found it.
struct Cleanup {
    user_was_there: bool,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if status().is_some() {
            let _ = Command::new("dpkg").args(["-P", "proplet"]).status();
        }
        if !self.user_was_there {
            let _ = Command::new("userdel").arg("proplet").output();
            let _ = Command::new("groupdel").arg("proplet").output();
        }
    }
}

/// Lintian on `deb`: no error, and no warning or info tag beyond [`LINTIAN_ACCEPTED`].
fn lintian(deb: &Path) {
    let out = run(Command::new("lintian")
        .args([
            "--fail-on",
            "error",
            "--display-info",
            "--tag-display-limit",
            "0",
        ])
        .arg(deb));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "lintian found errors in {}",
        deb.display()
    );
    let unexpected: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("E: ") || l.starts_with("W: "))
        .filter(|l| {
            // "W: proplet: TAG [context]"
            let tag = l.split_whitespace().nth(2).unwrap_or_default();
            !LINTIAN_ACCEPTED.iter().any(|(t, _)| *t == tag)
        })
        .collect();
    assert!(
        unexpected.is_empty(),
        "lintian tags not accepted in tests/deb_package.rs (fix them, or add them to LINTIAN_ACCEPTED with the reason):\n{}",
        unexpected.join("\n")
    );
}

fn mode(path: &str) -> (u32, u32, u32) {
    let meta = std::fs::metadata(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    (meta.permissions().mode() & 0o7777, meta.uid(), meta.gid())
}

#[test]
fn the_debian_package_installs_upgrades_removes_and_purges() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip("installing a package needs root");
    }
    for tool in [
        "dpkg",
        "dpkg-deb",
        "dpkg-query",
        "systemd-analyze",
        "lintian",
    ] {
        if !on_path(tool) {
            return skip(&format!(
                "no {tool} (scripts/test.sh installs lintian; dpkg and systemd come with Debian)"
            ));
        }
    }
    let began = Instant::now();

    let deb = match std::env::var_os("PROPLET_DEB") {
        Some(path) => PathBuf::from(path),
        None => stage("build the amd64 package (dev profile)", || {
            build_debs(&["amd64"]).remove(0)
        }),
    };
    stage("lintian amd64", || lintian(&deb));

    if let Some(left) = status() {
        eprintln!("a proplet package ({left}) is installed already: purging it first");
        ok(&mut cmd("dpkg", &["-P", "proplet"]));
    }
    let _cleanup = Cleanup {
        user_was_there: passwd().is_some(),
    };

    let files = stage("dpkg -i", || {
        ok(Command::new("dpkg").arg("-i").arg(&deb));
        assert_eq!(status().as_deref(), Some("ii"));
        ok(&mut cmd("dpkg", &["-L", "proplet"]))
            .lines()
            .map(PathBuf::from)
            .collect::<BTreeSet<_>>()
    });
    for path in ["/usr/bin/proplet", CONFFILE, UNIT] {
        assert!(files.contains(Path::new(path)), "dpkg -L lacks {path}");
    }

    stage("what the package set up", || {
        let version = ok(&mut cmd("/usr/bin/proplet", &["--version"]));
        assert_eq!(
            version.trim(),
            format!("proplet {}", env!("CARGO_PKG_VERSION"))
        );

        let conffiles = ok(&mut cmd(
            "dpkg-query",
            &["-W", "-f=${Conffiles}", "proplet"],
        ));
        assert!(conffiles.contains(CONFFILE), "conffiles: {conffiles:?}");
        let config = std::fs::read_to_string(CONFFILE).expect("read the conffile");
        assert!(config.contains("proplet join --server mqtts://HOST:8883 --token TOKEN"));
        assert!(
            config
                .lines()
                .all(|l| l.trim().is_empty() || l.trim_start().starts_with('#')),
            "the packaged config sets nothing:\n{config}"
        );

        let user = passwd().expect("the package creates the user proplet");
        assert_eq!(user[5], STATE_DIR, "home of proplet: {user:?}");
        assert!(user[6].ends_with("nologin"), "shell of proplet: {user:?}");
        assert!(group_exists(), "the package creates the group proplet");
        let (uid, gid): (u32, u32) = (user[2].parse().unwrap(), user[3].parse().unwrap());
        assert!(uid < 1000, "proplet is a system user: {user:?}");

        assert_eq!(mode(STATE_DIR), (0o700, uid, gid), "{STATE_DIR}");
        // The config may hold the key: root's, readable by the agent's group only.
        assert_eq!(mode(CONFFILE), (0o640, 0, gid), "{CONFFILE}");
        ok(&mut cmd(
            "runuser",
            &["-u", "proplet", "--", "cat", CONFFILE],
        ));
        assert!(!run(&mut cmd(
            "runuser",
            &["-u", "nobody", "--", "cat", CONFFILE]
        ))
        .status
        .success());

        // Enabled (for boot), not started: there is no systemd running here anyway. (Bookworm's
        // deb-systemd-helper links to /lib/systemd/system, /usr/lib's alias on merged /usr.)
        let link = std::fs::read_link(WANTS_LINK).expect("the unit is enabled");
        assert_eq!(
            std::fs::canonicalize(&link).expect("the link resolves"),
            std::fs::canonicalize(UNIT).expect("the unit"),
            "{WANTS_LINK} -> {}",
            link.display()
        );

        // With no systemd as PID 1 here, verify still loads the unit and checks its
        // directives and that its binaries exist; it prints nothing for a good unit (an
        // unknown key or a missing binary is printed, the former with exit status 0).
        let verify = run(&mut cmd("systemd-analyze", &["verify", UNIT]));
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&verify.stdout),
            String::from_utf8_lossy(&verify.stderr)
        );
        assert!(verify.status.success(), "systemd-analyze verify: {said}");
        assert!(
            !said.contains("proplet"),
            "systemd-analyze verify has remarks on the unit:\n{said}"
        );

        // The unit's ExecCondition, as the unit's user: exit 1 (systemd skips the start, the
        // unit is not failed) with the packaged config, exit 0 once the config has credentials.
        let unit = std::fs::read_to_string(UNIT).expect("read the unit");
        let condition: Vec<&str> = unit
            .lines()
            .find_map(|l| l.strip_prefix("ExecCondition="))
            .expect("the unit has an ExecCondition")
            .split_whitespace()
            .collect();
        let as_proplet = || {
            let mut c = cmd("runuser", &["-u", "proplet", "--"]);
            c.args(&condition);
            run(&mut c)
        };
        let out = as_proplet();
        assert_eq!(out.status.code(), Some(1), "unconfigured: exit 1");
        let said = String::from_utf8_lossy(&out.stderr);
        assert_eq!(said.trim().lines().count(), 1, "one line: {said}");
        assert!(said.contains("proplet join"), "{said}");
        std::fs::write(
            CONFFILE,
            format!(
                "{config}\nmqtt_address = \"tcp://127.0.0.1:1883\"\nclient_id = \"pi-1\"\nclient_key = \"k\"\n"
            ),
        )
        .expect("edit the conffile");
        assert_eq!(as_proplet().status.code(), Some(0), "configured: exit 0");
    });

    stage(
        "dpkg -i again (the upgrade path: prerm upgrade, postinst configure OLD)",
        || {
            ok(Command::new("dpkg").arg("-i").arg(&deb));
            assert_eq!(status().as_deref(), Some("ii"));
            let config = std::fs::read_to_string(CONFFILE).expect("read the conffile");
            assert!(
                config.contains("client_id = \"pi-1\""),
                "the edited conffile stays"
            );
            let uid: u32 = passwd().expect("user")[2].parse().unwrap();
            assert_eq!(mode(STATE_DIR).1, uid);
            assert_eq!(mode(CONFFILE).0, 0o640);
        },
    );

    // State the agent (or `proplet join`) leaves, and a file an administrator put in /etc.
    std::fs::write(
        format!("{STATE_DIR}/credentials.toml"),
        "client_id = \"pi-1\"\n",
    )
    .expect("write into the state dir");
    std::fs::write("/etc/proplet/ca.pem", "test\n").expect("write beside the conffile");

    stage("dpkg -r: the binary goes, the configuration stays", || {
        ok(&mut cmd("dpkg", &["-r", "proplet"]));
        assert_eq!(status().as_deref(), Some("rc"));
        assert!(!Path::new("/usr/bin/proplet").exists());
        assert!(!Path::new(UNIT).exists());
        assert!(
            Path::new(CONFFILE).is_file(),
            "the conffile stays on remove"
        );
        assert!(!Path::new(WANTS_LINK).exists(), "disabled on remove");
        let conffiles = ok(&mut cmd(
            "dpkg-query",
            &["-W", "-f=${Conffiles}", "proplet"],
        ));
        assert!(
            conffiles.contains(CONFFILE),
            "still registered: {conffiles:?}"
        );
        let config = std::fs::read_to_string(CONFFILE).expect("read the conffile");
        assert!(
            config.contains("client_id = \"pi-1\""),
            "the edited conffile stays"
        );
        assert!(Path::new(STATE_DIR).join("credentials.toml").is_file());
    });

    stage("dpkg -P: nothing of the package stays", || {
        ok(&mut cmd("dpkg", &["-P", "proplet"]));
        assert_eq!(status(), None, "dpkg forgets the package");
        for path in &files {
            // Directories other packages share (/usr/bin, /etc) stay; the package's own go.
            let shared = path.is_dir()
                && !path.starts_with("/etc/proplet")
                && !path.starts_with("/usr/share/doc/proplet");
            assert!(shared || !path.exists(), "{} is left", path.display());
        }
        for path in ["/etc/proplet", STATE_DIR, WANTS_LINK] {
            assert!(!Path::new(path).exists(), "{path} is left");
        }
        let overrides = ok(&mut cmd("dpkg-statoverride", &["--list"]));
        assert!(!overrides.contains("/etc/proplet"), "{overrides}");
        // deb-systemd-helper's records of the unit go too, and the mask `dpkg -r` set.
        assert!(
            std::fs::symlink_metadata("/etc/systemd/system/proplet.service").is_err(),
            "a mask of proplet.service is left"
        );
        for dir in [
            "/var/lib/systemd/deb-systemd-helper-enabled",
            "/var/lib/systemd/deb-systemd-helper-masked",
        ] {
            if Path::new(dir).exists() {
                let left = ok(&mut cmd("find", &[dir, "-name", "*proplet*"]));
                assert!(left.trim().is_empty(), "left in {dir}: {left}");
            }
        }
        // The system user stays, as Debian leaves system users (files it owns may remain).
        assert!(passwd().is_some(), "the user proplet stays after purge");
    });

    stage("arm64 and armhf packages under qemu-user", arm_packages);
    eprintln!("the whole test: {:.1} s", began.elapsed().as_secs_f64());
}

fn arm_packages() {
    let bins: Vec<PathBuf> = CROSS
        .iter()
        .map(|(_, triple, _, _)| target_dir().join(triple).join("debug/proplet"))
        .collect();
    let missing: Vec<String> = bins
        .iter()
        .filter(|b| !b.is_file())
        .map(|b| b.display().to_string())
        .collect();
    let qemu_missing: Vec<&str> = CROSS
        .iter()
        .filter(|(_, _, qemu, sysroot)| {
            !on_path(qemu) || !Path::new(sysroot).join("lib/libc.so.6").exists()
        })
        .map(|(_, _, qemu, _)| *qemu)
        .collect();
    if !missing.is_empty() || !qemu_missing.is_empty() {
        let why = format!(
            "no cross-built agents at {missing:?} (AGENT_PROFILE=dev scripts/build-agent-cross.sh) \
             or no qemu-user with the target's libc for {qemu_missing:?}"
        );
        assert!(
            std::env::var("PROPELLER_QEMU_AGENTS").as_deref() != Ok("required"),
            "PROPELLER_QEMU_AGENTS=required: {why}"
        );
        eprintln!("skipped: {why}");
        return;
    }
    let debs = build_debs(&["arm64", "armhf"]);
    // The packaged agents enrol with a token against a real server, as a Pi would.
    let server_dir = tempfile::tempdir().expect("temp dir");
    let server = TlsServer::start(server_dir.path());
    let token = server.token(&["--uses", "2", "--labels", "packaged=yes"]);
    for ((arch, _, qemu, sysroot), deb) in CROSS.iter().zip(&debs) {
        let field = |name: &str| {
            ok(Command::new("dpkg-deb").arg("-f").arg(deb).arg(name))
                .trim()
                .to_owned()
        };
        assert_eq!(field("Architecture"), *arch);
        let depends = field("Depends");
        assert!(depends.contains("libc6 (>="), "{arch}: Depends: {depends}");
        lintian(deb);

        let root = tempfile::tempdir().expect("temp dir");
        ok(Command::new("dpkg-deb").arg("-x").arg(deb).arg(root.path()));
        let bin = root.path().join("usr/bin/proplet");
        let version = ok(Command::new(qemu)
            .args(["-L", *sysroot])
            .arg(&bin)
            .arg("--version"));
        assert_eq!(
            version.trim(),
            format!("proplet {}", env!("CARGO_PKG_VERSION")),
            "{arch}"
        );
        for path in [CONFFILE, UNIT, "/usr/lib/sysusers.d/proplet.conf"] {
            assert!(
                root.path().join(path.trim_start_matches('/')).is_file(),
                "{arch}: the package lacks {path}"
            );
        }

        let joined = run(Command::new(qemu)
            .args(["-L", *sysroot])
            .arg(&bin)
            .args(["join", "--no-run", "--server"])
            .arg(server.tls_url())
            .args(["--token", &token, "--machine-id", &format!("deb-{arch}")])
            .arg("--tls-ca-cert")
            .arg(&server.ca)
            .arg("--state-dir")
            .arg(root.path().join("state")));
        let said = String::from_utf8_lossy(&joined.stderr).into_owned();
        assert!(joined.status.success(), "{arch}: proplet join: {said}");
        let name = support::enrol::enrolled_name(&said);
        let (found, json, err) = server.client(&["get", "proplet", &name, "-o", "json"]);
        assert!(found, "{arch}: {err}");
        let proplet: serde_json::Value = serde_json::from_str(&json).expect("json");
        let kube_arch = if *arch == "armhf" { "arm" } else { *arch };
        assert_eq!(
            proplet["metadata"]["labels"]["kubernetes.io/arch"], kube_arch,
            "{proplet:#}"
        );
        assert_eq!(proplet["metadata"]["labels"]["packaged"], "yes");
    }
}
