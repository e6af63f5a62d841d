//! Internal authentication of the HTTP exchange (PROTOCOL.md section 9):
//! with a shared secret set, a request under `/v1/task/` must carry
//! `X-Presto-Internal-Bearer` or `X-Trino-Internal-Bearer`, a JWT signed
//! HS256 that has not expired. That is what Presto and Trino workers
//! configured with `internal-communication.shared-secret` send, so they talk
//! to binxd unchanged. The engines derive the HMAC key from the secret in
//! one of two ways, and both are accepted:
//!
//! - SHA-256 of the secret's UTF-8 bytes (Presto; Trino up to 479);
//! - HKDF-SHA256 of those bytes, no salt, info `internal-communication`,
//!   32 bytes (Trino 480 and later).

use std::fmt;

use base64::Engine as _;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use ring::{digest, hkdf, hmac};
use thiserror::Error;

/// The headers that carry the token, in the order they are looked at.
pub const BEARER_HEADERS: [&str; 2] = ["X-Presto-Internal-Bearer", "X-Trino-Internal-Bearer"];

/// Longest token looked at; the engines' are a few hundred bytes.
pub const MAX_TOKEN_LEN: usize = 8192;

/// HKDF `info` of Trino 480 and later.
const HKDF_INFO: &[u8] = b"internal-communication";

/// Base64url, with or without padding (jjwt writes none).
const B64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::URL_SAFE,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// Why a request was not authenticated; the text goes in the 401 body.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum AuthError {
    #[error(
        "this binxd requires internal authentication: send X-Presto-Internal-Bearer or X-Trino-Internal-Bearer, a JWT signed with the cluster's shared secret (internal-communication.shared-secret)"
    )]
    Missing,
    #[error("the internal bearer token is not a JWT: {0}")]
    Malformed(&'static str),
    #[error("the internal bearer token is signed with {0:?}; only HS256 is accepted")]
    Algorithm(String),
    #[error(
        "the internal bearer token's signature does not match this binxd's shared secret (with either the SHA-256 or the HKDF key)"
    )]
    Signature,
    #[error("the internal bearer token has no expiry (exp)")]
    NoExpiry,
    #[error("the internal bearer token expired at {exp} (unix seconds); it is now {now}")]
    Expired { exp: u64, now: u64 },
}

/// The keys a shared secret gives, for checking bearer tokens.
#[derive(Clone)]
pub struct InternalAuth {
    keys: [hmac::Key; 2],
}

impl fmt::Debug for InternalAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("InternalAuth(keys hidden)")
    }
}

/// Whether a secret someone sent equals ours, in time that does not depend
/// on where they differ (HELLO's auth_token, the admin bearer token).
pub fn secret_matches(given: &[u8], ours: &[u8]) -> bool {
    use subtle::ConstantTimeEq as _;
    bool::from(given.ct_eq(ours))
}

/// The two 32-byte HMAC keys an engine may derive from `secret`:
/// `[sha256, hkdf]`.
pub fn derived_keys(secret: &str) -> [[u8; 32]; 2] {
    let mut sha = [0u8; 32];
    sha.copy_from_slice(digest::digest(&digest::SHA256, secret.as_bytes()).as_ref());
    let mut okm = [0u8; 32];
    // An empty salt is HKDF's "no salt": HMAC pads both to the same key.
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, &[]).extract(secret.as_bytes());
    if let Ok(expanded) = prk.expand(&[HKDF_INFO], hkdf::HKDF_SHA256) {
        let _ = expanded.fill(&mut okm);
    }
    [sha, okm]
}

#[derive(serde::Deserialize)]
struct JwtHeader {
    alg: String,
}

#[derive(serde::Deserialize)]
struct JwtClaims {
    exp: Option<serde_json::Number>,
}

impl InternalAuth {
    pub fn from_secret(secret: &str) -> Self {
        let [sha, hkdf] = derived_keys(secret);
        InternalAuth {
            keys: [
                hmac::Key::new(hmac::HMAC_SHA256, &sha),
                hmac::Key::new(hmac::HMAC_SHA256, &hkdf),
            ],
        }
    }

    /// Checks the first bearer header `header` finds, at `now_unix` seconds.
    pub fn check_headers<'a>(
        &self,
        header: impl Fn(&str) -> Option<&'a str>,
        now_unix: u64,
    ) -> Result<(), AuthError> {
        let token = BEARER_HEADERS
            .iter()
            .find_map(|name| header(name))
            .ok_or(AuthError::Missing)?;
        self.check(token, now_unix)
    }

    /// Checks one token: HS256, a signature by either key, not expired.
    pub fn check(&self, token: &str, now_unix: u64) -> Result<(), AuthError> {
        let token = token.trim();
        let token = token.strip_prefix("Bearer ").unwrap_or(token);
        if token.len() > MAX_TOKEN_LEN {
            return Err(AuthError::Malformed("longer than 8 KiB"));
        }
        let mut parts = token.split('.');
        let (Some(header), Some(claims), Some(signature), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(AuthError::Malformed("not three dot-separated parts"));
        };
        let decode = |part: &str, what: &'static str| {
            B64.decode(part).map_err(|_| AuthError::Malformed(what))
        };
        let header_json = decode(header, "the header is not base64url")?;
        let header_fields: JwtHeader = serde_json::from_slice(&header_json)
            .map_err(|_| AuthError::Malformed("the header is not a JSON object with alg"))?;
        if header_fields.alg != "HS256" {
            return Err(AuthError::Algorithm(
                binx_proto::truncate(&header_fields.alg, 32).to_string(),
            ));
        }
        let signature = decode(signature, "the signature is not base64url")?;
        let signed = &token.as_bytes()[..header.len() + 1 + claims.len()];
        if !self
            .keys
            .iter()
            .any(|key| hmac::verify(key, signed, &signature).is_ok())
        {
            return Err(AuthError::Signature);
        }
        // Only a signed token's claims are parsed.
        let claims: JwtClaims =
            serde_json::from_slice(&decode(claims, "the claims are not base64url")?)
                .map_err(|_| AuthError::Malformed("the claims are not a JSON object"))?;
        let exp = claims
            .exp
            .and_then(|n| n.as_u64().or_else(|| n.as_f64().map(|f| f.max(0.0) as u64)))
            .ok_or(AuthError::NoExpiry)?;
        if exp <= now_unix {
            return Err(AuthError::Expired { exp, now: now_unix });
        }
        Ok(())
    }
}

