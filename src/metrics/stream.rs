//! Stream mode's metrics: the streamer's state (active, messages), and the slot as the server
//! sees it (lag, WAL status, safe WAL size), sampled with the other database gauges.

use std::sync::Mutex;
use std::time::Instant;

use prometheus::{Gauge, GaugeVec, IntCounterVec, Registry};

use super::{Metrics, counter_vec, gauge, gauge_vec};
use crate::store::StreamSlot;

/// `wal_status` values a slot can have; the gauge of each is 1 for the current one.
pub const WAL_STATUSES: [&str; 5] = ["reserved", "extended", "unreserved", "lost", "missing"];

pub(super) struct StreamMetrics {
    #[cfg_attr(not(feature = "stream"), allow(dead_code))]
    active: Gauge,
    #[cfg_attr(not(feature = "stream"), allow(dead_code))]
    messages: IntCounterVec,
    slot_lost: Gauge,
    slot_active: GaugeVec,
    lag_bytes: GaugeVec,
    retained_bytes: GaugeVec,
    safe_wal_size: GaugeVec,
    wal_status: GaugeVec,
    gap_bytes: GaugeVec,
    stalled: Gauge,
    /// Since when the batch being delivered has waited.
    #[cfg_attr(not(feature = "stream"), allow(dead_code))]
    pending_since: Mutex<Option<Instant>>,
    /// Since when this relay has failed to stream.
    #[cfg_attr(not(feature = "stream"), allow(dead_code))]
    broken_since: Mutex<Option<Instant>>,
}

/// The streamer's name among what `/healthz` watches.
#[cfg(feature = "stream")]
const ALIVE_NAME: &str = "stream";

impl StreamMetrics {
    /// Sets the stall gauge as of `now` (before a scrape is rendered).
    pub(super) fn update(&self, now: Instant) {
        let pending = *self.pending_since.lock().expect("stream pending lock");
        let broken = *self.broken_since.lock().expect("stream broken lock");
        self.stalled.set(
            [pending, broken]
                .into_iter()
                .flatten()
                .map(|at| now.saturating_duration_since(at).as_secs_f64())
                .fold(0.0, f64::max),
        );
    }

    pub(super) fn register(r: &Registry) -> Self {
        StreamMetrics {
            active: gauge(
                r,
                "postbox_stream_active",
                "1 while this relay streams the slot; 0 while it stands by (another relay streams it) or reconnects.",
            ),
            messages: counter_vec(
                r,
                "postbox_stream_messages_total",
                "Stream messages this relay finished, by outcome (delivered, dead_lettered).",
                &["outcome"],
            ),
            slot_lost: gauge(
                r,
                "postbox_stream_slot_lost",
                "1 when the stream slot is lost or was dropped: published messages were not delivered; the streamer has stopped.",
            ),
            slot_active: gauge_vec(
                r,
                "postbox_stream_slot_active",
                "1 when some relay streams the slot (the server's view).",
                &["slot"],
            ),
            lag_bytes: gauge_vec(
                r,
                "postbox_stream_lag_bytes",
                "Bytes of WAL between the slot's confirmed position and the server's position.",
                &["slot"],
            ),
            retained_bytes: gauge_vec(
                r,
                "postbox_stream_retained_wal_bytes",
                "Bytes of WAL the slot keeps on the server's disk.",
                &["slot"],
            ),
            safe_wal_size: gauge_vec(
                r,
                "postbox_stream_safe_wal_size_bytes",
                "Bytes of WAL that can be written before the slot is lost (max_slot_wal_keep_size); absent when unlimited.",
                &["slot"],
            ),
            wal_status: gauge_vec(
                r,
                "postbox_stream_wal_status",
                "1 for the slot's current wal_status (reserved, extended, unreserved, lost; missing: the slot was dropped).",
                &["slot", "status"],
            ),
            gap_bytes: gauge_vec(
                r,
                "postbox_stream_slot_gap_bytes",
                "Bytes of WAL that may never have been streamed: the slot was found confirmed past the last position postbox recorded (created again by hand under the same name, advanced, or streamed by another program); 0 once `postbox stream setup` acknowledged it.",
                &["slot"],
            ),
            stalled: gauge(
                r,
                "postbox_stream_stalled_seconds",
                "How long the stream has been stalled on this relay: the batch being delivered waiting for its sink (or its dead letters for the database), or the relay failing to stream (sessions ending in errors, a missing publication, the database away); 0 while it streams or stands by.",
            ),
            pending_since: Mutex::new(None),
            broken_since: Mutex::new(None),
        }
    }
}

