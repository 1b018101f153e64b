//! `--only stream`: stream mode against the table, on one server with `wal_level = logical`
//! (`--database-url` must point at such a server; its database is set up for stream mode).
//!
//! - `publish_tx_ratio` next to `enqueue_tx_ratio`: 8 writers for 8 s, each transaction a
//!   business row plus one message (nothing consuming), against the business row alone.
//! - `stream_vs_decode`: the streamer (to a sink that formats each message as the log sink does
//!   and writes it to /dev/null) against `pg_recvlogical` decoding the same WAL (pgoutput,
//!   messages on) to /dev/null.
//! - `publish_vs_emit_async_commit` and `stream_redelivered_after_kill`: see `stream_bounds`.
//! - with `--kafka-brokers`: `stream_vs_table_kafka`, the same messages to Kafka from the stream
//!   and from the table; and commit → Kafka acknowledgement latency at 500 msg/s, both ways.

use std::io::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection};
use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use postbox::engine::{Engine, EngineConfig};
use postbox::sink::{Outcome, Sink, Unavailable};
use postbox::{ClaimedMessage, Message, Topics};
use tokio_util::sync::CancellationToken;

use super::{median, percentile, reset, writers_with};

const SLOT: &str = "postbox";

/// Formats each message as the log sink does and writes it to /dev/null.
struct DevNull(Mutex<std::fs::File>);

impl Sink for DevNull {
    fn name(&self) -> &str {
        "devnull"
    }
    fn topics(&self) -> Topics {
        Topics::all()
    }
    fn deliver(
        &self,
        batch: Vec<ClaimedMessage>,
    ) -> BoxFuture<'_, Result<Vec<Outcome>, Unavailable>> {
        async move {
            let mut text = String::with_capacity(batch.len() * 300);
            for m in &batch {
                text.push_str(&postbox::sink::log::line(m));
                text.push('\n');
            }
            self.0.lock().unwrap().write_all(text.as_bytes()).unwrap();
            Ok(vec![Outcome::Delivered; batch.len()])
        }
        .boxed()
    }
}

/// A sink that delivers through `inner` and records, for each message, commit → acknowledged.
struct Timed {
    inner: Arc<dyn Sink>,
    ms: Arc<Mutex<Vec<f64>>>,
}

impl Sink for Timed {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn topics(&self) -> Topics {
        self.inner.topics()
    }
    fn max_batch(&self) -> usize {
        self.inner.max_batch()
    }
    fn deliver(
        &self,
        batch: Vec<ClaimedMessage>,
    ) -> BoxFuture<'_, Result<Vec<Outcome>, Unavailable>> {
        async move {
            let created: Vec<_> = batch.iter().map(|m| m.created_at).collect();
            let out = self.inner.deliver(batch).await?;
            let now = chrono::Utc::now();
            let mut ms = self.ms.lock().unwrap();
            for (o, c) in out.iter().zip(created) {
                if *o == Outcome::Delivered {
                    ms.push((now - c).num_microseconds().unwrap_or_default() as f64 / 1000.0);
                }
            }
            Ok(out)
        }
        .boxed()
    }
}

fn lsn(conn: &mut PgConnection, sql: &str) -> i64 {
    #[derive(diesel::QueryableByName)]
    struct L {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        v: i64,
    }
    use diesel::RunQueryDsl;
    diesel::sql_query(sql).get_result::<L>(conn).unwrap().v
}

fn current(conn: &mut PgConnection) -> i64 {
    lsn(conn, "SELECT (pg_current_wal_lsn() - '0/0')::bigint AS v")
}

fn confirmed(conn: &mut PgConnection, slot: &str) -> i64 {
    lsn(
        conn,
        &format!(
            "SELECT coalesce((confirmed_flush_lsn - '0/0')::bigint, 0) AS v FROM pg_replication_slots WHERE slot_name = '{slot}'"
        ),
    )
}

