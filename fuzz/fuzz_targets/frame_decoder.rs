//! Feeds arbitrary bytes, in arbitrary pieces, to both directions of the
//! frame decoder and to the assembler that decodes shared memory runs in
//! place. They must return frames or errors, never panic, never hold more
//! than they were given plus one reservation step, and the assembler must
//! find exactly the frames the contiguous decoder finds.

#![no_main]

use binx_proto::{BinReply, BinRequest, FrameAssembler, FrameCodec};
use bytes::{Bytes, BytesMut};
use libfuzzer_sys::fuzz_target;
use tokio_util::codec::Decoder;

fuzz_target!(|data: &[u8]| {
    // The first byte picks the size of the pieces the stream arrives in.
    let Some((&step, stream)) = data.split_first() else {
        return;
    };
    let step = usize::from(step).max(1);
    let mut requests = FrameCodec::<BinRequest, BinReply>::new(1 << 16);
    let mut replies = FrameCodec::<BinReply, BinRequest>::new(1 << 16);
    let (mut a, mut b) = (BytesMut::new(), BytesMut::new());
    let (mut a_failed, mut b_failed) = (false, false);
    let mut assembler = FrameAssembler::<BinReply>::new(1 << 16);
    let (mut assembled, mut c_failed) = (Vec::new(), false);
    let mut decoded = Vec::new();
    for piece in stream.chunks(step) {
        if !c_failed {
            assembler.push(Bytes::copy_from_slice(piece));
            loop {
                match assembler.next_frame() {
                    Ok(Some(frame)) => assembled.push(frame),
                    Ok(None) => break,
                    Err(_) => {
                        c_failed = true;
                        break;
                    }
                }
            }
            assert!(assembler.buffered() <= (1 << 16) + 4 + step);
        }
        a.extend_from_slice(piece);
        b.extend_from_slice(piece);
        while !a_failed {
            match requests.decode(&mut a) {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(_) => a_failed = true,
            }
        }
        while !b_failed {
            match replies.decode(&mut b) {
                Ok(Some(frame)) => decoded.push(frame),
                Ok(None) => break,
                Err(_) => b_failed = true,
            }
        }
        assert!(a.capacity() <= stream.len() + (2 << 20));
    }
    let _ = requests.decode_eof(&mut a);
    let _ = replies.decode_eof(&mut b);
    assert_eq!(assembled, decoded);
    assert_eq!(c_failed, b_failed);
});
