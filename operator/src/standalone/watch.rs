//! The standalone API's watch, after the Kubernetes watch protocol: one JSON event per line
//! (`ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK`, `ERROR`), from a resourceVersion.
//!
//! A [`ChangeLog`] remembers the latest committed changes (names and versions, not objects),
//! so a client that reconnects with the last resourceVersion it saw gets exactly what it
//! missed. One too old for the log gets an `ERROR` with code 410 (`Expired`) and relists, as
//! a Kubernetes client does. Bookmarks carry the newest version while nothing matches, so a
//! quiet watch still resumes from a recent point.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::Notify;

use super::store::{Change, ChangeKind, ObjectStore, StoreError};
use crate::state::lock;

/// Annotation of the bookmark that follows the initial `ADDED` events.
pub const INITIAL_EVENTS_END: &str = "k8s.io/initial-events-end";
/// Changes the log keeps for resuming watches.
pub const LOG_CAPACITY: usize = 4096;
/// How often a watch with nothing to send sends a bookmark.
pub const BOOKMARK_INTERVAL: Duration = Duration::from_secs(10);

#[derive(Default)]
struct Entries {
    changes: VecDeque<Change>,
    /// Version of the newest change ever logged (also after the oldest were dropped).
    newest: u64,
    /// Versions up to this one are no longer all in the log.
    forgotten_through: u64,
}

/// Recent store changes, fed by a store observer, read by watches.
pub struct ChangeLog {
    entries: Mutex<Entries>,
    notify: Notify,
}

impl ChangeLog {
    /// A log of `store`'s changes from now on; changes before are as old as the store's
    /// current version.
    pub fn attach(store: &ObjectStore) -> Result<Arc<Self>, StoreError> {
        let start = store.current_version()?;
        let log = Arc::new(Self {
            entries: Mutex::new(Entries {
                newest: start,
                forgotten_through: start,
                ..Entries::default()
            }),
            notify: Notify::new(),
        });
        let weak = Arc::downgrade(&log);
        store.observe(Arc::new(move |change: &Change, _: Option<&Value>| {
            if let Some(log) = weak.upgrade() {
                log.push(change.clone());
            }
        }));
        Ok(log)
    }

    fn push(&self, change: Change) {
        {
            let mut e = lock(&self.entries);
            e.newest = e.newest.max(change.resource_version);
            e.changes.push_back(change);
            while e.changes.len() > LOG_CAPACITY {
                if let Some(old) = e.changes.pop_front() {
                    e.forgotten_through = old.resource_version;
                }
            }
        }
        self.notify.notify_waiters();
    }

    /// The changes after `version` matching `wanted`, and the version they bring the reader
    /// to; `Err(newest)` when changes after `version` were already forgotten.
    fn since(&self, version: u64, wanted: &Filter) -> Result<(Vec<Change>, u64), u64> {
        let e = lock(&self.entries);
        if version < e.forgotten_through {
            return Err(e.newest);
        }
        let changes = e
            .changes
            .iter()
            .filter(|c| c.resource_version > version && wanted.matches(c))
            .cloned()
            .collect();
        Ok((changes, e.newest.max(version)))
    }
}

/// Which objects a watch follows.
#[derive(Debug, Clone)]
pub struct Filter {
    /// Stored kind.
    pub kind: String,
    /// Namespace (all when `None`).
    pub namespace: Option<String>,
    /// One object's name (all when `None`).
    pub name: Option<String>,
}

impl Filter {
    fn matches(&self, c: &Change) -> bool {
        c.kind == self.kind
            && self.namespace.as_ref().is_none_or(|ns| *ns == c.namespace)
            && self.name.as_ref().is_none_or(|n| *n == c.name)
    }
}

fn line(value: &Value) -> String {
    let mut text = value.to_string();
    text.push('\n');
    text
}

fn event(kind: &str, object: Value) -> String {
    line(&json!({ "type": kind, "object": object }))
}

