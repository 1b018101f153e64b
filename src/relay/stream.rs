//! `postbox stream setup | status | drop`, and starting the streamer inside `postbox run`.

use std::sync::Arc;

use clap::Subcommand;
use tokio_util::sync::CancellationToken;

use super::{RelayError, Result, admin_store};
use crate::config::{Settings, StreamSettings};
use crate::metrics::Metrics;
use crate::sink::Sink;
use crate::store::{Store, StreamSlot};

#[derive(Subcommand)]
pub enum StreamCommand {
    /// Create the publication and the replication slot, and register them so `publish` accepts
    /// messages (needs the REPLICATION attribute). Safe to run again; replaces a lost slot and
    /// says which range of the WAL was never delivered; acknowledges a range a relay reported as
    /// possibly never streamed (a slot created again by hand).
    Setup,
    /// The slots: streamed or not, WAL status, lag, WAL kept on the server's disk.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Drop the slot (publish refuses messages from then on unless another slot is set up).
    Drop,
}

fn stream_settings(settings: &Settings) -> StreamSettings {
    settings.stream.clone().unwrap_or_else(|| {
        crate::config::StreamSection::default()
            .settings()
            .expect("the defaults are valid")
    })
}

/// One slot as `status` and `stream status` print it.
pub(super) fn text(slot: &StreamSlot) -> String {
    let mb = |b: Option<i64>| {
        b.map(|b| format!("{:.1} MB", b as f64 / 1e6))
            .unwrap_or_else(|| "-".into())
    };
    let state = if !slot.exists {
        "DROPPED (messages published since its last position were not delivered)".to_owned()
    } else if slot.wal_status.as_deref() == Some("lost") {
        "LOST (the server removed WAL it had not delivered)".to_owned()
    } else if !slot.publication_exists {
        "BROKEN (its publication is missing: no relay can stream, publish refuses; `postbox stream setup` creates it)".to_owned()
    } else if let Some(gap) = &slot.gap {
        format!(
            "GAP: it was found confirmed past the last position postbox recorded (created again by hand, advanced, or streamed by another program): messages published in {gap} may never have been streamed; `postbox stream setup` acknowledges this{}",
            if slot.active { ", streaming" } else { "" }
        )
    } else if slot.active {
        format!(
            "streaming (server pid {})",
            slot.active_pid.unwrap_or_default()
        )
    } else {
        "idle (no relay streams it)".to_owned()
    };
    format!(
        "slot {} (publication {}): {state}\n  wal_status {}, safe_wal_size {}, lag {}, WAL kept {}, confirmed {} of {}",
        slot.slot_name,
        slot.publication,
        slot.wal_status.as_deref().unwrap_or("-"),
        slot.safe_wal_size
            .map(|b| format!("{:.1} MB", b as f64 / 1e6))
            .unwrap_or_else(|| "unlimited".into()),
        mb(slot.lag_bytes),
        mb(slot.retained_bytes),
        slot.confirmed_lsn.as_deref().unwrap_or("-"),
        slot.current_lsn,
    )
}

/// One slot as `--json` prints it.
pub(super) fn slot_json(s: &StreamSlot) -> serde_json::Value {
    serde_json::json!({
        "slot": s.slot_name, "publication": s.publication, "exists": s.exists,
        "active": s.active, "active_pid": s.active_pid, "wal_status": s.wal_status,
        "safe_wal_size": s.safe_wal_size, "confirmed_lsn": s.confirmed_lsn,
        "current_lsn": s.current_lsn, "lag_bytes": s.lag_bytes,
        "retained_bytes": s.retained_bytes, "lost": s.is_lost(),
        "publication_exists": s.publication_exists, "broken": s.is_broken(),
        "gap": s.gap, "gap_bytes": s.gap_bytes,
    })
}

