//! The consumer side of the exchange, sans IO: which request a consumer
//! pulling one buffer sends next, and whether a DATA reply is exactly the
//! continuation of what it has (every page once, in token order, never a
//! short buffer). `binx-client`'s `ExchangeSource` drives it over a real
//! connection; the simulation drives it over a simulated one.

use std::collections::VecDeque;
use std::time::Duration;

use binx_proto::{BinReply, BinRequest, MessageType, Segment, Status, segment};

/// Reply size a consumer asks for when it names none: an eighth of its
/// memory budget, between 1 MiB and 16 MiB (4 MiB for the default 32 MiB
/// budget). One DATA at a time leaves the link idle for a round trip per
/// reply: at 1 MiB that cost 10-20% of a bulk read on loopback, at 4 MiB a
/// few percent (`cargo bench --bench bulk`, BENCHMARKS.md). A reply near
/// the budget is worse again: the source then has no room to ask for the
/// next one while its consumer works through the last.
pub fn auto_reply_size(memory_budget: u64) -> u64 {
    (memory_budget / 8).clamp(1 << 20, 16 << 20)
}

/// Limits of one pull.
#[derive(Clone, Debug)]
pub struct PullConfig {
    /// Bytes of received pages the consumer may hold. A page larger than the
    /// budget is still fetched when it holds nothing.
    pub memory_budget: u64,
    /// Largest reply asked for; 0 (the default) is [`auto_reply_size`].
    pub max_reply_size: u64,
    /// Long-poll time per request.
    pub max_wait: Duration,
    /// `host:port` of the sidecar that serves the buffer, when the requests
    /// go to the local sidecar to be forwarded.
    pub remote: Option<String>,
    /// The consumer reads spooled segments itself.
    pub accept_spooled: bool,
}

impl Default for PullConfig {
    fn default() -> Self {
        PullConfig {
            memory_budget: 32 << 20,
            max_reply_size: 0,
            max_wait: Duration::from_secs(1),
            remote: None,
            accept_spooled: true,
        }
    }
}

/// Codecs the clients of this crate decode in spooled segments.
pub const ACCEPT_ENCODINGS: [&str; 3] = ["none", "lz4", "zstd"];

/// What the consumer should do next.
#[derive(Clone, Debug, PartialEq)]
pub enum PullStep {
    /// Send this request (retrying it as is on transport errors) and hand
    /// its reply to [`SourceMachine::on_reply`].
    Send(Box<BinRequest>),
    /// The consumer holds its budget: wait until it takes pages.
    WaitForConsumer,
    /// The buffer was read to its end and deleted.
    Done,
}

/// Where the pages of a checked DATA reply are.
#[derive(Clone, Debug, PartialEq)]
pub enum ReplyPart {
    /// Pages in the frame body: `sizes` from byte `offset`.
    Inline {
        first_token: u64,
        offset: usize,
        sizes: Vec<u64>,
    },
    /// Pages in an object the consumer fetches itself.
    Spooled { first_token: u64, segment: Segment },
}

/// Why a reply is not the continuation the consumer expects.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ReplyError(pub String);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Asked {
    Data,
    /// Sizes while waiting for pages (long-poll).
    SizesWaiting,
    /// Sizes while the consumer is full.
    SizesFull,
    Ack,
    Delete,
}

/// One pull of one buffer; see the module docs.
#[derive(Debug)]
pub struct SourceMachine {
    task: String,
    buffer: u64,
    config: PullConfig,
    token: u64,
    known_sizes: VecDeque<u64>,
    nothing_arrived: bool,
    acked: u64,
    sized_while_full: bool,
    asked: Option<Asked>,
    deleting: bool,
    done: bool,
}

impl SourceMachine {
    pub fn new(task: impl Into<String>, buffer: u64, config: PullConfig) -> Self {
        SourceMachine {
            task: task.into(),
            buffer,
            config,
            token: 0,
            known_sizes: VecDeque::new(),
            nothing_arrived: false,
            acked: 0,
            sized_while_full: false,
            asked: None,
            deleting: false,
            done: false,
        }
    }

    /// The token of the next page expected.
    pub fn token(&self) -> u64 {
        self.token
    }

    pub fn config(&self) -> &PullConfig {
        &self.config
    }

