//! Completed-message retention against a real PostgreSQL: with `keep_completed`, every delivered
//! message (leased or held) is kept in `postbox.completed` with when and by which sink, `show`
//! finds a message wherever it is, and expired hours are dropped whole.

mod common;

use std::time::Duration;

use common::{TestDb, enqueue};
use postbox::engine::Engine;
use postbox::sink::handlers::{HandlerError, Handlers, Job};
use postbox::store::Shown;
use postbox::{Message, Store};
use tokio_util::sync::CancellationToken;

async fn drain(db: &TestDb, keep: Option<Duration>) -> postbox::engine::RunReport {
    drain_with(db, keep, postbox::engine::config::DEFAULT_HOLD_LIMIT).await
}

/// `hold_limit` zero: every delivery is leased and completed (no held batch).
async fn drain_with(
    db: &TestDb,
    keep: Option<Duration>,
    hold_limit: Duration,
) -> postbox::engine::RunReport {
    let handlers = Handlers::new()
        .on("orders", |_: Job<serde_json::Value>| async { Ok(()) })
        .on("doomed", |_: Job<serde_json::Value>| async {
            Err(HandlerError::dead("never deliverable"))
        });
    let mut b = Engine::builder(db.url.clone())
        .handlers(handlers)
        .hold_limit(hold_limit)
        .drain(true);
    if let Some(k) = keep {
        b = b.keep_completed(k);
    }
    b.build()
        .await
        .unwrap()
        .run(CancellationToken::new())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivered_messages_are_kept_with_their_sink_and_show_finds_every_message() {
    let db = TestDb::migrated();
    // A backlog (held batches) and ordered keys (hand-over), a dead letter and a scheduled one.
    let mut msgs: Vec<Message> = (0..500)
        .map(|i| {
            let m = Message::new("orders").payload(&serde_json::json!({ "n": i }));
            if i % 5 == 0 {
                m.key(format!("k{}", i % 3)).ordered()
            } else {
                m
            }
        })
        .collect();
    msgs.push(Message::new("doomed"));
    msgs.push(Message::new("orders").delay(Duration::from_secs(3600)));
    let ids = enqueue(&db, msgs);
    let report = drain(&db, Some(Duration::from_secs(24 * 3600))).await;
    assert_eq!(report.delivered, 500, "{report:?}");

    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.completed"),
        500
    );
    assert_eq!(
        db.scalar("SELECT count(DISTINCT id) AS v FROM postbox.completed WHERE sink = 'handlers' AND attempts = 1 AND delivered_at >= created_at AND relay IS NOT NULL"),
        500
    );
    // Only the scheduled message is left in the hot table.
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 1);

    let store = db.store().await;
    match store.show(ids[7]).await.unwrap() {
        Some(Shown::Delivered {
            id,
            sink,
            attempts,
            payload,
            ..
        }) => {
            assert_eq!((id, sink.as_str(), attempts), (ids[7], "handlers", 1));
            assert_eq!(payload, serde_json::json!({"n": 7}));
        }
        other => panic!("{other:?}"),
    }
    match store.show(ids[500]).await.unwrap() {
        Some(Shown::Dead { reason, .. }) => assert_eq!(reason, "never deliverable"),
        other => panic!("{other:?}"),
    }
    match store.show(ids[501]).await.unwrap() {
        Some(Shown::Queued { state, .. }) => assert_eq!(state, "scheduled"),
        other => panic!("{other:?}"),
    }
    assert_eq!(store.show(i64::MAX).await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_deliveries_are_kept_too() {
    let db = TestDb::migrated();
    let msgs = (0..300)
        .map(|i| Message::new("orders").key(format!("k{}", i % 7)).ordered())
        .collect();
    let ids = enqueue(&db, msgs);
    let report = drain_with(&db, Some(Duration::from_secs(3600)), Duration::ZERO).await;
    assert_eq!(report.delivered, 300);
    assert_eq!(
        db.scalar("SELECT count(DISTINCT id) AS v FROM postbox.completed WHERE sink = 'handlers' AND attempts = 1"),
        300
    );
    let store = db.store().await;
    assert!(matches!(
        store.show(ids[299]).await.unwrap(),
        Some(Shown::Delivered { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_retention_delivered_messages_are_gone() {
    let db = TestDb::migrated();
    let ids = enqueue(&db, vec![Message::new("orders")]);
    assert_eq!(drain(&db, None).await.delivered, 1);
    let store = db.store().await;
    assert_eq!(store.show(ids[0]).await.unwrap(), None);
    assert_eq!(db.scalar("SELECT count(*) AS v FROM postbox.completed"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_hours_are_dropped_whole_and_the_hours_to_come_exist() {
    let db = TestDb::migrated();
    let store = Store::connect(&db.url, 4).await.unwrap();
    let first = store
        .maintain_completed(Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(first.created, 25, "this hour and the next 24");
    assert_eq!(first.dropped, 0);
    // An hour long past, with a message in it, and the hour that just ended.
    db.exec(
        "CREATE TABLE postbox.completed_20200101_00 PARTITION OF postbox.completed
             FOR VALUES FROM ('2020-01-01 00:00Z') TO ('2020-01-01 01:00Z');
         INSERT INTO postbox.completed (id, topic, payload, headers, attempts, created_at, delivered_at, sink)
             VALUES (1, 't', '{}', '{}', 1, '2020-01-01 00:10Z', '2020-01-01 00:20Z', 'handlers')",
    );
    let again = store
        .maintain_completed(Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(
        again,
        postbox::store::Maintained {
            created: 0,
            dropped: 1
        }
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM pg_class WHERE relname = 'completed_20200101_00'"),
        0,
        "dropped, not only detached"
    );
    assert_eq!(store.show(1).await.unwrap(), None);
    // A second relay doing the same at the same time finds nothing to do.
    let (a, b) = tokio::join!(
        store.maintain_completed(Duration::from_secs(3600)),
        store.maintain_completed(Duration::from_secs(3600))
    );
    assert_eq!(a.unwrap().created + b.unwrap().created, 0);
}
