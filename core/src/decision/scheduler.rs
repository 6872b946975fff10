//! Proplet selection for a Task: filter, score, pick, as upstream's Go operator does, with the
//! fixes below.
//!
//! Fixes relative to upstream (upstream's Go operator):
//! * candidates are sorted by name before scoring, so the choice never depends on cache order;
//! * the round-robin position is kept **per namespace** in an explicit [`RoundRobinState`] that
//!   the caller owns and may persist, instead of one unlocked process-wide counter;
//! * "right after the last selected" means the first candidate whose name sorts after the last
//!   selected name, so the rotation stays fair when proplets join or leave;
//! * `matchDeviceTypes` and `matchCapabilities` apply to every proplet: one without a device type
//!   or capabilities (every k8s proplet) does not match a selector that asks for them;
//! * priority really orders dispatch ([`dispatch_order`]) instead of being a constant score;
//! * "no candidates" says which proplets were excluded and why.
//!
//! Everything here is pure. The reconciler converts Proplet and Task objects into the small
//! views below.

use std::cmp::{Ordering, Reverse};
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

pub use crate::crd::proplet::{PropletPhase, PropletType};
pub use crate::crd::task::PreferredPropletType as PreferredType;

mod explain;
use explain::render_no_candidates;
#[cfg(test)]
use explain::MAX_MESSAGE_LEN;

fn accepts(preferred: PreferredType, t: PropletType) -> bool {
    match preferred {
        PreferredType::Any => true,
        PreferredType::K8s => t == PropletType::K8s,
        PreferredType::External => t == PropletType::External,
    }
}

/// What the scheduler needs to know about one Proplet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CandidateProplet {
    /// `metadata.name`; unique within a namespace, and the tie-breaker everywhere.
    pub name: String,
    /// `metadata.namespace`; proplets of other namespaces are ignored.
    pub namespace: String,
    /// `status.phase`.
    pub phase: PropletPhase,
    /// `spec.type`.
    pub proplet_type: PropletType,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// `spec.external.deviceType`; `None` for k8s proplets and external ones without it.
    pub device_type: Option<String>,
    /// `spec.external.capabilities`; empty for k8s proplets.
    pub capabilities: Vec<String>,
    /// `status.metadata.attester`: the TEE attester its agent announced, if it can run
    /// encrypted tasks.
    pub attester: Option<String>,
    /// Tasks currently scheduled or running on this proplet (used by least-loaded scoring).
    pub active_tasks: u32,
    /// `spec.capacity`: the most tasks it takes at once (`None`: no limit).
    pub capacity: Option<u32>,
}

/// A Task's `spec.propletSelector` plus `spec.preferredPropletType`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SelectorView {
    /// Exact proplet name; `None` or an empty string means "any".
    pub proplet_id: Option<String>,
    /// Every label must be present with exactly this value.
    pub match_labels: BTreeMap<String, String>,
    /// If not empty, the proplet's device type must be one of these.
    pub match_device_types: Vec<String>,
    /// Every listed capability must be advertised by the proplet.
    pub match_capabilities: Vec<String>,
    /// Restricts the proplet type unless `Any`.
    pub preferred_type: PreferredType,
    /// The task is encrypted: only a proplet whose agent announced an attester can get its
    /// key.
    pub needs_attester: bool,
}

/// The selector rules an index of proplets by name and label can answer: every proplet the
/// selector admits is found under these keys ([`admits`] checks the other rules on each).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IndexKeys<'s> {
    /// No rule on the name or the labels: any proplet of the namespace.
    Any,
    /// Only the proplet of this name.
    Name(&'s str),
    /// Only proplets carrying every one of these labels with these values.
    Labels(Vec<(&'s str, &'s str)>),
}

impl SelectorView {
    /// Which index keys can find the proplets this selector admits; the rules are those of
    /// [`admits`] (the name pin first, then `matchLabels`).
    pub fn index_keys(&self) -> IndexKeys<'_> {
        if let Some(name) = self.pinned_name() {
            return IndexKeys::Name(name);
        }
        if self.match_labels.is_empty() {
            return IndexKeys::Any;
        }
        IndexKeys::Labels(
            self.match_labels
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect(),
        )
    }

    /// The proplet name the selector pins, if any (an empty `propletId` pins none).
    fn pinned_name(&self) -> Option<&str> {
        self.proplet_id.as_deref().filter(|id| !id.is_empty())
    }
}

/// Why a proplet was not a candidate: the first selector rule it failed, in the order
/// phase, propletId, type, labels, device type, capabilities, attester, capacity.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Exclusion {
    /// Its phase is not `Running`.
    NotRunning(PropletPhase),
    /// It enrolled with a token that asks for approval, and nobody approved it yet.
    AwaitingApproval,
    /// The selector pins another proplet by name.
    NotRequested {
        /// The pinned name.
        wanted: String,
    },
    /// Its type is not the preferred one.
    WrongType {
        /// The preferred type.
        wanted: PropletType,
    },
    /// A required label is absent or has another value.
    LabelMismatch {
        /// Label key.
        key: String,
        /// Required value.
        value: String,
    },
    /// The selector asks for device types and the proplet has none.
    NoDeviceType,
    /// Its device type is not in the selector's list.
    DeviceTypeNotAllowed {
        /// The proplet's device type.
        device_type: String,
    },
    /// A required capability is missing.
    MissingCapability(String),
    /// The task is encrypted and its agent announced no attester.
    CannotAttest,
    /// It already holds as many tasks as its `spec.capacity`.
    AtCapacity {
        /// Its capacity.
        capacity: u32,
    },
}

