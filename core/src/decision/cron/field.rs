//! The five fields of an expression: their ranges and names, and the parsing of lists,
//! ranges, steps and names into bit sets.

use crate::decision::cron::error::CronError;
use crate::decision::cron::field_name::CronField;

/// A field's value set in the crate's syntax: `*` when complete, else the values as a list
/// (weekdays by name, so the crate's 1 = Sunday numbering never matters).
pub(super) fn crate_field(bits: u64, min: u32, max: u32, names: Option<&[&str]>) -> String {
    let values: Vec<u32> = (min..=max).filter(|value| has_bit(bits, *value)).collect();
    if values.len() == (max - min + 1) as usize {
        return "*".to_string();
    }
    let text = |value: u32| match names.and_then(|names| names.get(value as usize)) {
        Some(name) => name.to_ascii_uppercase(),
        None => value.to_string(),
    };
    values.into_iter().map(text).collect::<Vec<_>>().join(",")
}

pub(super) fn has_bit(mask: u64, value: u32) -> bool {
    value < 64 && (mask >> value) & 1 == 1
}

/// One parsed field: the set of matching values and whether it was written as `*`/`?`.
pub(super) struct ParsedField {
    pub(super) bits: u64,
    pub(super) unrestricted: bool,
}

pub(super) fn parse_field(text: &str, field: CronField) -> Result<ParsedField, CronError> {
    let mut parsed = ParsedField {
        bits: 0,
        unrestricted: false,
    };
    for entry in text.split(',') {
        let (bits, unrestricted) = parse_entry(entry, field)?;
        parsed.bits |= bits;
        parsed.unrestricted |= unrestricted;
    }
    Ok(parsed)
}

/// Parses one list entry (`*`, `?`, `a`, `a-b`, each optionally followed by `/step`) into a bit
/// set and whether it leaves the field unrestricted.
pub(super) fn parse_entry(entry: &str, field: CronField) -> Result<(u64, bool), CronError> {
    let malformed = |reason: &'static str| CronError::Malformed {
        field,
        token: entry.to_string(),
        reason,
    };
    if entry.is_empty() {
        return Err(malformed("empty list entry (check for a stray comma)"));
    }
    let (range, step_text) = match entry.split_once('/') {
        Some((range, step)) => (range, Some(step)),
        None => (entry, None),
    };
    let step = match step_text {
        None => 1,
        Some(text) if text.contains('/') => return Err(malformed("more than one `/`")),
        Some(text) => parse_step(text, entry, field)?,
    };
    let min = field.bounds().0;
    let open_max = field.open_max();
    let (start, end, wildcard) = if range == "*" || range == "?" {
        if range == "?" && !field.allows_question_mark() {
            return Err(malformed(
                "`?` is only allowed in the day-of-month and day-of-week fields",
            ));
        }
        (min, open_max, true)
    } else if let Some((low, high)) = range.split_once('-') {
        if high.contains('-') {
            return Err(malformed("more than one `-` in a range"));
        }
        if matches!(low, "*" | "?") || matches!(high, "*" | "?") {
            return Err(malformed(
                "`*` and `?` cannot be part of a range; use them alone or write `a-b`",
            ));
        }
        let low = parse_value(low, entry, field)?;
        let high = parse_value(high, entry, field)?;
        (low, high, false)
    } else {
        let value = parse_value(range, entry, field)?;
        // `a/n` means `a` through the maximum, stepping by n.
        let end = if step_text.is_some() {
            open_max.max(value)
        } else {
            value
        };
        (value, end, false)
    };
    if start > end {
        return Err(CronError::ReversedRange {
            field,
            token: entry.to_string(),
            start,
            end,
            min,
            max: open_max,
        });
    }
    let mut bits = 0u64;
    let mut value = Some(start);
    while let Some(current) = value.filter(|v| *v <= end) {
        bits |= 1u64 << current;
        value = current.checked_add(step);
    }
    Ok((bits, wildcard && step == 1))
}

/// Parses a number or (in the month and day-of-week fields) a three-letter name, checking the
/// field's range.
pub(super) fn parse_value(text: &str, entry: &str, field: CronField) -> Result<u32, CronError> {
    if text.is_empty() {
        return Err(CronError::Malformed {
            field,
            token: entry.to_string(),
            reason: "a range is missing a value before or after `-`",
        });
    }
    let (min, max) = field.bounds();
    if text.bytes().all(|b| b.is_ascii_digit()) {
        let out_of_range = || CronError::OutOfRange {
            field,
            token: entry.to_string(),
            value: text.to_string(),
            min,
            max,
        };
        let value: u32 = text.parse().map_err(|_| out_of_range())?;
        if value < min || value > max {
            return Err(out_of_range());
        }
        return Ok(value);
    }
    let (names, first_value) = field.names();
    names
        .iter()
        .zip(first_value..)
        .find(|(name, _)| name.eq_ignore_ascii_case(text))
        .map(|(_, value)| value)
        .ok_or_else(|| CronError::InvalidValue {
            field,
            token: entry.to_string(),
            value: text.to_string(),
        })
}

pub(super) fn parse_step(text: &str, entry: &str, field: CronField) -> Result<u32, CronError> {
    let invalid = || CronError::InvalidStep {
        field,
        token: entry.to_string(),
        step: text.to_string(),
    };
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid());
    }
    match text.parse::<u32>() {
        Ok(0) | Err(_) => Err(invalid()),
        Ok(step) => Ok(step),
    }
}
