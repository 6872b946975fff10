//! Why an expression or a zone was refused, with advice on what to write instead.

use crate::decision::cron::field_name::CronField;

/// Why a schedule or time zone was rejected. Messages are meant to be shown to users as-is
/// (status conditions, Events): they name the field and the offending text. Every schedule
/// error starts with `invalid cron expression`, the upstream webhook's wording.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum CronError {
    /// The expression is empty or only whitespace.
    #[error(
        "invalid cron expression: the schedule is empty; expected 5 fields \
         (minute hour day-of-month month day-of-week)"
    )]
    Empty,
    /// The expression does not have exactly five fields (seconds fields are not supported).
    #[error(
        "invalid cron expression: expected 5 fields (minute hour day-of-month month \
         day-of-week), found {found} in `{expression}`"
    )]
    FieldCount {
        /// Number of whitespace-separated fields after any time-zone prefix.
        found: usize,
        /// The expression as given (trimmed).
        expression: String,
    },
    /// A descriptor such as `@hourly` or `@every 5m` was used.
    #[error("invalid cron expression: descriptor `{descriptor}` is not supported; {advice}", advice = descriptor_advice(.descriptor))]
    Descriptor {
        /// The descriptor word, e.g. `@hourly`.
        descriptor: String,
    },
    /// A number lies outside the field's range.
    #[error(
        "invalid cron expression: {field} field `{token}`: {value} is out of range {min}-{max}"
    )]
    OutOfRange {
        /// Field containing the value.
        field: CronField,
        /// The list entry containing the value.
        token: String,
        /// The offending number as written.
        value: String,
        /// Smallest accepted value.
        min: u32,
        /// Largest accepted value.
        max: u32,
    },
    /// A value is neither a number nor a name valid in this field.
    #[error("invalid cron expression: {field} field `{token}`: `{value}` is not {hint}", hint = .field.value_hint())]
    InvalidValue {
        /// Field containing the value.
        field: CronField,
        /// The list entry containing the value.
        token: String,
        /// The offending text.
        value: String,
    },
    /// The part after `/` is zero or not a whole number.
    #[error(
        "invalid cron expression: {field} field `{token}`: the step after `/` must be a \
         positive whole number, got `{step}`"
    )]
    InvalidStep {
        /// Field containing the step.
        field: CronField,
        /// The list entry containing the step.
        token: String,
        /// The step as written.
        step: String,
    },
    /// A range runs backwards; cron ranges do not wrap around.
    #[error(
        "invalid cron expression: {field} field `{token}`: the range starts at {start} but \
         ends at {end}; ranges do not wrap around, list both parts instead (e.g. \
         `{start}-{max},{min}-{end}`)"
    )]
    ReversedRange {
        /// Field containing the range.
        field: CronField,
        /// The list entry containing the range.
        token: String,
        /// Start value.
        start: u32,
        /// End value (smaller than `start`).
        end: u32,
        /// Smallest value of the field.
        min: u32,
        /// Largest value of the field for `*`.
        max: u32,
    },
    /// A list entry has a structural problem (empty entry, repeated `/` or `-`, misplaced `*`
    /// or `?`).
    #[error("invalid cron expression: {field} field `{token}`: {reason}")]
    Malformed {
        /// Field containing the entry.
        field: CronField,
        /// The list entry (may be empty).
        token: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// The `CRON_TZ=`/`TZ=` prefix names a zone that does not exist.
    #[error("invalid cron expression: unknown time zone `{name}` in the `{prefix}=` prefix{hint}", hint = suggestion_suffix(.suggestion))]
    PrefixTimezone {
        /// `CRON_TZ` or `TZ`.
        prefix: &'static str,
        /// The zone name as written.
        name: String,
        /// Correctly spelled zone when the name only differs in case.
        suggestion: Option<String>,
    },
    /// The `CRON_TZ=`/`TZ=` prefix is not followed by a zone name.
    #[error(
        "invalid cron expression: the `{prefix}=` prefix names no time zone; write e.g. \
         `{prefix}=Europe/Berlin 0 9 * * *`"
    )]
    EmptyPrefixTimezone {
        /// `CRON_TZ` or `TZ`.
        prefix: &'static str,
    },
    /// The `cron` crate rejected the expression this module translated the fields into.
    /// Validation here accepts only what translates, so this means a bug, reported rather
    /// than panicking.
    #[error(
        "invalid cron expression: the cron library rejected its translation `{expression}`: \
         {message}"
    )]
    Translation {
        /// The 6-field expression given to the crate.
        expression: String,
        /// The crate's error message.
        message: String,
    },
    /// `spec.timezone` names a zone that does not exist.
    #[error(
        "unknown time zone `{name}`: expected an IANA name such as `Europe/Berlin` or `UTC`{hint}",
        hint = suggestion_suffix(.suggestion)
    )]
    UnknownTimezone {
        /// The zone name as given.
        name: String,
        /// Correctly spelled zone when the name only differs in case.
        suggestion: Option<String>,
    },
}

pub(super) fn descriptor_advice(descriptor: &str) -> String {
    let lower = descriptor.to_ascii_lowercase();
    let equivalent = match lower.as_str() {
        "@yearly" | "@annually" => Some("0 0 1 1 *"),
        "@monthly" => Some("0 0 1 * *"),
        "@weekly" => Some("0 0 * * 0"),
        "@daily" | "@midnight" => Some("0 0 * * *"),
        "@hourly" => Some("0 * * * *"),
        _ => None,
    };
    match equivalent {
        Some(fields) => format!("write the 5 fields instead: `{fields}`"),
        None if lower == "@every" => "intervals are not supported; write the 5 fields instead \
             (e.g. `*/5 * * * *` for every 5 minutes)"
            .to_string(),
        None => {
            "write the 5 fields instead (minute hour day-of-month month day-of-week)".to_string()
        }
    }
}

pub(super) fn suggestion_suffix(suggestion: &Option<String>) -> String {
    match suggestion {
        Some(name) => format!(" (did you mean `{name}`?)"),
        None => String::new(),
    }
}
