//! Hostile input: rows the engine cannot read never stop their route. Each is dead-lettered with
//! its reason, and the messages around it (its batch, the rest of its ordered key) flow.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{TestDb, eventually};
use postbox::engine::Engine;
use postbox::sink::handlers::{Handlers, Job};
use tokio_util::sync::CancellationToken;

type Seen = Arc<Mutex<Vec<(i64, Option<String>)>>>;

fn recording(topic: &str, seen: Seen) -> Handlers {
    Handlers::new().on(topic, move |job: Job<serde_json::Value>| {
        let seen = seen.clone();
        async move {
            seen.lock().unwrap().push((job.id, job.key.clone()));
            Ok(())
        }
    })
}

/// Runs an engine on topic `t` until `delivered` messages are handled and `dead` are dead.
async fn run_until(db: &TestDb, delivered: usize, dead: i64) -> Vec<(i64, Option<String>)> {
    let seen: Seen = Default::default();
    let engine = Engine::builder(&db.url)
        .handlers(recording("t", seen.clone()))
        .build()
        .await
        .unwrap();
    let counters = engine.counters();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(engine.run(shutdown.clone()));
    let done = eventually(Duration::from_secs(30), || async {
        counters.snapshot().delivered as usize >= delivered
            && db.scalar("SELECT count(*) AS v FROM postbox.dead_letters") >= dead
    })
    .await;
    shutdown.cancel();
    task.await.unwrap().unwrap();
    assert!(
        done,
        "delivered {:?}, dead {}",
        counters.snapshot(),
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters")
    );
    let seen = seen.lock().unwrap().clone();
    seen
}

fn assert_once_and_in_key_order(seen: &[(i64, Option<String>)], n: usize) {
    let mut ids: Vec<i64> = seen.iter().map(|(id, _)| *id).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), seen.len(), "a message was delivered twice");
    assert_eq!(seen.len(), n);
    let mut last: std::collections::HashMap<&str, i64> = Default::default();
    for (id, key) in seen {
        if let Some(k) = key {
            let before = last.insert(k, *id).unwrap_or(0);
            assert!(before < *id, "key {k}: {id} delivered after {before}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_nested_deeper_than_serde_reads_is_dead_lettered_and_its_key_goes_on() {
    let db = TestDb::migrated();
    db.exec(
        "INSERT INTO postbox.messages (topic, payload) SELECT 't', to_jsonb(g) FROM generate_series(1, 20) g;
         INSERT INTO postbox.messages (topic, key, ordered, payload)
           VALUES ('t', 'k', true, (repeat('[', 129) || repeat(']', 129))::jsonb);
         INSERT INTO postbox.messages (topic, key, ordered, payload)
           SELECT 't', 'k', true, to_jsonb(g) FROM generate_series(21, 40) g;",
    );
    let deep = db.scalar("SELECT min(id) AS v FROM postbox.messages WHERE key = 'k'");
    let seen = run_until(&db, 40, 1).await;
    assert_once_and_in_key_order(&seen, 40);
    assert!(!seen.iter().any(|(id, _)| *id == deep));

    let store = db.store().await;
    let dead = store.dead_list(None, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, deep);
    assert!(
        dead[0].reason.contains("payload nested deeper than the 128 levels"),
        "{}",
        dead[0].reason
    );
    assert_eq!(dead[0].attempts, 1);
    // Listed and shown: the payload as its JSON text.
    assert_eq!(
        dead[0].payload,
        serde_json::Value::String(format!("{}{}", "[".repeat(129), "]".repeat(129)))
    );
    assert!(store.show(deep).await.unwrap().is_some());
    // A replay moves the stored value as it is.
    let replayed = store
        .dead_replay(&postbox::store::DeadSelector::Ids(vec![deep]))
        .await
        .unwrap();
    assert_eq!(replayed.replayed, vec![deep]);
    assert_eq!(
        db.scalar(&format!(
            "SELECT jsonb_array_length(payload)::bigint AS v FROM postbox.messages WHERE id = {deep}"
        )),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_that_is_not_utf8_in_a_sql_ascii_database_is_dead_lettered() {
    let db = TestDb::migrated_with_encoding("SQL_ASCII");
    db.exec(
        "INSERT INTO postbox.messages (topic, key, ordered, payload)
           SELECT 't', 'a', true, to_jsonb(g) FROM generate_series(1, 10) g;
         INSERT INTO postbox.messages (topic, key, ordered, payload) VALUES ('t', E'b\\xff', true, '1');
         INSERT INTO postbox.messages (topic, key, ordered, payload)
           SELECT 't', E'b\\xff', true, to_jsonb(g) FROM generate_series(11, 12) g;
         INSERT INTO postbox.messages (topic, payload) SELECT 't', to_jsonb(g) FROM generate_series(13, 20) g;",
    );
    let seen = run_until(&db, 18, 3).await;
    assert_once_and_in_key_order(&seen, 18);
    let store = db.store().await;
    let dead = store.dead_list(None, 10).await.unwrap();
    assert_eq!(dead.len(), 3, "every message of the unreadable key, in turn");
    for d in &dead {
        assert!(d.reason.contains("key not UTF-8"), "{}", d.reason);
        assert_eq!(d.key.as_deref(), Some("b\u{FFFD}"));
    }
}
