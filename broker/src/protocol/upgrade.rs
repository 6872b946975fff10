//! Agent upgrades: propeller asks one agent to install (or go back from) a version
//! (`control/manager/upgrade`), and the agent says how far it got
//! (`control/proplet/upgrade`). Both are propeller's own messages; upstream agents never
//! receive them.

use serde_json::Value;

use super::error::DecodeError;
use super::fields::{to_bytes, Fields, ObjectBuilder};

/// What an upgrade request asks of the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpgradeAction {
    /// Download, verify and start the version named.
    Install,
    /// Go back to the binary that ran before the last installed one.
    Revert,
}

impl UpgradeAction {
    /// The wire form: `install` or `revert`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Install => "install",
            Self::Revert => "revert",
        }
    }
}

/// What an agent does when asked to upgrade while tasks run on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BusyPolicy {
    /// Wait for the running tasks to finish, up to `wait_seconds`, then fail as busy.
    Wait,
    /// Fail as busy at once.
    Refuse,
}

impl BusyPolicy {
    /// The wire form: `wait` or `refuse`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Wait => "wait",
            Self::Refuse => "refuse",
        }
    }
}

/// Install a version, or go back (`control/manager/upgrade`), for one agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpgradeRequest {
    /// `id` (required): the rollout this belongs to; reports carry it back.
    pub id: String,
    /// `proplet_id` (required): the agent addressed.
    pub proplet_id: String,
    /// `action`: `install` (the default) or `revert`.
    pub action: UpgradeAction,
    /// `version`: the version the new binary reports (required to install).
    pub version: String,
    /// `url`: where the binary is, `https://…#sha256=<hex>` (the digest is required).
    pub url: String,
    /// `health_seconds`: how long the new binary has to connect and subscribe before the
    /// agent puts the previous one back.
    pub health_seconds: u64,
    /// `busy`: `wait` (the default) or `refuse`.
    pub busy: BusyPolicy,
    /// `wait_seconds`: how long `wait` waits for running tasks.
    pub wait_seconds: u64,
}

impl UpgradeRequest {
    pub(crate) fn from_fields(f: Fields<'_>) -> Result<Self, DecodeError> {
        let invalid = |key: &str, reason: &str| DecodeError::InvalidValue {
            key: f.key(key),
            reason: reason.to_owned(),
        };
        let action = match f.opt_str("action")?.as_deref() {
            None | Some("install") => UpgradeAction::Install,
            Some("revert") => UpgradeAction::Revert,
            Some(_) => return Err(invalid("action", "expected `install` or `revert`")),
        };
        let busy = match f.opt_str("busy")?.as_deref() {
            None | Some("wait") => BusyPolicy::Wait,
            Some("refuse") => BusyPolicy::Refuse,
            Some(_) => return Err(invalid("busy", "expected `wait` or `refuse`")),
        };
        let version = f.opt_str("version")?.unwrap_or_default();
        let url = f.opt_str("url")?.unwrap_or_default();
        if action == UpgradeAction::Install {
            if version.is_empty() {
                return Err(invalid("version", "an install names the version"));
            }
            if !url.contains("#sha256=") {
                return Err(invalid(
                    "url",
                    "an install pins the binary: `…#sha256=<hex>`",
                ));
            }
        }
        Ok(Self {
            id: f.req_id("id")?,
            proplet_id: f.req_id("proplet_id")?,
            action,
            version,
            url,
            health_seconds: f.opt_u64("health_seconds")?.unwrap_or(120),
            busy,
            wait_seconds: f.opt_u64("wait_seconds")?.unwrap_or(300),
        })
    }

    /// The JSON object.
    pub fn to_json(&self) -> Value {
        ObjectBuilder::new()
            .put("id", self.id.clone())
            .put("proplet_id", self.proplet_id.clone())
            .put("action", self.action.as_str())
            .put("version", self.version.clone())
            .put("url", self.url.clone())
            .put("health_seconds", self.health_seconds)
            .put("busy", self.busy.as_str())
            .put("wait_seconds", self.wait_seconds)
            .build()
    }

    /// The payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        to_bytes(&self.to_json())
    }
}

