//! Reads frames from a socket into a few rotating receive buffers.
//!
//! Decoded bodies are slices of the receive buffer (zero copy), so a buffer
//! stays allocated while any page from it is alive. Growing one buffer per
//! large frame would give every frame fresh memory, and first touches of
//! fresh memory cost page faults: on loopback that was a third of the time of
//! a 1 MiB exchange. Instead the reader retires a full buffer to a short list
//! of spares and takes back a spare whose pages have all been dropped, so the
//! same memory serves frame after frame, whatever the allocator does.
//!
//! No page pins a spare, nor a frame still arriving, so no page's memory
//! count includes them: readers that share a [`ReceiveBudget`] (a server's,
//! one per connection) hold both within it together.

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::codec::{Frame, FrameCodec, FrameError};
use crate::receive_budget::{FrameRoom, ReceiveBudget};

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

/// One reader's spare buffers, each with the bytes it holds of the budget
/// (given back when it is taken for reuse, freed, or the reader dropped).
#[derive(Default)]
struct Spares {
    buffers: Vec<(BytesMut, u64)>,
    budget: Option<ReceiveBudget>,
}

impl Spares {
    /// Keeps `buffer` (an allocation of `size` bytes) if a spare place and
    /// the budget allow; else it is freed once its pages are.
    fn keep(&mut self, buffer: BytesMut, size: u64) {
        if self.buffers.len() >= SPARES {
            return;
        }
        if let Some(budget) = &self.budget
            && !budget.try_take_spare(size)
        {
            return;
        }
        self.buffers.push((buffer, size));
    }

    /// A spare whose pages are all gone with room for `target` bytes.
    fn reclaim(&mut self, target: usize) -> Option<BytesMut> {
        let i = self
            .buffers
            .iter_mut()
            .position(|(spare, _)| spare.try_reclaim(target))?;
        let (buffer, size) = self.buffers.swap_remove(i);
        if let Some(budget) = &self.budget {
            budget.give_back_spare(size);
        }
        Some(buffer)
    }

    fn clear(&mut self) {
        let held: u64 = self.buffers.drain(..).map(|(_, size)| size).sum();
        if let Some(budget) = &self.budget {
            budget.give_back_spare(held);
        }
        self.buffers = Vec::new();
    }
}