/// Proplets excluded for the same reason, named in name order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExclusionGroup {
    /// The shared reason.
    pub reason: Exclusion,
    /// Names of the excluded proplets, sorted.
    pub proplets: Vec<String>,
}

/// Why no proplet could be selected. Both cases mean "leave the Task pending and retry".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// There are no Proplets at all in the Task's namespace.
    #[error("no proplets exist in namespace {namespace}")]
    NoProplet {
        /// The Task's namespace.
        namespace: String,
    },
    /// Proplets exist but none satisfies the selector; the message explains every exclusion.
    #[error("{}", render_no_candidates(.namespace, *.total, .groups))]
    NoCandidates {
        /// The Task's namespace.
        namespace: String,
        /// How many proplets the namespace has.
        total: usize,
        /// Exclusion reasons with the proplets they apply to, in reason order.
        groups: Vec<ExclusionGroup>,
    },
}

/// How candidates are scored (the `--scheduler` flag).
///
/// Dispatch *order* is independent of this: pending Tasks are always dispatched in
/// [`dispatch_order`] (highest priority first). The flag value `priority` (upstream's name for
/// its no-op priority scheduler) is accepted and means exactly that: priority-ordered dispatch,
/// which always happens, with least-loaded scoring, so it parses to [`Strategy::LeastLoaded`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Strategy {
    /// Upstream's default: the candidate after the last selected one scores 0.1, others 1.0.
    #[default]
    RoundRobin,
    /// Score = number of active tasks; the least busy proplet wins.
    LeastLoaded,
}

/// The `--scheduler` value was none of `round-robin`, `least-loaded`, `priority`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown scheduler {0:?}: expected round-robin, least-loaded or priority")]
pub struct UnknownStrategy(pub String);

/// Case-insensitive; surrounding whitespace and an empty value (flag left unset) give the
/// default, round-robin. Unlike upstream, an unknown value is an error, not round-robin.
impl FromStr for Strategy {
    type Err = UnknownStrategy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "round-robin" | "roundrobin" | "" => Ok(Strategy::RoundRobin),
            "least-loaded" | "leastloaded" | "priority" => Ok(Strategy::LeastLoaded),
            _ => Err(UnknownStrategy(s.to_owned())),
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Strategy::RoundRobin => "round-robin",
            Strategy::LeastLoaded => "least-loaded",
        })
    }
}

/// Round-robin position: the last proplet selected in each namespace.
///
/// Owned by the caller and serialisable so it can be persisted; [`select_proplet`] updates it.
/// A caller that may not commit a selection (for example before the Task's status write
/// succeeds) can select on a clone and keep the clone only on success.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RoundRobinState {
    /// Namespace → name of the proplet selected last there.
    #[serde(default)]
    pub last_selected: BTreeMap<String, String>,
}

impl RoundRobinState {
    /// Remembers that `proplet` was just selected in `namespace`.
    pub fn record(&mut self, namespace: &str, proplet: &str) {
        self.last_selected
            .insert(namespace.to_owned(), proplet.to_owned());
    }
}

/// A candidate with its score (lower is better).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scored<'a> {
    /// The candidate.
    pub proplet: &'a CandidateProplet,
    /// Its score.
    pub score: f64,
}

/// Round-robin score of the next candidate in line.
pub const NEXT_IN_LINE_SCORE: f64 = 0.1;
/// Round-robin score of every other candidate.
pub const DEFAULT_SCORE: f64 = 1.0;

/// What the selector rules look at: a [`CandidateProplet`], or a Proplet object itself
/// (which lets a driver pass the scheduler only the proplets that could take a task).
pub trait Schedulable {
    /// `metadata.name`.
    fn name(&self) -> &str;
    /// `status.phase`.
    fn phase(&self) -> PropletPhase;
    /// `spec.type`.
    fn proplet_type(&self) -> PropletType;
    /// The value of label `key`.
    fn label(&self, key: &str) -> Option<&str>;
    /// `spec.external.deviceType`.
    fn device_type(&self) -> Option<&str>;
    /// Whether `spec.external.capabilities` lists `capability`.
    fn has_capability(&self, capability: &str) -> bool;
    /// `status.metadata.attester`.
    fn attester(&self) -> Option<&str>;
    /// Its capacity, when the tasks it holds already fill it (as far as is known: a Proplet
    /// object alone does not know its load).
    fn full(&self) -> Option<u32> {
        None
    }
}

impl Schedulable for CandidateProplet {
    fn name(&self) -> &str {
        &self.name
    }
    fn phase(&self) -> PropletPhase {
        self.phase
    }
    fn proplet_type(&self) -> PropletType {
        self.proplet_type
    }
    fn label(&self, key: &str) -> Option<&str> {
        self.labels.get(key).map(String::as_str)
    }
    fn device_type(&self) -> Option<&str> {
        self.device_type.as_deref()
    }
    fn has_capability(&self, capability: &str) -> bool {
        self.capabilities.iter().any(|c| c == capability)
    }
    fn attester(&self) -> Option<&str> {
        self.attester.as_deref()
    }
    fn full(&self) -> Option<u32> {
        self.capacity.filter(|c| self.active_tasks >= *c)
    }
}

