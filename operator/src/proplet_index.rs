//! The Proplets by label, in both drivers: placing a task whose selector names a label (or a
//! proplet) reads the proplets carrying it instead of passing over every proplet of the
//! namespace. With 10,000 proplets of which four could take the tasks, that pass was most of
//! a burst's CPU (the candidate check over every cached Proplet per scheduling reconcile).
//!
//! Standalone feeds the index from its store's writes; Kubernetes mode from the Proplet
//! watch (a relist replaces it whole). It only narrows the set: the scheduler's own rules
//! are still checked on every proplet it returns.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::crd::proplet::Proplet;
use crate::decision::scheduler::{IndexKeys, SelectorView};
use crate::watch_index::{Index, Name, SharedIndex};

/// `(namespace, label key, label value)`.
type Label = (String, String, String);

/// A proplet's labels: what it put into the index.
type Labels = BTreeMap<String, String>;

/// The proplets of each label, per namespace.
#[derive(Debug, Default)]
pub struct PropletIndex {
    /// Each proplet's labels, so that its next version can take them out again.
    labels: HashMap<Name, Labels>,
    by_label: HashMap<Label, BTreeSet<String>>,
    /// The proplets of a relist in progress, which replace the index when it is complete.
    relist: Option<Vec<(Name, Labels)>>,
}

/// A [`PropletIndex`] shared by the Proplet watch that feeds it and the reconciles that
/// read it.
pub type SharedPropletIndex = SharedIndex<PropletIndex>;

/// Which proplets of a namespace a selector can match, as far as the index can say.
#[derive(Debug, PartialEq, Eq)]
pub enum Narrowed {
    /// The selector names no label and no proplet: every proplet of the namespace.
    Whole,
    /// At most these (by name); the selector's other rules still apply to each.
    Only(Vec<String>),
}

impl Index for PropletIndex {
    type Object = Proplet;
    type Entry = Labels;

    fn entry_of(proplet: &Proplet) -> Labels {
        proplet.metadata.labels.clone().unwrap_or_default()
    }

    fn relist(&mut self) -> &mut Option<Vec<(Name, Labels)>> {
        &mut self.relist
    }

    fn link(&mut self, key: Name, labels: Labels) {
        self.unlink(&key);
        let (namespace, name) = &key;
        for (label, value) in &labels {
            self.by_label
                .entry((namespace.clone(), label.clone(), value.clone()))
                .or_default()
                .insert(name.clone());
        }
        self.labels.insert(key, labels);
    }

    fn unlink(&mut self, key: &Name) {
        let Some(old) = self.labels.remove(key) else {
            return;
        };
        let (namespace, name) = key;
        for (label, value) in old {
            let at = (namespace.clone(), label, value);
            if let Some(names) = self.by_label.get_mut(&at) {
                names.remove(name);
                if names.is_empty() {
                    self.by_label.remove(&at);
                }
            }
        }
    }
}

