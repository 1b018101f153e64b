//! What the streamer confirms, held to a limit recorded in the database first (see the migration
//! `stream_slot_guard`): a slot found confirmed past the limit was not confirmed by postbox (it
//! was created again under the same name by hand, or advanced), and what was published before its
//! position may never have been streamed.
//!
//! One record covers every confirmation up to the server's WAL position at the time it was made,
//! so a busy stream records at most every [`RECORD_EVERY`]. An idle stream's keepalives do not
//! record again for WAL that is only the last record's own: the record would write WAL, the next
//! keepalive would report it, and the relay would record for ever.

use std::time::{Duration, Instant};

use pgwire_replication::{Lsn, ReplicationClient};
use tokio::task::JoinHandle;

use super::StreamReport;
use super::relay::lsn_text;
use crate::store::{Recorded, Store};

/// The least time between two records of the confirmation limit.
pub const RECORD_EVERY: Duration = Duration::from_millis(50);

/// How long a record may take before it counts as failed.
const RECORD_TIMEOUT: Duration = Duration::from_secs(10);

/// After a record failed, confirmations go unguarded this long (the slot keeps moving: WAL is
/// not kept for a database that cannot be written), then recording is tried again.
const UNGUARDED_FOR: Duration = Duration::from_secs(30);

type Recording = JoinHandle<Result<Option<Recorded>, String>>;

/// Why a position is confirmed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Confirm {
    /// Every message before it was delivered or dead-lettered.
    Delivered,
    /// A transaction without postbox messages passed (the stream's progress, but no reason to
    /// record: the last record's own transaction may be one, on servers that send empty ones).
    Passed,
    /// A keepalive's position: nothing is in flight.
    Idle,
}

pub(super) struct Guard {
    store: Store,
    slot: String,
    /// What the relay may confirm up to without recording again.
    limit: Option<u64>,
    /// The server's position right after the last record committed.
    own_end: u64,
    /// The highest position asked to be confirmed in this session.
    wanted: u64,
    /// The highest position the stream's own progress asked for (not a keepalive).
    progressed: u64,
    /// The position last handed to the replication client in this session.
    applied: u64,
    recording: Option<Recording>,
    last_record: Option<Instant>,
    /// Until when confirmations go unguarded after a failed record.
    unguarded_until: Option<Instant>,
    failure_said: Option<Instant>,
}

impl Guard {
    pub(super) fn new(store: Store, slot: String) -> Guard {
        Guard {
            store,
            slot,
            limit: None,
            own_end: 0,
            wanted: 0,
            progressed: 0,
            applied: 0,
            recording: None,
            last_record: None,
            unguarded_until: None,
            failure_said: None,
        }
    }

    /// A new replication session: nothing was confirmed on it yet.
    pub(super) fn session_started(&mut self) {
        self.wanted = 0;
        self.progressed = 0;
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
            self.progressed = self.progressed.max(lsn.0);
        }
        self.wanted = self.wanted.max(lsn.0);
        self.apply(client, report);
        self.record_if_needed();
    }

    /// Whether a record is being made (its end is awaited with [`Guard::recorded`]).
    pub(super) fn recording(&self) -> bool {
        self.recording.is_some()
    }

    /// Waits for the record being made (pending for ever when none is).
    pub(super) async fn wait(&mut self) -> Result<Option<Recorded>, String> {
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
        done: Result<Option<Recorded>, String>,
        client: &ReplicationClient,
        report: &mut StreamReport,
    ) {
        self.recording = None;
        self.last_record = Some(Instant::now());
        match done {
            Ok(Some(r)) => {
                self.limit = Some(self.limit.unwrap_or(0).max(r.limit));
                self.own_end = self.own_end.max(r.own_end);
                self.unguarded_until = None;
            }
            // Not registered (dropped meanwhile): nothing to guard; the relay finds the slot
            // gone when it connects again.
            Ok(None) => self.unguarded_until = Some(Instant::now() + UNGUARDED_FOR),
            Err(e) => {
                let now = Instant::now();
                if self
                    .failure_said
                    .is_none_or(|at| now.duration_since(at) >= Duration::from_secs(300))
                {
                    tracing::warn!(slot = %self.slot, error = %e, "stream: cannot record the confirmation limit; confirming without it for a while (a slot created again by hand may go unnoticed, or a restart may report a gap that is not one)");
                    self.failure_said = Some(now);
                }
                self.unguarded_until = Some(now + UNGUARDED_FOR);
            }
        }
        self.apply(client, report);
        self.record_if_needed();
    }

    /// Waits (up to `deadline`) for the record being made and confirms what it allows: a relay
    /// that stops confirms what it delivered.
    pub(super) async fn settle(
        &mut self,
        client: &ReplicationClient,
        report: &mut StreamReport,
        deadline: Duration,
    ) {
        if self.recording.is_none() && self.wanted > self.limit.unwrap_or(0) {
            self.start_record(Duration::ZERO);
        }
        if self.recording.is_some()
            && let Ok(done) = tokio::time::timeout(deadline, self.wait()).await
        {
            self.recording = None;
            self.last_record = Some(Instant::now());
            if let Ok(Some(r)) = done {
                self.limit = Some(self.limit.unwrap_or(0).max(r.limit));
                self.own_end = self.own_end.max(r.own_end);
            }
            self.apply(client, report);
        }
    }

    fn unguarded(&self) -> bool {
        self.unguarded_until
            .is_some_and(|until| Instant::now() < until)
    }

    fn apply(&mut self, client: &ReplicationClient, report: &mut StreamReport) {
        let to = if self.unguarded() {
            self.wanted
        } else {
            self.wanted.min(self.limit.unwrap_or(0))
        };
        if to > self.applied {
            client.update_applied_lsn(Lsn(to));
            self.applied = to;
            report.confirmed = Some(lsn_text(Lsn(to)));
        }
    }

    fn record_if_needed(&mut self) {
        if self.recording.is_some() || self.unguarded() {
            return;
        }
        let limit = self.limit.unwrap_or(0);
        // A keepalive up to the last record's own end says nothing of anyone else's WAL.
        let needed = self.progressed > limit || (self.wanted > limit && self.wanted > self.own_end);
        if needed {
            let wait = self
                .last_record
                .map(|at| (at + RECORD_EVERY).saturating_duration_since(Instant::now()))
                .unwrap_or_default();
            self.start_record(wait);
        }
    }

    fn start_record(&mut self, wait: Duration) {
        let (store, slot, confirmed) = (self.store.clone(), self.slot.clone(), self.applied);
        self.recording = Some(tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            match tokio::time::timeout(RECORD_TIMEOUT, store.stream_record_limit(&slot, confirmed))
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
