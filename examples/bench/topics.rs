//! `--only topics`: what many topics cost (issue: a claim must not cost O(topics)).
//!
//! 100,000 messages spread evenly over N topics (`topics.0` … `topics.N-1`, analyzed), drained by
//! one engine as the relay runs a route: batch 100, a sink that takes the glob `topics.*` and
//! delivers at once. The drain rate over N topics is given over that of one topic measured in
//! the same run (`drain_ratio_topics_N`). The engine reports to the relay's metrics; after the
//! drain at the most topics, a sample is applied and the series of one scrape are counted
//! (`metrics_series_topics_N`), with the scrape's size.

use std::time::Instant;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use postbox::engine::{Engine, EngineConfig};
use postbox::sink::{Outcome, Sink, Unavailable};
use postbox::{ClaimedMessage, Topics};
use tokio_util::sync::CancellationToken;

const MESSAGES: usize = 100_000;

/// Delivers everything of its topics at once.
struct Noop(Topics);

impl Sink for Noop {
    fn name(&self) -> &str {
        "log"
    }
    fn topics(&self) -> Topics {
        self.0.clone()
    }
    fn deliver(
        &self,
        batch: Vec<ClaimedMessage>,
    ) -> BoxFuture<'_, Result<Vec<Outcome>, Unavailable>> {
        async move { Ok(vec![Outcome::Delivered; batch.len()]) }.boxed()
    }
}

/// Drains the table; msg/s.
async fn drain(url: &str, metrics: Option<std::sync::Arc<postbox::metrics::Metrics>>) -> f64 {
    let mut builder = Engine::builder(url)
        .sink(Noop(Topics::only(["topics.*"])))
        .config(EngineConfig {
            batch_size: 100,
            drain: true,
            ..Default::default()
        })
        .listen(false);
    if let Some(m) = metrics {
        builder = builder.observer(m);
    }
    let engine = builder.build().await.unwrap();
    let t = Instant::now();
    let report = engine.run(CancellationToken::new()).await.unwrap();
    assert_eq!(report.delivered as usize, MESSAGES, "{report:?}");
    MESSAGES as f64 / t.elapsed().as_secs_f64()
}

fn fill(url: &str, topics: usize) {
    super::reset(url);
    super::backlog::exec(
        url,
        &format!(
            "INSERT INTO postbox.messages (topic) SELECT 'topics.' || (g % {topics}) FROM generate_series(1, {MESSAGES}) g"
        ),
    );
    // VACUUM cannot run inside the transaction a multi-statement string makes.
    super::backlog::exec(url, "VACUUM ANALYZE postbox.messages");
}

pub async fn run(url: &str) {
    let mut rates = Vec::new();
    for topics in [1, 2_000, 10_000] {
        fill(url, topics);
        let metrics = (topics == 10_000).then(|| postbox::metrics::Metrics::new(&["log"]));
        let rate = drain(url, metrics.clone()).await;
        println!("drain {MESSAGES} over {topics} topics: {rate:.0} msg/s");
        rates.push((topics, rate));
        if let Some(m) = metrics {
            // The depth series come from a sample of a table with every topic in it.
            fill(url, topics);
            let store = postbox::Store::connect(url, 2).await.unwrap();
            let rows = store
                .sample(std::time::Duration::from_secs(15))
                .await
                .unwrap();
            m.apply_sample(Ok(&rows));
            let scrape = m.render();
            let series = scrape
                .lines()
                .filter(|l| !l.starts_with('#') && !l.is_empty())
                .count();
            println!("metrics_series_topics_{topics}={series}");
            println!("metrics_scrape_bytes_topics_{topics}={}", scrape.len());
            super::reset(url);
        }
    }
    let one = rates[0].1;
    for (topics, rate) in &rates[1..] {
        println!("drain_ratio_topics_{topics}={:.2}", rate / one);
    }
}
