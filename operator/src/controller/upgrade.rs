//! The PropletUpgrade controller: observe the fleet and the devices' reports, plan with the
//! core, write the status, then send the requests the plan asks for.

use std::time::Instant;

use chrono::{DateTime, Utc};
use propeller_broker::protocol::{
    BusyPolicy as WireBusy, Channel, UpgradeAction, UpgradeRequest, UpgradeState,
};
use serde_json::Value;
use tracing::warn;

use crate::crd::upgrade::{BusyPolicy, ProgressState, PropletUpgrade};
use crate::decision::upgrade::{
    plan, rollout_id, UpgradeCandidate, UpgradeOrder, UpgradeProgressReport,
};

use super::{count, Cluster, Next, ObjectName, ReconcileError};

/// A device's wire state as the rollout's.
fn progress(state: UpgradeState) -> ProgressState {
    match state {
        UpgradeState::Downloading => ProgressState::Downloading,
        UpgradeState::Installed => ProgressState::Installed,
        UpgradeState::Healthy => ProgressState::Healthy,
        UpgradeState::Failed => ProgressState::Failed,
        UpgradeState::RolledBack => ProgressState::RolledBack,
    }
}

/// Reconciles one PropletUpgrade.
#[tracing::instrument(
    name = "reconcile",
    skip_all,
    fields(object.kind = "PropletUpgrade", object.ref = %ObjectName::of(upgrade))
)]
pub async fn reconcile<C: Cluster>(
    cluster: &C,
    upgrade: &PropletUpgrade,
    now: DateTime<Utc>,
) -> Result<Next, ReconcileError> {
    let started = Instant::now();
    let result = async {
        let namespace = ObjectName::of(upgrade).namespace;
        let id = rollout_id(upgrade);
        let proplets = cluster.proplets_in(&namespace);
        let candidates: Vec<UpgradeCandidate> =
            proplets.iter().map(|p| UpgradeCandidate::of(p)).collect();
        let state = &cluster.common().state;
        let taken = state.take_upgrade_reports(&id);
        let reports: Vec<UpgradeProgressReport> = taken
            .iter()
            .filter_map(|(client, report)| {
                let proplet = cluster
                    .proplet_by_client(client)
                    .filter(|p| ObjectName::of(p.as_ref()).namespace == namespace)?;
                Some(UpgradeProgressReport {
                    proplet: proplet.metadata.name.clone().unwrap_or_default(),
                    state: progress(report.state),
                    version: report.version.clone(),
                    reason: report.reason.clone(),
                })
            })
            .collect();
        let plan = plan(upgrade, &candidates, &reports, now);
        let old = upgrade.status.clone().unwrap_or_default();
        if old != plan.status {
            let json = |s: &_| serde_json::to_value(s).unwrap_or(Value::Null);
            if let Err(e) = cluster
                .write_status::<PropletUpgrade>(&upgrade.metadata, &json(&old), &json(&plan.status))
                .await
            {
                state.restore_upgrade_reports(&id, taken);
                return Err(e.into());
            }
        }
        for note in &plan.notes {
            cluster.note(upgrade, note).await;
        }
        let spec = &upgrade.spec;
        for order in &plan.orders {
            let (name, action, url) = match order {
                UpgradeOrder::Install { proplet, url } => {
                    (proplet, UpgradeAction::Install, url.clone())
                }
                UpgradeOrder::Revert { proplet } => (proplet, UpgradeAction::Revert, String::new()),
            };
            let Some(proplet) = cluster.proplet(&ObjectName::new(&namespace, name)) else {
                continue;
            };
            let conn = &proplet.spec.connection_config;
            let Ok(channel) = Channel::new(conn.domain().unwrap_or_default(), &conn.channel_id)
            else {
                warn!(proplet = %name, "no usable domain and channel; the request is not sent");
                continue;
            };
            let request = UpgradeRequest {
                id: id.clone(),
                proplet_id: proplet.client_id().to_owned(),
                action,
                version: spec.version.clone(),
                url,
                health_seconds: u64::try_from(spec.health_seconds).unwrap_or(0),
                busy: match spec.busy {
                    BusyPolicy::Wait => WireBusy::Wait,
                    BusyPolicy::Refuse => WireBusy::Refuse,
                },
                wait_seconds: u64::try_from(spec.busy_wait_seconds).unwrap_or(0),
            };
            if let Err(e) = cluster.common().publisher.upgrade(&channel, &request).await {
                // Sent again at the plan's next ask.
                warn!(proplet = %name, %e, "could not send an upgrade request");
            }
        }
        Ok(plan.requeue_at)
    }
    .await;
    count(cluster.common(), "propletupgrade", started, &result);
    result
}
