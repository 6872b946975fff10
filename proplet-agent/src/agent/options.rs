//! The MQTT connection options of each configured broker: TLS, keep-alive, Last Will.

use std::sync::Arc;

use anyhow::Context as _;
use propeller_broker::protocol::{Channel, OfflineNotice};
use rumqttc::{LastWill, MqttOptions, QoS, TlsConfiguration, Transport};

use crate::config::{BrokerAddress, Config};

/// Connection options for `config`'s first broker, with the offline Last Will; the event loop
/// given to [`Agent::run`] is made from these.
pub fn mqtt_options(config: &Config, channel: &Channel) -> anyhow::Result<MqttOptions> {
    let tls = tls_for(config)?;
    options_for(config, channel, config.brokers.primary(), tls.as_ref())
}

/// Connection options for each of `config`'s brokers, in order.
pub fn broker_options(config: &Config, channel: &Channel) -> anyhow::Result<Vec<MqttOptions>> {
    let tls = tls_for(config)?;
    config
        .brokers
        .as_slice()
        .iter()
        .map(|broker| options_for(config, channel, broker, tls.as_ref()))
        .collect()
}

/// The TLS client configuration, read once, when a broker asks for TLS.
pub(super) fn tls_for(config: &Config) -> anyhow::Result<Option<TlsConfiguration>> {
    match (&config.tls, config.brokers.first_tls()) {
        (Some(tls), Some(_)) => tls_config(tls).map(Some),
        _ => Ok(None),
    }
}

pub(super) fn options_for(
    config: &Config,
    channel: &Channel,
    broker: &BrokerAddress,
    tls: Option<&TlsConfiguration>,
) -> anyhow::Result<MqttOptions> {
    let mut opts = MqttOptions::new(&config.client_id, &broker.host, broker.port);
    opts.set_credentials(&config.client_id, &config.client_key)
        .set_keep_alive(config.keep_alive)
        .set_clean_session(true)
        .set_max_packet_size(10 * 1024 * 1024, 10 * 1024 * 1024)
        .set_inflight(super::RESULTS_IN_FLIGHT as u16)
        .set_request_channel_capacity(128);
    let will = OfflineNotice {
        proplet_id: config.client_id.clone(),
        namespace: Some(config.namespace.clone()),
    };
    opts.set_last_will(LastWill::new(
        channel.alive(),
        will.encode(),
        QoS::AtLeastOnce,
        false,
    ));
    if broker.tls {
        let tls = tls.with_context(|| {
            format!("{broker} uses TLS, but no CA bundle is configured (PROPLET_MQTT_TLS_CA_CERT)")
        })?;
        opts.set_transport(Transport::tls_with_config(tls.clone()));
    }
    Ok(opts)
}

pub fn tls_config(tls: &crate::config::TlsFiles) -> anyhow::Result<TlsConfiguration> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(&tls.ca_cert)
        .with_context(|| format!("reading CA bundle {}", tls.ca_cert.display()))?
    {
        roots
            .add(cert.with_context(|| format!("parsing {}", tls.ca_cert.display()))?)
            .context("adding CA certificate")?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_root_certificates(roots);
    let config = match &tls.client {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .with_context(|| format!("reading {}", cert.display()))?
                .collect::<Result<Vec<_>, _>>()
                .with_context(|| format!("parsing {}", cert.display()))?;
            let key = PrivateKeyDer::from_pem_file(key)
                .with_context(|| format!("reading {}", key.display()))?;
            builder
                .with_client_auth_cert(chain, key)
                .context("client certificate and key do not match")?
        }
    };
    Ok(TlsConfiguration::Rustls(Arc::new(config)))
}
