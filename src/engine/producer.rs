//! The producer: claims, dispatches to the sink under the concurrency limit, and decides when to
//! wait. Also the in-flight registry that heartbeats extend and shutdown hands back.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::completer::{HandOver, Settle, SettleKind};
use super::config::{EngineConfig, HOLD_SLOT_WAIT, LINGER_STAY_FRACTION, LINGER_STEP, MAX_HOLDS};
use super::notifier::Notifier;
use super::observer::Observer;
use crate::sink::{Outcome, Sink, Unavailable};
use crate::store::{ClaimedMessage, Lease, Store, TakePosition, Topics};

/// In drain mode, the longest wait for the completer before claiming again.
const DRAIN_POLL: Duration = Duration::from_millis(20);

/// A hold takes up to this many messages per message of its batch behind its ordered heads (see
/// `Store::take`): a key being drained is delivered by holds, one message after the other, without
/// a promotion and a claim between them.
const FOLLOWERS_PER_MESSAGE: usize = 16;

/// While its holds are in flight, a claim loop takes after the last row it took (see
/// `Store::take`); this long after it last took from the front, it takes from the front again.
const REWIND: Duration = Duration::from_millis(50);

/// Where a claim loop's last take ended in the claim order, while its holds are in flight; and whether
/// its last claim was full (a backlog: holds pay off; a trickle of small claims leases, which costs
/// one round trip and one commit less per claim).
struct Cursor {
    after: Option<TakePosition>,
    lap: Instant,
    backlog: bool,
    /// The last take came with messages behind its ordered heads.
    chained: bool,
}

impl Cursor {
    fn new() -> Self {
        Cursor {
            after: None,
            lap: Instant::now(),
            // A relay that starts meets a backlog more often than not; one short claim ends it.
            backlog: true,
            chained: false,
        }
    }

    /// The position to take after now (none: from the front, and a new lap starts).
    fn position(&mut self, holds_in_flight: bool) -> Option<TakePosition> {
        if !holds_in_flight || self.lap.elapsed() >= REWIND {
            self.after = None;
        }
        if self.after.is_none() {
            self.lap = Instant::now();
        }
        self.after
    }

    /// After a take of `got` out of `want` that ended at `last`: a short take reached the end,
    /// the next starts from the front.
    fn advance(&mut self, got: usize, want: usize, last: Option<TakePosition>) {
        self.backlog = got >= want;
        if got < want {
            self.after = None;
            return;
        }
        self.after = self.after.max(last);
    }
}

/// Messages claimed by this engine whose outcome has not reached the completer yet, by lease (id
/// and token): a message whose lease was lost and that this engine claimed again is two entries,
/// and the late end of the first delivery does not take the second out of the heartbeat.
#[derive(Default)]
pub(crate) struct InFlight {
    leases: Mutex<HashMap<(i64, i64), Lease>>,
    /// The topic of each message that went in, for the metrics of what shutdown hands back.
    topics: Mutex<HashMap<i64, String>>,
}

impl InFlight {
    pub(crate) fn add(&self, batch: &[ClaimedMessage]) {
        self.note_topics(batch);
        let mut m = self.leases.lock().expect("in-flight lock");
        m.extend(batch.iter().map(|c| ((c.id, c.lease_token), c.lease())));
    }
    /// Records the topics of messages about to be delivered.
    pub(crate) fn note_topics(&self, batch: &[ClaimedMessage]) {
        let mut t = self.topics.lock().expect("in-flight lock");
        t.extend(batch.iter().map(|c| (c.id, c.topic.clone())));
    }
    /// Forgets the topics of messages settled without a lease here (within their hold).
    pub(crate) fn forget_topics(&self, ids: impl IntoIterator<Item = i64>) {
        let mut t = self.topics.lock().expect("in-flight lock");
        for id in ids {
            t.remove(&id);
        }
    }
    /// The topic of a message that went in ("" if none was noted).
    pub(crate) fn topic_of(&self, id: i64) -> String {
        let t = self.topics.lock().expect("in-flight lock");
        t.get(&id).cloned().unwrap_or_default()
    }
    /// Leases of held messages leased as their hold ended.
    pub(crate) fn add_leases(&self, leases: &[Lease]) {
        let mut m = self.leases.lock().expect("in-flight lock");
        m.extend(leases.iter().map(|l| ((l.id, l.token), *l)));
    }
    pub(crate) fn remove(&self, lease: Lease) {
        self.leases
            .lock()
            .expect("in-flight lock")
            .remove(&(lease.id, lease.token));
        self.topics
            .lock()
            .expect("in-flight lock")
            .remove(&lease.id);
    }
    pub(crate) fn leases(&self) -> Vec<Lease> {
        self.leases
            .lock()
            .expect("in-flight lock")
            .values()
            .copied()
            .collect()
    }
    pub(crate) fn take_all(&self) -> Vec<Lease> {
        self.leases
            .lock()
            .expect("in-flight lock")
            .drain()
            .map(|(_, l)| l)
            .collect()
    }
    /// How many of `ids` still have a lease in flight.
    pub(crate) fn still_in(&self, ids: &[i64]) -> usize {
        let m = self.leases.lock().expect("in-flight lock");
        let held: std::collections::HashSet<i64> = m.keys().map(|(id, _)| *id).collect();
        ids.iter().filter(|id| held.contains(id)).count()
    }
    pub(crate) fn len(&self) -> usize {
        self.leases.lock().expect("in-flight lock").len()
    }
}

