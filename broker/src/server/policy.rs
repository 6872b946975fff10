//! What an authenticated client may publish and subscribe to, decided without any I/O.
//!
//! rumqttd 0.20 has no authorization hook, so the broker enforces these decisions inside its
//! MQTT codec (see [`super::guard`]): a refused publish is rewritten to an inert sink topic
//! with an empty payload (so QoS acknowledgements still flow and the client is not cut off),
//! and a refused subscription filter is rewritten to an inert literal topic.

use crate::protocol::enrolment::{
    decode_request, enrol_topic_allowed, key_topic, reply_topic, request_topic, EnrolLeg,
    KEY_TOPIC_PREFIX,
};
use crate::protocol::{classify, Decoder, TopicKind};

use super::auth::{Credential, Role};
use super::events::{BrokerEvent, EventKind};

/// Where refused publishes go: nothing of ours subscribes here, and the payload is emptied.
pub const DROPPED_TOPIC: &str = "propeller/dropped";

/// What refused subscription filters are replaced with: a literal topic nobody publishes to.
pub const DENIED_FILTER: &str = "propeller/denied";

/// Why a publish was not routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// A device published on a topic only the operator or a service may use
    /// (`control/manager/*`, `registry/server`, `fl/rounds/start`) or outside the protocol.
    ForbiddenTopic,
    /// A device published a report naming another proplet.
    Spoofed,
    /// A device's report did not decode.
    Malformed,
}

impl DropReason {
    /// A stable label for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ForbiddenTopic => "forbidden_topic",
            Self::Spoofed => "spoofed",
            Self::Malformed => "malformed",
        }
    }
}

/// The decision on one publish.
#[derive(Debug)]
pub struct PublishDecision {
    /// The topic's kind, `None` outside the protocol (for per-kind counting).
    pub kind: Option<TopicKind>,
    /// Route it, or drop it for a reason.
    pub verdict: Verdict,
    /// Set when the payload failed to decode (counted even when a service's publish is routed).
    pub decode_error: Option<String>,
}

/// Route a publish (with the event it produced, if any) or drop it.
#[derive(Debug)]
pub enum Verdict {
    /// Let the router deliver it; raise the event in-process if there is one.
    Route(Option<Box<BrokerEvent>>),
    /// Rewrite it to [`DROPPED_TOPIC`].
    Drop(DropReason),
}

/// Whether a kind is something agents report (as opposed to operator commands).
pub fn is_agent_report(kind: &TopicKind) -> bool {
    matches!(
        kind,
        TopicKind::Discovery
            | TopicKind::Alive
            | TopicKind::PropletMetrics
            | TopicKind::TaskMetrics
            | TopicKind::Results
            | TopicKind::InvokeResults
            | TopicKind::UpgradeReport
            | TopicKind::Logs
            | TopicKind::RegistryRequest
            | TopicKind::FlUpdate { .. }
    )
}

/// Decides one publish by `client_id` acting as `role` on `topic`.
pub fn judge_publish(
    decoder: &Decoder,
    role: Role,
    client_id: &str,
    topic: &str,
    payload: &[u8],
) -> PublishDecision {
    if role == Role::Enrolee {
        return judge_enrolment(client_id, topic, payload);
    }
    let Some((channel, kind)) = classify(topic) else {
        let verdict = match role {
            Role::Service => Verdict::Route(None),
            Role::Proplet | Role::Enrolee => Verdict::Drop(DropReason::ForbiddenTopic),
        };
        return PublishDecision {
            kind: None,
            verdict,
            decode_error: None,
        };
    };
    let report = is_agent_report(&kind);
    if role == Role::Proplet && !report {
        return PublishDecision {
            kind: Some(kind),
            verdict: Verdict::Drop(DropReason::ForbiddenTopic),
            decode_error: None,
        };
    }
    if !report {
        // A trusted service sending commands or chunks: routed, nothing for the operator.
        return PublishDecision {
            kind: Some(kind),
            verdict: Verdict::Route(None),
            decode_error: None,
        };
    }
    let inbound = match decoder.decode(&kind, payload) {
        Ok(inbound) => inbound,
        Err(error) => {
            let verdict = match role {
                Role::Service => Verdict::Route(None),
                Role::Proplet | Role::Enrolee => Verdict::Drop(DropReason::Malformed),
            };
            return PublishDecision {
                kind: Some(kind),
                verdict,
                decode_error: Some(error.to_string()),
            };
        }
    };
    if role == Role::Proplet {
        if let Some(claimed) = inbound.claimed_proplet_id() {
            if claimed != client_id {
                return PublishDecision {
                    kind: Some(kind),
                    verdict: Verdict::Drop(DropReason::Spoofed),
                    decode_error: None,
                };
            }
        }
    }
    let event = EventKind::from_inbound(inbound).map(|kind| {
        Box::new(BrokerEvent {
            client_id: client_id.to_owned(),
            domain: channel.map(|c| c.domain.to_owned()),
            channel: channel.map(|c| c.channel.to_owned()),
            kind,
        })
    });
    PublishDecision {
        kind: Some(kind),
        verdict: Verdict::Route(event),
        decode_error: None,
    }
}

