//! Files only their owner may read (keys, tokens, a broker configuration with device keys),
//! written so that a reader sees the old file or the new one, never a part.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// A private file that could not be written: the step and the file it failed on.
#[derive(Debug, thiserror::Error)]
#[error("{step} {}: {source}", path.display())]
pub struct PrivateFileError {
    /// What was being done.
    pub step: &'static str,
    /// The file (or the temporary file next to it).
    pub path: PathBuf,
    /// The operating system's error.
    pub source: std::io::Error,
}

/// Writes `contents` to `path` with mode 0600: a temporary file beside it, synced, given to
/// the directory's owner when that is another user (a root `proplet join` into the service's
/// state directory), then renamed over `path`, and the directory synced.
pub fn write_private(path: &Path, contents: &[u8]) -> Result<(), PrivateFileError> {
    let fail = |step: &'static str, path: &Path| {
        let path = path.to_owned();
        move |source| PrivateFileError { step, path, source }
    };
    let directory = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_owned(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temporary = directory.join(format!(".{name}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&temporary);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&temporary)
        .map_err(fail("creating", &temporary))?;
    let written = file
        .write_all(contents)
        .and_then(|()| file.sync_all())
        .map_err(fail("writing", &temporary))
        .and_then(|()| give_to_directory_owner(&directory, &temporary));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&temporary);
        return Err(e);
    }
    std::fs::rename(&temporary, path).map_err(fail("replacing", path))?;
    if let Ok(dir) = std::fs::File::open(&directory) {
        let _ = dir.sync_all();
    }
    Ok(())
}

/// Makes `path` a directory only its owner may enter (mode 0700), creating it and its
/// missing parents; an existing one is narrowed to 0700 when it is wider. What it holds
/// (a store of every device key) is then out of other local users' reach whatever the modes
/// of the files inside.
pub fn create_private_dir(path: &Path) -> Result<(), PrivateFileError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
        .map_err(|source| PrivateFileError {
            step: "creating",
            path: path.to_owned(),
            source,
        })?;
    restrict(path, 0o700)
}

/// Narrows `path`'s mode to `mode` when it grants more (never widens it).
pub fn restrict(path: &Path, mode: u32) -> Result<(), PrivateFileError> {
    let fail = |step: &'static str| {
        let path = path.to_owned();
        move |source| PrivateFileError { step, path, source }
    };
    let current = std::fs::metadata(path).map_err(fail("reading the mode of"))?;
    let bits = current.permissions().mode() & 0o777;
    if bits & !mode != 0 {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(bits & mode))
            .map_err(fail("narrowing the mode of"))?;
    }
    Ok(())
}

fn give_to_directory_owner(directory: &Path, file: &Path) -> Result<(), PrivateFileError> {
    let owner = std::fs::metadata(directory).map_err(|source| PrivateFileError {
        step: "reading the owner of",
        path: directory.to_owned(),
        source,
    })?;
    let current = std::fs::metadata(file).map_err(|source| PrivateFileError {
        step: "reading the owner of",
        path: file.to_owned(),
        source,
    })?;
    if current.uid() == owner.uid() {
        return Ok(());
    }
    std::os::unix::fs::chown(file, Some(owner.uid()), Some(owner.gid())).map_err(|source| {
        PrivateFileError {
            step: "giving the directory's owner",
            path: file.to_owned(),
            source,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_private_file_is_0600_replaced_whole_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("key.pem");
        std::fs::write(&path, "old").unwrap_or_else(|e| panic!("{e}"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))
            .unwrap_or_else(|e| panic!("{e}"));
        write_private(&path, b"new").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(std::fs::read_to_string(&path).ok().as_deref(), Some("new"));
        let mode = std::fs::metadata(&path)
            .unwrap_or_else(|e| panic!("{e}"))
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap_or_else(|e| panic!("{e}"))
            .filter_map(|e| e.ok())
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        let missing =
            write_private(&dir.path().join("no/such/dir/f"), b"x").expect_err("no directory");
        assert!(missing.to_string().contains("creating"), "{missing}");
    }
}