/// Whether the sink is taking messages; after it reports itself unavailable the producer pauses,
/// doubling the pause on every consecutive report.
pub(crate) struct SinkHealth {
    failures: AtomicU32,
    /// The (routed-to) sink that went down, to report it up again.
    down: Mutex<Option<String>>,
    paused_until: Mutex<Option<Instant>>,
    /// Topics the sink refused, with the refusals in a row and until when they are held back.
    topics: Mutex<HashMap<String, (u32, Instant)>>,
    /// Whether `topics` has any entry: read without the lock on every claim and delivery.
    any_refused: std::sync::atomic::AtomicBool,
    max: Duration,
}

impl SinkHealth {
    pub(crate) fn new(max: Duration) -> Self {
        SinkHealth {
            failures: AtomicU32::new(0),
            down: Mutex::new(None),
            paused_until: Mutex::new(None),
            topics: Mutex::new(HashMap::new()),
            any_refused: std::sync::atomic::AtomicBool::new(false),
            max,
        }
    }
    fn down(&self, observer: &dyn Observer, sink: &str, reason: &str) {
        let n = self.failures.fetch_add(1, Ordering::AcqRel);
        let pause = (Duration::from_millis(100) * 2u32.saturating_pow(n.min(20))).min(self.max);
        *self.paused_until.lock().expect("health lock") = Some(Instant::now() + pause);
        if n == 0 {
            *self.down.lock().expect("health lock") = Some(sink.to_owned());
            observer.sink_up(sink, false);
        }
        tracing::warn!(sink, reason, pause = ?pause, "sink unavailable; batch handed back");
    }
    fn up(&self, observer: &dyn Observer, sink: &str) {
        if self.failures.swap(0, Ordering::AcqRel) > 0 {
            let sink = self
                .down
                .lock()
                .expect("health lock")
                .take()
                .unwrap_or_else(|| sink.to_owned());
            let sink = sink.as_str();
            observer.sink_up(sink, true);
            tracing::info!(sink, "sink available again");
        }
    }
    /// A topic the sink refused (see [`Outcome::TopicUnavailable`]): not claimed for a while,
    /// longer each time in a row, up to the outage back-off's cap.
    fn topic_down(&self, topic: &str, reason: &str) {
        let mut held = self.topics.lock().expect("health lock");
        if let Some((_, until)) = held.get(topic)
            && *until > Instant::now()
        {
            return; // the rest of a batch sent before the topic was held back
        }
        if held.len() >= 1024 {
            // Glob routes can see many topics: forget those not refused for a long while.
            let long_ago = Instant::now().checked_sub(self.max * 8);
            held.retain(|_, (_, until)| long_ago.is_none_or(|t| *until > t));
        }
        let n = held.get(topic).map_or(0, |(n, _)| *n);
        let pause = (Duration::from_millis(500) * 2u32.saturating_pow(n.min(20))).min(self.max);
        held.insert(topic.to_owned(), (n + 1, Instant::now() + pause));
        self.any_refused.store(true, Ordering::Release);
        tracing::warn!(topic, reason, pause = ?pause, "topic refused by the sink; its messages are handed back and it is not claimed meanwhile");
    }
    fn topic_up(&self, topic: &str) {
        let mut held = self.topics.lock().expect("health lock");
        if held.remove(topic).is_some() {
            tracing::info!(topic, "topic accepted by the sink again");
            self.any_refused.store(!held.is_empty(), Ordering::Release);
        }
    }
    /// True if the sink has refused some topic and not accepted it since.
    fn any_refused(&self) -> bool {
        self.any_refused.load(Ordering::Acquire)
    }
    /// Topics held back now.
    pub(crate) fn held_topics(&self) -> Vec<String> {
        if !self.any_refused() {
            return Vec::new();
        }
        let held = self.topics.lock().expect("health lock");
        if held.is_empty() {
            return Vec::new();
        }
        let now = Instant::now();
        held.iter()
            .filter(|(_, (_, until))| *until > now)
            .map(|(t, _)| t.clone())
            .collect()
    }
    pub(crate) fn is_paused(&self) -> bool {
        self.paused_until().is_some()
    }
    fn paused_until(&self) -> Option<Instant> {
        let until = *self.paused_until.lock().expect("health lock");
        until.filter(|t| *t > Instant::now())
    }
}

