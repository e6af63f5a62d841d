//! binx spooling. So far: the spooled segment object, format 1
//! (PROTOCOL.md section 6). Stores, policies and the lifecycle of spooled
//! objects are still to come (issue 3).

pub mod segment;

pub use segment::{Codec, SegmentError, SegmentLimits, decode_segment, encode_segment, new_key};
