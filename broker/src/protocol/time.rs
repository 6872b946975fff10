//! Timestamps and intervals as the different upstream components write them.
//!
//! The Go manager writes RFC 3339 strings, the Rust proplet writes serde's `SystemTime` object
//! `{"secs_since_epoch":…,"nanos_since_epoch":…}` and the embedded proplet writes a bare number
//! (milliseconds since boot). Intervals arrive as seconds (Rust), as nanoseconds (Go's
//! `time.Duration`) or as duration text (`"10s"`, `"1m"`).

use std::time::Duration;

use chrono::{DateTime, FixedOffset, SecondsFormat, Utc};
use serde_json::{Map, Value};

use super::error::DecodeError;
use super::fields::{excerpt, f64_value, Fields};

/// A sender's timestamp, kept in the form it arrived in so re-encoding is faithful.
#[derive(Debug, Clone, PartialEq)]
pub enum Timestamp {
    /// An RFC 3339 string (Go manager style).
    Rfc3339(DateTime<FixedOffset>),
    /// serde's encoding of `std::time::SystemTime` (upstream Rust proplet style).
    SystemTime {
        /// Whole seconds since the Unix epoch.
        secs_since_epoch: u64,
        /// Nanoseconds within the second, below 1 000 000 000.
        nanos_since_epoch: u32,
    },
    /// A bare number. The embedded proplet sends milliseconds since *boot*, so the value has no
    /// absolute meaning and [`Timestamp::to_utc`] returns `None` for it.
    Number(f64),
}

impl Timestamp {
    /// The current time in the `SystemTime` form, which the upstream Rust tooling can read back.
    pub fn now() -> Self {
        Self::system_time(Utc::now())
    }

    /// `at` in the `SystemTime` form; instants before 1970 are clamped to the epoch because the
    /// form cannot express them.
    pub fn system_time(at: DateTime<Utc>) -> Self {
        match u64::try_from(at.timestamp()) {
            Ok(secs) => Self::SystemTime {
                secs_since_epoch: secs,
                nanos_since_epoch: at.timestamp_subsec_nanos().min(999_999_999),
            },
            Err(_) => Self::SystemTime {
                secs_since_epoch: 0,
                nanos_since_epoch: 0,
            },
        }
    }

    /// The absolute instant, when the form has one (not for the embedded boot-relative number).
    pub fn to_utc(&self) -> Option<DateTime<Utc>> {
        match self {
            Self::Rfc3339(dt) => Some(dt.with_timezone(&Utc)),
            Self::SystemTime {
                secs_since_epoch,
                nanos_since_epoch,
            } => {
                let secs = i64::try_from(*secs_since_epoch).ok()?;
                DateTime::from_timestamp(secs, *nanos_since_epoch)
            }
            Self::Number(_) => None,
        }
    }

    /// The JSON form, the same shape it was decoded from.
    pub fn to_json(&self) -> Value {
        match self {
            Self::Rfc3339(dt) => Value::String(dt.to_rfc3339_opts(SecondsFormat::AutoSi, true)),
            Self::SystemTime {
                secs_since_epoch,
                nanos_since_epoch,
            } => {
                let mut m = Map::new();
                m.insert("secs_since_epoch".into(), Value::from(*secs_since_epoch));
                m.insert("nanos_since_epoch".into(), Value::from(*nanos_since_epoch));
                Value::Object(m)
            }
            Self::Number(n) => f64_value(*n),
        }
    }