/// Whether an engine that found work at `rate` messages a second polls on (lingers) rather than
/// waiting for a NOTIFY: from `linger_above`, and once `lingering`, down to a fraction of it;
/// never when `idle_linger` is zero (lingering disabled: the engine stays registered).
fn lingers(rate: f64, lingering: bool, linger_above: f64, idle_linger: Duration) -> bool {
    if idle_linger.is_zero() {
        return false;
    }
    let floor = if lingering {
        linger_above * LINGER_STAY_FRACTION
    } else {
        linger_above
    };
    rate >= floor
}

/// Messages claimed per second, engine-wide, as an exponentially weighted count over ~100 ms.
pub(crate) struct ClaimRate {
    state: Mutex<(f64, Instant)>,
}

impl ClaimRate {
    const TAU: f64 = 0.1;

    pub(crate) fn new() -> Self {
        ClaimRate {
            state: Mutex::new((0.0, Instant::now())),
        }
    }

    fn decayed(state: &mut (f64, Instant)) {
        let now = Instant::now();
        let dt = now.duration_since(state.1).as_secs_f64();
        state.0 *= (-dt / Self::TAU).exp();
        state.1 = now;
    }

    fn add(&self, n: usize) {
        let mut s = self.state.lock().expect("rate lock");
        Self::decayed(&mut s);
        s.0 += n as f64;
    }

    fn per_second(&self) -> f64 {
        let mut s = self.state.lock().expect("rate lock");
        Self::decayed(&mut s);
        s.0 / Self::TAU
    }
}

/// Everything the producer works with.
pub(crate) struct Producer {
    pub store: Store,
    pub sink: Arc<dyn Sink>,
    /// What it serves minus the paused topics.
    pub pauses: Arc<super::pauses::Pauses>,
    pub config: EngineConfig,
    pub observer: Arc<dyn Observer>,
    pub inflight: Arc<InFlight>,
    pub health: Arc<SinkHealth>,
    pub settle_tx: mpsc::Sender<Settle>,
    /// Outcomes sent to the completer and not yet written.
    pub unwritten: Arc<AtomicUsize>,
    pub wake: Arc<Notify>,
    pub notifier: Option<Notifier>,
    pub shutdown: CancellationToken,
    /// Shared by every claim loop of the engine: the concurrency limit.
    pub permits: Arc<Semaphore>,
    /// Shared by every claim loop: how fast work arrives.
    pub rate: ClaimRate,
    /// Messages the completer leased to this engine as it settled their keys' heads.
    pub hand_over: Arc<HandOver>,
    /// Held batches in flight at most (each keeps a pool connection in a transaction).
    pub holds: Arc<Semaphore>,
    /// Bytes of claimed messages in flight (shared by a relay's engines).
    pub budget: Arc<super::PayloadBudget>,
}

