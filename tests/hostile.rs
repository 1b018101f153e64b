//! Hostile input: rows the engine cannot read never stop their route. Each is dead-lettered with
//! its reason, and the messages around it (its batch, the rest of its ordered key) flow.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::proxy::FreezingProxy;
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
    seen.lock().unwrap().clone()
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
        dead[0]
            .reason
            .contains("payload nested deeper than the 128 levels"),
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
    assert_eq!(
        dead.len(),
        3,
        "every message of the unreadable key, in turn"
    );
    for d in &dead {
        assert!(d.reason.contains("key not UTF-8"), "{}", d.reason);
        assert_eq!(d.key.as_deref(), Some("b\u{FFFD}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_listen_connection_never_holds_the_claim_loop_and_is_replaced() {
    let db = TestDb::migrated();
    let proxy = FreezingProxy::start();
    let seen: Seen = Default::default();
    let engine = Engine::builder(proxy.url(&db))
        .handlers(recording("t", seen.clone()))
        .poll_interval(Duration::from_millis(200))
        .shutdown_deadline(Duration::from_secs(2))
        .build()
        .await
        .unwrap();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(engine.run(shutdown.clone()));
    assert!(eventually(Duration::from_secs(10), || async { proxy.listeners() == 1 }).await);
    assert_eq!(proxy.freeze_listeners(), 1);
    // Idle turns, each of which arms the notifier, with messages in between: polling finds them.
    let mut conn = db.conn();
    for i in 0..40 {
        postbox::enqueue(&mut conn, &postbox::Message::new("t").payload(&i)).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        eventually(Duration::from_secs(20), || async {
            seen.lock().unwrap().len() == 40
        })
        .await,
        "delivered {} of 40 with the notifier's connection silent",
        seen.lock().unwrap().len()
    );
    // The silent connection is found out and replaced.
    assert!(
        eventually(Duration::from_secs(20), || async { proxy.listeners() >= 2 }).await,
        "the notifier never replaced its silent connection"
    );
    let started = std::time::Instant::now();
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(15), task)
        .await
        .expect("shutdown hung on the silent connection")
        .unwrap()
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_once_and_in_key_order(&seen.lock().unwrap(), 40);
}

/// An idle engine asks its notifier to wait on every turn (each `poll_interval`); while it is
/// registered that asks nothing of the server. The notifier's health check must come all the
/// same: it was a pause restarted by every command, so a connection gone silent under an idle
/// engine polling more often than the check was never found out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_engine_finds_its_silent_listen_connection_out() {
    let db = TestDb::migrated();
    let proxy = FreezingProxy::start();
    let engine = Engine::builder(proxy.url(&db))
        .handlers(recording("t", Default::default()))
        .poll_interval(Duration::from_millis(100))
        .shutdown_deadline(Duration::from_secs(2))
        .build()
        .await
        .unwrap();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(engine.run(shutdown.clone()));
    // Registered as waiting: the listeners row is the notifier's.
    assert!(
        eventually(Duration::from_secs(10), || async {
            db.scalar("SELECT count(*) AS v FROM postbox.listeners") == 1
        })
        .await
    );
    assert_eq!(proxy.freeze_listeners(), 1);
    assert!(
        eventually(Duration::from_secs(20), || async { proxy.listeners() >= 2 }).await,
        "the notifier never replaced its silent connection"
    );
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(15), task)
        .await
        .expect("shutdown hung")
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_keeps_its_deadline_while_a_claim_waits_on_a_table_lock() {
    use diesel::connection::SimpleConnection;
    let db = TestDb::migrated();
    let seen: Seen = Default::default();
    let engine = Engine::builder(&db.url)
        .handlers(recording("t", seen.clone()))
        .poll_interval(Duration::from_millis(100))
        .shutdown_deadline(Duration::from_secs(1))
        .build()
        .await
        .unwrap();
    let (shutdown, hard_stop) = (CancellationToken::new(), CancellationToken::new());
    let task = tokio::spawn(engine.run_until(shutdown.clone(), hard_stop.clone()));
    // A migration's ALTER TABLE: the table is locked, and the next claim waits on it.
    let mut migration = db.conn();
    migration
        .batch_execute("BEGIN; LOCK TABLE postbox.messages IN ACCESS EXCLUSIVE MODE")
        .unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            db.scalar(
                "SELECT count(*) AS v FROM pg_stat_activity
                 WHERE application_name = 'postbox' AND wait_event_type = 'Lock'",
            ) > 0
        })
        .await,
        "no claim waited on the lock"
    );
    let started = std::time::Instant::now();
    shutdown.cancel();
    let hard = hard_stop.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(2)).await;
        hard.cancel();
    });
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("shutdown waited for the lock")
        .unwrap()
        .unwrap();
    let took = started.elapsed();
    eprintln!("shutdown with a claim waiting on a table lock took {took:?}");
    // The deadline (1 s), then the window of the last writes, cut by the hard stop at 2 s: the
    // engine returns within a second of it (the promise), whatever the table lock does.
    assert!(
        took < Duration::from_millis(3_000 + 500),
        "shutdown took {took:?} (hard stop at 2 s)"
    );
    migration.batch_execute("ROLLBACK").unwrap();
}

