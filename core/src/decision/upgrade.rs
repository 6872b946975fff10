//! The PropletUpgrade plan: which proplets to ask, in which wave, what each one's state is,
//! and when the rollout stops, resumes, completes or reverts.
//!
//! The proplets are fixed, and cut into waves of `waveSize`, when the rollout starts. A wave
//! starts once the one before it settled (every proplet healthy, failed or rolled back) and
//! `pauseSeconds` passed. A proplet is asked when its wave starts and it is Running; it is
//! healthy once it reports so, or shows the new version while Running. A proplet not healthy
//! `deadlineSeconds` after its wave started or it was asked has failed. When failures reach
//! `failureThreshold` the rollout stops: no wave starts, and the healthy proplets of the wave
//! under way are asked to go back. Raising the threshold resumes it; `revert` sends every
//! upgraded proplet back.

use std::collections::BTreeMap;

use chrono::{DateTime, TimeDelta, Utc};

use crate::crd::proplet::PropletPhase;
use crate::crd::upgrade::{
    ProgressState, PropletProgress, PropletUpgrade, PropletUpgradeStatus, UpgradePhase,
};
use crate::decision::task::Note;

/// How often an unanswered request is sent again (a device that restarted mid-download has
/// forgotten it).
pub const ASK_AGAIN_AFTER: TimeDelta = TimeDelta::seconds(30);

/// A proplet the rollout may cover, as observed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpgradeCandidate {
    /// The Proplet's name.
    pub name: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Whether it is a device (`external`); `k8s` proplets are pods, upgraded by their image.
    pub device: bool,
    /// Its phase.
    pub phase: PropletPhase,
    /// The agent version it reports.
    pub version: Option<String>,
    /// The CPU architecture it reports.
    pub arch: Option<String>,
}

impl UpgradeCandidate {
    /// The candidate `proplet` is.
    pub fn of(proplet: &crate::crd::proplet::Proplet) -> Self {
        let metadata = proplet.status.as_ref().and_then(|s| s.metadata.as_ref());
        Self {
            name: proplet.metadata.name.clone().unwrap_or_default(),
            labels: proplet.metadata.labels.clone().unwrap_or_default(),
            device: proplet.spec.type_ == crate::crd::proplet::PropletType::External,
            phase: proplet.status.as_ref().map(|s| s.phase).unwrap_or_default(),
            version: metadata.and_then(|m| m.proplet_version.clone()),
            arch: metadata.and_then(|m| m.cpu_arch.clone()),
        }
    }
}

/// The id a rollout's requests and reports carry: `namespace/name/uid`, so a rollout
/// deleted and made again under its name does not take the old one's reports.
pub fn rollout_id(upgrade: &PropletUpgrade) -> String {
    format!(
        "{}/{}/{}",
        upgrade.metadata.namespace.as_deref().unwrap_or("default"),
        upgrade.metadata.name.as_deref().unwrap_or_default(),
        upgrade.metadata.uid.as_deref().unwrap_or_default()
    )
}

/// The namespace and name in a [`rollout_id`].
pub fn rollout_of(id: &str) -> Option<(&str, &str)> {
    let mut parts = id.splitn(3, '/');
    Some((parts.next()?, parts.next()?))
}

/// What a device said about this rollout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpgradeProgressReport {
    /// The Proplet's name.
    pub proplet: String,
    /// Where it got.
    pub state: ProgressState,
    /// The version it runs.
    pub version: String,
    /// Why, for a failure or a rollback.
    pub reason: Option<String>,
}

/// A request to send to one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpgradeOrder {
    /// Install the binary at `url` (pinned by digest).
    Install {
        /// The Proplet.
        proplet: String,
        /// Its architecture's artifact.
        url: String,
    },
    /// Go back to the previous binary.
    Revert {
        /// The Proplet.
        proplet: String,
    },
}

/// What to do for one PropletUpgrade.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct UpgradePlan {
    /// The status to write.
    pub status: PropletUpgradeStatus,
    /// Requests to send.
    pub orders: Vec<UpgradeOrder>,
    /// Events.
    pub notes: Vec<Note>,
    /// When to look again without an event.
    pub requeue_at: Option<DateTime<Utc>>,
}

fn seconds(n: i64) -> TimeDelta {
    TimeDelta::seconds(n.max(0))
}

