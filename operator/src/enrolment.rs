//! Device enrolment in both drivers: the broker's enrolment requests are queued (never
//! answered from the MQTT callback), and one worker answers them in batches per token,
//! applying the core's plans ([`crate::decision::enrolment::plan_enrolment`]) through the
//! driver's [`Cluster`] and publishing each reply on the asking login's own topic.
//!
//! A batch reads its token Secret, plans every request against it, then takes the uses the
//! new devices need in one conditional write of that Secret before creating anything, so
//! two replicas or a restart can never enrol more devices than the token allows.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::sync::{Arc, Weak};

use chrono::Utc;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::ByteString;
use propeller_broker::protocol::enrolment::{
    enrol_client_token_id, reply_topic, EnrolRefusal, EnrolReply, RefusalReason, SealedReply,
};
use propeller_broker::protocol::sealed_grant::seal_grant;
use propeller_broker::server::CredentialSource;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tracing::{info, instrument, warn};

use crate::controller::{CacheReads, Cluster, ObjectName, Refusal, Signals};
use crate::crd::proplet::Proplet;
use crate::decision::enrolment::{
    machine_label, plan_enrolment, token_secret_name, EnrolPlan, Enrolled, TokenRecord,
    MACHINE_LABEL,
};
use crate::decision::scheduler::SelectorView;
use crate::decision::task::Note;
use crate::enrolment_queue::{Enrolments, Pending};

/// Where standalone mode keeps its bootstrap tokens.
pub const STANDALONE_TOKEN_NAMESPACE: &str = "default";

/// Requests answered in one batch at most.
const BATCH: usize = 256;
/// Times a batch is planned again after its token's uses changed under it.
const CONFLICT_RETRIES: usize = 8;

/// Starts the worker that answers the requests queued on the returned [`Enrolments`] for
/// `cluster`, whose tokens are kept in `token_namespace`; it stops with the driver.
pub fn start<C: Cluster + 'static>(cluster: &Arc<C>, token_namespace: String) -> Arc<Enrolments> {
    let (queue, requests) = unbounded_channel();
    let namespace = token_namespace.clone();
    let cluster = Arc::downgrade(cluster);
    tokio::spawn(async move { answer_requests(cluster, namespace, requests).await });
    Arc::new(Enrolments::new(queue, token_namespace))
}

async fn answer_requests<C: Cluster>(
    cluster: Weak<C>,
    namespace: String,
    mut requests: UnboundedReceiver<Pending>,
) {
    while let Some(first) = requests.recv().await {
        let Some(cluster) = cluster.upgrade() else {
            return;
        };
        let mut by_token: BTreeMap<String, Vec<Pending>> = BTreeMap::new();
        let mut next = Some(first);
        let mut taken = 0;
        while let Some(pending) = next.take() {
            let token = enrol_client_token_id(&pending.client_id)
                .unwrap_or_default()
                .to_owned();
            by_token.entry(token).or_default().push(pending);
            taken += 1;
            if taken < BATCH {
                next = requests.try_recv().ok();
            }
        }
        for (token, batch) in by_token {
            enrol_batch(&*cluster, &namespace, &token, batch).await;
        }
    }
}

/// What one request came to, once planned.
struct Planned {
    client_id: String,
    /// The device's key the grant is sealed to (none when the request did not decode).
    reply_key: Option<String>,
    plan: EnrolPlan,
}

#[instrument(skip_all, fields(token = token_id, requests = batch.len()))]
async fn enrol_batch<C: Cluster>(
    cluster: &C,
    namespace: &str,
    token_id: &str,
    batch: Vec<Pending>,
) {
    let token_name = ObjectName::new(namespace, &token_secret_name(token_id));
    let mut planned = Vec::new();
    for attempt in 0..=CONFLICT_RETRIES {
        let stored = match cluster.get::<Secret>(&token_name).await {
            Ok(stored) => stored,
            Err(e) => return refuse_all(cluster, batch, &format!("reading the token: {e}")).await,
        };
        let token = match stored.as_ref().map(TokenRecord::from_secret).transpose() {
            Ok(token) => token,
            Err(e) => return refuse_all(cluster, batch, &e.to_string()).await,
        };
        planned = match plan_batch(cluster, token.as_ref(), token_id, &batch).await {
            Ok(planned) => planned,
            Err(e) => return refuse_all(cluster, batch, &e).await,
        };
        let new_devices = planned
            .iter()
            .filter(|p| matches!(p.plan, EnrolPlan::Create { .. }))
            .count();
        let (Some(stored), Some(token)) = (stored, token) else {
            break;
        };
        if new_devices == 0 {
            break;
        }
        let mut updated = stored.clone();
        let uses = token.uses + u32::try_from(new_devices).unwrap_or(u32::MAX);
        updated
            .data
            .get_or_insert_with(BTreeMap::new)
            .insert("uses".into(), ByteString(uses.to_string().into_bytes()));
        match cluster.replace(&updated).await {
            Ok(()) => break,
            Err(e) if C::refusal(&*e) == Some(Refusal::Conflict) && attempt < CONFLICT_RETRIES => {
                continue
            }
            Err(e) => {
                return refuse_all(cluster, batch, &format!("counting the token's uses: {e}")).await
            }
        }
    }
    let mut replies = Vec::with_capacity(planned.len());
    for Planned {
        client_id,
        reply_key,
        plan,
    } in planned
    {
        let reply = apply(cluster, token_id, plan).await;
        replies.push((client_id, reply_key, reply));
    }
    wait_for_logins(cluster, &replies).await;
    for (client_id, reply_key, reply) in replies {
        let outcome = match &reply {
            EnrolReply::Enrolled(g) if g.rotated => "rotated",
            EnrolReply::Enrolled(_) => "enrolled",
            EnrolReply::Refused(r) => r.reason.as_str(),
        };
        cluster.common().metrics.enrolment(outcome);
        publish(cluster, &client_id, reply_key.as_deref(), reply).await;
    }
}

