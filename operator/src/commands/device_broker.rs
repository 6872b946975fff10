//! The device plane of `run` and `standalone`: the embedded broker, or a client session on an
//! external MQTT cluster with propeller as its authentication backend. Both give the same
//! event stream and publisher, so the drivers do not know which one is in front.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use prometheus_client::registry::Registry;
use propeller_broker::external::callback::{self, CallbackState};
use propeller_broker::external::ExternalBroker;
use propeller_broker::server::{
    BrokerConfig, BrokerEvent, Credential, CredentialSource, CredentialStore, EmbeddedBroker,
    Publisher, Role,
};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::external_args::{DeviceAuth, ExternalPlan};

/// How long a leaving replica tries to end its session on the cluster.
const LEAVE_LIMIT: Duration = Duration::from_secs(5);

/// Where devices connect.
pub enum DeviceBroker {
    /// propeller is the broker.
    Embedded(EmbeddedBroker),
    /// propeller is a client of an external cluster.
    External {
        /// The client session.
        session: ExternalBroker,
        /// The authentication callbacks' server, with its address.
        callback: Option<(SocketAddr, CallbackState, JoinHandle<()>)>,
        /// What was connected to, for the start-up lines.
        addresses: String,
        /// The task keeping a rendered broker configuration current.
        renderer: Option<JoinHandle<()>>,
    },
}

/// The credential tables a device plane consults.
pub struct Logins {
    /// Proplets (from the Proplet resources and their Secrets, or the standalone store).
    pub proplets: Arc<CredentialStore>,
    /// Services (the credentials file); propeller's own login on a cluster is added here.
    pub services: CredentialStore,
}

impl Logins {
    /// Proplets first, then services.
    pub fn all(&self) -> Arc<dyn CredentialSource> {
        Arc::new(propeller_broker::server::LayeredCredentials::new(vec![
            self.proplets.clone(),
            Arc::new(self.services.clone()),
        ]))
    }
}

impl DeviceBroker {
    /// Starts the embedded broker, or connects to the cluster `external` describes.
    pub async fn start(
        embedded: BrokerConfig,
        external: Option<ExternalPlan>,
        logins: &Logins,
    ) -> anyhow::Result<Self> {
        let Some(plan) = external else {
            let broker = EmbeddedBroker::start(embedded, logins.all())
                .await
                .context("starting the MQTT broker")?;
            return Ok(Self::Embedded(broker));
        };
        if let Some((user, password)) = &plan.own_login {
            logins.services.insert(
                user.clone(),
                Credential::new(password.clone(), Role::Service),
            );
        }
        let callback = match &plan.callback {
            Some((listen, secret)) => {
                let listener = tokio::net::TcpListener::bind(listen)
                    .await
                    .with_context(|| format!("binding the auth callback address {listen}"))?;
                let addr = listener.local_addr()?;
                let state = CallbackState::new(logins.all(), secret.clone());
                let server = state.clone();
                let task = tokio::spawn(async move {
                    if let Err(e) = callback::serve(listener, server).await {
                        warn!(%e, "the auth callback server stopped");
                    }
                });
                info!(%addr, "auth callbacks listening (RabbitMQ /rabbitmq/<secret>/..., EMQX /emqx/<secret>/...)");
                Some((addr, state, task))
            }
            None => None,
        };
        match plan.device_auth {
            DeviceAuth::None => warn!(
                "devices are NOT authenticated by propeller: the broker lets anyone in, and \
                 reports are taken as they claim (--device-auth none is for development)"
            ),
            DeviceAuth::Rendered if plan.rendered.is_none() => info!(
                "devices are authenticated by the broker's rendered configuration: run \
                 `propeller broker-config` and reload the broker after Proplets change"
            ),
            DeviceAuth::Rendered => {}
            DeviceAuth::Callback => {}
        }
        if plan.device_auth != DeviceAuth::None {
            warn!(
                "external broker: reports are bound to proplets by their channel, not by \
                 the connection (the broker does not tell who published): give each proplet \
                 its own channel for the embedded broker's anti-spoofing guarantee"
            );
        }
        let addresses = plan
            .config
            .addresses
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let renderer = plan.rendered.map(|(path, reload)| {
            info!(path = %path.display(), "keeping the broker's device configuration current");
            tokio::spawn(super::broker_config::keep_rendered(
                (*logins.proplets).clone(),
                logins.services.clone(),
                path,
                reload,
            ))
        });
        let session = ExternalBroker::connect(plan.config, (*logins.proplets).clone())
            .context("connecting to the external MQTT broker")?;
        Ok(Self::External {
            session,
            callback,
            addresses,
            renderer,
        })
    }

