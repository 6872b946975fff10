//! Rotated keys delivered to connected devices: a new key is sent on the device's own topic
//! ([`key_topic`]) as soon as the credential table shows it, and while the device's old key
//! still works (the grace period `propeller rotate` gave it) every event heard from the
//! device sends it again, at most once per [`RESEND_AFTER`]: a device that was offline
//! during the rotation gets it as soon as it logs in again with the old key.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use chrono::{SecondsFormat, Utc};
use propeller_broker::protocol::enrolment::{key_topic, KeyRotation};
use propeller_broker::server::{Credential, CredentialSource, CredentialStore, Publisher, Role};
use tracing::{debug, warn};

/// How long a device that was sent its new key waits before it is sent it again.
pub const RESEND_AFTER: Duration = Duration::from_secs(5);

/// When each device was last sent its new key.
#[derive(Default)]
pub struct KeyDelivery {
    /// When each device was last sent a new key, and which (a fingerprint, not the key).
    sent: Mutex<HashMap<String, (u64, Instant)>>,
    /// Whether any device is in a grace period: the per-event check is one load otherwise.
    rotating: AtomicBool,
}

fn fingerprint(key: &str) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
    BuildHasherDefault::<DefaultHasher>::default().hash_one(key)
}

impl KeyDelivery {
    /// The new key to send `client_id` now (its login in `logins`), if it has one in its grace period and was not
    /// sent it within [`RESEND_AFTER`].
    pub fn due(&self, logins: &CredentialStore, client_id: &str) -> Option<KeyRotation> {
        if !self.rotating.load(Ordering::Relaxed) {
            return None;
        }
        let credential = logins.lookup(client_id)?;
        let mut sent = self.sent.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let recent = |at: &Instant| now.duration_since(*at) < RESEND_AFTER;
        if sent.get(client_id).is_some_and(|(_, at)| recent(at)) {
            return None;
        }
        let rotation = rotation_of(client_id, &credential)?;
        sent.insert(
            client_id.to_owned(),
            (fingerprint(&rotation.client_key), now),
        );
        Some(rotation)
    }

    /// The new keys not sent yet (a rotation the credential table has just taken in), to
    /// send at once; call after each rebuild of the table.
    pub fn new_rotations(&self, logins: &CredentialStore) -> Vec<KeyRotation> {
        let mut sent = self.sent.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let mut fresh = Vec::new();
        let mut live = HashMap::new();
        for (client_id, credential) in logins.snapshot() {
            let Some(rotation) = rotation_of(&client_id, &credential) else {
                continue;
            };
            let print = fingerprint(&rotation.client_key);
            match sent.get(&client_id) {
                Some((known, at)) if *known == print => {
                    live.insert(client_id, (print, *at));
                }
                _ => {
                    live.insert(client_id, (print, now));
                    fresh.push(rotation);
                }
            }
        }
        // Devices whose grace ended are forgotten.
        self.rotating.store(!live.is_empty(), Ordering::Relaxed);
        *sent = live;
        fresh
    }

    /// Sends `rotation` to its device (in the background).
    pub fn send(publisher: &Publisher, rotation: KeyRotation) {
        let publisher = publisher.clone();
        tokio::spawn(async move {
            let payload = match serde_json::to_vec(&rotation) {
                Ok(payload) => payload,
                Err(e) => return warn!(%e, "encoding a key rotation"),
            };
            match publisher
                .publish(key_topic(&rotation.client_id), payload)
                .await
            {
                Ok(()) => debug!(client = %rotation.client_id, "sent the device its new key"),
                Err(e) => warn!(client = %rotation.client_id, %e, "sending a new key"),
            }
        });
    }
}

/// The rotation to tell `client_id` while its old key still works.
fn rotation_of(client_id: &str, credential: &Credential) -> Option<KeyRotation> {
    if credential.role() != Role::Proplet {
        return None;
    }
    let until = credential.previous_valid_until(Utc::now())?;
    Some(KeyRotation {
        client_id: client_id.to_owned(),
        client_key: credential.secret().to_owned(),
        previous_valid_until: until.to_rfc3339_opts(SecondsFormat::Secs, true),
    })
}
