//! The device side of the Key Broker Service protocol (KBS protocol 0.4.0, the RCAR
//! handshake of Confidential Containers' trustee): the agent asks for a challenge, answers
//! it with evidence bound to the nonce and to a key made for this exchange, and gets the
//! resource wrapped for that key. The keys of encrypted tasks come this way.
//!
//! Transient failures (the service unreachable, its 5xx answers) are tried again a few
//! times, then the client refuses further exchanges for a growing pause, so a fleet of tasks
//! does not hammer a service that is down. Refusals (attestation, policy, a missing
//! resource) are final and named.

mod attester;
mod jwe;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use kbs_types::{Attestation, Challenge, CompositeEvidence, HashAlgorithm, Request, RuntimeData};
use serde_json::json;
use zeroize::Zeroizing;

pub use attester::{detected_tee, for_choice, Attester, SampleAttester};
pub use jwe::TeeKey;

use crate::config::KbsSettings;

/// The protocol version the KBS must speak.
pub const PROTOCOL_VERSION: &str = "0.4.0";
/// Attempts of one exchange when the service is unreachable or failing.
const ATTEMPTS: u32 = 3;
/// The pause before the second attempt; it doubles for each further one.
const FIRST_RETRY: Duration = Duration::from_millis(500);
/// The pause after a failed round of attempts; doubles with each further failed round.
const FIRST_PAUSE: Duration = Duration::from_secs(10);
/// The longest pause.
const MAX_PAUSE: Duration = Duration::from_secs(300);
/// One request's time limit.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// The longest refusal text kept from the service.
const DETAIL_LIMIT: usize = 300;
const SESSION_COOKIE: &str = "kbs-session-id";

/// Why a key could not be had.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KbsError {
    /// No answer (connection refused, timeout, TLS).
    #[error("the Key Broker Service at {url} is unreachable: {reason}")]
    Unreachable {
        /// The request's URL.
        url: String,
        /// What failed.
        reason: String,
    },
    /// A 5xx answer.
    #[error("the Key Broker Service failed at {step} (HTTP {status}): {detail}")]
    ServerError {
        /// The protocol step.
        step: &'static str,
        /// Its status.
        status: u16,
        /// Its body, shortened.
        detail: String,
    },
    /// The evidence was refused.
    #[error(
        "the Key Broker Service refused this device's attestation ({attester} evidence): {detail}"
    )]
    AttestationRefused {
        /// The attester whose evidence was sent.
        attester: &'static str,
        /// Its answer.
        detail: String,
    },
    /// The resource policy refused the key to this device.
    #[error("the Key Broker Service's resource policy denies {path} to this device: {detail}")]
    PolicyDenied {
        /// The resource.
        path: String,
        /// Its answer.
        detail: String,
    },
    /// No such resource, or the service cannot read it.
    #[error("the Key Broker Service has no resource {path} it can give (check kbsResourcePath and that the key was put there): {detail}")]
    ResourceUnavailable {
        /// The resource.
        path: String,
        /// Its answer.
        detail: String,
    },
    /// Another refusal.
    #[error("the Key Broker Service refused {step} (HTTP {status}): {detail}")]
    Refused {
        /// The protocol step.
        step: &'static str,
        /// Its status.
        status: u16,
        /// Its body, shortened.
        detail: String,
    },
    /// An answer that does not follow the protocol.
    #[error(
        "the Key Broker Service's answer does not follow KBS protocol {PROTOCOL_VERSION}: {0}"
    )]
    Protocol(String),
    /// Exchanges are paused after repeated failures.
    #[error("the Key Broker Service failed {failures} times in a row, last: {last}; the next exchange is tried in {}s", retry_in.as_secs().max(1))]
    Paused {
        /// Failed rounds so far.
        failures: u32,
        /// The time left.
        retry_in: Duration,
        /// The last failure.
        last: String,
    },
    /// The resource path is malformed.
    #[error("kbsResourcePath {0:?} is not REPOSITORY/TYPE/TAG (three non-empty segments of letters, digits, `-`, `_` and `.`)")]
    BadPath(String),
}

impl KbsError {
    fn is_transient(&self) -> bool {
        matches!(
            self,
            KbsError::Unreachable { .. } | KbsError::ServerError { .. }
        )
    }
}

/// Consecutive failed rounds and when the next exchange may start.
#[derive(Default)]
struct Pause {
    failures: u32,
    until: Option<Instant>,
    last: String,
}

/// A client of one Key Broker Service, with the device's attester.
pub struct KbsClient {
    http: reqwest::Client,
    base: String,
    attester: Box<dyn Attester>,
    pause: Mutex<Pause>,
}

/// Checks `path` is `REPOSITORY/TYPE/TAG`.
pub fn check_path(path: &str) -> Result<(), KbsError> {
    let segments: Vec<&str> = path.split('/').collect();
    let fine = segments.len() == 3
        && segments.iter().all(|s| {
            !s.is_empty()
                && *s != ".."
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        });
    if fine {
        Ok(())
    } else {
        Err(KbsError::BadPath(path.to_owned()))
    }
}

