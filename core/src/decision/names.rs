//! Kubernetes-safe names for the objects the operator creates.
//!
//! Upstream built child names by plain concatenation (`<job>-<task>`, `round-<n>-<job>`, …) with
//! no sanitising and no length check (upstream's Go operator), so a long or
//! oddly spelled parent made object creation fail. Every child name goes through this module
//! instead: a valid input is kept as it is; otherwise it is lowercased, characters outside
//! `[a-z0-9-]` become `-`, runs of `-` collapse, leading and trailing `-` are trimmed, and a name
//! that is still too long is truncated and given `-` plus 8 hex digits of a stable hash of the
//! **full original input**, so two long inputs sharing a prefix do not collide.
//!
//! Everything here is pure and deterministic: the same input always gives the same name, across
//! processes and versions (the hash is a fixed FNV-1a, not `std`'s randomly seeded hasher).

/// Maximum length of a DNS-1123 label (`metadata.name` of Services, label values, hostnames).
pub const DNS1123_LABEL_MAX: usize = 63;
/// Maximum length of a DNS-1123 subdomain (`metadata.name` of most objects, including CRs).
pub const DNS1123_SUBDOMAIN_MAX: usize = 253;
/// Maximum length of a label value.
pub const LABEL_VALUE_MAX: usize = 63;

/// Length of the `-xxxxxxxx` hash suffix appended to truncated names.
const HASH_SUFFIX_LEN: usize = 9;

/// Whether `s` is a DNS-1123 label: 1..=63 characters of `[a-z0-9-]`, starting and ending with
/// an alphanumeric character. Used to validate names that must also work as label values.
pub fn is_dns1123_label(s: &str) -> bool {
    !s.is_empty() && s.len() <= DNS1123_LABEL_MAX && is_label_segment(s)
}

/// Whether `s` is a DNS-1123 subdomain: at most 253 characters, dot-separated segments each made
/// of `[a-z0-9-]` and starting and ending with an alphanumeric character (the same rule as
/// Kubernetes' `IsDNS1123Subdomain`, which does not limit a single segment to 63 characters).
pub fn is_dns1123_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= DNS1123_SUBDOMAIN_MAX && s.split('.').all(is_label_segment)
}

/// Whether `s` is a valid label value: empty, or at most 63 characters of `[A-Za-z0-9._-]`
/// starting and ending with an alphanumeric character.
pub fn is_label_value(s: &str) -> bool {
    if s.is_empty() {
        return true;
    }
    let bytes = s.as_bytes();
    s.len() <= LABEL_VALUE_MAX
        && bytes.iter().all(|b| is_label_value_byte(*b))
        && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
        && bytes.last().is_some_and(u8::is_ascii_alphanumeric)
}

/// Name of a child object, `<parent>-<suffix>`, made into a valid DNS-1123 subdomain (≤ 253).
///
/// Use it for `metadata.name` of objects whose names only need to be subdomains, e.g. Tasks
/// created from a PropellerJob. Either part may be empty; the separator is then dropped.
pub fn child_name(parent: &str, suffix: &str) -> String {
    let joined = join(parent, suffix);
    if is_dns1123_subdomain(&joined) {
        return joined;
    }
    fit(&joined, DNS1123_SUBDOMAIN_MAX)
}

/// Like [`child_name`] but the result is a DNS-1123 label (≤ 63), for names that are also
/// stored as label values or that Kubernetes limits to 63 characters.
pub fn child_label_name(parent: &str, suffix: &str) -> String {
    let joined = join(parent, suffix);
    if is_dns1123_label(&joined) {
        return joined;
    }
    fit(&joined, DNS1123_LABEL_MAX)
}

/// `s` made into a valid label value (≤ 63, `[A-Za-z0-9._-]`, alphanumeric at both ends; case
/// is kept). Valid values are returned unchanged; an input with nothing usable gives `""`, which
/// is a valid (empty) label value.
pub fn label_value(s: &str) -> String {
    if is_label_value(s) {
        return s.to_owned();
    }
    let mut out = String::with_capacity(s.len().min(LABEL_VALUE_MAX * 2));
    for c in s.chars() {
        let mapped = if c.is_ascii() && is_label_value_byte(c as u8) {
            c
        } else {
            '-'
        };
        if mapped == '-' && out.ends_with('-') {
            continue;
        }
        out.push(mapped);
    }
    let trimmed = out.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    if trimmed.len() <= LABEL_VALUE_MAX {
        return trimmed.to_owned();
    }
    // ASCII only from here on, so byte slicing is on character boundaries.
    let keep = trimmed
        .get(..LABEL_VALUE_MAX - HASH_SUFFIX_LEN)
        .unwrap_or(trimmed)
        .trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
    with_hash(keep, s)
}

/// Name of the Task created for spec entry `spec_name` of PropellerJob `job` (`<job>-<name>`).
///
/// The PropellerJob reconciler must use this same function when it rewrites `dependsOn`
/// entries, so that dependencies name the Tasks that really exist (upstream bug 41).
pub fn job_task_name(job: &str, spec_name: &str) -> String {
    child_name(job, spec_name)
}

