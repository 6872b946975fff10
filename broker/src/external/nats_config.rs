//! The device policy as a NATS server `authorization` block, for brokers that cannot call
//! propeller back (NATS 2.9 has no auth callout): one user per client id, with the same
//! topics [`crate::server::may_access_topic`] allows, written as NATS subjects (`/` becomes
//! `.`, `+` becomes `*`).
//!
//! NATS reads the block at start and again on `nats-server --signal reload=<pid>` (SIGHUP);
//! propeller rewrites the file when the credential table changes and can run the reload.

use std::fmt::Write;

use crate::server::{ChannelScope, Credential, Role};

/// Renders `authorization { users: [...] }` for every credential.
pub fn render_authorization(entries: &[(String, Credential)]) -> String {
    let mut out = String::from("authorization {\n  users: [\n");
    for (client_id, credential) in entries {
        let user = quote(client_id);
        let password = quote(credential.secret());
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
    ]
    .iter()
    .map(|leaf| format!("{prefix}.control.proplet.{leaf}"))
    .collect();
    publish.push(format!("{prefix}.registry.proplet"));
    publish.push(format!("{prefix}.fl.rounds.*.updates.{client_id}"));
    publish.push(format!("fl.rounds.*.updates.{client_id}"));
    let mut subscribe: Vec<String> = ["start", "stop", "invoke"]
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
        let text = render_authorization(&[
            ("dev1".to_owned(), device),
            ("propeller".to_owned(), service),
        ]);
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
        let (publish, subscribe) = device_subjects("dev1", None);
        assert!(publish.iter().all(|s| !s.contains("manager")));
        assert!(subscribe.iter().all(|s| !s.contains("proplet.alive")));
        assert!(publish[0].starts_with("m.*.c.*."));
    }
}
