//! Which of the five fields of an expression a value or an error belongs to.

use std::fmt;

use super::{MONTH_NAMES, WEEKDAY_NAMES};

/// Names one of the five fields so parse errors can say where the problem is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CronField {
    /// First field, 0-59.
    Minute,
    /// Second field, 0-23.
    Hour,
    /// Third field, 1-31.
    DayOfMonth,
    /// Fourth field, 1-12 or `JAN`-`DEC`.
    Month,
    /// Fifth field, 0-7 or `SUN`-`SAT` (0 and 7 are Sunday).
    DayOfWeek,
}

impl CronField {
    /// Smallest and largest value accepted in a list entry or explicit range.
    pub(super) fn bounds(self) -> (u32, u32) {
        match self {
            CronField::Minute => (0, 59),
            CronField::Hour => (0, 23),
            CronField::DayOfMonth => (1, 31),
            CronField::Month => (1, 12),
            CronField::DayOfWeek => (0, 7),
        }
    }

    /// Upper end used by `*` and `a/n`; day-of-week stops at Saturday as in robfig.
    pub(super) fn open_max(self) -> u32 {
        match self {
            CronField::DayOfWeek => 6,
            other => other.bounds().1,
        }
    }

    /// Accepted names and the value of the first name.
    pub(super) fn names(self) -> (&'static [&'static str], u32) {
        match self {
            CronField::Month => (&MONTH_NAMES, 1),
            CronField::DayOfWeek => (&WEEKDAY_NAMES, 0),
            _ => (&[], 0),
        }
    }

    pub(super) fn allows_question_mark(self) -> bool {
        matches!(self, CronField::DayOfMonth | CronField::DayOfWeek)
    }

    /// What a value in this field may look like, for error messages.
    pub(super) fn value_hint(self) -> &'static str {
        match self {
            CronField::Month => "a number or a month name (JAN-DEC)",
            CronField::DayOfWeek => "a number or a weekday name (SUN-SAT)",
            _ => "a number",
        }
    }
}

impl fmt::Display for CronField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CronField::Minute => "minute",
            CronField::Hour => "hour",
            CronField::DayOfMonth => "day-of-month",
            CronField::Month => "month",
            CronField::DayOfWeek => "day-of-week",
        })
    }
}
