//! Task runs: start, execute, HTTP components, invocations, task metrics, stop and invoke.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use propeller_broker::protocol::{
    AggregatedMetrics, InvokeRequest, InvokeResult, MonitoringProfile, ProcessMetrics, ResultValue,
    StartRequest, StopRequest, TaskMetrics, Timestamp,
};
use tracing::{debug, info, warn};

use crate::finished::{Finished, Seen};
use crate::http_server::Server as HttpServer;
use crate::system::cpu_seconds;
use crate::wasm::{Compiled, Invocation, RunError, StopFlag, TaskGauge};

use super::encrypted::encrypted_problem;
use super::{Agent, Latent, MAX_TRACKED_ARRIVALS};

impl Agent {
    /// Runs one start request; its logs carry the task's id and run (the span `task`).
    #[tracing::instrument(name = "task", skip_all, fields(task_id = %request.id, run = ?request.run))]
    pub(super) async fn on_start(self: Arc<Self>, request: StartRequest) {
        let arrived = std::time::Instant::now();
        if !request.is_for(&self.config.client_id) {
            return;
        }
        let id = request.id.clone();
        let problem =
            start_problem(&request).or_else(|| encrypted_problem(&request, self.kbs.is_some()));
        if let Some(problem) = problem {
            self.report(&id, Err(problem)).await;
            return;
        }
        let run = request.run;
        let stop = StopFlag::default();
        let repeat = {
            let mut running = self.lock_running();
            // Looked up under the `running` lock, which a run holds while it records itself
            // as finished and leaves `running`: a repeated start sees it in one or the other.
            let seen = run.map_or(Seen::New, |run| self.finished.seen(&id, run));
            match seen {
                Seen::Finished(done) => Some(done),
                Seen::Superseded { latest } => {
                    info!(
                        task_id = id,
                        run, latest, "start of an older run ignored: a later run finished here"
                    );
                    return;
                }
                Seen::New if running.contains_key(&id) => {
                    info!(
                        task_id = id,
                        "duplicate start ignored: the task is already running"
                    );
                    return;
                }
                Seen::New => {
                    running.insert(id.clone(), stop.clone());
                    None
                }
            }
        };
        if let Some(done) = repeat {
            info!(
                task_id = id,
                run = done.run,
                "start of a run that already finished here: its result is published again"
            );
            self.metrics.repeated_starts.inc();
            self.spool_message(done.topic, done.payload.into_bytes())
                .await;
            return;
        }
        {
            let mut arrivals = self.arrivals.lock().unwrap_or_else(|e| e.into_inner());
            // Results that were never published (spool overflow) must not pile up here.
            if arrivals.len() >= MAX_TRACKED_ARRIVALS {
                arrivals.clear();
            }
            arrivals.insert(id.clone(), arrived);
        }
        info!(task_id = id, run, name = request.name, "task accepted");
        self.metrics.tasks_started.inc();
        self.metrics.tasks_running.inc();
        let latent = request.latent;
        let outcome = self.execute(request, &stop).await;
        self.metrics.tasks_running.dec();
        let outcome = match outcome {
            Ok(None) => {
                self.lock_running().remove(&id);
                info!(
                    task_id = id,
                    "latent task compiled and ready for invocations"
                );
                return;
            }
            Ok(Some(output)) => Ok(output),
            Err(error) => {
                if latent {
                    warn!(task_id = id, %error, "latent task not deployed");
                }
                Err(error)
            }
        };
        let (topic, payload) = self.result_message(&id, outcome);
        {
            let mut running = self.lock_running();
            if let Some(run) = run {
                let done = Finished {
                    run,
                    topic: topic.clone(),
                    payload: payload.clone(),
                };
                if let Err(e) = self.finished.record(&id, done) {
                    warn!(task_id = id, %e, "cannot persist the finished run; a repeated start after a restart would run it again");
                }
            }
            running.remove(&id);
        }
        self.spool_message(topic, payload.into_bytes()).await;
    }

