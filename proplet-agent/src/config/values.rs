//! Parsers of the text values settings take: lists, booleans, durations, sizes, addresses.

use std::str::FromStr;

use std::path::PathBuf;
use std::time::Duration;

use propeller_broker::protocol::BrokerAddress;

use super::ConfigError;

/// `a, b,,c` → `[a, b, c]`; nothing for unset.
pub(super) fn comma_list(text: Option<String>) -> Vec<String> {
    text.map(|t| {
        t.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    })
    .unwrap_or_default()
}

/// `1`, `true`, `yes`, `on` and their opposites, in any case.
pub(super) fn parse_bool(text: &str) -> Option<bool> {
    match text.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

pub(super) fn invalid(name: &str, message: &str) -> ConfigError {
    ConfigError::Invalid {
        name: name.to_owned(),
        message: message.to_owned(),
    }
}

/// Parses `10` (seconds, as upstream agents read it) or a Go-style duration (`10s`,
/// `500ms`, `1m30s`).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    propeller_broker::protocol::parse_setting_duration(text)
}

/// Parses a count or size: `1000`, `64Mi`, `1Gi`, `512Ki`.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let (number, factor) = if let Some(n) = t.strip_suffix("Ki") {
        (n, 1u64 << 10)
    } else if let Some(n) = t.strip_suffix("Mi") {
        (n, 1 << 20)
    } else if let Some(n) = t.strip_suffix("Gi") {
        (n, 1 << 30)
    } else {
        (t, 1)
    };
    number
        .trim()
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(factor))
        .ok_or_else(|| format!("{text:?} is not a whole number (suffixes Ki, Mi, Gi allowed)"))
}

/// Splits a broker URL into host, port and whether TLS is asked for.
pub fn parse_address(address: &str) -> Result<(String, u16, bool), ConfigError> {
    BrokerAddress::parse(address)
        .map(|a| (a.host, a.port, a.tls))
        .map_err(|problem| ConfigError::Address {
            origin: "PROPLET_MQTT_ADDRESS".into(),
            entry: 1,
            count: 1,
            value: address.trim().to_owned(),
            problem,
        })
}

/// Deserializes a setting from the TOML file the way its flag reads it: from a string, or
/// from a number, boolean or list of strings written as such (a list joins with commas).
macro_rules! from_text {
    ($t:ty, $expecting:literal) => {
        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct Text;
                impl<'de> serde::de::Visitor<'de> for Text {
                    type Value = String;
                    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                        f.write_str($expecting)
                    }
                    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<String, E> {
                        Ok(v.to_owned())
                    }
                    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<String, E> {
                        Ok(v.to_string())
                    }
                    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<String, E> {
                        Ok(v.to_string())
                    }
                    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<String, E> {
                        Ok(v.to_string())
                    }
                    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<String, E> {
                        Ok(v.to_string())
                    }
                    fn visit_seq<A: serde::de::SeqAccess<'de>>(
                        self,
                        mut seq: A,
                    ) -> Result<String, A::Error> {
                        let mut items: Vec<String> = Vec::new();
                        while let Some(item) = seq.next_element::<String>()? {
                            items.push(item);
                        }
                        Ok(items.join(","))
                    }
                }
                let text = d.deserialize_any(Text)?;
                text.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

/// A duration: `10` (seconds, as upstream agents read it) or `10s`, `500ms`, `1m30s`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interval(pub Duration);

impl FromStr for Interval {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        parse_duration(text).map(Interval)
    }
}
from_text!(Interval, "a duration such as 10, \"10s\" or \"500ms\"");

/// A count or size: `1000`, `64Mi`, `1Gi`, `512Ki`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size(pub u64);

impl FromStr for Size {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        parse_size(text).map(Size)
    }
}
from_text!(Size, "a whole number, suffixes Ki, Mi, Gi allowed");

/// On or off: `true`, `1`, `yes`, `on` and their opposites, in any case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Switch(pub bool);

impl FromStr for Switch {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        parse_bool(text)
            .map(Switch)
            .ok_or_else(|| format!("{text:?} is not true or false"))
    }
}
from_text!(Switch, "true or false");

/// An MQTT QoS: 0, 1 or 2.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Qos {
    /// 0: at most once.
    AtMostOnce,
    /// 1: at least once.
    AtLeastOnce,
    /// 2: exactly once.
    ExactlyOnce,
}

