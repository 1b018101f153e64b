//! Every metric of the relay, defined once, with bounded labels (topic, sink, state, table; never
//! a message id). Engine events arrive through [`Observer`]; database gauges are set from one
//! sampling query on an interval, never per scrape.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    Opts, Registry, TextEncoder,
};

use crate::engine::{Observer, Settlement};
use crate::store::{SampleRow, Topics};

mod claims;
mod console;
mod embedded;
mod horizon;
mod stream;
mod topics;

pub use console::Outcomes;
pub use embedded::{SAMPLE_INTERVAL, sample};
/// The prometheus crate postbox's metrics are made with: an app's `Registry` must be this one's.
pub use prometheus;

pub use stream::WAL_STATUSES;
use topics::TopicLabels;
pub use topics::{DEFAULT_MAX_TOPICS, OTHER};

/// The relay's metrics and the health they imply.
pub struct Metrics {
    registry: Registry,
    delivered: IntCounterVec,
    retried: IntCounterVec,
    snoozed: IntCounterVec,
    dead_lettered: IntCounterVec,
    released: IntCounter,
    fenced: IntCounter,
    delivery_duration: HistogramVec,
    end_to_end: HistogramVec,
    claim_batch: Histogram,
    queue_depth: GaugeVec,
    oldest_pending: GaugeVec,
    dead_letters: GaugeVec,
    stalled_keys: GaugeVec,
    dead_tuples: GaugeVec,
    live_tuples: GaugeVec,
    oldest_transaction: Gauge,
    sink_up: GaugeVec,
    database_up: Gauge,
    notifier_connected: Gauge,
    topic_paused: GaugeVec,
    schedule_last: GaugeVec,
    schedule_next: GaugeVec,
    schedule_fired: IntCounterVec,
    limit_running: GaugeVec,
    limit_max: GaugeVec,
    completed_kept: Gauge,
    invariant_violations: GaugeVec,
    keys_repaired: IntCounter,
    database_ok: AtomicBool,
    /// When each engine (by sink) last made progress, and how long without it means stuck.
    alive: Mutex<HashMap<String, std::time::Instant>>,
    stall_after: Mutex<Option<Duration>>,
    /// Which sink serves which topics: their outcome counters start at 0 once a topic is seen.
    routes: Mutex<Vec<(String, Topics)>>,
    /// The sinks, for the series of a topic that loses its name.
    sinks: Vec<String>,
    /// Which topics have series of their own (the others count under [`OTHER`]).
    topics: Mutex<TopicLabels>,
    stream: stream::StreamMetrics,
    claims: claims::ClaimStalls,
    horizon: horizon::Horizon,
}

fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(c.clone())).expect("registered once");
    c
}

fn gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    let g = GaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(g.clone())).expect("registered once");
    g
}

fn gauge(r: &Registry, name: &str, help: &str) -> Gauge {
    let g = Gauge::new(name, help).expect("valid metric");
    r.register(Box::new(g.clone())).expect("registered once");
    g
}

impl Metrics {
    /// Registers every metric; `sinks` start as up. The [`DEFAULT_MAX_TOPICS`] largest topics
    /// get series of their own.
    pub fn new(sinks: &[&str]) -> Arc<Self> {
        Self::with_max_topics(sinks, DEFAULT_MAX_TOPICS)
    }

