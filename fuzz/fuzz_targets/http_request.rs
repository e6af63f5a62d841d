//! Feeds arbitrary requests to the HTTP exchange's door: the path, method
//! and Presto or Trino headers parser (`presto::parse`, airlift units included) and
//! the internal bearer check. Each must answer or refuse, never panic, and a
//! request it accepts must be one the core can take as it is.

#![no_main]

use binx_server::internal_auth::{InternalAuth, MAX_TOKEN_LEN, derived_keys, sign_token};
use binx_server::http::presto::{Dialect, ExchangeRequest, HttpRequest, parse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    // Fields separated by newlines: method, path, max size, max wait, token.
    let mut fields = text.split('\n');
    let method = fields.next().unwrap_or("GET");
    let path = fields.next().unwrap_or("");
    let max_size = fields.next();
    let max_wait = fields.next();
    let token = fields.next().unwrap_or("");
    // The rest: header names, which pick the dialect.
    let dialect = Dialect::of(fields);
    let request = HttpRequest {
        method,
        path,
        dialect,
        max_size,
        max_wait,
        default_wait: std::time::Duration::from_secs(1),
    };
    match parse(&request) {
        Ok(ExchangeRequest::Results { task, request, .. }) => {
            assert!(!task.is_empty() && task.len() <= binx_core::MAX_TASK_ID_LEN);
            assert!(path.starts_with("/v1/task/"));
            assert_eq!(request.kind(), binx_proto::MessageType::Data);
        }
        Ok(ExchangeRequest::Acknowledge(_) | ExchangeRequest::Delete(_)) => {
            assert!(path.starts_with("/v1/task/"));
        }
        Err(reply) => assert!(reply.status >= 400),
    }
    let auth = InternalAuth::from_secret("fuzz secret");
    let now = 1_800_000_000;
    let _ = auth.check(token, now);
    // Any subject signs and checks (unless the token grows past the length
    // binxd looks at: refused, never read); a changed signature never does.
    let [key, _] = derived_keys("fuzz secret");
    let good = sign_token(&key, token, now + 60);
    if good.len() <= MAX_TOKEN_LEN {
        assert_eq!(auth.check(&good, now), Ok(()));
    } else {
        assert!(auth.check(&good, now).is_err());
    }
    let (signed, signature) = good.rsplit_once('.').expect("three parts");
    let first = if signature.starts_with('A') { 'B' } else { 'A' };
    let forged = format!("{signed}.{first}{}", &signature[1..]);
    assert!(auth.check(&forged, now).is_err());
});
