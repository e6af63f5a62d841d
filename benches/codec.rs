//! Frame codec: encoding and decoding DATA requests and replies.
//!
//! `cargo bench --bench codec`

use binx_proto::{
    BinReply, BinRequest, Frame, FrameCodec, MessageType, OutFrame, Segment, Status, write_frames,
};
use bytes::{Bytes, BytesMut};
use criterion::{Criterion, Throughput};
use std::hint::black_box;
use tokio_util::codec::{Decoder, Encoder};

fn data_request() -> BinRequest {
    let mut r = BinRequest::new(MessageType::Data);
    r.request_id = 123_456;
    r.task_id = "20261122_053000_00042_abcde.3.0.0.0".into();
    r.buffer_id = 17;
    r.page_token = 9_876;
    r.max_size_bytes = 1 << 20;
    r.max_wait_micros = 1_000_000;
    r
}

fn data_reply(pages: usize, size: usize) -> (BinReply, Vec<Bytes>) {
    let h = BinReply {
        request_id: 123_456,
        r#type: MessageType::Data as i32,
        status: Status::Ok as i32,
        page_token: 9_876,
        page_next_token: 9_876 + pages as u64,
        segments: vec![Segment::inline(9_876, vec![size as u64; pages])],
        ..Default::default()
    };
    let page = Bytes::from(vec![7u8; size]);
    (h, vec![page; pages])
}

fn codec(c: &mut Criterion) {
    let mut group = c.benchmark_group("codec");
    let request = data_request();
    group.throughput(Throughput::Elements(1));
    group.bench_function("encode_data_request", |b| {
        let mut codec = FrameCodec::<BinReply, BinRequest>::default();
        let mut dst = BytesMut::with_capacity(4096);
        b.iter(|| {
            dst.clear();
            codec
                .encode(Frame::new(black_box(request.clone())), &mut dst)
                .unwrap();
        })
    });
    let mut wire = BytesMut::new();
    FrameCodec::<BinReply, BinRequest>::default()
        .encode(Frame::new(request), &mut wire)
        .unwrap();
    let wire = wire.freeze();
    group.bench_function("decode_data_request", |b| {
        let mut codec = FrameCodec::<BinRequest, BinReply>::default();
        b.iter(|| {
            let mut src = BytesMut::from(&wire[..]);
            black_box(codec.decode(&mut src).unwrap().unwrap());
        })
    });

    for (pages, size) in [(32usize, 32usize), (1, 1 << 20)] {
        let (header, body) = data_reply(pages, size);
        let mut wire = BytesMut::new();
        FrameCodec::<BinRequest, BinReply>::default()
            .encode(
                Frame {
                    header: header.clone(),
                    body: Bytes::from(body.concat()),
                },
                &mut wire,
            )
            .unwrap();
        let wire = wire.freeze();
        group.throughput(Throughput::Bytes(wire.len() as u64));
        group.bench_function(format!("decode_data_reply_{pages}x{size}B"), |b| {
            let mut codec = FrameCodec::<BinReply, BinRequest>::default();
            b.iter(|| {
                // A fresh buffer each time, as a socket read would fill it.
                let mut src = BytesMut::from(&wire[..]);
                black_box(codec.decode(&mut src).unwrap().unwrap());
            })
        });
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        group.bench_function(format!("write_data_reply_{pages}x{size}B_vectored"), |b| {
            let mut scratch = BytesMut::with_capacity(64 << 10);
            let mut sink = tokio::io::sink();
            b.iter(|| {
                let frame = OutFrame {
                    header: header.clone(),
                    body: body.clone(),
                };
                runtime
                    .block_on(write_frames(&mut sink, [frame], &mut scratch))
                    .unwrap();
            })
        });
    }
    group.finish();
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    codec(&mut criterion);
    criterion.final_summary();
}