    /// [`Metrics::new`] with series of their own for the `max_topics` largest topics (by
    /// messages in the table and the dead letters, and traffic); every other topic counts under
    /// the label value [`OTHER`].
    pub fn with_max_topics(sinks: &[&str], max_topics: usize) -> Arc<Self> {
        let r = Registry::new();
        let latency_buckets = vec![
            0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            60.0, 300.0,
        ];
        let delivery_duration = HistogramVec::new(
            HistogramOpts::new(
                "postbox_delivery_duration_seconds",
                "Time a sink took to deliver one chunk of messages.",
            )
            .buckets(latency_buckets.clone()),
            &["sink"],
        )
        .expect("valid metric");
        r.register(Box::new(delivery_duration.clone()))
            .expect("registered once");
        let end_to_end = HistogramVec::new(
            HistogramOpts::new(
                "postbox_end_to_end_latency_seconds",
                "From a message's creation (its commit, roughly) to its acknowledgement by the sink.",
            )
            .buckets(latency_buckets),
            &["topic"],
        )
        .expect("valid metric");
        r.register(Box::new(end_to_end.clone()))
            .expect("registered once");
        let claim_batch = Histogram::with_opts(
            HistogramOpts::new(
                "postbox_claim_batch_size",
                "Messages returned by one claim statement.",
            )
            .buckets(vec![
                0.0, 1.0, 5.0, 10.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 5000.0,
            ]),
        )
        .expect("valid metric");
        r.register(Box::new(claim_batch.clone()))
            .expect("registered once");
        let m = Metrics {
            delivered: counter_vec(
                &r,
                "postbox_messages_delivered_total",
                "Messages acknowledged by their sink and deleted.",
                &["topic", "sink"],
            ),
            retried: counter_vec(
                &r,
                "postbox_messages_retried_total",
                "Failed deliveries sent back to pending with backoff.",
                &["topic", "sink"],
            ),
            snoozed: counter_vec(
                &r,
                "postbox_messages_snoozed_total",
                "Deliveries a handler put off without using an attempt (under the engine's max_snoozes; past it a snooze counts as a retry).",
                &["topic", "sink"],
            ),
            dead_lettered: counter_vec(
                &r,
                "postbox_messages_dead_lettered_total",
                "Messages moved to the dead letters.",
                &["topic", "sink"],
            ),
            released: {
                let c = IntCounter::new(
                    "postbox_messages_released_total",
                    "Messages handed back without using an attempt (shutdown, sink outage).",
                )
                .expect("valid metric");
                r.register(Box::new(c.clone())).expect("registered once");
                c
            },
            fenced: {
                let c = IntCounter::new("postbox_lease_fenced_total", "Outcomes that changed nothing because the lease had expired and the message was claimed again.").expect("valid metric");
                r.register(Box::new(c.clone())).expect("registered once");
                c
            },
            delivery_duration,
            end_to_end,
            claim_batch,
            queue_depth: gauge_vec(
                &r,
                "postbox_queue_depth",
                "Live messages per topic and state (available, scheduled, running).",
                &["topic", "state"],
            ),
            oldest_pending: gauge_vec(
                &r,
                "postbox_oldest_pending_age_seconds",
                "How long the oldest claimable message has waited.",
                &["topic"],
            ),
            dead_letters: gauge_vec(
                &r,
                "postbox_dead_letters",
                "Messages in the dead letters.",
                &["topic"],
            ),
            stalled_keys: gauge_vec(
                &r,
                "postbox_stalled_keys",
                "Ordered keys whose head has failed and holds the rest back.",
                &["topic"],
            ),
            dead_tuples: gauge_vec(
                &r,
                "postbox_table_dead_tuples",
                "Dead tuples of postbox's tables (vacuum is behind when this grows).",
                &["table"],
            ),
            live_tuples: gauge_vec(
                &r,
                "postbox_table_live_tuples",
                "Live tuples of postbox's tables.",
                &["table"],
            ),
            oldest_transaction: gauge(
                &r,
                "postbox_oldest_transaction_age_seconds",
                "Age of the oldest open transaction in the server: the xmin horizon that stops vacuum.",
            ),
            sink_up: gauge_vec(
                &r,
                "postbox_sink_up",
                "1 while the sink takes messages.",
                &["sink"],
            ),
            database_up: gauge(
                &r,
                "postbox_database_up",
                "1 while the last database sample succeeded.",
            ),
            notifier_connected: gauge(
                &r,
                "postbox_notifier_connected",
                "1 while the LISTEN connection is up.",
            ),
            topic_paused: gauge_vec(
                &r,
                "postbox_topic_paused",
                "1 while the topic is paused (postbox pause), 0 otherwise.",
                &["topic"],
            ),
            schedule_last: gauge_vec(
                &r,
                "postbox_schedule_last_tick_timestamp_seconds",
                "The last tick a cron schedule fired (by any relay), in Unix seconds.",
                &["schedule"],
            ),
            schedule_next: gauge_vec(
                &r,
                "postbox_schedule_next_tick_timestamp_seconds",
                "When a cron schedule's next tick is due, in Unix seconds.",
                &["schedule"],
            ),
            schedule_fired: counter_vec(
                &r,
                "postbox_schedule_fired_total",
                "Ticks this relay fired (one message each).",
                &["schedule"],
            ),
            limit_running: gauge_vec(
                &r,
                "postbox_limit_running",
                "Messages of a running limit's topics running now across every relay (per_key: of its busiest key).",
                &["limit"],
            ),
            limit_max: gauge_vec(
                &r,
                "postbox_limit_max_running",
                "The running limit's maximum.",
                &["limit"],
            ),
            completed_kept: gauge(
                &r,
                "postbox_completed_kept",
                "Delivered messages kept by retention (keep_completed), from the table statistics.",
            ),
            invariant_violations: {
                let g = gauge_vec(
                    &r,
                    "postbox_invariant_violations",
                    "What the state model forbids, found by the last sample (postbox check): stranded_key, double_head, hold_over_limit.",
                    &["kind"],
                );
                for k in crate::store::VIOLATION_KINDS {
                    g.with_label_values(&[k]).set(0.0);
                }
                g
            },
            keys_repaired: {
                let c = IntCounter::new("postbox_keys_repaired_total", "Stranded ordered keys (waiting messages, no head) the rescuer gave their head again.").expect("valid metric");
                r.register(Box::new(c.clone())).expect("registered once");
                c
            },
            database_ok: AtomicBool::new(false),
            alive: Mutex::new(HashMap::new()),
            stall_after: Mutex::new(None),
            routes: Mutex::new(Vec::new()),
            sinks: sinks.iter().map(|s| (*s).to_owned()).collect(),
            topics: Mutex::new(TopicLabels::new(max_topics)),
            stream: stream::StreamMetrics::register(&r),
            claims: claims::ClaimStalls::register(&r, sinks),
            horizon: horizon::Horizon::register(&r),
            registry: r,
        };
        let build = gauge_vec(
            &m.registry,
            "postbox_build_info",
            "Always 1; labels say which build runs.",
            &["version"],
        );
        build
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1.0);
        for s in sinks {
            m.sink_up.with_label_values(&[s]).set(1.0);
        }
        Arc::new(m)
    }

    /// Every metric, as of now.
    pub fn gather(&self) -> Vec<prometheus::proto::MetricFamily> {
        let now = std::time::Instant::now();
        self.claims.update(now);
        self.stream.update(now);
        self.registry.gather()
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.gather(), &mut buf)
            .expect("text encoding cannot fail");
        String::from_utf8(buf).expect("the text format is UTF-8")
    }

    /// Sets the database gauges from a sample (or marks the database down).
    pub fn apply_sample(&self, sample: Result<&[SampleRow], ()>) {
        let Ok(rows) = sample else {
            self.database_up.set(0.0);
            self.database_ok.store(false, Ordering::Release);
            return;
        };
        self.horizon.apply(rows);
        for g in [
            &self.queue_depth,
            &self.oldest_pending,
            &self.dead_letters,
            &self.stalled_keys,
            &self.dead_tuples,
            &self.live_tuples,
        ] {
            g.reset();
        }
        let mut sizes: HashMap<&str, f64> = HashMap::new();
        for r in rows
            .iter()
            .filter(|r| matches!(r.metric.as_str(), "depth" | "dead"))
        {
            *sizes.entry(r.label.as_str()).or_default() += r.value;
        }
        let mut labels = self.topics.lock().expect("topic labels lock");
        for gone in labels.rank(&sizes) {
            self.forget_topic(&gone);
        }
        // Per label: the sums (depth, dead letters, stalled keys) and the oldest wait.
        let mut sums: HashMap<(&str, &str, &str), f64> = HashMap::new();
        let mut oldest: HashMap<&str, f64> = HashMap::new();
        let routes = self.routes.lock().expect("routes lock");
        for r in rows {
            let label = labels.label(&r.label);
            if matches!(r.metric.as_str(), "depth" | "dead") {
                for (sink, _) in routes.iter().filter(|(_, t)| t.matches(&r.label)) {
                    for c in [&self.delivered, &self.retried, &self.dead_lettered] {
                        c.with_label_values(&[label, sink]);
                    }
                }
            }
            match r.metric.as_str() {
                // A topic with messages but none claimable has waited 0 s (a series, not an
                // absence).
                "depth" => {
                    *sums.entry(("depth", label, &r.state)).or_default() += r.value;
                    oldest.entry(label).or_default();
                }
                "oldest_available" => {
                    let o = oldest.entry(label).or_default();
                    *o = o.max(r.value);
                }
                "dead" | "stalled" => *sums.entry((&r.metric, label, "")).or_default() += r.value,
                "dead_tuples" => self.dead_tuples.with_label_values(&[&r.label]).set(r.value),
                "live_tuples" => self.live_tuples.with_label_values(&[&r.label]).set(r.value),
                "oldest_transaction" => self.oldest_transaction.set(r.value),
                _ => {}
            }
        }
        for ((metric, label, state), v) in sums {
            match metric {
                "depth" => self.queue_depth.with_label_values(&[label, state]).set(v),
                "dead" => self.dead_letters.with_label_values(&[label]).set(v),
                _ => self.stalled_keys.with_label_values(&[label]).set(v),
            }
        }
        for (label, v) in oldest {
            self.oldest_pending.with_label_values(&[label]).set(v);
        }
        self.database_up.set(1.0);
        self.database_ok.store(true, Ordering::Release);
    }

    /// Sets `postbox_topic_paused` for every topic the sample shows (1 if a pause pattern matches
    /// it) and for every paused exact name (a topic paused before it has messages).
    pub fn apply_pauses(&self, patterns: &[String], sample: &[SampleRow]) {
        self.topic_paused.reset();
        let paused = Topics::only(patterns);
        let mut labels = self.topics.lock().expect("topic labels lock");
        let mut by_label: HashMap<&str, f64> = HashMap::new();
        for r in sample
            .iter()
            .filter(|r| matches!(r.metric.as_str(), "depth" | "dead"))
        {
            let v = if paused.matches(&r.label) { 1.0 } else { 0.0 };
            let e = by_label.entry(labels.label(&r.label)).or_default();
            *e = e.max(v);
        }
        for p in patterns.iter().filter(|p| !p.contains('*')) {
            by_label.insert(labels.label(p), 1.0);
        }
        for (label, v) in by_label {
            self.topic_paused.with_label_values(&[label]).set(v);
        }
    }

    /// Removes the series of a topic that no longer has its own (it counts under [`OTHER`]
    /// from now on; a counter that comes back starts again from 0, which `rate()` reads as a
    /// reset).
    fn forget_topic(&self, topic: &str) {
        let routes = self.routes.lock().expect("routes lock");
        let sinks = self
            .sinks
            .iter()
            .map(String::as_str)
            .chain(routes.iter().map(|(s, _)| s.as_str()));
        for sink in sinks {
            for c in [
                &self.delivered,
                &self.retried,
                &self.dead_lettered,
                &self.snoozed,
            ] {
                let _ = c.remove_label_values(&[topic, sink]);
            }
        }
        let _ = self.end_to_end.remove_label_values(&[topic]);
    }

    /// How many topics get series of their own.
    pub fn max_topics(&self) -> usize {
        self.topics.lock().expect("topic labels lock").max()
    }

    /// Sets the gauges of a running limit: running now (sampled), and its maximum.
    pub fn limit(&self, limit: &crate::store::Limit, running: i64) {
        self.limit_running
            .with_label_values(&[limit.name()])
            .set(running as f64);
        self.limit_max
            .with_label_values(&[limit.name()])
            .set(f64::from(limit.max_running()));
    }

    /// Sets the number of delivered messages retention keeps.
    pub fn completed_kept(&self, n: i64) {
        self.completed_kept.set(n as f64);
    }

    /// Sets `postbox_invariant_violations` from a check: every kind, 0 when none was found.
    pub fn invariants(&self, found: &[crate::store::Violation]) {
        for k in crate::store::VIOLATION_KINDS {
            let n = found.iter().filter(|v| v.kind == k).count();
            self.invariant_violations
                .with_label_values(&[k])
                .set(n as f64);
        }
    }

    /// Ready: this pod can do its job — its database answers. A sink that is down is down for
    /// every replica alike (it shows in `postbox_sink_up` and `status`): making every pod unready
    /// for it would only block node drains and rollouts behind the disruption budget.
    pub fn ready(&self) -> Result<(), String> {
        if !self.database_ok.load(Ordering::Acquire) {
            return Err("database unreachable".into());
        }
        Ok(())
    }

    /// The topics each sink serves: once a sample shows a topic (messages or dead letters), its
    /// delivered/retried/dead-lettered counters exist at 0 for the sink that serves it, so the
    /// first failure shows in `rate()` and `increase()` (a series that appears at 1 does not).
    pub fn routes(&self, routes: Vec<(String, Topics)>) {
        *self.routes.lock().expect("routes lock") = routes;
    }

    /// Engines that have made no progress for `after` make the process not alive (see
    /// [`alive`](Self::alive)); `None` turns the check off.
    pub fn stall_after(&self, after: Option<Duration>) {
        *self.stall_after.lock().expect("stall lock") = after;
    }

    /// Alive: no engine is stuck — each has gone round its claim loop, or written (or tried to
    /// write) outcomes, within the stall limit. A database outage is not being stuck.
    pub fn alive_at(&self, now: std::time::Instant) -> Result<(), String> {
        let Some(after) = *self.stall_after.lock().expect("stall lock") else {
            return Ok(());
        };
        let stuck: Vec<String> = self
            .alive
            .lock()
            .expect("alive lock")
            .iter()
            .filter(|(_, at)| now.saturating_duration_since(**at) > after)
            .map(|(sink, at)| format!("{sink} (no progress for {:?})", now.duration_since(*at)))
            .collect();
        if stuck.is_empty() {
            Ok(())
        } else {
            Err(format!("engine stuck: {}", stuck.join(", ")))
        }
    }
}

