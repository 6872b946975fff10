//! The Deployment that runs a `k8s` proplet: our agent image, configured through the
//! `PROPLET_*` variables it reads (intervals in whole seconds, the key from its Secret).

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource,
    HTTPGetAction, PodSecurityContext, PodSpec, PodTemplateSpec, Probe, ResourceRequirements,
    SeccompProfile, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use propeller_broker::protocol::{parse_duration, whole_seconds};

use crate::crd::proplet::{ClientKeySource, LogLevel, Proplet, PropletType};
use crate::decision::names::{label_value, proplet_deployment_name};

/// Label naming the Proplet a Deployment belongs to.
pub const PROPLET_LABEL: &str = "propeller.absmach.eu/proplet";
/// Port of the agent's health and metrics endpoint when the Proplet does not set one.
pub const DEFAULT_METRICS_PORT: i32 = 9092;
/// Where the agent keeps its result spool inside the pod.
pub const STATE_DIR: &str = "/var/lib/proplet";

/// Why no Deployment can be built for a Proplet; shown in its status.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum DeploymentError {
    /// Only `k8s` proplets get a Deployment.
    #[error("proplet is not of type k8s")]
    NotK8s,
    /// `spec.k8s` is missing (the CRD rule normally prevents this).
    #[error("spec.k8s is required for a k8s proplet")]
    MissingK8sSpec,
    /// The object has no name, namespace or uid yet (not read from the API server).
    #[error("proplet metadata lacks {0}")]
    MissingMetadata(&'static str),
    /// No client key, inline or from a Secret.
    #[error("spec.connectionConfig needs clientKey or clientKeySecretRef")]
    MissingKey,
    /// A duration field does not parse.
    #[error("{field}: {message}")]
    BadDuration {
        /// The field path.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
}

/// Labels every object of this proplet carries; the first two also select its pods.
pub fn proplet_labels(proplet_name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".into(), "proplet".into()),
        (
            "app.kubernetes.io/instance".into(),
            label_value(proplet_name),
        ),
        ("app.kubernetes.io/managed-by".into(), "propeller".into()),
        (PROPLET_LABEL.into(), label_value(proplet_name)),
    ])
}

fn selector_labels(proplet_name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".into(), "proplet".into()),
        (
            "app.kubernetes.io/instance".into(),
            label_value(proplet_name),
        ),
    ])
}

fn env(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into()),
        value_from: None,
    }
}

fn seconds(field: &'static str, text: &str) -> Result<String, DeploymentError> {
    parse_duration(text)
        .map(|d| whole_seconds(d).to_string())
        .map_err(|message| DeploymentError::BadDuration { field, message })
}

