//! Frames from a stream that arrives as owned chunks rather than through a
//! read buffer: shared memory hands the reader each run of bytes in place,
//! in the slot the sidecar wrote it to.
//!
//! A frame that lies inside one chunk is decoded with no copy (its body is
//! a slice of the chunk, so it keeps the chunk alive); a frame that spans
//! chunks is copied together. The bytes decoded are the same either way, so
//! a writer that aligns frames to chunks only saves the copy.

use bytes::{Bytes, BytesMut};

use crate::codec::{Frame, FrameCodec, FrameError, FrameExtent};

/// Decodes frames of header type `H` from chunks pushed in stream order.
pub struct FrameAssembler<H> {
    codec: FrameCodec<H, ()>,
    /// The rest of the last chunk pushed, not yet decoded.
    chunk: Bytes,
    /// The start of a frame that spans chunks, copied together.
    spanning: BytesMut,
    /// Frames decoded in place and copied together, for tests and metrics.
    in_place: u64,
    copied: u64,
}

impl<H: prost::Message + Default> FrameAssembler<H> {
    /// Decodes frames whose `length` is at most `max_frame_length`.
    pub fn new(max_frame_length: usize) -> Self {
        FrameAssembler {
            codec: FrameCodec::new(max_frame_length),
            chunk: Bytes::new(),
            spanning: BytesMut::new(),
            in_place: 0,
            copied: 0,
        }
    }

    /// Whether every chunk pushed has been used up: only then may the next
    /// be pushed.
    pub fn wants_chunk(&self) -> bool {
        self.chunk.is_empty()
    }

    /// The next chunk of the stream. Call only when [`Self::wants_chunk`].
    pub fn push(&mut self, chunk: Bytes) {
        debug_assert!(self.chunk.is_empty());
        self.chunk = chunk;
    }

    /// Bytes received that are not yet part of a frame returned.
    pub fn buffered(&self) -> usize {
        self.chunk.len() + self.spanning.len()
    }

    /// (frames decoded in place, frames copied together).
    pub fn counts(&self) -> (u64, u64) {
        (self.in_place, self.copied)
    }

    /// The next whole frame, or `None` until more chunks arrive. Any error
    /// is final: the stream position is unknown afterwards.
    pub fn next_frame(&mut self) -> Result<Option<Frame<H>>, FrameError> {
        if self.spanning.is_empty() {
            if let Some(frame) = self.codec.decode_frame_in_place(&mut self.chunk)? {
                self.in_place += 1;
                return Ok(Some(frame));
            }
            if self.chunk.is_empty() {
                return Ok(None);
            }
        }
        // A frame (or its fixed fields) spans chunks: copy exactly up to its
        // end, checking its limits as soon as its length is known, before
        // anything past them is buffered.
        loop {
            let want = match self.codec.frame_extent(&self.spanning)? {
                FrameExtent {
                    total: Some(total),
                    header_length: Some(_),
                } => {
                    // Exactly the frame's size (limits checked above): the
                    // pages keep this allocation, so it must not be larger
                    // than they are, nor copied again as it grows.
                    self.spanning.reserve(total - self.spanning.len());
                    total
                }
                _ => 8,
            };
            let take = want
                .saturating_sub(self.spanning.len())
                .min(self.chunk.len());
            if take == 0 {
                break;
            }
            self.spanning.extend_from_slice(&self.chunk.split_to(take));
        }
        match self.codec.decode_frame(&mut self.spanning)? {
            Some(frame) => {
                self.copied += 1;
                Ok(Some(frame))
            }
            None => Ok(None),
        }
    }

