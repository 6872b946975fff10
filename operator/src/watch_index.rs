//! What the cache indexes (`task_index.rs`, `proplet_index.rs`) share: each remembers what
//! an object put in, so that the object's next version or its deletion takes it out again,
//! and follows a watch the same way (applies and deletes as they come, a relist as one
//! replacement once it is complete, so objects gone meanwhile leave the index then).

use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard};

use kube::runtime::watcher;

/// `(namespace, name)`.
pub type Name = (String, String);

/// An index of cached objects of one kind.
pub trait Index: Default {
    /// The kind indexed.
    type Object: kube::Resource;
    /// What one object puts into the index.
    type Entry;

    /// The object's `(namespace, name)` (namespace `default` when unset).
    fn name_of(object: &Self::Object) -> Name {
        name_in(kube::Resource::meta(object))
    }
    /// What `object` puts into the index.
    fn entry_of(object: &Self::Object) -> Self::Entry;
    /// Puts `entry` in for `key`, replacing what `key` put in before.
    fn link(&mut self, key: Name, entry: Self::Entry);
    /// Takes out what `key` put in.
    fn unlink(&mut self, key: &Name);
    /// The objects of a relist in progress, if one is.
    fn relist(&mut self) -> &mut Option<Vec<(Name, Self::Entry)>>;

    /// Indexes `object`, replacing what its previous version put in.
    fn put(&mut self, object: &Self::Object) {
        self.link(Self::name_of(object), Self::entry_of(object));
    }

    /// Takes the object `namespace`/`name` out of the index.
    fn remove(&mut self, namespace: &str, name: &str) {
        self.unlink(&(namespace.to_owned(), name.to_owned()));
    }

    /// Follows a watch of the indexed kind.
    fn apply(&mut self, event: &watcher::Event<Self::Object>) {
        match event {
            watcher::Event::Apply(object) => self.put(object),
            watcher::Event::Delete(object) => self.unlink(&Self::name_of(object)),
            watcher::Event::Init => *self.relist() = Some(Vec::new()),
            watcher::Event::InitApply(object) => {
                let entry = (Self::name_of(object), Self::entry_of(object));
                match self.relist() {
                    Some(listed) => listed.push(entry),
                    None => self.link(entry.0, entry.1),
                }
            }
            watcher::Event::InitDone => {
                if let Some(listed) = self.relist().take() {
                    *self = Self::default();
                    for (key, entry) in listed {
                        self.link(key, entry);
                    }
                }
            }
        }
    }
}

/// An index shared by the watch that feeds it and the reconciles that read it.
#[derive(Debug, Default)]
pub struct SharedIndex<I>(Arc<RwLock<I>>);

impl<I> Clone for SharedIndex<I> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<I: Index> SharedIndex<I> {
    /// Applies one event of the watch (see [`Index::apply`]).
    pub fn apply(&self, event: &watcher::Event<I::Object>) {
        self.0
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .apply(event);
    }

    /// The index as it is now.
    pub fn read(&self) -> RwLockReadGuard<'_, I> {
        self.0.read().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The `(namespace, name)` of an object's metadata (namespace `default` when unset).
pub fn name_in(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Name {
    (
        meta.namespace.clone().unwrap_or_else(|| "default".into()),
        meta.name.clone().unwrap_or_default(),
    )
}
