//! Tasks on `k8s` proplets run as Kubernetes Jobs: the ConfigMap `<task>-config` with the
//! task's settings, the Job `<task>-job` running `spec.imageUrl`, and the result taken from
//! the first place that has one, in the order upstream's Go operator reads them: a Job annotation, the container's
//! termination message, the `<job>-result` ConfigMap, the `<job>-result` Secret, a Pod
//! annotation.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, ConfigMapEnvSource, Container, EnvFromSource, EnvVar, Pod, PodSpec, PodTemplateSpec,
    ResourceRequirements, Secret,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::Resource;

use crate::controller::executor::JobRunner;
use crate::controller::BackendError;
use crate::crd::task::{RestartPolicy, Task};
use crate::decision::names::child_name;
use crate::decision::task::{start_request, JobOutcome};

/// Annotation (on the Job or its Pod) a workload may set to report its result.
pub const RESULT_ANNOTATION: &str = "propeller.propeller.absmach.eu/result";
/// Key of the result in the `<job>-result` ConfigMap or Secret.
pub const RESULT_KEY: &str = "result";
/// Label tying a Job to its Task.
pub const TASK_LABEL: &str = "propeller.absmach.eu/task";

/// Name of the task's Job.
pub fn job_name(task: &Task) -> String {
    child_name(task.metadata.name.as_deref().unwrap_or_default(), "job")
}

/// Name of the task's ConfigMap.
pub fn config_name(task: &Task) -> String {
    child_name(task.metadata.name.as_deref().unwrap_or_default(), "config")
}

/// The ConfigMap and Job that run `task`, both owned by it.
pub fn task_objects(task: &Task) -> (ConfigMap, Job) {
    let name = task.metadata.name.clone().unwrap_or_default();
    let namespace = task.metadata.namespace.clone();
    let owner = task.controller_owner_ref(&()).map(|o| vec![o]);
    let labels = BTreeMap::from([(
        TASK_LABEL.to_owned(),
        crate::decision::names::label_value(&name),
    )]);
    let start = start_request(task, None);
    let mut data = BTreeMap::from([
        ("TASK_ID".to_owned(), start.id.clone()),
        ("FUNCTION_NAME".to_owned(), start.name.clone()),
        ("INPUTS".to_owned(), start.inputs.join(",")),
    ]);
    if let Some(profile) = &start.monitoring_profile {
        data.insert(
            "MONITORING_PROFILE".to_owned(),
            profile.to_json().to_string(),
        );
    }
    let mut binary_data = BTreeMap::new();
    if let Some(file) = &start.file {
        data.insert("wasm_file_provided".to_owned(), "true".to_owned());
        binary_data.insert(
            "module.wasm".to_owned(),
            k8s_openapi::ByteString(file.clone()),
        );
    }
    let config = ConfigMap {
        metadata: ObjectMeta {
            name: Some(config_name(task)),
            namespace: namespace.clone(),
            labels: Some(labels.clone()),
            owner_references: owner.clone(),
            ..ObjectMeta::default()
        },
        data: Some(data),
        binary_data: (!binary_data.is_empty()).then_some(binary_data),
        ..ConfigMap::default()
    };
    let spec = &task.spec;
    let resources = spec.resource_requirements.as_ref().map(|r| {
        let mut limits = BTreeMap::new();
        if let Some(cpu) = &r.cpu {
            limits.insert("cpu".to_owned(), Quantity(cpu.clone()));
        }
        if let Some(memory) = &r.memory {
            limits.insert("memory".to_owned(), Quantity(memory.clone()));
        }
        for (k, v) in &r.custom {
            limits.insert(k.clone(), Quantity(v.clone()));
        }
        ResourceRequirements {
            requests: Some(limits.clone()),
            limits: Some(limits),
            ..ResourceRequirements::default()
        }
    });
    // A Job's pods may only restart OnFailure or Never; a daemon keeps restarting on failure.
    let restart = match (spec.restart_policy, spec.daemon) {
        (Some(RestartPolicy::Never), _) => "Never",
        (Some(_), _) | (None, true) => "OnFailure",
        (None, false) => "Never",
    };
    let env = spec
        .env
        .iter()
        .map(|(k, v)| EnvVar {
            name: k.clone(),
            value: Some(v.clone()),
            ..EnvVar::default()
        })
        .collect::<Vec<_>>();
    let job = Job {
        metadata: ObjectMeta {
            name: Some(job_name(task)),
            namespace,
            labels: Some(labels.clone()),
            owner_references: owner,
            ..ObjectMeta::default()
        },
        spec: Some(JobSpec {
            backoff_limit: Some(if spec.daemon { 6 } else { 0 }),
            suspend: spec.suspend.then_some(true),
            active_deadline_seconds: spec.timeout_seconds.filter(|_| !spec.daemon),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    restart_policy: Some(restart.to_owned()),
                    containers: vec![Container {
                        name: "task".to_owned(),
                        image: spec.image_url.clone(),
                        args: (!spec.cli_args.is_empty()).then(|| spec.cli_args.clone()),
                        env: (!env.is_empty()).then_some(env),
                        env_from: Some(vec![EnvFromSource {
                            config_map_ref: Some(ConfigMapEnvSource {
                                name: config_name(task),
                                optional: Some(false),
                            }),
                            ..EnvFromSource::default()
                        }]),
                        resources,
                        termination_message_policy: Some("FallbackToLogsOnError".to_owned()),
                        ..Container::default()
                    }],
                    ..PodSpec::default()
                }),
            },
            ..JobSpec::default()
        }),
        status: None,
    };
    (config, job)
}

