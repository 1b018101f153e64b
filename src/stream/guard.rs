//! What the streamer confirms, held to a limit recorded in the database first (see the migration
//! `stream_slot_guard`): a slot found confirmed past the limit was not confirmed by postbox (it
//! was created again under the same name by hand, advanced, or streamed by another program), and
//! what was published before its position may never have been streamed.
//!
//! The limit is exactly what the relay confirms: a delivered batch's position is recorded (at
//! most every [`RECORD_EVERY`]) before it is confirmed. A keepalive's position (nothing in
//! flight) is recorded only once it is [`IDLE_SLACK`] past the limit: every record writes WAL,
//! which the next keepalive reports, so recording each would never end (and two idle relays
//! would feed each other). Each record first checks the slot against the old limit, so a slot
//! replaced while a relay streams is found at its next record.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pgwire_replication::{Lsn, ReplicationClient};
use tokio::task::JoinHandle;

use super::StreamReport;
use super::relay::lsn_text;
use crate::store::{SlotRecord, Store};

/// The least time between two records of the confirmation limit (a busy stream records at most
/// a hundred times a second, as often as it confirms).
pub const RECORD_EVERY: Duration = Duration::from_millis(10);

/// How far a keepalive's position may pass the limit before it is recorded: the slot of an idle
/// stream stays at most this far behind the server.
pub const IDLE_SLACK: u64 = 256 * 1024;

/// How long a record may take before it counts as failed.
const RECORD_TIMEOUT: Duration = Duration::from_secs(10);

type Recording = JoinHandle<Result<SlotRecord, String>>;

/// Why a position is confirmed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Confirm {
    /// Every message before it was delivered or dead-lettered.
    Delivered,
    /// A transaction without postbox messages passed (the stream's progress, recorded as a
    /// keepalive is).
    Passed,
    /// A keepalive's position: nothing is in flight.
    Idle,
    /// A keepalive's position the server asks to be confirmed now (it shuts down and waits for
    /// the relay to confirm all it sent; a record cannot be made then): confirmed unrecorded,
    /// and this relay remembers it (a slot found there later is its own).
    Requested,
}

pub(super) struct Guard {
    store: Store,
    slot: String,
    /// What the relay may confirm up to (recorded); `None` until the first record.
    limit: Option<u64>,
    /// What this relay confirmed without a record (a server that shut down asked for it).
    unrecorded: u64,
    /// What a record being made reads when it runs (not when it was started: it may wait out a
    /// pause first): the target, what was confirmed, and `unrecorded`.
    shared: Arc<[AtomicU64; 3]>,
    /// The highest position asked to be confirmed in this session.
    wanted: u64,
    /// The highest position delivered batches asked for.
    delivered: u64,
    /// The highest position of a batch handed to delivery: recorded while it is delivered, so
    /// its confirmation does not wait for a record after it.
    ahead: u64,
    /// The position last handed to the replication client in this session.
    applied: u64,
    recording: Option<Recording>,
    last_record: Option<Instant>,
    /// Records that failed in a row (each waits longer before the next, up to 30 s).
    failures: u32,
    failure_said: Option<Instant>,
}

