//! The HTTP exchange that Presto and Trino workers read with their own
//! exchange clients, over the same buffer manager as BinX, so one buffer can
//! be read by either protocol:
//!
//! - `GET  /v1/task/{task}/results/{buffer}/{token}`: pages from `token`
//!   (max-size and max-wait headers); 200 with the pages, or 204 without a
//!   body;
//! - `HEAD` on the same path: only the sizes of the pages available;
//! - `GET  /v1/task/{task}/results/{buffer}/{token}/acknowledge`;
//! - `DELETE /v1/task/{task}/results/{buffer}`.
//!
//! Two dialects ([`Dialect`]), chosen per request by the headers the client
//! sends (docs/PROTOCOL.md section 7): Presto's (`X-Presto-*`, pages
//! concatenated) and Trino's (`X-Trino-*`, a serialized-pages header with
//! Trino's checksum before the pages).
//!
//! This module knows no HTTP library: it maps a method, a path and a few
//! header values to a status, headers and body pieces; binxd serves it with
//! hyper.

use std::time::Duration;

use binx_core::{BufferKey, DataQuery, Encodings, Op, Payload, Request, TaskId};
use binx_proto::{BinReply, Status};
use bytes::Bytes;

use crate::exchange::Exchange;

/// Media type of a Presto page body.
pub const PAGES_CONTENT_TYPE: &str = "application/X-presto-pages";

/// Media type of a Trino page body (Trino compares media types without
/// regard to case).
pub const TRINO_PAGES_CONTENT_TYPE: &str = "application/X-trino-pages";

/// First field of a Trino page body (`PagesInputStreamFactory`), written
/// little-endian like every number in it.
pub const TRINO_SERIALIZED_PAGES_MAGIC: u32 = 0xfea4_f001;

/// The checksum Trino reserves for "not computed" (`PagesSerdeUtil`); a
/// computed checksum that equals it is sent plus one.
pub const TRINO_NO_CHECKSUM: u64 = 0x0123_4567_89ab_cdef;

/// Most bytes either list of sizes (`X-Binx-Page-Sizes`, the remaining
/// bytes) takes in a reply's headers. The engines' HTTP clients refuse a
/// reply whose headers are larger than they take (airlift's default for
/// Trino is 16 KiB: "Response Header Bytes Too Large" over HTTP/1.1,
/// `invalid_hpack_block` over HTTP/2), and fail the query after retrying:
/// a buffer of thousands of small pages would list them all. So a reply
/// carries no more pages than its size list fits in this, and lists no
/// more remaining sizes; with the other headers it stays under 8 KiB.
pub const MAX_SIZES_HEADER_BYTES: usize = 3 * 1024;

/// Which engine's exchange a request speaks. They share paths and
/// semantics; header names, the failed-task answer and the body framing
/// differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// `X-Presto-*` headers.
    Presto,
    /// `X-Trino-*` headers.
    Trino,
}

/// The header names of one dialect.
#[derive(Debug)]
pub struct DialectHeaders {
    /// Request: most bytes of pages wanted.
    pub max_size: &'static str,
    /// Request: longest long-poll.
    pub max_wait: &'static str,
    /// Reply: the task instance (stable for the daemon's life).
    pub task_instance_id: &'static str,
    /// Reply: the token of the first page in the body.
    pub page_token: &'static str,
    /// Reply: the token to ask for next.
    pub page_next_token: &'static str,
    /// Reply: the buffer is finished and every page was acknowledged.
    pub buffer_complete: &'static str,
    /// Reply: bytes of pages held beyond this reply.
    pub buffer_remaining_bytes: &'static str,
    /// Reply: whether the task failed (Trino's client reads it; Presto's reads the 500).
    pub task_failed: &'static str,
    /// The media type of serialized pages.
    pub content_type: &'static str,
}

const PRESTO_HEADERS: DialectHeaders = DialectHeaders {
    max_size: "X-Presto-Max-Size",
    max_wait: "X-Presto-Max-Wait",
    task_instance_id: "X-Presto-Task-Instance-Id",
    page_token: "X-Presto-Page-Sequence-Id",
    page_next_token: "X-Presto-Page-End-Sequence-Id",
    buffer_complete: "X-Presto-Buffer-Complete",
    buffer_remaining_bytes: "X-Presto-Buffer-Remaining-Bytes",
    task_failed: "X-Presto-Task-Failed",
    content_type: PAGES_CONTENT_TYPE,
};

