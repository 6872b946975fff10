//! Which agent binary runs: the one installed (a package, or by hand), or one an upgrade put
//! in the state directory, on trial until it proves healthy.
//!
//! An upgrade installs the new binary beside the current one
//! (`<state dir>/agent/<sha256>/proplet`) and records it as a *trial* in
//! `<state dir>/agent/selection.json`, then the agent restarts into it by `exec`: the process
//! keeps its id, so systemd, a pod or any supervisor sees the same process go on. The trial
//! becomes the *active* binary once it has connected and its subscriptions were accepted
//! within its health deadline. Otherwise the previous binary comes back by itself:
//!
//! - the trial that is not healthy in time puts the previous binary back and `exec`s it;
//! - a trial that dies (a crash, a binary that exits at start) is found at the next start
//!   (systemd's `Restart=always`, a pod's restart): a trial already launched once is not
//!   launched again, and the previous binary runs.
//!
//! Every start of the installed binary first looks here ([`handoff`]) and `exec`s the active
//! binary if there is one, so a device rebooted after an upgrade runs the upgraded agent.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The version this binary reports: `PROPLET_BUILD_VERSION` at build time, or the crate's.
pub const AGENT_VERSION: &str = match option_env!("PROPLET_BUILD_VERSION") {
    Some(version) => version,
    None => env!("CARGO_PKG_VERSION"),
};

/// Set in the environment of a binary this agent `exec`s: it runs as chosen, without
/// looking at the selection again.
pub const HANDOFF_VARIABLE: &str = "PROPLET_HANDOFF";

/// The directory of installed binaries and the selection, inside the state directory.
pub fn agent_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("agent")
}

fn selection_file(state_dir: &Path) -> PathBuf {
    agent_dir(state_dir).join("selection.json")
}

/// One agent binary and the version it reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Binary {
    /// Where it is.
    pub path: PathBuf,
    /// What `--version` says.
    pub version: String,
}

/// A binary on trial.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trial {
    /// The new binary.
    pub binary: Binary,
    /// What ran before it, and comes back if it fails.
    pub previous: Binary,
    /// The rollout that asked for it (reports carry it).
    pub rollout: String,
    /// How long it has to connect and subscribe.
    pub health_seconds: u64,
    /// How many times it was started.
    pub launches: u32,
}

/// A report to send once connected: what happened while the agent was not running.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingReport {
    /// The rollout.
    pub rollout: String,
    /// `rolled_back` or `failed` (the wire form).
    pub state: String,
    /// Why.
    pub reason: String,
}

/// What `selection.json` holds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Selection {
    /// The binary to run (none: the installed one).
    #[serde(default)]
    pub active: Option<Binary>,
    /// The binary that ran before `active`, for a revert.
    #[serde(default)]
    pub previous: Option<Binary>,
    /// A new binary not yet proven healthy.
    #[serde(default)]
    pub trial: Option<Trial>,
    /// Reports to send.
    #[serde(default)]
    pub reports: Vec<PendingReport>,
}

/// Why the selection could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum SelectionError {
    /// Reading or writing the file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The file is not a selection.
    #[error("{path} is damaged ({source}); remove it to run the installed agent")]
    Damaged {
        /// The file.
        path: PathBuf,
        /// The parse error.
        source: serde_json::Error,
    },
}

impl Selection {
    /// The selection in `state_dir` (empty when there is none).
    pub fn load(state_dir: &Path) -> Result<Self, SelectionError> {
        let path = selection_file(state_dir);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|source| SelectionError::Damaged { path, source }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(source) => Err(SelectionError::Io { path, source }),
        }
    }

    /// Writes it atomically, owner-only.
    pub fn save(&self, state_dir: &Path) -> Result<(), SelectionError> {
        let path = selection_file(state_dir);
        let io = |source| SelectionError::Io {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(agent_dir(state_dir)).map_err(io)?;
        let text = serde_json::to_vec_pretty(self).unwrap_or_default();
        propeller_broker::private_file::write_private(&path, &text)
            .map_err(|e| io(std::io::Error::other(e.to_string())))
    }
}

/// What a start of the agent should run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    /// Go on as this process.
    Continue,
    /// `exec` this binary.
    Exec(PathBuf),
}

