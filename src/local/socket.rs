//! Creating the local unix socket safely.
//!
//! The socket file is bound inside a private 0700 directory, set to 0600,
//! and only then renamed to its final path, so no other user can ever
//! connect through a window with looser permissions (no chmod-after race,
//! and no process-wide umask change). A lock file next to the socket makes
//! "is another broker starting or running here?" a question with one answer.
//!
//! Squatting: without `$XDG_RUNTIME_DIR` the socket lives in
//! `<tmp>/clawmux-<uid>`, a name any local user can create first. So the
//! directory must belong to this user (or root), whatever its mode, and no
//! symbolic link is followed where the socket and its lock live: the lock
//! file is opened `O_NOFOLLOW`, and a link at the socket path is refused.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Why the socket could not be set up; each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error("{}", in_use_message(.path, *.pid))]
    InUse {
        path: PathBuf,
        /// The process serving there, from the kernel (`SO_PEERCRED` on a
        /// test connection); `None` while it is still starting.
        pid: Option<u32>,
    },
    #[error("{0} exists and is not a socket; remove it or pass --socket PATH")]
    NotASocket(PathBuf),
    #[error("{0} is a symbolic link; clawmux follows no links where its socket and lock live: remove it or pass --socket PATH")]
    Symlink(PathBuf),
    #[error("the socket directory {path} is unsafe: {why}")]
    UnsafeDir { path: PathBuf, why: String },
    /// `path` is the socket asked for (whatever file the step touched), and
    /// the cause is not a `#[source]`: printed once, in the message.
    #[error("cannot set up the socket {path}: {cause}")]
    Io { path: PathBuf, cause: io::Error },
}

fn in_use_message(path: &Path, pid: Option<u32>) -> String {
    match pid {
        Some(pid) => format!(
            "another clawmux is already serving on {} (pid {pid}); stop it first (kill {pid}, or systemctl --user stop clawmux.socket clawmux.service if systemd runs it) or pass --socket PATH",
            path.display()
        ),
        None => format!(
            "another clawmux is starting or serving on {} (it holds the lock file); stop it first (systemctl --user stop clawmux) or pass --socket PATH",
            path.display()
        ),
    }
}

/// The pid of the process serving the socket at `path`, as the kernel
/// reports it for a test connection (`SO_PEERCRED`); the connection is
/// closed at once, without a byte sent.
fn serving_pid(path: &Path) -> Option<u32> {
    let stream = std::os::unix::net::UnixStream::connect(path).ok()?;
    let cred = rustix::net::sockopt::socket_peercred(&stream).ok()?;
    u32::try_from(cred.pid.as_raw_nonzero().get()).ok()
}

fn in_use(path: &Path) -> SocketError {
    SocketError::InUse {
        path: path.to_owned(),
        pid: serving_pid(path),
    }
}

/// Fails with [`SocketError::InUse`] when another broker holds `path` (its
/// lock, or a socket that answers), creating and changing nothing. For
/// checks before work that [`bind`] would waste (`serve --demo` starts its
/// gateway double only after this); `bind` checks again.
pub fn ensure_free(path: &Path) -> Result<(), SocketError> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let Some(file_name) = path.file_name() else {
        return Ok(());
    };
    let lock_path = dir.join(format!(".{}.lock", file_name.to_string_lossy()));
    if let Ok(lock) = OpenOptions::new()
        .write(true)
        .private_no_follow()
        .open(&lock_path)
    {
        if let Err(fs::TryLockError::WouldBlock) = lock.try_lock() {
            return Err(in_use(path));
        }
    }
    match fs::symlink_metadata(path) {
        Ok(meta)
            if meta.file_type().is_socket()
                && std::os::unix::net::UnixStream::connect(path).is_ok() =>
        {
            Err(in_use(path))
        }
        _ => Ok(()),
    }
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> SocketError + '_ {
    move |cause| SocketError::Io {
        path: path.to_owned(),
        cause,
    }
}