const TRINO_HEADERS: DialectHeaders = DialectHeaders {
    max_size: "X-Trino-Max-Size",
    max_wait: "X-Trino-Max-Wait",
    task_instance_id: "X-Trino-Task-Instance-Id",
    page_token: "X-Trino-Page-Sequence-Id",
    page_next_token: "X-Trino-Page-End-Sequence-Id",
    buffer_complete: "X-Trino-Buffer-Complete",
    buffer_remaining_bytes: "X-Trino-Buffer-Remaining-Bytes",
    task_failed: "X-Trino-Task-Failed",
    content_type: TRINO_PAGES_CONTENT_TYPE,
};

impl Dialect {
    /// Trino when any header name starts with `X-Trino-` (Trino's client
    /// sends `X-Trino-Max-Size` on every GET, and its bearer with a secret);
    /// Presto otherwise.
    pub fn of<'a>(mut header_names: impl Iterator<Item = &'a str>) -> Dialect {
        let trino = header_names
            .any(|name| name.len() >= 8 && name.as_bytes()[..8].eq_ignore_ascii_case(b"x-trino-"));
        if trino {
            Dialect::Trino
        } else {
            Dialect::Presto
        }
    }

    /// The dialect's header names.
    pub fn headers(self) -> &'static DialectHeaders {
        match self {
            Dialect::Presto => &PRESTO_HEADERS,
            Dialect::Trino => &TRINO_HEADERS,
        }
    }
}

/// How long a GET without a max-wait header waits for pages: what Presto's
/// and Trino's servers do (`TaskUtils.randomizeWaitTime` of 2 s: uniform in
/// [1 s, 2 s)), so their clients, which send none, do not spin on an empty
/// buffer. The core caps it at its `max_wait`.
pub fn engine_default_wait() -> Duration {
    Duration::from_millis(1000 + fastrand::u64(0..1000))
}

/// Trino's checksum of the pages of one body (`PagesSerdeUtil.calculateChecksum`):
/// XXH64 with seed 0 over the pages in order, each with its page header.
pub fn trino_checksum(pages: &[Bytes]) -> u64 {
    let mut hash = twox_hash::XxHash64::with_seed(0);
    for page in pages {
        std::hash::Hasher::write(&mut hash, page);
    }
    let checksum = std::hash::Hasher::finish(&hash);
    if checksum == TRINO_NO_CHECKSUM {
        checksum.wrapping_add(1)
    } else {
        checksum
    }
}

/// The 16 bytes before the pages of a Trino body: magic, checksum, count.
fn trino_body_header(pages: &[Bytes]) -> Bytes {
    let mut header = Vec::with_capacity(16);
    header.extend_from_slice(&TRINO_SERIALIZED_PAGES_MAGIC.to_le_bytes());
    header.extend_from_slice(&trino_checksum(pages).to_le_bytes());
    // At most MAX_REPLY_PAGES pages, far below i32::MAX.
    header.extend_from_slice(&(pages.len() as u32).to_le_bytes());
    Bytes::from(header)
}

/// What to answer.
#[derive(Debug)]
pub struct HttpReply {
    /// The HTTP status code.
    pub status: u16,
    /// Response headers, in order.
    pub headers: Vec<(&'static str, String)>,
    /// Body pieces, sent in order (pages are not copied).
    pub body: Vec<Bytes>,
}

impl HttpReply {
    /// Whether this is a GET's "nothing yet" (204, neither complete nor
    /// failed): what a long-poll would have waited on.
    pub fn nothing_yet(&self, dialect: Dialect) -> bool {
        let names = dialect.headers();
        self.status == 204
            && !self.headers.iter().any(|(name, value)| {
                (*name == names.buffer_complete || *name == names.task_failed) && value == "true"
            })
    }

