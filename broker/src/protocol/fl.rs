//! Federated learning messages: round start (`fl/rounds/start`) and participant updates
//! (`fl/rounds/{round}/updates/{proplet}`, prefixed or not).

use std::fmt;

use serde_json::{Map, Value};

use super::error::DecodeError;
use super::fields::{b64_encode, number_to_u64, to_bytes, Fields, ObjectBuilder};
use super::topics::TopicSegment;

/// Starts one federated round (`fl/rounds/start`).
#[derive(Debug, Clone, PartialEq)]
pub struct FlRoundStart {
    /// `round_id` (required, non-empty; a number is taken as its decimal text).
    pub round_id: String,
    /// `experiment_id`: upstream falls back to `round_id` when absent.
    pub experiment_id: Option<String>,
    /// `model_uri`: the global model the round starts from.
    pub model_uri: Option<String>,
    /// `task_wasm_image`: the training task's image.
    pub task_wasm_image: Option<String>,
    /// `participants` (required, non-empty): agent ids.
    pub participants: Vec<String>,
    /// `k_of_n`: updates needed to aggregate.
    pub k_of_n: Option<u64>,
    /// `timeout_seconds`: round deadline.
    pub timeout_seconds: Option<u64>,
    /// `hyperparams`: passed to the training task as JSON.
    pub hyperparams: Option<Map<String, Value>>,
}

impl FlRoundStart {
    pub(crate) fn from_fields(f: Fields<'_>) -> Result<Self, DecodeError> {
        let round_id = f
            .opt_text("round_id")?
            .ok_or_else(|| DecodeError::MissingKey {
                key: "round_id".into(),
            })?;
        if round_id.is_empty() {
            return Err(DecodeError::InvalidValue {
                key: "round_id".into(),
                reason: "must not be empty".into(),
            });
        }
        if f.get("participants").is_none() {
            return Err(DecodeError::MissingKey {
                key: "participants".into(),
            });
        }
        let participants = f.str_list("participants")?;
        if participants.is_empty() {
            return Err(DecodeError::InvalidValue {
                key: "participants".into(),
                reason: "must name at least one participant".into(),
            });
        }
        Ok(Self {
            round_id,
            experiment_id: f.opt_str("experiment_id")?,
            model_uri: f.opt_str("model_uri")?,
            task_wasm_image: f.opt_str("task_wasm_image")?,
            participants,
            k_of_n: f.opt_u64("k_of_n")?,
            timeout_seconds: f.opt_u64("timeout_seconds")?,
            hyperparams: f.opt_object("hyperparams")?.cloned(),
        })
    }

    /// The JSON object.
    pub fn to_json(&self) -> Value {
        ObjectBuilder::new()
            .put("round_id", self.round_id.clone())
            .put_opt("experiment_id", self.experiment_id.clone())
            .put_opt("model_uri", self.model_uri.clone())
            .put_opt("task_wasm_image", self.task_wasm_image.clone())
            .put_strs("participants", &self.participants)
            .put_opt("k_of_n", self.k_of_n)
            .put_opt("timeout_seconds", self.timeout_seconds)
            .put_opt("hyperparams", self.hyperparams.clone().map(Value::Object))
            .build()
    }

    /// The payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        to_bytes(&self.to_json())
    }
}

/// A round id as senders write it: the Rust agent uses the task's `ROUND_ID` text (`"r1"`),
/// the embedded agent and the Go operator numbers.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum FlRoundId {
    /// A JSON number.
    Number(u64),
    /// A JSON string.
    Text(String),
}

/// Reads a round number from `1`-style, `round-1`-style or `r1`-style text (case-insensitive,
/// also `round_1`, `round1`, `r-1`, `r_1`): agents send `"round-1"` and `"r1"` where upstream
/// expected a number. `None` unless the rest is a whole decimal number (`"4abc"`, `"r"`,
/// `"-1"` have none). The one parser of round ids, for the broker and the operator.
pub fn round_number(text: &str) -> Option<u64> {
    let lower = text.trim().to_ascii_lowercase();
    let digits = ["round-", "round_", "round", "r-", "r_", "r"]
        .iter()
        .find_map(|prefix| lower.strip_prefix(prefix))
        .unwrap_or(&lower);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

impl FlRoundId {
    /// The round number: the number itself, or the text's by [`round_number`].
    pub fn as_number(&self) -> Option<u64> {
        match self {
            Self::Number(n) => Some(*n),
            Self::Text(t) => round_number(t),
        }
    }

    fn to_json(&self) -> Value {
        match self {
            Self::Number(n) => Value::from(*n),
            Self::Text(t) => Value::String(t.clone()),
        }
    }
}

impl fmt::Display for FlRoundId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Number(n) => write!(f, "{n}"),
            Self::Text(t) => f.write_str(t),
        }
    }
}

/// Keys [`FlUpdate`] types; everything else lands in [`FlUpdate::extra`].
const KNOWN_UPDATE_KEYS: [&str; 12] = [
    "task_id",
    "job_id",
    "round_id",
    "global_version",
    "proplet_id",
    "num_samples",
    "update_b64",
    "update",
    "format",
    "metrics",
    "base_model_uri",
    "error",
];

