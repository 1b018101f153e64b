//! The notifier: one dedicated connection that LISTENs on channel `postbox`, registers as a
//! waiting listener when the producer asks, and wakes the producer on every notification.
//! Reconnects with backoff when the connection drops, and wakes the producer after reconnecting
//! (notifications sent while it was away are lost; a claim finds their messages).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use futures_util::StreamExt;
use tokio::sync::{Notify, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::store;

/// First and longest pause between looks at the writers in progress at registration.
const WRITERS_FIRST_CHECK: Duration = Duration::from_millis(5);
const WRITERS_LAST_CHECK: Duration = Duration::from_millis(500);

/// How long the notifier waits for any one answer from the server (a connect, a registration, a
/// health check) before it calls the connection dead and opens a new one: a connection that went
/// silent (a NAT that dropped it without a reset) must not hold the notifier.
pub(crate) const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// How often an idle notifier checks its connection.
pub(crate) const HEALTH_CHECK_EVERY: Duration = Duration::from_secs(5);

/// How long a claim loop waits for its registration to be confirmed before it polls instead.
const ARM_WAIT: Duration = Duration::from_secs(2);

/// How long the engine stays registered as waiting after a notification while it is busy: it
/// unregisters (and writers stop notifying) only when it stayed busy that long. Going idle again
/// within it keeps the registration: without this, an engine woken by every message of a steady
/// stream would delete and insert its row of `postbox.listeners` for each, and while the xmin
/// horizon is pinned those dead rows pile up in front of every writer's look at the table.
const DISARM_AFTER_BUSY: Duration = Duration::from_secs(1);

enum Command {
    /// Register as waiting; answers once the registration committed.
    Arm(oneshot::Sender<bool>),
    /// Unregister (work found without a notification).
    Disarm,
    /// Unregister now: the engine polls (a fast flow), so a NOTIFY only costs the writers. At
    /// most one registration ends this way per [`DISARM_AFTER_BUSY`].
    Linger,
}

/// Handle to the notifier task.
#[derive(Clone)]
pub(crate) struct Notifier {
    commands: mpsc::Sender<Command>,
    connected: Arc<AtomicBool>,
}

/// What the notifier shares with the engine.
pub(crate) struct NotifierShared {
    pub wake: Arc<Notify>,
    pub connected: Arc<AtomicBool>,
    pub on_connected: Box<dyn Fn(bool) + Send + Sync>,
}

impl Notifier {
    pub(crate) fn spawn(
        url: String,
        shared: NotifierShared,
        stop: CancellationToken,
    ) -> (Notifier, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(16);
        let handle = Notifier {
            commands: tx,
            connected: shared.connected.clone(),
        };
        let task = tokio::spawn(run(url, shared, rx, stop));
        (handle, task)
    }

    /// Registers as waiting. `false` if not connected, or if the notifier does not confirm within
    /// [`ARM_WAIT`]: then only polling will find new work. Never waits longer than that: a
    /// notifier stuck on its connection never holds a claim loop.
    pub(crate) async fn arm(&self) -> bool {
        if !self.connected.load(Ordering::Acquire) {
            return false;
        }
        let (ack, answer) = oneshot::channel();
        // A full queue means the notifier is not taking commands: it is busy or stuck.
        if self.commands.try_send(Command::Arm(ack)).is_err() {
            return false;
        }
        matches!(tokio::time::timeout(ARM_WAIT, answer).await, Ok(Ok(true)))
    }

    /// Unregisters if the engine stays busy for [`DISARM_AFTER_BUSY`] (asking to wait again
    /// sooner keeps the registration), without waiting.
    pub(crate) fn disarm(&self) {
        let _ = self.commands.try_send(Command::Disarm);
    }

    /// The engine has started polling (see [`Command::Linger`]), without waiting.
    pub(crate) fn linger(&self) {
        let _ = self.commands.try_send(Command::Linger);
    }
}

enum Event {
    Notified,
    /// Busy since a notification for [`DISARM_AFTER_BUSY`].
    StillBusy,
    /// Time to look whether writers in progress at registration have ended.
    CheckWriters,
    Lost(String),
    Command(Option<Command>),
    HealthCheck,
    Stop,
}

async fn run(
    url: String,
    shared: NotifierShared,
    mut commands: mpsc::Receiver<Command>,
    stop: CancellationToken,
) {
    let mut backoff = Duration::from_millis(100);
    'connect: loop {
        if stop.is_cancelled() {
            return;
        }
        let connected = tokio::time::timeout(ANSWER_TIMEOUT * 2, connect(&url))
            .await
            .unwrap_or_else(|_| {
                Err(crate::Error::Pool(format!(
                    "no answer within {:?}",
                    ANSWER_TIMEOUT * 2
                )))
            });
        let mut conn = match connected {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?backoff, "notifier cannot connect");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = stop.cancelled() => return,
                }
                backoff = (backoff * 2).min(Duration::from_secs(10));
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        shared.connected.store(true, Ordering::Release);
        (shared.on_connected)(true);
        tracing::debug!("notifier listening on channel postbox");
        // Anything committed while we were not listening is found by a claim.
        shared.wake.notify_one();
        let mut armed = false;
        // Transactions in progress when we registered (see store::register_listener), and when
        // to look at them next.
        let mut writers: Vec<i64> = Vec::new();
        let mut check_in = WRITERS_FIRST_CHECK;
        // When to unregister, if the engine has not asked to wait again by then.
        let mut disarm_at: Option<tokio::time::Instant> = None;
        // When the last registration ended (a lingering engine unregisters at once, but not more
        // often than once per DISARM_AFTER_BUSY: each registration leaves a dead row).
        let mut unregistered_at: Option<tokio::time::Instant> = None;
        // When to check the connection next. A deadline, not a pause restarted by every event:
        // an engine that asks to wait on every idle turn, while already registered, sends a
        // command more often than this and talks to no server; a connection that went silent
        // meanwhile must still be found out.
        let mut health_at = tokio::time::Instant::now() + HEALTH_CHECK_EVERY;
        loop {
            let event = {
                let mut stream = std::pin::pin!(conn.notifications_stream());
                tokio::select! {
                    n = stream.next() => match n {
                        Some(Ok(_)) => Event::Notified,
                        Some(Err(e)) => Event::Lost(e.to_string()),
                        None => Event::Lost("connection closed".into()),
                    },
                    c = commands.recv() => Event::Command(c),
                    _ = tokio::time::sleep(check_in), if armed && !writers.is_empty() => Event::CheckWriters,
                    _ = tokio::time::sleep_until(disarm_at.unwrap_or_else(tokio::time::Instant::now)), if disarm_at.is_some() => Event::StillBusy,
                    _ = tokio::time::sleep_until(health_at) => Event::HealthCheck,
                    _ = stop.cancelled() => Event::Stop,
                }
            };
            let closing = matches!(event, Event::Command(None) | Event::Stop);
            let work = async {
                match event {
                    Event::Notified => {
                        // The server just spoke: the connection is alive.
                        health_at = tokio::time::Instant::now() + HEALTH_CHECK_EVERY;
                        shared.wake.notify_one();
                        if armed && disarm_at.is_none() {
                            disarm_at = Some(tokio::time::Instant::now() + DISARM_AFTER_BUSY);
                        }
                        Ok(())
                    }
                    Event::StillBusy => {
                        disarm_at = None;
                        if armed {
                            armed = false;
                            unregistered_at = Some(tokio::time::Instant::now());
                            store::unregister_listener(&mut conn).await
                        } else {
                            Ok(())
                        }
                    }
                    Event::CheckWriters => match store::still_running(&mut conn, &writers).await {
                        Ok(left) => {
                            if left.len() < writers.len() {
                                // A writer ended: if it committed a message, no NOTIFY told us.
                                shared.wake.notify_one();
                            }
                            writers = left;
                            check_in = (check_in * 2).min(WRITERS_LAST_CHECK);
                            Ok(())
                        }
                        Err(e) => Err(e),
                    },
                    Event::Lost(e) => Err(crate::Error::Pool(e)),
                    Event::Command(Some(Command::Arm(ack))) => {
                        // Idle again: stay registered.
                        disarm_at = None;
                        let r = if armed {
                            Ok(())
                        } else {
                            store::register_listener(&mut conn).await.map(|xids| {
                                writers = xids;
                                check_in = WRITERS_FIRST_CHECK;
                            })
                        };
                        armed = r.is_ok();
                        let _ = ack.send(armed);
                        r
                    }
                    Event::Command(Some(Command::Disarm)) => {
                        // Busy: unregistered if it stays so (see DISARM_AFTER_BUSY).
                        if armed && disarm_at.is_none() {
                            disarm_at = Some(tokio::time::Instant::now() + DISARM_AFTER_BUSY);
                        }
                        Ok(())
                    }
                    Event::Command(Some(Command::Linger)) => {
                        if armed {
                            let now = tokio::time::Instant::now();
                            disarm_at = Some(lingering_disarm(now, unregistered_at, disarm_at));
                        }
                        Ok(())
                    }
                    Event::HealthCheck => {
                        health_at = tokio::time::Instant::now() + HEALTH_CHECK_EVERY;
                        conn.batch_execute("SELECT 1").await.map_err(Into::into)
                    }
                    Event::Command(None) | Event::Stop => {
                        if armed {
                            let _ = store::unregister_listener(&mut conn).await;
                        }
                        Err(crate::Error::Pool("stopped".into()))
                    }
                }
            };
            // Every exchange with the server is bounded: a silent connection is a lost one.
            let bounded = async {
                tokio::time::timeout(ANSWER_TIMEOUT, work)
                    .await
                    .unwrap_or_else(|_| {
                        Err(crate::Error::Pool(format!(
                            "no answer within {ANSWER_TIMEOUT:?}"
                        )))
                    })
            };
            let result = if closing {
                bounded.await
            } else {
                tokio::select! {
                    r = bounded => r,
                    _ = stop.cancelled() => Err(crate::Error::Pool("stopped".into())),
                }
            };
            if closing || stop.is_cancelled() {
                shared.connected.store(false, Ordering::Release);
                (shared.on_connected)(false);
                return;
            }
            if let Err(e) = result {
                shared.connected.store(false, Ordering::Release);
                (shared.on_connected)(false);
                tracing::warn!(error = %e, "notifier connection lost; reconnecting");
                // Pending arm requests are answered `false` by their dropped senders.
                while let Ok(c) = commands.try_recv() {
                    drop(c);
                }
                // The producer polls meanwhile; wake it so it does not wait a whole interval.
                shared.wake.notify_one();
                continue 'connect;
            }
        }
    }
}