/// Decides, at a start not handed off by another agent, which binary runs, updating
/// `selection` (a trial launched before and not confirmed is given up).
pub fn choose(selection: &mut Selection, me: &Path) -> Choice {
    if let Some(trial) = &mut selection.trial {
        if trial.launches == 0 {
            trial.launches = 1;
            return target(&trial.binary.path, me);
        }
        let given_up = selection.trial.take();
        if let Some(trial) = given_up {
            selection.reports.push(PendingReport {
                rollout: trial.rollout,
                state: "rolled_back".into(),
                reason: format!(
                    "agent {} stopped before it was healthy; back on {}",
                    trial.binary.version, trial.previous.version
                ),
            });
        }
    }
    match &selection.active {
        Some(active) => target(&active.path, me),
        None => Choice::Continue,
    }
}

fn target(path: &Path, me: &Path) -> Choice {
    if same_file(path, me) {
        Choice::Continue
    } else {
        Choice::Exec(path.to_owned())
    }
}

/// Whether `a` and `b` name one file.
pub fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// Replaces this process with `binary`, with the same arguments and environment and
/// [`HANDOFF_VARIABLE`] set; returns only if that failed.
pub fn exec_into(binary: &Path) -> std::io::Error {
    use std::os::unix::process::CommandExt;
    std::process::Command::new(binary)
        .args(std::env::args_os().skip(1))
        .env(HANDOFF_VARIABLE, "1")
        .exec()
}

/// At the agent's start: runs the binary the selection in `state_dir` chooses, by `exec`
/// (returning only when this process is the one to run). A binary that cannot be started is
/// given up, and this one runs.
pub fn handoff(state_dir: &Path) -> Result<(), SelectionError> {
    if std::env::var_os(HANDOFF_VARIABLE).is_some() {
        // SAFETY-free: removing our own variable before any thread starts.
        std::env::remove_var(HANDOFF_VARIABLE);
        return Ok(());
    }
    let Ok(me) = std::env::current_exe() else {
        return Ok(());
    };
    let mut selection = Selection::load(state_dir)?;
    let before = selection.clone();
    let choice = choose(&mut selection, &me);
    if selection != before {
        selection.save(state_dir)?;
    }
    if let Choice::Exec(path) = choice {
        let error = exec_into(&path);
        eprintln!(
            "proplet: cannot start the selected agent {}: {error}; running this one",
            path.display()
        );
        if let Some(trial) = selection.trial.take() {
            selection.reports.push(PendingReport {
                rollout: trial.rollout,
                state: "rolled_back".into(),
                reason: format!(
                    "agent {} could not be started: {error}",
                    trial.binary.version
                ),
            });
        }
        selection.active = None;
        selection.save(state_dir)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binary(path: &str, version: &str) -> Binary {
        Binary {
            path: path.into(),
            version: version.into(),
        }
    }

    #[test]
    fn a_trial_runs_once_then_the_previous_binary_comes_back() {
        let me = Path::new("/usr/bin/proplet");
        let mut selection = Selection {
            trial: Some(Trial {
                binary: binary("/var/lib/proplet/agent/x/proplet", "2"),
                previous: binary("/usr/bin/proplet", "1"),
                rollout: "ns/r/u".into(),
                health_seconds: 30,
                launches: 0,
            }),
            ..Default::default()
        };
        assert_eq!(
            choose(&mut selection, me),
            Choice::Exec("/var/lib/proplet/agent/x/proplet".into())
        );
        // Started again without having been confirmed: it died.
        assert_eq!(choose(&mut selection, me), Choice::Continue);
        assert_eq!(selection.trial, None);
        assert_eq!(selection.reports.len(), 1);
        assert!(selection.reports[0]
            .reason
            .contains("stopped before it was healthy"));
    }

    #[test]
    fn the_active_binary_runs_and_the_selection_survives_a_save() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut selection = Selection::load(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            choose(&mut selection, Path::new("/usr/bin/proplet")),
            Choice::Continue
        );
        selection.active = Some(binary("/opt/p2", "2"));
        selection.save(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let mut back = Selection::load(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(back, selection);
        assert_eq!(
            choose(&mut back, Path::new("/usr/bin/proplet")),
            Choice::Exec("/opt/p2".into())
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(selection_file(dir.path()))
            .map(|m| m.permissions().mode() & 0o777)
            .unwrap_or_default();
        assert_eq!(mode, 0o600);
    }
}
