//! Internal authentication of the HTTP exchange (docs/PROTOCOL.md section 7):
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

use std::collections::HashSet;
use std::fmt;

use base64::Engine as _;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use ring::{digest, hkdf};
use thiserror::Error;

/// The headers that carry the token, in the order they are looked at.
pub const BEARER_HEADERS: [&str; 2] = ["X-Presto-Internal-Bearer", "X-Trino-Internal-Bearer"];

/// Longest token looked at; the engines' are a few hundred bytes.
pub const MAX_TOKEN_LEN: usize = 8192;

/// HKDF `info` of Trino 480 and later.
const HKDF_INFO: &[u8] = b"internal-communication";

/// Base64url, with or without padding; only used to name the algorithm of a
/// header that `jsonwebtoken` refused (JWTs carry no padding, RFC 7515).
const B64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::URL_SAFE,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// Why a request was not authenticated; the text goes in the 401 body.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum AuthError {
    /// No bearer header at all.
    #[error(
        "this binxd requires internal authentication: send X-Presto-Internal-Bearer or X-Trino-Internal-Bearer, a JWT signed with the cluster's shared secret (internal-communication.shared-secret)"
    )]
    Missing,
    /// Not a JWT: the reason names the part that is wrong.
    #[error("the internal bearer token is not a JWT: {0}")]
    Malformed(&'static str),
    /// A JWT, but not HS256 (`none` included).
    #[error("the internal bearer token is signed with {0:?}; only HS256 is accepted")]
    Algorithm(String),
    /// Signed with neither key the shared secret gives.
    #[error(
        "the internal bearer token's signature does not match this binxd's shared secret (with either the SHA-256 or the HKDF key)"
    )]
    Signature,
    /// Signed, but without `exp`: such a token would be good forever.
    #[error("the internal bearer token has no expiry (exp)")]
    NoExpiry,
    /// Signed and expired.
    #[error("the internal bearer token expired at {exp} (unix seconds); it is now {now}")]
    Expired {
        /// The token's `exp`.
        exp: u64,
        /// The time it was checked at.
        now: u64,
    },
}

/// The keys a shared secret gives, for checking bearer tokens.
#[derive(Clone)]
pub struct InternalAuth {
    keys: [DecodingKey; 2],
    validation: Validation,
}

impl fmt::Debug for InternalAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("InternalAuth(keys hidden)")
    }
}

pub use binx_core::door::secret_matches;

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

/// The one claim binxd reads; `exp` is checked against the caller's clock.
#[derive(serde::Deserialize)]
struct Expiry {
    exp: Option<u64>,
}

impl InternalAuth {
    /// The keys both engine generations derive from `secret`.
    pub fn from_secret(secret: &str) -> Self {
        let [sha, hkdf] = derived_keys(secret);
        // HS256 only; `exp` must be present. It is compared with the time
        // `check` is given (no leeway), not with jsonwebtoken's own clock.
        let mut validation = Validation::new(Algorithm::HS256);
        validation.validate_exp = false;
        validation.leeway = 0;
        validation.required_spec_claims = HashSet::from(["exp".to_string()]);
        InternalAuth {
            keys: [
                DecodingKey::from_secret(&sha),
                DecodingKey::from_secret(&hkdf),
            ],
            validation,
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
    /// The claims are read only once the signature holds.
    pub fn check(&self, token: &str, now_unix: u64) -> Result<(), AuthError> {
        let token = token.trim();
        let token = token.strip_prefix("Bearer ").unwrap_or(token);
        if token.len() > MAX_TOKEN_LEN {
            return Err(AuthError::Malformed("longer than 8 KiB"));
        }
        if token.split('.').count() != 3 {
            return Err(AuthError::Malformed("not three dot-separated parts"));
        }
        let header = jsonwebtoken::decode_header(token).map_err(|e| header_refusal(token, &e))?;
        if header.alg != Algorithm::HS256 {
            return Err(AuthError::Algorithm(format!("{:?}", header.alg)));
        }
        for key in &self.keys {
            match jsonwebtoken::decode::<Expiry>(token, key, &self.validation) {
                Ok(data) => {
                    return match data.claims.exp {
                        None => Err(AuthError::NoExpiry),
                        Some(exp) if exp <= now_unix => {
                            Err(AuthError::Expired { exp, now: now_unix })
                        }
                        Some(_) => Ok(()),
                    };
                }
                Err(e) => match e.kind() {
                    ErrorKind::InvalidSignature => continue,
                    ErrorKind::MissingRequiredClaim(_) => return Err(AuthError::NoExpiry),
                    ErrorKind::Base64(_) => {
                        return Err(AuthError::Malformed("a part is not base64url"));
                    }
                    _ => {
                        return Err(AuthError::Malformed(
                            "the claims are not a JSON object with a whole-second exp",
                        ));
                    }
                },
            }
        }
        Err(AuthError::Signature)
    }
}

/// Why `jsonwebtoken` could not read a header: an algorithm it does not
/// know (`none` among them) is named, anything else is malformed.
fn header_refusal(token: &str, error: &jsonwebtoken::errors::Error) -> AuthError {
    #[derive(serde::Deserialize)]
    struct NamedAlgorithm {
        alg: String,
    }
    let named = token
        .split('.')
        .next()
        .and_then(|header| B64.decode(header).ok())
        .and_then(|json| serde_json::from_slice::<NamedAlgorithm>(&json).ok());
    match (named, error.kind()) {
        (Some(named), _) if named.alg != "HS256" => {
            AuthError::Algorithm(binx_proto::truncate(&named.alg, 32).to_string())
        }
        (_, ErrorKind::Base64(_)) => {
            AuthError::Malformed("the header is not base64url without padding")
        }
        _ => AuthError::Malformed("the header is not a JSON object with alg"),
    }
}

/// A token as an engine would make it (for tests and tools): HS256 with
/// `key`, subject `subject`, expiring at `exp` (unix seconds).
pub fn sign_token(key: &[u8], subject: &str, exp: u64) -> String {
    let claims = serde_json::json!({ "sub": subject, "exp": exp });
    // Encoding a JSON value with an HMAC key has no failure path.
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(key),
    )
    .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ring::hmac;

    const NOW: u64 = 1_800_000_000;
    const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::URL_SAFE_NO_PAD;

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
        assert_eq!(
            auth.check(&none, NOW),
            Err(AuthError::Algorithm("none".into()))
        );
        // An algorithm jsonwebtoken knows but binxd does not take.
        let hs512 = jsonwebtoken::encode(
            &Header::new(Algorithm::HS512),
            &serde_json::json!({ "exp": NOW + 10 }),
            &EncodingKey::from_secret(&key),
        )
        .unwrap();
        assert_eq!(
            auth.check(&hs512, NOW),
            Err(AuthError::Algorithm("HS512".into()))
        );
        // A signed token whose exp is not a number is malformed.
        let text_exp = jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &serde_json::json!({ "exp": "tomorrow" }),
            &EncodingKey::from_secret(&key),
        )
        .unwrap();
        assert!(matches!(
            auth.check(&text_exp, NOW),
            Err(AuthError::Malformed(_))
        ));
        let no_exp = jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &serde_json::json!({ "sub": "w" }),
            &EncodingKey::from_secret(&key),
        )
        .unwrap();
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
