//! The Presto-compatible HTTP exchange, over the same buffer manager as BinX,
//! so one buffer can be read by either protocol:
//!
//! - `GET  /v1/task/{task}/results/{buffer}/{token}`: pages from `token`
//!   (`X-Presto-Max-Size`, `X-Presto-Max-Wait`); 200 with the pages
//!   concatenated, or 204 without a body;
//! - `HEAD` on the same path: only the sizes of the pages available;
//! - `GET  /v1/task/{task}/results/{buffer}/{token}/acknowledge`;
//! - `DELETE /v1/task/{task}/results/{buffer}`.
//!
//! This module knows no HTTP library: it maps a method, a path and two
//! header values to a status, headers and body pieces; binxd serves it with
//! hyper.

use std::time::Duration;

use binx_core::{BufferKey, DataQuery, Encodings, Op, Payload, Request, TaskId};
use binx_proto::{BinReply, Status};
use bytes::Bytes;

use crate::exchange::Exchange;

/// Media type of a page body, as Presto names it.
pub const PAGES_CONTENT_TYPE: &str = "application/X-presto-pages";

/// What to answer.
#[derive(Debug)]
pub struct HttpReply {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    /// Body pieces, sent in order (pages are not copied).
    pub body: Vec<Bytes>,
}

impl HttpReply {
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
    pub method: &'a str,
    pub path: &'a str,
    /// `X-Presto-Max-Size`, if sent.
    pub max_size: Option<&'a str>,
    /// `X-Presto-Max-Wait`, if sent.
    pub max_wait: Option<&'a str>,
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
        task: &'a str,
        buffer: u64,
        head: bool,
        request: Request,
    },
    Acknowledge(Request),
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
            let max_size = request
                .max_size
                .map(parse_data_size)
                .transpose()
                .map_err(|e| HttpReply::text(400, format!("X-Presto-Max-Size: {e}")))?
                .unwrap_or(0);
            let max_wait = request
                .max_wait
                .map(parse_duration)
                .transpose()
                .map_err(|e| HttpReply::text(400, format!("X-Presto-Max-Wait: {e}")))?
                .unwrap_or(Duration::ZERO);
            let key = buffer_key(task, buffer)?;
            Ok(ExchangeRequest::Results {
                task,
                buffer,
                head: method == "HEAD",
                request: typed(Op::Data(DataQuery {
                    key,
                    token,
                    sizes_only: method == "HEAD",
                    max_size,
                    max_wait,
                    accept_spooled: false,
                    encodings: Encodings::default(),
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
    match parse(&request) {
        Err(reply) => reply,
        Ok(ExchangeRequest::Results {
            task,
            buffer,
            head,
            request,
        }) => {
            let reply = exchange.handle(request, Payload::empty()).await;
            results_reply(
                exchange,
                instance_id,
                task,
                buffer,
                reply.header,
                reply.body,
                head,
            )
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

fn results_reply(
    exchange: &Exchange,
    instance_id: &str,
    task: &str,
    buffer: u64,
    header: BinReply,
    pages: Vec<Bytes>,
    head: bool,
) -> HttpReply {
    if !matches!(header.status_kind(), Status::Ok | Status::NoData) {
        return refusal(&header);
    }
    let page_sizes: Vec<u64> = pages.iter().map(|p| p.len() as u64).collect();
    // HEAD reports the sizes from the token; GET what remains after its pages.
    let remaining = if head {
        header.remaining_bytes.clone()
    } else {
        exchange.peek_sizes(task, buffer, header.page_next_token)
    };
    let headers = vec![
        ("Content-Type", PAGES_CONTENT_TYPE.to_string()),
        ("X-Presto-Task-Instance-Id", instance_id.to_string()),
        ("X-Presto-Page-Sequence-Id", header.page_token.to_string()),
        (
            "X-Presto-Page-End-Sequence-Id",
            header.page_next_token.to_string(),
        ),
        (
            "X-Presto-Buffer-Complete",
            header.buffer_complete.to_string(),
        ),
        ("X-Presto-Buffer-Remaining-Bytes", join(&remaining)),
        // binx extension: where one page ends and the next begins.
        ("X-Binx-Page-Sizes", join(&page_sizes)),
    ];
    HttpReply {
        status: if pages.is_empty() { 204 } else { 200 },
        headers,
        body: pages,
    }
}

/// Parses a Presto (airlift) DataSize: a number and a unit of B, kB, MB, GB,
/// TB or PB (powers of 1024), e.g. `1MB`, `32kB`, `512B`, `1.5MB`.
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
        _ => {
            return Err(format!(
                "{text:?} has the unknown unit {unit:?}; use B, kB, MB, GB, TB or PB"
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