/// How far an agent got with an upgrade request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum UpgradeState {
    /// Fetching the binary.
    Downloading,
    /// Verified and installed beside the current one; the agent restarts into it.
    Installed,
    /// The new binary connected and subscribed within its deadline.
    Healthy,
    /// Nothing was replaced (a bad digest, a busy device, a download that failed, a binary
    /// that does not start).
    Failed,
    /// The previous binary runs again (the new one was not healthy in time, or a revert).
    RolledBack,
}

impl UpgradeState {
    /// The wire form.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Downloading => "downloading",
            Self::Installed => "installed",
            Self::Healthy => "healthy",
            Self::Failed => "failed",
            Self::RolledBack => "rolled_back",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "downloading" => Self::Downloading,
            "installed" => Self::Installed,
            "healthy" => Self::Healthy,
            "failed" => Self::Failed,
            "rolled_back" => Self::RolledBack,
            _ => return None,
        })
    }
}

/// An agent's report on an upgrade (`control/proplet/upgrade`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpgradeReport {
    /// `id`: the request's.
    pub id: String,
    /// `proplet_id`: the agent reporting (checked against its login).
    pub proplet_id: String,
    /// `state`.
    pub state: UpgradeState,
    /// `version`: the version running now.
    pub version: String,
    /// `reason`: why it failed or rolled back.
    pub reason: Option<String>,
}

impl UpgradeReport {
    pub(crate) fn from_fields(f: Fields<'_>) -> Result<Self, DecodeError> {
        let state = f.req_str("state")?;
        let state = UpgradeState::parse(&state).ok_or_else(|| DecodeError::InvalidValue {
            key: f.key("state"),
            reason: "expected downloading, installed, healthy, failed or rolled_back".into(),
        })?;
        Ok(Self {
            id: f.req_id("id")?,
            proplet_id: f.req_id("proplet_id")?,
            state,
            version: f.opt_str("version")?.unwrap_or_default(),
            reason: f.opt_str("reason")?.filter(|r| !r.is_empty()),
        })
    }

    /// The JSON object.
    pub fn to_json(&self) -> Value {
        ObjectBuilder::new()
            .put("id", self.id.clone())
            .put("proplet_id", self.proplet_id.clone())
            .put("state", self.state.as_str())
            .put("version", self.version.clone())
            .put_opt("reason", self.reason.clone())
            .build()
    }

    /// The payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        to_bytes(&self.to_json())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{decode, Inbound, TopicKind};

    #[test]
    fn requests_and_reports_round_trip_and_bad_ones_are_named() {
        let request = UpgradeRequest {
            id: "u1".into(),
            proplet_id: "edge".into(),
            action: UpgradeAction::Install,
            version: "1.2.3".into(),
            url: format!("https://h/proplet#sha256={}", "a".repeat(64)),
            health_seconds: 30,
            busy: BusyPolicy::Refuse,
            wait_seconds: 10,
        };
        assert_eq!(
            decode(&TopicKind::Upgrade, &request.encode()),
            Ok(Inbound::Upgrade(request.clone()))
        );
        let report = UpgradeReport {
            id: "u1".into(),
            proplet_id: "edge".into(),
            state: UpgradeState::RolledBack,
            version: "1.2.2".into(),
            reason: Some("not healthy within 30 s".into()),
        };
        assert_eq!(
            decode(&TopicKind::UpgradeReport, &report.encode()),
            Ok(Inbound::UpgradeReport(report))
        );
        let unpinned = r#"{"id":"u","proplet_id":"p","version":"1","url":"https://h/x"}"#;
        let error = decode(&TopicKind::Upgrade, unpinned.as_bytes())
            .err()
            .map(|e| e.to_string());
        assert!(
            error.as_deref().is_some_and(|e| e.contains("sha256")),
            "{error:?}"
        );
        let revert = r#"{"id":"u","proplet_id":"p","action":"revert"}"#;
        assert!(matches!(
            decode(&TopicKind::Upgrade, revert.as_bytes()),
            Ok(Inbound::Upgrade(UpgradeRequest {
                action: UpgradeAction::Revert,
                ..
            }))
        ));
        let bad_state = r#"{"id":"u","proplet_id":"p","state":"done"}"#;
        assert!(decode(&TopicKind::UpgradeReport, bad_state.as_bytes()).is_err());
    }
}