impl Schedulable for crate::crd::proplet::Proplet {
    fn name(&self) -> &str {
        self.metadata.name.as_deref().unwrap_or_default()
    }
    fn phase(&self) -> PropletPhase {
        self.status.as_ref().map(|s| s.phase).unwrap_or_default()
    }
    fn proplet_type(&self) -> PropletType {
        self.spec.type_
    }
    fn label(&self, key: &str) -> Option<&str> {
        self.metadata.labels.as_ref()?.get(key).map(String::as_str)
    }
    fn device_type(&self) -> Option<&str> {
        self.spec.external.as_ref()?.device_type.as_deref()
    }
    fn has_capability(&self, capability: &str) -> bool {
        self.spec
            .external
            .as_ref()
            .is_some_and(|e| e.capabilities.iter().any(|c| c == capability))
    }
    fn attester(&self) -> Option<&str> {
        self.status.as_ref()?.metadata.as_ref()?.attester.as_deref()
    }
}

/// The rule a proplet fails, borrowing from the selector: finding it copies nothing.
enum Failure<'s> {
    NotRunning(PropletPhase),
    AwaitingApproval,
    NotRequested(&'s str),
    WrongType(PropletType),
    LabelMismatch(&'s str, &'s str),
    NoDeviceType,
    DeviceTypeNotAllowed,
    MissingCapability(&'s str),
    CannotAttest,
    AtCapacity(u32),
}

fn first_failure<'s>(
    proplet: &impl Schedulable,
    selector: &'s SelectorView,
) -> Option<Failure<'s>> {
    let phase = proplet.phase();
    if phase != PropletPhase::Running {
        return Some(Failure::NotRunning(phase));
    }
    if proplet.label(super::enrolment::APPROVAL_LABEL) == Some(super::enrolment::APPROVAL_PENDING) {
        return Some(Failure::AwaitingApproval);
    }
    if let Some(wanted) = selector.pinned_name() {
        if proplet.name() != wanted {
            return Some(Failure::NotRequested(wanted));
        }
    }
    if !accepts(selector.preferred_type, proplet.proplet_type()) {
        let wanted = match selector.preferred_type {
            PreferredType::External => PropletType::External,
            PreferredType::K8s | PreferredType::Any => PropletType::K8s,
        };
        return Some(Failure::WrongType(wanted));
    }
    for (key, value) in &selector.match_labels {
        if proplet.label(key) != Some(value.as_str()) {
            return Some(Failure::LabelMismatch(key, value));
        }
    }
    if !selector.match_device_types.is_empty() {
        match proplet.device_type() {
            None => return Some(Failure::NoDeviceType),
            Some(d) if !selector.match_device_types.iter().any(|t| t == d) => {
                return Some(Failure::DeviceTypeNotAllowed)
            }
            Some(_) => {}
        }
    }
    if let Some(c) = selector
        .match_capabilities
        .iter()
        .find(|c| !proplet.has_capability(c))
    {
        return Some(Failure::MissingCapability(c));
    }
    if selector.needs_attester && proplet.attester().is_none() {
        return Some(Failure::CannotAttest);
    }
    proplet.full().map(Failure::AtCapacity)
}

/// Whether `proplet` satisfies every rule of `selector` (see [`exclusion`]); copies nothing.
pub fn admits(proplet: &impl Schedulable, selector: &SelectorView) -> bool {
    first_failure(proplet, selector).is_none()
}

/// The first selector rule `proplet` fails, or `None` if it is a candidate.
pub fn exclusion(proplet: &impl Schedulable, selector: &SelectorView) -> Option<Exclusion> {
    Some(match first_failure(proplet, selector)? {
        Failure::NotRunning(phase) => Exclusion::NotRunning(phase),
        Failure::AwaitingApproval => Exclusion::AwaitingApproval,
        Failure::NotRequested(wanted) => Exclusion::NotRequested {
            wanted: wanted.to_owned(),
        },
        Failure::WrongType(wanted) => Exclusion::WrongType { wanted },
        Failure::LabelMismatch(key, value) => Exclusion::LabelMismatch {
            key: key.to_owned(),
            value: value.to_owned(),
        },
        Failure::NoDeviceType => Exclusion::NoDeviceType,
        Failure::DeviceTypeNotAllowed => Exclusion::DeviceTypeNotAllowed {
            device_type: proplet.device_type().unwrap_or_default().to_owned(),
        },
        Failure::MissingCapability(capability) => {
            Exclusion::MissingCapability(capability.to_owned())
        }
        Failure::CannotAttest => Exclusion::CannotAttest,
        Failure::AtCapacity(capacity) => Exclusion::AtCapacity { capacity },
    })
}