/// An error at the lock file, reported against the socket `path` (the name
/// the user gave) with the directory that must be writable.
fn lock_err<'a>(path: &'a Path, dir: &Path) -> impl FnOnce(io::Error) -> SocketError + 'a {
    let dir = dir.to_owned();
    move |e| {
        io_err(path)(io::Error::new(
            e.kind(),
            format!(
                "cannot create its lock file in {} ({e}); pick a directory you can write, e.g. --socket $XDG_RUNTIME_DIR/clawmux.sock",
                dir.display()
            ),
        ))
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

/// A socket file clawmux created, as a handover passes it on.
#[derive(Debug)]
pub struct SocketFileParts {
    /// (device, inode) of the socket file when it was bound.
    pub ino: Option<(u64, u64)>,
    pub lock_path: PathBuf,
    /// A copy of the lock file's descriptor (holding the same `flock`).
    pub lock: std::os::fd::OwnedFd,
}

/// The socket file this broker created, and the lock that says so.
#[derive(Debug)]
struct OwnedSocketFile {
    ino: Option<(u64, u64)>,
    lock_path: PathBuf,
    _lock: File,
    /// Removed only once this is open (an upgrade's new instance owns the
    /// files only from the old one's commit on).
    after: Option<crate::gate::Gate>,
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

    /// For a handover: the socket file's inode and lock path, and a copy of
    /// the lock's descriptor (the `flock` belongs to the open file, so the
    /// copy holds the same lock). `None` for a socket systemd owns.
    pub fn handover_parts(&self) -> Option<SocketFileParts> {
        let owned = self.owned.as_ref()?;
        let lock = owned._lock.try_clone().ok()?;
        Some(SocketFileParts {
            ino: owned.ino,
            lock_path: owned.lock_path.clone(),
            lock: lock.into(),
        })
    }

    /// The guard of a socket file the previous instance created and handed
    /// over with its lock: removed at this instance's final stop.
    pub fn handed_over(
        path: PathBuf,
        ino: Option<(u64, u64)>,
        lock_path: PathBuf,
        lock: std::os::fd::OwnedFd,
    ) -> Self {
        SocketGuard {
            path,
            owned: Some(OwnedSocketFile {
                ino,
                lock_path,
                _lock: File::from(lock),
                after: None,
            }),
        }
    }

    /// Leaves the files in place if dropped before `gate` opens: an
    /// upgrade's new instance that ends before the old one committed (the
    /// old one serves on them).
    pub fn removed_only_after(mut self, gate: &crate::gate::Gate) -> Self {
        if let Some(owned) = &mut self.owned {
            owned.after = Some(gate.clone());
        }
        self
    }

    /// After the next instance took the socket over: leave the file and its
    /// lock file in place (they are the next instance's now).
    pub fn disarm(&mut self) {
        self.owned = None;
    }
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        let Some(owned) = &self.owned else {
            return;
        };
        if owned.after.as_ref().is_some_and(|g| !g.is_open()) {
            return;
        }
        if let Ok(meta) = fs::symlink_metadata(&self.path) {
            if Some((meta.dev(), meta.ino())) == owned.ino {
                let _ = fs::remove_file(&self.path);
            }
        }
        let _ = fs::remove_file(&owned.lock_path);
    }
}

/// Makes sure the directory exists (created 0700), belongs to this user
/// (or root) and is not writable by others.
fn prepare_dir(dir: &Path) -> Result<(), SocketError> {
    if !dir.exists() {
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io_err(dir))?;
    }
    let me = rustix::process::getuid().as_raw();
    let unsafe_dir = |why| SocketError::UnsafeDir {
        path: dir.to_owned(),
        why,
    };
    // A link in a shared directory (e.g. /tmp/clawmux-1000 -> elsewhere) is
    // owned by whoever made it and can be re-pointed by them at any time.
    let link = fs::symlink_metadata(dir).map_err(io_err(dir))?;
    if link.file_type().is_symlink() {
        check_dir_owner(link.uid(), 0o700, me).map_err(unsafe_dir)?;
    }
    let meta = fs::metadata(dir).map_err(io_err(dir))?;
    check_dir_owner(meta.uid(), meta.mode(), me).map_err(unsafe_dir)
}

