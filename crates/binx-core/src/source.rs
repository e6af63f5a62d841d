//! The consumer side of the exchange, sans IO: which request a consumer
//! pulling one buffer sends next, and whether a DATA reply is exactly the
//! continuation of what it has (every page once, in token order, never a
//! short buffer). `binx-client`'s `ExchangeSource` drives it over a real
//! connection; the simulation drives it over a simulated one.
//!
//! With `pipeline_depth` above 1 it pipelines DATA (docs/PROTOCOL.md
//! section 8): every DATA carries `ack_token`, the token of the next page
//! it has not received, so a DATA acknowledges only what the consumer has
//! and any request still in flight stays exact to repeat. A reply to such
//! a DATA lists the sizes of the pages after it (`following_sizes`); from
//! them the machine tells where its next reply will end and asks for the
//! one after that before the first comes back. A reply is used only when it
//! starts exactly at the next page expected: a guess that was wrong (pages
//! spilled meanwhile, a server that stops elsewhere), a lost reply, or one
//! that comes out of order costs a request, never a page.

use std::collections::VecDeque;
use std::time::Duration;

use binx_proto::{BinReply, BinRequest, MessageType, Segment, Status, segment};

use crate::core::MAX_REPLY_PAGES;

/// Reply size a consumer asks for when it names none. One DATA at a time
/// (`pipeline_depth` 1) leaves the link idle for a round trip per reply, so
/// replies are large: an eighth of the memory budget, between 1 MiB and
/// 16 MiB (4 MiB for the default 32 MiB budget; at 1 MiB the round trips
/// cost 10-20% of a bulk read on loopback). Pipelined, the next reply is
/// already asked for, and smaller replies read faster (their receive
/// buffers stay in the caches): a sixteenth of the budget, between 1 MiB
/// and 2 MiB (`cargo bench --bench bulk`, one session: 2 MiB pipelined
/// read at 0.78-0.92 of a raw TCP stream, 4 MiB pipelined at 0.51-0.67,
/// 4 MiB one at a time at 0.64-0.77; BENCHMARKS.md).
pub fn auto_reply_size(memory_budget: u64, pipeline_depth: usize) -> u64 {
    if pipeline_depth > 1 {
        (memory_budget / 16).clamp(1 << 20, 2 << 20)
    } else {
        (memory_budget / 8).clamp(1 << 20, 16 << 20)
    }
}

/// DATA requests a pull keeps in flight by default when the server lists
/// the sizes of the pages that follow a reply: two hide the round trip
/// between replies.
pub const DEFAULT_PIPELINE_DEPTH: usize = 2;

/// Page sizes a consumer keeps from one reply's `following_sizes`; a
/// server lists fewer (`binx_core::MAX_FOLLOWING_SIZES`).
const MAX_KNOWN_SIZES: usize = 2 * MAX_REPLY_PAGES + 2;

/// A listed page size above this is a lie (no frame can carry it): the
/// list is cut before it.
const MAX_LISTED_PAGE: u64 = u32::MAX as u64;

/// Replies that ended where foreseen under a learned reply cap before the
/// cap is doubled, to find out whether the server's limit went up again.
const CAP_PROBE_AFTER: u32 = 8;

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
    /// DATA requests in flight at once (pipelined DATA); 1 sends one at a
    /// time, without `ack_token`, as a BinX 1.1 client does.
    pub pipeline_depth: usize,
}

impl Default for PullConfig {
    fn default() -> Self {
        PullConfig {
            memory_budget: 32 << 20,
            max_reply_size: 0,
            max_wait: Duration::from_secs(1),
            remote: None,
            accept_spooled: true,
            pipeline_depth: DEFAULT_PIPELINE_DEPTH,
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
    /// Requests are in flight and nothing more may be sent until a reply
    /// comes (or the consumer takes pages).
    AwaitReply,
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
        /// Token of the first page.
        first_token: u64,
        /// Where the first page starts in the body.
        offset: usize,
        /// Size of each page, in order (bytes).
        sizes: Vec<u64>,
    },
    /// Pages in an object the consumer fetches itself.
    Spooled {
        /// Token of the object's first page.
        first_token: u64,
        /// Where and how to fetch it.
        segment: Segment,
    },
}

/// Why a reply is not the continuation the consumer expects.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ReplyError(pub String);

/// A request other than a DATA for pages, in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Asked {
    /// Sizes while waiting for pages (long-poll).
    SizesWaiting,
    /// Sizes while the consumer is full.
    SizesFull,
    Ack,
    Delete,
}