fn look_again_by(plan: &mut UpgradePlan, at: DateTime<Utc>) {
    plan.requeue_at = Some(plan.requeue_at.map_or(at, |t| t.min(at)));
}

/// The proplets the rollout covers, by name, cut into waves.
fn start(upgrade: &PropletUpgrade, candidates: &[UpgradeCandidate]) -> Vec<PropletProgress> {
    let spec = &upgrade.spec;
    let mut names: Vec<&UpgradeCandidate> = candidates
        .iter()
        .filter(|c| c.device)
        .filter(|c| {
            spec.selector
                .iter()
                .all(|(k, v)| c.labels.get(k) == Some(v))
        })
        .collect();
    names.sort_by(|a, b| a.name.cmp(&b.name));
    let size = spec.wave_size.max(1) as usize;
    names
        .iter()
        .enumerate()
        .map(|(i, c)| PropletProgress {
            name: c.name.clone(),
            wave: (i / size) as i32,
            ..Default::default()
        })
        .collect()
}

/// Plans one reconcile of `upgrade`.
pub fn plan(
    upgrade: &PropletUpgrade,
    candidates: &[UpgradeCandidate],
    reports: &[UpgradeProgressReport],
    now: DateTime<Utc>,
) -> UpgradePlan {
    let spec = &upgrade.spec;
    let mut plan = UpgradePlan {
        status: upgrade.status.clone().unwrap_or_default(),
        ..Default::default()
    };
    let status = &mut plan.status;
    if status.proplets.is_empty() && status.waves == 0 {
        status.proplets = start(upgrade, candidates);
        status.waves = status
            .proplets
            .iter()
            .map(|p| p.wave + 1)
            .max()
            .unwrap_or(0);
        status.wave = 0;
        status.wave_started_at = Some(now);
        if status.waves > 0 {
            plan.notes.push(Note::normal(
                "RolloutStarted",
                format!(
                    "{} proplets in {} waves to version {}",
                    status.proplets.len(),
                    status.waves,
                    spec.version
                ),
            ));
        }
    }
    let observed: BTreeMap<&str, &UpgradeCandidate> =
        candidates.iter().map(|c| (c.name.as_str(), c)).collect();
    apply_reports(&mut plan.status, reports, &spec.version);
    observe_versions(&mut plan.status, &observed, &spec.version);

    if spec.revert {
        revert(&mut plan, &observed, now);
        return finish(plan, now);
    }
    expire(&mut plan, &spec_deadline(upgrade), now);
    let failures = plan
        .status
        .proplets
        .iter()
        .filter(|p| p.state.is_failure())
        .count() as i32;
    let current = plan.status.wave;
    if failures >= spec.failure_threshold {
        if plan.status.phase != UpgradePhase::Stopped {
            plan.notes.push(Note::warning(
                "RolloutStopped",
                format!(
                    "{failures} proplets failed (threshold {}); wave {} is rolled back",
                    spec.failure_threshold,
                    current + 1
                ),
            ));
        }
        plan.status.phase = UpgradePhase::Stopped;
        plan.status.message = Some(format!(
            "stopped: {failures} proplets failed, the threshold is {}; raise failureThreshold to resume or set revert to go back",
            spec.failure_threshold
        ));
        // The healthy proplets of the wave that crossed the threshold go back.
        for p in plan
            .status
            .proplets
            .iter_mut()
            .filter(|p| p.wave == current && p.state == ProgressState::Healthy)
        {
            p.state = ProgressState::Reverting;
            p.requested_at = Some(now);
            p.last_asked_at = None;
        }
        ask_reverts(&mut plan, &observed, now);
        return finish(plan, now);
    }
    if spec.paused {
        plan.status.phase = UpgradePhase::Paused;
        plan.status.message = Some("paused: set paused to false to go on".into());
        return finish(plan, now);
    }
    plan.status.phase = UpgradePhase::Progressing;
    plan.status.message = None;
    advance(&mut plan, upgrade, now);
    if plan.status.phase == UpgradePhase::Progressing {
        ask_installs(&mut plan, upgrade, &observed, now);
        ask_reverts(&mut plan, &observed, now);
    }
    finish(plan, now)
}

/// How long a proplet has, from its request (or its wave's start), to be healthy.
fn spec_deadline(upgrade: &PropletUpgrade) -> TimeDelta {
    seconds(upgrade.spec.deadline_seconds)
}

