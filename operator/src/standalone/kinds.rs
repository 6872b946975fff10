//! The kind names the standalone driver itself reads and writes objects under (every
//! reconciled kind's name is its [`kube::Resource::kind`]; see `crate::controller::kinds`).

/// Kind name of Proplets.
pub const PROPLET: &str = "Proplet";
/// Kind name of Tasks.
pub const TASK: &str = "Task";
pub use crate::manifest::{CONFIG_MAP, SECRET};
