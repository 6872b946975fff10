//! Recent events per object in standalone mode, the counterpart of Kubernetes Events that
//! `propeller describe` shows. Kept in memory, the latest few per object, like the short
//! time-to-live Events have on a cluster.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::decision::task::Note;
use crate::standalone::store::ObjectStore;

/// Events kept per object.
pub const EVENTS_PER_OBJECT: usize = 20;

/// One recorded event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Event {
    /// When it happened.
    pub time: DateTime<Utc>,
    /// `Normal` or `Warning`.
    #[serde(rename = "type")]
    pub type_: &'static str,
    /// CamelCase reason.
    pub reason: String,
    /// What happened.
    pub message: String,
}

/// Recent events by `Kind/namespace/name`.
#[derive(Debug, Default)]
pub struct EventLog {
    events: Mutex<HashMap<String, VecDeque<Event>>>,
}

fn key(kind: &str, namespace: &str, name: &str) -> String {
    format!("{kind}/{namespace}/{name}")
}

impl EventLog {
    /// An empty log.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty log that forgets an object's events once `store` has removed it (as the
    /// API server's Events go with their short TTL), so deleted objects do not pile up.
    pub fn attach(store: &ObjectStore) -> Arc<Self> {
        let log = Arc::new(Self::new());
        let weak = Arc::downgrade(&log);
        store.observe(Arc::new(move |change, object| {
            if let (Some(log), None) = (weak.upgrade(), object) {
                log.forget(&change.kind, &change.namespace, &change.name);
            }
        }));
        log
    }

    /// Drops the events of an object.
    pub fn forget(&self, kind: &str, namespace: &str, name: &str) {
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key(kind, namespace, name));
    }

    /// Records `note` about an object at `time`, dropping its oldest event past the cap.
    pub fn record(
        &self,
        kind: &str,
        namespace: &str,
        name: &str,
        note: &Note,
        time: DateTime<Utc>,
    ) {
        let mut events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        let list = events.entry(key(kind, namespace, name)).or_default();
        if list.len() >= EVENTS_PER_OBJECT {
            list.pop_front();
        }
        list.push_back(Event {
            time,
            type_: if note.warning { "Warning" } else { "Normal" },
            reason: note.reason.to_owned(),
            message: note.message.clone(),
        });
    }

    /// The object's recent events, oldest first.
    pub fn of(&self, kind: &str, namespace: &str, name: &str) -> Vec<Event> {
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key(kind, namespace, name))
            .map(|l| l.iter().cloned().collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_keeps_the_latest_events_per_object() {
        let log = EventLog::new();
        let now = Utc::now();
        for i in 0..(EVENTS_PER_OBJECT + 5) {
            log.record(
                "Task",
                "default",
                "a",
                &Note {
                    warning: i % 2 == 0,
                    reason: "Scheduled",
                    message: format!("event {i}"),
                },
                now,
            );
        }
        let events = log.of("Task", "default", "a");
        assert_eq!(events.len(), EVENTS_PER_OBJECT);
        assert_eq!(events[0].message, "event 5");
        assert!(log.of("Task", "default", "b").is_empty());
    }

    #[test]
    fn a_deleted_objects_events_go_with_it() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let store = ObjectStore::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let log = EventLog::attach(&store);
        let task = |name: &str| {
            serde_json::json!({
                "apiVersion": "propeller.propeller.absmach.eu/v1",
                "kind": "Task",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"name": name},
            })
        };
        let note = Note {
            warning: false,
            reason: "Scheduled",
            message: "assigned".into(),
        };
        for name in ["gone", "kept"] {
            store.apply(task(name)).unwrap_or_else(|e| panic!("{e}"));
            log.record("Task", "default", name, &note, Utc::now());
        }
        store
            .delete("Task", "default", "gone")
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(log.of("Task", "default", "gone").is_empty());
        assert_eq!(log.of("Task", "default", "kept").len(), 1);
    }
}