    fn text(status: u16, message: impl Into<String>) -> HttpReply {
        let mut message = message.into();
        message.push('\n');
        HttpReply {
            status,
            headers: vec![("Content-Type", "text/plain; charset=utf-8".into())],
            body: vec![Bytes::from(message)],
        }
    }
}

/// The request as far as the exchange cares.
#[derive(Debug, Clone, Copy)]
pub struct HttpRequest<'a> {
    /// The HTTP method.
    pub method: &'a str,
    /// The request path (no query).
    pub path: &'a str,
    /// Which engine's headers it uses.
    pub dialect: Dialect,
    /// The dialect's max-size header, if sent.
    pub max_size: Option<&'a str>,
    /// The dialect's max-wait header, if sent.
    pub max_wait: Option<&'a str>,
    /// The wait when no max-wait header is sent ([`engine_default_wait`]).
    pub default_wait: Duration,
}

/// Whether `path` belongs to the exchange (the caller routes the rest).
pub fn is_exchange_path(path: &str) -> bool {
    path.starts_with("/v1/task/")
}

#[derive(Debug)]
enum Route<'a> {
    Results {
        task: &'a str,
        buffer: u64,
        token: u64,
    },
    Acknowledge {
        task: &'a str,
        buffer: u64,
        token: u64,
    },
    Buffer {
        task: &'a str,
        buffer: u64,
    },
}

fn route(path: &str) -> Result<Route<'_>, String> {
    let usage = "expected /v1/task/{taskId}/results/{bufferId}/{token}, .../{token}/acknowledge or /v1/task/{taskId}/results/{bufferId}";
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (task, rest) = match parts.as_slice() {
        ["v1", "task", task, "results", rest @ ..] if !rest.is_empty() => (*task, rest),
        _ => return Err(format!("no such path {path:?}: {usage}")),
    };
    let number = |what: &str, text: &str| {
        text.parse::<u64>()
            .map_err(|_| format!("{what} {text:?} in {path:?} is not a whole number"))
    };
    match rest {
        [buffer] => Ok(Route::Buffer {
            task,
            buffer: number("buffer id", buffer)?,
        }),
        [buffer, token] => Ok(Route::Results {
            task,
            buffer: number("buffer id", buffer)?,
            token: number("token", token)?,
        }),
        [buffer, token, "acknowledge"] => Ok(Route::Acknowledge {
            task,
            buffer: number("buffer id", buffer)?,
            token: number("token", token)?,
        }),
        _ => Err(format!("no such path {path:?}: {usage}")),
    }
}

/// An HTTP exchange request checked at the door: the typed request to hand
/// the core, and how to answer it.
#[derive(Debug)]
pub enum ExchangeRequest<'a> {
    /// GET (pages) or HEAD (sizes only) from a token.
    Results {
        /// The task id from the path.
        task: &'a str,
        /// The buffer id from the path.
        buffer: u64,
        /// The token from the path.
        token: u64,
        /// HEAD: sizes only, no body.
        head: bool,
        /// The DATA request for the core.
        request: Request,
    },
    /// GET .../acknowledge: an ACK.
    Acknowledge(Request),
    /// DELETE of a buffer.
    Delete(Request),
}

/// Parses one exchange request (path, method, Presto headers) without
/// touching any buffer; a refusal is the reply to send. Pure, so the fuzz
/// target `http_request` drives it with arbitrary input.
pub fn parse<'a>(request: &HttpRequest<'a>) -> Result<ExchangeRequest<'a>, HttpReply> {
    let route = route(request.path).map_err(|e| HttpReply::text(404, e))?;
    let method = request.method;
    let typed = |op: Op| Request {
        id: 0,
        op,
        remote: None,
    };
    match (route, method) {
        (
            Route::Results {
                task,
                buffer,
                token,
            },
            "GET" | "HEAD",
        ) => {
            let names = request.dialect.headers();
            let max_size = request
                .max_size
                .map(parse_data_size)
                .transpose()
                .map_err(|e| HttpReply::text(400, format!("{}: {e}", names.max_size)))?
                .unwrap_or(0);
            let max_wait = request
                .max_wait
                .map(parse_duration)
                .transpose()
                .map_err(|e| HttpReply::text(400, format!("{}: {e}", names.max_wait)))?
                .unwrap_or(request.default_wait);
            let key = buffer_key(task, buffer)?;
            Ok(ExchangeRequest::Results {
                task,
                buffer,
                token,
                head: method == "HEAD",
                request: typed(Op::Data(DataQuery {
                    key,
                    token,
                    sizes_only: method == "HEAD",
                    max_size,
                    max_wait,
                    accept_spooled: false,
                    encodings: Encodings::default(),
                    ack: None,
                })),
            })
        }
        (
            Route::Acknowledge {
                task,
                buffer,
                token,
            },
            "GET",
        ) => Ok(ExchangeRequest::Acknowledge(typed(Op::Ack {
            key: buffer_key(task, buffer)?,
            token,
        }))),
        (Route::Buffer { task, buffer }, "DELETE") => {
            Ok(ExchangeRequest::Delete(typed(Op::Delete {
                key: buffer_key(task, buffer)?,
            })))
        }
        (Route::Results { .. }, _) => Err(method_not_allowed(method, "GET or HEAD")),
        (Route::Acknowledge { .. }, _) => Err(method_not_allowed(method, "GET")),
        (Route::Buffer { .. }, _) => Err(method_not_allowed(method, "DELETE")),
    }
}

