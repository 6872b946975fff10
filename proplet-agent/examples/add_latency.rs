//! Cold (compile + run) and warm (cached module) latency of upstream's add(10, 32) sample on
//! this machine's Wasm runtime, as the agent runs it.
//!
//! `cargo run --profile release-agent -p proplet-agent --example add_latency`

use std::time::{Duration, Instant};

use base64::Engine as _;
use proplet_agent::wasm::{Invocation, Limits, StopFlag, WasmRuntime};

const ADD_B64: &str = "AGFzbQEAAAABBwFgAn9/AX8DAgEABwgBBG1haW4AAAoJAQcAIAAgAWoL";

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let bytes = base64::engine::general_purpose::STANDARD.decode(ADD_B64)?;
    let invocation = Invocation {
        function: "add".into(),
        inputs: vec!["10".into(), "32".into()],
        timeout: Some(Duration::from_secs(5)),
        ..Invocation::default()
    };
    let stop = StopFlag::default();

    let mut cold = Vec::new();
    for _ in 0..20 {
        // A fresh runtime has an empty module cache, so this includes compilation.
        let runtime = WasmRuntime::new(Limits::default())?;
        let started = Instant::now();
        let (compiled, cached) = runtime.compile(&bytes)?;
        let outcome = runtime.run(&compiled, &invocation, &stop)?;
        cold.push(started.elapsed());
        anyhow::ensure!(!cached && outcome.output == "42", "unexpected {outcome:?}");
    }

    let runtime = WasmRuntime::new(Limits::default())?;
    runtime.compile(&bytes)?;
    let mut warm = Vec::new();
    for _ in 0..1000 {
        let started = Instant::now();
        let (compiled, cached) = runtime.compile(&bytes)?;
        let outcome = runtime.run(&compiled, &invocation, &stop)?;
        warm.push(started.elapsed());
        anyhow::ensure!(cached && outcome.output == "42", "unexpected {outcome:?}");
    }
    println!("add(10, 32) = 42");
    println!(
        "cold (compile + instantiate + call), median of 20: {:?}",
        median(cold)
    );
    println!(
        "warm (cached module), median of 1000:              {:?}",
        median(warm)
    );
    Ok(())
}
