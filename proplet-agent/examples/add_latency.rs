//! Cold (compile + run) and warm (cached module) latency of upstream's add(10, 32) sample, of a
//! WASI "hello" command, of upstream's `greet` component (a custom export with a WAVE string)
//! and, given one, of a command component, on this machine's Wasm runtime as the agent runs them.
//!
//! `cargo run --profile release-agent -p proplet-agent --example add_latency`
//! (`-- --hello-base64` prints the WASI command's module instead, for task manifests;
//! `HELLO_COMPONENT=path.wasm` adds a command component printing "hello from a component").

use std::time::{Duration, Instant};

use base64::Engine as _;
use proplet_agent::wasm::{Invocation, Limits, StopFlag, WasmRuntime};

const ADD_B64: &str = "AGFzbQEAAAABBwFgAn9/AX8DAgEABwgBBG1haW4AAAoJAQcAIAAgAWoL";

/// A WASI command that prints one line.
const HELLO_WAT: &str = r#"(module
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 16) "hello from wasi\n")
  (func (export "_start")
    (i32.store (i32.const 0) (i32.const 16))
    (i32.store (i32.const 4) (i32.const 16))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))))"#;

/// Median cold (fresh runtime, so compiled) and warm (cached) latency of running `bytes`.
fn measure(
    bytes: &[u8],
    invocation: &Invocation,
    expected: &str,
) -> anyhow::Result<(Duration, Duration)> {
    let stop = StopFlag::default();
    let mut cold = Vec::new();
    for _ in 0..20 {
        let runtime = WasmRuntime::new(Limits::default())?;
        let started = Instant::now();
        let (compiled, cached) = runtime.compile(bytes)?;
        let outcome = runtime.run(&compiled, invocation, &stop)?;
        cold.push(started.elapsed());
        anyhow::ensure!(
            !cached && outcome.output == expected,
            "unexpected {outcome:?}"
        );
    }
    let runtime = WasmRuntime::new(Limits::default())?;
    runtime.compile(bytes)?;
    let mut warm = Vec::new();
    let mut run_only = Vec::new();
    for _ in 0..1000 {
        let started = Instant::now();
        let (compiled, cached) = runtime.compile(bytes)?;
        let running = Instant::now();
        let outcome = runtime.run(&compiled, invocation, &stop)?;
        run_only.push(running.elapsed());
        warm.push(started.elapsed());
        anyhow::ensure!(
            cached && outcome.output == expected,
            "unexpected {outcome:?}"
        );
    }
    println!(
        "  (warm run alone, the cache lookup by SHA-256 of {} bytes aside: median {:?})",
        bytes.len(),
        median(run_only)
    );
    Ok((median(cold), median(warm)))
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn main() -> anyhow::Result<()> {
    // The agent runs guests on its Tokio runtime's blocking threads, where WASI 0.2's host
    // calls find that runtime; measure in the same context.
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let _context = (std::env::var_os("NO_TOKIO").is_none()).then(|| tokio.enter());
    if std::env::args().any(|a| a == "--greet-base64") {
        let greet = greet_component()?;
        println!(
            "{}",
            base64::engine::general_purpose::STANDARD.encode(greet)
        );
        return Ok(());
    }
    if std::env::args().any(|a| a == "--hello-base64") {
        // For scripts that submit the same command as a task.
        let hello = wat::parse_str(HELLO_WAT)?;
        println!(
            "{}",
            base64::engine::general_purpose::STANDARD.encode(hello)
        );
        return Ok(());
    }
    let bytes = base64::engine::general_purpose::STANDARD.decode(ADD_B64)?;
    let invocation = Invocation {
        function: "add".into(),
        inputs: vec!["10".into(), "32".into()],
        timeout: Some(Duration::from_secs(5)),
        ..Invocation::default()
    };
    let (cold, warm) = measure(&bytes, &invocation, "42")?;
    println!("add(10, 32) = 42");
    println!("cold (compile + instantiate + call), median of 20: {cold:?}");
    println!("warm (cached module), median of 1000:              {warm:?}");

    let hello = wat::parse_str(HELLO_WAT)?;
    let start = Invocation {
        function: "_start".into(),
        timeout: Some(Duration::from_secs(5)),
        ..Invocation::default()
    };
    let (cold, warm) = measure(&hello, &start, "hello from wasi\n")?;
    println!("WASI hello command prints \"hello from wasi\"");
    println!("cold (compile + instantiate + run), median of 20:  {cold:?}");
    println!("warm (cached module), median of 1000:              {warm:?}");

    let greet = greet_component()?;
    let call = Invocation {
        function: "greet".into(),
        inputs: vec!["\"John Doe\"".into()],
        timeout: Some(Duration::from_secs(5)),
        ..Invocation::default()
    };
    let (cold, warm) = measure(&greet, &call, "\"Hello, John Doe!\"")?;
    println!(
        "component custom export greet(\"John Doe\") = \"Hello, John Doe!\" (upstream's sample)"
    );
    println!("cold (compile + instantiate + call), median of 20: {cold:?}");
    println!("warm (cached component), median of 1000:           {warm:?}");

    if let Ok(path) = std::env::var("HELLO_COMPONENT") {
        let bytes = std::fs::read(&path)?;
        let (cold, warm) = measure(&bytes, &start, "hello from a component\n")?;
        println!("command component (wasi:cli/run) prints \"hello from a component\"");
        println!("cold (compile + instantiate + run), median of 20:  {cold:?}");
        println!("warm (cached component), median of 1000:           {warm:?}");
    }
    Ok(())
}

/// The component inlined in upstream's `propeller_v1_task_string_input.yaml`.
fn greet_component() -> anyhow::Result<Vec<u8>> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/upstream-samples/propeller_v1_task_string_input.yaml"
    );
    let text = std::fs::read_to_string(path)?;
    let encoded = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("file:"))
        .ok_or_else(|| anyhow::anyhow!("{path} has no file"))?;
    Ok(base64::engine::general_purpose::STANDARD.decode(encoded.trim().trim_matches('"'))?)
}