/// Answers one exchange request. `instance_id` identifies this daemon's
/// run (`X-Presto-Task-Instance-Id`).
pub async fn serve(exchange: &Exchange, instance_id: &str, request: HttpRequest<'_>) -> HttpReply {
    let dialect = request.dialect;
    match parse(&request) {
        Err(reply) => reply,
        Ok(ExchangeRequest::Results {
            task,
            buffer,
            token,
            head,
            request,
        }) => {
            let wait = match &request.op {
                Op::Data(q) => q.max_wait,
                _ => Duration::ZERO,
            };
            let reply = exchange.handle(request, Payload::empty()).await;
            if reply.header.status_kind() == Status::ServerError && exchange.task_failed(task) {
                return failed_task_reply(dialect, instance_id, token, &reply.header);
            }
            // A token below the acknowledged mark (a repeated or late request
            // of a client that moved on): the engines' own servers answer it
            // empty at its token, not complete, and never fail the query;
            // binxd does so after the request's wait, as for an empty
            // buffer, so a client stuck there polls, never spins.
            let behind = reply.header.status_kind() == Status::BadRequest
                && exchange
                    .acknowledged_mark(task, buffer)
                    .is_some_and(|mark| token < mark);
            if behind {
                tokio::time::sleep(exchange.capped_wait(task, wait)).await;
            }
            let pages = PagesReply {
                dialect,
                instance_id,
                head,
                behind,
                header: reply.header,
                pages: reply.body,
            };
            pages.into_reply(exchange, task, buffer)
        }
        Ok(ExchangeRequest::Acknowledge(request) | ExchangeRequest::Delete(request)) => {
            no_content_or_error(exchange.handle(request, Payload::empty()).await.header)
        }
    }
}

/// The buffer a path names, its task id checked at the door.
fn buffer_key(task: &str, buffer: u64) -> Result<BufferKey, HttpReply> {
    let task = TaskId::parse(task).map_err(|e| HttpReply::text(400, e))?;
    Ok(BufferKey { task, buffer })
}

fn method_not_allowed(method: &str, allowed: &str) -> HttpReply {
    let mut reply = HttpReply::text(
        405,
        format!("{method} is not allowed on this path; use {allowed}"),
    );
    reply.headers.push(("Allow", allowed.replace(" or ", ", ")));
    reply
}

/// A refusal from the buffer manager as an HTTP status: the client's mistakes
/// are 4xx; an aborted task is the server's failure.
fn refusal(header: &BinReply) -> HttpReply {
    let status = match header.status_kind() {
        Status::BadRequest => 400,
        Status::Unauthenticated => 401,
        Status::Busy => 429,
        _ => 500,
    };
    HttpReply::text(status, header.error.clone())
}

fn no_content_or_error(header: BinReply) -> HttpReply {
    match header.status_kind() {
        Status::Ok => HttpReply {
            status: 204,
            headers: Vec::new(),
            body: Vec::new(),
        },
        _ => refusal(&header),
    }
}

fn join(sizes: &[u64]) -> String {
    sizes
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// How many of `sizes`, from the first, [`join`] lists within
/// [`MAX_SIZES_HEADER_BYTES`]; at least one, so a reply always moves on.
fn sizes_that_fit(sizes: impl IntoIterator<Item = u64>) -> usize {
    let mut bytes = 0;
    let mut count = 0;
    for size in sizes {
        // Digits, and a comma before every size but the first.
        bytes += size.checked_ilog10().unwrap_or(0) as usize + 1 + usize::from(count > 0);
        if bytes > MAX_SIZES_HEADER_BYTES && count > 0 {
            break;
        }
        count += 1;
    }
    count
}

/// Pages (or none) for a GET or HEAD, before they become a reply.
struct PagesReply<'a> {
    dialect: Dialect,
    instance_id: &'a str,
    head: bool,
    /// The request's token is below the buffer's acknowledged mark.
    behind: bool,
    header: BinReply,
    pages: Vec<Bytes>,
}

