//! What the engine reports as it runs: counters for tests and reports, and the hook the relay's
//! Prometheus metrics plug into.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// What finally happened to one claimed message, as written to the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    /// Delivered and removed (or kept by retention).
    Delivered,
    /// Failed; scheduled again after its backoff.
    Retried,
    /// Moved to the dead letters.
    DeadLettered,
    /// Handed back without using an attempt (shutdown, sink outage).
    Released,
    /// The write matched no row: the lease had expired and the message was claimed again.
    Fenced,
    /// Put off by its handler without using an attempt (a snooze under the engine's cap).
    Snoozed,
}

/// Receives the engine's events. Every method has a no-op default.
pub trait Observer: Send + Sync + 'static {
    /// A claim statement returned `n` messages.
    fn claimed(&self, _n: usize) {}
    /// A message was settled; `age` is from its creation to now (end-to-end latency when
    /// delivered).
    fn settled(&self, _topic: &str, _sink: &str, _what: Settlement, _age: Duration) {}
    /// A sink call took `elapsed` for `n` messages.
    fn delivery(&self, _sink: &str, _n: usize, _elapsed: Duration) {}
    /// The sink became available (`true`) or unavailable.
    fn sink_up(&self, _sink: &str, _up: bool) {}
    /// The notifier connection came up or went down.
    fn notifier_connected(&self, _up: bool) {}
    /// Heartbeats found these many leases gone.
    fn lease_lost(&self, _n: usize) {}
    /// The rescuer gave `n` stranded ordered keys their head again (see `Store::repair`).
    fn keys_repaired(&self, _n: usize) {}
    /// A claim of the route of `sink` was sent to the database.
    fn claim_started(&self, _sink: &str) {}
    /// That claim came back: `ok`, or with an error (the database away, the pool exhausted).
    fn claim_ended(&self, _sink: &str, _ok: bool) {}
    /// The engine of `sink` is making progress: a claim loop went round, or the completer wrote
    /// (or is retrying while the database is away). Liveness probes watch for its absence.
    fn alive(&self, _sink: &str) {}
    /// A cron schedule was looked at: its last tick (by any relay), its next, and whether this
    /// engine fired a tick just now.
    fn schedule(
        &self,
        _name: &str,
        _last: Option<chrono::DateTime<chrono::Utc>>,
        _next: chrono::DateTime<chrono::Utc>,
        _fired: bool,
    ) {
    }
}

/// Totals since the engine started.
#[derive(Debug, Default)]
pub struct Counters {
    /// Messages claimed.
    pub claimed: AtomicU64,
    /// Messages delivered.
    pub delivered: AtomicU64,
    /// Failed attempts scheduled again.
    pub retried: AtomicU64,
    /// Messages dead-lettered.
    pub dead_lettered: AtomicU64,
    /// Messages handed back without using an attempt.
    pub released: AtomicU64,
    /// Outcomes that matched no row (their lease had expired).
    pub fenced: AtomicU64,
    /// Messages put off by their handler without using an attempt.
    pub snoozed: AtomicU64,
}

impl Counters {
    /// A copy of the totals.
    pub fn snapshot(&self) -> RunReport {
        RunReport {
            claimed: self.claimed.load(Ordering::Relaxed),
            delivered: self.delivered.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            released: self.released.load(Ordering::Relaxed),
            fenced: self.fenced.load(Ordering::Relaxed),
            snoozed: self.snoozed.load(Ordering::Relaxed),
        }
    }
}

/// What an engine did, returned when it stops.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunReport {
    /// Messages claimed.
    pub claimed: u64,
    /// Messages delivered.
    pub delivered: u64,
    /// Failed attempts scheduled again.
    pub retried: u64,
    /// Messages dead-lettered.
    pub dead_lettered: u64,
    /// Messages handed back without using an attempt.
    pub released: u64,
    /// Outcomes that matched no row (their lease had expired).
    pub fenced: u64,
    /// Messages put off by their handler without using an attempt.
    pub snoozed: u64,
}

/// Counts into [`Counters`], then passes the event on.
pub(crate) struct Counting {
    pub counters: std::sync::Arc<Counters>,
    pub inner: std::sync::Arc<dyn Observer>,
}

impl Observer for Counting {
    fn claimed(&self, n: usize) {
        self.counters.claimed.fetch_add(n as u64, Ordering::Relaxed);
        self.inner.claimed(n);
    }
    fn settled(&self, topic: &str, sink: &str, what: Settlement, age: Duration) {
        let c = match what {
            Settlement::Delivered => &self.counters.delivered,
            Settlement::Retried => &self.counters.retried,
            Settlement::DeadLettered => &self.counters.dead_lettered,
            Settlement::Released => &self.counters.released,
            Settlement::Fenced => &self.counters.fenced,
            Settlement::Snoozed => &self.counters.snoozed,
        };
        c.fetch_add(1, Ordering::Relaxed);
        self.inner.settled(topic, sink, what, age);
    }
    fn delivery(&self, sink: &str, n: usize, elapsed: Duration) {
        self.inner.delivery(sink, n, elapsed);
    }
    fn sink_up(&self, sink: &str, up: bool) {
        self.inner.sink_up(sink, up);
    }
    fn notifier_connected(&self, up: bool) {
        self.inner.notifier_connected(up);
    }
    fn lease_lost(&self, n: usize) {
        self.inner.lease_lost(n);
    }
    fn keys_repaired(&self, n: usize) {
        self.inner.keys_repaired(n);
    }
    fn claim_started(&self, sink: &str) {
        self.inner.claim_started(sink);
    }
    fn claim_ended(&self, sink: &str, ok: bool) {
        self.inner.claim_ended(sink, ok);
    }
    fn alive(&self, sink: &str) {
        self.inner.alive(sink);
    }
    fn schedule(
        &self,
        name: &str,
        last: Option<chrono::DateTime<chrono::Utc>>,
        next: chrono::DateTime<chrono::Utc>,
        fired: bool,
    ) {
        self.inner.schedule(name, last, next, fired);
    }
}

/// Ignores everything.
pub struct NoObserver;
impl Observer for NoObserver {}
