//! The on-disk, content-addressed store of pulled Wasm layers, bounded in size (least
//! recently used first out), and the index from the names devices ask for to layer digests.
//!
//! Layout under the cache directory: `blobs/sha256/<hex>` (the bytes, named by their
//! digest), `names/<sha256 of the name>` (the layer digest a pinned reference resolves to),
//! `tmp/` (pulls in progress, renamed into `blobs/` once verified). Use time is the file's
//! modification time, so the order survives restarts. Every read re-checks the digest: a
//! damaged file is deleted and pulled again.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use sha2::{Digest, Sha256};

/// Why the cache could not do something.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// The digest is not `sha256:<64 hex>`.
    #[error("unsupported digest {0:?} (only sha256 is cached)")]
    Digest(String),
    /// The file system refused.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> CacheError + '_ {
    move |source| CacheError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Lower-case hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The hex part of a `sha256:` digest, checked.
fn hex_of(digest: &str) -> Result<&str, CacheError> {
    digest
        .strip_prefix("sha256:")
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| CacheError::Digest(digest.to_owned()))
}

/// A size-capped blob store in one directory. Its methods do blocking file I/O.
#[derive(Debug)]
pub struct BlobCache {
    dir: PathBuf,
    cap_bytes: u64,
}

impl BlobCache {
    /// Opens (creating) the cache in `dir`, keeping at most `cap_bytes` of blobs, and removes
    /// pulls a previous process left unfinished.
    pub fn open(dir: &Path, cap_bytes: u64) -> Result<Self, CacheError> {
        for sub in ["blobs/sha256", "names", "tmp"] {
            let path = dir.join(sub);
            fs::create_dir_all(&path).map_err(io_at(&path))?;
        }
        let tmp = dir.join("tmp");
        if let Ok(entries) = fs::read_dir(&tmp) {
            for entry in entries.flatten() {
                let _ = fs::remove_file(entry.path());
            }
        }
        Ok(Self {
            dir: dir.to_owned(),
            cap_bytes,
        })
    }

    fn blob_path(&self, digest: &str) -> Result<PathBuf, CacheError> {
        Ok(self.dir.join("blobs/sha256").join(hex_of(digest)?))
    }

    fn name_path(&self, name: &str) -> PathBuf {
        self.dir.join("names").join(sha256_hex(name.as_bytes()))
    }

    /// A new file for a pull in progress, to hand to [`BlobCache::commit`] once complete.
    pub fn scratch(&self) -> Result<tempfile::NamedTempFile, CacheError> {
        let tmp = self.dir.join("tmp");
        tempfile::NamedTempFile::new_in(&tmp).map_err(io_at(&tmp))
    }

    /// The blob's bytes if cached and intact; marks it used.
    pub fn get(&self, digest: &str) -> Result<Option<Vec<u8>>, CacheError> {
        let path = self.blob_path(digest)?;
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_at(&path)(e)),
        };
        if sha256_hex(&bytes) != hex_of(digest)? {
            tracing::warn!(digest, "cached blob is damaged; it will be pulled again");
            let _ = fs::remove_file(&path);
            return Ok(None);
        }
        touch(&path);
        Ok(Some(bytes))
    }

    /// The first `n` bytes of a cached blob (fewer if it is shorter), without reading or
    /// hashing the rest.
    pub fn head(&self, digest: &str, n: usize) -> Result<Option<Vec<u8>>, CacheError> {
        use std::io::Read;
        let path = self.blob_path(digest)?;
        let file = match fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_at(&path)(e)),
        };
        let mut head = Vec::with_capacity(n);
        file.take(n as u64)
            .read_to_end(&mut head)
            .map_err(io_at(&path))?;
        Ok(Some(head))
    }

    /// Whether the blob is cached (without reading it).
    pub fn contains(&self, digest: &str) -> bool {
        self.blob_path(digest).is_ok_and(|p| p.is_file())
    }

    /// Moves a verified pull into the store under `digest`, then evicts the least recently
    /// used other blobs until the total fits the cap.
    pub fn commit(&self, file: tempfile::NamedTempFile, digest: &str) -> Result<(), CacheError> {
        let path = self.blob_path(digest)?;
        file.persist(&path).map_err(|e| io_at(&path)(e.error))?;
        touch(&path);
        self.evict(&path)
    }

    fn evict(&self, keep: &Path) -> Result<(), CacheError> {
        let dir = self.dir.join("blobs/sha256");
        let mut blobs: Vec<(SystemTime, u64, PathBuf)> = fs::read_dir(&dir)
            .map_err(io_at(&dir))?
            .flatten()
            .filter_map(|e| {
                let meta = e.metadata().ok()?;
                Some((meta.modified().ok()?, meta.len(), e.path()))
            })
            .collect();
        let mut total: u64 = blobs.iter().map(|(_, len, _)| len).sum();
        blobs.sort();
        for (_, len, path) in blobs {
            if total <= self.cap_bytes {
                break;
            }
            if path == keep {
                continue;
            }
            if fs::remove_file(&path).is_ok() {
                tracing::debug!(path = %path.display(), "evicted from the image cache");
                total = total.saturating_sub(len);
            }
        }
        Ok(())
    }

    /// Records that devices asking for `name` get the blob `layer_digest`, framed with
    /// `framing` (one line: an encrypted layer's descriptor) when there is one.
    pub fn remember(
        &self,
        name: &str,
        layer_digest: &str,
        framing: Option<&str>,
    ) -> Result<(), CacheError> {
        hex_of(layer_digest)?;
        let path = self.name_path(name);
        let record = match framing {
            Some(line) => format!("{layer_digest}\n{}", line.replace('\n', " ")),
            None => layer_digest.to_owned(),
        };
        fs::write(&path, record).map_err(io_at(&path))
    }

    /// The layer digest recorded for `name`, and its framing if it has one.
    pub fn lookup(&self, name: &str) -> Option<(String, Option<String>)> {
        let record = fs::read_to_string(self.name_path(name)).ok()?;
        let (digest, framing) = match record.split_once('\n') {
            Some((digest, framing)) => (digest.trim(), Some(framing.trim().to_owned())),
            None => (record.trim(), None),
        };
        hex_of(digest).ok()?;
        Some((digest.to_owned(), framing.filter(|f| !f.is_empty())))
    }
}

