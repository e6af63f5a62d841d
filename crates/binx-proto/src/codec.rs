//! Frame codec (docs/PROTOCOL.md section 2): `u32 length`, `u32 header_length`,
//! a protobuf header, then the raw body. Decoded bodies are slices of the read
//! buffer, so pages are never copied between the socket and the buffer manager.

use std::io;
use std::marker::PhantomData;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use thiserror::Error;
#[cfg(feature = "io")]
use tokio_util::codec::{Decoder, Encoder};

/// Default limit on `length`: 64 MiB of body plus 64 KiB for the header.
pub const DEFAULT_MAX_FRAME_LENGTH: usize = 64 * 1024 * 1024 + 64 * 1024;

/// Longest header accepted (docs/PROTOCOL.md section 2), checked before it is
/// decoded, so a frame of empty repeated fields cannot make the receiver
/// build millions of values.
pub const MAX_HEADER_LENGTH: usize = 64 * 1024;

/// One message: a decoded header and the raw body that follows it.
#[derive(Clone, Debug, PartialEq)]
pub struct Frame<H> {
    /// The protobuf header ([`crate::BinRequest`] or [`crate::BinReply`]).
    pub header: H,
    /// The bytes after the header: the pages, back to back.
    pub body: Bytes,
}

impl<H> Frame<H> {
    /// A frame without a body.
    pub fn new(header: H) -> Self {
        Frame {
            header,
            body: Bytes::new(),
        }
    }
}

/// Why a frame could not be decoded or encoded. Every decode error is fatal for
/// the connection: the stream position is unknown afterwards.
#[derive(Debug, Error)]
pub enum FrameError {
    /// The frame length cannot even hold the header length.
    #[error("frame length {length} is below the minimum of 4")]
    LengthTooSmall {
        /// The frame length received.
        length: u32,
    },
    /// The frame is longer than this side accepts (refused before reading it).
    #[error("frame length {length} exceeds the limit of {limit} bytes")]
    TooLarge {
        /// The frame length received (or to be sent).
        length: u64,
        /// The largest frame accepted.
        limit: usize,
    },
    /// The header length points past the end of the frame.
    #[error("frame header length {header_length} exceeds the {available} bytes that follow it")]
    HeaderTooLong {
        /// The header length received.
        header_length: u32,
        /// The bytes of the frame after the header length.
        available: u32,
    },
    /// The header is longer than [`MAX_HEADER_LENGTH`].
    #[error("frame header length {header_length} exceeds the header limit of {limit} bytes")]
    HeaderOverLimit {
        /// The header length received.
        header_length: u32,
        /// The largest header accepted.
        limit: usize,
    },
    /// The header is not a valid protobuf message.
    #[error("frame header does not decode as protobuf: {0}")]
    BadHeader(#[from] prost::DecodeError),
    /// The stream ended inside a frame.
    #[error("connection closed in the middle of a frame ({buffered} bytes of it received)")]
    Truncated {
        /// The bytes of the unfinished frame that did arrive.
        buffered: usize,
    },
    /// A frame was not whole within the frame timeout of the room its
    /// receiver took for it (its peer stalled inside it).
    #[error(
        "a frame of {length} bytes was not complete within {after:?} of its start ({received} bytes of it received); the connection is closed"
    )]
    Stalled {
        /// Bytes of the frame (its length field included).
        length: u64,
        /// Bytes of it that arrived.
        received: u64,
        /// The frame timeout.
        after: std::time::Duration,
    },
    /// Reading or writing the stream failed.
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// What the fixed fields at the start of a frame say, as far as they have
/// arrived (see [`FrameCodec::frame_extent`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FrameExtent {
    /// Bytes of the whole frame, its `length` field included.
    pub total: Option<usize>,
    /// Bytes of its header.
    pub header_length: Option<usize>,
}

/// Decodes frames whose header is `In` and encodes frames whose header is `Out`.
/// A server uses `FrameCodec<BinRequest, BinReply>`, a client the reverse.
#[derive(Debug)]
pub struct FrameCodec<In, Out> {
    max_frame_length: usize,
    _types: PhantomData<fn(Out) -> In>,
}

impl<In, Out> Clone for FrameCodec<In, Out> {
    fn clone(&self) -> Self {
        FrameCodec::new(self.max_frame_length)
    }
}

impl<In, Out> Default for FrameCodec<In, Out> {
    fn default() -> Self {
        FrameCodec::new(DEFAULT_MAX_FRAME_LENGTH)
    }
}

impl<In, Out> FrameCodec<In, Out> {
    /// A codec refusing frames whose `length` field exceeds `max_frame_length`.
    pub fn new(max_frame_length: usize) -> Self {
        FrameCodec {
            max_frame_length: max_frame_length.min(u32::MAX as usize),
            _types: PhantomData,
        }
    }

