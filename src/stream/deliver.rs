//! Delivering one batch of stream messages through the routes' sinks, until every message is
//! delivered or dead-lettered: the stream's position may then pass them.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::FutureExt;

use super::StreamObserver;
use super::encoding::{DecodeError, Encoded};
use crate::sink::{Outcome, Sink};
use crate::store::{ClaimedMessage, Store};

/// What a batch is delivered with: the store (dead letters), the routes' sinks, the stream's
/// settings (timeouts, back-off) and who is told (metrics).
pub struct Route {
    /// The store.
    pub store: Store,
    /// The sinks, one per route, in the order of the routes.
    pub sinks: Vec<Arc<dyn Sink>>,
    /// The stream's settings.
    pub config: super::StreamConfig,
    /// Told about sinks, liveness and progress.
    pub observer: Option<Arc<dyn StreamObserver>>,
}

/// A message read from the stream, not yet delivered.
#[derive(Debug, Clone)]
pub struct Item {
    /// Its stable id (see [`ClaimedMessage::stream_id`]).
    pub id: String,
    /// The commit time of its transaction (the created time when the writer gave none).
    pub committed_at: DateTime<Utc>,
    /// What it says, or why it cannot be read.
    pub message: Result<Encoded, (DecodeError, String)>,
    /// Why it is dead-lettered however it reads (emitted outside a transaction).
    pub refused: Option<&'static str>,
}

/// Why a message emitted with `transactional = false` is dead-lettered: PostgreSQL writes it at
/// once, whether its transaction commits or not, so it may come from one that rolled back.
pub const NOT_TRANSACTIONAL: &str = "stream: emitted with transactional = false: PostgreSQL streams such a message at once, even when its transaction rolls back, so it cannot be told from one that did; publish with pg_logical_emit_message(true, 'postbox', …)";

/// How many times a message a sink answers `Retry` for is sent again before it is dead-lettered
/// (a stream message has no attempts column: this bounds a poison message's hold on the stream).
/// The waits between tries double from `FIRST_RETRY` (500 ms) (or are the delay the sink asked for, if
/// longer) up to the relay's longest back-off: about 2.5 minutes in all with the defaults.
pub const MAX_RETRIES: u32 = 10;

/// How long a sink may take over a batch before the stream says it waits for it.
const SLOW_SINK: Duration = Duration::from_secs(10);

/// The first wait before a message a sink answered `Retry` for is sent again.
pub const FIRST_RETRY: Duration = Duration::from_millis(500);

/// What a batch came to.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Delivered {
    /// Messages the sink stored.
    pub delivered: u64,
    /// Messages it refused for good, now dead letters.
    pub dead_lettered: u64,
}

/// The batch could not be finished: the position stays before it, so it is streamed again (by
/// this relay at its next start or session, or by the relay that took the slot over).
#[derive(Debug, PartialEq, Eq)]
pub enum Stopped {
    /// The relay was asked to stop.
    Stop,
    /// The replication session ended: another relay may stream the slot now, so this one must
    /// not deliver what it read any more (it would interleave with the new streamer's messages).
    SessionLost,
}

struct Slot {
    item: usize,
    sink: usize,
    message: ClaimedMessage,
    retries: u32,
}

fn claimed(id: String, m: Encoded, committed_at: DateTime<Utc>) -> ClaimedMessage {
    let at = m.created_at.unwrap_or(committed_at);
    ClaimedMessage {
        id: 0,
        ordered: m.key.is_some(),
        topic: m.topic,
        key: m.key,
        payload: m.payload,
        headers: m.headers,
        priority: 0,
        run_at: at,
        attempts: 1,
        max_attempts: 1,
        created_at: at,
        locked_until: at,
        lease_token: 0,
        last_error: None,
        dedup_key: None,
        undecodable: None,
        stream_id: Some(id),
    }
}