fn touch(path: &Path) {
    if let Ok(file) = fs::File::options().append(true).open(path) {
        let _ = file.set_modified(SystemTime::now());
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::time::Duration;

    use super::*;

    fn put(cache: &BlobCache, bytes: &[u8]) -> String {
        let digest = format!("sha256:{}", sha256_hex(bytes));
        let mut file = cache
            .scratch()
            .map_err(|e| e.to_string())
            .unwrap_or_else(|e| panic!("{e}"));
        file.write_all(bytes).unwrap_or_else(|e| panic!("{e}"));
        cache
            .commit(file, &digest)
            .unwrap_or_else(|e| panic!("{e}"));
        digest
    }

    #[test]
    fn blobs_round_trip_and_names_resolve() -> Result<(), CacheError> {
        let dir = tempfile::tempdir().map_err(io_at(Path::new("tmp")))?;
        let cache = BlobCache::open(dir.path(), 1 << 20)?;
        let digest = put(&cache, b"\0asm\x01\0\0\0");
        assert_eq!(
            cache.get(&digest)?.as_deref(),
            Some(&b"\0asm\x01\0\0\0"[..])
        );
        assert_eq!(cache.head(&digest, 4)?.as_deref(), Some(&b"\0asm"[..]));
        cache.remember("reg/app@sha256:abc", &digest, None)?;
        assert_eq!(
            cache.lookup("reg/app@sha256:abc"),
            Some((digest.clone(), None))
        );
        cache.remember("reg/enc@sha256:abc", &digest, Some("{\"mediaType\":\"x\"}"))?;
        assert_eq!(
            cache.lookup("reg/enc@sha256:abc"),
            Some((digest, Some("{\"mediaType\":\"x\"}".into())))
        );
        assert_eq!(cache.lookup("reg/other@sha256:abc"), None);
        assert!(matches!(cache.get("md5:00"), Err(CacheError::Digest(_))));
        Ok(())
    }

    #[test]
    fn the_least_recently_used_blob_goes_first() -> Result<(), CacheError> {
        let dir = tempfile::tempdir().map_err(io_at(Path::new("tmp")))?;
        let cache = BlobCache::open(dir.path(), 250)?;
        let a = put(&cache, &[1u8; 100]);
        std::thread::sleep(Duration::from_millis(20));
        let b = put(&cache, &[2u8; 100]);
        std::thread::sleep(Duration::from_millis(20));
        // Reading `a` makes `b` the oldest.
        assert!(cache.get(&a)?.is_some());
        std::thread::sleep(Duration::from_millis(20));
        let c = put(&cache, &[3u8; 100]);
        assert!(cache.contains(&a));
        assert!(!cache.contains(&b));
        assert!(cache.contains(&c));
        Ok(())
    }

    #[test]
    fn a_damaged_blob_is_dropped() -> Result<(), CacheError> {
        let dir = tempfile::tempdir().map_err(io_at(Path::new("tmp")))?;
        let cache = BlobCache::open(dir.path(), 1 << 20)?;
        let digest = put(&cache, b"intact");
        let path = cache.blob_path(&digest)?;
        fs::write(&path, b"tampered").map_err(io_at(&path))?;
        assert_eq!(cache.get(&digest)?, None);
        assert!(!cache.contains(&digest));
        Ok(())
    }

    #[test]
    fn an_oversized_single_blob_is_kept_while_in_use() -> Result<(), CacheError> {
        let dir = tempfile::tempdir().map_err(io_at(Path::new("tmp")))?;
        let cache = BlobCache::open(dir.path(), 10)?;
        let big = put(&cache, &[7u8; 100]);
        assert!(cache.contains(&big));
        Ok(())
    }
}
