//! The MQTT side of Propeller: topic layout and payload types shared by the operator and
//! the `proplet` agent (usable without any server), for wire compatibility with the
//! upstream operator and the upstream Rust and embedded proplets.

pub mod protocol;
