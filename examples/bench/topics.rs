//! `--only topics`: what many topics and large payloads cost.
//!
//! 100,000 messages spread evenly over N topics (`topics.0` … `topics.N-1`, analyzed), drained by
//! one engine as the relay runs a route: batch 100, a sink that takes the glob `topics.*` and
//! delivers at once. The drain rate over N topics is given over that of one topic measured in
//! the same run (`drain_ratio_topics_N`); so is a route of every topic (`*`), and one that takes
//! the glob `hot.*` of 5 topics among 10,000 with as many messages (`drain_ratio_glob_5_of_10000`).
//! The engine reports to the relay's metrics; after the drain at the most topics, a sample is
//! applied and the series of one scrape are counted (`metrics_series_topics_N`), with the
//! scrape's size. Last, the relay binary (`target/release/postbox`, built beside this bench)
//! drains 2,000 messages of 500 KB with batch 500 under the default payload budget and without
//! one, and a sampler of `/proc` reads its peak RSS (`rss_mb_large_payloads`), against the
//! relay's RSS draining 2,000 small messages (`rss_mb_base`).

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

/// Drains what `route` takes (`MESSAGES` of them); msg/s.
async fn drain(
    url: &str,
    route: &str,
    metrics: Option<std::sync::Arc<postbox::metrics::Metrics>>,
) -> f64 {
    let mut builder = Engine::builder(url)
        .sink(Noop(Topics::only([route])))
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
    fill_with(
        url,
        &format!(
            "INSERT INTO postbox.messages (topic) SELECT 'topics.' || (g % {topics}) FROM generate_series(1, {MESSAGES}) g"
        ),
    );
}

fn fill_with(url: &str, sql: &str) {
    super::reset(url);
    super::backlog::exec(url, sql);
    // VACUUM cannot run inside the transaction a multi-statement string makes.
    super::backlog::exec(url, "VACUUM ANALYZE postbox.messages");
}

pub async fn run(url: &str) {
    let mut rates = Vec::new();
    for topics in [1, 2_000, 10_000] {
        fill(url, topics);
        let metrics = (topics == 10_000).then(|| postbox::metrics::Metrics::new(&["log"]));
        let rate = drain(url, "topics.*", metrics.clone()).await;
        println!("drain {MESSAGES} over {topics} topics (route topics.*): {rate:.0} msg/s");
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
    // Every topic, and a narrow glob among thousands, against the one-topic drain above.
    fill(url, 10_000);
    let every = drain(url, "*", None).await;
    println!("drain {MESSAGES} over 10000 topics (route *): {every:.0} msg/s");
    println!("drain_ratio_every_topic_10000={:.2}", every / one);
    fill_with(url, &format!(
        "INSERT INTO postbox.messages (topic) SELECT CASE WHEN g % 2 = 0 THEN 'hot.' || (g % 5) ELSE 'cold.' || (g % 9995) END
         FROM generate_series(1, {}) g", 2 * MESSAGES
    ));
    let glob = drain(url, "hot.*", None).await;
    println!("drain {MESSAGES} of 5 topics among 10000 (route hot.*): {glob:.0} msg/s");
    println!("drain_ratio_glob_5_of_10000={:.2}", glob / one);
    super::reset(url);
    large_payloads(url);
}

/// Peak RSS (MB) of `postbox run --drain` with `config`, sampled from `/proc` every 10 ms.
fn relay_peak_rss(url: &str, config: &str) -> f64 {
    use std::io::Write;
    let bin = std::env::current_exe()
        .unwrap()
        .parent()
        .and_then(|examples| examples.parent())
        .map(|release| release.join("postbox"))
        .filter(|p| p.exists())
        .expect("the relay binary next to the bench (cargo build --release)");
    let path = std::env::temp_dir().join(format!("postbox-bench-{}.toml", std::process::id()));
    let mut f = std::fs::File::create(&path).unwrap();
    writeln!(f, "database_url = {url:?}\n{config}").unwrap();
    let mut child = std::process::Command::new(bin)
        .args(["--config", path.to_str().unwrap(), "run", "--drain"])
        .env("POSTBOX_METRICS_LISTEN", "127.0.0.1:0")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let status = format!("/proc/{}/status", child.id());
    let mut peak_kb = 0u64;
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        if let Ok(s) = std::fs::read_to_string(&status) {
            for line in s.lines() {
                if let Some(v) = line.strip_prefix("VmHWM:") {
                    let kb: u64 = v.trim().trim_end_matches(" kB").trim().parse().unwrap_or(0);
                    peak_kb = peak_kb.max(kb);
                }
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let _ = std::fs::remove_file(&path);
    peak_kb as f64 / 1024.0
}

/// 2,000 messages of 500 KB, batch 500: the relay's peak RSS with the default payload budget and
/// without one, and its RSS draining 2,000 small messages.
fn large_payloads(url: &str) {
    let fill = |bytes: usize| {
        fill_with(
            url,
            &format!(
                "INSERT INTO postbox.messages (topic, payload)
             SELECT 'large', jsonb_build_object('blob', repeat(md5(g::text), {}))
             FROM generate_series(1, 2000) g",
                bytes / 32
            ),
        );
    };
    let budget_mb = postbox::engine::DEFAULT_PAYLOAD_BUDGET >> 20;
    fill(32);
    let base = relay_peak_rss(url, "[relay]\nbatch_size = 500\n");
    fill(500_000);
    let budgeted = relay_peak_rss(url, "[relay]\nbatch_size = 500\n");
    fill(500_000);
    let unbounded = relay_peak_rss(url, "[relay]\nbatch_size = 500\npayload_budget = 0\n");
    super::reset(url);
    println!("rss_mb_base={base:.0}");
    println!(
        "rss_mb_large_payloads={budgeted:.0} (payload_budget {budget_mb} MiB; 2,000 x 500 KB, batch 500)"
    );
    println!("rss_mb_large_payloads_no_budget={unbounded:.0}");
}
