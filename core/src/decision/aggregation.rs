//! Federated-learning updates: the envelope, its extraction from task results, and aggregation.
//!
//! Upstream (upstream's Go operator) could never collect an update: it looked for the
//! envelope only in a JSON *object*, while results were stored as strings; it parsed the Rust
//! proplet's `"round_id":"round-1"` as 0; it demanded a `job_id` the proplet never sends; and it
//! ignored `aggregator.algorithm`, letting the first update's format pick the algorithm. This
//! module fixes those points:
//!
//! * [`extract_update`] accepts every shape the agents send (a bare envelope object,
//!   `update_envelope`, `results.update_envelope`, a JSON string holding any of these, round ids
//!   `1`, `"1"`, `"round-1"`, `"r1"`), fills what the sender left out from what the round
//!   expects ([`ExpectedUpdate`]) and rejects an update that names another round, job or proplet.
//! * [`aggregate`] runs the algorithm the FederatedJob asked for ([`Algorithm`]): a weighted
//!   FedAvg over `json-f64` or little-endian `f32` vectors, or a plain concatenation.
//!
//! Everything is pure (no I/O, no clock) and deterministic: FedAvg sums the updates in a
//! canonical order, so the same set of updates gives bit-identical output whatever order the
//! caller collected them in.

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

use base64::alphabet;
use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig, STANDARD};
use base64::engine::DecodePaddingMode;
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

mod extraction;
mod vector;

use crate::decision::aggregation::extraction::snippet;
use crate::decision::aggregation::vector::{decode_bytes, VectorFormat};
pub use extraction::extract_update;
pub use vector::{decode_vector, encode_f32_le, encode_json_f64};

/// Vector format: base64 of a JSON array of numbers (upstream's default format).
pub const FORMAT_JSON_F64: &str = "json-f64";
/// Vector format: base64 of raw little-endian `f32` values.
pub const FORMAT_F32_LE: &str = "f32-le";
/// The Rust proplet's default `FL_FORMAT`: the same bytes as [`FORMAT_F32_LE`].
pub const FORMAT_F32_DELTA: &str = "f32-delta";
/// Joins the raw updates of a concat aggregation (the same separator as upstream).
pub const UPDATE_SEPARATOR: &str = "\n---PROP-UPDATE---\n";
/// `proplet_id` of an aggregated envelope, so it is never mistaken for a member update.
pub const AGGREGATOR_PROPLET_ID: &str = "aggregator";
/// `num_samples` assumed when the sender omits it (upstream's `FL_NUM_SAMPLES` default).
pub const DEFAULT_NUM_SAMPLES: u64 = 1;

/// How many times a JSON string holding JSON is unwrapped before giving up; results stored as
/// strings add one level, a re-stringified store a second. More than that is not a real sender.
const MAX_STRING_NESTING: usize = 4;
/// Longest piece of sender-provided text quoted in an error message, so logs stay small.
const SNIPPET_CHARS: usize = 64;

/// Standard-alphabet base64 that accepts both padded and unpadded input, as senders differ.
const LENIENT_B64: GeneralPurpose = GeneralPurpose::new(
    &alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// One participant's model update, or the aggregate of several (upstream's FL envelope).
///
/// The field order and JSON keys are upstream's, so the collected-updates and aggregated-update
/// annotations stay readable by upstream tooling and the `FL_GLOBAL_*` env keeps its meaning.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct UpdateEnvelope {
    /// Task the update came from; empty (and omitted) for an aggregate.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub task_id: String,
    /// FederatedJob experiment the update belongs to.
    pub job_id: String,
    /// Round number the update was trained for.
    pub round_id: u64,
    /// Version of the global model the participant started from.
    #[serde(default)]
    pub global_version: String,
    /// Proplet that produced the update ([`AGGREGATOR_PROPLET_ID`] for an aggregate).
    pub proplet_id: String,
    /// Number of training samples behind the update; the FedAvg weight.
    pub num_samples: u64,
    /// The update bytes, standard base64.
    pub update_b64: String,
    /// Free-form metrics reported with the update (loss, accuracy, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<Map<String, Value>>,
    /// Encoding of `update_b64`; `None` or empty means [`FORMAT_JSON_F64`].
    #[serde(default, skip_serializing_if = "format_is_absent")]
    pub format: Option<String>,
}

fn format_is_absent(format: &Option<String>) -> bool {
    format.as_deref().is_none_or(|f| f.trim().is_empty())
}

impl UpdateEnvelope {
    /// The format actually meant: the trimmed `format`, or [`FORMAT_JSON_F64`] when unset, as
    /// upstream treats an empty format.
    pub fn effective_format(&self) -> &str {
        match self.format.as_deref().map(str::trim) {
            Some(f) if !f.is_empty() => f,
            _ => FORMAT_JSON_F64,
        }
    }
}

/// What the TrainingRound expects of a participant's update: fills fields the sender omitted
/// and is checked against the fields it did send.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExpectedUpdate {
    /// FederatedJob experiment id (`FL_JOB_ID`); empty accepts whatever the sender says.
    pub job_id: String,
    /// Round number (see [`round_number`]); 0 means the round's id has no number, and then
    /// any sent round is accepted, as upstream does.
    pub round: u64,
    /// Proplet the participant's Task was dispatched to; empty accepts any sender.
    pub proplet_id: String,
    /// Global model version the round handed out; used when the sender omits it.
    pub global_version: String,
}

/// Why a task's results could not be turned into an [`UpdateEnvelope`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    /// The results (or a string inside them) were text that is not JSON.
    #[error("task results are not a JSON update envelope: {0}")]
    NotJson(String),
    /// The results were JSON, but not an object that could hold an envelope.
    #[error("task results are a JSON {found}, not an object holding an update envelope")]
    NotAnObject {
        /// JSON type that was found instead.
        found: &'static str,
    },
    /// A required key is absent (and the round could not supply it).
    #[error("update envelope is missing `{0}`")]
    MissingField(&'static str),
    /// A key is present but its value cannot be used.
    #[error("update envelope `{field}` is invalid: {reason}")]
    InvalidField {
        /// The offending key.
        field: &'static str,
        /// What is wrong with its value.
        reason: String,
    },
    /// The update names a different round, job or proplet than the one it was collected for.
    #[error("update envelope `{field}` is {got:?} but this round expects {expected:?}")]
    Mismatch {
        /// The key that disagrees.
        field: &'static str,
        /// Value the round expects.
        expected: String,
        /// Value the sender put in the envelope.
        got: String,
    },
}