    /// Changes the largest reply asked for from the next request on (0 is
    /// [`auto_reply_size`]).
    pub fn set_max_reply_size(&mut self, max_reply_size: u64) {
        self.config.max_reply_size = max_reply_size;
    }

    fn request(&self, kind: MessageType, token: u64) -> BinRequest {
        let mut r = BinRequest::new(kind);
        r.task_id = self.task.clone();
        r.buffer_id = self.buffer;
        r.page_token = token;
        r.remote = self.config.remote.clone().unwrap_or_default();
        r
    }

    fn wait_micros(&self) -> u64 {
        self.config.max_wait.as_micros().min(u128::from(u64::MAX)) as u64
    }

    /// What to do now, given the bytes of pages the consumer holds.
    pub fn poll(&mut self, held: u64) -> PullStep {
        if self.done {
            return PullStep::Done;
        }
        if self.deleting {
            self.asked = Some(Asked::Delete);
            return PullStep::Send(Box::new(self.request(MessageType::Delete, 0)));
        }
        let room = self.config.memory_budget.saturating_sub(held);
        let next_fits = self.known_sizes.front().is_none_or(|&s| s <= room);
        if held > 0 && (room == 0 || !next_fits) {
            // No room: let the server free what was read, learn what is
            // coming, then wait for the consumer.
            if self.token > self.acked {
                self.acked = self.token;
                self.asked = Some(Asked::Ack);
                return PullStep::Send(Box::new(self.request(MessageType::Ack, self.token)));
            }
            if self.known_sizes.is_empty() && !self.sized_while_full {
                self.sized_while_full = true;
                self.asked = Some(Asked::SizesFull);
                let mut r = self.request(MessageType::Data, self.token);
                r.get_data_size = true;
                return PullStep::Send(Box::new(r));
            }
            self.asked = None;
            return PullStep::WaitForConsumer;
        }
        self.sized_while_full = false;
        if self.nothing_arrived {
            self.asked = Some(Asked::SizesWaiting);
            let mut r = self.request(MessageType::Data, self.token);
            r.get_data_size = true;
            r.max_wait_micros = self.wait_micros();
            return PullStep::Send(Box::new(r));
        }
        self.asked = Some(Asked::Data);
        let mut r = self.request(MessageType::Data, self.token);
        let reply_size = match self.config.max_reply_size {
            0 => auto_reply_size(self.config.memory_budget),
            n => n,
        };
        r.max_size_bytes = room.min(reply_size).max(1);
        r.max_wait_micros = self.wait_micros();
        if self.config.accept_spooled {
            r.accept_spooled = true;
            r.accept_encodings = ACCEPT_ENCODINGS.iter().map(|e| e.to_string()).collect();
        }
        PullStep::Send(Box::new(r))
    }

    /// A reply to the request [`SourceMachine::poll`] asked for last. For a
    /// DATA with pages, returns where they are; the consumer takes them and
    /// then calls [`SourceMachine::pages_taken`]. An ACK that failed can be
    /// reported as `None` (the next DATA acknowledges the same pages).
    pub fn on_reply(
        &mut self,
        request: &BinRequest,
        reply: Option<(&BinReply, usize)>,
    ) -> Result<Vec<ReplyPart>, ReplyError> {
        let Some(asked) = self.asked.take() else {
            return Ok(Vec::new());
        };
        let Some((header, body_len)) = reply else {
            if asked != Asked::Ack {
                // Not answered: ask the same again.
                self.asked = Some(asked);
            }
            return Ok(Vec::new());
        };
        match asked {
            Asked::Ack => Ok(Vec::new()),
            Asked::Delete => {
                self.done = true;
                Ok(Vec::new())
            }
            Asked::SizesFull | Asked::SizesWaiting => {
                let sizes = &header.remaining_bytes;
                if header.buffer_complete && sizes.is_empty() {
                    self.deleting = true;
                    return Ok(Vec::new());
                }
                if asked == Asked::SizesWaiting {
                    self.nothing_arrived = sizes.is_empty();
                }
                self.known_sizes = sizes.iter().copied().collect();
                Ok(Vec::new())
            }
            Asked::Data => {
                let parts = check_data_reply(request, header, body_len)?;
                let count: u64 = parts
                    .iter()
                    .map(|p| match p {
                        ReplyPart::Inline { sizes, .. } => sizes.len() as u64,
                        ReplyPart::Spooled { segment, .. } => segment.page_sizes.len() as u64,
                    })
                    .sum();
                if count == 0 {
                    if header.buffer_complete {
                        self.deleting = true;
                    } else {
                        self.known_sizes.clear();
                        self.nothing_arrived = true;
                    }
                    return Ok(parts);
                }
                for _ in 0..count {
                    self.known_sizes.pop_front();
                }
                self.token = header.page_next_token;
                if header.buffer_complete {
                    self.deleting = true;
                }
                Ok(parts)
            }
        }
    }

