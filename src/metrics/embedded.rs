//! An embedded engine's metrics on the app's own Prometheus registry: the same series as the
//! relay's, so the shipped dashboard and alerts work for an app that runs the engine itself.

use std::sync::Arc;
use std::time::Duration;

use prometheus::Registry;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use tokio_util::sync::CancellationToken;

use super::Metrics;
use crate::error::{Error, Result};
use crate::store::Store;

/// How often an embedded engine's metrics sample the database (the relay's
/// `metrics.sample_interval` default).
pub const SAMPLE_INTERVAL: Duration = Duration::from_secs(5);

/// postbox's metrics as one collector of the app's registry.
struct OnRegistry {
    metrics: Arc<Metrics>,
    desc: Desc,
}

impl Collector for OnRegistry {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.metrics.gather()
    }
}

impl Metrics {
    /// postbox's metrics, registered on `registry` (the app's) as one collector: the same series
    /// as the relay's (sink `handlers`), so the shipped Grafana dashboard and Prometheus alerts
    /// apply as they are. [`EngineBuilder::metrics`] does this and samples the database's gauges
    /// while the engine runs; call this for engines that share one set
    /// ([`EngineBuilder::observer`] with the value returned). A second call on one registry is an
    /// error.
    ///
    /// [`EngineBuilder::metrics`]: crate::engine::EngineBuilder::metrics
    /// [`EngineBuilder::observer`]: crate::engine::EngineBuilder::observer
    pub fn register_on(registry: &Registry) -> Result<Arc<Metrics>> {
        let metrics = Metrics::new(&["handlers"]);
        let refused = |e: prometheus::Error| Error::InvalidArgument {
            field: "metrics",
            problem: format!("postbox's metrics cannot be registered: {e}"),
        };
        let desc = Desc::new(
            "postbox_metrics".into(),
            "postbox's metrics (an embedded engine's)".into(),
            Vec::new(),
            Default::default(),
        )
        .map_err(refused)?;
        registry
            .register(Box::new(OnRegistry {
                metrics: metrics.clone(),
                desc,
            }))
            .map_err(refused)?;
        Ok(metrics)
    }
}

/// Sets the database's gauges from one sampling query every `every` until `stop`: queue depth
/// and age per topic and state, dead letters, stalled keys, table health and the oldest
/// transaction; with `limits`, each limit's running count; with `retention`, what is kept; with
/// `stream`, the stream slots. What the relay runs beside its engines, and an embedded engine
/// built with [`EngineBuilder::metrics`](crate::engine::EngineBuilder::metrics).
pub async fn sample(
    store: Store,
    metrics: Arc<Metrics>,
    every: Duration,
    limits: Vec<crate::store::Limit>,
    retention: bool,
    stream: bool,
    stop: CancellationToken,
) {
    let mut wait = Duration::ZERO;
    // Between samples: `every`, or longer when computing one took more than its budget (whichever
    // relay computed it: the others then take no turn sooner either).
    let mut period = every;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.cancelled() => return,
        }
        let began = std::time::Instant::now();
        match store.sample(period).await {
            Ok(rows) => {
                let took = rows
                    .iter()
                    .find(|r| r.metric == "sample_seconds")
                    .and_then(|r| Duration::try_from_secs_f64(r.value).ok());
                let stretched = sample_period(every, took.unwrap_or_default());
                if stretched > every && stretched > period {
                    tracing::warn!(
                        took_ms = took.unwrap_or_default().as_millis() as u64,
                        every_ms = stretched.as_millis() as u64,
                        "the database sample is slow (a bloated table, a pinned xmin horizon?): sampling less often"
                    );
                }
                period = stretched;
                metrics.apply_sample(Ok(&rows));
                if let Ok(paused) = store.paused().await {
                    metrics.apply_pauses(&paused, &rows);
                }
                for l in &limits {
                    if let Ok(n) = store.limit_running(l).await {
                        metrics.limit(l, n);
                    }
                }
                match store.check(crate::engine::REPAIR_BATCH).await {
                    Ok(found) => metrics.invariants(&found),
                    Err(e) => tracing::warn!(error = %e, "invariant check failed"),
                }
                if retention && let Ok((n, _)) = store.completed_kept().await {
                    metrics.completed_kept(n);
                }
                if stream && let Ok(slots) = store.stream_status(None).await {
                    metrics.stream_slots(&slots);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "database sample failed");
                metrics.apply_sample(Err(()));
            }
        }
        wait = period.saturating_sub(began.elapsed());
    }
}

/// The share of the time computing the sample may take: its queries run beside delivery on the
/// same database, and on a bloated table or under a pinned xmin horizon they grow with what the
/// pin keeps; the samplers then sample less often rather than take more.
pub const SAMPLE_BUDGET: f64 = 0.1;

/// The time between samples, sampling every `every`, when computing the last one took `took`:
/// at least what keeps it within [`SAMPLE_BUDGET`].
pub fn sample_period(every: Duration, took: Duration) -> Duration {
    every.max(took.div_f64(SAMPLE_BUDGET))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_sample_spreads_the_next_out_to_stay_within_its_budget() {
        let every = Duration::from_secs(5);
        assert_eq!(sample_period(every, Duration::from_millis(100)), every);
        assert_eq!(
            sample_period(every, Duration::from_secs(1)),
            Duration::from_secs(10)
        );
        assert_eq!(
            sample_period(every, Duration::from_secs(10)),
            Duration::from_secs(100)
        );
    }
}
