//! Stream mode against what can go wrong around it: one message's bytes, a sink that hangs, a
//! publication or slot that is not what the relay expects, large messages, a kill. Each test runs
//! a PostgreSQL of its own with `wal_level = logical`.

mod common;

use std::time::Duration;

use common::relay::{Relay, wait};
use common::{OwnServer, TestDb};
use postbox::Message;

fn logical() -> OwnServer {
    OwnServer::start(&["wal_level=logical", "max_wal_senders=10"])
}

async fn stream_db(server: &OwnServer) -> TestDb {
    server.stream_db().await
}

const REV_ONLY: &str = "[[routes]]\ntopics = [\"rev.*\"]\nsink = \"log\"\n";

fn publish(db: &TestDb, topic: &str, n: i64) {
    postbox::publish(
        &mut db.conn(),
        &Message::new(topic).payload(&serde_json::json!({ "n": n })),
    )
    .unwrap();
}

/// A random string of `n` letters and digits: compresses badly (an index entry past its limit).
fn incompressible(n: usize) -> String {
    std::iter::repeat_with(fastrand::alphanumeric)
        .take(n)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_postgresql_cannot_store_is_dead_lettered_and_the_stream_goes_on() {
    let server = logical();
    let db = stream_db(&server).await;
    let relay = Relay::start(&db.url, REV_ONLY);
    publish(&db, "rev.nul", 1);
    // A plain SQL writer's content with a NUL byte: it cannot be read, and its text holds a NUL.
    db.exec(r"SELECT pg_logical_emit_message(true, 'postbox', '\x7b2276223a317d00'::bytea)");
    // A valid message with "\u0000" in its payload, headers and key, on a topic no route serves.
    db.exec(
        r#"SELECT pg_logical_emit_message(true, 'postbox', '{"v":1,"topic":"unrouted","key":"k\u0000","headers":{"h":"\u0000"},"payload":{"a\u0000":"b\u0000"}}')"#,
    );
    // A topic past the dead letters' index limit: stored in part.
    let long = incompressible(4_000);
    db.exec(&format!(
        r#"SELECT pg_logical_emit_message(true, 'postbox', '{{"v":1,"topic":"{long}","payload":{{"n":3}}}}')"#
    ));
    publish(&db, "rev.nul", 2);
    assert!(
        relay.wait_lines(2, Duration::from_secs(30)),
        "the stream stalled:\n{}",
        relay.log()
    );
    let ns: Vec<i64> = relay
        .lines()
        .iter()
        .map(|l| l["payload"]["n"].as_i64().unwrap())
        .collect();
    assert_eq!(ns, vec![1, 2]);
    assert!(wait(Duration::from_secs(10), || db
        .scalar("SELECT count(*) AS v FROM postbox.dead_letters")
        == 3));
    let all = db.text(
        "SELECT coalesce(string_agg(concat_ws(' | ', left(topic, 40), key, payload, headers, reason), E'\\n'), '') AS v
         FROM postbox.dead_letters",
    );
    // What could be stored is, with the reason saying what was replaced.
    assert_eq!(
        db.scalar(
            "SELECT count(*) AS v FROM postbox.dead_letters
             WHERE topic = '(undecodable)' AND payload = to_jsonb('{\"v\":1}' || U&'\\FFFD')
               AND reason LIKE 'stream: not a postbox stream message:%replaced with U+FFFD'"
        ),
        1,
        "{all}"
    );
    assert_eq!(
        db.scalar(
            "SELECT count(*) AS v FROM postbox.dead_letters
             WHERE topic = 'unrouted' AND key = 'k' || U&'\\FFFD'
               AND payload = jsonb_build_object('a' || U&'\\FFFD', 'b' || U&'\\FFFD')
               AND headers->>'h' = U&'\\FFFD' AND headers ? 'postbox-stream-id'
               AND stream_id IS NOT NULL"
        ),
        1
    );
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.dead_letters
             WHERE topic LIKE left('{long}', 200) || '% ... (4000 bytes in all)' AND octet_length(topic) <= 255
               AND reason LIKE '%stored in part%index row%'
               AND payload #>> '{{}}' LIKE '%\"n\":3%'"
        )),
        1,
        "{}",
        relay.log()
    );
    // Restarted, the relay streams on from after them: nothing again, nothing stuck.
    drop(relay);
    let relay = Relay::start(&db.url, REV_ONLY);
    publish(&db, "rev.nul", 4);
    assert!(
        relay.wait_lines(1, Duration::from_secs(30)),
        "{}",
        relay.log()
    );
    assert_eq!(relay.lines()[0]["payload"]["n"], 4);
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters"),
        3
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_emitted_outside_its_transaction_is_dead_lettered_not_delivered() {
    let server = logical();
    let db = stream_db(&server).await;
    let relay = Relay::start(&db.url, REV_ONLY);
    // PostgreSQL streams a non-transactional message at once: this one's transaction rolls back.
    db.exec(
        r#"BEGIN;
           SELECT pg_logical_emit_message(false, 'postbox', '{"v":1,"topic":"rev.nontx","payload":{"n":0}}');
           ROLLBACK;"#,
    );
    publish(&db, "rev.tx", 1);
    assert!(
        relay.wait_lines(1, Duration::from_secs(30)),
        "{}",
        relay.log()
    );
    assert!(wait(Duration::from_secs(10), || {
        db.scalar(
        "SELECT count(*) AS v FROM postbox.dead_letters
         WHERE topic = 'rev.nontx' AND payload = '{\"n\":0}' AND reason LIKE '%transactional = false%'"
    ) == 1
    }));
    // In stream order it came first: had it been delivered, it would be in the log already.
    let topics: Vec<String> = relay
        .lines()
        .iter()
        .map(|l| l["topic"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(topics, vec!["rev.tx"]);
}