impl Drop for Spares {
    fn drop(&mut self) {
        self.clear();
    }
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
    spares: Spares,
    eof: bool,
    /// Size of the last frame larger than `SMALL_BUFFER`: the next frame is
    /// expected to be as large, so a buffer starts it only with that much room.
    last_large: usize,
    /// Buffers allocated (not reclaimed) after the first.
    fresh_buffers: u64,
    /// Room the large frame being received holds of the budget.
    receiving: Option<FrameRoom>,
    /// Longest a frame that took room may take to arrive.
    frame_timeout: std::time::Duration,
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
            spares: Spares::default(),
            eof: false,
            last_large: 0,
            fresh_buffers: 0,
            receiving: None,
            frame_timeout: std::time::Duration::MAX,
        }
    }

    /// (id, size) of the receive buffer the last frame's body is a slice
    /// of: every page of that body keeps all of it allocated. Ids are unique
    /// in the process; a reused buffer gets a new one.
    pub fn last_backing(&self) -> (u64, u64) {
        self.last_backing
    }

    /// Keeps spare buffers, and frames larger than a small buffer while
    /// they arrive, within `budget`, shared with other readers; such a
    /// frame must be whole within `frame_timeout` of the room taken for it,
    /// else reading fails with [`FrameError::Stalled`]. Without a budget, a
    /// reader keeps up to three spares of any size, and reads any frame at
    /// once, taking as long as its peer does.
    pub fn with_receive_budget(
        mut self,
        budget: ReceiveBudget,
        frame_timeout: std::time::Duration,
    ) -> Self {
        self.receiving = None;
        self.frame_timeout = frame_timeout;
        self.spares.clear();
        self.spares.budget = Some(budget);
        self
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
        self.spares.clear();
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
            self.spares.buffers.len(),
            self.spares.buffers.iter().map(|(b, _)| b.capacity()).sum(),
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
                // Whole: its pages count where they are kept now.
                self.receiving = None;
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
            self.frame_room().await;
            let limit = self.make_room();
            let mut taken = (&mut self.reader).take(limit);
            let read = taken.read_buf(&mut self.buffer);
            let read = match &self.receiving {
                Some(room) => match tokio::time::timeout_at(room.deadline, read).await {
                    Ok(read) => read,
                    Err(_) => return Some(Err(self.stalled_error())),
                },
                None => read.await,
            };
            match read {
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

    fn stalled_error(&self) -> FrameError {
        FrameError::Stalled {
            length: self.receiving.as_ref().map_or(0, |room| room.length as u64),
            received: self.buffer.len() as u64,
            after: self.frame_timeout,
        }
    }

    /// With a budget, room for the frame being received before its body is
    /// read, when it is larger than a small buffer (waiting for it).
    async fn frame_room(&mut self) {
        let Some(budget) = &self.spares.budget else {
            return;
        };
        let frame = frame_total(&self.buffer);
        if self.receiving.is_none() && frame > SMALL_BUFFER {
            let timeout = self.frame_timeout;
            self.receiving = Some(budget.frame_room(frame, timeout).await);
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
        // Without a budget, the next frame is expected as large as the last
        // large one. With one, a large buffer is taken only for a frame that
        // has room (a spare taken back is counted nowhere after).
        let expected = if self.spares.budget.is_some() {
            0
        } else {
            self.last_large
        };
        let missing = if frame > 0 {
            frame - self.buffer.len()
        } else {
            expected
        }
        .max(MIN_READ_ROOM);
        let limit = if frame > SMALL_BUFFER {
            (frame - self.buffer.len()) as u64
        } else if self.spares.budget.is_some() {
            // Until a frame has room of the budget, no more than a small
            // buffer's worth is read past the last whole frame.
            SMALL_BUFFER.saturating_sub(self.buffer.len()).max(1) as u64
        } else {
            u64::MAX
        };
        let room = self.buffer.capacity() - self.buffer.len();
        if room >= missing {
            return limit;
        }
        let size = if frame.max(expected) > SMALL_BUFFER {
            frame.max(expected).max(LARGE_BUFFER)
        } else {
            SMALL_BUFFER
        };
        let target = size.max(self.buffer.len() + missing);
        let mut next = match self.spares.reclaim(target) {
            Some(spare) => spare,
            None => {
                self.fresh_buffers += 1;
                BytesMut::with_capacity(target)
            }
        };
        // Only the start of one frame is carried over.
        next.extend_from_slice(&self.buffer);
        self.buffer_id = next_buffer_id();
        let retired_size = std::mem::replace(&mut self.buffer_size, next.capacity());
        let mut retired = std::mem::replace(&mut self.buffer, next);
        retired.clear();
        self.spares.keep(retired, retired_size as u64);
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
    use tokio::io::AsyncWriteExt;

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
        assert!(reader.spares.buffers.len() <= SPARES);
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

    /// The wire bytes of ENQUEUE frames with bodies of `sizes`.
    async fn frames_of(sizes: &[usize]) -> Vec<u8> {
        let mut wire = Vec::new();
        let mut scratch = BytesMut::new();
        for &size in sizes {
            let frame = OutFrame {
                header: BinRequest::new(MessageType::Enqueue),
                body: vec![Bytes::from(vec![1u8; size])],
            };
            write_frames(&mut wire, [frame], &mut scratch)
                .await
                .unwrap();
        }
        wire
    }

    /// Reads every frame of `wire`, keeping every body (so no buffer can be
    /// reused): the reader after, and the bodies.
    async fn read_all(
        wire: Vec<u8>,
        budget: Option<&ReceiveBudget>,
    ) -> FrameReader<std::io::Cursor<Vec<u8>>, BinRequest> {
        let mut reader = FrameReader::new(std::io::Cursor::new(wire), 64 << 20);
        if let Some(budget) = budget {
            reader = reader.with_receive_budget(budget.clone(), std::time::Duration::from_secs(5));
        }
        let mut bodies = Vec::new();
        while let Some(frame) = reader.next().await {
            bodies.push(frame.unwrap().body);
        }
        assert_eq!(bodies.len(), 6);
        reader
    }

    #[tokio::test]
    async fn readers_sharing_a_budget_keep_spares_within_it_together() {
        let wire = frames_of(&[5 << 20; 6]).await;
        // Alone, a reader keeps three spares of any size.
        let alone = read_all(wire.clone(), None).await;
        assert_eq!(alone.spare_buffers().0, SPARES);
        let budget = ReceiveBudget::new(12 << 20);
        let mut readers = Vec::new();
        for _ in 0..4 {
            readers.push(read_all(wire.clone(), Some(&budget)).await);
        }
        let (count, bytes) = readers
            .iter()
            .map(|r| r.spare_buffers())
            .fold((0, 0), |(c, b), (n, m)| (c + n, b + m));
        assert!(
            budget.spares_held() <= budget.limit() && bytes as u64 <= budget.spares_held(),
            "{count} spares of {bytes} bytes kept, {} of the budget taken",
            budget.spares_held()
        );
        // Without the budget the four would keep twelve (each a 5 MiB
        // buffer but the first, a small one).
        assert!(
            count < 4 * SPARES && budget.spares_held() > 0,
            "{count} spares kept"
        );
        // Spares taken back for reuse, released, or dropped with their
        // reader give their share of the budget back.
        readers[0].release_spare_buffers();
        readers.truncate(1);
        drop(readers);
        assert_eq!(budget.spares_held(), 0);
        assert_eq!(budget.frames_held(), 0, "every frame was whole");
    }

    /// Two connections of one budget: while one peer sends a large frame
    /// the other's large frame waits (only a small buffer of it is read);
    /// a peer that stalls inside its frame gets an error at the frame
    /// timeout, which gives the room to the other.
    #[tokio::test(start_paused = true)]
    async fn a_large_frame_waits_for_room_and_a_stalled_one_gives_it_back() {
        let budget = ReceiveBudget::new(8 << 20);
        let timeout = std::time::Duration::from_secs(30);
        let wire = frames_of(&[6 << 20]).await;
        let (mut stalling, a) = tokio::io::duplex(1 << 20);
        let (mut whole, b) = tokio::io::duplex(1 << 20);
        let mut first = FrameReader::<_, BinRequest>::new(a, 64 << 20)
            .with_receive_budget(budget.clone(), timeout);
        let mut second = FrameReader::<_, BinRequest>::new(b, 64 << 20)
            .with_receive_budget(budget.clone(), timeout);
        let half = wire[..3 << 20].to_vec();
        let total = wire.len() as u64;
        let stall = tokio::spawn(async move {
            stalling.write_all(&half).await.unwrap();
            stalling
        });
        let send = tokio::spawn(async move { whole.write_all(&wire).await.map(|()| whole) });
        let first_read = tokio::spawn(async move {
            let error = first.next().await;
            (first, error)
        });
        // The first takes the room, and gets half its frame.
        while budget.frames_held() == 0 {
            tokio::task::yield_now().await;
        }
        let second_read =
            tokio::time::timeout(std::time::Duration::from_secs(10), second.next()).await;
        assert!(second_read.is_err(), "the second frame waited for room");
        assert!(
            second.buffered() <= SMALL_BUFFER,
            "{} bytes read ahead of room",
            second.buffered()
        );
        let (first, error) = first_read.await.unwrap();
        let error = error.unwrap().unwrap_err();
        assert!(
            matches!(error, FrameError::Stalled { length, received, .. }
            if length == total && received == 3 << 20),
            "{error}"
        );
        drop(first);
        let frame = second.next().await.unwrap().unwrap();
        assert_eq!(frame.body.len(), 6 << 20);
        assert_eq!(budget.frames_held(), 0);
        drop(stall.await.unwrap());
        drop(send.await.unwrap().unwrap());
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