/// The desired Deployment of a `k8s` proplet, owned by it (garbage-collected with it).
pub fn proplet_deployment(proplet: &Proplet) -> Result<Deployment, DeploymentError> {
    if proplet.spec.type_ != PropletType::K8s {
        return Err(DeploymentError::NotK8s);
    }
    let k8s = proplet
        .spec
        .k8s
        .as_ref()
        .ok_or(DeploymentError::MissingK8sSpec)?;
    let name = proplet
        .metadata
        .name
        .clone()
        .ok_or(DeploymentError::MissingMetadata("a name"))?;
    let namespace = proplet
        .metadata
        .namespace
        .clone()
        .ok_or(DeploymentError::MissingMetadata("a namespace"))?;
    let uid = proplet
        .metadata
        .uid
        .clone()
        .ok_or(DeploymentError::MissingMetadata("a uid"))?;
    let conn = &proplet.spec.connection_config;

    let mut vars = vec![
        env("PROPLET_MQTT_ADDRESS", conn.mqtt_address.clone()),
        env("PROPLET_DOMAIN_ID", conn.domain().unwrap_or_default()),
        env("PROPLET_CHANNEL_ID", conn.channel_id.clone()),
        env("PROPLET_CLIENT_ID", conn.client().unwrap_or(&name)),
    ];
    vars.push(
        match conn.key_source().ok_or(DeploymentError::MissingKey)? {
            ClientKeySource::Inline(key) => env("PROPLET_CLIENT_KEY", key),
            ClientKeySource::Secret(selector) => EnvVar {
                name: "PROPLET_CLIENT_KEY".into(),
                value: None,
                value_from: Some(EnvVarSource {
                    secret_key_ref: Some(selector.clone()),
                    ..EnvVarSource::default()
                }),
            },
        },
    );
    vars.push(env("PROPLET_MQTT_QOS", conn.mqtt_qos.to_string()));
    vars.push(env(
        "PROPLET_LOG_LEVEL",
        match k8s.log_level {
            LogLevel::Debug => "debug",
            LogLevel::Info => "info",
            LogLevel::Warn => "warn",
            LogLevel::Error => "error",
        },
    ));
    vars.push(env("PROPLET_STATE_DIR", STATE_DIR));
    if let Some(dir) = &k8s.plugin_dir {
        vars.push(env("PROPLET_PLUGIN_DIR", dir.clone()));
    }
    // Absent settings leave the agent's defaults.
    let extra = k8s.env.clone().unwrap_or_default();
    if let Some(v) = &extra.liveliness_interval {
        vars.push(env(
            "PROPLET_LIVELINESS_INTERVAL",
            seconds("spec.k8s.env.livelinessInterval", v)?,
        ));
    }
    if let Some(v) = &extra.metrics_interval {
        vars.push(env(
            "PROPLET_METRICS_INTERVAL",
            seconds("spec.k8s.env.metricsInterval", v)?,
        ));
    }
    let texts = [
        (
            "PROPLET_EXTERNAL_WASM_RUNTIME",
            &extra.external_wasm_runtime,
        ),
        ("PROPLET_OTEL_URL", &extra.otel_url),
        ("PROPLET_TRACE_RATIO", &extra.trace_ratio),
        ("PROPLET_TAGS", &extra.tags),
        ("PROPLET_LOCATION", &extra.location),
        ("PROPLET_DESCRIPTION", &extra.description),
        ("PROPLET_KBS_URI", &extra.kbs_uri),
        ("PROPLET_AA_CONFIG_PATH", &extra.aa_config_path),
        ("PROPLET_MQTT_TLS_CA_CERT", &extra.mqtt_tls_ca_cert),
        ("PROPLET_MQTT_TLS_CLIENT_CERT", &extra.mqtt_tls_client_cert),
        ("PROPLET_MQTT_TLS_CLIENT_KEY", &extra.mqtt_tls_client_key),
    ];
    vars.extend(
        texts
            .into_iter()
            .filter_map(|(n, v)| v.as_ref().map(|v| env(n, v.clone()))),
    );
    let flags = [
        ("PROPLET_HAL_ENABLED", extra.hal_enabled),
        ("PROPLET_HTTP_ENABLED", extra.http_enabled),
        ("PROPLET_USB_ENABLED", extra.usb_enabled),
        (
            "PROPLET_MQTT_TLS_INSECURE_SKIP_VERIFY",
            extra.mqtt_tls_insecure_skip_verify,
        ),
    ];
    vars.extend(
        flags
            .into_iter()
            .filter_map(|(n, v)| v.map(|v| env(n, v.to_string()))),
    );
    // The agent's health endpoint backs the pod's probes; on unless turned off explicitly.
    let probes_on = extra.metrics_enabled.unwrap_or(true);
    let port = extra.metrics_port.unwrap_or(DEFAULT_METRICS_PORT);
    vars.push(env("PROPLET_METRICS_ENABLED", probes_on.to_string()));
    vars.push(env("PROPLET_METRICS_PORT", port.to_string()));
    let probe = |path: &str, period: i32| Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::String("metrics".into()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(3),
        ..Probe::default()
    };

    let container = Container {
        name: "proplet".into(),
        image: Some(k8s.image.clone()),
        image_pull_policy: Some("IfNotPresent".into()),
        env: Some(vars),
        resources: proplet
            .spec
            .resources
            .clone()
            .map(|requests| ResourceRequirements {
                requests: Some(requests),
                ..ResourceRequirements::default()
            }),
        ports: probes_on.then(|| {
            vec![ContainerPort {
                name: Some("metrics".into()),
                container_port: port,
                ..ContainerPort::default()
            }]
        }),
        // Alive while the process answers; ready only while connected to the broker.
        liveness_probe: probes_on.then(|| probe("/health", 10)),
        readiness_probe: probes_on.then(|| probe("/ready", 5)),
        volume_mounts: Some(vec![VolumeMount {
            name: "state".into(),
            mount_path: STATE_DIR.into(),
            ..VolumeMount::default()
        }]),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Capabilities::default()
            }),
            ..SecurityContext::default()
        }),
        ..Container::default()
    };
    let labels = proplet_labels(&name);
    Ok(Deployment {
        metadata: ObjectMeta {
            name: Some(proplet_deployment_name(&name)),
            namespace: Some(namespace),
            labels: Some(labels.clone()),
            owner_references: Some(vec![OwnerReference {
                api_version: format!("{}/{}", crate::crd::GROUP, crate::crd::VERSION),
                kind: "Proplet".into(),
                name: name.clone(),
                uid,
                controller: Some(true),
                block_owner_deletion: Some(true),
            }]),
            ..ObjectMeta::default()
        },
        spec: Some(DeploymentSpec {
            replicas: Some(k8s.replicas),
            selector: LabelSelector {
                match_labels: Some(selector_labels(&name)),
                ..LabelSelector::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    containers: vec![container],
                    automount_service_account_token: Some(false),
                    security_context: Some(PodSecurityContext {
                        run_as_non_root: Some(true),
                        run_as_user: Some(65532),
                        seccomp_profile: Some(SeccompProfile {
                            type_: "RuntimeDefault".into(),
                            ..SeccompProfile::default()
                        }),
                        ..PodSecurityContext::default()
                    }),
                    volumes: Some(vec![Volume {
                        name: "state".into(),
                        empty_dir: Some(EmptyDirVolumeSource::default()),
                        ..Volume::default()
                    }]),
                    ..PodSpec::default()
                }),
            },
            ..DeploymentSpec::default()
        }),
        status: None,
    })
}
