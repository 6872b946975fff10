use super::*;

use std::time::Duration;

fn base() -> Flags {
    Flags {
        settings: Settings {
            domain_id: Some("d".into()),
            channel_id: Some("c".into()),
            client_id: Some("p1".into()),
            client_key: Some("k".into()),
            ..Settings::default()
        },
        ..Flags::default()
    }
}

fn text(address: &str) -> Option<AddressSetting> {
    Some(AddressSetting::Text(address.into()))
}

fn environment(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// A `proplet.toml` holding `toml` in a new directory (kept while the guard lives).
fn file_with(toml: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path().join("proplet.toml");
    std::fs::write(&path, toml).unwrap_or_else(|e| panic!("{e}"));
    (dir, path)
}

fn resolve(flags: Flags) -> Result<Config, ConfigError> {
    Config::resolve(flags, &HashMap::new())
}

#[test]
fn defaults_fill_everything_optional() {
    let c = match resolve(base()) {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(
        c.brokers.as_slice(),
        [BrokerAddress {
            host: "localhost".into(),
            port: 1883,
            tls: false
        }]
    );
    assert_eq!(c.liveliness_interval, Duration::from_secs(10));
    assert_eq!(c.metrics_interval, Some(Duration::from_secs(10)));
    assert_eq!(c.namespace, "default");
    assert_eq!(c.qos, Qos::AtLeastOnce);
    assert_eq!(c.log_level, LogLevel::Info);
}

#[test]
fn intervals_accept_plain_seconds_and_units() {
    assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
    assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
    assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
    assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
    assert!(parse_duration("ten").is_err());
    assert!(parse_duration("10x").is_err());
}

fn flag_error(args: &[&str]) -> String {
    let mut all = vec!["proplet"];
    all.extend(args);
    Flags::try_from_args(all)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default()
}

#[test]
fn values_are_typed_when_read_and_a_bad_one_names_its_flag() {
    let e = flag_error(&["--liveliness-interval", "soon"]);
    assert!(
        e.starts_with("--liveliness-interval: \"soon\" is not"),
        "{e}"
    );
    let e = flag_error(&["--mqtt-qos=3"]);
    assert_eq!(e, "--mqtt-qos: \"3\" is not 0, 1 or 2");
    let e = flag_error(&["--task-memory-limit", "lots"]);
    assert!(e.contains("suffixes Ki, Mi, Gi"), "{e}");
    let e = flag_error(&["--http-ports", "9-1"]);
    assert!(e.contains("is not FIRST-LAST"), "{e}");
    let parsed = Flags::try_from_args(["proplet", "--task-timeout", "2m", "--tags", "a, b"]);
    let parsed = parsed.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        parsed.settings.task_timeout,
        Some(Interval(Duration::from_secs(120)))
    );
    assert_eq!(
        parsed.settings.tags,
        Some(Words(vec!["a".into(), "b".into()]))
    );
}

#[test]
fn a_bad_value_in_the_file_names_the_file_and_its_line() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path().join("proplet.toml");
    let text = "[proplet]\ndomain_id = \"d\"\n\nmax_concurrent_tasks = \"many\"\n";
    std::fs::write(&path, text).unwrap_or_else(|e| panic!("{e}"));
    let mut f = base();
    f.config = Some(path.clone());
    let e = resolve(f).err().map(|e| e.to_string()).unwrap_or_default();
    assert_eq!(
        e,
        format!(
            "config file {}:4: `max_concurrent_tasks`: \"many\" is not a whole number \
             (suffixes Ki, Mi, Gi allowed)",
            path.display()
        )
    );
}

#[test]
fn bad_values_name_the_variable() {
    let mut f = base();
    f.settings.liveliness_interval = Some(Interval(Duration::ZERO));
    let e = resolve(f).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("PROPLET_LIVELINESS_INTERVAL"), "{e}");

    let mut f = base();
    f.settings.client_key = None;
    let e = resolve(f).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("PROPLET_CLIENT_KEY"), "{e}");

    let mut f = base();
    f.settings.mqtt_address = text("http://x");
    let e = resolve(f).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("PROPLET_MQTT_ADDRESS"), "{e}");
}

