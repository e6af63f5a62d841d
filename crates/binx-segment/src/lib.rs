//! The spooled segment object (PROTOCOL.md sections 6 and 6b), in a crate
//! of its own so the client (and libbinx) decode segments without linking
//! the object stores. Writers write format 2; readers read formats 1 and 2.
//!
//! ```text
//! format 2                                   format 1
//! 0    "BXS2"                                0    "BXS1"
//! 4    u8  codec: 0 none, 1 lz4, 2 zstd      4    u8  codec
//! 5    u8  flags: bit 0 encrypted            5    u8  flags
//! 6    u16 reserved, 0                       6    u16 reserved, 0
//! 8    u32 page_count (N)                    8    u32 page_count (N)
//! 12   u64 first_token                       12   u64 first_token
//! 20   u32 chunk_size (C)                    20   N x u64 page sizes
//! 24   N x u64 page sizes                         body: E, or nonce (12) +
//! 24+8N 7-byte nonce prefix (encrypted)             AES-256-GCM(E, aad =
//!      body: E = codec(pages) cut into             header) + tag
//!      chunks of C; encrypted, each chunk   end-4 CRC-32C of all before
//!      i is sealed with nonce prefix ||
//!      u32 i || u8 last, aad = header
//!      (through the prefix), tag after it
//! end-4 CRC-32C of every byte before it
//! ```
//!
//! All integers are big-endian. A reader checks the magic, then the CRC,
//! then decrypts (format 2: chunk by chunk, the last one marked last, so a
//! truncated object fails), then decompresses, then splits by the page
//! sizes; every mismatch is an error naming the object, never a panic. The
//! declared sizes are checked against limits before anything is
//! decompressed, so a hostile object cannot make the reader allocate
//! without bound.

#![forbid(unsafe_code)]

use std::io::{Read, Write};

use bytes::{Bytes, BytesMut};
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, Nonce, UnboundKey};
use thiserror::Error;

const MAGIC_V1: &[u8; 4] = b"BXS1";
const MAGIC_V2: &[u8; 4] = b"BXS2";
/// Bytes before the page sizes: format 1, format 2 (which adds chunk_size).
const FIXED_HEADER_V1: usize = 20;
const FIXED_HEADER_V2: usize = 24;
const NONCE_LEN: usize = 12;
const NONCE_PREFIX_LEN: usize = 7;
/// The chunk size format 2 writers use: large enough that a tag per chunk
/// costs nothing measurable, small enough that a reader holds little.
pub const CHUNK_SIZE: u32 = 1 << 20;
/// The chunk sizes a format 2 reader accepts (format 2, docs/PROTOCOL.md section 4, "Spooling"; vector (d) in section 5).
const CHUNK_SIZES: std::ops::RangeInclusive<u32> = 65536..=16_777_216;
const TAG_LEN: usize = 16;
const CRC_LEN: usize = 4;
const FLAG_ENCRYPTED: u8 = 1;

/// How a segment's body is compressed (shared with the core, which decides
/// whether a client can decode an object).
pub use binx_core::Codec;

/// Bounds a reader enforces before it allocates.
#[derive(Clone, Copy, Debug)]
pub struct SegmentLimits {
    /// Most pages a segment may hold.
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
    /// The object is not a well-formed segment, or is beyond the limits.
    #[error("segment object {object}: {detail}")]
    Corrupt {
        /// The name of the object read.
        object: String,
        /// What is wrong with it.
        detail: String,
    },
    /// A key was given but the object is not encrypted.
    #[error(
        "segment object {object} is not encrypted, but a key was given for it: it is not the object that was written"
    )]
    NotEncrypted {
        /// The name of the object read.
        object: String,
    },
    /// The object is encrypted but no key was given.
    #[error("segment object {object} is encrypted, but no key was given")]
    KeyMissing {
        /// The name of the object read.
        object: String,
    },
    /// Authenticated decryption failed: a wrong key or an altered object.
    #[error(
        "segment object {object} does not decrypt with the key given (wrong key, or the object was altered)"
    )]
    Decrypt {
        /// The name of the object read.
        object: String,
    },
    /// A segment could not be built (compression, encryption, randomness,
    /// too many pages); the text says why.
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

