//! Retry delays: exponential, capped, with jitter, stored in the row's `run_at`.

use std::time::Duration;

use crate::error::{Error, Result};

/// How long a failed message waits before its next attempt.
///
/// After attempt `n` (1-based) failed, the message becomes claimable again after
///
/// ```text
/// delay(n) = min(cap, base × 2^(n−1)) × (1 + jitter × u),   u uniform in [−1, 1)
/// ```
///
/// With the defaults (base 1 s, cap 1 h, jitter 0.1) the waits are about 1 s, 2 s, 4 s, … 34 min,
/// then 1 h each; the 25 default attempts span about 14 h. The delay is computed by the database
/// and written to `run_at`, so it survives restarts of every relay. A handler may ask for its own
/// delay instead.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// Delay after the first failed attempt.
    pub base: Duration,
    /// Longest delay before jitter.
    pub cap: Duration,
    /// Fraction of the delay added or removed at random, in `[0, 1]`, so that messages that
    /// failed together do not retry together.
    pub jitter: f64,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: Duration::from_secs(1),
            cap: Duration::from_secs(3600),
            jitter: 0.1,
        }
    }
}

impl Backoff {
    /// Checks the settings, naming the field that is wrong.
    pub fn validate(&self) -> Result<()> {
        if self.base.is_zero() {
            return Err(Error::InvalidArgument {
                field: "backoff.base",
                problem: "must be greater than zero".into(),
            });
        }
        if self.cap < self.base {
            return Err(Error::InvalidArgument {
                field: "backoff.cap",
                problem: format!("must be at least backoff.base ({:?})", self.base),
            });
        }
        if !(0.0..=1.0).contains(&self.jitter) {
            return Err(Error::InvalidArgument {
                field: "backoff.jitter",
                problem: format!("must be between 0 and 1, got {}", self.jitter),
            });
        }
        Ok(())
    }

    /// The shortest and longest delay after failed attempt `attempt` (1-based).
    pub fn bounds(&self, attempt: i32) -> (Duration, Duration) {
        let exp = (attempt.max(1) - 1).min(62);
        let raw = (self.base.as_secs_f64() * 2f64.powi(exp)).min(self.cap.as_secs_f64());
        (
            Duration::from_secs_f64(raw * (1.0 - self.jitter)),
            Duration::from_secs_f64(raw * (1.0 + self.jitter)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_then_caps() {
        let b = Backoff::default();
        assert_eq!(b.bounds(1).1, Duration::from_secs_f64(1.1));
        assert_eq!(b.bounds(4).0, Duration::from_secs_f64(7.2));
        assert_eq!(b.bounds(40).1, Duration::from_secs_f64(3960.0));
        assert_eq!(b.bounds(i32::MAX).1, Duration::from_secs_f64(3960.0));
    }

    #[test]
    fn validation_names_the_field() {
        let b = Backoff {
            jitter: 2.0,
            ..Backoff::default()
        };
        assert!(
            b.validate()
                .unwrap_err()
                .to_string()
                .starts_with("backoff.jitter")
        );
    }
}