#[test]
fn upstream_aliases_are_accepted() {
    let env: HashMap<String, String> = [
        ("PROPLET_TENANT_ID", "tenant"),
        ("PROPLET_ENTITY_ID", "entity"),
        ("PROPLET_API_KEY", "apikey"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let flags = Flags {
        settings: Settings {
            channel_id: Some("c".into()),
            ..Settings::default()
        },
        ..Flags::default()
    };
    let c = match Config::resolve(flags, &env) {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(
        (
            c.domain_id.as_str(),
            c.client_id.as_str(),
            c.client_key.as_str()
        ),
        ("tenant", "entity", "apikey")
    );
}

#[test]
fn file_fills_only_what_flags_and_env_leave_empty() {
    let dir = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => panic!("{e}"),
    };
    let path = dir.path().join("proplet.toml");
    let written = std::fs::write(
        &path,
        "[proplet]\ntenant_id = \"file-domain\"\nchannel_id = \"file-chan\"\nentity_id = \"file-id\"\napi_key = \"file-key\"\nliveliness_interval = \"3s\"\ntags = [\"gpu\", \"arm\"]\n",
    );
    if let Err(e) = written {
        panic!("{e}");
    }
    let flags = Flags {
        config: Some(path),
        settings: Settings {
            client_id: Some("flag-id".into()),
            ..Settings::default()
        },
        ..Flags::default()
    };
    let c = match resolve(flags) {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(c.client_id, "flag-id");
    assert_eq!(c.domain_id, "file-domain");
    assert_eq!(c.liveliness_interval, Duration::from_secs(3));
    assert_eq!(c.tags, vec!["gpu", "arm"]);
}

#[test]
fn addresses_parse_like_upstream() {
    assert_eq!(parse_address("tcp://h:1"), Ok(("h".into(), 1, false)));
    assert_eq!(parse_address("mqtts://h"), Ok(("h".into(), 8883, true)));
    assert_eq!(parse_address("[::1]:1884"), Ok(("::1".into(), 1884, false)));
    assert_eq!(
        parse_address("localhost:1883"),
        Ok(("localhost".into(), 1883, false))
    );
    assert!(parse_address("tcp://:1").is_err());
}

#[test]
fn outgoing_http_settings_are_checked_at_start_up() {
    let e = flag_error(&[
        "--http-resolve",
        "httpbin.org:443:127.0.0.1:40123,httpbin.org:80",
    ]);
    assert!(
        e.starts_with("--http-resolve: \"httpbin.org:80\": missing address"),
        "{e}"
    );

    let mut f = base();
    f.settings.http_ca_file = Some("/nonexistent/ca.pem".into());
    let e = resolve(f).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        e.starts_with("PROPLET_HTTP_CA_FILE: /nonexistent/ca.pem"),
        "{e}"
    );

    let mut f = base();
    f.settings.http_resolve = "httpbin.org:443:127.0.0.1:40123".parse().ok();
    let c = match resolve(f) {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(c.http_resolve.len(), 1);
    assert_eq!(c.http_resolve[0].to_port, 40123);
    let defaults = match resolve(base()) {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    };
    assert!(defaults.http_resolve.is_empty() && defaults.http_ca_roots.is_empty());
}

#[test]
fn a_plain_http_kbs_is_refused_unless_allowed() {
    let error = |f: Flags| resolve(f).err().map(|e| e.to_string()).unwrap_or_default();
    let mut f = base();
    f.settings.kbs_uri = Some("http://kbs.local:8080".into());
    let e = error(f.clone());
    assert!(
        e.starts_with("PROPLET_KBS_URI:") && e.contains("PROPLET_KBS_INSECURE_HTTP=true"),
        "{e}"
    );
    f.settings.kbs_insecure_http = Some(Switch(true));
    f.settings.attester = Some(AttesterChoice::Sample);
    let kbs = resolve(f).ok().and_then(|c| c.kbs).expect("allowed");
    assert_eq!(kbs.url, "http://kbs.local:8080");
    assert_eq!(kbs.attester, AttesterChoice::Sample);

    let mut f = base();
    f.settings.kbs_uri = Some("kbs.local".into());
    assert!(error(f).contains("must start with https://"));
    let mut f = base();
    f.settings.kbs_uri = Some("https://kbs.local/".into());
    let kbs = resolve(f).ok().and_then(|c| c.kbs).expect("https");
    assert_eq!(kbs.url, "https://kbs.local");
    assert_eq!(
        kbs.attester,
        AttesterChoice::None,
        "no attester unless asked"
    );
    assert!(resolve(base()).ok().is_some_and(|c| c.kbs.is_none()));

    // The upstream-style variable name is an alias; a bad attester names its variable.
    let env = environment(&[("PROPLET_KBS_URL", "https://kbs.example")]);
    assert_eq!(
        Settings::from_env(&env)
            .ok()
            .and_then(|s| s.kbs_uri)
            .as_deref(),
        Some("https://kbs.example")
    );
    let env = environment(&[("PROPLET_ATTESTER", "snp")]);
    let e = Settings::from_env(&env)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        e.contains("PROPLET_ATTESTER") && e.contains("not none or sample"),
        "{e}"
    );
}

fn address(host: &str, port: u16, tls: bool) -> BrokerAddress {
    BrokerAddress {
        host: host.into(),
        port,
        tls,
    }
}

fn with_address(text: &str) -> Result<Config, ConfigError> {
    let mut f = base();
    f.settings.mqtt_address = Some(AddressSetting::Text(text.into()));
    resolve(f)
}

/// Resolves `base()` with a config file holding `toml` (and no address flag).
fn with_file(toml: &str) -> Result<Config, ConfigError> {
    let (_dir, path) = file_with(toml);
    let mut f = base();
    f.config = Some(path);
    resolve(f)
}

fn brokers(outcome: Result<Config, ConfigError>) -> Vec<BrokerAddress> {
    match outcome {
        Ok(c) => c.brokers.as_slice().to_vec(),
        Err(e) => panic!("{e}"),
    }
}

fn error(outcome: Result<Config, ConfigError>) -> String {
    match outcome {
        Ok(c) => panic!("accepted: {:?}", c.brokers),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_single_address_reads_as_before() {
    assert_eq!(
        brokers(with_address("tcp://broker:1884")),
        [address("broker", 1884, false)]
    );
    assert_eq!(
        error(with_address("http://x")),
        "PROPLET_MQTT_ADDRESS: \"http://x\": unknown scheme \"http\" (use tcp, mqtt, ssl, tls or mqtts)"
    );
    assert_eq!(
        error(with_address("tcp://x:port")),
        "PROPLET_MQTT_ADDRESS: \"tcp://x:port\": bad port"
    );
}

#[test]
fn a_comma_separated_list_keeps_its_order_and_ignores_spaces() {
    assert_eq!(
        brokers(with_address("tcp://a:1883, mqtt://b:1884 ,c,  [::1]:1885")),
        [
            address("a", 1883, false),
            address("b", 1884, false),
            address("c", 1883, false),
            address("::1", 1885, false),
        ]
    );
}

#[test]
fn empty_entries_are_refused_with_their_position() {
    assert_eq!(
        error(with_address("tcp://a:1,,tcp://b:2")),
        "PROPLET_MQTT_ADDRESS: entry 2 of 3: empty address (give one or more addresses \
         separated by commas, e.g. tcp://a:1883,tcp://b:1883)"
    );
    let e = error(with_address("tcp://a:1,"));
    assert!(
        e.starts_with("PROPLET_MQTT_ADDRESS: entry 2 of 2: empty address"),
        "{e}"
    );
    let e = error(with_address(" , "));
    assert!(
        e.starts_with("PROPLET_MQTT_ADDRESS: entry 1 of 2: empty address"),
        "{e}"
    );
    let e = error(with_address("   "));
    assert!(e.starts_with("PROPLET_MQTT_ADDRESS: empty address"), "{e}");
}

#[test]
fn a_bad_entry_is_named_with_its_source() {
    let e = error(with_address("tcp://a:1, ftp://b:2"));
    assert_eq!(
        e,
        "PROPLET_MQTT_ADDRESS: entry 2 of 2, \"ftp://b:2\": unknown scheme \"ftp\" \
         (use tcp, mqtt, ssl, tls or mqtts)"
    );
    match with_address("tcp://a:1,tcp://:2") {
        Err(ConfigError::Address {
            entry: 2,
            count: 2,
            problem: AddressError::MissingHost,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_file_accepts_a_string_list_or_an_array() {
    assert_eq!(
        brokers(with_file("mqtt_address = \"tcp://a:1, tcp://b:2\"\n")),
        [address("a", 1, false), address("b", 2, false)]
    );
    assert_eq!(
        brokers(with_file(
            "[proplet]\nmqtt_address = [\"tcp://a:1\", \" tcp://b:2 \"]\n"
        )),
        [address("a", 1, false), address("b", 2, false)]
    );
    assert_eq!(
        brokers(with_file("mqtt_address = \"tcp://solo:7\"\n")),
        [address("solo", 7, false)]
    );
    // The flag (or environment) wins over the file.
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path().join("proplet.toml");
    std::fs::write(&path, "mqtt_address = [\"tcp://file:1\"]\n").unwrap_or_else(|e| panic!("{e}"));
    let mut f = base();
    f.config = Some(path);
    f.settings.mqtt_address = text("tcp://flag:2");
    assert_eq!(brokers(resolve(f)), [address("flag", 2, false)]);
}

#[test]
fn file_errors_name_the_key_and_the_file() {
    let e = error(with_file("mqtt_address = [\"tcp://a:1\", \"\"]\n"));
    assert!(
        e.starts_with("`mqtt_address` in config file ")
            && e.contains("proplet.toml: entry 2 of 2: empty address"),
        "{e}"
    );
    let e = error(with_file("mqtt_address = []\n"));
    assert!(
        e.starts_with("`mqtt_address` in config file ") && e.contains(": empty address"),
        "{e}"
    );
    let e = error(with_file("mqtt_address = [\"tcp://a:1\", 1883]\n"));
    assert!(e.ends_with("entry 2 of 2, \"1883\": not a string"), "{e}");
    let e = error(with_file("mqtt_address = \"tcp://a:1,tcp://b:x\"\n"));
    assert!(e.ends_with("entry 2 of 2, \"tcp://b:x\": bad port"), "{e}");
}

#[test]
fn addresses_display_as_urls() {
    let list = BrokerAddresses::parse_list("a, mqtts://b, [fe80::1]:9", "x")
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        list.to_string(),
        "tcp://a:1883,ssl://b:8883,tcp://[fe80::1]:9"
    );
    assert_eq!(list.len(), 3);
    assert_eq!(list.primary(), &address("a", 1883, false));
    assert_eq!(BrokerAddresses::new(Vec::new()), None);
}

#[test]
fn any_tls_address_needs_the_ca() {
    let e = error(with_address("tcp://a:1883,mqtts://b"));
    assert!(
        e.starts_with("PROPLET_MQTT_TLS_CA_CERT: ssl://b:8883 uses TLS"),
        "{e}"
    );
    let mut f = base();
    f.settings.mqtt_address = text("tcp://a:1883,mqtts://b");
    f.settings.tls_ca_cert = Some("/etc/proplet/ca.pem".into());
    let c = resolve(f).unwrap_or_else(|e| panic!("{e}"));
    assert!(c.tls.is_some());
    assert_eq!(
        c.brokers.as_slice(),
        [address("a", 1883, false), address("b", 8883, true)]
    );
}

#[test]
fn tls_scheme_needs_a_ca() {
    let mut f = base();
    f.settings.mqtt_address = text("ssl://broker:8883");
    let e = resolve(f).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("PROPLET_MQTT_TLS_CA_CERT"), "{e}");
}

#[test]
fn one_setting_in_all_four_layers_resolves_by_precedence() {
    let (_dir, path) = file_with("namespace = \"file-ns\"\nliveliness_interval = \"3s\"\n");
    let env = environment(&[
        ("PROPLET_MANAGER_K8S_NAMESPACE", "env-ns"),
        ("PROPLET_LIVELINESS_INTERVAL", "2s"),
    ]);
    let mut flags = Flags::try_from_args([
        "proplet",
        "--namespace",
        "flag-ns",
        "--liveliness-interval=1s",
        "--domain-id=d",
        "--channel-id=c",
        "--client-id=p1",
        "--client-key=k",
    ])
    .unwrap_or_else(|e| panic!("{e}"));
    flags.config = Some(path);
    let outcome = |flags: &Flags, env: &HashMap<String, String>| {
        let c = Config::resolve(flags.clone(), env).unwrap_or_else(|e| panic!("{e}"));
        (c.namespace, c.liveliness_interval)
    };
    let secs = Duration::from_secs;
    // Flags over the environment over the file over the defaults.
    assert_eq!(outcome(&flags, &env), ("flag-ns".into(), secs(1)));
    flags.settings.namespace = None;
    flags.settings.liveliness_interval = None;
    assert_eq!(outcome(&flags, &env), ("env-ns".into(), secs(2)));
    assert_eq!(
        outcome(&flags, &HashMap::new()),
        ("file-ns".into(), secs(3))
    );
    flags.config = None;
    assert_eq!(
        outcome(&flags, &HashMap::new()),
        ("default".into(), secs(10))
    );
}

#[test]
fn empty_text_counts_as_unset_below_the_flags() {
    let (_dir, path) = file_with("domain_id = \"file-d\"\nlocation = \"file-loc\"\n");
    let mut f = base();
    f.config = Some(path);
    f.settings.domain_id = Some(String::new());
    // An empty flag hides its variable and its alias, then counts as unset.
    let env = environment(&[
        ("PROPLET_DOMAIN_ID", "env-d"),
        ("PROPLET_TENANT_ID", "alias-d"),
        ("PROPLET_LOCATION", ""),
    ]);
    let c = Config::resolve(f.clone(), &env).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (c.domain_id.as_str(), c.location.as_deref()),
        ("file-d", Some("file-loc"))
    );
    // With nothing under it, an empty text is no value.
    f.config = None;
    f.settings.domain_id = Some("d".into());
    let c = Config::resolve(f, &env).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.location, None);
}

#[test]
fn an_alias_comes_after_its_canonical_variable_and_before_the_file() {
    let (_dir, path) = file_with("[proplet]\ndomain_id = \"file-d\"\nclient_key = \"file-k\"\n");
    let mut f = base();
    f.config = Some(path);
    f.settings.domain_id = None;
    f.settings.client_key = None;
    let both = environment(&[
        ("PROPLET_DOMAIN_ID", "env-d"),
        ("PROPLET_TENANT_ID", "alias-d"),
        ("PROPLET_API_KEY", "alias-k"),
    ]);
    let c = Config::resolve(f.clone(), &both).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (c.domain_id.as_str(), c.client_key.as_str()),
        ("env-d", "alias-k")
    );
    // An empty alias is unset: the file fills in.
    let empty = environment(&[("PROPLET_TENANT_ID", ""), ("PROPLET_API_KEY", "")]);
    let c = Config::resolve(f.clone(), &empty).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (c.domain_id.as_str(), c.client_key.as_str()),
        ("file-d", "file-k")
    );
    // A flag wins over both.
    f.settings.domain_id = Some("flag-d".into());
    let c = Config::resolve(f, &both).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.domain_id, "flag-d");
}

#[test]
fn qos_and_log_level_stay_typed_to_the_resolved_config() {
    let (_dir, path) = file_with("mqtt_qos = 2\nlog_level = \"error\"\n");
    let mut f = base();
    f.config = Some(path);
    let env = environment(&[("PROPLET_LOG_LEVEL", "DEBUG")]);
    let c = Config::resolve(f, &env).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.qos, Qos::ExactlyOnce);
    assert_eq!(c.qos.to_mqtt(), rumqttc::QoS::ExactlyOnce);
    assert_eq!(c.log_level, LogLevel::Debug);
    assert_eq!(
        tracing::level_filters::LevelFilter::from(c.log_level),
        tracing::level_filters::LevelFilter::DEBUG
    );
    // Results go out at least at QoS 1.
    assert_eq!(
        Qos::AtMostOnce.max(Qos::AtLeastOnce).to_mqtt(),
        rumqttc::QoS::AtLeastOnce
    );
}

