//! `propeller-mqtt-cluster`: a 3-node RabbitMQ or NATS cluster on loopback ports, from the same
//! harness the tests use, for the benchmarks and for trying the external broker mode by hand.
//! Prints one JSON line (`{"mqtt": ["127.0.0.1:port", ...], "pids": [...]}`) once the cluster
//! is ready and runs until it is interrupted; every node stops with it.

#[path = "support/envtest.rs"]
mod envtest;
#[path = "support/mqtt_cluster.rs"]
mod mqtt_cluster;
#[path = "support/signal.rs"]
mod signal;

use anyhow::bail;
use clap::{Parser, Subcommand};
// The harness reaches these through `super::`.
#[allow(unused_imports)]
use envtest::pdeathsig;

#[derive(Parser, Debug)]
struct Args {
    #[command(subcommand)]
    engine: Engine,
}

#[derive(Subcommand, Debug)]
enum Engine {
    /// RabbitMQ 3 nodes with `rabbitmq_mqtt` and the HTTP auth backend.
    Rabbitmq {
        /// Base URL of the auth callbacks (`http://host:port/rabbitmq/<secret>`).
        #[arg(long)]
        auth_base: String,
    },
    /// NATS 3 nodes with JetStream and MQTT.
    Nats {
        /// File with the initial `authorization { ... }` block.
        #[arg(long)]
        authorization: std::path::PathBuf,
        /// A user of that block, for the warm-up connect of each node.
        #[arg(long)]
        user: String,
        /// Its password.
        #[arg(long)]
        password: String,
    },
}

fn main() -> anyhow::Result<()> {
    match Args::parse().engine {
        Engine::Rabbitmq { auth_base } => {
            let Some(cluster) = mqtt_cluster::RabbitCluster::start(&auth_base) else {
                bail!("RabbitMQ is not installed (apt-get install rabbitmq-server)");
            };
            announce(&cluster.mqtt_addrs(), &[], None);
            signal::wait_for_signal();
        }
        Engine::Nats {
            authorization,
            user,
            password,
        } => {
            let text = std::fs::read_to_string(&authorization)?;
            let Some(cluster) = mqtt_cluster::NatsCluster::start(&text, &user, &password) else {
                bail!("NATS is not installed (apt-get install nats-server)");
            };
            announce(
                &cluster.mqtt_addrs(),
                &cluster.pids(),
                Some(&cluster.authorization_path()),
            );
            signal::wait_for_signal();
        }
    }
    Ok(())
}

fn announce(mqtt: &[std::net::SocketAddr], pids: &[u32], authorization: Option<&std::path::Path>) {
    let line = serde_json::json!({
        "mqtt": mqtt.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "pids": pids,
        "authorization": authorization.map(|p| p.display().to_string()),
    });
    println!("{line}");
}
