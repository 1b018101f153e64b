//! Pausing and resuming topics, against a real PostgreSQL: within two seconds no engine claims a
//! paused topic (exact or glob), deliveries already running finish, other topics flow, and
//! resuming lets the waiting messages through.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{TestDb, enqueue, eventually};
use postbox::Message;
use postbox::engine::Engine;
use postbox::sink::handlers::{Handlers, Job};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

type Seen = Arc<Mutex<HashMap<String, usize>>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_topic_is_claimed_by_no_engine_until_resumed_and_running_deliveries_finish() {
    let db = TestDb::migrated();
    let store = db.store().await;
    let seen: Seen = Arc::default();
    // A delivery of "a" that is running when the pause comes: it waits for `release`.
    let release = Arc::new(Notify::new());
    let started = Arc::new(Notify::new());
    let handlers = |seen: Seen| {
        let topics = ["a", "b", "x.y"];
        let mut h = Handlers::new();
        for t in topics {
            let (seen, release, started) = (seen.clone(), release.clone(), started.clone());
            h = h.on(t, move |job: Job<String>| {
                let (seen, release, started) = (seen.clone(), release.clone(), started.clone());
                async move {
                    if job.payload == "slow" {
                        started.notify_one();
                        release.notified().await;
                    }
                    *seen.lock().unwrap().entry(job.topic.clone()).or_default() += 1;
                    Ok(())
                }
            });
        }
        h
    };
    let stop = CancellationToken::new();
    let mut engines = Vec::new();
    for _ in 0..2 {
        let e = Engine::builder(db.url.clone())
            .handlers(handlers(seen.clone()))
            .poll_interval(Duration::from_millis(100))
            .build()
            .await
            .unwrap();
        engines.push(tokio::spawn(e.run(stop.clone())));
    }
    enqueue(&db, vec![Message::new("a").payload(&"slow")]);
    started.notified().await;

    // "c" has no messages yet; "x.*" is a pattern.
    let pauses = ["a", "c", "x.*"].map(String::from);
    assert_eq!(store.pause(&pauses).await.unwrap(), 3);
    assert_eq!(
        store.pause(&pauses[..1]).await.unwrap(),
        0,
        "already paused"
    );
    assert_eq!(store.paused().await.unwrap(), ["a", "c", "x.*"]);
    // The promise: within 2 s every engine has stopped claiming them.
    tokio::time::sleep(Duration::from_secs(2)).await;
    enqueue(
        &db,
        vec![
            Message::new("a").payload(&"waits"),
            Message::new("x.y").payload(&"waits"),
            Message::new("b").payload(&"flows"),
        ],
    );
    // The running delivery finishes; the other topic flows.
    release.notify_one();
    let count = |t: &str| seen.lock().unwrap().get(t).copied().unwrap_or(0);
    assert!(
        eventually(Duration::from_secs(10), || async {
            count("a") == 1 && count("b") == 1
        })
        .await,
        "{:?}",
        seen.lock().unwrap()
    );
    // Polls of both engines go by (they read the pauses every second): nothing paused is taken.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        (count("a"), count("x.y")),
        (1, 0),
        "a paused topic was claimed"
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE state = 'available'"),
        2
    );

    assert_eq!(store.resume(&pauses).await.unwrap(), 3);
    assert!(
        eventually(Duration::from_secs(10), || async {
            count("a") == 2 && count("x.y") == 1
        })
        .await,
        "resumed topics were not delivered: {:?}",
        seen.lock().unwrap()
    );
    assert!(store.paused().await.unwrap().is_empty());
    assert!(store.pause(&[]).await.is_err(), "no topic named");
    stop.cancel();
    for e in engines {
        e.await.unwrap().unwrap();
    }
}
