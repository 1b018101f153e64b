//! The completer: outcomes are buffered and written in batches, one statement per kind
//! (complete, retry, dead-letter, release), like River's batch completer. A flush takes whatever
//! has arrived, so at low load every outcome is written at once and under load they batch up by
//! themselves; the bounded channel in front of it is the back-pressure.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

use super::observer::Observer;
use crate::store::{ClaimedMessage, Lease, Store};

/// One outcome to write.
#[derive(Debug)]
pub(crate) struct Settle {
    pub lease: Lease,
    pub topic: String,
    /// The message is the head of an ordered key (its next message can be handed over).
    pub ordered: bool,
    pub created_at: DateTime<Utc>,
    pub kind: SettleKind,
}

#[derive(Debug)]
pub(crate) enum SettleKind {
    Complete,
    Retry {
        error: String,
        delay: Option<Duration>,
    },
    Dead {
        reason: String,
    },
    Release,
    Snooze {
        delay: Duration,
    },
}

/// Flushes of ordered outcomes written at once, each on its own connection (see `run`).
const FLUSHES_IN_FLIGHT: usize = 3;

/// The smallest share of a batch written by a statement of its own (see `run`).
const MIN_PART: usize = 100;

/// Longest wait for the outcomes of running deliveries before a flush.
const GATHER: Duration = Duration::from_millis(2);

/// What the completer writes with, and whom it tells.
pub(crate) struct Completer {
    pub store: Store,
    pub max_batch: usize,
    pub observer: Arc<dyn Observer>,
    pub sink: Arc<dyn crate::sink::Sink>,
    /// Outcomes sent and not yet written (the producer's drain check).
    pub unwritten: Arc<AtomicUsize>,
    /// Woken after each flush.
    pub written: Arc<tokio::sync::Notify>,
    /// Deliveries still running (their outcomes are worth waiting a moment for).
    pub inflight: Arc<super::producer::InFlight>,
    /// Where the next messages of delivered ordered heads go.
    pub hand_over: Arc<HandOver>,
    /// After shutdown, how long an unwritable batch is retried.
    pub shutdown_deadline: Duration,
    /// Snoozes a message may take without using an attempt.
    pub max_snoozes: i32,
}

/// Hand-over (see `postbox.hand_over`): when ordered heads are delivered, the next message of
/// each of their keys is leased to this engine by the same statement that deletes the heads, and
/// queued here for a claim loop to dispatch, with the concurrency permits reserved for it. A key
/// being drained costs one update per message instead of two plus a claim. Only while the engine
/// runs, the sink is up and permits are free: otherwise the next messages become claimable.
pub(crate) struct HandOver {
    permits: Arc<Semaphore>,
    /// Messages per permit (the sink's batch).
    chunk: usize,
    lease: Duration,
    shutdown: CancellationToken,
    health: Arc<super::producer::SinkHealth>,
    inflight: Arc<super::producer::InFlight>,
    pauses: Arc<super::pauses::Pauses>,
    queue: Mutex<VecDeque<(Vec<ClaimedMessage>, OwnedSemaphorePermit)>>,
    /// Signalled when a batch is queued.
    pub(crate) queued: Notify,
    /// Set once shutdown has taken the queue.
    closed: std::sync::atomic::AtomicBool,
}