    /// Fetches, compiles and runs a task. `Ok(None)` for a deployed latent task.
    pub(super) async fn execute(
        self: &Arc<Self>,
        request: StartRequest,
        stop: &StopFlag,
    ) -> Result<Option<String>, String> {
        let limit = self.config.max_module_size;
        let bytes = match (&request.file, &request.image_url) {
            (Some(file), _) if !file.is_empty() => {
                if file.len() > limit {
                    return Err(RunError::TooLarge {
                        what: "the inline module".into(),
                        size: file.len() as u64,
                        at_least: false,
                        limit,
                    }
                    .to_string());
                }
                file.clone()
            }
            (_, Some(url)) if url.starts_with("http://") || url.starts_with("https://") => {
                self.http.fetch(url).await.map_err(|e| e.to_string())?
            }
            (_, Some(image)) => self.fetch_chunks(image).await?,
            _ => return Err("the start request carries neither `file` nor `image_url`".into()),
        };
        let bytes = self.plaintext(&request, bytes).await?;
        if stop.is_stopped() {
            return Err(RunError::Stopped.to_string());
        }
        let runtime = self.runtime.clone();
        // A decrypted module goes into no cache: neither it nor code compiled from it rests
        // on disk.
        let private = request.encrypted;
        let (compiled, cached) = tokio::task::spawn_blocking(move || {
            if private {
                runtime.compile_uncached(&bytes).map(|c| (c, false))
            } else {
                runtime.compile(&bytes)
            }
        })
        .await
        .map_err(|e| format!("compilation aborted: {e}"))?
        .map_err(|e| e.to_string())?;
        debug!(task_id = request.id, cached, "module ready");
        if let Compiled::Component(component) = &compiled {
            if compiled.serves_http() {
                return self.serve_http(&request, component, stop).await;
            }
        }
        if request.latent {
            self.lock_latent()
                .insert(request.id.clone(), Arc::new(Latent { compiled, request }));
            return Ok(None);
        }
        let invocation = self.invocation(&request, &request.inputs, &request.env);
        let sampler = self
            .clone()
            .sample_task_metrics(&request, invocation.gauge.clone());
        let outcome = self.run_guest(compiled, invocation, stop.clone()).await;
        if let Some(sampler) = sampler {
            sampler.abort();
        }
        outcome.map(Some)
    }

    /// Runs an HTTP component until its stop: reports `started at port N` once it listens
    /// (as upstream does), and nothing when it ends.
    pub(super) async fn serve_http(
        self: &Arc<Self>,
        request: &StartRequest,
        component: &crate::component::Prepared,
        stop: &StopFlag,
    ) -> Result<Option<String>, String> {
        let invocation = self.invocation(request, &request.inputs, &request.env);
        let server = HttpServer::bind(
            self.runtime.clone(),
            component,
            invocation,
            stop.clone(),
            &self.config.http_serving,
        )
        .map_err(|e| e.to_string())?;
        let port = server.port();
        info!(task_id = request.id, port, "HTTP component serving");
        self.report(&request.id, Ok(format!("started at port {port}")))
            .await;
        server.serve().await;
        info!(task_id = request.id, port, "HTTP component stopped");
        Ok(None)
    }

    pub(super) fn invocation(
        &self,
        request: &StartRequest,
        inputs: &[String],
        env: &BTreeMap<String, String>,
    ) -> Invocation {
        // A task asks for host directories with `PROPLET_PREOPEN=/a:/b`; the runtime refuses
        // any outside the agent's allow-list (`PROPLET_DIRS`). A task that asks for none gets
        // the whole allow-list, as upstream's proplet gives every task.
        let preopens = env
            .get("PROPLET_PREOPEN")
            .map(|v| {
                v.split(':')
                    .filter(|p| !p.is_empty())
                    .map(std::path::PathBuf::from)
                    .collect()
            })
            .unwrap_or_else(|| self.config.preopen_dirs.clone());
        let mut env: Vec<(String, String)> =
            env.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        if !env.iter().any(|(k, _)| k == "PROPLET_ID") {
            env.push(("PROPLET_ID".into(), self.config.client_id.clone()));
        }
        Invocation {
            function: request.name.clone(),
            inputs: inputs.to_vec(),
            args: request.cli_args.clone(),
            env,
            timeout: (!request.daemon).then_some(self.config.task_timeout),
            preopens,
            gauge: Arc::new(TaskGauge::default()),
            log: self.log_tap(&request.id),
        }
    }

