//! Subcommands of the `propeller` binary that run services.

pub mod broker;
pub mod broker_config;
pub mod console_args;
pub mod demo;
pub mod device_broker;
pub mod encrypt;
pub mod external_args;
pub mod image_args;
pub mod log_endpoint_args;
pub mod logging;
pub mod logs;
pub mod random;
pub mod reconcile_args;
pub mod run;
pub mod serving_tls;
pub mod signals;
pub mod standalone;
pub mod token;
