//! Stream mode: `publish` writes into the WAL in the caller's transaction; a relay with `[stream]`
//! reads the slot and delivers in commit order, confirming only what its sink stored. Each test
//! runs a PostgreSQL of its own with `wal_level = logical`.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::proxy::FreezingProxy;
use common::relay::{Relay, wait};
use common::{OwnServer, TestDb, hermetic};
use diesel::{Connection, PgConnection, RunQueryDsl};
use postbox::{Error, InvalidMessage, Message};

fn logical() -> OwnServer {
    OwnServer::start(&["wal_level=logical", "max_wal_senders=10"])
}

fn setup(db: &TestDb) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let store = db.store().await;
        store
            .stream_setup("postbox", "postbox_stream")
            .await
            .unwrap();
    });
}

fn publish(conn: &mut PgConnection, topic: &str, key: &str, n: i64) {
    postbox::publish(
        conn,
        &Message::new(topic)
            .key(key)
            .payload(&serde_json::json!({ "n": n })),
    )
    .unwrap();
}

/// The commit position of a delivered message (its stream id starts with it, in hex).
fn commit_of(line: &serde_json::Value) -> i64 {
    i64::from_str_radix(&line["id"].as_str().unwrap()[..16], 16).unwrap()
}

fn ns(lines: &[serde_json::Value]) -> Vec<i64> {
    lines
        .iter()
        .map(|l| l["payload"]["n"].as_i64().unwrap())
        .collect()
}

