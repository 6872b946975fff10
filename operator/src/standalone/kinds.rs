//! The kind names objects are stored under in standalone mode.

/// Kind name of Proplets.
pub const PROPLET: &str = "Proplet";
/// Kind name of Tasks.
pub const TASK: &str = "Task";
/// Kind name of PropellerJobs.
pub const PROPELLER_JOB: &str = "PropellerJob";
/// Kind name of Secrets (proplet keys, bootstrap tokens).
pub const SECRET: &str = "Secret";
/// Kind name of FederatedJobs.
pub const FEDERATED_JOB: &str = "FederatedJob";
/// Kind name of TrainingRounds.
pub const TRAINING_ROUND: &str = "TrainingRound";