/// Name of round `round` of FederatedJob `job` (`round-<n>-<job>`).
///
/// Limited to 63 characters because the round name is also stored as the `training-round` label
/// value on its Tasks and is the prefix of their names.
pub fn training_round_name(round: u32, job: &str) -> String {
    child_label_name(&format!("round-{round}"), job)
}

/// Name of the Task of TrainingRound `round` for participant `participant` (`<round>-<participant>`).
pub fn round_task_name(round: &str, participant: &str) -> String {
    child_name(round, participant)
}

/// Name of the Deployment that runs k8s proplet `proplet` (`<proplet>-proplet`).
///
/// Limited to 63 characters because the name is also used as the Deployment's selector label
/// value.
pub fn proplet_deployment_name(proplet: &str) -> String {
    child_label_name(proplet, "proplet")
}

/// Stable 32-bit FNV-1a digest of `s` as 8 lowercase hex digits.
///
/// A hand-written FNV-1a (64-bit, folded to 32) keeps the names identical across Rust versions
/// and platforms, which `std`'s `DefaultHasher` does not promise.
pub fn short_hash(s: &str) -> String {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = OFFSET;
    for b in s.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(PRIME);
    }
    let folded = (h >> 32) ^ (h & 0xffff_ffff);
    format!("{folded:08x}")
}

fn join(parent: &str, suffix: &str) -> String {
    match (parent.is_empty(), suffix.is_empty()) {
        (_, true) => parent.to_owned(),
        (true, false) => suffix.to_owned(),
        (false, false) => format!("{parent}-{suffix}"),
    }
}

/// Sanitises `original` to `[a-z0-9-]` and fits it into `max` characters.
fn fit(original: &str, max: usize) -> String {
    let clean = sanitize(original);
    if clean.is_empty() {
        // Nothing usable survived: still produce a valid, input-specific name.
        return format!("x-{}", short_hash(original));
    }
    if clean.len() <= max {
        return clean;
    }
    // `clean` is ASCII, so byte slicing is on character boundaries.
    let keep = clean
        .get(..max.saturating_sub(HASH_SUFFIX_LEN))
        .unwrap_or(&clean)
        .trim_end_matches('-');
    with_hash(keep, original)
}

/// `prefix-<hash of original>`, or just the hash digits prefixed by `x-` if `prefix` is empty.
fn with_hash(prefix: &str, original: &str) -> String {
    if prefix.is_empty() {
        format!("x-{}", short_hash(original))
    } else {
        format!("{prefix}-{}", short_hash(original))
    }
}

/// Lowercase, map everything outside `[a-z0-9]` to `-`, collapse runs of `-`, trim `-`.
fn sanitize(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        let mapped = if c.is_ascii_alphanumeric() {
            c.to_ascii_lowercase()
        } else {
            '-'
        };
        if mapped == '-' && (out.is_empty() || out.ends_with('-')) {
            continue;
        }
        out.push(mapped);
    }
    while out.ends_with('-') {
        out.pop();
    }
    out
}

fn is_label_segment(s: &str) -> bool {
    let bytes = s.as_bytes();
    bytes
        .iter()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
        && bytes.last().is_some_and(u8::is_ascii_alphanumeric)
}