/// The most bytes a writer stores for `pages` pages of `page_bytes` bytes
/// in all, whatever the codec, encryption and format: a reader that knows
/// the pages fetches no more than this (a larger stored size was not
/// written by a binx writer).
pub fn max_stored_size(pages: u64, page_bytes: u64) -> u64 {
    // lz4's and zstd's worst cases both stay under n + n/128 + 64 KiB.
    let body = page_bytes
        .saturating_add(page_bytes / 128)
        .saturating_add(64 << 10);
    // A tag a chunk, at the smallest chunk a reader accepts.
    let chunks = body / u64::from(*CHUNK_SIZES.start()) + 1;
    ((FIXED_HEADER_V2 + NONCE_LEN + CRC_LEN) as u64)
        .saturating_add(pages.saturating_mul(8))
        .saturating_add(body)
        .saturating_add(chunks.saturating_mul(TAG_LEN as u64))
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
    let mut parts = Vec::new();
    encode_segment_pieces(first_token, pages, codec, key, |piece| {
        parts.push(piece);
        Ok(())
    })?;
    Ok(parts)
}

/// Builds the same object as [`encode_segment_content`] (no CRC trailer),
/// handing each piece to `emit` as soon as it exists: the header, then each
/// sealed chunk and its tag in turn. A writer on another thread can so write
/// chunk k while chunk k+1 is sealed. Uncompressed, each chunk is a
/// buffer of its own, so memory beside the pages is the chunks `emit` still
/// holds; compressed, the whole compressed body is held until its last
/// chunk is dropped. An error from `emit` stops the encoding and is
/// returned.
pub fn encode_segment_pieces(
    first_token: u64,
    pages: &[Bytes],
    codec: Codec,
    key: Option<&[u8; 32]>,
    mut emit: impl FnMut(Bytes) -> Result<(), SegmentError>,
) -> Result<(), SegmentError> {
    let count = u32::try_from(pages.len()).map_err(|_| {
        SegmentError::Encode(format!("{} pages do not fit one segment", pages.len()))
    })?;
    let body_len: usize = pages.iter().map(Bytes::len).sum();
    let mut header = BytesMut::with_capacity(FIXED_HEADER_V2 + 8 * pages.len() + NONCE_PREFIX_LEN);
    header.extend_from_slice(MAGIC_V2);
    header.extend_from_slice(&[
        codec.byte(),
        if key.is_some() { FLAG_ENCRYPTED } else { 0 },
        0,
        0,
    ]);
    header.extend_from_slice(&count.to_be_bytes());
    header.extend_from_slice(&first_token.to_be_bytes());
    header.extend_from_slice(&CHUNK_SIZE.to_be_bytes());
    for page in pages {
        header.extend_from_slice(&(page.len() as u64).to_be_bytes());
    }
    let mut prefix = [0u8; NONCE_PREFIX_LEN];
    if key.is_some() {
        getrandom::fill(&mut prefix)
            .map_err(|e| SegmentError::Encode(format!("no randomness for a nonce: {e}")))?;
        header.extend_from_slice(&prefix);
    }
    let header = header.freeze();
    emit(header.clone())?;
    let Some(key) = key else {
        if codec == Codec::None {
            return pages.iter().try_for_each(|page| emit(page.clone()));
        }
        return emit(compress(codec, pages, body_len)?.into());
    };
    let sealer = aes_key(key)?;
    // The plaintext body: compressed in one go, or, uncompressed, copied
    // from the pages one chunk at a time into a buffer of its own just
    // before that chunk is sealed (it is then still in cache, and freed as
    // soon as the writer is done with it).
    let mut body = match codec {
        Codec::None => BytesMut::new(),
        _ => BytesMut::from(Bytes::from(compress(codec, pages, body_len)?)),
    };
    let mut gather = Gather::new(pages);
    let chunk = CHUNK_SIZE as usize;
    let total = if codec == Codec::None {
        body_len
    } else {
        body.len()
    };
    // An empty body is one empty chunk.
    let chunks = total.div_ceil(chunk).max(1);
    for i in 0..chunks {
        let len = chunk.min(total - i * chunk);
        if codec == Codec::None {
            body = BytesMut::with_capacity(len);
            gather.copy_into(&mut body, len);
        }
        let mut plain = body.split_to(len);
        let nonce = chunk_nonce(&prefix, i, i + 1 == chunks)
            .ok_or_else(|| SegmentError::Encode("too many chunks".into()))?;
        let tag = sealer
            .seal_in_place_separate_tag(nonce, Aad::from(&header[..]), &mut plain)
            .map_err(|_| SegmentError::Encode("encryption failed".into()))?;
        emit(plain.freeze())?;
        emit(Bytes::copy_from_slice(tag.as_ref()))?;
    }
    Ok(())
}