    /// Once the stream has ended: bytes left over are a truncated frame.
    pub fn finish(&mut self) -> Result<(), FrameError> {
        match self.buffered() {
            0 => Ok(()),
            buffered => Err(FrameError::Truncated { buffered }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::encode_frame_head;
    use crate::{BinReply, MessageType};
    use proptest::prelude::*;

    fn wire(frames: &[(u64, Vec<u8>)]) -> Vec<u8> {
        let mut out = BytesMut::new();
        for (id, body) in frames {
            let mut header = BinReply::to(
                &crate::BinRequest::new(MessageType::Data),
                crate::Status::Ok,
            );
            header.request_id = *id;
            encode_frame_head(&header, body.len(), &mut out).unwrap();
            out.extend_from_slice(body);
        }
        out.to_vec()
    }

    fn decode_all(
        assembler: &mut FrameAssembler<BinReply>,
        chunks: Vec<Bytes>,
    ) -> Result<Vec<Frame<BinReply>>, FrameError> {
        let mut frames = Vec::new();
        for chunk in chunks {
            assert!(assembler.wants_chunk());
            assembler.push(chunk);
            while let Some(frame) = assembler.next_frame()? {
                frames.push(frame);
            }
        }
        assembler.finish()?;
        Ok(frames)
    }

    #[test]
    fn a_frame_inside_a_chunk_is_a_slice_of_it_and_one_across_chunks_is_copied() {
        let bytes = wire(&[(1, vec![7; 1000]), (2, vec![8; 3000])]);
        let first = wire(&[(1, vec![7; 1000])]).len();
        let chunk = Bytes::from(bytes);
        let (one, two) = (chunk.slice(..first + 100), chunk.slice(first + 100..));
        let mut assembler = FrameAssembler::<BinReply>::new(1 << 20);
        let frames = decode_all(&mut assembler, vec![one.clone(), two]).unwrap();
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[0].body, vec![7u8; 1000]);
        assert_eq!(frames[1].body, vec![8u8; 3000]);
        let inside = one.as_ptr_range();
        assert!(inside.contains(&frames[0].body.as_ptr()), "not in place");
        assert_eq!(assembler.counts(), (1, 1));
    }

    #[test]
    fn limits_are_checked_before_a_spanning_frame_is_buffered() {
        // A length of 1 GiB, then a chunk of garbage: refused at the length.
        let mut assembler = FrameAssembler::<BinReply>::new(1 << 20);
        assembler.push(Bytes::from_static(&[0x40, 0, 0]));
        assert!(assembler.next_frame().unwrap().is_none());
        assembler.push(Bytes::from_static(&[0, 0, 0, 0, 1]));
        assert!(matches!(
            assembler.next_frame(),
            Err(FrameError::TooLarge { .. })
        ));
        assert!(assembler.buffered() <= 8);
    }

    #[test]
    fn a_stream_ending_inside_a_frame_is_truncated() {
        let bytes = wire(&[(1, vec![1; 50])]);
        let mut assembler = FrameAssembler::<BinReply>::new(1 << 20);
        let cut = Bytes::from(bytes[..30].to_vec());
        assert!(matches!(
            decode_all(&mut assembler, vec![cut]),
            Err(FrameError::Truncated { buffered: 30 })
        ));
    }

    proptest! {
        /// Whatever the chunking, the frames decoded are those the
        /// contiguous decoder finds, in order.
        #[test]
        fn any_chunking_decodes_the_same_frames(
            bodies in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..600), 1..8),
            cuts in proptest::collection::vec(1usize..700, 0..20),
        ) {
            let frames: Vec<(u64, Vec<u8>)> =
                bodies.into_iter().enumerate().map(|(i, b)| (i as u64 + 1, b)).collect();
            let all = Bytes::from(wire(&frames));
            let mut chunks = Vec::new();
            let mut at = 0;
            for cut in cuts {
                if at >= all.len() {
                    break;
                }
                let end = (at + cut).min(all.len());
                chunks.push(all.slice(at..end));
                at = end;
            }
            if at < all.len() {
                chunks.push(all.slice(at..));
            }
            let mut assembler = FrameAssembler::<BinReply>::new(1 << 20);
            let decoded = decode_all(&mut assembler, chunks).unwrap();
            prop_assert_eq!(decoded.len(), frames.len());
            for (frame, (id, body)) in decoded.iter().zip(&frames) {
                prop_assert_eq!(frame.header.request_id, *id);
                prop_assert_eq!(&frame.body[..], &body[..]);
            }
        }

        /// Arbitrary bytes in arbitrary chunks: frames or an error, never a
        /// panic, and never more buffered than one frame's limit.
        #[test]
        fn garbage_is_an_error_or_frames(
            bytes in proptest::collection::vec(any::<u8>(), 0..2000),
            step in 1usize..64,
        ) {
            let mut assembler = FrameAssembler::<BinReply>::new(512);
            for chunk in bytes.chunks(step) {
                assembler.push(Bytes::copy_from_slice(chunk));
                loop {
                    match assembler.next_frame() {
                        Ok(Some(_)) => continue,
                        Ok(None) => break,
                        Err(_) => return Ok(()),
                    }
                }
                prop_assert!(assembler.buffered() <= 516 + step);
            }
        }
    }
}