impl Observer for Metrics {
    fn keys_repaired(&self, n: usize) {
        self.keys_repaired.inc_by(n as u64);
    }

    fn claimed(&self, n: usize) {
        self.claim_batch.observe(n as f64);
    }

    fn settled(&self, topic: &str, sink: &str, what: Settlement, age: Duration) {
        let topic = self
            .topics
            .lock()
            .expect("topic labels lock")
            .settled(topic);
        match what {
            Settlement::Delivered => {
                self.delivered.with_label_values(&[topic, sink]).inc();
                self.end_to_end
                    .with_label_values(&[topic])
                    .observe(age.as_secs_f64());
            }
            Settlement::Retried => self.retried.with_label_values(&[topic, sink]).inc(),
            Settlement::DeadLettered => self.dead_lettered.with_label_values(&[topic, sink]).inc(),
            Settlement::Released => self.released.inc(),
            Settlement::Fenced => self.fenced.inc(),
            Settlement::Snoozed => self.snoozed.with_label_values(&[topic, sink]).inc(),
        }
    }

    fn delivery(&self, sink: &str, _n: usize, elapsed: Duration) {
        self.delivery_duration
            .with_label_values(&[sink])
            .observe(elapsed.as_secs_f64());
    }

    fn sink_up(&self, sink: &str, up: bool) {
        self.sink_up
            .with_label_values(&[sink])
            .set(if up { 1.0 } else { 0.0 });
    }

