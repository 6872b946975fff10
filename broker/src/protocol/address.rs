//! Addresses of MQTT brokers, as agents and propeller take them: `tcp://host:1883`,
//! `mqtt://`, `ssl://` / `tls://` / `mqtts://`, or a bare `host[:port]`; lists are
//! comma-separated.

/// Why one broker address does not parse.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum AddressError {
    /// Nothing between two commas, or an empty list.
    #[error(
        "empty address (give one or more addresses separated by commas, e.g. tcp://a:1883,tcp://b:1883)"
    )]
    Empty,
    /// A scheme other than tcp, mqtt, ssl, tls or mqtts.
    #[error("unknown scheme {0:?} (use tcp, mqtt, ssl, tls or mqtts)")]
    UnknownScheme(String),
    /// `[::1` without its `]`.
    #[error("unclosed `[`")]
    UnclosedBracket,
    /// Text after an IPv6 address's `]` that is not `:port`.
    #[error("unexpected text after `]`")]
    AfterBracket,
    /// The port is not a number from 1 to 65535.
    #[error("bad port")]
    BadPort,
    /// A `user@` part or a path after the port.
    #[error("a user part or a path is not allowed")]
    UserOrPath,
    /// No host before the port.
    #[error("missing host")]
    MissingHost,
    /// A TOML list item that is not a string.
    #[error("not a string")]
    NotText,
}

/// One broker to connect to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerAddress {
    /// Host name or IP address (an IPv6 address without its brackets).
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// Whether the connection uses TLS (ssl://, tls:// or mqtts://).
    pub tls: bool,
}

impl BrokerAddress {
    /// Parses `tcp://host:1883`, `mqtt://…`, `ssl://` / `tls://` / `mqtts://` (default port
    /// 8883), `host:port` or `host` (tcp, 1883); IPv6 hosts in brackets. Surrounding spaces
    /// are ignored.
    pub fn parse(text: &str) -> Result<Self, AddressError> {
        let text = text.trim();
        if text.is_empty() {
            return Err(AddressError::Empty);
        }
        let (scheme, rest) = match text.split_once("://") {
            Some((s, r)) => (s.to_ascii_lowercase(), r),
            None => ("tcp".to_owned(), text),
        };
        let tls = match scheme.as_str() {
            "tcp" | "mqtt" => false,
            "ssl" | "tls" | "mqtts" => true,
            other => return Err(AddressError::UnknownScheme(other.to_owned())),
        };
        let rest = rest.trim_end_matches('/');
        if rest.contains(['/', '@']) {
            return Err(AddressError::UserOrPath);
        }
        let default_port = if tls { 8883 } else { 1883 };
        let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
            let (host, after) = v6.split_once(']').ok_or(AddressError::UnclosedBracket)?;
            let port = match after.strip_prefix(':') {
                Some(p) => parse_port(p)?,
                None if after.is_empty() => default_port,
                None => return Err(AddressError::AfterBracket),
            };
            (host.to_owned(), port)
        } else {
            match rest.rsplit_once(':') {
                Some((h, p)) => (h.to_owned(), parse_port(p)?),
                None => (rest.to_owned(), default_port),
            }
        };
        if host.is_empty() {
            return Err(AddressError::MissingHost);
        }
        Ok(Self { host, port, tls })
    }

    /// Parses a comma-separated list; an empty entry is refused.
    pub fn parse_list(text: &str) -> Result<Vec<Self>, AddressError> {
        text.split(',').map(Self::parse).collect()
    }
}

fn parse_port(text: &str) -> Result<u16, AddressError> {
    match text.parse::<u16>() {
        Ok(0) | Err(_) => Err(AddressError::BadPort),
        Ok(port) => Ok(port),
    }
}

impl std::fmt::Display for BrokerAddress {
    /// `tcp://host:port` or `ssl://host:port`, IPv6 hosts in brackets.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = if self.tls { "ssl" } else { "tcp" };
        if self.host.contains(':') {
            write!(f, "{scheme}://[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{scheme}://{}:{}", self.host, self.port)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes_ports_and_defaults() {
        let a = BrokerAddress::parse("mqtt://rabbit-1:1884").unwrap();
        assert_eq!((a.host.as_str(), a.port, a.tls), ("rabbit-1", 1884, false));
        let a = BrokerAddress::parse("mqtts://broker.example").unwrap();
        assert_eq!((a.port, a.tls), (8883, true));
        assert!(!BrokerAddress::parse("tcp://10.0.0.1:1883").unwrap().tls);
        assert!(BrokerAddress::parse("ssl://h:8884").unwrap().tls);
        let a = BrokerAddress::parse("127.0.0.1:2000").unwrap();
        assert_eq!((a.host.as_str(), a.port), ("127.0.0.1", 2000));
        let a = BrokerAddress::parse("mqtt://[::1]:1999").unwrap();
        assert_eq!((a.host.as_str(), a.port), ("::1", 1999));
        assert_eq!(a.to_string(), "tcp://[::1]:1999");
    }

    #[test]
    fn lists_and_refusals() {
        let list = BrokerAddress::parse_list("mqtt://a:1, mqtt://b:2,mqtts://c").unwrap();
        assert_eq!(list.len(), 3);
        assert_eq!(list[1].host, "b");
        let e = BrokerAddress::parse_list("mqtt://a:1,,mqtt://b:2").unwrap_err();
        assert_eq!(e, AddressError::Empty);
        let e = BrokerAddress::parse("http://a:1").unwrap_err();
        assert!(e.to_string().contains("unknown scheme"), "{e}");
        assert_eq!(
            BrokerAddress::parse("mqtt://a:0"),
            Err(AddressError::BadPort)
        );
        assert!(BrokerAddress::parse("mqtt://a:99999").is_err());
        assert_eq!(
            BrokerAddress::parse("mqtt://u@a:1"),
            Err(AddressError::UserOrPath)
        );
    }
}