    pub(super) async fn run_guest(
        &self,
        compiled: Compiled,
        invocation: Invocation,
        stop: StopFlag,
    ) -> Result<String, String> {
        let _permit = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| "the proplet is shutting down".to_owned())?;
        if stop.is_stopped() {
            return Err(RunError::Stopped.to_string());
        }
        let runtime = self.runtime.clone();
        tokio::task::spawn_blocking(move || runtime.run(&compiled, &invocation, &stop))
            .await
            .map_err(|e| format!("task aborted: {e}"))?
            .map(|outcome| outcome.output)
            .map_err(|e| e.to_string())
    }

    /// Publishes `task_metrics` while the task runs, if its monitoring profile asks for it.
    /// Figures are the task's own: elapsed time, its linear memory, the CPU time of the
    /// thread running it, and fuel when metered.
    pub(super) fn sample_task_metrics(
        self: Arc<Self>,
        request: &StartRequest,
        gauge: Arc<TaskGauge>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let profile = request.monitoring_profile.unwrap_or(if request.daemon {
            MonitoringProfile::long_running_daemon()
        } else {
            MonitoringProfile::standard()
        });
        if !(profile.enabled && profile.export_to_mqtt) {
            return None;
        }
        let task_id = request.id.clone();
        Some(tokio::spawn(async move {
            let period = Duration::from_secs(profile.interval_secs.max(1));
            let started = std::time::Instant::now();
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
            let mut summary = Summary::default();
            let mut last_cpu: Option<(std::time::Instant, f64)> = None;
            loop {
                tick.tick().await;
                let now = std::time::Instant::now();
                let cpu_percent = match (
                    profile.collect_cpu,
                    gauge.thread_id().and_then(thread_cpu_seconds),
                ) {
                    (true, Some(seconds)) => {
                        let percent = last_cpu.map(|(at, before)| {
                            let wall = now.duration_since(at).as_secs_f64();
                            if wall > 0.0 {
                                (seconds - before) * 100.0 / wall
                            } else {
                                0.0
                            }
                        });
                        last_cpu = Some((now, seconds));
                        percent
                    }
                    _ => None,
                };
                let memory = profile.collect_memory.then(|| gauge.memory_bytes());
                let metrics = ProcessMetrics {
                    cpu_percent,
                    memory_bytes: memory,
                    memory_percent: memory
                        .map(|m| m as f64 * 100.0 / self.config.task_memory_limit.max(1) as f64),
                    uptime_seconds: Some(started.elapsed().as_secs()),
                    thread_count: profile.collect_threads.then_some(1),
                    fuel_used: gauge.fuel_used(),
                    ..ProcessMetrics::default()
                };
                summary.add(cpu_percent, memory);
                let message = TaskMetrics {
                    task_id: task_id.clone(),
                    proplet_id: Some(self.config.client_id.clone()),
                    metrics,
                    aggregated: Some(summary.to_aggregated()),
                    timestamp: Some(Timestamp::now()),
                };
                self.publish_now(self.channel.task_metrics(), message.encode())
                    .await;
            }
        }))
    }

    pub(super) fn on_stop(&self, request: &StopRequest) {
        if !request.is_for(&self.config.client_id) {
            return;
        }
        let found_running = self.lock_running().get(&request.id).cloned();
        let found_latent = self.lock_latent().remove(&request.id).is_some();
        match found_running {
            Some(stop) => {
                info!(task_id = request.id, "stop requested");
                stop.stop();
            }
            None if found_latent => info!(task_id = request.id, "latent task removed"),
            None => debug!(task_id = request.id, "stop for a task not running here"),
        }
    }

    pub(super) async fn on_invoke(self: Arc<Self>, request: InvokeRequest) {
        if !request.is_for(&self.config.client_id) {
            return;
        }
        let invocation_id = request.invocation_id.clone().unwrap_or_default();
        let latent = self.lock_latent().get(&request.id).cloned();
        let outcome = match latent {
            None => Err(format!(
                "task {} is not deployed as a latent task on this proplet",
                request.id
            )),
            Some(latent) => {
                let mut env = latent.request.env.clone();
                env.extend(request.env.clone());
                let inputs = if request.inputs.is_empty() {
                    latent.request.inputs.clone()
                } else {
                    request.inputs.clone()
                };
                let invocation = self.invocation(&latent.request, &inputs, &env);
                self.run_guest(latent.compiled.clone(), invocation, StopFlag::default())
                    .await
            }
        };
        let (results, error) = split(outcome);
        let reply = InvokeResult {
            task_id: request.id.clone(),
            invocation_id,
            proplet_id: Some(self.config.client_id.clone()),
            results: ResultValue::Text(results),
            error,
        };
        self.spool_message(self.channel.invoke_results(), reply.encode())
            .await;
    }
}

