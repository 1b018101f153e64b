//! Engine settings: defaults as constants, validation that names the field.

use std::time::Duration;

use crate::error::{Error, Result};

/// Messages claimed per claim statement.
/// After the shutdown deadline, how long the last writes (outcomes, hand-backs) may take before
/// shutdown ends anyway and leaves them to lease expiry.
pub(crate) const SHUTDOWN_WRITE_WINDOW: Duration = Duration::from_secs(5);

/// After a hard stop (a second signal), how long the last writes may still take: the engine
/// returns within about this much of it, whatever the database does.
pub(crate) const HARD_STOP_GRACE: Duration = Duration::from_millis(500);

/// Snoozes a message may take without using an attempt (see
/// [`HandlerError::snooze`](crate::sink::handlers::HandlerError::snooze)): past them, a snooze
/// uses an attempt like a retry.
pub const DEFAULT_MAX_SNOOZES: i32 = 100;
/// Messages per claim when the builder is not told otherwise.
pub const DEFAULT_BATCH_SIZE: usize = 100;
/// Claim loops per engine. One keeps up with a 2-core database here (measured: 2 loops drained no
/// faster); more can help a database with more cores (SKIP LOCKED keeps them from waiting on each
/// other).
pub const DEFAULT_CLAIMERS: usize = 1;
/// Deliveries (handler calls, or sink chunks) running at once.
pub const DEFAULT_CONCURRENCY: usize = 100;
/// How long a claim holds a message before another relay may take it; extended automatically
/// (every third of it) while the delivery still runs.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// Fallback poll while waiting for a notification: finds everything even if none ever arrives.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(5);
/// Under a fast flow, keep polling this long (every [`LINGER_STEP`]) after the last work found
/// before going back to waiting for a notification; see [`EngineConfig::idle_linger`].
pub const DEFAULT_IDLE_LINGER: Duration = Duration::from_millis(50);
/// Claim rate (messages/s, over the last ~100 ms) from which the engine lingers instead of
/// waiting for NOTIFY; see [`EngineConfig::linger_above`].
pub const DEFAULT_LINGER_ABOVE: f64 = 500.0;
/// A lingering engine goes on lingering while the claim rate stays above this fraction of
/// [`EngineConfig::linger_above`] (hysteresis: see there).
pub const LINGER_STAY_FRACTION: f64 = 0.5;
/// Pause between claims while lingering.
pub const LINGER_STEP: Duration = Duration::from_millis(1);
/// How long shutdown waits for running deliveries before handing them back.
pub const DEFAULT_SHUTDOWN_DEADLINE: Duration = Duration::from_secs(25);
/// Longest the scheduler sleeps between looks for due scheduled messages (it sleeps exactly until
/// the next known one is due when that is sooner).
pub const DEFAULT_SCHEDULE_INTERVAL: Duration = Duration::from_millis(100);

/// Longest a delivery may run (a handler call, a batch to Kafka) before it counts as a failed
/// attempt, as River's default job timeout. Longer jobs set a per-topic override.
pub const DEFAULT_DELIVERY_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest a batch is held (see [`EngineConfig::hold_limit`]).
pub const DEFAULT_HOLD_LIMIT: Duration = Duration::from_secs(1);
/// Held batches in flight per engine at most, each on a pool connection of its own; past that,
/// a claim waits up to [`HOLD_SLOT_WAIT`] for one to end, then leases.
pub const MAX_HOLDS: usize = 4;
/// How long a claim loop with a backlog waits for a hold to end before it leases instead.
pub const HOLD_SLOT_WAIT: Duration = Duration::from_millis(20);
/// How often expired leases are rescued.
pub const DEFAULT_RESCUE_INTERVAL: Duration = Duration::from_secs(10);
/// Most outcomes written per completer flush.
pub const DEFAULT_COMPLETER_BATCH: usize = 2_000;
/// How often a relay keeping completed messages creates the partitions to come and drops the
/// expired ones.
pub const RETENTION_INTERVAL: Duration = Duration::from_secs(300);
/// Longest pause after the sink reported itself unavailable (doubling from 100 ms).
pub const DEFAULT_MAX_UNAVAILABLE_BACKOFF: Duration = Duration::from_secs(30);

