//! Agent configuration. Each setting is declared once, in [`Settings`]: a flag, its
//! environment variable and a key of the TOML file. [`Config::resolve`] stacks flags, then
//! environment (upstream names and aliases), then an enrolled device's credentials, then the
//! optional file, then defaults. A bad value stops start-up with the setting's name.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Args, CommandFactory, FromArgMatches, Parser};
pub use propeller_broker::protocol::{AddressError, BrokerAddress};

mod addresses;
mod file;
mod resolve;
mod settings;
mod values;

use crate::config::addresses::describe_entry;
use crate::config::values::invalid;
pub use addresses::{AddressSetting, BrokerAddresses};
pub use resolve::{Config, KbsSettings, TlsFiles, DEFAULT_MAX_MODULE_SIZE};
pub use settings::{BootstrapSection, Settings, ALIASES};
pub use values::{
    parse_address, parse_duration, parse_size, AttesterChoice, Dirs, Interval, LogLevel, Overrides,
    PortRange, Qos, Size, Switch, Words,
};

/// A configuration problem, naming the setting at fault.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    /// A value does not parse.
    #[error("{name}: {message}")]
    Invalid {
        /// Flag or variable name.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// A required setting is missing everywhere.
    #[error("{name} is required (flag {flag}, or set it in the config file as `{key}`)")]
    Missing {
        /// Variable name.
        name: &'static str,
        /// Flag.
        flag: &'static str,
        /// Key in the TOML file.
        key: &'static str,
    },
    /// The TOML file cannot be used.
    #[error("config file {path}: {message}")]
    File {
        /// The file, and the line at fault when there is one (`path:line`).
        path: String,
        /// What is wrong.
        message: String,
    },
    /// A key of the TOML file has an unusable value.
    #[error("config file {path}: `{key}`: {message}")]
    FileKey {
        /// The file and the line at fault (`path:line`).
        path: String,
        /// The key, as in the file: `max_concurrent_tasks`, `bootstrap.token`.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// An entry of the broker address list is unusable.
    #[error("{origin}: {}", describe_entry(*.entry, *.count, .value, .problem))]
    Address {
        /// Where the list came from: `PROPLET_MQTT_ADDRESS` (flag or environment), the
        /// `mqtt_address` key of a config file, or the enrolled credentials.
        origin: String,
        /// Position of the bad entry, from 1.
        entry: usize,
        /// Entries in the list.
        count: usize,
        /// The entry as given.
        value: String,
        /// What is wrong with it.
        problem: AddressError,
    },
}

/// `proplet`: runs WebAssembly tasks sent by Propeller over MQTT.
///
/// Every flag can also be set through the environment variable shown, or in the TOML file
/// given by --config (keys are the flag names with `_` instead of `-`). Flags win over the
/// environment, which wins over the file.
#[derive(Parser, Debug, Default, Clone)]
#[command(name = "proplet", version = crate::upgrade::AGENT_VERSION, about, long_about = None)]
pub struct Flags {
    /// `join` (enrol with a bootstrap token) or `configured` (for systemd); none: run.
    #[command(subcommand)]
    pub command: Option<AgentCommand>,
    /// TOML configuration file.
    #[arg(long, env = "PROPLET_CONFIG_FILE", global = true)]
    pub config: Option<PathBuf>,
    /// The settings given on the command line (their variables are read by
    /// [`Settings::from_env`]).
    #[command(flatten)]
    pub settings: Settings,
}

/// The agent's subcommands.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum AgentCommand {
    /// Enrol this device with a bootstrap token (`propeller token create`), keep its own
    /// credentials in the state directory, then run. As root on a host with the packaged
    /// proplet.service, the service is enabled and (re)started instead of running here.
    Join(JoinArgs),
    /// Exit 0 when this device can run (enrolled, configured by hand, or given a bootstrap
    /// token), 1 otherwise: the unit's ExecCondition, so an unconfigured device does not
    /// crash-loop.
    Configured,
}

/// Flags of `proplet join`.
#[derive(clap::Args, Debug, Clone)]
pub struct JoinArgs {
    /// The broker: mqtts://host:8883 (or tcp:// with --insecure-enrol).
    #[arg(long, env = "PROPLET_BOOTSTRAP_SERVER")]
    pub server: String,
    /// The bootstrap token, `<id>.<secret>`.
    #[arg(long, env = "PROPLET_BOOTSTRAP_TOKEN", hide_env_values = true)]
    pub token: String,
    /// CA bundle (PEM) that signed the broker's certificate.
    #[arg(long, env = "PROPLET_MQTT_TLS_CA_CERT")]
    pub tls_ca_cert: Option<PathBuf>,
    /// Send the token over plain tcp:// (the token must allow it too).
    #[arg(long)]
    pub insecure_enrol: bool,
    /// A stable id of this machine, instead of /etc/machine-id.
    #[arg(long)]
    pub machine_id: Option<String>,
    /// Where the credentials go (default: the configured state directory, else
    /// /var/lib/proplet).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// Run the agent here even where the packaged service could run it.
    #[arg(long)]
    pub foreground: bool,
    /// Only enrol: write the credentials and exit.
    #[arg(long, conflicts_with = "foreground")]
    pub no_run: bool,
}

