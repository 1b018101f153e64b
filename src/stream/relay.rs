//! The streamer: reads published messages from the slot in commit order, delivers them through
//! the routes' sinks, and confirms to PostgreSQL only the position up to which every message was
//! delivered or dead-lettered. One relay streams a slot at a time (PostgreSQL lets one session
//! hold it); the others wait and take it over when it is free.

use std::sync::Arc;
use std::time::Duration;

use pgwire_replication::{Lsn, PgWireError, ReplicationClient, ReplicationEvent};
use tokio_util::sync::CancellationToken;

use super::deliver::{Delivered, Item, NOT_TRANSACTIONAL, Route, Stopped, deliver};
use super::encoding::{Encoded, PREFIX};
use crate::sink::Sink;
use crate::store::Store;

/// `[stream]` of the relay's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamConfig {
    /// The logical replication slot (default `postbox`).
    pub slot: String,
    /// The publication named when streaming (default `postbox_stream`; it holds no tables).
    pub publication: String,
    /// Set up the slot and publication at start when they were never set up (default true). A
    /// slot that was set up and then lost or dropped is never recreated at start: only
    /// `postbox stream setup` does that, after an operator has seen what was lost.
    pub create_slot: bool,
    /// How often an idle session reports its position to the server (default 1 s); a delivered
    /// batch's position is confirmed within [`CONFIRM_EVERY`](super::CONFIRM_EVERY)
    /// (or this, if shorter).
    pub status_interval: Duration,
    /// Messages delivered together (default 5,000): with the replication buffer, what the relay
    /// holds in memory at most, whatever the size of a transaction.
    pub batch_size: usize,
    /// How often a relay that waits for the slot (another one streams it) tries to take it
    /// (default 1 s).
    pub takeover_interval: Duration,
    /// The longest back-off while a sink is away (default 30 s).
    pub max_backoff: Duration,
    /// After this long without a word from the server (it says nothing while nothing is
    /// published), the relay asks it over a connection of its own whether this relay's
    /// replication session is still there; when it is not (the server ended it: a link that went
    /// silent without a reset, after `wal_sender_timeout`; or another relay took the slot), the
    /// connection is presumed dead and opened again (default 10 s).
    pub liveness_interval: Duration,
    /// How long a sink may take over one batch before it is taken for unavailable: the stream
    /// waits (with the back-off) and sends the batch again (default 60 s, the engine's
    /// `delivery_timeout`).
    pub delivery_timeout: Duration,
    /// Longer (or shorter) delivery timeouts for topic patterns, as the engine's; the longest
    /// pattern that matches wins.
    pub topic_timeouts: Vec<(String, Duration)>,
    /// On stop, how long the batch being delivered may take to finish (default 25 s); after it,
    /// or at a hard stop, it is abandoned and streamed again at the next start.
    pub shutdown_deadline: Duration,
    /// Bytes of messages the streamer holds at most (the relay's `payload_budget`, 64 MiB by
    /// default; counted apart from the table engines'): a batch closes at half of it (at most
    /// 16 MiB), and one message larger than that is a batch of its own.
    pub payload_budget: usize,
}

impl StreamConfig {
    /// Bytes of content a batch closes at: half the payload budget (two batches are held, one
    /// delivered while the next is read), between 1 and 16 MiB.
    pub fn batch_bytes(&self) -> usize {
        (self.payload_budget / 2).clamp(1 << 20, BATCH_BYTES)
    }

    /// The delivery timeout of `topic`.
    pub fn timeout_for(&self, topic: &str) -> Duration {
        self.topic_timeouts
            .iter()
            .filter(|(pattern, _)| crate::store::Topics::only([pattern]).matches(topic))
            .max_by_key(|(pattern, _)| pattern.len())
            .map_or(self.delivery_timeout, |(_, t)| *t)
    }
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            slot: "postbox".into(),
            publication: "postbox_stream".into(),
            create_slot: true,
            status_interval: Duration::from_secs(1),
            batch_size: 5000,
            takeover_interval: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
            liveness_interval: Duration::from_secs(10),
            delivery_timeout: Duration::from_secs(60),
            topic_timeouts: Vec::new(),
            shutdown_deadline: Duration::from_secs(25),
            payload_budget: 64 << 20,
        }
    }
}

