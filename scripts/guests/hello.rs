//! The smallest WASI 0.2 command component: `rustc --target wasm32-wasip2 -O hello.rs`.
fn main() {
    println!("hello from a component");
}
