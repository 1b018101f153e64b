//! Writing one batch of outcomes (the completer's flush): one statement per kind, retried while
//! the database is away; an outcome the database keeps refusing is isolated by splitting the batch,
//! so it cannot hold up the others; after shutdown, retries stop at the shutdown deadline.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use chrono::Utc;

use super::completer::{HandOver, Settle, SettleKind};
use super::observer::{Observer, Settlement};
use crate::store::{Dead, Retry, RetryReport, Settled, Snooze, Store};

/// Failed tries of the same batch before the database is asked whether it is up, and the batch is
/// split (or, alone, the outcome is given up on) if it is.
const TRIES_BEFORE_SPLIT: u32 = 3;

/// Lock timeouts of one batch not counted as failures (the back-off between tries grows to 5 s, so
/// about a minute of a key lock held elsewhere) before they count like any other failure.
const LOCK_WAITS: u32 = 15;

/// What a flush writes with.
pub(crate) struct Writer<'a> {
    pub store: &'a Store,
    pub observer: &'a dyn Observer,
    pub sink: &'a dyn crate::sink::Sink,
    pub hand_over: &'a HandOver,
    /// After shutdown, how long a batch is retried before it is left to lease expiry.
    pub shutdown_deadline: Duration,
    /// Snoozes a message may take without using an attempt.
    pub max_snoozes: i32,
}

enum Tried {
    Written,
    /// The database is up and refuses this batch: split it.
    Refused(crate::Error),
    /// Shutting down and past the deadline.
    OutOfTime(crate::Error),
}

