//! Reading a spooled segment named in a DATA reply: GET its URL, check its
//! size, decrypt and decode it (docs/PROTOCOL.md section 4, "Spooling"), and check that it
//! holds the pages the reply promised.

use std::time::Duration;

use binx_proto::{BinRequest, Segment, Spooled};
use binx_segment::{SegmentLimits, decode_segment_shared};
use bytes::Bytes;

use crate::connection::describe;
use crate::error::ClientError;

/// Largest spooled object this client fetches.
const MAX_OBJECT_BYTES: u64 = 1 << 30;

pub(crate) fn http_client() -> reqwest::Client {
    // reqwest's rustls needs a process-wide crypto provider (once).
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap_or_else(|_| reqwest::Client::new())
}

/// A URI fit for errors and logs: no query string (a presigned URL's
/// signature lets anyone read the object).
pub(crate) fn redact(uri: &str) -> String {
    match uri.split_once('?') {
        Some((base, _)) => format!("{base}?(signature hidden)"),
        None => uri.to_string(),
    }
}

/// Fetches and decodes one spooled segment; returns its pages.
pub(crate) async fn fetch(
    http: &reqwest::Client,
    request: &BinRequest,
    segment: &Segment,
    spooled: &Spooled,
) -> Result<Vec<Bytes>, ClientError> {
    let uri = redact(&spooled.uri);
    let fail = |detail: String| ClientError::Spooled {
        request: describe(request),
        uri: uri.clone(),
        detail,
    };
    if spooled.stored_size > MAX_OBJECT_BYTES {
        return Err(fail(format!(
            "stored_size {} is above the {MAX_OBJECT_BYTES}-byte limit",
            spooled.stored_size
        )));
    }
    let key: Option<[u8; 32]> = match spooled.key.len() {
        0 => None,
        32 => {
            let mut k = [0u8; 32];
            k.copy_from_slice(&spooled.key);
            Some(k)
        }
        n => return Err(fail(format!("key is {n} bytes; AES-256-GCM needs 32"))),
    };
    let data = get(http, spooled).await.map_err(&fail)?;
    if data.len() as u64 != spooled.stored_size {
        return Err(fail(format!(
            "object is {} bytes, the reply said {}",
            data.len(),
            spooled.stored_size
        )));
    }
    let name = uri.clone();
    // No more than the pages promised are decoded: a compressed object
    // whose header claims a gigabyte is refused before it is inflated.
    let limits = SegmentLimits {
        max_pages: u32::try_from(segment.page_sizes.len()).unwrap_or(u32::MAX),
        max_body_bytes: segment
            .page_sizes
            .iter()
            .fold(0u64, |sum, &size| sum.saturating_add(size)),
    };
    let decoded = tokio::task::spawn_blocking(move || {
        decode_segment_shared(&name, data, key.as_ref(), limits)
    })
    .await
    .map_err(|e| fail(format!("decoder failed: {e}")))?;
    let (first_token, pages) = decoded.map_err(|e| fail(e.to_string()))?;
    let sizes: Vec<u64> = pages.iter().map(|p| p.len() as u64).collect();
    if first_token != segment.first_token || sizes != segment.page_sizes {
        return Err(fail(format!(
            "object holds {} pages from token {first_token}; the reply promised {} from token {}",
            sizes.len(),
            segment.page_sizes.len(),
            segment.first_token
        )));
    }
    Ok(pages)
}

async fn get(http: &reqwest::Client, spooled: &Spooled) -> Result<Bytes, String> {
    // A remote names the URI: reading a file:// (or any other scheme) it
    // names would let it make this process read its own files. binxd hands
    // out only presigned http(s) URLs; other stores are served inline.
    if !(spooled.uri.starts_with("http://") || spooled.uri.starts_with("https://")) {
        let scheme = spooled.uri.split(':').next().unwrap_or_default();
        return Err(format!(
            "this client reads only presigned http(s):// segment URLs, not {:?} URIs a remote names",
            binx_proto::truncate(scheme, 16)
        ));
    }
    let mut get = http.get(&spooled.uri);
    for (name, value) in &spooled.headers {
        get = get.header(name, value);
    }
    let mut response = get.send().await.map_err(|e| format!("GET failed: {e}"))?;
    let status = response.status();
    if !status.is_success() {
        return Err(format!("GET answered {status}"));
    }
    // Never more than the reply said the object is: checked on the
    // declared length first, then on what actually arrives.
    let expected = spooled.stored_size;
    if let Some(length) = response.content_length()
        && length != expected
    {
        return Err(format!(
            "GET announced {length} bytes, the reply said {expected}"
        ));
    }
    // Room grows as bytes arrive: a remote's stored_size alone reserves at
    // most 16 MiB.
    let mut body =
        bytes::BytesMut::with_capacity(usize::try_from(expected.min(16 << 20)).unwrap_or(0));
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| format!("GET body failed: {e}"))?
    {
        if body.len() as u64 + chunk.len() as u64 > expected {
            return Err(format!(
                "GET body is longer than the {expected} bytes the reply said; stopped reading"
            ));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spooled(uri: &str) -> Spooled {
        Spooled {
            uri: uri.into(),
            stored_size: 10,
            ..Spooled::default()
        }
    }

    /// A one-shot HTTP server on loopback that answers any request with
    /// `response`; its URL.
    async fn serve_once(response: Vec<u8>) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            if let Ok((mut stream, _)) = listener.accept().await {
                let mut head = [0u8; 4096];
                let _ = stream.read(&mut head).await;
                let _ = stream.write_all(&response).await;
                let _ = stream.shutdown().await;
            }
        });
        format!("http://{addr}/segment")
    }

    #[tokio::test]
    async fn a_body_longer_than_stored_size_is_refused_while_it_arrives() {
        let http = http_client();
        // No Content-Length: the body runs until the server closes.
        let mut response = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n".to_vec();
        response.extend(vec![b'x'; 1 << 20]);
        let url = serve_once(response).await;
        let err = get(&http, &spooled(&url)).await.unwrap_err();
        assert!(err.contains("longer than the 10 bytes"), "{err}");
        // A declared length other than stored_size is refused before the body.
        let url =
            serve_once(b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\nxxxxxxxxxxx".to_vec()).await;
        let err = get(&http, &spooled(&url)).await.unwrap_err();
        assert!(err.contains("announced 11 bytes"), "{err}");
        // The exact size is read.
        let url =
            serve_once(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n0123456789".to_vec()).await;
        assert_eq!(
            &get(&http, &spooled(&url)).await.unwrap()[..],
            b"0123456789"
        );
    }

    #[tokio::test]
    async fn uris_other_than_http_are_never_read() {
        let http = http_client();
        for uri in [
            "file:///etc/passwd",
            "s3://bucket/x",
            "gopher://x",
            "/etc/passwd",
        ] {
            let err = get(&http, &spooled(uri)).await.unwrap_err();
            assert!(err.contains("only presigned http(s)"), "{uri}: {err}");
        }
    }
}