/// Why the streamer stopped for good.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The slot is lost (its WAL was removed, `max_slot_wal_keep_size`) or was dropped: what was
    /// published in the range was never delivered. Only `postbox stream setup` replaces it.
    #[error(
        "stream slot {slot:?} is lost ({why}): messages published from {from} to {to} were not delivered and cannot be; run `postbox stream setup` to create a new slot once this is handled"
    )]
    SlotLost {
        /// The slot.
        slot: String,
        /// How it was lost (`lost` WAL, or dropped).
        why: String,
        /// The first position not delivered.
        from: String,
        /// The server's position when the loss was found: what was published up to here is gone.
        to: String,
    },
    /// Stream mode cannot run here (names what is missing).
    #[error("stream mode cannot start: {0}")]
    Unavailable(String),
}

/// What the streamer did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct StreamReport {
    /// Messages delivered.
    pub delivered: u64,
    /// Messages dead-lettered.
    pub dead_lettered: u64,
    /// The last position confirmed to the server.
    pub confirmed: Option<String>,
    /// Confirmations that passed a decoded transaction or a delivered batch (not only the
    /// server's keepalives): the stream's progress.
    pub progress: u64,
}

/// Reports what the streamer is doing (metrics).
pub trait StreamObserver: Send + Sync {
    /// Streaming (true) or waiting for the slot / reconnecting (false).
    fn stream_active(&self, active: bool);
    /// A batch was finished.
    fn stream_delivered(&self, done: Delivered);
    /// The slot is lost.
    fn stream_lost(&self);
    /// The slot is there and can be streamed (again, after `postbox stream setup` replaced a
    /// lost one).
    fn stream_slot_ready(&self) {}
    /// Since when the batch being delivered has waited (`None`: nothing is being delivered).
    fn stream_pending(&self, _since: Option<std::time::Instant>) {}
    /// A sink took a batch (`true`) or is unavailable: it failed, or did not answer in time.
    fn stream_sink_up(&self, _sink: &str, _up: bool) {}
    /// Since when this relay has been unable to stream (its sessions fail, the publication is
    /// missing, the database is away); `None`: it streams, or stands by while another relay does.
    fn stream_broken(&self, _since: Option<std::time::Instant>) {}
    /// The streamer went round its loop (liveness).
    fn stream_alive(&self) {}
    /// The streamer ended (stopped, or for good): no liveness to watch any more.
    fn stream_stopped(&self) {}
}

/// The streamer of one slot.
pub struct Streamer {
    /// The database (a replication connection is opened to it).
    pub url: String,
    /// The slot, the publication, the batch and the intervals.
    pub config: StreamConfig,
    /// The sinks, one per route, in the order of the routes.
    pub sinks: Vec<Arc<dyn Sink>>,
    /// The store (dead letters of stream messages).
    pub store: Store,
    /// Told what the streamer does (metrics), if given.
    pub observer: Option<Arc<dyn StreamObserver>>,
}

enum Ended {
    Stopped,
    Broken(String),
}

fn lsn_text(l: Lsn) -> String {
    format!("{:X}/{:X}", l.0 >> 32, l.0 & 0xffff_ffff)
}

/// The stable id of the `index`-th message of the transaction that committed at `commit`.
pub fn stream_id(commit: u64, index: u32) -> String {
    format!("{commit:016X}-{index:08X}")
}

fn pg_time(micros: i64) -> chrono::DateTime<chrono::Utc> {
    // PostgreSQL's epoch is 2000-01-01.
    chrono::DateTime::from_timestamp_micros(micros + 946_684_800_000_000).unwrap_or_default()
}

impl Streamer {
    fn observe(&self, f: impl FnOnce(&dyn StreamObserver)) {
        if let Some(o) = &self.observer {
            f(o.as_ref());
        }
    }

