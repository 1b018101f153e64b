//! Maintenance services. Each has the same shape: defaults as constants (see `config`), a
//! validated config, `run_once` returning what it did, and a loop that only ticks. They are safe
//! to run on every replica at once.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::error::Result;
use crate::store::{RESCUE_BATCH, RetryReport, Store};

/// Returns expired leases to pending (or to the dead letters when out of attempts).
#[derive(Debug, Clone)]
pub struct Rescuer {
    store: Store,
    interval: Duration,
}

impl Rescuer {
    /// A rescuer ticking every `interval`.
    pub fn new(store: Store, interval: Duration) -> Self {
        Rescuer { store, interval }
    }

    /// Rescues every lease expired now, in batches; returns what it did.
    pub async fn run_once(&self) -> Result<RetryReport> {
        let mut total = RetryReport::default();
        loop {
            let r = self.store.rescue_expired().await?;
            let n = r.retried.len() + r.dead.len();
            total.retried.extend(r.retried);
            total.dead.extend(r.dead);
            if (n as i64) < RESCUE_BATCH {
                return Ok(total);
            }
        }
    }

    /// Ticks until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.cancelled() => return,
            }
            match self.run_once().await {
                Ok(r) if !r.retried.is_empty() || !r.dead.is_empty() => {
                    tracing::info!(
                        retried = r.retried.len(),
                        dead = r.dead.len(),
                        "rescued expired leases"
                    );
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "rescue failed"),
            }
        }
    }
}
