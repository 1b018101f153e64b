//! Throughput and latency of postbox on this machine, with the raw-SQL baselines measured in the
//! same run.
//!
//! cargo run --release --example bench -- --messages N [--database-url URL]
//!
//! 1. enqueue N no-op messages with `enqueue_many` (1,000 a call);
//! 2. drain them with the embedded engine; then the same N with two raw-SQL cycles, batch 100 on
//!    2 connections — the lease cycle (claim `UPDATE … SKIP LOCKED`, then `DELETE`) and the
//!    held-lock cycle (`SELECT … FOR UPDATE SKIP LOCKED` and `DELETE` in one transaction) — the
//!    baselines (three rounds, medians);
//! 3. wake-up latency, commit → handler start, at 500 messages/s for 5 s (and at 20/s, where the
//!    engine is idle between messages and is woken by NOTIFY);
//! 4. 8 writers for 10 s, each transaction one business row plus one message (with an engine
//!    draining them), against the same transactions without the message.
//!
//! 5. `--only backlog` (not part of the default run: it builds tables of millions of rows): claim
//!    latency on backlogs of every shape, the drain rate of ordered against unordered messages,
//!    and the cost of `status` and of the metrics sample at 10M rows; see `backlog.rs`.
//!
//! 7. `--only xmin`: a pinned xmin horizon at a fixed rate, on a cluster of its own with
//!    autovacuum on, per minute (15 minutes by default); see `xmin.rs`.
//!
//! 6. `--only console`: the operator console's pages (overview, messages and dead letters with a
//!    JSON filter) at `--status-rows` rows, p50 and p95; see `console.rs`.
//!
//! The last lines are machine-readable, one figure a line.

mod backlog;
mod console;
mod fresh;
mod stream;
mod stream_bounds;
mod topics;
mod write;
mod xmin;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection};
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use postbox::Message;
use postbox::engine::{Engine, EngineConfig};
use postbox::sink::handlers::{Handlers, Job};
use tokio_util::sync::CancellationToken;

struct Args {
    messages: usize,
    url: String,
    /// Which parts to run: all by default; `--only drain|wakeup|tx|kafka|backlog` for one.
    only: Option<String>,
    /// Claim loops of the draining engine (default: the engine's default).
    claimers: Option<usize>,
    /// Kafka bootstrap servers for `--only kafka` (a topic `bench` is created there).
    kafka: Option<String>,
    /// Rows of each backlog shape for `--only backlog` (default 1,000,000).
    backlog_rows: usize,
    /// Rows for the `status` figure of `--only backlog` (default 10,000,000).
    status_rows: usize,
    /// `--only xmin`: how long the horizon is pinned (default 10 minutes).
    pin_minutes: u64,
    /// `--only xmin`: how many topics the messages go to, each with a handler (default 1).
    xmin_topics: usize,
    /// `--only xmin`: the topics are claimed through one glob (a relay's route `bench.xmin.*`)
    /// instead of a handler each.
    xmin_glob: bool,
    /// `--only xmin`: the offered rate, messages a second (default 800).
    rate: u64,
}

fn args() -> Args {
    let mut a = Args {
        messages: 100_000,
        url: "postgres://postgres@localhost/postbox_bench".into(),
        only: None,
        claimers: None,
        kafka: None,
        backlog_rows: 1_000_000,
        status_rows: 10_000_000,
        pin_minutes: 10,
        xmin_topics: 1,
        xmin_glob: false,
        rate: 800,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--messages" => {
                a.messages = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--messages N")
            }
            "--database-url" => a.url = it.next().expect("--database-url URL"),
            "--only" => a.only = it.next(),
            "--hold-limit" => {
                let ms: u64 = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--hold-limit MS");
                HOLD_LIMIT.set(Duration::from_millis(ms)).unwrap();
            }
            "--kafka-brokers" => a.kafka = it.next(),
            "--claimers" => a.claimers = it.next().and_then(|v| v.parse().ok()),
            "--backlog-rows" => {
                a.backlog_rows = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--backlog-rows N")
            }
            "--pin-minutes" => {
                a.pin_minutes = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--pin-minutes N")
            }
            "--xmin-glob" => a.xmin_glob = true,
            "--rate" => a.rate = it.next().and_then(|v| v.parse().ok()).expect("--rate N"),
            "--xmin-topics" => {
                a.xmin_topics = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--xmin-topics N")
            }
            "--status-rows" => {
                a.status_rows = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--status-rows N")
            }
            other => panic!(
                "unknown argument {other:?}; usage: bench [--messages N] [--database-url URL] [--only drain|wakeup|tx|kafka|backlog|limits|fresh|ordered-drain|topics|stream|console|write|xmin] [--claimers N] [--kafka-brokers HOST:PORT] [--backlog-rows N] [--status-rows N] [--hold-limit MS] [--pin-minutes N] [--rate N] [--xmin-topics N] [--xmin-glob]"
            ),
        }
    }
    a
}

