//! Maintenance services. Each has the same shape: defaults as constants (see `config`), a
//! validated config, `run_once` returning what it did, and a loop that only ticks. They are safe
//! to run on every replica at once.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::observer::{NoObserver, Observer};
use crate::error::Result;
use crate::store::{PROMOTE_BATCH, Promoted, RESCUE_BATCH, RetryReport, Store};

/// The most stranded keys one rescue repairs (the rest wait for the next tick).
pub const REPAIR_BATCH: u32 = 100;

/// Returns expired leases to pending (or to the dead letters when out of attempts), and repairs
/// stranded ordered keys.
#[derive(Clone)]
pub struct Rescuer {
    store: Store,
    interval: Duration,
    observer: Arc<dyn Observer>,
}

impl std::fmt::Debug for Rescuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rescuer")
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

impl Rescuer {
    /// A rescuer ticking every `interval`.
    pub fn new(store: Store, interval: Duration) -> Self {
        Rescuer {
            store,
            interval,
            observer: Arc::new(NoObserver),
        }
    }

    /// Reports the keys it repairs to `o` (metrics).
    pub fn observer(mut self, o: Arc<dyn Observer>) -> Self {
        self.observer = o;
        self
    }

    /// Rescues every lease expired now, in batches, after giving the messages of lost held
    /// batches an expired lease (their attempt counts), and drops the registrations of listeners
    /// that died while waiting; then gives up to [`REPAIR_BATCH`] stranded ordered keys their
    /// head again (logged at WARN: no path of the model strands a key, an operator's SQL can);
    /// returns what it rescued.
    pub async fn run_once(&self) -> Result<RetryReport> {
        // The token the store's floors are stamped with (a new one after a crash or a promotion).
        if let Err(e) = self.store.start_run().await {
            tracing::warn!(error = %e, "making the token of the server's run failed");
        }
        let stale = self.store.clean_listeners().await?;
        if stale > 0 {
            tracing::info!(
                stale,
                "dropped the registrations of listeners that are gone"
            );
        }
        let lost = self.store.lost_holds().await?;
        if lost > 0 {
            tracing::warn!(
                messages = lost,
                "held batches ended without a commit (a relay crashed or lost its connection); their attempts are counted"
            );
        }
        let mut total = RetryReport::default();
        loop {
            let r = self.store.rescue_expired().await?;
            let n = r.retried.len() + r.dead.len();
            total.retried.extend(r.retried);
            total.dead.extend(r.dead);
            if (n as i64) < RESCUE_BATCH {
                break;
            }
        }
        // Heads kept for writers that are done by now, whoever kept them (a relay that kept one
        // finishes it itself after its next wake-up; this is for those that died meanwhile).
        match self.store.finish_heads().await {
            Ok(f) if f.finished > 0 => {
                tracing::debug!(
                    finished = f.finished,
                    "finished heads kept for their writers"
                )
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "finishing kept heads failed"),
        }
        // Completions handlers recorded in their transactions, of messages now gone.
        if let Err(e) = self.store.forget_completions().await {
            tracing::warn!(error = %e, "dropping the completion records of settled messages failed");
        }
        // After the rescues, and never in their way: a repair that fails is tried again next
        // tick.
        match self.store.repair(REPAIR_BATCH).await {
            Ok(repaired) if !repaired.is_empty() => {
                for k in &repaired {
                    tracing::warn!(
                        topic = %k.topic,
                        key = %k.key,
                        "repaired a stranded ordered key: it had waiting messages and no head; its first waiting message is its head again"
                    );
                }
                self.observer.keys_repaired(repaired.len());
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "repair of stranded ordered keys failed"),
        }
        Ok(total)
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

/// Makes scheduled messages (delayed, or backing off after a failure) available when their
/// `run_at` comes: it sleeps until the next one is due, at most `interval` (so a message scheduled
/// meanwhile for sooner is late by at most `interval`).
#[derive(Debug, Clone)]
pub struct Scheduler {
    store: Store,
    interval: Duration,
    wake: Arc<Notify>,
}

impl Scheduler {
    /// A scheduler that looks at least every `interval` and wakes `wake` (the engine's claim
    /// loops) when it made something available.
    pub fn new(store: Store, interval: Duration, wake: Arc<Notify>) -> Self {
        Scheduler {
            store,
            interval,
            wake,
        }
    }

    /// Promotes everything due now, in batches; returns how many and when the next is due.
    pub async fn run_once(&self) -> Result<Promoted> {
        let mut total = 0;
        loop {
            let r = self.store.promote_due().await?;
            total += r.promoted;
            if r.promoted < PROMOTE_BATCH as usize {
                return Ok(Promoted {
                    promoted: total,
                    next_due: r.next_due,
                });
            }
        }
    }

    /// Runs until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        let mut pause = Duration::from_millis(100);
        loop {
            let sleep = match self.run_once().await {
                Ok(r) => {
                    pause = Duration::from_millis(100);
                    if r.promoted > 0 {
                        self.wake.notify_waiters();
                    }
                    r.next_due.map_or(self.interval, |d| d.min(self.interval))
                }
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?pause, "scheduler failed");
                    pause = (pause * 2).min(Duration::from_secs(10));
                    pause
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(sleep) => {}
                _ = stop.cancelled() => return,
            }
        }
    }
}

/// Retention upkeep every [`RETENTION_INTERVAL`](super::config::RETENTION_INTERVAL) until `stop`:
/// the partitions to come of `postbox.completed`, and the expired ones dropped.
pub(crate) async fn keep_completed(store: Store, keep: Duration, stop: CancellationToken) {
    let mut tick = tokio::time::interval(super::config::RETENTION_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => return,
        }
        match store.maintain_completed(keep).await {
            Ok(m) if m.created + m.dropped > 0 => {
                tracing::info!(
                    created = m.created,
                    dropped = m.dropped,
                    "completed-message partitions"
                )
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "completed-message retention upkeep failed"),
        }
    }
}
