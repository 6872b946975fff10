//! Time zones: `CRON_TZ=`/`TZ=` prefixes, IANA names with suggestions, and the local times
//! that daylight-saving changes skip or repeat.

use std::str::FromStr as _;

use chrono::{
    MappedLocalTime, NaiveDateTime, Offset as _, TimeDelta, TimeZone as _, Timelike as _,
};
use chrono_tz::{GapInfo, Tz, TZ_VARIANTS};

use crate::decision::cron::error::CronError;

use super::GAP_SCAN_LIMIT_MINUTES;

/// Resolves `spec.timezone`. An empty (or all-whitespace) name means UTC, the upstream
/// default; anything else must be an exact IANA name, and an error names the rejected value
/// (suggesting the right spelling when only the case is wrong).
pub fn parse_timezone(name: &str) -> Result<Tz, CronError> {
    let trimmed = name.trim();
    if trimmed.is_empty() {
        return Ok(Tz::UTC);
    }
    lookup_zone(trimmed).map_err(|suggestion| CronError::UnknownTimezone {
        name: name.to_string(),
        suggestion,
    })
}

/// Exact IANA lookup; on failure returns the case-insensitive match, if any, as a hint.
pub(super) fn lookup_zone(name: &str) -> Result<Tz, Option<String>> {
    Tz::from_str(name).map_err(|_| {
        TZ_VARIANTS
            .iter()
            .find(|tz| tz.name().eq_ignore_ascii_case(name))
            .map(|tz| tz.name().to_string())
    })
}

/// The instant at which a skipped wall-clock time is made up: the end of the gap, moved to
/// the next whole local minute if the zone data puts it mid-minute.
pub(super) fn first_instant_after_gap(local: NaiveDateTime, tz: Tz) -> Option<NaiveDateTime> {
    let mut probe = match GapInfo::new(&local, &tz).and_then(|gap| gap.end) {
        Some(end) => {
            let end_utc = end.naive_utc();
            let end_local = end_utc.checked_add_offset(end.offset().fix())?;
            if end_local.second() == 0 && end_local.nanosecond() == 0 {
                return Some(end_utc);
            }
            truncate_to_minute(end_local)?.checked_add_signed(TimeDelta::try_minutes(1)?)?
        }
        None => truncate_to_minute(local)?.checked_add_signed(TimeDelta::try_minutes(1)?)?,
    };
    for _ in 0..GAP_SCAN_LIMIT_MINUTES {
        if let Some(instant) = earliest_instant(probe, tz) {
            return Some(instant);
        }
        probe = probe.checked_add_signed(TimeDelta::try_minutes(1)?)?;
    }
    None
}

/// Earliest UTC instant showing `local` on the zone's clocks, if that wall-clock time exists.
pub(super) fn earliest_instant(local: NaiveDateTime, tz: Tz) -> Option<NaiveDateTime> {
    match tz.offset_from_local_datetime(&local) {
        MappedLocalTime::Single(offset) => local.checked_sub_offset(offset.fix()),
        MappedLocalTime::Ambiguous(first, second) => {
            let a = local.checked_sub_offset(first.fix());
            let b = local.checked_sub_offset(second.fix());
            match (a, b) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            }
        }
        MappedLocalTime::None => None,
    }
}

/// UTC offset of `tz` at the UTC instant `utc`, in seconds.
pub(super) fn offset_seconds(tz: Tz, utc: NaiveDateTime) -> i64 {
    i64::from(tz.offset_from_utc_datetime(&utc).fix().local_minus_utc())
}

pub(super) fn truncate_to_minute(t: NaiveDateTime) -> Option<NaiveDateTime> {
    t.with_second(0)?.with_nanosecond(0)
}

/// Splits a leading `CRON_TZ=<zone> ` / `TZ=<zone> ` prefix off the expression.
pub(super) fn split_timezone_prefix(expr: &str) -> Result<(Option<Tz>, &str), CronError> {
    for prefix in ["CRON_TZ", "TZ"] {
        let Some(rest) = expr
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_prefix('='))
        else {
            continue;
        };
        let (name, fields) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
        if name.is_empty() {
            return Err(CronError::EmptyPrefixTimezone { prefix });
        }
        let tz = lookup_zone(name).map_err(|suggestion| CronError::PrefixTimezone {
            prefix,
            name: name.to_string(),
            suggestion,
        })?;
        return Ok((Some(tz), fields));
    }
    Ok((None, expr))
}