async fn streamer(
    url: &str,
    sink: Arc<dyn Sink>,
) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let store = postbox::Store::connect(url, 4).await.unwrap();
    let s = postbox::stream::Streamer {
        url: url.to_owned(),
        config: postbox::stream::StreamConfig {
            status_interval: Duration::from_millis(100),
            create_slot: false,
            batch_size: std::env::var("BENCH_STREAM_BATCH")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(postbox::stream::StreamConfig::default().batch_size),
            ..Default::default()
        },
        sinks: vec![sink],
        store,
        observer: None,
    };
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move {
            s.run(stop).await.unwrap();
        }
    });
    (stop, task)
}

/// Publishes `n` messages of ~230 bytes over 100 keys, 100 a transaction.
pub(super) fn publish_events(url: &str, n: usize) {
    let mut conn = PgConnection::establish(url).unwrap();
    for chunk in (0..n).collect::<Vec<_>>().chunks(100) {
        let msgs: Vec<Message> = chunk
            .iter()
            .map(|i| {
                Message::new("bench")
                    .key(format!("k{}", i % 100))
                    .payload(&serde_json::json!({"n": i, "body": "x".repeat(200)}))
            })
            .collect();
        conn.transaction(|c| postbox::publish_many(c, &msgs))
            .unwrap();
    }
}

/// Waits until `slot` confirmed `end`; the seconds since `t`.
async fn until_confirmed(url: &str, slot: &str, end: i64, t: Instant) -> f64 {
    let mut conn = PgConnection::establish(url).unwrap();
    while confirmed(&mut conn, slot) < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    t.elapsed().as_secs_f64()
}

/// Moves the bench's slot past everything written so far, its restart point too (a checkpoint
/// logs the running transactions that lets it move): each run then decodes its own messages only,
/// as `pg_recvlogical` does with a slot made for its run.
pub(super) fn skip_to_now(url: &str) {
    PgConnection::establish(url)
        .unwrap()
        .batch_execute(&format!(
            "CHECKPOINT; SELECT pg_replication_slot_advance('{SLOT}', pg_current_wal_lsn());
             -- Moved by hand, on purpose: the relay's record starts again from here.
             UPDATE postbox.stream_slots SET confirm_limit = NULL, confirmed_before = NULL,
                 gap_from = NULL, gap_to = NULL, gap_found_at = NULL WHERE slot_name = '{SLOT}'"
        ))
        .unwrap();
}

/// The streamer over `n` published messages to `sink`: msg/s from its start to the confirmed end.
async fn stream_rate(url: &str, n: usize, sink: Arc<dyn Sink>) -> f64 {
    // The slot starts at the server's position: what was published before (for pg_recvlogical's
    // run, or the writers) is not part of this run's figure.
    skip_to_now(url);
    publish_events(url, n);
    let end = current(&mut PgConnection::establish(url).unwrap());
    let t = Instant::now();
    let (stop, task) = streamer(url, sink).await;
    let secs = until_confirmed(url, SLOT, end, t).await;
    stop.cancel();
    task.await.unwrap();
    n as f64 / secs
}

/// pg_recvlogical decoding the WAL of `n` published messages through its own slot: msg/s.
fn decode_rate(url: &str, n: usize) -> f64 {
    let mut conn = PgConnection::establish(url).unwrap();
    let _ = conn.batch_execute("SELECT pg_drop_replication_slot('bench_raw')");
    conn.batch_execute("SELECT pg_create_logical_replication_slot('bench_raw', 'pgoutput')")
        .unwrap();
    publish_events(url, n);
    let end = current(&mut conn);
    let endpos = format!("{:X}/{:X}", end >> 32, end & 0xffff_ffff);
    let t = Instant::now();
    let status = std::process::Command::new("pg_recvlogical")
        .args([
            "-d",
            url,
            "-S",
            "bench_raw",
            "--start",
            "--no-loop",
            "-E",
            &endpos,
            "-f",
            "/dev/null",
            "-o",
            "proto_version=1",
            "-o",
            "publication_names=postbox_stream",
            "-o",
            "messages=true",
        ])
        .status()
        .expect("pg_recvlogical (PostgreSQL's client tools)");
    assert!(status.success());
    let secs = t.elapsed().as_secs_f64();
    conn.batch_execute("SELECT pg_drop_replication_slot('bench_raw')")
        .unwrap();
    n as f64 / secs
}

