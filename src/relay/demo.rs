//! `postbox demo`: sample orders written in transactions, relayed to the log sink, summarised.

use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel_async::{AsyncConnection, SimpleAsyncConnection};
use tokio_util::sync::CancellationToken;

use super::{Result, migrate};
use crate::config::Settings;
use crate::engine::{Engine, Observer, Settlement};
use crate::metrics::Metrics;
use crate::sink::log::LogSink;
use crate::store::{Store, Topics};
use crate::{Error, Message};

/// Records end-to-end latencies (and passes everything to the metrics).
struct Latencies {
    inner: Arc<Metrics>,
    seconds: std::sync::Mutex<Vec<f64>>,
}

impl Observer for Latencies {
    fn claimed(&self, n: usize) {
        self.inner.claimed(n);
    }
    fn settled(&self, topic: &str, sink: &str, what: Settlement, age: Duration) {
        if what == Settlement::Delivered {
            self.seconds
                .lock()
                .expect("latency lock")
                .push(age.as_secs_f64());
        }
        self.inner.settled(topic, sink, what, age);
    }
    fn delivery(&self, sink: &str, n: usize, elapsed: Duration) {
        self.inner.delivery(sink, n, elapsed);
    }
}

/// What `demo` did.
#[derive(Debug, Clone, PartialEq)]
pub struct DemoSummary {
    /// Orders written, each in a transaction with its message.
    pub orders: usize,
    /// Messages the relay delivered.
    pub messages: u64,
    /// From the first write to the last delivery.
    pub seconds: f64,
    /// End-to-end latency (commit to delivery), median.
    pub p50_ms: f64,
    /// End-to-end latency, 99th percentile.
    pub p99_ms: f64,
}

/// Migrates, writes `orders` sample orders (each a business row and its message in one
/// transaction, 4 writers) while a relay with the log sink runs, waits until every message is
/// delivered, and summarises.
pub async fn demo(settings: Settings, orders: usize) -> Result<DemoSummary> {
    migrate(&settings).await?;
    let url = settings.database_url.clone();
    {
        let mut conn = crate::store::connect::open(&url)
            .await
            .map_err(|e| anyhow::anyhow!("connect: {e}"))?;
        conn.batch_execute(
            "CREATE TABLE IF NOT EXISTS demo_orders (id bigserial PRIMARY KEY, customer text NOT NULL,
                 total_cents bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now())",
        )
        .await
        .map_err(|e| anyhow::anyhow!("create demo_orders: {e}"))?;
    }
    let store = Store::connect(&url, crate::engine::DEFAULT_POOL_SIZE).await?;
    let metrics = Metrics::new(&["log"]);
    let observer = Arc::new(Latencies {
        inner: metrics,
        seconds: Default::default(),
    });
    let sink = Arc::new(LogSink::new(Topics::only(["demo.*"])));
    let engine = Engine::builder(&url)
        .store(store)
        .sink_arc(sink)
        .config(settings.engine.clone())
        .observer(observer.clone())
        .build()
        .await?;
    let counters = engine.counters();
    let shutdown = CancellationToken::new();
    let relay = tokio::spawn(engine.run(shutdown.clone()));

    let started = Instant::now();
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let url = url.clone();
            tokio::spawn(async move {
                let mut conn = crate::store::connect::open(&url).await?;
                for i in (w..orders).step_by(4) {
                    let customer = format!("customer-{}", i % 97);
                    let total = 500 + (i as i64 * 37) % 20_000;
                    conn.transaction(async |c| {
                        use diesel::sql_types::{BigInt, Text};
                        use diesel_async::RunQueryDsl;
                        #[derive(diesel::QueryableByName)]
                        struct Id {
                            #[diesel(sql_type = BigInt)]
                            id: i64,
                        }
                        let order: Id = diesel::sql_query("INSERT INTO demo_orders (customer, total_cents) VALUES ($1, $2) RETURNING id")
                            .bind::<Text, _>(&customer)
                            .bind::<BigInt, _>(total)
                            .get_result(c)
                            .await?;
                        let msg = Message::new("demo.order.created")
                            .key(&customer)
                            .ordered()
                            .header("source", "postbox demo")
                            .payload(&serde_json::json!({"order_id": order.id, "customer": customer, "total_cents": total}));
                        crate::enqueue_async(c, &msg).await?;
                        Ok::<_, Error>(())
                    })
                    .await?;
                }
                Ok::<_, anyhow::Error>(())
            })
        })
        .collect();
    for w in writers {
        w.await.map_err(|e| anyhow::anyhow!("writer: {e}"))??;
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while counters.snapshot().delivered < orders as u64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    shutdown.cancel();
    let report = relay.await.map_err(|e| anyhow::anyhow!("relay: {e}"))??;
    let mut lat = observer.seconds.lock().expect("latency lock").clone();
    lat.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        lat.get(((lat.len() as f64 - 1.0) * p).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
            * 1000.0
    };
    Ok(DemoSummary {
        orders,
        messages: report.delivered,
        seconds,
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
    })
}