impl Producer {
    /// Claims and dispatches until shutdown (or, in drain mode, until nothing is left). Returns
    /// the running deliveries. Every claimed message is started at once: permits are reserved
    /// before the claim.
    pub(crate) async fn run(self: Arc<Self>) -> JoinSet<()> {
        let chunk = self.sink.max_batch().max(1);
        let permits = self.permits.clone();
        let mut tasks = JoinSet::new();
        let mut linger_until: Option<Instant> = None;
        let mut rechecked = false;
        let mut armed = false;
        let mut db_pause = Duration::from_millis(100);
        let mut cursor = Cursor::new();
        // Claims that keep failing on a statement (not on reaching the database) are a stuck
        // engine, not a busy one: the loop goes round but does no work, and liveness must say so.
        let mut claims_failing = false;
        loop {
            while tasks.try_join_next().is_some() {}
            if !claims_failing {
                self.observer.alive(self.sink.name());
            }
            if self.shutdown.is_cancelled() {
                return tasks;
            }
            if let Some((batch, mut permits)) = self.hand_over.pop() {
                self.dispatch(batch, chunk, &mut permits, &mut tasks);
                continue;
            }
            if let Some(until) = self.health.paused_until() {
                tokio::select! {
                    _ = tokio::time::sleep_until(until.into()) => {}
                    _ = self.shutdown.cancelled() => {}
                }
                continue;
            }
            // Large messages fill the payload budget before the permits run out.
            if self.budget.room(1) == 0 {
                tokio::select! {
                    _ = self.budget.freed() => {}
                    _ = self.hand_over.queued.notified() => {}
                    _ = self.shutdown.cancelled() => {}
                }
                continue;
            }
            // Reserve room before claiming, so claim loops never claim more than the limit.
            if permits.available_permits() == 0 {
                tokio::select! {
                    p = permits.acquire() => drop(p),
                    // Handed-over messages arrive with their permits.
                    _ = self.hand_over.queued.notified() => {}
                    _ = self.shutdown.cancelled() => {}
                }
                continue;
            }
            let chunks = permits
                .available_permits()
                .min(self.config.batch_size.div_ceil(chunk));
            let Ok(mut reserved) = permits.clone().try_acquire_many_owned(chunks as u32) else {
                tokio::task::yield_now().await; // another claim loop took them first
                continue;
            };
            let want = (chunks * chunk).min(self.config.batch_size);
            // Drain mode ends only on an empty claim made after every outcome was written (an
            // outcome can make messages claimable: a retry due now, the next of an ordered key).
            let idle_before = self.idle(&tasks);
            self.observer.claim_started(self.sink.name());
            let claimed = self
                .claim(want, chunk, &mut reserved, &mut tasks, &mut cursor)
                .await;
            self.observer.claim_ended(self.sink.name(), claimed.is_ok());
            let got = match claimed {
                Ok(got) => {
                    db_pause = Duration::from_millis(100);
                    claims_failing = false;
                    got
                }
                Err(e) => {
                    drop(reserved);
                    claims_failing = !matches!(e, crate::Error::Pool(_));
                    tracing::warn!(error = %e, retry_in = ?db_pause, "claim failed");
                    tokio::select! {
                        _ = tokio::time::sleep(db_pause) => {}
                        _ = self.shutdown.cancelled() => {}
                    }
                    db_pause = (db_pause * 2).min(Duration::from_secs(10));
                    continue;
                }
            };
            if got > 0 {
                rechecked = false;
                if std::mem::take(&mut armed)
                    && let Some(n) = &self.notifier
                {
                    n.disarm();
                }
            }
            drop(reserved);
            if got > 0 {
                if cursor.backlog {
                    // There may be more right now: bring any sleeping claim loop in too.
                    self.wake.notify_waiters();
                    continue;
                }
                // A fast flow: poll rather than make writers NOTIFY. Once lingering, it goes on
                // down to a fraction of the threshold: notifying commits are serialised, so the
                // writers of a flow that the engine waits for by NOTIFY may be held below the
                // threshold by that alone, and would never bring the engine back to polling.
                let lingering = linger_until.is_some();
                if lingers(
                    self.rate.per_second(),
                    lingering,
                    self.config.linger_above,
                    self.config.idle_linger,
                ) {
                    if !lingering && let Some(n) = &self.notifier {
                        n.linger();
                    }
                    linger_until = Some(Instant::now() + self.config.idle_linger);
                }
            }
            if self.config.drain {
                if got == 0 && idle_before && self.idle(&tasks) {
                    // What writers committed to the intake since the last claim's move (which
                    // another relay's move may have found taken) is part of what is left.
                    if self.store.move_intake_all().await.unwrap_or(0) == 0 {
                        return tasks;
                    }
                    continue;
                }
                if got == 0 {
                    // What is left comes from our own outcomes: the completer wakes us.
                    self.pause(DRAIN_POLL).await;
                }
                continue;
            }
            // Nothing (more) claimable right now.
            if let Some(until) = linger_until {
                if Instant::now() < until {
                    self.pause(LINGER_STEP).await;
                    continue;
                }
                linger_until = None;
            }
            if let Some(n) = &self.notifier
                && n.arm().await
            {
                armed = true;
                // Registered: look once more (the next turn of the loop, without lingering),
                // so nothing committed before the registration waits for the next poll.
                if !std::mem::replace(&mut rechecked, true) {
                    continue;
                }
            }
            rechecked = false;
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(self.config.poll_interval) => {}
                _ = self.shutdown.cancelled() => {}
            }
        }
    }

    async fn pause(&self, d: Duration) {
        tokio::select! {
            _ = tokio::time::sleep(d) => {}
            _ = self.wake.notified() => {}
            _ = self.shutdown.cancelled() => {}
        }
    }

    /// True when nothing claimed is in flight and every outcome is written.
    fn idle(&self, tasks: &JoinSet<()>) -> bool {
        tasks.is_empty() && self.inflight.len() == 0 && self.unwritten.load(Ordering::Acquire) == 0
    }

    /// Claims up to `want` messages and starts their deliveries: held (see
    /// [`EngineConfig::hold_limit`]) while there is a backlog (the last claim was full) and a hold
    /// slot is free, leased otherwise. Returns how many.
    async fn claim(
        self: &Arc<Self>,
        want: usize,
        chunk: usize,
        reserved: &mut OwnedSemaphorePermit,
        tasks: &mut JoinSet<()>,
        cursor: &mut Cursor,
    ) -> crate::Result<usize> {
        // As many as the payload budget holds now (at least one: the caller saw room).
        let want = self.budget.room(want).max(1);
        let claimable = self.pauses.topics();
        // Topics the sink refused lately are left alone meanwhile; the others flow.
        let held = self.health.held_topics();
        let claimable = if held.is_empty() {
            claimable
        } else {
            Arc::new(claimable.without(&Topics::exact(held)))
        };
        // Limited topics first, leased (a hold's messages are not `running`: a limit could not
        // count them), then the rest with the permits left.
        let mut limited = 0;
        for (limit, topics) in &claimable.limited {
            let room = (want - limited).min(reserved.num_permits() * chunk);
            if room == 0 {
                break;
            }
            let batch = self
                .store
                .claim_limited(limit, room, self.config.lease, topics)
                .await?;
            if !batch.is_empty() {
                limited += batch.len();
                self.observer.claimed(batch.len());
                self.rate.add(batch.len());
                self.dispatch(batch, chunk, reserved, tasks);
            }
        }
        let want = (want - limited).min(reserved.num_permits() * chunk);
        if want == 0 {
            return Ok(limited);
        }
        let topics = &claimable.unlimited;
        if topics.is_empty() {
            cursor.backlog = false;
            return Ok(limited);
        }
        let slot = if self.config.hold_limit.is_zero() || !cursor.backlog {
            None
        } else {
            self.hold_slot().await
        };
        if let Some(slot) = slot {
            // Ordered keys being drained: a hold's keys are claimable again only once it ends, so
            // smaller holds, several at once, keep deliveries going while one ends.
            let want = if cursor.chained {
                want.div_ceil(MAX_HOLDS)
            } else {
                want
            };
            let in_flight = self.holds.available_permits() + 1 < MAX_HOLDS;
            let after = cursor.position(in_flight);
            let Some(hold) = self
                .store
                .take(
                    want,
                    self.config.hold_limit,
                    topics,
                    after,
                    (want * FOLLOWERS_PER_MESSAGE).min(
                        self.budget
                            .room(want * (FOLLOWERS_PER_MESSAGE + 1))
                            .saturating_sub(want),
                    ),
                )
                .await?
            else {
                // Nothing claimable besides what its holds in flight have: still a backlog if it
                // was one, as the next rows become claimable when those end.
                let backlog = cursor.backlog;
                cursor.advance(0, want, None);
                cursor.backlog = backlog && in_flight;
                return Ok(limited);
            };
            cursor.advance(hold.messages.len(), want, hold.last);
            cursor.chained = !hold.followers.is_empty();
            // Ordered keys with more waiting behind what was taken are a backlog too.
            cursor.backlog |=
                hold.followers_capped || hold.messages.len() + hold.followers.len() >= want;
            let got = hold.messages.len();
            self.observer.claimed(got);
            self.rate.add(got);
            let permits = reserved
                .split(got.div_ceil(chunk))
                .expect("a permit was reserved for every chunk");
            // Registered, delivered and ended by a task of its own: the claim loop goes on. Its
            // messages weigh on the budget until it ends.
            let charge = self.budget.charge(&hold.messages);
            let followers = self.budget.charge(&hold.followers);
            let run = super::held::run(self.clone(), hold, chunk, permits, slot);
            tasks.spawn(async move {
                run.await;
                drop((charge, followers));
            });
            return Ok(limited + got);
        }
        let batch = self.store.claim(want, self.config.lease, topics).await?;
        let got = batch.len();
        cursor.backlog = got >= want;
        self.observer.claimed(got);
        self.rate.add(got);
        if got > 0 {
            self.dispatch(batch, chunk, reserved, tasks);
        }
        Ok(limited + got)
    }

    /// A place among the engine's holds in flight: one that is free, or the first to free up
    /// within [`HOLD_SLOT_WAIT`] (a hold ends in a few milliseconds once its deliveries are done;
    /// leasing meanwhile would write every row twice and walk past the rows the holds lock).
    /// None if every hold is still delivering then: the claim leases.
    async fn hold_slot(&self) -> Option<OwnedSemaphorePermit> {
        if let Ok(slot) = self.holds.clone().try_acquire_owned() {
            return Some(slot);
        }
        tokio::select! {
            slot = tokio::time::timeout(HOLD_SLOT_WAIT, self.holds.clone().acquire_owned()) => {
                slot.ok()?.ok()
            }
            _ = self.shutdown.cancelled() => None,
        }
    }

    /// Starts one delivery per chunk of leased messages, each holding one of the reserved permits.
    fn dispatch(
        self: &Arc<Self>,
        batch: Vec<ClaimedMessage>,
        chunk: usize,
        reserved: &mut OwnedSemaphorePermit,
        tasks: &mut JoinSet<()>,
    ) {
        self.inflight.add(&batch); // again for handed-over batches: no harm
        for (part, permit) in chunks(batch, chunk, reserved) {
            let charge = self.budget.charge(&part);
            let delivery = deliver(self.clone(), part, permit);
            tasks.spawn(async move {
                delivery.await;
                drop(charge);
            });
        }
    }

    /// The delivery timeout of a chunk: the longest of its topics'.
    pub(crate) fn timeout_of(&self, part: &[ClaimedMessage]) -> Duration {
        part.iter()
            .map(|m| self.config.timeout_for(&m.topic))
            .max()
            .unwrap_or(self.config.delivery_timeout)
    }
}