/// The rule for the socket's directory: owned by `me` or root (a directory
/// another user owns lets them replace the socket with their own, whatever
/// its mode) and writable by nobody else.
fn check_dir_owner(owner: u32, mode: u32, me: u32) -> Result<(), String> {
    if owner != me && owner != 0 {
        return Err(format!(
            "it belongs to uid {owner}, not to you (uid {me}): another user may have created it to catch your clients; remove it, set XDG_RUNTIME_DIR, or pass --socket"
        ));
    }
    if mode & 0o022 != 0 {
        return Err(format!(
            "mode {:o} lets other users replace the socket; chmod 700 it, or pass --socket",
            mode & 0o777
        ));
    }
    Ok(())
}

/// Connections the kernel holds for a listening socket before the broker
/// accepts them. A burst of clients connecting at once (many processes
/// starting, a script in a loop: tens of thousands a second) can outrun the
/// accept loop for a moment; past the backlog, a client's non-blocking
/// `connect` fails with `EAGAIN` at once (a blocking one waits, and the
/// CLI retries briefly). The kernel caps it at `net.core.somaxconn` (4096
/// by default since Linux 5.4, which is what the broker gets: about 50 ms
/// of connections at 80,000 a second); asking for the largest value the
/// sysctl can take means raising the sysctl is all it takes to hold a
/// longer burst. It costs nothing until connections wait.
pub const LISTEN_BACKLOG: i32 = 65535;

/// Listens again on `listener` with [`LISTEN_BACKLOG`] (Linux takes a
/// second `listen` as a new backlog). A failure leaves the backlog it had.
pub fn size_backlog(listener: &std::os::unix::net::UnixListener) {
    if let Err(e) = rustix::net::listen(listener, LISTEN_BACKLOG) {
        tracing::warn!("cannot set the socket's backlog to {LISTEN_BACKLOG}: {e}");
    }
}

/// Binds the unix socket at `path` (mode 0600), refusing if another broker
/// answers there and replacing a stale socket file (connect refused).
pub fn bind(path: &Path) -> Result<(std::os::unix::net::UnixListener, SocketGuard), SocketError> {
    bind_with_mode(path, 0o600)
}

/// [`bind`] with another mode for the socket file (a policy socket that
/// other users or a group may reach); it has that mode from the moment it
/// exists under its name.
pub fn bind_with_mode(
    path: &Path,
    mode: u32,
) -> Result<(std::os::unix::net::UnixListener, SocketGuard), SocketError> {
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
        .private_no_follow()
        .open(&lock_path)
        .map_err(|e| match e.raw_os_error() {
            Some(code) if code == rustix::io::Errno::LOOP.raw_os_error() => {
                SocketError::Symlink(lock_path.clone())
            }
            _ => lock_err(path, dir)(e),
        })?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(fs::TryLockError::WouldBlock) => return Err(in_use(path)),
        Err(fs::TryLockError::Error(e)) => return Err(lock_err(path, dir)(e)),
    }
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            match std::os::unix::net::UnixStream::connect(path) {
                Ok(_) => return Err(in_use(path)),
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    tracing::info!(path = %path.display(), "replacing a stale socket file");
                }
                Err(e) => return Err(io_err(path)(e)),
            }
        }
        Ok(meta) if meta.file_type().is_symlink() => {
            return Err(SocketError::Symlink(path.to_owned()))
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
        fs::set_permissions(&tmp, fs::Permissions::from_mode(mode)).map_err(io_err(&tmp))?;
        fs::rename(&tmp, path).map_err(io_err(path))?;
        Ok(listener)
    })();
    let _ = fs::remove_file(&tmp);
    let _ = fs::remove_dir(&private);
    let listener = result?;
    size_backlog(&listener);
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
                after: None,
            }),
        },
    ))
}

trait PrivateNoFollow {
    /// Mode 0600 if created, and never through a symbolic link (`O_NOFOLLOW`:
    /// a link there fails with `ELOOP` instead of creating or locking
    /// whatever it points to).
    fn private_no_follow(&mut self) -> &mut Self;
}