impl Qos {
    /// The level as rumqttc takes it.
    pub fn to_mqtt(self) -> rumqttc::QoS {
        match self {
            Qos::AtMostOnce => rumqttc::QoS::AtMostOnce,
            Qos::AtLeastOnce => rumqttc::QoS::AtLeastOnce,
            Qos::ExactlyOnce => rumqttc::QoS::ExactlyOnce,
        }
    }
}

impl FromStr for Qos {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text.trim() {
            "0" => Ok(Qos::AtMostOnce),
            "1" => Ok(Qos::AtLeastOnce),
            "2" => Ok(Qos::ExactlyOnce),
            other => Err(format!("{other:?} is not 0, 1 or 2")),
        }
    }
}
from_text!(Qos, "0, 1 or 2");

/// A log level: trace, debug, info, warn or error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    /// `trace`.
    Trace,
    /// `debug`.
    Debug,
    /// `info`.
    Info,
    /// `warn`.
    Warn,
    /// `error`.
    Error,
}

impl From<LogLevel> for tracing::level_filters::LevelFilter {
    /// The level as a tracing filter: this level and the more severe ones.
    fn from(level: LogLevel) -> Self {
        match level {
            LogLevel::Trace => Self::TRACE,
            LogLevel::Debug => Self::DEBUG,
            LogLevel::Info => Self::INFO,
            LogLevel::Warn => Self::WARN,
            LogLevel::Error => Self::ERROR,
        }
    }
}

impl FromStr for LogLevel {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "trace" => Ok(LogLevel::Trace),
            "debug" => Ok(LogLevel::Debug),
            "info" => Ok(LogLevel::Info),
            "warn" => Ok(LogLevel::Warn),
            "error" => Ok(LogLevel::Error),
            _ => Err(format!("{text:?} is not trace, debug, info, warn or error")),
        }
    }
}
from_text!(LogLevel, "trace, debug, info, warn or error");

/// Which attester gives the evidence for a Key Broker Service: `none`, or `sample`
/// (no TEE: evidence any process can make, for tests and development only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttesterChoice {
    /// No attester: encrypted tasks are not taken.
    None,
    /// Confidential Containers' `sample` TEE: no hardware, no protection.
    Sample,
}

impl FromStr for AttesterChoice {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "none" => Ok(AttesterChoice::None),
            "sample" => Ok(AttesterChoice::Sample),
            other => Err(format!(
                "{other:?} is not none or sample (hardware attesters are not built into this proplet)"
            )),
        }
    }
}
from_text!(AttesterChoice, "none or sample");

/// A comma-separated list of words (`a, b,,c` → `[a, b, c]`), or a TOML list.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Words(pub Vec<String>);

impl FromStr for Words {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        Ok(Words(comma_list(Some(text.to_owned()))))
    }
}
from_text!(Words, "a comma-separated string or a list of strings");

/// Directories, separated by `:` or `,`, or a TOML list.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Dirs(pub Vec<PathBuf>);

impl FromStr for Dirs {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        Ok(Dirs(
            text.split([':', ','])
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(PathBuf::from)
                .collect(),
        ))
    }
}
from_text!(Dirs, "directories separated by `:` or a list of them");

/// Ports `FIRST-LAST`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortRange(pub std::ops::RangeInclusive<u16>);

impl FromStr for PortRange {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        let bad = || format!("{text:?} is not FIRST-LAST");
        let (first, last) = text.trim().split_once('-').ok_or_else(bad)?;
        let first: u16 = first.trim().parse().map_err(|_| bad())?;
        let last: u16 = last.trim().parse().map_err(|_| bad())?;
        if first == 0 || first > last {
            return Err(bad());
        }
        Ok(PortRange(first..=last))
    }
}
from_text!(PortRange, "ports FIRST-LAST");

/// Host overrides for guests' `wasi:http`, comma-separated `HOST:PORT:ADDRESS[:PORT]`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Overrides(pub Vec<crate::outgoing_http::HostOverride>);

impl FromStr for Overrides {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        crate::outgoing_http::parse_overrides(text).map(Overrides)
    }
}
from_text!(
    Overrides,
    "HOST:PORT:ADDRESS[:PORT] entries, comma-separated"
);