/// Where a device stands before it can run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// It enrolled: its credentials are in this file.
    Enrolled(PathBuf),
    /// A client id and key are configured by hand.
    Configured,
    /// It has a bootstrap token to enrol with first.
    Bootstrap {
        /// The broker to enrol through.
        server: String,
        /// The token.
        token: String,
    },
    /// Nothing to connect with.
    Unconfigured,
}

impl Flags {
    /// The command line. Each setting's variable is checked here too (a bad value is
    /// reported at once, naming it) but left to [`Settings::from_env`]; `--config` and the
    /// flags of `join` take theirs here.
    pub fn from_command_line() -> Result<Self, ConfigError> {
        Self::try_from_args(std::env::args_os())
    }

    /// [`Flags::from_command_line`] with these arguments (the variables checked are the
    /// process's).
    pub fn try_from_args<I, T>(args: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
        let mut matches = match Self::command().try_get_matches_from(&args) {
            Ok(matches) => matches,
            Err(e)
                if matches!(
                    e.kind(),
                    clap::error::ErrorKind::ValueValidation | clap::error::ErrorKind::InvalidValue
                ) =>
            {
                return Err(value_error(&e, &args))
            }
            Err(e) => e.exit(),
        };
        for arg in Settings::augment_args(clap::Command::new("proplet")).get_arguments() {
            let id = arg.get_id().as_str();
            if matches.value_source(id) == Some(clap::parser::ValueSource::EnvVariable) {
                // Known ids only, so clearing cannot fail.
                let _ = matches.try_clear_id(id);
            }
        }
        Self::from_arg_matches_mut(&mut matches).map_err(|e| value_error(&e, &args))
    }

    /// The settings of the file given by --config; none without one.
    pub fn file(&self) -> Result<Settings, ConfigError> {
        match &self.config {
            Some(path) => file::load(path),
            None => Ok(Settings::default()),
        }
    }

    /// The settings given by flags over the environment (`env`, aliases included).
    pub fn given(&self, env: &HashMap<String, String>) -> Result<Settings, ConfigError> {
        Ok(self.settings.clone().or(Settings::from_env(env)?))
    }

    /// The state directory named by a flag, its variable or the config file.
    pub fn chosen_state_dir(
        &self,
        env: &HashMap<String, String>,
    ) -> Result<Option<PathBuf>, ConfigError> {
        let given = self.given(env)?;
        Ok(given.state_dir.or(self.file()?.state_dir))
    }

    /// Where this device stands: enrolled, configured by hand, holding a bootstrap token
    /// (`PROPLET_BOOTSTRAP_TOKEN`, or a `[bootstrap]` table in the config file), or none.
    pub fn readiness(&self, env: &HashMap<String, String>) -> Result<Readiness, ConfigError> {
        let given = self.settings.clone().or(Settings::from_variables(env)?);
        let file = self.file()?;
        if let Some(dir) = given.state_dir.as_ref().or(file.state_dir.as_ref()) {
            if crate::credentials::load(dir)
                .map_err(|e| invalid("credentials", &e.to_string()))?
                .is_some()
            {
                return Ok(Readiness::Enrolled(
                    dir.join(crate::credentials::CREDENTIALS_FILE),
                ));
            }
        }
        // Any layer's id and key, aliases included, as upstream deployments give them.
        let layers = [&given, &file, &Settings::from_aliases(env)];
        let set = |v: &Option<String>| v.as_deref().is_some_and(|v| !v.is_empty());
        let id = layers.iter().any(|layer| set(&layer.client_id));
        let key = layers.iter().any(|layer| set(&layer.client_key));
        if id && key {
            return Ok(Readiness::Configured);
        }
        let bootstrap = file.bootstrap.unwrap_or_default();
        let token = env
            .get("PROPLET_BOOTSTRAP_TOKEN")
            .cloned()
            .filter(|t| !t.is_empty())
            .or(bootstrap.token);
        let server = env
            .get("PROPLET_BOOTSTRAP_SERVER")
            .cloned()
            .filter(|t| !t.is_empty())
            .or(bootstrap.server);
        Ok(match (token, server) {
            (Some(token), Some(server)) => Readiness::Bootstrap { server, token },
            _ => Readiness::Unconfigured,
        })
    }
}

/// A clap value error as a [`ConfigError`] naming the flag given on the command line, or the
/// environment variable the value came from.
fn value_error(e: &clap::Error, args: &[OsString]) -> ConfigError {
    use clap::error::{ContextKind, ContextValue};
    let context = |kind| match e.get(kind) {
        Some(ContextValue::String(s)) => s.clone(),
        _ => String::new(),
    };
    let shown = context(ContextKind::InvalidArg);
    let long = shown
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_owned();
    let on_command_line = args
        .iter()
        .filter_map(|a| a.to_str())
        .any(|a| a == long || a.starts_with(&format!("{long}=")));
    let command = Flags::command();
    let env = command
        .get_arguments()
        .find(|a| a.get_long().is_some_and(|l| format!("--{l}") == long))
        .and_then(|a| a.get_env())
        .map(|v| v.to_string_lossy().into_owned());
    let name = match (on_command_line, env) {
        (false, Some(variable)) => variable,
        _ => long,
    };
    // The parser's reason names the value; clap's kind is the fallback.
    let reason = std::error::Error::source(e).map_or_else(
        || format!("{:?}: {}", context(ContextKind::InvalidValue), e.kind()),
        |s| s.to_string(),
    );
    invalid(&name, &reason)
}

#[cfg(test)]
mod tests;