fn ensure_database(url: &str) {
    if PgConnection::establish(url).is_ok() {
        return;
    }
    let (server, name) = url.rsplit_once('/').expect("URL with a database name");
    let mut admin =
        PgConnection::establish(&format!("{server}/postgres")).expect("server reachable");
    admin
        .batch_execute(&format!("CREATE DATABASE \"{name}\""))
        .expect("create database");
}

pub(crate) fn reset(url: &str) {
    let mut c = PgConnection::establish(url).unwrap();
    c.batch_execute(
        "TRUNCATE postbox.messages, postbox.dead_letters, postbox.listeners;
         DROP TABLE IF EXISTS bench_orders;
         CREATE TABLE bench_orders (id bigserial PRIMARY KEY, customer int NOT NULL, total_cents bigint NOT NULL,
                                    created_at timestamptz NOT NULL DEFAULT now());",
    )
    .unwrap();
    c.batch_execute("VACUUM ANALYZE postbox.messages").unwrap();
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

pub(crate) async fn enqueue_noop(url: &str, n: usize) -> f64 {
    let mut conn = AsyncPgConnection::establish(url).await.unwrap();
    let t = Instant::now();
    let mut left = n;
    while left > 0 {
        let k = left.min(1000);
        let msgs: Vec<Message> = (0..k).map(|_| Message::new("bench.noop")).collect();
        postbox::enqueue_many_async(&mut conn, &msgs).await.unwrap();
        left -= k;
    }
    let rate = n as f64 / t.elapsed().as_secs_f64();
    // Both drains start from fresh statistics, as autovacuum would leave them.
    conn.batch_execute("ANALYZE postbox.messages")
        .await
        .unwrap();
    rate
}

/// `--hold-limit MS` for every draining engine (0: the lease cycle alone, as before held batches).
static HOLD_LIMIT: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();

fn hold_limit() -> Duration {
    *HOLD_LIMIT.get_or_init(|| EngineConfig::default().hold_limit)
}

pub(crate) async fn drain_engine(url: &str, n: usize, claimers: Option<usize>) -> f64 {
    drain_topic(url, "bench.noop", n, claimers, None).await
}

/// Drains `n` messages of `topic` with no-op handlers (batch 1000, 2000 at once), keeping the
/// delivered ones if `keep` says so; msg/s.
async fn drain_topic(
    url: &str,
    topic: &str,
    n: usize,
    claimers: Option<usize>,
    keep: Option<Duration>,
) -> f64 {
    let handlers = Handlers::new().on(topic, |_: Job<serde_json::Value>| async { Ok(()) });
    let engine = Engine::builder(url)
        .handlers(handlers)
        .config(EngineConfig {
            concurrency: 2000,
            claimers: claimers.unwrap_or(EngineConfig::default().claimers),
            batch_size: 1000,
            drain: true,
            hold_limit: hold_limit(),
            keep_completed: keep,
            ..Default::default()
        })
        .build()
        .await
        .unwrap();
    let t = Instant::now();
    let report = engine.run(CancellationToken::new()).await.unwrap();
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(report.delivered as usize, n, "{report:?}");
    n as f64 / secs
}

/// The raw-SQL baselines: what PostgreSQL allows for a claim-and-delete cycle, without postbox.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum RawCycle {
    /// Claim with a lease (`UPDATE … FOR UPDATE SKIP LOCKED`), then delete: postbox's lease mode.
    Lease,
    /// `BEGIN; SELECT … FOR UPDATE SKIP LOCKED; DELETE; COMMIT`: the rows are locked, not written,
    /// until they are deleted.
    HeldLock,
}

