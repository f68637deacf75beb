//! Creating the local unix socket safely.
//!
//! The socket file is bound inside a private 0700 directory, set to 0600,
//! and only then renamed to its final path, so no other user can ever
//! connect through a window with looser permissions (no chmod-after race,
//! and no process-wide umask change). A lock file next to the socket makes
//! "is another broker starting or running here?" a question with one answer.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Why the socket could not be set up; each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error("another clawmux is already serving on {0}; stop it first (systemctl --user stop clawmux) or pass --socket PATH")]
    InUse(PathBuf),
    #[error("{0} exists and is not a socket; remove it or pass --socket PATH")]
    NotASocket(PathBuf),
    #[error("the socket directory {path} is unsafe: {why}")]
    UnsafeDir { path: PathBuf, why: String },
    #[error("cannot set up the socket {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> SocketError + '_ {
    move |source| SocketError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Owns the socket path while the broker runs: removes the socket (if it is
/// still ours) and releases the lock on drop. A socket handed over by systemd
/// ([`SocketGuard::activated`]) is never removed: systemd keeps listening on
/// it after the broker exits and starts the broker again on the next connection.
#[derive(Debug)]
pub struct SocketGuard {
    path: PathBuf,
    /// `None` for a socket systemd owns.
    owned: Option<OwnedSocketFile>,
}

/// The socket file this broker created, and the lock that says so.
#[derive(Debug)]
struct OwnedSocketFile {
    ino: Option<(u64, u64)>,
    lock_path: PathBuf,
    _lock: File,
}

impl SocketGuard {
    /// A guard for a listener inherited through socket activation: the path
    /// is only shown, never unlinked.
    pub fn activated(path: impl Into<PathBuf>) -> Self {
        SocketGuard {
            path: path.into(),
            owned: None,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the listener came from systemd (socket activation).
    pub fn is_activated(&self) -> bool {
        self.owned.is_none()
    }
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        let Some(owned) = &self.owned else {
            return;
        };
        if let Ok(meta) = fs::symlink_metadata(&self.path) {
            if Some((meta.dev(), meta.ino())) == owned.ino {
                let _ = fs::remove_file(&self.path);
            }
        }
        let _ = fs::remove_file(&owned.lock_path);
    }
}

/// Makes sure the directory exists (created 0700) and is not writable by others.
fn prepare_dir(dir: &Path) -> Result<(), SocketError> {
    if !dir.exists() {
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io_err(dir))?;
    }
    let meta = fs::metadata(dir).map_err(io_err(dir))?;
    let me = rustix::process::getuid().as_raw();
    let mode = meta.mode();
    // A shared sticky dir like /tmp is fine for the socket itself only if we
    // own the directory; we never put the socket directly in a dir others can write.
    if meta.uid() != me && mode & 0o022 != 0 {
        return Err(SocketError::UnsafeDir {
            path: dir.to_owned(),
            why: "writable by other users; choose a private directory with --socket".into(),
        });
    }
    if meta.uid() == me && mode & 0o022 != 0 {
        return Err(SocketError::UnsafeDir {
            path: dir.to_owned(),
            why: format!(
                "mode {:o} lets other users replace the socket; chmod 700 it",
                mode & 0o777
            ),
        });
    }
    Ok(())
}

/// Binds the unix socket at `path` (mode 0600), refusing if another broker
/// answers there and replacing a stale socket file (connect refused).
pub fn bind(path: &Path) -> Result<(std::os::unix::net::UnixListener, SocketGuard), SocketError> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    prepare_dir(dir)?;
    let file_name = path
        .file_name()
        .ok_or_else(|| io_err(path)(io::Error::new(io::ErrorKind::InvalidInput, "no file name")))?;
    let lock_path = dir.join(format!(".{}.lock", file_name.to_string_lossy()));
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode_0600()
        .open(&lock_path)
        .map_err(io_err(&lock_path))?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(fs::TryLockError::WouldBlock) => return Err(SocketError::InUse(path.to_owned())),
        Err(fs::TryLockError::Error(e)) => return Err(io_err(&lock_path)(e)),
    }
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            match std::os::unix::net::UnixStream::connect(path) {
                Ok(_) => return Err(SocketError::InUse(path.to_owned())),
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    tracing::info!(path = %path.display(), "replacing a stale socket file");
                }
                Err(e) => return Err(io_err(path)(e)),
            }
        }
        Ok(_) => return Err(SocketError::NotASocket(path.to_owned())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(path)(e)),
    }
    // Bind in a private directory, tighten, then move into place atomically.
    let private = dir.join(format!(
        ".clawmux-bind-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    DirBuilder::new()
        .mode(0o700)
        .create(&private)
        .map_err(io_err(&private))?;
    let tmp = private.join("s");
    let result = (|| {
        let listener = std::os::unix::net::UnixListener::bind(&tmp).map_err(io_err(&tmp))?;
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o600)).map_err(io_err(&tmp))?;
        fs::rename(&tmp, path).map_err(io_err(path))?;
        Ok(listener)
    })();
    let _ = fs::remove_file(&tmp);
    let _ = fs::remove_dir(&private);
    let listener = result?;
    listener.set_nonblocking(true).map_err(io_err(path))?;
    let ino = fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()));
    Ok((
        listener,
        SocketGuard {
            path: path.to_owned(),
            owned: Some(OwnedSocketFile {
                ino,
                lock_path,
                _lock: lock,
            }),
        },
    ))
}

trait Mode0600 {
    fn mode_0600(&mut self) -> &mut Self;
}

impl Mode0600 for OpenOptions {
    fn mode_0600(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.mode(0o600)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_is_0600_and_dir_0700() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("run/clawmux.sock");
        let (_l, guard) = bind(&path).unwrap();
        let mode = fs::metadata(&path).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(
            fs::metadata(path.parent().unwrap()).unwrap().mode() & 0o777,
            0o700
        );
        drop(guard);
        assert!(!path.exists(), "socket removed on drop");
    }

    #[test]
    fn activated_guard_never_removes_the_socket() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("systemd.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let guard = SocketGuard::activated(&path);
        assert!(guard.is_activated());
        drop(guard);
        assert!(path.exists(), "a socket systemd owns stays");
    }

    #[test]
    fn live_socket_refused_stale_replaced_file_kept() {
        let tmp = tempfile::tempdir().unwrap();
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o700)).unwrap();
        let path = tmp.path().join("c.sock");
        let (live, guard) = bind(&path).unwrap();
        assert!(matches!(bind(&path), Err(SocketError::InUse(_))));
        // Simulate a crashed broker: the socket file stays, nothing listens, lock released.
        drop(live);
        std::mem::forget(guard); // keep the file as a crash would
        let lock = tmp.path().join(".c.sock.lock");
        let _ = fs::remove_file(&lock);
        let (_l2, _g2) = bind(&path).expect("stale socket replaced");
        let other = tmp.path().join("plain");
        fs::write(&other, b"x").unwrap();
        assert!(matches!(bind(&other), Err(SocketError::NotASocket(_))));
        assert_eq!(fs::read(&other).unwrap(), b"x");
    }
}
