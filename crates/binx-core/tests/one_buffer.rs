//! Property test: any sequence of ENQUEUE, DATA, ACK, DELETE and
//! NO_MORE_PAGES on one partitioned buffer gives the replies a plain
//! reference model of that buffer predicts, and the core's memory count
//! always equals what its pages really hold (`check_invariants` recounts it
//! from the pages) and goes back to zero when nothing is held.

use std::time::Duration;

use binx_core::testing::MemoryDriver;
use binx_core::{ConnId, CoreConfig, Handled, Payload};
use binx_proto::{BinRequest, BufferKind, MessageType, Status};
use bytes::Bytes;
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Enqueue(Vec<usize>),
    /// DATA at the model's mark plus this offset (may be below or past).
    Data {
        offset: i64,
        max: u64,
        sizes: bool,
    },
    Ack {
        offset: i64,
    },
    Delete,
    Finish,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => prop::collection::vec(prop_oneof![Just(0usize), 0usize..64, 0usize..5_000], 0..8).prop_map(Op::Enqueue),
        4 => (-2i64..6, prop_oneof![Just(0u64), 1u64..10_000], any::<bool>())
            .prop_map(|(offset, max, sizes)| Op::Data { offset, max, sizes }),
        2 => (-2i64..6).prop_map(|offset| Op::Ack { offset }),
        1 => Just(Op::Delete),
        1 => Just(Op::Finish),
    ]
}

/// What one buffer holds, as the contract says.
#[derive(Default)]
struct Model {
    pages: Vec<Vec<u8>>,
    mark: u64,
    finished: bool,
    deleted: bool,
}

struct Harness {
    driver: MemoryDriver,
    /// Receive buffers handed out (their ids).
    received: u64,
}

impl Harness {
    fn send(&mut self, mut raw: BinRequest, body: Vec<u8>) -> binx_core::Reply {
        raw.task_id = "t".into();
        // Bodies arrive as slices of a larger receive buffer, as from a socket.
        self.received += 1;
        let mut receive = vec![0u8; body.len() * 3 + 16];
        receive[7..7 + body.len()].copy_from_slice(&body);
        let receive = Bytes::from(receive);
        let payload = Payload {
            bytes: receive.slice(7..7 + body.len()),
            chunk: Some((self.received, receive.len() as u64)),
        };
        match self.driver.send(ConnId(1), raw, payload).1 {
            Handled::Reply(r) => r,
            other => panic!("no spool and no waits: {other:?}"),
        }
    }
}

fn pages_of(reply: &binx_core::Reply) -> Vec<Vec<u8>> {
    let body: Vec<u8> = reply.body.concat();
    let mut out = Vec::new();
    let mut at = 0;
    for s in &reply.header.segments {
        for &size in &s.page_sizes {
            out.push(body[at..at + size as usize].to_vec());
            at += size as usize;
        }
    }
    out
}