/// Decides an enrolling device's publish: only its own request topic, and the request is
/// raised as an event whether or not it decodes (a bad one is answered with the reason).
fn judge_enrolment(client_id: &str, topic: &str, payload: &[u8]) -> PublishDecision {
    if topic != request_topic(client_id) {
        return PublishDecision {
            kind: None,
            verdict: Verdict::Drop(DropReason::ForbiddenTopic),
            decode_error: None,
        };
    }
    let request = decode_request(payload);
    let decode_error = request.as_ref().err().cloned();
    PublishDecision {
        kind: None,
        verdict: Verdict::Route(Some(Box::new(BrokerEvent {
            client_id: client_id.to_owned(),
            domain: None,
            channel: None,
            kind: EventKind::EnrolmentRequest(request),
        }))),
        decode_error,
    }
}

/// Whether `role`, logged in as `client_id`, may subscribe to `filter`. Devices get literal
/// topics only, and never the reports of other agents; an enrolling device only its own
/// reply topic; services may subscribe to anything.
pub fn may_subscribe_as(role: Role, client_id: &str, filter: &str) -> bool {
    match role {
        Role::Enrolee => filter == reply_topic(client_id),
        Role::Proplet if filter.starts_with(KEY_TOPIC_PREFIX) => filter == key_topic(client_id),
        other => may_subscribe(other, filter),
    }
}

/// Whether `role` may subscribe to `filter` (see [`may_subscribe_as`]; an enrolling device
/// may subscribe only to a topic of its own, which this form cannot tell).
pub fn may_subscribe(role: Role, filter: &str) -> bool {
    match role {
        Role::Service => true,
        Role::Enrolee => false,
        Role::Proplet => {
            if filter.contains(['+', '#']) || filter.is_empty() {
                return false;
            }
            !matches!(classify(filter), Some((_, kind)) if is_agent_report(&kind))
        }
    }
}

/// What a client asks of a broker that consults propeller per topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopicAccess {
    /// Publish on the topic.
    Publish,
    /// Subscribe with the topic as a filter.
    Subscribe,
}

