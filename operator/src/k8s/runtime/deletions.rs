//! The Tasks the Task watch shows gone, each in its last known state: those it reports
//! deleted, and those a relist no longer lists (deleted while the watch was down, after the
//! API server had dropped the events it could have resumed from). With sharded watches a
//! relist also leaves out the namespaces that have just left this replica's share: those
//! Tasks were not deleted, and the predicate given to [`Deletions::new`] says so.

use std::collections::HashSet;
use std::sync::Arc;

use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;

use crate::crd::task::Task;

/// Whether a Task is among those the watch lists (with sharded watches, whether its namespace
/// is in this replica's share).
pub type InShare = Box<dyn Fn(&Task) -> bool + Send>;

/// Follows the Task watch, after the cache (`cached`) has taken each event.
pub struct Deletions {
    cached: Store<Task>,
    /// Whether a Task is in what the watch lists now.
    in_share: InShare,
    /// The cache's Tasks when a relist began (it keeps them until the relist is complete).
    before_relist: Option<Vec<Arc<Task>>>,
}

impl Deletions {
    /// Follows the watch whose cache is `cached` and which lists the Tasks `in_share` accepts.
    pub fn new(cached: Store<Task>, in_share: InShare) -> Self {
        Self {
            cached,
            in_share,
            before_relist: None,
        }
    }

    /// The Tasks `event` shows gone.
    pub fn seen(&mut self, event: &watcher::Event<Task>) -> Vec<Task> {
        match event {
            watcher::Event::Delete(task) => vec![task.clone()],
            watcher::Event::Init => {
                self.before_relist = Some(self.cached.state());
                Vec::new()
            }
            watcher::Event::InitDone => {
                let Some(before) = self.before_relist.take() else {
                    return Vec::new();
                };
                let listed: HashSet<ObjectRef<Task>> = self
                    .cached
                    .state()
                    .iter()
                    .map(|t| ObjectRef::from_obj(&**t))
                    .collect();
                before
                    .iter()
                    .filter(|t| !listed.contains(&ObjectRef::from_obj(&***t)))
                    .filter(|t| (self.in_share)(t))
                    .map(|t| (**t).clone())
                    .collect()
            }
            watcher::Event::Apply(_) | watcher::Event::InitApply(_) => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::reflector;

    fn task(name: &str) -> Task {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "propeller.propeller.absmach.eu/v1",
            "kind": "Task",
            "metadata": {"name": name, "namespace": "default", "uid": format!("{name}-uid")},
            "spec": {"name": name}
        }))
        .unwrap_or_else(|e| panic!("test task: {e}"))
    }

    fn names(tasks: &[Task]) -> Vec<String> {
        tasks
            .iter()
            .map(|t| t.metadata.name.clone().unwrap_or_default())
            .collect()
    }

    /// A cache and its deletions following a watch: each event fed gives the names it
    /// shows gone.
    fn follower(in_share: InShare) -> impl FnMut(watcher::Event<Task>) -> Vec<String> {
        let (reader, mut writer) = reflector::store::<Task>();
        let mut deletions = Deletions::new(reader, in_share);
        move |event| {
            writer.apply_watcher_event(&event);
            names(&deletions.seen(&event))
        }
    }

    #[test]
    fn a_delete_event_and_a_relist_without_a_task_both_show_it_gone() {
        let mut feed = follower(Box::new(|_: &Task| true));
        for event in [
            watcher::Event::Init,
            watcher::Event::InitApply(task("a")),
            watcher::Event::InitApply(task("b")),
            watcher::Event::InitApply(task("c")),
        ] {
            assert!(feed(event).is_empty());
        }
        assert!(feed(watcher::Event::InitDone).is_empty(), "the first list");
        assert_eq!(feed(watcher::Event::Delete(task("a"))), ["a"]);

        // The watch restarts and relists: `c` went meanwhile.
        assert!(feed(watcher::Event::Init).is_empty());
        assert!(feed(watcher::Event::InitApply(task("b"))).is_empty());
        assert_eq!(feed(watcher::Event::InitDone), ["c"]);
    }

    #[test]
    fn a_relist_of_a_smaller_share_shows_only_the_tasks_still_in_it_gone() {
        // The share keeps Tasks whose name starts with `a`: `b` left it, `a2` was deleted.
        let in_share = |t: &Task| {
            t.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with('a'))
        };
        let mut feed = follower(Box::new(in_share));
        for event in [
            watcher::Event::Init,
            watcher::Event::InitApply(task("a1")),
            watcher::Event::InitApply(task("a2")),
            watcher::Event::InitApply(task("b")),
            watcher::Event::InitDone,
            watcher::Event::Init,
            watcher::Event::InitApply(task("a1")),
        ] {
            assert!(feed(event).is_empty());
        }
        assert_eq!(feed(watcher::Event::InitDone), ["a2"]);
    }
}
