//! Propeller as the external broker's authentication and authorization backend: devices log
//! in with the same credentials, and may use the same topics, as on the embedded broker.
//!
//! - RabbitMQ (`rabbitmq_auth_backend_http`, `auth_http.http_method = get`):
//!   `/rabbitmq/{secret}/user`, `/vhost`, `/resource`, `/topic`, answering `allow` or `deny`.
//!   MQTT topics arrive as routing keys (`/` became `.`, `+` became `*`).
//! - EMQX 5 (HTTP authentication and HTTP authorization, POST with a JSON body):
//!   `/emqx/{secret}/authn` with `clientid`, `username`, `password`, and `/emqx/{secret}/authz`
//!   with `clientid`, `username`, `topic`, `action`; answering `{"result":"allow"|"deny"}`.
//!
//! The `{secret}` path segment is a shared secret only the broker knows (the callback
//! listener must never be reachable by devices); a request without it is refused with 403.
//! Decisions are made per request from the live credential table, so a deleted Proplet cannot
//! log in again, and when propeller is down the broker cannot reach this backend and refuses
//! new logins (existing sessions continue).

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use subtle::ConstantTimeEq;
use tracing::debug;

use crate::protocol::enrolment::{enrol_client_token_id, token_login_token_id};
use crate::server::{
    known_credential, login_shared_service, may_access_topic, Credential, CredentialSource, Role,
    TopicAccess,
};

/// Label set of one callback decision.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// `rabbitmq` or `emqx`.
    pub engine: &'static str,
    /// `user`, `vhost`, `resource`, `topic`, `authn`, `authz`.
    pub check: &'static str,
    /// `allow` or `deny`.
    pub result: &'static str,
}

/// What the callback handlers need.
#[derive(Clone)]
pub struct CallbackState {
    credentials: Arc<dyn CredentialSource>,
    secret: Arc<str>,
    decisions: Family<DecisionLabels, Counter>,
}

impl CallbackState {
    /// Callbacks deciding from `credentials`, reachable only with `secret` in the path.
    pub fn new(credentials: Arc<dyn CredentialSource>, secret: impl Into<Arc<str>>) -> Self {
        Self {
            credentials,
            secret: secret.into(),
            decisions: Family::default(),
        }
    }

    /// Registers `broker_callback_decisions` (per engine, check and result).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "broker_callback_decisions",
            "Decisions given to the external broker's authentication and authorization calls",
            self.decisions.clone(),
        );
    }

    fn knows(&self, secret: &str) -> bool {
        bool::from(secret.as_bytes().ct_eq(self.secret.as_bytes()))
    }

    fn count(&self, engine: &'static str, check: &'static str, allowed: bool) -> bool {
        let result = if allowed { "allow" } else { "deny" };
        self.decisions
            .get_or_create(&DecisionLabels {
                engine,
                check,
                result,
            })
            .inc();
        allowed
    }
}

/// The callback routes (see the module docs).
pub fn router(state: CallbackState) -> Router {
    Router::new()
        .route("/rabbitmq/{secret}/{check}", get(rabbitmq).post(rabbitmq))
        .route("/emqx/{secret}/authn", post(emqx_authn))
        .route("/emqx/{secret}/authz", post(emqx_authz))
        .with_state(state)
}

/// Serves the callbacks on `listener` until the task is dropped.
pub async fn serve(listener: tokio::net::TcpListener, state: CallbackState) -> std::io::Result<()> {
    axum::serve(listener, router(state)).await
}

fn forbidden() -> Response {
    (StatusCode::FORBIDDEN, "wrong callback secret\n").into_response()
}

/// RabbitMQ's four checks; every parameter arrives in the query string.
async fn rabbitmq(
    State(state): State<CallbackState>,
    Path((secret, check)): Path<(String, String)>,
    Query(params): Query<HashMap<String, String>>,
) -> Response {
    if !state.knows(&secret) {
        return forbidden();
    }
    let (check, allowed) = match check.as_str() {
        "user" => ("user", rabbitmq_user(&state, &params)),
        "vhost" => ("vhost", rabbitmq_known(&state, &params)),
        "resource" => ("resource", rabbitmq_resource(&state, &params)),
        "topic" => ("topic", rabbitmq_topic(&state, &params)),
        _ => return (StatusCode::NOT_FOUND, "unknown check\n").into_response(),
    };
    debug!(
        check,
        allowed,
        user = params.get("username").map(String::as_str),
        "rabbitmq callback"
    );
    let allowed = state.count("rabbitmq", check, allowed);
    (if allowed { "allow" } else { "deny" }).into_response()
}

