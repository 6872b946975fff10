//! Membership of the active replicas, on Kubernetes Leases: each replica holds a Lease of its
//! own in the group, renews it every third of its duration and writes on it the view it acts
//! on; the live members are the Leases whose renewal this replica has seen change within
//! their duration.
//!
//! ```text
//!  renewal task ── every duration/3, and at once after a switch ──▶ PATCH own Lease
//!     │ (renewTime, view announcement)              │ success: Ownership::renewed(sent at)
//!  watch of the group's Leases ──▶ Sightings ──▶ live members ──▶ target view
//!     │ target ≠ acting: Ownership::switch (waits for the old view's reconciles), renew
//!     ▼
//!  Ownership::observe(peers' announcements, own announcement seen) ──▶ reshuffle
//! ```
//!
//! The Leases are written with a client the fence does not stop, so a fenced replica can
//! renew and rejoin; on shutdown a replica stops acting, then deletes its Lease so the others
//! take its share at once instead of after the Lease's duration.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{SecondsFormat, Utc};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use propeller_core::shard::{target_view, Sightings, View};
use serde_json::json;
use tokio::sync::Notify;
use tracing::{debug, info, warn};

use crate::controller::ownership::Ownership;
use crate::errors::error_chain;

/// Label naming the group a member Lease belongs to.
pub const GROUP_LABEL: &str = "propeller.absmach.eu/shard-group";
/// Annotation holding the view a member acts on (member ids, comma-separated).
pub const VIEW_ANNOTATION: &str = "propeller.absmach.eu/view";
/// Field manager of the member Leases.
const MANAGER: &str = "propeller-membership";
/// How often expiries are looked for without a Lease event.
const CHECK_EVERY: Duration = Duration::from_millis(250);

/// Where and how long the members' Leases are held.
#[derive(Debug, Clone)]
pub struct MembershipSettings {
    /// The group's name (Lease names start with it).
    pub group: String,
    /// Namespace of the Leases.
    pub namespace: String,
    /// This replica's member id (the pod name in a cluster).
    pub identity: String,
    /// How long a Lease lasts without a renewal.
    pub lease_duration: Duration,
    /// The UID of this replica's pod (its name is `identity`): the Lease names the pod as its
    /// owner, so the garbage collector removes it once the pod is gone, even when the
    /// replica could not (killed, or its RBAC uninstalled before it left).
    pub pod_uid: Option<String>,
}

impl MembershipSettings {
    /// The name of this replica's Lease.
    pub fn lease_name(&self) -> String {
        format!("{}-{}", self.group, self.identity)
    }

    fn renew_every(&self) -> Duration {
        self.lease_duration / 3
    }
}

/// Renews this replica's Lease, announcing `view`; returns when the request was sent.
async fn renew(
    api: &Api<Lease>,
    settings: &MembershipSettings,
    view: &View,
) -> Result<Instant, kube::Error> {
    let sent = Instant::now();
    let mut lease = json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": settings.lease_name(),
            "labels": { GROUP_LABEL: settings.group },
            "annotations": { VIEW_ANNOTATION: view.to_text() },
        },
        "spec": {
            "holderIdentity": settings.identity,
            "leaseDurationSeconds": settings.lease_duration.as_secs().max(1),
            "renewTime": Utc::now().to_rfc3339_opts(SecondsFormat::Micros, true),
        },
    });
    if let Some(uid) = &settings.pod_uid {
        lease["metadata"]["ownerReferences"] = json!([{
            "apiVersion": "v1",
            "kind": "Pod",
            "name": settings.identity,
            "uid": uid,
        }]);
    }
    api.patch(
        &settings.lease_name(),
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&lease),
    )
    .await?;
    Ok(sent)
}

/// Renews this replica's Lease every third of its duration, and at once when `now` is
/// notified (a new view to announce), until `stop` resolves.
async fn renew_loop(
    api: Api<Lease>,
    settings: MembershipSettings,
    shard: Arc<Ownership>,
    now: Arc<Notify>,
) {
    let mut tick = tokio::time::interval(settings.renew_every());
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = now.notified() => {}
        }
        let view = shard.acting();
        match tokio::time::timeout(settings.renew_every(), renew(&api, &settings, &view)).await {
            Ok(Ok(sent)) => shard.renewed(sent).await,
            Ok(Err(e)) => {
                let error = error_chain(&e);
                warn!(lease = %settings.lease_name(), %error, "renewing the membership Lease");
                shard.renewal_failed(error);
            }
            Err(_) => {
                warn!(lease = %settings.lease_name(), "renewing the membership Lease timed out");
                shard.renewal_failed(format!(
                    "no answer from the API server within {:?}",
                    settings.renew_every()
                ));
            }
        }
    }
}