/// Delivers every message but the first of key `bad`, which is dead; before it returns that
/// outcome it locks that message's row on a connection of its own (an operator's transaction,
/// stretched), so the dead-lettering of that flush waits on the lock.
struct DeadWhileKeyLocked {
    bad: String,
    locker: Mutex<diesel::PgConnection>,
    delivered: Mutex<Vec<i64>>,
    seen_bad: std::sync::atomic::AtomicBool,
}

impl postbox::sink::Sink for DeadWhileKeyLocked {
    fn name(&self) -> &str {
        "keyed"
    }
    fn topics(&self) -> postbox::Topics {
        postbox::Topics::all()
    }
    fn deliver(
        &self,
        batch: Vec<postbox::ClaimedMessage>,
    ) -> futures_util::future::BoxFuture<
        '_,
        Result<Vec<postbox::sink::Outcome>, postbox::sink::Unavailable>,
    > {
        use std::sync::atomic::Ordering::SeqCst;
        let mut out = Vec::new();
        for m in &batch {
            if m.key.as_deref() == Some(self.bad.as_str()) && !self.seen_bad.swap(true, SeqCst) {
                use diesel::connection::SimpleConnection;
                self.locker
                    .lock()
                    .unwrap()
                    .batch_execute(&format!(
                        "BEGIN; SELECT 1 FROM postbox.messages WHERE id = {} FOR UPDATE",
                        m.id
                    ))
                    .unwrap();
                out.push(postbox::sink::Outcome::Dead {
                    reason: "refused".into(),
                });
            } else {
                self.delivered.lock().unwrap().push(m.id);
                out.push(postbox::sink::Outcome::Delivered);
            }
        }
        Box::pin(futures_util::future::ready(Ok(out)))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_that_fails_in_part_keeps_the_messages_its_hand_over_passed_on() {
    let db = TestDb::migrated();
    let bad = "b".to_owned();
    db.exec(&format!(
        "INSERT INTO postbox.messages (topic, key, ordered, payload)
         VALUES ('t', 'a', true, '1'), ('t', '{bad}', true, '2'), ('t', 'a', true, '3'), ('t', '{bad}', true, '4')"
    ));
    let a2 = db.scalar("SELECT max(id) AS v FROM postbox.messages WHERE key = 'a'");
    let sink = Arc::new(DeadWhileKeyLocked {
        bad: bad.clone(),
        locker: Mutex::new(db.conn()),
        delivered: Default::default(),
        seen_bad: Default::default(),
    });
    // The dead-lettering fails on the lock after 300 ms (and is tried again): the flush fails in
    // part.
    let engine = Engine::builder(format!("{}?options=-c%20lock_timeout%3D300", db.url))
        .sink_arc(sink.clone())
        .lease(Duration::from_secs(60))
        // Leased claims, settled by the completer's flush (held batches settle on their own).
        .hold_limit(Duration::ZERO)
        .build()
        .await
        .unwrap();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(engine.run(shutdown.clone()));
    // The complete of key a's head committed and handed its next message over while the
    // dead-lettering of the other key's head fails on the lock: that message is delivered now,
    // not after its lease expires.
    let handed_over_delivered = eventually(Duration::from_secs(10), || async {
        sink.delivered.lock().unwrap().contains(&a2)
    })
    .await;
    {
        use diesel::connection::SimpleConnection;
        sink.locker.lock().unwrap().batch_execute("COMMIT").unwrap();
    }
    assert!(
        handed_over_delivered,
        "the message handed over by a flush that failed in part was forgotten: {:?}",
        sink.delivered.lock().unwrap()
    );
    assert!(
        eventually(Duration::from_secs(20), || async {
            sink.delivered.lock().unwrap().len() == 3
                && db.scalar("SELECT count(*) AS v FROM postbox.dead_letters") == 1
        })
        .await
    );
    shutdown.cancel();
    task.await.unwrap().unwrap();
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
    let mut d = sink.delivered.lock().unwrap().clone();
    d.sort_unstable();
    d.dedup();
    assert_eq!(d.len(), 3, "a message was delivered twice");
}

/// Records every settlement with its topic.
#[derive(Default)]
struct Settlements(Mutex<Vec<(String, postbox::engine::Settlement)>>);

impl postbox::engine::Observer for Settlements {
    fn settled(&self, topic: &str, _sink: &str, what: postbox::engine::Settlement, _age: Duration) {
        self.0.lock().unwrap().push((topic.to_owned(), what));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_cut_off_by_shutdown_are_counted_under_their_topic() {
    let db = TestDb::migrated();
    let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let s = started.clone();
    let handlers = Handlers::new().on("reports.slow", move |_job: Job<serde_json::Value>| {
        let s = s.clone();
        async move {
            s.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            std::future::pending::<()>().await;
            Ok(())
        }
    });
    let observer = Arc::new(Settlements::default());
    let engine = Engine::builder(&db.url)
        .handlers(handlers)
        .observer(observer.clone())
        .shutdown_deadline(Duration::from_millis(200))
        .build()
        .await
        .unwrap();
    postbox::enqueue(&mut db.conn(), &postbox::Message::new("reports.slow")).unwrap();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(engine.run(shutdown.clone()));
    assert!(
        eventually(Duration::from_secs(10), || async {
            started.load(std::sync::atomic::Ordering::SeqCst) == 1
        })
        .await
    );
    shutdown.cancel();
    let report = task.await.unwrap().unwrap();
    assert_eq!(report.retried, 1);
    assert_eq!(
        *observer.0.lock().unwrap(),
        vec![(
            "reports.slow".to_owned(),
            postbox::engine::Settlement::Retried
        )]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_the_database_gone_ends_within_its_deadline_and_the_write_window() {
    let server = common::OwnServer::start(&[]);
    let db = server.migrated();
    let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let s = started.clone();
    let handlers = Handlers::new().on("t", move |_job: Job<serde_json::Value>| {
        let s = s.clone();
        async move {
            s.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            std::future::pending::<()>().await;
            Ok(())
        }
    });
    let engine = Engine::builder(&db.url)
        .handlers(handlers)
        .shutdown_deadline(Duration::from_secs(2))
        .build()
        .await
        .unwrap();
    let msgs: Vec<postbox::Message> = (0..5).map(|_| postbox::Message::new("t")).collect();
    postbox::enqueue_many(&mut db.conn(), &msgs).unwrap();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(engine.run(shutdown.clone()));
    assert!(
        eventually(Duration::from_secs(10), || async {
            started.load(std::sync::atomic::Ordering::SeqCst) == 5
        })
        .await
    );
    tokio::task::block_in_place(|| server.stop("immediate"));
    let stopping = std::time::Instant::now();
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(60), task)
        .await
        .expect("shutdown hung with the database gone");
    let took = stopping.elapsed();
    eprintln!("shutdown with the database gone took {took:?}");
    // The deadline (2 s), the window of the last writes (5 s), a second for the services.
    assert!(took < Duration::from_secs(10), "shutdown took {took:?}");
}

/// Counts the engine's signs of life.
#[derive(Default)]
struct Pulse(std::sync::atomic::AtomicUsize);

impl postbox::engine::Observer for Pulse {
    fn alive(&self, _sink: &str) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_whose_claims_keep_failing_gives_no_sign_of_life() {
    let db = TestDb::migrated();
    let pulse = Arc::new(Pulse::default());
    let engine = Engine::builder(&db.url)
        .handlers(recording("t", Default::default()))
        .observer(pulse.clone())
        .poll_interval(Duration::from_millis(50))
        .build()
        .await
        .unwrap();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(engine.run(shutdown.clone()));
    let beats = || pulse.0.load(std::sync::atomic::Ordering::SeqCst);
    assert!(eventually(Duration::from_secs(10), || async { beats() > 3 }).await);
    // Every claim now fails on its statement: the loop goes round, but does no work.
    db.exec("ALTER FUNCTION postbox.claim_ready(text, integer, double precision, bigint, text, text) RENAME TO claim_ready_gone");
    let failing = beats();
    // Over many poll intervals (and claim retries), no sign of life after the first failure.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = beats();
    assert!(
        after <= failing + 2,
        "alive {} times while every claim failed",
        after - failing
    );
    db.exec("ALTER FUNCTION postbox.claim_ready_gone(text, integer, double precision, bigint, text, text) RENAME TO claim_ready");
    assert!(
        eventually(Duration::from_secs(20), || async { beats() > after + 3 }).await,
        "no sign of life once claims work again"
    );
    shutdown.cancel();
    task.await.unwrap().unwrap();
}