/// Everything that tunes an engine. `Default` gives the documented defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Messages claimed per claim statement.
    pub batch_size: usize,
    /// Deliveries running at once (for the handlers sink: handler calls at once).
    pub concurrency: usize,
    /// Claim loops running at once, sharing the concurrency limit.
    pub claimers: usize,
    /// Lease per claim; heartbeats extend it while a delivery runs.
    pub lease: Duration,
    /// Fallback poll interval while waiting for a notification.
    pub poll_interval: Duration,
    /// How the engine waits for new work depends on how fast it arrives. Below `linger_above`
    /// messages a second it registers as a waiting listener and is woken by NOTIFY (about 1 ms
    /// from commit to handler here). At or above that rate, a notifying commit would cost every
    /// writer (notifying commits are serialised), so the engine does not register: it polls every
    /// millisecond until no work has come for `idle_linger`, then registers again; once
    /// lingering, it goes on while the rate stays above half of `linger_above` (writers that
    /// notify are held back by it, and may not reach the threshold again while the engine waits
    /// for their NOTIFYs). Writers thus never NOTIFY under load. Zero disables lingering (always
    /// NOTIFY).
    pub idle_linger: Duration,
    /// The claim rate (messages/s) from which the engine lingers; see `idle_linger`.
    pub linger_above: f64,
    /// Shutdown waits this long for running deliveries, then cuts the rest off (each counts as a
    /// failed attempt, retried with backoff); messages not started go back without one.
    pub shutdown_deadline: Duration,
    /// Rescue interval for expired leases.
    pub rescue_interval: Duration,
    /// Longest pause of the scheduler (scheduled → available); see [`DEFAULT_SCHEDULE_INTERVAL`].
    pub schedule_interval: Duration,
    /// Most outcomes written per flush of the completer.
    pub completer_batch: usize,
    /// Longest back-off after the sink reported itself unavailable.
    pub max_unavailable_backoff: Duration,
    /// Stop by itself once nothing claimable is left and nothing is in flight.
    pub drain: bool,
    /// A delivery still running after this long is cut off and counts as a failed attempt (retried
    /// with backoff, dead-lettered at `max_attempts`): a handler that hangs cannot hold its
    /// message, its concurrency slot and its ordered key forever.
    pub delivery_timeout: Duration,
    /// Per-topic `delivery_timeout`s, `(pattern, timeout)` (`*` matches any run of characters);
    /// of the patterns that match a topic, the longest wins.
    pub topic_timeouts: Vec<(String, Duration)>,
    /// Held batches, the claim's fast path while there is a backlog (the previous claim came back
    /// full): a batch is taken by locking its rows in a transaction that stays open while it is
    /// delivered, and the delivered messages are deleted in that transaction — no lease is
    /// written for them. When the hold ends, after its last
    /// outcome or at this limit, whatever is not delivered (a retry, a dead letter, a delivery
    /// still running) is leased and settled as a claimed message. The limit bounds how long a
    /// transaction stays open (the database's xmin horizon) and delays the settling of fast
    /// deliveries held with a slow one. Zero: always lease.
    pub hold_limit: Duration,
    /// Keep delivered messages this long in `postbox.completed` (an hourly partition is dropped
    /// once its hour ended this long ago), so `postbox show ID` can tell when and by which sink a
    /// message was delivered. `None` (the default): delivered messages are deleted.
    pub keep_completed: Option<Duration>,
    /// Bytes of claimed messages in memory at once, about (payloads as decoded): claims and holds
    /// take fewer messages when messages are large. A message larger than the budget is still
    /// delivered, alone. 0: no limit (the batch size and concurrency alone bound what is in
    /// flight). Default [`DEFAULT_PAYLOAD_BUDGET`](super::DEFAULT_PAYLOAD_BUDGET), 64 MiB.
    pub payload_budget: usize,
    /// Snoozes a message may take without using an attempt; past them a snooze uses an attempt
    /// like a retry (so a message that only ever snoozes still reaches the dead letters). Default
    /// [`DEFAULT_MAX_SNOOZES`].
    pub max_snoozes: i32,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            batch_size: DEFAULT_BATCH_SIZE,
            concurrency: DEFAULT_CONCURRENCY,
            claimers: DEFAULT_CLAIMERS,
            lease: DEFAULT_LEASE,
            poll_interval: DEFAULT_POLL_INTERVAL,
            idle_linger: DEFAULT_IDLE_LINGER,
            linger_above: DEFAULT_LINGER_ABOVE,
            shutdown_deadline: DEFAULT_SHUTDOWN_DEADLINE,
            rescue_interval: DEFAULT_RESCUE_INTERVAL,
            schedule_interval: DEFAULT_SCHEDULE_INTERVAL,
            completer_batch: DEFAULT_COMPLETER_BATCH,
            max_unavailable_backoff: DEFAULT_MAX_UNAVAILABLE_BACKOFF,
            drain: false,
            delivery_timeout: DEFAULT_DELIVERY_TIMEOUT,
            topic_timeouts: Vec::new(),
            hold_limit: DEFAULT_HOLD_LIMIT,
            keep_completed: None,
            payload_budget: super::budget::DEFAULT_PAYLOAD_BUDGET,
            max_snoozes: DEFAULT_MAX_SNOOZES,
        }
    }
}

