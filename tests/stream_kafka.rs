//! Stream mode to Kafka: published messages reach a real Kafka-protocol broker (tansu) with their
//! stable ids, per key in commit order; a record Kafka refuses for good is dead-lettered and
//! replayable into the table; a broker outage pauses the stream and nothing is skipped.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::broker::Broker;
use common::relay::{Relay, wait};
use common::{OwnServer, TestDb, hermetic};
use diesel::Connection;
use postbox::Message;

fn kafka_relay(db: &TestDb, broker: &Broker, properties: &str) -> Relay {
    Relay::start(
        &db.url,
        &format!(
            "[sinks.kafka]\nbrokers = \"{}\"\nproperties = {{ {properties} }}\n[[routes]]\ntopics = [\"orders\"]\nsink = \"kafka\"\n",
            broker.brokers()
        ),
    )
}

async fn logical_db(server: &OwnServer) -> TestDb {
    server.stream_db().await
}

fn order(key: &str, n: i64) -> Message {
    Message::new("orders")
        .key(key)
        .payload(&serde_json::json!({ "n": n }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_messages_reach_kafka_with_stable_ids_in_commit_order_and_refused_ones_are_dead_lettered()
 {
    let server = OwnServer::start(&["wal_level=logical"]);
    let db = logical_db(&server).await;
    let broker = Broker::start();
    broker.create_topic("orders", 3).await;
    let relay = kafka_relay(&db, &broker, r#""message.max.bytes" = "20000""#);
    let mut conn = db.conn();
    let mut n = 0;
    for tx in 0..5 {
        conn.transaction(|c| {
            let mut msgs: Vec<Message> = (0..4).map(|i| order(&format!("k{i}"), n + i)).collect();
            if tx == 2 {
                // Larger than the producer takes: Kafka can never store it.
                msgs.push(
                    Message::new("orders")
                        .key("k0")
                        .payload(&"x".repeat(50_000)),
                );
                // No route serves it.
                msgs.push(Message::new("elsewhere").payload(&1));
            }
            postbox::publish_many(c, &msgs)
        })
        .unwrap();
        n += 4;
    }
    let got = broker.consume("orders", 20);
    assert_eq!(got.len(), 20, "{}", relay.log());
    let mut by_key: HashMap<String, Vec<i64>> = HashMap::new();
    for r in &got {
        let id = &r.headers["postbox-id"];
        assert_eq!(id.len(), 25, "{id}");
        assert_eq!(r.headers["postbox-topic"], "orders");
        by_key
            .entry(r.key.clone().unwrap())
            .or_default()
            .push(r.payload["n"].as_i64().unwrap());
    }
    for (k, ns) in &by_key {
        assert!(ns.windows(2).all(|w| w[0] < w[1]), "{k}: {ns:?}");
    }
    assert!(wait(Duration::from_secs(20), || db
        .scalar("SELECT count(*) AS v FROM postbox.dead_letters")
        == 2));
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters WHERE reason LIKE 'kafka:%' AND headers ? 'postbox-stream-id'"),
        1
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters WHERE reason = 'stream: no route serves topic \"elsewhere\"'"),
        1
    );
    // Replayed into the table queue, as any dead letter.
    let out = hermetic(env!("CARGO_BIN_EXE_postbox"))
        .args(["dead", "replay", "--topic", "elsewhere"])
        .env("POSTBOX_DATABASE_URL", &db.url)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE topic = 'elsewhere'"),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_pauses_the_stream_and_nothing_is_skipped() {
    let server = OwnServer::start(&["wal_level=logical"]);
    let db = logical_db(&server).await;
    let broker = Broker::start();
    broker.create_topic("orders", 1).await;
    let relay = kafka_relay(&db, &broker, r#""message.timeout.ms" = "2000""#);
    let mut conn = db.conn();
    postbox::publish(&mut conn, &order("k", 0)).unwrap();
    assert_eq!(broker.consume("orders", 1).len(), 1, "{}", relay.log());
    // The broker stops answering (SIGSTOP: the process and its state stay, as behind a network
    // partition; memory-storage tansu forgets producer ids when restarted, which a real broker
    // does not).
    broker.signal("STOP");
    for n in 1..=5 {
        postbox::publish(&mut conn, &order("k", n)).unwrap();
    }
    assert!(
        wait(Duration::from_secs(30), || relay
            .log()
            .contains("stream: sink unavailable, waiting")),
        "{}",
        relay.log()
    );
    broker.signal("CONT");
    // Until all six are there (a record the broker wrote before it stopped answering is sent
    // again: a duplicate).
    let got = broker.consume_until(
        "orders",
        |records| {
            records
                .iter()
                .map(|r| r.payload["n"].as_i64().unwrap())
                .collect::<HashSet<_>>()
                .len()
                >= 6
        },
        Duration::ZERO,
    );
    let ns: Vec<i64> = got
        .iter()
        .map(|r| r.payload["n"].as_i64().unwrap())
        .collect();
    let first: Vec<i64> = ns.iter().fold(Vec::new(), |mut acc, n| {
        if !acc.contains(n) {
            acc.push(*n);
        }
        acc
    });
    assert_eq!(first, vec![0, 1, 2, 3, 4, 5], "{ns:?}: {}", relay.log());
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters"),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_mid_stream_loses_nothing_in_kafka_and_redelivers_with_the_same_ids() {
    let server = OwnServer::start(&["wal_level=logical"]);
    let db = logical_db(&server).await;
    let broker = Broker::start();
    broker.create_topic("orders", 3).await;
    let mut relays = vec![kafka_relay(&db, &broker, "")];
    // The writer: transactions of 1 to 3 messages over 6 keys, each message numbered; what
    // committed is recorded after the commit.
    let committed: Arc<Mutex<Vec<i64>>> = Arc::default();
    let done = Arc::new(AtomicBool::new(false));
    let writer = {
        let (url, committed, done) = (db.url.clone(), committed.clone(), done.clone());
        std::thread::spawn(move || {
            let mut conn = diesel::PgConnection::establish(&url).unwrap();
            let mut n = 0i64;
            while !done.load(Ordering::Relaxed) {
                let size = 1 + (n % 3);
                let msgs: Vec<Message> = (n..n + size)
                    .map(|i| order(&format!("k{}", i % 6), i))
                    .collect();
                conn.transaction(|c| postbox::publish_many(c, &msgs))
                    .unwrap();
                committed.lock().unwrap().extend(n..n + size);
                n += size;
            }
        })
    };
    common::relay::kill_while_writing(
        &mut relays,
        || committed.lock().unwrap().len(),
        || kafka_relay(&db, &broker, ""),
    );
    done.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    let all: HashSet<i64> = committed.lock().unwrap().iter().copied().collect();
    // Read back until every committed message is there, then a second more for late duplicates.
    let (mut missing, mut read) = (all.clone(), 0);
    let got = broker.consume_until(
        "orders",
        |records| {
            for r in &records[read..] {
                missing.remove(&r.payload["n"].as_i64().unwrap());
            }
            read = records.len();
            missing.is_empty()
        },
        Duration::from_secs(1),
    );
    let ns: HashSet<i64> = got
        .iter()
        .map(|r| r.payload["n"].as_i64().unwrap())
        .collect();
    let lost: Vec<_> = all.difference(&ns).take(10).collect();
    assert!(
        lost.is_empty(),
        "lost {lost:?}: {}",
        relays.last().unwrap().log()
    );
    // Per key, first deliveries come in commit order; a redelivery carries its first id.
    let mut ids: HashMap<i64, String> = HashMap::new();
    let mut last: HashMap<String, i64> = HashMap::new();
    for r in &got {
        let (key, n) = (r.key.clone().unwrap(), r.payload["n"].as_i64().unwrap());
        let id = r.headers["postbox-id"].clone();
        match ids.get(&n) {
            Some(first) => assert_eq!(first, &id, "message {n} redelivered with another id"),
            None => {
                ids.insert(n, id);
                let prev = last.insert(key.clone(), n);
                assert!(prev.is_none_or(|p| p < n), "key {key}: {n} after {prev:?}");
            }
        }
    }
    assert_eq!(
        ids.values().collect::<HashSet<_>>().len(),
        ids.len(),
        "ids are unique"
    );
    // Redelivered: at most what was in flight at each kill (a batch sent, one read, and the
    // producer's queue).
    let duplicates = got.len() - ns.len();
    assert!(duplicates <= 3 * 3000, "{duplicates} duplicates");
    eprintln!(
        "{} committed, {} records in Kafka, {duplicates} duplicates over 3 kills",
        all.len(),
        got.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_kafka_refuses_whose_content_postgresql_cannot_store_is_dead_lettered_and_the_stream_goes_on()
 {
    let server = OwnServer::start(&["wal_level=logical"]);
    let db = logical_db(&server).await;
    let broker = Broker::start();
    broker.create_topic("orders", 1).await;
    let relay = kafka_relay(&db, &broker, r#""message.max.bytes" = "20000""#);
    // A plain SQL writer's message Kafka refuses for good (too large), with "\u0000" in it.
    let big = "x".repeat(30_000);
    db.exec(&format!(
        r#"SELECT pg_logical_emit_message(true, 'postbox', '{{"v":1,"topic":"orders","key":"k","payload":{{"a":"\u0000{big}"}}}}')"#
    ));
    postbox::publish(&mut db.conn(), &order("k", 1)).unwrap();
    let got = broker.consume("orders", 1);
    assert_eq!(got.len(), 1, "{}", relay.log());
    assert_eq!(got[0].payload["n"], 1);
    assert!(
        wait(Duration::from_secs(20), || {
            db.scalar(
            "SELECT count(*) AS v FROM postbox.dead_letters
             WHERE reason LIKE 'kafka:%replaced with U+FFFD' AND payload->>'a' LIKE U&'\\FFFD' || 'xxx%'"
        ) == 1
        }),
        "{}",
        relay.log()
    );
}