    /// Reads any of the three forms; `key` is the full key path for error messages.
    pub(crate) fn from_json(value: &Value, key: &str) -> Result<Self, DecodeError> {
        match value {
            Value::String(s) => DateTime::parse_from_rfc3339(s)
                .map(Self::Rfc3339)
                .map_err(|e| DecodeError::InvalidValue {
                    key: key.to_owned(),
                    reason: format!("not an RFC 3339 timestamp: {e}"),
                }),
            Value::Number(n) => n.as_f64().map(Self::Number).ok_or(DecodeError::WrongType {
                key: key.to_owned(),
                expected: "RFC 3339 string, number or {secs_since_epoch, nanos_since_epoch}",
            }),
            Value::Object(obj) => {
                let f = Fields::nested(obj, key);
                let secs =
                    f.opt_u64("secs_since_epoch")?
                        .ok_or_else(|| DecodeError::MissingKey {
                            key: f.key("secs_since_epoch"),
                        })?;
                let nanos = f.req_u32("nanos_since_epoch")?;
                if nanos >= 1_000_000_000 {
                    return Err(DecodeError::InvalidValue {
                        key: f.key("nanos_since_epoch"),
                        reason: "must be below 1000000000".into(),
                    });
                }
                Ok(Self::SystemTime {
                    secs_since_epoch: secs,
                    nanos_since_epoch: nanos,
                })
            }
            _ => Err(DecodeError::WrongType {
                key: key.to_owned(),
                expected: "RFC 3339 string, number or {secs_since_epoch, nanos_since_epoch}",
            }),
        }
    }
}

/// Numbers at or above this are taken as nanoseconds: Go serialises `time.Duration` as
/// nanoseconds (10 s → 10 000 000 000), and no monitoring interval is 31 years long.
pub const NANOSECOND_INTERVAL_THRESHOLD: u64 = 1_000_000_000;

const NANOS_PER_SEC: f64 = 1_000_000_000.0;

/// Largest second count accepted; keeps the float-to-integer conversion exact and in range.
const MAX_INTERVAL_SECS: f64 = 4_294_967_295.0;

fn secs_from_f64(secs: f64) -> Result<u64, String> {
    if !secs.is_finite() || secs < 0.0 {
        return Err("must be a non-negative duration".into());
    }
    let whole = secs.ceil();
    if whole > MAX_INTERVAL_SECS {
        return Err(format!("must not exceed {MAX_INTERVAL_SECS} seconds"));
    }
    if whole < 1.0 {
        return Err("must be at least one second".into());
    }
    // `whole` is integral and within u32 range, so the conversion is exact.
    Ok(whole as u64)
}

fn secs_from_number(value: f64) -> Result<u64, String> {
    if value >= NANOSECOND_INTERVAL_THRESHOLD as f64 {
        secs_from_f64(value / NANOS_PER_SEC)
    } else {
        secs_from_f64(value)
    }
}

/// Parses Go-style duration text (`"10s"`, `"1m30s"`, `"1.5h"`, `"500ms"`) into nanoseconds.
fn parse_duration_text(text: &str) -> Result<f64, String> {
    let shown = excerpt(text);
    let mut rest = text;
    let mut total_ns = 0.0_f64;
    if rest.is_empty() {
        return Err("empty duration".into());
    }
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (num, after) = rest.split_at(num_len);
        if num.is_empty() {
            return Err(format!("expected a number in duration {shown}"));
        }
        let value: f64 = num
            .parse()
            .map_err(|_| format!("bad number {} in duration {shown}", excerpt(num)))?;
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, next) = after.split_at(unit_len);
        let unit_ns = match unit {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            "" => return Err(format!("missing unit in duration {shown}")),
            other => {
                return Err(format!(
                    "unknown unit {} in duration {shown}",
                    excerpt(other)
                ))
            }
        };
        total_ns += value * unit_ns;
        rest = next;
    }
    Ok(total_ns)
}