/// Filter phase: the proplets of `namespace` that satisfy `selector`, sorted by name.
///
/// Proplets of other namespaces are ignored. Errors say whether the namespace has no proplets
/// at all or which rule excluded each of them.
pub fn filter_candidates<'a>(
    namespace: &str,
    proplets: &'a [CandidateProplet],
    selector: &SelectorView,
) -> Result<Vec<&'a CandidateProplet>, ScheduleError> {
    let mut in_ns: Vec<&CandidateProplet> = proplets
        .iter()
        .filter(|p| p.namespace == namespace)
        .collect();
    if in_ns.is_empty() {
        return Err(ScheduleError::NoProplet {
            namespace: namespace.to_owned(),
        });
    }
    let mut candidates: Vec<&CandidateProplet> = in_ns
        .iter()
        .copied()
        .filter(|p| admits(*p, selector))
        .collect();
    candidates.sort_by(|a, b| a.name.cmp(&b.name));
    if candidates.is_empty() {
        // Why each was passed over, in name order: gathered only when nothing fits.
        in_ns.sort_by(|a, b| a.name.cmp(&b.name));
        let mut excluded: BTreeMap<Exclusion, Vec<String>> = BTreeMap::new();
        for p in &in_ns {
            if let Some(reason) = exclusion(*p, selector) {
                excluded.entry(reason).or_default().push(p.name.clone());
            }
        }
        return Err(ScheduleError::NoCandidates {
            namespace: namespace.to_owned(),
            total: in_ns.len(),
            groups: excluded
                .into_iter()
                .map(|(reason, proplets)| ExclusionGroup { reason, proplets })
                .collect(),
        });
    }
    Ok(candidates)
}

/// Score phase: one score per candidate, in name order (lower is better).
///
/// Round-robin: the first candidate whose name sorts after the namespace's last selected proplet
/// (wrapping around to the first; the first if nothing was selected yet) scores
/// [`NEXT_IN_LINE_SCORE`], all others [`DEFAULT_SCORE`]. Least-loaded: the number of active tasks.
pub fn score<'a>(
    strategy: Strategy,
    namespace: &str,
    candidates: &[&'a CandidateProplet],
    state: &RoundRobinState,
) -> Vec<Scored<'a>> {
    let mut sorted: Vec<&CandidateProplet> = candidates.to_vec();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    match strategy {
        Strategy::RoundRobin => {
            let next = state
                .last_selected
                .get(namespace)
                .and_then(|last| sorted.iter().position(|p| p.name.as_str() > last.as_str()))
                .unwrap_or(0);
            sorted
                .into_iter()
                .enumerate()
                .map(|(i, proplet)| Scored {
                    proplet,
                    score: if i == next {
                        NEXT_IN_LINE_SCORE
                    } else {
                        DEFAULT_SCORE
                    },
                })
                .collect()
        }
        Strategy::LeastLoaded => sorted
            .into_iter()
            .map(|proplet| Scored {
                proplet,
                score: f64::from(proplet.active_tasks),
            })
            .collect(),
    }
}

/// Pick phase: the lowest score wins; equal scores go to the smallest name.
pub fn pick<'a>(scored: &[Scored<'a>]) -> Option<&'a CandidateProplet> {
    scored
        .iter()
        .min_by(|a, b| {
            a.score
                .total_cmp(&b.score)
                .then_with(|| a.proplet.name.cmp(&b.proplet.name))
        })
        .map(|s| s.proplet)
}

/// Selects the proplet for a Task in `namespace`: filter, score, pick, and record the choice in
/// `state`. The result does not depend on the order of `proplets`.
///
/// With least-loaded scoring and several Tasks dispatched from one snapshot, the caller should
/// bump the chosen proplet's `active_tasks` between calls, or every Task goes to the same one.
pub fn select_proplet<'a>(
    strategy: Strategy,
    namespace: &str,
    proplets: &'a [CandidateProplet],
    selector: &SelectorView,
    state: &mut RoundRobinState,
) -> Result<&'a CandidateProplet, ScheduleError> {
    let candidates = filter_candidates(namespace, proplets, selector)?;
    let scored = score(strategy, namespace, &candidates, state);
    // `candidates` is not empty, so a pick always exists; the fallback is unreachable.
    let chosen = pick(&scored).ok_or_else(|| ScheduleError::NoCandidates {
        namespace: namespace.to_owned(),
        total: 0,
        groups: Vec::new(),
    })?;
    state.record(namespace, &chosen.name);
    Ok(chosen)
}

/// A pending Task as priority dispatch sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingTask {
    /// `metadata.name`; final tie-breaker.
    pub name: String,
    /// `spec.priority`, 0..=100 (higher = more urgent; 0 is a real, lowest priority). Values
    /// above 100 are treated as 100.
    pub priority: u8,
    /// Creation time in milliseconds (`metadata.creationTimestamp`): older first within a priority.
    pub created_millis: i64,
}

/// The default `spec.priority`.
pub const DEFAULT_PRIORITY: u8 = 50;

/// The order in which pending Tasks should be dispatched: highest priority first, oldest first
/// within a priority, then by name. Unlike upstream, priority 0 is kept as the lowest priority.
pub fn dispatch_order(tasks: &[PendingTask]) -> Vec<&PendingTask> {
    let mut order: Vec<&PendingTask> = tasks.iter().collect();
    order.sort_by(|a, b| dispatch_cmp(a, b));
    order
}

fn dispatch_cmp(a: &PendingTask, b: &PendingTask) -> Ordering {
    let key = |t: &PendingTask| (Reverse(t.priority.min(100)), t.created_millis);
    key(a).cmp(&key(b)).then_with(|| a.name.cmp(&b.name))
}

#[cfg(test)]
mod tests {
    use super::Strategy;
    use super::*;
    use proptest::prelude::*;
    use proptest::strategy::Strategy as PropStrategy;

