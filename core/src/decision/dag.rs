//! Task dependency (DAG) rules: when a Task may run, when it is skipped, and cycle detection.
//!
//! The readiness rules follow upstream's Go operator Unlike upstream, cycle detection and
//! topological ordering are meant to be *used* (bug 13): a Task on a dependency cycle would
//! otherwise stay pending forever, so the Task reconciler asks [`cycle_through`] and reports it.
//!
//! Everything here is pure; the reconciler turns CRD objects into the small views below.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

pub use crate::crd::task::{RunIf, TaskPhase};

/// A dependency graph: task name → the names it depends on (`spec.dependsOn`).
///
/// Entries naming tasks that are not keys of the map are ignored by the graph algorithms
/// (a missing dependency is a reason to wait, not a cycle; see [`missing_dependencies`]).
pub type Graph = BTreeMap<String, Vec<String>>;

/// What a pending Task should do about its dependencies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// Not all dependencies are terminal yet. Both lists keep the `dependsOn` order, without
    /// duplicates.
    Wait {
        /// Dependencies that do not exist (yet).
        missing: Vec<String>,
        /// Dependencies that exist but have not finished.
        unfinished: Vec<String>,
    },
    /// All dependencies are terminal and the `runIf` condition holds: dispatch the Task.
    Ready,
    /// All dependencies are terminal and the `runIf` condition does not hold: mark the Task
    /// skipped, with `reason` as the condition message.
    Skip {
        /// Human-readable explanation for the Task's condition.
        reason: String,
    },
}

/// How many dependency names a skip reason lists before summarising.
const MAX_NAMES_IN_REASON: usize = 5;

/// Decides whether a Task with these `depends_on` entries and this `run_if` may run.
///
/// `phase_of` looks a dependency up by name in the Task's namespace (`None` = not found).
/// Rules (upstream's Go operator): wait until every dependency exists and is terminal; then
/// `runIf: success` skips if any dependency failed, and `runIf: failure` skips if none failed.
/// A Task without dependencies is always ready, whatever its `runIf`.
pub fn evaluate<F>(depends_on: &[String], run_if: RunIf, phase_of: F) -> Readiness
where
    F: Fn(&str) -> Option<TaskPhase>,
{
    let mut seen = BTreeSet::new();
    let mut missing = Vec::new();
    let mut unfinished = Vec::new();
    let mut failed = Vec::new();
    for dep in depends_on {
        if !seen.insert(dep.as_str()) {
            continue;
        }
        match phase_of(dep).map(|p| (p, p.outcome())) {
            None => missing.push(dep.clone()),
            Some((_, None)) => unfinished.push(dep.clone()),
            Some((phase, Some(false))) => failed.push(format!("{dep} {}", phase.as_str())),
            Some((_, Some(true))) => {}
        }
    }
    if !missing.is_empty() || !unfinished.is_empty() {
        return Readiness::Wait {
            missing,
            unfinished,
        };
    }
    if seen.is_empty() {
        // No dependencies: `runIf` has nothing to judge.
        return Readiness::Ready;
    }
    match (run_if, failed.is_empty()) {
        (RunIf::Success, true) | (RunIf::Failure, false) => Readiness::Ready,
        (RunIf::Success, false) => Readiness::Skip {
            reason: format!(
                "runIf is success but dependencies did not all complete: {}",
                summarise(&failed)
            ),
        },
        (RunIf::Failure, true) => Readiness::Skip {
            reason: "runIf is failure but every dependency completed".to_owned(),
        },
    }
}

/// One dependency cycle, as a path that starts and ends with the same task.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("dependency cycle: {}", .path.join(" -> "))]
pub struct CycleError {
    /// The cycle, e.g. `["a", "b", "a"]`; a self-dependency is `["a", "a"]`.
    pub path: Vec<String>,
}

