//! Record formats read by clients no one here wrote: a relay process with Debezium and CloudEvents
//! routes (and topic templates, tombstones) sends table messages (`enqueue`, plain SQL) and stream
//! messages (`publish`, plain `pg_logical_emit_message`) to a real Kafka-protocol broker (tansu);
//! Python's confluent-kafka reads them as the Debezium example consumer does and through the
//! CloudEvents SDK's Kafka binding, and the npm kafkajs consumer reads the same topics and must
//! agree on every key, partition, header and value.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::process::Command;
use std::time::Duration;

use common::broker::Broker;
use common::relay::{Relay, wait};
use common::{OwnServer, TestDb};
use diesel::Connection;
use postbox::Message;
use serde_json::{Value, json};

/// The clients' directory (scripts/ensure-clients.sh installs them when missing).
fn clients() -> String {
    if let Ok(d) = std::env::var("POSTBOX_CLIENTS_DIR") {
        return d;
    }
    let out = Command::new("bash")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/ensure-clients.sh"
        ))
        .output()
        .expect("run scripts/ensure-clients.sh");
    assert!(
        out.status.success(),
        "scripts/ensure-clients.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

fn run_json(cmd: &mut Command) -> Value {
    let out = cmd.output().expect("run a client");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{cmd:?} printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

const ROUTES: &str = r#"
[[routes]]
topics = ["shop.order"]
sink = "kafka"
format = "debezium"
kafka_topic = "outbox.event.{topic[-1]}"

[[routes]]
topics = ["shop.expanded"]
sink = "kafka"
format = "debezium"
expand_payload = true
kafka_topic = "outbox.expanded"

[[routes]]
topics = ["shop.customer"]
sink = "kafka"
format = "debezium"
tombstone_on_empty = true
kafka_topic = "customers"

[[routes]]
topics = ["shop.payment"]
sink = "kafka"
format = "cloudevents"
source = "/shop/payments"
kafka_topic = "ce-binary"

[[routes]]
topics = ["shop.refund"]
sink = "kafka"
format = "cloudevents"
content_mode = "structured"
source = "urn:shop:refunds"
kafka_topic = "ce-structured"

[[routes]]
topics = ["shop.routed"]
sink = "kafka"
kafka_topic = "routed-{header:region}"
"#;

const EXPECT: [(&str, usize); 6] = [
    ("outbox.event.order", 6),
    ("outbox.expanded", 1),
    ("customers", 2),
    ("ce-binary", 3),
    ("ce-structured", 2),
    ("routed-eu", 1),
];

fn emit(db: &TestDb, content: Value) {
    db.exec(&format!(
        "SELECT pg_logical_emit_message(true, 'postbox', '{}')",
        content.to_string().replace('\'', "''")
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debezium_and_cloudevents_records_are_read_by_their_own_clients_from_table_and_stream() {
    let clients = clients();
    let server = OwnServer::start(&["wal_level=logical"]);
    let db = server.stream_db().await;
    let broker = Broker::start();
    for (topic, partitions) in [
        ("outbox.event.order", 3),
        ("outbox.expanded", 1),
        ("ce-binary", 3),
        ("ce-structured", 1),
        ("routed-eu", 1),
    ] {
        broker.create_topic(topic, partitions).await;
    }
    broker
        .create_topic_with("customers", 1, &[("cleanup.policy", "compact")])
        .await;
    let relay = Relay::start(
        &db.url,
        &format!(
            "[sinks.kafka]\nbrokers = \"{}\"\nproperties = {{ \"allow.auto.create.topics\" = \"false\" }}\n{ROUTES}",
            broker.brokers()
        ),
    );

    // Table messages.
    let order = |key: &str, n: i64, kind: &str| {
        Message::new("shop.order")
            .key(key)
            .header("type", kind)
            .header("trace", format!("t{n}"))
            .payload(&json!({ "order": n }))
    };
    let table_ids = common::enqueue(
        &db,
        vec![
            order("o-1", 1, "OrderCreated"),
            order("o-2", 2, "OrderCreated"),
            order("o-1", 3, "OrderPaid"),
            Message::new("shop.expanded")
                .key("x-1")
                .payload(&json!({"nested": {"a": [1, 2]}})),
            // Ordered: a compacted topic keeps the last record of a key, so the tombstone must
            // come after the value it deletes.
            Message::new("shop.customer")
                .key("c-1")
                .ordered()
                .payload(&json!({"name": "Ada"})),
            Message::new("shop.customer")
                .key("c-1")
                .ordered()
                .payload(&Value::Null),
            Message::new("shop.payment")
                .key("p-1")
                .header("type", "com.example.payment.captured")
                .header("ce_region", "eu")
                .header(
                    "traceparent",
                    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                )
                .payload(&json!({"amount": 42})),
            Message::new("shop.payment")
                .header("ce_subject", "invoice-9")
                .payload(&json!({"amount": 7})),
            Message::new("shop.refund")
                .key("r-1")
                .header("type", "com.example.refund.issued")
                .header("ce_region", "us")
                .payload(&json!({"amount": 3})),
            Message::new("shop.routed")
                .header("region", "eu")
                .payload(&json!(1)),
            Message::new("shop.routed")
                .header("region", "eu/west")
                .payload(&json!(2)),
            Message::new("shop.routed").payload(&json!(3)),
        ],
    );
    // A plain SQL enqueue with the app's creation time: the record's timestamp.
    db.exec(
        "INSERT INTO postbox.messages (topic, key, payload, created_at) \
         VALUES ('shop.order', 'o-4', '{\"order\": 4}', '2026-01-02T03:04:05.678Z')",
    );

    // Stream messages: publish, and plain pg_logical_emit_message.
    db.conn()
        .transaction(|c| {
            postbox::publish_many(
                c,
                &[
                    order("o-5", 5, "OrderShipped"),
                    Message::new("shop.payment")
                        .key("p-2")
                        .header("type", "com.example.payment.refunded")
                        .payload(&json!({"amount": 5})),
                    Message::new("shop.refund")
                        .key("r-2")
                        .payload(&json!({"amount": 1})),
                ],
            )
        })
        .unwrap();
    emit(
        &db,
        json!({"v": 1, "topic": "shop.order", "key": "o-6", "payload": {"order": 6},
               "headers": {"type": "OrderShipped"}, "created_at": "2026-02-03T04:05:06.789Z"}),
    );
    // A ce_ header the binding cannot carry, past publish's check: dead-lettered, not sent broken.
    emit(
        &db,
        json!({"v": 1, "topic": "shop.payment", "key": "p-3", "headers": {"ce_Bad-Name": "x"}}),
    );

    // Python: the Debezium example consumer's reading and the CloudEvents SDK.
    let mut python = Command::new(format!("{clients}/venv/bin/python"));
    python
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/clients/read.py"
        ))
        .args(["--brokers", &broker.brokers()]);
    for (t, n) in EXPECT {
        python.args(["--expect", &format!("{t}={n}")]);
    }
    python.args([
        "--debezium",
        "outbox.event.order:string",
        "--debezium",
        "outbox.expanded:expanded",
        "--debezium",
        "customers:string",
        "--cloudevents",
        "ce-binary",
        "--cloudevents",
        "ce-structured",
    ]);
    let py = run_json(&mut python);
    for (t, n) in EXPECT {
        assert_eq!(
            py["raw"][t].as_array().map(Vec::len),
            Some(n),
            "{t}: {}\n{}",
            py["raw"][t],
            relay.log()
        );
    }

    // Debezium: id, eventType, aggregate id and the payload parsed from the string.
    let orders = &py["debezium"]["outbox.event.order"];
    assert_eq!(orders["duplicates"], 0);
    let mut events: Vec<&Value> = orders["events"].as_array().unwrap().iter().collect();
    events.sort_by_key(|e| e["payload"]["order"].as_i64());
    let got: Vec<(Option<&str>, Option<&str>, i64)> = events
        .iter()
        .map(|e| {
            (
                e["aggregateid"].as_str(),
                e["eventType"].as_str(),
                e["payload"]["order"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (Some("o-1"), Some("OrderCreated"), 1),
            (Some("o-2"), Some("OrderCreated"), 2),
            (Some("o-1"), Some("OrderPaid"), 3),
            (Some("o-4"), None, 4),
            (Some("o-5"), Some("OrderShipped"), 5),
            (Some("o-6"), Some("OrderShipped"), 6),
        ]
    );
    // Table messages carry their row id; stream messages their stable stream id.
    for (i, e) in events.iter().take(3).enumerate() {
        assert_eq!(e["id"], table_ids[i].to_string(), "{e}");
    }
    let stream_ids: HashSet<&str> = events[4..]
        .iter()
        .map(|e| e["id"].as_str().unwrap())
        .collect();
    assert_eq!(stream_ids.len(), 2);
    assert!(
        stream_ids.iter().all(|id| id.parse::<i64>().is_err()),
        "{stream_ids:?}"
    );
    // The record timestamp is the creation time (the app's, in both sources), not the send time.
    let raw_orders = py["raw"]["outbox.event.order"].as_array().unwrap();
    let by_key = |key: &str| -> &Value {
        raw_orders
            .iter()
            .find(|r| r["key"] == key)
            .unwrap_or_else(|| panic!("no record with key {key}"))
    };
    for (key, at) in [
        ("o-4", "2026-01-02T03:04:05.678Z"),
        ("o-6", "2026-02-03T04:05:06.789Z"),
    ] {
        let r = by_key(key);
        assert_eq!(r["create_time"], true);
        let ms = chrono::DateTime::parse_from_rfc3339(at)
            .unwrap()
            .timestamp_millis();
        assert_eq!(r["timestamp"], ms, "{r}");
    }
    // The key is the aggregate id: one key, one partition, in order.
    let o1: Vec<&Value> = raw_orders.iter().filter(|r| r["key"] == "o-1").collect();
    assert!(o1.iter().all(|r| r["partition"] == o1[0]["partition"]));
    assert!(o1[0]["offset"].as_i64() < o1[1]["offset"].as_i64());
    for n in [1, 2, 3, 5] {
        assert!(
            raw_orders.iter().any(|r| r["headers"]
                .as_array()
                .unwrap()
                .contains(&json!(["trace", format!("t{n}")]))),
            "other headers pass on: {raw_orders:?}"
        );
    }

    let expanded = &py["debezium"]["outbox.expanded"]["events"][0];
    assert_eq!(expanded["payload"], json!({"nested": {"a": [1, 2]}}));
    assert_eq!(
        py["raw"]["outbox.expanded"][0]["value"],
        r#"{"nested":{"a":[1,2]}}"#
    );

    // The compacted topic: the empty payload is a tombstone (no value).
    let customers = &py["debezium"]["customers"]["events"];
    assert_eq!(customers[0]["payload"], json!({"name": "Ada"}));
    assert_eq!(customers[1]["tombstone"], true);
    assert_eq!(py["raw"]["customers"][1]["value"], Value::Null);
    assert_eq!(py["raw"]["customers"][1]["key"], "c-1");

    // CloudEvents, parsed and validated by the SDK's Kafka binding.
    let ce = |topic: &str| -> BTreeMap<String, Value> {
        py["cloudevents"][topic]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    e["attributes"]["id"].as_str().unwrap().to_owned(),
                    e.clone(),
                )
            })
            .collect()
    };
    let binary = ce("ce-binary");
    let captured = &binary[&table_ids[6].to_string()];
    assert_eq!(captured["mode"], "binary");
    let a = &captured["attributes"];
    assert_eq!(a["specversion"], "1.0");
    assert_eq!(a["source"], "/shop/payments");
    assert_eq!(a["type"], "com.example.payment.captured");
    assert_eq!(a.get("subject"), None, "no ce_subject header");
    assert_eq!(a["region"], "eu");
    assert_eq!(a["datacontenttype"], "application/json");
    assert_eq!(a["partitionkey"], "p-1");
    assert!(a["time"].as_str().unwrap().starts_with("20"), "{a}");
    assert_eq!(captured["data"], json!({"amount": 42}));
    let invoice = &binary[&table_ids[7].to_string()];
    assert_eq!(
        invoice["attributes"]["type"], "shop.payment",
        "no type header: the topic"
    );
    assert_eq!(invoice["attributes"]["subject"], "invoice-9");
    assert_eq!(invoice["attributes"].get("partitionkey"), None, "no key");
    let refunded = binary
        .values()
        .find(|e| e["attributes"]["type"] == "com.example.payment.refunded")
        .expect("the published payment event");
    assert_eq!(refunded["data"], json!({"amount": 5}));
    assert_eq!(refunded["attributes"]["partitionkey"], "p-2");
    let traceparent = py["raw"]["ce-binary"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["key"] == "p-1")
        .unwrap()["headers"]
        .as_array()
        .unwrap()
        .contains(&json!([
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        ]));
    assert!(traceparent, "other headers pass on as Kafka headers");

    let structured = ce("ce-structured");
    let issued = &structured[&table_ids[8].to_string()];
    assert_eq!(issued["mode"], "structured");
    assert_eq!(issued["attributes"]["source"], "urn:shop:refunds");
    assert_eq!(issued["attributes"]["type"], "com.example.refund.issued");
    assert_eq!(issued["attributes"]["region"], "us");
    assert_eq!(issued["attributes"]["partitionkey"], "r-1");
    assert_eq!(issued["data"], json!({"amount": 3}));
    assert!(
        structured
            .values()
            .any(|e| e["attributes"]["partitionkey"] == "r-2" && e["data"] == json!({"amount": 1})),
        "the published refund"
    );

    // Routed by a header: the good one arrived; the others are dead letters with their reason.
    assert_eq!(py["raw"]["routed-eu"][0]["value"], "1");
    assert!(
        wait(Duration::from_secs(30), || db
            .scalar("SELECT count(*) AS v FROM postbox.dead_letters")
            == 3),
        "{}",
        relay.log()
    );
    for pattern in [
        "%kafka topic \"routed-eu/west\"%",
        "%header \"region\" is missing%",
        "%ce_Bad-Name%",
    ] {
        assert_eq!(
            db.scalar(&format!(
                "SELECT count(*) AS v FROM postbox.dead_letters WHERE reason LIKE '{pattern}'"
            )),
            1,
            "{pattern}"
        );
    }

    // A second client, not built on librdkafka, agrees on every record.
    let mut node = Command::new("node");
    node.env("NODE_PATH", format!("{clients}/node_modules"))
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/clients/read.js"
        ))
        .arg(broker.brokers());
    for (t, n) in EXPECT {
        node.arg(format!("{t}={n}"));
    }
    let js = run_json(&mut node);
    for (t, _) in EXPECT {
        let view = |records: &Value| -> Vec<Value> {
            let mut v: Vec<Value> = records
                .as_array()
                .unwrap()
                .iter()
                .map(|r| {
                    let mut headers = r["headers"].as_array().unwrap().clone();
                    headers.sort_by_key(|h| h.to_string());
                    json!([
                        r["partition"],
                        r["offset"],
                        r["key"],
                        r["value"],
                        headers,
                        r["timestamp"]
                    ])
                })
                .collect();
            v.sort_by_key(|r| r.to_string());
            v
        };
        assert_eq!(view(&py["raw"][t]), view(&js[t]), "{t}");
    }
}
