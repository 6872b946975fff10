//! Enrolment: `proplet join` trades a bootstrap token for this device's own credentials
//! ([`crate::credentials`], kept in the state directory where every later start finds
//! them). The token itself is never stored.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use propeller_broker::protocol::enrolment::{
    enrol_client_id, reply_topic, request_topic, token_login_name, BootstrapToken, EnrolGrant,
    EnrolReply, EnrolRequest, SealedReply,
};
use propeller_broker::protocol::sealed_grant::ReplyKey;
use propeller_broker::protocol::BrokerAddress;
use rumqttc::{
    AsyncClient, ConnectReturnCode, Event, MqttOptions, Packet, QoS, SubscribeReasonCode, Transport,
};

use crate::config::TlsFiles;
use crate::credentials::Credentials;

/// Copies the CA bundle `ca` into `state_dir` (as `ca.pem`) and returns its absolute path:
/// the service that runs the agent later neither starts where `join` ran nor may read the
/// home directory the bundle was given from.
pub fn keep_ca(state_dir: &Path, ca: &Path) -> anyhow::Result<PathBuf> {
    let kept = std::path::absolute(state_dir.join("ca.pem"))
        .with_context(|| format!("the path of {}", state_dir.display()))?;
    let given = std::path::absolute(ca).with_context(|| format!("the path of {}", ca.display()))?;
    if given != kept {
        std::fs::create_dir_all(state_dir)
            .with_context(|| format!("creating {}", state_dir.display()))?;
        std::fs::copy(&given, &kept)
            .with_context(|| format!("copying {} to {}", given.display(), kept.display()))?;
    }
    Ok(kept)
}

/// What `proplet join` needs.
#[derive(Debug, Clone)]
pub struct JoinRequest {
    /// The broker URL (`mqtts://host:8883`).
    pub server: String,
    /// The bootstrap token, `<id>.<secret>`.
    pub token: String,
    /// The CA bundle that verifies the broker.
    pub tls_ca_cert: Option<PathBuf>,
    /// Allow the token over plain `tcp://`.
    pub insecure_enrol: bool,
    /// The machine id to report (default: `/etc/machine-id`).
    pub machine_id: Option<String>,
    /// How long to wait for the answer.
    pub timeout: Duration,
}

/// Logins a refused token gets before `join` gives up, 1 s then 2 s apart: a token made a
/// moment ago may not have reached the broker yet (NATS: the rendered file and its reload).
/// Few, because each wrong secret counts towards the token's lock.
const REFUSED_LOGIN_ATTEMPTS: u32 = 3;

/// How long a request sent waits for its answer before the device asks again on a new
/// connection (a new client id, so a late answer to the old one cannot arrive). A request or
/// its answer can be lost (a broker node failing over, propeller restarting between them);
/// asking again is safe because propeller answers a machine it already enrolled with a fresh
/// key for the same proplet, and the token's uses count machines, not requests.
const ANSWER_WAIT: Duration = Duration::from_secs(10);

/// Enrols this device: logs in with the token, sends its facts, and returns the
/// credentials propeller answered with (or its refusal, as the error).
pub async fn join(request: &JoinRequest) -> anyhow::Result<Credentials> {
    let deadline = tokio::time::Instant::now() + request.timeout;
    let mut refused = 1;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match join_once(request, left).await {
            Err(JoinError::Refused(message)) if refused < REFUSED_LOGIN_ATTEMPTS => {
                tracing::debug!(attempt = refused, "{message}; trying again");
                tokio::time::sleep(Duration::from_secs(u64::from(refused))).await;
                refused += 1;
            }
            Err(JoinError::Refused(message)) => bail!("{message}"),
            Err(JoinError::NoAnswer) if tokio::time::Instant::now() < deadline => {
                tracing::info!("no answer from propeller yet; asking again");
            }
            Err(JoinError::NoAnswer) => bail!(
                "no answer from propeller within {:?}: is propeller running and reachable at {}?",
                request.timeout,
                request.server
            ),
            Err(JoinError::Other(e)) => return Err(e),
            Ok(credentials) => return Ok(credentials),
        }
    }
}