/// One message through the path, waited for, then forgotten: the producer's first request after
/// it sat idle waits for its connection again (about a second here), for the table as for the
/// stream, and is not what is measured.
async fn warm(url: &str, publish: bool, ms: &Arc<Mutex<Vec<f64>>>) {
    let mut conn = PgConnection::establish(url).unwrap();
    let m = Message::new("bench").payload(&serde_json::json!({"warm": true}));
    if publish {
        postbox::publish(&mut conn, &m).unwrap();
    } else {
        postbox::enqueue(&mut conn, &m).unwrap();
    }
    while ms.lock().unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    ms.lock().unwrap().clear();
}

/// Publishes (or enqueues) one message a transaction at `rate` a second for `secs`.
async fn paced(url: &str, publish: bool, rate: u64, secs: u64) {
    let mut conn = PgConnection::establish(url).unwrap();
    let every = Duration::from_secs_f64(1.0 / rate as f64);
    let start = Instant::now();
    let mut next = start;
    let mut i = 0;
    while start.elapsed() < Duration::from_secs(secs) {
        let m = Message::new("bench")
            .key(format!("k{}", i % 100))
            .payload(&serde_json::json!({"n": i}));
        if publish {
            postbox::publish(&mut conn, &m).unwrap();
        } else {
            postbox::enqueue(&mut conn, &m).unwrap();
        }
        i += 1;
        next += every;
        if let Some(d) = next.checked_duration_since(Instant::now()) {
            tokio::time::sleep(d).await;
        }
    }
}