/// Copies the bytes of consecutive pages, a run at a time.
struct Gather<'a> {
    pages: std::slice::Iter<'a, Bytes>,
    current: &'a [u8],
}

impl<'a> Gather<'a> {
    fn new(pages: &'a [Bytes]) -> Self {
        Gather {
            pages: pages.iter(),
            current: &[],
        }
    }

    /// Appends the next `len` bytes (fewer if the pages end) to `out`.
    fn copy_into(&mut self, out: &mut BytesMut, mut len: usize) {
        while len > 0 {
            if self.current.is_empty() {
                match self.pages.next() {
                    Some(page) => self.current = page,
                    None => return,
                }
                continue;
            }
            let n = len.min(self.current.len());
            out.extend_from_slice(&self.current[..n]);
            self.current = &self.current[n..];
            len -= n;
        }
    }
}

/// The nonce of format 2 chunk `index`: prefix, index (big-endian), last.
fn chunk_nonce(prefix: &[u8; NONCE_PREFIX_LEN], index: usize, last: bool) -> Option<Nonce> {
    let index = u32::try_from(index).ok()?;
    let mut nonce = [0u8; NONCE_LEN];
    nonce[..NONCE_PREFIX_LEN].copy_from_slice(prefix);
    nonce[NONCE_PREFIX_LEN..NONCE_LEN - 1].copy_from_slice(&index.to_be_bytes());
    nonce[NONCE_LEN - 1] = u8::from(last);
    Some(Nonce::assume_unique_for_key(nonce))
}

/// The trailer of a segment whose other pieces are `parts`: CRC-32C of them all.
pub fn segment_crc(parts: &[Bytes]) -> Bytes {
    let mut crc = SegmentCrc::default();
    parts.iter().for_each(|part| crc.update(part));
    crc.trailer()
}

/// The CRC-32C trailer, computed as the pieces of a segment pass by.
#[derive(Clone, Copy, Debug, Default)]
pub struct SegmentCrc(u32);

impl SegmentCrc {
    /// Adds the next piece of the segment, in order.
    pub fn update(&mut self, piece: &[u8]) {
        self.0 = crc32c::crc32c_append(self.0, piece);
    }

