//! The `SIGUSR2` upgrade: the old instance's side ([`Successor`], driven by
//! [`super::old_instance::upgrade`]) and the new one's ([`Predecessor`],
//! driven by [`super::new_instance`]). The control
//! socket carries one word per line:
//!
//! 1. `valid` or `invalid <why>` (new → old): the state reads here;
//! 2. `released` (old → new), with the descriptors: the old one stopped
//!    serving at a message boundary;
//! 3. `ready` (new → old): everything is taken over, and nothing moved has
//!    been read or written yet (the new instance's [`crate::gate::Gate`] is
//!    closed), so the old one can still serve it all again, exactly;
//! 4. `commit` (old → new): the old one will never serve the moved sockets
//!    again; from here the new one owns them, and opens its gate;
//! 5. `serving` (new → old): systemd knows the new main process; the old
//!    one exits;
//! 6. `stop` (old → new), once for each stop asked of the old instance
//!    during the upgrade or after it, while it is still there (it lets go
//!    and exits, or it stays for its terminal): the new one counts it with
//!    its own stop signals, a stop sent to both being one
//!    ([`Next::ask_to_stop`]).
//!
//! So a moved socket is served by exactly one instance at a time: before
//! `commit` only the old one may touch it (and does again if the upgrade
//! fails), after only the new one. An upgrade that fails after `commit`
//! (the new instance dies in between) closes the moved clients; they
//! reconnect to the old one, which serves on, and resume by cursor.

use std::ffi::OsString;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

use super::clients::{Clients, Packed};
use super::{state, wire, State, CONTROL_FD_NAME, FDS_ENV};

/// How long the new instance may take to start and check the state before
/// the old one gives up on it (and goes on serving).
pub const START_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the new instance may take, once the old one stopped serving,
/// to serve (open the event log, bind nothing, start accepting).
pub const SERVE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the old instance waits for a killed new one to be gone.
pub const END_WAIT: Duration = Duration::from_secs(2);

/// How long the new instance waits for the old one to stop serving, beyond
/// the old one's own `--shutdown-timeout` (the same flag, as it runs with
/// the same arguments). The release's own bounds, which that timeout does
/// not shorten, fit in it: the clients' stop (1.5 s), the gateway
/// sessions' (2 s, all at once) and the event log's close (1 s).
pub const RELEASE_MARGIN: Duration = Duration::from_secs(5);

/// The program and arguments an upgrade starts: the path this broker was
/// started from (so an upgraded binary there takes over) and its own
/// arguments. Taken at start: after a package upgrade `/proc/self/exe`
/// names the deleted old file.
#[derive(Debug, Clone)]
pub struct Program {
    pub path: PathBuf,
    pub args: Vec<OsString>,
}

impl Program {
    /// This process's program and arguments.
    pub fn current() -> std::io::Result<Program> {
        Ok(Program {
            path: std::env::current_exe()?,
            args: std::env::args_os().skip(1).collect(),
        })
    }
}

/// The new instance, seen from the old one.
pub struct Successor {
    child: tokio::process::Child,
    lines: Lines<BufReader<OwnedReadHalf>>,
    write: OwnedWriteHalf,
}

