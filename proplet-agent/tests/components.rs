//! Components (WASI 0.2) on the runtime: upstream's sample components with the results
//! upstream's proplet gives, WAVE inputs and results, the HAL, and the same limits and stop
//! as core modules, on components written in component-model text.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use proplet_agent::component::is_command_name;
use proplet_agent::hal::NO_TEE;
use proplet_agent::wasm::{is_component, Invocation, Limits, RunError, StopFlag, WasmRuntime};

fn runtime(limits: Limits) -> WasmRuntime {
    match WasmRuntime::new(limits) {
        Ok(r) => r,
        Err(e) => panic!("{e}"),
    }
}

/// The Wasm binary inlined in one of upstream's sample Task manifests (kept in the repository).
fn sample(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/upstream-samples")
        .join(format!("propeller_v1_task_{name}.yaml"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let line = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("file:"))
        .unwrap_or_else(|| panic!("{} has no file", path.display()));
    let encoded = line.trim().trim_matches('"');
    base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn wat(text: &str) -> Vec<u8> {
    wat::parse_str(text).unwrap_or_else(|e| panic!("bad test WAT: {e}"))
}

fn invocation(function: &str, inputs: &[&str]) -> Invocation {
    Invocation {
        function: function.into(),
        inputs: inputs.iter().map(|s| s.to_string()).collect(),
        timeout: Some(Duration::from_secs(10)),
        ..Invocation::default()
    }
}

fn call(rt: &WasmRuntime, bytes: &[u8], inv: &Invocation) -> Result<String, RunError> {
    let (compiled, _) = rt.compile(bytes)?;
    rt.run(&compiled, inv, &StopFlag::default())
        .map(|o| o.output)
}

/// Exports for WAVE numbers, an `instance#func` path, a spin, a trap and a memory bomb.
const ARITHMETIC: &str = r#"(component
  (core module $m
    (func (export "add") (param i32 i32) (result i32) local.get 0 local.get 1 i32.add)
    (func (export "neg") (param f64) (result f64) local.get 0 f64.neg)
    (func (export "spin") (loop $l (br $l)))
    (func (export "trap") unreachable)
    (memory (export "memory") 1)
    (func (export "grow") (result i32) (memory.grow (i32.const 100000))))
  (core instance $i (instantiate $m))
  (func (export "add") (param "a" s32) (param "b" s32) (result s32) (canon lift (core func $i "add")))
  (func (export "neg") (param "x" f64) (result f64) (canon lift (core func $i "neg")))
  (func (export "spin") (canon lift (core func $i "spin")))
  (func (export "trap") (canon lift (core func $i "trap")))
  (func (export "grow") (result s32) (canon lift (core func $i "grow")))
  (instance $math (export "add" (func 0)))
  (export "math" (instance $math)))"#;

#[test]
fn component_headers_are_told_from_core_modules() {
    assert!(is_component(&sample("string_input")));
    assert!(is_component(&wat(ARITHMETIC)));
    assert!(!is_component(&wat("(module)")));
    assert!(is_command_name("_start") && is_command_name("fl-round-3") && is_command_name(""));
    assert!(!is_command_name("greet"));
}

#[test]
fn upstream_string_input_sample_greets_in_wave() {
    let rt = runtime(Limits::default());
    let bytes = sample("string_input");
    assert_eq!(
        call(&rt, &bytes, &invocation("greet", &["\"John Doe\""])),
        Ok("\"Hello, John Doe!\"".to_owned())
    );
    let Err(RunError::Inputs(message)) = call(&rt, &bytes, &invocation("greet", &["John"])) else {
        panic!("an unquoted string is not WAVE")
    };
    assert!(message.contains("input #1 (name)"), "{message}");
    let Err(RunError::NoExport { available, .. }) = call(&rt, &bytes, &invocation("hello", &[]))
    else {
        panic!("hello is not exported")
    };
    assert!(available.contains("greet"), "{available}");
}

#[test]
fn wave_values_and_export_paths() {
    let rt = runtime(Limits::default());
    let bytes = wat(ARITHMETIC);
    assert_eq!(
        call(&rt, &bytes, &invocation("add", &["40", "2"])),
        Ok("42".into())
    );
    assert_eq!(
        call(&rt, &bytes, &invocation("neg", &["1.5"])),
        Ok("-1.5".into())
    );
    assert_eq!(
        call(&rt, &bytes, &invocation("math#add", &["-1", "1"])),
        Ok("0".into())
    );
    let Err(RunError::Inputs(m)) = call(&rt, &bytes, &invocation("add", &["1"])) else {
        panic!("one input for two parameters")
    };
    assert!(m.contains("2 parameter(s), 1 input(s)"), "{m}");
    let Err(RunError::Inputs(m)) = call(&rt, &bytes, &invocation("add", &["1", "\"two\""])) else {
        panic!("a string for an s32")
    };
    assert!(m.contains("input #2 (b)"), "{m}");
    // A command name on a component without `wasi:cli/run` says what to do instead.
    let Err(RunError::NotACommand(exports)) = call(&rt, &bytes, &invocation("_start", &[])) else {
        panic!("not a command")
    };
    assert!(
        exports.contains("add") && exports.contains("math"),
        "{exports}"
    );
}

#[test]
fn component_limits_match_core_modules() {
    let rt = runtime(Limits {
        max_memory_bytes: 16 * 1024 * 1024,
        ..Limits::default()
    });
    let bytes = wat(ARITHMETIC);
    let mut short = invocation("spin", &[]);
    short.timeout = Some(Duration::from_millis(200));
    assert_eq!(
        call(&rt, &bytes, &short),
        Err(RunError::TimedOut(Duration::from_millis(200)))
    );
    let Err(RunError::Trap(m)) = call(&rt, &bytes, &invocation("trap", &[])) else {
        panic!("unreachable traps")
    };
    assert!(m.contains("unreachable"), "{m}");
    // memory.grow past the cap fails for the guest (the module sees -1), as for core modules.
    let grown = call(&rt, &bytes, &invocation("grow", &[]));
    assert!(
        matches!(grown, Err(RunError::MemoryLimit(_))) || grown == Ok("-1".into()),
        "{grown:?}"
    );
}

#[test]
fn a_spinning_component_stops_within_100_ms() {
    let rt = Arc::new(runtime(Limits::default()));
    let Ok((compiled, _)) = rt.compile(&wat(ARITHMETIC)) else {
        panic!("compile")
    };
    let stop = StopFlag::default();
    let mut inv = invocation("spin", &[]);
    inv.timeout = None;
    let (runner, flag) = (rt.clone(), stop.clone());
    let handle = std::thread::spawn(move || runner.run(&compiled, &inv, &flag));
    std::thread::sleep(Duration::from_millis(300));
    let asked = Instant::now();
    stop.stop();
    let outcome = handle.join().unwrap_or_else(|_| panic!("runner panicked"));
    let took = asked.elapsed();
    assert_eq!(outcome.map(|o| o.output), Err(RunError::Stopped));
    assert!(took < Duration::from_millis(100), "stop took {took:?}");
}

#[test]
fn upstream_filesystem_sample_uses_the_allowed_directory() {
    // The sample writes and reads back a file under `/tmp`, as the manifest's comment says
    // (`PROPLET_DIRS=/tmp`); the guest sees a directory at the same path as the host.
    let tmp = PathBuf::from("/tmp");
    let rt = runtime(Limits {
        preopen_allow_list: vec![tmp.clone()],
        ..Limits::default()
    });
    let bytes = sample("filesystem");
    let mut inv = invocation("_start", &[]);
    inv.preopens = vec![tmp.clone()];
    // The guest deletes its file itself ("Delete OK").
    let output = call(&rt, &bytes, &inv).unwrap_or_else(|e| panic!("{e}"));
    println!("filesystem sample said:\n{output}");
    assert!(
        output.contains("Read back") && output.contains("Delete OK"),
        "{output}"
    );
    // Without the directory the guest cannot write; it fails with its own message.
    inv.preopens.clear();
    let Err(RunError::Trap(message)) = call(&rt, &bytes, &inv) else {
        panic!("no /tmp, no file")
    };
    assert!(
        message.contains("stderr:"),
        "the guest's panic message is kept: {message}"
    );
    // Outside the allow-list, nothing is opened.
    // (Refused before anything is opened, so the path need not exist.)
    inv.preopens = vec![PathBuf::from("/srv/propeller-not-allowed")];
    assert!(matches!(
        call(&rt, &bytes, &inv),
        Err(RunError::PreopenDenied(_))
    ));
}

#[test]
fn upstream_hal_samples_run_on_a_plain_host() {
    let rt = runtime(Limits::default());
    let output = call(&rt, &sample("hal_test"), &invocation("run-hal-test", &[]))
        .unwrap_or_else(|e| panic!("{e}"));
    println!("hal_test said: {output}");
    assert!(
        output.starts_with('"') && output.ends_with('"'),
        "a WAVE string: {output}"
    );
    assert!(
        output.contains(&format!(
            "platform-info: type={}-{}",
            std::env::consts::OS,
            std::env::consts::ARCH
        )),
        "{output}"
    );
    assert!(output.contains("sha256(hello)=2cf24dba"), "{output}");
    let output = call(
        &rt,
        &sample("attestation_test"),
        &invocation("run-attestation", &[]),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    println!("attestation_test said: {output}");
    assert!(output.contains(NO_TEE), "{output}");
}

/// Builds `tests/guests/http-get` (a WASI 0.2 command making one `wasi:http` GET) from source.
fn http_get_guest() -> Vec<u8> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let target_dir = root.join("target/guests");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = std::process::Command::new(cargo)
        .args([
            "build",
            "--quiet",
            "--release",
            "--target",
            "wasm32-wasip2",
            "--manifest-path",
        ])
        .arg(root.join("tests/guests/http-get/Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir)
        .status()
        .unwrap_or_else(|e| panic!("cargo: {e}"));
    assert!(
        status.success(),
        "building the guest failed (is the target installed? rustup target add wasm32-wasip2)"
    );
    let wasm = target_dir.join("wasm32-wasip2/release/http-get-guest.wasm");
    std::fs::read(&wasm).unwrap_or_else(|e| panic!("{}: {e}", wasm.display()))
}

/// Answers every request on 127.0.0.1 with `body` until the test process ends.
fn serve(body: &'static str) -> u16 {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
    let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let mut request = [0u8; 4096];
            let _ = stream.read(&mut request);
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    port
}

#[test]
fn outgoing_wasi_http_follows_the_agents_policy() {
    let guest = http_get_guest();
    assert!(is_component(&guest));
    let port = serve("hello over wasi:http");
    let mut inv = invocation("_start", &[]);
    inv.env = vec![(
        "TARGET_URL".into(),
        format!("http://127.0.0.1:{port}/hello"),
    )];
    let open = runtime(Limits::default());
    assert_eq!(
        call(&open, &guest, &inv),
        Ok("status 200\nhello over wasi:http\n".to_owned())
    );
    // A host outside the allow-list is refused before any connection is made.
    let strict = runtime(Limits {
        outgoing_http: proplet_agent::component::OutgoingHttp {
            allow_hosts: vec!["*.example.com".into()],
            ..Default::default()
        },
        ..Limits::default()
    });
    let Err(RunError::Exit { code: 1, stderr }) = call(&strict, &guest, &inv) else {
        panic!("the request should be denied")
    };
    assert!(stderr.contains("HttpRequestDenied"), "{stderr}");
}

#[test]
fn host_rules_match_names_and_subdomains() {
    let policy = proplet_agent::component::OutgoingHttp {
        allow_hosts: vec!["api.example.com".into(), "*.example.org".into()],
        ..Default::default()
    };
    assert!(policy.allows("api.example.com") && policy.allows("API.example.com"));
    assert!(policy.allows("a.b.example.org"));
    assert!(!policy.allows("example.org") && !policy.allows("evil-example.org"));
    assert!(!policy.allows("example.com") && !policy.allows("127.0.0.1"));
    assert!(proplet_agent::component::OutgoingHttp::default().allows("anything"));
}