/// A raw cycle as plain SQL, batch 100, on 2 connections with `synchronous_commit = off` (as the
/// relay's own sessions).
fn drain_raw_sql(url: &str, n: usize, cycle: RawCycle) -> f64 {
    use diesel::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct Id {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        id: i64,
    }
    const CLIENTS: usize = 2;
    let done = Arc::new(AtomicU64::new(0));
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..CLIENTS {
            let done = done.clone();
            s.spawn(move || {
                let mut c = PgConnection::establish(url).unwrap();
                c.batch_execute("SET synchronous_commit = off").unwrap();
                loop {
                    let claim = match cycle {
                        RawCycle::Lease => {
                            "UPDATE postbox.messages m SET state = 'running', attempts = attempts + 1,
                                    locked_until = now() + interval '30 seconds', lease_token = 1
                             FROM (SELECT id FROM postbox.messages WHERE state = 'available' AND topic = 'bench.noop'
                                   ORDER BY priority, id LIMIT 100 FOR UPDATE SKIP LOCKED) p
                             WHERE m.id = p.id RETURNING m.id"
                        }
                        RawCycle::HeldLock => {
                            c.batch_execute("BEGIN").unwrap();
                            "SELECT id FROM postbox.messages WHERE state = 'available' AND topic = 'bench.noop'
                             ORDER BY priority, id LIMIT 100 FOR UPDATE SKIP LOCKED"
                        }
                    };
                    let ids: Vec<Id> = diesel::sql_query(claim).load(&mut c).unwrap();
                    let ids: Vec<i64> = ids.into_iter().map(|i| i.id).collect();
                    if !ids.is_empty() {
                        diesel::sql_query("DELETE FROM postbox.messages WHERE id = ANY($1)")
                            .bind::<diesel::sql_types::Array<diesel::sql_types::BigInt>, _>(&ids)
                            .execute(&mut c)
                            .unwrap();
                    }
                    if cycle == RawCycle::HeldLock {
                        c.batch_execute("COMMIT").unwrap();
                    }
                    if ids.is_empty() {
                        break;
                    }
                    done.fetch_add(ids.len() as u64, Ordering::Relaxed);
                }
            });
        }
    });
    assert_eq!(done.load(Ordering::Relaxed) as usize, n);
    n as f64 / t.elapsed().as_secs_f64()
}

/// The median of a few figures.
pub(crate) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        f64::NAN
    } else {
        s[s.len() / 2]
    }
}