impl Successor {
    pub fn spawn(
        program: &Program,
        state: &State,
        mut fds: Vec<(String, OwnedFd)>,
    ) -> std::io::Result<Successor> {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
        fds.push((state::STATE_FD_NAME.to_owned(), state.to_memfd()?));
        fds.push((CONTROL_FD_NAME.to_owned(), theirs.into()));
        // Copies without close-on-exec, so the child inherits them under
        // the numbers named in FDS_ENV; closed here right after the spawn.
        // (The broker starts no other program, so no other child can
        // inherit them meanwhile.)
        let inheritable = fds
            .iter()
            .map(|(name, fd)| Ok((name.clone(), rustix::io::dup(fd)?)))
            .collect::<std::io::Result<Vec<_>>>()?;
        let names = inheritable
            .iter()
            .map(|(name, fd)| format!("{name}={}", fd.as_raw_fd()))
            .collect::<Vec<_>>()
            .join(",");
        let mut command = tokio::process::Command::new(&program.path);
        // Blocked until the new instance's handlers are installed: a second
        // upgrade or a reload signalled at once must not kill it.
        crate::signals::hold_in_child(&mut command);
        let child = command
            .args(&program.args)
            .env(FDS_ENV, names)
            .env_remove("LISTEN_FDS")
            .env_remove("LISTEN_PID")
            .env_remove("LISTEN_FDNAMES")
            .kill_on_drop(false)
            .spawn();
        drop(inheritable);
        drop(fds);
        let child = child?;
        ours.set_nonblocking(true)?;
        let (read, write) = tokio::net::UnixStream::from_std(ours)?.into_split();
        Ok(Successor {
            child,
            lines: BufReader::new(read).lines(),
            write,
        })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Waits for `word`; anything else, an exit or the timeout is the
    /// reason the upgrade did not happen.
    pub async fn expect(&mut self, word: &str, timeout: Duration) -> Result<(), String> {
        let line = tokio::select! {
            line = tokio::time::timeout(timeout, self.lines.next_line()) => line,
            status = self.child.wait() => {
                return Err(match status {
                    Ok(s) => format!("the new instance exited ({s}) before it said {word}"),
                    Err(e) => format!("the new instance could not be waited for ({e})"),
                });
            }
        };
        match line {
            Err(_) => Err(format!(
                "the new instance did not say {word} within {} ms",
                timeout.as_millis()
            )),
            Ok(Ok(Some(line))) if line == word => Ok(()),
            Ok(Ok(Some(line))) => Err(format!(
                "the new instance refused: {}",
                crate::sanitize::one_line(line.strip_prefix("invalid ").unwrap_or(&line))
            )),
            Ok(Ok(None)) => Err(format!(
                "the new instance closed its control socket before it said {word}"
            )),
            Ok(Err(e)) => Err(format!("the new instance's control socket failed ({e})")),
        }
    }

    /// Says `released`, with the clients document (then the frames memfd
    /// and the gateway connection's socket, each when the document says
    /// it travels) and then
    /// every client's socket, in its order, as descriptors ([`wire`]).
    pub async fn send_released(&mut self, packed: &Packed) -> std::io::Result<()> {
        let doc = packed.doc.to_memfd()?;
        let sock = self.write.as_ref();
        let frames = packed.doc.frames_memfd()?;
        let mut first = vec![doc.as_fd()];
        first.extend(frames.as_ref().map(AsFd::as_fd));
        if packed.doc.upstream.is_some() {
            let upstream = packed.upstream.as_ref().ok_or_else(|| {
                std::io::Error::other("the gateway connection's socket is missing")
            })?;
            first.push(upstream.as_fd());
        }
        wire::send(sock, b"released\n", &first).await?;
        let mut fds: Vec<_> = packed.clients.iter().map(|(_, fd)| fd.as_fd()).collect();
        for (client, gateway) in &packed.dedicated {
            fds.push(client.as_fd());
            fds.push(gateway.as_fd());
        }
        fds.extend(packed.streams.iter().map(AsFd::as_fd));
        fds.extend(packed.narrower.iter().map(AsFd::as_fd));
        for chunk in fds.chunks(wire::FDS_PER_MESSAGE) {
            wire::send(sock, b"f", chunk).await?;
        }
        Ok(())
    }

    /// Says `commit`: from here the new instance owns what moved. An error
    /// means the word was not written (the new instance is gone, it cannot
    /// have read it): the moved sockets are still this instance's alone.
    pub async fn commit(&mut self) -> std::io::Result<()> {
        self.write.write_all(b"commit\n").await
    }

    /// Ends a new instance that will not serve (it may be stuck) and waits,
    /// bounded, until it is gone: what it holds (the event log's lock, its
    /// copies of the sockets) is let go before this one serves again.
    pub async fn end(mut self) {
        let _ = self.child.start_kill();
        if tokio::time::timeout(END_WAIT, self.child.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                pid = self.child.id(),
                "upgrade: the new instance did not end within {} ms",
                END_WAIT.as_millis()
            );
            self.abandon();
        }
    }

