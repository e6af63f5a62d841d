//! Where everything lives in a region. One region carries one direction:
//! its writer fills slots and submits descriptors, its reader copies them
//! out and returns the slots. docs/PROTOCOL.md section 6 documents this
//! layout byte by byte; keep the two in step.

use crate::ShmError;

/// `BXSM` read as a little-endian u32.
pub const MAGIC: u32 = u32::from_le_bytes(*b"BXSM");
/// The layout version this crate writes and reads.
pub const VERSION: u32 = 1;

/// Bytes of the header: the fields below, each hot word on its own cache line.
pub const HEADER_SIZE: usize = 512;

// Header fields (offsets in bytes).
/// u32: [`MAGIC`].
pub const MAGIC_AT: usize = 0;
/// u32: [`VERSION`].
pub const VERSION_AT: usize = 4;
/// u32: the number of slots.
pub const SLOT_COUNT_AT: usize = 8;
/// u32: bytes per slot.
pub const SLOT_SIZE_AT: usize = 12;
/// u64: bytes of the whole region.
pub const REGION_SIZE_AT: usize = 16;
/// u64: offset of the submit ring.
pub const SUBMIT_RING_AT: usize = 24;
/// u64: offset of the complete ring.
pub const COMPLETE_RING_AT: usize = 32;
/// u64: offset of the first slot.
pub const SLOTS_AT: usize = 40;
/// u64, written by the writer: descriptors submitted so far.
pub const SUBMIT_HEAD_AT: usize = 64;
/// u32, written by the reader: 1 while it is parked (or about to park) on
/// the submit eventfd, so the writer knows a wake-up is needed.
pub const READER_WAITING_AT: usize = 128;
/// u64, written by the reader: slots returned so far.
pub const COMPLETE_HEAD_AT: usize = 192;
/// u32, written by the writer: 1 while it waits for a slot to come back.
pub const WRITER_WAITING_AT: usize = 256;

/// A submit-ring entry: slot u32, generation u32, offset u32, length u32.
pub const DESCRIPTOR_SIZE: usize = 16;
/// A complete-ring entry: slot u32, generation u32.
pub const COMPLETION_SIZE: usize = 8;

const PAGE: usize = 4096;
/// Slots are at least this large, and a multiple of it.
pub const MIN_SLOT_SIZE: usize = PAGE;
/// Slots are at most this large (lengths travel as u32).
pub const MAX_SLOT_SIZE: usize = 64 << 20;
/// At most this many slots per region.
pub const MAX_SLOTS: usize = 1 << 16;

fn check_slot_size(slot_size: usize) -> Result<(), ShmError> {
    if !(MIN_SLOT_SIZE..=MAX_SLOT_SIZE).contains(&slot_size) || !slot_size.is_multiple_of(PAGE) {
        return Err(ShmError::Config(format!(
            "slot size {slot_size} must be a multiple of {PAGE} between {MIN_SLOT_SIZE} and {MAX_SLOT_SIZE} bytes"
        )));
    }
    Ok(())
}

/// The geometry of one region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Bytes of the whole region: header, rings and slots.
    pub region_size: usize,
    /// Bytes per slot, a multiple of the 4096-byte page.
    pub slot_size: usize,
    /// Number of slots (and of entries in each ring).
    pub slot_count: usize,
    /// Offset in bytes of the submit ring (right after the header).
    pub submit_ring: usize,
    /// Offset in bytes of the complete ring (right after the submit ring).
    pub complete_ring: usize,
    /// Offset in bytes of the first slot, page-aligned.
    pub slots: usize,
}

impl Layout {
    /// As many slots of `slot_size` as fit in `region_size` with the header
    /// and both rings.
    pub fn new(region_size: usize, slot_size: usize) -> Result<Layout, ShmError> {
        check_slot_size(slot_size)?;
        let per_slot = slot_size + DESCRIPTOR_SIZE + COMPLETION_SIZE;
        let slot_count = (region_size.saturating_sub(HEADER_SIZE + PAGE) / per_slot).min(MAX_SLOTS);
        if slot_count < 2 {
            return Err(ShmError::Config(format!(
                "a region of {region_size} bytes holds fewer than 2 slots of {slot_size} bytes"
            )));
        }
        let layout = Layout::with_slots(slot_count, slot_size)?;
        debug_assert!(layout.region_size <= region_size);
        Ok(layout)
    }

    /// The geometry of `slot_count` slots of `slot_size`: header, submit
    /// ring, complete ring, then the slots from the next page boundary.
    pub fn with_slots(slot_count: usize, slot_size: usize) -> Result<Layout, ShmError> {
        check_slot_size(slot_size)?;
        if !(2..=MAX_SLOTS).contains(&slot_count) {
            return Err(ShmError::Config(format!(
                "{slot_count} slots: a region has between 2 and {MAX_SLOTS}"
            )));
        }
        let submit_ring = HEADER_SIZE;
        let complete_ring = submit_ring + slot_count * DESCRIPTOR_SIZE;
        let slots = (complete_ring + slot_count * COMPLETION_SIZE).next_multiple_of(PAGE);
        Ok(Layout {
            region_size: slots + slot_count * slot_size,
            slot_size,
            slot_count,
            submit_ring,
            complete_ring,
            slots,
        })
    }