pub async fn run(url: &str, kafka: Option<&str>, n: usize) {
    reset(url);
    let store = postbox::Store::connect(url, 2).await.unwrap();
    if let Err(e) = store.stream_setup(SLOT, "postbox_stream").await {
        panic!(
            "--only stream needs a server with wal_level = logical and a role with REPLICATION: {e}"
        );
    }
    // Writers: the business row alone, with enqueue, with publish (alternating, two rounds).
    let (mut plain, mut enqueue, mut publish) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..2 {
        reset(url);
        plain.push(writers_with(url, None, 8).await);
        reset(url);
        enqueue.push(writers_with(url, Some(false), 8).await);
        reset(url);
        publish.push(writers_with(url, Some(true), 8).await);
    }
    // Whatever the writers published is read past (the slot would otherwise keep it).
    let end = current(&mut PgConnection::establish(url).unwrap());
    let (stop, task) = streamer(
        url,
        Arc::new(DevNull(Mutex::new(
            std::fs::File::create("/dev/null").unwrap(),
        ))),
    )
    .await;
    until_confirmed(url, SLOT, end, Instant::now()).await;
    stop.cancel();
    task.await.unwrap();
    println!(
        "stream: 8 writers, 8 s a run: business row only {plain:.0?} tx/s; + enqueue {enqueue:.0?} tx/s; + publish {publish:.0?} tx/s"
    );
    let (mut streamed, mut decoded) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let sink = Arc::new(DevNull(Mutex::new(
            std::fs::File::create("/dev/null").unwrap(),
        )));
        streamed.push(stream_rate(url, n, sink).await);
        decoded.push(decode_rate(url, n));
    }
    println!(
        "stream: {n} messages (~230-byte JSON, 100 a transaction): streamer to a log-format sink {streamed:.0?} msg/s; pg_recvlogical to /dev/null {decoded:.0?} msg/s"
    );
    println!("publish_tx_ratio={:.2}", median(&publish) / median(&plain));
    println!("enqueue_tx_ratio={:.2}", median(&enqueue) / median(&plain));
    println!(
        "stream_vs_decode={:.2}",
        median(&streamed) / median(&decoded)
    );
    super::stream_bounds::publish_vs_emit(url);
    super::stream_bounds::redelivered_after_kill(url, n);
    let Some(brokers) = kafka else { return };
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    let _ = admin
        .create_topics(
            &[NewTopic::new("bench", 3, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await;
    let producer = postbox::sink::kafka::producer(brokers, &Default::default()).unwrap();
    let kafka_sink = || -> Arc<dyn Sink> {
        Arc::new(postbox::sink::kafka::KafkaSink::new(
            producer.clone(),
            Topics::all(),
            Default::default(),
        ))
    };
    // Warm the producer up (its first delivery waits for a producer id).
    super::fill_events(url, 100).await;
    super::kafka_relay(url, &producer, None).await;
    let (mut from_stream, mut from_table) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        reset(url);
        from_stream.push(stream_rate(url, n, kafka_sink()).await);
        reset(url);
        super::fill_events(url, n).await;
        from_table.push(super::kafka_relay(url, &producer, None).await);
    }
    println!(
        "stream: {n} messages to Kafka (3 partitions): from the stream {from_stream:.0?} msg/s; from the table (batch 1000, 4 in flight) {from_table:.0?} msg/s"
    );
    let ceiling: Vec<f64> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(super::kafka_raw(brokers, n).await);
        }
        v
    };
    println!(
        "stream: the broker's ceiling here (a producer alone, the same records from memory): {ceiling:.0?} msg/s"
    );
    println!(
        "stream_vs_table_kafka={:.2}",
        median(&from_stream) / median(&from_table)
    );
    println!(
        "stream_kafka_vs_ceiling={:.2}",
        median(&from_stream) / median(&ceiling)
    );
    // Commit → Kafka acknowledgement at 500 msg/s for 5 s, both ways.
    reset(url);
    skip_to_now(url);
    let ms: Arc<Mutex<Vec<f64>>> = Arc::default();
    let (stop, task) = streamer(
        url,
        Arc::new(Timed {
            inner: if std::env::var_os("BENCH_STREAM_DEVNULL").is_some() {
                Arc::new(DevNull(Mutex::new(
                    std::fs::File::create("/dev/null").unwrap(),
                )))
            } else {
                kafka_sink()
            },
            ms: ms.clone(),
        }),
    )
    .await;
    warm(url, true, &ms).await;
    paced(url, true, 500, 5).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.cancel();
    task.await.unwrap();
    let mut stream_ms = ms.lock().unwrap().clone();
    if std::env::var_os("BENCH_STREAM_DEBUG").is_some() {
        let slow: Vec<(usize, f64)> = stream_ms
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, m)| *m > 100.0)
            .collect();
        eprintln!("slow deliveries (index, ms): {slow:?}");
    }
    stream_ms.sort_by(f64::total_cmp);
    reset(url);
    let tms: Arc<Mutex<Vec<f64>>> = Arc::default();
    let engine = Engine::builder(url)
        .sink_arc(Arc::new(Timed {
            inner: kafka_sink(),
            ms: tms.clone(),
        }))
        .config(EngineConfig {
            batch_size: 1000,
            concurrency: 4,
            ..Default::default()
        })
        .build()
        .await
        .unwrap();
    let shutdown = CancellationToken::new();
    let t = tokio::spawn(engine.run(shutdown.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    warm(url, false, &tms).await;
    paced(url, false, 500, 5).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    shutdown.cancel();
    t.await.unwrap().unwrap();
    let mut table_ms = tms.lock().unwrap().clone();
    table_ms.sort_by(f64::total_cmp);
    println!(
        "stream: commit → Kafka ack at 500 msg/s for 5 s (after one warm-up message): stream p50 {:.1} ms, p99 {:.1} ms ({} messages); table p50 {:.1} ms, p99 {:.1} ms ({} messages)",
        percentile(&stream_ms, 0.5),
        percentile(&stream_ms, 0.99),
        stream_ms.len(),
        percentile(&table_ms, 0.5),
        percentile(&table_ms, 0.99),
        table_ms.len()
    );
    println!(
        "stream_kafka_latency_p50_ms={:.1}",
        percentile(&stream_ms, 0.5)
    );
    println!(
        "stream_kafka_latency_p99_ms={:.1}",
        percentile(&stream_ms, 0.99)
    );
    println!(
        "table_kafka_latency_p50_ms={:.1}",
        percentile(&table_ms, 0.5)
    );
    println!(
        "table_kafka_latency_p99_ms={:.1}",
        percentile(&table_ms, 0.99)
    );
}