#[test]
fn publish_refuses_where_nothing_would_read_and_what_stream_mode_cannot_honour() {
    // The shared server decodes no WAL (wal_level = replica): the transaction fails, with the
    // business write.
    let db = TestDb::migrated();
    db.exec("CREATE TABLE orders (id int)");
    let mut conn = db.conn();
    let e = conn
        .transaction(|c| {
            diesel::sql_query("INSERT INTO orders VALUES (1)").execute(c)?;
            postbox::publish(c, &Message::new("order.created"))
        })
        .unwrap_err();
    assert!(e.to_string().contains("wal_level is replica"), "{e}");
    assert_eq!(db.scalar("SELECT count(*) AS v FROM orders"), 0);

    for (msg, field) in [
        (Message::new("t").delay(Duration::from_secs(1)), "delay"),
        (Message::new("t").run_at(chrono::Utc::now()), "run_at"),
        (Message::new("t").priority(1), "priority"),
        (Message::new("t").dedup_key("d"), "dedup_key"),
        (Message::new("t").max_attempts(3), "max_attempts"),
    ] {
        match postbox::publish(&mut conn, &msg) {
            Err(Error::InvalidMessage(InvalidMessage::NotInStream { field: f })) => {
                assert_eq!(f, field)
            }
            other => panic!("{field}: {other:?}"),
        }
    }

    // A server that decodes the WAL but has no postbox slot in this database: refused too.
    let server = logical();
    let db = server.migrated();
    let mut conn = db.conn();
    let e = postbox::publish_many(&mut conn, &[Message::new("t")]).unwrap_err();
    assert!(e.to_string().contains("no postbox stream slot"), "{e}");
    setup(&db);
    postbox::publish_many(&mut conn, &[Message::new("t"), Message::new("u")]).unwrap();
    // A plain SQL writer needs nothing of postbox's.
    db.exec(r#"SELECT pg_logical_emit_message(true, 'postbox', '{"v":1,"topic":"t"}')"#);
}

#[test]
fn the_relay_delivers_in_commit_order_never_what_rolled_back_and_resumes_after_its_position() {
    let server = logical();
    let db = server.migrated();
    setup(&db);
    let mut relay = Relay::start(&db.url, "");
    // Two transactions that publish in one order and commit in the other; a third rolls back.
    let (mut a, mut b, mut c) = (db.conn(), db.conn(), db.conn());
    diesel::sql_query("BEGIN").execute(&mut a).unwrap();
    publish(&mut a, "orders", "k", 1);
    diesel::sql_query("BEGIN").execute(&mut b).unwrap();
    publish(&mut b, "orders", "k", 2);
    diesel::sql_query("COMMIT").execute(&mut b).unwrap();
    diesel::sql_query("BEGIN").execute(&mut c).unwrap();
    publish(&mut c, "orders", "k", 99);
    diesel::sql_query("ROLLBACK").execute(&mut c).unwrap();
    diesel::sql_query("COMMIT").execute(&mut a).unwrap();
    assert!(
        relay.wait_lines(2, Duration::from_secs(20)),
        "{}",
        relay.log()
    );
    let lines = relay.lines();
    assert_eq!(ns(&lines), vec![2, 1], "commit order: {lines:?}");
    for l in &lines {
        let id = l["id"].as_str().unwrap();
        assert_eq!(id.len(), 25, "{id}");
        assert_eq!(l["key"], "k");
    }
    // Stopped and started again: it resumes after what it confirmed (nothing twice).
    relay.terminate();
    let relay = Relay::start(&db.url, "");
    publish(&mut b, "orders", "k", 3);
    assert!(
        relay.wait_lines(1, Duration::from_secs(20)),
        "{}",
        relay.log()
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(ns(&relay.lines()), vec![3], "{}", relay.log());
}

/// The relay's peak resident memory (VmHWM), in MB.
fn peak_rss_mb(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

#[test]
fn a_relay_killed_mid_stream_with_writers_running_loses_nothing_and_keeps_each_key_in_order() {
    let server = logical();
    let db = server.migrated();
    setup(&db);
    let mut relays = vec![Relay::start(&db.url, "")];
    // The writer: transactions of 1 to 3 messages over 4 keys, each message numbered; what
    // committed is recorded after the commit.
    let committed: Arc<Mutex<Vec<(String, i64)>>> = Arc::default();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (url, committed, done) = (db.url.clone(), committed.clone(), done.clone());
        std::thread::spawn(move || {
            let mut conn = PgConnection::establish(&url).unwrap();
            let mut n = 0i64;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let size = 1 + (n % 3);
                let batch: Vec<(String, i64)> = (0..size)
                    .map(|i| (format!("k{}", (n + i) % 4), n + i))
                    .collect();
                let msgs: Vec<Message> = batch
                    .iter()
                    .map(|(k, n)| {
                        Message::new("ledger")
                            .key(k.clone())
                            .payload(&serde_json::json!({ "n": n }))
                    })
                    .collect();
                conn.transaction(|c| postbox::publish_many(c, &msgs))
                    .unwrap();
                committed.lock().unwrap().extend(batch);
                n += size;
            }
        })
    };
    common::relay::kill_while_writing(
        &mut relays,
        || committed.lock().unwrap().len(),
        || Relay::start(&db.url, ""),
    );
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
    let committed = committed.lock().unwrap().clone();
    let delivered = |relays: &[Relay]| -> Vec<serde_json::Value> {
        relays.iter().flat_map(|r| r.lines()).collect()
    };
    let all: std::collections::HashSet<i64> = committed.iter().map(|(_, n)| *n).collect();
    assert!(
        wait(Duration::from_secs(60), || {
            let got: std::collections::HashSet<i64> = ns(&delivered(&relays)).into_iter().collect();
            all.is_subset(&got)
        }),
        "lost: {}",
        relays.last().unwrap().log()
    );
    let lines = delivered(&relays);
    let duplicates = lines.len() - all.len();
    // Per key, the first delivery of each message comes in commit order.
    let mut seen = std::collections::HashSet::new();
    let mut last: HashMap<String, i64> = HashMap::new();
    for l in &lines {
        let (k, n) = (
            l["key"].as_str().unwrap().to_owned(),
            l["payload"]["n"].as_i64().unwrap(),
        );
        if seen.insert(n) {
            let prev = last.insert(k.clone(), n);
            assert!(prev.is_none_or(|p| p < n), "key {k}: {n} after {prev:?}");
        }
    }
    // Redelivered: at most what was in flight at each kill (a batch and the replication buffer).
    assert!(duplicates <= 3 * 3000, "{duplicates} duplicates");
    eprintln!(
        "{} committed, {} delivered lines, {duplicates} duplicates over 3 kills",
        all.len(),
        lines.len()
    );
}

#[test]
fn a_standby_relay_takes_the_slot_over_within_seconds_of_the_active_one_dying() {
    // A bounded slot: safe_wal_size is exported (it is absent when unlimited).
    let server = OwnServer::start(&[
        "wal_level=logical",
        "max_wal_senders=10",
        "max_slot_wal_keep_size=1GB",
    ]);
    let db = server.migrated();
    setup(&db);
    let mut first = Relay::start(&db.url, "");
    assert!(wait(Duration::from_secs(20), || first
        .metric("postbox_stream_active")
        == Some(1.0)));
    let second = Relay::start(&db.url, "");
    assert!(
        wait(Duration::from_secs(20), || second
            .log()
            .contains("standing by")),
        "{}",
        second.log()
    );
    assert_eq!(second.metric("postbox_stream_active"), Some(0.0));
    // PostgreSQL lets one session stream a slot: one active streamer, no split brain.
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM pg_stat_replication WHERE application_name LIKE 'postbox-stream-%' AND state IN ('catchup', 'streaming')"),
        1
    );
    let mut conn = db.conn();
    publish(&mut conn, "t", "k", 1);
    assert!(first.wait_lines(1, Duration::from_secs(20)));
    let published = commit_of(&first.lines()[0]);
    // Every stream metric the chart's alerts and dashboard name is exported by a streaming relay
    // (the slot's gauges once its sampler ran, the
    // counters once a batch was delivered).
    let rules = include_str!("../helm/postbox/templates/prometheusrule.yaml");
    let dashboard = include_str!("../helm/postbox/files/grafana-dashboard.json");
    let named: std::collections::BTreeSet<&str> = rules
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .chain(dashboard.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')))
        .filter(|w| w.starts_with("postbox_stream_"))
        .collect();
    assert!(named.len() >= 5, "{named:?}");
    let missing = || -> Vec<&str> {
        let (_, scrape) = common::http_get(first.metrics_port, "/metrics").unwrap_or_default();
        named
            .iter()
            .copied()
            .filter(|name| {
                !scrape
                    .lines()
                    .any(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            })
            .collect()
    };
    assert!(
        wait(Duration::from_secs(20), || missing().is_empty()),
        "not exported by a streaming relay: {:?}",
        missing()
    );
    // Killed once its position is confirmed past the message (before that, the standby would
    // deliver it again: a duplicate of what was in flight).
    assert!(wait(Duration::from_secs(20), || {
        db.scalar(
        "SELECT (confirmed_flush_lsn - '0/0')::bigint AS v FROM pg_replication_slots WHERE slot_name = 'postbox'"
    ) > published
    }));
    first.kill();
    let killed = Instant::now();
    publish(&mut conn, "t", "k", 2);
    assert!(
        second.wait_lines(1, Duration::from_secs(30)),
        "{}",
        second.log()
    );
    let took = killed.elapsed();
    assert_eq!(ns(&second.lines()), vec![2], "{}", second.log());
    assert_eq!(ns(&first.lines()), vec![1]);
    eprintln!("takeover: the standby delivered {took:?} after the kill");
}

#[test]
fn relays_racing_for_one_slot_leave_exactly_one_streamer_and_deliver_each_message_once() {
    let server = logical();
    let db = server.migrated();
    setup(&db);
    // Three replicas started together, as a deployment's pods are: they race for the slot.
    let relays: Vec<Relay> = (0..3).map(|_| Relay::start(&db.url, "")).collect();
    let active = || {
        relays
            .iter()
            .filter(|r| r.metric("postbox_stream_active") == Some(1.0))
            .count()
    };
    assert!(
        wait(Duration::from_secs(20), || active() == 1
            && relays
                .iter()
                .all(|r| r.metric("postbox_stream_active").is_some())),
        "{}",
        relays
            .iter()
            .map(Relay::log)
            .collect::<Vec<_>>()
            .join("\n---\n")
    );
    let mut conn = db.conn();
    for n in 0..200 {
        publish(&mut conn, "t", &format!("k{}", n % 7), n);
    }
    // A last message: once it is there, everything committed before it was delivered.
    publish(&mut conn, "t", "end", 200);
    assert!(wait(Duration::from_secs(30), || relays
        .iter()
        .any(|r| ns(&r.lines()).contains(&200))));
    let per_relay: Vec<Vec<i64>> = relays.iter().map(|r| ns(&r.lines())).collect();
    let streamers: Vec<&Vec<i64>> = per_relay.iter().filter(|n| !n.is_empty()).collect();
    assert_eq!(streamers.len(), 1, "{per_relay:?}");
    assert_eq!(*streamers[0], (0..=200).collect::<Vec<_>>());
    assert_eq!(active(), 1);
    // Standbys knock (a walsender in `startup` for a moment, refused the slot); one streams.
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM pg_stat_replication WHERE application_name LIKE 'postbox-stream-%' AND state IN ('catchup', 'streaming')"),
        1
    );
}

#[test]
fn a_replication_connection_gone_silent_is_found_out_and_replaced() {
    // The server ends a walsender it has not heard from in 3 s (60 s by default).
    let server = OwnServer::start(&[
        "wal_level=logical",
        "max_wal_senders=10",
        "wal_sender_timeout=3s",
    ]);
    let db = server.migrated();
    setup(&db);
    let proxy = FreezingProxy::start_to(
        format!("postgres://postgres@127.0.0.1:{}", server.port),
        b"START_REPLICATION",
    );
    let relay = Relay::start(&proxy.route(&db.url), "liveness_interval = \"1s\"");
    let mut conn = db.conn();
    publish(&mut conn, "t", "k", 1);
    assert!(
        relay.wait_lines(1, Duration::from_secs(20)),
        "{}",
        relay.log()
    );
    // Confirmed past it first (else it is redelivered after the new connection: in flight).
    let published = commit_of(&relay.lines()[0]);
    assert!(wait(Duration::from_secs(20), || {
        db.scalar(
        "SELECT (confirmed_flush_lsn - '0/0')::bigint AS v FROM pg_replication_slots WHERE slot_name = 'postbox'"
    ) > published
    }));
    // The link goes silent without a reset (a NAT or a firewall that forgot the connection):
    // nothing more is forwarded either way, nothing is closed.
    assert_eq!(proxy.freeze_listeners(), 1);
    publish(&mut conn, "t", "k", 2);
    assert!(
        wait(Duration::from_secs(30), || ns(&relay.lines()).contains(&2)),
        "{}",
        relay.log()
    );
    assert!(relay.log().contains("presumed dead"), "{}", relay.log());
    assert_eq!(ns(&relay.lines()), vec![1, 2]);
}

#[test]
fn a_long_silence_while_the_server_decodes_other_writes_is_not_taken_for_a_dead_link() {
    let server = logical();
    let db = server.migrated();
    setup(&db);
    let relay = Relay::start(&db.url, "liveness_interval = \"500ms\"");
    let mut conn = db.conn();
    publish(&mut conn, "t", "k", 1);
    assert!(
        relay.wait_lines(1, Duration::from_secs(20)),
        "{}",
        relay.log()
    );
    // One large transaction on a table no message comes from: the server decodes it for seconds
    // and sends nothing meanwhile (nor keepalives: the relay's status updates keep it content).
    db.exec(
        "CREATE TABLE filler (x text);
         INSERT INTO filler SELECT repeat('x', 100) FROM generate_series(1, 1500000)",
    );
    publish(&mut conn, "t", "k", 2);
    let decoding = Instant::now();
    assert!(
        wait(Duration::from_secs(60), || ns(&relay.lines()).contains(&2)),
        "{}",
        relay.log()
    );
    eprintln!(
        "the message after the large transaction came {:?} after its commit",
        decoding.elapsed()
    );
    assert!(!relay.log().contains("presumed dead"), "{}", relay.log());
    assert_eq!(ns(&relay.lines()), vec![1, 2]);
}

#[test]
fn a_lost_or_dropped_slot_stops_the_stream_loudly_and_running_relays_stream_the_new_one_after_setup()
 {
    let server = OwnServer::start(&[
        "wal_level=logical",
        "max_slot_wal_keep_size=1MB",
        "max_wal_size=32MB",
        "min_wal_size=32MB",
    ]);
    let db = server.migrated();
    setup(&db);
    // Dropped behind postbox's back.
    db.exec("SELECT pg_drop_replication_slot('postbox')");
    let relay = Relay::start(&db.url, "");
    assert!(
        wait(Duration::from_secs(20), || relay
            .log()
            .contains("stream slot \"postbox\" is lost")),
        "{}",
        relay.log()
    );
    assert!(relay.log().contains("it was dropped"), "{}", relay.log());
    assert!(wait(Duration::from_secs(10), || relay
        .metric("postbox_stream_slot_lost")
        == Some(1.0)));
    let e = postbox::publish(&mut db.conn(), &Message::new("t")).unwrap_err();
    assert!(e.to_string().contains("no postbox stream slot"), "{e}");
    let cli = |args: &[&str]| {
        hermetic(env!("CARGO_BIN_EXE_postbox"))
            .args(args)
            .env("POSTBOX_DATABASE_URL", &db.url)
            .output()
            .unwrap()
    };
    let out = cli(&["stream", "setup"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && err.contains("was lost: messages published in"),
        "{err}"
    );
    // The running relay streams the new slot: what is published now is delivered, and the
    // metric says the slot is there again.
    postbox::publish(
        &mut db.conn(),
        &Message::new("t").payload(&serde_json::json!({ "n": 1 })),
    )
    .unwrap();
    assert!(
        relay.wait_lines(1, Duration::from_secs(20)),
        "{}",
        relay.log()
    );
    assert_eq!(relay.lines()[0]["payload"]["n"], 1);
    assert!(wait(Duration::from_secs(10), || relay
        .metric("postbox_stream_slot_lost")
        == Some(0.0)));
    assert!(wait(Duration::from_secs(10), || relay
        .metric("postbox_stream_active")
        == Some(1.0)));
    drop(relay);
    // Lost to max_slot_wal_keep_size: WAL written while no relay reads the slot.
    db.exec("CREATE TABLE filler (x text)");
    for _ in 0..6 {
        db.exec("INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 10000); SELECT pg_switch_wal(); CHECKPOINT;");
    }
    let out = cli(&["stream", "status"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success() && text.contains("LOST"), "{text}");
    let relay = Relay::start(&db.url, "");
    assert!(
        wait(Duration::from_secs(20), || relay
            .log()
            .contains("wal_status = lost")),
        "{}",
        relay.log()
    );
    assert!(wait(Duration::from_secs(10), || relay
        .metric("postbox_stream_slot_lost")
        == Some(1.0)));
    assert!(cli(&["stream", "setup"]).status.success());
    postbox::publish(
        &mut db.conn(),
        &Message::new("t").payload(&serde_json::json!({ "n": 2 })),
    )
    .unwrap();
    assert!(
        relay.wait_lines(1, Duration::from_secs(20)),
        "{}",
        relay.log()
    );
    assert_eq!(relay.lines()[0]["payload"]["n"], 2);
    assert!(wait(Duration::from_secs(10), || relay
        .metric("postbox_stream_slot_lost")
        == Some(0.0)));
}

#[test]
fn the_slot_advances_while_only_another_database_is_written() {
    let server = logical();
    let db = server.migrated();
    setup(&db);
    let relay = Relay::start(&db.url, "");
    assert!(wait(Duration::from_secs(20), || relay
        .metric("postbox_stream_active")
        == Some(1.0)));
    let mut admin = PgConnection::establish(&server.url("postgres")).unwrap();
    diesel::sql_query("CREATE DATABASE other")
        .execute(&mut admin)
        .unwrap();
    let mut other = PgConnection::establish(&server.url("other")).unwrap();
    use diesel::connection::SimpleConnection;
    other.batch_execute("CREATE TABLE busy (x text)").unwrap();
    let before = db.scalar("SELECT (pg_current_wal_lsn() - '0/0')::bigint AS v");
    for _ in 0..5 {
        other
            .batch_execute(
                "INSERT INTO busy SELECT repeat('x', 1000) FROM generate_series(1, 10000)",
            )
            .unwrap();
    }
    let written = db.scalar("SELECT (pg_current_wal_lsn() - '0/0')::bigint AS v") - before;
    assert!(written > 40_000_000, "{written}");
    assert!(
        wait(Duration::from_secs(30), || {
            db.scalar(
            "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint AS v FROM pg_replication_slots WHERE slot_name = 'postbox'"
        ) < 1_000_000
        }),
        "the slot stays behind: {}",
        relay.log()
    );
    let out = hermetic(env!("CARGO_BIN_EXE_postbox"))
        .args(["status"])
        .env("POSTBOX_DATABASE_URL", &db.url)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let drop = hermetic(env!("CARGO_BIN_EXE_postbox"))
        .args(["stream", "drop"])
        .env("POSTBOX_DATABASE_URL", &db.url)
        .output()
        .unwrap();
    let why = String::from_utf8_lossy(&drop.stderr);
    assert!(
        !drop.status.success() && why.contains("is being streamed"),
        "{why}"
    );
    assert!(
        text.contains("stream slot postbox (publication postbox_stream): streaming")
            && text.contains("wal_status reserved"),
        "{text}"
    );
    assert!(
        wait(Duration::from_secs(10), || relay
            .metric("postbox_stream_lag_bytes")
            .is_some_and(|l| l < 1e6)),
        "lag metric"
    );
}

#[test]
fn a_transaction_of_100k_messages_is_delivered_whole_in_order_within_bounded_memory() {
    let server = logical();
    let db = server.migrated();
    setup(&db);
    let relay = Relay::start(&db.url, "");
    let msgs: Vec<Message> = (0..100_000)
        .map(|n| {
            Message::new("big")
                .key(format!("k{}", n % 10))
                .payload(&serde_json::json!({ "n": n, "pad": "x".repeat(200) }))
        })
        .collect();
    db.conn()
        .transaction(|c| postbox::publish_many(c, &msgs))
        .unwrap();
    assert!(
        relay.wait_lines(100_000, Duration::from_secs(120)),
        "{} lines: {}",
        relay.lines().len(),
        relay.log()
    );
    let got = ns(&relay.lines());
    assert_eq!(got, (0..100_000).collect::<Vec<_>>());
    let ids: BTreeMap<String, ()> = relay
        .lines()
        .iter()
        .map(|l| (l["id"].as_str().unwrap().to_owned(), ()))
        .collect();
    assert_eq!(ids.len(), 100_000, "one stable id each");
    eprintln!(
        "100k-message transaction (about 25 MB of payload): relay peak RSS {:.0} MB",
        peak_rss_mb(relay.pid())
    );
}

#[test]
fn the_stream_resumes_after_a_postgresql_restart() {
    let server = logical();
    let db = server.migrated();
    setup(&db);
    let relay = Relay::start(&db.url, "");
    publish(&mut db.conn(), "t", "k", 1);
    assert!(
        relay.wait_lines(1, Duration::from_secs(20)),
        "{}",
        relay.log()
    );
    server.stop("fast");
    server.start_again();
    publish(&mut db.conn(), "t", "k", 2);
    // Message 2 itself: a redelivery of 1 (at least once) makes a second line too.
    assert!(
        wait(Duration::from_secs(60), || ns(&relay.lines()).contains(&2)),
        "{:?}\n{}",
        ns(&relay.lines()),
        relay.log()
    );
    let got = ns(&relay.lines());
    assert_eq!(got.last(), Some(&2), "{got:?}");
    assert!(got.iter().all(|n| [1, 2].contains(n)), "{got:?}");
    // The server asked the relay to confirm everything before it shut down: no record could
    // be made then, and the slot found past the record after the restart is still its own.
    assert!(
        !relay.log().contains("may never have been streamed"),
        "{}",
        relay.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_refuses_a_slot_name_another_database_holds_and_publish_refuses_while_a_slot_is_replaced()
 {
    let server = logical();
    let db = server.migrated();
    let store = db.store().await;
    store
        .stream_setup("postbox", "postbox_stream")
        .await
        .unwrap();
    // Slot names are the server's: another database's setup under the same name is refused, and
    // the first database's slot is untouched.
    let mut admin = PgConnection::establish(&server.url("postgres")).unwrap();
    diesel::sql_query("CREATE DATABASE second")
        .execute(&mut admin)
        .unwrap();
    let second = server.url("second");
    postbox::migrate(&mut PgConnection::establish(&second).unwrap()).unwrap();
    let other = postbox::Store::connect(&second, 2).await.unwrap();
    let e = other
        .stream_setup("postbox", "postbox_stream")
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("taken on this server by a slot of database \"postbox\""),
        "{e}"
    );
    assert!(store.stream_status(None).await.unwrap()[0].exists);
    other
        .stream_setup("second_stream", "postbox_stream")
        .await
        .unwrap();

    // A dead letter of a stream message is written once, however often it is streamed.
    let first = store
        .stream_dead_letter(
            "0000000001000000-00000000",
            "t",
            None,
            &serde_json::json!(1),
            &serde_json::json!({}),
            chrono::Utc::now(),
            "r",
        )
        .await
        .unwrap();
    let again = store
        .stream_dead_letter(
            "0000000001000000-00000000",
            "t",
            None,
            &serde_json::json!(1),
            &serde_json::json!({}),
            chrono::Utc::now(),
            "r",
        )
        .await
        .unwrap();
    assert!(first && !again);

    // The slot is lost; while its replacement waits for a transaction that is open, publish
    // refuses (the new slot would not stream what commits before it is ready).
    db.exec("SELECT pg_drop_replication_slot('postbox')");
    let mut blocker = db.conn();
    diesel::sql_query("BEGIN").execute(&mut blocker).unwrap();
    diesel::sql_query("SELECT txid_current()")
        .execute(&mut blocker)
        .unwrap();
    let replacing =
        tokio::spawn(async move { store.stream_setup("postbox", "postbox_stream").await });
    assert!(wait(Duration::from_secs(20), || {
        db.scalar(
        "SELECT count(*) AS v FROM pg_replication_slots WHERE slot_name = 'postbox' AND confirmed_flush_lsn IS NULL"
    ) == 1
    }));
    let e = postbox::publish(&mut db.conn(), &Message::new("t")).unwrap_err();
    assert!(e.to_string().contains("no postbox stream slot"), "{e}");
    diesel::sql_query("COMMIT").execute(&mut blocker).unwrap();
    let done = replacing.await.unwrap().unwrap();
    assert!(
        done.created_slot && done.replaced_lost.is_some(),
        "{done:?}"
    );
    postbox::publish(&mut db.conn(), &Message::new("t")).unwrap();
}

#[test]
fn a_relay_stopped_while_a_backlog_streams_exits_promptly_and_the_next_one_loses_nothing() {
    let server = logical();
    let db = server.migrated();
    setup(&db);
    // A backlog published before the relay starts: the stream always has an event ready.
    let msgs: Vec<Message> = (0..60_000)
        .map(|n| {
            Message::new("t")
                .key(format!("k{}", n % 7))
                .payload(&serde_json::json!({ "n": n }))
        })
        .collect();
    let mut conn = db.conn();
    for chunk in msgs.chunks(1000) {
        conn.transaction(|c| postbox::publish_many(c, chunk))
            .unwrap();
    }
    let mut first = Relay::start(&db.url, "");
    assert!(
        first.wait_lines(5000, Duration::from_secs(30)),
        "{}",
        first.log()
    );
    let asked = Instant::now();
    first.terminate();
    let took = asked.elapsed();
    assert!(first.log().contains("relay stopped"), "{}", first.log());
    let second = Relay::start(&db.url, "");
    let all: std::collections::HashSet<i64> = (0..60_000).collect();
    assert!(
        wait(Duration::from_secs(60), || {
            let got: std::collections::HashSet<i64> = ns(&first.lines())
                .into_iter()
                .chain(ns(&second.lines()))
                .collect();
            all.is_subset(&got)
        }),
        "{}",
        second.log()
    );
    eprintln!(
        "stopped after {} lines in {took:?}; the next relay delivered {} lines",
        first.lines().len(),
        second.lines().len()
    );
}
