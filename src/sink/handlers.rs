//! In-process handlers: the embedded queue. Async functions registered per topic receive the
//! typed payload; their result decides the message's fate.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use serde::de::DeserializeOwned;

use super::{Outcome, Sink, Unavailable};
use crate::message::MessageId;
use crate::store::{ClaimedMessage, Topics};

/// A message handed to a handler, with its payload deserialized.
#[derive(Debug, Clone)]
pub struct Job<T> {
    /// The payload, deserialized into the handler's type.
    pub payload: T,
    /// The message's id: the natural idempotency key (delivery is at least once).
    pub id: MessageId,
    /// The message's topic.
    pub topic: String,
    /// The message's key, if it has one.
    pub key: Option<String>,
    /// The message's headers.
    pub headers: BTreeMap<String, String>,
    /// 1 on the first delivery.
    pub attempt: i32,
    /// Attempts before the message is dead-lettered.
    pub max_attempts: i32,
    /// When it was enqueued (the database's clock).
    pub created_at: DateTime<Utc>,
    /// The error of the previous attempt, if any.
    pub last_error: Option<String>,
    /// The token of this delivery's lease (or of the held batch it is in): what
    /// [`Job::complete_in`] names this delivery with.
    pub lease_token: i64,
}

impl<T> Job<T> {
    /// Records, in the app's transaction open on `conn`, that this message's work is done
    /// (River's `JobCompleteTx`): do the work, enqueue its follow-up messages, and call this in the
    /// same transaction, **before** the work. It returns true when this transaction is the first
    /// to record it: do the work. False: an earlier delivery of this message committed its work
    /// (the engine stopped between that commit and recording the outcome, a lease expired, a held
    /// batch rolled back): skip the work and return `Ok(())`. A delivery of the same message still
    /// running elsewhere is waited for. If the transaction rolls back, nothing is recorded and the
    /// message is retried as usual. Works for leased and held messages alike (it takes no lock on
    /// the message); needs the writer's grants (`postbox grant --writer`); a stream message has no
    /// row and is refused.
    ///
    /// ```no_run
    /// # use postbox::sink::handlers::{HandlerError, Job};
    /// # async fn handle(job: Job<i64>, pool: &postbox::store::Pool) -> Result<(), HandlerError> {
    /// use diesel_async::AsyncConnection;
    /// let mut conn = pool.get().await.map_err(|e| HandlerError::retry(e.to_string()))?;
    /// conn.transaction::<_, postbox::Error, _>(async |conn| {
    ///     if !job.complete_in(conn).await? {
    ///         return Ok(()); // done by an earlier delivery
    ///     }
    ///     // ... the work, on `conn` ...
    ///     postbox::enqueue_async(conn, &postbox::Message::new("invoice.sent").payload(&job.payload)).await?;
    ///     Ok(())
    /// })
    /// .await?;
    /// Ok(())
    /// # }
    /// ```
    pub async fn complete_in(
        &self,
        conn: &mut diesel_async::AsyncPgConnection,
    ) -> crate::Result<bool> {
        crate::store::completion::complete_in(conn, self.id, self.lease_token).await
    }

    /// [`Job::complete_in`] on a sync connection (a handler that runs its work in
    /// `spawn_blocking`).
    pub fn complete_in_sync(&self, conn: &mut diesel::PgConnection) -> crate::Result<bool> {
        crate::store::completion::complete_in_sync(conn, self.id, self.lease_token)
    }
}

/// How a handler fails. Any `std::error::Error` converts into a retry (so `?` works); ask for
/// [`HandlerError::dead`] when retrying cannot help.
#[derive(Debug, Clone, PartialEq)]
pub enum HandlerError {
    /// Try again after the backoff, or after `delay`.
    Retry {
        /// The error, kept as the message's last error.
        reason: String,
        /// The delay asked for instead of the backoff.
        delay: Option<Duration>,
    },
    /// Never going to work: dead-letter now.
    Dead {
        /// Why, kept with the dead letter.
        reason: String,
    },
    /// Not now: run again after `delay` without using an attempt (see [`HandlerError::snooze`]).
    Snooze {
        /// When to run it again, from now.
        delay: Duration,
    },
}