impl Metrics {
    /// Sets the slot gauges from a sample of `postbox stream status`.
    pub fn stream_slots(&self, slots: &[StreamSlot]) {
        let s = &self.stream;
        for slot in slots {
            let name = slot.slot_name.as_str();
            s.slot_active
                .with_label_values(&[name])
                .set(f64::from(u8::from(slot.active)));
            if let Some(l) = slot.lag_bytes {
                s.lag_bytes.with_label_values(&[name]).set(l as f64);
            }
            if let Some(l) = slot.retained_bytes {
                s.retained_bytes.with_label_values(&[name]).set(l as f64);
            }
            match slot.safe_wal_size {
                Some(b) => s.safe_wal_size.with_label_values(&[name]).set(b as f64),
                None => {
                    let _ = s.safe_wal_size.remove_label_values(&[name]);
                }
            }
            let now = if slot.exists {
                slot.wal_status.as_deref().unwrap_or("missing")
            } else {
                "missing"
            };
            for st in WAL_STATUSES {
                s.wal_status
                    .with_label_values(&[name, st])
                    .set(f64::from(u8::from(st == now)));
            }
            s.gap_bytes
                .with_label_values(&[name])
                .set(slot.gap_bytes.map_or(0.0, |b| b.max(1) as f64));
            if slot.is_lost() {
                s.slot_lost.set(1.0);
            }
        }
        // Back to 0 once every slot can be streamed again (`postbox stream setup` replaced it).
        if !slots.is_empty() && !slots.iter().any(StreamSlot::is_lost) {
            s.slot_lost.set(0.0);
        }
    }
}

#[cfg(feature = "stream")]
impl crate::stream::StreamObserver for Metrics {
    fn stream_active(&self, active: bool) {
        self.stream.active.set(f64::from(u8::from(active)));
    }

    fn stream_delivered(&self, done: crate::stream::Delivered) {
        self.stream
            .messages
            .with_label_values(&["delivered"])
            .inc_by(done.delivered);
        self.stream
            .messages
            .with_label_values(&["dead_lettered"])
            .inc_by(done.dead_lettered);
    }

    fn stream_lost(&self) {
        self.stream.slot_lost.set(1.0);
        self.stream.active.set(0.0);
    }

    fn stream_slot_ready(&self) {
        self.stream.slot_lost.set(0.0);
    }

    fn stream_pending(&self, since: Option<Instant>) {
        *self
            .stream
            .pending_since
            .lock()
            .expect("stream pending lock") = since;
    }

    fn stream_broken(&self, since: Option<Instant>) {
        *self.stream.broken_since.lock().expect("stream broken lock") = since;
    }

    fn stream_sink_up(&self, sink: &str, up: bool) {
        crate::engine::Observer::sink_up(self, sink, up);
    }

    fn stream_alive(&self) {
        crate::engine::Observer::alive(self, ALIVE_NAME);
    }

    fn stream_stopped(&self) {
        self.alive.lock().expect("alive lock").remove(ALIVE_NAME);
        *self
            .stream
            .pending_since
            .lock()
            .expect("stream pending lock") = None;
        *self.stream.broken_since.lock().expect("stream broken lock") = None;
    }
}
