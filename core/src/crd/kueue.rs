//! The parts of Kueue's resources (`kueue.x-k8s.io/v1beta2`, its storage version) that
//! propeller writes or reads: a Workload per Kueue-managed PropellerJob, and the
//! ResourceFlavor and WorkloadPriorityClass a Workload names. Kueue owns their CRDs; these
//! types carry only the fields propeller uses, and never generate a CRD.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::PodTemplateSpec;
use kube::CustomResource;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::common::Condition;

/// What a Workload asks of Kueue.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[kube(
    group = "kueue.x-k8s.io",
    version = "v1beta2",
    kind = "Workload",
    plural = "workloads",
    namespaced,
    status = "WorkloadStatus",
    derive = "PartialEq",
    derive = "Default",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadSpec {
    /// The LocalQueue the Workload waits in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_name: Option<String>,
    /// What runs at once: one pod set, its count and what each member requests.
    #[serde(default)]
    pub pod_sets: Vec<PodSet>,
    /// What Kueue orders and preempts by.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// The priority class `priority` came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_ref: Option<PriorityClassRef>,
}

/// A group of identical members of a Workload.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PodSet {
    pub name: String,
    pub count: i32,
    pub template: PodTemplateSpec,
}

/// The class a Workload's priority comes from.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PriorityClassRef {
    pub group: String,
    pub kind: String,
    pub name: String,
}

/// What Kueue decided about a Workload (the parts propeller reads or acknowledges).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadStatus {
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// Where the quota was reserved: the ClusterQueue and each pod set's flavors. Kept as
    /// Kueue wrote it; `None` removes it when propeller gives the quota back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission: Option<Value>,
}

/// A ResourceFlavor: the node labels its admitted work is restricted to.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[kube(
    group = "kueue.x-k8s.io",
    version = "v1beta2",
    kind = "ResourceFlavor",
    plural = "resourceflavors",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct ResourceFlavorSpec {
    #[serde(default)]
    pub node_labels: BTreeMap<String, String>,
}

/// A WorkloadPriorityClass: a named priority value (its fields sit at the top level, as in
/// a Kubernetes PriorityClass).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct WorkloadPriorityClass {
    pub metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    #[serde(default)]
    pub value: i32,
}

impl kube::Resource for WorkloadPriorityClass {
    type DynamicType = ();
    type Scope = k8s_openapi::ClusterResourceScope;

    fn kind(_: &()) -> std::borrow::Cow<'_, str> {
        "WorkloadPriorityClass".into()
    }
    fn group(_: &()) -> std::borrow::Cow<'_, str> {
        "kueue.x-k8s.io".into()
    }
    fn version(_: &()) -> std::borrow::Cow<'_, str> {
        "v1beta2".into()
    }
    fn plural(_: &()) -> std::borrow::Cow<'_, str> {
        "workloadpriorityclasses".into()
    }
    fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        &mut self.metadata
    }
}
