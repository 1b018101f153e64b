//! One replication session of the streamer: messages read in commit order into batches, one
//! batch delivered while the next is read, a commit confirmed once every message before it was
//! delivered or dead-lettered.

use std::time::Duration;

use pgwire_replication::{Lsn, ReplicationClient, ReplicationEvent};
use tokio_util::sync::CancellationToken;

use super::StreamReport;
use super::deliver::{Delivered, Item, NOT_TRANSACTIONAL, Route, Stopped, deliver};
use super::encoding::{Encoded, PREFIX};
use super::guard::{Confirm, Guard};
use super::relay::{Ended, HEALTHY_SESSION, Streamer, pg_time, stream_id};

impl Streamer {
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn session(
        &self,
        client: &mut ReplicationClient,
        name: &str,
        stop: &CancellationToken,
        hard_stop: &CancellationToken,
        report: &mut StreamReport,
        recovering: Option<std::time::Instant>,
        guard: &mut Guard,
    ) -> Ended {
        guard.session_started();
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
                guard,
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
        guard: &mut Guard,
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
                        let _ = self.settled(done, f.confirm_at, client, report, guard);
                    }
                    return Ended::Stopped;
                }
                done = async { (&mut in_flight.as_mut().expect("guarded").task).await }, if in_flight.is_some() => {
                    let confirm_at = in_flight.take().expect("guarded").confirm_at;
                    if let Err(e) = self.settled(done, confirm_at, client, report, guard) {
                        return e;
                    }
                    // What was read meanwhile goes now: under load, batches fill while the one
                    // before them is delivered; when quiet, a message waits for nothing.
                    if !batch.items.is_empty()
                        && let Err(e) = self.flush(&mut batch, in_flight, client, stop, hard_stop, lost, report, guard).await
                    {
                        return e;
                    }
                    continue;
                }
                // A record of the confirmation limit ended: confirm what it allows.
                done = guard.wait(), if guard.recording() => {
                    guard.recorded(done, client, report);
                    continue;
                }
                e = client.recv() => e,
                _ = tokio::time::sleep(LINGER), if !batch.items.is_empty() && in_flight.is_none() => {
                    if let Err(e) = self.flush(&mut batch, in_flight, client, stop, hard_stop, lost, report, guard).await {
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
                            .flush(
                                &mut batch, in_flight, client, stop, hard_stop, lost, report, guard,
                            )
                            .await
                    {
                        return e;
                    }
                }
                ReplicationEvent::Commit { end_lsn, .. } => {
                    // A transaction of postbox messages read: its position is recorded while it
                    // is delivered (its confirmation then need not wait for a record).
                    if tx.is_some_and(|(_, _, n)| n > 0) {
                        guard.delivering(end_lsn);
                    }
                    tx = None;
                    if !batch.items.is_empty() {
                        batch.confirm_at = Some(end_lsn);
                        if in_flight.is_none()
                            && let Err(e) = self
                                .flush(
                                    &mut batch, in_flight, client, stop, hard_stop, lost, report,
                                    guard,
                                )
                                .await
                        {
                            return e;
                        }
                    } else if let Some(f) = in_flight {
                        // Its messages (if any) are in the batch being delivered.
                        f.confirm_at = Some(end_lsn);
                    } else {
                        guard.confirm(client, end_lsn, Confirm::Passed, report);
                    }
                }
                // Nothing is in flight: everything before the server's position is delivered
                // (this is what moves the slot while no message is published).
                ReplicationEvent::KeepAlive {
                    wal_end,
                    reply_requested,
                    ..
                } if batch.items.is_empty() && tx.is_none() && in_flight.is_none() => {
                    let why = if reply_requested {
                        Confirm::Requested
                    } else {
                        Confirm::Idle
                    };
                    guard.confirm(client, wal_end, why, report);
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
        guard: &mut Guard,
    ) -> Result<(), Ended> {
        if let Some(mut f) = in_flight.take() {
            let done = tokio::select! {
                done = &mut f.task => done,
                _ = stop.cancelled() => {
                    if let Some(done) = self.finish_in_time(&mut f, hard_stop).await {
                        let _ = self.settled(done, f.confirm_at, client, report, guard);
                    }
                    return Err(Ended::Stopped);
                }
            };
            self.settled(done, f.confirm_at, client, report, guard)?;
        }
        let Batch {
            items, confirm_at, ..
        } = std::mem::take(batch);
        if let Some(l) = confirm_at {
            guard.delivering(l);
        }
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
        guard: &mut Guard,
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
            guard.confirm(client, l, Confirm::Delivered, report);
        }
        Ok(())
    }
}

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
