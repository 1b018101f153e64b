//! The Kafka sink against a real Kafka-protocol broker: tansu with memory storage
//! (`scripts/ensure-tansu.sh` provides it; `.ci/run` calls it). Topics are created explicitly:
//! tansu does not auto-create them.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::broker::{Broker, Consumed, tansu_bin};
use common::{TestDb, create_ledger, eventually, free_port, http_get, ledger, ledger_writer};
use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use postbox::engine::{Engine, EngineConfig, RunReport};
use postbox::sink::kafka::{KafkaSink, producer};
use postbox::sink::record::{RecordLayout, TopicTemplate};
use postbox::sink::{Outcome, Sink, Unavailable};
use postbox::{Backoff, ClaimedMessage, Message, Topics};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use tokio_util::sync::CancellationToken;

/// The partition the Java client (Kafka Connect, Debezium, Java producers) gives a key: Kafka's
/// murmur2, made positive, modulo the partitions.
fn java_partition(key: &[u8], partitions: u32) -> i32 {
    const M: u32 = 0x5bd1_e995;
    let mut h: u32 = 0x9747_b28c ^ key.len() as u32;
    let mut chunks = key.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> 24;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M) ^ k;
    }
    let rest = chunks.remainder();
    if rest.len() >= 3 {
        h ^= u32::from(rest[2]) << 16;
    }
    if rest.len() >= 2 {
        h ^= u32::from(rest[1]) << 8;
    }
    if !rest.is_empty() {
        h ^= u32::from(rest[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    ((h & 0x7fff_ffff) % partitions) as i32
}

fn properties(extra: &[(&str, &str)]) -> BTreeMap<String, String> {
    extra
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Fails the first attempt of every third message, then delegates: retries, for the order test.
struct FirstAttemptFails(KafkaSink);

impl Sink for FirstAttemptFails {
    fn name(&self) -> &str {
        "kafka"
    }
    fn topics(&self) -> Topics {
        self.0.topics()
    }
    fn deliver(
        &self,
        batch: Vec<ClaimedMessage>,
    ) -> BoxFuture<'_, Result<Vec<Outcome>, Unavailable>> {
        async move {
            let fail: Vec<bool> = batch
                .iter()
                .map(|m| m.attempts == 1 && m.payload["n"].as_i64().unwrap_or(0) % 3 == 0)
                .collect();
            let send: Vec<ClaimedMessage> = batch
                .iter()
                .zip(&fail)
                .filter(|(_, f)| !**f)
                .map(|(m, _)| m.clone())
                .collect();
            let mut sent = self.0.deliver(send).await?.into_iter();
            Ok(fail
                .iter()
                .map(|f| {
                    if *f {
                        Outcome::Retry {
                            reason: "injected".into(),
                            delay: None,
                        }
                    } else {
                        sent.next().unwrap()
                    }
                })
                .collect())
        }
        .boxed()
    }
}

fn config() -> EngineConfig {
    EngineConfig {
        batch_size: 200,
        concurrency: 4,
        poll_interval: Duration::from_millis(200),
        ..Default::default()
    }
}

fn fast_backoff() -> Backoff {
    Backoff {
        base: Duration::from_millis(20),
        cap: Duration::from_millis(100),
        jitter: 0.0,
    }
}

fn start(
    engine: Engine,
) -> (
    CancellationToken,
    tokio::task::JoinHandle<postbox::Result<RunReport>>,
    Arc<postbox::engine::Counters>,
) {
    let stop = CancellationToken::new();
    let counters = engine.counters();
    (stop.clone(), tokio::spawn(engine.run(stop)), counters)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_message_reaches_kafka_with_headers_and_ordered_keys_in_order_across_retries_and_two_relays()
 {
    let broker = Broker::start();
    broker.create_topic("orders", 3).await;
    let db = TestDb::migrated();
    let mut msgs = Vec::new();
    for n in 0..40 {
        for k in 0..6 {
            msgs.push(
                Message::new("orders.created")
                    .key(format!("customer-{k}"))
                    .ordered()
                    .header("trace", format!("t{n}"))
                    .payload(&serde_json::json!({"n": n, "k": k})),
            );
        }
    }
    let ids = postbox::enqueue_many(&mut db.conn(), &msgs).unwrap();
    let p = producer(&broker.brokers(), &BTreeMap::new()).unwrap();
    let url = db.url.clone();
    let relay = |p| {
        let url = url.clone();
        async move {
            let sink = FirstAttemptFails(KafkaSink::new(
                p,
                Topics::only(["orders.*"]),
                RecordLayout {
                    topic: TopicTemplate::parse("orders").unwrap(),
                    ..RecordLayout::default()
                },
            ));
            Engine::builder(&url)
                .sink(sink)
                .config(config())
                .backoff(fast_backoff())
                .build()
                .await
                .unwrap()
        }
    };
    let (s1, t1, c1) = start(relay(p.clone()).await);
    let (s2, t2, c2) = start(relay(p.clone()).await);
    assert!(
        eventually(Duration::from_secs(60), || async {
            c1.snapshot().delivered + c2.snapshot().delivered == 240
        })
        .await
    );
    s1.cancel();
    s2.cancel();
    let (r1, r2) = (t1.await.unwrap().unwrap(), t2.await.unwrap().unwrap());
    assert!(
        r1.delivered > 0 && r2.delivered > 0,
        "one relay did everything: {r1:?} {r2:?}"
    );
    assert!(
        r1.retried + r2.retried >= 60,
        "the injected failures were retried"
    );

    let got = broker.consume("orders", 240);
    assert_eq!(got.len(), 240);
    let first = ids[0].id().unwrap();
    let mut by_key: HashMap<String, Vec<&Consumed>> = HashMap::new();
    for m in &got {
        by_key.entry(m.key.clone().unwrap()).or_default().push(m);
        assert_eq!(m.headers["postbox-topic"], "orders.created");
        assert!(m.headers["postbox-id"].parse::<i64>().unwrap() >= first);
        assert!(chrono::DateTime::parse_from_rfc3339(&m.headers["postbox-created-at"]).is_ok());
        assert_eq!(m.headers["trace"], format!("t{}", m.payload["n"]));
    }
    for (key, mut seq) in by_key {
        assert!(
            seq.windows(2).all(|w| w[0].partition == w[1].partition),
            "{key} spread over partitions"
        );
        assert_eq!(
            seq[0].partition,
            java_partition(key.as_bytes(), 3),
            "{key} is not where the Java client puts it"
        );
        seq.sort_by_key(|m| m.offset);
        let ns: Vec<i64> = seq
            .iter()
            .map(|m| m.payload["n"].as_i64().unwrap())
            .collect();
        assert_eq!(ns, (0..40).collect::<Vec<_>>(), "{key} out of order");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_can_never_be_delivered_is_dead_lettered_with_the_reason() {
    let broker = Broker::start();
    broker.create_topic("known", 1).await;
    let db = TestDb::migrated();
    // Larger than the producer's message.max.bytes: permanent, whatever the number of attempts.
    let big = "x".repeat(5_000);
    postbox::enqueue_many(
        &mut db.conn(),
        &[
            Message::new("known").payload(&1),
            Message::new("known").payload(&big),
        ],
    )
    .unwrap();
    let p = producer(
        &broker.brokers(),
        &properties(&[("message.max.bytes", "4096")]),
    )
    .unwrap();
    let engine = Engine::builder(&db.url)
        .sink(KafkaSink::new(p, Topics::all(), RecordLayout::default()))
        .config(config())
        .build()
        .await
        .unwrap();
    let (stop, task, counters) = start(engine);
    assert!(
        eventually(Duration::from_secs(60), || async {
            let s = counters.snapshot();
            s.delivered == 1 && s.dead_lettered == 1
        })
        .await,
        "{:?}",
        counters.snapshot()
    );
    stop.cancel();
    task.await.unwrap().unwrap();
    let store = db.store().await;
    let dead = store.dead_list(None, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].payload, serde_json::json!(big));
    assert!(
        dead[0].reason.starts_with("kafka:") && dead[0].reason.to_lowercase().contains("too large"),
        "{}",
        dead[0].reason
    );
    assert_eq!(dead[0].attempts, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_misconfigured_for_kafka_pauses_instead_of_dead_lettering_the_stream() {
    let broker = Broker::start();
    // The topic the route should name; the broker creates no other.
    broker.create_topic("events", 1).await;
    let db = TestDb::migrated();
    let route = |kafka_topic: Option<&str>| {
        let p = producer(
            &broker.brokers(),
            &properties(&[
                ("message.timeout.ms", "2000"),
                ("allow.auto.create.topics", "false"),
            ]),
        )
        .unwrap();
        let layout = RecordLayout {
            topic: kafka_topic
                .map_or_else(TopicTemplate::default, |t| TopicTemplate::parse(t).unwrap()),
            ..RecordLayout::default()
        };
        KafkaSink::new(p, Topics::all(), layout)
    };
    let msgs: Vec<Message> = (0..5)
        .map(|i| Message::new("events").payload(&i).max_attempts(1))
        .collect();
    postbox::enqueue_many(&mut db.conn(), &msgs).unwrap();
    // A typo in the route's kafka_topic (a topic Kafka does not have): every message would fail
    // alike. (A name Kafka could never take is refused with the configuration.)
    let engine = Engine::builder(&db.url)
        .sink(route(Some("events-typo")))
        .config(EngineConfig {
            max_unavailable_backoff: Duration::from_millis(500),
            ..config()
        })
        .build()
        .await
        .unwrap();
    let (stop, task, counters) = start(engine);
    assert!(
        eventually(Duration::from_secs(30), || async {
            counters.snapshot().released >= 5
        })
        .await,
        "{:?}",
        counters.snapshot()
    );
    stop.cancel();
    let report = task.await.unwrap().unwrap();
    assert_eq!(report.dead_lettered, 0, "{report:?}");
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters"),
        0
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE attempts = 0"),
        5,
        "the outage used attempts"
    );
    // The operator fixes the route: the backlog drains.
    let engine = Engine::builder(&db.url)
        .sink(route(Some("events")))
        .config(config())
        .build()
        .await
        .unwrap();
    let (stop, task, counters) = start(engine);
    assert!(
        eventually(Duration::from_secs(60), || async {
            counters.snapshot().delivered == 5
        })
        .await,
        "{:?}",
        counters.snapshot()
    );
    stop.cancel();
    task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_hands_batches_back_without_using_attempts_then_delivers() {
    let broker = Broker::start();
    broker.create_topic("events", 1).await;
    let db = TestDb::migrated();
    let p = producer(
        &broker.brokers(),
        &properties(&[
            ("message.timeout.ms", "1500"),
            ("reconnect.backoff.max.ms", "500"),
        ]),
    )
    .unwrap();
    let engine = Engine::builder(&db.url)
        .sink(KafkaSink::new(p, Topics::all(), RecordLayout::default()))
        .config(EngineConfig {
            max_unavailable_backoff: Duration::from_millis(500),
            ..config()
        })
        .build()
        .await
        .unwrap();
    let (stop, task, counters) = start(engine);
    postbox::enqueue(
        &mut db.conn(),
        &Message::new("events").payload(&0).max_attempts(1),
    )
    .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            counters.snapshot().delivered == 1
        })
        .await
    );

    // The broker stops answering (SIGSTOP: the process stays, with its state, like a broker behind
    // a network partition). Memory-storage tansu forgets producer ids when restarted, which a real
    // broker does not, so this is the outage that keeps the production defaults (idempotence) true.
    broker.signal("STOP");
    let msgs: Vec<Message> = (1..=5)
        .map(|i| Message::new("events").payload(&i).max_attempts(1))
        .collect();
    postbox::enqueue_many(&mut db.conn(), &msgs).unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            counters.snapshot().released >= 5
        })
        .await,
        "{:?}",
        counters.snapshot()
    );
    // One attempt each and none used: a retry would have dead-lettered them.
    assert_eq!(db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE attempts = 0 OR locked_until IS NOT NULL"), 5);

    broker.signal("CONT");
    let delivered = eventually(Duration::from_secs(60), || async {
        counters.snapshot().delivered == 6
    })
    .await;
    let store = db.store().await;
    assert!(
        delivered,
        "{:?} {:?}",
        counters.snapshot(),
        store
            .dead_list(None, 10)
            .await
            .unwrap()
            .iter()
            .map(|d| d.reason.clone())
            .collect::<Vec<_>>()
    );
    stop.cancel();
    let report = task.await.unwrap().unwrap();
    assert_eq!((report.retried, report.dead_lettered), (0, 0));
    // Every message is in Kafka (at least once: a batch that timed out may have been written too).
    let got = broker.consume("events", 6);
    let ns: std::collections::BTreeSet<i64> =
        got.iter().map(|m| m.payload.as_i64().unwrap()).collect();
    assert_eq!(ns, (0..=5).collect());
}

/// Chaos suite, Kafka row: the broker stops answering for 10 s while a writer keeps writing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_a_broker_outage_with_a_writer_running_loses_nothing() {
    let broker = Broker::start();
    broker.create_topic("chaos", 1).await;
    let db = TestDb::migrated();
    create_ledger(&db);
    let p = producer(
        &broker.brokers(),
        &properties(&[
            ("message.timeout.ms", "1500"),
            ("reconnect.backoff.max.ms", "500"),
        ]),
    )
    .unwrap();
    let engine = Engine::builder(&db.url)
        .sink(KafkaSink::new(p, Topics::all(), RecordLayout::default()))
        .config(EngineConfig {
            max_unavailable_backoff: Duration::from_millis(500),
            ..config()
        })
        .build()
        .await
        .unwrap();
    let (stop, task, counters) = start(engine);
    let stop_writing = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let w = ledger_writer(db.url.clone(), "chaos", stop_writing.clone());
    tokio::time::sleep(Duration::from_secs(2)).await;
    broker.signal("STOP");
    tokio::time::sleep(Duration::from_secs(30)).await;
    broker.signal("CONT");
    let back = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop_writing.store(true, std::sync::atomic::Ordering::Release);
    tokio::task::spawn_blocking(move || w.join().unwrap())
        .await
        .unwrap();
    let drained = eventually(Duration::from_secs(60), || async {
        db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v") == 0
    })
    .await;
    let recovery = back.elapsed();
    stop.cancel();
    let report = task.await.unwrap().unwrap();
    let produced = db.scalar("SELECT count(*) AS v FROM public.produced") as usize;
    let delivered = broker.consume_ids("chaos", produced);
    let (produced, lost, duplicates, dead) = ledger(&db, &delivered);
    eprintln!(
        "chaos (broker stopped 30 s): produced {produced}, in Kafka {} ({duplicates} duplicates), \
         lost {}, dead {dead}, attempts used by retries {}, released {}, drained {:?} after the \
         broker came back",
        delivered.len(),
        lost.len(),
        report.retried,
        counters.snapshot().released,
        recovery
    );
    assert!(drained);
    assert!(lost.is_empty(), "lost: {lost:?}");
    assert_eq!((dead, report.dead_lettered), (0, 0));
    assert_eq!(report.retried, 0, "the outage used attempts");
    assert!(produced > 100, "the writer barely wrote: {produced}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_binary_routes_to_kafka_and_reports_an_unreachable_broker() {
    let db = TestDb::migrated();
    let dead_broker = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = std::env::temp_dir().join(format!("postbox-kafka-{}.toml", fastrand::u64(..)));
    std::fs::write(
        &config,
        format!(
            r#"database_url = "{}"
[relay]
poll_interval = "200ms"
[metrics]
listen = "127.0.0.1:{metrics}"
sample_interval = "200ms"
[sinks.kafka]
brokers = "127.0.0.1:{dead_broker}"
properties = {{ "message.timeout.ms" = "1000" }}
[[routes]]
topics = ["orders.*"]
sink = "kafka"
[[routes]]
topics = ["*"]
sink = "log"
"#,
            db.url
        ),
    )
    .unwrap();
    let mut relay = common::hermetic(env!("CARGO_BIN_EXE_postbox"))
        .args(["--config", config.to_str().unwrap(), "run"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    postbox::enqueue(
        &mut db.conn(),
        &Message::new("audit").payload(&"to the log"),
    )
    .unwrap();
    assert!(
        eventually(Duration::from_secs(20), || async {
            db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v") == 0
        })
        .await
    );
    postbox::enqueue(&mut db.conn(), &Message::new("orders.created").payload(&1)).unwrap();
    let down = eventually(Duration::from_secs(30), || async {
        http_get(metrics, "/metrics")
            .is_some_and(|(_, b)| b.contains(r#"postbox_sink_up{sink="kafka"} 0"#))
    })
    .await;
    // Each route has its own engine: the log route keeps flowing while Kafka is down.
    postbox::enqueue(
        &mut db.conn(),
        &Message::new("audit").payload(&"during the outage"),
    )
    .unwrap();
    let log_flows = eventually(Duration::from_secs(20), || async {
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE topic = 'audit'") == 0
    })
    .await;
    let (ready, _) = http_get(metrics, "/readyz").unwrap();
    let (live, _) = http_get(metrics, "/healthz").unwrap();
    let (_, body) = http_get(metrics, "/metrics").unwrap();
    let _ = Command::new("kill")
        .args(["-TERM", &relay.id().to_string()])
        .status();
    let status = relay.wait().unwrap();
    std::fs::remove_file(&config).unwrap();
    assert!(down, "{body}");
    assert!(log_flows, "the log route waited for Kafka");
    assert_eq!(ready, 200, "a sink outage made the pod unready");
    assert_eq!(live, 200, "a sink outage is not a stuck engine");
    assert!(body.contains(r#"postbox_sink_up{sink="log"} 1"#), "{body}");
    assert!(
        body.contains(r#"postbox_messages_delivered_total{sink="log",topic="audit"} 2"#),
        "{body}"
    );
    assert!(status.success());
    // The Kafka message is still there, its attempt given back.
    assert_eq!(db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE topic = 'orders.created' AND attempts = 0"), 1);
    let mut out = String::new();
    std::io::Read::read_to_string(&mut relay.stdout.take().unwrap(), &mut out).unwrap();
    assert_eq!(out.lines().count(), 2, "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_kafka_refuses_is_held_back_while_the_rest_of_its_route_flows_and_nothing_is_sent_twice()
 {
    let broker = Broker::start();
    broker.create_topic("good", 1).await;
    let db = TestDb::migrated();
    let p = producer(
        &broker.brokers(),
        &properties(&[
            ("message.timeout.ms", "5000"),
            // A cluster that does not create topics on a producer's request, as production
            // clusters are set up; learn fast that one does not exist.
            ("allow.auto.create.topics", "false"),
            ("topic.metadata.propagation.max.ms", "100"),
        ]),
    )
    .unwrap();
    let msgs: Vec<Message> = (0..25)
        .map(|i| {
            Message::new(if i % 5 == 0 { "missing" } else { "good" })
                .payload(&serde_json::json!({ "n": i }))
                .max_attempts(1)
        })
        .collect();
    postbox::enqueue_many(&mut db.conn(), &msgs).unwrap();
    let engine = Engine::builder(&db.url)
        .sink(KafkaSink::new(p, Topics::all(), RecordLayout::default()))
        .config(EngineConfig {
            max_unavailable_backoff: Duration::from_secs(1),
            ..config()
        })
        .build()
        .await
        .unwrap();
    let (stop, task, counters) = start(engine);
    assert!(
        eventually(Duration::from_secs(30), || async {
            db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE topic = 'good'") == 0
                && counters.snapshot().released >= 5
        })
        .await,
        "{:?}",
        counters.snapshot()
    );
    // Refused, not failed: no attempt used, nothing dead.
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE topic = 'missing' AND attempts = 0 AND state = 'available'"),
        5
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters"),
        0
    );
    // The operator creates the topic: its messages follow, without a restart.
    broker.create_topic("missing", 1).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v") == 0
        })
        .await,
        "{:?}",
        counters.snapshot()
    );
    stop.cancel();
    let report = task.await.unwrap().unwrap();
    assert_eq!(
        (report.delivered, report.dead_lettered),
        (25, 0),
        "{report:?}"
    );
    let good = broker.consume_ids("good", 20);
    assert_eq!(good.len(), 20);
    assert!(
        good.values().all(|n| *n == 1),
        "Kafka got a message of the good topic again: {good:?}"
    );
    assert_eq!(broker.consume_ids("missing", 5).len(), 5);
}

/// Runs an engine that sends every topic through `producer` until `done` holds of its counters
/// (30 s at most, then fails), stops it and returns its report.
async fn drain_through(
    db: &TestDb,
    producer: Arc<postbox::sink::kafka::SharedProducer>,
    done: impl Fn(&RunReport) -> bool,
) -> RunReport {
    let engine = Engine::builder(&db.url)
        .sink(KafkaSink::new(
            producer,
            Topics::all(),
            RecordLayout::default(),
        ))
        .config(config())
        .build()
        .await
        .unwrap();
    let (stop, task, counters) = start(engine);
    assert!(
        eventually(Duration::from_secs(30), || async {
            done(&counters.snapshot())
        })
        .await,
        "{:?}",
        counters.snapshot()
    );
    stop.cancel();
    task.await.unwrap().unwrap()
}

/// A certificate authority and a broker certificate for 127.0.0.1, made for one test.
fn test_certificates(dir: &std::path::Path) {
    let script = r#"
set -e
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=postbox-test-ca
openssl req -newkey rsa:2048 -nodes -keyout broker.key -out broker.csr -subj /CN=localhost
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' > ext.cnf
openssl x509 -req -in broker.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out broker.pem -days 2 -extfile ext.cnf
openssl req -x509 -newkey rsa:2048 -nodes -keyout other.key -out other-ca.pem -days 2 -subj /CN=someone-else
"#;
    let out = Command::new("bash")
        .args(["-c", script])
        .current_dir(dir)
        .output()
        .expect("openssl (Debian package openssl)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Kills the child on drop.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits until something listens on 127.0.0.1:`port`.
fn wait_listening(port: u16, what: &str) {
    let end = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < end, "{what} did not listen on {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// tansu speaking plain Kafka on `plain` and advertising `advertised` (where TLS is terminated).
fn tansu_advertising(plain: u16, advertised: u16) -> Killed {
    let broker = Killed(
        Command::new(tansu_bin())
            .args([
                "broker",
                "--listener-url",
                &format!("tcp://127.0.0.1:{plain}"),
                "--advertised-listener-url",
                &format!("tcp://127.0.0.1:{advertised}"),
                "--storage-engine",
                "memory://tansu/",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start tansu"),
    );
    wait_listening(plain, "tansu");
    broker
}

/// socat terminating TLS on `tls` with the broker certificate of `dir`, forwarding to `to`.
fn tls_terminator(dir: &std::path::Path, tls: u16, to: u16) -> Killed {
    let socat = Killed(
        Command::new("socat")
            .arg(format!(
                "OPENSSL-LISTEN:{tls},bind=127.0.0.1,reuseaddr,fork,verify=0,cert={},key={}",
                dir.join("broker.pem").display(),
                dir.join("broker.key").display()
            ))
            .arg(format!("TCP:127.0.0.1:{to}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("socat (Debian package socat)"),
    );
    wait_listening(tls, "socat");
    socat
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kafka_sink_delivers_over_tls_and_refuses_a_broker_it_cannot_verify() {
    let dir = std::env::temp_dir().join(format!("postbox-kafka-tls-{}", fastrand::u64(..)));
    std::fs::create_dir_all(&dir).unwrap();
    test_certificates(&dir);
    // tansu speaks plain Kafka on one port and advertises the TLS port, where socat terminates
    // TLS with the broker's certificate: every byte a client sends goes through TLS.
    let (plain, tls) = (free_port(), free_port());
    let tansu = tansu_advertising(plain, tls);
    let terminator = tls_terminator(&dir, tls, plain);
    let ca = dir.join("ca.pem").display().to_string();
    let brokers = format!("127.0.0.1:{tls}");
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("security.protocol", "ssl")
        .set("ssl.ca.location", &ca)
        .create()
        .unwrap();
    for t in admin
        .create_topics(
            &[NewTopic::new("secure", 1, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .unwrap()
    {
        t.unwrap();
    }
    let db = TestDb::migrated();
    let msgs: Vec<Message> = (0..10)
        .map(|i| Message::new("secure").payload(&i))
        .collect();
    postbox::enqueue_many(&mut db.conn(), &msgs).unwrap();

    // A CA that did not sign the broker's certificate: nothing is sent, no attempt is used.
    let untrusted = producer(
        &brokers,
        &properties(&[
            ("security.protocol", "ssl"),
            (
                "ssl.ca.location",
                &dir.join("other-ca.pem").display().to_string(),
            ),
            ("message.timeout.ms", "3000"),
        ]),
    )
    .unwrap();
    let report = drain_through(&db, untrusted, |r| r.released >= 10).await;
    assert_eq!(
        report.delivered, 0,
        "delivered to a broker it could not verify"
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE attempts = 0"),
        10
    );

    // The broker's CA: delivered over TLS.
    let trusted = producer(
        &brokers,
        &properties(&[("security.protocol", "ssl"), ("ssl.ca.location", &ca)]),
    )
    .unwrap();
    drain_through(&db, trusted, |r| r.delivered == 10).await;
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
    drop((terminator, tansu));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_kafka_sink_is_built_with_tls_and_sasl_scram_and_oauthbearer() {
    for (protocol, mechanism) in [
        ("sasl_ssl", "SCRAM-SHA-512"),
        ("sasl_ssl", "SCRAM-SHA-256"),
        ("sasl_ssl", "OAUTHBEARER"),
        ("ssl", "PLAIN"),
    ] {
        let mut props = vec![
            ("security.protocol", protocol),
            ("sasl.mechanism", mechanism),
            ("sasl.username", "relay"),
            ("sasl.password", "secret"),
        ];
        if mechanism == "OAUTHBEARER" {
            props.truncate(2);
            props.push(("sasl.oauthbearer.config", "principal=relay"));
            props.push(("enable.sasl.oauthbearer.unsecure.jwt", "true"));
        }
        if let Err(e) = producer("127.0.0.1:1", &properties(&props)) {
            panic!("{protocol} with {mechanism}: {e}");
        }
    }
}

/// One relay process against everything hostile at once, with a writer running: rows it cannot
/// read (a payload deeper than serde reads, a key that is not UTF-8), a payload Kafka refuses for
/// its size, keys full of escape sequences, a key with NUL (refused at enqueue), a Kafka topic the
/// cluster refuses next to a good one, a notifier connection gone silent and a reader of stdout
/// that stalls. The ledger must be exact: every good message delivered once, in order per key;
/// every bad one dead-lettered with its reason; health answering throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_hostile_input_and_networks_with_a_writer_running() {
    use std::io::BufRead;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    let broker = Broker::start();
    broker.create_topic("good.orders", 1).await;
    // SQL_ASCII: text is stored as given, so a key that is not UTF-8 can be written with SQL.
    let db = TestDb::migrated_with_encoding("SQL_ASCII");
    db.exec("CREATE TABLE public.produced (id bigint PRIMARY KEY, good bool NOT NULL, what text)");
    let proxy = common::proxy::FreezingProxy::start();
    let metrics = free_port();
    let config = std::env::temp_dir().join(format!("postbox-hostile-{}.toml", fastrand::u64(..)));
    std::fs::write(
        &config,
        format!(
            r#"
[sinks.kafka]
brokers = "{}"

[sinks.kafka.properties]
"allow.auto.create.topics" = "false"
"topic.metadata.propagation.max.ms" = "100"
"message.timeout.ms" = "10000"

[[routes]]
topics = ["good.*", "acl.*"]
sink = "kafka"

[[routes]]
topics = ["*"]
sink = "log"
"#,
            broker.brokers()
        ),
    )
    .unwrap();
    let mut relay = common::hermetic(env!("CARGO_BIN_EXE_postbox"))
        .args(["--config", config.to_str().unwrap()])
        .args(["--database-url", &proxy.url(&db), "run"])
        .env("POSTBOX_POLL_INTERVAL", "200ms")
        .env("POSTBOX_METRICS_LISTEN", format!("127.0.0.1:{metrics}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // What reached stdout, in order; the reader can be stalled.
    let stalled = Arc::new(AtomicBool::new(false));
    type Lines = Arc<Mutex<Vec<(i64, Option<String>)>>>;
    let logged: Lines = Default::default();
    let reader = {
        let (out, stalled, logged) = (
            relay.stdout.take().unwrap(),
            stalled.clone(),
            logged.clone(),
        );
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines() {
                while stalled.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(10));
                }
                let Ok(line) = line else { break };
                let v: serde_json::Value = serde_json::from_str(&line).unwrap();
                let key = v["key"].as_str().map(str::to_owned);
                logged
                    .lock()
                    .unwrap()
                    .push((v["id"].as_i64().unwrap(), key));
            }
        })
    };
    let healthy = || common::http_get(metrics, "/healthz").is_some_and(|(c, _)| c == 200);
    assert!(eventually(Duration::from_secs(20), || async { healthy() }).await);
    assert!(eventually(Duration::from_secs(20), || async { proxy.listeners() >= 1 }).await);

    // The writer: good messages on ordered keys (escape sequences in some), with a bad row now
    // and then in the same transaction, each recorded in the ledger by the transaction itself.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (url, stop) = (db.url.clone(), stop.clone());
        std::thread::spawn(move || {
            use diesel::connection::SimpleConnection;
            use diesel::{Connection, RunQueryDsl};
            let mut conn = diesel::PgConnection::establish(&url).unwrap();
            let mut i = 0u64;
            while !stop.load(Ordering::Acquire) {
                i += 1;
                conn.transaction::<_, postbox::Error, _>(|c| {
                    let good = [
                        Message::new("good.orders").key(format!("k{}", i % 4)).ordered(),
                        Message::new("log.events").key(format!("e\u{1b}[2J{}", i % 3)).ordered(),
                        Message::new("log.plain"),
                    ];
                    // Log lines of about 1 KiB: a stalled reader's pipe fills within moments.
                    let body = serde_json::json!({ "n": i, "pad": "x".repeat(1000) });
                    for m in &good {
                        let id = postbox::enqueue(c, &m.clone().payload(&body))?.id().unwrap();
                        c.batch_execute(&format!(
                            "INSERT INTO public.produced VALUES ({id}, true, 'good')"
                        ))?;
                    }
                    let bad = match i % 40 {
                        1 => Some(("deep", "'log.events', E'e\\x1b[2J0', true, (repeat('[', 200) || repeat(']', 200))::jsonb")),
                        11 => Some(("not utf-8", "'log.events', E'bad\\xff', true, '1'::jsonb")),
                        21 => Some(("too large for kafka", "'good.orders', 'k0', true, to_jsonb(repeat('x', 2000000))")),
                        31 => Some(("refused topic", "'acl.audit', NULL, false, '1'::jsonb")),
                        _ => None,
                    };
                    if let Some((what, values)) = bad {
                        // A refused topic is not a bad message: it waits for the topic.
                        let good = what == "refused topic";
                        c.batch_execute(&format!(
                            "WITH m AS (INSERT INTO postbox.messages (topic, key, ordered, payload)
                                        VALUES ({values}) RETURNING id)
                             INSERT INTO public.produced SELECT id, {good}, '{what}' FROM m"
                        ))?;
                    }
                    Ok(())
                })
                .unwrap();
                // A key with NUL is refused at enqueue, naming the field; nothing is written.
                if i.is_multiple_of(50) {
                    let refused =
                        postbox::enqueue(&mut conn, &Message::new("log.events").key("a\0b"));
                    assert!(
                        matches!(refused, Err(postbox::Error::InvalidMessage(_))),
                        "{refused:?}"
                    );
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let _ = diesel::sql_query("SELECT 1").execute(&mut conn);
            i
        })
    };

    tokio::time::sleep(Duration::from_secs(2)).await;
    // The notifier's connection goes silent.
    assert!(proxy.freeze_listeners() >= 1);
    tokio::time::sleep(Duration::from_secs(2)).await;
    // stdout stops being read for 3 s: the log route is down meanwhile, the relay is not.
    stalled.store(true, Ordering::Release);
    let sink_down = eventually(Duration::from_secs(60), || async {
        common::http_get(metrics, "/metrics")
            .is_some_and(|(_, b)| b.contains("postbox_sink_up{sink=\"log\"} 0"))
    })
    .await;
    assert!(healthy(), "/healthz failed with stdout stalled");
    stalled.store(false, Ordering::Release);
    assert!(sink_down, "the log sink never reported the stalled stdout");
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Release);
    let turns = writer.join().unwrap();
    assert!(turns > 100, "the writer made only {turns} transactions");
    // The notifier found its silent connection out and replaced it.
    assert!(
        eventually(Duration::from_secs(30), || async { proxy.listeners() >= 2 }).await,
        "the notifier never replaced its silent connection"
    );
    // Everything but the refused topic's messages settles; then the topic is created.
    let unsettled = "SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v";
    let refused =
        "SELECT count(*) AS v FROM postbox.messages WHERE topic = 'acl.audit' AND attempts = 0";
    assert!(
        eventually(Duration::from_secs(60), || async {
            db.scalar(unsettled) == db.scalar(refused)
        })
        .await,
        "{} messages left, {} of the refused topic",
        db.scalar(unsettled),
        db.scalar(refused)
    );
    assert!(db.scalar(refused) > 0);
    broker.create_topic("acl.audit", 1).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            db.scalar(unsettled) == 0
        })
        .await,
        "{} messages left",
        db.scalar(unsettled)
    );
    assert!(healthy());
    let _ = Command::new("kill")
        .args(["-TERM", &relay.id().to_string()])
        .status();
    assert!(relay.wait().unwrap().success());
    reader.join().unwrap();
    let _ = std::fs::remove_file(&config);

    // The ledger.
    let good_ids = |sql: &str| -> Vec<i64> {
        #[derive(diesel::QueryableByName)]
        struct Id {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            id: i64,
        }
        use diesel::RunQueryDsl;
        diesel::sql_query(sql)
            .load::<Id>(&mut db.conn())
            .unwrap()
            .into_iter()
            .map(|r| r.id)
            .collect()
    };
    let mut delivered: HashMap<i64, u32> = HashMap::new();
    let logged = logged.lock().unwrap().clone();
    for (id, _) in &logged {
        *delivered.entry(*id).or_default() += 1;
    }
    let orders = broker.consume_ids("good.orders", 1);
    let audit = broker.consume_ids("acl.audit", 1);
    for (id, n) in orders.iter().chain(audit.iter()) {
        *delivered.entry(*id).or_default() += n;
    }
    let good = good_ids("SELECT id FROM public.produced WHERE good");
    let missing: Vec<i64> = good
        .iter()
        .filter(|id| !delivered.contains_key(id))
        .copied()
        .collect();
    let twice: Vec<(i64, u32)> = delivered
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(i, n)| (*i, *n))
        .collect();
    eprintln!(
        "hostile chaos: {turns} writer transactions, {} good messages ({} to Kafka), {} bad, {} dead; missing {}, delivered twice {}",
        good.len(),
        orders.len() + audit.len(),
        good_ids("SELECT id FROM public.produced WHERE NOT good").len(),
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters"),
        missing.len(),
        twice.len()
    );
    assert!(
        missing.is_empty(),
        "good messages not delivered: {missing:?}"
    );
    let sources: Vec<String> = twice
        .iter()
        .map(|(id, _)| {
            format!(
                "#{id}: log {}, kafka {}",
                logged.iter().filter(|(l, _)| l == id).count(),
                orders.get(id).or(audit.get(id)).copied().unwrap_or(0)
            )
        })
        .collect();
    assert!(twice.is_empty(), "delivered more than once: {sources:?}");
    // Every bad row is a dead letter, with the reason.
    for (what, reason) in [
        ("deep", "payload nested deeper"),
        ("not utf-8", "key not UTF-8"),
        ("too large for kafka", "kafka:"),
    ] {
        let ids = good_ids(&format!(
            "SELECT id FROM public.produced WHERE what = '{what}'"
        ));
        assert!(!ids.is_empty(), "no {what} row was written");
        for id in ids {
            let n = db.scalar(&format!(
                "SELECT count(*) AS v FROM postbox.dead_letters WHERE id = {id} AND strpos(reason, '{reason}') > 0"
            ));
            assert_eq!(
                n, 1,
                "{what} #{id} is not a dead letter with a reason naming {reason:?}"
            );
        }
    }
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters"),
        db.scalar("SELECT count(*) AS v FROM public.produced WHERE NOT good")
    );
    // In order per key: the log's lines, and Kafka's partition.
    let mut last: HashMap<String, i64> = HashMap::new();
    for (id, key) in &logged {
        if let Some(k) = key {
            let before = last.insert(k.clone(), *id).unwrap_or(0);
            assert!(before < *id, "key {k:?}: {id} after {before}");
        }
    }
    let mut last: HashMap<String, i64> = HashMap::new();
    for c in broker.consume("good.orders", orders.len()) {
        let id: i64 = c.headers["postbox-id"].parse().unwrap();
        let k = c.key.clone().unwrap();
        let before = last.insert(k.clone(), id).unwrap_or(0);
        assert!(before < id, "kafka key {k}: {id} after {before}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_route_runs_over_sasl_ssl_with_scram_sha_512() {
    let dir = std::env::temp_dir().join(format!("postbox-kafka-scram-{}", fastrand::u64(..)));
    std::fs::create_dir_all(&dir).unwrap();
    test_certificates(&dir);
    // tansu (no authentication of its own) behind a SCRAM-SHA-512 front, behind TLS: the client
    // meets TLS, then SASL, then Kafka, as on a secured cluster. tansu advertises the TLS port.
    let (plain, tls) = (free_port(), free_port());
    let _broker = tansu_advertising(plain, tls);
    let front = common::scram_front::start(format!("127.0.0.1:{plain}"), "relay", "s3cret pass");
    let _terminator = tls_terminator(&dir, tls, front);
    // The topic, made by a client that authenticates as the relay does.
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", format!("127.0.0.1:{tls}"))
        .set("security.protocol", "sasl_ssl")
        .set("sasl.mechanism", "SCRAM-SHA-512")
        .set("sasl.username", "relay")
        .set("sasl.password", "s3cret pass")
        .set("ssl.ca.location", dir.join("ca.pem").display().to_string())
        .create()
        .unwrap();
    let made = admin
        .create_topics(
            &[NewTopic::new("secure.scram", 1, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .unwrap();
    for t in made {
        t.unwrap();
    }
    let ca = dir.join("ca.pem").display().to_string();
    let brokers = format!("127.0.0.1:{tls}");
    let scram = |password: &str| {
        producer(
            &brokers,
            &properties(&[
                ("security.protocol", "sasl_ssl"),
                ("sasl.mechanism", "SCRAM-SHA-512"),
                ("sasl.username", "relay"),
                ("sasl.password", password),
                ("ssl.ca.location", &ca),
                ("message.timeout.ms", "5000"),
            ]),
        )
        .unwrap()
    };
    let db = TestDb::migrated();
    let msgs: Vec<Message> = (0..10)
        .map(|i| {
            Message::new("secure.scram")
                .key(format!("k{}", i % 2))
                .payload(&i)
        })
        .collect();
    postbox::enqueue_many(&mut db.conn(), &msgs).unwrap();

    // A wrong password: the broker refuses the session; nothing delivered, no attempt used.
    assert_eq!(
        drain_through(&db, scram("wrong"), |r| r.released >= 10)
            .await
            .delivered,
        0
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE attempts = 0"),
        10
    );

    // The right one: SCRAM-SHA-512 over TLS, every message acknowledged by the broker.
    drain_through(&db, scram("s3cret pass"), |r| r.delivered == 10).await;
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
    let _ = std::fs::remove_dir_all(&dir);
}
