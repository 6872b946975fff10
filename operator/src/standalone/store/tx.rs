//! One write transaction with the API server's semantics: create, apply, status,
//! finalizers, deletion with its cascade.

use std::collections::VecDeque;

use redb::ReadableTable as _;
use serde_json::Value;

use crate::standalone::store::change::{Applied, Change, ChangeKind, Deleted};
use crate::standalone::store::error::StoreError;
use crate::standalone::store::key::Key;
use crate::standalone::store::object::{
    desired_state, edit_meta, finalizers, given_version, is_empty_list, is_terminating, meta,
    now_rfc3339, owner_uids, resource_version, set_finalizer_list, uid,
};

use super::{NOT_DESIRED_STATE, SERVER_FIELDS};

/// One write transaction: the objects table, the counter as it will be committed, and the
/// changes to announce once the commit has succeeded.
pub(super) struct Tx<'t> {
    pub(super) objects: redb::Table<'t, &'static str, &'static [u8]>,
    /// The owner index (`super::OWNED`).
    pub(super) owned: redb::Table<'t, &'static str, ()>,
    pub(super) version: u64,
    pub(super) changes: Announced,
}

/// A transaction's changes, each with the object as stored after it (`None` once removed).
pub(super) type Announced = Vec<(Change, Option<Value>)>;

