//! What this process wrote to objects itself, remembered until its cache shows it. Both
//! drivers keep one per kind that needs it, for two questions:
//!
//! - **What is the newest version of this object?** ([`OwnWrites::newest`]) A reconcile right
//!   after a write must plan from what it wrote, not from a cached version that write
//!   replaced: planning from the stale one wrote (and noted) the same change again, or lost
//!   a conditional write to a conflict. The Kubernetes driver's watch shows a write a few
//!   milliseconds late, so it asks this for Proplets and Tasks.
//! - **Did I make this change?** ([`OwnWrites::is_own`]) A change this process made need not
//!   wake the reconcile that made it (the Proplet plan already chose its next look), which
//!   halves the reconciles of heartbeating proplets in standalone mode.

use std::collections::HashMap;
use std::sync::Mutex;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use propeller_core::object_name::ObjectName;

use crate::state::lock;

/// One remembered write.
#[derive(Debug)]
struct Written<T> {
    /// The versions the write (or the writes of one apply) replaced: a cache still showing
    /// one of them has not seen it.
    replaced: Vec<String>,
    /// The version it produced.
    version: Option<String>,
    /// What it left, as the backend returned it.
    object: T,
}

/// This process's latest write to each object of one kind, until the cache shows it.
#[derive(Debug)]
pub struct OwnWrites<T> {
    written: Mutex<HashMap<ObjectName, Written<T>>>,
}

impl<T> Default for OwnWrites<T> {
    fn default() -> Self {
        Self {
            written: Mutex::new(HashMap::new()),
        }
    }
}

impl<T: Clone> OwnWrites<T> {
    /// Remembers a write to the object read as `read` (its name and the version the write
    /// was conditional on), which produced `version` and left `object`. A write that follows
    /// this process's previous one (based on the version it produced) also supersedes what
    /// that one replaced, so a cache still showing any of them is behind.
    pub fn record_write(&self, read: &ObjectMeta, version: Option<String>, object: T) {
        let name = ObjectName::from_meta(read);
        let based_on = read.resource_version.clone();
        let mut written = lock(&self.written);
        let mut replaced = match written.remove(&name) {
            Some(previous) if based_on.is_some() && previous.version == based_on => {
                previous.replaced
            }
            _ => Vec::new(),
        };
        replaced.extend(based_on);
        written.insert(
            name,
            Written {
                replaced,
                version,
                object,
            },
        );
    }

    /// What this process last wrote to `name`, when the cache still shows `cached_version`,
    /// a version that write replaced; `None` (and forgotten) once the cache caught up.
    pub fn newest(&self, name: &ObjectName, cached_version: Option<&str>) -> Option<T> {
        let mut written = lock(&self.written);
        let entry = written.get(name)?;
        if cached_version.is_some_and(|v| entry.replaced.iter().any(|r| r == v)) {
            return Some(entry.object.clone());
        }
        written.remove(name);
        None
    }

    /// Whether `version` of `name` is the one this process's last write produced (forgotten
    /// once asked).
    pub fn is_own(&self, name: &ObjectName, version: &str) -> bool {
        let mut written = lock(&self.written);
        if written
            .get(name)
            .is_some_and(|w| w.version.as_deref() == Some(version))
        {
            written.remove(name);
            return true;
        }
        false
    }

    /// Forgets the writes the cache caught up with, or whose object is gone: `cached`
    /// answers the version the cache shows of an object (`None`: not there).
    pub fn prune(&self, cached: impl Fn(&ObjectName) -> Option<String>) {
        lock(&self.written).retain(|name, w| cached(name).is_some_and(|v| w.replaced.contains(&v)));
    }

    /// How many writes are remembered.
    pub fn len(&self) -> usize {
        lock(&self.written).len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(name: &str, version: &str) -> ObjectMeta {
        ObjectMeta {
            namespace: Some("ns".into()),
            name: Some(name.into()),
            resource_version: Some(version.into()),
            ..Default::default()
        }
    }

    #[test]
    fn a_write_is_the_newest_until_the_cache_shows_it_and_is_known_as_own_once() {
        let writes = OwnWrites::default();
        let name = ObjectName::new("ns", "p");
        // Two writes of one apply: the second, based on the first's version, supersedes both.
        writes.record_write(&read("p", "1"), Some("2".into()), "two");
        writes.record_write(&read("p", "2"), Some("3".into()), "three");
        assert_eq!(writes.newest(&name, Some("1")), Some("three"));
        assert_eq!(writes.newest(&name, Some("2")), Some("three"));
        // The cache caught up: forgotten.
        assert_eq!(writes.newest(&name, Some("3")), None);
        assert!(writes.is_empty());

        writes.record_write(&read("p", "3"), Some("4".into()), "four");
        assert!(!writes.is_own(&name, "5"));
        assert!(writes.is_own(&name, "4"));
        assert!(!writes.is_own(&name, "4"), "asked once");

        // A write from a version this process did not produce starts afresh.
        writes.record_write(&read("p", "9"), Some("10".into()), "ten");
        writes.record_write(&read("p", "4"), Some("5".into()), "five");
        assert_eq!(writes.newest(&name, Some("9")), None);

        writes.record_write(&read("p", "4"), Some("5".into()), "five");
        writes.record_write(&read("gone", "1"), None, "x");
        writes.prune(|n| (n.name == "p").then(|| "4".to_owned()));
        assert_eq!(writes.len(), 1);
        writes.prune(|_| Some("5".to_owned()));
        assert!(writes.is_empty());
    }
}