/// `batch` in chunks of `chunk` messages (a sink's batch), each with one of the `reserved` permits.
pub(crate) fn chunks(
    batch: Vec<ClaimedMessage>,
    chunk: usize,
    reserved: &mut OwnedSemaphorePermit,
) -> Vec<(Vec<ClaimedMessage>, OwnedSemaphorePermit)> {
    let mut out = Vec::with_capacity(batch.len().div_ceil(chunk));
    let mut rest = batch.into_iter().peekable();
    while rest.peek().is_some() {
        let permit = reserved
            .split(1)
            .expect("a permit was reserved for every chunk");
        out.push((rest.by_ref().take(chunk).collect(), permit));
    }
    out
}

/// What a delivery's outcomes are settled with: the lease, topic, whether ordered, created at.
pub(crate) type Meta = (Lease, String, bool, chrono::DateTime<chrono::Utc>);

/// Delivers a chunk of leased messages and hands the outcomes to the completer.
async fn deliver(p: Arc<Producer>, part: Vec<ClaimedMessage>, permit: OwnedSemaphorePermit) {
    let timeout = p.timeout_of(&part);
    let (meta, kinds) = deliver_chunk(&p.sink, part, timeout, &*p.observer, &p.health).await;
    settle(meta, kinds, &p.settle_tx, Some(&p.inflight), &p.unwritten).await;
    drop(permit);
}

