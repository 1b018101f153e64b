//! Sinks: where claimed messages go. The engine claims, a sink delivers, the engine settles.

pub mod handlers;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "kafka")]
mod kafka_context;
pub mod log;
pub mod record;

use std::time::Duration;

use futures_util::future::BoxFuture;

use crate::store::{ClaimedMessage, Topics};

/// What became of one message.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Delivered: delete it.
    Delivered,
    /// Failed for now: try again after the backoff, or after `delay` if given. At max attempts
    /// this dead-letters instead.
    Retry {
        /// The error, kept as the message's last error.
        reason: String,
        /// The delay asked for instead of the backoff.
        delay: Option<Duration>,
    },
    /// Not now: run it again after `delay` without using an attempt, up to the engine's
    /// `max_snoozes` (past it, a snooze uses an attempt; see [`HandlerError::snooze`]).
    ///
    /// [`HandlerError::snooze`]: crate::sink::handlers::HandlerError::snooze
    Snooze {
        /// When to run it again, from now.
        delay: Duration,
    },
    /// Can never succeed: dead-letter it now with this reason.
    Dead {
        /// Why, kept with the dead letter.
        reason: String,
    },
    /// Not delivered because the sink is away (a broker outage that failed part of a batch): hand
    /// it back without using an attempt, as a whole batch is when the sink is `Unavailable`.
    Release {
        /// Why it was not delivered (logged).
        reason: String,
    },
    /// Not delivered because the message's topic cannot take messages now (Kafka refuses it: the
    /// topic does not exist, or the relay may not write to it). Handed back without using an
    /// attempt, and the engine stops claiming that topic for a while (backing off as for an
    /// outage, and trying it again after) while the route's other topics flow: an operator's fix
    /// (creating the topic, granting the ACL) is picked up without a restart, and nothing is
    /// dead-lettered meanwhile.
    TopicUnavailable {
        /// What the sink said of the topic.
        reason: String,
    },
}

/// The sink as a whole cannot deliver right now (broker down). The engine hands the batch back
/// without using attempts and backs off before claiming again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("sink unavailable: {0}")]
pub struct Unavailable(
    /// What failed.
    pub String,
    /// The sink's own error, when it gave one.
    pub Option<String>,
);

impl Unavailable {
    /// Unavailable because of `reason`.
    pub fn new(reason: impl Into<String>) -> Self {
        Unavailable(reason.into(), None)
    }

    /// Names the sink that is down (metric label), when it is not the engine's own sink (a sink
    /// that wraps others).
    pub fn of_sink(mut self, sink: impl Into<String>) -> Self {
        self.1.get_or_insert_with(|| sink.into());
        self
    }
}

/// A destination for messages.
///
/// The engine claims up to its batch size, splits the batch into chunks of at most
/// [`Sink::max_batch`] messages, and runs up to its concurrency limit of chunks at once. A chunk's
/// future resolves to one [`Outcome`] per message, in the order given. A panic inside `deliver`
/// is caught by the engine and counts as a retry of the whole chunk, with the panic message.
pub trait Sink: Send + Sync + 'static {
    /// Short name for logs and metric labels ("handlers", "kafka", "log").
    fn name(&self) -> &str;

    /// The topics this sink serves; the engine claims nothing else.
    fn topics(&self) -> Topics;

    /// Largest chunk `deliver` takes at once: 1 delivers every message on its own (handlers),
    /// larger values let a sink send a whole batch and await it together (Kafka).
    fn max_batch(&self) -> usize {
        usize::MAX
    }

    /// Delivers `batch`; one outcome per message, same order.
    fn deliver(
        &self,
        batch: Vec<ClaimedMessage>,
    ) -> BoxFuture<'_, Result<Vec<Outcome>, Unavailable>>;
}