/// Finds one dependency cycle, or `None` if the graph is acyclic.
///
/// The result is deterministic: tasks and their dependencies are explored in name order, and the
/// returned path is rotated to start at its smallest name, e.g. `["a", "b", "c", "a"]`.
pub fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        OnPath,
        Done,
    }
    let adjacency = sorted_adjacency(graph);
    let mut marks: BTreeMap<&str, Mark> = BTreeMap::new();
    for start in adjacency.keys().copied() {
        if marks.contains_key(start) {
            continue;
        }
        // Iterative DFS: each frame is a node and the index of its next edge to follow, so a
        // long dependency chain cannot overflow the stack.
        let mut stack: Vec<(&str, usize)> = vec![(start, 0)];
        marks.insert(start, Mark::OnPath);
        while let Some(frame) = stack.last_mut() {
            let (node, next) = *frame;
            let deps = adjacency.get(node).map(Vec::as_slice).unwrap_or_default();
            let Some(dep) = deps.get(next).copied() else {
                marks.insert(node, Mark::Done);
                stack.pop();
                continue;
            };
            frame.1 += 1;
            match marks.get(dep) {
                Some(Mark::Done) => {}
                Some(Mark::OnPath) => {
                    let from = stack.iter().position(|(n, _)| *n == dep).unwrap_or(0);
                    let cycle: Vec<&str> = stack.iter().skip(from).map(|(n, _)| *n).collect();
                    return Some(canonical_cycle(&cycle));
                }
                None => {
                    marks.insert(dep, Mark::OnPath);
                    stack.push((dep, 0));
                }
            }
        }
    }
    None
}

/// The shortest dependency cycle that goes through `task`, as `[task, …, task]`, or `None`.
///
/// This is what a Task reconciler asks about the Task it is reconciling: a Task on a cycle can
/// never become ready, so it should fail with this path in its message instead of waiting.
/// Ties between equally short cycles are broken by name, so the answer is deterministic.
pub fn cycle_through(graph: &Graph, task: &str) -> Option<Vec<String>> {
    let adjacency = sorted_adjacency(graph);
    let (start, first_deps) = adjacency.get_key_value(task)?;
    // Breadth-first search from `task`'s dependencies back to `task`.
    let mut parent: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue: VecDeque<&str> = VecDeque::new();
    for dep in first_deps {
        if *dep == *start {
            return Some(vec![task.to_owned(), task.to_owned()]);
        }
        if adjacency.contains_key(dep) && !parent.contains_key(dep) {
            parent.insert(dep, start);
            queue.push_back(dep);
        }
    }
    while let Some(node) = queue.pop_front() {
        for dep in adjacency.get(node).map(Vec::as_slice).unwrap_or_default() {
            if *dep == *start {
                // Walk back from `node` to `start` to rebuild the path.
                let mut rev = vec![node];
                let mut cur = node;
                while let Some(p) = parent.get(cur).copied() {
                    if p == *start {
                        break;
                    }
                    rev.push(p);
                    cur = p;
                }
                let mut path = vec![task.to_owned()];
                path.extend(rev.iter().rev().map(|s| (*s).to_owned()));
                path.push(task.to_owned());
                return Some(path);
            }
            if adjacency.contains_key(dep) && !parent.contains_key(dep) {
                parent.insert(dep, node);
                queue.push_back(dep);
            }
        }
    }
    None
}

/// Orders the tasks so that every task comes after all of its dependencies.
///
/// Among tasks that are ready at the same time the smallest name comes first, so the order is
/// deterministic. Returns the cycle (as [`find_cycle`] reports it) if there is one.
pub fn topological_order(graph: &Graph) -> Result<Vec<String>, CycleError> {
    let adjacency = sorted_adjacency(graph);
    let mut remaining: BTreeMap<&str, usize> = BTreeMap::new();
    let mut dependents: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (task, deps) in &adjacency {
        let known: Vec<&str> = deps
            .iter()
            .copied()
            .filter(|d| adjacency.contains_key(d))
            .collect();
        remaining.insert(task, known.len());
        for dep in known {
            dependents.entry(dep).or_default().push(task);
        }
    }
    let mut ready: BTreeSet<&str> = remaining
        .iter()
        .filter(|(_, n)| **n == 0)
        .map(|(t, _)| *t)
        .collect();
    let mut order = Vec::with_capacity(adjacency.len());
    while let Some(task) = ready.pop_first() {
        order.push(task.to_owned());
        for dependent in dependents.get(task).map(Vec::as_slice).unwrap_or_default() {
            if let Some(n) = remaining.get_mut(dependent) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    ready.insert(dependent);
                }
            }
        }
    }
    if order.len() == adjacency.len() {
        return Ok(order);
    }
    let path = find_cycle(graph).unwrap_or_default();
    Err(CycleError { path })
}

/// For each task, the `dependsOn` entries that name no task in the graph (sorted, deduplicated);
/// tasks with none are left out. Useful for a warning condition on a Task that would otherwise
/// wait silently.
pub fn missing_dependencies(graph: &Graph) -> BTreeMap<String, Vec<String>> {
    graph
        .iter()
        .filter_map(|(task, deps)| {
            let missing: BTreeSet<&String> =
                deps.iter().filter(|d| !graph.contains_key(*d)).collect();
            (!missing.is_empty()).then(|| (task.clone(), missing.into_iter().cloned().collect()))
        })
        .collect()
}

