//! The codec against the hex test vectors in docs/PROTOCOL.md, byte for byte.

use binx_proto::{
    BinReply, BinRequest, Frame, FrameCodec, MessageType, PREFACE_LEN, Preface, Segment, Status,
};
use bytes::{Bytes, BytesMut};
use tokio_util::codec::{Decoder, Encoder};

fn doc() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/PROTOCOL.md");
    std::fs::read_to_string(path).expect("docs/PROTOCOL.md is readable")
}

/// The bytes of the ```hex block after `<!-- vector: NAME -->`.
fn vector(name: &str) -> Vec<u8> {
    let doc = doc();
    let marker = format!("<!-- vector: {name} -->");
    let start = doc
        .find(&marker)
        .unwrap_or_else(|| panic!("no vector {name}"));
    let rest = &doc[start..];
    let block_start = rest.find("```hex\n").expect("hex block") + 7;
    let block = &rest[block_start..];
    let block = &block[..block.find("```").expect("end of hex block")];
    let mut bytes = Vec::new();
    for line in block.lines() {
        let hex_part = line.trim_start().split("  ").next().unwrap_or("");
        for pair in hex_part.split_whitespace() {
            bytes.push(u8::from_str_radix(pair, 16).unwrap_or_else(|_| panic!("bad hex {pair:?}")));
        }
    }
    bytes
}

#[test]
fn preface_vector() {
    let bytes = vector("preface");
    assert_eq!(bytes.len(), PREFACE_LEN);
    assert_eq!(bytes, Preface::CURRENT.encode());
}

#[test]
fn data_request_vector() {
    let wire = vector("data-request");
    let mut expected = BinRequest::new(MessageType::Data);
    expected.request_id = 7;
    expected.task_id = "q1.2.0".into();
    expected.buffer_id = 3;
    expected.page_token = 42;
    expected.max_size_bytes = 1 << 20;
    expected.max_wait_micros = 1_000_000;

    let mut server = FrameCodec::<BinRequest, BinReply>::default();
    let mut src = BytesMut::from(&wire[..]);
    let frame = server.decode(&mut src).unwrap().expect("a whole frame");
    assert_eq!(frame.header, expected);
    assert!(frame.body.is_empty());
    assert!(src.is_empty());

    let mut client = FrameCodec::<BinReply, BinRequest>::default();
    let mut out = BytesMut::new();
    client.encode(Frame::new(expected), &mut out).unwrap();
    assert_eq!(out.to_vec(), wire);
}

#[test]
fn data_reply_vector() {
    let wire = vector("data-reply");
    let expected = BinReply {
        request_id: 7,
        r#type: MessageType::Data as i32,
        status: Status::Ok as i32,
        page_token: 42,
        page_next_token: 44,
        segments: vec![Segment::inline(42, vec![3, 5])],
        ..Default::default()
    };
    let body = Bytes::from_static(b"abchello");

    let mut client = FrameCodec::<BinReply, BinRequest>::default();
    let mut src = BytesMut::from(&wire[..]);
    let frame = client.decode(&mut src).unwrap().expect("a whole frame");
    assert_eq!(frame.header, expected);
    assert_eq!(frame.body, body);
    let pages = binx_proto::split_pages(&frame.body, &frame.header.segments[0].page_sizes).unwrap();
    assert_eq!(
        pages,
        vec![Bytes::from_static(b"abc"), Bytes::from_static(b"hello")]
    );

    let mut server = FrameCodec::<BinRequest, BinReply>::default();
    let mut out = BytesMut::new();
    server
        .encode(
            Frame {
                header: expected,
                body,
            },
            &mut out,
        )
        .unwrap();
    assert_eq!(out.to_vec(), wire);
}

#[test]
fn pipelined_data_vectors() {
    let wire = vector("pipelined-data-request");
    let mut request = BinRequest::new(MessageType::Data);
    request.request_id = 8;
    request.task_id = "q1.2.0".into();
    request.buffer_id = 3;
    request.page_token = 44;
    request.max_size_bytes = 2 << 20;
    request.max_wait_micros = 1_000_000;
    request.ack_token = Some(42);
    let mut server = FrameCodec::<BinRequest, BinReply>::default();
    let frame = server
        .decode(&mut BytesMut::from(&wire[..]))
        .unwrap()
        .expect("a whole frame");
    assert_eq!(frame.header, request);
    let mut client = FrameCodec::<BinReply, BinRequest>::default();
    let mut out = BytesMut::new();
    client
        .encode(Frame::new(request.clone()), &mut out)
        .unwrap();
    assert_eq!(out.to_vec(), wire);
    // ack_token 0 is present, not absent: it is written.
    request.ack_token = Some(0);
    let mut out = BytesMut::new();
    client.encode(Frame::new(request), &mut out).unwrap();
    assert_eq!(out.len(), wire.len());

    let wire = vector("pipelined-data-reply");
    let reply = BinReply {
        request_id: 8,
        r#type: MessageType::Data as i32,
        status: Status::Ok as i32,
        page_token: 44,
        page_next_token: 46,
        segments: vec![Segment::inline(44, vec![1, 2])],
        following_sizes: vec![3, 300],
        ..Default::default()
    };
    let body = Bytes::from_static(b"xyz");
    let frame = client
        .decode(&mut BytesMut::from(&wire[..]))
        .unwrap()
        .expect("a whole frame");
    assert_eq!(frame.header, reply);
    assert_eq!(frame.body, body);
    let mut out = BytesMut::new();
    server
        .encode(
            Frame {
                header: reply,
                body,
            },
            &mut out,
        )
        .unwrap();
    assert_eq!(out.to_vec(), wire);
}
