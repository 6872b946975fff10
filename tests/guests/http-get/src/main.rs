//! GETs `$TARGET_URL` (`http://authority/path`) through `wasi:http/outgoing-handler` and
//! prints the status and body, or writes `error <code>` to stderr and exits 1.

use wasi::http::outgoing_handler;
use wasi::http::types::{Fields, OutgoingRequest, Scheme};

fn main() {
    let url = std::env::var("TARGET_URL").unwrap_or_default();
    let rest = url.strip_prefix("http://").unwrap_or(&url);
    let (authority, path) = match rest.split_once('/') {
        Some((a, p)) => (a.to_owned(), format!("/{p}")),
        None => (rest.to_owned(), "/".to_owned()),
    };
    let request = OutgoingRequest::new(Fields::new());
    let _ = request.set_scheme(Some(&Scheme::Http));
    let _ = request.set_authority(Some(&authority));
    let _ = request.set_path_with_query(Some(&path));
    let pending = match outgoing_handler::handle(request, None) {
        Ok(pending) => pending,
        Err(code) => fail(&format!("{code:?}")),
    };
    pending.subscribe().block();
    let response = match pending.get() {
        Some(Ok(Ok(response))) => response,
        Some(Ok(Err(code))) => fail(&format!("{code:?}")),
        _ => fail("no response"),
    };
    println!("status {}", response.status());
    let Ok(body) = response.consume() else { fail("no body") };
    let Ok(stream) = body.stream() else { fail("no body stream") };
    let mut bytes = Vec::new();
    while let Ok(chunk) = stream.blocking_read(64 * 1024) {
        bytes.extend(chunk);
    }
    println!("{}", String::from_utf8_lossy(&bytes));
}

fn fail(why: &str) -> ! {
    eprintln!("error {why}");
    std::process::exit(1)
}
