//! `propeller`: MQTT broker and operator for WebAssembly workloads.

use std::io::Write;

use anyhow::Context;
use clap::{Parser, Subcommand};

mod commands;

/// jemalloc instead of glibc's malloc: thousands of connections and tasks allocate and free
/// from many threads, where glibc's per-thread arenas fragment and keep memory. The
/// `system-allocator` feature keeps glibc's, for heap profilers that hook `malloc`
/// (heaptrack, valgrind).
#[cfg(all(unix, not(target_env = "musl"), not(feature = "system-allocator")))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's start-up options (read by jemalloc through this symbol). One arena instead of
/// four per core: threads still allocate from their own caches, and at 10,000 device
/// connections one arena held 7% less memory at the same CPU (BENCHMARKS.md).
#[cfg(all(unix, not(target_env = "musl"), not(feature = "system-allocator")))]
#[allow(non_upper_case_globals)]
#[export_name = "_rjem_malloc_conf"]
pub static malloc_conf: &[u8] = b"narenas:1\0";

/// Propeller: orchestrates WebAssembly workloads on Kubernetes and edge devices.
#[derive(Parser, Debug)]
#[command(name = "propeller", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print the six CustomResourceDefinitions as one multi-document YAML stream.
    Crd {
        /// Write one file per CRD into this directory instead (as kept in `configs/crd/`).
        #[arg(long)]
        out_dir: Option<std::path::PathBuf>,
    },
    /// Write the book's generated reference pages: the CRD fields and these flags.
    #[command(hide = true)]
    Reference {
        /// The book's reference directory.
        #[arg(long, default_value = "docs/src/reference")]
        out_dir: std::path::PathBuf,
    },
    /// Run the embedded MQTT broker alone and log every typed event (device bring-up).
    Broker(commands::broker::BrokerCommand),
    /// Print the device policy as an external broker's configuration (NATS `authorization`),
    /// from the cluster's Proplets and their Secrets.
    BrokerConfig(commands::broker_config::BrokerConfigCommand),
    /// Run the Kubernetes operator with the MQTT broker in the same process.
    Run(Box<commands::run::RunCommand>),
    /// Run without Kubernetes: broker, reconcilers and a durable store on this machine.
    Standalone(Box<commands::standalone::StandaloneCommand>),
    /// Create or update the resources of a manifest (file, directory, or - for stdin).
    Apply {
        /// Manifest file, directory of manifests, or `-`.
        #[arg(short = 'f', long = "filename")]
        file: std::path::PathBuf,
        #[command(flatten)]
        client: commands::standalone::ClientArgs,
    },
    /// List resources of a kind, or show one.
    Get {
        /// Kind: proplet, task, pjob, federatedjob, traininground, propletupgrade, secret.
        kind: String,
        /// One resource by name.
        name: Option<String>,
        /// Namespace.
        #[arg(short = 'n', long, default_value = "default")]
        namespace: String,
        /// Output: wide, yaml or json (a table when unset).
        #[arg(short = 'o', long)]
        output: Option<String>,
        /// Keep printing as the resources change.
        #[arg(short = 'w', long)]
        watch: bool,
        #[command(flatten)]
        client: commands::standalone::ClientArgs,
    },
    /// Show one resource's spec, status and conditions.
    Describe {
        /// Kind.
        kind: String,
        /// Name.
        name: String,
        /// Namespace.
        #[arg(short = 'n', long, default_value = "default")]
        namespace: String,
        #[command(flatten)]
        client: commands::standalone::ClientArgs,
    },
    /// Bootstrap tokens devices enrol with (`proplet join --token`).
    Token {
        #[command(subcommand)]
        command: commands::token::TokenCommand,
        #[command(flatten)]
        target: commands::token::Target,
    },
    /// Let a proplet enrolled with a manual-approval token get tasks: `approve proplet/NAME`.
    Approve {
        /// `proplet/NAME`.
        what: String,
        /// Namespace.
        #[arg(short = 'n', long, default_value = "default")]
        namespace: String,
        #[command(flatten)]
        target: commands::token::Target,
    },
    /// Give a proplet a new key (`rotate proplet/NAME`); the old one keeps working for
    /// --grace, and the connected device is sent the new one.
    Rotate {
        /// `proplet/NAME`.
        what: String,
        /// Namespace.
        #[arg(short = 'n', long, default_value = "default")]
        namespace: String,
        /// How long the old key keeps working (an offline device can come back meanwhile).
        #[arg(long, default_value = "1h")]
        grace: String,
        #[command(flatten)]
        target: commands::token::Target,
    },
    /// Encrypt a Wasm module for an encrypted task (its key goes into the Key Broker
    /// Service at the task's kbsResourcePath).
    Encrypt(commands::encrypt::EncryptArgs),
    /// Print what a task printed: `logs task/NAME [-f] [--tail N] [--since 5m]`.
    Logs(commands::logs::LogsArgs),
    /// Delete one resource (and what it owns).
    Delete {
        /// Kind.
        kind: String,
        /// Name.
        name: String,
        /// Namespace.
        #[arg(short = 'n', long, default_value = "default")]
        namespace: String,
        #[command(flatten)]
        client: commands::standalone::ClientArgs,
    },
}

