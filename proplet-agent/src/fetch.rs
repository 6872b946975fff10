//! Fetching task binaries over HTTP(S), bounded in size and time, optionally pinned by digest.
//!
//! A URL may carry the expected content digest in its fragment, `…/add.wasm#sha256=<hex>`.
//! Fragments are never sent to the server, so the pin works with any HTTP host; a body whose
//! SHA-256 differs is refused.

use std::time::Duration;

use futures_util::StreamExt;
use sha2::{Digest, Sha256};

/// Why a binary could not be fetched.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum FetchError {
    /// The URL or its digest pin is malformed.
    #[error("bad image URL {url}: {reason}")]
    BadUrl {
        /// The URL as given.
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// The request failed or timed out.
    #[error("fetching {url} failed: {reason}")]
    Transport {
        /// The URL (without fragment).
        url: String,
        /// What happened.
        reason: String,
    },
    /// The server answered with an error status.
    #[error("fetching {url} failed: HTTP {status}")]
    Status {
        /// The URL.
        url: String,
        /// The status code.
        status: u16,
    },
    /// The content type is not a Wasm binary.
    #[error("{url} has content type {content_type:?}; expected application/wasm or application/octet-stream")]
    ContentType {
        /// The URL.
        url: String,
        /// What the server sent.
        content_type: String,
    },
    /// The body exceeds the size cap; it is not read further.
    #[error("{url} is {}{size} bytes, above the proplet's module size limit of {limit} bytes (PROPLET_MAX_MODULE_SIZE)", if *at_least { "at least " } else { "" })]
    TooLarge {
        /// The URL.
        url: String,
        /// The announced size, or what arrived before the download stopped.
        size: u64,
        /// Whether `size` is a lower bound (no Content-Length, the body cut short).
        at_least: bool,
        /// The cap.
        limit: u64,
    },
    /// The body's digest is not the pinned one.
    #[error("digest mismatch for {url}: expected sha256:{expected}, got sha256:{actual}")]
    DigestMismatch {
        /// The URL.
        url: String,
        /// Pinned digest (hex).
        expected: String,
        /// Digest of what arrived (hex).
        actual: String,
    },
}

/// An HTTP(S) client for task binaries.
pub struct HttpFetcher {
    client: reqwest::Client,
    max_bytes: u64,
}

/// Splits `url#sha256=<hex>` into the URL to request and the pinned digest.
pub fn split_digest(url: &str) -> Result<(&str, Option<[u8; 32]>), FetchError> {
    let Some((base, fragment)) = url.split_once('#') else {
        return Ok((url, None));
    };
    let bad = |reason: &str| FetchError::BadUrl {
        url: url.to_owned(),
        reason: reason.to_owned(),
    };
    let hex = fragment
        .strip_prefix("sha256=")
        .ok_or_else(|| bad("the fragment must be `sha256=<64 hex digits>`"))?;
    if hex.len() != 64 {
        return Err(bad("a sha256 digest has 64 hex digits"));
    }
    let mut digest = [0u8; 32];
    for (i, byte) in digest.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
            .map_err(|_| bad("the digest is not hexadecimal"))?;
    }
    Ok((base, Some(digest)))
}

