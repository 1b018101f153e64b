//! Whether each route's claims go through: `postbox_claim_stalled_seconds{sink}` is how long the
//! route's current claim has been waiting (on a lock, for a connection of the pool), or how long
//! its claims have been failing; 0 while they go through, and while the route waits for work or
//! for room. Whatever stalls delivery before a message is claimed — pool exhaustion, a lock, the
//! database away — shows here within the claim it stalls, and `PostboxDeliveryStalled` fires on it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use prometheus::{GaugeVec, Registry};

use super::gauge_vec;

/// A route's claims: the one in flight, and since when they fail.
#[derive(Default, Clone, Copy)]
struct State {
    started: Option<Instant>,
    failing_since: Option<Instant>,
}

pub(super) struct ClaimStalls {
    gauge: GaugeVec,
    state: Mutex<HashMap<String, State>>,
}

impl ClaimStalls {
    pub(super) fn register(r: &Registry, sinks: &[&str]) -> Self {
        let gauge = gauge_vec(
            r,
            "postbox_claim_stalled_seconds",
            "How long the route's claim in flight has been waiting, or its claims failing (0 while they go through).",
            &["sink"],
        );
        for s in sinks {
            gauge.with_label_values(&[s]).set(0.0);
        }
        ClaimStalls {
            gauge,
            state: Mutex::new(HashMap::new()),
        }
    }

    pub(super) fn started(&self, sink: &str) {
        let mut s = self.state.lock().expect("claims lock");
        s.entry(sink.to_owned()).or_default().started = Some(Instant::now());
    }

    pub(super) fn ended(&self, sink: &str, ok: bool) {
        let now = Instant::now();
        let mut s = self.state.lock().expect("claims lock");
        let e = s.entry(sink.to_owned()).or_default();
        e.started = None;
        e.failing_since = if ok {
            None
        } else {
            e.failing_since.or(Some(now))
        };
    }

    /// Sets the gauge as of `now` (before a scrape is rendered).
    pub(super) fn update(&self, now: Instant) {
        for (sink, e) in self.state.lock().expect("claims lock").iter() {
            let waiting = [e.started, e.failing_since]
                .into_iter()
                .flatten()
                .map(|at| now.saturating_duration_since(at).as_secs_f64())
                .fold(0.0, f64::max);
            self.gauge.with_label_values(&[sink]).set(waiting);
        }
    }

    /// The stall of `sink` as of `now`, in seconds.
    #[cfg(test)]
    pub(super) fn seconds(&self, sink: &str, now: Instant) -> f64 {
        self.update(now);
        self.gauge.with_label_values(&[sink]).get()
    }
}
