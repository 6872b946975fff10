//! Parsers of the text values settings take: lists, booleans, durations, sizes, addresses.

use super::*;

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
