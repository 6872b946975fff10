//! Upgrade requests: download, verify and install a new agent beside this one and restart
//! into it, or go back to the previous one; and, in a new agent on trial, confirm it once
//! healthy or put the previous one back (see [`crate::upgrade`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use propeller_broker::protocol::{
    BusyPolicy, UpgradeAction, UpgradeReport, UpgradeRequest, UpgradeState,
};
use tracing::{info, warn};

use crate::fetch::{split_digest, to_hex, HttpFetcher};
use crate::upgrade::{agent_dir, same_file, Binary, Selection, Trial, AGENT_VERSION};

use super::Agent;

/// The largest agent binary accepted.
const MAX_AGENT_BYTES: u64 = 512 * 1024 * 1024;
/// How long the download may take.
const DOWNLOAD_TIMEOUT: Duration = Duration::from_secs(600);
/// How long the new binary has to answer `--version`.
const PREFLIGHT_TIMEOUT: Duration = Duration::from_secs(10);

impl Agent {
    /// Handles an upgrade request addressed to this agent; one at a time (a repeat of the
    /// request under way is ignored).
    pub(super) async fn on_upgrade(self: Arc<Self>, request: UpgradeRequest) {
        if request.proplet_id != self.config.client_id {
            return;
        }
        if self.upgrading.swap(true, Ordering::SeqCst) {
            return;
        }
        let outcome = match request.action {
            UpgradeAction::Install => self.install(&request).await,
            UpgradeAction::Revert => self.revert(&request).await,
        };
        match outcome {
            Ok(Some(binary)) => self.restart_into(binary),
            Ok(None) => self.upgrading.store(false, Ordering::SeqCst),
            Err(reason) => {
                warn!(rollout = request.id, %reason, "upgrade failed; nothing was replaced");
                self.report_upgrade(
                    &request.id,
                    UpgradeState::Failed,
                    AGENT_VERSION,
                    Some(reason),
                )
                .await;
                self.upgrading.store(false, Ordering::SeqCst);
            }
        }
    }

    /// Downloads, verifies, installs and tries the new binary; `Some(path)`: restart into it.
    async fn install(&self, request: &UpgradeRequest) -> Result<Option<PathBuf>, String> {
        if request.version == AGENT_VERSION {
            self.report_upgrade(&request.id, UpgradeState::Healthy, AGENT_VERSION, None)
                .await;
            return Ok(None);
        }
        self.wait_until_idle(request).await?;
        self.report_upgrade(&request.id, UpgradeState::Downloading, AGENT_VERSION, None)
            .await;
        info!(
            rollout = request.id,
            version = request.version,
            "downloading a new agent"
        );
        let digest = match split_digest(&request.url) {
            Ok((_, Some(digest))) => to_hex(&digest),
            Ok((_, None)) => return Err("the URL pins no sha256 digest".into()),
            Err(e) => return Err(e.to_string()),
        };
        let fetcher =
            HttpFetcher::new(DOWNLOAD_TIMEOUT, MAX_AGENT_BYTES).map_err(|e| e.to_string())?;
        let dir = agent_dir(&self.config.state_dir).join(&digest);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        // Left by a download cut short (the agent killed mid-way): written again from the
        // start.
        let partial = dir.join("proplet.partial");
        fetcher
            .download_to(&request.url, &partial)
            .await
            .map_err(|e| format!("download: {e}"))?;
        let path = dir.join("proplet");
        install_executable(&partial, &path)
            .map_err(|e| format!("installing in {}: {e}", dir.display()))?;
        if let Err(reason) = preflight(&path, &request.version).await {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(format!("the new agent does not start: {reason}"));
        }
        let me = std::env::current_exe().map_err(|e| format!("this agent's path: {e}"))?;
        let state_dir = self.config.state_dir.clone();
        let mut selection = Selection::load(&state_dir).map_err(|e| e.to_string())?;
        selection.trial = Some(Trial {
            binary: Binary {
                path: path.clone(),
                version: request.version.clone(),
            },
            previous: Binary {
                path: me,
                version: AGENT_VERSION.to_owned(),
            },
            rollout: request.id.clone(),
            health_seconds: request.health_seconds,
            // This start counts: a trial that dies is not started again.
            launches: 1,
        });
        selection.save(&state_dir).map_err(|e| e.to_string())?;
        self.report_upgrade(&request.id, UpgradeState::Installed, AGENT_VERSION, None)
            .await;
        info!(rollout = request.id, path = %path.display(), "installed; restarting into it");
        Ok(Some(path))
    }

    /// Goes back to the previous binary; `Some(path)`: restart into it.
    async fn revert(&self, request: &UpgradeRequest) -> Result<Option<PathBuf>, String> {
        let state_dir = self.config.state_dir.clone();
        let mut selection = Selection::load(&state_dir).map_err(|e| e.to_string())?;
        let Some(previous) = selection.previous.take() else {
            return Err("no previous agent to go back to".into());
        };
        self.wait_until_idle(request).await?;
        selection.previous = selection.active.take();
        selection.active = Some(previous.clone());
        selection.save(&state_dir).map_err(|e| e.to_string())?;
        self.report_upgrade(
            &request.id,
            UpgradeState::RolledBack,
            &previous.version,
            Some(format!(
                "reverted from {AGENT_VERSION} to {}",
                previous.version
            )),
        )
        .await;
        let me = std::env::current_exe().map_err(|e| e.to_string())?;
        if same_file(&previous.path, &me) {
            return Ok(None);
        }
        info!(
            rollout = request.id,
            version = previous.version,
            "reverting to the previous agent"
        );
        Ok(Some(previous.path))
    }