/// Whether `client_id` holding `credential` may publish on or subscribe to `topic`, decided
/// from the topic alone: for external brokers, which ask per topic and never show propeller
/// the payload. Services may do anything. A device may publish only its reports (including
/// `registry/proplet` and FL updates that name itself) and subscribe only to the literal
/// command topics of a channel (start, stop, invoke, `registry/server`, `fl/rounds/start`);
/// a device bound to a channel ([`Credential::scope`]) only on that channel.
pub fn may_access_topic(
    client_id: &str,
    credential: &Credential,
    access: TopicAccess,
    topic: &str,
) -> bool {
    match credential.role() {
        Role::Service => return true,
        Role::Enrolee => {
            let leg = match access {
                TopicAccess::Publish => EnrolLeg::Request,
                TopicAccess::Subscribe => EnrolLeg::Reply,
            };
            return enrol_topic_allowed(client_id, topic, leg);
        }
        Role::Proplet => {}
    }
    if topic.starts_with(KEY_TOPIC_PREFIX) {
        return access == TopicAccess::Subscribe && topic == key_topic(client_id);
    }
    if topic.contains(['+', '#']) || topic.is_empty() {
        return false;
    }
    let Some((channel, kind)) = classify(topic) else {
        return false;
    };
    let in_scope = match (channel, credential.scope()) {
        (Some(found), Some(scope)) => scope.covers(found.domain, found.channel),
        (Some(_), None) => true,
        // The unprefixed FL update topic names no channel; its proplet level binds it.
        (None, _) => true,
    };
    if !in_scope {
        return false;
    }
    match access {
        TopicAccess::Publish => match &kind {
            TopicKind::FlUpdate { proplet_id, .. } => proplet_id.as_str() == client_id,
            other => is_agent_report(other),
        },
        TopicAccess::Subscribe => matches!(
            kind,
            TopicKind::Start
                | TopicKind::Stop
                | TopicKind::Invoke
                | TopicKind::Upgrade
                | TopicKind::RegistryChunk
                | TopicKind::FlRoundStart
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::DEFAULT_MAX_PAYLOAD_BYTES;

    const ALIVE: &str = "m/dom/c/chan/control/proplet/alive";
    const RESULTS: &str = "m/dom/c/chan/control/proplet/results";

    fn decoder() -> Decoder {
        Decoder::new(DEFAULT_MAX_PAYLOAD_BYTES)
    }

    fn heartbeat(id: &str) -> Vec<u8> {
        format!(r#"{{"status":"alive","proplet_id":"{id}"}}"#).into_bytes()
    }

    #[test]
    fn own_heartbeat_is_routed_with_an_event() {
        let d = judge_publish(&decoder(), Role::Proplet, "a", ALIVE, &heartbeat("a"));
        match d.verdict {
            Verdict::Route(Some(event)) => {
                assert_eq!(event.client_id, "a");
                assert_eq!(event.domain.as_deref(), Some("dom"));
                assert_eq!(event.channel.as_deref(), Some("chan"));
                assert!(matches!(event.kind, EventKind::Heartbeat(_)));
            }
            other => panic!("unexpected verdict {other:?}"),
        }
    }

    #[test]
    fn heartbeat_or_result_for_someone_else_is_spoofed() {
        let d = judge_publish(&decoder(), Role::Proplet, "a", ALIVE, &heartbeat("b"));
        assert!(matches!(d.verdict, Verdict::Drop(DropReason::Spoofed)));
        let result = br#"{"task_id":"t1","proplet_id":"b","result":"42"}"#;
        let d = judge_publish(&decoder(), Role::Proplet, "a", RESULTS, result);
        assert!(matches!(d.verdict, Verdict::Drop(DropReason::Spoofed)));
    }

    #[test]
    fn result_without_proplet_id_is_attributed_to_the_publisher() {
        let result = br#"{"task_id":"t1","result":"42"}"#;
        let d = judge_publish(&decoder(), Role::Proplet, "a", RESULTS, result);
        match d.verdict {
            Verdict::Route(Some(event)) => assert_eq!(event.client_id, "a"),
            other => panic!("unexpected verdict {other:?}"),
        }
    }

    #[test]
    fn devices_cannot_publish_commands_or_outside_the_protocol() {
        for topic in [
            "m/dom/c/chan/control/manager/start",
            "m/dom/c/chan/control/manager/stop",
            "m/dom/c/chan/control/manager/invoke",
            "m/dom/c/chan/registry/server",
            "m/dom/c/chan/fl/rounds/start",
            "some/other/topic",
        ] {
            let d = judge_publish(&decoder(), Role::Proplet, "a", topic, b"{}");
            assert!(
                matches!(d.verdict, Verdict::Drop(DropReason::ForbiddenTopic)),
                "{topic}: {:?}",
                d.verdict
            );
        }
    }

    #[test]
    fn services_may_publish_commands_and_chunks() {
        let d = judge_publish(
            &decoder(),
            Role::Service,
            "proxy",
            "m/dom/c/chan/registry/server",
            b"anything",
        );
        assert!(matches!(d.verdict, Verdict::Route(None)));
    }

    #[test]
    fn malformed_device_reports_are_dropped_and_explained() {
        let d = judge_publish(&decoder(), Role::Proplet, "a", ALIVE, b"{not json");
        assert!(matches!(d.verdict, Verdict::Drop(DropReason::Malformed)));
        assert!(d.decode_error.is_some());
    }

    #[test]
    fn fl_update_topic_level_must_name_the_publisher() {
        let body = br#"{"round_id":"r1","proplet_id":"b","update":{"w":[1.0]}}"#;
        let d = judge_publish(
            &decoder(),
            Role::Proplet,
            "a",
            "fl/rounds/r1/updates/b",
            body,
        );
        assert!(matches!(d.verdict, Verdict::Drop(_)), "{:?}", d.verdict);
    }

    fn scoped_device() -> Credential {
        Credential::proplet("k").on_channel(crate::server::ChannelScope {
            domain: Some("dom".into()),
            channel: "chan".into(),
        })
    }

    #[test]
    fn a_scoped_device_publishes_only_its_channels_reports() {
        let dev = scoped_device();
        let publish = |topic| may_access_topic("a", &dev, TopicAccess::Publish, topic);
        assert!(publish(ALIVE));
        assert!(publish(RESULTS));
        assert!(publish("m/dom/c/chan/registry/proplet"));
        assert!(publish("m/dom/c/chan/fl/rounds/r1/updates/a"));
        assert!(publish("fl/rounds/r1/updates/a"));
        assert!(
            !publish("fl/rounds/r1/updates/b"),
            "FL update naming another"
        );
        assert!(
            !publish("m/dom/c/other/control/proplet/alive"),
            "other channel"
        );
        assert!(
            !publish("m/dom2/c/chan/control/proplet/alive"),
            "other domain"
        );
        assert!(
            !publish("m/dom/c/chan/control/manager/start"),
            "manager topic"
        );
        assert!(!publish("m/dom/c/chan/registry/server"));
        assert!(!publish("m/+/c/chan/control/proplet/alive"));
        assert!(!publish("some/topic"));
    }

    #[test]
    fn a_scoped_device_subscribes_only_to_its_channels_commands() {
        let dev = scoped_device();
        let subscribe = |topic| may_access_topic("a", &dev, TopicAccess::Subscribe, topic);
        assert!(subscribe("m/dom/c/chan/control/manager/start"));
        assert!(subscribe("m/dom/c/chan/control/manager/stop"));
        assert!(subscribe("m/dom/c/chan/control/manager/invoke"));
        assert!(subscribe("m/dom/c/chan/registry/server"));
        assert!(!subscribe("#"));
        assert!(!subscribe("m/dom/c/+/control/manager/start"));
        assert!(!subscribe("m/dom/c/other/control/manager/start"));
        assert!(!subscribe(ALIVE), "another agent's reports");
        assert!(!subscribe("m/dom/c/chan/registry/proplet"));
    }

    #[test]
    fn an_unscoped_device_may_use_any_channel_and_services_anything() {
        let dev = Credential::proplet("k");
        assert!(may_access_topic(
            "a",
            &dev,
            TopicAccess::Publish,
            "m/x/c/y/control/proplet/alive"
        ));
        let svc = Credential::new("k", Role::Service);
        assert!(may_access_topic("s", &svc, TopicAccess::Subscribe, "#"));
    }

    #[test]
    fn device_subscriptions_are_literal_and_not_reports() {
        assert!(may_subscribe(
            Role::Proplet,
            "m/dom/c/chan/control/manager/start"
        ));
        assert!(may_subscribe(Role::Proplet, "m/dom/c/chan/registry/server"));
        assert!(may_subscribe(Role::Proplet, "fl/models/global_model_v0"));
        assert!(!may_subscribe(Role::Proplet, "#"));
        assert!(!may_subscribe(
            Role::Proplet,
            "m/+/c/+/control/proplet/alive"
        ));
        assert!(!may_subscribe(Role::Proplet, ALIVE));
        assert!(!may_subscribe(
            Role::Proplet,
            "m/dom/c/chan/registry/proplet"
        ));
        assert!(!may_subscribe(Role::Proplet, ""));
        assert!(may_subscribe(Role::Service, "#"));
    }
}
