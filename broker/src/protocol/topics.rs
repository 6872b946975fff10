//! Topic layout: `m/{domain}/c/{channel}/{path}` and the unprefixed FL update topic.
//!
//! Ids are validated once, when a [`TopicSegment`] or [`Channel`] is built, so no id can add a
//! topic level (`/`) or act as a wildcard (`+`, `#`); upstream does not escape ids, we refuse
//! them instead.

use std::fmt;

use super::error::TopicError;

/// Operator-side filter for the unprefixed FL update topic the upstream agents publish to.
pub const UNPREFIXED_FL_UPDATE_FILTER: &str = "fl/rounds/+/updates/+";

fn check_segment(text: &str, what: &'static str) -> Result<(), TopicError> {
    if text.is_empty() {
        return Err(TopicError::Empty { what });
    }
    match text.chars().find(|c| matches!(c, '/' | '+' | '#' | '\0')) {
        Some(ch) => Err(TopicError::ForbiddenChar { what, ch }),
        None => Ok(()),
    }
}

/// One topic level: non-empty, without `/`, `+`, `#` or NUL.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TopicSegment(String);

impl TopicSegment {
    /// Validates `text` as a single topic level; `what` names it in the error.
    pub fn new(text: impl Into<String>, what: &'static str) -> Result<Self, TopicError> {
        let text = text.into();
        check_segment(&text, what)?;
        Ok(Self(text))
    }

    /// The level's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for TopicSegment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for TopicSegment {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// What a topic carries; the decoder needs it to pick the payload type.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum TopicKind {
    /// `control/proplet/create`: discovery, once at agent start.
    Discovery,
    /// `control/proplet/alive`: heartbeats and the "offline" Last Will.
    Alive,
    /// `control/proplet/metrics`: host-level CPU and memory.
    PropletMetrics,
    /// `control/proplet/task_metrics`: per-task process metrics.
    TaskMetrics,
    /// `control/proplet/results`: task results and failures.
    Results,
    /// `control/proplet/invoke_results`: results of latent-task invocations.
    InvokeResults,
    /// `control/proplet/upgrade`: how far an agent got with an upgrade.
    UpgradeReport,
    /// `control/proplet/logs`: lines tasks printed.
    Logs,
    /// `control/manager/start`: start a task.
    Start,
    /// `control/manager/stop`: stop a task.
    Stop,
    /// `control/manager/invoke`: invoke a latent task.
    Invoke,
    /// `control/manager/upgrade`: install or revert an agent version.
    Upgrade,
    /// `registry/proplet`: an agent asks for a Wasm binary.
    RegistryRequest,
    /// `registry/server`: one base64 chunk of a Wasm binary.
    RegistryChunk,
    /// `fl/rounds/start`: start of a federated round.
    FlRoundStart,
    /// `fl/rounds/{round}/updates/{proplet}`: one participant's update (prefixed or not).
    FlUpdate {
        /// The `{round}` level.
        round_id: TopicSegment,
        /// The `{proplet}` level.
        proplet_id: TopicSegment,
    },
}

impl TopicKind {
    /// Every kind with a fixed path (all but [`TopicKind::FlUpdate`]).
    pub const FIXED: [TopicKind; 15] = [
        TopicKind::Discovery,
        TopicKind::Alive,
        TopicKind::PropletMetrics,
        TopicKind::TaskMetrics,
        TopicKind::Results,
        TopicKind::InvokeResults,
        TopicKind::UpgradeReport,
        TopicKind::Logs,
        TopicKind::Start,
        TopicKind::Stop,
        TopicKind::Invoke,
        TopicKind::Upgrade,
        TopicKind::RegistryRequest,
        TopicKind::RegistryChunk,
        TopicKind::FlRoundStart,
    ];

    /// The path after `m/{domain}/c/{channel}/`.
    pub fn path(&self) -> String {
        let fixed = match self {
            Self::Discovery => "control/proplet/create",
            Self::Alive => "control/proplet/alive",
            Self::PropletMetrics => "control/proplet/metrics",
            Self::TaskMetrics => "control/proplet/task_metrics",
            Self::Results => "control/proplet/results",
            Self::InvokeResults => "control/proplet/invoke_results",
            Self::UpgradeReport => "control/proplet/upgrade",
            Self::Logs => "control/proplet/logs",
            Self::Start => "control/manager/start",
            Self::Stop => "control/manager/stop",
            Self::Invoke => "control/manager/invoke",
            Self::Upgrade => "control/manager/upgrade",
            Self::RegistryRequest => "registry/proplet",
            Self::RegistryChunk => "registry/server",
            Self::FlRoundStart => "fl/rounds/start",
            Self::FlUpdate {
                round_id,
                proplet_id,
            } => return fl_update_path(round_id, proplet_id),
        };
        fixed.to_owned()
    }

