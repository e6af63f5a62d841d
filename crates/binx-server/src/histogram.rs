//! Histograms that every connection feeds on every request, without a lock.
//!
//! `prometheus-client`'s `Histogram` takes a write lock for each value, and
//! its `Family` a read lock and a hash for each lookup: two of each on every
//! BinX request, shared by every core. Here each thread adds to its own
//! stripe of atomic counters (its own cache lines), one histogram per
//! request type is found by index, and a scrape sums the stripes.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use binx_proto::MessageType;

/// Stripes per histogram: threads are dealt out over them, so that two
/// cores seldom write the same cache line.
const STRIPES: usize = 8;

/// The most finite bucket bounds a histogram takes.
pub const MAX_BOUNDS: usize = 15;

/// Request types are numbered below this (the enum's largest is 21).
const TYPE_SLOTS: usize = 32;

/// One thread group's counts.
#[repr(align(128))]
#[derive(Debug, Default)]
struct Stripe {
    /// Values per bucket; the one after the last bound counts the rest.
    counts: [AtomicU64; MAX_BOUNDS + 1],
    /// The sum of the values, as `f64` bits.
    sum: AtomicU64,
}

/// What a scrape reads: the sum, the count, and per bucket its upper bound
/// and the values in it (not cumulative; the last bound is `f64::MAX`, for
/// `+Inf`), the shape `prometheus-client` encodes.
pub type HistogramReading = (f64, u64, Vec<(f64, u64)>);

/// A histogram of `f64` values with fixed bucket bounds.
#[derive(Debug)]
pub struct StripedHistogram {
    bounds: Vec<f64>,
    stripes: Box<[Stripe]>,
}

impl StripedHistogram {
    /// A histogram with these upper bounds, ascending (at most
    /// [`MAX_BOUNDS`]; more are dropped).
    pub fn new(bounds: impl IntoIterator<Item = f64>) -> Self {
        StripedHistogram {
            bounds: bounds.into_iter().take(MAX_BOUNDS).collect(),
            stripes: (0..STRIPES).map(|_| Stripe::default()).collect(),
        }
    }

    /// Counts one value.
    pub fn observe(&self, value: f64) {
        let stripe = &self.stripes[stripe_of_this_thread()];
        let bucket = self
            .bounds
            .iter()
            .position(|&bound| value <= bound)
            .unwrap_or(self.bounds.len());
        stripe.counts[bucket].fetch_add(1, Ordering::Relaxed);
        // Only the threads of one stripe contend here.
        let _ = stripe
            .sum
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + value).to_bits())
            });
    }

    /// The counts so far, summed over the stripes.
    pub fn read(&self) -> HistogramReading {
        let mut counts = vec![0u64; self.bounds.len() + 1];
        let mut sum = 0.0;
        for stripe in self.stripes.iter() {
            for (total, count) in counts.iter_mut().zip(&stripe.counts) {
                *total += count.load(Ordering::Relaxed);
            }
            sum += f64::from_bits(stripe.sum.load(Ordering::Relaxed));
        }
        let count = counts.iter().sum();
        let buckets = self
            .bounds
            .iter()
            .copied()
            .chain(std::iter::once(f64::MAX))
            .zip(counts)
            .collect();
        (sum, count, buckets)
    }
}

/// One [`StripedHistogram`] per request type, made when the type is first
/// seen (so a scrape lists only the types that were answered).
#[derive(Debug)]
pub struct HistogramsByType {
    bounds: Vec<f64>,
    slots: [OnceLock<StripedHistogram>; TYPE_SLOTS],
}

impl HistogramsByType {
    /// Histograms with these bucket bounds.
    pub fn new(bounds: impl IntoIterator<Item = f64>) -> Self {
        HistogramsByType {
            bounds: bounds.into_iter().take(MAX_BOUNDS).collect(),
            slots: std::array::from_fn(|_| OnceLock::new()),
        }
    }

    /// Counts one value for requests of `kind`.
    pub fn observe(&self, kind: MessageType, value: f64) {
        let Some(slot) = usize::try_from(kind as i32)
            .ok()
            .and_then(|i| self.slots.get(i))
        else {
            return;
        };
        slot.get_or_init(|| StripedHistogram::new(self.bounds.iter().copied()))
            .observe(value);
    }

    /// Each type seen so far, with its counts.
    pub fn read(&self) -> Vec<(MessageType, HistogramReading)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, slot)| {
                let kind = MessageType::try_from(i32::try_from(i).ok()?).ok()?;
                Some((kind, slot.get()?.read()))
            })
            .collect()
    }
}

/// The stripe the calling thread adds to: threads are dealt out in turn as
/// they first observe (tokio's workers live as long as the runtime).
fn stripe_of_this_thread() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES;
    }
    STRIPE.with(|stripe| *stripe)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_land_in_the_first_bucket_whose_bound_holds_them() {
        let h = StripedHistogram::new([1.0, 10.0, 100.0]);
        for v in [0.5, 1.0, 1.5, 10.0, 99.0, 100.5, 1e9] {
            h.observe(v);
        }
        let (sum, count, buckets) = h.read();
        assert_eq!(count, 7);
        assert!((sum - (0.5 + 1.0 + 1.5 + 10.0 + 99.0 + 100.5 + 1e9)).abs() < 1e-3);
        assert_eq!(
            buckets,
            vec![(1.0, 2), (10.0, 2), (100.0, 1), (f64::MAX, 2)]
        );
    }

    #[test]
    fn threads_on_every_stripe_are_all_counted() {
        let h = std::sync::Arc::new(StripedHistogram::new([5.0]));
        let threads: Vec<_> = (0..3 * STRIPES)
            .map(|t| {
                let h = h.clone();
                std::thread::spawn(move || {
                    for i in 0..1000 {
                        h.observe(((t + i) % 10) as f64);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("an observing thread panicked");
        }
        let (sum, count, buckets) = h.read();
        assert_eq!(count, 3 * STRIPES as u64 * 1000);
        // Each thread observes 0..=9 a hundred times each.
        assert_eq!(sum, 3.0 * STRIPES as f64 * 100.0 * 45.0);
        assert_eq!(
            buckets,
            vec![(5.0, count * 6 / 10), (f64::MAX, count * 4 / 10)]
        );
    }

    #[test]
    fn a_type_appears_once_it_was_observed() {
        let by_type = HistogramsByType::new([1.0]);
        assert!(by_type.read().is_empty());
        by_type.observe(MessageType::Data, 0.5);
        by_type.observe(MessageType::Data, 2.0);
        by_type.observe(MessageType::Enqueue, 0.5);
        let read = by_type.read();
        let kinds: Vec<MessageType> = read.iter().map(|(k, _)| *k).collect();
        assert_eq!(kinds, vec![MessageType::Data, MessageType::Enqueue]);
        assert_eq!(read[0].1.1, 2);
        assert_eq!(read[1].1.1, 1);
    }
}
