//! `propeller broker` as a real process, driven by Debian's mosquitto clients.

mod support;

use support::{binary, mosquitto_pub, WAIT};

#[test]
fn broker_command_authenticates_logs_events_and_reloads_credentials() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (broker, port) =
        support::start_broker(dir.path(), "[[client]]\nid = \"pi-1\"\nkey = \"s3cret\"\n");
    let creds = dir.path().join("credentials.toml");

    let topic = "m/d1/c/c1/control/proplet/alive";
    assert!(mosquitto_pub(
        &port,
        "pi-1",
        "s3cret",
        topic,
        r#"{"status":"alive","proplet_id":"pi-1"}"#
    ));
    let logged = broker.stderr_line("heartbeat");
    assert!(logged.contains("pi-1"), "{logged}");
    assert!(
        !logged.contains("s3cret"),
        "secret leaked into logs: {logged}"
    );

    // Unknown client refused, and the refusal is logged without the password.
    assert!(!mosquitto_pub(&port, "pi-2", "other-key", topic, "{}"));
    let refused = broker.stderr_line("login refused");
    assert!(
        refused.contains("pi-2") && !refused.contains("other-key"),
        "{refused}"
    );

    // Adding the client to the file lets it in without a restart.
    std::fs::write(
        &creds,
        "[[client]]\nid = \"pi-1\"\nkey = \"s3cret\"\n[[client]]\nid = \"pi-2\"\nkey = \"other-key\"\n",
    )
    .expect("rewrite");
    broker.stderr_line("credentials reloaded");
    let deadline = std::time::Instant::now() + WAIT;
    while !mosquitto_pub(
        &port,
        "pi-2",
        "other-key",
        topic,
        r#"{"status":"alive","proplet_id":"pi-2"}"#,
    ) {
        assert!(std::time::Instant::now() < deadline, "pi-2 never admitted");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

#[test]
fn broker_command_reports_a_bad_credentials_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    let creds = dir.path().join("credentials.toml");
    std::fs::write(&creds, "[[client]]\nid = \"pi-1\"\n").expect("write");
    let out = binary("propeller")
        .args(["broker", "--mqtt-listen", "127.0.0.1:0", "--credentials"])
        .arg(&creds)
        .output()
        .expect("run propeller broker");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("credentials.toml") && stderr.contains("key"),
        "{stderr}"
    );
}