#[test]
fn a_bad_value_in_the_environment_names_its_variable() {
    let bad = |pairs: &[(&str, &str)]| {
        Config::resolve(base(), &environment(pairs))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    assert_eq!(
        bad(&[("PROPLET_MQTT_QOS", "3")]),
        "PROPLET_MQTT_QOS: \"3\" is not 0, 1 or 2"
    );
    let e = bad(&[("PROPLET_METRICS_PORT", "")]);
    assert!(e.starts_with("PROPLET_METRICS_PORT: "), "{e}");
    let e = bad(&[("PROPLET_MQTT_ADDRESS", "tcp://a:1,ftp://b")]);
    assert!(e.starts_with("PROPLET_MQTT_ADDRESS: entry 2 of 2"), "{e}");
}

#[test]
fn a_bad_value_in_the_file_names_its_key() {
    let bad = |toml: &str| {
        let (_dir, path) = file_with(toml);
        let mut f = base();
        f.config = Some(path.clone());
        let shown = path.display().to_string();
        match resolve(f) {
            Err(ConfigError::FileKey { path, key, message }) => (
                path.strip_prefix(&shown).unwrap_or(&path).to_owned(),
                key,
                message,
            ),
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(
        bad("tags = [\"a\"]\nmqtt_qos = 3\n"),
        (
            ":2".into(),
            "mqtt_qos".into(),
            "\"3\" is not 0, 1 or 2".into()
        )
    );
    let (line, key, message) = bad("[proplet]\nmetrics_port = \"high\"\n");
    assert_eq!((line.as_str(), key.as_str()), (":2", "metrics_port"));
    assert!(message.contains("expected u16"), "{message}");
    let (line, key, message) = bad("[bootstrap]\nserver = \"s\"\ntoken = 5\n");
    assert_eq!((line.as_str(), key.as_str()), (":3", "bootstrap.token"));
    assert!(message.contains("expected a string"), "{message}");
    let (_, key, message) = bad("[bootstrap]\ntokn = \"t\"\n");
    assert_eq!(key, "bootstrap.tokn");
    assert!(message.contains("unknown field `tokn`"), "{message}");
}

#[test]
fn unknown_keys_are_ignored_outside_the_bootstrap_table() {
    let (_dir, path) = file_with("whatever = 1\nconfig = \"/x\"\n[elsewhere]\nkey = true\n");
    let mut f = base();
    f.config = Some(path);
    assert!(resolve(f).is_ok());
    let (_dir, path) = file_with("[proplet]\nwhatever = 1\n[elsewhere]\nkey = true\n");
    let mut f = base();
    f.config = Some(path);
    assert!(resolve(f).is_ok());
}

#[test]
fn the_flags_keep_only_the_command_line() {
    // Variables reach the configuration through `Config::resolve`'s environment only.
    let flags = Flags::try_from_args(["proplet", "--channel-id", "c"]);
    let flags = flags.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(flags.settings.channel_id.as_deref(), Some("c"));
    assert_eq!(flags.settings.domain_id, None);
    let env = environment(&[
        ("PROPLET_DOMAIN_ID", "d"),
        ("PROPLET_CLIENT_ID", "p"),
        ("PROPLET_CLIENT_KEY", "k"),
    ]);
    let c = Config::resolve(flags, &env).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((c.domain_id.as_str(), c.channel_id.as_str()), ("d", "c"));
}

#[test]
fn enrolled_credentials_come_after_the_environment_and_before_the_file() {
    let state = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let enrolled = crate::credentials::Credentials {
        mqtt_address: "tcp://enrolled:1883".into(),
        tls_ca_cert: None,
        domain_id: "enrolled-d".into(),
        channel_id: "enrolled-c".into(),
        client_id: "enrolled-p".into(),
        client_key: "enrolled-k".into(),
        namespace: "enrolled-ns".into(),
        previous_client_key: None,
        previous_key_until: None,
    };
    crate::credentials::save(state.path(), &enrolled).unwrap_or_else(|e| panic!("{e}"));
    let (_dir, path) = file_with(&format!(
        "state_dir = {:?}\ndomain_id = \"file-d\"\nnamespace = \"file-ns\"\nmqtt_address = \"tcp://file:1\"\n",
        state.path().display().to_string()
    ));
    let flags = Flags {
        config: Some(path),
        ..Flags::default()
    };
    let env = environment(&[("PROPLET_CLIENT_ID", "env-p")]);
    let c = Config::resolve(flags.clone(), &env).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.brokers.to_string(), "tcp://enrolled:1883");
    assert_eq!(
        (
            c.domain_id.as_str(),
            c.client_id.as_str(),
            c.namespace.as_str()
        ),
        ("enrolled-d", "env-p", "enrolled-ns")
    );
    assert_eq!(
        flags.readiness(&env),
        Ok(Readiness::Enrolled(
            state.path().join(crate::credentials::CREDENTIALS_FILE)
        ))
    );
    let env = environment(&[("PROPLET_MQTT_ADDRESS", "tcp://env:2")]);
    let c = Config::resolve(flags, &env).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.brokers.to_string(), "tcp://env:2");
}

#[test]
fn readiness_reads_the_same_layers() {
    let flags = Flags::default();
    let aliases = environment(&[("PROPLET_ENTITY_ID", "p"), ("PROPLET_API_KEY", "k")]);
    assert_eq!(flags.readiness(&aliases), Ok(Readiness::Configured));
    assert_eq!(
        flags.readiness(&environment(&[("PROPLET_CLIENT_ID", "p")])),
        Ok(Readiness::Unconfigured)
    );
    let (_dir, path) = file_with("client_id = \"p\"\n[bootstrap]\nserver = \"mqtts://s\"\n");
    let flags = Flags {
        config: Some(path),
        ..Flags::default()
    };
    let token = environment(&[("PROPLET_BOOTSTRAP_TOKEN", "id.secret")]);
    assert_eq!(
        flags.readiness(&token),
        Ok(Readiness::Bootstrap {
            server: "mqtts://s".into(),
            token: "id.secret".into()
        })
    );
    let key = environment(&[("PROPLET_CLIENT_KEY", "k")]);
    assert_eq!(flags.readiness(&key), Ok(Readiness::Configured));
}