/// Delivers one chunk: one outcome per message (a timeout, a panic or a wrong number of outcomes
/// is a retry of each; an unavailable sink releases each).
pub(crate) async fn deliver_chunk(
    sink: &Arc<dyn Sink>,
    chunk: Vec<ClaimedMessage>,
    timeout: Duration,
    observer: &dyn Observer,
    health: &SinkHealth,
) -> (Vec<Meta>, Vec<SettleKind>) {
    let meta: Vec<Meta> = chunk
        .iter()
        .map(|m| (m.lease(), m.topic.clone(), m.ordered, m.created_at))
        .collect();
    if chunk.iter().any(|m| m.undecodable.is_some()) {
        return deliver_decodable(sink, chunk, meta, timeout, observer, health).await;
    }
    let n = chunk.len();
    let started = Instant::now();
    let result = tokio::time::timeout(
        timeout,
        AssertUnwindSafe(sink.deliver(chunk)).catch_unwind(),
    )
    .await;
    observer.delivery(sink.name(), n, started.elapsed());
    let Ok(result) = result else {
        let error = format!("delivery timed out after {timeout:?}");
        tracing::warn!(sink = sink.name(), messages = n, "{error}");
        let kinds = (0..n)
            .map(|_| SettleKind::Retry {
                error: error.clone(),
                delay: None,
            })
            .collect();
        return (meta, kinds);
    };
    let kinds: Vec<SettleKind> = match result {
        Ok(Ok(outcomes)) if outcomes.len() == n => {
            health.up(observer, sink.name());
            // Per-topic refusals: looked at only when there are any (not per message otherwise).
            let refusals = health.any_refused()
                || outcomes
                    .iter()
                    .any(|o| matches!(o, Outcome::TopicUnavailable { .. }));
            for ((_, topic, ..), outcome) in meta.iter().zip(&outcomes).filter(|_| refusals) {
                match outcome {
                    Outcome::TopicUnavailable { reason } => health.topic_down(topic, reason),
                    Outcome::Delivered => health.topic_up(topic),
                    _ => {}
                }
            }
            outcomes.into_iter().map(SettleKind::from).collect()
        }
        Ok(Ok(outcomes)) => {
            let error = format!(
                "sink {} returned {} outcomes for {n} messages",
                sink.name(),
                outcomes.len()
            );
            tracing::error!("{error}");
            (0..n)
                .map(|_| SettleKind::Retry {
                    error: error.clone(),
                    delay: None,
                })
                .collect()
        }
        Ok(Err(Unavailable(reason, down))) => {
            health.down(observer, down.as_deref().unwrap_or(sink.name()), &reason);
            (0..n).map(|_| SettleKind::Release).collect()
        }
        Err(panic) => {
            let error = format!("panicked: {}", panic_message(&*panic));
            (0..n)
                .map(|_| SettleKind::Retry {
                    error: error.clone(),
                    delay: None,
                })
                .collect()
        }
    };
    (meta, kinds)
}