impl HandlerError {
    /// Retry after the engine's backoff.
    pub fn retry(reason: impl Into<String>) -> Self {
        HandlerError::Retry {
            reason: reason.into(),
            delay: None,
        }
    }

    /// Retry after `delay` (for example a rate limit's Retry-After).
    pub fn retry_after(reason: impl Into<String>, delay: Duration) -> Self {
        HandlerError::Retry {
            reason: reason.into(),
            delay: Some(delay),
        }
    }

    /// Dead-letter now with this reason.
    pub fn dead(reason: impl Into<String>) -> Self {
        HandlerError::Dead {
            reason: reason.into(),
        }
    }

    /// Run again after `delay` without using an attempt (River's `JobSnooze`, Oban's
    /// `{:snooze, s}`): for a message that is not ready yet (a payment still pending, a resource
    /// not there yet), not one that failed. Its key, if ordered, waits with it. Each snooze is
    /// counted (`postbox_messages_snoozed_total`, and on the message); past the engine's
    /// `max_snoozes` (default [`DEFAULT_MAX_SNOOZES`](crate::engine::DEFAULT_MAX_SNOOZES)) a
    /// snooze uses an attempt like a retry, so a message that only ever snoozes still reaches the
    /// dead letters.
    pub fn snooze(delay: Duration) -> Self {
        HandlerError::Snooze { delay }
    }
}

/// Any error converts into a retry whose reason is the error and its sources (`a: b: c`), so `?`
/// works on `std::error::Error` types, `anyhow::Error`, `Box<dyn Error + Send + Sync>` and strings.
impl<E: Into<Box<dyn std::error::Error + Send + Sync>>> From<E> for HandlerError {
    fn from(e: E) -> Self {
        let e: Box<dyn std::error::Error + Send + Sync> = e.into();
        let mut reason = e.to_string();
        let mut source = e.source();
        while let Some(s) = source {
            let s_text = s.to_string();
            // anyhow and others print their source in their own message already.
            if !reason.ends_with(&s_text) {
                reason.push_str(": ");
                reason.push_str(&s_text);
            }
            source = s.source();
        }
        HandlerError::retry(reason)
    }
}

impl std::fmt::Display for HandlerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HandlerError::Retry {
                reason,
                delay: None,
            } => write!(f, "retry: {reason}"),
            HandlerError::Retry {
                reason,
                delay: Some(d),
            } => write!(f, "retry after {d:?}: {reason}"),
            HandlerError::Dead { reason } => write!(f, "dead: {reason}"),
            HandlerError::Snooze { delay } => write!(f, "snooze for {delay:?}"),
        }
    }
}

type Erased = dyn Fn(ClaimedMessage) -> BoxFuture<'static, Outcome> + Send + Sync;

/// A set of handlers, one per topic.
///
/// ```
/// use postbox::sink::handlers::{Handlers, HandlerError, Job};
///
/// #[derive(serde::Deserialize)]
/// struct OrderCreated { order_id: i64 }
///
/// let handlers = Handlers::new().on("order.created", |job: Job<OrderCreated>| async move {
///     if job.payload.order_id < 0 {
///         return Err(HandlerError::dead("negative order id"));
///     }
///     Ok(())
/// });
/// assert_eq!(handlers.topic_names(), vec!["order.created"]);
/// ```
#[derive(Clone, Default)]
pub struct Handlers {
    by_topic: HashMap<String, Arc<Erased>>,
}

impl std::fmt::Debug for Handlers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handlers")
            .field("topics", &self.topic_names())
            .finish()
    }
}

