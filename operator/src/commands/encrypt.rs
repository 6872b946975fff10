//! `propeller encrypt`: seals a Wasm module or component for an encrypted task, under a
//! 32-byte key that the Key Broker Service then holds at the task's `kbsResourcePath`.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use propeller_broker::private_file::write_private;
use propeller_broker::protocol::encrypted_module::{self, KEY_LEN};
use sha2::{Digest, Sha256};

/// What `propeller encrypt` is given.
#[derive(clap::Args, Debug)]
pub struct EncryptArgs {
    /// The Wasm module or component to encrypt.
    pub module: PathBuf,
    /// The key: a file of 32 raw bytes (what you put in the Key Broker Service).
    #[arg(long)]
    pub key: PathBuf,
    /// Make a new random key and write it to --key (mode 0600); refused if that file exists.
    #[arg(long)]
    pub new_key: bool,
    /// Where the encrypted module goes.
    #[arg(short = 'o', long)]
    pub out: PathBuf,
}

fn new_key(path: &Path) -> anyhow::Result<[u8; KEY_LEN]> {
    if path.exists() {
        bail!(
            "{} exists; drop --new-key to encrypt with it, or name another file",
            path.display()
        );
    }
    let mut key = [0u8; KEY_LEN];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut key))
        .context("reading /dev/urandom")?;
    write_private(path, &key)?;
    Ok(key)
}

/// Runs `propeller encrypt`; prints the output's SHA-256 (for an `imageUrl`'s `#sha256=` pin).
pub fn run(args: &EncryptArgs) -> anyhow::Result<()> {
    let module = std::fs::read(&args.module)
        .with_context(|| format!("reading {}", args.module.display()))?;
    if encrypted_module::is_encrypted(&module) {
        bail!("{} is already encrypted", args.module.display());
    }
    if !module.starts_with(b"\0asm") {
        bail!(
            "{} is not a Wasm binary (it does not start with \\0asm); compile it first (a .wat text module: `wasm-tools parse`)",
            args.module.display()
        );
    }
    let key = if args.new_key {
        zeroize::Zeroizing::new(new_key(&args.key)?.to_vec())
    } else {
        zeroize::Zeroizing::new(
            std::fs::read(&args.key)
                .with_context(|| format!("reading the key {}", args.key.display()))?,
        )
    };
    let sealed = encrypted_module::seal(&key, &module)
        .with_context(|| format!("the key in {}", args.key.display()))?;
    let partial = args.out.with_extension("partial");
    std::fs::write(&partial, &sealed).with_context(|| format!("writing {}", partial.display()))?;
    std::fs::rename(&partial, &args.out)
        .with_context(|| format!("writing {}", args.out.display()))?;
    let digest: String = Sha256::digest(&sealed)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    println!(
        "wrote {} ({} bytes, sha256 {digest})",
        args.out.display(),
        sealed.len()
    );
    Ok(())
}