fn token(model: &Model, offset: i64) -> u64 {
    (model.mark as i64 + offset).max(0) as u64
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn one_buffer_behaves_as_the_contract_says(ops in prop::collection::vec(op(), 1..60)) {
        let mut h = Harness {
            driver: MemoryDriver::new(CoreConfig { max_wait: Duration::ZERO, ..CoreConfig::default() }),
            received: 0,
        };
        let mut open = BinRequest::new(MessageType::OpenTask);
        open.buffer_kind = BufferKind::Partitioned as i32;
        open.buffer_count = 1;
        prop_assert_eq!(h.send(open, Vec::new()).header.status_kind(), Status::Ok);
        let mut m = Model::default();
        let mut seq = 0u8;
        for op in ops {
            h.driver.now += Duration::from_millis(1);
            match op {
                Op::Enqueue(sizes) => {
                    let pages: Vec<Vec<u8>> = sizes.iter().map(|&s| { seq = seq.wrapping_add(1); vec![seq; s] }).collect();
                    let mut r = BinRequest::new(MessageType::Enqueue);
                    r.page_sizes = sizes.iter().map(|&s| s as u64).collect();
                    let reply = h.send(r, pages.concat());
                    if m.finished && !m.deleted {
                        prop_assert_eq!(reply.header.status_kind(), Status::BadRequest);
                    } else {
                        prop_assert_eq!(reply.header.status_kind(), Status::Ok, "{}", reply.header.error);
                        if !m.deleted {
                            m.pages.extend(pages);
                        }
                    }
                }
                Op::Data { offset, max, sizes } => {
                    let t = token(&m, offset);
                    let mut r = BinRequest::new(MessageType::Data);
                    r.page_token = t;
                    r.max_size_bytes = max;
                    r.get_data_size = sizes;
                    let reply = h.send(r, Vec::new());
                    let hd = &reply.header;
                    prop_assert_eq!(hd.page_token, t, "every DATA reply names its token");
                    let next = m.pages.len() as u64;
                    if m.deleted {
                        prop_assert_eq!(hd.status_kind(), Status::Ok);
                        prop_assert!(hd.buffer_complete && reply.body.is_empty());
                    } else if t < m.mark || t > next {
                        prop_assert_eq!(hd.status_kind(), Status::BadRequest);
                    } else if sizes {
                        let expected: Vec<u64> = m.pages[t as usize..].iter().map(|p| p.len() as u64).collect();
                        prop_assert_eq!(&hd.remaining_bytes, &expected);
                        prop_assert_eq!(hd.buffer_complete, m.finished && t == next);
                        m.mark = t;
                    } else {
                        let got = pages_of(&reply);
                        let available = &m.pages[t as usize..];
                        if available.is_empty() {
                            prop_assert!(got.is_empty());
                            prop_assert_eq!(hd.status_kind(), if m.finished { Status::Ok } else { Status::NoData });
                        } else {
                            // At least one page, then whole pages within the size.
                            let limit = if max == 0 { 1 << 20 } else { max };
                            let mut want = 1;
                            let mut total = available[0].len() as u64;
                            while want < available.len() && total + available[want].len() as u64 <= limit {
                                total += available[want].len() as u64;
                                want += 1;
                            }
                            prop_assert_eq!(&got[..], &available[..want]);
                        }
                        prop_assert_eq!(hd.page_next_token, t + got.len() as u64);
                        prop_assert_eq!(hd.buffer_complete, m.finished && t + got.len() as u64 == next);
                        m.mark = t;
                    }
                }
                Op::Ack { offset } => {
                    let t = token(&m, offset);
                    let mut r = BinRequest::new(MessageType::Ack);
                    r.page_token = t;
                    let reply = h.send(r, Vec::new());
                    if !m.deleted && t > m.pages.len() as u64 {
                        prop_assert_eq!(reply.header.status_kind(), Status::BadRequest);
                    } else {
                        prop_assert_eq!(reply.header.status_kind(), Status::Ok);
                        if !m.deleted {
                            m.mark = m.mark.max(t);
                        }
                    }
                }
                Op::Delete => {
                    let reply = h.send(BinRequest::new(MessageType::Delete), Vec::new());
                    prop_assert_eq!(reply.header.status_kind(), Status::Ok);
                    m.deleted = true;
                }
                Op::Finish => {
                    let reply = h.send(BinRequest::new(MessageType::NoMorePages), Vec::new());
                    prop_assert_eq!(reply.header.status_kind(), Status::Ok);
                    m.finished = true;
                }
            }
            let held = if m.deleted { 0 } else { m.pages.len() as u64 - m.mark };
            prop_assert_eq!(h.driver.core.pages_held(), held);
            if held == 0 {
                prop_assert_eq!(h.driver.core.memory_used(), 0, "nothing held, nothing counted");
            } else {
                let bytes: u64 = m.pages[m.mark as usize..].iter().map(|p| p.len() as u64).sum();
                prop_assert!(h.driver.core.memory_used() >= bytes);
            }
        }
    }
}