/// Moves each reported proplet forward; a settled proplet only changes by a rollback or a
/// revert's outcome.
fn apply_reports(
    status: &mut PropletUpgradeStatus,
    reports: &[UpgradeProgressReport],
    target: &str,
) {
    for report in reports {
        let Some(p) = status
            .proplets
            .iter_mut()
            .find(|p| p.name == report.proplet)
        else {
            continue;
        };
        if !report.version.is_empty() {
            p.version = Some(report.version.clone());
        }
        let next = match (p.state, report.state) {
            (ProgressState::Reverting, ProgressState::RolledBack) => ProgressState::Reverted,
            (ProgressState::Reverting, ProgressState::Failed) => {
                p.reason = report.reason.clone();
                continue;
            }
            (ProgressState::Reverting, _) => continue,
            (ProgressState::Reverted | ProgressState::Pending, _) => continue,
            (_, ProgressState::Healthy) if report.version != target => continue,
            (current, new) if current.is_settled() && !new.is_failure() => continue,
            (current, new) if new < current && !new.is_failure() => continue,
            (_, new) => new,
        };
        if next.is_failure() || next == ProgressState::Reverted {
            p.reason = report.reason.clone();
        }
        p.state = next;
    }
}

/// A proplet Running on the target version is healthy even if its report was lost; one
/// being reverted that runs another version again is reverted.
fn observe_versions(
    status: &mut PropletUpgradeStatus,
    observed: &BTreeMap<&str, &UpgradeCandidate>,
    target: &str,
) {
    for p in &mut status.proplets {
        let Some(c) = observed.get(p.name.as_str()) else {
            continue;
        };
        if c.version.is_some() {
            p.version = c.version.clone();
        }
        let running = c.phase == PropletPhase::Running;
        let on_target = c.version.as_deref() == Some(target);
        match p.state {
            ProgressState::Downloading | ProgressState::Installed if running && on_target => {
                p.state = ProgressState::Healthy;
            }
            ProgressState::Reverting if running && !on_target && c.version.is_some() => {
                p.state = ProgressState::Reverted;
            }
            _ => {}
        }
    }
}

/// Proplets asked (or waiting in a started wave) past the deadline have failed.
fn expire(plan: &mut UpgradePlan, deadline: &TimeDelta, now: DateTime<Utc>) {
    let wave = plan.status.wave;
    let wave_started = plan.status.wave_started_at;
    let mut next = None::<DateTime<Utc>>;
    for p in &mut plan.status.proplets {
        let since = match p.state {
            ProgressState::Downloading | ProgressState::Installed => p.requested_at,
            ProgressState::Pending if p.wave == wave => wave_started,
            _ => None,
        };
        let Some(since) = since else { continue };
        let due = since + *deadline;
        if now >= due {
            let reason = if p.state == ProgressState::Pending {
                format!(
                    "not Running within {}s of its wave's start",
                    deadline.num_seconds()
                )
            } else {
                format!(
                    "not healthy within {}s of the request",
                    deadline.num_seconds()
                )
            };
            plan.notes.push(Note::warning(
                "UpgradeFailed",
                format!("{}: {reason}", p.name),
            ));
            p.state = ProgressState::Failed;
            p.reason = Some(reason);
        } else {
            next = Some(next.map_or(due, |n| n.min(due)));
        }
    }
    if let Some(at) = next {
        look_again_by(plan, at);
    }
}

/// Starts the next wave once the current one settled and the pause passed; completes the
/// rollout after the last.
fn advance(plan: &mut UpgradePlan, upgrade: &PropletUpgrade, now: DateTime<Utc>) {
    loop {
        let status = &mut plan.status;
        let wave = status.wave;
        let settled = status
            .proplets
            .iter()
            .filter(|p| p.wave == wave)
            .all(|p| p.state.is_settled());
        if !settled {
            status.wave_settled_at = None;
            return;
        }
        if wave + 1 >= status.waves {
            if status.phase != UpgradePhase::Completed {
                plan.notes.push(Note::normal(
                    "RolloutCompleted",
                    format!("every wave settled on version {}", upgrade.spec.version),
                ));
            }
            status.phase = UpgradePhase::Completed;
            return;
        }
        let settled_at = *status.wave_settled_at.get_or_insert(now);
        let next_at = settled_at + seconds(upgrade.spec.pause_seconds);
        if now < next_at {
            status.message = Some(format!(
                "wave {} settled; wave {} starts at {}",
                wave + 1,
                wave + 2,
                next_at.to_rfc3339()
            ));
            look_again_by(plan, next_at);
            return;
        }
        status.wave = wave + 1;
        status.wave_started_at = Some(now);
        status.wave_settled_at = None;
        plan.notes.push(Note::normal(
            "WaveStarted",
            format!("wave {} of {}", wave + 2, status.waves),
        ));
    }
}

