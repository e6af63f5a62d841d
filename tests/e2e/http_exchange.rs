//! The Presto-compatible HTTP exchange against the same buffers as BinX.

use binx_proto::{BinRequest, MessageType, Status};
use bytes::Bytes;

use crate::common::{Daemon, http_request, metric, rng};

fn pages(seed: u64, count: usize) -> Vec<Bytes> {
    let mut rng = rng(seed);
    (0..count)
        .map(|_| {
            let mut p = vec![0u8; rng.usize(0..5000)];
            rng.fill(&mut p);
            Bytes::from(p)
        })
        .collect()
}

fn binx_data(task: &str, buffer: u64, token: u64, sizes_only: bool) -> BinRequest {
    let mut r = BinRequest::new(MessageType::Data);
    r.task_id = task.into();
    r.buffer_id = buffer;
    r.page_token = token;
    r.max_size_bytes = 1;
    r.get_data_size = sizes_only;
    r
}

fn results(task: &str, buffer: u64, token: u64) -> String {
    format!("/v1/task/{task}/results/{buffer}/{token}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_and_binx_read_one_buffer_and_agree_on_every_page_and_token() {
    let daemon = Daemon::start(&[]);
    let producer = daemon.producer("mixed", 2).await;
    let sent = pages(9, 24);
    producer.enqueue("mixed", 0, &sent).await.unwrap();
    producer.no_more_pages("mixed", None).await.unwrap();
    let binx = daemon.connect_tcp();
    let http = daemon.http.clone();

    for token in 0..sent.len() as u64 {
        // Before reading: the sizes HEAD reports are those get_data_size reports.
        if token % 4 == 0 {
            let head = http_request(&http, "HEAD", &results("mixed", 0, token), &[]);
            let sizes = binx
                .request(binx_data("mixed", 0, token, true), Vec::new())
                .await
                .unwrap();
            let listed: Vec<String> = sizes
                .header
                .remaining_bytes
                .iter()
                .map(u64::to_string)
                .collect();
            assert_eq!(
                head.header("X-Presto-Buffer-Remaining-Bytes"),
                listed.join(","),
                "token {token}"
            );
            assert_eq!(
                sizes.header.remaining_bytes.len() as u64,
                sent.len() as u64 - token
            );
        }
        let page = &sent[token as usize];
        let last = token + 1 == sent.len() as u64;
        if token % 2 == 0 {
            let r = http_request(
                &http,
                "GET",
                &results("mixed", 0, token),
                &[("X-Presto-Max-Size", "1B")],
            );
            assert_eq!(r.status, 200, "token {token}");
            assert_eq!(r.header("Content-Type"), "application/X-presto-pages");
            assert_eq!(r.header("X-Presto-Page-Sequence-Id"), token.to_string());
            assert_eq!(
                r.header("X-Presto-Page-End-Sequence-Id"),
                (token + 1).to_string()
            );
            assert_eq!(r.header("X-Presto-Buffer-Complete"), last.to_string());
            assert_eq!(r.header("X-Binx-Page-Sizes"), page.len().to_string());
            assert_eq!(&r.body[..], &page[..], "page {token} over HTTP");
        } else {
            let r = binx
                .request(binx_data("mixed", 0, token, false), Vec::new())
                .await
                .unwrap();
            assert_eq!(
                (r.header.page_token, r.header.page_next_token),
                (token, token + 1)
            );
            assert_eq!(r.header.buffer_complete, last);
            assert_eq!(&r.body[..], &page[..], "page {token} over BinX");
        }
    }
    // At the end token: 204, complete; the task instance id is stable.
    let end = http_request(&http, "GET", &results("mixed", 0, sent.len() as u64), &[]);
    assert_eq!(end.status, 204);
    assert_eq!(end.header("X-Presto-Buffer-Complete"), "true");
    assert!(end.body.is_empty());
    let again = http_request(&http, "GET", &results("mixed", 0, sent.len() as u64), &[]);
    assert_eq!(
        again.header("X-Presto-Task-Instance-Id"),
        end.header("X-Presto-Task-Instance-Id")
    );

    // A buffer with nothing yet: 204 after the wait, not complete.
    let empty = http_request(
        &http,
        "GET",
        &results("later", 0, 0),
        &[("X-Presto-Max-Wait", "200ms")],
    );
    assert_eq!(empty.status, 204);
    assert_eq!(empty.header("X-Presto-Buffer-Complete"), "false");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledge_and_delete_over_http_free_memory() {
    let daemon = Daemon::start(&[]);
    let producer = daemon.producer("free", 1).await;
    let sent = pages(4, 10);
    let total: u64 = sent.iter().map(|p| p.len() as u64).sum();
    producer.enqueue("free", 0, &sent).await.unwrap();
    producer.no_more_pages("free", None).await.unwrap();
    assert_eq!(metric(&daemon, "binx_memory_pages_bytes"), total);
    assert!(metric(&daemon, "binx_memory_used_bytes") >= total);

    let r = http_request(
        &daemon.http,
        "GET",
        &results("free", 0, 0),
        &[("X-Presto-Max-Size", "1MB"), ("X-Presto-Max-Wait", "1.00s")],
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.body, sent.concat());
    assert_eq!(r.header("X-Presto-Page-End-Sequence-Id"), "10");
    assert_eq!(r.header("X-Presto-Buffer-Remaining-Bytes"), "");
    assert_eq!(
        metric(&daemon, "binx_memory_pages_bytes"),
        total,
        "reading alone frees nothing"
    );

    let ack = http_request(
        &daemon.http,
        "GET",
        "/v1/task/free/results/0/6/acknowledge",
        &[],
    );
    assert_eq!(ack.status, 204);
    let left: u64 = sent[6..].iter().map(|p| p.len() as u64).sum();
    assert_eq!(metric(&daemon, "binx_memory_pages_bytes"), left);

    let delete = http_request(&daemon.http, "DELETE", "/v1/task/free/results/0", &[]);
    assert_eq!(delete.status, 204);
    assert_eq!(metric(&daemon, "binx_memory_used_bytes"), 0);
    assert_eq!(metric(&daemon, "binx_tasks"), 0);
    assert!(metric(&daemon, "binx_served_bytes_total") >= total);
}

/// A GET or HEAD below the acknowledged mark (a repeated or late request of
/// a client that moved on) gets what Presto's and Trino's own servers give
/// it: nothing, at its token, not complete; never an error that fails the
/// query. BinX's DATA refuses it, as the contract says; nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_below_the_acknowledged_mark_is_answered_empty_as_the_engines_do() {
    let daemon = Daemon::start(&[]);
    let sent = pages(7, 4);
    for (prefix, task) in [("X-Presto-", "behind-p"), ("X-Trino-", "behind-t")] {
        let producer = daemon.producer(task, 1).await;
        producer.enqueue(task, 0, &sent).await.unwrap();
        let h = |name: &str| format!("{prefix}{name}");
        let (max_size, max_wait) = (h("Max-Size"), h("Max-Wait"));
        let asks = [(max_size.as_str(), "1MB"), (max_wait.as_str(), "300ms")];
        // Trino's body starts with a 16-byte header; Presto's is the pages.
        let pages_of = |body: &[u8]| body[if prefix == "X-Trino-" { 16 } else { 0 }..].to_vec();
        let first = http_request(&daemon.http, "GET", &results(task, 0, 0), &asks);
        assert_eq!(first.status, 200, "{prefix}");
        assert_eq!(pages_of(&first.body), sent.concat(), "{prefix}");
        let ack = http_request(
            &daemon.http,
            "GET",
            &format!("{}/acknowledge", results(task, 0, 2)),
            &[],
        );
        assert_eq!(ack.status, 204, "{prefix}");
        let stale_is_empty = |method: &str, token: u64| {
            let asked = std::time::Instant::now();
            let stale = http_request(&daemon.http, method, &results(task, 0, token), &asks);
            let what = format!("{prefix}: {method} at {token}");
            // After the request's wait, as for an empty buffer: a client
            // stuck below the mark polls, never spins.
            assert!(
                asked.elapsed() >= std::time::Duration::from_millis(300),
                "{what}"
            );
            let body = String::from_utf8_lossy(&stale.body).to_string();
            assert_eq!(stale.status, 204, "{what}: {body:?}");
            assert!(stale.body.is_empty(), "{what}");
            assert_eq!(
                stale.header(&h("Page-Sequence-Id")),
                token.to_string(),
                "{what}"
            );
            assert_eq!(
                stale.header(&h("Page-End-Sequence-Id")),
                token.to_string(),
                "{what}"
            );
            assert_eq!(stale.header(&h("Buffer-Complete")), "false", "{what}");
            assert_eq!(stale.header(&h("Task-Failed")), "false", "{what}");
            let why = stale.header("X-Binx-Error");
            assert!(
                why.contains("below its acknowledged mark 2"),
                "{what}: {why:?}"
            );
        };
        for (method, token) in [("GET", 0), ("GET", 1), ("HEAD", 1)] {
            stale_is_empty(method, token);
        }
        // Every page from the mark is still there.
        let again = http_request(&daemon.http, "GET", &results(task, 0, 2), &asks);
        assert_eq!(again.status, 200, "{prefix}");
        assert_eq!(again.header(&h("Page-End-Sequence-Id")), "4", "{prefix}");
        assert_eq!(pages_of(&again.body), sent[2..].concat(), "{prefix}");
        // Over BinX, a DATA below the mark is refused (the contract).
        let binx = daemon.connect_tcp();
        let reply = binx
            .call(binx_data(task, 0, 1, false), Vec::new())
            .await
            .unwrap();
        assert_eq!(reply.header.status_kind(), Status::BadRequest, "{prefix}");
        assert!(reply.header.error.contains("below its acknowledged mark 2"));
        // Finished and read to its end (mark 4 now): completion is told at
        // the reader's token only, as the engines do.
        producer.no_more_pages(task, None).await.unwrap();
        let end = http_request(&daemon.http, "GET", &results(task, 0, 4), &asks);
        assert_eq!(end.status, 204, "{prefix}");
        assert_eq!(end.header(&h("Buffer-Complete")), "true", "{prefix}");
        let stale = http_request(&daemon.http, "GET", &results(task, 0, 1), &asks);
        assert_eq!(stale.status, 204, "{prefix}");
        assert_eq!(stale.header(&h("Buffer-Complete")), "false", "{prefix}");
        assert!(
            stale
                .header("X-Binx-Error")
                .contains("below its acknowledged mark 4")
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_mistakes_get_clear_4xx_never_5xx() {
    let daemon = Daemon::start(&[]);
    let producer = daemon.producer("t", 2).await;
    producer
        .enqueue("t", 0, &[Bytes::from_static(b"x")])
        .await
        .unwrap();
    // (method, path, headers, expected status, text the body must contain)
    type Case<'a> = (&'a str, String, Vec<(&'a str, &'a str)>, u16, &'a str);
    let cases: Vec<Case> = vec![
        (
            "GET",
            "/v1/task/t/status".into(),
            vec![],
            404,
            "expected /v1/task/",
        ),
        (
            "GET",
            "/v1/task/t/results/x/0".into(),
            vec![],
            404,
            "buffer id \"x\"",
        ),
        (
            "GET",
            results("t", 0, 0),
            vec![("X-Presto-Max-Size", "lots")],
            400,
            "not a data size",
        ),
        (
            "GET",
            results("t", 0, 0),
            vec![("X-Presto-Max-Wait", "1 fortnight")],
            400,
            "unknown unit",
        ),
        (
            "GET",
            results("t", 5, 0),
            vec![],
            400,
            "at or above the buffer_count 2",
        ),
        (
            "GET",
            results("t", 0, 9),
            vec![],
            400,
            "beyond the next token",
        ),
        ("GET", results("bad/id", 0, 0), vec![], 404, "no such path"),
        ("GET", results("bad%20id", 0, 0), vec![], 400, "task_id"),
        ("POST", results("t", 0, 0), vec![], 405, "use GET or HEAD"),
        (
            "GET",
            "/v1/task/t/results/0".into(),
            vec![],
            405,
            "use DELETE",
        ),
        (
            "GET",
            "/v1/task/t/results/0/1/acknowledge".into(),
            vec![],
            204,
            "",
        ),
        (
            "GET",
            "/v1/task/t/results/0/7/acknowledge".into(),
            vec![],
            400,
            "beyond the next token",
        ),
    ];
    for (method, path, headers, status, text) in cases {
        let r = http_request(&daemon.http, method, &path, &headers);
        let body = String::from_utf8_lossy(&r.body);
        assert_eq!(r.status, status, "{method} {path}: {body}");
        assert!(
            body.contains(text),
            "{method} {path}: {body:?} lacks {text:?}"
        );
        if status >= 400 {
            assert!(!body.trim().is_empty(), "{method} {path}: empty error");
        }
    }
    // An aborted task is the server's failure, reported with its reason.
    producer.abort("t", "worker lost").await.unwrap();
    let r = http_request(&daemon.http, "GET", &results("t", 0, 0), &[]);
    assert_eq!(r.status, 500);
    assert!(String::from_utf8_lossy(&r.body).contains("worker lost"));
    let binx = daemon.connect_tcp();
    let reply = binx
        .call(binx_data("t", 0, 0, false), Vec::new())
        .await
        .unwrap();
    assert_eq!(reply.header.status_kind(), Status::ServerError);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_reads_a_buffer_as_the_readme_shows() {
    let daemon = Daemon::start(&[]);
    let producer = daemon.producer("curl", 1).await;
    producer
        .enqueue(
            "curl",
            0,
            &[Bytes::from_static(b"hello "), Bytes::from_static(b"curl")],
        )
        .await
        .unwrap();
    producer.no_more_pages("curl", None).await.unwrap();
    let url = format!("http://{}/v1/task/curl/results/0/0", daemon.http);
    let out = std::process::Command::new("curl")
        .args(["-sS", "-D", "-", "-H", "X-Presto-Max-Size: 1MB", &url])
        .output()
        .expect("curl is installed (.ci/run installs it)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(
        text.to_ascii_lowercase()
            .contains("x-presto-buffer-complete: true"),
        "{text}"
    );
    assert!(text.ends_with("hello curl"), "{text}");
}
