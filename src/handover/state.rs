//! The handover's state: what the old instance tells the new one, as JSON in
//! a sealed memfd. Descriptors never travel inside it, only their names
//! (systemd's `FDNAME=` / `LISTEN_FDNAMES`, or the names beside the fds in
//! `CLAWMUX_HANDOVER_FDS` for a `SIGUSR2` upgrade).

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The state format this binary writes and the only one it reads. A state
/// in any other format is not guessed at: the new instance starts fresh (a
/// normal restart), never with a wrong state.
pub const FORMAT: u32 = 1;

/// The largest state read back. Format 1 holds a few lines per listening
/// socket; a memfd larger than this is not a state this binary wrote.
pub const MAX_STATE_BYTES: u64 = 1024 * 1024;

/// The descriptor name of the state memfd.
pub const STATE_FD_NAME: &str = "clawmux-state";

/// What moves from one instance to the next (format [`FORMAT`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct State {
    pub format: u32,
    /// The old instance's version, for the new one's log line.
    pub from_version: String,
    pub from_pid: u32,
    /// The listening sockets, the main one first.
    pub listeners: Vec<Listener>,
}

/// One listening socket: its descriptor travels under `fd_name`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Listener {
    /// `clawmux-listen` for the main socket, `clawmux-listen-<name>` for a
    /// `[[sockets]]` policy socket.
    pub fd_name: String,
    /// `None` for the main socket, else the `[[sockets]]` entry's name.
    pub policy: Option<String>,
    pub path: PathBuf,
    /// Set when clawmux created the socket file (not systemd): the new
    /// instance owns it from now on and removes it at its final stop.
    pub owned: Option<OwnedSocket>,
}

/// A socket file clawmux created, and its lock (whose descriptor travels as
/// `<fd_name>-lock`: an `flock` belongs to the open file, so the lock moves
/// with the descriptor and is never released in between).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OwnedSocket {
    /// (device, inode) of the socket file when it was bound.
    pub ino: Option<(u64, u64)>,
    pub lock_path: PathBuf,
}

/// The descriptor name of the main socket.
pub const MAIN_LISTENER: &str = "clawmux-listen";

/// The descriptor name of a policy socket's listener.
pub fn policy_listener(name: &str) -> String {
    format!("{MAIN_LISTENER}-{name}")
}

/// The descriptor name of a listener's lock file.
pub fn lock_name(fd_name: &str) -> String {
    format!("{fd_name}-lock")
}

/// Why a state cannot be taken; the new instance starts fresh instead.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Unreadable {
    #[error("cannot read the state: {0}")]
    Io(String),
    #[error("the state is {0} bytes, more than any this version writes")]
    TooLarge(u64),
    #[error("the state is in format {found}; this clawmux reads format {FORMAT} only")]
    Format { found: u64 },
    #[error("the state is not valid: {0}")]
    Invalid(String),
}

/// Checks a document's `format` before it is read whole, so a newer format
/// is reported as such rather than as a schema error. Reads nothing else
/// into memory: the document is parsed once more, into its own type, after.
pub(super) fn check_format(bytes: &[u8]) -> Result<(), Unreadable> {
    /// The format number of any document; every other field is skipped.
    #[derive(Deserialize)]
    struct Head {
        format: Option<serde_json::Value>,
    }
    let invalid = |e: serde_json::Error| Unreadable::Invalid(e.to_string());
    // Only an object has one (a struct would also be read from an array).
    if bytes.trim_ascii_start().first() != Some(&b'{') {
        serde_json::from_slice::<serde::de::IgnoredAny>(bytes).map_err(invalid)?;
        return Err(Unreadable::Invalid("no format number".into()));
    }
    let head: Head = serde_json::from_slice(bytes).map_err(invalid)?;
    match head.format.as_ref().and_then(serde_json::Value::as_u64) {
        Some(f) if f == u64::from(FORMAT) => Ok(()),
        Some(found) => Err(Unreadable::Format { found }),
        None => Err(Unreadable::Invalid("no format number".into())),
    }
}

impl State {
    /// Parses a state, checking the format first so a newer format is
    /// reported as such rather than as a schema error.
    pub fn parse(bytes: &[u8]) -> Result<State, Unreadable> {
        check_format(bytes)?;
        let state: State =
            serde_json::from_slice(bytes).map_err(|e| Unreadable::Invalid(e.to_string()))?;
        let mut names: Vec<&str> = state.listeners.iter().map(|l| l.fd_name.as_str()).collect();
        names.sort_unstable();
        if names.windows(2).any(|w| w[0] == w[1]) {
            return Err(Unreadable::Invalid(
                "a descriptor name appears twice".into(),
            ));
        }
        let mains = state
            .listeners
            .iter()
            .filter(|l| l.policy.is_none())
            .count();
        if mains > 1
            || state
                .listeners
                .iter()
                .any(|l| l.policy.is_none() != (l.fd_name == MAIN_LISTENER))
        {
            return Err(Unreadable::Invalid(
                "the main listener is named twice or wrongly".into(),
            ));
        }
        Ok(state)
    }