    /// The new instance serves: its process (a broker that keeps its
    /// terminal waits for it, [`crate::lifecycle`]) and the control
    /// socket's writing half, on which this one may still pass it a stop.
    pub fn into_next(self) -> Next {
        Next {
            child: self.child,
            control: self.write,
        }
    }

    /// Ends a new instance that will not serve (it may be stuck), and reaps
    /// it in the background.
    pub fn abandon(mut self) {
        let _ = self.child.start_kill();
        tokio::spawn(async move {
            let _ = self.child.wait().await;
        });
    }
}

/// The instance that took over, seen from the old one once it serves.
#[derive(Debug)]
pub struct Next {
    pub child: tokio::process::Child,
    control: OwnedWriteHalf,
}

impl Next {
    /// Says `stop`: a stop was asked of this instance (the new one counts
    /// it as a stop). Over the control socket, not as a signal: a stop
    /// signalled to the whole group (systemd, a terminal's job) has reached
    /// the new instance too, which counts word and signal as one stop; two
    /// signals would force its stop.
    pub async fn ask_to_stop(&mut self) -> std::io::Result<()> {
        tokio::time::timeout(Duration::from_secs(1), self.control.write_all(b"stop\n"))
            .await
            .map_err(|_| {
                std::io::Error::other("the new instance does not read its control socket")
            })?
    }
}

/// The old instance, seen from the new one during a `SIGUSR2` upgrade.
#[derive(Debug)]
pub struct Predecessor {
    control: tokio::net::UnixStream,
    /// What was read of the old instance's next word, once serving.
    partial: Vec<u8>,
}

impl Predecessor {
    /// Over the control socket the old instance passed.
    pub fn new(control: std::os::unix::net::UnixStream) -> std::io::Result<Predecessor> {
        control.set_nonblocking(true)?;
        Ok(Predecessor {
            control: tokio::net::UnixStream::from_std(control)?,
            partial: Vec::new(),
        })
    }

    pub async fn say(&mut self, word: &str) -> std::io::Result<()> {
        self.control.write_all(format!("{word}\n").as_bytes()).await
    }

