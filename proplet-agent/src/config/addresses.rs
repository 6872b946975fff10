//! The list of brokers the agent may dial, as flags, variables and the file give it.

use std::str::FromStr;

use propeller_broker::protocol::{AddressError, BrokerAddress};
use serde::Deserialize;

use super::ConfigError;

/// `"tcp://x:1": bad port` for a single address (as before lists were accepted);
/// `entry 2 of 3, "tcp://x:1": bad port` in a list.
pub(super) fn describe_entry(
    entry: usize,
    count: usize,
    value: &str,
    problem: &AddressError,
) -> String {
    match (count, problem) {
        (0 | 1, AddressError::Empty) => format!("{problem}"),
        (1, _) => format!("{value:?}: {problem}"),
        (_, AddressError::Empty) => format!("entry {entry} of {count}: {problem}"),
        _ => format!("entry {entry} of {count}, {value:?}: {problem}"),
    }
}

/// The brokers the agent may use, in the order given; never empty. The agent connects to the
/// first and moves round-robin to the next one whenever a connection fails or drops.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerAddresses(Vec<BrokerAddress>);

impl BrokerAddresses {
    /// The list, or `None` when it is empty.
    pub fn new(addresses: Vec<BrokerAddress>) -> Option<Self> {
        (!addresses.is_empty()).then_some(Self(addresses))
    }

    /// A list of one.
    pub fn single(address: BrokerAddress) -> Self {
        Self(vec![address])
    }

    /// Parses a list of entries (a comma-separated setting already split, or a TOML array),
    /// naming `origin` and the bad entry in an error.
    pub fn parse<S: AsRef<str>>(entries: &[S], origin: &str) -> Result<Self, ConfigError> {
        let count = entries.len();
        let bad = |entry: usize, value: &str, problem: AddressError| ConfigError::Address {
            origin: origin.to_owned(),
            entry,
            count,
            value: value.trim().to_owned(),
            problem,
        };
        if count == 0 {
            return Err(bad(0, "", AddressError::Empty));
        }
        entries
            .iter()
            .enumerate()
            .map(|(i, e)| BrokerAddress::parse(e.as_ref()).map_err(|p| bad(i + 1, e.as_ref(), p)))
            .collect::<Result<Vec<_>, _>>()
            .map(Self)
    }

    /// Parses `tcp://a:1883,tcp://b:1883` (spaces around entries ignored).
    pub fn parse_list(text: &str, origin: &str) -> Result<Self, ConfigError> {
        Self::parse(&text.split(',').collect::<Vec<_>>(), origin)
    }

    /// The first broker, tried first.
    pub fn primary(&self) -> &BrokerAddress {
        &self.0[0]
    }

    /// All brokers, in order.
    pub fn as_slice(&self) -> &[BrokerAddress] {
        &self.0
    }

    /// How many there are (at least one).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Always false: the list is never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The first broker that uses TLS, if any.
    pub fn first_tls(&self) -> Option<&BrokerAddress> {
        self.0.iter().find(|a| a.tls)
    }
}

impl std::fmt::Display for BrokerAddresses {
    /// The addresses, comma-separated.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, address) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{address}")?;
        }
        Ok(())
    }
}

/// `mqtt_address` as a setting gives it: comma-separated text (a flag, a variable, the file
/// or the enrolled credentials), or a list in the file, checked entry by entry.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum AddressSetting {
    /// `tcp://a:1883,tcp://b:1883`.
    Text(String),
    /// A TOML array of addresses.
    List(Vec<toml::Value>),
}

impl FromStr for AddressSetting {
    type Err = std::convert::Infallible;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Ok(AddressSetting::Text(text.to_owned()))
    }
}

impl AddressSetting {
    /// False for empty text, which counts as unset.
    pub fn is_given(&self) -> bool {
        !matches!(self, AddressSetting::Text(text) if text.is_empty())
    }

    /// The brokers; an error names `origin` and the bad entry.
    pub fn brokers(&self, origin: &str) -> Result<BrokerAddresses, ConfigError> {
        match self {
            AddressSetting::Text(text) => BrokerAddresses::parse_list(text, origin),
            AddressSetting::List(items) => {
                let count = items.len();
                let mut entries = Vec::with_capacity(count);
                for (i, item) in items.iter().enumerate() {
                    let text = item.as_str().ok_or_else(|| ConfigError::Address {
                        origin: origin.to_owned(),
                        entry: i + 1,
                        count,
                        value: item.to_string(),
                        problem: AddressError::NotText,
                    })?;
                    entries.push(text);
                }
                BrokerAddresses::parse(&entries, origin)
            }
        }
    }
}
