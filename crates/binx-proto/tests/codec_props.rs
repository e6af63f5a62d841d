//! Property tests of the frame codec: round trips of arbitrary messages and
//! bodies (also when the stream arrives in arbitrary pieces), and decoding
//! arbitrary bytes never panics.

use binx_proto::{
    BinReply, BinRequest, Frame, FrameCodec, FrameError, Inline, Segment, Spooled, segment,
};
use bytes::{BufMut, Bytes, BytesMut};
use proptest::prelude::*;
use tokio_util::codec::{Decoder, Encoder};

fn text() -> impl Strategy<Value = String> {
    proptest::string::string_regex("[a-zA-Z0-9._:/ é-]{0,24}").expect("regex")
}

fn request() -> impl Strategy<Value = BinRequest> {
    (
        (
            any::<u64>(),
            -2i32..25,
            text(),
            any::<u64>(),
            any::<u64>(),
            any::<bool>(),
        ),
        (
            any::<u64>(),
            any::<u64>(),
            any::<bool>(),
            prop::collection::vec(text(), 0..3),
        ),
        (
            text(),
            text(),
            prop::collection::vec(any::<u64>(), 0..8),
            0i32..3,
            any::<u64>(),
        ),
        (
            text(),
            text(),
            text(),
            prop::option::of(any::<u64>()),
            prop::option::of(any::<u64>()),
        ),
    )
        .prop_map(|(a, b, c, d)| BinRequest {
            request_id: a.0,
            r#type: a.1,
            task_id: a.2,
            buffer_id: a.3,
            page_token: a.4,
            get_data_size: a.5,
            max_size_bytes: b.0,
            max_wait_micros: b.1,
            accept_spooled: b.2,
            accept_encodings: b.3,
            auth_token: c.0,
            client_name: c.1,
            page_sizes: c.2,
            buffer_kind: c.3,
            buffer_count: c.4,
            remote: d.0,
            reason: d.1,
            spool_policy: d.2,
            ack_token: d.3,
            append_token: d.4,
        })
}

fn segment_strategy() -> impl Strategy<Value = Segment> {
    let spooled = (
        text(),
        prop::collection::btree_map(text(), text(), 0..3),
        any::<u64>(),
        prop::collection::vec(any::<u8>(), 0..33),
        any::<u64>(),
    )
        .prop_map(
            |(uri, headers, stored_size, key, expires_at_unix_ms)| Spooled {
                uri,
                headers,
                stored_size,
                key,
                expires_at_unix_ms,
            },
        );
    let body = prop_oneof![
        Just(None),
        Just(Some(segment::Body::Inline(Inline {}))),
        spooled.prop_map(|s| Some(segment::Body::Spooled(s))),
    ];
    (
        any::<u64>(),
        prop::collection::vec(any::<u64>(), 0..6),
        body,
    )
        .prop_map(|(first_token, page_sizes, body)| Segment {
            first_token,
            page_sizes,
            body,
        })
}

fn reply() -> impl Strategy<Value = BinReply> {
    (
        (
            any::<u64>(),
            -2i32..25,
            0i32..9,
            any::<bool>(),
            any::<u64>(),
            any::<u64>(),
        ),
        (
            prop::collection::vec(any::<u64>(), 0..6),
            prop::collection::vec(any::<u64>(), 0..6),
        ),
        prop::collection::vec(segment_strategy(), 0..3),
        (text(), text(), prop::collection::vec(text(), 0..3)),
        prop::option::of(
            (
                text(),
                text(),
                any::<u64>(),
                prop::collection::vec(any::<u64>(), 0..6),
            )
                .prop_map(|(node, endpoint, buffer_count, end_tokens)| {
                    Box::new(binx_proto::Committed {
                        node,
                        endpoint,
                        buffer_count,
                        bytes: end_tokens.iter().map(|t| t.wrapping_mul(3)).collect(),
                        end_tokens,
                    })
                }),
        ),
    )
        .prop_map(
            |(a, (remaining_bytes, following_sizes), segments, c, committed)| BinReply {
                request_id: a.0,
                r#type: a.1,
                status: a.2,
                buffer_complete: a.3,
                page_token: a.4,
                page_next_token: a.5,
                remaining_bytes,
                segments,
                error: c.0,
                server_name: c.1,
                capabilities: c.2,
                following_sizes,
                committed,
            },
        )
}

fn body() -> impl Strategy<Value = Bytes> {
    prop::collection::vec(any::<u8>(), 0..2048).prop_map(Bytes::from)
}