/// When a registration ends once the engine lingers (polls): at once, unless the previous one
/// ended less than [`DISARM_AFTER_BUSY`] ago (each registration leaves a dead row, which a pinned
/// xmin horizon keeps in front of every writer's look at the table); never later than an
/// unregistration already planned.
fn lingering_disarm(
    now: tokio::time::Instant,
    unregistered_at: Option<tokio::time::Instant>,
    planned: Option<tokio::time::Instant>,
) -> tokio::time::Instant {
    let soonest = unregistered_at.map_or(now, |t| (t + DISARM_AFTER_BUSY).max(now));
    planned.map_or(soonest, |d| d.min(soonest))
}

async fn connect(url: &str) -> crate::Result<AsyncPgConnection> {
    let mut conn = store::connect::establish(url).await?;
    // A backend that died while registered left its row; register_listener also cleans those.
    store::unregister_listener(&mut conn).await?;
    store::listen(&mut conn).await?;
    Ok(conn)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    #[test]
    fn a_lingering_engine_unregisters_at_once_but_not_more_than_once_a_second() {
        let now = Instant::now();
        let ms = Duration::from_millis;
        // Never unregistered, or long ago: now.
        assert_eq!(lingering_disarm(now, None, None), now);
        assert_eq!(
            lingering_disarm(now + ms(5000), Some(now), None),
            now + ms(5000)
        );
        // Unregistered 200 ms ago: a second after that.
        assert_eq!(
            lingering_disarm(now + ms(200), Some(now), None),
            now + DISARM_AFTER_BUSY
        );
        // An unregistration already planned sooner stays.
        assert_eq!(
            lingering_disarm(now + ms(200), Some(now), Some(now + ms(300))),
            now + ms(300)
        );
        assert_eq!(lingering_disarm(now, None, Some(now + ms(900))), now);
    }
}