/// Runs `postbox stream ...`.
pub async fn run(settings: &Settings, command: StreamCommand) -> Result<()> {
    let s = stream_settings(settings);
    let store = admin_store(settings).await?;
    match command {
        StreamCommand::Setup => {
            let done = store
                .stream_setup(&s.slot, &s.publication)
                .await
                .map_err(setup_error)?;
            if let Some(range) = &done.acknowledged_gap {
                eprintln!(
                    "slot {}: acknowledged the range {range} a relay reported as possibly never streamed (the slot had been created again or advanced behind postbox's back); no longer reported",
                    s.slot
                );
            }
            if let Some(range) = &done.replaced_lost {
                eprintln!(
                    "slot {} was lost: messages published in {range} were never delivered; a new slot streams from now on",
                    s.slot
                );
            }
            eprintln!(
                "stream set up: slot {} ({}), publication {} ({})",
                s.slot,
                if done.created_slot {
                    "created"
                } else {
                    "exists"
                },
                s.publication,
                if done.created_publication {
                    "created"
                } else {
                    "exists"
                }
            );
        }
        StreamCommand::Status { json } => {
            let slots = store.stream_status(None).await?;
            let lost = slots.iter().any(StreamSlot::is_lost);
            let broken = slots.iter().any(StreamSlot::is_broken);
            if json {
                let rows: Vec<serde_json::Value> = slots.iter().map(slot_json).collect();
                println!("{}", serde_json::Value::Array(rows));
            } else if slots.is_empty() {
                println!("stream mode is not set up in this database (postbox stream setup)");
            } else {
                for slot in &slots {
                    println!("{}", text(slot));
                }
            }
            if lost {
                return Err(RelayError::Runtime(anyhow::anyhow!(
                    "a stream slot is lost: run `postbox stream setup` to replace it"
                )));
            }
            if broken {
                return Err(RelayError::Runtime(anyhow::anyhow!(
                    "a stream slot's publication is missing: run `postbox stream setup` to create it"
                )));
            }
            if slots.iter().any(|s| s.gap.is_some()) {
                return Err(RelayError::Runtime(anyhow::anyhow!(
                    "a stream slot has a range that may never have been streamed: see its GAP line; `postbox stream setup` acknowledges it"
                )));
            }
        }
        StreamCommand::Drop => {
            // What the slot still holds, read before it goes (the server decodes it again).
            let unread = store
                .stream_unread_messages(&s.slot, &s.publication)
                .await
                .unwrap_or(None);
            match store.stream_drop(&s.slot).await.map_err(setup_error)? {
                Some(was) => {
                    let from = was.confirmed_lsn.as_deref().unwrap_or("its last position");
                    match unread {
                        Some(0) => eprintln!(
                            "slot {} dropped; every message published before it was delivered",
                            s.slot
                        ),
                        Some(n) => eprintln!(
                            "slot {} dropped; {n} message(s) published after {from} (up to {}) were not delivered",
                            s.slot, was.current_lsn
                        ),
                        None => eprintln!(
                            "slot {} dropped; messages published after {from} (up to {}) may not have been delivered (the server could not say)",
                            s.slot, was.current_lsn
                        ),
                    }
                }
                None => eprintln!("slot {} was not set up; nothing dropped", s.slot),
            }
        }
    }
    Ok(())
}

fn setup_error(e: crate::Error) -> RelayError {
    match e {
        crate::Error::InvalidArgument { .. } => RelayError::Usage(e.to_string()),
        other => {
            let text = other.to_string();
            // "permission denied for database X": creating the publication needs CREATE there.
            if let Some(at) = text.find("permission denied for database ") {
                let database = text[at + "permission denied for database ".len()..]
                    .split_whitespace()
                    .next()
                    .unwrap_or("the database");
                return RelayError::Runtime(anyhow::anyhow!(
                    "stream setup: {text}\nthe role needs CREATE on database {database} to create the publication (GRANT CREATE ON DATABASE {database} TO the role), or run `postbox stream setup` as the database's owner"
                ));
            }
            RelayError::Runtime(other.into())
        }
    }
}

/// Starts the streamer of `settings.stream` over `sinks`; its task ends at `stop`, or when the
/// slot is lost (logged as an error, `postbox_stream_slot_lost` set).
#[cfg(feature = "stream")]
pub fn spawn(
    settings: &Settings,
    s: &StreamSettings,
    sinks: Vec<Arc<dyn Sink>>,
    store: Store,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
    hard_stop: CancellationToken,
) -> Result<tokio::task::JoinHandle<crate::stream::StreamReport>> {
    let streamer = crate::stream::Streamer {
        url: settings.database_url.clone(),
        config: crate::stream::StreamConfig {
            slot: s.slot.clone(),
            publication: s.publication.clone(),
            create_slot: s.create_slot,
            status_interval: s.status_interval,
            batch_size: s.batch_size,
            takeover_interval: s.takeover_interval,
            liveness_interval: s.liveness_interval,
            max_backoff: settings.engine.max_unavailable_backoff,
            delivery_timeout: settings.engine.delivery_timeout,
            topic_timeouts: settings.engine.topic_timeouts.clone(),
            shutdown_deadline: settings.engine.shutdown_deadline,
            payload_budget: settings.engine.payload_budget,
        },
        sinks,
        store,
        observer: Some(metrics),
    };
    Ok(tokio::spawn(async move {
        match streamer.run_until(stop, hard_stop).await {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "stream: stopped");
                crate::stream::StreamReport::default()
            }
        }
    }))
}

/// Without the `stream` feature, a `[stream]` section is refused.
#[cfg(not(feature = "stream"))]
pub fn spawn(
    _settings: &Settings,
    _s: &StreamSettings,
    _sinks: Vec<Arc<dyn Sink>>,
    _store: Store,
    _metrics: Arc<Metrics>,
    _stop: CancellationToken,
    _hard_stop: CancellationToken,
) -> Result<tokio::task::JoinHandle<StreamReportStub>> {
    Err(RelayError::Usage(
        "stream: this build has no stream mode (feature `stream`)".into(),
    ))
}

/// What a build without stream mode reports (never made).
#[cfg(not(feature = "stream"))]
#[derive(Debug, Default)]
pub struct StreamReportStub {
    pub delivered: u64,
    pub dead_lettered: u64,
}