impl Writer<'_> {
    /// Writes `batch`: retried with back-off while the database is away, so outcomes are not
    /// dropped (if it stays away long enough the leases expire and rescue takes over; the late
    /// write is then fenced and counted). If the database is up and keeps refusing the batch, the
    /// batch is split until the outcome it refuses is alone: a refused retry or release becomes a
    /// dead letter with the database's error as reason; anything else is left to lease expiry and
    /// logged.
    pub(crate) async fn flush(&self, batch: Vec<Settle>) {
        let mut parts = vec![batch];
        while let Some(mut part) = parts.pop() {
            match self.try_write(&mut part).await {
                Tried::Written => {}
                Tried::Refused(e) if part.len() > 1 => {
                    tracing::warn!(error = %e, outcomes = part.len(), "the database refuses a batch of outcomes; splitting it");
                    let half = part.split_off(part.len() / 2);
                    parts.push(half);
                    parts.push(part);
                }
                Tried::Refused(e) => {
                    let s = &mut part[0];
                    match &s.kind {
                        SettleKind::Retry { .. }
                        | SettleKind::Release
                        | SettleKind::Snooze { .. } => {
                            tracing::error!(id = s.lease.id, error = %e, "the database refuses this outcome; dead-lettering the message");
                            s.kind = SettleKind::Dead {
                                reason: format!("postbox could not record its outcome: {e}"),
                            };
                            parts.push(part);
                        }
                        _ => {
                            tracing::error!(id = s.lease.id, error = %e, "the database refuses this outcome; it is left to lease expiry");
                            self.observer.lease_lost(1);
                        }
                    }
                }
                Tried::OutOfTime(e) => {
                    tracing::error!(error = %e, outcomes = part.len(), "shutdown deadline reached with outcomes unwritten; they are left to lease expiry");
                    self.observer.lease_lost(part.len());
                }
            }
        }
    }

    /// Writes `buf` with one statement per kind of outcome. Each statement commits on its own, so
    /// the result of one that succeeded is kept and it is never run again: a complete-and-hand-over
    /// that committed next to a retry that failed has passed its key's next messages to this
    /// engine, and those must be delivered, not forgotten (running it again would be fenced and
    /// would hand over nothing). When giving up, what was written is reported and removed from
    /// `buf`; what is left is what failed.
    async fn try_write(&self, buf: &mut Vec<Settle>) -> Tried {
        let mut complete = Vec::new();
        let mut heads = 0;
        let mut retry = Vec::new();
        let mut dead = Vec::new();
        let mut release = Vec::new();
        let mut snooze = Vec::new();
        for s in buf.iter() {
            match &s.kind {
                SettleKind::Complete => {
                    complete.push(s.lease);
                    heads += usize::from(s.ordered);
                }
                SettleKind::Retry { error, delay } => retry.push(Retry {
                    lease: s.lease,
                    error: error.clone(),
                    delay: *delay,
                }),
                SettleKind::Dead { reason } => dead.push(Dead {
                    lease: s.lease,
                    reason: reason.clone(),
                }),
                SettleKind::Release => release.push(s.lease),
                SettleKind::Snooze { delay } => snooze.push(Snooze {
                    lease: s.lease,
                    delay: *delay,
                }),
            }
        }
        let mut reserved = self.hand_over.reserve(heads);
        let take = reserved.as_ref().map_or(0, |r| r.1);
        let mut pause = Duration::from_millis(50);
        let mut tries = 0;
        let mut lock_waits = 0;
        let mut give_up_at: Option<Instant> = None;
        let store = self.store;
        let mut written = Written::default();
        let failure = loop {
            let (c, r, d, l, z) = tokio::join!(
                async {
                    match written.complete {
                        None => Some(
                            store
                                .complete_and_take(&complete, take, self.hand_over.lease())
                                .await,
                        ),
                        Some(_) => None,
                    }
                },
                async {
                    match written.retry {
                        None => Some(store.retry(&retry).await),
                        Some(_) => None,
                    }
                },
                async {
                    match written.dead {
                        None => Some(store.dead_letter(&dead).await),
                        Some(_) => None,
                    }
                },
                async {
                    match written.release {
                        None => Some(store.release(&release).await),
                        Some(_) => None,
                    }
                },
                async {
                    match written.snooze {
                        None => Some(store.snooze(&snooze, self.max_snoozes).await),
                        Some(_) => None,
                    }
                },
            );
            let mut error = None;
            match c {
                Some(Ok((settled, next))) => {
                    // Handed over now, once: they are ours to deliver whatever happens next.
                    if let Some((permits, _)) = reserved.take() {
                        self.observer.claimed(next.len());
                        self.hand_over.push(next, permits);
                    }
                    written.complete = Some(settled);
                }
                Some(Err(e)) => error = Some(e),
                None => {}
            }
            keep(&mut written.retry, r, &mut error);
            keep(&mut written.dead, d, &mut error);
            keep(&mut written.release, l, &mut error);
            keep(&mut written.snooze, z, &mut error);
            let Some(e) = error else {
                break None;
            };
            // Waiting on a lock (a writer of the key committing) is contention, not refusal, for
            // a while: a lock held for longer than LOCK_WAITS tries counts like any failure.
            if is_lock_wait(&e) && lock_waits < LOCK_WAITS {
                lock_waits += 1;
            } else {
                tries += 1;
            }
            if self.hand_over.shutdown().is_cancelled() {
                let at = *give_up_at.get_or_insert_with(|| Instant::now() + self.shutdown_deadline);
                if Instant::now() >= at {
                    break Some(Tried::OutOfTime(e));
                }
            }
            if tries >= TRIES_BEFORE_SPLIT && store.ping().await.is_ok() {
                break Some(Tried::Refused(e));
            }
            // Waiting for the database is not being stuck.
            self.observer.alive(self.sink.name());
            tracing::warn!(error = %e, outcomes = buf.len(), retry_in = ?pause, "completer cannot write outcomes");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(5));
        };
        self.report(buf, &written);
        self.observer.alive(self.sink.name());
        failure.unwrap_or(Tried::Written)
    }

    /// Reports every outcome of `buf` whose statement was written (what happened to it, as the
    /// database saw it) and removes it from `buf`.
    fn report(&self, buf: &mut Vec<Settle>, w: &Written) {
        let now = Utc::now();
        let fenced: HashSet<i64> = [
            w.complete.as_ref().map(|s| &s.fenced),
            w.retry.as_ref().map(|r| &r.fenced),
            w.dead.as_ref().map(|s| &s.fenced),
            w.release.as_ref().map(|s| &s.fenced),
            w.snooze.as_ref().map(|r| &r.fenced),
        ]
        .into_iter()
        .flatten()
        .flatten()
        .copied()
        .collect();
        let exhausted: HashSet<i64> = [&w.retry, &w.snooze]
            .into_iter()
            .flatten()
            .flat_map(|r| r.dead.iter().copied())
            .collect();
        let snoozed: HashSet<i64> = w
            .snooze
            .as_ref()
            .map(|r| r.snoozed.iter().copied().collect())
            .unwrap_or_default();
        buf.retain(|s| {
            let done = match s.kind {
                SettleKind::Complete => w.complete.is_some(),
                SettleKind::Retry { .. } => w.retry.is_some(),
                SettleKind::Dead { .. } => w.dead.is_some(),
                SettleKind::Release => w.release.is_some(),
                SettleKind::Snooze { .. } => w.snooze.is_some(),
            };
            if !done {
                return true;
            }
            let what = if fenced.contains(&s.lease.id) {
                Settlement::Fenced
            } else {
                match s.kind {
                    SettleKind::Complete => Settlement::Delivered,
                    SettleKind::Retry { .. } if exhausted.contains(&s.lease.id) => {
                        Settlement::DeadLettered
                    }
                    SettleKind::Retry { .. } => Settlement::Retried,
                    SettleKind::Dead { .. } => Settlement::DeadLettered,
                    SettleKind::Release => Settlement::Released,
                    SettleKind::Snooze { .. } if exhausted.contains(&s.lease.id) => {
                        Settlement::DeadLettered
                    }
                    SettleKind::Snooze { .. } if snoozed.contains(&s.lease.id) => {
                        Settlement::Snoozed
                    }
                    // Past the cap: an attempt used, as a retry.
                    SettleKind::Snooze { .. } => Settlement::Retried,
                }
            };
            let age = (now - s.created_at).to_std().unwrap_or_default();
            self.observer.settled(&s.topic, self.sink.name(), what, age);
            false
        });
    }
}

/// The statements of one flush that committed, with their results.
#[derive(Default)]
struct Written {
    complete: Option<Settled>,
    retry: Option<RetryReport>,
    dead: Option<Settled>,
    release: Option<Settled>,
    snooze: Option<RetryReport>,
}

/// A statement ended by `lock_timeout` (SQLSTATE 55P03, "canceling statement due to lock
/// timeout"): worth trying again as it is, up to [`LOCK_WAITS`] times.
fn is_lock_wait(e: &crate::Error) -> bool {
    e.to_string().contains("lock timeout")
}

/// Keeps a statement's result, or the first error.
fn keep<T>(
    slot: &mut Option<T>,
    result: Option<crate::Result<T>>,
    error: &mut Option<crate::Error>,
) {
    match result {
        Some(Ok(v)) => *slot = Some(v),
        Some(Err(e)) => {
            error.get_or_insert(e);
        }
        None => {}
    }
}