    /// The largest `length` field this codec accepts.
    pub fn max_frame_length(&self) -> usize {
        self.max_frame_length
    }

    /// Changes the limit for the frames not decoded yet (a server accepts
    /// only small frames until the peer has authenticated).
    pub fn set_max_frame_length(&mut self, max_frame_length: usize) {
        self.max_frame_length = max_frame_length.min(u32::MAX as usize);
    }
}

impl<In: prost::Message + Default, Out> FrameCodec<In, Out> {
    /// Checks the fixed fields at the start of `src` as far as they have
    /// arrived: the frame's whole size (length field included) once its
    /// `length` is in, and its header length once that is in too. Every
    /// limit is checked before anything of the frame is buffered or decoded.
    pub(crate) fn frame_extent(&self, src: &[u8]) -> Result<FrameExtent, FrameError> {
        let [a, b, c, d, rest @ ..] = src else {
            return Ok(FrameExtent::default());
        };
        let length = u32::from_be_bytes([*a, *b, *c, *d]);
        if length < 4 {
            return Err(FrameError::LengthTooSmall { length });
        }
        if length as usize > self.max_frame_length {
            return Err(FrameError::TooLarge {
                length: length.into(),
                limit: self.max_frame_length,
            });
        }
        let total = Some(4 + length as usize);
        let [e, f, g, h, ..] = rest else {
            return Ok(FrameExtent {
                total,
                header_length: None,
            });
        };
        let header_length = u32::from_be_bytes([*e, *f, *g, *h]);
        if header_length > length - 4 {
            return Err(FrameError::HeaderTooLong {
                header_length,
                available: length - 4,
            });
        }
        if header_length as usize > MAX_HEADER_LENGTH {
            return Err(FrameError::HeaderOverLimit {
                header_length,
                limit: MAX_HEADER_LENGTH,
            });
        }
        Ok(FrameExtent {
            total,
            header_length: Some(header_length as usize),
        })
    }

    /// (whole size, header length) of the frame at the start of `src` once
    /// all of it is there.
    fn whole_frame(&self, src: &[u8]) -> Result<Option<(usize, usize)>, FrameError> {
        Ok(match self.frame_extent(src)? {
            FrameExtent {
                total: Some(total),
                header_length: Some(header_length),
            } if src.len() >= total => Some((total, header_length)),
            _ => None,
        })
    }

    /// The next whole frame at the start of `src`, taken out of it; `None`
    /// until all of it has arrived (the reader decides how to make room, see
    /// `FrameReader`).
    pub fn decode_frame(&mut self, src: &mut BytesMut) -> Result<Option<Frame<In>>, FrameError> {
        let Some((total, header_length)) = self.whole_frame(src)? else {
            return Ok(None);
        };
        let mut frame = src.split_to(total);
        frame.advance(8);
        let header = frame.split_to(header_length);
        let header = In::decode(header.freeze())?;
        Ok(Some(Frame {
            header,
            body: frame.freeze(),
        }))
    }

    /// The next whole frame at the start of `src` when all of it is there,
    /// taken out of it with no copy: its body is a slice of `src`.
    pub fn decode_frame_in_place(
        &mut self,
        src: &mut Bytes,
    ) -> Result<Option<Frame<In>>, FrameError> {
        let Some((total, header_length)) = self.whole_frame(src)? else {
            return Ok(None);
        };
        let mut frame = src.split_to(total);
        frame.advance(8);
        let header = In::decode(frame.split_to(header_length))?;
        Ok(Some(Frame {
            header,
            body: frame,
        }))
    }

    /// Like [`FrameCodec::decode_frame`] once the peer closed: bytes left
    /// over are a truncated frame.
    pub fn decode_frame_eof(
        &mut self,
        buf: &mut BytesMut,
    ) -> Result<Option<Frame<In>>, FrameError> {
        match self.decode_frame(buf)? {
            Some(frame) => Ok(Some(frame)),
            None if buf.is_empty() => Ok(None),
            None => Err(FrameError::Truncated {
                buffered: buf.len(),
            }),
        }
    }
}

#[cfg(feature = "io")]
impl<In: prost::Message + Default, Out> Decoder for FrameCodec<In, Out> {
    type Item = Frame<In>;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Frame<In>>, FrameError> {
        self.decode_frame(src)
    }

    fn decode_eof(&mut self, buf: &mut BytesMut) -> Result<Option<Frame<In>>, FrameError> {
        self.decode_frame_eof(buf)
    }
}

