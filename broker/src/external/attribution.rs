//! Who sent a message that arrived through an external broker.
//!
//! An external broker does not tell subscribers who published. The embedded broker compares
//! the payload's proplet id with the authenticated client; here the topic is what the broker
//! vouches for: a device bound to a channel may publish only on that channel (the callbacks
//! and rendered configs enforce it), so a report is accepted only when the proplet it names
//! belongs to the channel it came on. With one channel per proplet that binds the identity as
//! strongly as the embedded broker does; on a channel shared by several proplets, any of them
//! can speak for the others.

use crate::protocol::enrolment::{decode_request, request_topic_client};
use crate::protocol::{classify, Decoder};
use crate::server::{
    is_agent_report, BrokerEvent, CredentialSource, CredentialStore, DropReason, EventKind,
};

/// What became of one inbound message.
#[derive(Debug)]
pub enum Attributed {
    /// An event for the reconcilers.
    Event(Box<BrokerEvent>),
    /// Not a device report (outside the protocol, or a command): nothing to do.
    NotAReport,
    /// Refused, for a reason counted in the meters.
    Dropped(DropReason),
}

/// Whether the broker in front authenticates devices against propeller's credential table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceTrust {
    /// Devices log in with propeller's credentials and topic policy (callbacks or a
    /// rendered config): reports must name a known proplet bound to the channel.
    Authenticated,
    /// The broker lets anyone in (a development broker): reports are taken as they claim.
    Unauthenticated,
}

/// Decodes one message from the external broker and decides whom it comes from.
pub fn attribute(
    decoder: &Decoder,
    devices: &CredentialStore,
    trust: DeviceTrust,
    topic: &str,
    payload: &[u8],
) -> Attributed {
    if let Some(client_id) = request_topic_client(topic) {
        // Only the enrolment login may publish there (the callbacks' topic rule), and only
        // it may read the reply: without a broker that enforces that, nobody enrols.
        if trust == DeviceTrust::Unauthenticated {
            return Attributed::Dropped(DropReason::ForbiddenTopic);
        }
        return Attributed::Event(Box::new(BrokerEvent {
            client_id,
            domain: None,
            channel: None,
            kind: EventKind::EnrolmentRequest(decode_request(payload)),
        }));
    }
    let Some((channel, kind)) = classify(topic) else {
        return Attributed::NotAReport;
    };
    if !is_agent_report(&kind) {
        return Attributed::NotAReport;
    }
    let inbound = match decoder.decode(&kind, payload) {
        Ok(inbound) => inbound,
        Err(_) => return Attributed::Dropped(DropReason::Malformed),
    };
    let client_id = match inbound.claimed_proplet_id() {
        Some(claimed) => {
            if trust == DeviceTrust::Authenticated {
                let bound = devices.lookup(claimed).is_some_and(|credential| {
                    match (credential.scope(), channel) {
                        (Some(scope), Some(found)) => scope.covers(found.domain, found.channel),
                        _ => true,
                    }
                });
                if !bound {
                    return Attributed::Dropped(DropReason::Spoofed);
                }
            }
            claimed.to_owned()
        }
        // Results of agents that leave the proplet id out: the channel's only device, if it
        // has exactly one; otherwise nobody (the task then ignores the result, with a note).
        None => match channel {
            Some(found) => {
                let mut members = devices.channel_members(found.domain, found.channel);
                if members.len() == 1 {
                    members.remove(0)
                } else {
                    String::new()
                }
            }
            None => String::new(),
        },
    };
    let Some(kind) = EventKind::from_inbound(inbound) else {
        return Attributed::NotAReport;
    };
    Attributed::Event(Box::new(BrokerEvent {
        client_id,
        domain: channel.map(|c| c.domain.to_owned()),
        channel: channel.map(|c| c.channel.to_owned()),
        kind,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::DEFAULT_MAX_PAYLOAD_BYTES;
    use crate::server::{ChannelScope, Credential};

    fn devices() -> CredentialStore {
        let store = CredentialStore::new();
        let on = |channel: &str| ChannelScope {
            domain: Some("d".into()),
            channel: channel.into(),
        };
        store.insert("a", Credential::proplet("ka").on_channel(on("ca")));
        store.insert("b", Credential::proplet("kb").on_channel(on("shared")));
        store.insert("c", Credential::proplet("kc").on_channel(on("shared")));
        store
    }

    fn run(trust: DeviceTrust, topic: &str, payload: &str) -> Attributed {
        let decoder = Decoder::new(DEFAULT_MAX_PAYLOAD_BYTES);
        attribute(&decoder, &devices(), trust, topic, payload.as_bytes())
    }

    fn client_of(outcome: Attributed) -> String {
        match outcome {
            Attributed::Event(event) => event.client_id,
            other => panic!("expected an event, got {other:?}"),
        }
    }

    #[test]
    fn a_report_naming_the_channels_own_device_is_accepted() {
        let hb = r#"{"status":"alive","proplet_id":"a"}"#;
        let out = run(
            DeviceTrust::Authenticated,
            "m/d/c/ca/control/proplet/alive",
            hb,
        );
        assert_eq!(client_of(out), "a");
    }

    #[test]
    fn a_report_naming_a_device_of_another_channel_or_nobody_known_is_spoofed() {
        let claims_b = r#"{"status":"alive","proplet_id":"b"}"#;
        let out = run(
            DeviceTrust::Authenticated,
            "m/d/c/ca/control/proplet/alive",
            claims_b,
        );
        assert!(matches!(out, Attributed::Dropped(DropReason::Spoofed)));
        let ghost = r#"{"status":"alive","proplet_id":"ghost"}"#;
        let out = run(
            DeviceTrust::Authenticated,
            "m/d/c/ca/control/proplet/alive",
            ghost,
        );
        assert!(matches!(out, Attributed::Dropped(DropReason::Spoofed)));
        // Without device authentication the claim is all there is.
        let out = run(
            DeviceTrust::Unauthenticated,
            "m/d/c/ca/control/proplet/alive",
            ghost,
        );
        assert_eq!(client_of(out), "ghost");
    }

    #[test]
    fn a_result_without_proplet_id_belongs_to_the_channels_only_device() {
        let result = r#"{"task_id":"t1","results":"42"}"#;
        let out = run(
            DeviceTrust::Authenticated,
            "m/d/c/ca/control/proplet/results",
            result,
        );
        assert_eq!(client_of(out), "a");
        let out = run(
            DeviceTrust::Authenticated,
            "m/d/c/shared/control/proplet/results",
            result,
        );
        assert_eq!(client_of(out), "", "two devices share the channel");
    }

    #[test]
    fn commands_and_foreign_topics_are_not_reports_and_bad_payloads_are_dropped() {
        let out = run(
            DeviceTrust::Authenticated,
            "m/d/c/ca/control/manager/start",
            "{}",
        );
        assert!(matches!(out, Attributed::NotAReport));
        let out = run(DeviceTrust::Authenticated, "other/topic", "{}");
        assert!(matches!(out, Attributed::NotAReport));
        let out = run(
            DeviceTrust::Authenticated,
            "m/d/c/ca/control/proplet/alive",
            "{not json",
        );
        assert!(matches!(out, Attributed::Dropped(DropReason::Malformed)));
    }
}
