//! Addresses of an external broker's nodes: `mqtt://host:port`, `mqtts://host:port` (also
//! upstream's `tcp://` and `ssl://`), or a bare `host:port` (plain).

use std::fmt;

/// One node of an external MQTT broker (or its load balancer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerAddress {
    /// Host name or IP literal (without brackets).
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// Whether the connection is wrapped in TLS.
    pub tls: bool,
}

/// An address that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("broker address {given:?}: {reason} (expected mqtt://host:port or mqtts://host:port)")]
pub struct AddressError {
    /// What was given.
    pub given: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl BrokerAddress {
    /// Parses one address; the default port is 1883 (plain) or 8883 (TLS).
    pub fn parse(text: &str) -> Result<Self, AddressError> {
        let given = text.trim();
        let error = |reason| AddressError {
            given: given.to_owned(),
            reason,
        };
        let (tls, rest) = match given.split_once("://") {
            Some(("mqtt" | "tcp", rest)) => (false, rest),
            Some(("mqtts" | "ssl" | "tls", rest)) => (true, rest),
            Some(_) => return Err(error("unknown scheme")),
            None => (false, given),
        };
        let rest = rest.trim_end_matches('/');
        if rest.is_empty() {
            return Err(error("no host"));
        }
        if rest.contains('/') || rest.contains('@') {
            return Err(error("a path or user part is not allowed"));
        }
        let default_port = if tls { 8883 } else { 1883 };
        let (host, port) = if let Some(bracketed) = rest.strip_prefix('[') {
            let (host, after) = bracketed
                .split_once(']')
                .ok_or_else(|| error("unclosed [ in an IPv6 address"))?;
            match after.strip_prefix(':') {
                Some(port) => (host, parse_port(port).ok_or_else(|| error("bad port"))?),
                None if after.is_empty() => (host, default_port),
                None => return Err(error("text after the IPv6 address")),
            }
        } else {
            match rest.rsplit_once(':') {
                Some((host, port)) => (host, parse_port(port).ok_or_else(|| error("bad port"))?),
                None => (rest, default_port),
            }
        };
        if host.is_empty() {
            return Err(error("no host"));
        }
        Ok(Self {
            host: host.to_owned(),
            port,
            tls,
        })
    }

    /// Parses a comma-separated list; empty entries are refused.
    pub fn parse_list(text: &str) -> Result<Vec<Self>, AddressError> {
        let list: Vec<Self> = text.split(',').map(Self::parse).collect::<Result<_, _>>()?;
        Ok(list)
    }
}

fn parse_port(text: &str) -> Option<u16> {
    text.parse::<u16>().ok().filter(|p| *p != 0)
}

impl fmt::Display for BrokerAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = if self.tls { "mqtts" } else { "mqtt" };
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
        let a = BrokerAddress::parse("tcp://10.0.0.1:1883").unwrap();
        assert!(!a.tls);
        let a = BrokerAddress::parse("ssl://h:8884").unwrap();
        assert!(a.tls);
        let a = BrokerAddress::parse("127.0.0.1:2000").unwrap();
        assert_eq!((a.host.as_str(), a.port), ("127.0.0.1", 2000));
        let a = BrokerAddress::parse("mqtt://[::1]:1999").unwrap();
        assert_eq!((a.host.as_str(), a.port), ("::1", 1999));
        assert_eq!(a.to_string(), "mqtt://[::1]:1999");
    }

    #[test]
    fn lists_and_refusals_name_the_entry() {
        let list = BrokerAddress::parse_list("mqtt://a:1, mqtt://b:2,mqtts://c").unwrap();
        assert_eq!(list.len(), 3);
        assert_eq!(list[1].host, "b");
        let e = BrokerAddress::parse_list("mqtt://a:1,,mqtt://b:2").unwrap_err();
        assert_eq!(e.reason, "no host");
        let e = BrokerAddress::parse("http://a:1").unwrap_err();
        assert!(e.to_string().contains("unknown scheme"), "{e}");
        assert!(BrokerAddress::parse("mqtt://a:0").is_err());
        assert!(BrokerAddress::parse("mqtt://a:99999").is_err());
        assert!(BrokerAddress::parse("mqtt://u@a:1").is_err());
    }
}