    /// Writes the state into a new memfd and seals it (no write, grow or
    /// shrink, no further seals): the reader gets exactly these bytes.
    pub fn to_memfd(&self) -> std::io::Result<OwnedFd> {
        memfd_with(&serde_json::to_vec(self).map_err(std::io::Error::other)?)
    }

    /// Reads a state from a memfd (from its start, whatever its offset).
    pub fn from_fd(fd: impl AsFd) -> Result<State, Unreadable> {
        State::parse(&read_memfd(fd, MAX_STATE_BYTES)?)
    }
}

/// A new sealed memfd holding `bytes`.
pub fn memfd_with(bytes: &[u8]) -> std::io::Result<OwnedFd> {
    use rustix::fs::{MemfdFlags, SealFlags};
    let fd = rustix::fs::memfd_create(
        "clawmux-handover",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )?;
    let mut file = std::fs::File::from(fd);
    file.write_all(bytes)?;
    rustix::fs::fcntl_add_seals(
        &file,
        SealFlags::WRITE | SealFlags::GROW | SealFlags::SHRINK | SealFlags::SEAL,
    )?;
    Ok(OwnedFd::from(file))
}

/// A memfd's bytes from its start, at most `max`.
pub fn read_memfd(fd: impl AsFd, max: u64) -> Result<Vec<u8>, Unreadable> {
    let io = |e: std::io::Error| Unreadable::Io(e.to_string());
    let mut file = std::fs::File::from(fd.as_fd().try_clone_to_owned().map_err(io)?);
    let len = file.metadata().map_err(io)?.len();
    if len > max {
        return Err(Unreadable::TooLarge(len));
    }
    file.seek(SeekFrom::Start(0)).map_err(io)?;
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(max + 1).read_to_end(&mut bytes).map_err(io)?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> State {
        State {
            format: FORMAT,
            from_version: "0.1.0".into(),
            from_pid: 42,
            listeners: vec![
                Listener {
                    fd_name: MAIN_LISTENER.into(),
                    policy: None,
                    path: "/run/user/1000/clawmux.sock".into(),
                    owned: Some(OwnedSocket {
                        ino: Some((1, 2)),
                        lock_path: "/run/user/1000/.clawmux.sock.lock".into(),
                    }),
                },
                Listener {
                    fd_name: policy_listener("ro"),
                    policy: Some("ro".into()),
                    path: "/run/user/1000/ro.sock".into(),
                    owned: None,
                },
            ],
        }
    }

    #[test]
    fn a_state_comes_back_from_its_sealed_memfd_unchanged() {
        let fd = state().to_memfd().unwrap();
        let seals = rustix::fs::fcntl_get_seals(&fd).unwrap();
        assert!(seals.contains(rustix::fs::SealFlags::WRITE | rustix::fs::SealFlags::SEAL));
        assert_eq!(State::from_fd(&fd).unwrap(), state());
        // Sealed: nobody can change it after it was written.
        let mut file = std::fs::File::from(fd);
        assert!(file.write_all(b"x").is_err());
    }

    /// A memfd over the cap is not a state this version wrote: refused by
    /// its size, before a byte is read (`MAX_STATE_BYTES`, limits page).
    #[test]
    fn a_state_over_the_cap_is_refused_by_its_size() {
        let mut big = serde_json::to_vec(&state()).unwrap();
        big.resize(MAX_STATE_BYTES as usize + 1, b' ');
        let fd = memfd_with(&big).unwrap();
        assert_eq!(
            State::from_fd(&fd),
            Err(Unreadable::TooLarge(MAX_STATE_BYTES + 1))
        );
        big.truncate(MAX_STATE_BYTES as usize);
        assert_eq!(State::from_fd(memfd_with(&big).unwrap()).unwrap(), state());
    }

    #[test]
    fn another_format_or_a_broken_state_is_refused_not_guessed() {
        let mut next = serde_json::to_value(state()).unwrap();
        next["format"] = serde_json::json!(FORMAT + 1);
        next["clients"] = serde_json::json!([]);
        let bytes = serde_json::to_vec(&next).unwrap();
        assert_eq!(
            State::parse(&bytes),
            Err(Unreadable::Format {
                found: u64::from(FORMAT) + 1
            })
        );
        assert!(matches!(
            State::parse(b"{\"format\":1"),
            Err(Unreadable::Invalid(_))
        ));
        assert!(matches!(State::parse(b"{}"), Err(Unreadable::Invalid(_))));
        let no_number = Err(Unreadable::Invalid("no format number".into()));
        assert_eq!(State::parse(b"[1]"), no_number);
        assert_eq!(State::parse(b"{\"format\":\"1\"}"), no_number);
        assert_eq!(
            super::super::clients::Clients::parse(b"{\"format\":7,\"x\":[]}").map(|_| ()),
            Err(Unreadable::Format { found: 7 })
        );
        let mut unknown = serde_json::to_value(state()).unwrap();
        unknown["clients"] = serde_json::json!([]);
        assert!(matches!(
            State::parse(&serde_json::to_vec(&unknown).unwrap()),
            Err(Unreadable::Invalid(_))
        ));
        let mut twice = state();
        twice.listeners[1].fd_name = MAIN_LISTENER.into();
        assert!(matches!(
            State::parse(&serde_json::to_vec(&twice).unwrap()),
            Err(Unreadable::Invalid(_))
        ));
    }
}