/// Asks the Running proplets of the wave under way that are pending, and again those that
/// have not answered for [`ASK_AGAIN_AFTER`].
fn ask_installs(
    plan: &mut UpgradePlan,
    upgrade: &PropletUpgrade,
    observed: &BTreeMap<&str, &UpgradeCandidate>,
    now: DateTime<Utc>,
) {
    let wave = plan.status.wave;
    let mut orders = Vec::new();
    let mut notes = Vec::new();
    let mut next = None::<DateTime<Utc>>;
    for p in plan.status.proplets.iter_mut().filter(|p| p.wave == wave) {
        let Some(c) = observed.get(p.name.as_str()) else {
            continue;
        };
        let due = match p.state {
            ProgressState::Pending => true,
            ProgressState::Downloading | ProgressState::Installed => {
                p.last_asked_at.is_none_or(|at| now >= at + ASK_AGAIN_AFTER)
            }
            _ => false,
        };
        if !due || c.phase != PropletPhase::Running {
            if let Some(at) = p.last_asked_at.filter(|_| p.state.is_asked()) {
                let again = at + ASK_AGAIN_AFTER;
                next = Some(next.map_or(again, |n| n.min(again)));
            }
            continue;
        }
        if p.state == ProgressState::Pending
            && c.version.as_deref() == Some(upgrade.spec.version.as_str())
        {
            p.state = ProgressState::Healthy;
            continue;
        }
        let arch = c.arch.as_deref().unwrap_or_default();
        let Some(artifact) = upgrade.spec.artifacts.iter().find(|a| a.arch == arch) else {
            let reason = format!("no artifact for its architecture {arch:?}");
            notes.push(Note::warning(
                "UpgradeFailed",
                format!("{}: {reason}", p.name),
            ));
            p.state = ProgressState::Failed;
            p.reason = Some(reason);
            continue;
        };
        if p.state == ProgressState::Pending {
            p.state = ProgressState::Downloading;
            p.requested_at = Some(now);
        }
        p.last_asked_at = Some(now);
        let again = now + ASK_AGAIN_AFTER;
        next = Some(next.map_or(again, |n| n.min(again)));
        orders.push(UpgradeOrder::Install {
            proplet: p.name.clone(),
            url: artifact.url.clone(),
        });
    }
    plan.orders.extend(orders);
    plan.notes.extend(notes);
    if let Some(at) = next {
        look_again_by(plan, at);
    }
}

/// Sends (and sends again) the reverts not answered yet, to Running proplets.
fn ask_reverts(
    plan: &mut UpgradePlan,
    observed: &BTreeMap<&str, &UpgradeCandidate>,
    now: DateTime<Utc>,
) {
    let mut next = None::<DateTime<Utc>>;
    for p in plan
        .status
        .proplets
        .iter_mut()
        .filter(|p| p.state == ProgressState::Reverting)
    {
        let running = observed
            .get(p.name.as_str())
            .is_some_and(|c| c.phase == PropletPhase::Running);
        let due = p.last_asked_at.is_none_or(|at| now >= at + ASK_AGAIN_AFTER);
        if running && due {
            p.last_asked_at = Some(now);
            plan.orders.push(UpgradeOrder::Revert {
                proplet: p.name.clone(),
            });
        }
        let again = p.last_asked_at.map_or(now, |at| at) + ASK_AGAIN_AFTER;
        next = Some(next.map_or(again, |n| n.min(again)));
    }
    if let Some(at) = next {
        look_again_by(plan, at);
    }
}