    fn notifier_connected(&self, up: bool) {
        self.notifier_connected.set(if up { 1.0 } else { 0.0 });
    }

    fn schedule(
        &self,
        name: &str,
        last: Option<chrono::DateTime<chrono::Utc>>,
        next: chrono::DateTime<chrono::Utc>,
        fired: bool,
    ) {
        let fired_total = self.schedule_fired.with_label_values(&[name]);
        if fired {
            fired_total.inc();
        }
        if let Some(last) = last {
            self.schedule_last
                .with_label_values(&[name])
                .set(last.timestamp_millis() as f64 / 1000.0);
        }
        self.schedule_next
            .with_label_values(&[name])
            .set(next.timestamp_millis() as f64 / 1000.0);
    }

    fn claim_started(&self, sink: &str) {
        self.claims.started(sink);
    }

    fn claim_ended(&self, sink: &str, ok: bool) {
        self.claims.ended(sink, ok);
    }

    fn alive(&self, sink: &str) {
        let now = std::time::Instant::now();
        let mut alive = self.alive.lock().expect("alive lock");
        match alive.get_mut(sink) {
            Some(at) => *at = now,
            None => {
                alive.insert(sink.to_owned(), now);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn a_claim_that_waits_or_keeps_failing_shows_as_a_stall() {
        let m = Metrics::new(&["kafka"]);
        let t0 = Instant::now();
        assert_eq!(m.claims.seconds("kafka", t0), 0.0, "no claim yet");
        m.claim_started("kafka");
        assert!(m.claims.seconds("kafka", t0 + Duration::from_secs(30)) >= 29.0);
        m.claim_ended("kafka", true);
        assert_eq!(m.claims.seconds("kafka", Instant::now()), 0.0);
        m.claim_started("kafka");
        m.claim_ended("kafka", false);
        m.claim_started("kafka");
        m.claim_ended("kafka", false);
        assert!(
            m.claims
                .seconds("kafka", Instant::now() + Duration::from_secs(45))
                >= 44.0
        );
        m.claim_started("kafka");
        m.claim_ended("kafka", true);
        assert_eq!(m.claims.seconds("kafka", Instant::now()), 0.0);
        assert!(
            m.render()
                .contains("postbox_claim_stalled_seconds{sink=\"kafka\"} 0")
        );
    }

    #[test]
    fn not_alive_once_an_engine_makes_no_progress_for_the_stall_limit() {
        let m = Metrics::new(&["kafka", "log"]);
        let t0 = Instant::now();
        assert!(m.alive_at(t0).is_ok(), "no engine yet");
        m.alive("kafka");
        m.alive("log");
        m.stall_after(Some(Duration::from_secs(60)));
        assert!(m.alive_at(Instant::now() + Duration::from_secs(30)).is_ok());
        m.alive("log");
        let later = Instant::now() + Duration::from_secs(61);
        let why = m.alive_at(later).unwrap_err();
        assert!(why.contains("kafka") && why.contains("log"), "{why}");
        m.alive("kafka");
        m.alive("log");
        assert!(m.alive_at(Instant::now() + Duration::from_secs(59)).is_ok());
        m.stall_after(None);
        assert!(m.alive_at(later + Duration::from_secs(3600)).is_ok());
    }

    #[test]
    fn outcome_counters_start_at_zero_for_the_topics_a_sample_shows() {
        let m = Metrics::new(&["kafka", "log"]);
        m.routes(vec![
            ("kafka".to_owned(), Topics::only(["orders.*"])),
            ("log".to_owned(), Topics::only(["audit"])),
        ]);
        let row = |metric: &str, label: &str| SampleRow {
            metric: metric.to_owned(),
            label: label.to_owned(),
            state: "available".to_owned(),
            value: 3.0,
        };
        m.apply_sample(Ok(&[
            row("depth", "orders.new"),
            row("dead", "audit"),
            row("depth", "other"),
        ]));
        let text = m.render();
        for series in [
            r#"postbox_messages_delivered_total{sink="kafka",topic="orders.new"} 0"#,
            r#"postbox_messages_retried_total{sink="kafka",topic="orders.new"} 0"#,
            r#"postbox_messages_dead_lettered_total{sink="log",topic="audit"} 0"#,
        ] {
            assert!(text.contains(series), "{series} missing:\n{text}");
        }
        assert!(!text.contains(r#"sink="log",topic="orders.new""#), "{text}");
        assert!(
            text.contains(r#"postbox_oldest_pending_age_seconds{topic="orders.new"} 0"#),
            "{text}"
        );
        // A topic no route serves gets no counters.
        assert!(
            !text
                .lines()
                .any(|l| l.contains("_total{") && l.contains(r#"topic="other""#)),
            "{text}"
        );
    }

    #[test]
    fn paused_topics_read_1_and_the_others_0() {
        let m = Metrics::new(&["log"]);
        let row = |label: &str| SampleRow {
            metric: "depth".to_owned(),
            label: label.to_owned(),
            state: "available".to_owned(),
            value: 1.0,
        };
        m.apply_pauses(
            &["emails.*".to_owned(), "later".to_owned()],
            &[row("emails.welcome"), row("orders")],
        );
        let text = m.render();
        for series in [
            r#"postbox_topic_paused{topic="emails.welcome"} 1"#,
            r#"postbox_topic_paused{topic="orders"} 0"#,
            r#"postbox_topic_paused{topic="later"} 1"#,
        ] {
            assert!(text.contains(series), "{series} missing:\n{text}");
        }
    }

    #[test]
    fn a_sink_that_is_down_does_not_make_the_pod_unready() {
        let m = Metrics::new(&["kafka"]);
        m.database_ok.store(true, Ordering::Release);
        m.sink_up("kafka", false);
        assert!(m.ready().is_ok());
        m.database_ok.store(false, Ordering::Release);
        assert!(m.ready().is_err());
    }

    /// With 10,000 topics a scrape stays under 2,000 series: the 50 largest topics have series
    /// of their own, every other one counts under `(other)`, and the sums stay exact.
    #[test]
    fn ten_thousand_topics_make_a_bounded_scrape_with_exact_sums() {
        let m = Metrics::new(&["log"]);
        m.routes(vec![("log".to_owned(), Topics::all())]);
        let row = |metric: &str, label: String, state: &str, value: f64| SampleRow {
            metric: metric.to_owned(),
            label,
            state: state.to_owned(),
            value,
        };
        // Topic i holds i + 1 available messages, and 1 dead letter.
        let mut rows = Vec::new();
        for i in 0..10_000 {
            rows.push(row("depth", format!("t.{i}"), "available", (i + 1) as f64));
            rows.push(row("oldest_available", format!("t.{i}"), "", i as f64));
            rows.push(row("dead", format!("t.{i}"), "", 1.0));
        }
        m.apply_sample(Ok(&rows));
        m.apply_pauses(&["t.1*".to_owned()], &rows);
        for i in 0..10_000 {
            m.settled(
                &format!("t.{i}"),
                "log",
                Settlement::Delivered,
                Duration::from_millis(5),
            );
        }
        let text = m.render();
        let series = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .count();
        assert!(series <= 2_000, "{series} series");
        let sum = |prefix: &str| -> f64 {
            text.lines()
                .filter(|l| l.starts_with(prefix))
                .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
                .sum()
        };
        assert_eq!(
            sum("postbox_queue_depth{"),
            (1..=10_000).sum::<i64>() as f64
        );
        assert_eq!(sum("postbox_dead_letters{"), 10_000.0);
        assert_eq!(sum("postbox_messages_delivered_total{"), 10_000.0);
        // The largest are named, the small ones are not; the oldest wait is the largest of all.
        assert!(text.contains(r#"postbox_queue_depth{state="available",topic="t.9999"} 10000"#));
        assert!(!text.contains(r#"topic="t.5""#), "{text}");
        assert!(text.contains(r#"postbox_oldest_pending_age_seconds{topic="(other)"} 9949"#));
        assert!(text.contains(r#"postbox_topic_paused{topic="(other)"} 1"#));
        assert_eq!(m.max_topics(), DEFAULT_MAX_TOPICS);
    }
}