impl PropletIndex {
    /// The proplets of `namespace` that `selector` can match: the one it names, or those
    /// carrying the rarest of its labels ([`SelectorView::index_keys`] says which).
    pub fn narrow(&self, namespace: &str, selector: &SelectorView) -> Narrowed {
        let labels = match selector.index_keys() {
            IndexKeys::Any => return Narrowed::Whole,
            IndexKeys::Name(name) => return Narrowed::Only(vec![name.to_owned()]),
            IndexKeys::Labels(labels) => labels,
        };
        let mut rarest: Option<&BTreeSet<String>> = None;
        for (key, value) in labels {
            let at = (namespace.to_owned(), key.to_owned(), value.to_owned());
            match self.by_label.get(&at) {
                None => return Narrowed::Only(Vec::new()),
                Some(names) if rarest.is_none_or(|r| names.len() < r.len()) => rarest = Some(names),
                Some(_) => {}
            }
        }
        Narrowed::Only(
            rarest
                .map(|names| names.iter().cloned().collect())
                .unwrap_or_default(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::watcher;
    use serde_json::json;

    fn proplet(namespace: &str, name: &str, labels: serde_json::Value) -> Proplet {
        serde_json::from_value(json!({
            "apiVersion": "propeller.propeller.absmach.eu/v1",
            "kind": "Proplet",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"type": "external", "connectionConfig": {
                "mqttAddress": "tcp://127.0.0.1:1883", "domainId": "d", "channelId": name,
                "clientId": name, "clientKeySecretRef": {"name": name, "key": "key"}}},
        }))
        .unwrap_or_else(|e| panic!("test proplet: {e}"))
    }

    fn selector(labels: &[(&str, &str)], proplet_id: Option<&str>) -> SelectorView {
        SelectorView {
            proplet_id: proplet_id.map(str::to_owned),
            match_labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..SelectorView::default()
        }
    }

    fn only(names: &[&str]) -> Narrowed {
        Narrowed::Only(names.iter().map(|n| (*n).to_owned()).collect())
    }

    #[test]
    fn a_selector_reads_the_proplets_of_its_rarest_label_in_its_namespace() {
        let mut index = PropletIndex::default();
        index.put(&proplet("a", "w0", json!({"role": "worker", "zone": "x"})));
        index.put(&proplet("a", "w1", json!({"role": "worker", "zone": "y"})));
        index.put(&proplet("a", "hb", json!({"zone": "x"})));
        index.put(&proplet("b", "w2", json!({"role": "worker"})));

        assert_eq!(index.narrow("a", &selector(&[], None)), Narrowed::Whole);
        assert_eq!(
            index.narrow("a", &selector(&[("role", "worker")], None)),
            only(&["w0", "w1"])
        );
        assert_eq!(
            index.narrow("a", &selector(&[("role", "worker"), ("zone", "y")], None)),
            only(&["w1"])
        );
        assert_eq!(
            index.narrow("a", &selector(&[("role", "gpu")], None)),
            only(&[])
        );
        assert_eq!(
            index.narrow("b", &selector(&[("role", "worker")], None)),
            only(&["w2"])
        );
        assert_eq!(
            index.narrow("a", &selector(&[("role", "worker")], Some("hb"))),
            only(&["hb"])
        );
    }

    proptest::proptest! {
        /// Narrowing never drops a proplet the scheduler's rules admit, whatever the labels,
        /// the name pin and the namespaces.
        #[test]
        fn narrowing_keeps_every_proplet_the_selector_admits(
            fleet in proptest::collection::btree_map(
                (0..2usize, 0..6usize),
                proptest::collection::btree_map(0..3usize, 0..2usize, 0..3),
                0..10,
            ),
            wanted in proptest::collection::btree_map(0..3usize, 0..2usize, 0..3),
            pinned in proptest::option::of(0..7usize),
        ) {
            let namespaces = ["a", "b"];
            let label = |k: usize, v: usize| (format!("k{k}"), format!("v{v}"));
            let mut index = PropletIndex::default();
            let mut proplets = Vec::new();
            for ((ns, n), labels) in &fleet {
                let labels: BTreeMap<String, String> =
                    labels.iter().map(|(k, v)| label(*k, *v)).collect();
                let mut p = proplet(namespaces[*ns], &format!("p{n}"), json!(labels));
                p.status = Some(serde_json::from_value(json!({"phase": "Running"}))
                    .unwrap_or_else(|e| panic!("status: {e}")));
                index.put(&p);
                proplets.push(p);
            }
            let view = SelectorView {
                // p6 exists nowhere: a pin to an absent proplet.
                proplet_id: pinned.map(|n| if n == 0 { String::new() } else { format!("p{n}") }),
                match_labels: wanted.iter().map(|(k, v)| label(*k, *v)).collect(),
                ..SelectorView::default()
            };
            for namespace in namespaces {
                let narrowed = index.narrow(namespace, &view);
                for p in proplets.iter().filter(|p| p.metadata.namespace.as_deref() == Some(namespace)) {
                    let name = p.metadata.name.clone().unwrap_or_default();
                    let kept = match &narrowed {
                        Narrowed::Whole => true,
                        Narrowed::Only(names) => names.contains(&name),
                    };
                    proptest::prop_assert!(
                        kept || !crate::decision::scheduler::admits(p, &view),
                        "{name} in {namespace} admitted by {view:?} but narrowed to {narrowed:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_new_version_or_a_deletion_takes_out_what_the_old_one_indexed() {
        let mut index = PropletIndex::default();
        index.put(&proplet("a", "w0", json!({"role": "worker"})));
        index.put(&proplet("a", "w0", json!({"role": "spare"})));
        let worker = selector(&[("role", "worker")], None);
        assert_eq!(index.narrow("a", &worker), only(&[]));
        assert_eq!(
            index.narrow("a", &selector(&[("role", "spare")], None)),
            only(&["w0"])
        );
        index.remove("a", "w0");
        assert_eq!(
            index.narrow("a", &selector(&[("role", "spare")], None)),
            only(&[])
        );
        assert!(index.by_label.is_empty() && index.labels.is_empty());
    }

    #[test]
    fn a_relist_replaces_the_index_once_it_is_complete() {
        let mut index = PropletIndex::default();
        index.put(&proplet("a", "gone", json!({"role": "worker"})));
        index.apply(&watcher::Event::Init);
        index.apply(&watcher::Event::InitApply(proplet(
            "a",
            "w1",
            json!({"role": "worker"}),
        )));
        let worker = selector(&[("role", "worker")], None);
        // Until the relist is complete, the index is the one before it.
        assert_eq!(index.narrow("a", &worker), only(&["gone"]));
        index.apply(&watcher::Event::InitDone);
        assert_eq!(index.narrow("a", &worker), only(&["w1"]));
    }
}