/// A chunk with rows that could not be read: those are dead-lettered with their reason (never
/// handed to the sink: a payload it cannot parse would fail the same way on every attempt), the
/// rest are delivered as usual, and the outcomes come back in the chunk's order.
async fn deliver_decodable(
    sink: &Arc<dyn Sink>,
    chunk: Vec<ClaimedMessage>,
    meta: Vec<Meta>,
    timeout: Duration,
    observer: &dyn Observer,
    health: &SinkHealth,
) -> (Vec<Meta>, Vec<SettleKind>) {
    let mut kinds: Vec<Option<SettleKind>> = Vec::with_capacity(chunk.len());
    let mut good = Vec::new();
    for m in chunk {
        match &m.undecodable {
            Some(reason) => {
                tracing::warn!(id = m.id, reason = %reason, "message cannot be read: dead-lettered");
                kinds.push(Some(SettleKind::Dead {
                    reason: reason.clone(),
                }));
            }
            None => {
                kinds.push(None);
                good.push(m);
            }
        }
    }
    let mut delivered = if good.is_empty() {
        Vec::new()
    } else {
        Box::pin(deliver_chunk(sink, good, timeout, observer, health))
            .await
            .1
    }
    .into_iter();
    let kinds = kinds
        .into_iter()
        .map(|k| k.unwrap_or_else(|| delivered.next().expect("one outcome per message")))
        .collect();
    (meta, kinds)
}