/// Lower-case hex of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl HttpFetcher {
    /// A client with a whole-request timeout and a body cap. TLS uses rustls on `ring` with
    /// the Mozilla roots.
    pub fn new(timeout: Duration, max_bytes: u64) -> Result<Self, FetchError> {
        // The agent hosts no other TLS stack; make `ring` the process default once.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .user_agent(concat!("proplet/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| FetchError::Transport {
                url: String::new(),
                reason: e.to_string(),
            })?;
        Ok(Self { client, max_bytes })
    }

    /// Downloads `url`, checking status, content type, size and the digest pin.
    pub async fn fetch(&self, url: &str) -> Result<Vec<u8>, FetchError> {
        let mut body = Vec::new();
        self.stream(url, true, |piece, announced| {
            // Reserve what the server announced (within the cap), so the body is not
            // copied while it grows.
            if body.is_empty() {
                body.reserve(announced);
            }
            body.extend_from_slice(piece);
            Ok(())
        })
        .await?;
        Ok(body)
    }

    /// Downloads `url` into the file `path` (whatever its content type), checking status,
    /// size and the digest pin; the file is removed when a check fails.
    pub async fn download_to(&self, url: &str, path: &std::path::Path) -> Result<(), FetchError> {
        use std::io::Write;
        let (target, _) = split_digest(url)?;
        let write_error = |e: std::io::Error| FetchError::Transport {
            url: target.to_owned(),
            reason: format!("writing {}: {e}", path.display()),
        };
        let mut file = std::io::BufWriter::new(std::fs::File::create(path).map_err(write_error)?);
        let streamed = self
            .stream(url, false, |piece, _| file.write_all(piece))
            .await;
        let flushed = file
            .into_inner()
            .map_err(|e| e.into_error())
            .and_then(|f| f.sync_all());
        let outcome = streamed.and_then(|()| flushed.map_err(write_error));
        if outcome.is_err() {
            let _ = std::fs::remove_file(path);
        }
        outcome
    }

    /// Streams `url`'s body into `sink` (each piece with the announced size), checking
    /// status, content type (`wasm_only`), size and the digest pin.
    async fn stream(
        &self,
        url: &str,
        wasm_only: bool,
        mut sink: impl FnMut(&[u8], usize) -> std::io::Result<()>,
    ) -> Result<(), FetchError> {
        let (target, pinned) = split_digest(url)?;
        let transport = |e: reqwest::Error| FetchError::Transport {
            url: target.to_owned(),
            reason: e.without_url().to_string(),
        };
        let response = self.client.get(target).send().await.map_err(transport)?;
        let status = response.status();
        if !status.is_success() {
            return Err(FetchError::Status {
                url: target.to_owned(),
                status: status.as_u16(),
            });
        }
        if let Some(value) = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .filter(|_| wasm_only)
        {
            let content_type = value.to_str().unwrap_or("").to_ascii_lowercase();
            let acceptable = content_type.is_empty()
                || content_type.contains("application/wasm")
                || content_type.contains("application/octet-stream");
            if !acceptable {
                return Err(FetchError::ContentType {
                    url: target.to_owned(),
                    content_type,
                });
            }
        }
        let too_large = |size: u64, at_least: bool| FetchError::TooLarge {
            url: target.to_owned(),
            size,
            at_least,
            limit: self.max_bytes,
        };
        let announced = response.content_length();
        if let Some(size) = announced.filter(|n| *n > self.max_bytes) {
            return Err(too_large(size, false));
        }
        let announced = announced.unwrap_or(0) as usize;
        let mut hasher = pinned.map(|_| Sha256::new());
        let mut size = 0u64;
        let mut stream = response.bytes_stream();
        while let Some(piece) = stream.next().await {
            let piece = piece.map_err(transport)?;
            size += piece.len() as u64;
            if size > self.max_bytes {
                return Err(too_large(size, true));
            }
            if let Some(hasher) = hasher.as_mut() {
                hasher.update(&piece);
            }
            sink(&piece, announced).map_err(|e| FetchError::Transport {
                url: target.to_owned(),
                reason: e.to_string(),
            })?;
        }
        if let (Some(expected), Some(hasher)) = (pinned, hasher) {
            let actual: [u8; 32] = hasher.finalize().into();
            if actual != expected {
                return Err(FetchError::DigestMismatch {
                    url: target.to_owned(),
                    expected: to_hex(&expected),
                    actual: to_hex(&actual),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_pins_parse_and_bad_ones_are_explained() {
        let hex = "ab".repeat(32);
        let url = format!("https://h/x.wasm#sha256={hex}");
        match split_digest(&url) {
            Ok((base, Some(d))) => {
                assert_eq!(base, "https://h/x.wasm");
                assert_eq!(d, [0xab; 32]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(split_digest("http://h/x"), Ok(("http://h/x", None)));
        assert!(split_digest("http://h/x#md5=00").is_err());
        assert!(split_digest("http://h/x#sha256=zz").is_err());
        assert!(split_digest(&format!("http://h/x#sha256={}", "g".repeat(64))).is_err());
    }
}