impl HandOver {
    pub(crate) fn new(
        permits: Arc<Semaphore>,
        chunk: usize,
        lease: Duration,
        shutdown: CancellationToken,
        health: Arc<super::producer::SinkHealth>,
        inflight: Arc<super::producer::InFlight>,
        pauses: Arc<super::pauses::Pauses>,
    ) -> Self {
        HandOver {
            pauses,
            permits,
            chunk: chunk.max(1),
            lease,
            shutdown,
            health,
            inflight,
            queue: Mutex::new(VecDeque::new()),
            queued: Notify::new(),
            closed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Permits for up to `wanted` messages, if the engine can take them now.
    pub(crate) fn reserve(&self, wanted: usize) -> Option<(OwnedSemaphorePermit, usize)> {
        // While a topic is paused nothing is handed over: the next messages of delivered heads
        // become claimable, and claims leave out what is paused.
        if wanted == 0
            || self.shutdown.is_cancelled()
            || self.health.is_paused()
            || self.pauses.any()
        {
            return None;
        }
        let chunks = wanted
            .div_ceil(self.chunk)
            .min(self.permits.available_permits());
        let permit = self
            .permits
            .clone()
            .try_acquire_many_owned(u32::try_from(chunks).ok()?)
            .ok()?;
        Some((permit, (chunks * self.chunk).min(wanted)))
    }

    /// Queues handed-over messages with the permits they need (the rest of `reserved` is given
    /// back as it drops).
    pub(crate) fn push(&self, batch: Vec<ClaimedMessage>, mut reserved: OwnedSemaphorePermit) {
        if batch.is_empty() {
            return;
        }
        let permit = reserved
            .split(batch.len().div_ceil(self.chunk))
            .expect("permits were reserved for every message taken");
        let mut q = self.queue.lock().expect("hand-over lock");
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            // Shutdown has taken what was queued: these are left to their lease's expiry
            // (handed back by the rescue, never counted as interrupted deliveries).
            tracing::warn!(
                messages = batch.len(),
                "handed over after shutdown took the queue; left to lease expiry"
            );
            return;
        }
        self.inflight.add(&batch);
        q.push_back((batch, permit));
        drop(q);
        self.queued.notify_one();
    }

    pub(crate) fn lease(&self) -> Duration {
        self.lease
    }

    pub(crate) fn shutdown(&self) -> &CancellationToken {
        &self.shutdown
    }

    /// The leases of the handed-over messages no claim loop dispatched (at shutdown).
    pub(crate) fn take_queued(&self) -> Vec<Lease> {
        let mut q = self.queue.lock().expect("hand-over lock");
        // Nothing is handed over after this (a flush still running at the end of shutdown).
        self.closed
            .store(true, std::sync::atomic::Ordering::Release);
        q.drain(..)
            .flat_map(|(batch, _)| batch.into_iter().map(|m| m.lease()))
            .collect()
    }

    /// The next handed-over batch to dispatch, with its permits.
    pub(crate) fn pop(&self) -> Option<(Vec<ClaimedMessage>, OwnedSemaphorePermit)> {
        self.queue.lock().expect("hand-over lock").pop_front()
    }
}

/// Runs until every sender is gone, then flushes what is left and returns.
pub(crate) async fn run(c: Completer, mut rx: mpsc::Receiver<Settle>) {
    let Completer {
        store,
        max_batch,
        observer,
        sink,
        unwritten,
        written,
        inflight,
        hand_over,
        shutdown_deadline,
        max_snoozes,
    } = c;
    let flushes = Arc::new(tokio::sync::Semaphore::new(FLUSHES_IN_FLIGHT));
    let mut running = tokio::task::JoinSet::new();
    let mut buf = Vec::with_capacity(max_batch);
    while rx.recv_many(&mut buf, max_batch).await > 0 {
        while running.try_join_next().is_some() {}
        // While deliveries are still running, wait a moment for their outcomes so that a batch
        // is written as one statement rather than as many small ones (small flushes would make
        // the claims that follow them small too, and keep them small).
        let until = tokio::time::Instant::now() + GATHER;
        while buf.len() < max_batch && inflight.len() > 0 {
            let room = max_batch - buf.len();
            match tokio::time::timeout_at(until, rx.recv_many(&mut buf, room)).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        // Outcomes of unordered messages are written one statement at a time: a flush that waits
        // gathers more, and the database's cores are left to the claims. The settling of ordered
        // heads is what makes the next messages of their keys claimable (or hands them over), so
        // while a drain of ordered keys arrives in waves, a large batch of them is split into
        // statements written at once, and the waves overlap instead of queueing behind one writer.
        let heads = buf
            .iter()
            .filter(|s| s.ordered && matches!(s.kind, SettleKind::Complete))
            .count();
        let mut permits = Vec::with_capacity(FLUSHES_IN_FLIGHT);
        if heads == 0 {
            permits.push(
                flushes
                    .clone()
                    .acquire_many_owned(FLUSHES_IN_FLIGHT as u32)
                    .await
                    .expect("the semaphore is never closed"),
            );
        } else {
            permits.push(
                flushes
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("the semaphore is never closed"),
            );
            while heads >= MIN_PART * (permits.len() + 1) {
                match flushes.clone().try_acquire_owned() {
                    Ok(p) => permits.push(p),
                    Err(_) => break,
                }
            }
        }
        let parts = permits.len();
        let per = buf.len().div_ceil(parts);
        for permit in permits {
            let take = per.min(buf.len());
            let mut batch: Vec<Settle> = buf.drain(..take).collect();
            let n = batch.len();
            let (store, observer, sink) = (store.clone(), observer.clone(), sink.clone());
            let (unwritten, written, hand_over) =
                (unwritten.clone(), written.clone(), hand_over.clone());
            running.spawn(async move {
                let writer = super::flush::Writer {
                    store: &store,
                    observer: &*observer,
                    sink: &*sink,
                    hand_over: &hand_over,
                    shutdown_deadline,
                    max_snoozes,
                };
                writer.flush(std::mem::take(&mut batch)).await;
                unwritten.fetch_sub(n, Ordering::AcqRel);
                // Outcomes can make messages claimable (the next of an ordered key, a retry due
                // now): tell a claim loop rather than have it poll for it. `notify_one` keeps the
                // wake-up for a loop that is busy claiming right now, so it is not lost.
                written.notify_one();
                drop(permit);
            });
        }
    }
    while running.join_next().await.is_some() {}
}