fn version_of(object: &Value) -> u64 {
    object["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// What one watch sends next.
pub struct Watch {
    store: ObjectStore,
    log: Arc<ChangeLog>,
    filter: Filter,
    /// The last version the client has been brought to.
    version: u64,
    /// Events ready to send.
    pending: VecDeque<String>,
    done: bool,
}

impl Watch {
    /// Starts a watch. Without `from` (or with 0) the current objects come first as
    /// `ADDED`, like `kubectl get -w`; with it, only what changed after that version.
    pub fn start(
        store: ObjectStore,
        log: Arc<ChangeLog>,
        filter: Filter,
        from: Option<u64>,
    ) -> Result<Self, StoreError> {
        let mut watch = Self {
            store,
            log,
            filter,
            version: 0,
            pending: VecDeque::new(),
            done: false,
        };
        match from.filter(|v| *v > 0) {
            Some(v) => watch.version = v,
            None => {
                // The log's position first: a change committed during the list is then
                // sent again rather than missed.
                watch.version = lock(&watch.log.entries).newest;
                // As stored, unparsed: a console opening on 10,000 proplets costs their text,
                // not 10,000 parsed objects.
                let mut objects = watch
                    .store
                    .list_text(&watch.filter.kind, watch.filter.namespace.as_deref())?;
                if let Some(name) = &watch.filter.name {
                    objects.retain(|(_, n, _)| n == name);
                }
                for (_, _, text) in objects {
                    watch
                        .pending
                        .push_back(format!("{{\"type\":\"ADDED\",\"object\":{text}}}\n"));
                }
                // As Kubernetes marks the end of the initial events, so a client knows when
                // its first table is complete.
                watch.pending.push_back(event(
                    "BOOKMARK",
                    json!({
                        "kind": watch.filter.kind,
                        "metadata": {
                            "resourceVersion": watch.version.to_string(),
                            "annotations": { INITIAL_EVENTS_END: "true" },
                        },
                    }),
                ));
            }
        }
        Ok(watch)
    }

    fn collect(&mut self) {
        match self.log.since(self.version, &self.filter) {
            Ok((changes, reached)) => {
                for change in changes {
                    if let Some(line) = self.render(&change) {
                        self.pending.push_back(line);
                    }
                }
                self.version = reached;
            }
            Err(newest) => {
                self.pending.push_back(event(
                    "ERROR",
                    json!({
                        "kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "code": 410, "reason": "Expired",
                        "message": format!(
                            "too old resource version: {} (oldest resumable is newer; newest {newest}); list again",
                            self.version
                        ),
                    }),
                ));
                self.done = true;
            }
        }
    }

    /// The event for `change`, or `None` when a later change of the same object (also in
    /// the log) will report it: the object is read as it is now, so each state is sent once.
    fn render(&self, change: &Change) -> Option<String> {
        if change.kind_of_change == ChangeKind::Deleted {
            return Some(event(
                "DELETED",
                json!({
                    "kind": change.kind,
                    "metadata": {
                        "name": change.name,
                        "namespace": change.namespace,
                        "resourceVersion": change.resource_version.to_string(),
                    },
                }),
            ));
        }
        let current = self
            .store
            .get(&change.kind, &change.namespace, &change.name)
            .ok()
            .flatten()?;
        if version_of(&current) > change.resource_version {
            return None;
        }
        let kind = match change.kind_of_change {
            ChangeKind::Added => "ADDED",
            _ => "MODIFIED",
        };
        Some(event(kind, current))
    }

    /// The next line to send; `None` once the watch ended (after an `ERROR`).
    pub async fn next_line(&mut self) -> Option<String> {
        loop {
            if let Some(line) = self.pending.pop_front() {
                return Some(line);
            }
            if self.done {
                return None;
            }
            let log = self.log.clone();
            let woken = log.notify.notified();
            tokio::pin!(woken);
            // Register before looking, so a change between the look and the wait wakes us.
            woken.as_mut().enable();
            self.collect();
            if !self.pending.is_empty() {
                continue;
            }
            if tokio::time::timeout(BOOKMARK_INTERVAL, woken)
                .await
                .is_err()
            {
                return Some(event(
                    "BOOKMARK",
                    json!({
                        "kind": self.filter.kind,
                        "metadata": { "resourceVersion": self.version.to_string() },
                    }),
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_map(name: &str, value: &str) -> Value {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": name, "namespace": "default"}, "data": {"v": value}})
    }

    fn filter(name: Option<&str>) -> Filter {
        Filter {
            kind: "ConfigMap".into(),
            namespace: Some("default".into()),
            name: name.map(str::to_owned),
        }
    }

    async fn next(watch: &mut Watch) -> Value {
        let line = tokio::time::timeout(Duration::from_secs(5), watch.next_line())
            .await
            .ok()
            .flatten()
            .unwrap_or_default();
        serde_json::from_str(&line).unwrap_or(Value::Null)
    }

    #[tokio::test]
    async fn lists_then_streams_changes_and_resumes_from_a_version() -> Result<(), StoreError> {
        let dir = tempfile::tempdir().map_err(|e| StoreError::Database(e.to_string()))?;
        let store = ObjectStore::open(dir.path())?;
        let log = ChangeLog::attach(&store)?;
        store.apply(config_map("a", "1"))?;
        let mut watch = Watch::start(store.clone(), log.clone(), filter(None), None)?;
        let added = next(&mut watch).await;
        assert_eq!(
            (
                added["type"].as_str(),
                added["object"]["data"]["v"].as_str()
            ),
            (Some("ADDED"), Some("1"))
        );
        let end = next(&mut watch).await;
        assert_eq!(end["type"], "BOOKMARK");
        assert_eq!(
            end["object"]["metadata"]["annotations"][INITIAL_EVENTS_END],
            "true"
        );
        let listed_at: u64 = end["object"]["metadata"]["resourceVersion"]
            .as_str()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);

        store.apply(config_map("a", "2"))?;
        let modified = next(&mut watch).await;
        assert_eq!(
            (
                modified["type"].as_str(),
                modified["object"]["data"]["v"].as_str()
            ),
            (Some("MODIFIED"), Some("2"))
        );
        store.delete("ConfigMap", "default", "a")?;
        let deleted = next(&mut watch).await;
        assert_eq!(deleted["type"], "DELETED");
        assert_eq!(deleted["object"]["metadata"]["name"], "a");

        // A client that went away after the list sees exactly what it missed, and a watch
        // of one name sees only that name.
        store.apply(config_map("b", "1"))?;
        let mut resumed = Watch::start(
            store.clone(),
            log.clone(),
            filter(Some("a")),
            Some(listed_at),
        )?;
        // The modification is reported by the deletion that followed it.
        assert_eq!(next(&mut resumed).await["type"], "DELETED");
        store.apply(config_map("a", "3"))?;
        let again = next(&mut resumed).await;
        assert_eq!(again["type"], "ADDED");
        assert_eq!(again["object"]["data"]["v"], "3");
        Ok(())
    }

    #[tokio::test]
    async fn a_version_older_than_the_log_expires_with_410() -> Result<(), StoreError> {
        let dir = tempfile::tempdir().map_err(|e| StoreError::Database(e.to_string()))?;
        let store = ObjectStore::open(dir.path())?;
        let log = ChangeLog::attach(&store)?;
        for version in 1..=(LOG_CAPACITY as u64 + 10) {
            log.push(Change {
                kind: "ConfigMap".into(),
                namespace: "default".into(),
                name: "x".into(),
                kind_of_change: ChangeKind::Modified,
                resource_version: version,
            });
        }
        let mut old = Watch::start(store.clone(), log.clone(), filter(None), Some(3))?;
        let expired = next(&mut old).await;
        assert_eq!(expired["type"], "ERROR");
        assert_eq!(expired["object"]["code"], 410);
        assert_eq!(old.next_line().await, None);
        let mut recent = Watch::start(store, log, filter(None), Some(LOG_CAPACITY as u64 + 5))?;
        // Not expired: it waits (its next event would be a bookmark).
        assert!(
            tokio::time::timeout(Duration::from_millis(200), recent.next_line())
                .await
                .is_err()
        );
        Ok(())
    }
}