    fn from_levels(levels: &[&str]) -> Option<Self> {
        let kind = match levels {
            ["control", "proplet", leaf] => match *leaf {
                "create" => Self::Discovery,
                "alive" => Self::Alive,
                "metrics" => Self::PropletMetrics,
                "task_metrics" => Self::TaskMetrics,
                "results" => Self::Results,
                "invoke_results" => Self::InvokeResults,
                "upgrade" => Self::UpgradeReport,
                "logs" => Self::Logs,
                _ => return None,
            },
            ["control", "manager", leaf] => match *leaf {
                "start" => Self::Start,
                "stop" => Self::Stop,
                "invoke" => Self::Invoke,
                "upgrade" => Self::Upgrade,
                _ => return None,
            },
            ["registry", "proplet"] => Self::RegistryRequest,
            ["registry", "server"] => Self::RegistryChunk,
            ["fl", "rounds", "start"] => Self::FlRoundStart,
            ["fl", "rounds", round, "updates", proplet] => Self::FlUpdate {
                round_id: TopicSegment::new(*round, "round id").ok()?,
                proplet_id: TopicSegment::new(*proplet, "proplet id").ok()?,
            },
            _ => return None,
        };
        Some(kind)
    }
}

fn fl_update_path(round_id: &TopicSegment, proplet_id: &TopicSegment) -> String {
    format!("fl/rounds/{round_id}/updates/{proplet_id}")
}

/// The filters of a SUBSCRIBE that its SUBACK refused, given whether each return code (in
/// the filters' order) is a refusal; `None` when the SUBACK does not have one code per filter.
pub fn refused_filters(filters: &[String], refusals: &[bool]) -> Option<Vec<String>> {
    (filters.len() == refusals.len()).then(|| {
        filters
            .iter()
            .zip(refusals)
            .filter(|(_, refused)| **refused)
            .map(|(filter, _)| filter.clone())
            .collect()
    })
}

/// The unprefixed `fl/rounds/{round}/updates/{proplet}` topic the upstream agents publish to.
pub fn unprefixed_fl_update_topic(round_id: &TopicSegment, proplet_id: &TopicSegment) -> String {
    fl_update_path(round_id, proplet_id)
}

/// A borrowed view of the domain and channel found in a topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChannelRef<'a> {
    /// The `{domain}` level.
    pub domain: &'a str,
    /// The `{channel}` level.
    pub channel: &'a str,
}

/// Splits a topic into its channel (`None` for the unprefixed FL update topic) and its kind.
/// Returns `None` for topics outside the protocol, wildcard filters and empty levels.
pub fn classify(topic: &str) -> Option<(Option<ChannelRef<'_>>, TopicKind)> {
    let levels: Vec<&str> = topic.split('/').collect();
    match levels.as_slice() {
        ["m", domain, "c", channel, rest @ ..] => {
            check_segment(domain, "domain").ok()?;
            check_segment(channel, "channel").ok()?;
            let kind = TopicKind::from_levels(rest)?;
            Some((Some(ChannelRef { domain, channel }), kind))
        }
        ["fl", "rounds", _, "updates", _] => {
            let kind = TopicKind::from_levels(&levels)?;
            Some((None, kind))
        }
        _ => None,
    }
}

/// One domain/channel pair: every topic of the protocol is built from it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Channel {
    domain: TopicSegment,
    channel: TopicSegment,
}

impl Channel {
    /// Validates both ids; an id with `/`, `+`, `#` or NUL, or an empty one, is refused so it
    /// cannot create extra topic levels.
    pub fn new(domain: impl Into<String>, channel: impl Into<String>) -> Result<Self, TopicError> {
        Ok(Self {
            domain: TopicSegment::new(domain, "domain")?,
            channel: TopicSegment::new(channel, "channel")?,
        })
    }

    /// The domain (upstream: tenant) id.
    pub fn domain(&self) -> &str {
        self.domain.as_str()
    }

    /// The channel id.
    pub fn channel(&self) -> &str {
        self.channel.as_str()
    }

