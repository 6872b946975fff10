//! The Task lookups both drivers answer without looking at every Task: a task by UID (where
//! a device's result goes), the tasks occupying a proplet (its load, its `taskCount`) and
//! the tasks depending on a task (what its completion wakes).
//!
//! Standalone feeds the index from its store's writes; Kubernetes mode from the Task watch
//! (a relist replaces it whole, as it replaces the watch's cache). Either way a reconcile's
//! lookups cost the same with ten tasks or ten thousand.

use std::collections::{BTreeSet, HashMap};

use crate::crd::task::Task;
use crate::decision::task::occupied;
pub use crate::watch_index::Name;
use crate::watch_index::{Index, SharedIndex};

/// What one task put into the index, so that its next version can take it out again.
#[derive(Debug, Clone)]
pub struct Entry {
    uid: Option<String>,
    occupies: Vec<String>,
    depends_on: Vec<String>,
}

/// The Task indexes of one cache.
#[derive(Debug, Default)]
pub struct TaskIndex {
    entries: HashMap<Name, Entry>,
    by_uid: HashMap<String, Name>,
    /// Tasks occupying each proplet (`(namespace, proplet)` → task names).
    occupants: HashMap<Name, BTreeSet<String>>,
    /// Tasks depending on each task (`(namespace, dependency)` → task names).
    dependents: HashMap<Name, BTreeSet<String>>,
    /// The tasks of a relist in progress, which replace the index when it is complete.
    relist: Option<Vec<(Name, Entry)>>,
}

/// A [`TaskIndex`] shared by the Task watch that feeds it and the reconciles that read it.
pub type SharedTaskIndex = SharedIndex<TaskIndex>;

impl Index for TaskIndex {
    type Object = Task;
    type Entry = Entry;

    fn entry_of(task: &Task) -> Entry {
        Entry {
            uid: task.metadata.uid.clone(),
            occupies: occupied(task).into_iter().map(str::to_owned).collect(),
            depends_on: task.spec.depends_on.clone(),
        }
    }

    fn relist(&mut self) -> &mut Option<Vec<(Name, Entry)>> {
        &mut self.relist
    }

    fn link(&mut self, key: Name, entry: Entry) {
        self.unlink(&key);
        let (namespace, name) = &key;
        if let Some(uid) = &entry.uid {
            self.by_uid.insert(uid.clone(), key.clone());
        }
        for proplet in &entry.occupies {
            self.occupants
                .entry((namespace.clone(), proplet.clone()))
                .or_default()
                .insert(name.clone());
        }
        for dependency in &entry.depends_on {
            self.dependents
                .entry((namespace.clone(), dependency.clone()))
                .or_default()
                .insert(name.clone());
        }
        self.entries.insert(key, entry);
    }

    fn unlink(&mut self, key: &Name) {
        let Some(old) = self.entries.remove(key) else {
            return;
        };
        if let Some(uid) = &old.uid {
            if self.by_uid.get(uid) == Some(key) {
                self.by_uid.remove(uid);
            }
        }
        let (namespace, name) = key;
        let drop_from = |index: &mut HashMap<Name, BTreeSet<String>>, of: &str| {
            let at = (namespace.clone(), of.to_owned());
            if let Some(names) = index.get_mut(&at) {
                names.remove(name);
                if names.is_empty() {
                    index.remove(&at);
                }
            }
        };
        for proplet in &old.occupies {
            drop_from(&mut self.occupants, proplet);
        }
        for dependency in &old.depends_on {
            drop_from(&mut self.dependents, dependency);
        }
    }
}

impl TaskIndex {
    /// The `(namespace, name)` of the task with this UID.
    pub fn by_uid(&self, uid: &str) -> Option<&Name> {
        self.by_uid.get(uid)
    }

    /// Names of the tasks occupying proplet `namespace`/`proplet` (scheduled or running
    /// there).
    pub fn occupants(&self, namespace: &str, proplet: &str) -> Vec<String> {
        self.occupants
            .get(&(namespace.to_owned(), proplet.to_owned()))
            .map(|names| names.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// How many tasks occupy proplet `namespace`/`proplet`.
    pub fn load(&self, namespace: &str, proplet: &str) -> u32 {
        self.occupants
            .get(&(namespace.to_owned(), proplet.to_owned()))
            .map_or(0, |names| u32::try_from(names.len()).unwrap_or(u32::MAX))
    }

    /// Names of the tasks of `namespace` that depend on task `name`.
    pub fn dependents(&self, namespace: &str, name: &str) -> Vec<String> {
        self.dependents
            .get(&(namespace.to_owned(), name.to_owned()))
            .map(|names| names.iter().cloned().collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::watcher;
    use serde_json::json;

    fn task(name: &str, uid: &str, depends_on: &[&str], on: Option<&str>) -> Task {
        let mut value = json!({
            "apiVersion": "propeller.propeller.absmach.eu/v1",
            "kind": "Task",
            "metadata": {"name": name, "namespace": "default", "uid": uid},
            "spec": {"name": name, "dependsOn": depends_on},
        });
        if let Some(proplet) = on {
            value["status"] = json!({"phase": "running", "assignedProplet": proplet});
        }
        serde_json::from_value(value).unwrap_or_else(|e| panic!("test task: {e}"))
    }

    #[test]
    fn a_new_version_replaces_what_the_old_one_indexed() {
        let mut index = TaskIndex::default();
        index.put(&task("t2", "u2", &["t1"], Some("a")));
        assert_eq!(index.load("default", "a"), 1);
        assert_eq!(index.dependents("default", "t1"), vec!["t2".to_owned()]);
        assert_eq!(index.by_uid("u2"), Some(&("default".into(), "t2".into())));

        index.put(&task("t2", "u2", &[], Some("b")));
        assert_eq!(index.load("default", "a"), 0);
        assert_eq!(index.occupants("default", "b"), vec!["t2".to_owned()]);
        assert!(index.dependents("default", "t1").is_empty());

        index.remove("default", "t2");
        assert_eq!(index.load("default", "b"), 0);
        assert_eq!(index.by_uid("u2"), None);
    }

    #[test]
    fn a_relist_replaces_the_index_only_when_complete() {
        let mut index = TaskIndex::default();
        index.apply(&watcher::Event::Apply(task("gone", "u1", &[], Some("a"))));
        index.apply(&watcher::Event::Apply(task("kept", "u2", &[], Some("a"))));
        assert_eq!(index.load("default", "a"), 2);

        index.apply(&watcher::Event::Init);
        index.apply(&watcher::Event::InitApply(task(
            "kept",
            "u2",
            &[],
            Some("b"),
        )));
        // Until the relist is complete the index answers from the previous one.
        assert_eq!(index.load("default", "a"), 2);
        index.apply(&watcher::Event::InitDone);

        assert_eq!(index.load("default", "a"), 0);
        assert_eq!(index.occupants("default", "b"), vec!["kept".to_owned()]);
        assert_eq!(index.by_uid("u1"), None);

        index.apply(&watcher::Event::Delete(task("kept", "u2", &[], None)));
        assert_eq!(index.load("default", "b"), 0);
    }

    #[test]
    fn finished_tasks_occupy_nothing() {
        let mut index = TaskIndex::default();
        let mut done = task("t", "u", &[], Some("a"));
        if let Some(status) = done.status.as_mut() {
            status.phase = crate::crd::task::TaskPhase::Completed;
        }
        index.put(&done);
        assert_eq!(index.load("default", "a"), 0);
        assert_eq!(index.by_uid("u"), Some(&("default".into(), "t".into())));
    }
}
