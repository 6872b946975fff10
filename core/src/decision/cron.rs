//! Cron schedules for recurring Tasks (`spec.schedule`, `spec.timezone`, `spec.isRecurring`).
//!
//! The upstream Go operator parsed schedules with robfig/cron v3's standard parser, so the
//! accepted syntax is kept compatible with it (and a little more permissive where noted):
//!
//! * exactly five fields: minute (0-59), hour (0-23), day-of-month (1-31), month (1-12 or
//!   `JAN`-`DEC`), day-of-week (0-7 or `SUN`-`SAT`, both 0 and 7 mean Sunday); seconds are
//!   always 0;
//! * `*`, lists `a,b`, ranges `a-b`, steps `*/n`, `a-b/n` and `a/n` (= `a` through the field's
//!   maximum, step `n`); names are case-insensitive; `?` is accepted as `*` in day-of-month and
//!   day-of-week only;
//! * an optional leading `CRON_TZ=<zone> ` or `TZ=<zone> ` prefix overrides the time zone
//!   given by the caller (`spec.timezone`);
//! * descriptors (`@hourly`, `@every 5m`, ...) are rejected with an error suggesting the
//!   equivalent five-field expression.
//!
//! Deliberate differences from robfig: day-of-week accepts 7 (robfig stops at 6; `*` and `a/n`
//! still stop at 6, so `*/2` and `1/3` mean the same as in robfig); `*-5` and `?` outside the
//! day fields are errors instead of being silently read as `*`.
//!
//! Day matching follows Vixie cron / robfig: when both day-of-month and day-of-week are
//! restricted, a day matches if EITHER matches (`0 0 13 * FRI` fires on every 13th and every
//! Friday). A field counts as unrestricted when one of its list entries is `*` or `?` without
//! a step greater than 1 (so `*/1` is unrestricted, `*/2` and `1-31` are restricted, as in
//! robfig).
//!
//! # Time zones and daylight-saving changes
//!
//! Fields are matched against the wall-clock time in the schedule's zone (the `CRON_TZ`
//! override, else the caller's zone). Where the wall clock jumps, the behaviour depends on
//! whether the schedule fires every hour (its hour set is all of 0-23, e.g. `*`, `*/1`,
//! `0-23`) — an *interval* schedule — or names specific hours — a *wall-clock* schedule.
//! This mirrors cronie, which treats wildcard-time jobs and fixed-time jobs differently:
//!
//! * **Wall-clock schedules** (`30 2 * * *`, `0 */2 * * *`, `*/15 1-3 * * *`): every matching
//!   wall-clock minute fires exactly once.
//!   - Spring-forward gap: a matching time that does not exist that day (02:30 in
//!     America/New_York on 2026-03-08) fires once at the first instant after the gap (03:00
//!     local, precisely the instant the clocks change). Several skipped times and a real
//!     activation at that instant collapse into a single activation — nothing fires twice.
//!   - Fall-back overlap: a matching time that occurs twice fires only at its first (earlier,
//!     daylight-time) occurrence.
//! * **Interval schedules** (`*/15 * * * *`, `0 * * * *`, `30 * * 1 MON`): they follow
//!   elapsed time and fire at every instant whose local wall-clock time matches.
//!   - Fall-back overlap: the repeated hour fires in BOTH passes (`*/15 * * * *` fires at
//!     01:00, 01:15, 01:30, 01:45 EDT and again at 01:00 ... 01:45 EST), keeping the cadence
//!     in real time.
//!   - Spring-forward gap: the missing wall-clock times simply do not occur and are not
//!     moved (`30 * * * *` goes from 01:30 EST straight to 03:30 EDT, one real hour later).
//!
//! In zones whose historical offsets had seconds (local mean time before ~1970), a gap's end
//! may not fall on a whole local minute; the activation then moves to the next whole local
//! minute so every activation has local seconds 0.
//!
//! # Search
//!
//! The `cron` crate does the calendar search: the five fields are validated here, then
//! translated into the crate's 6-field form (seconds `0`, weekdays by name) and searched on a
//! UTC clock that stands for naive wall-clock time, so the crate never sees a clock change.
//! This module maps each wall-clock match to instants with the zone's rules (the policy
//! above), adds the day OR (the crate ANDs the day fields, so two crate schedules are
//! searched) and gives up after [`SEARCH_HORIZON_YEARS`] years of local calendar time
//! (`0 0 30 2 *` never fires). The zone's offset is probed hourly over the 26 hours after the
//! start instant, so an upcoming clock set back is seen and its second-pass wall-clock times
//! (which lie *before* the start's wall-clock time) are searched too. It reads no clock and
//! keeps no state.

use std::str::FromStr;

use chrono::{
    DateTime, Datelike, MappedLocalTime, Months, NaiveDate, NaiveDateTime, NaiveTime, Offset,
    TimeDelta, TimeZone, Utc,
};
use chrono_tz::Tz;

mod error;
mod field;
mod field_name;
mod zone;

use crate::decision::cron::field::{crate_field, parse_field};
use crate::decision::cron::zone::{
    first_instant_after_gap, offset_seconds, split_timezone_prefix, truncate_to_minute,
};
pub use error::CronError;
pub use field_name::CronField;
pub use zone::parse_timezone;

/// How many years of local calendar time `next_after` examines before concluding that a
/// schedule never fires. Eight years covers the longest gap between two February 29ths
/// (2096 -> 2104), so every satisfiable schedule is found.
pub const SEARCH_HORIZON_YEARS: u32 = 8;

/// How far ahead (in hours) the zone's offsets are probed for a clock set back, so that
/// the repeated wall-clock range of an upcoming fall-back is also searched.
const FOLD_PROBE_HOURS: i64 = 26;

/// Upper bound (minutes) when walking out of a gap whose end the zone data cannot report
/// directly; real gaps are at most one day long.
const GAP_SCAN_LIMIT_MINUTES: u32 = 48 * 60;

/// The years the `cron` crate searches (its year field's range); other years are searched
/// on a stand-in year with the same calendar.
const CRATE_FIRST_YEAR: i32 = 1970;
const CRATE_LAST_YEAR: i32 = 2100;

const MONTH_NAMES: [&str; 12] = [
    "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
];
const WEEKDAY_NAMES: [&str; 7] = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"];

/// A parsed, validated 5-field cron expression. Parsing once and keeping this value lets
/// reconcilers validate `spec.schedule` and compute `status.nextRun` from the same rules.
///
/// The fields are checked here (typed errors, robfig quirks) and then handed to the `cron`
/// crate as its 6-field form, which does the calendar search; this type only adds what the
/// crate does not do: the Vixie day OR, time zones and the daylight-saving policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CronSchedule {
    /// The crate's schedules over naive wall-clock time; an activation is a match of any of
    /// them. Two when both day fields are restricted (day-of-month with any weekday, any day
    /// of the month with the weekdays), since the crate ANDs the day fields.
    calendars: Vec<cron::Schedule>,
    /// The hour set is all of 0-23: the schedule follows elapsed time across clock changes.
    interval: bool,
    /// Zone from a `CRON_TZ=`/`TZ=` prefix; takes precedence over the caller's zone.
    timezone: Option<Tz>,
}

impl FromStr for CronSchedule {
    type Err = CronError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CronSchedule::parse(s)
    }
}