    /// Waits for running tasks as `request` says, or fails as busy.
    async fn wait_until_idle(&self, request: &UpgradeRequest) -> Result<(), String> {
        let busy = || self.lock_running().len();
        if busy() == 0 {
            return Ok(());
        }
        if request.busy == BusyPolicy::Refuse {
            return Err(format!("busy: {} tasks running", busy()));
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(request.wait_seconds);
        while busy() > 0 {
            if tokio::time::Instant::now() >= deadline {
                return Err(format!(
                    "busy: {} tasks still running after {}s",
                    busy(),
                    request.wait_seconds
                ));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        Ok(())
    }

    /// Spools an upgrade report (sent at QoS 1, kept across the restart).
    pub(super) async fn report_upgrade(
        &self,
        rollout: &str,
        state: UpgradeState,
        version: &str,
        reason: Option<String>,
    ) {
        let report = UpgradeReport {
            id: rollout.to_owned(),
            proplet_id: self.config.client_id.clone(),
            state,
            version: version.to_owned(),
            reason,
        };
        self.spool_message(self.channel.upgrade_report(), report.encode())
            .await;
    }

    /// Asks the run loop to stop and the process to `exec` `binary`.
    fn restart_into(&self, binary: PathBuf) {
        *self.lock_restart() = Some(binary);
        self.restart.notify_one();
    }

    /// The binary to `exec` once [`Agent::run`] returned, if an upgrade asked for one.
    pub fn restart_target(&self) -> Option<PathBuf> {
        self.lock_restart().clone()
    }

    /// At start: spools what the launcher had to report, and, for a binary on trial, gives
    /// it `health_seconds` to connect and subscribe before the previous one comes back.
    pub(super) async fn start_upgrades(self: Arc<Self>) {
        let state_dir = self.config.state_dir.clone();
        let mut selection = match Selection::load(&state_dir) {
            Ok(s) => s,
            Err(e) => {
                warn!(%e, "cannot read the agent selection");
                return;
            }
        };
        if !selection.reports.is_empty() {
            for pending in std::mem::take(&mut selection.reports) {
                let state = if pending.state == "failed" {
                    UpgradeState::Failed
                } else {
                    UpgradeState::RolledBack
                };
                warn!(
                    rollout = pending.rollout,
                    reason = pending.reason,
                    "upgrade given up"
                );
                self.report_upgrade(&pending.rollout, state, AGENT_VERSION, Some(pending.reason))
                    .await;
            }
            if let Err(e) = selection.save(&state_dir) {
                warn!(%e, "cannot update the agent selection");
            }
        }
        let Some(trial) = selection.trial.clone() else {
            return;
        };
        let Ok(me) = std::env::current_exe() else {
            return;
        };
        if !same_file(&trial.binary.path, &me) {
            return;
        }
        info!(
            version = AGENT_VERSION,
            health_seconds = trial.health_seconds,
            "running on trial"
        );
        *self.lock_trial() = Some(trial.clone());
        tokio::time::sleep(Duration::from_secs(trial.health_seconds)).await;
        if self.lock_trial().take().is_none() {
            return;
        }
        let reason = format!(
            "agent {AGENT_VERSION} did not connect and subscribe within {}s; back on {}",
            trial.health_seconds, trial.previous.version
        );
        warn!(%reason, "giving the new agent up");
        let mut selection = Selection::load(&state_dir).unwrap_or_default();
        selection.trial = None;
        selection.reports.push(crate::upgrade::PendingReport {
            rollout: trial.rollout.clone(),
            state: "rolled_back".into(),
            reason,
        });
        if let Err(e) = selection.save(&state_dir) {
            warn!(%e, "cannot update the agent selection");
        }
        self.restart_into(trial.previous.path);
    }

    /// Once subscribed: a binary on trial has proven healthy and becomes the active one.
    pub(super) async fn confirm_trial(&self) {
        let Some(trial) = self.lock_trial().take() else {
            return;
        };
        let state_dir = &self.config.state_dir;
        let mut selection = Selection::load(state_dir).unwrap_or_default();
        selection.trial = None;
        selection.previous = Some(trial.previous.clone());
        selection.active = Some(trial.binary.clone());
        if let Err(e) = selection.save(state_dir) {
            warn!(%e, "cannot record the new agent as the active one");
        }
        info!(version = AGENT_VERSION, "the new agent is healthy");
        self.report_upgrade(&trial.rollout, UpgradeState::Healthy, AGENT_VERSION, None)
            .await;
    }
}

/// Makes the verified download `partial` the executable `path` (owner-only: 0700).
fn install_executable(partial: &Path, path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(partial, std::fs::Permissions::from_mode(0o700))?;
    std::fs::rename(partial, path)
}

/// Runs `binary --version` and checks it names `version`.
async fn preflight(binary: &Path, version: &str) -> Result<(), String> {
    let run = tokio::process::Command::new(binary)
        .arg("--version")
        .kill_on_drop(true)
        .output();
    let output = match tokio::time::timeout(PREFLIGHT_TIMEOUT, run).await {
        Err(_) => {
            return Err(format!(
                "`--version` did not answer in {PREFLIGHT_TIMEOUT:?}"
            ))
        }
        Ok(Err(e)) => return Err(e.to_string()),
        Ok(Ok(output)) => output,
    };
    let said = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!("`--version` exited with {}", output.status));
    }
    if !said.split_whitespace().any(|word| word == version) {
        return Err(format!("`--version` says {:?}, not {version}", said.trim()));
    }
    Ok(())
}