    /// The trailer of every piece seen.
    pub fn trailer(&self) -> Bytes {
        Bytes::copy_from_slice(&self.0.to_be_bytes())
    }
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

/// Reads a segment object named `object` (for errors), format 1 or 2:
/// returns its first token and its pages.
pub fn decode_segment(
    object: &str,
    data: &[u8],
    key: Option<&[u8; 32]>,
    limits: SegmentLimits,
) -> Result<(u64, Vec<Bytes>), SegmentError> {
    let layout = parse(object, data, key, limits)?;
    let body = &data[layout.body.clone()];
    let plain = match &layout.seal {
        None => return layout.pages(object, None, body),
        Some(seal) => {
            let mut buffer = body.to_vec();
            let plain = seal.open(object, &mut buffer)?;
            buffer.truncate(plain.end);
            Bytes::from(buffer).slice(plain)
        }
    };
    layout.pages(object, Some(plain), &[])
}

/// [`decode_segment`] of an object read into a `Bytes`, using its memory:
/// the pages of an unencrypted, uncompressed object are slices of it, and an
/// encrypted one is decrypted in place, chunk by chunk, when no one else
/// holds `data` (otherwise in a copy of its body), so reading an object
/// needs little more memory than the object itself.
pub fn decode_segment_shared(
    object: &str,
    data: Bytes,
    key: Option<&[u8; 32]>,
    limits: SegmentLimits,
) -> Result<(u64, Vec<Bytes>), SegmentError> {
    let layout = parse(object, &data, key, limits)?;
    let Some(seal) = &layout.seal else {
        return match layout.codec {
            Codec::None => layout.pages(object, Some(data.slice(layout.body.clone())), &[]),
            _ => layout.pages(object, None, &data[layout.body.clone()]),
        };
    };
    let plain = match data.try_into_mut() {
        Ok(mut owned) => {
            let body = layout.body.clone();
            let plain = seal.open(object, &mut owned[body.clone()])?;
            owned
                .freeze()
                .slice(body.start + plain.start..body.start + plain.end)
        }
        Err(data) => {
            let mut buffer = data[layout.body.clone()].to_vec();
            let plain = seal.open(object, &mut buffer)?;
            buffer.truncate(plain.end);
            Bytes::from(buffer).slice(plain)
        }
    };
    layout.pages(object, Some(plain), &[])
}

/// What a segment's header says, checked; the body is not touched yet.
struct Layout {
    first_token: u64,
    sizes: Vec<u64>,
    /// The sum of `sizes`, within the limits.
    total: u64,
    codec: Codec,
    /// Where the body is in the object.
    body: std::ops::Range<usize>,
    seal: Option<Seal>,
}

/// How an encrypted body is sealed, and what opens it.
enum Seal {
    /// Format 1: nonce, then one AES-256-GCM message.
    Whole {
        opener: LessSafeKey,
        header: Vec<u8>,
    },
    /// Format 2: chunks, each sealed under prefix || index || last.
    Chunks {
        opener: LessSafeKey,
        header: Vec<u8>,
        prefix: [u8; NONCE_PREFIX_LEN],
        chunk_size: usize,
    },
}

impl Seal {
    /// Decrypts `body` in place; returns where the plaintext is in it.
    fn open(&self, object: &str, body: &mut [u8]) -> Result<std::ops::Range<usize>, SegmentError> {
        let corrupt = |detail: String| SegmentError::Corrupt {
            object: object.to_string(),
            detail,
        };
        let decrypt_failed = || SegmentError::Decrypt {
            object: object.to_string(),
        };
        match self {
            Seal::Chunks {
                opener,
                header,
                prefix,
                chunk_size,
            } => open_chunks(opener, prefix, header, body, *chunk_size)
                .map(|len| 0..len)
                .map_err(|e| match e {
                    ChunkError::Shape(detail) => corrupt(detail),
                    ChunkError::Tag => decrypt_failed(),
                }),
            Seal::Whole { opener, header } => {
                if body.len() < NONCE_LEN + TAG_LEN {
                    return Err(corrupt(
                        "encrypted body is shorter than its nonce and tag".into(),
                    ));
                }
                let (nonce, sealed) = body.split_at_mut(NONCE_LEN);
                let nonce = Nonce::try_assume_unique_for_key(nonce)
                    .map_err(|_| corrupt("bad nonce".into()))?;
                let len = opener
                    .open_in_place(nonce, Aad::from(&header[..]), sealed)
                    .map_err(|_| decrypt_failed())?
                    .len();
                Ok(NONCE_LEN..NONCE_LEN + len)
            }
        }
    }
}

impl Layout {
    /// The pages: `plain` when the body is already the uncompressed pages
    /// (or the decrypted body, still compressed), else `body` inflated.
    fn pages(
        &self,
        object: &str,
        plain: Option<Bytes>,
        body: &[u8],
    ) -> Result<(u64, Vec<Bytes>), SegmentError> {
        let corrupt = |detail: String| SegmentError::Corrupt {
            object: object.to_string(),
            detail,
        };
        let inflate = |body: &[u8]| -> Result<Bytes, SegmentError> {
            decompress(self.codec, body, self.total)
                .map(Bytes::from)
                .map_err(corrupt)
        };
        let all = match (plain, self.codec) {
            (Some(plain), Codec::None) => plain,
            (Some(plain), _) => inflate(&plain)?,
            (None, _) => inflate(body)?,
        };
        let total = self.total;
        if all.len() as u64 != total {
            return Err(corrupt(format!(
                "body holds {} bytes but the page sizes add up to {total}",
                all.len()
            )));
        }
        let mut offset = 0usize;
        let pages = self
            .sizes
            .iter()
            .map(|&s| {
                let page = all.slice(offset..offset + s as usize);
                offset += s as usize;
                page
            })
            .collect();
        Ok((self.first_token, pages))
    }
}

/// Checks a segment's magic, CRC and header against the limits and the key.
fn parse(
    object: &str,
    data: &[u8],
    key: Option<&[u8; 32]>,
    limits: SegmentLimits,
) -> Result<Layout, SegmentError> {
    let corrupt = |detail: String| SegmentError::Corrupt {
        object: object.to_string(),
        detail,
    };
    if data.len() < FIXED_HEADER_V1 + CRC_LEN {
        return Err(corrupt(format!(
            "{} bytes is shorter than any segment",
            data.len()
        )));
    }
    let format2 = match &data[..4] {
        m if m == MAGIC_V1 => false,
        m if m == MAGIC_V2 => true,
        other => {
            return Err(corrupt(format!(
                "starts with {other:02x?}, not \"BXS2\" or \"BXS1\""
            )));
        }
    };
    let (content, crc_bytes) = data.split_at(data.len() - CRC_LEN);
    let stored = u32::from_be_bytes([crc_bytes[0], crc_bytes[1], crc_bytes[2], crc_bytes[3]]);
    let computed = crc32c::crc32c(content);
    if stored != computed {
        return Err(corrupt(format!(
            "CRC-32C mismatch: stored {stored:08x}, computed {computed:08x} (the object is damaged)"
        )));
    }
    let fixed = if format2 {
        FIXED_HEADER_V2
    } else {
        FIXED_HEADER_V1
    };
    if content.len() < fixed {
        return Err(corrupt(format!(
            "{} bytes is shorter than its header",
            content.len()
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
    let encrypted = flags & FLAG_ENCRYPTED != 0;
    let count = u32::from_be_bytes([content[8], content[9], content[10], content[11]]);
    if count > limits.max_pages {
        return Err(corrupt(format!(
            "{count} pages, more than the limit of {}",
            limits.max_pages
        )));
    }
    let first_token = u64::from_be_bytes(content[12..20].try_into().unwrap_or_default());
    let chunk_size = if format2 {
        let c = u32::from_be_bytes(content[20..24].try_into().unwrap_or_default());
        if !CHUNK_SIZES.contains(&c) {
            return Err(corrupt(format!(
                "chunk size {c} is outside {}..={}",
                CHUNK_SIZES.start(),
                CHUNK_SIZES.end()
            )));
        }
        c as usize
    } else {
        0
    };
    let sizes_end = fixed + 8 * count as usize;
    // Format 2 encrypted: the nonce prefix ends the header.
    let header_end = sizes_end
        + if format2 && encrypted {
            NONCE_PREFIX_LEN
        } else {
            0
        };
    if content.len() < header_end {
        return Err(corrupt(format!(
            "{count} page sizes do not fit in {} bytes",
            content.len()
        )));
    }
    let sizes: Vec<u64> = content[fixed..sizes_end]
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
    if key.is_some() && !encrypted {
        // Whoever could put a plain object where an encrypted one was
        // could choose the pages (docs/PROTOCOL.md section 4, "Spooling").
        return Err(SegmentError::NotEncrypted {
            object: object.to_string(),
        });
    }
    let seal = if !encrypted {
        None
    } else {
        let key = key.ok_or_else(|| SegmentError::KeyMissing {
            object: object.to_string(),
        })?;
        let opener = aes_key(key).map_err(|_| SegmentError::Decrypt {
            object: object.to_string(),
        })?;
        let header = content[..header_end].to_vec();
        Some(if format2 {
            let prefix: [u8; NONCE_PREFIX_LEN] = header[sizes_end..]
                .try_into()
                .map_err(|_| corrupt("no nonce prefix".into()))?;
            Seal::Chunks {
                opener,
                header,
                prefix,
                chunk_size,
            }
        } else {
            Seal::Whole { opener, header }
        })
    };
    Ok(Layout {
        first_token,
        sizes,
        total,
        codec,
        body: header_end..content.len(),
        seal,
    })
}

/// Why the chunks of a format 2 body did not open.
enum ChunkError {
    /// The body cannot be chunks of this size (a short tag, too many chunks).
    Shape(String),
    /// A tag did not verify: wrong key, altered or truncated object.
    Tag,
}

/// Opens the sealed chunks of a format 2 body in place, in order, each under
/// its own nonce, the last marked last; moves each chunk's plaintext down
/// next to the one before it and returns the plaintext's length (E).
fn open_chunks(
    opener: &LessSafeKey,
    prefix: &[u8; NONCE_PREFIX_LEN],
    header: &[u8],
    buffer: &mut [u8],
    chunk_size: usize,
) -> Result<usize, ChunkError> {
    let sealed = chunk_size + TAG_LEN;
    let count = buffer.len().div_ceil(sealed).max(1);
    let last_len = buffer.len().saturating_sub((count - 1) * sealed);
    if last_len < TAG_LEN {
        return Err(ChunkError::Shape(format!(
            "an encrypted body of {} bytes does not end in a whole chunk tag",
            buffer.len()
        )));
    }
    let mut plain_len = 0;
    for i in 0..count {
        let start = i * sealed;
        let end = (start + sealed).min(buffer.len());
        let nonce = chunk_nonce(prefix, i, i + 1 == count)
            .ok_or_else(|| ChunkError::Shape("too many chunks".into()))?;
        let opened = opener
            .open_in_place(nonce, Aad::from(header), &mut buffer[start..end])
            .map_err(|_| ChunkError::Tag)?
            .len();
        buffer.copy_within(start..start + opened, plain_len);
        plain_len += opened;
    }
    Ok(plain_len)
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
            Ok(mut decoder) => {
                // A frame may ask for a window of up to 128 MiB before the
                // output cap applies: allow no more than the body needs, but
                // at least 8 MiB (what zstd levels up to 19 use when the
                // size is not known in advance; ours is level 3, 2 MiB).
                let log = (u64::BITS - expected.leading_zeros()).clamp(23, 27);
                match decoder.window_log_max(log) {
                    Ok(()) => decoder.take(cap).read_to_end(&mut out),
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        },
    };
    result.map_err(|e| format!("{} body does not decompress: {e}", codec.name()))?;
    Ok(out)
}

#[cfg(test)]
mod tests;
