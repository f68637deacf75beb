//! Descriptors over the control socket of a `SIGUSR2` upgrade
//! (`SCM_RIGHTS`), for what exists only once the old instance stopped
//! serving: its clients' sockets. rustix does the system calls; what is
//! here is only the batching.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use tokio::io::Interest;
use tokio::net::UnixStream;

/// Descriptors per message (the kernel takes at most 253, `SCM_MAX_FD`).
pub const FDS_PER_MESSAGE: usize = 200;

/// Sends `data` with `fds` attached (at most [`FDS_PER_MESSAGE`]).
pub async fn send(sock: &UnixStream, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    assert!(fds.len() <= FDS_PER_MESSAGE && !data.is_empty());
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS_PER_MESSAGE))];
    loop {
        sock.writable().await?;
        let sent = sock.try_io(Interest::WRITABLE, || {
            let mut control = SendAncillaryBuffer::new(&mut space);
            if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
                return Err(io::Error::other("too many descriptors for one message"));
            }
            rustix::net::sendmsg(
                sock.as_fd(),
                &[io::IoSlice::new(data)],
                &mut control,
                SendFlags::NOSIGNAL,
            )
            .map_err(io::Error::from)
        });
        match sent {
            // The descriptors went with the first byte; the rest is plain data.
            Ok(n) if n == data.len() => return Ok(()),
            Ok(n) => return write_rest(sock, &data[n..]).await,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

async fn write_rest(sock: &UnixStream, mut rest: &[u8]) -> io::Result<()> {
    while !rest.is_empty() {
        sock.writable().await?;
        match sock.try_write(rest) {
            Ok(n) => rest = &rest[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Receives some data and the descriptors attached to it (close-on-exec).
/// `Ok((0, _))` at the end of the stream.
pub async fn recv(sock: &UnixStream, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS_PER_MESSAGE))];
    loop {
        sock.readable().await?;
        let mut fds = Vec::new();
        let got = sock.try_io(Interest::READABLE, || {
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let got = rustix::net::recvmsg(
                sock.as_fd(),
                &mut [io::IoSliceMut::new(buf)],
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            )
            .map_err(io::Error::from)?;
            for msg in control.drain() {
                if let RecvAncillaryMessage::ScmRights(rights) = msg {
                    fds.extend(rights);
                }
            }
            Ok(got.bytes)
        });
        match got {
            Ok(n) => return Ok((n, fds)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}