/// Delivers `items` in order through `sinks` (the first whose topics match a message's topic):
/// what a sink refuses for good, what no route serves and what cannot be read is dead-lettered
/// with its reason; a sink that is away (or a topic it cannot take now) is waited for with a
/// back-off, without counting attempts, and the messages from its first undelivered one on are
/// sent again, so a key's messages reach it in commit order.
pub async fn deliver(
    route: &Route,
    items: Vec<Item>,
    stop: &tokio_util::sync::CancellationToken,
    session_alive: &(dyn Fn() -> bool + Sync),
) -> Result<Delivered, Stopped> {
    let (sinks, max_backoff) = (&route.sinks[..], route.config.max_backoff);
    let observe = |f: &dyn Fn(&dyn StreamObserver)| {
        if let Some(o) = &route.observer {
            f(o.as_ref());
        }
    };
    let mut done = Delivered::default();
    let mut pending: Vec<Slot> = Vec::with_capacity(items.len());
    // Each sink's topics, read once (not once a message).
    let routes: Vec<crate::store::Topics> = sinks.iter().map(|s| s.topics()).collect();
    for (i, item) in items.into_iter().enumerate() {
        match item.message {
            Err((why, raw)) => {
                let payload = serde_json::Value::String(raw);
                dead_letter(
                    route,
                    &item.id,
                    "(undecodable)",
                    None,
                    &payload,
                    &Default::default(),
                    item.committed_at,
                    &format!("stream: {why}"),
                    stop,
                )
                .await?;
                done.dead_lettered += 1;
            }
            Ok(m) => {
                // Refused as written (not transactional), or no route serves its topic.
                let reason = match (
                    item.refused,
                    routes.iter().position(|t| t.matches(&m.topic)),
                ) {
                    (None, Some(sink)) => {
                        pending.push(Slot {
                            item: i,
                            sink,
                            message: claimed(item.id, m, item.committed_at),
                            retries: 0,
                        });
                        continue;
                    }
                    (Some(refused), _) => refused.to_owned(),
                    (None, None) => format!(
                        "stream: no route serves topic {:?}",
                        if m.topic.len() > 255 {
                            crate::store::storable::ascii(&m.topic, 255)
                        } else {
                            m.topic.clone()
                        }
                    ),
                };
                dead_letter(
                    route,
                    &item.id,
                    &m.topic,
                    m.key.as_deref(),
                    &m.payload,
                    &m.headers,
                    m.created_at.unwrap_or(item.committed_at),
                    &reason,
                    stop,
                )
                .await?;
                done.dead_lettered += 1;
            }
        }
    }
    let mut pause = Duration::from_millis(100);
    let mut retry_pause = FIRST_RETRY;
    while !pending.is_empty() {
        if !session_alive() {
            return Err(Stopped::SessionLost);
        }
        observe(&|o| o.stream_alive());
        // Every sink's share, in order, sent concurrently across sinks.
        let rounds = sinks.iter().enumerate().map(|(s, sink)| {
            let mine: Vec<&Slot> = pending.iter().filter(|p| p.sink == s).collect();
            async move {
                let mut outcomes = Vec::with_capacity(mine.len());
                for chunk in mine.chunks(sink.max_batch().max(1)) {
                    let batch: Vec<ClaimedMessage> =
                        chunk.iter().map(|p| p.message.clone()).collect();
                    let n = batch.len();
                    let timeout = batch
                        .iter()
                        .map(|m| route.config.timeout_for(&m.topic))
                        .max()
                        .unwrap_or(route.config.delivery_timeout);
                    let delivery = tokio::time::timeout(
                        timeout,
                        std::panic::AssertUnwindSafe(sink.deliver(batch)).catch_unwind(),
                    );
                    tokio::pin!(delivery);
                    // A sink that takes long is said to (the stream waits on it) before the
                    // delivery timeout calls it unavailable.
                    let slow = tokio::time::sleep(SLOW_SINK.min(timeout / 2));
                    tokio::pin!(slow);
                    let mut said = false;
                    let result = loop {
                        tokio::select! {
                            r = &mut delivery => break r,
                            _ = &mut slow, if !said => {
                                said = true;
                                tracing::warn!(sink = sink.name(), messages = n, waited = ?SLOW_SINK.min(timeout / 2), delivery_timeout = ?timeout, "stream: the sink has not taken the batch yet; the stream waits for it");
                            }
                        }
                    };
                    let up = matches!(result, Ok(Ok(Ok(_))));
                    observe(&|o| o.stream_sink_up(sink.name(), up));
                    let result = match result {
                        Ok(r) => r,
                        Err(_) => Ok(Err(crate::sink::Unavailable::new(format!(
                            "sink {} did not answer within the delivery timeout ({timeout:?})",
                            sink.name()
                        )))),
                    };
                    match result {
                        Ok(Ok(o)) if o.len() == n => outcomes.extend(o),
                        Ok(Ok(o)) => outcomes.extend(std::iter::repeat_n(
                            Outcome::Retry {
                                reason: format!(
                                    "sink {} answered {} outcomes for {n} messages",
                                    sink.name(),
                                    o.len()
                                ),
                                delay: None,
                            },
                            n,
                        )),
                        Ok(Err(e)) => outcomes.extend(std::iter::repeat_n(
                            Outcome::Release {
                                reason: e.to_string(),
                            },
                            n,
                        )),
                        Err(_) => outcomes.extend(std::iter::repeat_n(
                            Outcome::Retry {
                                reason: format!("sink {} panicked", sink.name()),
                                delay: None,
                            },
                            n,
                        )),
                    }
                    // A chunk that did not go through: later chunks wait for the next round, so
                    // they do not overtake it.
                    if outcomes
                        .iter()
                        .any(|o| !matches!(o, Outcome::Delivered | Outcome::Dead { .. }))
                    {
                        break;
                    }
                }
                (s, outcomes)
            }
        });
        let answers = futures_util::future::join_all(rounds).await;
        let mut keep: Vec<Slot> = Vec::new();
        let mut by_sink: Vec<Vec<Slot>> = (0..sinks.len()).map(|_| Vec::new()).collect();
        for p in pending.drain(..) {
            let s = p.sink;
            by_sink[s].push(p);
        }
        let mut waiting = false;
        let mut retry_wait: Option<Duration> = None;
        for (s, outcomes) in answers {
            let mine = std::mem::take(&mut by_sink[s]);
            let mut resend_from: Option<usize> = None;
            for (j, mut p) in mine.into_iter().enumerate() {
                // A stream message has no row to put off: a snooze is a retry after its delay.
                let outcome = outcomes.get(j).cloned().map(|o| match o {
                    Outcome::Snooze { delay } => Outcome::Retry {
                        reason: "snoozed (a stream message waits in the stream: a try used)".into(),
                        delay: Some(delay),
                    },
                    o => o,
                });
                if resend_from.is_some() {
                    keep.push(p);
                    continue;
                }
                match outcome {
                    Some(Outcome::Delivered) => done.delivered += 1,
                    Some(Outcome::Dead { reason }) => {
                        dead(route, &p, &reason, stop).await?;
                        done.dead_lettered += 1;
                    }
                    Some(Outcome::Retry { reason, .. }) if p.retries + 1 >= MAX_RETRIES => {
                        dead(
                            route,
                            &p,
                            &format!("{reason} (after {MAX_RETRIES} tries)"),
                            stop,
                        )
                        .await?;
                        done.dead_lettered += 1;
                    }
                    Some(Outcome::Retry { reason, delay }) => {
                        tracing::warn!(stream_id = ?p.message.stream_id, %reason, "stream: delivery failed, sending again");
                        let wait = delay.unwrap_or_default().max(retry_pause);
                        retry_wait = Some(retry_wait.map_or(wait, |w| w.max(wait)));
                        p.retries += 1;
                        resend_from = Some(j);
                        keep.push(p);
                    }
                    other => {
                        if let Some(
                            Outcome::Release { reason } | Outcome::TopicUnavailable { reason },
                        ) = &other
                        {
                            tracing::warn!(sink = sinks[s].name(), %reason, "stream: sink unavailable, waiting");
                        }
                        waiting = true;
                        resend_from = Some(j);
                        keep.push(p);
                    }
                }
            }
        }
        keep.sort_by_key(|p| p.item);
        pending = keep;
        if pending.is_empty() {
            break;
        }
        if !waiting {
            pause = Duration::from_millis(100);
        }
        let wait = match retry_wait {
            Some(r) => {
                retry_pause = (retry_pause * 2).min(max_backoff);
                r.max(if waiting { pause } else { Duration::ZERO })
            }
            None => pause,
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.cancelled() => return Err(Stopped::Stop),
        }
        if waiting {
            pause = (pause * 2).min(max_backoff);
        }
    }
    Ok(done)
}