    fn proplet(name: &str) -> CandidateProplet {
        CandidateProplet {
            name: name.to_owned(),
            namespace: "edge".to_owned(),
            phase: PropletPhase::Running,
            proplet_type: PropletType::External,
            labels: BTreeMap::new(),
            device_type: None,
            capabilities: Vec::new(),
            attester: None,
            active_tasks: 0,
            capacity: None,
        }
    }

    fn with(name: &str, f: impl FnOnce(&mut CandidateProplet)) -> CandidateProplet {
        let mut p = proplet(name);
        f(&mut p);
        p
    }

    fn selected(
        strategy: Strategy,
        proplets: &[CandidateProplet],
        selector: &SelectorView,
        state: &mut RoundRobinState,
    ) -> Result<String, ScheduleError> {
        select_proplet(strategy, "edge", proplets, selector, state).map(|p| p.name.clone())
    }

    fn candidate_names(proplets: &[CandidateProplet], selector: &SelectorView) -> Vec<String> {
        filter_candidates("edge", proplets, selector)
            .map(|c| c.iter().map(|p| p.name.clone()).collect())
            .unwrap_or_default()
    }

    #[test]
    fn only_running_proplets_are_candidates() {
        let ps = [
            with("a", |p| p.phase = PropletPhase::Initializing),
            proplet("b"),
            with("c", |p| p.phase = PropletPhase::Offline),
        ];
        assert_eq!(candidate_names(&ps, &SelectorView::default()), vec!["b"]);
    }

    #[test]
    fn proplet_id_is_an_exact_name_match() {
        let ps = [proplet("edge-1"), proplet("edge-10"), proplet("edge-2")];
        let sel = SelectorView {
            proplet_id: Some("edge-1".into()),
            ..Default::default()
        };
        assert_eq!(candidate_names(&ps, &sel), vec!["edge-1"]);
        let empty = SelectorView {
            proplet_id: Some(String::new()),
            ..Default::default()
        };
        assert_eq!(candidate_names(&ps, &empty).len(), 3);
    }

    #[test]
    fn match_labels_need_every_key_with_equal_value() {
        let ps = [
            with("a", |p| {
                p.labels = BTreeMap::from([
                    ("zone".into(), "north".into()),
                    ("tier".into(), "gold".into()),
                ])
            }),
            with("b", |p| {
                p.labels = BTreeMap::from([("zone".into(), "north".into())])
            }),
            with("c", |p| {
                p.labels = BTreeMap::from([
                    ("zone".into(), "south".into()),
                    ("tier".into(), "gold".into()),
                ])
            }),
        ];
        let sel = SelectorView {
            match_labels: BTreeMap::from([
                ("zone".into(), "north".into()),
                ("tier".into(), "gold".into()),
            ]),
            ..Default::default()
        };
        assert_eq!(candidate_names(&ps, &sel), vec!["a"]);
    }

    #[test]
    fn match_device_types_excludes_proplets_without_device_type() {
        let ps = [
            with("esp", |p| p.device_type = Some("esp32".into())),
            with("pi", |p| p.device_type = Some("raspberry-pi".into())),
            with("k8s", |p| p.proplet_type = PropletType::K8s),
            proplet("bare-external"),
        ];
        let sel = SelectorView {
            match_device_types: vec!["esp32".into(), "jetson".into()],
            ..Default::default()
        };
        assert_eq!(candidate_names(&ps, &sel), vec!["esp"]);
        // Without the rule every running proplet matches.
        assert_eq!(candidate_names(&ps, &SelectorView::default()).len(), 4);
    }

    #[test]
    fn match_capabilities_need_all_of_them() {
        let ps = [
            with("both", |p| {
                p.capabilities = vec!["gpu".into(), "camera".into()]
            }),
            with("gpu", |p| p.capabilities = vec!["gpu".into()]),
            with("k8s", |p| p.proplet_type = PropletType::K8s),
        ];
        let sel = SelectorView {
            match_capabilities: vec!["camera".into(), "gpu".into()],
            ..Default::default()
        };
        assert_eq!(candidate_names(&ps, &sel), vec!["both"]);
    }

    #[test]
    fn preferred_type_filters_unless_any() {
        let ps = [
            with("k", |p| p.proplet_type = PropletType::K8s),
            proplet("x"),
        ];
        let sel = |t| SelectorView {
            preferred_type: t,
            ..Default::default()
        };
        assert_eq!(candidate_names(&ps, &sel(PreferredType::K8s)), vec!["k"]);
        assert_eq!(
            candidate_names(&ps, &sel(PreferredType::External)),
            vec!["x"]
        );
        assert_eq!(
            candidate_names(&ps, &sel(PreferredType::Any)),
            vec!["k", "x"]
        );
    }

    #[test]
    fn other_namespaces_are_ignored() {
        let ps = [with("a", |p| p.namespace = "other".into())];
        let mut st = RoundRobinState::default();
        assert_eq!(
            selected(Strategy::RoundRobin, &ps, &SelectorView::default(), &mut st),
            Err(ScheduleError::NoProplet {
                namespace: "edge".into()
            })
        );
        assert_eq!(
            ScheduleError::NoProplet {
                namespace: "edge".into()
            }
            .to_string(),
            "no proplets exist in namespace edge"
        );
        assert_eq!(st, RoundRobinState::default(), "no pick, no state change");
    }

