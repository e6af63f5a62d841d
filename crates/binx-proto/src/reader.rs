//! Reads frames from a socket into a few rotating receive buffers.
//!
//! Decoded bodies are slices of the receive buffer (zero copy), so a buffer
//! stays allocated while any page from it is alive. Growing one buffer per
//! large frame would give every frame fresh memory, and first touches of
//! fresh memory cost page faults: on loopback that was a third of the time of
//! a 1 MiB exchange. Instead the reader retires a full buffer to a short list
//! of spares and takes back a spare whose pages have all been dropped, so the
//! same memory serves frame after frame, whatever the allocator does.

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::codec::{Frame, FrameCodec, FrameError};

/// Receive buffer for a connection that has seen only small frames: one
/// frame of the largest header and no body fits (8 bytes of lengths and
/// 64 KiB), so a peer whose requests carry no body never grows it.
const SMALL_BUFFER: usize = 8 + crate::codec::MAX_HEADER_LENGTH;

/// Receive buffer once frames larger than `SMALL_BUFFER` arrive: room for
/// several 1 MiB replies, so a buffer is retired only every few frames.
const LARGE_BUFFER: usize = 4 * 1024 * 1024;

/// Retired buffers kept for reuse.
const SPARES: usize = 3;

/// Least free room worth a `read` call.
const MIN_READ_ROOM: usize = 4 * 1024;