/// Commit → handler start, in ms, for `rate` messages a second over `secs` seconds.
async fn wakeup(url: &str, rate: u64, secs: u64) -> Vec<f64> {
    let started: Arc<Mutex<HashMap<i64, Instant>>> = Default::default();
    let s = started.clone();
    let handlers = Handlers::new().on("bench.wake", move |job: Job<serde_json::Value>| {
        let s = s.clone();
        async move {
            s.lock().unwrap().insert(job.id, Instant::now());
            Ok(())
        }
    });
    let engine = Engine::builder(url)
        .handlers(handlers)
        .build()
        .await
        .unwrap();
    let counters = engine.counters();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(engine.run(shutdown.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await; // let it go idle

    let mut conn = AsyncPgConnection::establish(url).await.unwrap();
    let mut committed: Vec<(i64, Instant)> = Vec::new();
    let mut commit_ms: Vec<f64> = Vec::new();
    let total = rate * secs;
    let period = Duration::from_secs_f64(1.0 / rate as f64);
    let t0 = tokio::time::Instant::now();
    for i in 0..total {
        tokio::time::sleep_until(t0 + period * i as u32).await;
        conn.batch_execute("BEGIN").await.unwrap();
        let id = postbox::enqueue_async(&mut conn, &Message::new("bench.wake"))
            .await
            .unwrap()
            .id()
            .unwrap();
        let at = Instant::now();
        conn.batch_execute("COMMIT").await.unwrap();
        commit_ms.push(at.elapsed().as_secs_f64() * 1000.0);
        committed.push((id, at));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while counters.snapshot().delivered < total && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    shutdown.cancel();
    task.await.unwrap().unwrap();
    let started = started.lock().unwrap();
    let mut lat: Vec<f64> = committed
        .iter()
        .filter_map(|(id, at)| {
            started
                .get(id)
                .map(|s| s.duration_since(*at).as_secs_f64() * 1000.0)
        })
        .collect();
    assert_eq!(lat.len() as u64, total, "some messages were not handled");
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    commit_ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "  (the COMMIT itself, included above: p50 {:.2} ms, p99 {:.2} ms)",
        percentile(&commit_ms, 0.5),
        percentile(&commit_ms, 0.99)
    );
    lat
}

/// Transactions a second of 8 writers over `secs`: one business row, plus one message if asked.
/// 8 writers for `secs`: each transaction a business row, plus one message when `message` says
/// how (`Some(false)` enqueue, `Some(true)` publish); transactions a second.
pub(crate) async fn writers_with(url: &str, message: Option<bool>, secs: u64) -> f64 {
    writers_of(url, message.is_some(), false, message == Some(true), secs).await
}

async fn writers(url: &str, with_message: bool, ordered: bool, secs: u64) -> f64 {
    writers_of(url, with_message, ordered, false, secs).await
}

async fn writers_of(url: &str, with_message: bool, ordered: bool, publish: bool, secs: u64) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for w in 0..8 {
        let (url, stop, count) = (url.to_owned(), stop.clone(), count.clone());
        tasks.push(tokio::spawn(async move {
            let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
            let mut i = 0i64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                conn.transaction(async |c| {
                    use diesel_async::RunQueryDsl;
                    diesel::sql_query(
                        "INSERT INTO bench_orders (customer, total_cents) VALUES ($1, $2)",
                    )
                    .bind::<diesel::sql_types::Integer, _>(w)
                    .bind::<diesel::sql_types::BigInt, _>(i)
                    .execute(c)
                    .await?;
                    if with_message {
                        let mut m = Message::new("bench.order")
                            .key(format!("c{w}-{}", i % 100))
                            .payload(&serde_json::json!({"n": i}));
                        if ordered {
                            m = m.ordered();
                        }
                        if publish {
                            postbox::publish_async(c, &m).await?;
                        } else {
                            postbox::enqueue_async(c, &m).await?;
                        }
                    }
                    Ok::<_, postbox::Error>(())
                })
                .await
                .unwrap();
                count.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    count.load(Ordering::Relaxed) as f64 / secs as f64
}

/// Relays `n` messages to Kafka (topic `bench`, 3 partitions) with the engine and the Kafka sink.
/// The broker's own ceiling: `n` records like the relay's, produced straight from memory with the
/// sink's producer settings, every report awaited, the producer started beforehand.
async fn kafka_raw(brokers: &str, n: usize) -> f64 {
    kafka_raw_with(brokers, n, &[]).await
}

/// [`kafka_raw`] with these headers on every record.
async fn kafka_raw_with(brokers: &str, n: usize, headers: &[(&str, &str)]) -> f64 {
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let producer: FutureProducer = {
        let mut c = rdkafka::ClientConfig::new();
        c.set("bootstrap.servers", brokers);
        for (k, v) in postbox::sink::kafka::PRODUCER_DEFAULTS {
            c.set(k, v);
        }
        c.create().unwrap()
    };
    let payload =
        serde_json::to_vec(&serde_json::json!({"n": 1, "body": "x".repeat(200)})).unwrap();
    // Started as the relay's producer is: one record first, outside the measured time.
    let first = FutureRecord::to("bench").payload(&payload).key("k0");
    producer.send(first, Duration::from_secs(10)).await.unwrap();
    let t = Instant::now();
    let mut pending = Vec::with_capacity(n);
    for i in 0..n {
        let key = format!("k{}", i % 100);
        let mut record = FutureRecord::to("bench").payload(&payload).key(&key);
        if !headers.is_empty() {
            let h = headers.iter().fold(
                OwnedHeaders::new_with_capacity(headers.len()),
                |h, (k, v)| {
                    h.insert(Header {
                        key: k,
                        value: Some(v.as_bytes()),
                    })
                },
            );
            record = record.headers(h);
        }
        loop {
            match producer.send_result(record) {
                Ok(f) => {
                    pending.push(f);
                    break;
                }
                Err((_, r)) => {
                    record = r;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
    }
    for f in pending {
        f.await.unwrap().unwrap();
    }
    n as f64 / t.elapsed().as_secs_f64()
}

/// `n` messages like an app's events: ~230-byte JSON, 100 keys, topic `bench`.
pub(crate) async fn fill_events(url: &str, n: usize) {
    let mut conn = AsyncPgConnection::establish(url).await.unwrap();
    let mut left = n;
    let mut i = 0;
    while left > 0 {
        let k = left.min(1000);
        let msgs: Vec<Message> = (0..k)
            .map(|j| {
                Message::new("bench")
                    .key(format!("k{}", (i + j) % 100))
                    .payload(&serde_json::json!({"n": i + j, "body": "x".repeat(200)}))
            })
            .collect();
        postbox::enqueue_many_async(&mut conn, &msgs).await.unwrap();
        left -= k;
        i += k;
    }
    conn.batch_execute("ANALYZE postbox.messages")
        .await
        .unwrap();
}

/// Relays every message of topic `bench` to Kafka (batch 1000) through `producer`; msg/s.
pub(crate) async fn kafka_relay(
    url: &str,
    producer: &Arc<postbox::sink::kafka::SharedProducer>,
    claimers: Option<usize>,
) -> f64 {
    kafka_relay_as(url, producer, claimers, Default::default()).await
}

/// [`kafka_relay`] with the records made as `layout` says (a format, a topic template).
async fn kafka_relay_as(
    url: &str,
    producer: &Arc<postbox::sink::kafka::SharedProducer>,
    claimers: Option<usize>,
    layout: postbox::sink::record::RecordLayout,
) -> f64 {
    let sink =
        postbox::sink::kafka::KafkaSink::new(producer.clone(), postbox::Topics::all(), layout);
    let engine = Engine::builder(url)
        .sink(sink)
        .config(EngineConfig {
            batch_size: 1000,
            concurrency: 4,
            claimers: claimers.unwrap_or(EngineConfig::default().claimers),
            drain: true,
            ..Default::default()
        })
        .build()
        .await
        .unwrap();
    let t = Instant::now();
    let report = engine.run(CancellationToken::new()).await.unwrap();
    report.delivered as f64 / t.elapsed().as_secs_f64()
}

/// Kafka against the embedded queue on the same messages, alternating, and the broker's own
/// ceiling.
async fn kafka_bench(url: &str, brokers: &str, n: usize, claimers: Option<usize>) {
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
    // One producer for every run, as a relay keeps its producer: a new idempotent producer's first
    // delivery waits for its producer id (~0.5 s here), which a warm-up drain pays before the runs.
    let producer = postbox::sink::kafka::producer(brokers, &Default::default()).unwrap();
    reset(url);
    fill_events(url, 1000).await;
    kafka_relay(url, &producer, claimers).await;
    let (mut kafka, mut embedded) = (Vec::new(), Vec::new());
    for round in 0..3 {
        for first in [round % 2 == 0, round % 2 == 1] {
            reset(url);
            fill_events(url, n).await;
            if first {
                kafka.push(kafka_relay(url, &producer, claimers).await);
            } else {
                // The same messages to a no-op handler in the app (the embedded queue).
                embedded.push(drain_topic(url, "bench", n, claimers, None).await);
            }
        }
    }
    let raw = kafka_raw(brokers, n).await;
    println!(
        "kafka: {n} messages (~230-byte JSON, 100 keys, 3 partitions), batch 1000, 4 batches in flight: {kafka:.0?} msg/s"
    );
    println!("kafka: the same messages to a no-op handler (embedded queue): {embedded:.0?} msg/s");
    println!(
        "kafka: raw producer, {n} records from memory (the broker's ceiling here): {raw:.0} msg/s"
    );
    println!("kafka_msgs_per_s={:.0}", median(&kafka));
    println!("kafka_vs_drain={:.2}", median(&kafka) / median(&embedded));
    kafka_formats(url, brokers, &producer, n, claimers).await;
}

/// CPU time to make one record in `format` (a bench message: ~230-byte payload, a key, no
/// headers), best of 5 passes over 100k messages.
fn record_ns(format: &postbox::sink::record::Format) -> f64 {
    let layout = postbox::sink::record::RecordLayout {
        format: format.clone(),
        ..Default::default()
    };
    let now = chrono::Utc::now();
    let m = postbox::ClaimedMessage {
        id: 123_456,
        topic: "bench".into(),
        key: Some("k42".into()),
        ordered: false,
        payload: serde_json::json!({"n": 42, "body": "x".repeat(200)}),
        headers: Default::default(),
        priority: 0,
        run_at: now,
        attempts: 1,
        max_attempts: 25,
        created_at: now,
        locked_until: now,
        lease_token: 1,
        last_error: None,
        dedup_key: None,
        undecodable: None,
        stream_id: None,
    };
    (0..5)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..100_000 {
                std::hint::black_box(layout.record(std::hint::black_box(&m)).unwrap());
            }
            t.elapsed().as_nanos() as f64 / 100_000.0
        })
        .fold(f64::INFINITY, f64::min)
}

/// Each record format against postbox's own on the same messages, in rotating order, 5 rounds.
async fn kafka_formats(
    url: &str,
    brokers: &str,
    producer: &Arc<postbox::sink::kafka::SharedProducer>,
    n: usize,
    claimers: Option<usize>,
) {
    use postbox::sink::record::{Format, RecordLayout};
    let formats: [(&str, Format); 5] = [
        ("postbox", Format::default()),
        (
            "debezium",
            Format::Debezium {
                expand_payload: false,
                tombstone_on_empty: false,
            },
        ),
        (
            "debezium_expanded",
            Format::Debezium {
                expand_payload: true,
                tombstone_on_empty: false,
            },
        ),
        (
            "cloudevents_binary",
            Format::CloudEvents {
                source: "/bench".into(),
                structured: false,
            },
        ),
        (
            "cloudevents_structured",
            Format::CloudEvents {
                source: "/bench".into(),
                structured: true,
            },
        ),
    ];
    let mut runs: Vec<Vec<f64>> = vec![Vec::new(); formats.len()];
    for round in 0..5 {
        for i in 0..formats.len() {
            let f = (i + round) % formats.len();
            reset(url);
            fill_events(url, n).await;
            let layout = RecordLayout {
                format: formats[f].1.clone(),
                ..RecordLayout::default()
            };
            runs[f].push(kafka_relay_as(url, producer, claimers, layout).await);
        }
    }
    let postbox = median(&runs[0]);
    for (i, (name, _)) in formats.iter().enumerate() {
        println!(
            "kafka format {name}: {:.0?} msg/s; making its records alone: {:.0} ns a message",
            runs[i],
            record_ns(&formats[i].1)
        );
    }
    for (i, (name, _)) in formats.iter().enumerate().skip(1) {
        println!(
            "kafka_format_{name}_vs_postbox={:.2}",
            median(&runs[i]) / postbox
        );
    }
    // What the headers alone cost the producer and the broker: the same records from memory with
    // postbox's three headers and with a binary CloudEvent's six.
    let postbox_headers = [
        ("postbox-id", "123456"),
        ("postbox-topic", "bench"),
        ("postbox-created-at", "2026-12-03T07:00:00.123456+00:00"),
    ];
    let ce_headers = [
        ("ce_specversion", "1.0"),
        ("ce_id", "123456"),
        ("ce_source", "/bench"),
        ("ce_type", "bench"),
        ("ce_time", "2026-12-03T07:00:00.123456Z"),
        ("content-type", "application/json"),
    ];
    let (mut with_postbox, mut with_ce) = (Vec::new(), Vec::new());
    for round in 0..3 {
        for first in [round % 2 == 0, round % 2 == 1] {
            if first {
                with_postbox.push(kafka_raw_with(brokers, n, &postbox_headers).await);
            } else {
                with_ce.push(kafka_raw_with(brokers, n, &ce_headers).await);
            }
        }
    }
    println!(
        "kafka raw producer, postbox's headers / a binary CloudEvent's: {with_postbox:.0?} / {with_ce:.0?} msg/s"
    );
    println!(
        "kafka_raw_cloudevents_headers_vs_postbox_headers={:.2}",
        median(&with_ce) / median(&with_postbox)
    );
}

async fn count_notifications(url: &str, count: Arc<AtomicU64>) -> tokio::task::JoinHandle<()> {
    use futures_util::StreamExt;
    let mut conn = AsyncPgConnection::establish(url).await.unwrap();
    conn.batch_execute("LISTEN postbox").await.unwrap();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(conn.notifications_stream());
        while let Some(Ok(_)) = stream.next().await {
            count.fetch_add(1, Ordering::Relaxed);
        }
    })
}

async fn with_engine<F: std::future::Future<Output = f64>>(url: &str, f: F) -> (f64, u64) {
    let handlers = Handlers::new().on("bench.order", |_: Job<serde_json::Value>| async { Ok(()) });
    let engine = Engine::builder(url)
        .handlers(handlers)
        .build()
        .await
        .unwrap();
    let counters = engine.counters();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(engine.run(shutdown.clone()));
    let r = f.await;
    shutdown.cancel();
    task.await.unwrap().unwrap();
    (r, counters.snapshot().delivered)
}

/// The hot table's write counters (pg_stat_user_tables; the engine's backends flush them when
/// they exit).
fn hot_table_counters(url: &str) -> [i64; 4] {
    use diesel::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct C {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        upd: i64,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        hot: i64,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        del: i64,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        dead: i64,
    }
    let mut c = PgConnection::establish(url).unwrap();
    let r: C = diesel::sql_query(
        "SELECT n_tup_upd AS upd, n_tup_hot_upd AS hot, n_tup_del AS del, n_dead_tup AS dead
         FROM pg_stat_user_tables WHERE schemaname = 'postbox' AND relname = 'messages'",
    )
    .get_result(&mut c)
    .unwrap();
    [r.upd, r.hot, r.del, r.dead]
}

/// Completed-message retention off and on, alternating, three rounds: drain rate, and what the
/// drain wrote to the hot table (updates, HOT updates, deletes, dead tuples left).
async fn retention(url: &str, n: usize, claimers: Option<usize>) {
    let keep = Some(Duration::from_secs(3600));
    let (mut off, mut on) = (Vec::new(), Vec::new());
    for round in 0..6 {
        let kept = if round % 2 == 0 { None } else { keep };
        reset(url);
        PgConnection::establish(url)
            .unwrap()
            .batch_execute("TRUNCATE postbox.completed")
            .unwrap();
        enqueue_noop(url, n).await;
        tokio::time::sleep(Duration::from_millis(700)).await; // let the statistics settle
        let before = hot_table_counters(url);
        let rate = drain_topic(url, "bench.noop", n, claimers, kept).await;
        tokio::time::sleep(Duration::from_millis(700)).await;
        let after = hot_table_counters(url);
        let d: Vec<i64> = (0..4).map(|i| after[i] - before[i]).collect();
        println!(
            "retention {}: {rate:.0} msg/s; hot table: {} updates ({} HOT), {} deletes, dead tuples {:+}",
            if kept.is_some() { "on " } else { "off" },
            d[0],
            d[1],
            d[2],
            d[3]
        );
        if kept.is_some() { &mut on } else { &mut off }.push(rate);
    }
    println!("retention_drain_ratio={:.2}", median(&on) / median(&off));
    // Claim latency in a claim-and-complete cycle over a 100,000-message backlog, off and on
    // alternating: 500 claims of 100 each, the completions copying (on) or not (off).
    let (mut off99, mut on99) = (Vec::new(), Vec::new());
    for round in 0..4 {
        let kept = round % 2 == 1;
        reset(url);
        enqueue_noop(url, n).await;
        let mut store = postbox::Store::connect(url, 4).await.unwrap();
        if kept {
            store.prepare_completed().await.unwrap();
            store = store.with_archive("bench");
        }
        let mut lat = Vec::with_capacity(500);
        for _ in 0..500 {
            let t = Instant::now();
            let got = store
                .claim(100, Duration::from_secs(30), &postbox::Topics::all())
                .await
                .unwrap();
            lat.push(t.elapsed().as_secs_f64() * 1000.0);
            let leases: Vec<_> = got.iter().map(|m| m.lease()).collect();
            store.complete(&leases).await.unwrap();
        }
        lat.sort_by(f64::total_cmp);
        let (p50, p99) = (percentile(&lat, 0.5), percentile(&lat, 0.99));
        println!(
            "retention {}: claim of 100 p50 {p50:.2} ms, p99 {p99:.2} ms",
            if kept { "on " } else { "off" }
        );
        if kept { &mut on99 } else { &mut off99 }.push(p99);
    }
    println!(
        "retention_claim_p99_ratio={:.2}",
        median(&on99) / median(&off99)
    );
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter("warn")
        .init();
    let a = args();
    ensure_database(&a.url);
    postbox::migrate(&mut PgConnection::establish(&a.url).unwrap()).unwrap();
    let n = a.messages;
    let run = |part: &str| a.only.as_deref().is_none_or(|o| o == part);
    let (mut enqueue, mut drain, mut p50, mut p99, mut ratio, mut ordered_ratio) =
        (f64::NAN, f64::NAN, f64::NAN, f64::NAN, f64::NAN, f64::NAN);

    if run("drain") {
        // Side by side, three rounds, the order rotating: the engine, then the raw cycles.
        let mut engine_rates = Vec::new();
        let mut lease_rates = Vec::new();
        let mut held_rates = Vec::new();
        let mut enqueue_rates = Vec::new();
        let order = ["engine", "lease", "held"];
        for round in 0..3 {
            for k in 0..3 {
                let which = order[(round + k) % 3];
                reset(&a.url);
                enqueue_rates.push(enqueue_noop(&a.url, n).await);
                if which == "engine" {
                    engine_rates.push(drain_engine(&a.url, n, a.claimers).await);
                    continue;
                }
                let url = a.url.clone();
                let cycle = if which == "lease" {
                    RawCycle::Lease
                } else {
                    RawCycle::HeldLock
                };
                let rate = tokio::task::spawn_blocking(move || drain_raw_sql(&url, n, cycle))
                    .await
                    .unwrap();
                if cycle == RawCycle::Lease {
                    lease_rates.push(rate);
                } else {
                    held_rates.push(rate);
                }
            }
        }
        enqueue = median(&enqueue_rates);
        drain = median(&engine_rates);
        let (lease, held) = (median(&lease_rates), median(&held_rates));
        println!(
            "enqueue: {n} messages with enqueue_many, 1000 a call: {enqueue:.0} msg/s (median of 9)"
        );
        println!("drain: engine (batch 1000, handlers no-op): {engine_rates:.0?} msg/s");
        println!(
            "drain: raw lease cycle (UPDATE … SKIP LOCKED + DELETE, batch 100, 2 connections): {lease_rates:.0?} msg/s"
        );
        println!(
            "drain: raw held-lock cycle (BEGIN; SELECT … FOR UPDATE SKIP LOCKED; DELETE; COMMIT, batch 100, 2 connections): {held_rates:.0?} msg/s"
        );
        println!("drain_vs_lease={:.2}", drain / lease);
        println!("drain_vs_heldlock={:.2}", drain / held);
    }

    if a.only.as_deref() == Some("enqueue") {
        // enqueue_many alone: 1,000 messages a call, and all of them in one call.
        let mut per_call = Vec::new();
        let mut one_call = Vec::new();
        for _ in 0..3 {
            reset(&a.url);
            per_call.push(enqueue_noop(&a.url, n).await);
            reset(&a.url);
            let mut conn = AsyncPgConnection::establish(&a.url).await.unwrap();
            let msgs: Vec<Message> = (0..n).map(|_| Message::new("bench.noop")).collect();
            let t = Instant::now();
            postbox::enqueue_many_async(&mut conn, &msgs).await.unwrap();
            one_call.push(n as f64 / t.elapsed().as_secs_f64());
        }
        println!("enqueue: {n} messages with enqueue_many, 1000 a call: {per_call:.0?} msg/s");
        println!("enqueue: {n} messages with one enqueue_many call: {one_call:.0?} msg/s");
        println!("enqueue_msgs_per_s={:.0}", median(&per_call));
        println!("enqueue_one_call_msgs_per_s={:.0}", median(&one_call));
        return;
    }
    if a.only.as_deref() == Some("engine-drain") {
        // The engine's drain alone, three times (for profiling and quick comparisons).
        for _ in 0..3 {
            reset(&a.url);
            enqueue_noop(&a.url, n).await;
            println!(
                "drain: engine {:.0} msg/s",
                drain_engine(&a.url, n, a.claimers).await
            );
        }
        return;
    }
    if a.only.as_deref() == Some("retention") {
        retention(&a.url, n, a.claimers).await;
        return;
    }
    if a.only.as_deref() == Some("ordered-drain") {
        let r = backlog::ordered_drain(&a.url).await;
        let u = backlog::ordered_drain_unanalyzed(&a.url).await;
        println!("ordered_drain_ratio={r:.2}");
        println!("ordered_drain_ratio_unanalyzed={u:.2}");
        return;
    }
    if a.only.as_deref() == Some("topics") {
        topics::run(&a.url).await;
        return;
    }
    if a.only.as_deref() == Some("status") {
        let store = postbox::Store::connect(&a.url, 4).await.unwrap();
        let (status, sample) = backlog::status_at_scale(&a.url, &store, a.status_rows).await;
        println!("status_ms_10m={status:.1}");
        println!("sample_ms_10m={sample:.1}");
        return;
    }
    if a.only.as_deref() == Some("console") {
        console::run(&a.url, a.status_rows).await;
        return;
    }
    if a.only.as_deref() == Some("xmin") {
        xmin::run(a.rate, a.pin_minutes, a.xmin_topics, a.xmin_glob).await;
        return;
    }
    if a.only.as_deref() == Some("write") {
        write::run(&a.url).await;
        return;
    }
    if a.only.as_deref() == Some("fresh") {
        fresh::run(&a.url).await;
        return;
    }
    if a.only.as_deref() == Some("limits") {
        let store = postbox::Store::connect(&a.url, 4).await.unwrap();
        backlog::limited_claims(&a.url, &store).await;
        return;
    }
    if a.only.as_deref() == Some("backlog") {
        backlog::run(&a.url, a.backlog_rows, a.status_rows).await;
        return;
    }

    if a.only.as_deref() == Some("stream") {
        stream::run(&a.url, a.kafka.as_deref(), n).await;
        return;
    }

    if a.only.as_deref() == Some("kafka") {
        let brokers = a
            .kafka
            .clone()
            .expect("--only kafka needs --kafka-brokers HOST:PORT");
        kafka_bench(&a.url, &brokers, n, a.claimers).await;
        return;
    }

    if run("wakeup") {
        reset(&a.url);
        let lat = wakeup(&a.url, 500, 5).await;
        (p50, p99) = (percentile(&lat, 0.5), percentile(&lat, 0.99));
        println!(
            "wake-up at 500 msg/s for 5 s: p50 {p50:.2} ms, p99 {p99:.2} ms, max {:.2} ms",
            lat[lat.len() - 1]
        );
        let sparse = wakeup(&a.url, 20, 5).await;
        println!(
            "wake-up at 20 msg/s for 5 s (idle engine, woken by NOTIFY): p50 {:.2} ms, p99 {:.2} ms",
            percentile(&sparse, 0.5),
            percentile(&sparse, 0.99)
        );
    }

    if run("tx") {
        let mut plain = Vec::new();
        let mut unconsumed = Vec::new();
        let mut ordered = Vec::new();
        for _ in 0..2 {
            reset(&a.url);
            plain.push(writers(&a.url, false, false, 10).await);
            reset(&a.url);
            unconsumed.push(writers(&a.url, true, false, 10).await);
            reset(&a.url);
            ordered.push(writers(&a.url, true, true, 10).await);
        }
        reset(&a.url);
        let notifies = Arc::new(AtomicU64::new(0));
        let counting = count_notifications(&a.url, notifies.clone()).await;
        let (relayed_tx, relayed) = with_engine(&a.url, writers(&a.url, true, false, 10)).await;
        counting.abort();
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        ratio = mean(&unconsumed) / mean(&plain);
        ordered_ratio = mean(&ordered) / mean(&plain);
        println!(
            "8 writers, 10 s a run: business row only {plain:.0?} tx/s; + one message {unconsumed:.0?} tx/s; + one ordered message {ordered:.0?} tx/s ({:.2} of plain)",
            mean(&ordered) / mean(&plain)
        );
        println!(
            "  + one message with an engine relaying them: {relayed_tx:.0} tx/s ({:.2} of plain), {relayed} relayed, {} NOTIFYs sent",
            relayed_tx / mean(&plain),
            notifies.load(Ordering::Relaxed)
        );
    }

    println!("enqueue_msgs_per_s={enqueue:.0}");
    println!("drain_msgs_per_s={drain:.0}");
    println!("wakeup_p50_ms={p50:.2}");
    println!("wakeup_p99_ms={p99:.2}");
    println!("enqueue_tx_ratio={ratio:.2}");
    println!("enqueue_tx_ratio_ordered={ordered_ratio:.2}");
}
