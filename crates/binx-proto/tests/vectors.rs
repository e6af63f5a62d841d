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

/// Decodes vector `name` as one request frame without a body, checks it is
/// `expected`, and encodes `expected` back to the same bytes.
fn request_vector(name: &str, expected: &BinRequest) -> Vec<u8> {
    let wire = vector(name);
    let mut server = FrameCodec::<BinRequest, BinReply>::default();
    let mut src = BytesMut::from(&wire[..]);
    let frame = server.decode(&mut src).unwrap().expect("a whole frame");
    assert_eq!(&frame.header, expected, "{name}");
    assert!(frame.body.is_empty());
    assert!(src.is_empty());
    let mut client = FrameCodec::<BinReply, BinRequest>::default();
    let mut out = BytesMut::new();
    client
        .encode(Frame::new(expected.clone()), &mut out)
        .unwrap();
    assert_eq!(out.to_vec(), wire, "{name}");
    wire
}

/// The same for a reply frame with `body`.
fn reply_vector(name: &str, expected: &BinReply, body: &'static [u8]) {
    let wire = vector(name);
    let mut client = FrameCodec::<BinReply, BinRequest>::default();
    let mut src = BytesMut::from(&wire[..]);
    let frame = client.decode(&mut src).unwrap().expect("a whole frame");
    assert_eq!(&frame.header, expected, "{name}");
    assert_eq!(frame.body, body);
    assert!(src.is_empty());
    let mut server = FrameCodec::<BinRequest, BinReply>::default();
    let mut out = BytesMut::new();
    let frame = Frame {
        header: expected.clone(),
        body: Bytes::from_static(body),
    };
    server.encode(frame, &mut out).unwrap();
    assert_eq!(out.to_vec(), wire, "{name}");
}

#[test]
fn data_request_vector() {
    let mut expected = BinRequest::new(MessageType::Data);
    expected.request_id = 7;
    expected.task_id = "q1.2.0".into();
    expected.buffer_id = 3;
    expected.page_token = 42;
    expected.max_size_bytes = 1 << 20;
    expected.max_wait_micros = 1_000_000;
    request_vector("data-request", &expected);
}

#[test]
fn data_reply_vector() {
    let expected = BinReply {
        request_id: 7,
        r#type: MessageType::Data as i32,
        status: Status::Ok as i32,
        page_token: 42,
        page_next_token: 44,
        segments: vec![Segment::inline(42, vec![3, 5])],
        ..Default::default()
    };
    reply_vector("data-reply", &expected, b"abchello");
    let pages = binx_proto::split_pages(&Bytes::from_static(b"abchello"), &[3, 5]).unwrap();
    assert_eq!(
        pages,
        vec![Bytes::from_static(b"abc"), Bytes::from_static(b"hello")]
    );
}

#[test]
fn pipelined_data_vectors() {
    let mut request = BinRequest::new(MessageType::Data);
    request.request_id = 8;
    request.task_id = "q1.2.0".into();
    request.buffer_id = 3;
    request.page_token = 44;
    request.max_size_bytes = 2 << 20;
    request.max_wait_micros = 1_000_000;
    request.ack_token = Some(42);
    let wire = request_vector("pipelined-data-request", &request);
    // ack_token 0 is present, not absent: it is written.
    request.ack_token = Some(0);
    let mut client = FrameCodec::<BinReply, BinRequest>::default();
    let mut out = BytesMut::new();
    client.encode(Frame::new(request), &mut out).unwrap();
    assert_eq!(out.len(), wire.len());

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
    reply_vector("pipelined-data-reply", &reply, b"xyz");
}

#[test]
fn numbered_enqueue_vectors() {
    let mut request = BinRequest::new(MessageType::Enqueue);
    request.request_id = 9;
    request.task_id = "q1.2.0".into();
    request.buffer_id = 3;
    request.page_sizes = vec![2, 3];
    request.append_token = Some(5);
    let wire = vector("numbered-enqueue-request");
    let mut server = FrameCodec::<BinRequest, BinReply>::default();
    let mut src = BytesMut::from(&wire[..]);
    let frame = server.decode(&mut src).unwrap().expect("a whole frame");
    assert_eq!(frame.header, request);
    assert_eq!(frame.body, Bytes::from_static(b"abcde"));
    assert!(src.is_empty());
    let mut client = FrameCodec::<BinReply, BinRequest>::default();
    let mut out = BytesMut::new();
    let frame = Frame {
        header: request.clone(),
        body: Bytes::from_static(b"abcde"),
    };
    client.encode(frame, &mut out).unwrap();
    assert_eq!(out.to_vec(), wire);

    // Every reply to it carries its append_token as page_token.
    let ok = BinReply {
        page_next_token: 7,
        ..BinReply::to(&request, Status::Ok)
    };
    assert_eq!(ok.page_token, 5);
    reply_vector("numbered-enqueue-ok", &ok, b"");
    let refusal = BinReply {
        page_next_token: 2,
        ..BinReply::error(&request, Status::BadRequest, "next token is 2")
    };
    reply_vector("numbered-enqueue-refusal", &refusal, b"");
    // Without it, an ENQUEUE's replies carry no token, as in 1.2.
    request.append_token = None;
    assert_eq!(BinReply::to(&request, Status::Ok).page_token, 0);
}

#[test]
fn committed_vectors() {
    let mut request = BinRequest::new(MessageType::Committed);
    request.request_id = 11;
    request.task_id = "q1.2.0".into();
    request_vector("committed-request", &request);
    let reply = BinReply {
        request_id: 11,
        r#type: MessageType::Committed as i32,
        status: Status::Ok as i32,
        buffer_complete: true,
        page_next_token: 3,
        committed: Some(Box::new(binx_proto::Committed {
            node: "pod7".into(),
            endpoint: "10.0.0.7:8091".into(),
            buffer_count: 3,
            end_tokens: vec![2, 0, 1],
            bytes: vec![300, 0, 17],
        })),
        ..Default::default()
    };
    reply_vector("committed-reply", &reply, b"");
    assert!(MessageType::Committed.is_local_only());
}

#[test]
fn delete_task_vectors() {
    let mut request = BinRequest::new(MessageType::DeleteTask);
    request.request_id = 12;
    request.task_id = "q1.2.0".into();
    request.buffer_count = 5;
    request_vector("delete-task-request", &request);
    let reply = BinReply {
        request_id: 12,
        r#type: MessageType::DeleteTask as i32,
        status: Status::Ok as i32,
        ..Default::default()
    };
    reply_vector("delete-task-reply", &reply, b"");
    // A peer may send it over TCP, as DELETE.
    assert!(!MessageType::DeleteTask.is_local_only());
}