/// `spec.revert`: every proplet this rollout moved goes back.
fn revert(
    plan: &mut UpgradePlan,
    observed: &BTreeMap<&str, &UpgradeCandidate>,
    now: DateTime<Utc>,
) {
    for p in &mut plan.status.proplets {
        if matches!(
            p.state,
            ProgressState::Healthy | ProgressState::Installed | ProgressState::Downloading
        ) {
            p.state = ProgressState::Reverting;
            p.requested_at = Some(now);
            p.last_asked_at = None;
        }
    }
    ask_reverts(plan, observed, now);
    let reverting = plan
        .status
        .proplets
        .iter()
        .filter(|p| p.state == ProgressState::Reverting)
        .count();
    if reverting == 0 {
        if plan.status.phase != UpgradePhase::Reverted {
            plan.notes.push(Note::normal(
                "RolloutReverted",
                "every upgraded proplet went back",
            ));
        }
        plan.status.phase = UpgradePhase::Reverted;
        plan.status.message = None;
    } else {
        plan.status.message = Some(format!("reverting {reverting} proplets"));
    }
}

/// How soon a rollout with proplets under way looks at them again: a proplet that shows the
/// new version is healthy even when its report was lost.
pub const WATCH_ASKED_EVERY: TimeDelta = TimeDelta::seconds(5);