impl PrivateNoFollow for OpenOptions {
    fn private_no_follow(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.mode(0o600)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
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
    fn the_directory_must_be_mine_or_roots_and_private() {
        assert!(check_dir_owner(1000, 0o700, 1000).is_ok());
        assert!(
            check_dir_owner(0, 0o755, 1000).is_ok(),
            "root-owned, not writable"
        );
        let err = check_dir_owner(1001, 0o700, 1000).unwrap_err();
        assert!(
            err.contains("uid 1001") && err.contains("uid 1000"),
            "{err}"
        );
        assert!(check_dir_owner(1001, 0o755, 1000).is_err(), "any mode");
        assert!(check_dir_owner(1000, 0o770, 1000)
            .unwrap_err()
            .contains("770"));
        assert!(check_dir_owner(0, 0o1777, 1000).is_err(), "not /tmp itself");
    }

    /// A directory another user created first (the squatting attack on
    /// `<tmp>/clawmux-<uid>`) is refused even at mode 0700. Needs root to
    /// hand the directory to another uid.
    #[test]
    fn a_directory_owned_by_another_user_is_refused() {
        if rustix::process::getuid().as_raw() != 0 {
            eprintln!("SKIPPED a_directory_owned_by_another_user_is_refused: needs root to chown");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("clawmux-1000");
        DirBuilder::new().mode(0o700).create(&dir).unwrap();
        std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
        let err = bind(&dir.join("clawmux.sock")).unwrap_err();
        assert!(matches!(err, SocketError::UnsafeDir { .. }), "{err}");
        assert!(err.to_string().contains("uid 65534"), "{err}");
        assert!(!dir.join("clawmux.sock").exists());
        assert!(!dir.join(".clawmux.sock.lock").exists());
        // A link to it, made by that user, is refused the same way.
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        assert!(bind(&link.join("clawmux.sock")).is_err());
    }

    #[test]
    fn no_symlink_is_followed_at_the_lock_or_the_socket() {
        let tmp = tempfile::tempdir().unwrap();
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o700)).unwrap();
        let victim = tmp.path().join("victim");
        fs::write(&victim, b"precious").unwrap();
        let path = tmp.path().join("c.sock");
        // A link at the lock path: neither truncated nor locked through.
        let lock = tmp.path().join(".c.sock.lock");
        std::os::unix::fs::symlink(&victim, &lock).unwrap();
        let err = bind(&path).unwrap_err();
        assert!(
            matches!(err, SocketError::Symlink(ref p) if *p == lock),
            "{err}"
        );
        // A dangling link there creates nothing either.
        fs::remove_file(&lock).unwrap();
        let nowhere = tmp.path().join("nowhere");
        std::os::unix::fs::symlink(&nowhere, &lock).unwrap();
        assert!(matches!(bind(&path), Err(SocketError::Symlink(_))));
        assert!(!nowhere.exists());
        fs::remove_file(&lock).unwrap();
        // A link at the socket path.
        std::os::unix::fs::symlink(&victim, &path).unwrap();
        let err = bind(&path).unwrap_err();
        assert!(
            matches!(err, SocketError::Symlink(ref p) if *p == path),
            "{err}"
        );
        assert_eq!(fs::read(&victim).unwrap(), b"precious");
        assert!(fs::symlink_metadata(&path)
            .unwrap()
            .file_type()
            .is_symlink());
    }

    /// A burst of connections the broker has not accepted yet waits in the
    /// backlog, as many as the kernel allows (`net.core.somaxconn`); the
    /// next non-blocking connect fails `EAGAIN` at once. (Rust's standard
    /// library already asks Linux for its maximum; the broker says so
    /// itself, for sockets systemd passes too.)
    #[test]
    fn the_backlog_holds_a_burst() {
        use rustix::net::{
            connect, socket_with, AddressFamily, SocketAddrUnix, SocketFlags, SocketType,
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("clawmux.sock");
        let (_listener, _guard) = bind(&path).unwrap();
        let addr = SocketAddrUnix::new(&path).unwrap();
        let somaxconn: usize = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(4096);
        let held = somaxconn.min(LISTEN_BACKLOG as usize) + 1;
        let mut pending = Vec::new();
        for n in 0..held {
            let fd = socket_with(
                AddressFamily::UNIX,
                SocketType::STREAM,
                SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
                None,
            )
            .unwrap();
            if let Err(e) = connect(&fd, &addr) {
                panic!("connection {n} not held: {e}");
            }
            pending.push(fd);
        }
        let fd = socket_with(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        assert_eq!(
            connect(&fd, &addr),
            Err(rustix::io::Errno::AGAIN),
            "{held} held"
        );
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
        assert!(matches!(bind(&path), Err(SocketError::InUse { .. })));
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