/// Why a set of updates could not be aggregated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AggregationError {
    /// `aggregator.algorithm` names no known algorithm.
    #[error("unknown aggregation algorithm {0:?}; expected `fedavg` or `concat`")]
    UnknownAlgorithm(String),
    /// The update list is empty.
    #[error("no updates to aggregate")]
    NoUpdates,
    /// FedAvg weights are all zero, so there is no mean.
    #[error("cannot aggregate: total num_samples is zero")]
    ZeroTotalSamples,
    /// The sum of `num_samples` does not fit in a `u64`.
    #[error("cannot aggregate: total num_samples overflows u64")]
    SampleOverflow,
    /// FedAvg was asked to average a format it cannot read as numbers.
    #[error(
        "fedavg cannot average updates in format {format:?} (it reads json-f64, f32-le and \
         f32-delta); set `aggregator.algorithm: concat` to join the raw updates instead"
    )]
    UnsupportedFormat {
        /// The format found.
        format: String,
    },
    /// Updates disagree on the format, so their vectors cannot be combined.
    #[error(
        "update from proplet {proplet_id:?} has format {found:?} but the first update has \
         {expected:?}; all updates must share one format"
    )]
    FormatMismatch {
        /// Proplet whose update differs.
        proplet_id: String,
        /// Format of the first update.
        expected: String,
        /// Format of this update.
        found: String,
    },
    /// Updates disagree on the vector length.
    #[error(
        "update from proplet {proplet_id:?} has {found} values but the first update has \
         {expected}; all updates must have one dimension"
    )]
    DimensionMismatch {
        /// Proplet whose update differs.
        proplet_id: String,
        /// Dimension of the first update.
        expected: usize,
        /// Dimension of this update.
        found: usize,
    },
    /// A vector with no values cannot be averaged.
    #[error("update from proplet {proplet_id:?} is an empty vector")]
    EmptyVector {
        /// Proplet that sent it.
        proplet_id: String,
    },
    /// `update_b64` is not base64.
    #[error("update from proplet {proplet_id:?} has invalid update_b64: {reason}")]
    InvalidBase64 {
        /// Proplet that sent it.
        proplet_id: String,
        /// Decoder message.
        reason: String,
    },
    /// A `json-f64` payload is not a JSON array of numbers.
    #[error("update from proplet {proplet_id:?} has an invalid json-f64 payload: {reason}")]
    InvalidJsonPayload {
        /// Proplet that sent it.
        proplet_id: String,
        /// Parser message.
        reason: String,
    },
    /// An `f32` payload is cut in the middle of a value.
    #[error(
        "update from proplet {proplet_id:?} has an f32 payload of {len} bytes, which is not a \
         multiple of 4"
    )]
    InvalidF32Length {
        /// Proplet that sent it.
        proplet_id: String,
        /// Payload length in bytes.
        len: usize,
    },
    /// A value is NaN or infinite, which would poison the mean.
    #[error("update from proplet {proplet_id:?} has a non-finite value at index {index}")]
    NonFinite {
        /// Proplet that sent it.
        proplet_id: String,
        /// Position of the first bad value.
        index: usize,
    },
}

/// How the updates of a round are combined (`FederatedJob.spec.aggregator.algorithm`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Mean of the vectors weighted by `num_samples`; the upstream default when the setting is
    /// empty.
    #[default]
    FedAvg,
    /// The raw updates joined with [`UPDATE_SEPARATOR`], for payloads that are not vectors.
    Concat,
}

impl Algorithm {
    /// Reads `fedavg` or `concat` (case and surrounding spaces ignored). An empty setting is the
    /// caller's to default (see [`Algorithm::default`]), so it is an error here.
    pub fn parse(name: &str) -> Result<Self, AggregationError> {
        let trimmed = name.trim();
        if trimmed.eq_ignore_ascii_case("fedavg") {
            Ok(Self::FedAvg)
        } else if trimmed.eq_ignore_ascii_case("concat") {
            Ok(Self::Concat)
        } else {
            Err(AggregationError::UnknownAlgorithm(snippet(name)))
        }
    }

    /// The canonical name, as written in the aggregate's `metrics.algorithm`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::FedAvg => "fedavg",
            Self::Concat => "concat",
        }
    }
}

