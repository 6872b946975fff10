//! Cross-module tests: the example payloads upstream documents, encoder output checked key by
//! key, error reporting, round trips and property tests.
//!
//! Payloads marked "verbatim" are copied unchanged from the messages upstream's proplet and Go
//! operator document. Where such an example elides a value (`…` inside base64, `<base64>`),
//! the verbatim text is shown to fail on exactly that key, and a completed copy is decoded.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use super::*;

fn dec(kind: TopicKind, payload: &str) -> Inbound {
    match decode(&kind, payload.as_bytes()) {
        Ok(m) => m,
        Err(e) => panic!("{kind:?} payload failed to decode: {e}\n{payload}"),
    }
}

fn dec_err(kind: TopicKind, payload: &str) -> DecodeError {
    match decode(&kind, payload.as_bytes()) {
        Ok(m) => panic!("{kind:?} payload unexpectedly decoded: {m:?}"),
        Err(e) => e,
    }
}

fn json_of(bytes: &[u8]) -> Map<String, Value> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(m)) => m,
        other => panic!("encoder did not produce an object: {other:?}"),
    }
}

fn seg(s: &str) -> TopicSegment {
    match TopicSegment::new(s, "test") {
        Ok(x) => x,
        Err(e) => panic!("{e}"),
    }
}

fn s(x: &str) -> String {
    x.to_owned()
}

// ---------------------------------------------------------------- upstream proplet's messages

#[test]
fn proplet_3_1_discovery_verbatim() {
    let payload = r#"{"proplet_id":"3f1c…","namespace":"default","metadata":{"tags":["gpu"],"ip":"10.0.0.7","environment":"docker","os":"linux","hostname":"edge1","cpu_arch":"x86_64","total_memory_bytes":16660000000,"proplet_version":"0.5.0","wasm_runtime":"wasmtime"}}"#;
    let expected = Discovery {
        proplet_id: s("3f1c…"),
        namespace: Some(s("default")),
        metadata: Some(PropletMetadata {
            description: None,
            tags: vec![s("gpu")],
            location: None,
            ip: Some(s("10.0.0.7")),
            environment: Some(s("docker")),
            os: Some(s("linux")),
            hostname: Some(s("edge1")),
            cpu_arch: Some(s("x86_64")),
            total_memory_bytes: Some(16_660_000_000),
            proplet_version: Some(s("0.5.0")),
            wasm_runtime: Some(s("wasmtime")),
            attester: None,
        }),
    };
    assert_eq!(
        dec(TopicKind::Discovery, payload),
        Inbound::Discovery(expected)
    );
}