#[cfg(feature = "io")]
impl<In, Out: prost::Message> Encoder<Frame<Out>> for FrameCodec<In, Out> {
    type Error = FrameError;

    fn encode(&mut self, frame: Frame<Out>, dst: &mut BytesMut) -> Result<(), FrameError> {
        encode_frame_head(&frame.header, frame.body.len(), dst)?;
        dst.extend_from_slice(&frame.body);
        Ok(())
    }
}

/// A frame to send: a header and a body in any number of pieces (pages are
/// not copied into one buffer).
#[derive(Clone, Debug)]
pub struct OutFrame<H> {
    /// The protobuf header.
    pub header: H,
    /// The body's pieces, written back to back.
    pub body: Vec<Bytes>,
}

impl<H> OutFrame<H> {
    /// A frame without a body.
    pub fn new(header: H) -> Self {
        OutFrame {
            header,
            body: Vec::new(),
        }
    }

    /// Bytes of body.
    pub fn body_len(&self) -> usize {
        self.body.iter().map(Bytes::len).sum()
    }
}

/// Appends the `length`, `header_length` and header of a frame whose body of
/// `body_len` bytes the caller sends next. Refuses a frame whose length does
/// not fit the `u32` field.
pub fn encode_frame_head<H: prost::Message>(
    header: &H,
    body_len: usize,
    dst: &mut BytesMut,
) -> Result<(), FrameError> {
    let header_len = header.encoded_len();
    let length = 4 + header_len as u64 + body_len as u64;
    if length > u64::from(u32::MAX) {
        return Err(FrameError::TooLarge {
            length,
            limit: u32::MAX as usize,
        });
    }
    dst.reserve(8 + header_len);
    dst.put_u32(length as u32);
    dst.put_u32(header_len as u32);
    header
        .encode(dst)
        .map_err(|e| FrameError::Io(io::Error::other(e)))?;
    Ok(())
}

#[cfg(all(test, feature = "io"))]
mod tests {
    use super::*;
    use crate::{BinReply, BinRequest, MessageType};

    type ServerCodec = FrameCodec<BinRequest, BinReply>;
    type ClientCodec = FrameCodec<BinReply, BinRequest>;

    #[test]
    fn decodes_frame_fed_one_byte_at_a_time() {
        let mut request = BinRequest::new(MessageType::Enqueue);
        request.task_id = "t1".into();
        request.page_sizes = vec![3];
        let mut wire = BytesMut::new();
        ClientCodec::default()
            .encode(
                Frame {
                    header: request.clone(),
                    body: Bytes::from_static(b"abc"),
                },
                &mut wire,
            )
            .unwrap();
        let mut codec = ServerCodec::default();
        let mut src = BytesMut::new();
        let mut out = None;
        for (i, byte) in wire.iter().enumerate() {
            src.put_u8(*byte);
            let got = codec.decode(&mut src).unwrap();
            if i + 1 < wire.len() {
                assert!(got.is_none(), "frame complete early at byte {i}");
            } else {
                out = got;
            }
        }
        let frame = out.expect("frame after the last byte");
        assert_eq!(frame.header, request);
        assert_eq!(&frame.body[..], b"abc");
        assert!(src.is_empty());
    }

    #[test]
    fn refuses_bad_lengths() {
        let mut codec = ServerCodec::new(1024);
        let mut src = BytesMut::from(&[0u8, 0, 0, 3][..]);
        assert!(matches!(
            codec.decode(&mut src),
            Err(FrameError::LengthTooSmall { length: 3 })
        ));
        let mut src = BytesMut::from(&[0xffu8, 0xff, 0xff, 0xff][..]);
        assert!(matches!(
            codec.decode(&mut src),
            Err(FrameError::TooLarge {
                length: 0xffff_ffff,
                limit: 1024
            })
        ));
        let mut src = BytesMut::from(&[0u8, 0, 0, 10, 0, 0, 0, 7][..]);
        assert!(matches!(
            codec.decode(&mut src),
            Err(FrameError::HeaderTooLong {
                header_length: 7,
                available: 6
            })
        ));
        let mut src = BytesMut::from(&[0u8, 0, 0, 6, 0, 0, 0, 2, 0xff, 0xff][..]);
        assert!(matches!(
            codec.decode(&mut src),
            Err(FrameError::BadHeader(_))
        ));
    }

    #[test]
    fn eof_inside_a_frame_is_an_error() {
        let mut codec = ServerCodec::default();
        let mut src = BytesMut::from(&[0u8, 0, 0, 10, 0, 0][..]);
        assert!(matches!(
            codec.decode_eof(&mut src),
            Err(FrameError::Truncated { buffered: 6 })
        ));
    }
}