/// A DATA for pages in flight. Replies are matched to it by what the
/// request asked (token, `ack_token`, size): two requests that asked the
/// same are answered alike, so either reply may stand for either.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct InFlight {
    token: u64,
    ack: Option<u64>,
    max_size: u64,
    /// Where its reply will end, when the sizes of the pages from `token`
    /// told (the server's rule: at least one page, then whole pages within
    /// the size asked, at most [`MAX_REPLY_PAGES`]).
    end: Option<u64>,
    /// Bytes its reply will hold (the size asked, when `end` is unknown):
    /// counted against the memory budget until it comes.
    bytes: u64,
}

/// Whether `request` is a DATA sent past the next page expected (its
/// `ack_token`), on the word of `following_sizes`: a refusal of it says the
/// guess was wrong, not that the pull failed.
fn speculative(request: &BinRequest) -> bool {
    request.r#type == MessageType::Data as i32
        && !request.get_data_size
        && request
            .ack_token
            .is_some_and(|ack| ack < request.page_token)
}

/// One pull of one buffer; see the module docs.
#[derive(Debug)]
pub struct SourceMachine {
    task: String,
    buffer: u64,
    config: PullConfig,
    /// The next page expected: every page below it was received.
    token: u64,
    /// Sizes of the pages from `known_from` on, as the server last listed
    /// them (pages never change, so a size once known stays right).
    known_from: u64,
    known: VecDeque<u64>,
    /// The known sizes came from `following_sizes`: pages whose replies end
    /// where their sizes say. Sizes from `get_data_size` may include pages
    /// a reply takes by object (spooled, or over the server's read limit).
    known_predictable: bool,
    nothing_arrived: bool,
    acked: u64,
    sized_while_full: bool,
    asked: Option<Asked>,
    in_flight: Vec<InFlight>,
    /// A speculative DATA failed: pipeline again only after a reply.
    pipeline_paused: bool,
    /// The largest reply the server gave where more pages would have
    /// fitted what was asked (its own reply limit is lower, for now): asked
    /// for no more than this, so that where replies end stays predictable.
    /// Doubled after [`CAP_PROBE_AFTER`] replies that ended as foreseen.
    reply_cap: u64,
    /// Replies that ended as foreseen since `reply_cap` last changed.
    replies_at_cap: u32,
    /// A reply listed `following_sizes`: the server pipelines, and smaller
    /// replies pay off (see [`auto_reply_size`]).
    server_lists_sizes: bool,
    /// Replies that held more bytes than the listed sizes they were sent
    /// on foretold (see [`SourceMachine::replies_past_listed`]).
    replies_past_listed: u64,
    deleting: bool,
    done: bool,
}

impl SourceMachine {
    /// A consumer of `buffer` of `task` that starts at token 0.
    pub fn new(task: impl Into<String>, buffer: u64, config: PullConfig) -> Self {
        SourceMachine {
            task: task.into(),
            buffer,
            config,
            token: 0,
            known_from: 0,
            known: VecDeque::new(),
            known_predictable: false,
            nothing_arrived: false,
            acked: 0,
            sized_while_full: false,
            asked: None,
            in_flight: Vec::new(),
            pipeline_paused: false,
            reply_cap: u64::MAX,
            replies_at_cap: 0,
            server_lists_sizes: false,
            replies_past_listed: 0,
            deleting: false,
            done: false,
        }
    }

    /// Replies that held more bytes than the `following_sizes` they were
    /// sent on foretold: a server that breaks section 10's rule of where a
    /// reply ends (a wrong list). Such a reply is still taken, so this
    /// costs budget, never a page; binxd never sends one, and its
    /// simulation holds it to that.
    pub fn replies_past_listed(&self) -> u64 {
        self.replies_past_listed
    }

    /// The token of the next page expected.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// The sizes and pipelining it pulls with.
    pub fn config(&self) -> &PullConfig {
        &self.config
    }