fn param<'a>(params: &'a HashMap<String, String>, name: &str) -> &'a str {
    params.get(name).map(String::as_str).unwrap_or_default()
}

fn rabbitmq_user(state: &CallbackState, params: &HashMap<String, String>) -> bool {
    let username = param(params, "username");
    // RabbitMQ 3.10 sends the MQTT client id with the login; older versions do not.
    let client_id = params
        .get("client_id")
        .map(String::as_str)
        .unwrap_or(username);
    login_shared_service(
        state.credentials.as_ref(),
        client_id,
        username,
        param(params, "password"),
    )
    .is_ok()
}

fn rabbitmq_known(state: &CallbackState, params: &HashMap<String, String>) -> bool {
    known_credential(state.credentials.as_ref(), param(params, "username")).is_some()
}

/// Queues and exchanges: a device may use only its own subscription queues and the topic
/// exchange (what it may route there is decided per topic).
fn rabbitmq_resource(state: &CallbackState, params: &HashMap<String, String>) -> bool {
    let username = param(params, "username");
    let Some(credential) = known_credential(state.credentials.as_ref(), username) else {
        return false;
    };
    if credential.role() == Role::Service {
        return true;
    }
    let name = param(params, "name");
    match param(params, "resource") {
        "exchange" => name == "amq.topic",
        "queue" => name
            .strip_prefix("mqtt-subscription-")
            .and_then(|rest| {
                rest.strip_suffix("qos0")
                    .or_else(|| rest.strip_suffix("qos1"))
            })
            .is_some_and(|client_id| queue_owner_is(username, &credential, client_id)),
        _ => false,
    }
}

/// Whether the login `username` may use the subscription queue of `client_id`: a device its
/// own; an enrolment login (username `enrol-<token id>`) those of its token's client ids.
fn queue_owner_is(username: &str, credential: &Credential, client_id: &str) -> bool {
    match credential.role() {
        Role::Enrolee => {
            let token = enrol_client_token_id(client_id);
            token.is_some() && token_login_token_id(username) == token
        }
        _ => client_id == username,
    }
}

fn rabbitmq_topic(state: &CallbackState, params: &HashMap<String, String>) -> bool {
    let username = param(params, "username");
    let Some(credential) = known_credential(state.credentials.as_ref(), username) else {
        return false;
    };
    let access = match param(params, "permission") {
        "write" => TopicAccess::Publish,
        "read" => TopicAccess::Subscribe,
        _ => return false,
    };
    let topic = mqtt_topic_of_routing_key(param(params, "routing_key"));
    // An enrolment login's username names only its token; RabbitMQ's MQTT plugin adds the
    // client id, which binds the login to its own exchange.
    let login = match params.get("variable_map.client_id") {
        Some(client_id) if credential.role() == Role::Enrolee => client_id.as_str(),
        _ => username,
    };
    may_access_topic(login, &credential, access, &topic)
}

/// RabbitMQ's routing key back to the MQTT topic: `.` separates levels, `*` is `+`.
fn mqtt_topic_of_routing_key(key: &str) -> String {
    key.split('.')
        .map(|level| if level == "*" { "+" } else { level })
        .collect::<Vec<_>>()
        .join("/")
}

#[derive(Deserialize)]
struct EmqxAuthn {
    #[serde(default)]
    clientid: String,
    #[serde(default)]
    username: String,
    #[serde(default)]
    password: String,
}

#[derive(Deserialize)]
struct EmqxAuthz {
    #[serde(default)]
    clientid: String,
    #[serde(default)]
    username: String,
    #[serde(default)]
    topic: String,
    #[serde(default)]
    action: String,
}

