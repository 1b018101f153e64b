//! The end of a held batch (see [`super::EngineConfig::hold_limit`]): its outcomes are gathered
//! until the last one, the hold limit or shutdown, then one statement deletes the delivered messages,
//! leases the retried, dead and still running ones, and commits. Released messages (the sink was
//! unavailable) are simply not touched: they are claimable again, no attempt used. From then on
//! the leased ones are ordinary claimed messages: known outcomes go to the completer, running
//! deliveries join the heartbeat and send theirs there when they end.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use chrono::Utc;
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tokio::task::JoinSet;

use super::completer::{Settle, SettleKind};
use super::observer::Settlement;
use super::producer::{Producer, chunks, deliver_chunk, settle};
use crate::message::MessageId;
use crate::store::{ClaimedMessage, Hold, Lease};

/// The messages a hold took behind its ordered heads (see `Store::take`), started one after the
/// other as the message before each is delivered, until the hold ends.
struct Chains {
    state: Mutex<ChainState>,
}

struct ChainState {
    /// The message that follows each message, by id, not started yet.
    next: HashMap<MessageId, ClaimedMessage>,
    /// Followers started (their leases, should the hold end before their outcome).
    started: Vec<Lease>,
    stopped: bool,
}

impl Chains {
    fn new(heads: &[ClaimedMessage], followers: Vec<ClaimedMessage>) -> Self {
        let mut last: HashMap<(String, Option<String>), MessageId> = heads
            .iter()
            .filter(|m| m.ordered)
            .map(|m| ((m.topic.clone(), m.key.clone()), m.id))
            .collect();
        let mut next = HashMap::with_capacity(followers.len());
        for f in followers {
            let Some(before) = last.get_mut(&(f.topic.clone(), f.key.clone())) else {
                continue; // not behind a head of this hold: never started
            };
            let id = f.id;
            next.insert(std::mem::replace(before, id), f);
        }
        Chains {
            state: Mutex::new(ChainState {
                next,
                started: Vec::new(),
                stopped: false,
            }),
        }
    }

    /// The followers of `delivered` messages, started now; none once the hold has ended.
    fn after(&self, delivered: &[MessageId]) -> Vec<ClaimedMessage> {
        let mut s = self.state.lock().expect("chains lock");
        if s.stopped {
            return Vec::new();
        }
        let next: Vec<ClaimedMessage> = delivered
            .iter()
            .filter_map(|id| s.next.remove(id))
            .collect();
        s.started.extend(next.iter().map(|m| m.lease()));
        next
    }

    /// Ends the chains: no follower starts from now on. Returns those that started.
    fn stop(&self) -> Vec<Lease> {
        let mut s = self.state.lock().expect("chains lock");
        s.stopped = true;
        s.next.clear();
        std::mem::take(&mut s.started)
    }
}

/// Registers `hold`, delivers its messages (one delivery per chunk, each with one of `permits`;
/// the followers of a chunk's delivered messages next, with the same permit), and ends it. `slot`
/// is its place among the engine's holds in flight.
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
    let followers = std::mem::take(&mut hold.followers);
    // Without followers (no ordered heads), deliveries skip the chains altogether.
    let chains = (!followers.is_empty()).then(|| Arc::new(Chains::new(&batch, followers)));
    let leases: Vec<Lease> = batch.iter().map(|m| m.lease()).collect();
    let (tx, rx) = mpsc::channel(batch.len().max(1));
    let mut deliveries = JoinSet::new();
    for (part, permit) in chunks(batch, chunk, &mut permits) {
        deliveries.spawn(deliver(p.clone(), part, permit, tx.clone(), chains.clone()));
    }
    drop((permits, tx));
    end(&p, hold, leases, rx, slot, chains.as_deref()).await;
    while deliveries.join_next().await.is_some() {}
}

/// Delivers `part`, then the followers of its delivered messages, and so on while the hold lasts.
async fn deliver(
    p: Arc<Producer>,
    mut part: Vec<ClaimedMessage>,
    permit: OwnedSemaphorePermit,
    tx: mpsc::Sender<Settle>,
    chains: Option<Arc<Chains>>,
) {
    loop {
        let timeout = p.timeout_of(&part);
        p.inflight.note_topics(&part);
        let (meta, kinds) = deliver_chunk(&p.sink, part, timeout, &*p.observer, &p.health).await;
        let delivered: Vec<MessageId> = match &chains {
            Some(_) => meta
                .iter()
                .zip(&kinds)
                .filter(|(_, k)| matches!(k, SettleKind::Complete))
                .map(|(m, _)| m.0.id)
                .collect(),
            None => Vec::new(),
        };
        if !settle(meta, kinds, &tx, None, &p.unwritten).await {
            break;
        }
        let Some(chains) = &chains else { break };
        part = chains.after(&delivered);
        if part.is_empty() {
            break;
        }
        p.observer.claimed(part.len());
    }
    drop(permit);
}

/// Ends `hold`, whose deliveries send their outcomes to `rx` (closed when the last has ended).
async fn end(
    p: &Arc<Producer>,
    hold: Hold,
    mut leases: Vec<Lease>,
    mut rx: mpsc::Receiver<Settle>,
    slot: OwnedSemaphorePermit,
    chains: Option<&Chains>,
) {
    let until = tokio::time::Instant::now() + p.config.hold_limit;
    let mut got = Vec::with_capacity(leases.len());
    // Until the last outcome, the limit, or shutdown (from then on, deliveries still running are
    // leased, and shutdown treats them as any other).
    loop {
        tokio::select! {
            s = rx.recv() => match s {
                Some(s) => got.push(s),
                None => break,
            },
            _ = tokio::time::sleep_until(until) => break,
            _ = p.shutdown.cancelled() => break,
        }
    }
    // Followers not started stay as they are (waiting, behind the last delivered of their key).
    if let Some(chains) = chains {
        leases.extend(chains.stop());
    }
    while let Ok(s) = rx.try_recv() {
        got.push(s);
    }
    let n = leases.len();
    let answered: HashSet<i64> = got.iter().map(|s| s.lease.id).collect();
    p.inflight.forget_topics(answered.iter().copied());
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
    // The next message of each key whose delivered messages left no head in the hold is promoted
    // (not handed over): the next take holds it with the messages behind it.
    let ended = p
        .store
        .end_hold(hold, &delivered, &rest, p.config.lease, 0)
        .await;
    drop(slot);
    let sink = p.sink.name();
    let unwritten = &p.unwritten;
    if let Err(e) = ended {
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
        // The next messages of delivered ordered keys are claimable now.
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