/// The graph with each task's dependencies sorted and deduplicated, borrowing the names.
fn sorted_adjacency(graph: &Graph) -> BTreeMap<&str, Vec<&str>> {
    graph
        .iter()
        .map(|(task, deps)| {
            let set: BTreeSet<&str> = deps.iter().map(String::as_str).collect();
            (task.as_str(), set.into_iter().collect())
        })
        .collect()
}

/// Rotates a cycle (given without the closing repeat) to start at its smallest name, and closes it.
fn canonical_cycle(cycle: &[&str]) -> Vec<String> {
    let min_at = cycle
        .iter()
        .enumerate()
        .min_by_key(|(_, n)| **n)
        .map(|(i, _)| i)
        .unwrap_or(0);
    let mut path: Vec<String> = cycle
        .iter()
        .cycle()
        .skip(min_at)
        .take(cycle.len())
        .map(|s| (*s).to_owned())
        .collect();
    if let Some(first) = path.first().cloned() {
        path.push(first);
    }
    path
}

fn summarise(items: &[String]) -> String {
    let shown = items
        .iter()
        .take(MAX_NAMES_IN_REASON)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    match items.len().saturating_sub(MAX_NAMES_IN_REASON) {
        0 => shown,
        more => format!("{shown} and {more} more"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    fn graph(edges: &[(&str, &[&str])]) -> Graph {
        edges
            .iter()
            .map(|(t, deps)| ((*t).to_owned(), names(deps)))
            .collect()
    }

    fn eval(deps: &[&str], run_if: RunIf, phases: &[(&str, TaskPhase)]) -> Readiness {
        let map: BTreeMap<String, TaskPhase> =
            phases.iter().map(|(n, p)| ((*n).to_owned(), *p)).collect();
        evaluate(&names(deps), run_if, |n| map.get(n).copied())
    }

    #[test]
    fn single_dependency_every_phase_and_run_if() {
        for phase in TaskPhase::ALL {
            for run_if in [RunIf::Success, RunIf::Failure] {
                let got = eval(&["a"], run_if, &[("a", phase)]);
                match (phase, run_if) {
                    (TaskPhase::Pending | TaskPhase::Scheduled | TaskPhase::Running, _) => {
                        assert_eq!(
                            got,
                            Readiness::Wait {
                                missing: vec![],
                                unfinished: names(&["a"])
                            },
                            "{phase:?} {run_if:?}"
                        );
                    }
                    (TaskPhase::Completed, RunIf::Success) => assert_eq!(got, Readiness::Ready),
                    (TaskPhase::Completed, RunIf::Failure) => assert_eq!(
                        got,
                        Readiness::Skip {
                            reason: "runIf is failure but every dependency completed".into()
                        }
                    ),
                    (_, RunIf::Success) => assert_eq!(
                        got,
                        Readiness::Skip {
                            reason: format!(
                                "runIf is success but dependencies did not all complete: a {}",
                                phase.as_str()
                            )
                        },
                        "{phase:?}"
                    ),
                    (_, RunIf::Failure) => assert_eq!(got, Readiness::Ready, "{phase:?}"),
                }
            }
        }
    }

    #[test]
    fn default_run_if_is_success() {
        assert_eq!(RunIf::default(), RunIf::Success);
    }

    #[test]
    fn mixed_dependencies() {
        use TaskPhase::*;
        let ok_and_failed = [("a", Completed), ("b", Failed)];
        assert!(matches!(
            eval(&["a", "b"], RunIf::Success, &ok_and_failed),
            Readiness::Skip { .. }
        ));
        assert_eq!(
            eval(&["a", "b"], RunIf::Failure, &ok_and_failed),
            Readiness::Ready
        );
        // Waits while anything is unfinished, even if the outcome is already decided.
        assert_eq!(
            eval(
                &["b", "c"],
                RunIf::Success,
                &[("b", Failed), ("c", Running)]
            ),
            Readiness::Wait {
                missing: vec![],
                unfinished: names(&["c"])
            }
        );
        assert_eq!(
            eval(&["a", "a", "a"], RunIf::Success, &[("a", Completed)]),
            Readiness::Ready
        );
    }

    #[test]
    fn missing_dependencies_wait() {
        use TaskPhase::*;
        assert_eq!(
            eval(
                &["x", "a", "y", "b", "x"],
                RunIf::Success,
                &[("a", Completed), ("b", Pending)]
            ),
            Readiness::Wait {
                missing: names(&["x", "y"]),
                unfinished: names(&["b"])
            }
        );
    }

    #[test]
    fn no_dependencies_is_ready_for_both_run_if() {
        assert_eq!(eval(&[], RunIf::Success, &[]), Readiness::Ready);
        assert_eq!(eval(&[], RunIf::Failure, &[]), Readiness::Ready);
    }

    #[test]
    fn skip_reason_is_bounded() {
        let deps: Vec<String> = (0..20).map(|i| format!("t{i:02}")).collect();
        let got = evaluate(&deps, RunIf::Success, |_| Some(TaskPhase::Failed));
        assert_eq!(
            got,
            Readiness::Skip {
                reason: "runIf is success but dependencies did not all complete: \
                         t00 failed, t01 failed, t02 failed, t03 failed, t04 failed and 15 more"
                    .into()
            }
        );
    }

    #[test]
    fn skip_cascades_down_a_three_level_chain() {
        // a fails; b (runIf success) depends on a; c on b; d on c with runIf failure.
        let mut phases: BTreeMap<String, TaskPhase> = BTreeMap::new();
        phases.insert("a".into(), TaskPhase::Failed);
        let chain = [
            ("b", "a", RunIf::Success),
            ("c", "b", RunIf::Success),
            ("d", "c", RunIf::Failure),
        ];
        let mut outcomes = Vec::new();
        for (task, dep, run_if) in chain {
            let r = evaluate(&names(&[dep]), run_if, |n| phases.get(n).copied());
            let phase = match &r {
                Readiness::Skip { .. } => TaskPhase::Skipped,
                Readiness::Ready => TaskPhase::Completed, // pretend it ran fine
                Readiness::Wait { .. } => TaskPhase::Pending,
            };
            phases.insert(task.into(), phase);
            outcomes.push((task, phase));
        }
        assert_eq!(
            outcomes,
            vec![
                ("b", TaskPhase::Skipped),
                ("c", TaskPhase::Skipped),
                ("d", TaskPhase::Completed),
            ]
        );
    }

    #[test]
    fn cycles_of_length_one_two_three() {
        let g = graph(&[("a", &["a"])]);
        assert_eq!(find_cycle(&g), Some(names(&["a", "a"])));
        assert_eq!(cycle_through(&g, "a"), Some(names(&["a", "a"])));

        let g = graph(&[("a", &["b"]), ("b", &["a"])]);
        assert_eq!(find_cycle(&g), Some(names(&["a", "b", "a"])));
        assert_eq!(cycle_through(&g, "b"), Some(names(&["b", "a", "b"])));

        // c depends on b, b on a, a on c: dependsOn edges a→c→b→a.
        let g = graph(&[("a", &["c"]), ("b", &["a"]), ("c", &["b"])]);
        assert_eq!(find_cycle(&g), Some(names(&["a", "c", "b", "a"])));
        assert_eq!(cycle_through(&g, "b"), Some(names(&["b", "a", "c", "b"])));
        let err = topological_order(&g).unwrap_err();
        assert_eq!(err.to_string(), "dependency cycle: a -> c -> b -> a");
    }

    #[test]
    fn cycle_inside_larger_acyclic_graph() {
        let g = graph(&[
            ("root", &[]),
            ("etl", &["root"]),
            ("p", &["etl", "r"]),
            ("q", &["p"]),
            ("r", &["q", "root"]),
            ("report", &["p", "etl"]),
            ("zz", &["missing"]),
        ]);
        assert_eq!(find_cycle(&g), Some(names(&["p", "r", "q", "p"])));
        assert_eq!(cycle_through(&g, "q"), Some(names(&["q", "p", "r", "q"])));
        // Depending on a cycle is not being on one.
        assert_eq!(cycle_through(&g, "report"), None);
        assert_eq!(cycle_through(&g, "root"), None);
        assert_eq!(cycle_through(&g, "nope"), None);
        assert!(topological_order(&g).is_err());
        assert_eq!(
            missing_dependencies(&g),
            BTreeMap::from([("zz".to_owned(), names(&["missing"]))])
        );
    }

    #[test]
    fn cycle_through_prefers_shortest() {
        // a→b→a (length 2) and a→c→d→a (length 3).
        let g = graph(&[
            ("a", &["c", "b"]),
            ("b", &["a"]),
            ("c", &["d"]),
            ("d", &["a"]),
        ]);
        assert_eq!(cycle_through(&g, "a"), Some(names(&["a", "b", "a"])));
        assert_eq!(cycle_through(&g, "d"), Some(names(&["d", "a", "c", "d"])));
    }

    #[test]
    fn output_does_not_depend_on_dependency_order() {
        let g1 = graph(&[("a", &["b", "c"]), ("b", &["a"]), ("c", &["a"])]);
        let g2 = graph(&[("a", &["c", "b", "c"]), ("b", &["a"]), ("c", &["a"])]);
        assert_eq!(find_cycle(&g1), Some(names(&["a", "b", "a"])));
        assert_eq!(find_cycle(&g1), find_cycle(&g2));
    }

    #[test]
    fn topological_order_is_deterministic() {
        let g = graph(&[
            ("d", &["b", "c"]),
            ("c", &["a"]),
            ("b", &["a"]),
            ("a", &[]),
            ("e", &["ghost"]),
        ]);
        assert_eq!(topological_order(&g), Ok(names(&["a", "b", "c", "d", "e"])));
        assert_eq!(find_cycle(&g), None);
    }

    #[test]
    fn long_chain_does_not_overflow() {
        let n = 50_000;
        let mut g = Graph::new();
        for i in 0..n {
            let deps = if i == 0 {
                vec![]
            } else {
                vec![format!("t{:06}", i - 1)]
            };
            g.insert(format!("t{i:06}"), deps);
        }
        assert_eq!(find_cycle(&g), None);
        g.insert("t000000".into(), vec![format!("t{:06}", n - 1)]);
        let cycle = find_cycle(&g).map(|c| c.len());
        assert_eq!(cycle, Some(n + 1));
    }

    /// Random DAG over `t0..tN`: edges only from a higher index to a lower one.
    fn dag_strategy() -> impl Strategy<Value = (usize, Vec<(usize, usize)>)> {
        (2usize..12).prop_flat_map(|n| {
            let edge = (1..n).prop_flat_map(|hi| (Just(hi), 0..hi));
            (Just(n), prop::collection::vec(edge, 1..30))
        })
    }

    fn build(n: usize, edges: &[(usize, usize)]) -> Graph {
        let mut g: Graph = (0..n).map(|i| (format!("t{i}"), Vec::new())).collect();
        for (from, to) in edges {
            if let Some(deps) = g.get_mut(&format!("t{from}")) {
                deps.push(format!("t{to}"));
            }
        }
        g
    }

    fn is_real_cycle(g: &Graph, path: &[String]) -> bool {
        path.len() >= 2
            && path.first() == path.last()
            && path
                .windows(2)
                .all(|w| g.get(&w[0]).is_some_and(|deps| deps.contains(&w[1])))
    }

    proptest! {
        #[test]
        fn random_dags_have_no_cycle((n, edges) in dag_strategy()) {
            let g = build(n, &edges);
            prop_assert_eq!(find_cycle(&g), None);
            for t in g.keys() {
                prop_assert_eq!(cycle_through(&g, t), None);
            }
            let order = topological_order(&g).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(order.len(), n);
            let pos: BTreeMap<&String, usize> = order.iter().enumerate().map(|(i, t)| (t, i)).collect();
            for (task, deps) in &g {
                for d in deps {
                    prop_assert!(pos[d] < pos[task], "{} must come before {}", d, task);
                }
            }
        }

        #[test]
        fn back_edge_makes_a_real_cycle((n, edges) in dag_strategy(), pick in any::<prop::sample::Index>()) {
            let mut g = build(n, &edges);
            let (hi, lo) = edges[pick.index(edges.len())];
            // t{hi} depends on t{lo}; making t{lo} depend on t{hi} closes a cycle.
            if let Some(deps) = g.get_mut(&format!("t{lo}")) {
                deps.push(format!("t{hi}"));
            }
            let cycle = find_cycle(&g);
            prop_assert!(cycle.as_ref().is_some_and(|c| is_real_cycle(&g, c)), "{:?}", cycle);
            let first = cycle.as_ref().and_then(|c| c.first()).cloned().unwrap_or_default();
            prop_assert!(cycle.iter().flatten().all(|t| *t >= first), "not rotated to smallest");
            let through = cycle_through(&g, &format!("t{lo}"));
            prop_assert!(through.as_ref().is_some_and(|c| is_real_cycle(&g, c)), "{:?}", through);
            prop_assert!(topological_order(&g).is_err());
        }
    }
}
