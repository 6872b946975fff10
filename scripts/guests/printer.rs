//! A guest that prints flat out, for `scripts/bench-logs.sh --one-device`, which builds it:
//! `rustc --target wasm32-wasip1 --crate-type cdylib -O printer.rs`.
//! Its export `print(count)` writes `line 0` .. `line count` to stdout, one line each, and
//! returns `count`.
use std::io::Write;

#[no_mangle]
pub extern "C" fn print(count: u32) -> u32 {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for i in 0..=count {
        // A line at a time, as a chatty program writes (no buffering past the newline).
        let _ = writeln!(out, "line {i}");
        let _ = out.flush();
    }
    count
}
