//! The streamer: reads published messages from the slot in commit order, delivers them through
//! the routes' sinks, and confirms to PostgreSQL only the position up to which every message was
//! delivered or dead-lettered. One relay streams a slot at a time (PostgreSQL lets one session
//! hold it); the others wait and take it over when it is free.

use std::sync::Arc;
use std::time::Duration;

use pgwire_replication::{Lsn, PgWireError, ReplicationClient};
use tokio_util::sync::CancellationToken;

use super::{StreamConfig, StreamError, StreamObserver, StreamReport};
use crate::sink::Sink;
use crate::store::Store;

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

pub(super) enum Ended {
    Stopped,
    Broken(String),
}

pub(super) fn lsn_text(l: Lsn) -> String {
    format!("{:X}/{:X}", l.0 >> 32, l.0 & 0xffff_ffff)
}

/// The stable id of the `index`-th message of the transaction that committed at `commit`.
pub fn stream_id(commit: u64, index: u32) -> String {
    format!("{commit:016X}-{index:08X}")
}

pub(super) fn pg_time(micros: i64) -> chrono::DateTime<chrono::Utc> {
    // PostgreSQL's epoch is 2000-01-01.
    chrono::DateTime::from_timestamp_micros(micros + 946_684_800_000_000).unwrap_or_default()
}

impl Streamer {
    pub(super) fn observe(&self, f: impl FnOnce(&dyn StreamObserver)) {
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

    /// Checks the slot against the limit its relays recorded before this relay streams it: one
    /// found confirmed past it (created again by hand under the same name, advanced, or streamed
    /// by another program) is said loudly, with the range that may never have been streamed;
    /// it stays in `postbox stream status` and `postbox_stream_slot_gap_bytes` until `postbox
    /// stream setup`. (Each record of the limit checks again, while the relay streams.)
    async fn find_gap(&self, guard: &super::guard::Guard) {
        match self
            .store
            .stream_slot_record(&self.config.slot, None, 0, guard.unrecorded())
            .await
        {
            Ok(crate::store::SlotRecord::Gap { from, to, .. }) => {
                super::guard::gap_found(&self.config.slot, &from, &to);
            }
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(error = %e, "stream: cannot check the slot against its recorded limit")
            }
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
        // What this relay confirms, held to a limit recorded first (a slot created again by
        // hand is told from this one by it).
        let mut guard = super::guard::Guard::new(self.store.clone(), self.config.slot.clone());
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
            // Without UPDATE on postbox.stream_slots the relay could neither confirm what it
            // delivered (each confirmation is recorded first) nor tell a slot created again.
            if let Ok(false) = self.store.stream_can_record().await {
                self.broken(
                    &mut broken,
                    "the role cannot record the slot's confirmation limit: GRANT UPDATE ON postbox.stream_slots to the relay's role (`postbox grant` prints the relay role's grants)",
                    pause,
                );
                if sleep_or_stop(pause, &stop).await {
                    break;
                }
                pause = (pause * 2).min(Duration::from_secs(30));
                continue;
            }
            self.find_gap(&guard).await;
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
                    &mut guard,
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
                        guard
                            .settle(&client, &mut report, Duration::from_secs(2))
                            .await;
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
}

/// How often a relay whose slot is lost looks for the one `postbox stream setup` makes.
const LOST_RECHECK: Duration = Duration::from_secs(2);

/// A session that lasted this long without an error was a healthy one: its end is a blip.
pub(super) const HEALTHY_SESSION: Duration = Duration::from_secs(30);

/// How often a failure that goes on is logged again.
const BROKEN_REPEAT: Duration = Duration::from_secs(300);

/// Since when the relay fails to stream, and what it said about it last.
#[derive(Default)]
struct Broken {
    since: Option<std::time::Instant>,
    said: Option<String>,
    said_at: Option<std::time::Instant>,
}

/// Events the replication client reads ahead of the streamer: few, so that what is held in
/// memory is bounded by the batches' bytes, not by a count of messages of any size. (Measured
/// with `bench --only stream`, 100,000 messages: 4 events streamed 226–237k msg/s, 5,000
/// events 155–161k msg/s: reading ahead far bought nothing.)
const REPLICATION_BUFFER_EVENTS: usize = 4;

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