    #[test]
    fn encrypted_tasks_go_only_to_proplets_that_announced_an_attester() {
        let ps = [
            with("tee", |p| p.attester = Some("sample".into())),
            proplet("plain"),
        ];
        let sel = SelectorView {
            needs_attester: true,
            ..Default::default()
        };
        assert_eq!(candidate_names(&ps, &sel), vec!["tee"]);
        assert_eq!(
            candidate_names(&ps, &SelectorView::default()),
            vec!["plain", "tee"]
        );
        let pinned = SelectorView {
            proplet_id: Some("plain".into()),
            ..sel
        };
        let err = filter_candidates("edge", &ps, &pinned).unwrap_err();
        assert!(
            err.to_string()
                .contains("1 cannot run encrypted tasks: no attester announced"),
            "{err}"
        );
    }

    #[test]
    fn no_candidates_message_explains_each_group() {
        let ps = [
            with("edge-1", |p| p.capabilities = vec!["camera".into()]),
            with("edge-2", |p| p.phase = PropletPhase::Offline),
            proplet("edge-3"),
        ];
        let sel = SelectorView {
            match_capabilities: vec!["gpu".into()],
            ..Default::default()
        };
        let err = filter_candidates("edge", &ps, &sel).unwrap_err();
        assert_eq!(
            err.to_string(),
            "no proplet matches: 3 proplets in namespace edge: \
             1 not Running (edge-2 is Offline), 2 lack capability gpu (edge-1, edge-3)"
        );
        let ScheduleError::NoCandidates { total, groups, .. } = err else {
            panic!("expected NoCandidates");
        };
        assert_eq!(total, 3);
        assert_eq!(
            groups,
            vec![
                ExclusionGroup {
                    reason: Exclusion::NotRunning(PropletPhase::Offline),
                    proplets: vec!["edge-2".into()]
                },
                ExclusionGroup {
                    reason: Exclusion::MissingCapability("gpu".into()),
                    proplets: vec!["edge-1".into(), "edge-3".into()]
                },
            ]
        );
    }

    #[test]
    fn no_candidates_message_covers_every_reason() {
        let ps = [
            with("a", |p| p.phase = PropletPhase::Initializing),
            with("b", |p| p.proplet_type = PropletType::K8s),
            with("c", |p| {
                p.labels = BTreeMap::from([("zone".into(), "x".into())])
            }),
            with("d", |p| {
                p.labels = BTreeMap::from([("zone".into(), "north".into())])
            }),
            with("e", |p| {
                p.labels = BTreeMap::from([("zone".into(), "north".into())]);
                p.device_type = Some("pi".into());
            }),
        ];
        let sel = SelectorView {
            preferred_type: PreferredType::External,
            match_labels: BTreeMap::from([("zone".into(), "north".into())]),
            match_device_types: vec!["esp32".into()],
            ..Default::default()
        };
        assert_eq!(
            filter_candidates("edge", &ps, &sel)
                .unwrap_err()
                .to_string(),
            "no proplet matches: 5 proplets in namespace edge: \
             1 not Running (a is Initializing), \
             1 not of preferred type external (b), \
             1 lacks label zone=north (c), \
             1 has no device type (d), \
             1 has device type pi, not in matchDeviceTypes (e)"
        );
        let pinned = SelectorView {
            proplet_id: Some("zz".into()),
            ..Default::default()
        };
        assert_eq!(
            filter_candidates("edge", &ps[1..3], &pinned)
                .unwrap_err()
                .to_string(),
            "no proplet matches: 2 proplets in namespace edge: \
             2 not the requested propletId zz (b, c)"
        );
    }

    #[test]
    fn no_candidates_message_is_bounded() {
        let ps: Vec<CandidateProplet> = (0..40)
            .map(|i| {
                with(&format!("p{i:02}-{}", "x".repeat(200)), |p| {
                    p.phase = PropletPhase::Offline
                })
            })
            .collect();
        let msg = filter_candidates("edge", &ps, &SelectorView::default())
            .unwrap_err()
            .to_string();
        assert!(msg.len() <= MAX_MESSAGE_LEN, "{}", msg.len());
        assert!(msg.starts_with(
            "no proplet matches: 40 proplets in namespace edge: 40 not Running (p00-"
        ));
        assert!(msg.ends_with('…'));

        let short: Vec<CandidateProplet> = (0..8)
            .map(|i| with(&format!("p{i}"), |p| p.phase = PropletPhase::Offline))
            .collect();
        assert_eq!(
            filter_candidates("edge", &short, &SelectorView::default())
                .unwrap_err()
                .to_string(),
            "no proplet matches: 8 proplets in namespace edge: \
             8 not Running (p0, p1, p2, p3, p4 and 3 more are Offline)"
        );

        // Many distinct reasons: only MAX_GROUPS are spelled out.
        let keys: Vec<String> = (0..9).map(|i| format!("k{i}")).collect();
        let labelled: Vec<CandidateProplet> = (0..9)
            .map(|i| {
                with(&format!("c{i}"), |p| {
                    // c{i} has every label except k{i}.
                    p.labels = keys
                        .iter()
                        .filter(|k| **k != format!("k{i}"))
                        .map(|k| (k.clone(), "v".to_owned()))
                        .collect()
                })
            })
            .collect();
        let sel = SelectorView {
            match_labels: keys.iter().map(|k| (k.clone(), "v".to_owned())).collect(),
            ..Default::default()
        };
        let msg = filter_candidates("edge", &labelled, &sel)
            .unwrap_err()
            .to_string();
        assert!(
            msg.ends_with("1 lacks label k5=v (c5), 3 excluded for other reasons"),
            "{msg}"
        );
    }