    /// A borrowed view, comparable with what [`classify`] returns.
    pub fn as_channel_ref(&self) -> ChannelRef<'_> {
        ChannelRef {
            domain: self.domain(),
            channel: self.channel(),
        }
    }

    /// `m/{domain}/c/{channel}`.
    pub fn prefix(&self) -> String {
        format!("m/{}/c/{}", self.domain, self.channel)
    }

    /// The full topic of `kind` on this channel.
    pub fn topic(&self, kind: &TopicKind) -> String {
        format!("{}/{}", self.prefix(), kind.path())
    }

    /// Discovery topic (`control/proplet/create`).
    pub fn discovery(&self) -> String {
        self.topic(&TopicKind::Discovery)
    }

    /// Heartbeat and Last Will topic (`control/proplet/alive`).
    pub fn alive(&self) -> String {
        self.topic(&TopicKind::Alive)
    }

    /// Host metrics topic (`control/proplet/metrics`).
    pub fn proplet_metrics(&self) -> String {
        self.topic(&TopicKind::PropletMetrics)
    }

    /// Task metrics topic (`control/proplet/task_metrics`).
    pub fn task_metrics(&self) -> String {
        self.topic(&TopicKind::TaskMetrics)
    }

    /// Results topic (`control/proplet/results`).
    pub fn results(&self) -> String {
        self.topic(&TopicKind::Results)
    }

    /// Invoke results topic (`control/proplet/invoke_results`).
    pub fn invoke_results(&self) -> String {
        self.topic(&TopicKind::InvokeResults)
    }

    /// Start topic (`control/manager/start`).
    pub fn start(&self) -> String {
        self.topic(&TopicKind::Start)
    }

    /// Stop topic (`control/manager/stop`).
    pub fn stop(&self) -> String {
        self.topic(&TopicKind::Stop)
    }

    /// Invoke topic (`control/manager/invoke`).
    pub fn invoke(&self) -> String {
        self.topic(&TopicKind::Invoke)
    }

    /// `…/control/manager/upgrade`.
    pub fn upgrade(&self) -> String {
        self.topic(&TopicKind::Upgrade)
    }

    /// `…/control/proplet/upgrade`.
    pub fn upgrade_report(&self) -> String {
        self.topic(&TopicKind::UpgradeReport)
    }

    /// `…/control/proplet/logs`.
    pub fn logs(&self) -> String {
        self.topic(&TopicKind::Logs)
    }

    /// Binary request topic (`registry/proplet`).
    pub fn registry_request(&self) -> String {
        self.topic(&TopicKind::RegistryRequest)
    }

    /// Binary chunk topic (`registry/server`).
    pub fn registry_chunks(&self) -> String {
        self.topic(&TopicKind::RegistryChunk)
    }

    /// FL round start topic (`fl/rounds/start`).
    pub fn fl_round_start(&self) -> String {
        self.topic(&TopicKind::FlRoundStart)
    }

    /// Prefixed FL update topic (`fl/rounds/{round}/updates/{proplet}`).
    pub fn fl_update(&self, round_id: &TopicSegment, proplet_id: &TopicSegment) -> String {
        format!("{}/{}", self.prefix(), fl_update_path(round_id, proplet_id))
    }

    /// The kind of `topic` if it belongs to this channel, or is the unprefixed FL update topic
    /// (which carries no channel, so any channel's operator may take it).
    pub fn classify(&self, topic: &str) -> Option<TopicKind> {
        match classify(topic)? {
            (Some(found), kind) if found == self.as_channel_ref() => Some(kind),
            (Some(_), _) => None,
            (None, kind) => Some(kind),
        }
    }

    /// Subscriptions of the operator: everything agents publish on this channel, binary
    /// requests, FL round starts and FL updates in both the prefixed and unprefixed form.
    /// Narrower than upstream's `{P}/#`, so binary chunks are not echoed back to the operator.
    pub fn operator_filters(&self) -> Vec<String> {
        let p = self.prefix();
        vec![
            format!("{p}/control/proplet/+"),
            format!("{p}/registry/proplet"),
            format!("{p}/fl/rounds/start"),
            format!("{p}/fl/rounds/+/updates/+"),
            UNPREFIXED_FL_UPDATE_FILTER.to_owned(),
        ]
    }

    /// Subscriptions of an agent: the same four topics as the upstream Rust proplet (an
    /// agent of ours also subscribes to [`Channel::upgrade`], and runs without it where it
    /// is refused).
    pub fn agent_filters(&self) -> Vec<String> {
        vec![
            self.start(),
            self.stop(),
            self.invoke(),
            self.registry_chunks(),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chan() -> Channel {
        match Channel::new("dom", "chan") {
            Ok(c) => c,
            Err(e) => panic!("valid ids rejected: {e}"),
        }
    }

    fn seg(s: &str) -> TopicSegment {
        match TopicSegment::new(s, "test") {
            Ok(x) => x,
            Err(e) => panic!("valid segment rejected: {e}"),
        }
    }

    #[test]
    fn builds_every_topic_of_the_catalogue() {
        let c = chan();
        assert_eq!(c.prefix(), "m/dom/c/chan");
        assert_eq!(c.discovery(), "m/dom/c/chan/control/proplet/create");
        assert_eq!(c.alive(), "m/dom/c/chan/control/proplet/alive");
        assert_eq!(c.proplet_metrics(), "m/dom/c/chan/control/proplet/metrics");
        assert_eq!(
            c.task_metrics(),
            "m/dom/c/chan/control/proplet/task_metrics"
        );
        assert_eq!(c.results(), "m/dom/c/chan/control/proplet/results");
        assert_eq!(
            c.invoke_results(),
            "m/dom/c/chan/control/proplet/invoke_results"
        );
        assert_eq!(c.start(), "m/dom/c/chan/control/manager/start");
        assert_eq!(c.stop(), "m/dom/c/chan/control/manager/stop");
        assert_eq!(c.invoke(), "m/dom/c/chan/control/manager/invoke");
        assert_eq!(c.registry_request(), "m/dom/c/chan/registry/proplet");
        assert_eq!(c.registry_chunks(), "m/dom/c/chan/registry/server");
        assert_eq!(c.fl_round_start(), "m/dom/c/chan/fl/rounds/start");
        assert_eq!(
            c.fl_update(&seg("r1"), &seg("p1")),
            "m/dom/c/chan/fl/rounds/r1/updates/p1"
        );
        assert_eq!(
            unprefixed_fl_update_topic(&seg("r1"), &seg("p1")),
            "fl/rounds/r1/updates/p1"
        );
    }

    #[test]
    fn rejects_ids_that_would_change_the_topic_shape() {
        assert_eq!(
            Channel::new("", "c"),
            Err(TopicError::Empty { what: "domain" })
        );
        assert_eq!(
            Channel::new("d", ""),
            Err(TopicError::Empty { what: "channel" })
        );
        for (bad, ch) in [("a/b", '/'), ("a+", '+'), ("#", '#'), ("a\0", '\0')] {
            assert_eq!(
                Channel::new(bad, "c"),
                Err(TopicError::ForbiddenChar { what: "domain", ch })
            );
            assert_eq!(
                Channel::new("d", bad),
                Err(TopicError::ForbiddenChar {
                    what: "channel",
                    ch
                })
            );
        }
    }

    #[test]
    fn classify_recognises_every_fixed_kind() {
        let c = chan();
        for kind in TopicKind::FIXED {
            let topic = c.topic(&kind);
            assert_eq!(
                classify(&topic),
                Some((
                    Some(ChannelRef {
                        domain: "dom",
                        channel: "chan"
                    }),
                    kind.clone()
                )),
                "{topic}"
            );
            assert_eq!(c.classify(&topic), Some(kind));
        }
    }

    #[test]
    fn classify_fl_updates_prefixed_and_unprefixed() {
        let expected = TopicKind::FlUpdate {
            round_id: seg("r1"),
            proplet_id: seg("edge-1"),
        };
        assert_eq!(
            classify("m/d/c/ch/fl/rounds/r1/updates/edge-1"),
            Some((
                Some(ChannelRef {
                    domain: "d",
                    channel: "ch"
                }),
                expected.clone()
            ))
        );
        assert_eq!(
            classify("fl/rounds/r1/updates/edge-1"),
            Some((None, expected.clone()))
        );
        assert_eq!(
            chan().classify("fl/rounds/r1/updates/edge-1"),
            Some(expected)
        );
    }

    #[test]
    fn classify_rejects_foreign_and_malformed_topics() {
        let c = chan();
        for topic in [
            "",
            "m/dom/c/chan",
            "m/dom/c/chan/",
            "m/dom/c/chan/control/proplet",
            "m/dom/c/chan/control/proplet/unknown",
            "m/dom/c/chan/control/proplet/alive/extra",
            "m/dom/c/chan/control/manager/registry",
            "m/dom/c/chan/control/proplet/+",
            "m/dom/c/chan/#",
            "m//c/chan/control/proplet/alive",
            "m/+/c/chan/control/proplet/alive",
            "x/dom/c/chan/control/proplet/alive",
            "m/dom/x/chan/control/proplet/alive",
            "fl/rounds/next",
            "fl/rounds/start",
            "fl/rounds//updates/p",
            "fl/rounds/+/updates/+",
            "fl/models/global_model_v0",
            "m/dom/c/chan/fl/rounds/r/updates/p/x",
        ] {
            assert_eq!(classify(topic), None, "{topic:?}");
        }
        assert_eq!(c.classify("m/other/c/chan/control/proplet/alive"), None);
        assert_eq!(c.classify("m/dom/c/other/control/proplet/alive"), None);
    }

    #[test]
    fn subscription_filters() {
        let c = chan();
        assert_eq!(
            c.operator_filters(),
            vec![
                "m/dom/c/chan/control/proplet/+",
                "m/dom/c/chan/registry/proplet",
                "m/dom/c/chan/fl/rounds/start",
                "m/dom/c/chan/fl/rounds/+/updates/+",
                "fl/rounds/+/updates/+",
            ]
        );
        assert_eq!(
            c.agent_filters(),
            vec![
                "m/dom/c/chan/control/manager/start",
                "m/dom/c/chan/control/manager/stop",
                "m/dom/c/chan/control/manager/invoke",
                "m/dom/c/chan/registry/server",
            ]
        );
    }
}