    /// Once serving: waits for the old instance to say `stop` (a stop was
    /// asked of it), once per call. False when it ends without (it exited,
    /// the usual end) or says anything else. Cancel-safe: what was read of
    /// a word stays here for the next call.
    pub async fn stop_asked(&mut self) -> bool {
        loop {
            if let Some(end) = self.partial.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.partial.drain(..=end).collect();
                return line == b"stop\n";
            }
            if self.partial.len() > 64 {
                return false;
            }
            let mut buf = [0u8; 64];
            match self.control.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => self.partial.extend_from_slice(&buf[..n]),
            }
        }
    }

    /// After `ready`: waits for the old instance's `commit`. Anything else
    /// (it closed the socket, it gave up on the upgrade, the timeout) means
    /// it serves the moved sockets again: this instance must not touch them.
    pub async fn committed(&mut self, within: Duration) -> Result<(), String> {
        let mut line = Vec::new();
        let read = async {
            let mut byte = [0u8; 1];
            while line.len() < 64 {
                match self.control.read(&mut byte).await {
                    Ok(0) => return Err("the old instance closed the control socket".to_owned()),
                    Ok(_) if byte[0] == b'\n' => return Ok(()),
                    Ok(_) => line.push(byte[0]),
                    Err(e) => return Err(format!("the control socket failed ({e})")),
                }
            }
            Err("the old instance said too much".to_owned())
        };
        match tokio::time::timeout(within, read).await {
            Err(_) => Err(format!(
                "the old instance did not commit within {} ms",
                within.as_millis()
            )),
            Ok(Err(why)) => Err(why),
            Ok(Ok(())) if line == b"commit" => Ok(()),
            Ok(Ok(())) => Err(format!(
                "the old instance said \"{}\", not commit",
                crate::sanitize::one_line(&String::from_utf8_lossy(&line))
            )),
        }
    }

    /// Waits until the old instance stopped serving (it says `released`),
    /// and takes what it passes: the document, the gateway connection's
    /// socket if it moves, and each client's socket by id. Whole or not at
    /// all.
    pub async fn released(&mut self, within: Duration) -> Result<Packed, String> {
        tokio::time::timeout(within, self.receive())
            .await
            .map_err(|_| {
                format!(
                    "the old instance did not stop serving within {} ms",
                    within.as_millis()
                )
            })?
    }

    async fn receive(&mut self) -> Result<Packed, String> {
        let mut buf = [0u8; 64];
        let (n, mut fds) = wire::recv(&self.control, &mut buf)
            .await
            .map_err(|e| format!("the control socket failed ({e})"))?;
        if n == 0 {
            return Err("the old instance gave up on the upgrade".into());
        }
        if !buf[..n].starts_with(b"released\n") || fds.is_empty() {
            return Err(format!(
                "the old instance said \"{}\", not released",
                crate::sanitize::one_line(&String::from_utf8_lossy(&buf[..n]))
            ));
        }
        let doc = fds.remove(0);
        let mut clients = Clients::from_fd(&doc).map_err(|e| e.to_string())?;
        // Next when the document names it (read_frames refuses it missing).
        let frames = (clients.has_frames() && !fds.is_empty()).then(|| fds.remove(0));
        clients.read_frames(frames).map_err(|e| e.to_string())?;
        let upstream = match clients.upstream {
            Some(_) if fds.is_empty() => {
                return Err("the gateway connection's socket was not passed".into())
            }
            Some(_) => Some(fds.remove(0)),
            None => None,
        };
        let mut sockets = fds;
        let expected = clients.clients.len()
            + 2 * clients.dedicated.len()
            + clients.streams.len()
            + clients.narrower.len();
        while sockets.len() < expected {
            let (n, more) = wire::recv(&self.control, &mut buf)
                .await
                .map_err(|e| format!("the control socket failed ({e})"))?;
            if n == 0 {
                return Err("the old instance closed before passing every client".into());
            }
            sockets.extend(more);
        }
        if sockets.len() != expected {
            return Err("more client sockets than clients".into());
        }
        let narrower = sockets
            .split_off(clients.clients.len() + 2 * clients.dedicated.len() + clients.streams.len());
        let streams = sockets.split_off(clients.clients.len() + 2 * clients.dedicated.len());
        let mut dedicated_fds = sockets.split_off(clients.clients.len()).into_iter();
        let mut dedicated = Vec::new();
        while let (Some(client), Some(gateway)) = (dedicated_fds.next(), dedicated_fds.next()) {
            dedicated.push((client, gateway));
        }
        let fds = clients.clients.iter().map(|c| c.id).zip(sockets).collect();
        Ok(Packed {
            doc: clients,
            clients: fds,
            upstream,
            dedicated,
            streams,
            narrower,
            leftovers: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;
    use std::time::Duration;

    use super::Predecessor;

    /// A wait for the old instance's word that is cancelled (a `select!`
    /// that took another branch) after part of the word was read keeps that
    /// part: the next wait reads the rest and sees the whole word.
    #[tokio::test]
    async fn a_word_read_across_a_cancelled_wait_is_still_the_word() {
        let (mut old, new) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut previous = Predecessor::new(new).unwrap();
        old.write_all(b"st").unwrap();
        // Waits cancelled until the half word has been read (at most 5 s).
        for _ in 0..500 {
            if previous.partial == b"st" {
                break;
            }
            let cut = tokio::time::timeout(Duration::from_millis(10), previous.stop_asked()).await;
            assert!(cut.is_err(), "half a word is no word yet");
        }
        assert_eq!(previous.partial, b"st", "the half word was read and kept");
        old.write_all(b"op\nstop\n").unwrap();
        for _ in 0..2 {
            let asked = tokio::time::timeout(Duration::from_secs(5), previous.stop_asked())
                .await
                .expect("the word, read whole");
            assert!(asked);
        }
        drop(old);
        assert!(!previous.stop_asked().await, "the old instance ended");
    }

    #[tokio::test]
    async fn anything_but_stop_is_not_a_stop() {
        let (mut old, new) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut previous = Predecessor::new(new).unwrap();
        old.write_all(b"stopp\n").unwrap();
        assert!(!previous.stop_asked().await);
    }
}