    /// This relay failed to stream: since when (the metric), and why (logged when it changes,
    /// and every [`BROKEN_REPEAT`] while it lasts).
    fn broken(&self, b: &mut Broken, why: &str, retry_in: Duration) {
        let now = std::time::Instant::now();
        let since = *b.since.get_or_insert(now);
        self.observe(|o| o.stream_broken(Some(since)));
        // The same words with other positions or pids in them are the same failure.
        let shape: String = why.chars().filter(|c| !c.is_ascii_hexdigit()).collect();
        if b.said.as_deref() != Some(shape.as_str())
            || b.said_at
                .is_none_or(|at| now.duration_since(at) >= BROKEN_REPEAT)
        {
            tracing::error!(slot = %self.config.slot, error = %why, for_ = ?now.duration_since(since), ?retry_in, "stream: cannot stream");
            b.said = Some(shape);
            b.said_at = Some(now);
        } else {
            tracing::debug!(slot = %self.config.slot, error = %why, ?retry_in, "stream: cannot stream");
        }
    }

    /// Checks the slot before streaming: set up when never set up (with `create_slot`), loud when
    /// lost or dropped.
    async fn ensure_slot(&self) -> Result<(), Result<StreamError, crate::Error>> {
        let slots = self
            .store
            .stream_status(Some(&self.config.slot))
            .await
            .map_err(Err)?;
        match slots.first() {
            Some(s) if s.name_taken && !s.exists => Err(Ok(StreamError::Unavailable(format!(
                "the slot name {:?} is taken on this server by another database's slot or a physical slot: choose another stream.slot",
                s.slot_name
            )))),
            Some(s) if s.is_lost() => {
                self.observe(|o| o.stream_lost());
                Err(Ok(StreamError::SlotLost {
                    slot: s.slot_name.clone(),
                    why: if s.exists {
                        "wal_status = lost: the server removed WAL it had not delivered".into()
                    } else {
                        "the server has no such slot: it was dropped".into()
                    },
                    from: s
                        .confirmed_lsn
                        .clone()
                        .unwrap_or_else(|| "its last confirmed position".into()),
                    to: s.current_lsn.clone(),
                }))
            }
            Some(_) => Ok(()),
            None if self.config.create_slot => {
                let missing = self.store.stream_prerequisites().await.map_err(Err)?;
                if !missing.is_empty() {
                    return Err(Ok(StreamError::Unavailable(missing.join("; "))));
                }
                let setup = self
                    .store
                    .stream_setup(&self.config.slot, &self.config.publication)
                    .await
                    .map_err(|e| match e {
                        crate::Error::InvalidArgument { .. } => {
                            Ok(StreamError::Unavailable(e.to_string()))
                        }
                        other => Err(other),
                    })?;
                tracing::info!(slot = %self.config.slot, ?setup, "stream: slot set up");
                Ok(())
            }
            None => Err(Ok(StreamError::Unavailable(format!(
                "slot {:?} is not set up in this database (run `postbox stream setup`, or set stream.create_slot = true)",
                self.config.slot
            )))),
        }
    }

    /// Streams until `stop`, reconnecting after a broken session and waiting while another relay
    /// holds the slot. Returns an error only for what a restart cannot fix (a lost slot, a server
    /// without logical decoding).
    pub async fn run(self, stop: CancellationToken) -> Result<StreamReport, StreamError> {
        self.run_until(stop, CancellationToken::new()).await
    }

    /// [`run`](Self::run), and at `hard_stop` hands back at once: the batch being delivered is
    /// abandoned (streamed again at the next start) and the session is not closed politely.
    pub async fn run_until(
        self,
        stop: CancellationToken,
        hard_stop: CancellationToken,
    ) -> Result<StreamReport, StreamError> {
        let observer = self.observer.clone();
        let r = self.streaming(stop, hard_stop).await;
        if let Some(o) = observer {
            o.stream_stopped();
        }
        r
    }