fn is_label_value_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn validators_accept_and_reject_the_right_strings() {
        assert!(is_dns1123_label("a"));
        assert!(is_dns1123_label("job-1"));
        assert!(is_dns1123_label("xn--80ak6aa92e"));
        assert!(is_dns1123_label(&"a".repeat(63)));
        assert!(!is_dns1123_label(&"a".repeat(64)));
        assert!(!is_dns1123_label(""));
        assert!(!is_dns1123_label("-a"));
        assert!(!is_dns1123_label("a-"));
        assert!(!is_dns1123_label("A"));
        assert!(!is_dns1123_label("a.b"));
        assert!(!is_dns1123_label("a_b"));

        assert!(is_dns1123_subdomain("a.b-c.d"));
        assert!(is_dns1123_subdomain(&"a".repeat(253)));
        assert!(!is_dns1123_subdomain(&"a".repeat(254)));
        assert!(!is_dns1123_subdomain("a..b"));
        assert!(!is_dns1123_subdomain(".a"));
        assert!(!is_dns1123_subdomain("a.-b"));
        assert!(!is_dns1123_subdomain(""));

        assert!(is_label_value(""));
        assert!(is_label_value("My_Value.1-x"));
        assert!(is_label_value(&"A".repeat(63)));
        assert!(!is_label_value(&"A".repeat(64)));
        assert!(!is_label_value("_a"));
        assert!(!is_label_value("a."));
        assert!(!is_label_value("a b"));
        assert!(!is_label_value("é"));
    }

    #[test]
    fn valid_names_are_unchanged() {
        assert_eq!(child_name("job", "task-a"), "job-task-a");
        assert_eq!(child_name("my.app", "x"), "my.app-x");
        assert_eq!(child_label_name("a--b", "c"), "a--b-c");
        assert_eq!(job_task_name("pipeline", "extract"), "pipeline-extract");
        assert_eq!(training_round_name(3, "fl-mnist"), "round-3-fl-mnist");
        assert_eq!(
            round_task_name("round-3-fl-mnist", "edge-1"),
            "round-3-fl-mnist-edge-1"
        );
        assert_eq!(proplet_deployment_name("worker"), "worker-proplet");
        assert_eq!(label_value("Edge_1.a"), "Edge_1.a");
    }

    #[test]
    fn upstream_style_sanitising() {
        // Upstream lowercased and turned `_` and spaces into `-`; we do the same and more.
        assert_eq!(job_task_name("Pipeline", "My_Task"), "pipeline-my-task");
        assert_eq!(job_task_name("pipeline", "step two"), "pipeline-step-two");
        assert_eq!(child_name("a", "__b__"), "a-b");
        assert_eq!(child_name("-a-", "b!"), "a-b");
        assert_eq!(child_name("é", "b"), "b");
        assert_eq!(child_name("", "Task"), "task");
        assert_eq!(child_name("job", ""), "job");
        // A dot is fine in a subdomain but not in a label.
        assert_eq!(child_label_name("my.app", "x"), "my-app-x");
    }

    #[test]
    fn empty_or_unusable_input_gives_a_hash_name() {
        let n = child_name("", "");
        assert!(is_dns1123_subdomain(&n), "{n}");
        assert_eq!(n, format!("x-{}", short_hash("")));
        let a = child_label_name("___", "!!!");
        let b = child_label_name("???", "***");
        assert!(is_dns1123_label(&a) && is_dns1123_label(&b));
        assert_ne!(a, b);
        assert_eq!(label_value("!!!"), "");
        assert_eq!(label_value("__x__"), "x");
    }

    #[test]
    fn long_names_are_truncated_with_hash_of_full_input() {
        let parent = "p".repeat(60);
        let a = child_label_name(&parent, "alpha");
        let b = child_label_name(&parent, "beta");
        assert_eq!(a.len(), 63);
        assert_eq!(b.len(), 63);
        assert_ne!(a, b, "shared prefix must not collide");
        assert!(a.starts_with(&"p".repeat(54)));
        assert_eq!(&a[54..55], "-");
        assert_eq!(&a[55..], short_hash(&format!("{parent}-alpha")));

        let long = "x".repeat(300);
        let n = child_name(&long, "task");
        assert_eq!(n.len(), 253);
        assert!(is_dns1123_subdomain(&n));
        assert!(n.ends_with(&short_hash(&format!("{long}-task"))));

        // Truncation never leaves a `--` before the hash.
        let dashy = format!("{}-{}", "a".repeat(53), "b".repeat(20));
        let n = child_label_name(&dashy, "");
        assert!(is_dns1123_label(&n), "{n}");
        assert!(!n.contains("--"), "{n}");
        assert_eq!(n, format!("{}-{}", "a".repeat(53), short_hash(&dashy)));

        let v = label_value(&"V".repeat(100));
        assert_eq!(v.len(), 63);
        assert!(v.starts_with(&"V".repeat(54)));
        assert!(is_label_value(&v));
    }

    #[test]
    fn short_hash_is_stable() {
        // Pinned values: changing the hash would rename existing children.
        // FNV-1a 64 test vectors: "" = cbf29ce484222325, "a" = af63dc4c8601ec8c, folded.
        assert_eq!(short_hash(""), "4fd0bfc1");
        assert_eq!(short_hash("a"), "296230c0");
        assert_ne!(short_hash("a"), short_hash("b"));
        assert_eq!(short_hash("abc").len(), 8);
    }

    proptest! {
        #[test]
        fn child_names_are_always_valid(parent in "\\PC{0,300}", suffix in "\\PC{0,80}") {
            let n = child_name(&parent, &suffix);
            prop_assert!(is_dns1123_subdomain(&n), "{:?}", n);
            prop_assert_eq!(&n, &child_name(&parent, &suffix));
            let l = child_label_name(&parent, &suffix);
            prop_assert!(is_dns1123_label(&l), "{:?}", l);
            prop_assert_eq!(&l, &child_label_name(&parent, &suffix));
        }

        #[test]
        fn label_values_are_always_valid(s in "\\PC{0,120}") {
            let v = label_value(&s);
            prop_assert!(is_label_value(&v), "{:?}", v);
            prop_assert_eq!(&v, &label_value(&s));
        }

        #[test]
        fn short_valid_names_are_kept(parent in "[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?",
                                      suffix in "[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?") {
            let joined = format!("{parent}-{suffix}");
            prop_assert_eq!(child_name(&parent, &suffix), joined.clone());
            prop_assert_eq!(child_label_name(&parent, &suffix), joined.clone());
            prop_assert_eq!(label_value(&joined), joined);
        }

        #[test]
        fn sanitised_names_are_idempotent(parent in "[a-zA-Z0-9_ .-]{0,100}") {
            let once = child_label_name(&parent, "");
            prop_assert_eq!(child_label_name(&once, ""), once.clone());
        }
    }
}
