//! The pure decision core. Every module here is a function of (object, observations, now):
//! no I/O, no clock reads, no global state. Drivers (Kubernetes, standalone) execute what
//! these functions decide, so every rule is testable without a server.

pub mod aggregation;
pub mod capacity;
pub mod conditions;
pub mod cron;
pub mod dag;
pub mod deployment;
pub mod enrolment;
pub mod federated;
pub mod kueue;
pub mod liveness;
pub mod names;
pub mod propeller_job;
pub mod proplet;
pub mod recurrence;
pub mod scheduler;
pub mod task;
pub mod task_observations;
pub mod task_phase;
pub mod upgrade;