    #[test]
    fn round_robin_cycles_fairly_over_rounds() {
        let ps = [proplet("c"), proplet("a"), proplet("b")];
        let mut st = RoundRobinState::default();
        let picks: Vec<String> = (0..9)
            .map(|_| selected(Strategy::RoundRobin, &ps, &SelectorView::default(), &mut st))
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(picks, ["a", "b", "c", "a", "b", "c", "a", "b", "c"]);
        assert_eq!(st.last_selected.get("edge").map(String::as_str), Some("c"));
    }

    #[test]
    fn round_robin_scores_next_in_line_low() {
        let ps = [proplet("a"), proplet("b"), proplet("c")];
        let cands: Vec<&CandidateProplet> = ps.iter().collect();
        let mut st = RoundRobinState::default();
        st.record("edge", "a");
        let scores: Vec<(String, f64)> = score(Strategy::RoundRobin, "edge", &cands, &st)
            .iter()
            .map(|s| (s.proplet.name.clone(), s.score))
            .collect();
        assert_eq!(
            scores,
            vec![("a".into(), 1.0), ("b".into(), 0.1), ("c".into(), 1.0)]
        );
    }

    #[test]
    fn round_robin_is_per_namespace() {
        let mut ps = vec![proplet("a"), proplet("b"), proplet("c")];
        ps.extend(["a", "b"].map(|n| with(n, |p| p.namespace = "lab".into())));
        let sel = SelectorView::default();
        let mut st = RoundRobinState::default();
        let mut pick_in = |ns: &str| {
            select_proplet(Strategy::RoundRobin, ns, &ps, &sel, &mut st)
                .map(|p| (p.namespace.clone(), p.name.clone()))
        };
        let got: Vec<(String, String)> = ["edge", "edge", "lab", "edge", "lab", "lab"]
            .iter()
            .map(|ns| pick_in(ns))
            .collect::<Result<_, _>>()
            .unwrap();
        let want = [
            ("edge", "a"),
            ("edge", "b"),
            ("lab", "a"),
            ("edge", "c"),
            ("lab", "b"),
            ("lab", "a"),
        ];
        assert_eq!(
            got,
            want.map(|(ns, n)| (ns.to_owned(), n.to_owned())).to_vec()
        );
    }

    #[test]
    fn round_robin_when_last_selected_disappears_or_proplets_join() {
        let sel = SelectorView::default();
        let mut st = RoundRobinState::default();
        st.record("edge", "b");
        // b is gone: continue with the next name after it.
        let ps = [proplet("a"), proplet("c"), proplet("d")];
        assert_eq!(
            selected(Strategy::RoundRobin, &ps, &sel, &mut st).unwrap(),
            "c"
        );
        // The last one selected is gone and was the greatest name: wrap around.
        st.record("edge", "z");
        assert_eq!(
            selected(Strategy::RoundRobin, &ps, &sel, &mut st).unwrap(),
            "a"
        );
        // A proplet joining right after the current position is next in line.
        let joined = [proplet("a"), proplet("ab"), proplet("c"), proplet("d")];
        assert_eq!(
            selected(Strategy::RoundRobin, &joined, &sel, &mut st).unwrap(),
            "ab"
        );
        // Only one candidate: always it.
        let one = [proplet("solo")];
        for _ in 0..3 {
            assert_eq!(
                selected(Strategy::RoundRobin, &one, &sel, &mut st).unwrap(),
                "solo"
            );
        }
    }

