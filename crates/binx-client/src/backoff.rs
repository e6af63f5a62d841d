//! Retry pacing: exponential backoff with jitter between a minimum and a
//! maximum delay, giving up once errors have lasted a maximum duration
//! (Presto's exchange client does the same).

use std::time::{Duration, Instant};

/// Backoff limits.
#[derive(Clone, Copy, Debug)]
pub struct BackoffConfig {
    /// The first delay.
    pub min_delay: Duration,
    /// The delay doubles up to this.
    pub max_delay: Duration,
    /// Errors in a row for this long make the request fail for good.
    pub max_error_duration: Duration,
}

impl Default for BackoffConfig {
    fn default() -> Self {
        BackoffConfig {
            min_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(10),
            max_error_duration: Duration::from_secs(180),
        }
    }
}

/// The state of one retried operation.
#[derive(Clone, Debug)]
pub struct Backoff {
    config: BackoffConfig,
    first_error: Option<Instant>,
    failures: u32,
}

impl Backoff {
    /// A backoff with no error yet.
    pub fn new(config: BackoffConfig) -> Self {
        Backoff {
            config,
            first_error: None,
            failures: 0,
        }
    }

    /// Records a success: the next error starts a fresh series.
    pub fn succeeded(&mut self) {
        self.first_error = None;
        self.failures = 0;
    }

    /// Records an error at `now`: the delay before the next try, or `None`
    /// when errors have lasted longer than the maximum error duration.
    pub fn failed(&mut self, now: Instant) -> Option<Duration> {
        let first = *self.first_error.get_or_insert(now);
        if now.saturating_duration_since(first) >= self.config.max_error_duration {
            return None;
        }
        let exp = self.failures.min(20);
        self.failures += 1;
        let ceiling = self
            .config
            .min_delay
            .saturating_mul(1u32 << exp)
            .min(self.config.max_delay);
        // Jitter in [ceiling/2, ceiling], never below the minimum delay.
        let half = ceiling / 2;
        let jitter = half.mul_f64(fastrand::f64());
        Some((half + jitter).max(self.config.min_delay.min(ceiling)))
    }

    /// After an error that may pass: sleeps the next delay (Ok), or gives
    /// up at once (Err, with how long the errors lasted) once they have
    /// lasted `max_error_duration`. The one retry loop of the connection,
    /// the producer and the source.
    pub async fn wait_after_error(&mut self) -> Result<(), Duration> {
        // tokio's clock, so a paused test clock paces the give-up too.
        let now = tokio::time::Instant::now().into_std();
        match self.failed(now) {
            Some(delay) => {
                tokio::time::sleep(delay).await;
                Ok(())
            }
            None => Err(self.error_duration(now)),
        }
    }

    /// How long the current series of errors has lasted.
    pub fn error_duration(&self, now: Instant) -> Duration {
        self.first_error
            .map_or(Duration::ZERO, |first| now.saturating_duration_since(first))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_within_bounds_and_give_up_after_the_error_duration() {
        let config = BackoffConfig {
            min_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(10),
            max_error_duration: Duration::from_secs(60),
        };
        let mut b = Backoff::new(config);
        let start = Instant::now();
        let mut last_ceiling = Duration::ZERO;
        for i in 0..12u32 {
            let delay = b.failed(start).expect("within the error duration");
            let ceiling = (Duration::from_millis(100) * 2u32.pow(i)).min(Duration::from_secs(10));
            assert!(
                delay <= ceiling && delay >= ceiling / 2,
                "try {i}: {delay:?} vs {ceiling:?}"
            );
            assert!(delay >= Duration::from_millis(100));
            last_ceiling = ceiling;
        }
        assert_eq!(last_ceiling, Duration::from_secs(10));
        assert!(b.failed(start + Duration::from_secs(59)).is_some());
        assert!(b.failed(start + Duration::from_secs(60)).is_none());
        b.succeeded();
        assert!(
            b.failed(start + Duration::from_secs(61)).is_some(),
            "a success resets"
        );
    }
}
