//! Attaching shared memory on a Unix socket connection: SHM_ATTACH as the
//! first request after the preface, the reply read together with the region
//! descriptors it carries, then the BinX stream runs through the regions
//! (docs/PROTOCOL.md section 6).

use std::io;
use std::time::Duration;

use binx_proto::{BinReply, BinRequest, FrameCodec, MessageType, OutFrame, Status, write_frames};
use binx_shm::{ShmReader, ShmWriter};
use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio_util::codec::Decoder;

/// Largest attach reply accepted (it has no body).
const MAX_REPLY: usize = 64 * 1024;

/// Room left in a slot for a reply's header, besides its pages.
fn header_room(slot_size: usize) -> usize {
    (slot_size / 16).clamp(4 << 10, 64 << 10)
}

/// The largest reply to ask for so that its frame fits one slot, and its
/// pages are read in place (docs/PROTOCOL.md section 6); `None` when slots
/// are too small for any run to be read in place.
pub(crate) fn reply_size_in_place(slot_size: usize) -> Option<u64> {
    let size = slot_size.saturating_sub(header_room(slot_size));
    (size >= binx_shm::stream::MIN_IN_PLACE).then_some(size as u64)
}

/// Asks for shared memory on `stream` (prefaces already exchanged) and
/// returns the stream halves over the regions, and the size of their slots.
pub(crate) async fn attach(
    mut stream: UnixStream,
    spin: Duration,
) -> io::Result<(ShmReader, ShmWriter, usize)> {
    let mut request = BinRequest::new(MessageType::ShmAttach);
    request.request_id = 1;
    let mut bytes = Vec::new();
    write_frames(&mut bytes, [OutFrame::new(request)], &mut BytesMut::new())
        .await
        .map_err(io::Error::other)?;
    stream.write_all(&bytes).await?;

    let mut buf = vec![0u8; MAX_REPLY];
    let (mut got, fds) = binx_shm::pass::recv_with_fds(&stream, &mut buf).await?;
    if got == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "binxd closed the connection instead of answering SHM_ATTACH",
        ));
    }
    let mut codec = FrameCodec::<BinReply, ()>::new(MAX_REPLY);
    let reply = loop {
        let mut pending = BytesMut::from(&buf[..got]);
        if let Some(frame) = codec.decode(&mut pending).map_err(|e| {
            io::Error::new(io::ErrorKind::InvalidData, format!("SHM_ATTACH reply: {e}"))
        })? {
            break frame.header;
        }
        if got == buf.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "SHM_ATTACH reply is larger than 64 KiB",
            ));
        }
        let n = stream.read(&mut buf[got..]).await?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "binxd closed the connection in the middle of the SHM_ATTACH reply",
            ));
        }
        got += n;
    };
    if reply.status_kind() != Status::Ok {
        return Err(io::Error::other(format!(
            "binxd refused shared memory with {}: {}",
            reply.status_kind().name(),
            reply.error
        )));
    }
    let (reader, writer, link) = binx_shm::attach(fds, stream, spin)?;
    Ok((reader, writer, link.layout().slot_size))
}
