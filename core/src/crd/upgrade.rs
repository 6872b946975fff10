//! PropletUpgrade: "these proplets should run agent version X", rolled out in waves that stop
//! by themselves when too many devices fail.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::bounded_string_map;

/// Desired state of a PropletUpgrade.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "propeller.propeller.absmach.eu",
    version = "v1",
    kind = "PropletUpgrade",
    plural = "propletupgrades",
    shortname = "pupgrade",
    namespaced,
    status = "PropletUpgradeStatus",
    printcolumn = r#"{"name":"Version","type":"string","jsonPath":".spec.version"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Wave","type":"string","jsonPath":".status.progress"}"#,
    printcolumn = r#"{"name":"Healthy","type":"integer","jsonPath":".status.healthy"}"#,
    printcolumn = r#"{"name":"Failed","type":"integer","jsonPath":".status.failed"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct PropletUpgradeSpec {
    /// Labels the Proplets to upgrade carry (every `external` Proplet of the namespace when
    /// empty). The set is fixed when the rollout starts.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "bounded_string_map::<32, 63>")]
    pub selector: BTreeMap<String, String>,
    /// The version the new agent reports (`proplet --version`, and the Proplet's
    /// `status.metadata.propletVersion`).
    #[schemars(length(min = 1, max = 64))]
    pub version: String,
    /// The agent binary for each CPU architecture the devices report (`x86_64`, `aarch64`,
    /// `arm`), each an `https://` (or `http://`) URL pinned with `#sha256=<64 hex digits>`.
    #[schemars(length(min = 1, max = 8))]
    pub artifacts: Vec<UpgradeArtifact>,
    /// Proplets upgraded at once, in each wave.
    #[serde(default = "default_wave_size")]
    #[schemars(range(min = 1, max = 10000))]
    pub wave_size: i32,
    /// Failed proplets that stop the rollout: when this many have failed, no further wave
    /// starts and the healthy proplets of the wave that crossed it are rolled back.
    #[serde(default = "default_failure_threshold")]
    #[schemars(range(min = 1, max = 10000))]
    pub failure_threshold: i32,
    /// Seconds to wait after a wave is healthy before the next one starts.
    #[serde(default)]
    #[schemars(range(min = 0, max = 86400))]
    pub pause_seconds: i64,
    /// Seconds a proplet has from the request until its new agent is healthy (downloaded,
    /// verified, restarted, connected and subscribed); the device itself goes back to its
    /// previous binary if the new one is not healthy within the last `healthSeconds` of it.
    #[serde(default = "default_deadline_seconds")]
    #[schemars(range(min = 10, max = 86400))]
    pub deadline_seconds: i64,
    /// Seconds the new agent has after its restart to connect and subscribe.
    #[serde(default = "default_health_seconds")]
    #[schemars(range(min = 5, max = 3600))]
    pub health_seconds: i64,
    /// What a proplet running tasks does: `Wait` for them (up to `busyWaitSeconds`), or
    /// `Refuse` (it fails as busy).
    #[serde(default)]
    pub busy: BusyPolicy,
    /// How long `Wait` waits for running tasks.
    #[serde(default = "default_busy_wait_seconds")]
    #[schemars(range(min = 0, max = 86400))]
    pub busy_wait_seconds: i64,
    /// Holds the rollout: no new wave and no new request while true.
    #[serde(default)]
    pub paused: bool,
    /// Puts every proplet this rollout upgraded back on its previous agent.
    #[serde(default)]
    pub revert: bool,
}

/// One architecture's agent binary.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UpgradeArtifact {
    /// The CPU architecture, as the agent reports it (`x86_64`, `aarch64`, `arm`).
    #[schemars(length(min = 1, max = 64))]
    pub arch: String,
    /// `https://…#sha256=<hex>`: the binary, pinned by its digest.
    #[schemars(
        length(min = 1, max = 2048),
        regex(pattern = r"^https?://[^#]+#sha256=[0-9a-f]{64}$")
    )]
    pub url: String,
}

/// What a busy proplet does.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum BusyPolicy {
    /// Wait for running tasks, up to `busyWaitSeconds`.
    #[default]
    Wait,
    /// Fail as busy.
    Refuse,
}

fn default_wave_size() -> i32 {
    1
}
fn default_failure_threshold() -> i32 {
    1
}
fn default_deadline_seconds() -> i64 {
    600
}
fn default_health_seconds() -> i64 {
    120
}
fn default_busy_wait_seconds() -> i64 {
    300
}

/// Where a rollout stands.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum UpgradePhase {
    /// Waves are under way.
    #[default]
    Progressing,
    /// `spec.paused`: held.
    Paused,
    /// The failure threshold was reached: no further wave starts.
    Stopped,
    /// Every proplet of every wave is healthy on the new version (or failed below the
    /// threshold).
    Completed,
    /// `spec.revert`: the upgraded proplets went back.
    Reverted,
}

/// Where one proplet stands, in the order a rollout moves it.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, JsonSchema,
)]
pub enum ProgressState {
    /// Its wave has not started.
    #[default]
    Pending,
    /// Asked; fetching the binary.
    Downloading,
    /// Verified and installed; restarting into it.
    Installed,
    /// Running the new version, connected.
    Healthy,
    /// Nothing replaced, or not healthy in time.
    Failed,
    /// The new agent was not healthy in time, and the device put its previous agent back
    /// by itself.
    RolledBack,
    /// Asked to go back to its previous agent (a revert, or its wave crossed the threshold).
    Reverting,
    /// On its previous agent again, as asked.
    Reverted,
}

impl ProgressState {
    /// Whether the proplet's part of the wave is over.
    pub fn is_settled(self) -> bool {
        matches!(
            self,
            Self::Healthy | Self::Failed | Self::RolledBack | Self::Reverted
        )
    }

    /// Whether it counts against the failure threshold.
    pub fn is_failure(self) -> bool {
        matches!(self, Self::Failed | Self::RolledBack)
    }

    /// Whether the proplet was asked and has not settled yet.
    pub fn is_asked(self) -> bool {
        matches!(self, Self::Downloading | Self::Installed | Self::Reverting)
    }
}

/// One proplet's progress.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PropletProgress {
    /// The Proplet.
    pub name: String,
    /// Its wave (0 is the first).
    pub wave: i32,
    /// Where it stands.
    pub state: ProgressState,
    /// The agent version it reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Why it failed or rolled back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// When it was first asked (the deadline counts from here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_at: Option<DateTime<Utc>>,
    /// When the request was last sent (it is sent again while unanswered).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_asked_at: Option<DateTime<Utc>>,
}

/// Observed state of a PropletUpgrade.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PropletUpgradeStatus {
    /// Where the rollout stands.
    #[serde(default)]
    pub phase: UpgradePhase,
    /// The wave under way (0 is the first).
    #[serde(default)]
    pub wave: i32,
    /// Waves in all.
    #[serde(default)]
    pub waves: i32,
    /// `wave/waves` for the printer column, e.g. `2/4`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<String>,
    /// Proplets healthy on the new version.
    #[serde(default)]
    pub healthy: i32,
    /// Proplets that failed or rolled back by themselves.
    #[serde(default)]
    pub failed: i32,
    /// When the wave under way started (an offline proplet fails at its deadline from here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wave_started_at: Option<DateTime<Utc>>,
    /// When the wave under way settled (the pause counts from here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wave_settled_at: Option<DateTime<Utc>>,
    /// Every proplet of the rollout, by wave.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub proplets: Vec<PropletProgress>,
    /// A sentence on what the rollout waits for, or why it stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}
