//! Sending and receiving file descriptors with SCM_RIGHTS on a tokio Unix
//! socket. The descriptors ride on the first byte of the data sent with
//! them, so the receiver must read that byte with [`recv_with_fds`], never
//! with a plain read (which would drop them).

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use tokio::io::Interest;
use tokio::net::UnixStream;

use crate::{PASSED_FDS, ShmError};

/// Writes all of `bytes`, the descriptors attached to the first of them.
pub async fn send_with_fds(
    socket: &UnixStream,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> Result<(), ShmError> {
    let failed = |e: std::io::Error| ShmError::Sys("sending shared memory descriptors", e);
    let mut sent = 0;
    while sent < bytes.len() {
        socket.writable().await.map_err(failed)?;
        let result = socket.try_io(Interest::WRITABLE, || {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(PASSED_FDS))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            if sent == 0 && !control.push(SendAncillaryMessage::ScmRights(fds)) {
                return Err(std::io::Error::other(
                    "too many descriptors for one message",
                ));
            }
            rustix::net::sendmsg(
                socket,
                &[IoSlice::new(&bytes[sent..])],
                &mut control,
                SendFlags::NOSIGNAL,
            )
            .map_err(std::io::Error::from)
        });
        match result {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(failed(e)),
        }
    }
    Ok(())
}

/// Reads some bytes into `buf` with whatever descriptors ride on them;
/// returns the byte count (0 at end of stream) and the descriptors.
pub async fn recv_with_fds(
    socket: &UnixStream,
    buf: &mut [u8],
) -> Result<(usize, Vec<OwnedFd>), ShmError> {
    let failed = |e: std::io::Error| ShmError::Sys("receiving shared memory descriptors", e);
    loop {
        socket.readable().await.map_err(failed)?;
        let result = socket.try_io(Interest::READABLE, || {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(PASSED_FDS))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let msg = rustix::net::recvmsg(
                socket,
                &mut [IoSliceMut::new(buf)],
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            )
            .map_err(std::io::Error::from)?;
            let mut fds = Vec::new();
            for message in control.drain() {
                if let RecvAncillaryMessage::ScmRights(rights) = message {
                    fds.extend(rights);
                }
            }
            let truncated = msg.flags.contains(rustix::net::ReturnFlags::CTRUNC);
            Ok((msg.bytes, fds, truncated))
        });
        match result {
            Ok((_, _, true)) => {
                return Err(ShmError::Passing(format!(
                    "more descriptors arrived than the {PASSED_FDS} expected"
                )));
            }
            Ok((n, fds, false)) => return Ok((n, fds)),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(failed(e)),
        }
    }
}