async fn dead(
    route: &Route,
    p: &Slot,
    reason: &str,
    stop: &tokio_util::sync::CancellationToken,
) -> Result<(), Stopped> {
    let m = &p.message;
    dead_letter(
        route,
        m.stream_id.as_deref().unwrap_or_default(),
        &m.topic,
        m.key.as_deref(),
        &m.payload,
        &m.headers,
        m.created_at,
        reason,
        stop,
    )
    .await
}

/// Dead-letters one stream message, retrying while the database is away (the position cannot
/// pass a message that is neither delivered nor dead-lettered). When the database answers twice
/// in the same words that it refuses the message as it is (a value past one of its limits), the
/// message is stored in part ([`Store::stream_dead_letter_in_part`]): one message's bytes never
/// stop the stream.
#[allow(clippy::too_many_arguments)]
async fn dead_letter(
    route: &Route,
    id: &str,
    topic: &str,
    key: Option<&str>,
    payload: &serde_json::Value,
    headers: &std::collections::BTreeMap<String, String>,
    created_at: DateTime<Utc>,
    reason: &str,
    stop: &tokio_util::sync::CancellationToken,
) -> Result<(), Stopped> {
    let store = &route.store;
    let headers = serde_json::to_value(headers).expect("a string map is JSON");
    let mut pause = Duration::from_millis(100);
    // The database's last answer to the whole message, and how many times in a row it gave it.
    let (mut answer, mut times) = (String::new(), 0u32);
    loop {
        // Waiting for the database is not being stuck.
        if let Some(o) = &route.observer {
            o.stream_alive();
        }
        let in_part = times >= 2;
        let result = if in_part {
            let content = serde_json::json!({"key": key, "headers": &headers, "payload": payload});
            store
                .stream_dead_letter_in_part(
                    id,
                    topic,
                    &content.to_string(),
                    created_at,
                    reason,
                    &answer,
                )
                .await
        } else {
            store
                .stream_dead_letter(id, topic, key, payload, &headers, created_at, reason)
                .await
        };
        match result {
            Ok(_) => {
                if in_part {
                    tracing::error!(stream_id = id, topic = %crate::store::storable::ascii(topic, 255), reason, refused = %answer, "stream: message dead-lettered in part: the database refused it as it was");
                } else {
                    tracing::warn!(stream_id = id, topic = %crate::store::storable::ascii(topic, 255), reason, "stream: message dead-lettered");
                }
                return Ok(());
            }
            Err(crate::Error::Database(diesel::result::Error::DatabaseError(kind, info)))
                if !in_part
                    && !matches!(
                        kind,
                        diesel::result::DatabaseErrorKind::ClosedConnection
                            | diesel::result::DatabaseErrorKind::UnableToSendCommand
                    ) =>
            {
                // The server answered: the message, or a passing state of the database (a lock,
                // a failover's read-only moment)? The same answer twice says the message.
                let said = info.message().to_owned();
                tracing::warn!(stream_id = id, error = %said, "stream: the database refused the dead letter");
                if said == answer {
                    times += 1;
                } else {
                    (answer, times) = (said, 1);
                }
                if times >= 2 {
                    continue;
                }
            }
            Err(e) => {
                // Even the storable part was refused, or no answer: the database is away.
                times = 0;
                tracing::warn!(stream_id = id, error = %e, "stream: cannot write the dead letter yet")
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = stop.cancelled() => return Err(Stopped::Stop),
        }
        pause = (pause * 2).min(Duration::from_secs(10));
    }
}
