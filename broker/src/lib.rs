//! The MQTT side of Propeller: topic layout and payload types shared by the operator and
//! the `proplet` agent (usable without any server), for wire compatibility with the
//! upstream operator and the upstream Rust and embedded proplets; and, with the default
//! `server` feature, the embedded broker that authenticates devices and turns their publishes
//! into typed in-process events.

#[cfg(feature = "server")]
pub mod external;
#[cfg(feature = "http")]
pub mod http;
pub mod private_file;
pub mod protocol;
#[cfg(feature = "server")]
pub mod server;
