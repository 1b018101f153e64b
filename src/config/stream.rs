//! `[stream]`: stream mode (messages published into the WAL, read through a replication slot).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::durations::opt_duration;
use super::{ConfigError, err};

/// `[stream]`: present, the relay also streams published messages (see `postbox::publish`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StreamSection {
    /// The logical replication slot (default `postbox`).
    pub slot: Option<String>,
    /// The publication named when streaming (default `postbox_stream`; it holds no tables).
    pub publication: Option<String>,
    /// Set up the slot at start when it was never set up (default true). A lost or dropped slot
    /// is only ever replaced by `postbox stream setup`.
    pub create_slot: Option<bool>,
    /// How often the confirmed position is reported to the server (default 1s).
    #[serde(default, with = "opt_duration")]
    pub status_interval: Option<Duration>,
    /// Messages delivered together, and so held in memory at most (default 5000).
    pub batch_size: Option<usize>,
    /// How often a standby relay tries to take the slot over (default 1s).
    #[serde(default, with = "opt_duration")]
    pub takeover_interval: Option<Duration>,
    /// After this long without a word from the server, the relay asks it whether its replication
    /// session is still there; gone, the connection is presumed dead and opened again
    /// (default 10s).
    #[serde(default, with = "opt_duration")]
    pub liveness_interval: Option<Duration>,
}

/// `[stream]` with every default filled in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSettings {
    /// The logical replication slot.
    pub slot: String,
    /// The publication named when streaming.
    pub publication: String,
    /// Set the slot up at start when it was never set up.
    pub create_slot: bool,
    /// How often the confirmed position is reported to the server.
    pub status_interval: Duration,
    /// Messages delivered together, and so held in memory at most.
    pub batch_size: usize,
    /// How often a standby relay tries to take the slot over.
    pub takeover_interval: Duration,
    /// After this long without a word from the server, ask whether the session is still there.
    pub liveness_interval: Duration,
}

fn name(field: &'static str, value: &str) -> Result<(), ConfigError> {
    crate::store::check_slot_name(field, value).map_err(|e| match e {
        crate::Error::InvalidArgument { field, problem } => err(field, problem),
        other => err(field, other.to_string()),
    })
}

impl StreamSection {
    /// Validates and fills in the defaults.
    pub fn settings(&self) -> Result<StreamSettings, ConfigError> {
        let slot = self.slot.clone().unwrap_or_else(|| "postbox".into());
        name("stream.slot", &slot)?;
        let publication = self
            .publication
            .clone()
            .unwrap_or_else(|| "postbox_stream".into());
        name("stream.publication", &publication)?;
        let status_interval = self.status_interval.unwrap_or(Duration::from_secs(1));
        if status_interval < Duration::from_millis(100) || status_interval > Duration::from_secs(60)
        {
            return Err(err(
                "stream.status_interval",
                "must be between 100ms and 60s (the server's wal_sender_timeout is 60s by default)",
            ));
        }
        let batch_size = self.batch_size.unwrap_or(5000);
        if !(1..=100_000).contains(&batch_size) {
            return Err(err("stream.batch_size", "must be between 1 and 100000"));
        }
        let takeover_interval = self.takeover_interval.unwrap_or(Duration::from_secs(1));
        if takeover_interval < Duration::from_millis(100) {
            return Err(err("stream.takeover_interval", "must be at least 100ms"));
        }
        let liveness_interval = self.liveness_interval.unwrap_or(Duration::from_secs(10));
        if liveness_interval < Duration::from_millis(500) {
            return Err(err("stream.liveness_interval", "must be at least 500ms"));
        }
        Ok(StreamSettings {
            slot,
            publication,
            create_slot: self.create_slot.unwrap_or(true),
            status_interval,
            batch_size,
            takeover_interval,
            liveness_interval,
        })
    }
}
