//! Compiled modules and components, cached by content hash with a size bound.

use std::collections::{HashMap, VecDeque};

use super::Compiled;

/// A small least-recently-used map of compiled modules.
pub(super) struct ModuleCache {
    pub(super) capacity: usize,
    pub(super) entries: HashMap<[u8; 32], Compiled>,
    pub(super) order: VecDeque<[u8; 32]>,
}

impl ModuleCache {
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            entries: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    pub(super) fn get(&mut self, key: &[u8; 32]) -> Option<Compiled> {
        let module = self.entries.get(key)?.clone();
        self.order.retain(|k| k != key);
        self.order.push_back(*key);
        Some(module)
    }

    pub(super) fn put(&mut self, key: [u8; 32], module: Compiled) {
        if self.entries.insert(key, module).is_none() {
            self.order.push_back(key);
        }
        while self.entries.len() > self.capacity {
            match self.order.pop_front() {
                Some(old) => {
                    self.entries.remove(&old);
                }
                None => break,
            }
        }
    }
}