impl CronSchedule {
    /// Parses and validates a schedule; see the module documentation for the syntax. Errors
    /// name the field and the offending list entry so users can fix `spec.schedule`.
    pub fn parse(expr: &str) -> Result<CronSchedule, CronError> {
        let trimmed = expr.trim();
        if trimmed.is_empty() {
            return Err(CronError::Empty);
        }
        let (timezone, rest) = split_timezone_prefix(trimmed)?;
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if let Some(first) = fields.first() {
            if first.starts_with('@') {
                return Err(CronError::Descriptor {
                    descriptor: (*first).to_string(),
                });
            }
        }
        let &[minute, hour, dom, month, dow] = fields.as_slice() else {
            return Err(CronError::FieldCount {
                found: fields.len(),
                expression: trimmed.to_string(),
            });
        };
        let minute = parse_field(minute, CronField::Minute)?;
        let hour = parse_field(hour, CronField::Hour)?;
        let dom = parse_field(dom, CronField::DayOfMonth)?;
        let month = parse_field(month, CronField::Month)?;
        let dow = parse_field(dow, CronField::DayOfWeek)?;
        // Sunday may be written 0 or 7; keep it as bit 0 only.
        let sunday_as_seven = 1u64 << 7;
        let days_of_week = if dow.bits & sunday_as_seven != 0 {
            (dow.bits & !sunday_as_seven) | 1
        } else {
            dow.bits
        };

        let times = format!(
            "0 {} {}",
            crate_field(minute.bits, 0, 59, None),
            crate_field(hour.bits, 0, 23, None)
        );
        let month = crate_field(month.bits, 1, 12, None);
        let dom_text = crate_field(dom.bits, 1, 31, None);
        let dow_text = crate_field(days_of_week, 0, 6, Some(&WEEKDAY_NAMES));
        let days = if dom.unrestricted || dow.unrestricted {
            vec![(dom_text.as_str(), dow_text.as_str())]
        } else {
            vec![(dom_text.as_str(), "*"), ("*", dow_text.as_str())]
        };
        let calendars = days
            .into_iter()
            .map(|(dom, dow)| {
                let expression = format!("{times} {dom} {month} {dow}");
                cron::Schedule::from_str(&expression).map_err(|error| CronError::Translation {
                    expression,
                    message: error.to_string(),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(CronSchedule {
            calendars,
            interval: hour.bits == (1u64 << 24) - 1,
            timezone,
        })
    }

    /// The zone named by a `CRON_TZ=`/`TZ=` prefix, which `next_after` uses instead of its
    /// `tz` argument.
    pub fn timezone_override(&self) -> Option<Tz> {
        self.timezone
    }

    /// First activation strictly after `after`, evaluated in the schedule's CRON_TZ override
    /// if present, else `tz`; this is what `status.nextRun` is set to.
    ///
    /// Daylight-saving changes are handled as the module documentation describes. Returns
    /// `None` when nothing fires within [`SEARCH_HORIZON_YEARS`] years (e.g. `0 0 30 2 *`) or
    /// when `after` is so close to the start or end of representable time that the search
    /// would overflow.
    pub fn next_after(&self, after: DateTime<Utc>, tz: Tz) -> Option<DateTime<Utc>> {
        let tz = self.timezone.unwrap_or(tz);
        let after_utc = after.naive_utc();
        let offset_after = offset_seconds(tz, after_utc);
        let local_after = after_utc.checked_add_signed(TimeDelta::try_seconds(offset_after)?)?;

        // Probe the offsets of the next day: a clock set back there repeats wall-clock times
        // that lie before `local_after`, and those (second-pass) instants are still in the
        // future, so the search starts one fold length earlier in wall-clock time.
        let mut min_offset = offset_after;
        let mut max_offset = offset_after;
        for hour in 1..=FOLD_PROBE_HOURS {
            if let Some(probe) = after_utc.checked_add_signed(TimeDelta::try_hours(hour)?) {
                let offset = offset_seconds(tz, probe);
                min_offset = min_offset.min(offset);
                max_offset = max_offset.max(offset);
            }
        }
        let lookback = TimeDelta::try_seconds(offset_after - min_offset)?;
        let mut cursor = truncate_to_minute(local_after.checked_sub_signed(lookback)?)?;
        let limit = local_after
            .date()
            .checked_add_months(Months::new(12 * SEARCH_HORIZON_YEARS))
            .unwrap_or(NaiveDate::MAX);

        // The crate yields matching wall-clock times in increasing local order. Their instants
        // are increasing too except around a fall-back, so keep the earliest instant seen and
        // stop once a candidate's earliest possible instant (local time minus the largest
        // offset in play) cannot beat it.
        let mut best: Option<(NaiveDateTime, TimeDelta)> = None;
        while let Some(candidate) = self.next_local_match(cursor, limit) {
            if let Some((best_instant, max_shift)) = best {
                match candidate.checked_sub_signed(max_shift) {
                    Some(earliest) if earliest < best_instant => {}
                    _ => break,
                }
            }
            for instant in self.fire_instants(candidate, tz).into_iter().flatten() {
                let improves = best.is_none_or(|(best_instant, _)| instant < best_instant);
                if instant > after_utc && improves {
                    let shift = max_offset.max(offset_seconds(tz, instant));
                    best = Some((instant, TimeDelta::try_seconds(shift)?));
                }
            }
            match candidate.checked_add_signed(TimeDelta::try_minutes(1)?) {
                Some(next) => cursor = next,
                None => break,
            }
        }
        best.map(|(instant, _)| instant.and_utc())
    }

    /// True when the schedule fires every hour, i.e. it is an interval schedule that follows
    /// elapsed time across daylight-saving changes.
    fn is_interval(&self) -> bool {
        self.interval
    }

    /// Whether a local wall-clock time (with seconds 0) matches all fields.
    #[cfg(test)]
    fn matches_local(&self, local: NaiveDateTime) -> bool {
        use chrono::Timelike;
        let stand_in = stand_in_year(local.year()).and_then(|year| local.with_year(year));
        local.nanosecond() == 0
            && stand_in.is_some_and(|stand_in| {
                let clock = stand_in.and_utc();
                self.calendars
                    .iter()
                    .any(|calendar| calendar.includes(clock))
            })
    }

    /// First matching whole-minute wall-clock time at or after `from` (whose seconds are
    /// ignored), on or before `limit`.
    ///
    /// The crate searches a UTC clock that stands for naive wall-clock time, so it never sees
    /// a clock change. It only knows the years 1970-2100; outside them each year is searched
    /// on its stand-in (see [`stand_in_year`]), one year per call.
    fn next_local_match(&self, from: NaiveDateTime, limit: NaiveDate) -> Option<NaiveDateTime> {
        let mut from = truncate_to_minute(from)?;
        while from.date() <= limit {
            let year = from.year();
            let stand_in = stand_in_year(year)?;
            // The crate returns matches strictly after its argument.
            let start = from
                .with_year(stand_in)?
                .checked_sub_signed(TimeDelta::try_seconds(1)?)?
                .and_utc();
            let found = self
                .calendars
                .iter()
                .filter_map(|calendar| calendar.after(&start).next())
                .map(|clock| clock.naive_utc())
                // Past its stand-in year, a match only counts where the years are the real ones.
                .filter(|clock| clock.year() == stand_in || stand_in == year)
                .min();
            if let Some(clock) = found {
                let local = clock.with_year(clock.year() - stand_in + year)?;
                return (local.date() <= limit).then_some(local);
            }
            // With the real years the crate has already looked up to its last year.
            let next_year = if stand_in == year {
                CRATE_LAST_YEAR
            } else {
                year
            };
            from =
                NaiveDate::from_ymd_opt(next_year.checked_add(1)?, 1, 1)?.and_time(NaiveTime::MIN);
        }
        None
    }

    /// UTC instants (as naive UTC) at which a matching wall-clock time fires, per the DST rules
    /// in the module documentation.
    fn fire_instants(&self, local: NaiveDateTime, tz: Tz) -> [Option<NaiveDateTime>; 2] {
        match tz.offset_from_local_datetime(&local) {
            MappedLocalTime::Single(offset) => [local.checked_sub_offset(offset.fix()), None],
            MappedLocalTime::Ambiguous(first, second) => {
                let a = local.checked_sub_offset(first.fix());
                let b = local.checked_sub_offset(second.fix());
                let (early, late) = match (a, b) {
                    (Some(a), Some(b)) if b < a => (Some(b), Some(a)),
                    _ => (a, b),
                };
                if self.is_interval() {
                    [early, late]
                } else {
                    [early.or(late), None]
                }
            }
            MappedLocalTime::None => {
                if self.is_interval() {
                    [None, None]
                } else {
                    [first_instant_after_gap(local, tz), None]
                }
            }
        }
    }
}

/// The year whose calendar the crate searches in place of `year`: `year` itself within the
/// crate's range (1970-2100), else a year in 2001-2028 that starts on the same weekday and
/// has the same length. Those 28 years hold all fourteen Gregorian year calendars, so every
/// date keeps its weekday and February 29 exists exactly when it does in `year`.
fn stand_in_year(year: i32) -> Option<i32> {
    if (CRATE_FIRST_YEAR..=CRATE_LAST_YEAR).contains(&year) {
        return Some(year);
    }
    let shape = |year: i32| {
        let first_day = NaiveDate::from_ymd_opt(year, 1, 1)?.weekday();
        Some((first_day, NaiveDate::from_ymd_opt(year, 2, 29).is_some()))
    };
    let wanted = shape(year)?;
    (2001..=2028).find(|candidate| shape(*candidate) == Some(wanted))
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Timelike;
    use chrono::{Duration, NaiveTime};
    use proptest::prelude::*;

    fn parse(expr: &str) -> CronSchedule {
        CronSchedule::parse(expr).unwrap()
    }

    fn err(expr: &str) -> CronError {
        CronSchedule::parse(expr).unwrap_err()
    }

    fn utc(text: &str) -> DateTime<Utc> {
        text.parse().unwrap()
    }

    fn next(expr: &str, after: &str, tz: Tz) -> Option<DateTime<Utc>> {
        parse(expr).next_after(utc(after), tz)
    }

    /// The successive activations after `after`.
    fn series(expr: &str, after: &str, tz: Tz, count: usize) -> Vec<DateTime<Utc>> {
        let schedule = parse(expr);
        let mut out = Vec::new();
        let mut cursor = utc(after);
        for _ in 0..count {
            cursor = schedule.next_after(cursor, tz).unwrap();
            out.push(cursor);
        }
        out
    }

    fn utcs(texts: &[&str]) -> Vec<DateTime<Utc>> {
        texts.iter().map(|t| utc(t)).collect()
    }

    fn local_of(instant: DateTime<Utc>, tz: Tz) -> NaiveDateTime {
        instant.with_timezone(&tz).naive_local()
    }

    // ---------------------------------------------------------------- parse errors

    #[test]
    fn empty_expression_is_rejected() {
        assert_eq!(err(""), CronError::Empty);
        assert_eq!(err("   \t "), CronError::Empty);
        assert!(err("").to_string().starts_with("invalid cron expression"));
    }

    #[test]
    fn wrong_field_count_reports_how_many_were_found() {
        assert_eq!(
            err("* * * *"),
            CronError::FieldCount {
                found: 4,
                expression: "* * * *".into()
            }
        );
        let six = err("0 0 12 * * *");
        assert_eq!(
            six.to_string(),
            "invalid cron expression: expected 5 fields (minute hour day-of-month month \
             day-of-week), found 6 in `0 0 12 * * *`"
        );
        assert!(matches!(
            err("CRON_TZ=UTC"),
            CronError::FieldCount { found: 0, .. }
        ));
    }

    #[test]
    fn out_of_range_values_name_field_and_token() {
        let e = err("60 * * * *");
        assert_eq!(
            e.to_string(),
            "invalid cron expression: minute field `60`: 60 is out of range 0-59"
        );
        assert!(matches!(
            err("0 24 * * *"),
            CronError::OutOfRange { field: CronField::Hour, ref value, min: 0, max: 23, .. } if value == "24"
        ));
        assert!(matches!(
            err("0 0 0 * *"),
            CronError::OutOfRange {
                field: CronField::DayOfMonth,
                min: 1,
                max: 31,
                ..
            }
        ));
        assert!(matches!(
            err("0 0 32 * *"),
            CronError::OutOfRange {
                field: CronField::DayOfMonth,
                ..
            }
        ));
        assert!(matches!(
            err("0 0 * 13 *"),
            CronError::OutOfRange {
                field: CronField::Month,
                min: 1,
                max: 12,
                ..
            }
        ));
        let e = err("0 0 * * 1-8");
        assert_eq!(
            e.to_string(),
            "invalid cron expression: day-of-week field `1-8`: 8 is out of range 0-7"
        );
        // Numbers too large for any integer type are still a range error, not a panic.
        let e = err("0 0 99999999999999999999 * *");
        assert!(matches!(
            e,
            CronError::OutOfRange {
                field: CronField::DayOfMonth,
                ..
            }
        ));
        assert!(e
            .to_string()
            .contains("99999999999999999999 is out of range 1-31"));
    }

    #[test]
    fn bad_steps_are_rejected() {
        let e = err("*/0 * * * *");
        assert_eq!(
            e,
            CronError::InvalidStep {
                field: CronField::Minute,
                token: "*/0".into(),
                step: "0".into()
            }
        );
        assert_eq!(
            e.to_string(),
            "invalid cron expression: minute field `*/0`: the step after `/` must be a \
             positive whole number, got `0`"
        );
        assert!(
            matches!(err("0 1-5/x * * *"), CronError::InvalidStep { field: CronField::Hour, ref step, .. } if step == "x")
        );
        assert!(matches!(err("*/ * * * *"), CronError::InvalidStep { .. }));
        assert!(matches!(err("*/-1 * * * *"), CronError::InvalidStep { .. }));
        assert!(matches!(
            err("*/99999999999 * * * *"),
            CronError::InvalidStep { .. }
        ));
        assert!(matches!(
            err("*/5/2 * * * *"),
            CronError::Malformed {
                reason: "more than one `/`",
                ..
            }
        ));
    }

    #[test]
    fn bad_names_are_rejected_with_a_hint() {
        let e = err("0 0 * JANUARY *");
        assert_eq!(
            e.to_string(),
            "invalid cron expression: month field `JANUARY`: `JANUARY` is not a number or a \
             month name (JAN-DEC)"
        );
        // Weekday names are not month names and vice versa.
        assert!(matches!(
            err("0 0 * MON *"),
            CronError::InvalidValue {
                field: CronField::Month,
                ..
            }
        ));
        let e = err("0 0 * * JAN");
        assert!(e.to_string().contains(
            "day-of-week field `JAN`: `JAN` is not a number or a weekday name (SUN-SAT)"
        ));
        let e = err("five * * * *");
        assert_eq!(
            e.to_string(),
            "invalid cron expression: minute field `five`: `five` is not a number"
        );
        assert!(matches!(
            err("-1 * * * *"),
            CronError::Malformed {
                field: CronField::Minute,
                ..
            }
        ));
    }

    #[test]
    fn reversed_ranges_are_rejected_with_a_wrap_suggestion() {
        let e = err("0 22-2 * * *");
        assert_eq!(
            e,
            CronError::ReversedRange {
                field: CronField::Hour,
                token: "22-2".into(),
                start: 22,
                end: 2,
                min: 0,
                max: 23
            }
        );
        assert!(e.to_string().contains("`22-23,0-2`"), "{e}");
        let e = err("0 0 * * FRI-MON");
        assert!(e.to_string().contains("day-of-week field `FRI-MON`"), "{e}");
        assert!(e.to_string().contains("`5-6,0-1`"), "{e}");
    }

    #[test]
    fn descriptors_are_rejected_with_the_equivalent_fields() {
        let e = err("@hourly");
        assert_eq!(
            e.to_string(),
            "invalid cron expression: descriptor `@hourly` is not supported; write the 5 \
             fields instead: `0 * * * *`"
        );
        assert!(err("@Daily").to_string().contains("`0 0 * * *`"));
        assert!(err("@weekly").to_string().contains("`0 0 * * 0`"));
        assert!(err("@annually").to_string().contains("`0 0 1 1 *`"));
        let e = err("@every 5m");
        assert_eq!(
            e,
            CronError::Descriptor {
                descriptor: "@every".into()
            }
        );
        assert!(e.to_string().contains("intervals are not supported"));
        assert!(err("CRON_TZ=UTC @daily")
            .to_string()
            .contains("descriptor `@daily`"));
        assert!(err("@reboot")
            .to_string()
            .contains("write the 5 fields instead"));
    }

    #[test]
    fn malformed_entries_are_rejected() {
        assert!(matches!(
            err("1,,2 * * * *"),
            CronError::Malformed { field: CronField::Minute, ref token, .. } if token.is_empty()
        ));
        assert!(matches!(
            err("0 0 1, * *"),
            CronError::Malformed {
                field: CronField::DayOfMonth,
                ..
            }
        ));
        assert!(matches!(
            err("1-2-3 * * * *"),
            CronError::Malformed {
                reason: "more than one `-` in a range",
                ..
            }
        ));
        assert!(matches!(err("5- * * * *"), CronError::Malformed { .. }));
        let e = err("*-5 * * * *");
        assert!(e
            .to_string()
            .contains("minute field `*-5`: `*` and `?` cannot be part of a range"));
        let e = err("? * * * *");
        assert!(e
            .to_string()
            .contains("`?` is only allowed in the day-of-month and day-of-week fields"));
        assert!(matches!(
            err("0 ? * * *"),
            CronError::Malformed {
                field: CronField::Hour,
                ..
            }
        ));
    }

    #[test]
    fn timezone_prefix_errors_name_the_zone() {
        let e = err("CRON_TZ=Mars/Olympus 0 9 * * *");
        assert_eq!(
            e.to_string(),
            "invalid cron expression: unknown time zone `Mars/Olympus` in the `CRON_TZ=` prefix"
        );
        let e = err("TZ=europe/berlin 0 9 * * *");
        assert_eq!(
            e,
            CronError::PrefixTimezone {
                prefix: "TZ",
                name: "europe/berlin".into(),
                suggestion: Some("Europe/Berlin".into())
            }
        );
        assert!(e.to_string().ends_with("(did you mean `Europe/Berlin`?)"));
        assert_eq!(
            err("CRON_TZ= 0 9 * * *"),
            CronError::EmptyPrefixTimezone { prefix: "CRON_TZ" }
        );
    }

    #[test]
    fn parse_timezone_defaults_to_utc_and_names_bad_values() {
        assert_eq!(parse_timezone("").unwrap(), Tz::UTC);
        assert_eq!(parse_timezone("  ").unwrap(), Tz::UTC);
        assert_eq!(parse_timezone("UTC").unwrap(), Tz::UTC);
        assert_eq!(parse_timezone("Europe/Berlin").unwrap(), Tz::Europe__Berlin);
        assert_eq!(parse_timezone(" Asia/Kolkata ").unwrap(), Tz::Asia__Kolkata);
        let e = parse_timezone("Nowhere/Land").unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown time zone `Nowhere/Land`: expected an IANA name such as `Europe/Berlin` or `UTC`"
        );
        let e = parse_timezone("america/new_york").unwrap_err();
        assert_eq!(
            e,
            CronError::UnknownTimezone {
                name: "america/new_york".into(),
                suggestion: Some("America/New_York".into())
            }
        );
    }

    // ---------------------------------------------------------------- parse successes

    #[test]
    fn names_are_case_insensitive_and_equal_numbers() {
        assert_eq!(
            parse("0 0 * jan,Feb,DEC mon-FRI"),
            parse("0 0 * 1,2,12 1-5")
        );
        assert_eq!(parse("0 0 * * sun"), parse("0 0 * * 0"));
        assert_eq!(parse("0 0 * * SAT"), parse("0 0 * * 6"));
    }

    #[test]
    fn sunday_is_both_zero_and_seven() {
        assert_eq!(parse("0 0 * * 7"), parse("0 0 * * 0"));
        assert_eq!(parse("0 0 * * 5-7"), parse("0 0 * * 0,5,6"));
        assert_eq!(parse("0 0 * * 0-7"), parse("0 0 * * 0-6"));
        // `a/n` and `*` stop at Saturday, like robfig.
        assert_eq!(parse("0 0 * * 1/3"), parse("0 0 * * 1,4"));
        assert_eq!(parse("0 0 * * */2"), parse("0 0 * * 0,2,4,6"));
    }

    #[test]
    fn steps_ranges_and_lists() {
        assert_eq!(parse("*/15 * * * *"), parse("0,15,30,45 * * * *"));
        assert_eq!(parse("5/20 * * * *"), parse("5,25,45 * * * *"));
        assert_eq!(parse("1-30/10 * * * *"), parse("1,11,21 * * * *"));
        assert_eq!(parse("0 */100 * * *"), parse("0 0 * * *"));
        assert_eq!(parse("  0   9 * *\tMON  "), parse("0 9 * * 1"));
        assert_eq!(parse("0 9 ? * MON"), parse("0 9 * * 1"));
        assert_eq!(parse("0 9 * * ?"), parse("0 9 * * *"));
    }

    #[test]
    fn timezone_prefix_is_recorded() {
        assert_eq!(
            parse("CRON_TZ=Asia/Tokyo 0 9 * * *").timezone_override(),
            Some(Tz::Asia__Tokyo)
        );
        assert_eq!(parse("TZ=UTC 0 9 * * *").timezone_override(), Some(Tz::UTC));
        assert_eq!(parse("0 9 * * *").timezone_override(), None);
        assert_eq!(
            "0 9 * * *".parse::<CronSchedule>().unwrap(),
            parse("0 9 * * *")
        );
    }

    // ---------------------------------------------------------------- next_after in UTC

    #[test]
    fn every_minute() {
        assert_eq!(
            next("* * * * *", "2026-01-01T10:00:30Z", Tz::UTC),
            Some(utc("2026-01-01T10:01:00Z"))
        );
        assert_eq!(
            next("* * * * *", "2026-12-31T23:59:00Z", Tz::UTC),
            Some(utc("2027-01-01T00:00:00Z"))
        );
    }

    #[test]
    fn every_five_minutes() {
        assert_eq!(
            series("*/5 * * * *", "2026-01-01T10:03:00Z", Tz::UTC, 3),
            utcs(&[
                "2026-01-01T10:05:00Z",
                "2026-01-01T10:10:00Z",
                "2026-01-01T10:15:00Z"
            ])
        );
        assert_eq!(
            next("*/5 * * * *", "2026-01-01T10:55:00Z", Tz::UTC),
            Some(utc("2026-01-01T11:00:00Z"))
        );
    }

    #[test]
    fn specific_time_daily() {
        assert_eq!(
            next("30 14 * * *", "2026-01-01T15:00:00Z", Tz::UTC),
            Some(utc("2026-01-02T14:30:00Z"))
        );
        assert_eq!(
            next("30 14 * * *", "2026-01-01T14:29:59Z", Tz::UTC),
            Some(utc("2026-01-01T14:30:00Z"))
        );
    }

    #[test]
    fn strictly_after_a_tick() {
        assert_eq!(
            next("0 9 * * *", "2026-01-01T09:00:00Z", Tz::UTC),
            Some(utc("2026-01-02T09:00:00Z"))
        );
        assert_eq!(
            next("0 9 * * *", "2026-01-01T08:59:59.999Z", Tz::UTC),
            Some(utc("2026-01-01T09:00:00Z"))
        );
        assert_eq!(
            next("0 9 * * *", "2026-01-01T09:00:00.001Z", Tz::UTC),
            Some(utc("2026-01-02T09:00:00Z"))
        );
    }

    #[test]
    fn weekday_names() {
        // 2026-01-01 is a Thursday.
        assert_eq!(
            series("0 9 * * MON,wed", "2026-01-01T00:00:00Z", Tz::UTC, 3),
            utcs(&[
                "2026-01-05T09:00:00Z",
                "2026-01-07T09:00:00Z",
                "2026-01-12T09:00:00Z"
            ])
        );
    }

    #[test]
    fn weekdays_skip_the_weekend() {
        // Friday 2026-01-02 after 09:00 -> Monday 2026-01-05.
        assert_eq!(
            next("0 9 * * 1-5", "2026-01-02T10:00:00Z", Tz::UTC),
            Some(utc("2026-01-05T09:00:00Z"))
        );
        assert_eq!(
            next("0 9 * * 1-5", "2026-01-02T08:00:00Z", Tz::UTC),
            Some(utc("2026-01-02T09:00:00Z"))
        );
    }

    #[test]
    fn restricted_day_of_month_and_week_use_or() {
        // Every 13th (2026-01-13 is a Tuesday) and every Friday.
        assert_eq!(
            series("0 0 13 * FRI", "2026-01-10T00:00:00Z", Tz::UTC, 3),
            utcs(&[
                "2026-01-13T00:00:00Z",
                "2026-01-16T00:00:00Z",
                "2026-01-23T00:00:00Z"
            ])
        );
        // `1-31` is restricted, so with a weekday the rule is OR: every day fires.
        assert_eq!(
            next("0 0 1-31 * 5", "2026-01-05T12:00:00Z", Tz::UTC),
            Some(utc("2026-01-06T00:00:00Z"))
        );
        // `*`, `?` and `*/1` leave day-of-month unrestricted: AND, so only Fridays.
        for expr in ["0 0 * * 5", "0 0 ? * 5", "0 0 */1 * 5"] {
            assert_eq!(
                next(expr, "2026-01-05T12:00:00Z", Tz::UTC),
                Some(utc("2026-01-09T00:00:00Z")),
                "{expr}"
            );
        }
        // Unrestricted weekday: day-of-month alone decides.
        assert_eq!(
            next("0 0 13 * *", "2026-01-05T12:00:00Z", Tz::UTC),
            Some(utc("2026-01-13T00:00:00Z"))
        );
    }

    #[test]
    fn day_31_skips_short_months() {
        assert_eq!(
            series("0 0 31 * *", "2026-01-31T00:00:00Z", Tz::UTC, 4),
            utcs(&[
                "2026-03-31T00:00:00Z",
                "2026-05-31T00:00:00Z",
                "2026-07-31T00:00:00Z",
                "2026-08-31T00:00:00Z"
            ])
        );
    }

    #[test]
    fn february_29_only_in_leap_years() {
        assert_eq!(
            series("0 12 29 2 *", "2026-01-01T00:00:00Z", Tz::UTC, 2),
            utcs(&["2028-02-29T12:00:00Z", "2032-02-29T12:00:00Z"])
        );
        // 2100 is not a leap year: the longest wait (8 years) is still inside the horizon.
        assert_eq!(
            next("0 12 29 2 *", "2096-03-01T00:00:00Z", Tz::UTC),
            Some(utc("2104-02-29T12:00:00Z"))
        );
    }

    #[test]
    fn impossible_dates_never_fire() {
        assert_eq!(next("0 0 30 2 *", "2026-01-01T00:00:00Z", Tz::UTC), None);
        assert_eq!(
            next("0 0 31 4,6,9,11 *", "2026-01-01T00:00:00Z", Tz::UTC),
            None
        );
    }

    #[test]
    fn extreme_instants_do_not_panic() {
        let schedule = parse("* * * * *");
        assert_eq!(schedule.next_after(DateTime::<Utc>::MAX_UTC, Tz::UTC), None);
        assert_eq!(
            schedule.next_after(DateTime::<Utc>::MAX_UTC, Tz::Pacific__Kiritimati),
            None
        );
        assert_eq!(
            schedule.next_after(DateTime::<Utc>::MIN_UTC, Tz::UTC),
            Some(DateTime::<Utc>::MIN_UTC + Duration::minutes(1))
        );
        // West of UTC the local time of MIN_UTC is not representable: no answer, no panic.
        assert_eq!(
            schedule.next_after(DateTime::<Utc>::MIN_UTC, Tz::America__New_York),
            None
        );
        assert_eq!(
            parse("0 0 1 1 *").next_after(utc("2026-01-01T00:00:00Z"), Tz::Asia__Kolkata),
            Some(utc("2026-12-31T18:30:00Z"))
        );
    }

    // ---------------------------------------------------------------- time zones

    #[test]
    fn cron_tz_prefix_overrides_the_argument() {
        assert_eq!(
            next(
                "CRON_TZ=Asia/Tokyo 0 9 * * *",
                "2026-01-01T01:00:00Z",
                Tz::America__New_York
            ),
            Some(utc("2026-01-02T00:00:00Z"))
        );
        assert_eq!(
            next("TZ=Asia/Tokyo 0 9 * * *", "2025-12-31T23:00:00Z", Tz::UTC),
            Some(utc("2026-01-01T00:00:00Z"))
        );
        // Without the prefix, the argument is used.
        assert_eq!(
            next("0 9 * * *", "2026-01-01T01:00:00Z", Tz::America__New_York),
            Some(utc("2026-01-01T14:00:00Z"))
        );
    }

    #[test]
    fn half_hour_zone_kolkata() {
        let tz = Tz::Asia__Kolkata;
        assert_eq!(
            series("0 9 * * *", "2026-01-01T00:00:00Z", tz, 2),
            utcs(&["2026-01-01T03:30:00Z", "2026-01-02T03:30:00Z"])
        );
        // Hourly in a +05:30 zone fires at half past every UTC hour.
        assert_eq!(
            series("0 * * * *", "2026-01-01T00:00:00Z", tz, 2),
            utcs(&["2026-01-01T00:30:00Z", "2026-01-01T01:30:00Z"])
        );
        // Midnight local on the 1st is 18:30 UTC the day before.
        assert_eq!(
            next("0 0 1 * *", "2026-01-15T00:00:00Z", tz),
            Some(utc("2026-01-31T18:30:00Z"))
        );
    }

    #[test]
    fn new_york_spring_forward_moves_skipped_time_to_the_change() {
        let tz = Tz::America__New_York;
        // 2026-03-08 02:00 EST -> 03:00 EDT (07:00Z). 02:30 does not exist: fire at 03:00 EDT.
        assert_eq!(
            series("30 2 * * *", "2026-03-07T12:00:00Z", tz, 3),
            utcs(&[
                "2026-03-08T07:00:00Z",
                "2026-03-09T06:30:00Z",
                "2026-03-10T06:30:00Z"
            ])
        );
        // Several skipped times and a real 03:00 activation fire once, at the change.
        assert_eq!(
            series("0,30 2,3 * * *", "2026-03-08T06:00:00Z", tz, 3),
            utcs(&[
                "2026-03-08T07:00:00Z",
                "2026-03-08T07:30:00Z",
                "2026-03-09T06:00:00Z"
            ])
        );
        // Every minute of the skipped hour collapses into one activation.
        assert_eq!(
            series("* 2 * * *", "2026-03-08T06:58:00Z", tz, 2),
            utcs(&["2026-03-08T07:00:00Z", "2026-03-09T06:00:00Z"])
        );
    }

    #[test]
    fn new_york_fall_back_fires_fixed_times_once() {
        let tz = Tz::America__New_York;
        // 2026-11-01 02:00 EDT -> 01:00 EST (06:00Z); 01:30 happens at 05:30Z and 06:30Z.
        assert_eq!(
            series("30 1 * * *", "2026-10-31T12:00:00Z", tz, 3),
            utcs(&[
                "2026-11-01T05:30:00Z",
                "2026-11-02T06:30:00Z",
                "2026-11-03T06:30:00Z"
            ])
        );
        // Asked from inside the second pass, the repeated time is not fired again.
        assert_eq!(
            next("30 1 * * *", "2026-11-01T06:10:00Z", tz),
            Some(utc("2026-11-02T06:30:00Z"))
        );
        // Named hours with a minute step: only the first pass of 01:xx fires.
        assert_eq!(
            series("*/20 1,2 * * *", "2026-11-01T05:30:00Z", tz, 3),
            utcs(&[
                "2026-11-01T05:40:00Z",
                "2026-11-01T07:00:00Z",
                "2026-11-01T07:20:00Z"
            ])
        );
    }

    #[test]
    fn new_york_interval_schedules_follow_elapsed_time() {
        let tz = Tz::America__New_York;
        // Fall back: the repeated 01:xx hour fires in both passes.
        assert_eq!(
            series("0 * * * *", "2026-11-01T04:30:00Z", tz, 4),
            utcs(&[
                "2026-11-01T05:00:00Z", // 01:00 EDT
                "2026-11-01T06:00:00Z", // 01:00 EST
                "2026-11-01T07:00:00Z", // 02:00 EST
                "2026-11-01T08:00:00Z"
            ])
        );
        // Asked from inside the first pass, the second pass's earlier wall-clock times are
        // still found.
        assert_eq!(
            series("10,25 * * * *", "2026-11-01T05:20:00Z", tz, 4),
            utcs(&[
                "2026-11-01T05:25:00Z", // 01:25 EDT
                "2026-11-01T06:10:00Z", // 01:10 EST
                "2026-11-01T06:25:00Z", // 01:25 EST
                "2026-11-01T07:10:00Z"  // 02:10 EST
            ])
        );
        // Spring forward: 02:30 does not exist and is not moved.
        assert_eq!(
            series("30 * * * *", "2026-03-08T06:00:00Z", tz, 2),
            utcs(&["2026-03-08T06:30:00Z", "2026-03-08T07:30:00Z"])
        );
        assert_eq!(
            series("*/15 * * * *", "2026-03-08T06:40:00Z", tz, 2),
            utcs(&["2026-03-08T06:45:00Z", "2026-03-08T07:00:00Z"])
        );
    }

    #[test]
    fn berlin_spring_forward_and_fall_back() {
        let tz = Tz::Europe__Berlin;
        // 2026-03-29 02:00 CET -> 03:00 CEST at 01:00Z.
        assert_eq!(
            series("30 2 * * *", "2026-03-28T12:00:00Z", tz, 2),
            utcs(&["2026-03-29T01:00:00Z", "2026-03-30T00:30:00Z"])
        );
        assert_eq!(
            next("0 3 * * *", "2026-03-28T12:00:00Z", tz),
            Some(utc("2026-03-29T01:00:00Z"))
        );
        // 2026-10-25 03:00 CEST -> 02:00 CET at 01:00Z: 02:30 fires once, at 00:30Z.
        assert_eq!(
            series("30 2 * * *", "2026-10-24T12:00:00Z", tz, 2),
            utcs(&["2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"])
        );
        // Interval schedule: both passes of 02:xx.
        assert_eq!(
            series("*/30 * * * *", "2026-10-25T00:00:00Z", tz, 4),
            utcs(&[
                "2026-10-25T00:30:00Z", // 02:30 CEST
                "2026-10-25T01:00:00Z", // 02:00 CET
                "2026-10-25T01:30:00Z", // 02:30 CET
                "2026-10-25T02:00:00Z"  // 03:00 CET
            ])
        );
        for instant in series("*/30 * * * *", "2026-10-25T00:00:00Z", tz, 4) {
            assert_eq!(local_of(instant, tz).time().minute() % 30, 0);
        }
    }

    #[test]
    fn sydney_southern_hemisphere() {
        let tz = Tz::Australia__Sydney;
        // DST ends 2026-04-05 03:00 AEDT -> 02:00 AEST (16:00Z on the 4th): 02:30 fires once,
        // at its first (AEDT) occurrence.
        assert_eq!(
            series("30 2 * * *", "2026-04-04T00:00:00Z", tz, 2),
            utcs(&["2026-04-04T15:30:00Z", "2026-04-05T16:30:00Z"])
        );
        // DST starts 2026-10-04 02:00 AEST -> 03:00 AEDT (16:00Z on the 3rd).
        assert_eq!(
            series("30 2 * * *", "2026-10-03T00:00:00Z", tz, 2),
            utcs(&["2026-10-03T16:00:00Z", "2026-10-04T15:30:00Z"])
        );
        // Midsummer (January) is UTC+11.
        assert_eq!(
            next("0 9 * * *", "2026-01-10T00:00:00Z", tz),
            Some(utc("2026-01-10T22:00:00Z"))
        );
    }

    #[test]
    fn lord_howe_half_hour_shift() {
        let tz = Tz::Australia__Lord_Howe;
        // 2026-10-04 02:00 +10:30 -> 02:30 +11 (15:30Z on the 3rd): 02:15 moves to 02:30.
        assert_eq!(
            series("15 2 * * *", "2026-10-03T00:00:00Z", tz, 2),
            utcs(&["2026-10-03T15:30:00Z", "2026-10-04T15:15:00Z"])
        );
        // 02:45 still exists that day and fires normally.
        assert_eq!(
            next("45 2 * * *", "2026-10-03T00:00:00Z", tz),
            Some(utc("2026-10-03T15:45:00Z"))
        );
    }

    #[test]
    fn skipped_midnight_in_santiago() {
        let tz = Tz::America__Santiago;
        // Chile starts DST at local midnight: 2026-09-06 00:00 -04 -> 01:00 -03 (04:00Z).
        let change = utc("2026-09-06T04:00:00Z");
        assert_eq!(
            local_of(change, tz),
            NaiveDate::from_ymd_opt(2026, 9, 6)
                .unwrap()
                .and_hms_opt(1, 0, 0)
                .unwrap()
        );
        assert_eq!(next("0 0 * * *", "2026-09-05T12:00:00Z", tz), Some(change));
        assert_eq!(next("0 0 6 9 *", "2026-09-01T00:00:00Z", tz), Some(change));
    }

    #[test]
    fn skipped_day_in_samoa() {
        let tz = Tz::Pacific__Apia;
        // 2011-12-29 24:00 -10 became 2011-12-31 00:00 +14: December 30 never happened there.
        // Its 09:00 fires once at the first instant after the gap.
        assert_eq!(
            series("0 9 * * *", "2011-12-29T20:00:00Z", tz, 2),
            utcs(&["2011-12-30T10:00:00Z", "2011-12-30T19:00:00Z"])
        );
        // A schedule only for December 30 (or Fridays, OR rule) still fires exactly once.
        assert_eq!(
            next("0 12 30 12 *", "2011-12-29T20:00:00Z", tz),
            Some(utc("2011-12-30T10:00:00Z"))
        );
    }

    // ---------------------------------------------------------------- outside 1970-2100

    // The cron crate only searches 1970-2100; these years are searched on a stand-in year.

    #[test]
    fn stand_in_years_have_the_same_calendar() {
        let mut checked = 0;
        for year in (1000..1970).chain(2101..3200).chain([-262_000, 262_000]) {
            let stand_in = stand_in_year(year).unwrap();
            assert!((2001..=2028).contains(&stand_in), "{year} -> {stand_in}");
            for ordinal in 1..=366 {
                let real = NaiveDate::from_yo_opt(year, ordinal);
                let other = NaiveDate::from_yo_opt(stand_in, ordinal);
                assert_eq!(
                    real.map(|d| (d.month(), d.day(), d.weekday())),
                    other.map(|d| (d.month(), d.day(), d.weekday())),
                    "{year} day {ordinal} vs {stand_in}"
                );
                checked += 1;
            }
        }
        assert!(checked > 700_000, "only {checked} days");
        for year in [1970, 2026, 2100] {
            assert_eq!(stand_in_year(year), Some(year));
        }
    }

    #[test]
    fn years_past_2100_and_before_1970() {
        // 2200-01-06 is the first Monday of 2200.
        assert_eq!(
            series("0 9 * * MON", "2200-01-01T00:00:00Z", Tz::UTC, 2),
            utcs(&["2200-01-06T09:00:00Z", "2200-01-13T09:00:00Z"])
        );
        // Day OR in 2300: the 13th (a Monday) and every Friday.
        assert_eq!(
            series("0 0 13 * FRI", "2300-01-01T00:00:00Z", Tz::UTC, 4),
            utcs(&[
                "2300-01-05T00:00:00Z",
                "2300-01-12T00:00:00Z",
                "2300-01-13T00:00:00Z",
                "2300-01-19T00:00:00Z"
            ])
        );
        // 1900 was not a leap year.
        assert_eq!(
            series("0 0 29 2 *", "1890-01-01T00:00:00Z", Tz::UTC, 3),
            utcs(&[
                "1892-02-29T00:00:00Z",
                "1896-02-29T00:00:00Z",
                "1904-02-29T00:00:00Z"
            ])
        );
        // A year-end crossing from a stand-in year into the next.
        assert_eq!(
            series("0 0 1 1 *", "2150-06-01T00:00:00Z", Tz::UTC, 2),
            utcs(&["2151-01-01T00:00:00Z", "2152-01-01T00:00:00Z"])
        );
    }

    #[test]
    fn dst_policy_applies_before_1970() {
        let tz = Tz::America__New_York;
        // 1960-04-24 02:00 EST -> 03:00 EDT (07:00Z): 02:30 fires at the change.
        assert_eq!(
            series("30 2 * * *", "1960-04-23T12:00:00Z", tz, 2),
            utcs(&["1960-04-24T07:00:00Z", "1960-04-25T06:30:00Z"])
        );
        // 1960-10-30 02:00 EDT -> 01:00 EST (06:00Z): 01:30 fires once, an hourly schedule in
        // both passes.
        assert_eq!(
            series("30 1 * * *", "1960-10-29T12:00:00Z", tz, 2),
            utcs(&["1960-10-30T05:30:00Z", "1960-10-31T06:30:00Z"])
        );
        assert_eq!(
            series("0 * * * *", "1960-10-30T04:30:00Z", tz, 3),
            utcs(&[
                "1960-10-30T05:00:00Z",
                "1960-10-30T06:00:00Z",
                "1960-10-30T07:00:00Z"
            ])
        );
    }

    // ---------------------------------------------------------------- brute-force oracle

    /// Independent, minute-by-minute implementation of the documented semantics. Valid for
    /// zones whose offsets are whole minutes (all zones since the 1970s).
    fn oracle_fires(schedule: &CronSchedule, t: NaiveDateTime, tz: Tz) -> bool {
        let local = |u: NaiveDateTime| u + Duration::seconds(offset_seconds(tz, u));
        let here = local(t);
        if schedule.is_interval() {
            return schedule.matches_local(here);
        }
        if schedule.matches_local(here)
            && tz
                .from_local_datetime(&here)
                .earliest()
                .map(|d| d.naive_utc())
                == Some(t)
        {
            return true;
        }
        // Clocks jumped forward exactly at t: the wall-clock range [before + 1s, here) was
        // skipped.
        let skipped_from = local(t - Duration::seconds(1)) + Duration::seconds(1);
        let mut m = skipped_from;
        while m < here {
            if schedule.matches_local(m) {
                return true;
            }
            m += Duration::minutes(1);
        }
        false
    }

    fn oracle_next(
        schedule: &CronSchedule,
        after: DateTime<Utc>,
        tz: Tz,
        window_minutes: u32,
    ) -> Option<DateTime<Utc>> {
        let tz = schedule.timezone_override().unwrap_or(tz);
        let start = after.naive_utc();
        let mut t = start.with_second(0).unwrap().with_nanosecond(0).unwrap();
        for _ in 0..=window_minutes {
            if t > start && oracle_fires(schedule, t, tz) {
                return Some(t.and_utc());
            }
            t += Duration::minutes(1);
        }
        None
    }

    /// Instants (to the hour) around which a zone's offset changes during `year`.
    fn transitions(tz: Tz, year: i32) -> Vec<NaiveDateTime> {
        let mut t = NaiveDate::from_ymd_opt(year, 1, 1)
            .unwrap()
            .and_time(NaiveTime::MIN);
        let end = NaiveDate::from_ymd_opt(year + 1, 1, 1)
            .unwrap()
            .and_time(NaiveTime::MIN);
        let mut out = Vec::new();
        let mut previous = offset_seconds(tz, t);
        while t < end {
            t += Duration::hours(1);
            let offset = offset_seconds(tz, t);
            if offset != previous {
                out.push(t);
                previous = offset;
            }
        }
        out
    }

    #[test]
    fn matches_brute_force_around_every_2026_transition() {
        let zones = [
            Tz::America__New_York,
            Tz::Europe__Berlin,
            Tz::Australia__Sydney,
            Tz::Australia__Lord_Howe,
            Tz::America__Santiago,
            Tz::Pacific__Chatham,
            Tz::America__St_Johns,
            Tz::Africa__Casablanca,
            Tz::America__Havana,
        ];
        let schedules = [
            "*/15 * * * *",
            "30 * * * *",
            "30 2 * * *",
            "0 0 * * *",
            "0 1,2 * * *",
            "*/7 0-3 * * *",
            "45 */2 * * *",
            "* 2 * * *",
            "0,30 2,3 * * *",
        ]
        .map(parse);
        let mut checked = 0;
        for tz in zones {
            let found = transitions(tz, 2026);
            assert!(!found.is_empty(), "{tz} has no 2026 transition");
            for change in found {
                let mut after = change - Duration::hours(3);
                while after < change + Duration::hours(3) {
                    for schedule in &schedules {
                        let expected = oracle_next(schedule, after.and_utc(), tz, 26 * 60);
                        let actual = schedule.next_after(after.and_utc(), tz);
                        if expected.is_some() {
                            assert_eq!(actual, expected, "{schedule:?} after {after} in {tz}");
                            checked += 1;
                        }
                    }
                    after += Duration::minutes(23);
                }
            }
        }
        assert!(checked > 1000, "only {checked} comparisons");
    }

    // ---------------------------------------------------------------- property tests

    const ZONES: &[Tz] = &[
        Tz::UTC,
        Tz::Europe__Berlin,
        Tz::Europe__London,
        Tz::America__New_York,
        Tz::America__Santiago,
        Tz::America__St_Johns,
        Tz::America__Havana,
        Tz::Australia__Sydney,
        Tz::Australia__Lord_Howe,
        Tz::Asia__Kolkata,
        Tz::Asia__Kathmandu,
        Tz::Pacific__Chatham,
        Tz::Pacific__Apia,
        Tz::Africa__Casablanca,
        Tz::Asia__Tehran,
    ];

    fn field(
        min: u32,
        max: u32,
        open_max: u32,
        names: &'static [&'static str],
        base: u32,
    ) -> BoxedStrategy<String> {
        let width = open_max - min + 1;
        let ordered = move |(a, b): (u32, u32)| (a.min(b), a.max(b));
        let value = prop_oneof![
            4 => (min..=max).prop_map(|v| v.to_string()),
            1 => (0..names.len().max(1)).prop_map(move |i| match names.get(i) {
                Some(name) if i % 2 == 0 => name.to_uppercase(),
                Some(name) => (*name).to_string(),
                None => min.to_string(),
            }),
        ];
        let _ = base;
        prop_oneof![
            4 => Just("*".to_string()),
            2 => value.clone(),
            2 => (1..=width).prop_map(|n| format!("*/{n}")),
            1 => (min..=max, min..=max).prop_map(ordered).prop_map(|(a, b)| format!("{a}-{b}")),
            1 => ((min..=max, min..=max).prop_map(ordered), 1u32..=12).prop_map(|((a, b), n)| format!("{a}-{b}/{n}")),
            1 => (min..=max, 1u32..=12).prop_map(|(a, n)| format!("{a}/{n}")),
            1 => prop::collection::vec(value, 1..4).prop_map(|v| v.join(",")),
        ]
        .boxed()
    }

    fn schedule_text() -> impl Strategy<Value = String> {
        (
            field(0, 59, 59, &[], 0),
            field(0, 23, 23, &[], 0),
            field(1, 31, 31, &[], 1),
            field(1, 12, 12, &MONTH_NAMES, 1),
            field(0, 7, 6, &WEEKDAY_NAMES, 0),
        )
            .prop_map(|(m, h, d, mo, w)| format!("{m} {h} {d} {mo} {w}"))
    }

    /// Schedules that fire often enough for the brute-force oracle to find them.
    fn frequent_schedule_text() -> impl Strategy<Value = String> {
        (
            field(0, 59, 59, &[], 0),
            field(0, 23, 23, &[], 0),
            prop_oneof![3 => Just("*".to_string()), 1 => field(1, 31, 31, &[], 1)],
            field(0, 7, 6, &WEEKDAY_NAMES, 0),
        )
            .prop_map(|(m, h, d, w)| format!("{m} {h} {d} * {w}"))
    }

    fn instant() -> impl Strategy<Value = DateTime<Utc>> {
        let uniform =
            (1_577_836_800i64..2_082_758_400).prop_map(|s| DateTime::from_timestamp(s, 0).unwrap());
        // Nights of the months in which most zones change their clocks.
        let near_changes = (
            2020i32..2036,
            prop::sample::select(vec![3u32, 4, 9, 10, 11]),
            1u32..=28,
            0u32..86_400,
        )
            .prop_map(|(y, m, d, s)| {
                NaiveDate::from_ymd_opt(y, m, d)
                    .unwrap()
                    .and_time(NaiveTime::MIN)
                    .and_utc()
                    + Duration::seconds(i64::from(s))
            });
        prop_oneof![uniform, near_changes]
    }

    /// When `instant` is the moment clocks jumped forward, the skipped wall-clock range.
    fn skipped_range(instant: DateTime<Utc>, tz: Tz) -> Option<(NaiveDateTime, NaiveDateTime)> {
        let before = local_of(instant - Duration::seconds(1), tz) + Duration::seconds(1);
        let here = local_of(instant, tz);
        (before < here).then_some((before, here))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        #[test]
        fn next_is_later_whole_minute_and_matches(
            text in schedule_text(),
            after in instant(),
            tz in prop::sample::select(ZONES),
        ) {
            let schedule = CronSchedule::parse(&text).unwrap();
            if let Some(first) = schedule.next_after(after, tz) {
                prop_assert!(first > after);
                let local = local_of(first, tz);
                prop_assert_eq!(local.second(), 0);
                prop_assert_eq!(first.second(), 0);
                prop_assert_eq!(first.nanosecond(), 0);
                if !schedule.matches_local(local) {
                    // Only the documented gap adjustment may fire at a non-matching time.
                    prop_assert!(!schedule.is_interval(), "{} at {}", text, first);
                    let (from, to) = skipped_range(first, tz).ok_or_else(|| {
                        TestCaseError::fail(format!("{text}: {first} matches nothing and is no clock change"))
                    })?;
                    let mut m = from.with_second(0).unwrap();
                    let mut hit = false;
                    while m < to {
                        hit |= m >= from && schedule.matches_local(m);
                        m += Duration::minutes(1);
                    }
                    prop_assert!(hit, "{} at {}: no skipped time matches", text, first);
                }
                if let Some(second) = schedule.next_after(first, tz) {
                    prop_assert!(second > first);
                }
            }
        }

        #[test]
        fn agrees_with_brute_force(
            text in frequent_schedule_text(),
            after in instant(),
            tz in prop::sample::select(ZONES),
        ) {
            let schedule = CronSchedule::parse(&text).unwrap();
            let window = 8 * 24 * 60;
            let expected = oracle_next(&schedule, after, tz, window);
            let actual = schedule.next_after(after, tz);
            match expected {
                Some(_) => prop_assert_eq!(actual, expected, "{} after {} in {}", text, after, tz),
                None => prop_assert!(
                    actual.is_none_or(|a| a > after + Duration::minutes(i64::from(window))),
                    "{} after {} in {}: got {:?}", text, after, tz, actual
                ),
            }
        }

        #[test]
        fn utc_schedules_have_no_dst_surprises(
            text in schedule_text(),
            after in instant(),
        ) {
            let schedule = CronSchedule::parse(&text).unwrap();
            if let Some(first) = schedule.next_after(after, Tz::UTC) {
                prop_assert!(schedule.matches_local(first.naive_utc()));
                // Nothing fires in between: brute-force the first day at least.
                let mut t = after.naive_utc().with_second(0).unwrap().with_nanosecond(0).unwrap() + Duration::minutes(1);
                let stop = first.naive_utc().min(t + Duration::days(1));
                while t < stop {
                    prop_assert!(!schedule.matches_local(t), "{} fires at {} before {}", text, t, first);
                    t += Duration::minutes(1);
                }
            }
        }

        #[test]
        fn parse_never_panics(text in "\\PC{0,40}") {
            let _ = CronSchedule::parse(&text);
        }

        #[test]
        fn parse_never_panics_on_cron_like_text(text in "[0-9a-zA-Z*/,?@ =_-]{0,30}") {
            if let Ok(schedule) = CronSchedule::parse(&text) {
                let _ = schedule.next_after(utc("2026-01-01T00:00:00Z"), Tz::Europe__Berlin);
            }
        }
    }
}
