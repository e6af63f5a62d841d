//! Arbitrary bytes as a spooled segment object: the reader returns pages or
//! an error naming the object, never panics, and stays within its limits.

#![no_main]

use binx_spool::{SegmentLimits, decode_segment};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = SegmentLimits {
        max_pages: 1024,
        max_body_bytes: 1 << 20,
    };
    for key in [None, Some(&[7u8; 32])] {
        if let Ok((_, pages)) = decode_segment("fuzz", data, key, limits) {
            assert!(pages.len() <= 1024);
            assert!(pages.iter().map(|p| p.len()).sum::<usize>() <= 1 << 20);
        }
    }
});
