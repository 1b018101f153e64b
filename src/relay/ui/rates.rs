//! Delivered / retried / dead-lettered per minute, and the last hour of them, kept in the relay:
//! a sample of this relay's outcome counters every minute (61 kept), nothing stored elsewhere.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::metrics::{Metrics, Outcomes};

/// How often the counters are sampled: one bar of the chart.
pub const BUCKET: Duration = Duration::from_secs(60);
/// Bars of the chart: an hour.
pub const BARS: usize = 60;

/// The samples, oldest first.
#[derive(Default)]
pub struct Rates {
    samples: Mutex<VecDeque<(Instant, BTreeMap<String, Outcomes>)>>,
}

/// One topic's figures for the overview.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct TopicRates {
    /// In the last minute (or since the relay started, when that is less).
    pub last_minute: Outcomes,
    /// Per minute, the oldest first, the current (partial) minute last.
    pub hour: Vec<Outcomes>,
}

impl Rates {
    /// Takes a sample now (the relay calls it every [`BUCKET`]).
    pub fn sample(&self, metrics: &Metrics) {
        let mut s = self.samples.lock().expect("rates lock");
        s.push_back((Instant::now(), metrics.outcomes()));
        while s.len() > BARS + 1 {
            s.pop_front();
        }
    }

    /// Every topic's rates, from the samples and the counters now.
    pub fn topics(&self, metrics: &Metrics) -> BTreeMap<String, TopicRates> {
        let now_at = Instant::now();
        let now = metrics.outcomes();
        let s = self.samples.lock().expect("rates lock");
        let zero = Outcomes::default();
        let at = |i: usize, topic: &str| -> Outcomes {
            s.get(i)
                .and_then(|(_, m)| m.get(topic))
                .copied()
                .unwrap_or(zero)
        };
        // The latest sample at least a minute old; else the oldest (the relay is younger).
        let minute_ago = s
            .iter()
            .rposition(|(t, _)| now_at.duration_since(*t) >= BUCKET)
            .unwrap_or(0);
        now.iter()
            .map(|(topic, current)| {
                let mut hour: Vec<Outcomes> = (1..s.len())
                    .map(|i| at(i, topic).since(&at(i - 1, topic)))
                    .collect();
                hour.push(current.since(&at(s.len().saturating_sub(1), topic)));
                let skip = hour.len().saturating_sub(BARS);
                let rates = TopicRates {
                    last_minute: current.since(&at(minute_ago, topic)),
                    hour: hour.split_off(skip),
                };
                (topic.clone(), rates)
            })
            .collect()
    }
}

/// Samples every [`BUCKET`] until `stop`.
pub fn spawn(
    rates: Arc<Rates>,
    metrics: Arc<Metrics>,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(BUCKET);
        loop {
            tokio::select! {
                _ = tick.tick() => rates.sample(&metrics),
                _ = stop.cancelled() => return,
            }
        }
    })
}

/// The hour as a small bar chart (inline SVG, no script): delivered bars, dead ones in red on top.
pub fn chart(r: &TopicRates) -> String {
    let (w, h) = (3usize, 24.0f64);
    let max = r
        .hour
        .iter()
        .map(|o| o.delivered + o.retried + o.dead)
        .max()
        .unwrap_or(0)
        .max(1) as f64;
    let width = BARS * w;
    let mut out = format!(
        "<svg class=\"chart\" width=\"{width}\" height=\"{h}\" viewBox=\"0 0 {width} {h}\" role=\"img\" aria-label=\"messages per minute, last hour\">"
    );
    let offset = BARS.saturating_sub(r.hour.len());
    for (i, o) in r.hour.iter().enumerate() {
        let x = (offset + i) * w;
        let mut y = h;
        for (n, class) in [(o.delivered, "d"), (o.retried, "r"), (o.dead, "x")] {
            if n == 0 {
                continue;
            }
            let bar = (n as f64 / max * h).max(1.0);
            y -= bar;
            let _ = write!(
                out,
                "<rect class=\"{class}\" x=\"{x}\" y=\"{y:.1}\" width=\"{}\" height=\"{bar:.1}\"></rect>",
                w - 1
            );
        }
    }
    out += "</svg>";
    out
}
