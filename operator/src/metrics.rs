//! The operator's own Prometheus meters: reconciles per controller and outcome, how long they
//! took, how many proplets and tasks are in each phase, tasks finished and how long they ran,
//! whether this replica runs the controllers, and its requests to the API server.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::crd::task::TaskPhase;

/// Labels of a reconcile.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReconcileLabels {
    /// `proplet`, `task`, …
    pub controller: String,
    /// `ok` or `error`.
    pub outcome: String,
}

/// Label of a per-phase gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    /// The phase, as written in status.
    pub phase: String,
}

/// Meters shared by every controller.
#[derive(Debug)]
pub struct ControllerMetrics {
    reconciles: Family<ReconcileLabels, Counter>,
    durations: Family<ReconcileLabels, Histogram>,
    /// Proplets by `status.phase`.
    pub proplets: Family<PhaseLabels, Gauge>,
    /// Tasks by `status.phase`.
    pub tasks: Family<PhaseLabels, Gauge>,
    offline_delays: Family<StageLabels, Histogram>,
    enrolments: Family<OutcomeLabels, Counter>,
    finished_tasks: Family<PhaseLabels, Counter>,
    task_durations: Family<PhaseLabels, Histogram>,
    /// 1 while this process runs the controllers (standalone, the leader, or a sharded
    /// member), 0 while it waits as a standby.
    pub leader: Gauge,
    /// Requests to the API server, counted by [`crate::k8s::api_requests`].
    pub api_requests: Family<ApiRequestLabels, Counter>,
}

/// Labels of a request to the API server.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiRequestLabels {
    /// `get`, `watch`, `create`, `update`, `patch`, `delete`.
    pub verb: String,
    /// `tasks`, `tasks/status`, `leases`, `events`, …
    pub resource: String,
    /// The HTTP status, or `error` when none came.
    pub code: String,
}

/// Label of the enrolment counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// `enrolled`, `rotated`, or the refusal's reason (`expired`, `used_up`, …).
    pub outcome: String,
}

/// A step in taking a silent proplet Offline.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabels {
    /// `reconcile_started` or `status_written`.
    pub stage: String,
}

fn duration_histogram() -> Histogram {
    Histogram::new([0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0])
}

impl Default for ControllerMetrics {
    fn default() -> Self {
        let finished_tasks: Family<PhaseLabels, Counter> = Family::default();
        // Every final phase from 0, so a rate or increase sees the first run that ends in it.
        for phase in TaskPhase::ALL.iter().filter(|p| p.is_terminal()) {
            let _created = finished_tasks.get_or_create(&PhaseLabels {
                phase: phase.as_str().to_owned(),
            });
        }
        Self {
            reconciles: Family::default(),
            durations: Family::new_with_constructor(duration_histogram),
            proplets: Family::default(),
            tasks: Family::default(),
            offline_delays: Family::new_with_constructor(|| {
                Histogram::new([0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0])
            }),
            enrolments: Family::default(),
            finished_tasks,
            task_durations: Family::new_with_constructor(|| {
                Histogram::new([0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0, 600.0, 3600.0])
            }),
            leader: Gauge::default(),
            api_requests: Family::default(),
        }
    }
}

