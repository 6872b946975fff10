//! The Wasm runtime on real modules: results, WASI, traps, limits, stop and caching.

use std::time::{Duration, Instant};

use base64::Engine as _;
use proplet_agent::wasm::{Invocation, Limits, RunError, StopFlag, WasmRuntime};

/// The add module of upstream's sample manifests: `main(i32, i32) -> i32`.
const UPSTREAM_ADD_B64: &str = "AGFzbQEAAAABBwFgAn9/AX8DAgEABwgBBG1haW4AAAoJAQcAIAAgAWoL";

fn runtime(limits: Limits) -> WasmRuntime {
    match WasmRuntime::new(limits) {
        Ok(r) => r,
        Err(e) => panic!("{e}"),
    }
}

fn wat(text: &str) -> Vec<u8> {
    match wat::parse_str(text) {
        Ok(b) => b,
        Err(e) => panic!("bad test WAT: {e}"),
    }
}

fn call(rt: &WasmRuntime, bytes: &[u8], inv: Invocation) -> Result<String, RunError> {
    let (compiled, _) = rt.compile(bytes)?;
    rt.run(&compiled, &inv, &StopFlag::default())
        .map(|o| o.output)
}

fn invocation(function: &str, inputs: &[&str]) -> Invocation {
    Invocation {
        function: function.into(),
        inputs: inputs.iter().map(|s| s.to_string()).collect(),
        timeout: Some(Duration::from_secs(5)),
        ..Invocation::default()
    }
}

#[test]
fn upstream_add_sample_returns_42() {
    let rt = runtime(Limits::default());
    let bytes = match base64::engine::general_purpose::STANDARD.decode(UPSTREAM_ADD_B64) {
        Ok(b) => b,
        Err(e) => panic!("{e}"),
    };
    // The task name is not an export, so `main` is used, as upstream does.
    assert_eq!(
        call(&rt, &bytes, invocation("job-task-1", &["10", "32"])),
        Ok("42".to_owned())
    );
}

#[test]
fn typed_parameters_and_results_are_converted() {
    let rt = runtime(Limits::default());
    let module = wat(r#"(module
        (func (export "mul64") (param i64 i64) (result i64) local.get 0 local.get 1 i64.mul)
        (func (export "half") (param f64) (result f64) local.get 0 f64.const 2 f64.div)
        (func (export "noop")))"#);
    assert_eq!(
        call(&rt, &module, invocation("mul64", &["3000000000", "3"])),
        Ok("9000000000".into())
    );
    assert_eq!(
        call(&rt, &module, invocation("half", &["5"])),
        Ok("2.5".into())
    );
    assert_eq!(
        call(&rt, &module, invocation("noop", &[])),
        Ok(String::new())
    );
    let err = call(&rt, &module, invocation("half", &["abc"]));
    assert!(
        matches!(err, Err(RunError::Inputs(ref m)) if m.contains("abc")),
        "{err:?}"
    );
    let err = call(&rt, &module, invocation("half", &[]));
    assert!(matches!(err, Err(RunError::Inputs(_))), "{err:?}");
}

#[test]
fn missing_export_lists_what_exists() {
    let rt = runtime(Limits::default());
    let module = wat(r#"(module (func (export "only_this")))"#);
    match call(&rt, &module, invocation("missing", &[])) {
        Err(RunError::NoExport { available, .. }) => assert!(available.contains("only_this")),
        other => panic!("{other:?}"),
    }
}

const HELLO_WASI: &str = r#"(module
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 16) "hello from wasi\n")
  (func (export "_start")
    ;; iovec at 0: ptr 16, len 16
    (i32.store (i32.const 0) (i32.const 16))
    (i32.store (i32.const 4) (i32.const 16))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))))
"#;

#[test]
fn wasi_command_stdout_is_captured() {
    let rt = runtime(Limits::default());
    let out = call(&rt, &wat(HELLO_WASI), invocation("_start", &[]));
    assert_eq!(out, Ok("hello from wasi\n".into()));
}