impl PagesReply<'_> {
    fn into_reply(self, exchange: &Exchange, task: &str, buffer: u64) -> HttpReply {
        let mut header = self.header;
        // BUSY is backpressure ("retry later", nothing changed): both
        // engines' clients fail the query on any status but 200 and 204,
        // so it is an empty reply at the request's token, which they poll
        // again, with the reason in X-Binx-Error.
        let busy = header.status_kind() == Status::Busy;
        let behind = self.behind;
        if busy || behind {
            header.page_next_token = header.page_token;
            header.buffer_complete = false;
        } else if !matches!(header.status_kind(), Status::Ok | Status::NoData) {
            return refusal(&header);
        }
        let names = self.dialect.headers();
        let mut pages = self.pages;
        let fit = sizes_that_fit(pages.iter().map(|p| p.len() as u64));
        if fit < pages.len() {
            // The rest stays for the next GET, which asks from here on.
            pages.truncate(fit);
            header.page_next_token = header.page_token.saturating_add(fit as u64);
            header.buffer_complete = false;
        }
        let page_sizes: Vec<u64> = pages.iter().map(|p| p.len() as u64).collect();
        // HEAD reports the sizes from the token; GET what remains after its pages.
        let mut remaining = if behind {
            Vec::new()
        } else if self.head {
            header.remaining_bytes.clone()
        } else {
            exchange.peek_sizes(task, buffer, header.page_next_token)
        };
        remaining.truncate(sizes_that_fit(remaining.iter().copied()));
        let mut headers = token_headers(
            self.dialect,
            self.instance_id,
            header.page_token,
            header.page_next_token,
            header.buffer_complete,
        );
        headers.push((names.buffer_remaining_bytes, join(&remaining)));
        // binx extension: where one page ends and the next begins.
        headers.push(("X-Binx-Page-Sizes", join(&page_sizes)));
        if busy || behind {
            headers.push(("X-Binx-Error", header_text(&header.error)));
        }
        if pages.is_empty() {
            return HttpReply {
                status: 204,
                headers,
                body: Vec::new(),
            };
        }
        headers.push(("Content-Type", names.content_type.to_string()));
        let body = match self.dialect {
            Dialect::Presto => pages,
            Dialect::Trino => {
                let mut body = Vec::with_capacity(pages.len() + 1);
                body.push(trino_body_header(&pages));
                body.extend(pages);
                body
            }
        };
        HttpReply {
            status: 200,
            headers,
            body,
        }
    }
}

/// The headers every 200 and 204 carries (Trino's client refuses a reply
/// without any of them, task-failed included).
fn token_headers(
    dialect: Dialect,
    instance_id: &str,
    token: u64,
    next_token: u64,
    complete: bool,
) -> Vec<(&'static str, String)> {
    let names = dialect.headers();
    vec![
        (names.task_instance_id, instance_id.to_string()),
        (names.page_token, token.to_string()),
        (names.page_next_token, next_token.to_string()),
        (names.buffer_complete, complete.to_string()),
        (names.task_failed, "false".to_string()),
    ]
}

/// A GET or HEAD on a task that was aborted or abandoned, as each engine's
/// client reads a failed task: Trino's from `X-Trino-Task-Failed: true` on a
/// 204 (REMOTE_TASK_FAILED); Presto's client has no such header and fails
/// the query on any status but 200 and 204, so Presto gets 500 with the
/// reason (and the header, for other readers).
fn failed_task_reply(
    dialect: Dialect,
    instance_id: &str,
    token: u64,
    header: &BinReply,
) -> HttpReply {
    let names = dialect.headers();
    let mut reply = match dialect {
        Dialect::Presto => HttpReply::text(500, header.error.clone()),
        Dialect::Trino => HttpReply {
            status: 204,
            headers: token_headers(dialect, instance_id, token, token, false),
            body: Vec::new(),
        },
    };
    reply.headers.retain(|(name, _)| *name != names.task_failed);
    reply.headers.push((names.task_failed, "true".to_string()));
    if dialect == Dialect::Trino {
        // The reason, for logs and curl (Trino's client ignores it).
        reply
            .headers
            .push(("X-Binx-Error", header_text(&header.error)));
    }
    reply
}