/// Whether the Job finished: `Some(true)` succeeded, `Some(false)` failed (with why).
pub fn job_finished(job: &Job) -> Option<Result<(), String>> {
    let status = job.status.as_ref()?;
    let condition = |type_: &str| {
        status
            .conditions
            .as_ref()
            .and_then(|cs| cs.iter().find(|c| c.type_ == type_ && c.status == "True"))
    };
    if condition("Complete").is_some() || status.succeeded.unwrap_or(0) > 0 {
        return Some(Ok(()));
    }
    condition("Failed").map(|c| {
        Err(format!(
            "Job failed: {}",
            c.message.clone().or(c.reason.clone()).unwrap_or_default()
        ))
    })
}

/// The result, from the first source that has one, in upstream's order.
pub fn extract_result(
    job: &Job,
    pods: &[Pod],
    config: Option<&ConfigMap>,
    secret: Option<&Secret>,
) -> Option<String> {
    let annotation = |meta: &ObjectMeta| {
        meta.annotations
            .as_ref()
            .and_then(|a| a.get(RESULT_ANNOTATION))
            .cloned()
    };
    if let Some(r) = annotation(&job.metadata) {
        return Some(r);
    }
    let terminated = pods.iter().find_map(|pod| {
        pod.status
            .as_ref()?
            .container_statuses
            .as_ref()?
            .iter()
            .find_map(|c| c.state.as_ref()?.terminated.as_ref()?.message.clone())
            .filter(|m| !m.is_empty())
    });
    if let Some(r) = terminated {
        return Some(r);
    }
    if let Some(r) = config.and_then(|c| c.data.as_ref()?.get(RESULT_KEY).cloned()) {
        return Some(r);
    }
    if let Some(r) = secret
        .and_then(|s| s.data.as_ref()?.get(RESULT_KEY))
        .and_then(|b| String::from_utf8(b.0.clone()).ok())
    {
        return Some(r);
    }
    pods.iter().find_map(|p| annotation(&p.metadata))
}

/// How the Job's container ended when it failed: exit code, reason and the last lines it
/// wrote (the termination message, or its log tail under `FallbackToLogsOnError`).
pub fn container_failure(pods: &[Pod]) -> Option<String> {
    pods.iter().find_map(|pod| {
        pod.status
            .as_ref()?
            .container_statuses
            .as_ref()?
            .iter()
            .find_map(|c| {
                let ended = c.last_state.as_ref().and_then(|s| s.terminated.as_ref());
                let ended = c
                    .state
                    .as_ref()
                    .and_then(|s| s.terminated.as_ref())
                    .or(ended)
                    .filter(|t| t.exit_code != 0)?;
                let mut text = format!(
                    "container {} exited with code {} ({})",
                    c.name,
                    ended.exit_code,
                    ended.reason.as_deref().unwrap_or("no reason given")
                );
                if let Some(message) = ended.message.as_deref().map(str::trim) {
                    if !message.is_empty() {
                        text.push_str(": ");
                        text.push_str(message);
                    }
                }
                Some(text)
            })
    })
}