/// Hands a delivery's outcomes to the completer (or to the end of their hold). False when the
/// receiver is gone.
pub(crate) async fn settle(
    meta: Vec<Meta>,
    kinds: impl IntoIterator<Item = SettleKind>,
    tx: &mpsc::Sender<Settle>,
    inflight: Option<&InFlight>,
    unwritten: &AtomicUsize,
) -> bool {
    for ((lease, topic, ordered, created_at), kind) in meta.into_iter().zip(kinds) {
        unwritten.fetch_add(1, Ordering::AcqRel);
        if tx
            .send(Settle {
                lease,
                topic,
                ordered,
                created_at,
                kind,
            })
            .await
            .is_err()
        {
            unwritten.fetch_sub(1, Ordering::AcqRel);
            return false; // completer gone: shutdown releases what is left in flight
        }
        if let Some(inflight) = inflight {
            inflight.remove(lease);
        }
    }
    true
}

impl From<Outcome> for SettleKind {
    fn from(o: Outcome) -> Self {
        match o {
            Outcome::Delivered => SettleKind::Complete,
            Outcome::Retry { reason, delay } => SettleKind::Retry {
                error: reason,
                delay,
            },
            Outcome::Dead { reason } => SettleKind::Dead { reason },
            Outcome::Snooze { delay } => SettleKind::Snooze { delay },
            Outcome::Release { .. } | Outcome::TopicUnavailable { .. } => SettleKind::Release,
        }
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

/// Extends the leases of everything in flight every third of the lease.
pub(crate) async fn heartbeat(
    store: Store,
    inflight: Arc<InFlight>,
    lease: Duration,
    observer: Arc<dyn Observer>,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(lease / 3);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => return,
        }
        let leases = inflight.leases();
        if leases.is_empty() {
            continue;
        }
        match store.extend(&leases, lease).await {
            Ok(r) if !r.fenced.is_empty() => {
                // A message settled while the extension ran is not lost: its outcome was written
                // (it leaves the registry right after its outcome is queued for the completer).
                let lost = inflight.still_in(&r.fenced);
                if lost > 0 {
                    tracing::warn!(
                        lost,
                        "leases lost before delivery finished; their outcomes will be fenced"
                    );
                    observer.lease_lost(lost);
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "lease extension failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_flight_entries_are_per_lease_not_per_message() {
        let f = InFlight::default();
        let (old, new) = (Lease { id: 7, token: 1 }, Lease { id: 7, token: 2 });
        f.leases.lock().unwrap().insert((7, 1), old);
        f.leases.lock().unwrap().insert((7, 2), new);
        f.remove(old);
        assert_eq!(f.leases(), vec![new]);
    }

    #[test]
    fn lingering_starts_at_the_threshold_and_goes_on_down_to_half_of_it() {
        const ON: Duration = Duration::from_millis(100);
        // Waiting for NOTIFYs: polling starts at the threshold only.
        assert!(!lingers(499.0, false, 500.0, ON));
        assert!(lingers(500.0, false, 500.0, ON));
        // Polling: a flow held back to 300/s (by the NOTIFYs of the time before) keeps it.
        assert!(lingers(300.0, true, 500.0, ON));
        assert!(lingers(250.0, true, 500.0, ON));
        assert!(!lingers(249.0, true, 500.0, ON));
        // Zero: always polls under any flow.
        assert!(lingers(0.0, false, 0.0, ON));
        // A zero idle_linger disables lingering: the engine never unregisters, whatever the flow.
        assert!(!lingers(10_000.0, false, 500.0, Duration::ZERO));
        assert!(!lingers(10_000.0, true, 0.0, Duration::ZERO));
    }
}
