//! The two rings of a region as plain state machines, without I/O: the
//! writer takes free slots, fills them and submits descriptors; the reader
//! takes descriptors and completes the slots once done with the bytes, in
//! any order. A slot comes back only through the complete ring, so slots in
//! flight are both recycling and backpressure.
//!
//! Each side keeps its own indices and its own record of every slot, and
//! checks whatever it reads from the shared rings against them: a peer that
//! scribbles over the region gets an error naming what it broke, never an
//! out-of-bounds access on our side.

use std::sync::atomic::{Ordering, fence};

use crate::ShmError;
use crate::layout::{
    COMPLETE_HEAD_AT, COMPLETION_SIZE, DESCRIPTOR_SIZE, READER_WAITING_AT, SUBMIT_HEAD_AT,
    WRITER_WAITING_AT,
};
use crate::mapping::Mapping;

/// A run of stream bytes in one slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Descriptor {
    /// Index of the slot in the region.
    pub slot: u32,
    /// The slot's use count, bumped on every lease, so a stale or repeated
    /// completion is caught.
    pub generation: u32,
    /// Where the bytes start in the slot, in bytes.
    pub offset: u32,
    /// How many bytes.
    pub length: u32,
}

/// A slot the writer holds and is filling.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    /// Index of the slot in the region.
    pub slot: u32,
    /// The generation the slot will be submitted with (one past its last).
    pub generation: u32,
}

/// The writing side of one region.
pub struct SlotWriter {
    /// Free slots, most recently returned last: reusing a warm slot keeps the
    /// memory touched small and in cache.
    free: Vec<u32>,
    /// Generation each slot was last submitted with.
    generation: Vec<u32>,
    in_flight: Vec<bool>,
    submitted: u64,
    reclaimed: u64,
}

impl SlotWriter {
    /// The writer of a fresh region: every slot free, the submit head reset
    /// to 0.
    pub fn new(region: &Mapping) -> Self {
        let count = region.layout().slot_count;
        region.word64(SUBMIT_HEAD_AT).store(0, Ordering::Release);
        SlotWriter {
            free: (0..count as u32).rev().collect(),
            generation: vec![0; count],
            in_flight: vec![false; count],
            submitted: 0,
            reclaimed: 0,
        }
    }

    /// A free slot, after taking back whatever the reader completed; `None`
    /// when every slot is in flight. Taking back first (one atomic load when
    /// nothing came back) lets the slot the reader just emptied, still in
    /// cache, be filled again, instead of cycling through the whole region.
    pub fn acquire(&mut self, region: &Mapping) -> Result<Option<Lease>, ShmError> {
        self.reclaim(region)?;
        Ok(self.free.pop().map(|slot| Lease {
            slot,
            generation: self.generation[slot as usize].wrapping_add(1),
        }))
    }

    /// Takes back completed slots, checking each against what is in flight.
    pub fn reclaim(&mut self, region: &Mapping) -> Result<usize, ShmError> {
        let layout = region.layout();
        let count = layout.slot_count as u64;
        let head = region.word64(COMPLETE_HEAD_AT).load(Ordering::Acquire);
        let pending = head.wrapping_sub(self.reclaimed);
        if pending > count {
            return Err(ShmError::Ring(format!(
                "complete ring head {head} is {pending} entries past the {} taken back, more than the {count} slots",
                self.reclaimed
            )));
        }
        for _ in 0..pending {
            let at = layout.complete_ring + (self.reclaimed % count) as usize * COMPLETION_SIZE;
            let entry = region.word64(at).load(Ordering::Relaxed);
            let (slot, generation) = (entry as u32, (entry >> 32) as u32);
            let index = slot as usize;
            if index >= layout.slot_count {
                return Err(ShmError::Ring(format!(
                    "completion {} names slot {slot}, but the region has {count} slots",
                    self.reclaimed
                )));
            }
            if !self.in_flight[index] || self.generation[index] != generation {
                return Err(ShmError::Ring(format!(
                    "completion {} returns slot {slot} generation {generation}, which is not in flight (in flight: {}, last generation {})",
                    self.reclaimed, self.in_flight[index], self.generation[index]
                )));
            }
            self.in_flight[index] = false;
            self.free.push(slot);
            self.reclaimed += 1;
        }
        Ok(pending as usize)
    }

    /// Publishes `length` bytes at `offset` of a leased slot.
    pub fn submit(&mut self, region: &Mapping, lease: Lease, offset: u32, length: u32) {
        let layout = region.layout();
        let index = lease.slot as usize;
        debug_assert!(offset as usize + length as usize <= layout.slot_size);
        self.generation[index] = lease.generation;
        self.in_flight[index] = true;
        let at = layout.submit_ring
            + (self.submitted % layout.slot_count as u64) as usize * DESCRIPTOR_SIZE;
        let first = u64::from(lease.slot) | u64::from(lease.generation) << 32;
        let second = u64::from(offset) | u64::from(length) << 32;
        region.word64(at).store(first, Ordering::Relaxed);
        region.word64(at + 8).store(second, Ordering::Relaxed);
        self.submitted += 1;
        region
            .word64(SUBMIT_HEAD_AT)
            .store(self.submitted, Ordering::Release);
    }

