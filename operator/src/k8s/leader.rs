//! The leader Lease (`--leader-elect`): one replica acts, the others wait to take over. The
//! decisions are `propeller_core::shard::leader`'s; this is the loop that reads and writes
//! the Lease.
//!
//! ```text
//!  acquire: read ──▶ next_step ──▶ Create / Take (conditional on the version read) ──▶ held
//!                         └── Wait: read again every retry_every
//!  hold: every renew_every ──▶ PUT (conditional) ──▶ Ownership::lead(sent at)
//!          409 ──▶ read: another holder ──▶ Lost
//!          no answer ──▶ the fence lapses by itself (Ownership::is_fenced): no turn, no write
//!  release (shutdown): holder cleared, so a candidate takes it at once
//! ```
//!
//! The holder is an [`Ownership`] of one member: while its renewals fail it takes no turn
//! and the API client's fence refuses its writes, from two thirds of the Lease's duration,
//! before any candidate can see the Lease expire. Its MQTT broker stays up meanwhile, so what
//! devices report is kept and written once a renewal succeeds again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{SecondsFormat, Utc};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, PostParams};
use propeller_core::shard::leader::{
    next_step, renew_every, retry_every, HolderSighting, LeaderStep, LeaseRecord,
};
use serde_json::json;
use tracing::{info, warn};

use crate::controller::ownership::Ownership;
use crate::errors::error_chain;

/// How often the fence is looked at to say so in the log and on `/metrics`.
const CHECK_EVERY: Duration = Duration::from_millis(250);

/// Which Lease, and who this replica is.
#[derive(Debug, Clone)]
pub struct LeaderSettings {
    /// The Lease's name.
    pub name: String,
    /// Its namespace.
    pub namespace: String,
    /// This replica's identity (its pod name in a cluster).
    pub identity: String,
    /// How long the Lease lasts without a renewal.
    pub lease_duration: Duration,
}

/// Why this replica stopped holding the Lease.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    /// Another replica took it while this one could not renew.
    #[error("the leader Lease {name} is now held by {holder}")]
    Lost {
        /// The Lease.
        name: String,
        /// Its new holder.
        holder: String,
    },
}

fn record(lease: &Lease) -> LeaseRecord {
    let spec = lease.spec.as_ref();
    LeaseRecord {
        holder: spec.and_then(|s| s.holder_identity.clone()),
        renewal: spec
            .and_then(|s| s.renew_time.as_ref())
            .map(|t| t.0.to_string()),
        duration: Duration::from_secs(
            spec.and_then(|s| s.lease_duration_seconds)
                .and_then(|s| u64::try_from(s).ok())
                .unwrap_or(15),
        ),
    }
}

/// The Lease held by `holder` (`None`: released), based on `current` (its version and
/// transitions), renewed now.
fn written(
    settings: &LeaderSettings,
    current: Option<&Lease>,
    holder: Option<&str>,
) -> Result<Lease, serde_json::Error> {
    let now = Utc::now().to_rfc3339_opts(SecondsFormat::Micros, true);
    let spec = current.and_then(|l| l.spec.as_ref());
    let previous = spec.and_then(|s| s.holder_identity.as_deref());
    let transitions = spec.and_then(|s| s.lease_transitions).unwrap_or(0);
    let changes_hands = holder.is_some() && previous != holder;
    let acquired = match (changes_hands, spec.and_then(|s| s.acquire_time.as_ref())) {
        (false, Some(t)) => json!(t),
        _ => json!(now),
    };
    serde_json::from_value(json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": settings.name,
            "namespace": settings.namespace,
            "resourceVersion": current.and_then(|l| l.metadata.resource_version.clone()),
        },
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": settings.lease_duration.as_secs().max(1),
            "acquireTime": acquired,
            "renewTime": now,
            "leaseTransitions": transitions + i32::from(changes_hands && previous.is_some()),
        },
    }))
}

/// One attempt: reads the Lease and takes or renews it if this replica may. `Ok(Some(..))`
/// with the Lease as written and when the write was sent; `Ok(None)` while another holds
/// it (and until when, at most, to wait).
async fn attempt(
    api: &Api<Lease>,
    settings: &LeaderSettings,
    sighting: &mut HolderSighting,
) -> Result<Result<(Lease, Instant), Duration>, kube::Error> {
    let current = api.get_opt(&settings.name).await?;
    let step = next_step(
        &settings.identity,
        current.as_ref().map(record).as_ref(),
        sighting,
        Instant::now(),
    );
    let sent = Instant::now();
    let me = Some(settings.identity.as_str());
    let lease = match step {
        LeaderStep::Wait { expires_in, .. } => return Ok(Err(expires_in)),
        LeaderStep::Create => {
            let lease = written(settings, None, me).map_err(kube::Error::SerdeError)?;
            api.create(&PostParams::default(), &lease).await?
        }
        LeaderStep::Take | LeaderStep::Renew => {
            let lease = written(settings, current.as_ref(), me).map_err(kube::Error::SerdeError)?;
            api.replace(&settings.name, &PostParams::default(), &lease)
                .await?
        }
    };
    Ok(Ok((lease, sent)))
}