    #[test]
    fn round_robin_state_serialises() {
        let mut st = RoundRobinState::default();
        st.record("edge", "a");
        let json = serde_json::to_string(&st).unwrap();
        assert_eq!(json, r#"{"lastSelected":{"edge":"a"}}"#);
        let back: RoundRobinState = serde_json::from_str(&json).unwrap();
        assert_eq!(back, st);
        let empty: RoundRobinState = serde_json::from_str("{}").unwrap();
        assert_eq!(empty, RoundRobinState::default());
    }

    #[test]
    fn least_loaded_picks_fewest_active_tasks_ties_by_name() {
        let ps = [
            with("c", |p| p.active_tasks = 1),
            with("b", |p| p.active_tasks = 3),
            with("a", |p| p.active_tasks = 1),
        ];
        let mut st = RoundRobinState::default();
        let sel = SelectorView::default();
        assert_eq!(
            selected(Strategy::LeastLoaded, &ps, &sel, &mut st).unwrap(),
            "a"
        );
        // Repeated picks on the same snapshot are stable (the caller bumps the counts).
        assert_eq!(
            selected(Strategy::LeastLoaded, &ps, &sel, &mut st).unwrap(),
            "a"
        );
        let ps2 = [
            with("c", |p| p.active_tasks = 1),
            with("b", |p| p.active_tasks = 3),
            with("a", |p| p.active_tasks = 2),
        ];
        assert_eq!(
            selected(Strategy::LeastLoaded, &ps2, &sel, &mut st).unwrap(),
            "c"
        );
    }

    #[test]
    fn strategy_parses_flag_values() {
        assert_eq!("round-robin".parse(), Ok(Strategy::RoundRobin));
        assert_eq!("least-loaded".parse(), Ok(Strategy::LeastLoaded));
        assert_eq!("priority".parse(), Ok(Strategy::LeastLoaded));
        assert_eq!("Round-Robin".parse(), Ok(Strategy::RoundRobin));
        assert_eq!(
            "random".parse::<Strategy>(),
            Err(UnknownStrategy("random".into()))
        );
        assert_eq!(
            UnknownStrategy("random".into()).to_string(),
            "unknown scheduler \"random\": expected round-robin, least-loaded or priority"
        );
        assert_eq!(Strategy::default().to_string(), "round-robin");
        assert_eq!(Strategy::LeastLoaded.to_string(), "least-loaded");
    }

    #[test]
    fn dispatch_order_is_priority_then_fifo() {
        let t = |name: &str, priority: u8, created_millis: i64| PendingTask {
            name: name.into(),
            priority,
            created_millis,
        };
        let tasks = [
            t("low-old", 0, 1),
            t("mid-new", 50, 30),
            t("urgent", 100, 40),
            t("mid-old", 50, 10),
            t("mid-old-b", 50, 10),
            t("low-new", 0, 50),
            t("clamped", 200, 60),
        ];
        let order: Vec<&str> = dispatch_order(&tasks)
            .iter()
            .map(|t| t.name.as_str())
            .collect();
        assert_eq!(
            order,
            [
                "urgent",
                "clamped",
                "mid-old",
                "mid-old-b",
                "mid-new",
                "low-old",
                "low-new"
            ]
        );
    }

    fn arb_proplet() -> impl PropStrategy<Value = CandidateProplet> {
        (
            prop::sample::select(vec![
                PropletPhase::Running,
                PropletPhase::Running,
                PropletPhase::Offline,
            ]),
            prop::bool::ANY,
            prop::option::of(prop::sample::select(vec!["esp32", "pi"])),
            prop::collection::vec(prop::sample::select(vec!["gpu", "camera"]), 0..2),
            0u32..4,
        )
            .prop_map(|(phase, k8s, dev, caps, active)| CandidateProplet {
                name: String::new(),
                namespace: "edge".into(),
                phase,
                proplet_type: if k8s {
                    PropletType::K8s
                } else {
                    PropletType::External
                },
                labels: BTreeMap::new(),
                device_type: dev.map(str::to_owned),
                capabilities: caps.into_iter().map(str::to_owned).collect(),
                attester: None,
                active_tasks: active,
                capacity: None,
            })
    }

    fn arb_proplets(min: usize) -> impl PropStrategy<Value = Vec<CandidateProplet>> {
        prop::collection::vec(arb_proplet(), min..8).prop_map(|v| {
            v.into_iter()
                .enumerate()
                .map(|(i, mut p)| {
                    p.name = format!("p{i}");
                    p
                })
                .collect()
        })
    }

    proptest! {
        #[test]
        fn selection_ignores_input_order(
            (ps, shuffled) in arb_proplets(1).prop_flat_map(|ps| (Just(ps.clone()), Just(ps).prop_shuffle())),
            least in prop::bool::ANY,
            want_gpu in prop::bool::ANY,
            rounds in 1usize..6,
        ) {
            let strategy = if least { Strategy::LeastLoaded } else { Strategy::RoundRobin };
            let sel = SelectorView {
                match_capabilities: if want_gpu { vec!["gpu".into()] } else { vec![] },
                ..Default::default()
            };
            let (mut s1, mut s2) = (RoundRobinState::default(), RoundRobinState::default());
            for _ in 0..rounds {
                let a = select_proplet(strategy, "edge", &ps, &sel, &mut s1).map(|p| p.name.clone());
                let b = select_proplet(strategy, "edge", &shuffled, &sel, &mut s2).map(|p| p.name.clone());
                prop_assert_eq!(a, b);
            }
            prop_assert_eq!(s1, s2);
        }

        #[test]
        fn round_robin_picks_each_candidate_once_per_n(n in 1usize..8, start in 0usize..8) {
            let ps: Vec<CandidateProplet> = (0..n).map(|i| proplet(&format!("p{i}"))).collect();
            let mut st = RoundRobinState::default();
            st.record("edge", &format!("p{}", start % n));
            let mut seen = Vec::new();
            for _ in 0..n {
                seen.push(select_proplet(Strategy::RoundRobin, "edge", &ps, &SelectorView::default(), &mut st)
                    .map(|p| p.name.clone())
                    .map_err(|e| TestCaseError::fail(e.to_string()))?);
            }
            seen.sort();
            seen.dedup();
            prop_assert_eq!(seen.len(), n);
        }

        #[test]
        fn chosen_proplet_always_satisfies_selector(
            ps in arb_proplets(0),
            dev in prop::collection::vec(prop::sample::select(vec!["esp32".to_owned(), "pi".to_owned()]), 0..2),
        ) {
            let sel = SelectorView { match_device_types: dev, ..Default::default() };
            let mut st = RoundRobinState::default();
            match select_proplet(Strategy::RoundRobin, "edge", &ps, &sel, &mut st) {
                Ok(p) => prop_assert_eq!(exclusion(p, &sel), None),
                Err(ScheduleError::NoProplet { .. }) => prop_assert!(ps.is_empty()),
                Err(ScheduleError::NoCandidates { total, groups, .. }) => {
                    prop_assert_eq!(total, ps.len());
                    prop_assert_eq!(groups.iter().map(|g| g.proplets.len()).sum::<usize>(), ps.len());
                }
            }
        }
    }
}