/// Reads the group's Leases into `sightings`.
fn observe_leases(store: &Store<Lease>, sightings: &mut Sightings, now: Instant) {
    let leases = store.state();
    let mut present = Vec::with_capacity(leases.len());
    for lease in leases {
        let Some(spec) = &lease.spec else { continue };
        let Some(member) = spec.holder_identity.clone() else {
            continue;
        };
        let renewal = spec
            .renew_time
            .as_ref()
            .map(|t| format!("{:?}", t.0))
            .unwrap_or_default();
        let duration = Duration::from_secs(
            u64::try_from(spec.lease_duration_seconds.unwrap_or(15)).unwrap_or(15),
        );
        let announced = lease
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(VIEW_ANNOTATION))
            .map(|text| View::from_text(text))
            .unwrap_or_default();
        sightings.observe(&member, &renewal, duration, announced, now);
        present.push(member);
    }
    sightings.retain(&present);
}

/// How many Lease durations after its last renewal was seen a departed member's Lease is
/// deleted (a replica killed without leaving cannot delete its own).
const DEPARTED_AFTER: u32 = 4;

/// Deletes the Leases of members gone for [`DEPARTED_AFTER`] durations, each only at the
/// version read (a member that renewed meanwhile keeps its Lease).
async fn remove_departed(
    api: &Api<Lease>,
    store: &Store<Lease>,
    sightings: &Sightings,
    now: Instant,
) {
    for lease in store.state() {
        let Some(member) = lease
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.as_deref())
        else {
            continue;
        };
        let gone = sightings.get(member).is_some_and(|s| {
            now.saturating_duration_since(s.seen_at) >= s.duration * DEPARTED_AFTER
        });
        if !gone {
            continue;
        }
        let Some(name) = lease.metadata.name.as_deref() else {
            continue;
        };
        let params = DeleteParams {
            preconditions: Some(kube::api::Preconditions {
                resource_version: lease.metadata.resource_version.clone(),
                uid: None,
            }),
            ..DeleteParams::default()
        };
        match api.delete(name, &params).await {
            Ok(_) => info!(%member, "deleted the Lease of a member gone without leaving"),
            Err(e) => {
                debug!(%member, error = %error_chain(&e), "not deleting a departed member's Lease")
            }
        }
    }
}

/// Keeps this replica's membership until `stop` resolves, then leaves the group: it stops
/// acting and deletes its Lease.
pub async fn run(
    client: kube::Client,
    settings: MembershipSettings,
    shard: Arc<Ownership>,
    stop: impl std::future::Future<Output = ()>,
) {
    let api: Api<Lease> = Api::namespaced(client, &settings.namespace);
    let announce = Arc::new(Notify::new());
    let renewals = tokio::spawn(renew_loop(
        api.clone(),
        settings.clone(),
        shard.clone(),
        announce.clone(),
    ));
    let (store, writer) = reflector::store();
    let selector = format!("{GROUP_LABEL}={}", settings.group);
    let events = reflector::reflector(
        writer,
        watcher(api.clone(), watcher::Config::default().labels(&selector)),
    )
    .default_backoff();
    let mut events = std::pin::pin!(events);
    let mut check = tokio::time::interval(CHECK_EVERY);
    let mut sightings = Sightings::default();
    let mut cleaned = Instant::now();
    // When this replica last could not act: its sightings of the others are only as recent
    // as its own link to the API server, so it judges no one departed until it has been
    // acting (renewing, watching) for as long as that judgement takes.
    let mut last_fenced = Instant::now();
    let mut stop = std::pin::pin!(stop);
    info!(member = %settings.identity, group = %settings.group, "joining the group");
    loop {
        tokio::select! {
            event = events.next() => match event {
                Some(Ok(_)) => {}
                Some(Err(e)) => debug!(%e, "watching the membership Leases"),
                None => break,
            },
            _ = check.tick() => {}
            _ = &mut stop => break,
        }
        let now = Instant::now();
        observe_leases(&store, &mut sightings, now);
        let live = sightings.live(now);
        let is_fenced = shard.is_fenced(now);
        if is_fenced {
            last_fenced = now;
        }
        let target = target_view(&settings.identity, &live, is_fenced);
        if target != shard.acting() {
            if target.is_empty() {
                warn!(member = %settings.identity, "membership not renewed in time: fenced, acting on nothing until it is");
            } else {
                info!(members = %target.to_text(), "acting on a new view");
            }
            shard.switch(target).await;
            announce.notify_one();
        }
        let own = sightings
            .get(&settings.identity)
            .map(|s| s.announced.clone());
        shard.observe(live, own.as_ref(), Instant::now());
        let judged_long_enough =
            now.saturating_duration_since(last_fenced) >= settings.lease_duration * DEPARTED_AFTER;
        if judged_long_enough && now.saturating_duration_since(cleaned) >= settings.lease_duration {
            cleaned = now;
            remove_departed(&api, &store, &sightings, now).await;
        }
    }
    info!(member = %settings.identity, "leaving the group");
    shard.switch(View::default()).await;
    renewals.abort();
    if let Err(e) = api
        .delete(&settings.lease_name(), &DeleteParams::default())
        .await
    {
        warn!(error = %error_chain(&e), "deleting the membership Lease; the others take over when it expires");
    }
}