/// The counts and the printer column's progress.
fn finish(mut plan: UpgradePlan, now: DateTime<Utc>) -> UpgradePlan {
    if plan.status.proplets.iter().any(|p| p.state.is_asked()) {
        look_again_by(&mut plan, now + WATCH_ASKED_EVERY);
    }
    let status = &mut plan.status;
    status.healthy = status
        .proplets
        .iter()
        .filter(|p| p.state == ProgressState::Healthy)
        .count() as i32;
    status.failed = status
        .proplets
        .iter()
        .filter(|p| p.state.is_failure())
        .count() as i32;
    status.progress = Some(if status.waves == 0 {
        "0/0".to_owned()
    } else {
        format!("{}/{}", status.wave + 1, status.waves)
    });
    if status.waves == 0 && status.phase == UpgradePhase::Progressing {
        status.phase = UpgradePhase::Completed;
        status.message = Some("no device Proplet matches the selector".into());
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::upgrade::PropletUpgradeSpec;

    fn t(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap_or_default()
    }

    fn upgrade(wave_size: i32, threshold: i32) -> PropletUpgrade {
        let spec: PropletUpgradeSpec = serde_json::from_value(serde_json::json!({
            "version": "2.0.0",
            "artifacts": [{"arch": "x86_64", "url": format!("http://h/p#sha256={}", "a".repeat(64))}],
            "waveSize": wave_size,
            "failureThreshold": threshold,
            "deadlineSeconds": 100,
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        PropletUpgrade::new("roll", spec)
    }

    fn fleet(n: usize, version: &str) -> Vec<UpgradeCandidate> {
        (0..n)
            .map(|i| UpgradeCandidate {
                name: format!("p{i}"),
                labels: BTreeMap::new(),
                device: true,
                phase: PropletPhase::Running,
                version: Some(version.into()),
                arch: Some("x86_64".into()),
            })
            .collect()
    }

    fn report(name: &str, state: ProgressState, version: &str) -> UpgradeProgressReport {
        UpgradeProgressReport {
            proplet: name.into(),
            state,
            version: version.into(),
            reason: Some("why".into()),
        }
    }

    fn step(
        u: &mut PropletUpgrade,
        fleet: &[UpgradeCandidate],
        reports: &[UpgradeProgressReport],
        now: DateTime<Utc>,
    ) -> UpgradePlan {
        let p = plan(u, fleet, reports, now);
        u.status = Some(p.status.clone());
        p
    }

    fn asked(p: &UpgradePlan) -> Vec<String> {
        p.orders
            .iter()
            .map(|o| match o {
                UpgradeOrder::Install { proplet, .. } => format!("install {proplet}"),
                UpgradeOrder::Revert { proplet } => format!("revert {proplet}"),
            })
            .collect()
    }

    #[test]
    fn waves_go_one_after_another_and_the_rollout_completes() {
        let mut u = upgrade(2, 1);
        let mut devices = fleet(4, "1.0.0");
        let first = step(&mut u, &devices, &[], t(0));
        assert_eq!(asked(&first), ["install p0", "install p1"]);
        assert_eq!(first.status.waves, 2);
        assert_eq!(first.status.progress.as_deref(), Some("1/2"));
        // p0 reports healthy; p1 only shows the new version.
        devices[1].version = Some("2.0.0".into());
        let second = step(
            &mut u,
            &devices,
            &[report("p0", ProgressState::Healthy, "2.0.0")],
            t(5),
        );
        assert_eq!(asked(&second), ["install p2", "install p3"]);
        assert_eq!(second.status.wave, 1);
        assert_eq!(second.status.healthy, 2);
        for d in &mut devices {
            d.version = Some("2.0.0".into());
        }
        let done = step(&mut u, &devices, &[], t(6));
        assert_eq!(done.status.phase, UpgradePhase::Completed);
        assert_eq!(done.status.healthy, 4);
        assert!(done.orders.is_empty());
    }

    #[test]
    fn a_failure_at_the_threshold_stops_and_rolls_back_the_wave() {
        let mut u = upgrade(3, 1);
        let devices = fleet(6, "1.0.0");
        step(&mut u, &devices, &[], t(0));
        let p = step(
            &mut u,
            &devices,
            &[
                report("p0", ProgressState::Healthy, "2.0.0"),
                report("p1", ProgressState::RolledBack, "1.0.0"),
            ],
            t(5),
        );
        assert_eq!(p.status.phase, UpgradePhase::Stopped);
        assert_eq!(asked(&p), ["revert p0"]);
        assert_eq!(p.status.failed, 1);
        // No further wave starts, even when p2 settles.
        let p = step(
            &mut u,
            &devices,
            &[
                report("p2", ProgressState::Failed, "1.0.0"),
                report("p0", ProgressState::RolledBack, "1.0.0"),
            ],
            t(6),
        );
        assert_eq!(p.status.phase, UpgradePhase::Stopped);
        assert_eq!(p.status.wave, 0);
        assert!(p.orders.is_empty());
        let states: Vec<_> = p.status.proplets.iter().map(|p| p.state).collect();
        assert_eq!(
            &states[..3],
            [
                ProgressState::Reverted,
                ProgressState::RolledBack,
                ProgressState::Failed
            ]
        );
        // Raising the threshold resumes it with the next wave.
        u.spec.failure_threshold = 5;
        let p = step(&mut u, &devices, &[], t(7));
        assert_eq!(p.status.phase, UpgradePhase::Progressing);
        assert_eq!(asked(&p), ["install p3", "install p4", "install p5"]);
    }

    #[test]
    fn the_deadline_fails_silent_proplets_and_unanswered_requests_go_again() {
        let mut u = upgrade(1, 2);
        let devices = fleet(2, "1.0.0");
        let p = step(&mut u, &devices, &[], t(0));
        assert_eq!(p.requeue_at, Some(t(5)));
        let p = step(&mut u, &devices, &[], t(30));
        assert_eq!(asked(&p), ["install p0"]);
        let p = step(&mut u, &devices, &[], t(100));
        assert_eq!(p.status.proplets[0].state, ProgressState::Failed);
        assert_eq!(asked(&p), ["install p1"]);
    }

    #[test]
    fn paused_holds_and_revert_sends_the_upgraded_back() {
        let mut u = upgrade(1, 1);
        let mut devices = fleet(2, "1.0.0");
        step(&mut u, &devices, &[], t(0));
        devices[0].version = Some("2.0.0".into());
        u.spec.paused = true;
        let p = step(&mut u, &devices, &[], t(1));
        assert_eq!(p.status.phase, UpgradePhase::Paused);
        assert!(p.orders.is_empty());
        u.spec.revert = true;
        let p = step(&mut u, &devices, &[], t(2));
        assert_eq!(asked(&p), ["revert p0"]);
        devices[0].version = Some("1.0.0".into());
        let p = step(&mut u, &devices, &[], t(3));
        assert_eq!(p.status.phase, UpgradePhase::Reverted);
    }

    #[test]
    fn a_missing_artifact_and_an_offline_proplet_fail_with_their_reason() {
        let mut u = upgrade(2, 5);
        let mut devices = fleet(2, "1.0.0");
        devices[0].arch = Some("riscv64".into());
        devices[1].phase = PropletPhase::Offline;
        let p = step(&mut u, &devices, &[], t(0));
        assert!(p.orders.is_empty());
        assert!(p.status.proplets[0]
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("riscv64")));
        let p = step(&mut u, &devices, &[], t(100));
        assert_eq!(p.status.proplets[1].state, ProgressState::Failed);
        assert_eq!(p.status.phase, UpgradePhase::Completed);
    }
}
