//! `propeller standalone`: the reconcilers of the Kubernetes driver, run without a cluster
//! over a durable embedded store that keeps the API server semantics they rely on.

pub mod api;
pub mod cache;
pub mod client;
pub mod driver;
pub mod events;
pub mod kinds;
pub mod pull_secrets;
pub mod store;
pub mod watch;

#[cfg(test)]
mod api_hostile_tests;