/// Runs one async command on a fresh multi-threaded runtime.
fn block_on(command: impl std::future::Future<Output = anyhow::Result<()>>) -> anyhow::Result<()> {
    tokio::runtime::Runtime::new()
        .context("starting the async runtime")?
        .block_on(command)
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Crd { out_dir: None } => {
            let yaml = propeller_operator::crd::crds_yaml().context("rendering CRDs")?;
            std::io::stdout()
                .write_all(yaml.as_bytes())
                .context("writing CRDs to stdout")?;
        }
        Command::Crd { out_dir: Some(dir) } => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            for crd in propeller_operator::crd::all_crds() {
                let path = dir.join(propeller_operator::crd::crd_file_name(&crd));
                let yaml = propeller_operator::crd::crd_yaml(&crd).context("rendering CRD")?;
                std::fs::write(&path, yaml)
                    .with_context(|| format!("writing {}", path.display()))?;
                println!("wrote {}", path.display());
            }
        }
        Command::Reference { out_dir } => {
            std::fs::create_dir_all(&out_dir)
                .with_context(|| format!("creating {}", out_dir.display()))?;
            let crds = propeller_operator::crd::crd_reference(&propeller_operator::crd::all_crds());
            let options = clap_markdown::MarkdownOptions::new()
                .title("`propeller` command line".to_owned())
                .show_footer(false);
            let flags = clap_markdown::help_markdown_custom::<Cli>(&options);
            for (name, text) in [("crds.md", crds), ("propeller.md", flags)] {
                let path = out_dir.join(name);
                std::fs::write(&path, text)
                    .with_context(|| format!("writing {}", path.display()))?;
                println!("wrote {}", path.display());
            }
        }
        Command::Broker(cmd) => {
            commands::logging::init();
            block_on(commands::broker::run(cmd))?;
        }
        Command::BrokerConfig(cmd) => {
            block_on(commands::broker_config::print(cmd))?;
        }
        Command::Standalone(cmd) => {
            if cmd.demo && !cmd.verbose {
                propeller_broker::private_file::create_private_dir(&cmd.data_dir)?;
                commands::logging::init_to_file(&cmd.data_dir.join(commands::demo::LOG_FILE))?;
            } else {
                commands::logging::init();
            }
            block_on(commands::standalone::run(*cmd))?;
        }
        Command::Token { command, target } => {
            block_on(commands::token::run(command, target))?;
        }
        Command::Approve {
            what,
            namespace,
            target,
        } => {
            block_on(commands::token::approve(&what, &namespace, target))?;
        }
        Command::Rotate {
            what,
            namespace,
            grace,
            target,
        } => {
            block_on(commands::token::rotate(&what, &namespace, &grace, target))?;
        }
        Command::Encrypt(args) => commands::encrypt::run(&args)?,
        Command::Apply { file, client } => {
            block_on(commands::standalone::apply(&client, &file))?;
        }
        Command::Get {
            kind,
            name,
            namespace,
            output,
            watch,
            client,
        } => {
            block_on(commands::standalone::get(
                &client,
                &kind,
                name.as_deref(),
                &namespace,
                output.as_deref(),
                watch,
            ))?;
        }
        Command::Describe {
            kind,
            name,
            namespace,
            client,
        } => {
            block_on(commands::standalone::describe_one(
                &client, &kind, &name, &namespace,
            ))?;
        }
        Command::Delete {
            kind,
            name,
            namespace,
            client,
        } => {
            block_on(commands::standalone::delete(
                &client, &kind, &name, &namespace,
            ))?;
        }
        Command::Logs(args) => block_on(commands::logs::run(&args))?,
        Command::Run(cmd) => {
            commands::logging::init_with(cmd.log_format);
            block_on(commands::run::run(*cmd))?;
        }
    }
    Ok(())
}
