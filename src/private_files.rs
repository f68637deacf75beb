//! Files only the broker's user may read: a 0700 directory and 0600 files
//! written so that no other user can ever see them, not even for a moment.
//!
//! Files are created with their final mode (`open(O_CREAT|O_EXCL, 0600)`)
//! under a temporary name and then moved into place, so there is no
//! chmod-after-create window and a reader never sees a half-written file.
//! (Hand-written: the few lines of `std` below do exactly this; the crates
//! that offer atomic writes either chmod after creating or cannot refuse to
//! replace an existing file.)

use std::fs::{DirBuilder, File, OpenOptions, Permissions};
use std::io::{self, Write as _};
use std::os::unix::fs::{
    DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _,
};
use std::path::{Path, PathBuf};

/// Why a private file or directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PrivateFileError {
    #[error("cannot use {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("refusing to use {path}: {reason}")]
    Unsafe { path: PathBuf, reason: String },
    /// Not a regular file, or above [`crate::files::PRIVATE_MAX_BYTES`].
    #[error(transparent)]
    Read(#[from] crate::files::ReadError),
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> PrivateFileError + '_ {
    move |source| PrivateFileError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Creates `dir` (and missing parents) with mode 0700, or checks an existing
/// one: it must be a directory owned by this user. One that others can read
/// is tightened to 0700, with a warning.
pub fn ensure_private_dir(dir: &Path) -> Result<(), PrivateFileError> {
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io_error(dir))?;
    let meta = std::fs::metadata(dir).map_err(io_error(dir))?;
    check_owner(dir, &meta)?;
    if !meta.is_dir() {
        return Err(PrivateFileError::Unsafe {
            path: dir.to_owned(),
            reason: "not a directory".into(),
        });
    }
    if meta.mode() & 0o077 != 0 {
        tracing::warn!(dir = %dir.display(), mode = format!("{:o}", meta.mode() & 0o777), "state directory is open to other users; setting it to 0700");
        std::fs::set_permissions(dir, Permissions::from_mode(0o700)).map_err(io_error(dir))?;
    }
    Ok(())
}

fn check_owner(path: &Path, meta: &std::fs::Metadata) -> Result<(), PrivateFileError> {
    let me = rustix::process::geteuid().as_raw();
    if meta.uid() != me {
        return Err(PrivateFileError::Unsafe {
            path: path.to_owned(),
            reason: format!("owned by uid {}, not by this user (uid {me})", meta.uid()),
        });
    }
    Ok(())
}

/// Reads a private file; `Ok(None)` when it does not exist. A file owned by
/// someone else is refused; one that others can read is tightened to 0600,
/// with a warning.
pub fn read_private(path: &Path) -> Result<Option<Vec<u8>>, PrivateFileError> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_error(path)(e)),
    };
    check_owner(path, &meta)?;
    if meta.mode() & 0o077 != 0 {
        tracing::warn!(file = %path.display(), mode = format!("{:o}", meta.mode() & 0o777), "private file is open to other users; setting it to 0600");
        std::fs::set_permissions(path, Permissions::from_mode(0o600)).map_err(io_error(path))?;
    }
    Ok(Some(crate::files::read(
        path,
        crate::files::PRIVATE_MAX_BYTES,
    )?))
}

/// How [`write_private`] treats an existing file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Existing {
    /// Replace it atomically.
    Replace,
    /// Keep it: the write reports [`Written::AlreadyThere`] (two brokers
    /// creating a key at once must not overwrite each other's).
    Keep,
}

/// What [`write_private`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    Written,
    AlreadyThere,
}

/// Writes `bytes` to `path` with mode 0600: to a fresh temporary file in the
/// same directory (created 0600, flushed to disk), then moved into place.
pub fn write_private(
    path: &Path,
    bytes: &[u8],
    existing: Existing,
) -> Result<Written, PrivateFileError> {
    let tmp = temporary_name(path);
    let result = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        drop(file);
        match existing {
            Existing::Replace => std::fs::rename(&tmp, path).map(|()| Written::Written),
            // link(2) fails if the target exists: create-once, atomically.
            Existing::Keep => match std::fs::hard_link(&tmp, path) {
                Ok(()) => Ok(Written::Written),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(Written::AlreadyThere),
                Err(e) => Err(e),
            },
        }
    })();
    // After a rename the temporary name is gone already; otherwise remove it.
    let _ = std::fs::remove_file(&tmp);
    result.map_err(io_error(path))
}