fn invalid(field: &'static str, problem: impl Into<String>) -> Error {
    Error::InvalidArgument {
        field,
        problem: problem.into(),
    }
}

impl EngineConfig {
    /// The delivery timeout of `topic`.
    pub fn timeout_for(&self, topic: &str) -> Duration {
        self.topic_timeouts
            .iter()
            .filter(|(pattern, _)| crate::store::Topics::only([pattern]).matches(topic))
            .max_by_key(|(pattern, _)| pattern.len())
            .map_or(self.delivery_timeout, |(_, t)| *t)
    }

    /// Checks every setting; the error names the first field that is wrong.
    pub fn validate(&self) -> Result<()> {
        for t in std::iter::once(&self.delivery_timeout)
            .chain(self.topic_timeouts.iter().map(|(_, t)| t))
        {
            if *t < Duration::from_millis(10) {
                return Err(invalid(
                    "delivery_timeout",
                    format!("must be at least 10ms, got {t:?}"),
                ));
            }
        }
        if self.max_snoozes < 0 {
            return Err(invalid(
                "max_snoozes",
                format!("must not be negative, got {}", self.max_snoozes),
            ));
        }
        if self.hold_limit > Duration::from_secs(60) {
            return Err(invalid(
                "hold_limit",
                format!(
                    "must be at most 60s (it keeps a transaction open), got {:?}",
                    self.hold_limit
                ),
            ));
        }
        if self.batch_size == 0 || self.batch_size > 10_000 {
            return Err(invalid(
                "batch_size",
                format!("must be between 1 and 10000, got {}", self.batch_size),
            ));
        }
        if self.concurrency == 0 || self.concurrency > 100_000 {
            return Err(invalid(
                "concurrency",
                format!("must be between 1 and 100000, got {}", self.concurrency),
            ));
        }
        if self.claimers == 0 || self.claimers > 16 {
            return Err(invalid(
                "claimers",
                format!("must be between 1 and 16, got {}", self.claimers),
            ));
        }
        if self.lease < Duration::from_secs(1) {
            return Err(invalid(
                "lease",
                format!("must be at least 1s, got {:?}", self.lease),
            ));
        }
        if self.poll_interval < Duration::from_millis(10) {
            return Err(invalid(
                "poll_interval",
                format!("must be at least 10ms, got {:?}", self.poll_interval),
            ));
        }
        if self.idle_linger > self.poll_interval {
            return Err(invalid("idle_linger", "must not exceed poll_interval"));
        }
        if self.linger_above.is_nan() || self.linger_above < 0.0 {
            return Err(invalid(
                "linger_above",
                "must be a rate of zero or more messages per second",
            ));
        }
        if self.rescue_interval.is_zero() {
            return Err(invalid("rescue_interval", "must be greater than zero"));
        }
        if self.schedule_interval < Duration::from_millis(10) {
            return Err(invalid(
                "schedule_interval",
                format!("must be at least 10ms, got {:?}", self.schedule_interval),
            ));
        }
        if self.completer_batch == 0 {
            return Err(invalid("completer_batch", "must be at least 1"));
        }
        if self.max_unavailable_backoff < Duration::from_millis(100) {
            return Err(invalid("max_unavailable_backoff", "must be at least 100ms"));
        }
        if self
            .keep_completed
            .is_some_and(|k| k < Duration::from_secs(60))
        {
            return Err(invalid(
                "keep_completed",
                "must be at least 1m (completed messages are expired by the hour)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_errors_name_the_field() {
        EngineConfig::default().validate().unwrap();
        let cases: [(EngineConfig, &str); 4] = [
            (
                EngineConfig {
                    batch_size: 0,
                    ..Default::default()
                },
                "batch_size",
            ),
            (
                EngineConfig {
                    concurrency: 0,
                    ..Default::default()
                },
                "concurrency",
            ),
            (
                EngineConfig {
                    lease: Duration::from_millis(10),
                    ..Default::default()
                },
                "lease",
            ),
            (
                EngineConfig {
                    poll_interval: Duration::ZERO,
                    ..Default::default()
                },
                "poll_interval",
            ),
        ];
        for (c, field) in cases {
            let e = c.validate().unwrap_err().to_string();
            assert!(e.starts_with(field), "{e}");
        }
    }
}