    /// DATA requests for pages in flight.
    pub fn data_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Changes the largest reply asked for from the next request on (0 is
    /// [`auto_reply_size`]).
    pub fn set_max_reply_size(&mut self, max_reply_size: u64) {
        self.config.max_reply_size = max_reply_size;
    }

    fn pipelining(&self) -> bool {
        self.config.pipeline_depth > 1
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

    /// The size of page `token`, when known.
    fn known_size(&self, token: u64) -> Option<u64> {
        let index = usize::try_from(token.checked_sub(self.known_from)?).ok()?;
        self.known.get(index).copied()
    }

    /// Forgets the sizes of pages below `token`.
    fn forget_sizes_below(&mut self, token: u64) {
        while self.known_from < token && self.known.pop_front().is_some() {
            self.known_from += 1;
        }
        if self.known.is_empty() {
            self.known_from = token;
        }
    }

    fn learn_sizes(&mut self, from: u64, sizes: &[u64], predictable: bool) {
        self.known_from = from;
        self.known = sizes
            .iter()
            .take(MAX_KNOWN_SIZES)
            .take_while(|&&s| s <= MAX_LISTED_PAGE)
            .copied()
            .collect();
        self.known_predictable = predictable;
    }

    /// Where a reply to a DATA at `token` asking for `max_bytes` ends, by
    /// the server's rule, and the bytes it holds, if the sizes from
    /// `following_sizes` tell.
    fn predicted_end(&self, token: u64, max_bytes: u64) -> Option<(u64, u64)> {
        if !self.known_predictable {
            return None;
        }
        let mut total = 0u64;
        let mut count = 0u64;
        loop {
            if count >= MAX_REPLY_PAGES as u64 {
                return Some((token + count, total));
            }
            let size = self.known_size(token + count)?;
            if count > 0 && total.saturating_add(size) > max_bytes {
                return Some((token + count, total));
            }
            total = total.saturating_add(size);
            count += 1;
        }
    }

    /// The reply size to ask for with `room` bytes free.
    fn reply_size(&self, room: u64) -> u64 {
        // Until a reply lists the pages after it, nothing is pipelined:
        // replies sized for one DATA at a time.
        let depth = if self.server_lists_sizes {
            self.config.pipeline_depth
        } else {
            1
        };
        let reply_size = match self.config.max_reply_size {
            0 => auto_reply_size(self.config.memory_budget, depth),
            n => n,
        };
        room.min(reply_size).min(self.reply_cap).max(1)
    }

    /// Where the chain of DATA in flight from `token` ends: the token the
    /// next DATA would ask for, or `None` when a reply's end is unknown.
    fn chain_end(&self) -> Option<u64> {
        let mut at = self.token;
        while let Some(request) = self.in_flight.iter().find(|r| r.token == at) {
            at = request.end?;
        }
        Some(at)
    }

    /// A DATA for pages at `at` within `room`, recorded as in flight.
    fn data_request(&mut self, at: u64, room: u64) -> BinRequest {
        let max_bytes = self.reply_size(room);
        let (end, bytes) = match self.predicted_end(at, max_bytes) {
            Some((end, bytes)) => (Some(end), bytes),
            None => (None, max_bytes),
        };
        let ack = self.pipelining().then_some(self.token);
        self.in_flight.push(InFlight {
            token: at,
            ack,
            max_size: max_bytes,
            end,
            bytes,
        });
        let mut r = self.request(MessageType::Data, at);
        r.max_size_bytes = max_bytes;
        r.max_wait_micros = self.wait_micros();
        r.ack_token = ack;
        if self.config.accept_spooled {
            r.accept_spooled = true;
            r.accept_encodings = ACCEPT_ENCODINGS.iter().map(|e| e.to_string()).collect();
        }
        r
    }

    /// With DATA in flight: the next one to send, if any may go now.
    fn next_in_flight(&mut self, room: u64) -> Option<BinRequest> {
        let at = self.chain_end()?;
        if at == self.token {
            // The DATA at the next page is not in flight (its reply was
            // lost, refused or ended elsewhere than foreseen): ask again.
            if self.known_size(at).is_some_and(|s| s > room) || room == 0 {
                return None;
            }
            return Some(self.data_request(at, room));
        }
        let fits = self.known_size(at).is_some_and(|s| s <= room);
        if !self.pipelining()
            || self.pipeline_paused
            || self.in_flight.len() >= self.config.pipeline_depth
            || !fits
        {
            return None;
        }
        Some(self.data_request(at, room))
    }

    /// What to do now, given the bytes of pages the consumer holds. May
    /// be called at any time; with pipelining it can ask for another
    /// request while earlier ones are in flight.
    pub fn poll(&mut self, held: u64) -> PullStep {
        if self.done {
            return PullStep::Done;
        }
        if self.deleting {
            if self.asked == Some(Asked::Delete) {
                return PullStep::AwaitReply;
            }
            // Whatever is still in flight is past the end: its reply is
            // dropped.
            self.in_flight.clear();
            self.asked = Some(Asked::Delete);
            return PullStep::Send(Box::new(self.request(MessageType::Delete, 0)));
        }
        if self.asked.is_some() {
            return PullStep::AwaitReply;
        }
        let in_flight = self
            .in_flight
            .iter()
            .fold(0u64, |a, r| a.saturating_add(r.bytes));
        let room = self
            .config
            .memory_budget
            .saturating_sub(held.saturating_add(in_flight));
        if !self.in_flight.is_empty() {
            return match self.next_in_flight(room) {
                Some(r) => PullStep::Send(Box::new(r)),
                None => PullStep::AwaitReply,
            };
        }
        let next_fits = self.known_size(self.token).is_none_or(|s| s <= room);
        if held > 0 && (room == 0 || !next_fits) {
            // No room: let the server free what was read, learn what is
            // coming, then wait for the consumer.
            if self.token > self.acked {
                self.acked = self.token;
                self.asked = Some(Asked::Ack);
                return PullStep::Send(Box::new(self.request(MessageType::Ack, self.token)));
            }
            if self.known_size(self.token).is_none() && !self.sized_while_full {
                self.sized_while_full = true;
                self.asked = Some(Asked::SizesFull);
                let mut r = self.request(MessageType::Data, self.token);
                r.get_data_size = true;
                return PullStep::Send(Box::new(r));
            }
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
        PullStep::Send(Box::new(self.data_request(self.token, room)))
    }

    /// Whether the reply to `request` is still waited for. A driver that
    /// gets a failure for a request that is not (a DATA past a reply that
    /// ended elsewhere, say, which the server may refuse) hands it to
    /// [`SourceMachine::on_reply`] as `None` and goes on: it is no error of
    /// the pull.
    pub fn awaits(&self, request: &BinRequest) -> bool {
        match request.message_type() {
            Ok(MessageType::Data) if !request.get_data_size => {
                request.page_token == self.token && self.entry_of(request).is_some()
            }
            Ok(MessageType::Data) => {
                matches!(self.asked, Some(Asked::SizesFull | Asked::SizesWaiting))
            }
            Ok(MessageType::Ack) => self.asked == Some(Asked::Ack),
            Ok(MessageType::Delete) => self.asked == Some(Asked::Delete),
            _ => false,
        }
    }

    /// Whether a refusal of `request` (any status but OK and NO_DATA, or
    /// giving up on it) leaves the pull intact: true for a DATA the machine
    /// no longer waits for, and for one it sent past the next page expected
    /// on the word of `following_sizes` (it is asked again as the next page
    /// once that comes, and a second refusal is the pull's). A driver hands
    /// such a refusal to [`SourceMachine::on_reply`] as `None`.
    pub fn tolerates_refusal(&self, request: &BinRequest) -> bool {
        !self.awaits(request) || speculative(request)
    }

    /// The reply to a request [`SourceMachine::poll`] asked for, in any
    /// order. For a DATA with pages, returns where they are; the consumer
    /// takes them (fetching spooled segments) before it polls again, or
    /// calls [`SourceMachine::retry_pages`]: the next DATA acknowledges
    /// them. `None` means the request was not answered (lost, BUSY,
    /// TIMEOUT): it is asked again (an ACK is left to the next DATA).
    /// Replies to requests the machine no longer waits for (a DATA that
    /// does not start at the next page expected) are ignored: they return
    /// no pages, whatever they hold.
    pub fn on_reply(
        &mut self,
        request: &BinRequest,
        reply: Option<(&BinReply, usize)>,
    ) -> Result<Vec<ReplyPart>, ReplyError> {
        let asked = match request.message_type() {
            Ok(MessageType::Ack) => Asked::Ack,
            Ok(MessageType::Delete) => Asked::Delete,
            Ok(MessageType::Data) if request.get_data_size => match self.asked {
                Some(a @ (Asked::SizesFull | Asked::SizesWaiting)) => a,
                _ => return Ok(Vec::new()),
            },
            Ok(MessageType::Data) => return self.on_data_reply(request, reply),
            _ => return Ok(Vec::new()),
        };
        if self.asked != Some(asked) {
            return Ok(Vec::new());
        }
        let Some((header, _)) = reply else {
            self.asked = None;
            self.resend(asked);
            return Ok(Vec::new());
        };
        self.asked = None;
        match asked {
            Asked::Ack => {}
            Asked::Delete => self.done = true,
            Asked::SizesFull | Asked::SizesWaiting => {
                let sizes = &header.remaining_bytes;
                if header.buffer_complete && sizes.is_empty() {
                    self.deleting = true;
                    return Ok(Vec::new());
                }
                if asked == Asked::SizesWaiting {
                    self.nothing_arrived = sizes.is_empty();
                }
                self.learn_sizes(self.token, sizes, false);
            }
        }
        Ok(Vec::new())
    }

    /// A request other than a DATA for pages went unanswered: the next
    /// poll asks it again.
    fn resend(&mut self, asked: Asked) {
        match asked {
            Asked::SizesFull => self.sized_while_full = false,
            Asked::SizesWaiting => self.nothing_arrived = true,
            Asked::Delete => self.deleting = true,
            Asked::Ack => {}
        }
    }

    /// The DATA in flight that `request` is (or asked the same as).
    fn entry_of(&self, request: &BinRequest) -> Option<usize> {
        self.in_flight.iter().position(|r| {
            r.token == request.page_token
                && r.ack == request.ack_token
                && r.max_size == request.max_size_bytes
        })
    }

    fn on_data_reply(
        &mut self,
        request: &BinRequest,
        reply: Option<(&BinReply, usize)>,
    ) -> Result<Vec<ReplyPart>, ReplyError> {
        let Some(index) = self.entry_of(request) else {
            return Ok(Vec::new());
        };
        let sent = self.in_flight.swap_remove(index);
        let Some((header, body_len)) = reply else {
            if speculative(request) {
                self.pipeline_paused = true;
            }
            return Ok(Vec::new());
        };
        if sent.token != self.token {
            // Out of order, or past a reply that ended elsewhere: dropped.
            return Ok(Vec::new());
        }
        let parts = check_data_reply(request, header, body_len)?;
        let mut count = 0u64;
        let mut bytes = 0u64;
        let mut inline = true;
        for part in &parts {
            let sizes = match part {
                ReplyPart::Inline { sizes, .. } => sizes,
                ReplyPart::Spooled { segment, .. } => {
                    inline = false;
                    &segment.page_sizes
                }
            };
            count += sizes.len() as u64;
            bytes = sizes.iter().fold(bytes, |a, &s| a.saturating_add(s));
        }
        if count == 0 {
            // Nothing from here yet: whatever else is in flight is past
            // pages that do not exist yet.
            self.in_flight.clear();
            if header.buffer_complete {
                self.deleting = true;
            } else {
                self.known.clear();
                self.nothing_arrived = true;
            }
            return Ok(parts);
        }
        if sent.end.is_some() && bytes > sent.bytes {
            // More than the listed sizes said (a wrong list): the DATA sent
            // after this one counted their room on the same list, so their
            // replies are dropped and what follows is asked for again
            // within the room left. Taking several such replies could hold
            // more than the budget plus one page.
            self.replies_past_listed += 1;
            self.in_flight.clear();
        }
        self.pipeline_paused = false;
        self.token = header.page_next_token;
        match sent.end {
            Some(end) if self.token < end && inline && !header.buffer_complete => {
                // The server stopped short of pages that fitted what this
                // request asked: its reply limit is lower, for now.
                self.reply_cap = bytes.max(1);
                self.replies_at_cap = 0;
            }
            Some(end) if self.token == end && self.reply_cap < u64::MAX => {
                self.replies_at_cap += 1;
                if self.replies_at_cap >= CAP_PROBE_AFTER {
                    // Ask for more again: a limit that went back up (a
                    // forwarding sidecar's budget freed) is found, and one
                    // that did not costs one reply ending early.
                    self.reply_cap = self.reply_cap.saturating_mul(2);
                    self.replies_at_cap = 0;
                }
            }
            _ => {}
        }
        self.forget_sizes_below(self.token);
        if request.ack_token.is_some() {
            // The server vouches for what it lists now, and for nothing it
            // listed before (pages may have spilled, or a forwarding sidecar
            // may answer from a commit marker, which lists nothing).
            self.server_lists_sizes |= !header.following_sizes.is_empty();
            self.learn_sizes(self.token, &header.following_sizes, true);
        }
        if header.buffer_complete {
            self.deleting = true;
        }
        Ok(parts)
    }

    /// The pages of the last DATA reply could not all be taken (a spooled
    /// segment failed): ask again at the same token.
    pub fn retry_pages(&mut self, token: u64) {
        self.token = token;
        self.deleting = false;
        self.in_flight.clear();
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
        let asked_with = |memory_budget: u64, max_reply_size: u64, held: u64, depth: usize| {
            let config = PullConfig {
                memory_budget,
                max_reply_size,
                pipeline_depth: depth,
                ..PullConfig::default()
            };
            match SourceMachine::new("t", 0, config).poll(held) {
                PullStep::Send(r) => r.max_size_bytes,
                other => panic!("{other:?}"),
            }
        };
        let asked = |budget, max, held| asked_with(budget, max, held, 1);
        // The default budget (32 MiB), one DATA at a time: 4 MiB.
        assert_eq!(asked(PullConfig::default().memory_budget, 0, 0), 4 << 20);
        assert_eq!(asked(256 << 20, 0, 0), 16 << 20);
        assert_eq!(asked(8 << 20, 0, 0), 1 << 20);
        // Pipelining (the default) starts as one DATA at a time, and asks
        // for 2 MiB (never below 1 MiB) once the server lists the sizes
        // that follow its replies.
        assert_eq!(asked_with(32 << 20, 0, 0, 2), 4 << 20);
        for (budget, expected) in [
            (32 << 20, 2 << 20),
            (256 << 20, 2 << 20),
            (8 << 20, 1 << 20),
        ] {
            let config = PullConfig {
                memory_budget: budget,
                ..PullConfig::default()
            };
            let mut m = SourceMachine::new("t", 0, config);
            let first = send(&mut m, 0);
            let reply = with_following(data_reply(0, &[10], false), &[10; 4]);
            m.on_reply(&first, Some((&reply, 10))).unwrap();
            assert_eq!(send(&mut m, 10).max_size_bytes, expected, "budget {budget}");
        }
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

    fn send(m: &mut SourceMachine, held: u64) -> BinRequest {
        match m.poll(held) {
            PullStep::Send(r) => *r,
            other => panic!("expected a request, got {other:?}"),
        }
    }

    fn with_following(mut reply: BinReply, following: &[u64]) -> BinReply {
        reply.following_sizes = following.to_vec();
        reply
    }

    /// A pipelining machine that got page 0 of 10 bytes, with nine more of
    /// 10 bytes listed after it, and sent the next two DATA.
    fn two_in_flight(reply: u64) -> (SourceMachine, BinRequest, BinRequest) {
        let mut m = pipelining(1 << 20, reply);
        let first = send(&mut m, 0);
        let listed = with_following(data_reply(0, &[10], false), &[10; 9]);
        m.on_reply(&first, Some((&listed, 10))).unwrap();
        let second = send(&mut m, 10);
        let third = send(&mut m, 10);
        (m, second, third)
    }

    fn pipelining(budget: u64, reply: u64) -> SourceMachine {
        SourceMachine::new(
            "t",
            0,
            PullConfig {
                memory_budget: budget,
                max_reply_size: reply,
                ..PullConfig::default()
            },
        )
    }

    #[test]
    fn following_sizes_let_the_next_data_go_before_the_last_reply_comes() {
        let mut m = pipelining(1 << 20, 30);
        let first = send(&mut m, 0);
        assert_eq!((first.page_token, first.ack_token), (0, Some(0)));
        // Nothing is known of the pages after it yet: one at a time.
        assert_eq!(m.poll(0), PullStep::AwaitReply);
        let reply = with_following(data_reply(0, &[10, 10, 10], false), &[10; 9]);
        assert_eq!(m.on_reply(&first, Some((&reply, 30))).unwrap().len(), 1);
        let second = send(&mut m, 30);
        assert_eq!((second.page_token, second.ack_token), (3, Some(3)));
        // Pages 3, 4, 5 make its reply: the next one starts at 6.
        let third = send(&mut m, 30);
        assert_eq!((third.page_token, third.ack_token), (6, Some(3)));
        assert_eq!(third.max_size_bytes, 30);
        assert_eq!(m.data_in_flight(), 2);
        assert_eq!(m.poll(30), PullStep::AwaitReply, "two in flight at most");
        let reply = with_following(data_reply(3, &[10, 10, 10], false), &[10; 6]);
        m.on_reply(&second, Some((&reply, 30))).unwrap();
        assert_eq!(m.token(), 6);
        let fourth = send(&mut m, 60);
        assert_eq!((fourth.page_token, fourth.ack_token), (9, Some(6)));
    }

    #[test]
    fn a_reply_that_ends_elsewhere_than_foreseen_drops_the_data_behind_it() {
        let (mut m, second, third) = two_in_flight(30);
        assert_eq!((second.page_token, third.page_token), (1, 4));
        // The server stopped after two pages (its own limit is 20 bytes).
        let short = with_following(data_reply(1, &[10, 10], false), &[10; 7]);
        m.on_reply(&second, Some((&short, 20))).unwrap();
        assert_eq!(m.token(), 3);
        // The DATA at 4 is not what comes next: the one at 3 goes now, no
        // larger than what the server gives.
        let again = send(&mut m, 30);
        assert_eq!((again.page_token, again.max_size_bytes), (3, 20));
        assert!(!m.awaits(&third));
        let late = with_following(data_reply(4, &[10, 10, 10], false), &[]);
        assert!(m.on_reply(&third, Some((&late, 30))).unwrap().is_empty());
        assert_eq!(m.token(), 3, "a reply that skips pages is never used");
        let right = with_following(data_reply(3, &[10, 10], false), &[10; 5]);
        assert!(m.awaits(&again));
        assert_eq!(m.on_reply(&again, Some((&right, 20))).unwrap().len(), 1);
        assert_eq!(m.token(), 5);
    }

    #[test]
    fn replies_out_of_order_or_unanswered_cost_a_request_never_a_page() {
        let (mut m, second, third) = two_in_flight(10);
        // The third's reply comes first: dropped.
        let early = with_following(data_reply(2, &[10], false), &[10; 7]);
        assert!(!m.awaits(&third));
        assert!(m.on_reply(&third, Some((&early, 10))).unwrap().is_empty());
        // The second was not answered (BUSY): asked again, and pipelining
        // waits for a reply that brings pages.
        m.on_reply(&second, None).unwrap();
        let retry = send(&mut m, 10);
        assert_eq!((retry.page_token, retry.ack_token), (1, Some(1)));
        let reply = with_following(data_reply(1, &[10], false), &[10; 8]);
        m.on_reply(&retry, Some((&reply, 10))).unwrap();
        assert_eq!(m.token(), 2);
        let next = send(&mut m, 20);
        assert_eq!(next.page_token, 2);
        // A speculative DATA that fails pauses pipelining until a reply.
        let spec = send(&mut m, 20);
        assert_eq!(spec.page_token, 3);
        m.on_reply(&spec, None).unwrap();
        assert_eq!(m.poll(20), PullStep::AwaitReply);
    }

    #[test]
    fn the_budget_counts_the_replies_in_flight_and_depth_one_never_pipelines() {
        let mut m = pipelining(25, 10);
        let first = send(&mut m, 0);
        let reply = with_following(data_reply(0, &[10], false), &[10; 9]);
        m.on_reply(&first, Some((&reply, 10))).unwrap();
        // Held 10 + in flight 10 leave 5: no room for a third page.
        let second = send(&mut m, 10);
        assert_eq!(second.max_size_bytes, 10);
        assert_eq!(m.poll(10), PullStep::AwaitReply);
        let mut one = SourceMachine::new(
            "t",
            0,
            PullConfig {
                pipeline_depth: 1,
                ..PullConfig::default()
            },
        );
        let first = send(&mut one, 0);
        assert_eq!(first.ack_token, None, "a BinX 1.1 request");
        let reply = with_following(data_reply(0, &[10], false), &[10; 9]);
        one.on_reply(&first, Some((&reply, 10))).unwrap();
        let second = send(&mut one, 10);
        assert_eq!((second.page_token, second.ack_token), (1, None));
        assert_eq!(one.poll(10), PullStep::AwaitReply);
    }

    #[test]
    fn a_server_limit_below_the_ask_is_learnt_and_probed_again() {
        let mut m = pipelining(1 << 20, 30);
        let first = send(&mut m, 0);
        let reply = with_following(data_reply(0, &[10], false), &[10; 40]);
        m.on_reply(&first, Some((&reply, 10))).unwrap();
        let second = send(&mut m, 10);
        assert_eq!((second.page_token, second.max_size_bytes), (1, 30));
        // The server gives 20 bytes where 30 fitted: its limit is 20.
        let short = with_following(data_reply(1, &[10, 10], false), &[10; 40]);
        m.on_reply(&second, Some((&short, 20))).unwrap();
        let mut token = 3;
        for _ in 0..CAP_PROBE_AFTER {
            let next = send(&mut m, 0);
            assert_eq!((next.page_token, next.max_size_bytes), (token, 20));
            let reply = with_following(data_reply(token, &[10, 10], false), &[10; 40]);
            m.on_reply(&next, Some((&reply, 20))).unwrap();
            token += 2;
        }
        // After replies that ended as foreseen, it asks for more again.
        let probe = send(&mut m, 0);
        assert_eq!((probe.page_token, probe.max_size_bytes), (token, 30));
    }

    #[test]
    fn a_data_in_flight_for_the_next_page_serves_whatever_it_acknowledged_and_is_asked_again_if_refused()
     {
        let (mut m, second, third) = two_in_flight(30);
        assert_eq!((third.page_token, third.ack_token), (4, Some(1)));
        // The second ends early, at 3: the next page is asked for.
        let short = with_following(data_reply(1, &[10, 10], false), &[10; 7]);
        m.on_reply(&second, Some((&short, 20))).unwrap();
        let at_three = send(&mut m, 0);
        assert_eq!((at_three.page_token, at_three.max_size_bytes), (3, 20));
        let reply = with_following(data_reply(3, &[10], false), &[10; 6]);
        m.on_reply(&at_three, Some((&reply, 10))).unwrap();
        // The third, sent at 4 before, is now the next page's DATA: the one
        // after goes behind it.
        assert!(m.awaits(&third));
        let at_seven = send(&mut m, 0);
        assert_eq!((at_seven.page_token, at_seven.ack_token), (7, Some(4)));
        // It was a guess: its refusal is not the pull's, and 4 is asked
        // again, acknowledging what was received.
        assert!(m.tolerates_refusal(&third));
        m.on_reply(&third, None).unwrap();
        let at_four = send(&mut m, 0);
        assert_eq!((at_four.page_token, at_four.ack_token), (4, Some(4)));
        assert!(
            !m.tolerates_refusal(&at_four),
            "the next page's own refusal is the pull's"
        );
        // The DATA at 7 answers first: not the next page, dropped.
        assert!(!m.awaits(&at_seven));
        let early = with_following(data_reply(7, &[10], false), &[]);
        assert!(
            m.on_reply(&at_seven, Some((&early, 10)))
                .unwrap()
                .is_empty()
        );
        let reply = with_following(data_reply(4, &[10, 10], false), &[10; 3]);
        assert_eq!(m.on_reply(&at_four, Some((&reply, 20))).unwrap().len(), 1);
        assert_eq!(m.token(), 6);
    }

    #[test]
    fn a_reply_larger_than_listed_is_taken_and_the_data_sent_behind_it_dropped() {
        // Pages 1 to 9 listed at 10 bytes: DATA at 1 and 4, 30 bytes each.
        let (mut m, second, third) = two_in_flight(30);
        assert_eq!((third.page_token, m.data_in_flight()), (4, 2));
        // The reply at 1 holds 1 to 4, 45 bytes: the list was wrong.
        let larger = with_following(data_reply(1, &[10, 10, 10, 15], false), &[10; 5]);
        assert_eq!(m.on_reply(&second, Some((&larger, 45))).unwrap().len(), 1);
        assert_eq!(m.token(), 5);
        // The DATA at 4 counted its room on that list: not waited for.
        assert_eq!(m.data_in_flight(), 0);
        assert!(!m.awaits(&third));
        let next = send(&mut m, 45);
        assert_eq!((next.page_token, next.ack_token), (5, Some(5)));
    }

    #[test]
    fn a_spooled_segment_retried_drops_the_data_in_flight_behind_it() {
        let (mut m, second, third) = two_in_flight(30);
        let reply = with_following(data_reply(1, &[10, 10, 10], false), &[10; 6]);
        m.on_reply(&second, Some((&reply, 30))).unwrap();
        // Its pages could not be taken: asked again, from 1.
        m.retry_pages(1);
        assert!(!m.awaits(&third));
        let again = send(&mut m, 0);
        assert_eq!((again.page_token, again.ack_token), (1, Some(1)));
        let late = with_following(data_reply(4, &[10, 10, 10], false), &[]);
        assert!(m.on_reply(&third, Some((&late, 30))).unwrap().is_empty());
        assert_eq!(m.token(), 1);
    }

    #[test]
    fn sizes_no_frame_can_carry_are_not_believed() {
        let mut m = pipelining(1 << 20, 30);
        let first = send(&mut m, 0);
        let reply = with_following(data_reply(0, &[10], false), &[u64::MAX, 0, 0]);
        m.on_reply(&first, Some((&reply, 10))).unwrap();
        let second = send(&mut m, 10);
        assert_eq!(second.page_token, 1);
        // Nothing is known past the lie: no second DATA, no overflow.
        assert_eq!(m.poll(10), PullStep::AwaitReply);
        let reply = with_following(data_reply(1, &[5], false), &[u64::MAX / 2, u64::MAX / 2, 1]);
        m.on_reply(&second, Some((&reply, 5))).unwrap();
        let _ = m.poll(0);
        let _ = m.poll(0);
    }
}
