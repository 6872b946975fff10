//! The message of a task no proplet can take: why each proplet was passed over, grouped by
//! reason, bounded in size.

use super::{Exclusion, ExclusionGroup};

/// Longest exclusion message; proplet names and label keys can be long.
pub(super) const MAX_MESSAGE_LEN: usize = 1024;
/// Names listed per exclusion group before "and N more".
const MAX_NAMES_PER_GROUP: usize = 5;
/// Exclusion groups listed before "and N more reasons".
const MAX_GROUPS: usize = 6;

pub(super) fn render_no_candidates(
    namespace: &str,
    total: usize,
    groups: &[ExclusionGroup],
) -> String {
    let mut parts: Vec<String> = groups.iter().take(MAX_GROUPS).map(render_group).collect();
    if groups.len() > MAX_GROUPS {
        let rest: usize = groups
            .iter()
            .skip(MAX_GROUPS)
            .map(|g| g.proplets.len())
            .sum();
        parts.push(format!("{rest} excluded for other reasons"));
    }
    let plural = if total == 1 { "proplet" } else { "proplets" };
    let msg = format!(
        "no proplet matches: {total} {plural} in namespace {namespace}: {}",
        parts.join(", ")
    );
    truncate(msg, MAX_MESSAGE_LEN)
}

fn render_group(g: &ExclusionGroup) -> String {
    let n = g.proplets.len();
    let names = summarise_names(&g.proplets);
    let (s, is_are, has_have) = if n == 1 {
        ("s", "is", "has")
    } else {
        ("", "are", "have")
    };
    match &g.reason {
        Exclusion::NotRunning(phase) => format!("{n} not Running ({names} {is_are} {phase})"),
        Exclusion::AwaitingApproval => format!(
            "{n} await{s} approval ({names}; `propeller approve proplet/NAME`, or remove the label {})",
            crate::decision::enrolment::APPROVAL_LABEL
        ),
        Exclusion::NotRequested { wanted } => {
            format!("{n} not the requested propletId {wanted} ({names})")
        }
        Exclusion::WrongType { wanted } => {
            format!("{n} not of preferred type {wanted} ({names})")
        }
        Exclusion::LabelMismatch { key, value } => {
            format!("{n} lack{s} label {key}={value} ({names})")
        }
        Exclusion::NoDeviceType => format!("{n} {has_have} no device type ({names})"),
        Exclusion::DeviceTypeNotAllowed { device_type } => {
            format!("{n} {has_have} device type {device_type}, not in matchDeviceTypes ({names})")
        }
        Exclusion::MissingCapability(cap) => {
            format!("{n} lack{s} capability {cap} ({names})")
        }
        Exclusion::CannotAttest => format!(
            "{n} cannot run encrypted tasks: no attester announced, their agents need PROPLET_KBS_URI and PROPLET_ATTESTER ({names})"
        ),
        Exclusion::AtCapacity { capacity } => {
            format!("{n} at capacity, {capacity} task(s) each ({names})")
        }
    }
}

fn summarise_names(names: &[String]) -> String {
    let shown = names
        .iter()
        .take(MAX_NAMES_PER_GROUP)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    match names.len().saturating_sub(MAX_NAMES_PER_GROUP) {
        0 => shown,
        more => format!("{shown} and {more} more"),
    }
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() <= max {
        return s;
    }
    let mut cut = max.saturating_sub('…'.len_utf8());
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    s.truncate(cut);
    s.push('…');
    s
}
