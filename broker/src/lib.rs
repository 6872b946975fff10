//! Propeller broker.
