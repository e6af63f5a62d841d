//! The spooled segment object, format 1 (PROTOCOL.md section 6), in a
//! crate of its own so the client (and libbinx) decode segments without
//! linking the object stores:
//!
//! ```text
//! offset 0   4 bytes  magic "BXS1"
//!        4   u8       codec: 0 none, 1 lz4 (frame format), 2 zstd
//!        5   u8       flags: bit 0 encrypted
//!        6   u16      reserved, 0
//!        8   u32      page_count (N)
//!       12   u64      first_token
//!       20   N x u64  uncompressed page sizes
//!            body     codec(concatenation of the pages); if encrypted:
//!                     12-byte nonce, then AES-256-GCM(key, nonce, that,
//!                     aad = all header bytes above), tag appended
//!  end - 4   u32      CRC-32C of every byte before it
//! ```
//!
//! All integers are big-endian. A reader checks the magic, then the CRC,
//! then decrypts, then decompresses, then splits by the page sizes; every
//! mismatch is an error naming the object, never a panic. The declared sizes
//! are checked against limits before anything is decompressed, so a hostile
//! object cannot make the reader allocate without bound.

#![forbid(unsafe_code)]

use std::io::{Read, Write};

use bytes::{Bytes, BytesMut};
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, Nonce, UnboundKey};
use thiserror::Error;

const MAGIC: &[u8; 4] = b"BXS1";
const FIXED_HEADER: usize = 20;
const NONCE_LEN: usize = 12;
const TAG_LEN: usize = 16;
const CRC_LEN: usize = 4;
const FLAG_ENCRYPTED: u8 = 1;

/// How a segment's body is compressed (shared with the core, which decides
/// whether a client can decode an object).
pub use binx_core::Codec;

/// Bounds a reader enforces before it allocates.
#[derive(Clone, Copy, Debug)]
pub struct SegmentLimits {
    pub max_pages: u32,
    /// Largest sum of page sizes (the uncompressed body).
    pub max_body_bytes: u64,
}

impl Default for SegmentLimits {
    fn default() -> Self {
        SegmentLimits {
            max_pages: 1 << 20,
            max_body_bytes: 1 << 30,
        }
    }
}

/// Why a segment could not be written or read. Read errors name the object.
#[derive(Debug, Error)]
pub enum SegmentError {
    #[error("segment object {object}: {detail}")]
    Corrupt { object: String, detail: String },
    #[error(
        "segment object {object} is not encrypted, but a key was given for it: it is not the object that was written"
    )]
    NotEncrypted { object: String },
    #[error("segment object {object} is encrypted, but no key was given")]
    KeyMissing { object: String },
    #[error(
        "segment object {object} does not decrypt with the key given (wrong key, or the object was altered)"
    )]
    Decrypt { object: String },
    #[error("cannot build a segment: {0}")]
    Encode(String),
}

/// A fresh random AES-256 key for one segment.
pub fn new_key() -> Result<[u8; 32], SegmentError> {
    let mut key = [0u8; 32];
    getrandom::fill(&mut key)
        .map_err(|e| SegmentError::Encode(format!("no randomness for a key: {e}")))?;
    Ok(key)
}

/// Builds a segment object of `pages` starting at `first_token`, compressed
/// with `codec`, encrypted when `key` is given (with a random nonce).
pub fn encode_segment(
    first_token: u64,
    pages: &[Bytes],
    codec: Codec,
    key: Option<&[u8; 32]>,
) -> Result<Bytes, SegmentError> {
    let parts = encode_segment_parts(first_token, pages, codec, key)?;
    if let [one] = parts.as_slice() {
        return Ok(one.clone());
    }
    let mut out = BytesMut::with_capacity(parts.iter().map(Bytes::len).sum());
    for part in &parts {
        out.extend_from_slice(part);
    }
    Ok(out.freeze())
}

/// The same object as [`encode_segment`], as pieces to write one after the
/// other. Uncompressed and unencrypted, the pages are pieces themselves: the
/// object is written without copying them.
pub fn encode_segment_parts(
    first_token: u64,
    pages: &[Bytes],
    codec: Codec,
    key: Option<&[u8; 32]>,
) -> Result<Vec<Bytes>, SegmentError> {
    let mut parts = encode_segment_content(first_token, pages, codec, key)?;
    parts.push(segment_crc(&parts));
    Ok(parts)
}