    /// The pages of the last DATA reply could not all be taken (a spooled
    /// segment failed): ask again at the same token.
    pub fn retry_pages(&mut self, token: u64) {
        self.token = token;
        self.deleting = false;
    }
}

/// Checks a DATA reply against the token asked for: `page_token` equals it,
/// segments follow each other from it, inline pages fill the body exactly,
/// spooled ones come only when accepted, `page_next_token` follows the last
/// page, and only OK and NO_DATA carry pages.
pub fn check_data_reply(
    request: &BinRequest,
    header: &BinReply,
    body_len: usize,
) -> Result<Vec<ReplyPart>, ReplyError> {
    let err = |detail: String| Err(ReplyError(detail));
    let token = request.page_token;
    if header.page_token != token {
        return err(format!(
            "reply page_token {} differs from the token asked for ({token})",
            header.page_token
        ));
    }
    let status = header.status_kind();
    if !matches!(status, Status::Ok | Status::NoData) {
        return err(format!(
            "DATA reply status {} is not OK or NO_DATA: {}",
            status.name(),
            header.error
        ));
    }
    let mut parts = Vec::new();
    let mut offset = 0usize;
    let mut expected = token;
    for segment in &header.segments {
        if segment.first_token != expected {
            return err(format!(
                "segment starts at token {} where {expected} was due",
                segment.first_token
            ));
        }
        let pages = segment.page_sizes.len() as u64;
        match &segment.body {
            Some(segment::Body::Inline(_)) => {
                let length = segment
                    .page_sizes
                    .iter()
                    .try_fold(0u64, |a, &s| a.checked_add(s))
                    .and_then(|l| usize::try_from(l).ok());
                let end = length
                    .and_then(|l| offset.checked_add(l))
                    .filter(|&e| e <= body_len);
                let Some(end) = end else {
                    return err("segment page sizes exceed the frame body".into());
                };
                parts.push(ReplyPart::Inline {
                    first_token: expected,
                    offset,
                    sizes: segment.page_sizes.clone(),
                });
                offset = end;
            }
            Some(segment::Body::Spooled(_)) if !request.accept_spooled => {
                return err(
                    "server sent a spooled segment although this client did not accept spooled segments"
                        .into(),
                );
            }
            Some(segment::Body::Spooled(_)) => parts.push(ReplyPart::Spooled {
                first_token: expected,
                segment: segment.clone(),
            }),
            None => return err("segment has neither inline nor spooled body".into()),
        }
        expected += pages;
    }
    if offset != body_len {
        return err(format!(
            "frame body has {} bytes beyond its segments",
            body_len - offset
        ));
    }
    if header.page_next_token != expected {
        return err(format!(
            "page_next_token {} does not follow the {} pages sent from token {token}",
            header.page_next_token,
            expected - token
        ));
    }
    if status == Status::NoData && expected != token {
        return err("a NO_DATA reply carries pages".into());
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data_reply(token: u64, sizes: &[u64], complete: bool) -> BinReply {
        BinReply {
            r#type: MessageType::Data as i32,
            status: Status::Ok as i32,
            page_token: token,
            page_next_token: token + sizes.len() as u64,
            buffer_complete: complete,
            segments: if sizes.is_empty() {
                Vec::new()
            } else {
                vec![Segment::inline(token, sizes.to_vec())]
            },
            ..Default::default()
        }
    }

    #[test]
    fn a_pull_reads_to_the_end_then_deletes() {
        let mut m = SourceMachine::new("t", 0, PullConfig::default());
        let PullStep::Send(r) = m.poll(0) else {
            panic!()
        };
        assert_eq!((r.r#type, r.page_token), (MessageType::Data as i32, 0));
        let parts = m
            .on_reply(&r, Some((&data_reply(0, &[3, 4], false), 7)))
            .unwrap();
        assert_eq!(parts.len(), 1);
        assert_eq!(m.token(), 2);
        let PullStep::Send(r) = m.poll(0) else {
            panic!()
        };
        assert_eq!(r.page_token, 2);
        m.on_reply(&r, Some((&data_reply(2, &[], true), 0)))
            .unwrap();
        let PullStep::Send(r) = m.poll(0) else {
            panic!()
        };
        assert_eq!(r.r#type, MessageType::Delete as i32);
        m.on_reply(&r, Some((&BinReply::default(), 0))).unwrap();
        assert_eq!(m.poll(0), PullStep::Done);
    }

    #[test]
    fn the_reply_size_asked_for_follows_the_budget_unless_set() {
        let asked = |memory_budget: u64, max_reply_size: u64, held: u64| {
            let config = PullConfig {
                memory_budget,
                max_reply_size,
                ..PullConfig::default()
            };
            match SourceMachine::new("t", 0, config).poll(held) {
                PullStep::Send(r) => r.max_size_bytes,
                other => panic!("{other:?}"),
            }
        };
        // The default budget (32 MiB): 4 MiB.
        assert_eq!(asked(PullConfig::default().memory_budget, 0, 0), 4 << 20);
        assert_eq!(asked(256 << 20, 0, 0), 16 << 20);
        assert_eq!(asked(8 << 20, 0, 0), 1 << 20);
        // Never more than the room left, and set sizes are kept.
        assert_eq!(asked(32 << 20, 0, 31 << 20), 1 << 20);
        assert_eq!(asked(32 << 20, 0, (32 << 20) - 5), 5);
        assert_eq!(asked(32 << 20, 64 << 10, 0), 64 << 10);
    }

    #[test]
    fn replies_that_skip_repeat_or_shorten_are_refused() {
        let mut r = BinRequest::new(MessageType::Data);
        r.page_token = 5;
        assert!(check_data_reply(&r, &data_reply(4, &[1], false), 1).is_err());
        let mut gap = data_reply(5, &[1], false);
        gap.segments[0].first_token = 6;
        assert!(check_data_reply(&r, &gap, 1).is_err());
        assert!(check_data_reply(&r, &data_reply(5, &[2], false), 1).is_err());
        assert!(check_data_reply(&r, &data_reply(5, &[1], false), 2).is_err());
        let mut next = data_reply(5, &[1], false);
        next.page_next_token = 9;
        assert!(check_data_reply(&r, &next, 1).is_err());
        let mut huge = data_reply(5, &[u64::MAX, 2], false);
        huge.page_next_token = 7;
        assert!(check_data_reply(&r, &huge, 1).is_err());
        assert!(check_data_reply(&r, &data_reply(5, &[1], false), 1).is_ok());
    }

    #[test]
    fn a_full_consumer_acknowledges_learns_sizes_and_waits() {
        let config = PullConfig {
            memory_budget: 10,
            ..Default::default()
        };
        let mut m = SourceMachine::new("t", 0, config);
        let PullStep::Send(r) = m.poll(0) else {
            panic!()
        };
        m.on_reply(&r, Some((&data_reply(0, &[10], false), 10)))
            .unwrap();
        let PullStep::Send(ack) = m.poll(10) else {
            panic!()
        };
        assert_eq!((ack.r#type, ack.page_token), (MessageType::Ack as i32, 1));
        m.on_reply(&ack, None).unwrap();
        let PullStep::Send(sizes) = m.poll(10) else {
            panic!()
        };
        assert!(sizes.get_data_size);
        let mut reply = data_reply(1, &[], false);
        reply.remaining_bytes = vec![4];
        m.on_reply(&sizes, Some((&reply, 0))).unwrap();
        assert_eq!(m.poll(10), PullStep::WaitForConsumer);
        let PullStep::Send(r) = m.poll(0) else {
            panic!()
        };
        assert_eq!(r.max_size_bytes, 10);
    }
}