/// `error` as a header value: at most 1 KiB, printable ASCII.
fn header_text(error: &str) -> String {
    binx_proto::truncate(error, 1024)
        .chars()
        .map(|c| {
            if c == ' ' || c.is_ascii_graphic() {
                c
            } else {
                '?'
            }
        })
        .collect()
}

/// Parses an airlift DataSize, as Presto and Trino send `X-*-Max-Size`: a
/// number and a unit of B, kB, MB, GB, TB, PB or EB (powers of 1024), e.g. `1MB`, `32kB`, `512B`, `1.5MB`.
pub fn parse_data_size(text: &str) -> Result<u64, String> {
    let (value, unit) = split_number(text)
        .ok_or_else(|| format!("{text:?} is not a data size (e.g. 1MB, 32kB, 512B)"))?;
    let factor: u64 = match unit {
        "B" => 1,
        "kB" => 1 << 10,
        "MB" => 1 << 20,
        "GB" => 1 << 30,
        "TB" => 1 << 40,
        "PB" => 1 << 50,
        "EB" => 1 << 60,
        _ => {
            return Err(format!(
                "{text:?} has the unknown unit {unit:?}; use B, kB, MB, GB, TB, PB or EB"
            ));
        }
    };
    let bytes = value * factor as f64;
    if !(0.0..=u64::MAX as f64).contains(&bytes) {
        return Err(format!("{text:?} is out of range"));
    }
    Ok(bytes as u64)
}

/// Parses a Presto (airlift) Duration: a number and a unit of ns, us, ms, s,
/// m, h or d, e.g. `100ms`, `1.00s`, `2m`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let (value, unit) = split_number(text)
        .ok_or_else(|| format!("{text:?} is not a duration (e.g. 100ms, 1.00s, 2m)"))?;
    let seconds = match unit {
        "ns" => 1e-9,
        "us" => 1e-6,
        "ms" => 1e-3,
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        "d" => 86_400.0,
        _ => {
            return Err(format!(
                "{text:?} has the unknown unit {unit:?}; use ns, us, ms, s, m, h or d"
            ));
        }
    };
    Duration::try_from_secs_f64(value * seconds).map_err(|_| format!("{text:?} is out of range"))
}