/// Creates the task's ConfigMap and Job unless they exist; an existing Job is suspended or
/// resumed as the task is (`spec.suspend`).
pub async fn create(client: &kube::Client, task: &Task) -> Result<(), kube::Error> {
    let ns = task.metadata.namespace.as_deref().unwrap_or("default");
    let (config, job) = task_objects(task);
    let configs: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let jobs: Api<Job> = Api::namespaced(client.clone(), ns);
    match configs.create(&PostParams::default(), &config).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(e),
    }
    match jobs.create(&PostParams::default(), &job).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => {
            let name = job_name(task);
            let existing = jobs.get_opt(&name).await?;
            let suspended = existing
                .and_then(|j| j.spec)
                .and_then(|s| s.suspend)
                .unwrap_or(false);
            if suspended != task.spec.suspend {
                let patch = serde_json::json!({"spec": {"suspend": task.spec.suspend}});
                jobs.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await?;
            }
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Reads the task's Job and, once it finished, its result.
pub async fn observe(
    client: &kube::Client,
    task: &Task,
) -> Result<Option<JobOutcome>, kube::Error> {
    let ns = task.metadata.namespace.as_deref().unwrap_or("default");
    let jobs: Api<Job> = Api::namespaced(client.clone(), ns);
    let name = job_name(task);
    let Some(job) = jobs.get_opt(&name).await? else {
        return Ok(None);
    };
    let pods_of_job = || async {
        Api::<Pod>::namespaced(client.clone(), ns)
            .list(&ListParams::default().labels(&format!("job-name={name}")))
            .await
            .map(|list| list.items)
    };
    match job_finished(&job) {
        None => Ok(Some(JobOutcome::Running)),
        Some(Err(message)) => {
            let pods = pods_of_job().await?;
            let message = match container_failure(&pods) {
                Some(container) => format!("{message}; {container}"),
                None => message,
            };
            Ok(Some(JobOutcome::Failed { message }))
        }
        Some(Ok(())) => {
            let pods = pods_of_job().await?;
            let result_name = child_name(&name, "result");
            let config = Api::<ConfigMap>::namespaced(client.clone(), ns)
                .get_opt(&result_name)
                .await?;
            let secret = Api::<Secret>::namespaced(client.clone(), ns)
                .get_opt(&result_name)
                .await?;
            Ok(Some(JobOutcome::Succeeded {
                result: extract_result(&job, &pods, config.as_ref(), secret.as_ref()),
            }))
        }
    }
}

/// Runs `k8s` proplets' tasks as Jobs through the API server.
#[derive(Clone)]
pub struct KubeJobs(kube::Client);

impl KubeJobs {
    /// Jobs created and read with `client`.
    pub fn new(client: kube::Client) -> Self {
        Self(client)
    }
}

impl JobRunner for KubeJobs {
    async fn create_task_job(&self, task: &Task) -> Result<(), BackendError> {
        Ok(create(&self.0, task).await?)
    }

    async fn observe_task_job(&self, task: &Task) -> Result<Option<JobOutcome>, BackendError> {
        Ok(observe(&self.0, task).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::batch::v1::{JobCondition, JobStatus};
    use k8s_openapi::api::core::v1::{
        ContainerState, ContainerStateTerminated, ContainerStatus, PodStatus,
    };
    use serde_json::json;

    fn task() -> Task {
        serde_json::from_value(json!({
            "apiVersion": "propeller.propeller.absmach.eu/v1", "kind": "Task",
            "metadata": {"name": "resize", "namespace": "lab", "uid": "t-uid"},
            "spec": {"name": "resize", "imageUrl": "registry.local/resize:1", "cliArgs": ["--fast"],
                     "env": {"MODE": "x"}, "inputs": [1, "b"],
                     "resourceRequirements": {"cpu": "100m", "memory": "64Mi"}}
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn the_job_runs_the_image_with_args_env_config_and_resources() {
        let (config, job) = task_objects(&task());
        assert_eq!(config.metadata.name.as_deref(), Some("resize-config"));
        let data = config.data.unwrap_or_default();
        assert_eq!(data.get("INPUTS").map(String::as_str), Some("1,b"));
        assert_eq!(data.get("TASK_ID").map(String::as_str), Some("t-uid"));
        assert_eq!(job.metadata.name.as_deref(), Some("resize-job"));
        assert_eq!(
            job.metadata
                .owner_references
                .as_ref()
                .map(|o| o[0].uid.as_str()),
            Some("t-uid")
        );
        let pod = job.spec.and_then(|s| s.template.spec).unwrap_or_default();
        assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
        let c = &pod.containers[0];
        assert_eq!(c.image.as_deref(), Some("registry.local/resize:1"));
        assert_eq!(c.args.as_deref(), Some(&["--fast".to_owned()][..]));
        assert_eq!(c.env.as_ref().map(|e| e[0].name.as_str()), Some("MODE"));
        let limits = c
            .resources
            .as_ref()
            .and_then(|r| r.limits.clone())
            .unwrap_or_default();
        assert_eq!(limits.get("memory").map(|q| q.0.as_str()), Some("64Mi"));
    }

    fn finished_job(annotation: Option<&str>) -> Job {
        Job {
            metadata: ObjectMeta {
                annotations: annotation
                    .map(|a| BTreeMap::from([(RESULT_ANNOTATION.to_owned(), a.to_owned())])),
                ..ObjectMeta::default()
            },
            status: Some(JobStatus {
                succeeded: Some(1),
                conditions: Some(vec![JobCondition {
                    type_: "Complete".into(),
                    status: "True".into(),
                    ..JobCondition::default()
                }]),
                ..JobStatus::default()
            }),
            ..Job::default()
        }
    }

    fn pod_with_message(message: &str) -> Pod {
        Pod {
            status: Some(PodStatus {
                container_statuses: Some(vec![ContainerStatus {
                    state: Some(ContainerState {
                        terminated: Some(ContainerStateTerminated {
                            message: Some(message.into()),
                            ..ContainerStateTerminated::default()
                        }),
                        ..ContainerState::default()
                    }),
                    ..ContainerStatus::default()
                }]),
                ..PodStatus::default()
            }),
            ..Pod::default()
        }
    }

    #[test]
    fn results_are_taken_in_the_seeds_order() {
        let cm = ConfigMap {
            data: Some(BTreeMap::from([(
                RESULT_KEY.to_owned(),
                "from-cm".to_owned(),
            )])),
            ..ConfigMap::default()
        };
        let pods = [pod_with_message("from-termination")];
        assert_eq!(
            extract_result(&finished_job(Some("from-job")), &pods, Some(&cm), None).as_deref(),
            Some("from-job")
        );
        assert_eq!(
            extract_result(&finished_job(None), &pods, Some(&cm), None).as_deref(),
            Some("from-termination")
        );
        assert_eq!(
            extract_result(&finished_job(None), &[], Some(&cm), None).as_deref(),
            Some("from-cm")
        );
        let secret = Secret {
            data: Some(BTreeMap::from([(
                RESULT_KEY.to_owned(),
                k8s_openapi::ByteString(b"from-secret".to_vec()),
            )])),
            ..Secret::default()
        };
        assert_eq!(
            extract_result(&finished_job(None), &[], None, Some(&secret)).as_deref(),
            Some("from-secret")
        );
        let mut annotated = Pod::default();
        annotated.metadata.annotations = Some(BTreeMap::from([(
            RESULT_ANNOTATION.to_owned(),
            "from-pod".to_owned(),
        )]));
        assert_eq!(
            extract_result(&finished_job(None), &[annotated], None, None).as_deref(),
            Some("from-pod")
        );
        assert_eq!(job_finished(&finished_job(None)), Some(Ok(())));
    }

    #[test]
    fn a_failed_job_says_why() {
        let job = Job {
            status: Some(JobStatus {
                conditions: Some(vec![JobCondition {
                    type_: "Failed".into(),
                    status: "True".into(),
                    message: Some("BackoffLimitExceeded".into()),
                    ..JobCondition::default()
                }]),
                ..JobStatus::default()
            }),
            ..Job::default()
        };
        assert_eq!(
            job_finished(&job),
            Some(Err("Job failed: BackoffLimitExceeded".to_owned()))
        );
        assert_eq!(job_finished(&Job::default()), None);
    }

    #[test]
    fn a_failed_container_is_named_with_its_exit_code_reason_and_output() {
        let mut pod = pod_with_message("disk full\n");
        let status = &mut pod
            .status
            .as_mut()
            .unwrap()
            .container_statuses
            .as_mut()
            .unwrap()[0];
        status.name = "task".into();
        let ended = status.state.as_mut().unwrap().terminated.as_mut().unwrap();
        ended.exit_code = 3;
        ended.reason = Some("Error".into());
        assert_eq!(
            container_failure(&[pod]).as_deref(),
            Some("container task exited with code 3 (Error): disk full")
        );
        // A container that succeeded says nothing about a failure.
        assert_eq!(container_failure(&[pod_with_message("ok")]), None);
    }
}