/// Reads an interval in whole seconds from a number (seconds, or nanoseconds at or above
/// [`NANOSECOND_INTERVAL_THRESHOLD`]) or from text (a plain number of seconds or Go duration
/// syntax). Fractions round up and zero is rejected, because a zero period crashes the upstream
/// agent's timer.
pub(crate) fn interval_secs(value: &Value, key: &str) -> Result<u64, DecodeError> {
    let invalid = |reason: String| DecodeError::InvalidValue {
        key: key.to_owned(),
        reason,
    };
    match value {
        Value::Number(n) => {
            let v = n.as_f64().ok_or_else(|| invalid("not a number".into()))?;
            secs_from_number(v).map_err(invalid)
        }
        Value::String(s) => {
            let text = s.trim();
            if let Ok(v) = text.parse::<f64>() {
                return secs_from_number(v).map_err(invalid);
            }
            let ns = parse_duration_text(text).map_err(invalid)?;
            secs_from_f64(ns / NANOS_PER_SEC).map_err(invalid)
        }
        _ => Err(DecodeError::WrongType {
            key: key.to_owned(),
            expected: "number of seconds or duration text like \"10s\"",
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn timestamp_accepts_all_three_forms() {
        let rfc = Timestamp::from_json(&json!("2026-08-20T10:00:00.5+02:00"), "timestamp");
        let Ok(Timestamp::Rfc3339(dt)) = rfc else {
            panic!("expected RFC 3339, got {rfc:?}");
        };
        assert_eq!(
            dt.with_timezone(&Utc)
                .to_rfc3339_opts(SecondsFormat::Millis, true),
            "2026-08-20T08:00:00.500Z"
        );

        let sys = Timestamp::from_json(
            &json!({"secs_since_epoch": 1785400000u64, "nanos_since_epoch": 7}),
            "timestamp",
        );
        assert_eq!(
            sys,
            Ok(Timestamp::SystemTime {
                secs_since_epoch: 1_785_400_000,
                nanos_since_epoch: 7
            })
        );
        assert_eq!(
            sys.ok().and_then(|t| t.to_utc()).map(|d| d.timestamp()),
            Some(1_785_400_000)
        );

        let num = Timestamp::from_json(&json!(123456), "timestamp");
        assert_eq!(num, Ok(Timestamp::Number(123_456.0)));
        assert_eq!(Timestamp::Number(1.0).to_utc(), None);
    }

    #[test]
    fn timestamp_errors_name_the_key() {
        assert!(matches!(
            Timestamp::from_json(&json!("yesterday"), "timestamp"),
            Err(DecodeError::InvalidValue { ref key, .. }) if key == "timestamp"
        ));
        assert_eq!(
            Timestamp::from_json(&json!({"secs_since_epoch": 1}), "timestamp"),
            Err(DecodeError::MissingKey {
                key: "timestamp.nanos_since_epoch".into()
            })
        );
        assert!(matches!(
            Timestamp::from_json(&json!({"secs_since_epoch": 1, "nanos_since_epoch": 2_000_000_000u64}), "timestamp"),
            Err(DecodeError::InvalidValue { ref key, .. }) if key == "timestamp.nanos_since_epoch"
        ));
        assert!(matches!(
            Timestamp::from_json(&json!(true), "timestamp"),
            Err(DecodeError::WrongType { ref key, .. }) if key == "timestamp"
        ));
    }

    #[test]
    fn timestamp_round_trips_through_json() {
        let cases = [
            Timestamp::SystemTime {
                secs_since_epoch: 5,
                nanos_since_epoch: 999_999_999,
            },
            Timestamp::Number(42.0),
            Timestamp::system_time(Utc::now()),
        ];
        for t in cases {
            assert_eq!(Timestamp::from_json(&t.to_json(), "t"), Ok(t.clone()));
        }
        let rfc = Timestamp::from_json(&json!("2026-01-02T03:04:05.123456789Z"), "t");
        let encoded = rfc.clone().map(|t| t.to_json());
        assert_eq!(encoded, Ok(json!("2026-01-02T03:04:05.123456789Z")));
    }

    #[test]
    fn intervals_in_every_upstream_form() {
        let k = "monitoring_profile.interval";
        assert_eq!(interval_secs(&json!(10), k), Ok(10));
        assert_eq!(interval_secs(&json!(10_000_000_000u64), k), Ok(10));
        assert_eq!(interval_secs(&json!(2.5), k), Ok(3));
        assert_eq!(interval_secs(&json!("10s"), k), Ok(10));
        assert_eq!(interval_secs(&json!("1m"), k), Ok(60));
        assert_eq!(interval_secs(&json!("1m30s"), k), Ok(90));
        assert_eq!(interval_secs(&json!("1h0m0s"), k), Ok(3600));
        assert_eq!(interval_secs(&json!("1.5h"), k), Ok(5400));
        assert_eq!(interval_secs(&json!("500ms"), k), Ok(1));
        assert_eq!(interval_secs(&json!(" 15 "), k), Ok(15));
    }

    #[test]
    fn bad_intervals_are_rejected_with_the_key() {
        let k = "monitoring_profile.interval";
        for bad in [
            json!(0),
            json!(-5),
            json!("0s"),
            json!("10x"),
            json!("s"),
            json!(""),
        ]
        .iter()
        {
            assert!(
                matches!(interval_secs(bad, k), Err(DecodeError::InvalidValue { ref key, .. }) if key == k),
                "{bad} should be invalid"
            );
        }
        assert!(matches!(
            interval_secs(&json!([1]), k),
            Err(DecodeError::WrongType { ref key, .. }) if key == k
        ));
        assert!(matches!(
            interval_secs(&json!(1e300), k),
            Err(DecodeError::InvalidValue { .. })
        ));
    }

    #[test]
    fn a_setting_of_too_many_seconds_is_refused() {
        assert!(parse_setting_duration("1e300").is_err());
        assert!(parse_setting_duration("-1").is_err());
        assert!(parse_setting_duration("NaN").is_err());
        assert_eq!(
            parse_setting_duration("0.5"),
            Ok(Duration::from_millis(500))
        );
    }
}

/// Parses a setting's duration: a bare number is seconds (`10`, `0.5`), anything else a
/// Go-style duration (`10s`, `1h30m`). Both the agent and the operator accept this form.
pub fn parse_setting_duration(text: &str) -> Result<Duration, String> {
    match text.trim().parse::<f64>() {
        // A number of seconds too large for a Duration (1e300) is refused, not a panic.
        Ok(seconds) => Duration::try_from_secs_f64(seconds)
            .map_err(|_| format!("{text:?} is not a valid duration")),
        Err(_) => parse_duration(text),
    }
}

/// Parses a Go-style duration (the CRDs' `DURATION_PATTERN`): one or more `<number><unit>`
/// pairs with units `ns`, `us`/`µs`, `ms`, `s`, `m`, `h`, e.g. `10s`, `500ms`, `1h30m`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let invalid = || format!("{text:?} is not a duration such as 10s, 500ms or 1h30m");
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(invalid());
    }
    let mut total = 0f64;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .ok_or_else(invalid)?;
        if number_len == 0 {
            return Err(invalid());
        }
        let value: f64 = rest[..number_len].parse().map_err(|_| invalid())?;
        rest = &rest[number_len..];
        let (unit_seconds, unit_len) = [
            ("ns", 1e-9),
            ("us", 1e-6),
            ("µs", 1e-6),
            ("ms", 1e-3),
            ("s", 1.0),
            ("m", 60.0),
            ("h", 3600.0),
        ]
        .iter()
        .find(|(unit, _)| rest.starts_with(unit))
        .map(|(unit, seconds)| (*seconds, unit.len()))
        .ok_or_else(invalid)?;
        total += value * unit_seconds;
        rest = &rest[unit_len..];
    }
    if !total.is_finite() || total > u32::MAX as f64 {
        return Err(invalid());
    }
    Ok(Duration::from_secs_f64(total))
}

/// Whole seconds for agents that read plain numbers (`PROPLET_*_INTERVAL`): rounded up, so a
/// sub-second interval never becomes 0 (which upstream agents treat as "disabled" or crash on).
pub fn whole_seconds(duration: Duration) -> u64 {
    let secs = duration.as_secs() + u64::from(duration.subsec_nanos() > 0);
    secs.max(1)
}

#[cfg(test)]
mod duration_tests {
    use super::*;

    #[test]
    fn go_durations_parse() {
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        for bad in ["", "10", "s", "10x", "1h-5m", "ten s"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn whole_seconds_round_up_and_never_reach_zero() {
        assert_eq!(whole_seconds(Duration::from_secs(10)), 10);
        assert_eq!(whole_seconds(Duration::from_millis(1500)), 2);
        assert_eq!(whole_seconds(Duration::from_millis(100)), 1);
        assert_eq!(whole_seconds(Duration::ZERO), 1);
    }
}
