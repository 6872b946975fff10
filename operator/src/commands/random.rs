//! Random secrets for the commands: the standalone API token, the demo device's key.

use std::io::Read;

use anyhow::Context;

/// `bytes` random bytes from the kernel, as lowercase hex.
pub(crate) fn random_hex(bytes: usize) -> anyhow::Result<String> {
    let mut buf = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .context("reading /dev/urandom")?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}
