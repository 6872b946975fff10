//! The commands a Task plan sends to devices: start requests (pinned to an image digest
//! when resolved) and stops, and the proplet views they are addressed by.

use propeller_broker::protocol::{MonitoringProfile as WireProfile, StartRequest, StopRequest};
use serde_json::Value;

use crate::crd::task::{Task, TaskStatus};
use crate::decision::scheduler::SelectorView;
use crate::decision::task_observations::{PropletView, TaskObservations};

use super::{StartCommand, StopCommand};

/// The identity results of a proplet carry: its client id, or its name when unknown.
pub(super) fn client_of<'a>(observed: &'a TaskObservations, proplet: &'a str) -> &'a str {
    observed
        .proplets
        .iter()
        .find(|p| p.candidate.name == proplet)
        .map_or(proplet, |p| p.client_id.as_str())
}

pub(super) fn view<'a>(observed: &'a TaskObservations, proplet: &str) -> Option<&'a PropletView> {
    observed
        .proplets
        .iter()
        .find(|p| p.candidate.name == proplet)
}

/// The selector in the scheduler's terms.
pub fn selector_of(task: &Task) -> SelectorView {
    let sel = task.spec.proplet_selector.clone().unwrap_or_default();
    SelectorView {
        proplet_id: sel.proplet_id.filter(|s| !s.is_empty()),
        match_labels: sel.match_labels,
        match_device_types: sel.match_device_types,
        match_capabilities: sel.match_capabilities,
        preferred_type: task.spec.preferred_proplet_type,
        needs_attester: task.spec.encrypted,
    }
}

/// The start message for `target` in a run whose OCI image resolved to `image_digest`: the
/// device is asked to fetch the digest-pinned name, so all copies get the same bytes.
pub fn start_request_pinned(
    task: &Task,
    target: Option<&PropletView>,
    image_digest: Option<&str>,
) -> StartRequest {
    let mut request = start_request(task, target);
    let pinned = image_digest.zip(task.spec.image_url.as_deref());
    if let Some(pinned) = pinned.and_then(|(d, url)| crate::image_reference::pinned(url, d)) {
        request.image_url = Some(pinned);
    }
    request
}

/// The start message for `target` (`None` builds the upstream-style broadcast start).
pub fn start_request(task: &Task, target: Option<&PropletView>) -> StartRequest {
    let spec = &task.spec;
    let uid = task.metadata.uid.clone().unwrap_or_default();
    let mut env = spec.env.clone();
    if let Some(t) = target {
        env.insert("PROPLET_ID".into(), t.client_id.clone());
        env.insert("TASK_ID".into(), uid.clone());
    }
    let monitoring_profile = spec.monitoring_profile.as_ref().map(|m| {
        let interval_secs = m
            .interval
            .as_deref()
            .and_then(|s| propeller_broker::protocol::parse_duration(s).ok())
            .map_or(10, |d| d.as_secs().max(1));
        WireProfile {
            enabled: m.enabled,
            interval_secs,
            collect_cpu: m.collect_cpu,
            collect_memory: m.collect_memory,
            collect_disk_io: m.collect_disk_io,
            collect_threads: m.collect_threads,
            collect_file_descriptors: m.collect_file_descriptors,
            export_to_mqtt: m.export_to_mqtt,
            retain_history: m.retain_history,
            history_size: m.history_size.map_or(0, |n| n.max(0) as u64),
        }
    });
    let file = spec.file.as_deref().and_then(|b64| {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.decode(b64).ok()
    });
    let metadata = match &spec.metadata {
        Some(Value::Object(map)) => Some(map.clone()),
        _ => None,
    };
    StartRequest {
        id: uid,
        name: spec
            .function_name
            .clone()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| task.metadata.name.clone().unwrap_or_default()),
        state: 1,
        image_url: spec.image_url.clone(),
        file,
        inputs: spec
            .inputs
            .iter()
            .map(|i| match i {
                k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n) => n.to_string(),
                k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(s) => s.clone(),
            })
            .collect(),
        cli_args: spec.cli_args.clone(),
        broadcast: target.is_none(),
        daemon: spec.daemon,
        latent: false,
        env,
        encrypted: spec.encrypted,
        kbs_resource_path: spec.kbs_resource_path.clone(),
        monitoring_profile,
        proplet_id: target.map(|t| t.client_id.clone()),
        hal_storage_path: spec.hal_storage_path.clone(),
        mode: spec.mode.map(|m| m.as_str().to_owned()),
        kind: Some(spec.kind.as_str().to_owned()),
        priority: Some(i64::from(spec.priority)),
        metadata,
        parent_results: None,
        // Set by `start_for` when a dispatch sends it.
        run: None,
    }
}

pub(super) fn stop_for(task: &Task, target: &PropletView) -> StopCommand {
    StopCommand {
        domain: target.domain.clone(),
        channel: target.channel.clone(),
        request: StopRequest::new(
            task.metadata.uid.clone().unwrap_or_default(),
            task.metadata.name.clone().unwrap_or_default(),
            Some(target.client_id.clone()),
        ),
    }
}

/// The start of the run `status` records, numbered with its run count so an agent that
/// already finished that run answers a repeat with its result instead of running again.
pub(super) fn start_for(task: &Task, target: &PropletView, status: &TaskStatus) -> StartCommand {
    let mut request = start_request_pinned(task, Some(target), status.image_digest.as_deref());
    request.run = status.run_count.and_then(|n| u64::try_from(n).ok());
    StartCommand {
        proplet: target.candidate.name.clone(),
        domain: target.domain.clone(),
        channel: target.channel.clone(),
        request,
    }
}

/// Proplets the current run was sent to.
pub(super) fn targets_of(status: &TaskStatus) -> Vec<String> {
    if !status.broadcast_proplets.is_empty() {
        status.broadcast_proplets.clone()
    } else {
        status.assigned_proplet.iter().cloned().collect()
    }
}