    /// The header a region starts with, in the region's byte order (native).
    pub fn header(&self) -> [u8; HEADER_SIZE] {
        let mut h = [0u8; HEADER_SIZE];
        h[MAGIC_AT..MAGIC_AT + 4].copy_from_slice(&MAGIC.to_ne_bytes());
        h[VERSION_AT..VERSION_AT + 4].copy_from_slice(&VERSION.to_ne_bytes());
        h[SLOT_COUNT_AT..SLOT_COUNT_AT + 4]
            .copy_from_slice(&(self.slot_count as u32).to_ne_bytes());
        h[SLOT_SIZE_AT..SLOT_SIZE_AT + 4].copy_from_slice(&(self.slot_size as u32).to_ne_bytes());
        for (at, value) in [
            (REGION_SIZE_AT, self.region_size),
            (SUBMIT_RING_AT, self.submit_ring),
            (COMPLETE_RING_AT, self.complete_ring),
            (SLOTS_AT, self.slots),
        ] {
            h[at..at + 8].copy_from_slice(&(value as u64).to_ne_bytes());
        }
        h
    }

    /// Reads and checks the header of a region of `mapped` bytes: the
    /// geometry must be exactly what [`Layout::new`] gives for it.
    pub fn parse(header: &[u8], mapped: usize) -> Result<Layout, ShmError> {
        let bad = |what: String| ShmError::BadHeader(what);
        if header.len() < HEADER_SIZE {
            return Err(bad(format!(
                "region of {} bytes has no header",
                header.len()
            )));
        }
        let u32_at = |at: usize| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&header[at..at + 4]);
            u32::from_ne_bytes(b)
        };
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&header[at..at + 8]);
            u64::from_ne_bytes(b)
        };
        if u32_at(MAGIC_AT) != MAGIC {
            return Err(bad(format!("magic {:#010x} is not BXSM", u32_at(MAGIC_AT))));
        }
        if u32_at(VERSION_AT) != VERSION {
            return Err(bad(format!(
                "layout version {} is not {VERSION}",
                u32_at(VERSION_AT)
            )));
        }
        let region_size = usize::try_from(u64_at(REGION_SIZE_AT)).unwrap_or(usize::MAX);
        if region_size > mapped {
            return Err(bad(format!(
                "region size {region_size} exceeds the {mapped} bytes mapped"
            )));
        }
        let expected = Layout::with_slots(
            u32_at(SLOT_COUNT_AT) as usize,
            u32_at(SLOT_SIZE_AT) as usize,
        )
        .map_err(|e| bad(e.to_string()))?;
        let found = Layout {
            region_size,
            slot_size: u32_at(SLOT_SIZE_AT) as usize,
            slot_count: u32_at(SLOT_COUNT_AT) as usize,
            submit_ring: u64_at(SUBMIT_RING_AT) as usize,
            complete_ring: u64_at(COMPLETE_RING_AT) as usize,
            slots: u64_at(SLOTS_AT) as usize,
        };
        if found != expected {
            return Err(bad(format!(
                "geometry {found:?} does not match {expected:?}"
            )));
        }
        Ok(found)
    }

    /// Byte range of slot `slot` in the region.
    pub fn slot_range(&self, slot: usize) -> std::ops::Range<usize> {
        let start = self.slots + slot * self.slot_size;
        start..start + self.slot_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_fits_and_round_trips_through_the_header() {
        for (region, slot) in [(64 << 20, 256 << 10), (1 << 20, 4096), (8 << 20, 1 << 20)] {
            let layout = Layout::new(region, slot).unwrap();
            assert!(layout.region_size <= region);
            assert!(layout.slots.is_multiple_of(4096));
            assert!(layout.complete_ring + layout.slot_count * COMPLETION_SIZE <= layout.slots);
            assert_eq!(
                layout.slot_range(layout.slot_count - 1).end,
                layout.region_size
            );
            assert_eq!(
                Layout::parse(&layout.header(), layout.region_size).unwrap(),
                layout
            );
        }
    }

    #[test]
    fn bad_geometry_and_headers_are_refused() {
        assert!(Layout::new(64 << 20, 1000).is_err());
        assert!(Layout::new(8192, 4096).is_err());
        let layout = Layout::new(1 << 20, 4096).unwrap();
        let mut h = layout.header();
        assert!(
            Layout::parse(&h, layout.region_size - 1)
                .unwrap_err()
                .to_string()
                .contains("exceeds")
        );
        h[SLOT_COUNT_AT] ^= 1;
        assert!(
            Layout::parse(&h, layout.region_size)
                .unwrap_err()
                .to_string()
                .contains("geometry")
        );
        h[MAGIC_AT] = b'X';
        assert!(
            Layout::parse(&h, layout.region_size)
                .unwrap_err()
                .to_string()
                .contains("magic")
        );
    }
}