impl FromStr for Algorithm {
    type Err = AggregationError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

// ---------------------------------------------------------------------------------------------
// Aggregation
// ---------------------------------------------------------------------------------------------

/// Combines a round's updates with `algorithm` into one envelope.
///
/// The result takes `job_id`, `round_id` and `global_version` from the first update, has
/// `proplet_id` [`AGGREGATOR_PROPLET_ID`], `num_samples` = the total, no `task_id`, and metrics
/// `{"algorithm", "num_clients", "total_samples"}`. FedAvg output is in the inputs' format;
/// concat output keeps the first update's format.
pub fn aggregate(
    updates: &[UpdateEnvelope],
    algorithm: Algorithm,
) -> Result<UpdateEnvelope, AggregationError> {
    let first = updates.first().ok_or(AggregationError::NoUpdates)?;
    match algorithm {
        Algorithm::FedAvg => fedavg(first, updates),
        Algorithm::Concat => concat(first, updates),
    }
}

fn total_samples(updates: &[UpdateEnvelope]) -> Result<u64, AggregationError> {
    updates.iter().try_fold(0_u64, |sum, u| {
        sum.checked_add(u.num_samples)
            .ok_or(AggregationError::SampleOverflow)
    })
}

fn fedavg(
    first: &UpdateEnvelope,
    updates: &[UpdateEnvelope],
) -> Result<UpdateEnvelope, AggregationError> {
    let format = first.effective_format();
    let kind =
        VectorFormat::from_name(format).ok_or_else(|| AggregationError::UnsupportedFormat {
            format: snippet(format),
        })?;
    if let Some(odd) = updates
        .iter()
        .find(|u| !u.effective_format().eq_ignore_ascii_case(format))
    {
        return Err(AggregationError::FormatMismatch {
            proplet_id: odd.proplet_id.clone(),
            expected: snippet(format),
            found: snippet(odd.effective_format()),
        });
    }
    let total = total_samples(updates)?;
    if total == 0 {
        return Err(AggregationError::ZeroTotalSamples);
    }

    // Decode and check in input order, so "the first update" in errors means what it says.
    let mut vectors = Vec::with_capacity(updates.len());
    let mut dimension = None;
    for update in updates {
        let values = decode_vector(update)?;
        let expected = *dimension.get_or_insert(values.len());
        if values.len() != expected {
            return Err(AggregationError::DimensionMismatch {
                proplet_id: update.proplet_id.clone(),
                expected,
                found: values.len(),
            });
        }
        vectors.push((update, values));
    }

    // Sum in a canonical order: floating-point addition is not associative, and the caller's
    // order may come from a map or from arrival times.
    vectors.sort_by(|(a, va), (b, vb)| canonical_order(a, va, b, vb));
    let mut sum = Vec::new();
    let mut low = Vec::new();
    let mut high = Vec::new();
    let total_f = total as f64;
    for (update, values) in &vectors {
        if sum.is_empty() {
            sum = vec![0.0_f64; values.len()];
            low.clone_from(values);
            high.clone_from(values);
        }
        let weight = update.num_samples as f64 / total_f;
        for (((acc, lo), hi), v) in sum
            .iter_mut()
            .zip(low.iter_mut())
            .zip(high.iter_mut())
            .zip(values)
        {
            *acc += weight * v;
            *lo = lo.min(*v);
            *hi = hi.max(*v);
        }
    }
    // A weighted mean lies within the inputs' range; clamping removes rounding drift (so equal
    // inputs give exactly that input) and keeps the result finite.
    let mean: Vec<f64> = sum
        .iter()
        .zip(low.iter().zip(&high))
        .map(|(acc, (lo, hi))| acc.clamp(*lo, *hi))
        .collect();

    let update_b64 = match kind {
        VectorFormat::JsonF64 => encode_json_f64(&mean),
        VectorFormat::F32Le => {
            let narrowed: Vec<f32> = mean.iter().map(|v| *v as f32).collect();
            encode_f32_le(&narrowed)
        }
    };
    Ok(aggregate_envelope(
        first,
        Algorithm::FedAvg,
        updates.len(),
        total,
        update_b64,
        Some(format.to_owned()),
    ))
}

/// Total order on decoded updates used for summation; ties are identical updates.
fn canonical_order(a: &UpdateEnvelope, va: &[f64], b: &UpdateEnvelope, vb: &[f64]) -> Ordering {
    a.proplet_id
        .cmp(&b.proplet_id)
        .then(a.num_samples.cmp(&b.num_samples))
        .then_with(|| {
            va.iter()
                .zip(vb)
                .map(|(x, y)| x.total_cmp(y))
                .find(|o| o.is_ne())
                .unwrap_or(Ordering::Equal)
        })
}

fn concat(
    first: &UpdateEnvelope,
    updates: &[UpdateEnvelope],
) -> Result<UpdateEnvelope, AggregationError> {
    let total = total_samples(updates)?;
    let mut joined = Vec::new();
    for (i, update) in updates.iter().enumerate() {
        if i > 0 {
            joined.extend_from_slice(UPDATE_SEPARATOR.as_bytes());
        }
        joined.extend(decode_bytes(update)?);
    }
    Ok(aggregate_envelope(
        first,
        Algorithm::Concat,
        updates.len(),
        total,
        STANDARD.encode(joined),
        first.format.clone(),
    ))
}

fn aggregate_envelope(
    first: &UpdateEnvelope,
    algorithm: Algorithm,
    clients: usize,
    total: u64,
    update_b64: String,
    format: Option<String>,
) -> UpdateEnvelope {
    let mut metrics = Map::new();
    metrics.insert("algorithm".to_owned(), Value::from(algorithm.as_str()));
    metrics.insert("num_clients".to_owned(), Value::from(clients));
    metrics.insert("total_samples".to_owned(), Value::from(total));
    UpdateEnvelope {
        task_id: String::new(),
        job_id: first.job_id.clone(),
        round_id: first.round_id,
        global_version: first.global_version.clone(),
        proplet_id: AGGREGATOR_PROPLET_ID.to_owned(),
        num_samples: total,
        update_b64,
        metrics: Some(metrics),
        format,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn b64(text: &str) -> String {
        STANDARD.encode(text)
    }

    fn decoded_text(env: &UpdateEnvelope) -> String {
        let bytes = STANDARD
            .decode(&env.update_b64)
            .expect("aggregate emits valid base64");
        String::from_utf8(bytes).expect("test payloads are UTF-8")
    }

    fn update(proplet: &str, samples: u64, update_b64: String, format: &str) -> UpdateEnvelope {
        UpdateEnvelope {
            task_id: format!("task-{proplet}"),
            job_id: "exp1".to_owned(),
            round_id: 1,
            global_version: "v0".to_owned(),
            proplet_id: proplet.to_owned(),
            num_samples: samples,
            update_b64,
            metrics: None,
            format: Some(format.to_owned()),
        }
    }

    fn json_update(proplet: &str, samples: u64, values: &[f64]) -> UpdateEnvelope {
        update(proplet, samples, encode_json_f64(values), FORMAT_JSON_F64)
    }

    fn f32_update(proplet: &str, samples: u64, values: &[f32], format: &str) -> UpdateEnvelope {
        update(proplet, samples, encode_f32_le(values), format)
    }

    fn expected() -> ExpectedUpdate {
        ExpectedUpdate {
            job_id: "exp1".to_owned(),
            round: 1,
            proplet_id: "edge-1".to_owned(),
            global_version: "v0".to_owned(),
        }
    }

    /// The object the Rust proplet sends as `results` for an FL task (upstream's proplet).
    fn rust_proplet_results(round_id: Value) -> Value {
        json!({
            "task_id": "t-1",
            "round_id": round_id,
            "proplet_id": "edge-1",
            "num_samples": 1,
            "update_b64": encode_f32_le(&[0.5, -1.0]),
            "format": "f32-delta",
            "metrics": {}
        })
    }

    fn extract_err(results: Value) -> EnvelopeError {
        extract_update(&results, &expected()).expect_err("extraction should fail")
    }

    fn agg_err(updates: &[UpdateEnvelope], algorithm: Algorithm) -> AggregationError {
        aggregate(updates, algorithm).expect_err("aggregation should fail")
    }

    // --- envelope wire form ----------------------------------------------------------------

    #[test]
    fn envelope_serialises_in_upstream_key_order() {
        let mut metrics = Map::new();
        metrics.insert("loss".to_owned(), json!(0.31));
        let env = UpdateEnvelope {
            task_id: String::new(),
            job_id: "exp1".to_owned(),
            round_id: 1,
            global_version: "v0".to_owned(),
            proplet_id: "edge-1".to_owned(),
            num_samples: 100,
            update_b64: "WzAuMSwwLjJd".to_owned(),
            metrics: Some(metrics),
            format: Some("json-f64".to_owned()),
        };
        let text = serde_json::to_string(&env).expect("serialises");
        assert_eq!(
            text,
            r#"{"job_id":"exp1","round_id":1,"global_version":"v0","proplet_id":"edge-1","num_samples":100,"update_b64":"WzAuMSwwLjJd","metrics":{"loss":0.31},"format":"json-f64"}"#
        );
        let back: UpdateEnvelope = serde_json::from_str(&text).expect("parses back");
        assert_eq!(back, env);
    }

    #[test]
    fn envelope_omits_task_id_metrics_and_empty_format() {
        let mut env = json_update("a", 1, &[1.0]);
        env.task_id = "t-9".to_owned();
        let with_task = serde_json::to_value(&env).expect("serialises");
        assert_eq!(with_task["task_id"], json!("t-9"));

        env.task_id.clear();
        env.format = Some("  ".to_owned());
        let value = serde_json::to_value(&env).expect("serialises");
        let keys: Vec<&str> = value
            .as_object()
            .expect("object")
            .keys()
            .map(String::as_str)
            .collect();
        assert!(!keys.contains(&"task_id"), "{keys:?}");
        assert!(!keys.contains(&"metrics"), "{keys:?}");
        assert!(!keys.contains(&"format"), "{keys:?}");
        env.format = None;
        assert_eq!(serde_json::to_value(&env).expect("serialises"), value);
        assert_eq!(env.effective_format(), "json-f64");
    }

    // --- extraction --------------------------------------------------------------------------

    #[test]
    fn extracts_rust_proplet_object_and_fills_job_id() {
        let env = extract_update(&rust_proplet_results(json!("round-1")), &expected())
            .expect("Rust proplet form is accepted");
        assert_eq!(env.task_id, "t-1");
        assert_eq!(env.job_id, "exp1", "job_id comes from the round");
        assert_eq!(env.round_id, 1);
        assert_eq!(
            env.global_version, "v0",
            "global_version comes from the round"
        );
        assert_eq!(env.proplet_id, "edge-1");
        assert_eq!(env.num_samples, 1);
        assert_eq!(env.format.as_deref(), Some("f32-delta"));
        assert_eq!(env.metrics, Some(Map::new()));
        assert_eq!(decode_vector(&env).expect("decodes"), vec![0.5, -1.0]);
    }

    #[test]
    fn accepts_every_round_id_spelling() {
        for round in [
            json!(1),
            json!(1.0),
            json!("1"),
            json!(" 1 "),
            json!("round-1"),
            json!("Round-1"),
            json!("round_1"),
            json!("r1"),
            json!("R-1"),
        ] {
            let env = extract_update(&rust_proplet_results(round.clone()), &expected())
                .unwrap_or_else(|e| panic!("{round} rejected: {e}"));
            assert_eq!(env.round_id, 1, "{round}");
        }
    }

    #[test]
    fn extracts_nested_update_envelope() {
        let inner = rust_proplet_results(json!(1));
        let env = extract_update(&json!({ "update_envelope": inner }), &expected())
            .expect("update_envelope form");
        assert_eq!(env.proplet_id, "edge-1");
        assert_eq!(env.round_id, 1);

        let env = extract_update(
            &json!({ "results": { "update_envelope": rust_proplet_results(json!("r1")) } }),
            &expected(),
        )
        .expect("results.update_envelope form");
        assert_eq!(env.task_id, "t-1");
        assert_eq!(env.format.as_deref(), Some("f32-delta"));
    }

    #[test]
    fn extracts_from_whole_result_message() {
        let message = json!({
            "task_id": "t-1",
            "results": rust_proplet_results(json!("round-1")),
            "error": null
        });
        let env = extract_update(&message, &expected()).expect("result message form");
        assert_eq!(env.proplet_id, "edge-1");
        assert_eq!(decode_vector(&env).expect("decodes"), vec![0.5, -1.0]);
    }

    #[test]
    fn extracts_from_json_strings() {
        let object = rust_proplet_results(json!("round-1"));
        let once = Value::String(object.to_string());
        let env = extract_update(&once, &expected()).expect("string holding an object");
        assert_eq!(env.round_id, 1);
        assert_eq!(env.job_id, "exp1");

        let twice = Value::String(once.to_string());
        let env2 = extract_update(&twice, &expected()).expect("string holding a string");
        assert_eq!(env2, env);

        let wrapped = json!({ "update_envelope": object.to_string() });
        let env3 = extract_update(&wrapped, &expected()).expect("update_envelope as a string");
        assert_eq!(env3, env);

        let message = json!({ "task_id": "t-1", "results": format!("\n{object}\n") });
        let env4 = extract_update(&message, &expected()).expect("results as a string");
        assert_eq!(env4, env);
    }

    #[test]
    fn upstream_member_envelope_round_trips() {
        let mut metrics = Map::new();
        metrics.insert("loss".to_owned(), json!(0.31));
        let member = UpdateEnvelope {
            metrics: Some(metrics),
            ..json_update("edge-1", 100, &[0.1, 0.2])
        };
        let text = serde_json::to_string(&member).expect("serialises");
        let env = extract_update(&Value::String(text), &expected()).expect("extracts");
        assert_eq!(env, member);
    }

    #[test]
    fn defaults_num_samples_and_format() {
        let results = json!({ "round_id": 1, "proplet_id": "edge-1", "update_b64": b64("[1]") });
        let env = extract_update(&results, &expected()).expect("minimal envelope");
        assert_eq!(env.num_samples, DEFAULT_NUM_SAMPLES);
        assert_eq!(env.format.as_deref(), Some("json-f64"));
        assert_eq!(env.task_id, "");
        assert_eq!(env.metrics, None);
    }

    #[test]
    fn fills_round_and_proplet_when_omitted_and_keeps_sent_values() {
        let results = json!({
            "update_b64": b64("[1]"),
            "global_version": "v3",
            "num_samples": "250",
            "job_id": "exp1"
        });
        let env = extract_update(&results, &expected()).expect("fills");
        assert_eq!(env.round_id, 1);
        assert_eq!(env.proplet_id, "edge-1");
        assert_eq!(env.global_version, "v3", "a sent version is kept");
        assert_eq!(env.num_samples, 250);
    }

    #[test]
    fn accepts_unpadded_and_wrapped_base64() {
        let results = json!({ "update_b64": "WzEs\nMl0", "num_samples": 4.0 });
        let env = extract_update(&results, &expected()).expect("lenient base64");
        assert_eq!(env.update_b64, "WzEsMl0");
        assert_eq!(env.num_samples, 4);
        assert_eq!(decode_vector(&env).expect("decodes"), vec![1.0, 2.0]);
    }

    #[test]
    fn round_zero_expectation_accepts_any_round() {
        let any_round = ExpectedUpdate {
            round: 0,
            ..expected()
        };
        let env = extract_update(&rust_proplet_results(json!("round-9")), &any_round)
            .expect("unnumbered round accepts");
        assert_eq!(env.round_id, 9);
    }

    #[test]
    fn rejects_round_mismatch_naming_both_values() {
        let err = extract_err(rust_proplet_results(json!("round-2")));
        assert_eq!(
            err,
            EnvelopeError::Mismatch {
                field: "round_id",
                expected: "1".to_owned(),
                got: "2".to_owned()
            }
        );
        assert_eq!(
            err.to_string(),
            r#"update envelope `round_id` is "2" but this round expects "1""#
        );
    }

    #[test]
    fn rejects_proplet_and_job_mismatch() {
        let mut results = rust_proplet_results(json!(1));
        results["proplet_id"] = json!("intruder");
        let err = extract_err(results.clone());
        assert_eq!(
            err.to_string(),
            r#"update envelope `proplet_id` is "intruder" but this round expects "edge-1""#
        );

        results["proplet_id"] = json!("edge-1");
        results["job_id"] = json!("other-exp");
        let err = extract_err(results);
        assert_eq!(
            err,
            EnvelopeError::Mismatch {
                field: "job_id",
                expected: "exp1".to_owned(),
                got: "other-exp".to_owned()
            }
        );
    }

    #[test]
    fn sent_identities_are_used_when_round_has_none() {
        let open = ExpectedUpdate::default();
        let mut results = rust_proplet_results(json!(4));
        results["job_id"] = json!("exp9");
        let env = extract_update(&results, &open).expect("open expectation");
        assert_eq!((env.job_id.as_str(), env.round_id), ("exp9", 4));
        assert_eq!(env.global_version, "");

        let no_job = rust_proplet_results(json!(4));
        assert_eq!(
            extract_update(&no_job, &open),
            Err(EnvelopeError::MissingField("job_id"))
        );
        let mut no_proplet = json!({ "job_id": "exp9", "update_b64": b64("[1]") });
        assert_eq!(
            extract_update(&no_proplet, &open),
            Err(EnvelopeError::MissingField("proplet_id"))
        );
        no_proplet["proplet_id"] = json!("   ");
        assert_eq!(
            extract_update(&no_proplet, &open),
            Err(EnvelopeError::MissingField("proplet_id"))
        );
    }

    #[test]
    fn missing_update_b64_names_the_key() {
        let mut results = rust_proplet_results(json!(1));
        results
            .as_object_mut()
            .expect("object")
            .remove("update_b64");
        let err = extract_err(results);
        assert_eq!(err, EnvelopeError::MissingField("update_b64"));
        assert_eq!(err.to_string(), "update envelope is missing `update_b64`");

        // A normal (non-FL) result has no envelope at all.
        let err = extract_err(json!({ "task_id": "t", "results": "42", "error": null }));
        assert_eq!(err, EnvelopeError::MissingField("update_b64"));
    }

    #[test]
    fn rejects_bad_field_values() {
        let cases = [
            ("round_id", json!("abc"), "\"abc\" is not a round number"),
            ("round_id", json!(-1), "-1 is not a round number"),
            ("round_id", json!(1.5), "1.5 is not a round number"),
            ("round_id", json!(true), "boolean is not a round number"),
            (
                "num_samples",
                json!(-3),
                "-3 is not a non-negative whole number",
            ),
            (
                "num_samples",
                json!("many"),
                "\"many\" is not a non-negative",
            ),
            ("update_b64", json!("***"), "not base64"),
            ("update_b64", json!(12), "expected a string, got a number"),
            (
                "proplet_id",
                json!(["edge-1"]),
                "expected a string, got a array",
            ),
            ("metrics", json!([1]), "expected an object, got a array"),
        ];
        for (field, value, needle) in cases {
            let mut results = rust_proplet_results(json!(1));
            results[field] = value.clone();
            let err = extract_err(results);
            match &err {
                EnvelopeError::InvalidField { field: f, reason } => {
                    assert_eq!(*f, field, "{value}");
                    assert!(reason.contains(needle), "{field}={value}: {reason}");
                }
                other => panic!("{field}={value}: unexpected {other:?}"),
            }
            assert!(err.to_string().contains(&format!("`{field}` is invalid")));
        }
    }

    #[test]
    fn rejects_non_objects_and_non_json() {
        assert_eq!(
            extract_err(json!([1, 2])),
            EnvelopeError::NotAnObject { found: "array" }
        );
        assert_eq!(
            extract_err(Value::Null),
            EnvelopeError::NotAnObject { found: "null" }
        );
        assert_eq!(
            extract_err(json!("42")),
            EnvelopeError::NotAnObject { found: "number" }
        );
        assert_eq!(
            extract_err(json!("")),
            EnvelopeError::NotJson("the text is empty".to_owned())
        );
        let err = extract_err(json!("not json at all"));
        assert!(matches!(err, EnvelopeError::NotJson(_)), "{err:?}");
        assert!(err
            .to_string()
            .starts_with("task results are not a JSON update envelope"));
        assert_eq!(
            extract_err(json!({ "update_envelope": 5 })),
            EnvelopeError::NotAnObject { found: "number" }
        );
    }

    #[test]
    fn gives_up_on_absurd_string_nesting() {
        let mut value = rust_proplet_results(json!(1));
        for _ in 0..=MAX_STRING_NESTING + 1 {
            value = Value::String(value.to_string());
        }
        let err = extract_err(value);
        assert!(err.to_string().contains("nested more than"), "{err}");
    }

    #[test]
    fn long_values_are_shortened_in_errors() {
        let mut results = rust_proplet_results(json!(1));
        results["proplet_id"] = json!("x".repeat(500));
        let message = extract_err(results).to_string();
        assert!(message.len() < 200, "{message}");
        assert!(message.contains('…'));
    }

    // --- FedAvg --------------------------------------------------------------------------------

    // Worked example (the numbers used by the two tests below):
    //   proplet A: [1.0, 2.0], 100 samples   proplet B: [3.0, 6.0], 300 samples
    //   total = 400, weights: A = 100/400 = 0.25, B = 300/400 = 0.75
    //   x0 = 0.25·1.0 + 0.75·3.0 = 0.25 + 2.25 = 2.5
    //   x1 = 0.25·2.0 + 0.75·6.0 = 0.50 + 4.50 = 5.0
    //   → [2.5, 5.0], num_samples 400, metrics {fedavg, 2 clients, 400 samples}.
    // Every intermediate is exact in binary floating point, so the checks are exact.

    #[test]
    fn fedavg_json_f64_worked_example() {
        let a = json_update("A", 100, &[1.0, 2.0]);
        let b = json_update("B", 300, &[3.0, 6.0]);
        let out = aggregate(&[a, b], Algorithm::FedAvg).expect("aggregates");
        assert_eq!(decoded_text(&out), "[2.5,5.0]");
        assert_eq!(decode_vector(&out).expect("decodes"), vec![2.5, 5.0]);
        assert_eq!(out.num_samples, 400);
        assert_eq!(out.proplet_id, "aggregator");
        assert_eq!(out.task_id, "");
        assert_eq!((out.job_id.as_str(), out.round_id), ("exp1", 1));
        assert_eq!(out.global_version, "v0");
        assert_eq!(out.format.as_deref(), Some("json-f64"));
        assert_eq!(
            Value::Object(out.metrics.clone().expect("metrics")),
            json!({ "algorithm": "fedavg", "num_clients": 2, "total_samples": 400 })
        );
        let wire = serde_json::to_value(&out).expect("serialises");
        assert!(wire.get("task_id").is_none());
    }

    #[test]
    fn fedavg_f32_le_worked_example() {
        let a = f32_update("A", 100, &[1.0, 2.0], FORMAT_F32_LE);
        let b = f32_update("B", 300, &[3.0, 6.0], FORMAT_F32_LE);
        let out = aggregate(&[a, b], Algorithm::FedAvg).expect("aggregates");
        let bytes = STANDARD.decode(&out.update_b64).expect("base64");
        let want: Vec<u8> = [2.5_f32, 5.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(bytes, want);
        assert_eq!(bytes, vec![0, 0, 0x20, 0x40, 0, 0, 0xa0, 0x40]);
        assert_eq!(out.format.as_deref(), Some("f32-le"));
        assert_eq!(out.num_samples, 400);
    }

    #[test]
    fn fedavg_keeps_rust_proplet_f32_delta_format() {
        let a = f32_update("A", 1, &[0.0, -4.0, 8.0], FORMAT_F32_DELTA);
        let b = f32_update("B", 1, &[2.0, 4.0, 8.0], FORMAT_F32_DELTA);
        let out = aggregate(&[a, b], Algorithm::FedAvg).expect("aggregates");
        assert_eq!(out.format.as_deref(), Some("f32-delta"));
        assert_eq!(decode_vector(&out).expect("decodes"), vec![1.0, 0.0, 8.0]);
    }

    #[test]
    fn fedavg_reads_integers_and_unset_format_as_json_f64() {
        let mut a = update("A", 1, b64("[1, 3]"), "");
        a.format = None;
        let b = update("B", 3, b64(" [5,7] "), "JSON-F64");
        let out = aggregate(&[a, b], Algorithm::FedAvg).expect("aggregates");
        // (1·1 + 5·3)/4 = 4, (3·1 + 7·3)/4 = 6
        assert_eq!(decode_vector(&out).expect("decodes"), vec![4.0, 6.0]);
        assert_eq!(out.format.as_deref(), Some("json-f64"));
    }

    #[test]
    fn fedavg_ignores_zero_weight_updates_but_still_checks_them() {
        let a = json_update("A", 2, &[10.0]);
        let b = json_update("B", 0, &[-50.0]);
        let out = aggregate(&[a.clone(), b], Algorithm::FedAvg).expect("aggregates");
        assert_eq!(decode_vector(&out).expect("decodes"), vec![10.0]);

        let broken = update("B", 0, b64("[1,"), FORMAT_JSON_F64);
        assert!(matches!(
            agg_err(&[a, broken], Algorithm::FedAvg),
            AggregationError::InvalidJsonPayload { .. }
        ));
    }

    #[test]
    fn fedavg_result_is_independent_of_input_order() {
        let ups = [
            json_update("A", 3, &[0.1, 1e16]),
            json_update("B", 7, &[0.2, 1.0]),
            json_update("C", 11, &[0.3, -1e16]),
        ];
        let reference = aggregate(&ups, Algorithm::FedAvg).expect("aggregates");
        for order in [[0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]] {
            let permuted: Vec<UpdateEnvelope> = order.iter().map(|i| ups[*i].clone()).collect();
            let out = aggregate(&permuted, Algorithm::FedAvg).expect("aggregates");
            assert_eq!(out.update_b64, reference.update_b64, "order {order:?}");
        }
    }

    #[test]
    fn fedavg_errors_name_the_problem() {
        assert_eq!(agg_err(&[], Algorithm::FedAvg), AggregationError::NoUpdates);
        assert_eq!(
            AggregationError::NoUpdates.to_string(),
            "no updates to aggregate"
        );

        let zero = [json_update("A", 0, &[1.0]), json_update("B", 0, &[2.0])];
        let err = agg_err(&zero, Algorithm::FedAvg);
        assert_eq!(err, AggregationError::ZeroTotalSamples);
        assert_eq!(
            err.to_string(),
            "cannot aggregate: total num_samples is zero"
        );

        let huge = [
            json_update("A", u64::MAX, &[1.0]),
            json_update("B", 1, &[2.0]),
        ];
        assert_eq!(
            agg_err(&huge, Algorithm::FedAvg),
            AggregationError::SampleOverflow
        );

        let raw = [update("A", 1, b64("weights"), "onnx")];
        let err = agg_err(&raw, Algorithm::FedAvg);
        assert_eq!(
            err,
            AggregationError::UnsupportedFormat {
                format: "onnx".to_owned()
            }
        );
        assert!(
            err.to_string().contains("`aggregator.algorithm: concat`"),
            "{err}"
        );

        let mixed = [
            json_update("A", 1, &[1.0]),
            f32_update("B", 1, &[1.0], FORMAT_F32_LE),
        ];
        let err = agg_err(&mixed, Algorithm::FedAvg);
        assert_eq!(
            err.to_string(),
            "update from proplet \"B\" has format \"f32-le\" but the first update has \
             \"json-f64\"; all updates must share one format"
        );
        let le_and_delta = [
            f32_update("A", 1, &[1.0], FORMAT_F32_DELTA),
            f32_update("B", 1, &[1.0], FORMAT_F32_LE),
        ];
        assert!(matches!(
            agg_err(&le_and_delta, Algorithm::FedAvg),
            AggregationError::FormatMismatch { .. }
        ));

        let dims = [
            json_update("A", 1, &[1.0, 2.0]),
            json_update("B", 1, &[1.0, 2.0]),
            json_update("C", 1, &[1.0, 2.0, 3.0]),
        ];
        let err = agg_err(&dims, Algorithm::FedAvg);
        assert_eq!(
            err,
            AggregationError::DimensionMismatch {
                proplet_id: "C".to_owned(),
                expected: 2,
                found: 3
            }
        );
        assert!(err.to_string().contains("\"C\" has 3 values"), "{err}");
        assert!(err.to_string().contains("first update has 2"), "{err}");
    }

    #[test]
    fn payload_errors_name_the_proplet() {
        let err = agg_err(&[json_update("A", 1, &[])], Algorithm::FedAvg);
        assert_eq!(
            err.to_string(),
            "update from proplet \"A\" is an empty vector"
        );
        let err = agg_err(&[f32_update("A", 1, &[], FORMAT_F32_LE)], Algorithm::FedAvg);
        assert_eq!(
            err,
            AggregationError::EmptyVector {
                proplet_id: "A".to_owned()
            }
        );

        let bad = update("edge-7", 1, "%%%".to_owned(), FORMAT_JSON_F64);
        let err = agg_err(&[json_update("A", 1, &[1.0]), bad], Algorithm::FedAvg);
        assert!(
            err.to_string()
                .starts_with("update from proplet \"edge-7\" has invalid update_b64"),
            "{err}"
        );

        for text in ["not json", "{\"a\":1}", "[1,null]", "[\"1\"]", ""] {
            let err = agg_err(
                &[update("A", 1, b64(text), FORMAT_JSON_F64)],
                Algorithm::FedAvg,
            );
            assert!(
                err.to_string()
                    .starts_with("update from proplet \"A\" has an invalid json-f64 payload"),
                "{text:?}: {err}"
            );
        }

        let five = update("A", 1, STANDARD.encode([0_u8; 5]), FORMAT_F32_LE);
        let err = agg_err(&[five], Algorithm::FedAvg);
        assert_eq!(
            err.to_string(),
            "update from proplet \"A\" has an f32 payload of 5 bytes, which is not a multiple of 4"
        );

        let nan = f32_update("A", 1, &[1.0, f32::NAN], FORMAT_F32_LE);
        let err = agg_err(&[nan], Algorithm::FedAvg);
        assert_eq!(
            err.to_string(),
            "update from proplet \"A\" has a non-finite value at index 1"
        );
        let inf = f32_update("A", 1, &[f32::NEG_INFINITY], FORMAT_F32_DELTA);
        assert_eq!(
            agg_err(&[inf], Algorithm::FedAvg),
            AggregationError::NonFinite {
                proplet_id: "A".to_owned(),
                index: 0
            }
        );
    }

    #[test]
    fn json_encoder_writes_nan_as_null_which_decoding_rejects() {
        let encoded = encode_json_f64(&[1.5, f64::NAN]);
        assert_eq!(STANDARD.decode(&encoded).expect("base64"), b"[1.5,null]");
        let env = update("A", 1, encoded, FORMAT_JSON_F64);
        assert!(matches!(
            decode_vector(&env),
            Err(AggregationError::InvalidJsonPayload { .. })
        ));
        assert_eq!(
            decode_vector(&update("A", 1, b64("x"), "cbor")),
            Err(AggregationError::UnsupportedFormat {
                format: "cbor".to_owned()
            })
        );
    }

    #[test]
    fn json_f64_round_trips_bit_exactly() {
        let values = [
            404_658_861.579_171_96,
            0.1,
            -0.0,
            1e-300,
            5e-324,
            f64::MAX,
            -123_456_789.123_456_78,
        ];
        let env = update("A", 1, encode_json_f64(&values), FORMAT_JSON_F64);
        let back = decode_vector(&env).expect("decodes");
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back), bits(&values));
    }

    #[test]
    fn json_f64_payload_grammar_is_strict() {
        let ok = |text: &str| decode_vector(&update("A", 1, b64(text), FORMAT_JSON_F64));
        assert_eq!(
            ok("\n[ 0, -1.5e2 ,2E-1,3e+0 ]\t"),
            Ok(vec![0.0, -150.0, 0.2, 3.0])
        );
        for bad in [
            "[1,]", "[01]", "[.5]", "[1.]", "[+1]", "[NaN]", "[1 2]", "[1e]", "[[1]]", "1",
        ] {
            let err = ok(bad).expect_err(bad);
            assert!(
                matches!(err, AggregationError::InvalidJsonPayload { .. }),
                "{bad}: {err:?}"
            );
        }
        let err = ok("[1, 2").expect_err("unterminated");
        assert_eq!(
            err.to_string(),
            "update from proplet \"A\" has an invalid json-f64 payload: expected a JSON array of numbers"
        );
        let err = ok("[1, true]").expect_err("boolean");
        assert!(
            err.to_string()
                .ends_with("element 1 is not a number: \"true\""),
            "{err}"
        );
        assert_eq!(
            ok("[1, 1e400]"),
            Err(AggregationError::NonFinite {
                proplet_id: "A".to_owned(),
                index: 1
            })
        );
    }

    #[test]
    fn blank_update_b64_counts_as_missing() {
        let mut results = rust_proplet_results(json!(1));
        results["update_b64"] = json!("  ");
        assert_eq!(
            extract_err(results),
            EnvelopeError::MissingField("update_b64")
        );
    }

    // --- Concat and algorithm choice ---------------------------------------------------------

    #[test]
    fn concat_joins_in_input_order_with_separator() {
        let ups = [
            update("B", 0, b64("second-first"), "onnx"),
            update("A", 0, b64("then-A"), "pt"),
            update("C", 5, b64(""), "onnx"),
        ];
        let out = aggregate(&ups, Algorithm::Concat).expect("zero samples are fine for concat");
        assert_eq!(
            decoded_text(&out),
            "second-first\n---PROP-UPDATE---\nthen-A\n---PROP-UPDATE---\n"
        );
        assert_eq!(out.num_samples, 5);
        assert_eq!(
            out.format.as_deref(),
            Some("onnx"),
            "format of the first update"
        );
        assert_eq!(out.proplet_id, "aggregator");
        assert_eq!(
            Value::Object(out.metrics.expect("metrics")),
            json!({ "algorithm": "concat", "num_clients": 3, "total_samples": 5 })
        );
    }

    #[test]
    fn concat_of_vectors_keeps_bytes_and_unset_format() {
        let mut a = json_update("A", 1, &[1.0]);
        a.format = None;
        let out = aggregate(&[a], Algorithm::Concat).expect("aggregates");
        assert_eq!(decoded_text(&out), "[1.0]");
        assert_eq!(out.format, None);
    }

    #[test]
    fn concat_errors() {
        assert_eq!(agg_err(&[], Algorithm::Concat), AggregationError::NoUpdates);
        let bad = [
            update("A", 1, b64("x"), "raw"),
            update("Z", 1, "!".to_owned(), "raw"),
        ];
        let err = agg_err(&bad, Algorithm::Concat);
        assert!(
            matches!(&err, AggregationError::InvalidBase64 { proplet_id, .. } if proplet_id == "Z"),
            "{err:?}"
        );
        let overflow = [
            update("A", u64::MAX, b64("x"), "raw"),
            update("B", 1, b64("y"), "raw"),
        ];
        assert_eq!(
            agg_err(&overflow, Algorithm::Concat),
            AggregationError::SampleOverflow
        );
    }

    #[test]
    fn algorithm_parsing() {
        assert_eq!(Algorithm::parse("fedavg"), Ok(Algorithm::FedAvg));
        assert_eq!(Algorithm::parse(" FedAvg "), Ok(Algorithm::FedAvg));
        assert_eq!(Algorithm::parse("CONCAT"), Ok(Algorithm::Concat));
        assert_eq!("concat".parse::<Algorithm>(), Ok(Algorithm::Concat));
        assert_eq!(Algorithm::default(), Algorithm::FedAvg);
        assert_eq!(Algorithm::Concat.to_string(), "concat");
        let err = Algorithm::parse("fedprox").expect_err("unknown");
        assert_eq!(
            err.to_string(),
            "unknown aggregation algorithm \"fedprox\"; expected `fedavg` or `concat`"
        );
        assert!(Algorithm::parse("").is_err());
    }

    // --- properties ----------------------------------------------------------------------------

    /// 1..6 updates of one dimension (1..12) with values in ±1e6 and 1..1000 samples each.
    fn same_dim_updates() -> impl Strategy<Value = Vec<(Vec<f64>, u64)>> {
        (1_usize..12).prop_flat_map(|dim| {
            prop::collection::vec(
                (prop::collection::vec(-1.0e6_f64..1.0e6, dim), 1_u64..1000),
                1..6,
            )
        })
    }

    fn to_json_updates(raw: &[(Vec<f64>, u64)]) -> Vec<UpdateEnvelope> {
        raw.iter()
            .enumerate()
            .map(|(i, (values, n))| json_update(&format!("p{i}"), *n, values))
            .collect()
    }

    fn arb_key() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("update_envelope".to_owned()),
            Just("results".to_owned()),
            Just("update_b64".to_owned()),
            Just("round_id".to_owned()),
            Just("proplet_id".to_owned()),
            Just("job_id".to_owned()),
            Just("num_samples".to_owned()),
            Just("metrics".to_owned()),
            Just("format".to_owned()),
            "[a-z_]{0,6}",
        ]
    }

    /// Arbitrary JSON biased towards envelope-like shapes, including stringified nesting.
    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            ".{0,12}".prop_map(Value::String),
            Just(json!("round-1")),
            Just(json!("edge-1")),
            Just(json!("AACAPw==")),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::vec((arb_key(), inner.clone()), 0..6)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
                inner.prop_map(|v| Value::String(v.to_string())),
            ]
        })
    }

    proptest! {
        #[test]
        fn fedavg_of_identical_vectors_is_that_vector(
            values in prop::collection::vec(-1.0e9_f64..1.0e9, 1..16),
            samples in prop::collection::vec(1_u64..10_000, 1..8),
        ) {
            let ups: Vec<UpdateEnvelope> = samples
                .iter()
                .enumerate()
                .map(|(i, n)| json_update(&format!("p{i}"), *n, &values))
                .collect();
            let out = decode_vector(&aggregate(&ups, Algorithm::FedAvg).expect("aggregates"))
                .expect("decodes");
            prop_assert_eq!(out.len(), values.len());
            for (got, want) in out.iter().zip(&values) {
                prop_assert!((got - want).abs() <= 1e-9, "{} vs {}", got, want);
            }

            let narrowed: Vec<f32> = values.iter().map(|v| *v as f32).collect();
            let ups: Vec<UpdateEnvelope> = samples
                .iter()
                .enumerate()
                .map(|(i, n)| f32_update(&format!("p{i}"), *n, &narrowed, FORMAT_F32_DELTA))
                .collect();
            let out = aggregate(&ups, Algorithm::FedAvg).expect("aggregates");
            prop_assert_eq!(out.update_b64, encode_f32_le(&narrowed));
        }

        #[test]
        fn fedavg_lies_within_per_coordinate_range(raw in same_dim_updates()) {
            let ups = to_json_updates(&raw);
            let out = decode_vector(&aggregate(&ups, Algorithm::FedAvg).expect("aggregates"))
                .expect("decodes");
            for (j, got) in out.iter().enumerate() {
                let column = raw.iter().filter_map(|(v, _)| v.get(j).copied());
                let lo = column.clone().fold(f64::INFINITY, f64::min);
                let hi = column.fold(f64::NEG_INFINITY, f64::max);
                prop_assert!(lo <= *got && *got <= hi, "coord {}: {} not in [{}, {}]", j, got, lo, hi);
            }
        }

        #[test]
        fn fedavg_is_invariant_to_input_order(
            (raw, shuffled) in same_dim_updates().prop_flat_map(|raw| {
                let idx: Vec<usize> = (0..raw.len()).collect();
                (Just(raw), Just(idx).prop_shuffle())
            })
        ) {
            let ups = to_json_updates(&raw);
            let permuted: Vec<UpdateEnvelope> =
                shuffled.iter().filter_map(|i| ups.get(*i).cloned()).collect();
            let a = aggregate(&ups, Algorithm::FedAvg).expect("aggregates");
            let b = aggregate(&permuted, Algorithm::FedAvg).expect("aggregates");
            let (va, vb) = (decode_vector(&a).expect("decodes"), decode_vector(&b).expect("decodes"));
            for (x, y) in va.iter().zip(&vb) {
                prop_assert!((x - y).abs() <= 1e-9 * x.abs().max(1.0));
            }
            // Stronger than the tolerance: the canonical summation order makes it exact.
            prop_assert_eq!(a.update_b64, b.update_b64);
            prop_assert_eq!(a.num_samples, b.num_samples);
        }

        #[test]
        fn extract_never_panics_on_arbitrary_text(text in ".{0,200}", bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = extract_update(&Value::String(text), &expected());
            let lossy = String::from_utf8_lossy(&bytes).into_owned();
            let _ = extract_update(&Value::String(lossy), &ExpectedUpdate::default());
        }

        #[test]
        fn extract_never_panics_and_honours_expectations(value in arb_json()) {
            let exp = expected();
            if let Ok(env) = extract_update(&value, &exp) {
                prop_assert_eq!(env.round_id, exp.round);
                prop_assert_eq!(env.proplet_id, exp.proplet_id);
                prop_assert_eq!(env.job_id, exp.job_id);
                prop_assert!(LENIENT_B64.decode(&env.update_b64).is_ok());
            }
            let _ = extract_update(&Value::String(value.to_string()), &ExpectedUpdate::default());
        }

        #[test]
        fn aggregate_never_panics_on_arbitrary_updates(
            raw in prop::collection::vec(
                (
                    "[A-Za-z0-9+/=%]{0,24}",
                    prop_oneof![Just("json-f64"), Just("f32-le"), Just("f32-delta"), Just(""), Just("raw")],
                    prop_oneof![Just(0_u64), 1_u64..100, Just(u64::MAX)],
                ),
                0..5,
            )
        ) {
            let ups: Vec<UpdateEnvelope> = raw
                .iter()
                .enumerate()
                .map(|(i, (b, f, n))| update(&format!("p{i}"), *n, b.clone(), f))
                .collect();
            for algorithm in [Algorithm::FedAvg, Algorithm::Concat] {
                if let Ok(out) = aggregate(&ups, algorithm) {
                    prop_assert_eq!(out.proplet_id.as_str(), AGGREGATOR_PROPLET_ID);
                    prop_assert!(STANDARD.decode(&out.update_b64).is_ok());
                }
            }
        }
    }
}