/// A token as an engine would make it (for tests and tools): HS256 with
/// `key`, subject `subject`, expiring at `exp` (unix seconds).
pub fn sign_token(key: &[u8], subject: &str, exp: u64) -> String {
    let header = B64.encode(br#"{"alg":"HS256"}"#);
    let claims = B64.encode(
        serde_json::json!({ "sub": subject, "exp": exp })
            .to_string()
            .as_bytes(),
    );
    let signed = format!("{header}.{claims}");
    let tag = hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, key), signed.as_bytes());
    format!("{signed}.{}", B64.encode(tag.as_ref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_800_000_000;

    #[test]
    fn both_engine_keys_are_accepted_and_other_keys_are_not() {
        let auth = InternalAuth::from_secret("cluster secret");
        let [sha, hkdf] = derived_keys("cluster secret");
        assert_ne!(sha, hkdf);
        for key in [sha, hkdf] {
            assert_eq!(
                auth.check(&sign_token(&key, "worker-1", NOW + 300), NOW),
                Ok(())
            );
        }
        let [other, _] = derived_keys("another secret");
        assert_eq!(
            auth.check(&sign_token(&other, "w", NOW + 300), NOW),
            Err(AuthError::Signature)
        );
        // The raw secret as a key is neither derivation.
        assert_eq!(
            auth.check(&sign_token(b"cluster secret", "w", NOW + 300), NOW),
            Err(AuthError::Signature)
        );
    }

    #[test]
    fn sha256_key_is_the_digest_of_the_secret() {
        // echo -n 'abc' | sha256sum
        let [sha, _] = derived_keys("abc");
        let hex: String = sha.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn hkdf_key_matches_rfc5869_construction() {
        // RFC 5869 with an empty salt: PRK = HMAC(zeros, IKM), OKM = HMAC(PRK, info || 1).
        let secret = b"s3cr3t";
        let prk = hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, &[0u8; 32]), secret);
        let t1 = hmac::sign(
            &hmac::Key::new(hmac::HMAC_SHA256, prk.as_ref()),
            &[HKDF_INFO, &[1u8]].concat(),
        );
        let [_, hkdf] = derived_keys("s3cr3t");
        assert_eq!(&hkdf[..], t1.as_ref());
    }

    #[test]
    fn expired_unsigned_and_malformed_tokens_are_refused_by_name() {
        let auth = InternalAuth::from_secret("x");
        let [key, _] = derived_keys("x");
        assert_eq!(
            auth.check(&sign_token(&key, "w", NOW - 1), NOW),
            Err(AuthError::Expired {
                exp: NOW - 1,
                now: NOW
            })
        );
        let none = format!(
            "{}.{}.",
            B64.encode(br#"{"alg":"none"}"#),
            B64.encode(br#"{"exp":99999999999}"#)
        );
        assert!(matches!(
            auth.check(&none, NOW),
            Err(AuthError::Algorithm(_))
        ));
        let no_exp = {
            let signed = format!(
                "{}.{}",
                B64.encode(br#"{"alg":"HS256"}"#),
                B64.encode(br#"{"sub":"w"}"#)
            );
            let tag = hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, &key), signed.as_bytes());
            format!("{signed}.{}", B64.encode(tag.as_ref()))
        };
        assert_eq!(auth.check(&no_exp, NOW), Err(AuthError::NoExpiry));
        for bad in ["", "a.b", "a.b.c.d", "!!.??.**", &"a".repeat(10_000)] {
            assert!(
                matches!(auth.check(bad, NOW), Err(AuthError::Malformed(_))),
                "{bad:.20}"
            );
        }
        assert_eq!(auth.check_headers(|_| None, NOW), Err(AuthError::Missing));
        let good = sign_token(&key, "w", NOW + 10);
        assert_eq!(
            auth.check_headers(
                |name| (name == "X-Trino-Internal-Bearer").then_some(good.as_str()),
                NOW
            ),
            Ok(())
        );
    }

    #[test]
    fn a_tampered_claim_breaks_the_signature() {
        let auth = InternalAuth::from_secret("x");
        let [key, _] = derived_keys("x");
        let token = sign_token(&key, "w", NOW + 10);
        let mut parts: Vec<&str> = token.split('.').collect();
        let forged = B64.encode(br#"{"sub":"w","exp":99999999999}"#);
        parts[1] = &forged;
        assert_eq!(auth.check(&parts.join("."), NOW), Err(AuthError::Signature));
    }
}
