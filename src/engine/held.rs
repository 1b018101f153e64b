//! The end of a held batch (see [`super::EngineConfig::hold_limit`]): its outcomes are gathered
//! until the last one, the hold limit or shutdown, then one statement deletes the delivered messages,
//! leases the retried, dead and still running ones, and commits. Released messages (the sink was
//! unavailable) are simply not touched: they are claimable again, no attempt used. From then on
//! the leased ones are ordinary claimed messages: known outcomes go to the completer, running
//! deliveries join the heartbeat and send theirs there when they end.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use chrono::Utc;
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tokio::task::JoinSet;

use super::completer::{Settle, SettleKind};
use super::observer::Settlement;
use super::producer::Producer;
use crate::store::{Hold, Lease};

/// Registers `hold`, delivers its messages (one delivery per chunk, each with one of `permits`),
/// and ends it. `slot` is its place among the engine's holds in flight.
pub(crate) async fn run(
    p: Arc<Producer>,
    mut hold: Hold,
    chunk: usize,
    mut permits: OwnedSemaphorePermit,
    slot: OwnedSemaphorePermit,
) {
    if let Err(e) = p.store.register_hold(&hold).await {
        // Dropping the hold rolls it back: nothing was delivered, the messages are claimable.
        tracing::warn!(error = %e, "could not register a held batch; it is handed back");
        return;
    }
    let batch = std::mem::take(&mut hold.messages);
    let leases: Vec<Lease> = batch.iter().map(|m| m.lease()).collect();
    let (tx, rx) = mpsc::channel(batch.len().max(1));
    let mut deliveries = JoinSet::new();
    p.spawn_deliveries(batch, chunk, &mut permits, &mut deliveries, tx, None);
    drop(permits);
    end(&p, hold, leases, rx, slot).await;
    while deliveries.join_next().await.is_some() {}
}

/// Ends `hold`, whose deliveries send their outcomes to `rx`.
async fn end(
    p: &Arc<Producer>,
    hold: Hold,
    leases: Vec<Lease>,
    mut rx: mpsc::Receiver<Settle>,
    slot: OwnedSemaphorePermit,
) {
    let n = leases.len();
    let until = tokio::time::Instant::now() + p.config.hold_limit;
    let mut got = Vec::with_capacity(n);
    // Until the last outcome, the limit, or shutdown (from then on, deliveries still running are
    // leased, and shutdown treats them as any other).
    while got.len() < n {
        tokio::select! {
            s = rx.recv() => match s {
                Some(s) => got.push(s),
                None => break,
            },
            _ = tokio::time::sleep_until(until) => break,
            _ = p.shutdown.cancelled() => break,
        }
    }
    let answered: HashSet<i64> = got.iter().map(|s| s.lease.id).collect();
    let (done, outcomes): (Vec<Settle>, Vec<Settle>) = got
        .into_iter()
        .partition(|s| matches!(s.kind, SettleKind::Complete | SettleKind::Release));
    let delivered: Vec<i64> = done
        .iter()
        .filter(|s| matches!(s.kind, SettleKind::Complete))
        .map(|s| s.lease.id)
        .collect();
    let running: Vec<Lease> = leases
        .into_iter()
        .filter(|l| !answered.contains(&l.id))
        .collect();
    let rest: Vec<i64> = outcomes
        .iter()
        .map(|s| s.lease.id)
        .chain(running.iter().map(|l| l.id))
        .collect();
    // Delivered heads of ordered keys hand the next messages of their keys over to this engine,
    // as the completer's settle does, while it has room for them.
    let heads = done
        .iter()
        .filter(|s| s.ordered && matches!(s.kind, SettleKind::Complete))
        .count();
    let reserved = p.hand_over.reserve(heads);
    let take = reserved.as_ref().map_or(0, |r| r.1);
    let ended = p
        .store
        .end_hold(hold, &delivered, &rest, p.config.lease, take)
        .await;
    drop(slot);
    let sink = p.sink.name();
    let unwritten = &p.unwritten;
    let next = match ended {
        Ok((_, next)) => next,
        Err(e) => {
            // Rolled back: every message of the hold is claimable again, delivered or not, and the
            // rescuer counts the attempt (postbox.lost_holds).
            tracing::warn!(error = %e, messages = n, "a held batch could not be settled; it was rolled back and will be delivered again");
            p.observer.lease_lost(n);
            unwritten.fetch_sub(done.len() + outcomes.len(), Ordering::AcqRel);
            while rx.recv().await.is_some() {
                unwritten.fetch_sub(1, Ordering::AcqRel);
            }
            return;
        }
    };
    if let Some((permits, _)) = reserved {
        p.observer.claimed(next.len());
        p.hand_over.push(next, permits);
    }
    let now = Utc::now();
    for s in &done {
        let what = match s.kind {
            SettleKind::Complete => Settlement::Delivered,
            _ => Settlement::Released,
        };
        let age = (now - s.created_at).to_std().unwrap_or_default();
        p.observer.settled(&s.topic, sink, what, age);
    }
    unwritten.fetch_sub(done.len(), Ordering::AcqRel);
    p.observer.alive(sink);
    if !delivered.is_empty() {
        // The next messages of delivered ordered heads are claimable now.
        p.wake.notify_one();
    }
    // The rest are leased now: settled by the completer like any claimed message.
    p.inflight.add_leases(&running);
    for s in outcomes {
        forward(p, s).await;
    }
    while let Some(s) = rx.recv().await {
        p.inflight.remove(s.lease);
        forward(p, s).await;
    }
}

async fn forward(p: &Producer, s: Settle) {
    if p.settle_tx.send(s).await.is_err() {
        // The completer is gone (shutdown): the lease expires and the rescuer takes it back.
        p.unwritten.fetch_sub(1, Ordering::AcqRel);
    }
}