/// How long a batch's replies wait for the broker's login table to take in the new keys.
const LOGIN_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Waits (up to [`LOGIN_WAIT`]) until the broker accepts every granted key, so a device
/// that logs in as soon as it has its reply is let in.
async fn wait_for_logins<C: Cluster>(
    cluster: &C,
    replies: &[(String, Option<String>, EnrolReply)],
) {
    let Some(logins) = cluster.common().logins.get() else {
        return;
    };
    let started = tokio::time::Instant::now();
    while started.elapsed() < LOGIN_WAIT {
        let waiting = replies.iter().any(|(_, _, reply)| match reply {
            EnrolReply::Enrolled(grant) => !logins
                .lookup(&grant.client_id)
                .is_some_and(|c| c.accepts(&grant.client_key)),
            EnrolReply::Refused(_) => false,
        });
        if !waiting {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    warn!("the broker's login table did not show every enrolled device within {LOGIN_WAIT:?}; they retry their login");
}

/// Plans every request of the batch in turn, each seeing the uses the earlier ones took and
/// the machines they enrolled.
async fn plan_batch<C: Cluster>(
    cluster: &C,
    token: Option<&TokenRecord>,
    token_id: &str,
    batch: &[Pending],
) -> Result<Vec<Planned>, String> {
    let mut token = token.cloned();
    let mut enrolled_now: HashMap<String, (Proplet, Secret)> = HashMap::new();
    let now = Utc::now();
    let mut planned = Vec::with_capacity(batch.len());
    for pending in batch {
        let request = pending.request.as_deref().map_err(String::as_str);
        let machine = request.ok().map(|r| machine_label(&r.machine_id));
        let mut existing: Option<(Proplet, Option<Secret>)> = None;
        if let (Some(machine), Some(token)) = (&machine, &token) {
            if let Some((proplet, secret)) = enrolled_now.get(machine) {
                existing = Some((proplet.clone(), Some(secret.clone())));
            } else if let Some(proplet) = machine_proplet(cluster, &token.namespace, machine) {
                let secret = key_secret_of(cluster, &proplet).await?;
                existing = Some((proplet, secret));
            }
        }
        let key = random_key().map_err(|e| format!("generating a key: {e}"))?;
        let plan = plan_enrolment(
            token.as_ref(),
            token_id,
            request,
            existing.as_ref().map(|(proplet, secret)| Enrolled {
                proplet,
                secret: secret.as_ref(),
            }),
            &key,
            now,
        );
        if let (
            EnrolPlan::Create {
                secret, proplet, ..
            },
            Some(machine),
            Some(token),
        ) = (&plan, &machine, &mut token)
        {
            token.uses += 1;
            enrolled_now.insert(machine.clone(), ((**proplet).clone(), (**secret).clone()));
        }
        planned.push(Planned {
            client_id: pending.client_id.clone(),
            reply_key: request.ok().map(|r| r.reply_key.clone()),
            plan,
        });
    }
    Ok(planned)
}

/// The Proplet of `namespace` labelled with this machine, from the driver's cache (through
/// its label index).
fn machine_proplet<C: CacheReads + Signals>(
    cluster: &C,
    namespace: &str,
    machine: &str,
) -> Option<Proplet> {
    let selector = SelectorView {
        match_labels: BTreeMap::from([(MACHINE_LABEL.to_owned(), machine.to_owned())]),
        ..SelectorView::default()
    };
    cluster
        .proplets_for(namespace, &selector)
        .into_iter()
        .find(|p| {
            p.metadata.deletion_timestamp.is_none()
                && p.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(MACHINE_LABEL))
                    .is_some_and(|m| m == machine)
        })
        .map(|p| (*p).clone())
}

/// The Secret `proplet`'s key is in, read from the backend.
async fn key_secret_of<C: Cluster>(
    cluster: &C,
    proplet: &Proplet,
) -> Result<Option<Secret>, String> {
    let Some(selector) = &proplet.spec.connection_config.client_key_secret_ref else {
        return Ok(None);
    };
    let namespace = proplet.metadata.namespace.as_deref().unwrap_or("default");
    cluster
        .get::<Secret>(&ObjectName::new(namespace, &selector.name))
        .await
        .map_err(|e| format!("reading Secret {namespace}/{}: {e}", selector.name))
}

/// Writes what `plan` asks and returns the reply.
async fn apply<C: Cluster>(cluster: &C, token_id: &str, plan: EnrolPlan) -> EnrolReply {
    match plan {
        EnrolPlan::Refuse(refusal) => {
            info!(
                token = token_id,
                reason = refusal.reason.as_str(),
                "enrolment refused"
            );
            EnrolReply::Refused(refusal)
        }
        EnrolPlan::Create {
            secret,
            proplet,
            grant,
        } => {
            let created = async {
                cluster.create_once(&*secret).await?;
                cluster.create_once(&*proplet).await
            };
            if let Err(e) = created.await {
                return unavailable(&format!("storing the device: {e}"));
            }
            info!(token = token_id, proplet = %grant.client_id, "device enrolled");
            note(
                cluster,
                &proplet,
                "Enrolled",
                format!("enrolled with token {token_id}"),
            );
            EnrolReply::Enrolled(grant)
        }
        EnrolPlan::Rotate { secret, grant } => {
            let written = if secret.metadata.resource_version.is_some() {
                cluster.replace(&*secret).await
            } else {
                cluster.create_once(&*secret).await
            };
            if let Err(e) = written {
                return unavailable(&format!("storing the new key: {e}"));
            }
            info!(token = token_id, proplet = %grant.client_id, "device enrolled again; key replaced");
            if let Some(proplet) =
                cluster.proplet(&ObjectName::new(&grant.namespace, &grant.client_id))
            {
                note(
                    cluster,
                    &proplet,
                    "KeyRotated",
                    format!("enrolled again with token {token_id}: a new key replaced the old one"),
                );
            }
            EnrolReply::Enrolled(grant)
        }
    }
}

fn note<C: CacheReads + Signals>(
    cluster: &C,
    proplet: &Proplet,
    reason: &'static str,
    message: String,
) {
    cluster.note_later(
        proplet,
        Note {
            warning: false,
            reason,
            message,
        },
    );
}

fn unavailable<G>(message: &str) -> EnrolReply<G> {
    warn!("enrolment failed: {message}");
    EnrolReply::Refused(EnrolRefusal {
        reason: RefusalReason::Unavailable,
        message: format!("propeller could not enrol the device now ({message}); try again"),
    })
}

async fn refuse_all<C: Cluster>(cluster: &C, batch: Vec<Pending>, message: &str) {
    let reply: EnrolReply = unavailable(message);
    for pending in batch {
        cluster
            .common()
            .metrics
            .enrolment(RefusalReason::Unavailable.as_str());
        publish(cluster, &pending.client_id, None, reply.clone()).await;
    }
}

/// Publishes `reply` to `client_id`, its grant sealed to the device's `reply_key`.
async fn publish<C: Cluster>(
    cluster: &C,
    client_id: &str,
    reply_key: Option<&str>,
    reply: EnrolReply,
) {
    let sealed: SealedReply = match reply {
        EnrolReply::Refused(refusal) => EnrolReply::Refused(refusal),
        EnrolReply::Enrolled(grant) => {
            match seal_grant(&grant, reply_key.unwrap_or_default(), client_id) {
                Ok(sealed) => EnrolReply::Enrolled(sealed),
                Err(e) => unavailable(&e.to_string()),
            }
        }
    };
    let payload = match serde_json::to_vec(&sealed) {
        Ok(payload) => payload,
        Err(e) => return warn!(%e, "encoding an enrolment reply"),
    };
    if let Err(e) = cluster
        .common()
        .publisher
        .publish(reply_topic(client_id), payload)
        .await
    {
        warn!(client = client_id, %e, "publishing an enrolment reply");
    }
}

/// A new device key: 32 random bytes from the kernel, as hex.
fn random_key() -> std::io::Result<String> {
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}