/// Every piece of a segment but its CRC trailer (see [`segment_crc`]), so a
/// writer can checksum on one core while it writes on another.
pub fn encode_segment_content(
    first_token: u64,
    pages: &[Bytes],
    codec: Codec,
    key: Option<&[u8; 32]>,
) -> Result<Vec<Bytes>, SegmentError> {
    let count = u32::try_from(pages.len()).map_err(|_| {
        SegmentError::Encode(format!("{} pages do not fit one segment", pages.len()))
    })?;
    let body_len: usize = pages.iter().map(Bytes::len).sum();
    let mut header = BytesMut::with_capacity(FIXED_HEADER + 8 * pages.len());
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(&[
        codec.byte(),
        if key.is_some() { FLAG_ENCRYPTED } else { 0 },
        0,
        0,
    ]);
    header.extend_from_slice(&count.to_be_bytes());
    header.extend_from_slice(&first_token.to_be_bytes());
    for page in pages {
        header.extend_from_slice(&(page.len() as u64).to_be_bytes());
    }
    let header = header.freeze();
    let mut parts = vec![header.clone()];
    match (codec, key) {
        (Codec::None, None) => parts.extend(pages.iter().cloned()),
        (_, None) => parts.push(compress(codec, pages, body_len)?.into()),
        (_, Some(key)) => {
            let mut body = compress(codec, pages, body_len)?;
            let mut nonce = [0u8; NONCE_LEN];
            getrandom::fill(&mut nonce)
                .map_err(|e| SegmentError::Encode(format!("no randomness for a nonce: {e}")))?;
            let tag = aes_key(key)?
                .seal_in_place_separate_tag(
                    Nonce::assume_unique_for_key(nonce),
                    Aad::from(&header[..]),
                    &mut body,
                )
                .map_err(|_| SegmentError::Encode("encryption failed".into()))?;
            parts.push(Bytes::copy_from_slice(&nonce));
            parts.push(body.into());
            parts.push(Bytes::copy_from_slice(tag.as_ref()));
        }
    }
    Ok(parts)
}

/// The trailer of a segment whose other pieces are `parts`: CRC-32C of them all.
pub fn segment_crc(parts: &[Bytes]) -> Bytes {
    let crc = parts
        .iter()
        .fold(0u32, |crc, part| crc32c::crc32c_append(crc, part));
    Bytes::copy_from_slice(&crc.to_be_bytes())
}

/// An AES-256-GCM key (ring: hardware AES and carry-less multiply).
pub fn aes_key(key: &[u8; 32]) -> Result<LessSafeKey, SegmentError> {
    UnboundKey::new(&AES_256_GCM, key)
        .map(LessSafeKey::new)
        .map_err(|_| SegmentError::Encode("not an AES-256 key".into()))
}

fn compress(codec: Codec, pages: &[Bytes], body_len: usize) -> Result<Vec<u8>, SegmentError> {
    let failed = |e: std::io::Error| {
        SegmentError::Encode(format!("{} compression failed: {e}", codec.name()))
    };
    match codec {
        Codec::None => {
            let mut body = Vec::with_capacity(body_len);
            for page in pages {
                body.extend_from_slice(page);
            }
            Ok(body)
        }
        Codec::Lz4 => {
            let mut encoder =
                lz4_flex::frame::FrameEncoder::new(Vec::with_capacity(body_len / 2 + 64));
            for page in pages {
                encoder.write_all(page).map_err(failed)?;
            }
            encoder
                .finish()
                .map_err(|e| SegmentError::Encode(format!("lz4 compression failed: {e}")))
        }
        Codec::Zstd => {
            let mut encoder = zstd::stream::Encoder::new(Vec::with_capacity(body_len / 2 + 64), 3)
                .map_err(failed)?;
            for page in pages {
                encoder.write_all(page).map_err(failed)?;
            }
            encoder.finish().map_err(failed)
        }
    }
}