/// `"1.5 MB"` -> (1.5, "MB"): a non-negative decimal number, then letters.
fn split_number(text: &str) -> Option<(f64, &str)> {
    let text = text.trim();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let (number, unit) = text.split_at(split);
    if number.is_empty() || number.starts_with('.') || number.ends_with('.') {
        return None;
    }
    let value: f64 = number.parse().ok()?;
    let unit = unit.trim();
    (!unit.is_empty() && unit.chars().all(|c| c.is_ascii_alphabetic())).then_some((value, unit))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_lists_stop_where_the_header_would_pass_its_budget() {
        // "81," per page: 1024 pages are 3071 bytes, one more is too many.
        assert_eq!(sizes_that_fit(vec![81; 5000]), 1024);
        assert_eq!(join(&[81; 1024]).len(), 3071);
        assert_eq!(sizes_that_fit(vec![81; 10]), 10);
        assert_eq!(sizes_that_fit(Vec::new()), 0);
        // One size always goes, however long; a list never passes the budget.
        assert_eq!(sizes_that_fit(vec![u64::MAX; 3]), 3);
        for sizes in [
            vec![0; 2000],
            vec![9; 2000],
            vec![10; 2000],
            vec![16 << 20; 2000],
        ] {
            let n = sizes_that_fit(sizes.iter().copied());
            assert!(join(&sizes[..n]).len() <= MAX_SIZES_HEADER_BYTES);
            assert!(join(&sizes[..n + 1]).len() > MAX_SIZES_HEADER_BYTES);
        }
    }

    #[test]
    fn presto_data_sizes_and_durations() {
        assert_eq!(parse_data_size("1MB"), Ok(1 << 20));
        assert_eq!(parse_data_size("32kB"), Ok(32 << 10));
        assert_eq!(parse_data_size("512B"), Ok(512));
        assert_eq!(parse_data_size("1.5MB"), Ok(3 << 19));
        assert!(parse_data_size("1mb").unwrap_err().contains("unknown unit"));
        assert!(parse_data_size("MB").is_err());
        assert!(parse_data_size("-1MB").is_err());
        assert!(parse_data_size("1.MB").is_err());
        assert_eq!(parse_duration("100ms"), Ok(Duration::from_millis(100)));
        assert_eq!(parse_duration("1.00s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("10").is_err());
        assert!(parse_duration("1e9s").is_err());
    }

    #[test]
    fn trino_body_header_matches_the_documented_vector() {
        // docs/PROTOCOL.md section 7: one page "abc".
        let pages = [Bytes::from_static(b"abc")];
        assert_eq!(trino_checksum(&pages), 0x44bc_2cf5_ad77_0999);
        assert_eq!(
            trino_body_header(&pages).as_ref(),
            [
                0x01, 0xf0, 0xa4, 0xfe, 0x99, 0x09, 0x77, 0xad, 0xf5, 0x2c, 0xbc, 0x44, 1, 0, 0, 0
            ]
        );
        // XXH64 of nothing, the well-known value.
        assert_eq!(trino_checksum(&[]), 0xef46_db37_51d8_e999);
    }

    #[test]
    fn trino_checksum_covers_the_pages_as_one_stream_in_order() {
        let whole = trino_checksum(&[Bytes::from_static(b"page one|page two")]);
        let split = [
            Bytes::from_static(b"page one|"),
            Bytes::from_static(b"page two"),
        ];
        assert_eq!(trino_checksum(&split), whole);
        let swapped = [split[1].clone(), split[0].clone()];
        assert_ne!(trino_checksum(&swapped), whole);
    }

    #[test]
    fn the_dialect_follows_the_headers_the_client_sends() {
        assert_eq!(
            Dialect::of(["x-trino-max-size"].into_iter()),
            Dialect::Trino
        );
        assert_eq!(
            Dialect::of(["host", "X-Trino-Internal-Bearer"].into_iter()),
            Dialect::Trino
        );
        assert_eq!(
            Dialect::of(["x-presto-max-size", "host"].into_iter()),
            Dialect::Presto
        );
        assert_eq!(Dialect::of(["x-trino"].into_iter()), Dialect::Presto);
        assert_eq!(Dialect::of(std::iter::empty()), Dialect::Presto);
    }

    #[test]
    fn without_a_max_wait_header_a_get_waits_as_the_engines_servers_do() {
        for _ in 0..1000 {
            let wait = engine_default_wait();
            assert!((Duration::from_secs(1)..Duration::from_secs(2)).contains(&wait));
        }
        let request = HttpRequest {
            method: "GET",
            path: "/v1/task/t1/results/0/0",
            dialect: Dialect::Trino,
            max_size: Some("12582912B"),
            max_wait: None,
            default_wait: Duration::from_millis(1500),
        };
        let Ok(ExchangeRequest::Results { request, .. }) = parse(&request) else {
            panic!("a Trino GET parses");
        };
        let Op::Data(query) = request.op else {
            panic!("a GET is a DATA");
        };
        assert_eq!(query.max_wait, Duration::from_millis(1500));
        assert_eq!(query.max_size, 12_582_912);
    }

    #[test]
    fn paths_route_or_say_what_is_expected() {
        assert!(matches!(
            route("/v1/task/t1/results/3/17"),
            Ok(Route::Results {
                task: "t1",
                buffer: 3,
                token: 17
            })
        ));
        assert!(matches!(
            route("/v1/task/t1/results/3/17/acknowledge"),
            Ok(Route::Acknowledge {
                buffer: 3,
                token: 17,
                ..
            })
        ));
        assert!(matches!(
            route("/v1/task/t1/results/3"),
            Ok(Route::Buffer { buffer: 3, .. })
        ));
        assert!(
            route("/v1/task/t1/results/x/1")
                .unwrap_err()
                .contains("buffer id \"x\"")
        );
        assert!(
            route("/v1/task/t1/status")
                .unwrap_err()
                .contains("expected /v1/task/")
        );
        assert!(route("/v1/task/t1/results/1/2/3/4").is_err());
    }
}
