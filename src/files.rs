//! Reading the small local files clawmux trusts (settings, tokens, the
//! device key, stored device tokens): only regular files, only up to a cap.
//!
//! A settings file symlinked to `/dev/zero` would otherwise grow memory
//! without bound on the next `SIGHUP`, and a FIFO would block the reload
//! forever, silently. So a file is opened with `O_NONBLOCK` (opening a FIFO
//! does not wait for a writer), checked with `fstat` on the open descriptor
//! (no race with a rename), refused unless it is a regular file, refused
//! above its cap, and read for at most cap + 1 bytes (a file that grows
//! while read is refused too).
//!
//! Hand-written: `std` has every piece; no crate combines "regular files
//! only" with a read bound.

use std::fs::{File, OpenOptions};
use std::io::{self, Read as _};
use std::os::unix::fs::{FileTypeExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

/// Largest settings file read: `config.toml`, Claw3D's `settings.json`,
/// OpenClaw's `openclaw.json`. Real ones are a few KiB.
pub const CONFIG_MAX_BYTES: u64 = 1024 * 1024;

/// Largest secret file read: gateway token, password and credential files
/// (a token is well under 1 KiB).
pub const SECRET_MAX_BYTES: u64 = 64 * 1024;

/// Largest private state file read: the device key and the stored device
/// tokens (a few hundred bytes each; one token per gateway).
pub const PRIVATE_MAX_BYTES: u64 = 1024 * 1024;

/// Why a local file was not read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("cannot read {}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error("refusing to read {}: it is {kind}, not a regular file", path.display())]
    NotRegular { path: PathBuf, kind: &'static str },
    #[error("refusing to read {}: it is larger than {} (the limit for this file)", path.display(), size(*cap))]
    TooLarge { path: PathBuf, cap: u64 },
}

impl ReadError {
    /// The file does not exist (callers with defaults treat it as absent).
    pub fn is_not_found(&self) -> bool {
        matches!(self, ReadError::Io { source, .. } if source.kind() == io::ErrorKind::NotFound)
    }
}

/// `1 MiB`, `64 KiB`, `512 bytes`.
fn size(n: u64) -> String {
    match n {
        n if n >= 1024 * 1024 && n % (1024 * 1024) == 0 => format!("{} MiB", n / (1024 * 1024)),
        n if n >= 1024 && n % 1024 == 0 => format!("{} KiB", n / 1024),
        n => format!("{n} bytes"),
    }
}

/// What a file that is not a regular one is, for a refusal: "a FIFO".
pub(crate) fn kind_of(t: std::fs::FileType) -> &'static str {
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Opens `path` for reading without blocking (a FIFO), checks it is a
/// regular file of at most `max` bytes.
fn open_regular(path: &Path, max: u64) -> Result<File, ReadError> {
    let io = |source| ReadError::Io {
        path: path.to_owned(),
        source,
    };
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc_flags())
        .open(path)
        .map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !meta.file_type().is_file() {
        return Err(ReadError::NotRegular {
            path: path.to_owned(),
            kind: kind_of(meta.file_type()),
        });
    }
    if meta.len() > max {
        return Err(ReadError::TooLarge {
            path: path.to_owned(),
            cap: max,
        });
    }
    Ok(file)
}

/// `O_NONBLOCK | O_CLOEXEC` (std adds `O_CLOEXEC` itself; said here too).
fn libc_flags() -> i32 {
    use rustix::fs::OFlags;
    (OFlags::NONBLOCK | OFlags::CLOEXEC).bits() as i32
}

/// The bytes of the regular file `path`, at most `max` of them.
pub fn read(path: &Path, max: u64) -> Result<Vec<u8>, ReadError> {
    let file = open_regular(path, max)?;
    let mut bytes = Vec::new();
    file.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|source| ReadError::Io {
            path: path.to_owned(),
            source,
        })?;
    if bytes.len() as u64 > max {
        return Err(ReadError::TooLarge {
            path: path.to_owned(),
            cap: max,
        });
    }
    Ok(bytes)
}

/// [`read`] as UTF-8 text.
pub fn read_string(path: &Path, max: u64) -> Result<String, ReadError> {
    String::from_utf8(read(path, max)?).map_err(|_| ReadError::Io {
        path: path.to_owned(),
        source: io::Error::new(io::ErrorKind::InvalidData, "not UTF-8 text"),
    })
}

/// [`read_string`], `Ok(None)` when the file does not exist.
pub fn read_optional_string(path: &Path, max: u64) -> Result<Option<String>, ReadError> {
    match read_string(path, max) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_behind_a_symlink_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join("config.toml");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        let e = read(&link, CONFIG_MAX_BYTES).unwrap_err();
        assert!(matches!(e, ReadError::NotRegular { .. }), "{e}");
        assert!(e.to_string().contains("a character device"), "{e}");
        assert!(e.to_string().contains("config.toml"), "{e}");
    }

    #[test]
    fn a_fifo_is_refused_without_waiting_for_a_writer() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("token");
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .unwrap();
        let e = read(&fifo, SECRET_MAX_BYTES).unwrap_err();
        assert!(e.to_string().contains("a FIFO, not a regular file"), "{e}");
        let e = read(dir.path(), SECRET_MAX_BYTES).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
    }

    #[test]
    fn a_file_above_its_cap_is_refused_naming_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, vec![b'a'; SECRET_MAX_BYTES as usize + 1]).unwrap();
        let e = read(&path, SECRET_MAX_BYTES).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "refusing to read {}: it is larger than 64 KiB (the limit for this file)",
                path.display()
            )
        );
        std::fs::write(&path, vec![b'a'; SECRET_MAX_BYTES as usize]).unwrap();
        assert_eq!(read(&path, SECRET_MAX_BYTES).unwrap().len(), 65536);
        assert!(read_optional_string(&dir.path().join("none"), 1)
            .unwrap()
            .is_none());
    }
}