/// Why one enrolment attempt failed.
enum JoinError {
    /// The broker refused the token login.
    Refused(String),
    /// Propeller did not answer in time.
    NoAnswer,
    /// Anything else (final).
    Other(anyhow::Error),
}

impl<E: Into<anyhow::Error>> From<E> for JoinError {
    fn from(e: E) -> Self {
        Self::Other(e.into())
    }
}

async fn join_once(request: &JoinRequest, wait: Duration) -> Result<Credentials, JoinError> {
    let token: BootstrapToken = request.token.parse()?;
    let address = BrokerAddress::parse(&request.server)
        .map_err(|e| anyhow::anyhow!("--server {:?}: {e}", request.server))?;
    if !address.tls && !request.insecure_enrol {
        return Err(JoinError::Other(anyhow::anyhow!(
            "refusing to send a bootstrap token over plain {}: use an mqtts:// address (the token and the key it gets back must not cross an unencrypted link), or give --insecure-enrol on a network you trust (the token must have been made with --insecure-enrol too)",
            request.server
        )));
    }
    let facts = facts(request.machine_id.as_deref())?;
    let nonce = random_nonce()?;
    let client_id = enrol_client_id(token.id(), &nonce);
    let mut options = MqttOptions::new(&client_id, &address.host, address.port);
    options
        .set_credentials(token_login_name(token.id()), token.reveal())
        .set_keep_alive(Duration::from_secs(30))
        .set_clean_session(true);
    if address.tls {
        let ca_cert = request.tls_ca_cert.clone().with_context(|| {
            format!(
                "{} uses TLS: give the CA bundle that signed the broker's certificate (--tls-ca-cert)",
                request.server
            )
        })?;
        let tls = crate::agent::tls_config(&TlsFiles {
            ca_cert,
            client: None,
        })?;
        options.set_transport(Transport::tls_with_config(tls));
    }
    let (client, mut events) = AsyncClient::new(options, 16);
    let reply_key = ReplyKey::generate();
    let payload = serde_json::to_vec(&EnrolRequest {
        server: request.server.clone(),
        reply_key: reply_key.public().to_owned(),
        ..facts
    })?;
    let exchange = async {
        let mut connected = false;
        // When the request went out: its answer is awaited for ANSWER_WAIT from then.
        let mut asked: Option<tokio::time::Instant> = None;
        loop {
            let polled = match asked {
                Some(at) => match tokio::time::timeout_at(at + ANSWER_WAIT, events.poll()).await {
                    Ok(polled) => polled,
                    Err(_) => return Err(JoinError::NoAnswer),
                },
                None => events.poll().await,
            };
            let event = polled.map_err(|e| match e {
                // A refused login: a CONNACK saying so, or (as the embedded broker does) the
                // connection closed after the CONNECT, before any CONNACK (seen as a state
                // error or, over TLS, as the stream ending).
                rumqttc::ConnectionError::ConnectionRefused(
                    ConnectReturnCode::BadUserNamePassword | ConnectReturnCode::NotAuthorized,
                )
                | rumqttc::ConnectionError::MqttState(_)
                    if !connected =>
                {
                    JoinError::Refused(format!(
                        "the broker refused bootstrap token {}: it does not exist (deleted or mistyped), its secret is wrong, it is locked for a while after too many wrong secrets, or it is only for TLS and this was plain tcp://",
                        token.id()
                    ))
                }
                rumqttc::ConnectionError::Io(ref io)
                    if !connected
                        && matches!(
                            io.kind(),
                            std::io::ErrorKind::UnexpectedEof
                                | std::io::ErrorKind::ConnectionReset
                                | std::io::ErrorKind::ConnectionAborted
                                | std::io::ErrorKind::BrokenPipe
                        ) =>
                {
                    JoinError::Refused(format!(
                        "the broker refused bootstrap token {}: it does not exist (deleted or mistyped), its secret is wrong, it is locked for a while after too many wrong secrets, or it is only for TLS and this was plain tcp://",
                        token.id()
                    ))
                }
                other => JoinError::Other(anyhow::anyhow!("connecting to {}: {other}", request.server)),
            })?;
            match event {
                Event::Incoming(Packet::ConnAck(_)) => {
                    connected = true;
                    client
                        .subscribe(reply_topic(&client_id), QoS::AtLeastOnce)
                        .await?;
                }
                Event::Incoming(Packet::SubAck(ack))
                    if ack
                        .return_codes
                        .iter()
                        .any(|c| matches!(c, SubscribeReasonCode::Failure)) =>
                {
                    // A clustered broker can refuse a subscription for a while (NATS after a
                    // node failure); the request waits until the answer can reach the device.
                    tracing::info!(
                        "the broker refused the answer's subscription; subscribing again"
                    );
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    client
                        .subscribe(reply_topic(&client_id), QoS::AtLeastOnce)
                        .await?;
                }
                Event::Incoming(Packet::SubAck(_)) => {
                    client
                        .publish(
                            request_topic(&client_id),
                            QoS::AtLeastOnce,
                            false,
                            payload.clone(),
                        )
                        .await?;
                    asked = Some(tokio::time::Instant::now());
                }
                Event::Incoming(Packet::Publish(p)) if p.topic == reply_topic(&client_id) => {
                    let reply: SealedReply = serde_json::from_slice(&p.payload)
                        .context("propeller's answer could not be read")?;
                    return Ok::<_, JoinError>(reply);
                }
                _ => {}
            }
        }
    };
    let answer = tokio::time::timeout(wait, exchange).await;
    let _ = client.disconnect().await;
    let reply = answer.map_err(|_| JoinError::NoAnswer)??;
    match reply {
        EnrolReply::Refused(refusal) => Err(JoinError::Other(anyhow::anyhow!(
            "enrolment refused: {}",
            refusal.message
        ))),
        EnrolReply::Enrolled(sealed) => {
            let grant = reply_key
                .open(&sealed, &client_id)
                .context("propeller's answer could not be opened")?;
            Ok(credentials(request, grant))
        }
    }
}

