//! Container images built without Docker from the runtime stage of our Dockerfiles.
//!
//! The last stage of `configs/docker/*.Dockerfile` is the one description of an image's
//! layout (binary path, user, environment, ports, entrypoint). Docker builds it as usual;
//! the in-cluster tests read the same lines and build the same layout from the binaries
//! already on disk, with the node kit's `rootfs-from-binary.sh` (the binary's libraries and
//! the CA bundle, which is what `distroless/cc` holds) and `mkimage.py` (a `docker save`
//! archive that `ctr` imports). A directive this reader does not know is an error, so the
//! Dockerfile cannot grow a step the test image would silently lack.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The base images the reader can reproduce: what they hold is the binary's shared
/// libraries, the CA certificates and the `nonroot` user.
const DISTROLESS_CC: &str = "gcr.io/distroless/cc-debian12";

/// The runtime stage of a Dockerfile, as the reader understood it.
#[derive(Debug, Default, PartialEq)]
pub struct RuntimeStage {
    pub base: String,
    /// (builder path, image path)
    pub copies: Vec<(String, String)>,
    pub env: Vec<(String, String)>,
    pub user: String,
    pub exposed: Vec<u16>,
    pub entrypoint: Vec<String>,
    pub cmd: Option<Vec<String>>,
}