    /// Gives back a leased slot unused.
    pub fn release(&mut self, lease: Lease) {
        self.free.push(lease.slot);
    }

    /// Slots the reader holds or has not yet taken.
    pub fn in_flight(&self) -> usize {
        self.in_flight.iter().filter(|f| **f).count()
    }

    /// Whether the reader is parked and must be woken after a submit. The
    /// fence pairs with the reader's in [`SlotReader::park`]: either it sees
    /// our new head, or we see its flag.
    pub fn reader_parked(region: &Mapping) -> bool {
        fence(Ordering::SeqCst);
        region.word32(READER_WAITING_AT).load(Ordering::Relaxed) != 0
    }

    /// Announces that the writer waits for a slot (or stops waiting).
    /// After setting it, call [`SlotWriter::reclaim`] once more before
    /// sleeping.
    pub fn park(region: &Mapping, waiting: bool) {
        region
            .word32(WRITER_WAITING_AT)
            .store(u32::from(waiting), Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Slots the reader has completed that this writer has not taken back.
    pub fn completions_waiting(&self, region: &Mapping) -> bool {
        region.word64(COMPLETE_HEAD_AT).load(Ordering::Acquire) != self.reclaimed
    }
}

/// The reading side of one region.
pub struct SlotReader {
    /// Generation each slot was last seen with.
    generation: Vec<u32>,
    held: Vec<bool>,
    taken: u64,
    completed: u64,
}

impl SlotReader {
    /// The reader of a fresh region: no slot held, the complete head reset
    /// to 0.
    pub fn new(region: &Mapping) -> Self {
        let count = region.layout().slot_count;
        region.word64(COMPLETE_HEAD_AT).store(0, Ordering::Release);
        SlotReader {
            generation: vec![0; count],
            held: vec![false; count],
            taken: 0,
            completed: 0,
        }
    }

    /// Whether the writer has submitted a descriptor not yet taken.
    pub fn has_next(&self, region: &Mapping) -> bool {
        region.word64(SUBMIT_HEAD_AT).load(Ordering::Acquire) != self.taken
    }

    /// The next descriptor, checked: a slot of this region that this reader
    /// does not hold, the next generation of that slot, a non-empty range
    /// within the slot.
    pub fn next(&mut self, region: &Mapping) -> Result<Option<Descriptor>, ShmError> {
        let layout = region.layout();
        let count = layout.slot_count as u64;
        let head = region.word64(SUBMIT_HEAD_AT).load(Ordering::Acquire);
        let pending = head.wrapping_sub(self.taken);
        if pending == 0 {
            return Ok(None);
        }
        if pending > count {
            return Err(ShmError::Ring(format!(
                "submit ring head {head} is {pending} entries past the {} taken, more than the {count} slots",
                self.taken
            )));
        }
        let at = layout.submit_ring + (self.taken % count) as usize * DESCRIPTOR_SIZE;
        let first = region.word64(at).load(Ordering::Relaxed);
        let second = region.word64(at + 8).load(Ordering::Relaxed);
        let d = Descriptor {
            slot: first as u32,
            generation: (first >> 32) as u32,
            offset: second as u32,
            length: (second >> 32) as u32,
        };
        let index = d.slot as usize;
        let problem = if index >= layout.slot_count {
            Some(format!(
                "names slot {}, but the region has {count} slots",
                d.slot
            ))
        } else if self.held[index] {
            Some(format!("names slot {}, which was not yet returned", d.slot))
        } else if d.generation != self.generation[index].wrapping_add(1) {
            Some(format!(
                "gives slot {} generation {}, expected {}",
                d.slot,
                d.generation,
                self.generation[index].wrapping_add(1)
            ))
        } else if d.length == 0 || d.offset as usize + d.length as usize > layout.slot_size {
            Some(format!(
                "gives offset {} and length {}, outside the slot of {} bytes (or empty)",
                d.offset, d.length, layout.slot_size
            ))
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(ShmError::Ring(format!(
                "descriptor {} {problem}",
                self.taken
            )));
        }
        self.held[index] = true;
        self.generation[index] = d.generation;
        self.taken += 1;
        Ok(Some(d))
    }

    /// Returns a slot to the writer.
    pub fn complete(&mut self, region: &Mapping, d: Descriptor) {
        let layout = region.layout();
        let index = d.slot as usize;
        debug_assert!(self.held[index]);
        self.held[index] = false;
        let at = layout.complete_ring
            + (self.completed % layout.slot_count as u64) as usize * COMPLETION_SIZE;
        region.word64(at).store(
            u64::from(d.slot) | u64::from(d.generation) << 32,
            Ordering::Relaxed,
        );
        self.completed += 1;
        region
            .word64(COMPLETE_HEAD_AT)
            .store(self.completed, Ordering::Release);
    }

    /// Whether the writer waits for a slot and must be woken after a
    /// completion (pairs with [`SlotWriter::park`]).
    pub fn writer_parked(region: &Mapping) -> bool {
        fence(Ordering::SeqCst);
        region.word32(WRITER_WAITING_AT).load(Ordering::Relaxed) != 0
    }

    /// Announces that the reader is about to sleep (or is awake again).
    /// After setting it, check [`SlotReader::has_next`] once more before
    /// sleeping.
    pub fn park(region: &Mapping, waiting: bool) {
        region
            .word32(READER_WAITING_AT)
            .store(u32::from(waiting), Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{Layout, SUBMIT_HEAD_AT};

    fn region() -> Mapping {
        Mapping::create("binx-test", Layout::new(64 << 10, 4096).unwrap()).unwrap()
    }

    #[test]
    fn slots_travel_and_come_back_until_all_are_in_flight() {
        let region = region();
        let count = region.layout().slot_count;
        let (mut w, mut r) = (SlotWriter::new(&region), SlotReader::new(&region));
        let mut leases = Vec::new();
        while let Some(lease) = w.acquire(&region).unwrap() {
            region.write_slot(lease.slot as usize, 0, &lease.slot.to_be_bytes());
            w.submit(&region, lease, 0, 4);
            leases.push(lease);
        }
        assert_eq!(leases.len(), count);
        assert_eq!(w.in_flight(), count);
        for lease in &leases {
            let d = r.next(&region).unwrap().unwrap();
            assert_eq!((d.slot, d.generation, d.length), (lease.slot, 1, 4));
            let mut out = [0u8; 4];
            region.read_slot(d.slot as usize, 0, &mut out);
            assert_eq!(u32::from_be_bytes(out), lease.slot);
            r.complete(&region, d);
        }
        assert_eq!(r.next(&region).unwrap(), None);
        let again = w.acquire(&region).unwrap().unwrap();
        assert_eq!(
            again.generation, 2,
            "a reused slot gets the next generation"
        );
        assert_eq!(w.in_flight(), 0);
    }

    #[test]
    fn the_slot_the_reader_just_completed_is_filled_next() {
        let region = region();
        let (mut w, mut r) = (SlotWriter::new(&region), SlotReader::new(&region));
        let first = w.acquire(&region).unwrap().unwrap();
        w.submit(&region, first, 0, 1);
        let second = w.acquire(&region).unwrap().unwrap();
        w.submit(&region, second, 0, 1);
        let d = r.next(&region).unwrap().unwrap();
        r.complete(&region, d);
        // Free slots remain, yet the warm one comes back first: the writer
        // keeps cycling over the few slots in cache, not the whole region.
        let third = w.acquire(&region).unwrap().unwrap();
        assert_eq!((third.slot, third.generation), (first.slot, 2));
        assert_eq!(w.in_flight(), 1);
    }

    #[test]
    fn a_scribbled_submit_ring_is_an_error_naming_what_broke() {
        let region = region();
        let (mut w, mut r) = (SlotWriter::new(&region), SlotReader::new(&region));
        region
            .word64(SUBMIT_HEAD_AT)
            .store(1 << 40, Ordering::Release);
        assert!(
            r.next(&region)
                .unwrap_err()
                .to_string()
                .contains("submit ring head")
        );

        let mut r = SlotReader::new(&region);
        let lease = w.acquire(&region).unwrap().unwrap();
        w.submit(&region, lease, 0, 10);
        let at = region.layout().submit_ring;
        // Slot out of range.
        region
            .word64(at)
            .store(u64::from(u32::MAX) | 1 << 32, Ordering::Relaxed);
        region.word64(SUBMIT_HEAD_AT).store(1, Ordering::Release);
        assert!(r.next(&region).unwrap_err().to_string().contains("slots"));
        // Length past the slot.
        let mut r = SlotReader::new(&region);
        region.word64(at).store(1 << 32, Ordering::Relaxed);
        region
            .word64(at + 8)
            .store(100 | 4096 << 32, Ordering::Relaxed);
        assert!(
            r.next(&region)
                .unwrap_err()
                .to_string()
                .contains("outside the slot")
        );
        // Stale generation.
        let mut r = SlotReader::new(&region);
        region.word64(at).store(7 << 32, Ordering::Relaxed);
        region.word64(at + 8).store(10 << 32, Ordering::Relaxed);
        assert!(
            r.next(&region)
                .unwrap_err()
                .to_string()
                .contains("generation 7")
        );
    }

    #[test]
    fn a_completion_for_a_slot_not_in_flight_is_an_error() {
        let region = region();
        let (mut w, mut r) = (SlotWriter::new(&region), SlotReader::new(&region));
        let lease = w.acquire(&region).unwrap().unwrap();
        w.submit(&region, lease, 0, 1);
        let d = r.next(&region).unwrap().unwrap();
        r.complete(&region, d);
        // The same completion again: the slot is no longer in flight.
        r.held[d.slot as usize] = true;
        r.complete(&region, d);
        let error = w.reclaim(&region).unwrap_err().to_string();
        assert!(error.contains("not in flight"), "{error}");
        region
            .word64(COMPLETE_HEAD_AT)
            .store(u64::MAX, Ordering::Release);
        assert!(
            w.reclaim(&region)
                .unwrap_err()
                .to_string()
                .contains("complete ring head")
        );
    }
}
