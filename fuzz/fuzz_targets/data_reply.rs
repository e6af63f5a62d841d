//! Feeds arbitrary DATA replies (decoded from the input as frames) to the
//! consumer machine (`binx_core::source::SourceMachine`), answering its
//! requests in an order the input picks, with pipelining on or off. What a
//! hostile server sends must never make it panic, hand out a page twice or
//! out of order, or keep more requests in flight than it may.

#![no_main]

use binx_core::source::{PullConfig, PullStep, ReplyPart, SourceMachine};
use binx_proto::{BinReply, BinRequest, FrameCodec, MessageType};
use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use tokio_util::codec::Decoder;

fuzz_target!(|data: &[u8]| {
    let Some((&knobs, frames)) = data.split_first() else {
        return;
    };
    let depth = usize::from(knobs % 4).max(1);
    let config = PullConfig {
        memory_budget: [1, 4 << 10, 1 << 20, u64::MAX][usize::from(knobs >> 2) % 4],
        max_reply_size: [0, 1, 100, 1 << 20][usize::from(knobs >> 4) % 4],
        accept_spooled: knobs & 0x40 != 0,
        pipeline_depth: depth,
        ..PullConfig::default()
    };
    let mut machine = SourceMachine::new("t", 0, config);
    let mut codec = FrameCodec::<BinReply, BinRequest>::new(1 << 16);
    let mut input = BytesMut::from(frames);
    let mut in_flight: Vec<BinRequest> = Vec::new();
    let mut next = 0u64;
    let mut held = 0u64;
    for _ in 0..256 {
        loop {
            match machine.poll(held) {
                PullStep::Send(r) => {
                    in_flight.push(*r);
                    assert!(machine.data_in_flight() <= depth + 1);
                    assert!(in_flight.len() <= 64, "requests without end");
                }
                PullStep::Done => return,
                PullStep::AwaitReply | PullStep::WaitForConsumer => break,
            }
        }
        if in_flight.is_empty() {
            held = 0;
            continue;
        }
        // The next frame of the input answers one of the requests in flight
        // (its request_id picks which), or the input has ended.
        let Ok(Some(frame)) = codec.decode(&mut input) else {
            return;
        };
        let pick = (frame.header.request_id % in_flight.len() as u64) as usize;
        let request = in_flight.swap_remove(pick);
        let mut header = frame.header;
        header.r#type = request.r#type;
        if header.status % 3 == 0 {
            // Not answered (lost, BUSY).
            let _ = machine.on_reply(&request, None);
            continue;
        }
        if !machine.awaits(&request) {
            let _ = machine.on_reply(&request, None);
            continue;
        }
        let Ok(parts) = machine.on_reply(&request, Some((&header, frame.body.len()))) else {
            return;
        };
        for part in parts {
            let (first, count) = match &part {
                ReplyPart::Inline {
                    first_token,
                    offset,
                    sizes,
                } => {
                    let length: u64 = sizes.iter().sum();
                    assert!(*offset as u64 + length <= frame.body.len() as u64);
                    held = held.saturating_add(length);
                    (*first_token, sizes.len() as u64)
                }
                ReplyPart::Spooled {
                    first_token,
                    segment,
                } => {
                    assert!(request.accept_spooled, "a spooled part it did not accept");
                    (*first_token, segment.page_sizes.len() as u64)
                }
            };
            assert_eq!(first, next, "pages out of order or twice");
            next += count;
        }
        assert_eq!(machine.token(), next);
        if request.r#type == MessageType::Data as i32 && header.status % 5 == 0 {
            held = 0;
        }
    }
});