/// Running averages and maxima for the `aggregated` part of task metrics.
#[derive(Debug, Default)]
pub(super) struct Summary {
    pub(super) samples: u64,
    pub(super) cpu_sum: f64,
    pub(super) cpu_samples: u64,
    pub(super) cpu_max: f64,
    pub(super) memory_sum: f64,
    pub(super) memory_max: f64,
}

impl Summary {
    pub(super) fn add(&mut self, cpu: Option<f64>, memory: Option<u64>) {
        self.samples += 1;
        if let Some(c) = cpu {
            self.cpu_sum += c;
            self.cpu_samples += 1;
            self.cpu_max = self.cpu_max.max(c);
        }
        if let Some(m) = memory {
            self.memory_sum += m as f64;
            self.memory_max = self.memory_max.max(m as f64);
        }
    }

    pub(super) fn to_aggregated(&self) -> AggregatedMetrics {
        AggregatedMetrics {
            avg_cpu_usage: (self.cpu_samples > 0).then(|| self.cpu_sum / self.cpu_samples as f64),
            max_cpu_usage: (self.cpu_samples > 0).then_some(self.cpu_max),
            avg_memory_usage: (self.samples > 0).then(|| self.memory_sum / self.samples as f64),
            max_memory_usage: (self.samples > 0).then_some(self.memory_max),
            total_disk_read: None,
            total_disk_write: None,
            sample_count: Some(self.samples),
        }
    }
}

/// CPU seconds (user + system) consumed by one thread of this process (Linux).
pub(super) fn thread_cpu_seconds(thread_id: u32) -> Option<f64> {
    cpu_seconds(&format!("/proc/self/task/{thread_id}/stat")).map(|(user, system)| user + system)
}

/// Why a start request cannot run, checked before anything is fetched.
pub(super) fn start_problem(request: &StartRequest) -> Option<String> {
    if request.name.trim().is_empty() {
        return Some("the start request has an empty `name`".into());
    }
    let has_file = request.file.as_ref().is_some_and(|f| !f.is_empty());
    let has_image = request.image_url.as_ref().is_some_and(|u| !u.is_empty());
    if !has_file && !has_image {
        return Some("the start request carries neither `file` nor `image_url`".into());
    }
    None
}

pub(super) fn split(outcome: Result<String, String>) -> (String, Option<String>) {
    match outcome {
        Ok(output) => (output, None),
        Err(error) => (String::new(), Some(error)),
    }
}