/// Reads the last stage of a Dockerfile; `Err` names the line it cannot reproduce.
pub fn runtime_stage(dockerfile: &str) -> Result<RuntimeStage, String> {
    let mut logical = Vec::new();
    let mut pending = String::new();
    for line in dockerfile.lines() {
        let trimmed = line.trim();
        if pending.is_empty() && (trimmed.is_empty() || trimmed.starts_with('#')) {
            continue;
        }
        if let Some(head) = trimmed.strip_suffix('\\') {
            pending.push_str(head);
            pending.push(' ');
            continue;
        }
        pending.push_str(trimmed);
        logical.push(std::mem::take(&mut pending));
    }
    let start = logical
        .iter()
        .rposition(|l| l.to_ascii_uppercase().starts_with("FROM "))
        .ok_or("no FROM line")?;
    let mut stage = RuntimeStage::default();
    for line in &logical[start..] {
        let (directive, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
        let rest = rest.trim();
        match directive.to_ascii_uppercase().as_str() {
            "FROM" => stage.base = rest.to_owned(),
            "COPY" => {
                let words: Vec<&str> = rest.split_whitespace().collect();
                let (flags, paths): (Vec<&str>, Vec<&str>) =
                    words.iter().partition(|w| w.starts_with("--"));
                if !flags.contains(&"--from=builder") || paths.len() != 2 {
                    return Err(format!(
                        "only `COPY --from=builder SRC DEST` can be reproduced: {line}"
                    ));
                }
                stage
                    .copies
                    .push((paths[0].to_owned(), paths[1].to_owned()));
            }
            "ENV" => {
                let (key, value) = rest
                    .split_once('=')
                    .ok_or_else(|| format!("ENV must be KEY=VALUE: {line}"))?;
                stage.env.push((key.to_owned(), value.to_owned()));
            }
            "USER" => stage.user = rest.to_owned(),
            "EXPOSE" => {
                for port in rest.split_whitespace() {
                    stage.exposed.push(
                        port.trim_end_matches("/tcp")
                            .parse()
                            .map_err(|_| format!("EXPOSE takes port numbers: {line}"))?,
                    );
                }
            }
            "ENTRYPOINT" => stage.entrypoint = exec_form(rest, line)?,
            "CMD" => stage.cmd = Some(exec_form(rest, line)?),
            other => {
                return Err(format!(
                    "{other} cannot be reproduced without Docker; the runtime stage may use \
                     FROM, COPY --from=builder, ENV, USER, EXPOSE, ENTRYPOINT, CMD: {line}"
                ))
            }
        }
    }
    if !stage.base.starts_with(DISTROLESS_CC) {
        return Err(format!(
            "base image {} unknown to the reader (it knows {DISTROLESS_CC})",
            stage.base
        ));
    }
    Ok(stage)
}

fn exec_form(text: &str, line: &str) -> Result<Vec<String>, String> {
    serde_json::from_str(text).map_err(|_| format!("use the JSON (exec) form: {line}"))
}

/// Builds `reference` from `dockerfile` into a `docker save` archive at `out`.
/// `sources` maps each `COPY --from=builder` source to a file or directory on this machine.
pub fn build(
    kit: &Path,
    dockerfile: &Path,
    sources: &BTreeMap<&str, PathBuf>,
    reference: &str,
    out: &Path,
) -> Result<RuntimeStage, String> {
    let text = std::fs::read_to_string(dockerfile)
        .map_err(|e| format!("read {}: {e}", dockerfile.display()))?;
    let stage = runtime_stage(&text).map_err(|e| format!("{}: {e}", dockerfile.display()))?;
    let root = out.with_extension("rootfs");
    let _ = std::fs::remove_dir_all(&root);
    let (first_binary, _) = stage
        .copies
        .iter()
        .find(|(from, _)| sources.get(from.as_str()).is_some_and(|p| p.is_file()))
        .ok_or("the stage copies no program")?;
    let program = &sources[first_binary.as_str()];
    // The libraries the binary loads and the CA bundle: distroless/cc's content.
    run(Command::new(kit.join("rootfs-from-binary.sh"))
        .arg(&root)
        .arg(program)
        .arg("/etc/ssl/certs/ca-certificates.crt"))?;
    let placed = root.join(program.file_name().ok_or("program without a name")?);
    std::fs::remove_file(&placed).map_err(|e| format!("{}: {e}", placed.display()))?;
    for (from, to) in &stage.copies {
        let source = sources
            .get(from.as_str())
            .ok_or_else(|| format!("no file given for COPY --from=builder {from}"))?;
        let target = root.join(to.trim_start_matches('/'));
        if source.is_dir() {
            // mkimage.py stores every entry as uid 0: the image's directories are not
            // writable by 65532, which is why the chart and the operator mount volumes there.
            std::fs::create_dir_all(&target).map_err(|e| format!("{}: {e}", target.display()))?;
            continue;
        }
        std::fs::create_dir_all(target.parent().ok_or("COPY to /")?)
            .map_err(|e| format!("{}: {e}", target.display()))?;
        // Debug binaries carry hundreds of MB of debug information the pods never read.
        run(Command::new("objcopy")
            .arg("--strip-debug")
            .arg(source)
            .arg(&target))?;
    }
    let passwd = root.join("etc/passwd");
    let mut users = std::fs::read_to_string(&passwd).unwrap_or_default();
    users.push_str("nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n");
    std::fs::write(&passwd, users).map_err(|e| format!("{}: {e}", passwd.display()))?;
    let mut mkimage = Command::new("python3");
    mkimage
        .arg(kit.join("mkimage.py"))
        .arg(&root)
        .arg(reference)
        .arg(out)
        .arg("--entrypoint")
        .arg(serde_json::to_string(&stage.entrypoint).map_err(|e| e.to_string())?)
        .arg("--user")
        .arg(&stage.user);
    if let Some(cmd) = &stage.cmd {
        mkimage
            .arg("--cmd")
            .arg(serde_json::to_string(cmd).map_err(|e| e.to_string())?);
    }
    for (key, value) in &stage.env {
        mkimage.arg("--env").arg(format!("{key}={value}"));
    }
    run(&mut mkimage)?;
    let _ = std::fs::remove_dir_all(&root);
    Ok(stage)
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// An image of one test program (the program at `/`, its libraries, entrypoint it).
pub fn build_program(
    kit: &Path,
    program: &Path,
    reference: &str,
    out: &Path,
) -> Result<(), String> {
    let root = out.with_extension("rootfs");
    let _ = std::fs::remove_dir_all(&root);
    run(Command::new(kit.join("rootfs-from-binary.sh"))
        .arg(&root)
        .arg(program)
        .arg("/etc/ssl/certs/ca-certificates.crt"))?;
    let name = program
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or("program without a name")?;
    let placed = root.join(name);
    run(Command::new("objcopy")
        .arg("--strip-debug")
        .arg(program)
        .arg(&placed))?;
    run(Command::new("python3")
        .arg(kit.join("mkimage.py"))
        .arg(&root)
        .arg(reference)
        .arg(out)
        .arg("--entrypoint")
        .arg(format!("[\"/{name}\"]")))?;
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}
