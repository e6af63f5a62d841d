//! Arbitrary bytes as a spooled segment object: both readers (copying, and
//! in place from a `Bytes` of its own) return the same pages or the same
//! error naming the object, never panic, and stay within their limits.

#![no_main]

use binx_spool::{SegmentLimits, decode_segment, decode_segment_shared};
use bytes::Bytes;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = SegmentLimits {
        max_pages: 1024,
        max_body_bytes: 1 << 20,
    };
    for key in [None, Some(&[7u8; 32])] {
        let copied = decode_segment("fuzz", data, key, limits);
        let in_place = decode_segment_shared("fuzz", Bytes::copy_from_slice(data), key, limits);
        assert_eq!(
            copied.as_ref().map_err(|e| e.to_string()),
            in_place.as_ref().map_err(|e| e.to_string())
        );
        if let Ok((_, pages)) = copied {
            assert!(pages.len() <= 1024);
            assert!(pages.iter().map(|p| p.len()).sum::<usize>() <= 1 << 20);
        }
    }
});