fn shorten(text: &str) -> String {
    let text = text.trim();
    match text.char_indices().nth(DETAIL_LIMIT) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

/// The readable part of a KBS error body: `{"type": ".../PolicyDeny", "detail": "..."}`.
fn detail_of(body: &[u8]) -> String {
    match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(value) => {
            let kind = value["type"]
                .as_str()
                .and_then(|t| t.rsplit('/').next())
                .unwrap_or_default();
            let detail = value["detail"].as_str().unwrap_or_default();
            shorten(&format!("{kind}: {detail}"))
        }
        Err(_) => shorten(&String::from_utf8_lossy(body)),
    }
}

impl KbsClient {
    /// A client of the service `settings` name, attesting with `attester`.
    pub fn new(settings: &KbsSettings, attester: Box<dyn Attester>) -> Result<Self, KbsError> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut builder = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .user_agent(concat!("proplet/", env!("CARGO_PKG_VERSION")));
        for root in &settings.ca_roots {
            let certificate = reqwest::Certificate::from_der(root)
                .map_err(|e| KbsError::Protocol(format!("PROPLET_KBS_CA_FILE certificate: {e}")))?;
            builder = builder.add_root_certificate(certificate);
        }
        let http = builder.build().map_err(|e| KbsError::Unreachable {
            url: settings.url.clone(),
            reason: e.to_string(),
        })?;
        Ok(Self {
            http,
            base: format!("{}/kbs/v0", settings.url),
            attester,
            pause: Mutex::new(Pause::default()),
        })
    }

    /// The attester's name.
    pub fn attester(&self) -> &'static str {
        self.attester.name()
    }

    /// The resource at `path` (`REPOSITORY/TYPE/TAG`), after attestation; wiped from memory
    /// when dropped.
    pub async fn resource(&self, path: &str) -> Result<Zeroizing<Vec<u8>>, KbsError> {
        check_path(path)?;
        self.check_pause()?;
        let mut delay = FIRST_RETRY;
        let mut attempt = 1;
        loop {
            match self.exchange(path).await {
                Err(error) if error.is_transient() && attempt < ATTEMPTS => {
                    tracing::warn!(%error, attempt, retry_in = ?delay, "Key Broker Service exchange failed; trying again");
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                    attempt += 1;
                }
                Err(error) if error.is_transient() => {
                    self.pause_after(&error);
                    return Err(error);
                }
                outcome => {
                    if outcome.is_ok() {
                        *self.lock_pause() = Pause::default();
                    }
                    return outcome;
                }
            }
        }
    }

    fn lock_pause(&self) -> std::sync::MutexGuard<'_, Pause> {
        self.pause.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check_pause(&self) -> Result<(), KbsError> {
        let pause = self.lock_pause();
        match pause.until {
            Some(until) if until > Instant::now() => Err(KbsError::Paused {
                failures: pause.failures,
                retry_in: until - Instant::now(),
                last: pause.last.clone(),
            }),
            _ => Ok(()),
        }
    }

    fn pause_after(&self, error: &KbsError) {
        let mut pause = self.lock_pause();
        pause.failures += 1;
        let length = FIRST_PAUSE
            .saturating_mul(1 << (pause.failures - 1).min(10))
            .min(MAX_PAUSE);
        pause.until = Some(Instant::now() + length);
        pause.last = error.to_string();
        tracing::warn!(%error, pause = ?length, "Key Broker Service failing; exchanges paused");
    }

    /// One RCAR handshake and resource fetch.
    async fn exchange(&self, path: &str) -> Result<Zeroizing<Vec<u8>>, KbsError> {
        let request = Request {
            version: PROTOCOL_VERSION.to_owned(),
            tee: self.attester.tee(),
            extra_params: json!({}),
        };
        let answer = self
            .send(
                "auth",
                self.http.post(format!("{}/auth", self.base)).json(&request),
            )
            .await?;
        let cookie = session_cookie(&answer)?;
        let challenge: Challenge = serde_json::from_slice(&read("auth", answer).await?)
            .map_err(|e| KbsError::Protocol(format!("the challenge: {e}")))?;

        let key = TeeKey::generate()?;
        let tee_pubkey = key.public_jwk();
        // The binding the verifier checks: the hash of the canonical (RFC 8785) JSON of the
        // nonce and the key.
        let binding = json!({
            "additional-evidence": "",
            "nonce": challenge.nonce,
            "tee-pubkey": tee_pubkey,
        });
        let canonical = serde_json_canonicalizer::to_vec(&binding)
            .map_err(|e| KbsError::Protocol(format!("canonical JSON: {e}")))?;
        let report_data = HashAlgorithm::Sha384.digest(&canonical);
        let attestation = Attestation {
            init_data: None,
            runtime_data: RuntimeData {
                nonce: challenge.nonce,
                tee_pubkey,
            },
            tee_evidence: CompositeEvidence {
                primary_evidence: self.attester.evidence(&report_data),
                additional_evidence: String::new(),
            },
        };
        let attested = self
            .send(
                "attest",
                self.http
                    .post(format!("{}/attest", self.base))
                    .header(reqwest::header::COOKIE, &cookie)
                    .json(&attestation),
            )
            .await;
        match attested {
            Err(KbsError::Refused {
                status: 401,
                detail,
                ..
            }) => {
                return Err(KbsError::AttestationRefused {
                    attester: self.attester.name(),
                    detail,
                })
            }
            other => drop(other?),
        }

        let fetched = self
            .send(
                "resource",
                self.http
                    .get(format!("{}/resource/{path}", self.base))
                    .header(reqwest::header::COOKIE, &cookie),
            )
            .await;
        let answer = match fetched {
            Err(KbsError::Refused { detail, .. }) if detail.starts_with("PolicyDeny") => {
                return Err(KbsError::PolicyDenied {
                    path: path.to_owned(),
                    detail,
                })
            }
            Err(KbsError::Refused {
                status: 401 | 404,
                detail,
                ..
            }) => {
                return Err(KbsError::ResourceUnavailable {
                    path: path.to_owned(),
                    detail,
                })
            }
            other => other?,
        };
        key.open(&read("resource", answer).await?)
    }

    /// Sends one request; a non-2xx answer becomes the matching error.
    async fn send(
        &self,
        step: &'static str,
        request: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, KbsError> {
        let answer = request.send().await.map_err(|e| KbsError::Unreachable {
            url: e.url().map(|u| u.to_string()).unwrap_or_default(),
            reason: root_cause(&e),
        })?;
        let status = answer.status().as_u16();
        if answer.status().is_success() {
            return Ok(answer);
        }
        let detail = detail_of(&answer.bytes().await.unwrap_or_default());
        Err(if status >= 500 {
            KbsError::ServerError {
                step,
                status,
                detail,
            }
        } else {
            KbsError::Refused {
                step,
                status,
                detail,
            }
        })
    }
}