impl Tx<'_> {
    pub(super) fn load(&self, key: &Key) -> Result<Option<Value>, StoreError> {
        match self.objects.get(key.encoded().as_str())? {
            Some(bytes) => Ok(Some(serde_json::from_slice(bytes.value())?)),
            None => Ok(None),
        }
    }

    /// Stamps `obj` with the next resourceVersion, stores it and records the change.
    pub(super) fn save(
        &mut self,
        key: &Key,
        obj: &mut Value,
        change: ChangeKind,
    ) -> Result<(), StoreError> {
        self.stamp(obj);
        let bytes = serde_json::to_vec(obj)?;
        let encoded = key.encoded();
        self.objects.insert(encoded.as_str(), bytes.as_slice())?;
        for owner in owner_uids(obj) {
            self.owned
                .insert(owned_entry(owner, &encoded).as_str(), ())?;
        }
        self.changes
            .push((key.change(change, self.version), Some(obj.clone())));
        Ok(())
    }

    /// Removes the object (no cascade), stamping its last state with a new version.
    pub(super) fn remove(&mut self, key: &Key, mut obj: Value) -> Result<Value, StoreError> {
        self.stamp(&mut obj);
        let encoded = key.encoded();
        self.objects.remove(encoded.as_str())?;
        for owner in owner_uids(&obj) {
            self.owned.remove(owned_entry(owner, &encoded).as_str())?;
        }
        self.changes
            .push((key.change(ChangeKind::Deleted, self.version), None));
        Ok(obj)
    }

    pub(super) fn stamp(&mut self, obj: &mut Value) {
        self.version += 1;
        let version = Value::String(self.version.to_string());
        edit_meta(obj, |meta| {
            meta.insert("resourceVersion".into(), version);
        });
    }

    pub(super) fn load_existing(&self, key: &Key) -> Result<Value, StoreError> {
        self.load(key)?.ok_or_else(|| key.not_found())
    }

    pub(super) fn check_version(
        key: &Key,
        current: &Value,
        expected: Option<&str>,
    ) -> Result<(), StoreError> {
        match expected {
            Some(expected) if !expected.is_empty() => {
                let actual = resource_version(current);
                if actual == expected {
                    Ok(())
                } else {
                    Err(key.conflict(expected, actual))
                }
            }
            _ => Ok(()),
        }
    }

    pub(super) fn create(&mut self, key: &Key, mut obj: Value) -> Result<Value, StoreError> {
        if let Some(map) = obj.as_object_mut() {
            map.remove("status");
        }
        edit_meta(&mut obj, |meta| {
            for field in SERVER_FIELDS {
                meta.remove(*field);
            }
            meta.insert("namespace".into(), Value::String(key.namespace.clone()));
            meta.insert(
                "uid".into(),
                Value::String(uuid::Uuid::new_v4().hyphenated().to_string()),
            );
            meta.insert("creationTimestamp".into(), Value::String(now_rfc3339()));
            meta.insert("generation".into(), Value::from(1));
            for field in ["finalizers", "ownerReferences"] {
                if meta.get(field).is_some_and(is_empty_list) {
                    meta.remove(field);
                }
            }
        });
        self.save(key, &mut obj, ChangeKind::Added)?;
        Ok(obj)
    }

    pub(super) fn apply(
        &mut self,
        key: &Key,
        incoming: Value,
        create_only: bool,
    ) -> Result<Applied, StoreError> {
        let given = given_version(&incoming)?;
        let Some(current) = self.load(key)? else {
            if given.is_some() {
                // An update of something that is not there, as a PUT would be.
                return Err(key.not_found());
            }
            let object = self.create(key, incoming)?;
            return Ok(Applied {
                object,
                created: true,
            });
        };
        if create_only {
            return Err(key.already_exists());
        }
        Self::check_version(key, &current, given.as_deref())?;
        let mut next = current.clone();
        let old_state = desired_state(&current);
        let new_state = desired_state(&incoming);
        let state_changed = old_state != new_state;
        if let Some(map) = next.as_object_mut() {
            map.retain(|k, _| NOT_DESIRED_STATE.contains(&k.as_str()));
            map.extend(new_state);
            if let Some(api_version) = incoming.get("apiVersion") {
                map.insert("apiVersion".into(), api_version.clone());
            }
        }
        let incoming_meta = meta(&incoming).cloned().unwrap_or_default();
        edit_meta(&mut next, |next_meta| {
            for field in ["labels", "annotations"] {
                match incoming_meta.get(field) {
                    Some(v) if !v.is_null() => {
                        next_meta.insert(field.into(), v.clone());
                    }
                    _ => {
                        next_meta.remove(field);
                    }
                }
            }
            for field in ["finalizers", "ownerReferences"] {
                match incoming_meta.get(field) {
                    None => {}
                    Some(v) if is_empty_list(v) => {
                        next_meta.remove(field);
                    }
                    Some(v) => {
                        next_meta.insert(field.into(), v.clone());
                    }
                }
            }
        });
        if next == current {
            return Ok(Applied {
                object: current,
                created: false,
            });
        }
        if is_terminating(&current) {
            return Err(key.terminating("apply changed its spec or metadata"));
        }
        if state_changed {
            let generation = meta(&current)
                .and_then(|m| m.get("generation"))
                .and_then(Value::as_i64)
                .unwrap_or(0);
            edit_meta(&mut next, |meta| {
                meta.insert("generation".into(), Value::from(generation + 1));
            });
        }
        self.save(key, &mut next, ChangeKind::Modified)?;
        Ok(Applied {
            object: next,
            created: false,
        })
    }

    pub(super) fn write_status(
        &mut self,
        key: &Key,
        status: Value,
        expected: Option<&str>,
    ) -> Result<Value, StoreError> {
        let current = self.load_existing(key)?;
        Self::check_version(key, &current, expected)?;
        let mut next = current.clone();
        if let Some(map) = next.as_object_mut() {
            if status.is_null() {
                map.remove("status");
            } else {
                map.insert("status".into(), status);
            }
        }
        if next == current {
            return Ok(current);
        }
        self.save(key, &mut next, ChangeKind::Modified)?;
        Ok(next)
    }

    pub(super) fn set_finalizers(
        &mut self,
        key: &Key,
        list: Vec<String>,
        expected: Option<&str>,
    ) -> Result<Value, StoreError> {
        let current = self.load_existing(key)?;
        Self::check_version(key, &current, expected)?;
        let terminating = is_terminating(&current);
        if terminating {
            let had = finalizers(&current);
            if let Some(added) = list.iter().find(|f| !had.contains(f)) {
                return Err(key.terminating(format!("adding finalizer {added:?}")));
            }
        }
        let mut next = current.clone();
        set_finalizer_list(&mut next, &list);
        if terminating && list.is_empty() {
            return match self.delete_tree(key, next, true)? {
                Deleted::Removed(last) | Deleted::Pending(last) => Ok(last),
            };
        }
        if next == current {
            return Ok(current);
        }
        self.save(key, &mut next, ChangeKind::Modified)?;
        Ok(next)
    }

    /// Deletes one object without cascading: marks it if it has finalizers, else removes it.
    pub(super) fn delete_one(&mut self, key: &Key, obj: Value) -> Result<Deleted, StoreError> {
        if finalizers(&obj).is_empty() {
            return Ok(Deleted::Removed(self.remove(key, obj)?));
        }
        if is_terminating(&obj) {
            return Ok(Deleted::Pending(obj));
        }
        let mut obj = obj;
        edit_meta(&mut obj, |meta| {
            meta.insert("deletionTimestamp".into(), Value::String(now_rfc3339()));
        });
        self.save(key, &mut obj, ChangeKind::Modified)?;
        Ok(Deleted::Pending(obj))
    }

    /// Deletes `obj` and, once it is removed, every object it owns (transitively), each under
    /// the same finalizer rule. `remove_now` skips the finalizer check for the first object
    /// (its last finalizer was just removed).
    pub(super) fn delete_tree(
        &mut self,
        key: &Key,
        obj: Value,
        remove_now: bool,
    ) -> Result<Deleted, StoreError> {
        let first = if remove_now {
            Deleted::Removed(self.remove(key, obj)?)
        } else {
            self.delete_one(key, obj)?
        };
        let Deleted::Removed(removed) = &first else {
            return Ok(first);
        };
        let mut queue = VecDeque::from([uid(removed).to_owned()]);
        while let Some(owner) = queue.pop_front() {
            if owner.is_empty() {
                continue;
            }
            for child_key in self.take_children(&owner)? {
                // Already gone when several owners of it were removed in this cascade, or
                // no longer naming this owner.
                let Some(child) = self.load(&child_key)? else {
                    continue;
                };
                if !owner_uids(&child).any(|o| o == owner) {
                    continue;
                }
                if let Deleted::Removed(child) = self.delete_one(&child_key, child)? {
                    queue.push_back(uid(&child).to_owned());
                }
            }
        }
        Ok(first)
    }

    /// The keys the owner index lists under `owner`, their entries removed.
    fn take_children(&mut self, owner: &str) -> Result<Vec<Key>, StoreError> {
        let from = owned_entry(owner, "");
        let to = format!("{owner}\u{1}");
        let mut entries = Vec::new();
        for entry in self.owned.range(from.as_str()..to.as_str())? {
            let (entry, _) = entry?;
            entries.push(entry.value().to_owned());
        }
        let mut children = Vec::new();
        for entry in entries {
            self.owned.remove(entry.as_str())?;
            if let Some(key) = entry.split_once('\0').and_then(|(_, k)| Key::decode(k)) {
                children.push(key);
            }
        }
        Ok(children)
    }
}

/// The owner index's entry of object `key` (encoded) under `owner`'s uid.
pub(super) fn owned_entry(owner: &str, key: &str) -> String {
    format!("{owner}\0{key}")
}