#[test]
fn embedded_discovery_has_only_the_id() {
    // Shape built by the embedded agent: {"proplet_id":"%s"}.
    assert_eq!(
        dec(TopicKind::Discovery, r#"{"proplet_id":"esp-1"}"#),
        Inbound::Discovery(Discovery {
            proplet_id: s("esp-1"),
            namespace: None,
            metadata: None,
        })
    );
}

// ---------------------------------------------------------------- §3.2 and Last Wills

#[test]
fn proplet_3_2_heartbeat_verbatim() {
    let payload = r#"{"proplet_id":"3f1c…","status":"alive","namespace":"default"}"#;
    assert_eq!(
        dec(TopicKind::Alive, payload),
        Inbound::Heartbeat(Heartbeat {
            proplet_id: s("3f1c…"),
            namespace: Some(s("default")),
            metadata: None,
            metrics: None,
        })
    );
}

#[test]
fn last_wills_are_offline_notices_not_heartbeats() {
    // Embedded agent's will (template from §8.1 / the C source).
    let embedded = r#"{"status":"offline","proplet_id":"esp-1","namespace":"embedded"}"#;
    assert_eq!(
        dec(TopicKind::Alive, embedded),
        Inbound::Offline(OfflineNotice {
            proplet_id: s("esp-1"),
            namespace: Some(s("embedded")),
        })
    );
    // Go operator's will (upstream's Go operator) carries channel_id, which is ignored.
    let operator = r#"{"status":"offline","proplet_id":"operator-1","channel_id":"ch"}"#;
    assert!(matches!(
        dec(TopicKind::Alive, operator),
        Inbound::Offline(OfflineNotice { ref proplet_id, namespace: None }) if proplet_id == "operator-1"
    ));
    // Unknown status values are refused, naming the key.
    assert_eq!(
        dec_err(
            TopicKind::Alive,
            r#"{"status":"sleeping","proplet_id":"p"}"#
        )
        .key(),
        Some("status")
    );
}

#[test]
fn heartbeat_with_our_optional_keys() {
    let payload = r#"{"proplet_id":"p1","status":"alive","namespace":"default","metadata":{"os":"linux","tags":["a","b"]},"metrics":{"cpu_percent":12.5,"memory_bytes":1048576,"memory_percent":3.25}}"#;
    let Inbound::Heartbeat(h) = dec(TopicKind::Alive, payload) else {
        panic!("not a heartbeat");
    };
    assert_eq!(
        h.metadata.as_ref().and_then(|m| m.os.as_deref()),
        Some("linux")
    );
    assert_eq!(
        h.metadata.as_ref().map(|m| m.tags.clone()),
        Some(vec![s("a"), s("b")])
    );
    assert_eq!(
        h.metrics,
        Some(HeartbeatMetrics {
            cpu_percent: Some(12.5),
            memory_bytes: Some(1_048_576),
            memory_percent: Some(3.25),
        })
    );
}

#[test]
fn operator_3_3_1_heartbeat_verbatim() {
    let payload = r#"{"proplet_id":"6a1f0c2e-proplet","status":"alive","namespace":"default"}"#;
    assert!(matches!(
        dec(TopicKind::Alive, payload),
        Inbound::Heartbeat(Heartbeat { ref proplet_id, .. }) if proplet_id == "6a1f0c2e-proplet"
    ));
}

// ---------------------------------------------------------------- §3.3 proplet metrics

#[test]
fn rust_proplet_metrics_verbatim_from_operator_3_3_2() {
    let payload = r#"{"proplet_id":"6a1f…","namespace":"default","timestamp":{"secs_since_epoch":1785400000,"nanos_since_epoch":0},"cpu_metrics":{"user_seconds":1.2,"system_seconds":0.4,"percent":12.5},"memory_metrics":{"rss_bytes":52428800,"heap_alloc_bytes":0,"heap_sys_bytes":0,"heap_inuse_bytes":0}}"#;
    let expected = PropletMetrics {
        proplet_id: s("6a1f…"),
        namespace: Some(s("default")),
        timestamp: Some(Timestamp::SystemTime {
            secs_since_epoch: 1_785_400_000,
            nanos_since_epoch: 0,
        }),
        cpu_metrics: Some(CpuMetrics {
            user_seconds: Some(1.2),
            system_seconds: Some(0.4),
            percent: Some(12.5),
        }),
        memory_metrics: Some(MemoryMetrics {
            rss_bytes: Some(52_428_800),
            heap_alloc_bytes: Some(0),
            heap_sys_bytes: Some(0),
            heap_inuse_bytes: Some(0),
            ..MemoryMetrics::default()
        }),
    };
    assert_eq!(
        dec(TopicKind::PropletMetrics, payload),
        Inbound::PropletMetrics(expected)
    );
}

#[test]
fn rust_proplet_metrics_with_cgroup_keys() {
    // §3.3 table: container usage is present, the limit only when set.
    let payload = r#"{"proplet_id":"p","namespace":"default","timestamp":{"secs_since_epoch":1785400000,"nanos_since_epoch":123},"cpu_metrics":{"user_seconds":0.5,"system_seconds":0.1,"percent":3.0},"memory_metrics":{"rss_bytes":1000,"heap_alloc_bytes":0,"heap_sys_bytes":0,"heap_inuse_bytes":0,"container_usage_bytes":2000,"container_limit_bytes":4000}}"#;
    let Inbound::PropletMetrics(m) = dec(TopicKind::PropletMetrics, payload) else {
        panic!("not proplet metrics");
    };
    let mem = m.memory_metrics.unwrap_or_default();
    assert_eq!(mem.container_usage_bytes, Some(2000));
    assert_eq!(mem.container_limit_bytes, Some(4000));
    assert_eq!(
        m.timestamp.and_then(|t| t.to_utc()).map(|t| t.timestamp()),
        Some(1_785_400_000)
    );
}

#[test]
fn embedded_proplet_metrics_with_uptime_number_timestamp() {
    // Shape built by the embedded agent (§3.3 "Embedded version"): cJSON numbers, timestamp in
    // ms since boot, heap keys including the two embedded-only ones.
    let payload = r#"{"proplet_id":"esp-1","namespace":"embedded","timestamp":123456,"cpu_metrics":{"user_seconds":0,"system_seconds":0,"percent":0},"memory_metrics":{"rss_bytes":0,"heap_alloc_bytes":2048,"heap_sys_bytes":10240,"heap_inuse_bytes":2048,"heap_free_bytes":8192,"heap_max_alloc_bytes":4096}}"#;
    let Inbound::PropletMetrics(m) = dec(TopicKind::PropletMetrics, payload) else {
        panic!("not proplet metrics");
    };
    assert_eq!(m.timestamp, Some(Timestamp::Number(123_456.0)));
    assert_eq!(m.timestamp.as_ref().and_then(Timestamp::to_utc), None);
    assert_eq!(
        m.memory_metrics,
        Some(MemoryMetrics {
            rss_bytes: Some(0),
            heap_alloc_bytes: Some(2048),
            heap_sys_bytes: Some(10240),
            heap_inuse_bytes: Some(2048),
            heap_free_bytes: Some(8192),
            heap_max_alloc_bytes: Some(4096),
            ..MemoryMetrics::default()
        })
    );
    assert_eq!(
        m.cpu_metrics.and_then(|c| c.percent),
        Some(0.0),
        "integer zero reads as a number"
    );
}

#[test]
fn go_style_metrics_with_rfc3339_timestamp() {
    let payload = r#"{"proplet_id":"p","timestamp":"2026-08-20T10:00:00.123456789Z","cpu_metrics":{"percent":1.5},"memory_metrics":{"rss_bytes":10,"percent":2.5}}"#;
    let Inbound::PropletMetrics(m) = dec(TopicKind::PropletMetrics, payload) else {
        panic!("not proplet metrics");
    };
    let at = m.timestamp.as_ref().and_then(Timestamp::to_utc);
    assert_eq!(
        at.map(|t| (t.timestamp(), t.timestamp_subsec_nanos())),
        Some((1_787_220_000, 123_456_789))
    );
    assert_eq!(m.memory_metrics.and_then(|x| x.percent), Some(2.5));
}

// ---------------------------------------------------------------- §3.4 task metrics

#[test]
fn proplet_3_4_task_metrics_with_placeholders_filled() {
    // The spec's example elides numbers with `…`, which is not JSON: verbatim it is refused...
    let verbatim = r#"{"task_id":"…","proplet_id":"…","metrics":{"cpu_percent":3.1,"memory_bytes":…,"memory_percent":0.0,"disk_read_bytes":…,"disk_write_bytes":…,"uptime_seconds":12,"thread_count":17,"file_descriptor_count":40},"aggregated":{"avg_cpu_usage":…,"max_cpu_usage":…,"avg_memory_usage":…,"max_memory_usage":…,"total_disk_read":…,"total_disk_write":…,"sample_count":3},"timestamp":{"secs_since_epoch":…,"nanos_since_epoch":…}}"#;
    assert!(matches!(
        dec_err(TopicKind::TaskMetrics, verbatim),
        DecodeError::NotJson { .. }
    ));
    // ...and with the elisions filled in it decodes to the right values.
    let filled = r#"{"task_id":"t1","proplet_id":"p1","metrics":{"cpu_percent":3.1,"memory_bytes":52428800,"memory_percent":0.0,"disk_read_bytes":4096,"disk_write_bytes":8192,"uptime_seconds":12,"thread_count":17,"file_descriptor_count":40},"aggregated":{"avg_cpu_usage":2.5,"max_cpu_usage":3.1,"avg_memory_usage":51200000.5,"max_memory_usage":52428800,"total_disk_read":4096,"total_disk_write":8192,"sample_count":3},"timestamp":{"secs_since_epoch":1785400000,"nanos_since_epoch":5}}"#;
    let expected = TaskMetrics {
        task_id: s("t1"),
        proplet_id: Some(s("p1")),
        metrics: ProcessMetrics {
            cpu_percent: Some(3.1),
            memory_bytes: Some(52_428_800),
            memory_percent: Some(0.0),
            disk_read_bytes: Some(4096),
            disk_write_bytes: Some(8192),
            uptime_seconds: Some(12),
            thread_count: Some(17),
            file_descriptor_count: Some(40),
            fuel_used: None,
        },
        aggregated: Some(AggregatedMetrics {
            avg_cpu_usage: Some(2.5),
            max_cpu_usage: Some(3.1),
            avg_memory_usage: Some(51_200_000.5),
            max_memory_usage: Some(52_428_800.0),
            total_disk_read: Some(4096),
            total_disk_write: Some(8192),
            sample_count: Some(3),
        }),
        timestamp: Some(Timestamp::SystemTime {
            secs_since_epoch: 1_785_400_000,
            nanos_since_epoch: 5,
        }),
    };
    assert_eq!(
        dec(TopicKind::TaskMetrics, filled),
        Inbound::TaskMetrics(expected)
    );
}

#[test]
fn operator_3_3_5_task_metrics_verbatim_and_null_aggregated() {
    let payload = r#"{"task_id":"0b6b…","proplet_id":"6a1f…","metrics":{"cpu_percent":3.5,"memory_bytes":1048576,"memory_percent":0.8}}"#;
    assert_eq!(
        dec(TopicKind::TaskMetrics, payload),
        Inbound::TaskMetrics(TaskMetrics {
            task_id: s("0b6b…"),
            proplet_id: Some(s("6a1f…")),
            metrics: ProcessMetrics {
                cpu_percent: Some(3.5),
                memory_bytes: Some(1_048_576),
                memory_percent: Some(0.8),
                ..ProcessMetrics::default()
            },
            aggregated: None,
            timestamp: None,
        })
    );
    let with_null = r#"{"task_id":"t","metrics":{},"aggregated":null}"#;
    assert!(matches!(
        dec(TopicKind::TaskMetrics, with_null),
        Inbound::TaskMetrics(TaskMetrics {
            aggregated: None,
            ..
        })
    ));
    assert_eq!(
        dec_err(TopicKind::TaskMetrics, r#"{"task_id":"t"}"#),
        DecodeError::MissingKey { key: s("metrics") }
    );
}

// ---------------------------------------------------------------- §3.5 start

const ADD_WASM_B64: &str = "AGFzbQEAAAABBwFgAn9/AX8DAgEABwgBBG1haW4AAAoJAQcAIAAgAWoL";

fn wasm_bytes() -> Vec<u8> {
    match fields::b64_decode(ADD_WASM_B64) {
        Ok(b) => b,
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn proplet_3_5_start_verbatim_fails_only_on_the_elided_file() {
    let verbatim = r#"{"id":"9b2e…","name":"add","state":0,"file":"AGFzbQEAAAAB…","inputs":["10","20"],"cli_args":null,"broadcast":false,"daemon":false,"latent":false,"encrypted":false,"proplet_id":"3f1c…"}"#;
    assert_eq!(
        dec_err(TopicKind::Start, verbatim).key(),
        Some("file"),
        "the `…` inside the base64 is the only problem"
    );
    let completed = verbatim.replace("AGFzbQEAAAAB…", "AGFzbQEAAAAB");
    let expected = StartRequest {
        id: s("9b2e…"),
        name: s("add"),
        state: 0,
        file: Some(b"\0asm\x01\0\0\0\x01".to_vec()),
        inputs: vec![s("10"), s("20")],
        cli_args: vec![],
        proplet_id: Some(s("3f1c…")),
        ..StartRequest::default()
    };
    assert_eq!(
        dec(TopicKind::Start, &completed),
        Inbound::Start(Box::new(expected))
    );
}

#[test]
fn operator_3_4_1_targeted_start_verbatim() {
    let payload = r#"{"broadcast":false,"cli_args":null,"daemon":false,"encrypted":false,"env":{"PROPLET_ID":"6a1f…","TASK_ID":"0b6b…"},"file":"AGFzbQEAAAABBwFgAn9/AX8DAgEABwgBBG1haW4AAAoJAQcAIAAgAWoL","id":"0b6b…","image_url":"","inputs":["10","32"],"kbs_resource_path":"","kind":"standard","mode":"","name":"main","priority":50,"proplet_id":"6a1f…","state":1}"#;
    let expected = StartRequest {
        id: s("0b6b…"),
        name: s("main"),
        state: 1,
        image_url: Some(String::new()),
        file: Some(wasm_bytes()),
        inputs: vec![s("10"), s("32")],
        env: BTreeMap::from([(s("PROPLET_ID"), s("6a1f…")), (s("TASK_ID"), s("0b6b…"))]),
        kbs_resource_path: Some(String::new()),
        proplet_id: Some(s("6a1f…")),
        mode: Some(String::new()),
        kind: Some(s("standard")),
        priority: Some(50),
        ..StartRequest::default()
    };
    let Inbound::Start(got) = dec(TopicKind::Start, payload) else {
        panic!("not a start");
    };
    assert_eq!(*got, expected);
    assert!(got.is_for("6a1f…"));
    assert!(!got.is_for("other"));
    assert_eq!(got.image_ref(), None, "empty image_url means none");
    assert_eq!(got.inline_binary().map(<[u8]>::len), Some(42));
}

#[test]
fn operator_3_4_2_broadcast_start() {
    let verbatim = r#"{"broadcast":true,"cli_args":null,"daemon":false,"encrypted":false,"env":null,"file":"AGFz…","id":"0b6b…","image_url":"","inputs":["10","32"],"kbs_resource_path":"","kind":"standard","name":"main","priority":50,"state":1}"#;
    assert_eq!(dec_err(TopicKind::Start, verbatim).key(), Some("file"));
    let completed = verbatim.replace("AGFz…", ADD_WASM_B64);
    let Inbound::Start(got) = dec(TopicKind::Start, &completed) else {
        panic!("not a start");
    };
    assert!(got.broadcast);
    assert_eq!(got.proplet_id, None);
    assert_eq!(got.mode, None);
    assert!(got.env.is_empty(), "env:null decodes as empty");
    assert_eq!(got.inputs, vec![s("10"), s("32")]);
    assert!(got.is_for("anyone"));
}

#[test]
fn start_inputs_accept_numbers_and_keep_strings() {
    // The README-style payload the upstream Rust agent rejects.
    let payload = r#"{"id":"t","name":"add","file":"AGFzbQ==","inputs":[10,20,2.5,"x",-3]}"#;
    let Inbound::Start(got) = dec(TopicKind::Start, payload) else {
        panic!("not a start");
    };
    assert_eq!(
        got.inputs,
        vec![s("10"), s("20"), s("2.5"), s("x"), s("-3")]
    );
}

#[test]
fn monitoring_profile_decoding_is_tolerant() {
    // The Go manager's nanoseconds, a partial object and duration text all decode.
    let go =
        r#"{"id":"t","name":"n","monitoring_profile":{"enabled":true,"interval":10000000000}}"#;
    let Inbound::Start(got) = dec(TopicKind::Start, go) else {
        panic!("not a start");
    };
    assert_eq!(got.monitoring_profile, Some(MonitoringProfile::standard()));

    let text = r#"{"id":"t","name":"n","monitoring_profile":{"interval":"1m","export_to_mqtt":false,"history_size":7}}"#;
    let Inbound::Start(got) = dec(TopicKind::Start, text) else {
        panic!("not a start");
    };
    assert_eq!(
        got.monitoring_profile,
        Some(MonitoringProfile {
            interval_secs: 60,
            export_to_mqtt: false,
            history_size: 7,
            ..MonitoringProfile::standard()
        })
    );

    // The operator's broadcast path omits interval entirely.
    let no_interval = r#"{"id":"t","name":"n","monitoring_profile":{"enabled":false}}"#;
    let Inbound::Start(got) = dec(TopicKind::Start, no_interval) else {
        panic!("not a start");
    };
    assert_eq!(got.monitoring_profile.map(|p| p.interval_secs), Some(10));

    let bad = r#"{"id":"t","name":"n","monitoring_profile":{"interval":"soon"}}"#;
    assert_eq!(
        dec_err(TopicKind::Start, bad).key(),
        Some("monitoring_profile.interval")
    );
}

#[test]
fn start_encoder_output_key_by_key() {
    let req = StartRequest {
        id: s("task-1"),
        name: s("main"),
        state: 1,
        file: Some(wasm_bytes()),
        inputs: vec![s("10"), s("32")],
        env: BTreeMap::from([(s("K"), s("V"))]),
        monitoring_profile: Some(MonitoringProfile {
            interval_secs: 15,
            ..MonitoringProfile::standard()
        }),
        proplet_id: Some(s("edge-1")),
        priority: Some(50),
        ..StartRequest::default()
    };
    let m = json_of(&req.encode());
    assert_eq!(m.get("id"), Some(&json!("task-1")));
    assert_eq!(m.get("name"), Some(&json!("main")));
    assert_eq!(m.get("state"), Some(&json!(1)));
    assert_eq!(m.get("file"), Some(&json!(ADD_WASM_B64)));
    assert_eq!(m.get("inputs"), Some(&json!(["10", "32"])));
    assert_eq!(m.get("cli_args"), Some(&json!([])));
    assert_eq!(m.get("broadcast"), Some(&json!(false)));
    assert_eq!(m.get("daemon"), Some(&json!(false)));
    assert_eq!(m.get("latent"), Some(&json!(false)));
    assert_eq!(m.get("encrypted"), Some(&json!(false)));
    assert_eq!(m.get("env"), Some(&json!({"K": "V"})));
    assert_eq!(m.get("proplet_id"), Some(&json!("edge-1")));
    assert_eq!(m.get("priority"), Some(&json!(50)));
    assert_eq!(
        m.get("monitoring_profile"),
        Some(&json!({
            "enabled": true,
            "interval": 15,
            "collect_cpu": true,
            "collect_memory": true,
            "collect_disk_io": true,
            "collect_threads": true,
            "collect_file_descriptors": true,
            "export_to_mqtt": true,
            "retain_history": true,
            "history_size": 100
        }))
    );
    assert!(
        m.get("monitoring_profile")
            .and_then(|p| p.get("interval"))
            .is_some_and(Value::is_u64),
        "interval is an integer, not a float or a string"
    );
    for absent in [
        "image_url",
        "kbs_resource_path",
        "hal_storage_path",
        "mode",
        "kind",
        "metadata",
        "parent_results",
    ] {
        assert!(!m.contains_key(absent), "{absent} should be omitted");
    }
    assert_eq!(m.len(), 14);
}

#[test]
fn broadcast_start_never_carries_a_proplet_id() {
    let req = StartRequest {
        id: s("t"),
        name: s("main"),
        broadcast: true,
        proplet_id: Some(s("leftover")),
        ..StartRequest::default()
    };
    let m = json_of(&req.encode());
    assert_eq!(m.get("broadcast"), Some(&json!(true)));
    assert!(!m.contains_key("proplet_id"));
    assert!(!m.contains_key("inputs"), "empty inputs are omitted");
    assert!(!m.contains_key("env"), "empty env is omitted");
}

// ---------------------------------------------------------------- §3.6 stop

#[test]
fn operator_3_4_3_stop_verbatim() {
    let payload = r#"{"broadcast":false,"id":"0b6b…","proplet_id":"6a1f…"}"#;
    assert_eq!(
        dec(TopicKind::Stop, payload),
        Inbound::Stop(StopRequest {
            id: s("0b6b…"),
            proplet_id: Some(s("6a1f…")),
            broadcast: false,
            name: String::new(),
            state: String::new(),
        })
    );
    // Shutdown/recovery form: only id and proplet_id.
    assert!(matches!(
        dec(TopicKind::Stop, r#"{"id":"t","proplet_id":"p"}"#),
        Inbound::Stop(StopRequest {
            broadcast: false,
            ..
        })
    ));
}

#[test]
fn embedded_stop_shape_decodes() {
    // The embedded agent requires id, name and state as strings (§3.6).
    let payload = r#"{"id":"t1","name":"main","state":"stopped"}"#;
    assert_eq!(
        dec(TopicKind::Stop, payload),
        Inbound::Stop(StopRequest {
            id: s("t1"),
            proplet_id: None,
            broadcast: false,
            name: s("main"),
            state: s("stopped"),
        })
    );
}

#[test]
fn stop_encoder_output_key_by_key() {
    let targeted = json_of(&StopRequest::new("t1", "main", Some(s("edge-1"))).encode());
    assert_eq!(
        Value::Object(targeted),
        json!({"id":"t1","broadcast":false,"proplet_id":"edge-1","name":"main","state":"stopped"})
    );
    let broadcast = json_of(&StopRequest::new("t1", "main", None).encode());
    assert_eq!(
        Value::Object(broadcast.clone()),
        json!({"id":"t1","broadcast":true,"name":"main","state":"stopped"})
    );
    assert!(broadcast.get("name").is_some_and(Value::is_string));
    assert!(broadcast.get("state").is_some_and(Value::is_string));
}

// ---------------------------------------------------------------- §3.7 invoke

#[test]
fn proplet_3_7_invoke_and_invoke_result_verbatim() {
    let invoke = r#"{"id":"9b2e…","broadcast":false,"proplet_id":"3f1c…","invocation_id":"5d7a…","inputs":["3"],"env":{"K":"V"}}"#;
    assert_eq!(
        dec(TopicKind::Invoke, invoke),
        Inbound::Invoke(InvokeRequest {
            id: s("9b2e…"),
            broadcast: false,
            proplet_id: Some(s("3f1c…")),
            invocation_id: Some(s("5d7a…")),
            inputs: vec![s("3")],
            env: BTreeMap::from([(s("K"), s("V"))]),
        })
    );
    let result = r#"{"task_id":"9b2e…","invocation_id":"5d7a…","proplet_id":"3f1c…","results":"…","error":null}"#;
    assert_eq!(
        dec(TopicKind::InvokeResults, result),
        Inbound::InvokeResult(InvokeResult {
            task_id: s("9b2e…"),
            invocation_id: s("5d7a…"),
            proplet_id: Some(s("3f1c…")),
            results: ResultValue::Text(s("…")),
            error: None,
        })
    );
    // Only `id` is required.
    assert!(matches!(
        dec(TopicKind::Invoke, r#"{"id":"x"}"#),
        Inbound::Invoke(InvokeRequest { ref invocation_id, .. }) if invocation_id.is_none()
    ));
}

// ---------------------------------------------------------------- §3.8 results

#[test]
fn proplet_3_8_normal_result_verbatim() {
    let payload = r#"{"task_id":"9b2e…","proplet_id":"3f1c…","results":"30","error":null}"#;
    let Inbound::Result(r) = dec(TopicKind::Results, payload) else {
        panic!("not a result");
    };
    assert_eq!(
        r,
        TaskResult {
            task_id: s("9b2e…"),
            proplet_id: Some(s("3f1c…")),
            results: ResultValue::Text(s("30")),
            error: None,
        }
    );
    assert_eq!(r.failure(), None);
}

#[test]
fn proplet_3_8_fl_object_result_verbatim() {
    let payload = r#"{"task_id":"…","results":{"task_id":"…","round_id":"r1","proplet_id":"…","num_samples":1,"update_b64":"<base64 of raw output>","format":"f32-delta","metrics":{}},"error":null}"#;
    let Inbound::Result(r) = dec(TopicKind::Results, payload) else {
        panic!("not a result");
    };
    assert_eq!(r.proplet_id, None, "no top-level proplet_id in this form");
    assert_eq!(r.results.as_text(), None);
    assert!(matches!(
        r.results,
        ResultValue::Json(Value::Object(ref o)) if o.get("round_id") == Some(&json!("r1"))
    ));
    // The raw value is kept; parsing it as an envelope points at the placeholder.
    assert_eq!(
        r.results
            .fl_update()
            .and_then(Result::err)
            .map(|e| e.key().map(str::to_owned)),
        Some(Some(s("results.update_b64")))
    );

    let completed = payload.replace("<base64 of raw output>", "WzAuMSwwLjJd");
    let Inbound::Result(r) = dec(TopicKind::Results, &completed) else {
        panic!("not a result");
    };
    let envelope = match r.results.fl_update() {
        Some(Ok(e)) => e,
        other => panic!("no envelope: {other:?}"),
    };
    assert_eq!(
        envelope,
        FlUpdate {
            task_id: Some(s("…")),
            round_id: Some(FlRoundId::Text(s("r1"))),
            proplet_id: Some(s("…")),
            num_samples: Some(1),
            update_b64: Some(b"[0.1,0.2]".to_vec()),
            format: Some(s("f32-delta")),
            metrics: Some(Map::new()),
            ..FlUpdate::default()
        }
    );
}

#[test]
fn embedded_results_with_comma_separated_values() {
    // Shapes built by the embedded agent: no proplet_id, `error` only on failure.
    let ok = r#"{"task_id":"t1","results":"30,4"}"#;
    assert_eq!(
        dec(TopicKind::Results, ok),
        Inbound::Result(TaskResult {
            task_id: s("t1"),
            proplet_id: None,
            results: ResultValue::Text(s("30,4")),
            error: None,
        })
    );
    let failed = r#"{"task_id":"t1","results":"","error":"no main export"}"#;
    let Inbound::Result(r) = dec(TopicKind::Results, failed) else {
        panic!("not a result");
    };
    assert_eq!(r.failure(), Some("no main export"));
    assert!(r.results.is_empty());
}

#[test]
fn operator_3_3_4_results_verbatim() {
    let ok = r#"{"task_id":"0b6b…-uid","proplet_id":"6a1f…","results":"42","error":null}"#;
    let Inbound::Result(r) = dec(TopicKind::Results, ok) else {
        panic!("not a result");
    };
    assert_eq!(r.results, ResultValue::Text(s("42")));
    let failed = r#"{"task_id":"0b6b…","proplet_id":"6a1f…","results":"","error":"TEE runtime not available"}"#;
    let Inbound::Result(r) = dec(TopicKind::Results, failed) else {
        panic!("not a result");
    };
    assert_eq!(r.failure(), Some("TEE runtime not available"));
    // An empty error string means success, as upstream.
    let empty_error = r#"{"task_id":"t","results":"1","error":""}"#;
    let Inbound::Result(r) = dec(TopicKind::Results, empty_error) else {
        panic!("not a result");
    };
    assert_eq!(r.error.as_deref(), Some(""));
    assert_eq!(r.failure(), None);
    assert_eq!(
        dec_err(TopicKind::Results, r#"{"task_id":"t","error":5}"#),
        DecodeError::WrongType {
            key: s("error"),
            expected: "string or null"
        }
    );
}

#[test]
fn fl_envelope_found_where_the_operator_looks() {
    let member = json!({"job_id":"exp1","round_id":1,"global_version":"v0","proplet_id":"edge-1","num_samples":100,"update_b64":"WzAuMSwwLjJd","metrics":{"loss":0.31},"format":"json-f64"});
    for results in [
        json!({ "update_envelope": member.clone() }),
        json!({ "results": { "update_envelope": member.clone() } }),
        member.clone(),
    ] {
        let v = ResultValue::Json(results);
        let env = match v.fl_update() {
            Some(Ok(e)) => e,
            other => panic!("no envelope: {other:?}"),
        };
        assert_eq!(env.job_id.as_deref(), Some("exp1"));
        assert_eq!(env.round_id, Some(FlRoundId::Number(1)));
        assert_eq!(env.num_samples, Some(100));
    }
    assert!(ResultValue::Text(s("42")).fl_update().is_none());
    assert!(ResultValue::Json(json!({"other": 1})).fl_update().is_none());
}

// ---------------------------------------------------------------- §3.9 registry

#[test]
fn proplet_3_9_registry_request_and_chunk() {
    assert_eq!(
        dec(
            TopicKind::RegistryRequest,
            r#"{"app_name":"docker.io/acme/add:1.0"}"#
        ),
        Inbound::RegistryRequest(RegistryRequest {
            app_name: s("docker.io/acme/add:1.0")
        })
    );
    let verbatim =
        r#"{"app_name":"docker.io/acme/add:1.0","chunk_idx":0,"total_chunks":3,"data":"<base64>"}"#;
    assert_eq!(
        dec_err(TopicKind::RegistryChunk, verbatim).key(),
        Some("data")
    );
    let completed = verbatim.replace("<base64>", "AGFzbQ==");
    assert_eq!(
        dec(TopicKind::RegistryChunk, &completed),
        Inbound::RegistryChunk(RegistryChunk {
            app_name: s("docker.io/acme/add:1.0"),
            chunk_idx: 0,
            total_chunks: 3,
            data: b"\0asm".to_vec(),
        })
    );
}

#[test]
fn operator_registry_examples() {
    assert!(matches!(
        dec(TopicKind::RegistryRequest, r#"{"app_name":"docker.io/mrstevenyaga/add.wasm:latest"}"#),
        Inbound::RegistryRequest(RegistryRequest { ref app_name }) if app_name == "docker.io/mrstevenyaga/add.wasm:latest"
    ));
    let verbatim = r#"{"app_name":"docker.io/x/add.wasm:latest","chunk_idx":0,"data":"AGFzbQEAAAAB…","total_chunks":1}"#;
    assert_eq!(
        dec_err(TopicKind::RegistryChunk, verbatim).key(),
        Some("data")
    );
    let completed = verbatim.replace("AGFzbQEAAAAB…", "AGFzbQEAAAAB");
    assert!(matches!(
        dec(TopicKind::RegistryChunk, &completed),
        Inbound::RegistryChunk(RegistryChunk { total_chunks: 1, ref data, .. }) if data.len() == 9
    ));
}

#[test]
fn chunk_indices_are_validated_on_decode() {
    let out_of_range = r#"{"app_name":"a","chunk_idx":3,"total_chunks":3,"data":""}"#;
    assert_eq!(
        dec_err(TopicKind::RegistryChunk, out_of_range).key(),
        Some("chunk_idx")
    );
    let zero = r#"{"app_name":"a","chunk_idx":0,"total_chunks":0,"data":""}"#;
    assert_eq!(
        dec_err(TopicKind::RegistryChunk, zero).key(),
        Some("total_chunks")
    );
    let negative = r#"{"app_name":"a","chunk_idx":-1,"total_chunks":1,"data":""}"#;
    assert_eq!(
        dec_err(TopicKind::RegistryChunk, negative),
        DecodeError::WrongType {
            key: s("chunk_idx"),
            expected: "non-negative integer"
        }
    );
}

#[test]
fn chunks_survive_the_wire_and_reassemble() {
    let binary: Vec<u8> = (0..=255u8).cycle().take(1_300_000).collect();
    let mut assembler = ChunkAssembler::new("img", 2_000_000);
    let mut done = None;
    let chunks = match split_into_chunks("img", &binary, DEFAULT_RAW_CHUNK_SIZE) {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(chunks.len(), 3);
    for chunk in chunks {
        let Inbound::RegistryChunk(back) = dec_bytes(TopicKind::RegistryChunk, &chunk.encode())
        else {
            panic!("not a chunk");
        };
        assert_eq!(back, chunk);
        if let Ok(ChunkProgress::Complete(bytes)) = assembler.push(back) {
            done = Some(bytes);
        }
    }
    assert_eq!(done, Some(binary));
}

fn dec_bytes(kind: TopicKind, payload: &[u8]) -> Inbound {
    match decode(&kind, payload) {
        Ok(m) => m,
        Err(e) => panic!("{kind:?} payload failed to decode: {e}"),
    }
}

// ---------------------------------------------------------------- §3.10 FL

#[test]
fn proplet_3_10_round_start_verbatim() {
    let payload = r#"{"round_id":"r1","model_uri":"fl/models/global_model_v0","task_wasm_image":"docker.io/acme/fl-client","participants":["3f1c…"],"hyperparams":{"epochs":1}}"#;
    let mut hyper = Map::new();
    hyper.insert(s("epochs"), json!(1));
    assert_eq!(
        dec(TopicKind::FlRoundStart, payload),
        Inbound::FlRoundStart(FlRoundStart {
            round_id: s("r1"),
            experiment_id: None,
            model_uri: Some(s("fl/models/global_model_v0")),
            task_wasm_image: Some(s("docker.io/acme/fl-client")),
            participants: vec![s("3f1c…")],
            k_of_n: None,
            timeout_seconds: None,
            hyperparams: Some(hyper),
        })
    );
}

#[test]
fn operator_3_3_7_round_start_verbatim() {
    let payload = r#"{"round_id":"r-7","experiment_id":"exp1","model_uri":"oci://reg/model:v0","task_wasm_image":"docker.io/org/fl-train:latest","participants":["k8s-proplet","edge-1"],"k_of_n":2,"timeout_seconds":300,"hyperparams":{"lr":0.01}}"#;
    let Inbound::FlRoundStart(r) = dec(TopicKind::FlRoundStart, payload) else {
        panic!("not a round start");
    };
    assert_eq!(r.round_id, "r-7");
    assert_eq!(r.experiment_id.as_deref(), Some("exp1"));
    assert_eq!(r.participants, vec![s("k8s-proplet"), s("edge-1")]);
    assert_eq!(r.k_of_n, Some(2));
    assert_eq!(r.timeout_seconds, Some(300));
    assert_eq!(
        r.hyperparams.and_then(|h| h.get("lr").cloned()),
        Some(json!(0.01))
    );
    assert_eq!(
        dec_err(
            TopicKind::FlRoundStart,
            r#"{"round_id":"r","participants":[]}"#
        )
        .key(),
        Some("participants")
    );
    assert_eq!(
        dec_err(TopicKind::FlRoundStart, r#"{"round_id":"r"}"#),
        DecodeError::MissingKey {
            key: s("participants")
        }
    );
    assert_eq!(
        dec_err(TopicKind::FlRoundStart, r#"{"participants":["a"]}"#),
        DecodeError::MissingKey { key: s("round_id") }
    );
}

#[test]
fn fl_updates_from_every_sender() {
    let kind = TopicKind::FlUpdate {
        round_id: seg("1"),
        proplet_id: seg("edge-1"),
    };
    // Upstream's FL member envelope, verbatim.
    let member = r#"{"job_id":"exp1","round_id":1,"global_version":"v0","proplet_id":"edge-1","num_samples":100,"update_b64":"WzAuMSwwLjJd","metrics":{"loss":0.31},"format":"json-f64"}"#;
    let Inbound::FlUpdate(m) = dec(kind.clone(), member) else {
        panic!("not an FL update");
    };
    assert_eq!(m.round_id.as_str(), "1");
    assert_eq!(m.proplet_id.as_str(), "edge-1");
    assert_eq!(m.envelope.job_id.as_deref(), Some("exp1"));
    assert_eq!(m.envelope.update_b64.as_deref(), Some(&b"[0.1,0.2]"[..]));
    assert_eq!(
        m.envelope.round_id.as_ref().and_then(FlRoundId::as_number),
        Some(1)
    );

    // Embedded agent's FML update (shape from its C source), on the unprefixed topic.
    let Some((None, topic_kind)) = classify("fl/rounds/r1/updates/esp-1") else {
        panic!("unprefixed topic not recognised");
    };
    let embedded = r#"{"round_id":"r1","proplet_id":"esp-1","base_model_uri":"fl/models/global_model_v0","num_samples":0,"metrics":{},"update":{},"error":"boom"}"#;
    let Inbound::FlUpdate(m) = dec(topic_kind, embedded) else {
        panic!("not an FL update");
    };
    assert_eq!(m.round_id.as_str(), "r1");
    assert_eq!(m.envelope.update, Some(json!({})));
    assert_eq!(m.envelope.error.as_deref(), Some("boom"));
    assert_eq!(
        m.envelope.base_model_uri.as_deref(),
        Some("fl/models/global_model_v0")
    );

    // The Rust agent's fallback publishes the client's own JSON: unknown keys are kept.
    let client = r#"{"round_id":"r1","weights":[0.5,0.25],"loss":0.1}"#;
    let Inbound::FlUpdate(m) = dec(kind.clone(), client) else {
        panic!("not an FL update");
    };
    assert_eq!(m.envelope.extra.get("weights"), Some(&json!([0.5, 0.25])));
    assert_eq!(m.envelope.extra.len(), 2);

    assert_eq!(
        dec_err(kind, r#"{"round_id":true}"#),
        DecodeError::WrongType {
            key: s("round_id"),
            expected: "string or non-negative integer"
        }
    );
}

// ---------------------------------------------------------------- errors and limits

#[test]
fn size_is_checked_before_parsing() {
    let decoder = Decoder::new(16);
    let garbage = [b'{'; 17];
    assert_eq!(
        decoder.decode(&TopicKind::Alive, &garbage),
        Err(DecodeError::TooLarge { size: 17, max: 16 })
    );
    assert!(matches!(
        decoder.decode(&TopicKind::Alive, &garbage[..16]),
        Err(DecodeError::NotJson { .. })
    ));
    assert_eq!(
        Decoder::default().max_payload_bytes(),
        DEFAULT_MAX_PAYLOAD_BYTES
    );
}

#[test]
fn structural_errors() {
    assert!(matches!(
        dec_err(TopicKind::Alive, "not json"),
        DecodeError::NotJson { .. }
    ));
    assert!(matches!(
        decode(&TopicKind::Alive, &[0xff, 0xfe]),
        Err(DecodeError::NotJson { .. })
    ));
    for not_object in ["[]", "\"x\"", "1", "null", "true"] {
        assert_eq!(
            dec_err(TopicKind::Results, not_object),
            DecodeError::NotAnObject
        );
    }
}

#[test]
fn key_errors_name_the_key() {
    let cases: [(TopicKind, &str, DecodeError); 8] = [
        (
            TopicKind::Alive,
            r#"{"status":"alive"}"#,
            DecodeError::MissingKey {
                key: s("proplet_id"),
            },
        ),
        (
            TopicKind::Alive,
            r#"{"proplet_id":""}"#,
            DecodeError::InvalidValue {
                key: s("proplet_id"),
                reason: s("must not be empty"),
            },
        ),
        (
            TopicKind::Start,
            r#"{"id":"t"}"#,
            DecodeError::MissingKey { key: s("name") },
        ),
        (
            TopicKind::Start,
            r#"{"id":"t","name":"n","daemon":"yes"}"#,
            DecodeError::WrongType {
                key: s("daemon"),
                expected: "boolean",
            },
        ),
        (
            TopicKind::Start,
            r#"{"id":"t","name":"n","env":{"A":1}}"#,
            DecodeError::WrongType {
                key: s("env.A"),
                expected: "string",
            },
        ),
        (
            TopicKind::Start,
            r#"{"id":"t","name":"n","inputs":[1,null]}"#,
            DecodeError::WrongType {
                key: s("inputs[1]"),
                expected: "string or number",
            },
        ),
        (
            TopicKind::Discovery,
            r#"{"proplet_id":"p","metadata":{"total_memory_bytes":"lots"}}"#,
            DecodeError::WrongType {
                key: s("metadata.total_memory_bytes"),
                expected: "non-negative integer",
            },
        ),
        (
            TopicKind::PropletMetrics,
            r#"{"proplet_id":"p","timestamp":{"secs_since_epoch":1}}"#,
            DecodeError::MissingKey {
                key: s("timestamp.nanos_since_epoch"),
            },
        ),
    ];
    for (kind, payload, expected) in cases {
        let err = dec_err(kind, payload);
        assert_eq!(err, expected, "{payload}");
        let key = err.key().unwrap_or_default().to_owned();
        assert!(
            err.to_string().contains(&key),
            "message names the key: {err}"
        );
    }
}

#[test]
fn claimed_ids_for_identity_checks() {
    let hb = dec(TopicKind::Alive, r#"{"proplet_id":"p1","status":"alive"}"#);
    assert_eq!(hb.claimed_proplet_id(), Some("p1"));
    let embedded_result = dec(TopicKind::Results, r#"{"task_id":"t","results":"1"}"#);
    assert_eq!(embedded_result.claimed_proplet_id(), None);
    let fl = dec(
        TopicKind::FlUpdate {
            round_id: seg("r"),
            proplet_id: seg("p9"),
        },
        r#"{"proplet_id":"someone-else"}"#,
    );
    assert_eq!(
        fl.claimed_proplet_id(),
        Some("p9"),
        "the topic level is used"
    );
    let start = dec(TopicKind::Start, r#"{"id":"t","name":"n"}"#);
    assert_eq!(start.claimed_proplet_id(), None);
}

#[test]
fn kind_matches_the_topic_and_classify_agrees() {
    let channel = match Channel::new("d", "c") {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    };
    let msg = dec(TopicKind::Alive, r#"{"proplet_id":"p","status":"offline"}"#);
    assert_eq!(msg.kind(), TopicKind::Alive);
    assert_eq!(
        channel.classify(&channel.topic(&msg.kind())),
        Some(msg.kind())
    );
}

// ---------------------------------------------------------------- round trips

fn round_trip(msg: &Inbound) {
    let back = match decode(&msg.kind(), &msg.encode()) {
        Ok(m) => m,
        Err(e) => panic!("our own encoding of {msg:?} failed to decode: {e}"),
    };
    assert_eq!(&back, msg);
}

#[test]
fn every_message_type_round_trips() {
    let full_start = StartRequest {
        id: s("t"),
        name: s("main"),
        state: 3,
        image_url: Some(s("docker.io/a/b:1")),
        file: Some(wasm_bytes()),
        inputs: vec![s("1"), s("two")],
        cli_args: vec![s("--x")],
        broadcast: false,
        daemon: true,
        latent: true,
        env: BTreeMap::from([(s("A"), s("B"))]),
        encrypted: true,
        kbs_resource_path: Some(s("default/key/1")),
        monitoring_profile: Some(MonitoringProfile::long_running_daemon()),
        proplet_id: Some(s("p")),
        hal_storage_path: Some(s("/data")),
        mode: Some(s("train")),
        kind: Some(s("standard")),
        priority: Some(-5),
        metadata: Some(Map::from_iter([(s("k"), json!({"n": [1, 2]}))])),
        parent_results: Some(Map::from_iter([(s("t0"), json!("42"))])),
        run: Some(3),
    };
    let messages = vec![
        Inbound::Discovery(Discovery {
            proplet_id: s("p"),
            namespace: Some(s("default")),
            metadata: Some(PropletMetadata {
                description: Some(s("d")),
                tags: vec![s("gpu")],
                total_memory_bytes: Some(1),
                ..PropletMetadata::default()
            }),
        }),
        Inbound::Heartbeat(Heartbeat {
            proplet_id: s("p"),
            namespace: None,
            metadata: Some(PropletMetadata::default()),
            metrics: Some(HeartbeatMetrics {
                cpu_percent: Some(1.5),
                memory_bytes: Some(2),
                memory_percent: None,
            }),
        }),
        Inbound::Offline(OfflineNotice {
            proplet_id: s("p"),
            namespace: Some(s("embedded")),
        }),
        Inbound::PropletMetrics(PropletMetrics {
            proplet_id: s("p"),
            namespace: None,
            timestamp: Some(Timestamp::Number(5.0)),
            cpu_metrics: Some(CpuMetrics::default()),
            memory_metrics: None,
        }),
        Inbound::TaskMetrics(TaskMetrics {
            task_id: s("t"),
            proplet_id: None,
            metrics: ProcessMetrics::default(),
            aggregated: Some(AggregatedMetrics::default()),
            timestamp: Some(Timestamp::now()),
        }),
        Inbound::Result(TaskResult {
            task_id: s("t"),
            proplet_id: Some(s("p")),
            results: ResultValue::Json(json!([1, "a"])),
            error: Some(s("bad")),
        }),
        Inbound::InvokeResult(InvokeResult {
            task_id: s("t"),
            invocation_id: String::new(),
            proplet_id: None,
            results: ResultValue::Text(s("ok")),
            error: None,
        }),
        Inbound::Start(Box::new(full_start)),
        Inbound::Stop(StopRequest::new("t", "main", Some(s("p")))),
        Inbound::Invoke(InvokeRequest {
            id: s("t"),
            broadcast: true,
            proplet_id: None,
            invocation_id: Some(s("i")),
            inputs: vec![s("3")],
            env: BTreeMap::new(),
        }),
        Inbound::RegistryRequest(RegistryRequest { app_name: s("a") }),
        Inbound::RegistryChunk(RegistryChunk {
            app_name: s("a"),
            chunk_idx: 1,
            total_chunks: 2,
            data: vec![0, 255, 7],
        }),
        Inbound::FlRoundStart(FlRoundStart {
            round_id: s("r1"),
            experiment_id: Some(s("e")),
            model_uri: None,
            task_wasm_image: Some(s("img")),
            participants: vec![s("a"), s("b")],
            k_of_n: Some(1),
            timeout_seconds: Some(60),
            hyperparams: None,
        }),
        Inbound::FlUpdate(Box::new(FlUpdateMessage {
            round_id: seg("r1"),
            proplet_id: seg("a"),
            envelope: FlUpdate {
                round_id: Some(FlRoundId::Number(3)),
                update_b64: Some(vec![1, 2, 3]),
                update: Some(json!({"w": 1})),
                extra: Map::from_iter([(s("x_extra"), json!(null))]),
                ..FlUpdate::default()
            },
        })),
    ];
    for msg in &messages {
        round_trip(msg);
    }
}

#[test]
fn rfc3339_timestamps_round_trip() {
    let Inbound::PropletMetrics(m) = dec(
        TopicKind::PropletMetrics,
        r#"{"proplet_id":"p","timestamp":"2026-08-20T10:00:00.5+02:00"}"#,
    ) else {
        panic!("not metrics");
    };
    round_trip(&Inbound::PropletMetrics(m));
}

// ---------------------------------------------------------------- property tests

pub(super) mod props {
    use super::*;
    use proptest::collection::{btree_map, vec as pvec};
    use proptest::option;
    use proptest::prelude::*;

    fn all_kinds() -> Vec<TopicKind> {
        let mut kinds = TopicKind::FIXED.to_vec();
        kinds.push(TopicKind::FlUpdate {
            round_id: seg("r"),
            proplet_id: seg("p"),
        });
        kinds
    }

    const KEYS: &[&str] = &[
        "proplet_id",
        "status",
        "namespace",
        "metadata",
        "metrics",
        "timestamp",
        "cpu_metrics",
        "memory_metrics",
        "task_id",
        "aggregated",
        "results",
        "error",
        "invocation_id",
        "id",
        "name",
        "state",
        "image_url",
        "file",
        "inputs",
        "cli_args",
        "broadcast",
        "daemon",
        "latent",
        "env",
        "encrypted",
        "monitoring_profile",
        "interval",
        "priority",
        "parent_results",
        "app_name",
        "chunk_idx",
        "total_chunks",
        "data",
        "round_id",
        "participants",
        "k_of_n",
        "hyperparams",
        "update_b64",
        "update",
        "num_samples",
        "secs_since_epoch",
        "nanos_since_epoch",
        "tags",
        "total_memory_bytes",
        "history_size",
    ];

    fn key() -> impl Strategy<Value = String> {
        prop_oneof![
            4 => proptest::sample::select(KEYS).prop_map(str::to_owned),
            1 => "[a-z_]{0,6}",
        ]
    }

    /// Arbitrary JSON whose object keys are mostly protocol keys, to reach deep decode paths.
    pub(in crate::protocol) fn json_value() -> impl Strategy<Value = Value> {
        json_with_floats(any::<f64>().boxed())
    }

    /// JSON as it looks after one trip over the wire. serde_json (without its
    /// `float_roundtrip` feature) may move an extreme float by one ulp when parsing, so values
    /// that must come back identical use floats with few significant digits.
    fn wire_json() -> impl Strategy<Value = Value> {
        json_with_floats(small_f64().boxed())
    }

    fn json_with_floats(floats: BoxedStrategy<f64>) -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            floats.prop_map(fields::f64_value),
            "[ -~]{0,12}".prop_map(Value::String),
            Just(Value::String(s("AGFzbQ=="))),
            Just(Value::String(s("10s"))),
            Just(Value::String(s("2026-08-20T10:00:00Z"))),
        ];
        leaf.prop_recursive(4, 48, 8, |inner| {
            prop_oneof![
                pvec(inner.clone(), 0..6).prop_map(Value::Array),
                pvec((key(), inner), 0..8).prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    fn text() -> impl Strategy<Value = String> {
        ".{0,12}"
    }

    fn id() -> impl Strategy<Value = String> {
        "[A-Za-z0-9._…-]{1,12}"
    }

    fn small_f64() -> impl Strategy<Value = f64> {
        (-10_000_000i64..10_000_000).prop_map(|n| n as f64 / 100.0)
    }

    fn json_map() -> impl Strategy<Value = Map<String, Value>> {
        pvec((text(), wire_json()), 0..4).prop_map(|kv| kv.into_iter().collect())
    }

    /// JSON values our encoders can carry back exactly: nulls only where absent means null.
    fn result_value() -> impl Strategy<Value = ResultValue> {
        prop_oneof![
            text().prop_map(ResultValue::Text),
            json_map().prop_map(|m| ResultValue::Json(Value::Object(m))),
            pvec(wire_json(), 0..4).prop_map(|v| ResultValue::Json(Value::Array(v))),
            any::<i64>().prop_map(|n| ResultValue::Json(Value::from(n))),
            any::<bool>().prop_map(|b| ResultValue::Json(Value::Bool(b))),
        ]
    }

    fn timestamp() -> impl Strategy<Value = Timestamp> {
        prop_oneof![
            (any::<u64>(), 0u32..1_000_000_000).prop_map(|(s, n)| Timestamp::SystemTime {
                secs_since_epoch: s,
                nanos_since_epoch: n,
            }),
            small_f64().prop_map(Timestamp::Number),
            (0i64..4_000_000_000, 0u32..1_000_000_000, -1_439i32..1_440).prop_filter_map(
                "representable",
                |(secs, nanos, offset_minutes)| {
                    // RFC 3339 offsets have minute resolution.
                    let tz = chrono::FixedOffset::east_opt(offset_minutes * 60)?;
                    let at = chrono::DateTime::from_timestamp(secs, nanos)?;
                    Some(Timestamp::Rfc3339(at.with_timezone(&tz)))
                }
            ),
        ]
    }

    fn metadata() -> impl Strategy<Value = PropletMetadata> {
        (
            option::of(text()),
            pvec(text(), 0..3),
            option::of(text()),
            option::of(text()),
            option::of(text()),
            option::of(text()),
            option::of(text()),
            option::of(text()),
            option::of(any::<u64>()),
            option::of(text()),
            option::of(text()),
        )
            .prop_map(|(d, t, l, ip, e, os, h, a, m, v, w)| PropletMetadata {
                description: d,
                tags: t,
                location: l,
                ip,
                environment: e,
                os,
                hostname: h,
                cpu_arch: a,
                total_memory_bytes: m,
                proplet_version: v,
                wasm_runtime: w,
                attester: None,
            })
    }

    fn profile() -> impl Strategy<Value = MonitoringProfile> {
        (
            pvec(any::<bool>(), 8),
            1u64..NANOSECOND_INTERVAL_THRESHOLD,
            any::<u64>(),
        )
            .prop_map(|(b, interval_secs, history_size)| MonitoringProfile {
                enabled: b.first().copied().unwrap_or_default(),
                interval_secs,
                collect_cpu: b.get(1).copied().unwrap_or_default(),
                collect_memory: b.get(2).copied().unwrap_or_default(),
                collect_disk_io: b.get(3).copied().unwrap_or_default(),
                collect_threads: b.get(4).copied().unwrap_or_default(),
                collect_file_descriptors: b.get(5).copied().unwrap_or_default(),
                export_to_mqtt: b.get(6).copied().unwrap_or_default(),
                retain_history: b.get(7).copied().unwrap_or_default(),
                history_size,
            })
    }

    fn start() -> impl Strategy<Value = StartRequest> {
        let head = (
            id(),
            id(),
            any::<u8>(),
            option::of(text()),
            option::of(pvec(any::<u8>(), 0..64)),
            pvec(text(), 0..4),
            pvec(text(), 0..3),
            pvec(any::<bool>(), 4),
            btree_map(text(), text(), 0..4),
        );
        let tail = (
            option::of(text()),
            option::of(profile()),
            option::of(id()),
            option::of(text()),
            option::of(text()),
            option::of(text()),
            option::of(any::<i64>()),
            option::of(json_map()),
            option::of(json_map()),
            option::of(any::<u64>()),
        );
        (head, tail).prop_map(
            |(
                (id, name, state, image_url, file, inputs, cli_args, flags, env),
                (
                    kbs,
                    monitoring_profile,
                    target,
                    hal,
                    mode,
                    kind,
                    priority,
                    metadata,
                    parents,
                    run,
                ),
            )| {
                let broadcast = flags.first().copied().unwrap_or_default();
                StartRequest {
                    id,
                    name,
                    state,
                    image_url,
                    file,
                    inputs,
                    cli_args,
                    broadcast,
                    daemon: flags.get(1).copied().unwrap_or_default(),
                    latent: flags.get(2).copied().unwrap_or_default(),
                    env,
                    encrypted: flags.get(3).copied().unwrap_or_default(),
                    kbs_resource_path: kbs,
                    monitoring_profile,
                    proplet_id: if broadcast { None } else { target },
                    hal_storage_path: hal,
                    mode,
                    kind,
                    priority,
                    metadata,
                    parent_results: parents,
                    run,
                }
            },
        )
    }

    fn fl_update() -> impl Strategy<Value = FlUpdate> {
        let round = prop_oneof![
            any::<u64>().prop_map(FlRoundId::Number),
            text().prop_map(FlRoundId::Text),
        ];
        let non_null = wire_json().prop_filter("null means absent", |v| !v.is_null());
        (
            (
                option::of(text()),
                option::of(text()),
                option::of(round),
                option::of(text()),
                option::of(text()),
                option::of(any::<u64>()),
            ),
            (
                option::of(pvec(any::<u8>(), 0..32)),
                option::of(non_null),
                option::of(text()),
                option::of(json_map()),
                option::of(text()),
                option::of(text()),
                pvec(("x_[a-z]{1,6}", wire_json()), 0..3),
            ),
        )
            .prop_map(
                |(
                    (task_id, job_id, round_id, global_version, proplet_id, num_samples),
                    (update_b64, update, format, metrics, base_model_uri, error, extra),
                )| FlUpdate {
                    task_id,
                    job_id,
                    round_id,
                    global_version,
                    proplet_id,
                    num_samples,
                    update_b64,
                    update,
                    format,
                    metrics,
                    base_model_uri,
                    error,
                    extra: extra.into_iter().collect(),
                },
            )
    }

    pub(in crate::protocol) fn inbound() -> impl Strategy<Value = Inbound> {
        let opt_f = || option::of(small_f64());
        let opt_u = || option::of(any::<u64>());
        prop_oneof![
            (id(), option::of(text()), option::of(metadata())).prop_map(|(p, n, m)| {
                Inbound::Discovery(Discovery {
                    proplet_id: p,
                    namespace: n,
                    metadata: m,
                })
            }),
            (
                id(),
                option::of(text()),
                option::of(metadata()),
                option::of((opt_f(), opt_u(), opt_f()))
            )
                .prop_map(|(p, n, m, x)| Inbound::Heartbeat(Heartbeat {
                    proplet_id: p,
                    namespace: n,
                    metadata: m,
                    metrics: x.map(|(c, b, mp)| HeartbeatMetrics {
                        cpu_percent: c,
                        memory_bytes: b,
                        memory_percent: mp,
                    }),
                })),
            (id(), option::of(text())).prop_map(|(p, n)| Inbound::Offline(OfflineNotice {
                proplet_id: p,
                namespace: n,
            })),
            (
                id(),
                option::of(text()),
                option::of(timestamp()),
                option::of((opt_f(), opt_f(), opt_f())),
                option::of((pvec(opt_u(), 8), opt_f()))
            )
                .prop_map(|(p, n, t, cpu, mem)| Inbound::PropletMetrics(
                    PropletMetrics {
                        proplet_id: p,
                        namespace: n,
                        timestamp: t,
                        cpu_metrics: cpu.map(|(u, s, pc)| CpuMetrics {
                            user_seconds: u,
                            system_seconds: s,
                            percent: pc,
                        }),
                        memory_metrics: mem.map(|(v, pc)| MemoryMetrics {
                            rss_bytes: v.first().copied().flatten(),
                            heap_alloc_bytes: v.get(1).copied().flatten(),
                            heap_sys_bytes: v.get(2).copied().flatten(),
                            heap_inuse_bytes: v.get(3).copied().flatten(),
                            heap_free_bytes: v.get(4).copied().flatten(),
                            heap_max_alloc_bytes: v.get(5).copied().flatten(),
                            container_usage_bytes: v.get(6).copied().flatten(),
                            container_limit_bytes: v.get(7).copied().flatten(),
                            percent: pc,
                        }),
                    }
                )),
            (
                id(),
                option::of(text()),
                (opt_f(), pvec(opt_u(), 6), opt_f()),
                option::of((pvec(opt_f(), 4), pvec(opt_u(), 3))),
                option::of(timestamp())
            )
                .prop_map(|(t, p, (cpu, us, mp), agg, ts)| {
                    Inbound::TaskMetrics(TaskMetrics {
                        task_id: t,
                        proplet_id: p,
                        metrics: ProcessMetrics {
                            cpu_percent: cpu,
                            memory_bytes: us.first().copied().flatten(),
                            memory_percent: mp,
                            disk_read_bytes: us.get(1).copied().flatten(),
                            disk_write_bytes: us.get(2).copied().flatten(),
                            uptime_seconds: us.get(3).copied().flatten(),
                            thread_count: us.get(4).copied().flatten(),
                            file_descriptor_count: us.get(5).copied().flatten(),
                            fuel_used: None,
                        },
                        aggregated: agg.map(|(f, u)| AggregatedMetrics {
                            avg_cpu_usage: f.first().copied().flatten(),
                            max_cpu_usage: f.get(1).copied().flatten(),
                            avg_memory_usage: f.get(2).copied().flatten(),
                            max_memory_usage: f.get(3).copied().flatten(),
                            total_disk_read: u.first().copied().flatten(),
                            total_disk_write: u.get(1).copied().flatten(),
                            sample_count: u.get(2).copied().flatten(),
                        }),
                        timestamp: ts,
                    })
                }),
            (id(), option::of(text()), result_value(), option::of(text())).prop_map(
                |(t, p, r, e)| Inbound::Result(TaskResult {
                    task_id: t,
                    proplet_id: p,
                    results: r,
                    error: e,
                })
            ),
            (
                id(),
                text(),
                option::of(text()),
                result_value(),
                option::of(text())
            )
                .prop_map(|(t, i, p, r, e)| Inbound::InvokeResult(InvokeResult {
                    task_id: t,
                    invocation_id: i,
                    proplet_id: p,
                    results: r,
                    error: e,
                })),
            start().prop_map(|s| Inbound::Start(Box::new(s))),
            (id(), option::of(id()), any::<bool>(), text(), text()).prop_map(|(i, p, b, n, st)| {
                Inbound::Stop(StopRequest {
                    id: i,
                    proplet_id: if b { None } else { p },
                    broadcast: b,
                    name: n,
                    state: st,
                })
            }),
            (
                id(),
                any::<bool>(),
                option::of(id()),
                option::of(text()),
                pvec(text(), 0..3),
                btree_map(text(), text(), 0..3)
            )
                .prop_map(|(i, b, p, inv, inputs, env)| Inbound::Invoke(
                    InvokeRequest {
                        id: i,
                        broadcast: b,
                        proplet_id: if b { None } else { p },
                        invocation_id: inv,
                        inputs,
                        env,
                    }
                )),
            id().prop_map(|a| Inbound::RegistryRequest(RegistryRequest { app_name: a })),
            (
                id(),
                1u32..=u32::MAX,
                any::<u32>(),
                pvec(any::<u8>(), 0..64)
            )
                .prop_map(|(a, total, idx, data)| Inbound::RegistryChunk(
                    RegistryChunk {
                        app_name: a,
                        chunk_idx: idx % total,
                        total_chunks: total,
                        data,
                    }
                )),
            (
                id(),
                option::of(text()),
                option::of(text()),
                option::of(text()),
                pvec(text(), 1..4),
                opt_u(),
                opt_u(),
                option::of(json_map())
            )
                .prop_map(|(r, e, m, img, parts, k, t, h)| {
                    Inbound::FlRoundStart(FlRoundStart {
                        round_id: r,
                        experiment_id: e,
                        model_uri: m,
                        task_wasm_image: img,
                        participants: parts,
                        k_of_n: k,
                        timeout_seconds: t,
                        hyperparams: h,
                    })
                }),
            (id(), id(), fl_update()).prop_map(|(r, p, envelope)| {
                Inbound::FlUpdate(Box::new(FlUpdateMessage {
                    round_id: seg(&r),
                    proplet_id: seg(&p),
                    envelope,
                }))
            }),
        ]
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in pvec(any::<u8>(), 0..256)) {
            for kind in all_kinds() {
                let _ = decode(&kind, &bytes);
            }
        }

        #[test]
        fn json_ish_text_never_panics(text in r#"[\[\]{}":,0-9a-z_\-. ]{0,96}"#) {
            for kind in all_kinds() {
                let _ = decode(&kind, text.as_bytes());
            }
        }

        #[test]
        fn structured_json_never_panics_and_errors_name_keys(value in json_value()) {
            let payload = value.to_string();
            for kind in all_kinds() {
                match decode(&kind, payload.as_bytes()) {
                    Ok(_) => {}
                    Err(DecodeError::MissingKey { key })
                    | Err(DecodeError::WrongType { key, .. })
                    | Err(DecodeError::InvalidValue { key, .. }) => {
                        prop_assert!(!key.is_empty());
                    }
                    Err(DecodeError::NotAnObject) => prop_assert!(!value.is_object()),
                    Err(e) => prop_assert!(false, "unexpected error {e}"),
                }
            }
        }

        #[test]
        fn valid_messages_round_trip(msg in inbound()) {
            let back = decode(&msg.kind(), &msg.encode());
            prop_assert_eq!(back, Ok(msg));
        }

        #[test]
        fn split_and_assemble_in_any_order(
            binary in pvec(any::<u8>(), 0..2048),
            size in 1usize..300,
            seed in any::<u64>(),
        ) {
            let mut chunks: Vec<RegistryChunk> = match split_into_chunks("img", &binary, size) {
                Ok(c) => c.collect(),
                Err(e) => return Err(TestCaseError::fail(e.to_string())),
            };
            // Deterministic shuffle from the seed.
            let n = chunks.len();
            for i in (1..n).rev() {
                let j = usize::try_from(seed.wrapping_mul(i as u64 + 7) % (i as u64 + 1)).unwrap_or(0);
                chunks.swap(i, j);
            }
            let mut assembler = ChunkAssembler::new("img", binary.len());
            let mut out = None;
            for c in chunks {
                match assembler.push(c) {
                    Ok(ChunkProgress::Complete(b)) => out = Some(b),
                    Ok(ChunkProgress::Pending { .. }) => {}
                    Err(e) => return Err(TestCaseError::fail(e.to_string())),
                }
            }
            prop_assert_eq!(out, Some(binary));
        }

        #[test]
        fn classify_inverts_topic_building(domain in "[a-z0-9-]{1,8}", channel in "[a-z0-9-]{1,8}",
                                          round in "[a-z0-9]{1,6}", proplet in "[a-z0-9-]{1,8}") {
            let c = match Channel::new(domain, channel) {
                Ok(c) => c,
                Err(e) => return Err(TestCaseError::fail(e.to_string())),
            };
            let mut kinds = TopicKind::FIXED.to_vec();
            kinds.push(TopicKind::FlUpdate { round_id: seg(&round), proplet_id: seg(&proplet) });
            for kind in kinds {
                let topic = c.topic(&kind);
                prop_assert_eq!(
                    classify(&topic),
                    Some((Some(c.as_channel_ref()), kind.clone()))
                );
            }
        }
    }
}

#[test]
fn the_run_counter_is_optional_both_ways() {
    // An upstream manager's start has no `run`: it decodes, as a start to run regardless.
    let upstream =
        r#"{"id":"t","name":"main","file":"AGFzbQEAAAA=","inputs":["1"],"proplet_id":"p"}"#;
    let Inbound::Start(without) = dec(TopicKind::Start, upstream) else {
        panic!("not a start");
    };
    assert_eq!(without.run, None);
    assert!(
        !String::from_utf8_lossy(&without.encode()).contains("\"run\""),
        "no counter, no key: our starts without one look like upstream's"
    );
    let counted = upstream.replace("\"proplet_id\"", "\"run\":7,\"proplet_id\"");
    let Inbound::Start(with) = dec(TopicKind::Start, &counted) else {
        panic!("not a start");
    };
    assert_eq!(with.run, Some(7));
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&with.encode())
            .ok()
            .and_then(|v| v.get("run").cloned()),
        Some(json!(7))
    );
    // A counter that is not a non-negative integer is refused with its key named.
    let bad = upstream.replace("\"proplet_id\"", "\"run\":\"2\",\"proplet_id\"");
    assert_eq!(dec_err(TopicKind::Start, &bad).key(), Some("run"));
}