/// Numbers receive buffers across the process, so the pages a body pins can
/// be charged to the buffer they pin (see [`FrameReader::last_backing`]).
static BUFFER_IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn next_buffer_id() -> u64 {
    BUFFER_IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Frames of header type `H` from `reader`.
pub struct FrameReader<R, H> {
    reader: R,
    codec: FrameCodec<H, ()>,
    buffer: BytesMut,
    /// Id and size of the allocation `buffer` reads into.
    buffer_id: u64,
    buffer_size: usize,
    /// The allocation the last frame's body lies in.
    last_backing: (u64, u64),
    spares: Vec<BytesMut>,
    eof: bool,
    /// Size of the last frame larger than `SMALL_BUFFER`: the next frame is
    /// expected to be as large, so a buffer starts it only with that much room.
    last_large: usize,
    /// Buffers allocated (not reclaimed) after the first.
    fresh_buffers: u64,
}

impl<R: AsyncRead + Unpin, H: prost::Message + Default> FrameReader<R, H> {
    /// Reads frames whose `length` is at most `max_frame_length`.
    pub fn new(reader: R, max_frame_length: usize) -> Self {
        let buffer = BytesMut::with_capacity(SMALL_BUFFER);
        FrameReader {
            reader,
            codec: FrameCodec::new(max_frame_length),
            buffer_id: next_buffer_id(),
            buffer_size: buffer.capacity(),
            last_backing: (0, 0),
            buffer,
            spares: Vec::new(),
            eof: false,
            last_large: 0,
            fresh_buffers: 0,
        }
    }

    /// (id, size) of the receive buffer the last frame's body is a slice
    /// of: every page of that body keeps all of it allocated. Ids are unique
    /// in the process; a reused buffer gets a new one.
    pub fn last_backing(&self) -> (u64, u64) {
        self.last_backing
    }

    /// Changes the largest frame accepted from the next frame on.
    pub fn set_max_frame_length(&mut self, max_frame_length: usize) {
        self.codec.set_max_frame_length(max_frame_length);
    }

    /// Frees the receive buffers kept for reuse, and the current one too
    /// when it holds no partial frame and is larger than a small one (a
    /// connection that went quiet after large frames keeps only a small
    /// buffer; memory of pages still alive stays theirs).
    pub fn release_spare_buffers(&mut self) {
        self.spares = Vec::new();
        if self.buffer.is_empty() && self.buffer.capacity() > SMALL_BUFFER {
            self.buffer = BytesMut::with_capacity(SMALL_BUFFER);
            self.buffer_id = next_buffer_id();
            self.buffer_size = self.buffer.capacity();
        }
        self.last_large = 0;
    }

    /// Receive buffers kept for reuse, and their bytes (for tests).
    pub fn spare_buffers(&self) -> (usize, usize) {
        (
            self.spares.len(),
            self.spares.iter().map(BytesMut::capacity).sum(),
        )
    }

    /// Bytes read from the reader past the last frame returned.
    pub fn buffered(&self) -> usize {
        self.buffer.len()
    }

    /// The reader back, with the bytes read past the last frame returned
    /// (for a connection that switches transport after a request).
    pub fn into_parts(self) -> (R, BytesMut) {
        (self.reader, self.buffer)
    }

    /// The next frame if the bytes read already hold all of it (or an
    /// error), without reading: a server answering many requests per read
    /// takes them without building a future for each.
    pub fn buffered_frame(&mut self) -> Option<Result<Frame<H>, FrameError>> {
        let total = frame_total(&self.buffer);
        match self.codec.decode_frame(&mut self.buffer) {
            Ok(Some(frame)) => {
                if total > SMALL_BUFFER {
                    self.last_large = total;
                }
                self.last_backing = (self.buffer_id, self.buffer_size as u64);
                Some(Ok(frame))
            }
            Ok(None) => None,
            Err(e) => Some(Err(e)),
        }
    }

    /// The next frame; `None` when the peer closed cleanly between frames.
    /// Any error is final for the connection.
    pub async fn next(&mut self) -> Option<Result<Frame<H>, FrameError>> {
        loop {
            if let Some(next) = self.buffered_frame() {
                return Some(next);
            }
            if self.eof {
                return self.codec.decode_frame_eof(&mut self.buffer).transpose();
            }
            let limit = self.make_room();
            match (&mut self.reader)
                .take(limit)
                .read_buf(&mut self.buffer)
                .await
            {
                Ok(0) => self.eof = true,
                Ok(_) => {}
                // TLS without close_notify (a peer that just went away):
                // between frames nothing is lost, since frames carry their
                // length; inside one it is still a cut-off frame.
                Err(e)
                    if e.kind() == std::io::ErrorKind::UnexpectedEof && self.buffer.is_empty() =>
                {
                    self.eof = true
                }
                Err(e) => return Some(Err(e.into())),
            }
        }
    }

    /// Ensures the buffer can take the rest of the frame being received (at
    /// a frame boundary: a frame as large as the last large one, or at least
    /// a useful read), switching to a reclaimed or new buffer if not. Returns
    /// how much the next read may take: never past the end of a large frame,
    /// so a read does not carry the start of the next one into a buffer too
    /// small for it (which would have to be copied).
    fn make_room(&mut self) -> u64 {
        let frame = frame_total(&self.buffer);
        let missing = if frame > 0 {
            frame - self.buffer.len()
        } else {
            self.last_large
        }
        .max(MIN_READ_ROOM);
        let limit = if frame > SMALL_BUFFER {
            (frame - self.buffer.len()) as u64
        } else {
            u64::MAX
        };
        let room = self.buffer.capacity() - self.buffer.len();
        if room >= missing {
            return limit;
        }
        let size = if frame.max(self.last_large) > SMALL_BUFFER {
            frame.max(self.last_large).max(LARGE_BUFFER)
        } else {
            SMALL_BUFFER
        };
        let target = size.max(self.buffer.len() + missing);
        let reclaimed = self
            .spares
            .iter_mut()
            .position(|spare| spare.try_reclaim(target));
        let mut next = match reclaimed {
            Some(i) => self.spares.swap_remove(i),
            None => {
                self.fresh_buffers += 1;
                BytesMut::with_capacity(target)
            }
        };
        // Only the start of one frame is carried over.
        next.extend_from_slice(&self.buffer);
        self.buffer_id = next_buffer_id();
        self.buffer_size = next.capacity();
        let mut retired = std::mem::replace(&mut self.buffer, next);
        retired.clear();
        if self.spares.len() < SPARES {
            self.spares.push(retired);
        }
        limit
    }
}

/// Bytes of the whole frame at the start of `buffer` (length field
/// included), or 0 while its length field has not arrived.
fn frame_total(buffer: &[u8]) -> usize {
    match buffer {
        [a, b, c, d, ..] => 4 + u32::from_be_bytes([*a, *b, *c, *d]) as usize,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BinRequest, MessageType, OutFrame, write_frames};
    use bytes::Bytes;

    /// Yields `bytes`, then fails as rustls does when a peer goes away
    /// without close_notify.
    struct CutOff(std::io::Cursor<Vec<u8>>);

    impl AsyncRead for CutOff {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            if self.0.position() as usize == self.0.get_ref().len() {
                return std::task::Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "peer closed connection without sending TLS close_notify",
                )));
            }
            std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
        }
    }

    async fn one_frame() -> Vec<u8> {
        let mut bytes = Vec::new();
        let mut scratch = BytesMut::new();
        write_frames(
            &mut bytes,
            [OutFrame {
                header: BinRequest::new(MessageType::Ping),
                body: vec![Bytes::from_static(b"body")],
            }],
            &mut scratch,
        )
        .await
        .unwrap();
        bytes
    }

    #[tokio::test]
    async fn a_tls_peer_gone_without_close_notify_ends_cleanly_only_between_frames() {
        let whole = one_frame().await;
        let mut reader =
            FrameReader::<_, BinRequest>::new(CutOff(std::io::Cursor::new(whole.clone())), 1 << 20);
        assert_eq!(reader.next().await.unwrap().unwrap().body.as_ref(), b"body");
        assert!(reader.next().await.is_none(), "a clean end between frames");
        let cut = whole[..whole.len() - 2].to_vec();
        let mut reader =
            FrameReader::<_, BinRequest>::new(CutOff(std::io::Cursor::new(cut)), 1 << 20);
        assert!(
            matches!(reader.next().await, Some(Err(_))),
            "a frame cut off is still an error"
        );
    }

    #[tokio::test]
    async fn frames_of_every_size_arrive_whole_and_buffers_are_reused() {
        let (mut client, server) = tokio::io::duplex(256 * 1024);
        let sizes: Vec<usize> = [0, 10, 70_000, 1 << 20, 5 << 20, 3, 1 << 20]
            .into_iter()
            .cycle()
            .take(40)
            .collect();
        let expected = sizes.clone();
        let writer = tokio::spawn(async move {
            let mut scratch = BytesMut::new();
            for (i, size) in sizes.into_iter().enumerate() {
                let mut header = BinRequest::new(MessageType::Enqueue);
                header.request_id = i as u64;
                let body = Bytes::from(vec![i as u8; size]);
                write_frames(
                    &mut client,
                    [OutFrame {
                        header,
                        body: vec![body],
                    }],
                    &mut scratch,
                )
                .await
                .unwrap();
            }
        });
        let mut reader = FrameReader::<_, BinRequest>::new(server, 64 << 20);
        for (i, size) in expected.into_iter().enumerate() {
            let frame = reader.next().await.unwrap().unwrap();
            assert_eq!(frame.header.request_id, i as u64);
            assert_eq!(frame.body.len(), size);
            assert!(frame.body.iter().all(|&b| b == i as u8));
            // Dropped here, so retired buffers can be reclaimed.
        }
        writer.await.unwrap();
        assert!(reader.next().await.is_none());
        assert!(reader.spares.len() <= SPARES);
        // 40 frames, 16 of them 1 MiB or more: without reclaiming, every large
        // frame would need a buffer of its own.
        assert!(
            reader.fresh_buffers <= 6,
            "{} buffers allocated",
            reader.fresh_buffers
        );
        // A quiet connection gives its spares back, and keeps only a small
        // buffer (review: three 64 MiB spares stayed, counted nowhere).
        let (count, bytes) = reader.spare_buffers();
        assert!(
            count > 0 && bytes > SMALL_BUFFER,
            "{count} spares of {bytes} bytes"
        );
        reader.release_spare_buffers();
        assert_eq!(reader.spare_buffers(), (0, 0));
        assert!(reader.buffer.capacity() <= SMALL_BUFFER);
    }

    #[tokio::test]
    async fn a_stream_ending_inside_a_frame_is_an_error() {
        let wire: &[u8] = &[0, 0, 0, 20, 0, 0, 0, 2, 8, 1];
        let mut reader = FrameReader::<_, BinRequest>::new(wire, 1024);
        assert!(matches!(
            reader.next().await,
            Some(Err(FrameError::Truncated { buffered: 10 }))
        ));
    }

    #[tokio::test]
    async fn a_buffered_frame_is_taken_without_reading_and_only_when_whole() {
        let one = one_frame().await;
        // Two frames and half a third on the wire.
        let wire = [one.clone(), one.clone(), one[..one.len() / 2].to_vec()].concat();
        let mut reader = FrameReader::<_, BinRequest>::new(wire.as_slice(), 1 << 20);
        assert!(reader.buffered_frame().is_none(), "nothing read yet");
        assert_eq!(reader.next().await.unwrap().unwrap().body.as_ref(), b"body");
        let second = reader.buffered_frame().expect("read with the first");
        assert_eq!(second.unwrap().body.as_ref(), b"body");
        assert!(
            reader.buffered_frame().is_none(),
            "half a frame is not taken"
        );
        assert_eq!(reader.buffered(), one.len() / 2, "and stays buffered");
        assert!(matches!(
            reader.next().await,
            Some(Err(FrameError::Truncated { .. }))
        ));
        // A header past the limit is refused from the buffer too.
        let mut reader = FrameReader::<_, BinRequest>::new(&[0u8, 0, 1, 0, 0, 0, 0, 2][..], 16);
        assert!(reader.next().await.unwrap().is_err());
        let mut reader = FrameReader::<_, BinRequest>::new(one.as_slice(), 1 << 20);
        assert!(reader.next().await.unwrap().is_ok());
        assert!(reader.buffered_frame().is_none() && reader.next().await.is_none());
    }
}