impl Guard {
    pub(super) fn new(store: Store, slot: String) -> Guard {
        Guard {
            store,
            slot,
            limit: None,
            unrecorded: 0,
            shared: Arc::new([AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)]),
            wanted: 0,
            delivered: 0,
            ahead: 0,
            applied: 0,
            recording: None,
            last_record: None,
            failures: 0,
            failure_said: None,
        }
    }

    /// A new replication session: nothing was confirmed on it yet. A record still being made
    /// for the last session goes on: it checks the slot first.
    pub(super) fn session_started(&mut self) {
        self.wanted = 0;
        self.delivered = 0;
        self.ahead = 0;
        self.applied = 0;
    }

    /// Asks that `lsn` be confirmed, for `why`.
    pub(super) fn confirm(
        &mut self,
        client: &ReplicationClient,
        lsn: Lsn,
        why: Confirm,
        report: &mut StreamReport,
    ) {
        if why != Confirm::Idle {
            report.progress += 1;
        }
        if lsn.0 == 0 {
            return;
        }
        if why == Confirm::Delivered {
            self.delivered = self.delivered.max(lsn.0);
        }
        if why == Confirm::Requested {
            self.unrecorded = self.unrecorded.max(lsn.0);
        }
        self.wanted = self.wanted.max(lsn.0);
        self.apply(client, report);
        self.record_if_needed();
    }

    /// A transaction of postbox messages was read (or a batch goes to delivery) up to `lsn`: its
    /// position is recorded while it is delivered. (The limit then covers what was read and not
    /// delivered yet: a slot advanced by hand to a position inside that, while no relay runs, is
    /// not told apart; one moved to the server's position is.)
    pub(super) fn delivering(&mut self, lsn: Lsn) {
        self.ahead = self.ahead.max(lsn.0);
        self.share();
        self.record_if_needed();
    }

    /// Whether a record is being made (its end is awaited with [`Guard::wait`]).
    pub(super) fn recording(&self) -> bool {
        self.recording.is_some()
    }

    /// Waits for the record being made (pending for ever when none is).
    pub(super) async fn wait(&mut self) -> Result<SlotRecord, String> {
        match &mut self.recording {
            Some(task) => match task.await {
                Ok(r) => r,
                Err(e) => Err(format!("record task: {e}")),
            },
            None => std::future::pending().await,
        }
    }

    /// The record being made ended with `done`: confirms what it allows.
    pub(super) fn recorded(
        &mut self,
        done: Result<SlotRecord, String>,
        client: &ReplicationClient,
        report: &mut StreamReport,
    ) {
        self.recording = None;
        self.last_record = Some(Instant::now());
        self.take(done);
        self.apply(client, report);
        self.record_if_needed();
    }

    fn take(&mut self, done: Result<SlotRecord, String>) {
        match done {
            Ok(SlotRecord::Ours { limit }) => {
                self.failures = 0;
                if let Some(l) = limit {
                    self.limit = Some(self.limit.unwrap_or(0).max(l));
                }
            }
            Ok(SlotRecord::Gap { from, to, limit }) => {
                self.failures = 0;
                self.limit = Some(limit);
                gap_found(&self.slot, &from, &to);
            }
            Ok(SlotRecord::Missing) => {
                self.failed("the slot is not registered, or the server has no such slot".into())
            }
            Err(e) => self.failed(e),
        }
    }

    fn failed(&mut self, why: String) {
        self.failures = self.failures.saturating_add(1);
        let now = Instant::now();
        if self
            .failure_said
            .is_none_or(|at| now.duration_since(at) >= Duration::from_secs(300))
        {
            tracing::warn!(slot = %self.slot, error = %why, "stream: cannot record the confirmation limit: delivered messages are not confirmed past it until a record succeeds (they are streamed again after a restart, and the server keeps their WAL)");
            self.failure_said = Some(now);
        }
    }

    /// Waits (up to `deadline`) for a record of what was delivered and confirms what it allows:
    /// a relay that stops confirms what it delivered.
    pub(super) async fn settle(
        &mut self,
        client: &ReplicationClient,
        report: &mut StreamReport,
        deadline: Duration,
    ) {
        let deadline = tokio::time::Instant::now() + deadline;
        loop {
            if self.recording.is_none() {
                if self.delivered <= self.limit.unwrap_or(0) {
                    return;
                }
                self.start_record(Duration::ZERO);
            }
            match tokio::time::timeout_at(deadline, self.wait()).await {
                Ok(done) => {
                    self.recording = None;
                    self.last_record = Some(Instant::now());
                    let failed =
                        !matches!(done, Ok(SlotRecord::Ours { .. } | SlotRecord::Gap { .. }));
                    self.take(done);
                    self.apply(client, report);
                    if failed {
                        return;
                    }
                }
                Err(_) => return,
            }
        }
    }

    fn apply(&mut self, client: &ReplicationClient, report: &mut StreamReport) {
        let to = self
            .wanted
            .min(self.limit.unwrap_or(0).max(self.unrecorded));
        if to > self.applied {
            client.update_applied_lsn(Lsn(to));
            self.applied = to;
            report.confirmed = Some(lsn_text(Lsn(to)));
        }
        self.share();
    }

    fn record_if_needed(&mut self) {
        if self.recording.is_some() {
            return;
        }
        let needed = match self.limit {
            None => self.wanted > 0 || self.ahead > 0 || self.unrecorded > 0,
            // What was confirmed unrecorded when a server shut down is recorded as soon as a
            // record can be made (another relay would take it for a slot not postbox's).
            Some(limit) => {
                self.delivered > limit
                    || self.ahead > limit
                    || self.unrecorded > limit
                    || self.wanted >= limit.saturating_add(IDLE_SLACK)
            }
        };
        if needed {
            let since = self
                .last_record
                .map(|at| at.elapsed())
                .unwrap_or(Duration::MAX);
            let pause = if self.failures > 0 {
                Duration::from_secs(1 << self.failures.min(5)).min(Duration::from_secs(30))
            } else {
                RECORD_EVERY
            };
            self.start_record(pause.saturating_sub(since));
        }
    }

    /// What this relay confirmed without a record, for its checks of the slot.
    pub(super) fn unrecorded(&self) -> u64 {
        self.unrecorded
    }

    /// Publishes what a record reads when it runs.
    fn share(&self) {
        self.shared[0].store(
            self.wanted.max(self.unrecorded).max(self.ahead),
            Ordering::Relaxed,
        );
        self.shared[1].store(self.applied, Ordering::Relaxed);
        self.shared[2].store(self.unrecorded, Ordering::Relaxed);
    }

    fn start_record(&mut self, wait: Duration) {
        let (store, slot, shared) = (self.store.clone(), self.slot.clone(), self.shared.clone());
        self.share();
        self.recording = Some(tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            let [target, confirmed, ours] = [0, 1, 2].map(|i| shared[i].load(Ordering::Relaxed));
            match tokio::time::timeout(
                RECORD_TIMEOUT,
                store.stream_slot_record(&slot, Some(target), confirmed, ours),
            )
            .await
            {
                Ok(r) => r.map_err(|e| crate::redact::redact_url(&e.to_string())),
                Err(_) => Err(format!("no answer within {RECORD_TIMEOUT:?}")),
            }
        }));
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(t) = &self.recording {
            t.abort();
        }
    }
}

/// Says loudly that `slot` was found confirmed past the limit postbox recorded.
pub(super) fn gap_found(slot: &str, from: &str, to: &str) {
    tracing::error!(
        slot = %slot,
        %from,
        %to,
        "stream: the slot was confirmed past the last position postbox recorded for it: it was dropped and created again by hand under the same name, advanced, or streamed by another program; messages published from {from} to {to} may never have been streamed, and cannot be now; streaming goes on from the slot's position; `postbox stream setup` acknowledges this report"
    );
}