    /// The event stream; `None` after the first call.
    pub fn take_events(&mut self) -> Option<UnboundedReceiver<BrokerEvent>> {
        match self {
            Self::Embedded(broker) => broker.take_events(),
            Self::External { session, .. } => session.take_events(),
        }
    }

    /// Publishes commands to devices.
    pub fn publisher(&self) -> Publisher {
        match self {
            Self::Embedded(broker) => broker.publisher(),
            Self::External { session, .. } => session.publisher(),
        }
    }

    /// Registers the device plane's meters.
    pub fn register(&self, registry: &mut Registry) {
        match self {
            Self::Embedded(broker) => broker.metrics().register(registry),
            Self::External {
                session, callback, ..
            } => {
                session.metrics().register(registry);
                if let Some((_, state, _)) = callback {
                    state.register(registry);
                }
            }
        }
    }

    /// Whether devices can reach propeller now: always for the embedded broker; while the
    /// session is connected and subscribed for an external one.
    pub fn ready(&self) -> Option<watch::Receiver<bool>> {
        match self {
            Self::Embedded(_) => None,
            Self::External { session, .. } => Some(session.ready()),
        }
    }

    /// The plain listener of the embedded broker.
    pub fn listen_addr(&self) -> Option<SocketAddr> {
        match self {
            Self::Embedded(broker) => broker.tcp_addr(),
            Self::External { .. } => None,
        }
    }

    /// The embedded broker's TLS address, when it has a TLS listener.
    pub fn tls_addr(&self) -> Option<SocketAddr> {
        match self {
            Self::Embedded(broker) => broker.tls_addr(),
            Self::External { .. } => None,
        }
    }

    /// The address of the auth callbacks, when served.
    pub fn callback_addr(&self) -> Option<SocketAddr> {
        match self {
            Self::External {
                callback: Some((addr, _, _)),
                ..
            } => Some(*addr),
            _ => None,
        }
    }

    /// What devices connect to, as an agent's `PROPLET_MQTT_ADDRESS` value.
    pub fn device_address(&self) -> Option<String> {
        match self {
            Self::Embedded(broker) => broker.tcp_addr().map(|a| format!("tcp://{a}")),
            Self::External { addresses, .. } => Some(addresses.clone()),
        }
    }

    /// Stops like [`DeviceBroker::shutdown`], and on an external cluster ends the session
    /// there as well (for a sharded replica, whose client id is never used again); what
    /// fails is logged, and the cluster then keeps the session until it expires there.
    pub async fn leave(&mut self) {
        if let Self::External { session, .. } = self {
            match session.end_session(LEAVE_LIMIT).await {
                Ok(()) => info!("ended this replica's session on the MQTT cluster"),
                Err(e) => warn!(error = %e, "the MQTT cluster keeps this replica's session"),
            }
        }
        self.shutdown();
    }

    /// Stops listening or ends the session.
    pub fn shutdown(&mut self) {
        match self {
            Self::Embedded(broker) => broker.shutdown(),
            Self::External {
                session,
                callback,
                renderer,
                ..
            } => {
                session.shutdown();
                if let Some((_, _, task)) = callback.take() {
                    task.abort();
                }
                if let Some(task) = renderer.take() {
                    task.abort();
                }
            }
        }
    }
}