async fn emqx_authn(
    State(state): State<CallbackState>,
    Path(secret): Path<String>,
    Json(request): Json<EmqxAuthn>,
) -> Response {
    if !state.knows(&secret) {
        return forbidden();
    }
    let outcome = login_shared_service(
        state.credentials.as_ref(),
        &request.clientid,
        &request.username,
        &request.password,
    );
    let allowed = state.count("emqx", "authn", outcome.is_ok());
    let superuser = matches!(&outcome, Ok(c) if c.role() == Role::Service);
    Json(serde_json::json!({
        "result": if allowed { "allow" } else { "deny" },
        "is_superuser": superuser,
    }))
    .into_response()
}

async fn emqx_authz(
    State(state): State<CallbackState>,
    Path(secret): Path<String>,
    Json(request): Json<EmqxAuthz>,
) -> Response {
    if !state.knows(&secret) {
        return forbidden();
    }
    // A device's identity is its client id (a username that differs was refused at login);
    // propeller's replicas share its service account under client ids of their own.
    let identity = match state.credentials.lookup(&request.username) {
        Some(service) if service.role() == Role::Service => Some(service),
        _ if request.username == request.clientid => {
            known_credential(state.credentials.as_ref(), &request.clientid)
        }
        // An enrolment login: its username names its token, its client id the exchange.
        _ if token_login_token_id(&request.username).is_some()
            && token_login_token_id(&request.username)
                == enrol_client_token_id(&request.clientid) =>
        {
            known_credential(state.credentials.as_ref(), &request.clientid)
        }
        _ => None,
    };
    let allowed = identity.is_some_and(|credential| {
        let access = match request.action.as_str() {
            "publish" => TopicAccess::Publish,
            "subscribe" => TopicAccess::Subscribe,
            _ => return false,
        };
        may_access_topic(&request.clientid, &credential, access, &request.topic)
    });
    let allowed = state.count("emqx", "authz", allowed);
    Json(serde_json::json!({ "result": if allowed { "allow" } else { "deny" } })).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::{ChannelScope, Credential, CredentialStore};

    fn state() -> CallbackState {
        let store = CredentialStore::new();
        store.insert(
            "dev1",
            Credential::proplet("k1").on_channel(ChannelScope {
                domain: Some("d".into()),
                channel: "c1".into(),
            }),
        );
        store.insert("propeller", Credential::new("svc", Role::Service));
        CallbackState::new(Arc::new(store), "s3cret")
    }

    fn params(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn rabbitmq_logins() {
        let s = state();
        let ok = params(&[
            ("username", "dev1"),
            ("password", "k1"),
            ("client_id", "dev1"),
        ]);
        assert!(rabbitmq_user(&s, &ok));
        let wrong_key = params(&[
            ("username", "dev1"),
            ("password", "k2"),
            ("client_id", "dev1"),
        ]);
        assert!(!rabbitmq_user(&s, &wrong_key));
        let other_client = params(&[("username", "dev1"), ("password", "k1"), ("client_id", "x")]);
        assert!(
            !rabbitmq_user(&s, &other_client),
            "username must be the client id"
        );
        let anonymous = params(&[("username", ""), ("password", ""), ("client_id", "dev1")]);
        assert!(!rabbitmq_user(&s, &anonymous));
    }

    #[test]
    fn rabbitmq_resources_are_the_devices_own_queues_and_the_topic_exchange() {
        let s = state();
        let check = |resource: &str, name: &str| {
            rabbitmq_resource(
                &s,
                &params(&[
                    ("username", "dev1"),
                    ("resource", resource),
                    ("name", name),
                    ("permission", "configure"),
                ]),
            )
        };
        assert!(check("queue", "mqtt-subscription-dev1qos1"));
        assert!(check("queue", "mqtt-subscription-dev1qos0"));
        assert!(!check("queue", "mqtt-subscription-propellerqos1"));
        assert!(check("exchange", "amq.topic"));
        assert!(!check("exchange", "amq.direct"));
    }

    #[test]
    fn rabbitmq_topics_follow_the_device_policy() {
        let s = state();
        let topic = |permission: &str, key: &str| {
            rabbitmq_topic(
                &s,
                &params(&[
                    ("username", "dev1"),
                    ("permission", permission),
                    ("routing_key", key),
                ]),
            )
        };
        assert!(topic("write", "m.d.c.c1.control.proplet.alive"));
        assert!(topic("write", "m.d.c.c1.registry.proplet"));
        assert!(!topic("write", "m.d.c.c1.control.manager.start"));
        assert!(!topic("write", "m.d.c.c2.control.proplet.alive"));
        assert!(topic("read", "m.d.c.c1.control.manager.start"));
        assert!(topic("read", "m.d.c.c1.registry.server"));
        assert!(!topic("read", "#"));
        assert!(!topic("read", "m.d.c.*.control.manager.start"));
        assert!(!topic("read", "m.d.c.c2.control.manager.start"));
        assert!(!topic("read", "m.d.c.c1.control.proplet.alive"));
    }

    #[test]
    fn routing_keys_become_topics() {
        assert_eq!(mqtt_topic_of_routing_key("m.d.c.*.x"), "m/d/c/+/x");
        assert_eq!(mqtt_topic_of_routing_key("#"), "#");
    }

    /// One HTTP/1.1 request to a served router; returns the status line and the body.
    async fn exchange(addr: std::net::SocketAddr, request: String) -> (String, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).await.unwrap();
        let status = reply.lines().next().unwrap_or_default().to_owned();
        let body = reply
            .split("\r\n\r\n")
            .nth(1)
            .unwrap_or_default()
            .to_owned();
        (status, body)
    }

    fn post(path: &str, json: &str) -> String {
        format!(
            "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{json}",
            json.len()
        )
    }

    /// A store with one bootstrap token `abcdef.0123456789abcdef`, usable over plain TCP.
    fn state_with_token() -> CallbackState {
        let store = CredentialStore::new();
        let token: crate::protocol::enrolment::BootstrapToken = "abcdef.0123456789abcdef"
            .parse()
            .unwrap_or_else(|e| panic!("{e}"));
        store.replace_tokens(HashMap::from([(
            "abcdef".to_owned(),
            crate::server::TokenCredential::new(token.secret_digest(), false),
        )]));
        CallbackState::new(Arc::new(store), "s3cret")
    }

    #[test]
    fn an_enrolment_login_may_use_its_own_enrolment_topics_only() {
        let s = state_with_token();
        let me = "enrol-abcdef-n0nce123";
        let user = "enrol-abcdef";
        let login = |username: &str, password: &str| {
            rabbitmq_user(
                &s,
                &params(&[
                    ("username", username),
                    ("password", password),
                    ("client_id", me),
                ]),
            )
        };
        assert!(login(user, "abcdef.0123456789abcdef"));
        assert!(!login(user, "abcdef.0123456789abcdee"), "a wrong secret");
        assert!(
            !login(me, "abcdef.0123456789abcdef"),
            "the username must be the token's login name"
        );
        assert!(rabbitmq_known(&s, &params(&[("username", user)])));
        assert!(!rabbitmq_known(
            &s,
            &params(&[("username", "enrol-zzzzzz")])
        ));
        let resource = |name: &str| {
            rabbitmq_resource(
                &s,
                &params(&[("username", user), ("resource", "queue"), ("name", name)]),
            )
        };
        assert!(resource(&format!("mqtt-subscription-{me}qos1")));
        assert!(!resource("mqtt-subscription-otherqos1"));
        assert!(!resource("mqtt-subscription-enrol-zzzzzz-n0nce123qos1"));
        let topic = |key: &str, permission: &str, client: Option<&str>| {
            let mut p = params(&[
                ("username", user),
                ("routing_key", key),
                ("permission", permission),
            ]);
            if let Some(client) = client {
                p.insert("variable_map.client_id".into(), client.into());
            }
            rabbitmq_topic(&s, &p)
        };
        for client in [Some(me), None] {
            assert!(topic(
                "propeller.enrol.abcdef.n0nce123.request",
                "write",
                client
            ));
            assert!(topic(
                "propeller.enrol.abcdef.n0nce123.reply",
                "read",
                client
            ));
            assert!(!topic(
                "propeller.enrol.abcdef.n0nce123.reply",
                "write",
                client
            ));
            assert!(!topic(
                "propeller.enrol.zzzzzz.n0nce123.reply",
                "read",
                client
            ));
            assert!(!topic("m.d.c.c1.control.proplet.alive", "write", client));
            assert!(!topic("#", "read", client));
        }
        assert!(
            !topic("propeller.enrol.abcdef.other123.reply", "read", Some(me)),
            "given the client id, another login's reply is refused"
        );
    }

    #[tokio::test]
    async fn emqx_requests_in_their_documented_format_get_allow_or_deny() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(serve(listener, state()));
        let authn = |json: &str| post("/emqx/s3cret/authn", json);
        let (status, body) = exchange(
            addr,
            authn(r#"{"clientid":"dev1","username":"dev1","password":"k1"}"#),
        )
        .await;
        assert!(status.contains("200"), "{status}");
        assert!(body.contains(r#""result":"allow""#), "{body}");
        assert!(body.contains(r#""is_superuser":false"#), "{body}");
        let (_, body) = exchange(
            addr,
            authn(r#"{"clientid":"dev1","username":"dev1","password":"bad"}"#),
        )
        .await;
        assert!(body.contains(r#""result":"deny""#), "{body}");
        let (_, body) = exchange(
            addr,
            authn(r#"{"clientid":"propeller","username":"propeller","password":"svc"}"#),
        )
        .await;
        assert!(body.contains(r#""is_superuser":true"#), "{body}");
        // A replica: propeller's account under a client id of its own (no device's).
        let (_, body) = exchange(
            addr,
            authn(r#"{"clientid":"propeller-r1","username":"propeller","password":"svc"}"#),
        )
        .await;
        assert!(body.contains(r#""result":"allow""#), "{body}");
        let (_, body) = exchange(
            addr,
            authn(r#"{"clientid":"dev1","username":"propeller","password":"svc"}"#),
        )
        .await;
        assert!(body.contains(r#""result":"deny""#), "{body}");
        let (_, body) = exchange(
            addr,
            post(
                "/emqx/s3cret/authz",
                r#"{"clientid":"propeller-r1","username":"propeller","topic":"m/d/c/c1/control/manager/start","action":"publish"}"#,
            ),
        )
        .await;
        assert!(body.contains(r#""result":"allow""#), "{body}");

        let authz = |topic: &str, action: &str| {
            post(
                "/emqx/s3cret/authz",
                &format!(
                    r#"{{"clientid":"dev1","username":"dev1","topic":"{topic}","action":"{action}"}}"#
                ),
            )
        };
        for (topic, action, expected) in [
            ("m/d/c/c1/control/proplet/alive", "publish", "allow"),
            ("m/d/c/c1/control/manager/start", "publish", "deny"),
            ("m/d/c/c1/control/manager/start", "subscribe", "allow"),
            ("m/d/c/c2/control/manager/start", "subscribe", "deny"),
            ("#", "subscribe", "deny"),
        ] {
            let (_, body) = exchange(addr, authz(topic, action)).await;
            assert!(
                body.contains(&format!(r#""result":"{expected}""#)),
                "{action} {topic}: {body}"
            );
        }
        // Without the secret nothing is decided.
        let (status, _) = exchange(
            addr,
            post(
                "/emqx/wrong/authn",
                r#"{"clientid":"dev1","username":"dev1","password":"k1"}"#,
            ),
        )
        .await;
        assert!(status.contains("403"), "{status}");
        let get = "GET /rabbitmq/wrong/user?username=dev1&password=k1 HTTP/1.1\r\nhost: x\r\n\
                   connection: close\r\n\r\n";
        let (status, _) = exchange(addr, get.to_owned()).await;
        assert!(status.contains("403"), "{status}");
        let get = "GET /rabbitmq/s3cret/user?username=dev1&password=k1&client_id=dev1 HTTP/1.1\r\n\
                   host: x\r\nconnection: close\r\n\r\n";
        let (status, body) = exchange(addr, get.to_owned()).await;
        assert!(status.contains("200"), "{status}");
        assert_eq!(body, "allow");
        server.abort();
    }
}
