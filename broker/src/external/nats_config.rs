//! The device policy as a NATS server `authorization` block, for brokers that cannot call
//! propeller back (NATS 2.9 has no auth callout): one user per client id, with the same
//! topics [`crate::server::may_access_topic`] allows, written as NATS subjects (`/` becomes
//! `.`, `+` becomes `*`).
//!
//! Each bootstrap token that has a bcrypt hash becomes the user `enrol-<token id>` with that
//! hash as its password (NATS checks bcrypt itself, so the secret is never written), allowed
//! its token's enrolment subjects only. NATS does not lock a token after wrong secrets nor
//! know whether a login came over TLS; the secret's 82 bits bound guessing, and a token that
//! must not cross a plain link needs a NATS MQTT listener with TLS.
//!
//! NATS reads the block at start and again on `nats-server --signal reload=<pid>` (SIGHUP);
//! propeller rewrites the file when the credential table changes and can run the reload.

use std::fmt::Write;

use crate::protocol::enrolment::token_login_name;
use crate::server::{ChannelScope, Credential, Role, TokenCredential};

/// Renders `authorization { users: [...] }` at `now` for every credential (a rotated device
/// with its old key until the grace ends: [`Credential::single_key`]) and every token with a
/// bcrypt hash.
pub fn render_authorization(
    entries: &[(String, Credential)],
    tokens: &[(String, TokenCredential)],
    now: chrono::DateTime<chrono::Utc>,
) -> String {
    let mut out = String::from("authorization {\n  users: [\n");
    for (client_id, credential) in entries {
        let user = quote(client_id);
        let password = quote(credential.single_key(now));
        match credential.role() {
            Role::Service => {
                let _ = writeln!(out, "    {{ user: {user}, password: {password} }}");
            }
            // Enrolment logins are never in the credential table.
            Role::Enrolee => {}
            Role::Proplet => {
                let (publish, subscribe) = device_subjects(client_id, credential.scope());
                let _ = writeln!(
                    out,
                    "    {{ user: {user}, password: {password}, allowed_connection_types: [\"MQTT\"],\n      \
                     permissions: {{ publish: {{ allow: [{}] }}, subscribe: {{ allow: [{}] }} }} }}",
                    list(&publish),
                    list(&subscribe),
                );
            }
        }
    }
    for (id, token) in tokens {
        let Some(hash) = token.bcrypt() else {
            continue;
        };
        let _ = writeln!(
            out,
            "    {{ user: {}, password: {}, allowed_connection_types: [\"MQTT\"],\n      \
             permissions: {{ publish: {{ allow: [{}] }}, subscribe: {{ allow: [{}, \"$MQTT.sub.>\"] }} }} }}",
            quote(&token_login_name(id)),
            quote(hash),
            quote(&format!("propeller.enrol.{id}.*.request")),
            quote(&format!("propeller.enrol.{id}.*.reply")),
        );
    }
    out.push_str("  ]\n}\n");
    out
}

/// Subjects a device may publish to and subscribe to.
fn device_subjects(client_id: &str, scope: Option<&ChannelScope>) -> (Vec<String>, Vec<String>) {
    let prefix = match scope {
        Some(scope) => format!(
            "m.{}.c.{}",
            scope.domain.as_deref().unwrap_or("*"),
            scope.channel
        ),
        None => "m.*.c.*".to_owned(),
    };
    let mut publish: Vec<String> = [
        "create",
        "alive",
        "metrics",
        "task_metrics",
        "results",
        "invoke_results",
        "upgrade",
        "logs",
    ]
    .iter()
    .map(|leaf| format!("{prefix}.control.proplet.{leaf}"))
    .collect();
    publish.push(format!("{prefix}.registry.proplet"));
    publish.push(format!("{prefix}.fl.rounds.*.updates.{client_id}"));
    publish.push(format!("fl.rounds.*.updates.{client_id}"));
    let mut subscribe: Vec<String> = ["start", "stop", "invoke", "upgrade"]
        .iter()
        .map(|leaf| format!("{prefix}.control.manager.{leaf}"))
        .collect();
    subscribe.push(format!("{prefix}.registry.server"));
    subscribe.push(format!("{prefix}.fl.rounds.start"));
    // Its own rotated keys (`propeller rotate`).
    subscribe.push(format!("propeller.keys.{client_id}"));
    // NATS delivers a QoS 1 subscription through a JetStream consumer on this subject.
    subscribe.push("$MQTT.sub.>".to_owned());
    (publish, subscribe)
}

fn list(subjects: &[String]) -> String {
    subjects
        .iter()
        .map(|s| quote(s))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A NATS config string literal (JSON string escaping is valid there).
fn quote(text: &str) -> String {
    serde_json::Value::String(text.to_owned()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_get_their_channels_subjects_and_services_everything() {
        let device = Credential::proplet("k\"1").on_channel(ChannelScope {
            domain: Some("d".into()),
            channel: "c1".into(),
        });
        let service = Credential::new("s", Role::Service);
        let tokens = [
            (
                "abcdef".to_owned(),
                TokenCredential::new("digest", true).with_bcrypt(Some("$2b$06$hash".into())),
            ),
            ("nohash".to_owned(), TokenCredential::new("digest", true)),
        ];
        let text = render_authorization(
            &[
                ("dev1".to_owned(), device),
                ("propeller".to_owned(), service),
            ],
            &tokens,
            chrono::Utc::now(),
        );
        assert!(
            text.contains(r#"{ user: "enrol-abcdef", password: "$2b$06$hash""#),
            "{text}"
        );
        assert!(
            text.contains(r#"publish: { allow: ["propeller.enrol.abcdef.*.request"] }"#),
            "{text}"
        );
        assert!(
            text.contains(
                r#"subscribe: { allow: ["propeller.enrol.abcdef.*.reply", "$MQTT.sub.>"] }"#
            ),
            "{text}"
        );
        assert!(
            !text.contains("digest"),
            "only the bcrypt hash is written: {text}"
        );
        assert!(!text.contains("nohash"), "{text}");
        assert!(text.contains(r#"user: "dev1", password: "k\"1""#), "{text}");
        assert!(
            text.contains(r#""m.d.c.c1.control.proplet.alive""#),
            "{text}"
        );
        assert!(
            text.contains(r#""m.d.c.c1.control.manager.start""#),
            "{text}"
        );
        assert!(text.contains(r#""fl.rounds.*.updates.dev1""#), "{text}");
        assert!(
            text.contains(r#"{ user: "propeller", password: "s" }"#),
            "{text}"
        );
        let now = chrono::Utc::now();
        let rotated =
            Credential::proplet("new").with_previous("old", now + chrono::Duration::minutes(5));
        let during = render_authorization(&[("dev2".to_owned(), rotated.clone())], &[], now);
        assert!(during.contains(r#"password: "old""#), "{during}");
        let after = render_authorization(
            &[("dev2".to_owned(), rotated)],
            &[],
            now + chrono::Duration::minutes(6),
        );
        assert!(after.contains(r#"password: "new""#), "{after}");
        let (publish, subscribe) = device_subjects("dev1", None);
        assert!(publish.iter().all(|s| !s.contains("manager")));
        assert!(subscribe.iter().all(|s| !s.contains("proplet.alive")));
        assert!(publish[0].starts_with("m.*.c.*."));
    }
}
