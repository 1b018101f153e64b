//! What the streamer is given and what it reports: its settings, its errors, its report and its
//! observer.

use std::time::Duration;

use super::deliver::Delivered;

/// Bytes of message content a batch holds at most (besides `batch_size`), whatever the payload
/// budget: large messages make smaller batches.
const BATCH_BYTES: usize = 16 << 20;

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