fn credentials(request: &JoinRequest, grant: EnrolGrant) -> Credentials {
    Credentials {
        mqtt_address: request.server.clone(),
        tls_ca_cert: request.tls_ca_cert.clone(),
        domain_id: grant.domain_id,
        channel_id: grant.channel_id,
        client_id: grant.client_id,
        client_key: grant.client_key,
        namespace: grant.namespace,
        previous_client_key: None,
        previous_key_until: None,
    }
}

/// What the device tells about itself.
fn facts(machine_id: Option<&str>) -> anyhow::Result<EnrolRequest> {
    let machine_id = match machine_id {
        Some(id) => id.trim().to_owned(),
        None => ["/etc/machine-id", "/var/lib/dbus/machine-id"]
            .iter()
            .find_map(|p| std::fs::read_to_string(p).ok())
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .context("no /etc/machine-id: give a stable id of this machine with --machine-id")?,
    };
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    let memory_bytes = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024);
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "arm" => "arm",
        other => other,
    };
    Ok(EnrolRequest {
        machine_id,
        hostname,
        arch: arch.to_owned(),
        os: std::env::consts::OS.to_owned(),
        memory_bytes,
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
        agent_version: crate::upgrade::AGENT_VERSION.to_owned(),
        server: String::new(),
        reply_key: String::new(),
    })
}

/// 12 random characters for the enrolment login's client id.
fn random_nonce() -> anyhow::Result<String> {
    use std::io::Read;
    let mut bytes = [0u8; 6];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("reading /dev/urandom")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_address_is_refused_without_insecure_enrol() {
        let request = JoinRequest {
            server: "tcp://127.0.0.1:1".into(),
            token: "abcdef.0123456789abcdef".into(),
            tls_ca_cert: None,
            insecure_enrol: false,
            machine_id: Some("m".into()),
            timeout: Duration::from_secs(1),
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        let error = runtime.block_on(join(&request)).expect_err("plain tcp");
        assert!(error.to_string().contains("--insecure-enrol"), "{error}");
        let bad_token = JoinRequest {
            token: "nope".into(),
            ..request
        };
        let error = runtime.block_on(join(&bad_token)).expect_err("bad token");
        assert!(
            error.to_string().contains("propeller token create"),
            "{error}"
        );
    }
}