impl Handlers {
    /// No handlers yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Handles `topic` with `handler`. The payload is deserialized into `T`; a payload that does
    /// not deserialize is dead-lettered with the serde error as reason (retrying cannot fix it).
    /// Registering a topic twice replaces the first handler.
    pub fn on<T, F, Fut>(mut self, topic: impl Into<String>, handler: F) -> Self
    where
        T: DeserializeOwned + Send + 'static,
        F: Fn(Job<T>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
    {
        let handler = Arc::new(handler);
        let erased = move |m: ClaimedMessage| -> BoxFuture<'static, Outcome> {
            let payload = match T::deserialize(&m.payload) {
                Ok(p) => p,
                Err(e) => {
                    let reason = format!(
                        "payload does not deserialize into {}: {e}",
                        std::any::type_name::<T>()
                    );
                    return futures_util::future::ready(Outcome::Dead { reason }).boxed();
                }
            };
            #[cfg(feature = "otel")]
            let cx = crate::otel::handler_context(&m.topic, m.id, m.attempts, &m.headers);
            let job = Job {
                payload,
                id: m.id,
                topic: m.topic,
                key: m.key,
                headers: m.headers,
                attempt: m.attempts,
                max_attempts: m.max_attempts,
                created_at: m.created_at,
                last_error: m.last_error,
                lease_token: m.lease_token,
            };
            #[cfg(feature = "otel")]
            let fut = {
                use opentelemetry::context::FutureExt as _;
                handler(job).with_context(cx.clone())
            };
            #[cfg(not(feature = "otel"))]
            let fut = handler(job);
            async move {
                let outcome = match fut.await {
                    Ok(()) => Outcome::Delivered,
                    Err(HandlerError::Retry { reason, delay }) => Outcome::Retry { reason, delay },
                    Err(HandlerError::Dead { reason }) => Outcome::Dead { reason },
                    Err(HandlerError::Snooze { delay }) => Outcome::Snooze { delay },
                };
                #[cfg(feature = "otel")]
                {
                    use opentelemetry::trace::{Status, TraceContextExt as _};
                    let span = cx.span();
                    match &outcome {
                        Outcome::Delivered | Outcome::Snooze { .. } => span.set_status(Status::Ok),
                        Outcome::Retry { reason, .. }
                        | Outcome::Dead { reason }
                        | Outcome::Release { reason }
                        | Outcome::TopicUnavailable { reason } => {
                            span.set_status(Status::error(reason.clone()))
                        }
                    }
                    span.end();
                }
                outcome
            }
            .boxed()
        };
        self.by_topic.insert(topic.into(), Arc::new(erased));
        self
    }

    /// The topics with a handler, sorted.
    pub fn topic_names(&self) -> Vec<&str> {
        let mut t: Vec<&str> = self.by_topic.keys().map(String::as_str).collect();
        t.sort_unstable();
        t
    }
}

impl Sink for Handlers {
    fn name(&self) -> &str {
        "handlers"
    }

    fn topics(&self) -> Topics {
        Topics::exact(self.by_topic.keys())
    }

    fn max_batch(&self) -> usize {
        1
    }

    fn deliver(
        &self,
        batch: Vec<ClaimedMessage>,
    ) -> BoxFuture<'_, Result<Vec<Outcome>, Unavailable>> {
        async move {
            let mut out = Vec::with_capacity(batch.len());
            for m in batch {
                let outcome = match self.by_topic.get(&m.topic) {
                    Some(h) => h(m).await,
                    // Only claimed topics arrive here; keep the message rather than lose it.
                    None => Outcome::Retry {
                        reason: format!("no handler for topic {:?}", m.topic),
                        delay: None,
                    },
                };
                out.push(outcome);
            }
            Ok(out)
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::HandlerError;

    #[test]
    fn any_error_converts_with_its_sources_and_a_handler_error_displays() {
        fn io() -> Result<(), HandlerError> {
            Err(std::io::Error::other("disk full"))?;
            Ok(())
        }
        fn any() -> Result<(), HandlerError> {
            Err(anyhow::anyhow!("db down").context("saving order 7"))?;
            Ok(())
        }
        fn boxed() -> Result<(), HandlerError> {
            let e: Box<dyn std::error::Error + Send + Sync> = "bad input".into();
            Err(e)?;
            Ok(())
        }
        fn text() -> Result<(), HandlerError> {
            Err(format!("status {}", 503))?;
            Ok(())
        }
        assert_eq!(io(), Err(HandlerError::retry("disk full")));
        assert_eq!(any(), Err(HandlerError::retry("saving order 7: db down")));
        assert_eq!(boxed(), Err(HandlerError::retry("bad input")));
        assert_eq!(text(), Err(HandlerError::retry("status 503")));
        assert_eq!(
            HandlerError::dead("no such customer").to_string(),
            "dead: no such customer"
        );
        assert_eq!(HandlerError::retry("later").to_string(), "retry: later");
        assert_eq!(
            HandlerError::retry_after("rate limited", std::time::Duration::from_secs(2))
                .to_string(),
            "retry after 2s: rate limited"
        );
    }
}