#[test]
fn guests_see_only_the_task_environment() {
    let rt = runtime(Limits::default());
    // Reads environ into memory and prints it.
    let module = wat(r#"(module
      (import "wasi_snapshot_preview1" "environ_sizes_get" (func $sizes (param i32 i32) (result i32)))
      (import "wasi_snapshot_preview1" "environ_get" (func $get (param i32 i32) (result i32)))
      (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
      (memory (export "memory") 1)
      (func (export "_start")
        (drop (call $sizes (i32.const 0) (i32.const 4)))
        (drop (call $get (i32.const 64) (i32.const 1024)))
        (i32.store (i32.const 8) (i32.const 1024))
        (i32.store (i32.const 12) (i32.load (i32.const 4)))
        (drop (call $write (i32.const 1) (i32.const 8) (i32.const 1) (i32.const 16)))))"#);
    // The test process has PATH in its environment; the guest must not see it.
    let inv = Invocation {
        env: vec![("ONLY".into(), "this".into())],
        ..invocation("_start", &[])
    };
    let out = match call(&rt, &module, inv) {
        Ok(o) => o,
        Err(e) => panic!("{e}"),
    };
    assert!(out.contains("ONLY=this"), "{out:?}");
    assert!(!out.contains("PATH="), "agent environment leaked: {out:?}");
}

#[test]
fn traps_are_reported() {
    let rt = runtime(Limits::default());
    let module = wat(r#"(module (func (export "boom") unreachable))"#);
    match call(&rt, &module, invocation("boom", &[])) {
        Err(RunError::Trap(m)) => assert!(m.contains("unreachable"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn undecodable_modules_are_refused() {
    let rt = runtime(Limits::default());
    let err = rt.compile(b"\0asm\x01\0\0\0garbage").err();
    assert!(matches!(err, Some(RunError::Compile(_))), "{err:?}");
    let err = rt.compile(b"not wasm at all").err();
    assert!(matches!(err, Some(RunError::Compile(_))), "{err:?}");
}

const SPIN: &str = r#"(module (func (export "spin") (loop $l (br $l))))"#;

#[test]
fn infinite_loop_hits_the_time_limit() {
    let rt = runtime(Limits::default());
    let inv = Invocation {
        timeout: Some(Duration::from_millis(200)),
        ..invocation("spin", &[])
    };
    let started = Instant::now();
    let err = call(&rt, &wat(SPIN), inv);
    assert!(matches!(err, Err(RunError::TimedOut(_))), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn stop_interrupts_a_running_loop() {
    let rt = std::sync::Arc::new(runtime(Limits::default()));
    let (compiled, _) = match rt.compile(&wat(SPIN)) {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    };
    let stop = StopFlag::default();
    let worker = {
        let (rt, stop) = (rt.clone(), stop.clone());
        std::thread::spawn(move || {
            let inv = Invocation {
                timeout: None,
                ..invocation("spin", &[])
            };
            rt.run(&compiled, &inv, &stop)
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    stop.stop();
    match worker.join() {
        Ok(result) => assert_eq!(result.map(|o| o.output), Err(RunError::Stopped)),
        Err(_) => panic!("worker panicked"),
    }
}

#[test]
fn memory_bomb_hits_the_memory_cap() {
    let rt = runtime(Limits {
        max_memory_bytes: 4 * 1024 * 1024,
        ..Limits::default()
    });
    let module = wat(r#"(module (memory 1)
        (func (export "bomb") (result i32)
          (loop $grow (br_if $grow (i32.ne (memory.grow (i32.const 16)) (i32.const -1))))
          (i32.const 0)))"#);
    let err = call(&rt, &module, invocation("bomb", &[]));
    assert!(matches!(err, Err(RunError::MemoryLimit(_))), "{err:?}");
}

#[test]
fn fuel_budget_stops_runaway_work() {
    let rt = runtime(Limits {
        fuel: Some(10_000),
        ..Limits::default()
    });
    let err = call(&rt, &wat(SPIN), invocation("spin", &[]));
    assert!(matches!(err, Err(RunError::OutOfFuel(10_000))), "{err:?}");
}

#[test]
fn repeated_modules_come_from_the_cache() {
    let rt = runtime(Limits::default());
    let module = wat(SPIN);
    let first = rt.compile(&module).map(|(_, cached)| cached);
    let second = rt.compile(&module).map(|(_, cached)| cached);
    assert_eq!((first, second), (Ok(false), Ok(true)));
}

#[test]
fn nonzero_exit_status_is_an_error_with_stderr() {
    let rt = runtime(Limits::default());
    let module = wat(r#"(module
      (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
      (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
      (memory (export "memory") 1)
      (data (i32.const 16) "bad input")
      (func (export "_start")
        (i32.store (i32.const 0) (i32.const 16))
        (i32.store (i32.const 4) (i32.const 9))
        (drop (call $w (i32.const 2) (i32.const 0) (i32.const 1) (i32.const 8)))
        (call $exit (i32.const 3))))"#);
    match call(&rt, &module, invocation("_start", &[])) {
        Err(RunError::Exit { code, stderr }) => {
            assert_eq!(code, 3);
            assert_eq!(stderr, "bad input");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn compiled_modules_survive_a_restart_through_the_disk_cache() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let limits = Limits {
        disk_cache: Some(dir.path().join("modules")),
        ..Limits::default()
    };
    let module = wat(r#"(module (func (export "seven") (result i32) i32.const 7))"#);
    let first = runtime(limits.clone());
    assert_eq!(first.compile(&module).map(|(_, cached)| cached), Ok(false));
    drop(first);
    // A new runtime (an agent restart) loads the module from disk instead of compiling.
    let second = runtime(limits.clone());
    let (compiled, cached) = second.compile(&module).unwrap_or_else(|e| panic!("{e}"));
    assert!(cached);
    let out = second.run(&compiled, &invocation("seven", &[]), &StopFlag::default());
    assert_eq!(out.map(|o| o.output), Ok("7".to_owned()));
    // The loaded module maps its file; release it before damaging the file below.
    drop(compiled);
    drop(second);

    // A damaged cache file is discarded and the module compiled again.
    let files: Vec<_> = std::fs::read_dir(dir.path().join("modules"))
        .unwrap_or_else(|e| panic!("{e}"))
        .filter_map(Result::ok)
        .collect();
    assert_eq!(files.len(), 1);
    std::fs::write(files[0].path(), b"garbage").unwrap_or_else(|e| panic!("{e}"));
    let third = runtime(limits);
    assert_eq!(third.compile(&module).map(|(_, cached)| cached), Ok(false));
}

/// Returns the WASI errno of `fd_prestat_get(3)`: 0 when a directory is preopened.
const PRESTAT: &str = r#"(module
  (import "wasi_snapshot_preview1" "fd_prestat_get" (func $prestat (param i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "check") (result i32) (call $prestat (i32.const 3) (i32.const 16))))"#;

#[test]
fn directories_are_preopened_only_from_the_allow_list() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let allowed = dir.path().join("data");
    std::fs::create_dir_all(&allowed).unwrap_or_else(|e| panic!("{e}"));
    let rt = runtime(Limits {
        preopen_allow_list: vec![allowed.clone()],
        ..Limits::default()
    });
    let module = wat(PRESTAT);
    // No directory unless asked for: fd 3 does not exist (EBADF = 8).
    assert_eq!(call(&rt, &module, invocation("check", &[])), Ok("8".into()));
    let granted = Invocation {
        preopens: vec![allowed],
        ..invocation("check", &[])
    };
    assert_eq!(call(&rt, &module, granted), Ok("0".into()));
    let outside = Invocation {
        preopens: vec![dir.path().to_owned()],
        ..invocation("check", &[])
    };
    assert!(matches!(
        call(&rt, &module, outside),
        Err(RunError::PreopenDenied(_))
    ));
}