/// Waits until this replica holds the Lease, then has `shard` act on every object. `None`
/// when `stop` resolved first. `server` names the API server in the log.
pub async fn acquire(
    client: kube::Client,
    server: &str,
    settings: &LeaderSettings,
    shard: &Ownership,
    stop: impl std::future::Future<Output = ()>,
) -> Option<Lease> {
    let api: Api<Lease> = Api::namespaced(client, &settings.namespace);
    let mut sighting = HolderSighting::default();
    let mut stop = std::pin::pin!(stop);
    let mut said_waiting = false;
    loop {
        let wait = retry_every(settings.lease_duration);
        let attempted = tokio::select! {
            attempted = tokio::time::timeout(wait.max(Duration::from_secs(2)), attempt(&api, settings, &mut sighting)) => attempted,
            _ = &mut stop => return None,
        };
        match attempted {
            Ok(Ok(Ok((lease, sent)))) => {
                shard.lead(sent).await;
                info!(lease = %settings.name, "leading");
                return Some(lease);
            }
            Ok(Ok(Err(_))) if !said_waiting => {
                said_waiting = true;
                info!(lease = %settings.name, "waiting to become the leader");
            }
            Ok(Ok(Err(_))) => {}
            // Another candidate won the race for the same version: read again.
            Ok(Err(kube::Error::Api(e))) if e.code == 409 => {}
            Ok(Err(e)) => warn!(
                %server,
                lease = %settings.name,
                error = %error_chain(&e),
                retry_in = ?wait,
                "cannot reach the Lease for leader election"
            ),
            Err(_) => {
                warn!(lease = %settings.name, retry_in = ?wait, "the API server did not answer about the leader Lease")
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = &mut stop => return None,
        }
    }
}

/// Renews the Lease held as `lease` until `stop` resolves (then releases it) or another
/// replica takes it (then returns why).
pub async fn hold(
    client: kube::Client,
    settings: LeaderSettings,
    shard: Arc<Ownership>,
    mut lease: Lease,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), LeaderError> {
    let api: Api<Lease> = Api::namespaced(client, &settings.namespace);
    let every = renew_every(settings.lease_duration);
    let mut renew = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    renew.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Apart from the renewals: one in flight waits up to `every` for its answer, long enough
    // for a whole fence to begin and end unsaid. Dropped (so aborted) when this returns.
    let mut fence_watch = tokio::task::JoinSet::new();
    fence_watch.spawn(say_fence_changes(shard.clone(), settings.name.clone()));
    let mut stop = std::pin::pin!(stop);
    loop {
        tokio::select! {
            _ = renew.tick() => {}
            _ = &mut stop => break,
        }
        let sent = Instant::now();
        let renewed = match written(&settings, Some(&lease), Some(&settings.identity)) {
            Ok(next) => {
                tokio::time::timeout(
                    every,
                    api.replace(&settings.name, &PostParams::default(), &next),
                )
                .await
            }
            Err(e) => Ok(Err(kube::Error::SerdeError(e))),
        };
        match renewed {
            Ok(Ok(next)) => {
                lease = next;
                shard.lead(sent).await;
            }
            Ok(Err(kube::Error::Api(e))) if e.code == 409 || e.code == 404 => {
                // Written by someone else since: see who holds it now.
                match api.get_opt(&settings.name).await {
                    Ok(Some(current)) => {
                        let holder = record(&current).holder.unwrap_or_default();
                        if holder != settings.identity {
                            return Err(LeaderError::Lost {
                                name: settings.name.clone(),
                                holder,
                            });
                        }
                        lease = current;
                        renew.reset_immediately();
                    }
                    Ok(None) => {
                        return Err(LeaderError::Lost {
                            name: settings.name.clone(),
                            holder: "nobody (it was deleted)".into(),
                        })
                    }
                    Err(e) => shard.renewal_failed(error_chain(&e)),
                }
            }
            Ok(Err(e)) => {
                let error = error_chain(&e);
                warn!(lease = %settings.name, %error, "renewing the leader Lease");
                shard.renewal_failed(error);
            }
            Err(_) => {
                warn!(lease = %settings.name, "renewing the leader Lease timed out");
                shard.renewal_failed(format!("no answer from the API server within {every:?}"));
            }
        }
    }
    release(&api, &settings, &lease).await;
    Ok(())
}

/// Logs (and sets on `/metrics`) each time the fence begins, with its reason, and ends,
/// looking every [`CHECK_EVERY`].
async fn say_fence_changes(shard: Arc<Ownership>, lease: String) {
    let mut check = tokio::time::interval(CHECK_EVERY);
    let mut was_fenced = false;
    loop {
        check.tick().await;
        let fenced = shard.fence_reason(Instant::now());
        if let (Some(reason), false) = (&fenced, was_fenced) {
            warn!(%lease, %reason, "leader Lease not renewed in time: fenced");
        }
        if fenced.is_none() && was_fenced {
            info!(%lease, "leader Lease renewed again: acting");
        }
        was_fenced = fenced.is_some();
    }
}

/// Clears the holder so a candidate takes the Lease at once (best effort: otherwise it
/// expires).
async fn release(api: &Api<Lease>, settings: &LeaderSettings, lease: &Lease) {
    let released = match written(settings, Some(lease), None) {
        Ok(released) => released,
        Err(_) => return,
    };
    match tokio::time::timeout(
        Duration::from_secs(5),
        api.replace(&settings.name, &PostParams::default(), &released),
    )
    .await
    {
        Ok(Ok(_)) => info!(lease = %settings.name, "leader Lease released"),
        Ok(Err(e)) => {
            warn!(lease = %settings.name, error = %error_chain(&e), "releasing the leader Lease: it expires instead")
        }
        Err(_) => {
            warn!(lease = %settings.name, "releasing the leader Lease timed out: it expires instead")
        }
    }
}
