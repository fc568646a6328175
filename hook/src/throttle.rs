//! Compute throttling: every kernel launch takes tokens from a bucket (its grid's block count),
//! and a controller sets the bucket's refill rate from the utilization the container actually
//! reaches, so that it settles at the container's compute share. A launch that finds the bucket
//! empty sleeps until its debt is repaid (never more than [`MAX_SLEEP`] at once).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The longest a launch is held back at once.
pub const MAX_SLEEP: Duration = Duration::from_millis(200);
/// How often the controller looks at utilization.
pub const PERIOD: Duration = Duration::from_millis(100);
/// The lowest refill rate, blocks per second (a share always progresses).
const MIN_RATE: f64 = 10.0;

#[derive(Debug)]
struct BucketState {
    tokens: f64,
    /// Blocks per second; `None` = not limited yet (before the first measurement).
    rate: Option<f64>,
    last: Instant,
}

/// The token bucket of one process.
#[derive(Debug)]
pub struct Bucket {
    state: Mutex<BucketState>,
    /// Blocks launched since start (the controller's view of demand).
    launched: AtomicU64,
}

impl Default for Bucket {
    fn default() -> Self {
        Self::new()
    }
}

impl Bucket {
    /// Unlimited until a rate is set.
    pub fn new() -> Self {
        Self {
            state: Mutex::new(BucketState {
                tokens: 0.0,
                rate: None,
                last: Instant::now(),
            }),
            launched: AtomicU64::new(0),
        }
    }

    /// Takes `cost` tokens; returns how long the caller must wait first (`None`: go now).
    pub fn take(&self, cost: u64) -> Option<Duration> {
        self.launched.fetch_add(cost, Ordering::Relaxed);
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let rate = s.rate?;
        let now = Instant::now();
        let dt = now.duration_since(s.last).as_secs_f64();
        s.last = now;
        // Up to a tenth of a second of burst.
        let capacity = rate * PERIOD.as_secs_f64();
        s.tokens = (s.tokens + rate * dt).min(capacity) - cost as f64;
        (s.tokens < 0.0).then(|| Duration::from_secs_f64(-s.tokens / rate).min(MAX_SLEEP))
    }

    /// Blocks launched so far.
    pub fn launched(&self) -> u64 {
        self.launched.load(Ordering::Relaxed)
    }

    /// The refill rate (blocks per second), when limited.
    pub fn rate(&self) -> Option<f64> {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).rate
    }

    fn set_rate(&self, rate: f64) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.rate = Some(rate.max(MIN_RATE));
    }
}

/// Steers a bucket's rate towards a utilization target.
#[derive(Debug)]
pub struct Controller {
    target: f64,
    last_launched: u64,
}

impl Controller {
    /// A controller for `target` percent.
    pub fn new(target: u32) -> Self {
        Self {
            target: f64::from(target),
            last_launched: 0,
        }
    }

    /// One control step: `util` is the container's utilization (percent) over the last period.
    pub fn step(&mut self, bucket: &Bucket, util: Option<u32>, period: Duration) {
        let launched = bucket.launched();
        let demand = (launched - self.last_launched) as f64 / period.as_secs_f64();
        self.last_launched = launched;
        let Some(util) = util.map(f64::from) else {
            return;
        };
        match bucket.rate() {
            // First measurement: what was launched reached `util`; scale it to the target.
            None => {
                if demand > 0.0 && util > 0.0 {
                    bucket.set_rate(demand * self.target / util);
                }
            }
            Some(rate) => {
                if util <= 0.5 {
                    // Idle, or not measured yet: let the rate recover slowly.
                    bucket.set_rate(rate * 1.1);
                    return;
                }
                // Utilization is about proportional to the rate while the rate binds; move by
                // the square root of the ratio so one noisy sample cannot swing it.
                let factor = (self.target / util).sqrt().clamp(0.5, 2.0);
                bucket.set_rate(rate * factor);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_bucket_makes_launches_wait_and_unlimited_ones_do_not() {
        let b = Bucket::new();
        assert_eq!(b.take(1_000_000), None, "no rate yet: no limit");
        b.set_rate(1000.0);
        // 100 tokens of burst at most, so a 1000-block launch waits about a second (capped).
        let wait = b.take(1000).unwrap();
        assert_eq!(wait, MAX_SLEEP);
        assert_eq!(b.launched(), 1_001_000);
    }

    /// A simulated GPU whose utilization is proportional to what is launched: the controller
    /// brings it to the target from above and below.
    #[test]
    fn the_controller_settles_at_the_target() {
        for (target, blocks_per_util_point) in [(30u32, 1000.0), (70, 50.0)] {
            let b = Bucket::new();
            let mut c = Controller::new(target);
            let period = Duration::from_millis(100);
            let mut util = 0.0f64;
            for _ in 0..60 {
                // The program launches as fast as the bucket lets it: demand = rate (or 100%).
                let demand = b.rate().unwrap_or(100.0 * blocks_per_util_point);
                b.launched
                    .fetch_add((demand * period.as_secs_f64()) as u64, Ordering::Relaxed);
                util = (demand / blocks_per_util_point).min(100.0);
                c.step(&b, Some(util.round() as u32), period);
            }
            assert!(
                (util - f64::from(target)).abs() <= 2.0,
                "target {target}: settled at {util}"
            );
        }
    }
}