    async fn streaming(
        self,
        stop: CancellationToken,
        hard_stop: CancellationToken,
    ) -> Result<StreamReport, StreamError> {
        let mut report = StreamReport::default();
        let mut pause = Duration::from_millis(250);
        let mut waiting_logged = false;
        // Since when this relay has failed to stream, and what it last said about it (said again
        // only when it changes, or every few minutes).
        let mut broken = Broken::default();
        let mut lost_said = false;
        while !stop.is_cancelled() {
            self.observe(|o| o.stream_alive());
            match self.ensure_slot().await {
                Ok(()) => {
                    if lost_said {
                        tracing::info!(slot = %self.config.slot, "stream: the slot was set up again; streaming from its new position");
                        lost_said = false;
                    }
                    self.observe(|o| o.stream_slot_ready());
                }
                // Lost or dropped: said once, loudly; only `postbox stream setup` replaces it,
                // and this relay streams the new slot as soon as it exists.
                Err(Ok(lost @ StreamError::SlotLost { .. })) => {
                    if !lost_said {
                        tracing::error!(error = %lost, "stream: stopped until the slot is set up again");
                        lost_said = true;
                    }
                    self.observe(|o| o.stream_active(false));
                    if sleep_or_stop(LOST_RECHECK.max(self.config.takeover_interval), &stop).await {
                        break;
                    }
                    continue;
                }
                Err(Ok(fatal)) => return Err(fatal),
                Err(Err(e)) => {
                    self.broken(
                        &mut broken,
                        &format!(
                            "database unreachable: {}",
                            crate::redact::redact_url(&e.to_string())
                        ),
                        pause,
                    );
                    if sleep_or_stop(pause, &stop).await {
                        break;
                    }
                    pause = (pause * 2).min(Duration::from_secs(30));
                    continue;
                }
            }
            match self
                .store
                .stream_publication_exists(&self.config.publication)
                .await
            {
                Ok(true) => {}
                Ok(false) => {
                    self.broken(
                        &mut broken,
                        &format!(
                            "publication {:?} does not exist in this database: the server would end every session at the first table change it decodes (stream.publication names it; `postbox stream setup` creates it)",
                            self.config.publication
                        ),
                        pause,
                    );
                    if sleep_or_stop(pause, &stop).await {
                        break;
                    }
                    pause = (pause * 2).min(Duration::from_secs(30));
                    continue;
                }
                Err(e) => tracing::debug!(error = %e, "stream: cannot check the publication"),
            }
            let mut cfg = super::connect::replication_config(
                &self.url,
                &self.config.slot,
                &self.config.publication,
                self.config.status_interval,
                REPLICATION_BUFFER_EVENTS,
            )
            .map_err(StreamError::Unavailable)?;
            // A name of this session's own, by which the server's view of it is found (see
            // `liveness_interval`).
            let session = format!("postbox-stream-{:016x}", fastrand::u64(..));
            cfg.application_name = Some(session.clone());
            let mut client = match ReplicationClient::connect(cfg).await {
                Ok(c) => c,
                Err(e) => {
                    self.broken(&mut broken, &format!("cannot connect: {e}"), pause);
                    if sleep_or_stop(pause, &stop).await {
                        break;
                    }
                    pause = (pause * 2).min(Duration::from_secs(30));
                    continue;
                }
            };
            let started = tokio::select! {
                r = client.wait_started() => r,
                _ = stop.cancelled() => { client.abort(); break; }
            };
            match started {
                Ok(()) => {}
                Err(e) if slot_in_use(&e) => {
                    if !waiting_logged {
                        tracing::info!(slot = %self.config.slot, "stream: another relay streams the slot; standing by to take over");
                        waiting_logged = true;
                    }
                    // Not broken: another relay streams.
                    broken = Broken::default();
                    self.observe(|o| {
                        o.stream_active(false);
                        o.stream_broken(None)
                    });
                    pause = Duration::from_millis(250);
                    if sleep_or_stop(self.config.takeover_interval, &stop).await {
                        break;
                    }
                    continue;
                }
                Err(e) => {
                    self.broken(&mut broken, &format!("cannot start streaming: {e}"), pause);
                    if sleep_or_stop(pause, &stop).await {
                        break;
                    }
                    pause = (pause * 2).min(Duration::from_secs(30));
                    continue;
                }
            }
            waiting_logged = false;
            if broken.since.is_none() {
                tracing::info!(slot = %self.config.slot, "stream: streaming");
            }
            // Said once the session goes somewhere, after the errors were.
            let recovering = broken.since;
            self.observe(|o| o.stream_active(true));
            let (progress, started_at) = (report.progress, std::time::Instant::now());
            let ended = self
                .session(
                    &mut client,
                    &session,
                    &stop,
                    &hard_stop,
                    &mut report,
                    recovering,
                )
                .await;
            self.observe(|o| o.stream_active(false));
            match ended {
                Ended::Stopped if hard_stop.is_cancelled() => {
                    client.abort();
                    break;
                }
                Ended::Stopped => {
                    // Let the last confirmed position reach the server before the session ends,
                    // so the next start does not stream again what was delivered.
                    let polite = async {
                        let deadline = self.config.status_interval * 3 + Duration::from_secs(2);
                        let since = std::time::Instant::now();
                        while client.feedback_pending_since().is_some()
                            && since.elapsed() < deadline
                        {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        client.stop();
                        let _ =
                            tokio::time::timeout(Duration::from_secs(5), client.shutdown()).await;
                    };
                    tokio::select! {
                        _ = polite => {}
                        _ = hard_stop.cancelled() => {}
                    }
                    client.abort();
                    break;
                }
                Ended::Broken(why) => {
                    client.abort();
                    // A session that went somewhere (a transaction passed, a batch delivered, or
                    // a while without an error) ended: reconnect at once, as after a blip. One
                    // that ends the same way each time backs off and says so.
                    let historic = why.contains("publication")
                        && why.contains("does not exist")
                        && matches!(
                            self.store
                                .stream_publication_exists(&self.config.publication)
                                .await,
                            Ok(true)
                        );
                    if historic {
                        // PostgreSQL before 18 looks the publication up as of the WAL it decodes:
                        // a table change written while it was missing can never be decoded.
                        self.broken(
                            &mut broken,
                            &format!(
                                "the slot is stuck on WAL written while publication {:?} was missing (PostgreSQL before 18 looks it up as of the WAL it decodes, and cannot pass it): {why}; `postbox stream drop` then `postbox stream setup` starts a new slot from now, and says from where messages were not delivered",
                                self.config.publication
                            ),
                            pause,
                        );
                    } else if report.progress > progress || started_at.elapsed() >= HEALTHY_SESSION
                    {
                        broken = Broken::default();
                        self.observe(|o| o.stream_broken(None));
                        pause = Duration::from_millis(250);
                        tracing::warn!(slot = %self.config.slot, error = %why, "stream: session ended, reconnecting");
                    } else {
                        self.broken(&mut broken, &format!("session ended: {why}"), pause);
                    }
                    if sleep_or_stop(pause, &stop).await {
                        break;
                    }
                    pause = (pause * 2).min(Duration::from_secs(30));
                }
            }
        }
        Ok(report)
    }

    async fn session(
        &self,
        client: &mut ReplicationClient,
        name: &str,
        stop: &CancellationToken,
        hard_stop: &CancellationToken,
        report: &mut StreamReport,
        recovering: Option<std::time::Instant>,
    ) -> Ended {
        // Cancelled when the replication session ends: a batch still being delivered then stops
        // (another relay may stream the slot by now).
        let lost = CancellationToken::new();
        // One batch is delivered while the next is read; its commit to confirm once it is done.
        let mut in_flight: Option<InFlight> = None;
        let ended = self
            .read(
                client,
                name,
                stop,
                hard_stop,
                report,
                &lost,
                &mut in_flight,
                recovering,
            )
            .await;
        lost.cancel();
        // A batch still being delivered is stopped before this relay streams again (or another
        // one takes the slot): what it had not finished is streamed again, after what it sent.
        if let Some(mut f) = in_flight.take() {
            f.task.abort();
            let _ = (&mut f.task).await;
        }
        self.observe(|o| o.stream_pending(None));
        ended
    }

    /// Waits for the batch being delivered once asked to stop: up to `shutdown_deadline`, or
    /// until the hard stop; `None` when it was abandoned (aborted).
    async fn finish_in_time(
        &self,
        f: &mut InFlight,
        hard_stop: &CancellationToken,
    ) -> Option<Result<Result<Delivered, Stopped>, tokio::task::JoinError>> {
        tokio::select! {
            done = &mut f.task => Some(done),
            _ = tokio::time::sleep(self.config.shutdown_deadline) => {
                tracing::warn!(deadline = ?self.config.shutdown_deadline, "stream: the batch being delivered did not finish by the shutdown deadline; it is streamed again at the next start");
                f.task.abort();
                None
            }
            _ = hard_stop.cancelled() => {
                f.task.abort();
                None
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn read(
        &self,
        client: &mut ReplicationClient,
        name: &str,
        stop: &CancellationToken,
        hard_stop: &CancellationToken,
        report: &mut StreamReport,
        lost: &CancellationToken,
        in_flight: &mut Option<InFlight>,
        recovering: Option<std::time::Instant>,
    ) -> Ended {
        const LINGER: Duration = Duration::from_millis(2);
        // Once this session goes somewhere, the relay streams again (see `broken`).
        let (progress, started, mut healthy) =
            (report.progress, tokio::time::Instant::now(), false);
        let mut batch = Batch::default();
        // The transaction being read: its commit position, commit time and messages so far.
        let mut tx: Option<(u64, chrono::DateTime<chrono::Utc>, u32)> = None;
        // When the server was last heard from.
        let liveness = self.config.liveness_interval;
        let mut heard = tokio::time::Instant::now();
        loop {
            self.observe(|o| o.stream_alive());
            if !healthy && (report.progress > progress || started.elapsed() >= HEALTHY_SESSION) {
                healthy = true;
                self.observe(|o| o.stream_broken(None));
                if let Some(since) = recovering {
                    tracing::info!(slot = %self.config.slot, failed_for = ?since.elapsed(), "stream: streaming again");
                }
            }
            let event = tokio::select! {
                // Stop first: a busy stream always has an event ready.
                biased;
                _ = stop.cancelled() => {
                    if let Some(mut f) = in_flight.take()
                        && let Some(done) = self.finish_in_time(&mut f, hard_stop).await
                    {
                        let _ = self.settled(done, f.confirm_at, client, report);
                    }
                    return Ended::Stopped;
                }
                done = async { (&mut in_flight.as_mut().expect("guarded").task).await }, if in_flight.is_some() => {
                    let confirm_at = in_flight.take().expect("guarded").confirm_at;
                    if let Err(e) = self.settled(done, confirm_at, client, report) {
                        return e;
                    }
                    // What was read meanwhile goes now: under load, batches fill while the one
                    // before them is delivered; when quiet, a message waits for nothing.
                    if !batch.items.is_empty()
                        && let Err(e) = self.flush(&mut batch, in_flight, client, stop, hard_stop, lost, report).await
                    {
                        return e;
                    }
                    continue;
                }
                e = client.recv() => e,
                _ = tokio::time::sleep(LINGER), if !batch.items.is_empty() && in_flight.is_none() => {
                    if let Err(e) = self.flush(&mut batch, in_flight, client, stop, hard_stop, lost, report).await {
                        return e;
                    }
                    continue;
                }
                // The server says nothing on an idle stream, nor while it decodes WAL that holds
                // no message: silence alone proves nothing. Ask it, over a connection of its own,
                // whether this session is still there (a link that went silent without a reset
                // is ended on its side after `wal_sender_timeout`).
                _ = tokio::time::sleep_until(heard + liveness) => {
                    let there = tokio::select! {
                        r = tokio::time::timeout(liveness, crate::store::stream_session_alive(&self.url, name)) => r,
                        // Seen by the stop branch above.
                        _ = stop.cancelled() => continue,
                    };
                    match there {
                        Ok(Ok(false)) => {
                            return Ended::Broken(format!(
                                "the server has no replication session {name} any more (it ended it, or the link went silent): the connection is presumed dead"
                            ));
                        }
                        Ok(Err(e)) => tracing::debug!(error = %crate::redact::redact_url(&e.to_string()), "stream: cannot ask the server about this session"),
                        Ok(Ok(true)) | Err(_) => {}
                    }
                    heard = tokio::time::Instant::now();
                    continue;
                }
            };
            heard = tokio::time::Instant::now();
            let event = match event {
                Ok(Some(e)) => e,
                Ok(None) => return Ended::Broken("the replication stream ended".into()),
                Err(e) => return Ended::Broken(e.to_string()),
            };
            match event {
                ReplicationEvent::Begin {
                    final_lsn,
                    commit_time_micros,
                    ..
                } => tx = Some((final_lsn.0, pg_time(commit_time_micros), 0)),
                ReplicationEvent::Message {
                    prefix,
                    content,
                    lsn,
                    transactional,
                } if prefix == PREFIX => {
                    let (commit, at, index, refused) = match (&mut tx, transactional) {
                        (Some((commit, at, n)), true) => {
                            *n += 1;
                            (*commit, *at, *n - 1, None)
                        }
                        // Emitted outside a transaction: its own position is its id, and it is
                        // dead-lettered (it may come from a transaction that rolled back).
                        _ => (lsn.0, chrono::Utc::now(), 0, Some(NOT_TRANSACTIONAL)),
                    };
                    batch.bytes += content.len();
                    batch.items.push(Item {
                        refused,
                        id: stream_id(commit, index),
                        committed_at: at,
                        message: Encoded::decode(&content).map_err(|e| {
                            (
                                e,
                                String::from_utf8_lossy(&content[..content.len().min(64 * 1024)])
                                    .into_owned(),
                            )
                        }),
                    });
                    if (batch.items.len() >= self.config.batch_size
                        || batch.bytes >= self.config.batch_bytes())
                        && let Err(e) = self
                            .flush(&mut batch, in_flight, client, stop, hard_stop, lost, report)
                            .await
                    {
                        return e;
                    }
                }
                ReplicationEvent::Commit { end_lsn, .. } => {
                    tx = None;
                    if !batch.items.is_empty() {
                        batch.confirm_at = Some(end_lsn);
                        if in_flight.is_none()
                            && let Err(e) = self
                                .flush(&mut batch, in_flight, client, stop, hard_stop, lost, report)
                                .await
                        {
                            return e;
                        }
                    } else if let Some(f) = in_flight {
                        // Its messages (if any) are in the batch being delivered.
                        f.confirm_at = Some(end_lsn);
                    } else {
                        confirm(client, end_lsn, report);
                    }
                }
                // Nothing is in flight: everything before the server's position is delivered
                // (this is what moves the slot while no message is published).
                ReplicationEvent::KeepAlive { wal_end, .. }
                    if batch.items.is_empty() && tx.is_none() && in_flight.is_none() =>
                {
                    confirm_idle(client, wal_end, report);
                }
                ReplicationEvent::StoppedAt { .. } => return Ended::Stopped,
                _ => {}
            }
        }
    }

    /// Hands `batch` to a delivery task, once the one before it is done (deliveries stay in
    /// order; reading goes on meanwhile).
    #[allow(clippy::too_many_arguments)]
    async fn flush(
        &self,
        batch: &mut Batch,
        in_flight: &mut Option<InFlight>,
        client: &ReplicationClient,
        stop: &CancellationToken,
        hard_stop: &CancellationToken,
        lost: &CancellationToken,
        report: &mut StreamReport,
    ) -> Result<(), Ended> {
        if let Some(mut f) = in_flight.take() {
            let done = tokio::select! {
                done = &mut f.task => done,
                _ = stop.cancelled() => {
                    if let Some(done) = self.finish_in_time(&mut f, hard_stop).await {
                        let _ = self.settled(done, f.confirm_at, client, report);
                    }
                    return Err(Ended::Stopped);
                }
            };
            self.settled(done, f.confirm_at, client, report)?;
        }
        let Batch {
            items, confirm_at, ..
        } = std::mem::take(batch);
        let route = Route {
            store: self.store.clone(),
            sinks: self.sinks.clone(),
            config: self.config.clone(),
            observer: self.observer.clone(),
        };
        let (stop, lost) = (stop.clone(), lost.clone());
        let task = tokio::spawn(async move {
            let alive = || !lost.is_cancelled();
            deliver(&route, items, &stop, &alive).await
        });
        self.observe(|o| o.stream_pending(Some(std::time::Instant::now())));
        *in_flight = Some(InFlight { task, confirm_at });
        Ok(())
    }

    /// A delivery task ended: count it, and confirm its commit if it finished.
    fn settled(
        &self,
        done: Result<Result<Delivered, Stopped>, tokio::task::JoinError>,
        confirm_at: Option<Lsn>,
        client: &ReplicationClient,
        report: &mut StreamReport,
    ) -> Result<(), Ended> {
        let done = match done {
            Ok(Ok(d)) => d,
            Ok(Err(Stopped::Stop)) => return Err(Ended::Stopped),
            Ok(Err(Stopped::SessionLost)) => {
                return Err(Ended::Broken(
                    "the replication session ended while a batch was delivered; it is streamed again from the confirmed position".into(),
                ));
            }
            Err(e) => return Err(Ended::Broken(format!("stream delivery task: {e}"))),
        };
        report.delivered += done.delivered;
        report.dead_lettered += done.dead_lettered;
        self.observe(|o| {
            o.stream_pending(None);
            o.stream_delivered(done)
        });
        if let Some(l) = confirm_at {
            confirm(client, l, report);
        }
        Ok(())
    }
}

/// How often a relay whose slot is lost looks for the one `postbox stream setup` makes.
const LOST_RECHECK: Duration = Duration::from_secs(2);

/// A session that lasted this long without an error was a healthy one: its end is a blip.
const HEALTHY_SESSION: Duration = Duration::from_secs(30);

/// How often a failure that goes on is logged again.
const BROKEN_REPEAT: Duration = Duration::from_secs(300);

/// Since when the relay fails to stream, and what it said about it last.
#[derive(Default)]
struct Broken {
    since: Option<std::time::Instant>,
    said: Option<String>,
    said_at: Option<std::time::Instant>,
}

/// Bytes of message content a batch holds at most (besides `batch_size`), whatever the payload
/// budget: large messages make smaller batches.
const BATCH_BYTES: usize = 16 << 20;

/// Events the replication client reads ahead of the streamer: few, so that what is held in
/// memory is bounded by the batches' bytes, not by a count of messages of any size. (Measured
/// with `bench --only stream`, 100,000 messages: 4 events streamed 226–237k msg/s, 5,000
/// events 155–161k msg/s: reading ahead far bought nothing.)
const REPLICATION_BUFFER_EVENTS: usize = 4;

/// The messages read and not yet handed to delivery.
#[derive(Default)]
struct Batch {
    items: Vec<Item>,
    bytes: usize,
    /// The last commit whose messages are all in this batch or before it.
    confirm_at: Option<Lsn>,
}

/// The batch being delivered; its task is aborted if it is dropped unfinished (never detached:
/// it would go on delivering behind the next session's back).
struct InFlight {
    task: tokio::task::JoinHandle<Result<Delivered, Stopped>>,
    confirm_at: Option<Lsn>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn confirm(client: &ReplicationClient, lsn: Lsn, report: &mut StreamReport) {
    report.progress += 1;
    confirm_idle(client, lsn, report);
}

/// [`confirm`] of a keepalive's position: not progress of the stream's own.
fn confirm_idle(client: &ReplicationClient, lsn: Lsn, report: &mut StreamReport) {
    if lsn.0 == 0 {
        return;
    }
    client.update_applied_lsn(lsn);
    report.confirmed = Some(lsn_text(lsn));
}

/// PostgreSQL's answer when another session holds the slot (SQLSTATE 55006).
fn slot_in_use(e: &PgWireError) -> bool {
    let text = e.to_string();
    text.contains("55006") || text.contains("is active for PID")
}

/// Sleeps `d`; true if `stop` came first.
async fn sleep_or_stop(d: Duration, stop: &CancellationToken) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => false,
        _ = stop.cancelled() => true,
    }
}
