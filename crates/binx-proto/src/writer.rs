//! Sends batches of frames with vectored writes: frame heads are encoded into
//! one scratch buffer, large bodies go out from their own memory (no copy),
//! small bodies are copied next to their head because one iovec is cheaper.

use std::io::{self, IoSlice};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncWrite, AsyncWriteExt};

use crate::codec::{FrameError, OutFrame, encode_frame_head};

/// Bodies shorter than this are copied beside their head instead of getting
/// an iovec of their own.
const COPY_BELOW: usize = 4096;

/// At most this many iovecs per `writev` call (well below `IOV_MAX`).
const MAX_IOVECS: usize = 64;

/// Writes every frame of `frames` in order and flushes; returns the bytes
/// written. `scratch` is reused between calls to hold the encoded heads.
pub async fn write_frames<W, H, I>(
    writer: &mut W,
    frames: I,
    scratch: &mut BytesMut,
) -> Result<u64, FrameError>
where
    W: AsyncWrite + Unpin,
    H: prost::Message,
    I: IntoIterator<Item = OutFrame<H>>,
{
    let mut chunks: Vec<Bytes> = Vec::new();
    for frame in frames {
        encode_frame_head(&frame.header, frame.body_len(), scratch)?;
        for piece in frame.body {
            if piece.len() < COPY_BELOW {
                scratch.extend_from_slice(&piece);
            } else {
                if !scratch.is_empty() {
                    chunks.push(scratch.split().freeze());
                }
                chunks.push(piece);
            }
        }
    }
    if !scratch.is_empty() {
        chunks.push(scratch.split().freeze());
    }
    write_all_vectored(writer, &chunks).await?;
    writer.flush().await?;
    Ok(chunks.iter().map(|c| c.len() as u64).sum())
}

/// At most this many queued frames go into one [`write_frames`] call.
pub const WRITE_BATCH: usize = 64;

/// The writing half of a connection (server or client): takes frames off
/// `queue` as they come, coalescing whatever else is already queued (up to
/// [`WRITE_BATCH`] frames) into one vectored write, and reports each
/// write's bytes, and of those its frames' bodies', to `written`, which
/// returns false to stop. Once the queue closes or `written` says stop,
/// shuts the writer down; a failed write returns its error at once.
pub async fn write_queued<W, H>(
    mut writer: W,
    queue: &mut tokio::sync::mpsc::Receiver<OutFrame<H>>,
    mut written: impl FnMut(u64, u64) -> bool,
) -> Result<(), FrameError>
where
    W: AsyncWrite + Unpin,
    H: prost::Message,
{
    let mut scratch = BytesMut::with_capacity(64 * 1024);
    let mut batch = Vec::with_capacity(WRITE_BATCH);
    while let Some(first) = queue.recv().await {
        batch.push(first);
        while batch.len() < WRITE_BATCH {
            match queue.try_recv() {
                Ok(frame) => batch.push(frame),
                Err(_) => break,
            }
        }
        let bodies = batch.iter().map(|f| f.body_len() as u64).sum();
        let bytes = write_frames(&mut writer, batch.drain(..), &mut scratch).await?;
        if !written(bytes, bodies) {
            break;
        }
    }
    let _ = writer.shutdown().await;
    Ok(())
}

async fn write_all_vectored<W: AsyncWrite + Unpin>(
    writer: &mut W,
    chunks: &[Bytes],
) -> io::Result<()> {
    let mut index = 0;
    let mut offset = 0;
    while index < chunks.len() {
        let mut slices: [IoSlice<'_>; MAX_IOVECS] = [IoSlice::new(&[]); MAX_IOVECS];
        let mut count = 0;
        for (i, chunk) in chunks[index..].iter().take(MAX_IOVECS).enumerate() {
            let start = if i == 0 { offset } else { 0 };
            slices[count] = IoSlice::new(&chunk[start..]);
            count += 1;
        }
        let mut written = writer.write_vectored(&slices[..count]).await?;
        if written == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        while written > 0 {
            let left = chunks[index].len() - offset;
            if written >= left {
                written -= left;
                index += 1;
                offset = 0;
            } else {
                offset += written;
                written = 0;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BinReply, BinRequest, Frame, FrameCodec, MessageType};
    use tokio_util::codec::Decoder;

    #[tokio::test]
    async fn vectored_frames_decode_back() {
        let big = Bytes::from(vec![7u8; 100_000]);
        let small = Bytes::from_static(b"tiny");
        let header = BinReply {
            r#type: MessageType::Data as i32,
            ..Default::default()
        };
        let frames = vec![
            OutFrame {
                header: header.clone(),
                body: vec![small.clone(), big.clone(), small.clone()],
            },
            OutFrame::new(header.clone()),
        ];
        let (mut a, mut b) = tokio::io::duplex(1 << 20);
        let mut scratch = BytesMut::new();
        write_frames(&mut a, frames, &mut scratch).await.unwrap();
        drop(a);
        let mut wire = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut b, &mut wire)
            .await
            .unwrap();
        let mut codec = FrameCodec::<BinReply, BinRequest>::default();
        let mut src = BytesMut::from(&wire[..]);
        let first: Frame<BinReply> = codec.decode(&mut src).unwrap().unwrap();
        let mut expected = small.to_vec();
        expected.extend_from_slice(&big);
        expected.extend_from_slice(&small);
        assert_eq!(first.body.to_vec(), expected);
        let second = codec.decode(&mut src).unwrap().unwrap();
        assert!(second.body.is_empty());
        assert!(src.is_empty());
    }
}