/// Creates `path` anew for a file written as it goes (a recording), mode
/// 0600 from its first byte, and never through a symbolic link: a fresh
/// temporary file in the same directory (`O_CREAT|O_EXCL`, 0600) is moved
/// over `path` at once, and the open file is returned. `rename(2)`
/// replaces a link, never follows it, so neither a link's target nor a
/// dangling link's would-be target is written, chmodded or created; a link
/// at `path` is refused outright (the caller meant its target: say so
/// rather than replace the link), and so is anything that is not a regular
/// file (a device, a FIFO, a directory), which would be replaced.
pub fn create_private(path: &Path) -> Result<File, PrivateFileError> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_symlink() => {
            return Err(PrivateFileError::Unsafe {
                path: path.to_owned(),
                reason: "it is a symbolic link, and clawmux does not write through links; name the file itself".into(),
            })
        }
        Ok(meta) if !meta.is_file() => {
            return Err(PrivateFileError::Unsafe {
                path: path.to_owned(),
                reason: format!("it is {}, not a regular file", crate::files::kind_of(meta.file_type())),
            })
        }
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_error(path)(e)),
    }
    let tmp = temporary_name(path);
    let result = (|| {
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        std::fs::rename(&tmp, path)?;
        Ok(file)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(io_error(path))
}

/// A name for a temporary file beside `path` that no one else uses.
fn temporary_name(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.{}.tmp", uuid::Uuid::new_v4().simple()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().mode() & 0o777
    }

    #[test]
    fn directories_and_files_are_private() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a/b/clawmux");
        ensure_private_dir(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);
        let f = dir.join("x.json");
        assert_eq!(
            write_private(&f, b"one", Existing::Keep).unwrap(),
            Written::Written
        );
        assert_eq!(mode(&f), 0o600);
        assert_eq!(
            write_private(&f, b"two", Existing::Keep).unwrap(),
            Written::AlreadyThere
        );
        assert_eq!(read_private(&f).unwrap().unwrap(), b"one");
        write_private(&f, b"three", Existing::Replace).unwrap();
        assert_eq!(read_private(&f).unwrap().unwrap(), b"three");
        assert_eq!(mode(&f), 0o600);
        // No temporary files are left behind.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        assert!(read_private(&dir.join("missing")).unwrap().is_none());
    }

    #[test]
    fn loose_permissions_are_tightened() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("s");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, Permissions::from_mode(0o755)).unwrap();
        ensure_private_dir(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);
        let f = dir.join("k");
        std::fs::write(&f, b"k").unwrap();
        std::fs::set_permissions(&f, Permissions::from_mode(0o644)).unwrap();
        read_private(&f).unwrap();
        assert_eq!(mode(&f), 0o600);
    }

    #[test]
    fn a_file_in_place_of_the_directory_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let f = tmp.path().join("f");
        std::fs::write(&f, b"").unwrap();
        assert!(ensure_private_dir(&f).is_err());
    }

    #[test]
    fn a_created_file_is_fresh_private_and_replaces_a_regular_one() {
        use std::io::Write as _;
        let tmp = tempfile::tempdir().unwrap();
        let f = tmp.path().join("rec.jsonl");
        std::fs::write(&f, b"old contents").unwrap();
        std::fs::set_permissions(&f, Permissions::from_mode(0o644)).unwrap();
        let mut file = create_private(&f).unwrap();
        file.write_all(b"new").unwrap();
        assert_eq!(std::fs::read(&f).unwrap(), b"new");
        assert_eq!(mode(&f), 0o600);
        assert_eq!(
            std::fs::read_dir(tmp.path()).unwrap().count(),
            1,
            "no temporary left"
        );
        drop(file);
        create_private(&tmp.path().join("new.jsonl")).unwrap();
        assert_eq!(mode(&tmp.path().join("new.jsonl")), 0o600);
    }

    #[test]
    fn a_link_is_never_written_through_and_a_dangling_one_creates_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, b"keep me").unwrap();
        std::fs::set_permissions(&victim, Permissions::from_mode(0o644)).unwrap();
        let link = tmp.path().join("rec.jsonl");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let e = create_private(&link).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
        assert_eq!(mode(&victim), 0o644, "the target's mode is untouched");
        assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());

        let nowhere = tmp.path().join("nowhere");
        let dangling = tmp.path().join("dangling.jsonl");
        std::os::unix::fs::symlink(&nowhere, &dangling).unwrap();
        let e = create_private(&dangling).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert!(!nowhere.exists(), "the target is not created");
        // Nothing else was left behind either.
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 3);
    }

    #[test]
    fn a_device_or_a_fifo_is_not_replaced() {
        let tmp = tempfile::tempdir().unwrap();
        let fifo = tmp.path().join("rec.jsonl");
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .unwrap();
        let e = create_private(&fifo).unwrap_err();
        assert!(e.to_string().contains("a FIFO, not a regular file"), "{e}");
        let e = create_private(tmp.path()).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
    }

    #[test]
    fn a_fifo_or_an_oversized_file_is_refused_not_read() {
        let tmp = tempfile::tempdir().unwrap();
        let fifo = tmp.path().join("device.json");
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .unwrap();
        let e = read_private(&fifo).unwrap_err();
        assert!(e.to_string().contains("a FIFO, not a regular file"), "{e}");
        let big = tmp.path().join("device-auth.json");
        let f = std::fs::File::create(&big).unwrap();
        f.set_len(crate::files::PRIVATE_MAX_BYTES + 1).unwrap();
        std::fs::set_permissions(&big, Permissions::from_mode(0o600)).unwrap();
        let e = read_private(&big).unwrap_err();
        assert!(e.to_string().contains("larger than 1 MiB"), "{e}");
    }
}
