//! The `proplet` agent: connects to a Propeller broker, reports liveness and runs Wasm tasks
//! with Wasmtime inside memory, time and capability limits, never losing a result.

pub mod agent;
pub mod component;
pub mod config;
pub mod credentials;
pub mod enrol;
pub mod fetch;
pub mod finished;
pub mod hal;
pub mod http_server;
pub mod kbs;
pub mod ocicrypt;
pub mod outgoing_http;
pub mod sandbox;
pub mod spool;
pub mod system;
pub mod task_log;
pub mod telemetry;
pub mod upgrade;
pub mod wasm;