impl ControllerMetrics {
    /// Registers every meter under `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "reconciles",
            "Reconciles by controller and outcome",
            self.reconciles.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Time spent in one reconcile",
            self.durations.clone(),
        );
        registry.register("proplets", "Proplets by phase", self.proplets.clone());
        registry.register("tasks", "Tasks by phase", self.tasks.clone());
        registry.register(
            "proplet_offline_delay_seconds",
            "How long after a silent proplet's deadline (last heartbeat + threshold) its \
             Offline reconcile started, and its Offline status was written",
            self.offline_delays.clone(),
        );
        registry.register(
            "enrolments",
            "Enrolment requests answered, by outcome (enrolled, rotated, or why refused)",
            self.enrolments.clone(),
        );
        registry.register(
            "tasks_finished",
            "Task runs whose final phase (completed, failed, interrupted, skipped) this \
             process wrote",
            self.finished_tasks.clone(),
        );
        registry.register(
            "task_duration_seconds",
            "From a task run's start to its end, by final phase",
            self.task_durations.clone(),
        );
        registry.register(
            "leader",
            "1 while this process runs the controllers (standalone, the leader, or a sharded \
             member), 0 while it waits as a standby",
            self.leader.clone(),
        );
        registry.register(
            "apiserver_requests",
            "Requests to the Kubernetes API server by verb, resource and HTTP status",
            self.api_requests.clone(),
        );
    }

    /// Counts a task run that ended in `phase`, `seconds` after it started (when known).
    pub fn task_finished(&self, phase: &str, seconds: Option<f64>) {
        let labels = PhaseLabels {
            phase: phase.to_owned(),
        };
        self.finished_tasks.get_or_create(&labels).inc();
        if let Some(seconds) = seconds {
            self.task_durations
                .get_or_create(&labels)
                .observe(seconds.max(0.0));
        }
    }

    /// Counts one answered enrolment request.
    pub fn enrolment(&self, outcome: &str) {
        self.enrolments
            .get_or_create(&OutcomeLabels {
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    /// Enrolment requests answered with `outcome` so far.
    pub fn enrolments(&self, outcome: &str) -> u64 {
        self.enrolments
            .get_or_create(&OutcomeLabels {
                outcome: outcome.to_owned(),
            })
            .get()
    }

    /// Records how late, past its deadline, a silent proplet's Offline reconcile started
    /// and its status was written: the operator's own share of Offline detection time.
    pub fn observe_offline(&self, started_late: f64, written_late: f64) {
        for (stage, late) in [
            ("reconcile_started", started_late),
            ("status_written", written_late),
        ] {
            self.offline_delays
                .get_or_create(&StageLabels {
                    stage: stage.to_owned(),
                })
                .observe(late.max(0.0));
        }
    }

    /// Counts one reconcile of `controller`.
    pub fn observe(&self, controller: &str, took: Duration, ok: bool) {
        let labels = ReconcileLabels {
            controller: controller.to_owned(),
            outcome: if ok { "ok" } else { "error" }.to_owned(),
        };
        self.reconciles.get_or_create(&labels).inc();
        self.durations
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
    }

    /// How many reconciles of `controller` ended with `ok`.
    pub fn reconciles(&self, controller: &str, ok: bool) -> u64 {
        self.reconciles
            .get_or_create(&ReconcileLabels {
                controller: controller.to_owned(),
                outcome: if ok { "ok" } else { "error" }.to_owned(),
            })
            .get()
    }

    /// Sets the per-phase gauges of Proplets and Tasks from the objects a driver holds.
    pub fn count_phases<'a>(
        &self,
        proplets: impl IntoIterator<Item = &'a crate::crd::proplet::Proplet>,
        tasks: impl IntoIterator<Item = &'a crate::crd::task::Task>,
    ) {
        use crate::crd::proplet::PropletPhase;
        use crate::crd::task::TaskPhase;
        const PROPLET_PHASES: [PropletPhase; 3] = [
            PropletPhase::Initializing,
            PropletPhase::Running,
            PropletPhase::Offline,
        ];
        // Counted by position, without a string per object: this runs over the whole fleet
        // at every scrape (standalone) or gauge tick (Kubernetes mode).
        let mut counts = [0i64; PROPLET_PHASES.len()];
        for p in proplets {
            let phase = p.status.as_ref().map(|s| s.phase).unwrap_or_default();
            if let Some(i) = PROPLET_PHASES.iter().position(|x| *x == phase) {
                counts[i] += 1;
            }
        }
        Self::set_phases(
            &self.proplets,
            PROPLET_PHASES.iter().map(|p| p.to_string()).zip(counts),
        );
        let mut counts = [0i64; TaskPhase::ALL.len()];
        for t in tasks {
            let phase = t.status.as_ref().map(|s| s.phase).unwrap_or_default();
            if let Some(i) = TaskPhase::ALL.iter().position(|x| *x == phase) {
                counts[i] += 1;
            }
        }
        Self::set_phases(
            &self.tasks,
            TaskPhase::ALL
                .iter()
                .map(|p| p.as_str().to_owned())
                .zip(counts),
        );
    }

    /// Sets a per-phase gauge family's values to `counts` (phase, count).
    pub fn set_phases(
        family: &Family<PhaseLabels, Gauge>,
        counts: impl IntoIterator<Item = (String, i64)>,
    ) {
        for (phase, count) in counts {
            family.get_or_create(&PhaseLabels { phase }).set(count);
        }
    }
}