/// One participant's update envelope.
///
/// Senders differ: the Rust agent's FL result carries `update_b64` and `format`, the embedded
/// agent sends `update` (an object), `base_model_uri` and sometimes `error`, and the Rust
/// agent's MQTT fallback sends the training client's own JSON. So no key is required here (the
/// topic names the round and the participant); types are still checked, and unknown keys are
/// kept in [`FlUpdate::extra`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FlUpdate {
    /// `task_id`.
    pub task_id: Option<String>,
    /// `job_id`: the FL job / experiment.
    pub job_id: Option<String>,
    /// `round_id`: string or number.
    pub round_id: Option<FlRoundId>,
    /// `global_version`: model version the update is based on.
    pub global_version: Option<String>,
    /// `proplet_id`: the participant.
    pub proplet_id: Option<String>,
    /// `num_samples`: training samples behind the update (its FedAvg weight).
    pub num_samples: Option<u64>,
    /// The decoded bytes of `update_b64`.
    pub update_b64: Option<Vec<u8>>,
    /// `update`: an inline JSON update (embedded agent).
    pub update: Option<Value>,
    /// `format`: e.g. `f32-delta`, `json-f64`.
    pub format: Option<String>,
    /// `metrics`: training metrics.
    pub metrics: Option<Map<String, Value>>,
    /// `base_model_uri`: the model trained from (embedded agent).
    pub base_model_uri: Option<String>,
    /// `error`: the participant's failure, if any.
    pub error: Option<String>,
    /// Every other key, unchanged.
    pub extra: Map<String, Value>,
}

impl FlUpdate {
    pub(crate) fn from_fields(f: Fields<'_>) -> Result<Self, DecodeError> {
        let round_id = match f.get("round_id") {
            None => None,
            Some(Value::String(s)) => Some(FlRoundId::Text(s.clone())),
            Some(v @ Value::Number(_)) => {
                Some(FlRoundId::Number(number_to_u64(v).ok_or_else(|| {
                    DecodeError::WrongType {
                        key: f.key("round_id"),
                        expected: "string or non-negative integer",
                    }
                })?))
            }
            Some(_) => {
                return Err(DecodeError::WrongType {
                    key: f.key("round_id"),
                    expected: "string or non-negative integer",
                })
            }
        };
        let extra = f
            .raw()
            .iter()
            .filter(|(k, _)| !KNOWN_UPDATE_KEYS.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Ok(Self {
            task_id: f.opt_str("task_id")?,
            job_id: f.opt_str("job_id")?,
            round_id,
            global_version: f.opt_str("global_version")?,
            proplet_id: f.opt_str("proplet_id")?,
            num_samples: f.opt_u64("num_samples")?,
            update_b64: f.opt_base64("update_b64")?,
            update: f.get("update").cloned(),
            format: f.opt_str("format")?,
            metrics: f.opt_object("metrics")?.cloned(),
            base_model_uri: f.opt_str("base_model_uri")?,
            error: f.opt_str("error")?,
            extra,
        })
    }

    /// The JSON object; typed keys override same-named keys in `extra`.
    pub fn to_json(&self) -> Value {
        ObjectBuilder::from_map(self.extra.clone())
            .put_opt("task_id", self.task_id.clone())
            .put_opt("job_id", self.job_id.clone())
            .put_opt("round_id", self.round_id.as_ref().map(FlRoundId::to_json))
            .put_opt("global_version", self.global_version.clone())
            .put_opt("proplet_id", self.proplet_id.clone())
            .put_opt("num_samples", self.num_samples)
            .put_opt("update_b64", self.update_b64.as_deref().map(b64_encode))
            .put_opt("update", self.update.clone())
            .put_opt("format", self.format.clone())
            .put_opt("metrics", self.metrics.clone().map(Value::Object))
            .put_opt("base_model_uri", self.base_model_uri.clone())
            .put_opt("error", self.error.clone())
            .build()
    }

    /// The payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        to_bytes(&self.to_json())
    }
}

/// An update as received on an update topic: the topic's round and participant levels plus
/// the envelope. The topic levels are what a broker can check against the publisher's identity.
#[derive(Debug, Clone, PartialEq)]
pub struct FlUpdateMessage {
    /// The topic's `{round}` level.
    pub round_id: TopicSegment,
    /// The topic's `{proplet}` level.
    pub proplet_id: TopicSegment,
    /// The payload.
    pub envelope: FlUpdate,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_number_reads_only_whole_numbers() {
        assert_eq!(round_number("round-12"), Some(12));
        assert_eq!(round_number("r7"), Some(7));
        assert_eq!(round_number("007"), Some(7));
        assert_eq!(round_number("round3"), Some(3));
        for bad in [
            "",
            "round-",
            "r",
            "-1",
            "+1",
            "1a",
            "round-1.5",
            "rr1",
            "round-18446744073709551616",
        ] {
            assert_eq!(round_number(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn round_id_numbers() {
        assert_eq!(FlRoundId::Number(7).as_number(), Some(7));
        assert_eq!(FlRoundId::Text("12".into()).as_number(), Some(12));
        assert_eq!(FlRoundId::Text("round-3".into()).as_number(), Some(3));
        assert_eq!(FlRoundId::Text("4abc".into()).as_number(), None);
        assert_eq!(FlRoundId::Text("r1".into()).as_number(), Some(1));
        assert_eq!(FlRoundId::Text("4".into()).as_number(), Some(4));
        assert_eq!(FlRoundId::Text(String::new()).as_number(), None);
        assert_eq!(FlRoundId::Text("r1".into()).to_string(), "r1");
        assert_eq!(FlRoundId::Number(9).to_string(), "9");
    }

    #[test]
    fn extra_keys_survive_and_do_not_override_typed_keys() {
        let mut extra = Map::new();
        extra.insert("weights".into(), Value::from(vec![1, 2]));
        extra.insert("job_id".into(), Value::from("shadow"));
        let u = FlUpdate {
            job_id: Some("real".into()),
            extra,
            ..FlUpdate::default()
        };
        let v = u.to_json();
        assert_eq!(v.get("job_id"), Some(&Value::from("real")));
        assert_eq!(v.get("weights"), Some(&Value::from(vec![1, 2])));
    }
}