/// Reads a segment object named `object` (for errors): returns its first
/// token and its pages.
pub fn decode_segment(
    object: &str,
    data: &[u8],
    key: Option<&[u8; 32]>,
    limits: SegmentLimits,
) -> Result<(u64, Vec<Bytes>), SegmentError> {
    let corrupt = |detail: String| SegmentError::Corrupt {
        object: object.to_string(),
        detail,
    };
    if data.len() < FIXED_HEADER + CRC_LEN {
        return Err(corrupt(format!(
            "{} bytes is shorter than any segment",
            data.len()
        )));
    }
    if &data[..4] != MAGIC {
        return Err(corrupt(format!(
            "starts with {:02x?}, not \"BXS1\"",
            &data[..4]
        )));
    }
    let (content, crc_bytes) = data.split_at(data.len() - CRC_LEN);
    let stored = u32::from_be_bytes([crc_bytes[0], crc_bytes[1], crc_bytes[2], crc_bytes[3]]);
    let computed = crc32c::crc32c(content);
    if stored != computed {
        return Err(corrupt(format!(
            "CRC-32C mismatch: stored {stored:08x}, computed {computed:08x} (the object is damaged)"
        )));
    }
    let codec = Codec::from_byte(content[4])
        .ok_or_else(|| corrupt(format!("unknown codec {}", content[4])))?;
    let flags = content[5];
    if flags & !FLAG_ENCRYPTED != 0 || content[6] != 0 || content[7] != 0 {
        return Err(corrupt(format!(
            "unknown flags {flags:#04x} or non-zero reserved bytes"
        )));
    }
    let count = u32::from_be_bytes([content[8], content[9], content[10], content[11]]);
    if count > limits.max_pages {
        return Err(corrupt(format!(
            "{count} pages, more than the limit of {}",
            limits.max_pages
        )));
    }
    let first_token = u64::from_be_bytes(content[12..20].try_into().unwrap_or_default());
    let sizes_end = FIXED_HEADER + 8 * count as usize;
    if content.len() < sizes_end {
        return Err(corrupt(format!(
            "{count} page sizes do not fit in {} bytes",
            content.len()
        )));
    }
    let sizes: Vec<u64> = content[FIXED_HEADER..sizes_end]
        .chunks_exact(8)
        .map(|c| u64::from_be_bytes(c.try_into().unwrap_or_default()))
        .collect();
    let total = sizes
        .iter()
        .try_fold(0u64, |acc, &s| acc.checked_add(s))
        .filter(|&t| t <= limits.max_body_bytes)
        .ok_or_else(|| {
            corrupt(format!(
                "page sizes add up to more than the limit of {} bytes",
                limits.max_body_bytes
            ))
        })?;
    let (header, body) = content.split_at(sizes_end);
    if key.is_some() && flags & FLAG_ENCRYPTED == 0 {
        // Whoever could put a plain object where an encrypted one was
        // could choose the pages (PROTOCOL.md section 6).
        return Err(SegmentError::NotEncrypted {
            object: object.to_string(),
        });
    }
    let plain;
    let body = if flags & FLAG_ENCRYPTED != 0 {
        let key = key.ok_or_else(|| SegmentError::KeyMissing {
            object: object.to_string(),
        })?;
        if body.len() < NONCE_LEN + TAG_LEN {
            return Err(corrupt(
                "encrypted body is shorter than its nonce and tag".into(),
            ));
        }
        let (nonce, sealed) = body.split_at(NONCE_LEN);
        let nonce =
            Nonce::try_assume_unique_for_key(nonce).map_err(|_| corrupt("bad nonce".into()))?;
        let decrypt_failed = || SegmentError::Decrypt {
            object: object.to_string(),
        };
        let mut buffer = sealed.to_vec();
        let plain_len = aes_key(key)
            .map_err(|_| decrypt_failed())?
            .open_in_place(nonce, Aad::from(header), &mut buffer)
            .map_err(|_| decrypt_failed())?
            .len();
        buffer.truncate(plain_len);
        plain = buffer;
        &plain[..]
    } else {
        body
    };
    let pages_bytes = decompress(codec, body, total).map_err(corrupt)?;
    if pages_bytes.len() as u64 != total {
        return Err(corrupt(format!(
            "body holds {} bytes but the page sizes add up to {total}",
            pages_bytes.len()
        )));
    }
    let all = Bytes::from(pages_bytes);
    let mut offset = 0usize;
    let pages = sizes
        .iter()
        .map(|&s| {
            let page = all.slice(offset..offset + s as usize);
            offset += s as usize;
            page
        })
        .collect();
    Ok((first_token, pages))
}

/// Decompresses at most `expected + 1` bytes, so a body that inflates past
/// its declared size is caught without inflating it all.
fn decompress(codec: Codec, body: &[u8], expected: u64) -> Result<Vec<u8>, String> {
    let cap = expected.saturating_add(1);
    let mut out = Vec::with_capacity(expected.min(64 << 20) as usize);
    let result = match codec {
        Codec::None => return Ok(body.to_vec()),
        Codec::Lz4 => lz4_flex::frame::FrameDecoder::new(body)
            .take(cap)
            .read_to_end(&mut out),
        Codec::Zstd => match zstd::stream::Decoder::new(body) {
            Ok(decoder) => decoder.take(cap).read_to_end(&mut out),
            Err(e) => Err(e),
        },
    };
    result.map_err(|e| format!("{} body does not decompress: {e}", codec.name()))?;
    Ok(out)
}

#[cfg(test)]
mod tests;