proptest! {
    #[test]
    fn requests_round_trip(frames in prop::collection::vec((request(), body()), 1..5), cuts in prop::collection::vec(1usize..300, 0..20)) {
        let mut client = FrameCodec::<BinReply, BinRequest>::default();
        let mut wire = BytesMut::new();
        for (header, body) in &frames {
            client.encode(Frame { header: header.clone(), body: body.clone() }, &mut wire).unwrap();
        }
        // Feed the stream in arbitrary pieces.
        let wire = wire.freeze();
        let mut server = FrameCodec::<BinRequest, BinReply>::default();
        let mut src = BytesMut::new();
        let mut decoded = Vec::new();
        let mut offset = 0;
        let mut cuts = cuts.into_iter();
        while offset < wire.len() {
            let step = cuts.next().unwrap_or(wire.len());
            let end = (offset + step).min(wire.len());
            src.put_slice(&wire[offset..end]);
            offset = end;
            while let Some(frame) = server.decode(&mut src).unwrap() {
                decoded.push(frame);
            }
        }
        prop_assert!(src.is_empty());
        let expected: Vec<Frame<BinRequest>> = frames.into_iter().map(|(header, body)| Frame { header, body }).collect();
        prop_assert_eq!(decoded, expected);
    }

    #[test]
    fn replies_round_trip(header in reply(), body in body()) {
        let mut server = FrameCodec::<BinRequest, BinReply>::default();
        let mut wire = BytesMut::new();
        server.encode(Frame { header: header.clone(), body: body.clone() }, &mut wire).unwrap();
        let mut client = FrameCodec::<BinReply, BinRequest>::default();
        let frame = client.decode(&mut wire).unwrap().expect("a whole frame");
        prop_assert_eq!(frame.header, header);
        prop_assert_eq!(frame.body, body);
        prop_assert!(wire.is_empty());
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..4096)) {
        decode_all(&bytes);
    }

    #[test]
    fn arbitrary_headers_in_a_valid_envelope_never_panic(header in prop::collection::vec(any::<u8>(), 0..512), body_len in 0usize..64) {
        // A correct length prefix, so the protobuf decoder sees the junk.
        let mut wire = BytesMut::new();
        wire.put_u32((4 + header.len() + body_len) as u32);
        wire.put_u32(header.len() as u32);
        wire.put_slice(&header);
        wire.put_bytes(0xab, body_len);
        let mut codec = FrameCodec::<BinRequest, BinReply>::default();
        match codec.decode(&mut wire) {
            Ok(Some(frame)) => prop_assert_eq!(frame.body.len(), body_len),
            Ok(None) => prop_assert!(false, "a complete frame must decode or fail"),
            Err(e) => prop_assert!(matches!(e, FrameError::BadHeader(_))),
        }
    }
}

fn decode_all(bytes: &[u8]) {
    let mut codec = FrameCodec::<BinRequest, BinReply>::new(1 << 16);
    let mut src = BytesMut::from(bytes);
    while let Ok(Some(_)) = codec.decode(&mut src) {}
    let mut codec = FrameCodec::<BinReply, BinRequest>::new(1 << 16);
    let mut src = BytesMut::from(bytes);
    while let Ok(Some(_)) = codec.decode_eof(&mut src) {}
}

#[test]
fn invalid_utf8_and_wrong_wire_type_are_bad_headers() {
    // Field 3 (task_id, a string) holding the invalid UTF-8 byte 0xff.
    let header = [0x1a, 0x01, 0xff];
    // Field 1 (request_id, a varint) sent as length-delimited.
    let wrong_type = [0x0a, 0x01, 0x00];
    for h in [&header[..], &wrong_type[..]] {
        let mut wire = BytesMut::new();
        wire.put_u32(4 + h.len() as u32);
        wire.put_u32(h.len() as u32);
        wire.put_slice(h);
        let mut codec = FrameCodec::<BinRequest, BinReply>::default();
        assert!(matches!(
            codec.decode(&mut wire),
            Err(FrameError::BadHeader(_))
        ));
    }
}

proptest! {
    /// `enqueue_frame_overhead` bounds what an ENQUEUE's frame holds beside
    /// its pages, whatever the values of the fields a client sets: a client
    /// that keeps pages plus it within `max-frame-bytes=` is never cut off
    /// for a frame too long.
    #[test]
    fn an_enqueue_frame_is_its_pages_and_at_most_the_overhead(
        ids in (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()),
        task in proptest::string::string_regex("[a-zA-Z0-9._:-]{1,256}").expect("regex"),
        sizes in prop::collection::vec(any::<u64>(), 0..600),
    ) {
        let mut r = BinRequest::new(binx_proto::MessageType::Enqueue);
        (r.request_id, r.buffer_id, r.max_wait_micros) = (ids.0, ids.1, ids.2);
        r.append_token = Some(ids.3);
        r.task_id = task;
        r.page_sizes = sizes;
        let mut head = BytesMut::new();
        binx_proto::encode_frame_head(&r, 0, &mut head).expect("encodes");
        // The length field itself is not counted in the frame's length.
        let frame_beside_pages = (head.len() - 4) as u64;
        prop_assert!(
            frame_beside_pages <= binx_proto::enqueue_frame_overhead(r.task_id.len(), r.page_sizes.len()),
            "{} bytes", frame_beside_pages
        );
    }
}