async fn read(step: &'static str, answer: reqwest::Response) -> Result<Vec<u8>, KbsError> {
    answer
        .bytes()
        .await
        .map(|b| b.to_vec())
        .map_err(|e| KbsError::Protocol(format!("reading the {step} answer: {e}")))
}

/// `kbs-session-id=…` from the auth answer's `Set-Cookie`.
fn session_cookie(answer: &reqwest::Response) -> Result<String, KbsError> {
    answer
        .headers()
        .get_all(reqwest::header::SET_COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .filter_map(|value| value.split(';').next())
        .find(|pair| pair.trim_start().starts_with(SESSION_COOKIE))
        .map(|pair| pair.trim().to_owned())
        .ok_or_else(|| KbsError::Protocol("the auth answer set no kbs-session-id cookie".into()))
}

/// The innermost cause of a request error (e.g. "Connection refused").
fn root_cause(error: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = error;
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resource_paths_are_three_plain_segments() {
        assert!(check_path("default/key/wasm-key").is_ok());
        assert!(check_path("repo/type/tag.v1_2").is_ok());
        for bad in ["", "a/b", "a/b/c/d", "a//c", "a/../c", "a/b/c?x=1", "/a/b"] {
            assert_eq!(check_path(bad), Err(KbsError::BadPath(bad.into())), "{bad}");
        }
    }

    #[test]
    fn refusal_bodies_are_shortened_to_their_kind_and_detail() {
        let body = br#"{"type":"https://github.com/confidential-containers/kbs/errors/PolicyDeny","detail":"Resource policy denied"}"#;
        assert_eq!(detail_of(body), "PolicyDeny: Resource policy denied");
        let long = "x".repeat(1000);
        assert_eq!(detail_of(long.as_bytes()).chars().count(), DETAIL_LIMIT + 1);
    }

    #[tokio::test]
    async fn an_unreachable_service_is_tried_three_times_then_paused() {
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let settings = KbsSettings {
            url: format!("http://127.0.0.1:{port}"),
            ca_roots: Vec::new(),
            attester: crate::config::AttesterChoice::Sample,
        };
        let client = KbsClient::new(&settings, Box::new(SampleAttester)).unwrap();
        let started = Instant::now();
        let first = client.resource("default/key/k").await.unwrap_err();
        assert!(matches!(first, KbsError::Unreachable { .. }), "{first}");
        // Two pauses between three attempts: 0.5 s and 1 s.
        assert!(started.elapsed() >= Duration::from_millis(1500));
        let second = client.resource("default/key/k").await.unwrap_err();
        assert!(
            matches!(second, KbsError::Paused { failures: 1, .. }),
            "{second}"
        );
        assert!(second.to_string().contains("unreachable"), "{second}");
    }
}
