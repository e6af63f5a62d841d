use super::*;
use proptest::prelude::*;

fn doc_vector(name: &str) -> Vec<u8> {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/PROTOCOL.md"
    ))
    .expect("docs/PROTOCOL.md");
    let start = doc
        .find(&format!("<!-- vector: {name} -->"))
        .expect("vector in the doc");
    let block = &doc[start..];
    let block = &block[block.find("```hex\n").expect("hex block") + 7..];
    let block = &block[..block.find("```").expect("end of block")];
    block
        .lines()
        .flat_map(|l| {
            l.trim_start()
                .split("  ")
                .next()
                .unwrap_or("")
                .split_whitespace()
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .map(|h| u8::from_str_radix(&h, 16).expect("hex"))
        .collect()
}

fn pages(texts: &[&'static [u8]]) -> Vec<Bytes> {
    texts.iter().map(|t| Bytes::from_static(t)).collect()
}

const LIMITS: SegmentLimits = SegmentLimits {
    max_pages: 1 << 20,
    max_body_bytes: 1 << 30,
};

#[test]
fn the_documented_vectors_decode_and_format_2_encodes_byte_for_byte() {
    // Format 1, as binx 0.1 wrote it: still read.
    let wire = doc_vector("segment-none");
    let (first, got) = decode_segment("vector", &wire, None, LIMITS).unwrap();
    assert_eq!(first, 42);
    assert_eq!(got, pages(&[b"abc", b"hello"]));
    // Format 2, what binx writes.
    let wire = doc_vector("segment-v2-none");
    let (first, got) = decode_segment("vector", &wire, None, LIMITS).unwrap();
    assert_eq!((first, &got), (42, &pages(&[b"abc", b"hello"])));
    let built = encode_segment(42, &got, Codec::None, None).unwrap();
    assert_eq!(built.to_vec(), wire);
}

#[test]
fn an_encrypted_format_2_vector_from_another_implementation_decodes() {
    let wire = doc_vector("segment-v2-aes");
    let key: [u8; 32] = std::array::from_fn(|i| i as u8);
    let (first, got) = decode_segment("vector", &wire, Some(&key), LIMITS).unwrap();
    assert_eq!((first, got), (42, pages(&[b"abc", b"hello"])));
    let mut wrong = key;
    wrong[0] ^= 1;
    assert!(matches!(
        decode_segment("vector", &wire, Some(&wrong), LIMITS),
        Err(SegmentError::Decrypt { .. })
    ));
}

/// Re-seals `object`'s CRC after a change, as an attacker who can write
/// the store could (the CRC is no MAC).
fn reseal_crc(object: &mut [u8]) {
    let end = object.len() - 4;
    let crc = crc32c::crc32c(&object[..end]);
    object[end..].copy_from_slice(&crc.to_be_bytes());
}

#[test]
fn format_2_chunks_are_bound_to_their_place_and_the_end() {
    let key = new_key().unwrap();
    // Incompressible pages over three chunks: 2.5 MiB.
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let big: Vec<u8> = (0..(5 << 19))
        .map(|_| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng as u8
        })
        .collect();
    let input = vec![Bytes::from(big), Bytes::from_static(b"tail")];
    let object = encode_segment(9, &input, Codec::None, Some(&key))
        .unwrap()
        .to_vec();
    let (_, output) = decode_segment("o", &object, Some(&key), LIMITS).unwrap();
    assert_eq!(output, input);
    let header = FIXED_HEADER_V2 + 8 * input.len() + NONCE_PREFIX_LEN;
    let sealed = CHUNK_SIZE as usize + TAG_LEN;
    assert_eq!(
        object.len(),
        header + 2 * sealed + (input[0].len() + 4 - 2 * CHUNK_SIZE as usize) + TAG_LEN + 4
    );

    // Cut after the second chunk, CRC made right again: the second chunk
    // was not sealed as the last one, so the object is refused.
    let mut cut = object[..header + 2 * sealed].to_vec();
    cut.extend_from_slice(&[0; 4]);
    reseal_crc(&mut cut);
    assert!(matches!(
        decode_segment("o", &cut, Some(&key), LIMITS),
        Err(SegmentError::Decrypt { .. })
    ));
    // Two chunks swapped: each is sealed to its index.
    let mut swapped = object.clone();
    let (a, b) = (header, header + sealed);
    let first: Vec<u8> = swapped[a..b].to_vec();
    swapped.copy_within(b..b + sealed, a);
    swapped[b..b + sealed].copy_from_slice(&first);
    reseal_crc(&mut swapped);
    assert!(matches!(
        decode_segment("o", &swapped, Some(&key), LIMITS),
        Err(SegmentError::Decrypt { .. })
    ));
    // A chunk size out of range, or a body that ends inside a tag.
    let mut odd = object.clone();
    odd[20..24].copy_from_slice(&1024u32.to_be_bytes());
    reseal_crc(&mut odd);
    assert!(matches!(
        decode_segment("o", &odd, Some(&key), LIMITS),
        Err(SegmentError::Corrupt { .. })
    ));
    let mut short = object[..header + 2 * sealed + 7].to_vec();
    short.extend_from_slice(&[0; 4]);
    reseal_crc(&mut short);
    assert!(matches!(
        decode_segment("o", &short, Some(&key), LIMITS),
        Err(SegmentError::Corrupt { .. })
    ));
    // An empty segment is one empty chunk: its tag alone.
    let empty = encode_segment(3, &[], Codec::Zstd, Some(&key)).unwrap();
    assert_eq!(
        decode_segment("o", &empty, Some(&key), LIMITS).unwrap(),
        (3, vec![])
    );
}

#[test]
fn every_codec_with_and_without_encryption_round_trips() {
    let key = new_key().unwrap();
    let input: Vec<Bytes> = (0..50u8)
        .map(|i| Bytes::from(vec![i; usize::from(i) * 100]))
        .collect();
    for codec in [Codec::None, Codec::Lz4, Codec::Zstd] {
        for key in [None, Some(&key)] {
            let object = encode_segment(7, &input, codec, key).unwrap();
            let (first, output) = decode_segment("o", &object, key, LIMITS).unwrap();
            assert_eq!(
                (first, &output),
                (7, &input),
                "{codec:?} encrypted={}",
                key.is_some()
            );
            // From a Bytes of its own: the same pages; uncompressed, they
            // are slices of the object itself (decrypted in place when
            // encrypted), not copies.
            let owned = Bytes::from(object.to_vec());
            let range = owned.as_ptr_range();
            let (first, shared) = decode_segment_shared("o", owned, key, LIMITS).unwrap();
            assert_eq!((first, &shared), (7, &input), "{codec:?} shared");
            let inside = |page: &Bytes| page.is_empty() || range.contains(&page.as_ptr());
            assert_eq!(
                shared.iter().all(inside),
                codec == Codec::None,
                "{codec:?} encrypted={}",
                key.is_some()
            );
            // Held elsewhere too: decoded from a copy, the object untouched.
            let (first, copied) = decode_segment_shared("o", object.clone(), key, LIMITS).unwrap();
            assert_eq!((first, &copied), (7, &input), "{codec:?} copied");
            assert_eq!(decode_segment("o", &object, key, LIMITS).unwrap().1, input);
            if codec != Codec::None {
                assert!(
                    object.len() < input.iter().map(Bytes::len).sum::<usize>() / 4,
                    "{codec:?} did not compress"
                );
            }
        }
    }
}

#[test]
fn the_key_is_never_in_the_object_and_each_object_has_its_own_nonce() {
    let key = new_key().unwrap();
    let input = pages(&[b"secret page"]);
    let a = encode_segment(0, &input, Codec::None, Some(&key)).unwrap();
    let b = encode_segment(0, &input, Codec::None, Some(&key)).unwrap();
    assert!(
        !a.windows(32).any(|w| w == key),
        "the key is stored in the object"
    );
    assert!(
        !a.windows(11).any(|w| w == b"secret page"),
        "the page is stored in clear"
    );
    assert_ne!(
        a, b,
        "two encryptions of the same pages are identical (nonce reused)"
    );
}

#[test]
fn damage_wrong_keys_and_tampering_are_clear_errors_naming_the_object() {
    let key = new_key().unwrap();
    let input = pages(&[b"abc", b"hello"]);
    for (codec, k) in [
        (Codec::None, None),
        (Codec::Zstd, Some(&key)),
        (Codec::Lz4, Some(&key)),
    ] {
        let object = encode_segment(1, &input, codec, k).unwrap();
        for i in 0..object.len() {
            let mut bad = object.to_vec();
            bad[i] ^= 0x01;
            let err =
                decode_segment("s3://bucket/seg-1", &bad, k, LIMITS).expect_err("a flipped byte");
            assert!(err.to_string().contains("s3://bucket/seg-1"), "{err}");
        }
        assert!(decode_segment("o", &object[..object.len() - 1], k, LIMITS).is_err());
    }
    let object = encode_segment(1, &input, Codec::None, Some(&key)).unwrap();
    let err = decode_segment("seg-2", &object, Some(&new_key().unwrap()), LIMITS).unwrap_err();
    assert!(matches!(err, SegmentError::Decrypt { .. }), "{err}");
    assert!(matches!(
        decode_segment("seg-2", &object, None, LIMITS),
        Err(SegmentError::KeyMissing { .. })
    ));
    // Someone who changes the header and recomputes the CRC is caught by the
    // authenticated header (AAD).
    let mut forged = object.to_vec();
    forged[12..20].copy_from_slice(&99u64.to_be_bytes());
    let body_end = forged.len() - 4;
    let crc = crc32c::crc32c(&forged[..body_end]);
    forged[body_end..].copy_from_slice(&crc.to_be_bytes());
    assert!(matches!(
        decode_segment("seg-3", &forged, Some(&key), LIMITS),
        Err(SegmentError::Decrypt { .. })
    ));
}

#[test]
fn declared_sizes_are_bounded_before_anything_is_inflated() {
    let big = Bytes::from(vec![0u8; 1 << 20]);
    let object = encode_segment(0, &[big], Codec::Zstd, None).unwrap();
    let tight = SegmentLimits {
        max_pages: 10,
        max_body_bytes: 1000,
    };
    let err = decode_segment("bomb", &object, None, tight).unwrap_err();
    assert!(
        err.to_string()
            .contains("more than the limit of 1000 bytes"),
        "{err}"
    );
    // A header that understates the body: the decompressed size is checked.
    let mut lying = object.to_vec();
    // Format 2: the first page size follows chunk_size, at offset 24.
    lying[24..32].copy_from_slice(&10u64.to_be_bytes());
    let body_end = lying.len() - 4;
    let crc = crc32c::crc32c(&lying[..body_end]);
    lying[body_end..].copy_from_slice(&crc.to_be_bytes());
    let err = decode_segment("liar", &lying, None, LIMITS).unwrap_err();
    assert!(err.to_string().contains("page sizes add up to 10"), "{err}");
}

/// What a reader believes a writer may store for some pages is at least
/// what it stores: incompressible pages, every codec, sealed or not, from
/// none to several chunks.
#[test]
fn no_segment_is_larger_than_its_pages_bound() {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let noise: Vec<u8> = (0..3 * CHUNK_SIZE as usize + 17)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    let key = [5u8; 32];
    for pages in [
        vec![],
        vec![Bytes::new(); 1000],
        vec![Bytes::copy_from_slice(&noise[..1])],
        vec![Bytes::from(noise.clone())],
        noise.chunks(977).map(Bytes::copy_from_slice).collect(),
    ] {
        let bytes = pages.iter().map(|p| p.len() as u64).sum();
        let bound = max_stored_size(pages.len() as u64, bytes);
        for codec in [Codec::None, Codec::Lz4, Codec::Zstd] {
            for key in [None, Some(&key)] {
                let object = encode_segment(3, &pages, codec, key).unwrap();
                assert!(
                    object.len() as u64 <= bound,
                    "{} pages of {bytes} bytes, {codec:?}, sealed {}: {} > {bound}",
                    pages.len(),
                    key.is_some(),
                    object.len()
                );
            }
        }
    }
}

proptest! {
    #[test]
    fn arbitrary_pages_round_trip(
        first in any::<u64>(),
        input in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..300), 0..20),
        codec in prop_oneof![Just(Codec::None), Just(Codec::Lz4), Just(Codec::Zstd)],
        encrypted in any::<bool>(),
    ) {
        let key = [9u8; 32];
        let key = encrypted.then_some(&key);
        let input: Vec<Bytes> = input.into_iter().map(Bytes::from).collect();
        let object = encode_segment(first, &input, codec, key).unwrap();
        let bytes = input.iter().map(|p| p.len() as u64).sum();
        prop_assert!(object.len() as u64 <= max_stored_size(input.len() as u64, bytes));
        let (got_first, output) = decode_segment("p", &object, key, LIMITS).unwrap();
        prop_assert_eq!(got_first, first);
        prop_assert_eq!(output, input);
    }

    /// Format 2 headers that parse, with any chunk size field, flags, page
    /// sizes and body (a valid CRC): the chunk arithmetic never panics, and
    /// only a body sealed with the key ever decodes.
    #[test]
    fn hostile_format_2_bodies_never_panic(
        chunk in prop_oneof![Just(65536u32), Just(16_777_216u32), any::<u32>()],
        encrypted in any::<bool>(),
        sizes in prop::collection::vec(0u64..70_000, 0..4),
        body in prop::collection::vec(any::<u8>(), 0..140_000),
    ) {
        let mut object = b"BXS2".to_vec();
        object.extend_from_slice(&[0, u8::from(encrypted), 0, 0]);
        object.extend_from_slice(&(sizes.len() as u32).to_be_bytes());
        object.extend_from_slice(&5u64.to_be_bytes());
        object.extend_from_slice(&chunk.to_be_bytes());
        for s in &sizes {
            object.extend_from_slice(&s.to_be_bytes());
        }
        if encrypted {
            object.extend_from_slice(&[7; 7]);
        }
        object.extend_from_slice(&body);
        object.extend_from_slice(&[0; 4]);
        reseal_crc(&mut object);
        let key = [3u8; 32];
        let result = decode_segment("p", &object, encrypted.then_some(&key), LIMITS);
        // The in-place reader agrees with the copying one on every input.
        let shared = decode_segment_shared("p", Bytes::from(object.clone()), encrypted.then_some(&key), LIMITS);
        prop_assert_eq!(
            result.as_ref().map_err(|e| e.to_string()),
            shared.as_ref().map_err(|e| e.to_string())
        );
        if encrypted {
            prop_assert!(result.is_err(), "random bytes opened as sealed chunks");
        } else if let Ok((_, pages)) = result {
            prop_assert_eq!(pages.iter().map(|p| p.len() as u64).sum::<u64>(), body.len() as u64);
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(data in prop::collection::vec(any::<u8>(), 0..600), with_magic in any::<bool>()) {
        let mut data = data;
        if with_magic && data.len() >= 4 {
            let magic: &[u8; 4] = if data[0] & 1 == 0 { b"BXS1" } else { b"BXS2" };
            data[..4].copy_from_slice(magic);
            // A CRC that holds, so the parser past it is what gets exercised.
            if data.len() >= 8 {
                let end = data.len() - 4;
                let crc = crc32c::crc32c(&data[..end]);
                data[end..].copy_from_slice(&crc.to_be_bytes());
            }
        }
        let limits = SegmentLimits { max_pages: 64, max_body_bytes: 1 << 16 };
        let _ = decode_segment("fuzz", &data, Some(&[1u8; 32]), limits);
        let _ = decode_segment_shared("fuzz", Bytes::from(data.clone()), Some(&[1u8; 32]), limits);
        let _ = decode_segment_shared("fuzz", Bytes::from(data), None, limits);
    }
}

#[test]
fn a_plain_object_where_an_encrypted_one_was_expected_is_refused() {
    let plain = encode_segment(3, &pages(&[b"forged"]), Codec::None, None).unwrap();
    let key = [9u8; 32];
    let err = decode_segment("seg-x", &plain, Some(&key), LIMITS).unwrap_err();
    assert!(
        matches!(&err, SegmentError::NotEncrypted { object } if object == "seg-x"),
        "{err}"
    );
    // Without a key it is read as the plain object it is.
    let (first, read) = decode_segment("seg-x", &plain, None, LIMITS).unwrap();
    assert_eq!((first, read), (3, pages(&[b"forged"])));
}

/// A zstd frame asking for a 128 MiB window (legal, and allowed by zstd's
/// default limit) is refused before the decoder reserves it: no body of a
/// few KiB needs more than 8 MiB.
#[test]
fn a_zstd_frame_asking_for_a_huge_window_is_refused() {
    let body = vec![7u8; 4096];
    let mut encoder = zstd::stream::Encoder::new(Vec::new(), 3).expect("encoder");
    encoder.window_log(27).expect("window log");
    std::io::Write::write_all(&mut encoder, &body).expect("compress");
    let frame = encoder.finish().expect("finish");
    let error = match super::decompress(Codec::Zstd, &frame, body.len() as u64) {
        Ok(out) => panic!(
            "a 128 MiB window for 4 KiB was accepted ({} bytes)",
            out.len()
        ),
        Err(error) => error,
    };
    assert!(error.contains("zstd"), "{error}");
    // Our own frames still decode.
    let ours = zstd::stream::encode_all(&body[..], 3).expect("compress");
    assert_eq!(
        super::decompress(Codec::Zstd, &ours, body.len() as u64).expect("decode"),
        body
    );
}
