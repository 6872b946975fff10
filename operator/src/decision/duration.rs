//! Go-style durations (`1h30m`, `10s`, `500ms`) as the CRDs accept them.

use std::time::Duration;

/// Parses a duration matching the CRDs' `DURATION_PATTERN`: one or more `<number><unit>`
/// pairs with units `ns`, `us`/`µs`, `ms`, `s`, `m`, `h`.
pub fn parse_go_duration(text: &str) -> Result<Duration, String> {
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
mod tests {
    use super::*;

    #[test]
    fn go_durations_parse() {
        assert_eq!(parse_go_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_go_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_go_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_go_duration("1.5s"), Ok(Duration::from_millis(1500)));
        for bad in ["", "10", "s", "10x", "1h-5m", "ten s"] {
            assert!(parse_go_duration(bad).is_err(), "{bad:?} accepted");
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
