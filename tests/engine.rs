//! The embedded queue end to end: handlers, wake-up, lost notifications, retries, dead letters,
//! panics, lease extension, graceful shutdown, two engines on one table.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{TestDb, eventually};
use diesel::Connection;
use postbox::engine::{Engine, EngineConfig, RunReport};
use postbox::sink::handlers::{HandlerError, Handlers, Job};
use postbox::{Backoff, Message};
use tokio_util::sync::CancellationToken;

type Seen = Arc<Mutex<HashMap<i64, usize>>>;

fn recording(topic: &str, seen: Seen) -> Handlers {
    Handlers::new().on(topic, move |job: Job<serde_json::Value>| {
        let seen = seen.clone();
        async move {
            *seen.lock().unwrap().entry(job.id).or_default() += 1;
            Ok(())
        }
    })
}

fn fast_backoff() -> Backoff {
    Backoff {
        base: Duration::from_millis(20),
        cap: Duration::from_millis(200),
        jitter: 0.0,
    }
}

struct Running {
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<postbox::Result<RunReport>>,
    counters: Arc<postbox::engine::Counters>,
}

impl Running {
    async fn stop(self) -> RunReport {
        self.shutdown.cancel();
        self.task.await.unwrap().unwrap()
    }
}

fn start(engine: Engine) -> Running {
    let shutdown = CancellationToken::new();
    let counters = engine.counters();
    let task = tokio::spawn(engine.run(shutdown.clone()));
    Running {
        shutdown,
        task,
        counters,
    }
}

async fn listener_registered(db: &TestDb) -> bool {
    let url = db.url.clone();
    tokio::task::spawn_blocking(move || {
        let mut c = diesel::PgConnection::establish(&url).unwrap();
        #[derive(diesel::QueryableByName)]
        struct N {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        use diesel::RunQueryDsl;
        let n: N = diesel::sql_query("SELECT count(*) AS n FROM postbox.listeners")
            .get_result(&mut c)
            .unwrap();
        n.n > 0
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_from_app_transactions_reach_their_handlers_exactly_once() {
    let db = TestDb::migrated();
    db.exec("CREATE TABLE orders (id bigint PRIMARY KEY)");
    let seen: Seen = Default::default();
    let engine = Engine::builder(&db.url)
        .handlers(recording("order.created", seen.clone()))
        .build()
        .await
        .unwrap();
    let running = start(engine);

    let mut conn = db.conn();
    let mut committed = Vec::new();
    for i in 0..300i64 {
        let r: Result<i64, postbox::Error> = conn.transaction(|conn| {
            use diesel::connection::SimpleConnection;
            conn.batch_execute(&format!("INSERT INTO orders VALUES ({i})"))?;
            let id = postbox::enqueue(conn, &Message::new("order.created").payload(&i))?
                .id()
                .unwrap();
            if i % 10 == 0 {
                return Err(postbox::Error::Database(
                    diesel::result::Error::RollbackTransaction,
                ));
            }
            Ok(id)
        });
        if let Ok(id) = r {
            committed.push(id);
        }
    }
    assert!(
        eventually(Duration::from_secs(30), || async {
            running.counters.snapshot().delivered >= 270
        })
        .await,
        "delivered {:?}",
        running.counters.snapshot()
    );
    let report = running.stop().await;
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 270);
    assert!(
        seen.values().all(|n| *n == 1),
        "some message was handled twice"
    );
    for id in committed {
        assert_eq!(seen.get(&id), Some(&1));
    }
    assert_eq!(
        (report.delivered, report.retried, report.fenced),
        (270, 0, 0)
    );
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committed_message_wakes_an_idle_engine_without_waiting_for_the_poll() {
    let db = TestDb::migrated();
    let seen: Seen = Default::default();
    let engine = Engine::builder(&db.url)
        .handlers(recording("t", seen.clone()))
        .poll_interval(Duration::from_secs(60))
        .build()
        .await
        .unwrap();
    let running = start(engine);
    // Idle and registered as a waiting listener.
    assert!(eventually(Duration::from_secs(10), || listener_registered(&db)).await);
    let t0 = Instant::now();
    postbox::enqueue(&mut db.conn(), &Message::new("t")).unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            !seen.lock().unwrap().is_empty()
        })
        .await
    );
    let waited = t0.elapsed();
    assert!(
        waited < Duration::from_secs(5),
        "took {waited:?} with a 60 s poll interval"
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_notifications_are_covered_by_polling_and_the_notifier_reconnects() {
    let db = TestDb::migrated();
    let seen: Seen = Default::default();
    let engine = Engine::builder(&db.url)
        .handlers(recording("t", seen.clone()))
        .poll_interval(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    let running = start(engine);
    assert!(eventually(Duration::from_secs(10), || listener_registered(&db)).await);
    let old = db.scalar("SELECT pid::bigint AS v FROM postbox.listeners LIMIT 1");
    // Kill the LISTEN backend, then enqueue at once: no notification can reach the engine.
    db.exec(&format!("SELECT pg_terminate_backend({old})"));
    let ids: Vec<i64> =
        postbox::enqueue_many(&mut db.conn(), &[Message::new("t"), Message::new("t")])
            .unwrap()
            .iter()
            .map(|e| e.id().unwrap())
            .collect();
    assert!(
        eventually(Duration::from_secs(10), || async {
            let s = seen.lock().unwrap();
            ids.iter().all(|id| s.contains_key(id))
        })
        .await
    );
    // The notifier is back: a new backend LISTENs and registers when the engine goes idle.
    let reconnected = eventually(Duration::from_secs(10), || async {
        let url = db.url.clone();
        tokio::task::spawn_blocking(move || {
            use diesel::RunQueryDsl;
            #[derive(diesel::QueryableByName)]
            struct N {
                #[diesel(sql_type = diesel::sql_types::BigInt)]
                n: i64,
            }
            let mut c = diesel::PgConnection::establish(&url).unwrap();
            let n: N = diesel::sql_query(format!(
                "SELECT count(*) AS n FROM postbox.listeners WHERE pid <> {old}"
            ))
            .get_result(&mut c)
            .unwrap();
            n.n > 0
        })
        .await
        .unwrap()
    })
    .await;
    assert!(reconnected, "the notifier did not come back");
    // And it works: with a 300 ms poll this could pass by polling alone, so the check above is
    // the one that proves the reconnection.
    postbox::enqueue(&mut db.conn(), &Message::new("t")).unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            seen.lock().unwrap().len() == 3
        })
        .await
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_decisions_retry_with_delay_dead_letter_and_panics_retry_with_the_panic_text() {
    let db = TestDb::migrated();
    type Call = (String, i32, Option<String>, Instant);
    let calls: Arc<Mutex<Vec<Call>>> = Default::default();
    let c = calls.clone();
    let handlers = Handlers::new().on("jobs", move |job: Job<String>| {
        let c = c.clone();
        async move {
            c.lock().unwrap().push((
                job.payload.clone(),
                job.attempt,
                job.last_error.clone(),
                Instant::now(),
            ));
            match (job.payload.as_str(), job.attempt) {
                ("delay", 1) => Err(HandlerError::retry_after(
                    "busy",
                    Duration::from_millis(300),
                )),
                ("panic", 1) => panic!("boom at attempt 1"),
                ("dead", _) => Err(HandlerError::dead("invalid order")),
                ("io", 1) => Err(std::io::Error::other("disk full").into()),
                _ => Ok(()),
            }
        }
    });
    let engine = Engine::builder(&db.url)
        .handlers(handlers)
        .backoff(fast_backoff())
        .build()
        .await
        .unwrap();
    let running = start(engine);
    let mut conn = db.conn();
    let msgs = ["delay", "panic", "dead", "io"].map(|p| Message::new("jobs").payload(&p));
    postbox::enqueue_many(&mut conn, &msgs).unwrap();
    postbox::enqueue(&mut conn, &Message::new("jobs").payload(&42)).unwrap(); // not a String
    assert!(
        eventually(Duration::from_secs(20), || async {
            let s = running.counters.snapshot();
            s.delivered == 3 && s.dead_lettered == 2
        })
        .await,
        "{:?}",
        running.counters.snapshot()
    );
    let report = running.stop().await;
    assert_eq!(report.retried, 3);
    let calls = calls.lock().unwrap().clone();
    let of = |p: &str| {
        calls
            .iter()
            .filter(|c| c.0 == p)
            .cloned()
            .collect::<Vec<_>>()
    };
    let delay = of("delay");
    assert_eq!(delay.len(), 2);
    assert_eq!(delay[1].2.as_deref(), Some("busy"));
    assert!(
        delay[1].3 - delay[0].3 >= Duration::from_millis(290),
        "redelivered too early"
    );
    let panic = of("panic");
    assert_eq!(panic.len(), 2);
    assert_eq!(panic[1].2.as_deref(), Some("panicked: boom at attempt 1"));
    assert_eq!(of("io")[1].2.as_deref(), Some("disk full"));
    assert_eq!(of("dead").len(), 1);

    let store = postbox::Store::connect(&db.url, 2).await.unwrap();
    let dead = store.dead_list(None, 10).await.unwrap();
    assert_eq!(dead.len(), 2);
    assert!(
        dead.iter()
            .any(|d| d.reason == "invalid order" && d.attempts == 1)
    );
    assert!(dead.iter().any(|d| {
        d.reason
            .starts_with("payload does not deserialize into alloc::string::String")
            && d.reason.contains("invalid type: integer `42`")
    }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_extension_keeps_a_slow_message_from_a_second_engine() {
    let db = TestDb::migrated();
    let calls = Arc::new(AtomicUsize::new(0));
    let handlers = |calls: Arc<AtomicUsize>| {
        Handlers::new().on("slow", move |_job: Job<serde_json::Value>| {
            let calls = calls.clone();
            async move {
                calls.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(3500)).await;
                Ok(())
            }
        })
    };
    let config = EngineConfig {
        lease: Duration::from_secs(1),
        rescue_interval: Duration::from_millis(100),
        poll_interval: Duration::from_millis(100),
        ..Default::default()
    };
    let a = start(
        Engine::builder(&db.url)
            .handlers(handlers(calls.clone()))
            .config(config.clone())
            .build()
            .await
            .unwrap(),
    );
    postbox::enqueue(&mut db.conn(), &Message::new("slow")).unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            calls.load(Ordering::SeqCst) == 1
        })
        .await
    );
    // A second engine (with its own rescuer) runs beside it for longer than three leases.
    let b = start(
        Engine::builder(&db.url)
            .handlers(handlers(calls.clone()))
            .config(config)
            .build()
            .await
            .unwrap(),
    );
    assert!(
        eventually(Duration::from_secs(20), || async {
            a.counters.snapshot().delivered == 1
        })
        .await
    );
    let (ra, rb) = (a.stop().await, b.stop().await);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "handled twice: the lease was not extended"
    );
    assert_eq!((ra.fenced, rb.claimed), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_retries_deliveries_cut_off_at_the_deadline_and_leaves_the_rest_untouched()
 {
    let db = TestDb::migrated();
    let started = Arc::new(AtomicUsize::new(0));
    let s = started.clone();
    let handlers = Handlers::new().on("stuck", move |_job: Job<serde_json::Value>| {
        let s = s.clone();
        async move {
            s.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<()>().await;
            Ok(())
        }
    });
    let engine = Engine::builder(&db.url)
        .handlers(handlers)
        .concurrency(2)
        .shutdown_deadline(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    let running = start(engine);
    postbox::enqueue_many(
        &mut db.conn(),
        &(0..5).map(|_| Message::new("stuck")).collect::<Vec<_>>(),
    )
    .unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            started.load(Ordering::SeqCst) == 2
        })
        .await
    );
    // Held (the claim's fast path): nothing is written while the batch is held; the hold ends
    // at its limit (1 s) and leases the two still running, attempt counted.
    assert!(
        eventually(Duration::from_secs(10), || async {
            db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE attempts = 1 AND state = 'running'") == 2
        })
        .await
    );
    let report = running.stop().await;
    // The two cut off used their attempt (retried with backoff); the three never claimed did not.
    assert_eq!((report.retried, report.released), (2, 0));
    assert_eq!(
        db.scalar(
            "SELECT count(*) AS v FROM postbox.messages WHERE attempts = 1 AND state = 'scheduled'
               AND last_error LIKE 'delivery interrupted by shutdown%'"
        ),
        2
    );
    assert_eq!(
        db.scalar(
            "SELECT count(*) AS v FROM postbox.messages WHERE attempts = 0 AND state = 'available'"
        ),
        3,
        "a message kept its lease or lost an attempt"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_running_handlers_finish_within_the_deadline() {
    let db = TestDb::migrated();
    let gate = Arc::new(tokio::sync::Notify::new());
    let started = Arc::new(AtomicUsize::new(0));
    let (g, s) = (gate.clone(), started.clone());
    let handlers = Handlers::new().on("t", move |_job: Job<serde_json::Value>| {
        let (g, s) = (g.clone(), s.clone());
        async move {
            s.fetch_add(1, Ordering::SeqCst);
            g.notified().await;
            Ok(())
        }
    });
    let engine = Engine::builder(&db.url)
        .handlers(handlers)
        .concurrency(1)
        .build()
        .await
        .unwrap();
    let running = start(engine);
    postbox::enqueue_many(&mut db.conn(), &[Message::new("t"), Message::new("t")]).unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            started.load(Ordering::SeqCst) == 1
        })
        .await
    );
    running.shutdown.cancel();
    gate.notify_one();
    let report = running.task.await.unwrap().unwrap();
    assert_eq!((report.delivered, report.released), (1, 0));
    assert_eq!(
        started.load(Ordering::SeqCst),
        1,
        "claimed more after shutdown"
    );
    assert_eq!(
        db.scalar(
            "SELECT count(*) AS v FROM postbox.messages WHERE attempts = 0 AND locked_until IS NULL"
        ),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_engines_share_one_table_without_double_handling() {
    let db = TestDb::migrated();
    let seen: Seen = Default::default();
    // One holds its batches (the default), the other leases them (hold limit zero).
    let (url, seen2) = (&db.url, &seen);
    let mk = |hold_limit: Duration| async move {
        Engine::builder(url)
            .handlers(recording("shared", seen2.clone()))
            .batch_size(20)
            .hold_limit(hold_limit)
            .build()
            .await
            .unwrap()
    };
    let (a, b) = (
        start(mk(Duration::from_secs(1)).await),
        start(mk(Duration::ZERO).await),
    );
    let mut conn = db.conn();
    for chunk in 0..20 {
        let msgs: Vec<Message> = (0..100)
            .map(|i| Message::new("shared").payload(&(chunk * 100 + i)))
            .collect();
        postbox::enqueue_many(&mut conn, &msgs).unwrap();
    }
    assert!(
        eventually(Duration::from_secs(30), || async {
            seen.lock().unwrap().len() == 2000
        })
        .await
    );
    let (ra, rb) = (a.stop().await, b.stop().await);
    assert!(
        seen.lock().unwrap().values().all(|n| *n == 1),
        "double handling"
    );
    assert_eq!(ra.delivered + rb.delivered, 2000);
    assert!(
        ra.delivered > 0 && rb.delivered > 0,
        "one engine did all the work: {ra:?} {rb:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_claims_only_the_topics_it_has_handlers_for() {
    let db = TestDb::migrated();
    let seen: Seen = Default::default();
    let engine = Engine::builder(&db.url)
        .handlers(recording("mine", seen.clone()))
        .drain(true)
        .build()
        .await
        .unwrap();
    postbox::enqueue_many(
        &mut db.conn(),
        &[
            Message::new("mine"),
            Message::new("theirs"),
            Message::new("mine"),
        ],
    )
    .unwrap();
    let report = engine.run(CancellationToken::new()).await.unwrap();
    assert_eq!(report.delivered, 2);
    assert_eq!(
        db.scalar(
            "SELECT count(*) AS v FROM postbox.messages WHERE topic = 'theirs' AND attempts = 0"
        ),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_leases_of_a_dead_relay_are_rescued_and_delivered() {
    let db = TestDb::migrated();
    postbox::enqueue(&mut db.conn(), &Message::new("t")).unwrap();
    // A relay claims and dies.
    let store = postbox::Store::connect(&db.url, 2).await.unwrap();
    let claimed = store
        .claim(1, Duration::from_secs(1), &postbox::Topics::all())
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    let seen: Seen = Default::default();
    let config = EngineConfig {
        rescue_interval: Duration::from_millis(200),
        poll_interval: Duration::from_millis(200),
        ..Default::default()
    };
    let running = start(
        Engine::builder(&db.url)
            .handlers(recording("t", seen.clone()))
            .config(config)
            .backoff(fast_backoff())
            .build()
            .await
            .unwrap(),
    );
    assert!(
        eventually(Duration::from_secs(15), || async {
            seen.lock().unwrap().len() == 1
        })
        .await
    );
    running.stop().await;
    // The dead relay's late acknowledgement is fenced.
    assert_eq!(
        store.complete(&[claimed[0].lease()]).await.unwrap().fenced,
        vec![claimed[0].id]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmigrated_database_is_an_error_at_build() {
    let db = TestDb::empty();
    let e = Engine::builder(&db.url)
        .handlers(Handlers::new().on("t", |_: Job<()>| async { Ok(()) }))
        .build()
        .await
        .err()
        .unwrap();
    assert!(matches!(e, postbox::Error::Migration(_)), "{e}");
    assert!(e.to_string().contains("run postbox::migrate"), "{e}");
}

#[tokio::test]
async fn builder_errors_name_the_field() {
    let e = Engine::builder("postgres://unused")
        .build()
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(e.starts_with("sink:"), "{e}");
    let e = Engine::builder("postgres://unused")
        .handlers(Handlers::new().on("t", |_: Job<()>| async { Ok(()) }))
        .concurrency(0)
        .build()
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(e.starts_with("concurrency:"), "{e}");
    let e = Engine::builder("postgres://unused")
        .handlers(Handlers::new())
        .build()
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("serves no topics"), "{e}");
}

/// A sink that is down until told otherwise, then delivers everything.
struct Flaky {
    up: Arc<std::sync::atomic::AtomicBool>,
    calls: Arc<AtomicUsize>,
    delivered: Seen,
}

impl postbox::sink::Sink for Flaky {
    fn name(&self) -> &str {
        "flaky"
    }
    fn topics(&self) -> postbox::Topics {
        postbox::Topics::all()
    }
    fn max_batch(&self) -> usize {
        50
    }
    fn deliver(
        &self,
        batch: Vec<postbox::ClaimedMessage>,
    ) -> futures_util::future::BoxFuture<
        '_,
        Result<Vec<postbox::sink::Outcome>, postbox::sink::Unavailable>,
    > {
        use futures_util::FutureExt;
        async move {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if !self.up.load(Ordering::SeqCst) {
                return Err(postbox::sink::Unavailable::new("broker down"));
            }
            let mut d = self.delivered.lock().unwrap();
            for m in &batch {
                *d.entry(m.id).or_default() += 1;
            }
            Ok(batch
                .iter()
                .map(|_| postbox::sink::Outcome::Delivered)
                .collect())
        }
        .boxed()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unavailable_sink_gets_its_batch_back_without_using_attempts_and_the_engine_backs_off() {
    let db = TestDb::migrated();
    postbox::enqueue_many(
        &mut db.conn(),
        &(0..20)
            .map(|i| Message::new("t").payload(&i).max_attempts(1))
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let up = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let calls = Arc::new(AtomicUsize::new(0));
    let delivered: Seen = Default::default();
    let sink = Flaky {
        up: up.clone(),
        calls: calls.clone(),
        delivered: delivered.clone(),
    };
    let running = start(
        Engine::builder(&db.url)
            .sink(sink)
            .poll_interval(Duration::from_millis(50))
            .build()
            .await
            .unwrap(),
    );
    // Down: batches come back released, attempts untouched.
    assert!(
        eventually(Duration::from_secs(10), || async {
            running.counters.snapshot().released >= 20
        })
        .await
    );
    let t = Instant::now();
    let calls_then = calls.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Backing off (100 ms, doubling): a handful of tries in half a second, not one per poll.
    let tries = calls.load(Ordering::SeqCst) - calls_then;
    assert!(
        tries <= 6,
        "{tries} tries in {:?}: no back-off",
        t.elapsed()
    );
    // Attempts unused: 0 while waiting, 1 only for a batch being tried right now.
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE attempts = 0 OR (attempts = 1 AND locked_until IS NOT NULL)"),
        20
    );
    // Back up: everything is delivered, on its only attempt.
    up.store(true, Ordering::SeqCst);
    assert!(
        eventually(Duration::from_secs(40), || async {
            delivered.lock().unwrap().len() == 20
        })
        .await
    );
    let report = running.stop().await;
    assert_eq!((report.delivered, report.dead_lettered), (20, 0));
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters"),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_hands_running_messages_back_at_once() {
    let db = TestDb::migrated();
    let started = Arc::new(AtomicUsize::new(0));
    let s = started.clone();
    let handlers = Handlers::new().on("stuck", move |_job: Job<serde_json::Value>| {
        let s = s.clone();
        async move {
            s.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<()>().await;
            Ok(())
        }
    });
    let engine = Engine::builder(&db.url)
        .handlers(handlers)
        .shutdown_deadline(Duration::from_secs(600))
        .build()
        .await
        .unwrap();
    let (shutdown, hard_stop) = (CancellationToken::new(), CancellationToken::new());
    let task = tokio::spawn(engine.run_until(shutdown.clone(), hard_stop.clone()));
    postbox::enqueue(&mut db.conn(), &Message::new("stuck")).unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            started.load(Ordering::SeqCst) == 1
        })
        .await
    );
    shutdown.cancel();
    // Graceful: still waiting for the handler (the deadline is ten minutes away).
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!task.is_finished());
    hard_stop.cancel();
    let report = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("hard stop did not stop")
        .unwrap()
        .unwrap();
    assert_eq!((report.retried, report.released), (1, 0));
    assert_eq!(
        db.scalar(
            "SELECT count(*) AS v FROM postbox.messages WHERE attempts = 1 AND locked_until IS NULL"
        ),
        1
    );
    // The message's error says what happened: a second signal, not the deadline.
    assert_eq!(
        db.scalar(
            "SELECT count(*) AS v FROM postbox.messages
             WHERE last_error = 'delivery interrupted by a second stop signal during shutdown'"
        ),
        1
    );
}

/// Hands back the first delivery of every message with an even id (as a Kafka batch that a broker
/// outage failed in part), delivers the rest.
struct PartlyAway(Mutex<std::collections::HashSet<i64>>);

impl postbox::sink::Sink for PartlyAway {
    fn name(&self) -> &str {
        "partly"
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
        let mut seen = self.0.lock().unwrap();
        let out = batch
            .iter()
            .map(|m| {
                if m.id % 2 == 0 && seen.insert(m.id) {
                    postbox::sink::Outcome::Release {
                        reason: "away".into(),
                    }
                } else {
                    postbox::sink::Outcome::Delivered
                }
            })
            .collect();
        Box::pin(futures_util::future::ready(Ok(out)))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_a_sink_hands_back_from_a_partly_delivered_batch_use_no_attempt() {
    let db = TestDb::migrated();
    // One attempt each: a handed-back message that used it would be dead-lettered.
    let msgs: Vec<Message> = (0..50).map(|_| Message::new("t").max_attempts(1)).collect();
    common::enqueue(&db, msgs);
    let engine = Engine::builder(db.url.clone())
        .sink(PartlyAway(Mutex::default()))
        .config(EngineConfig {
            drain: true,
            ..Default::default()
        })
        .build()
        .await
        .unwrap();
    let report = engine.run(CancellationToken::new()).await.unwrap();
    assert_eq!(report.delivered, 50, "{report:?}");
    assert_eq!((report.retried, report.dead_lettered), (0, 0), "{report:?}");
    assert_eq!(report.released, 25, "{report:?}");
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters"),
        0
    );
}

/// A buffer a tracing subscriber writes into.
#[derive(Clone, Default)]
struct LogBuffer(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogBuffer {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// postbox logs through `tracing`: an app with a subscriber sees one info line when its engine
/// starts, naming what it serves.
#[tokio::test]
async fn an_engine_says_at_info_that_it_runs_and_what_it_serves_and_that_it_stopped() {
    use tracing_subscriber::util::SubscriberInitExt;
    let logs = LogBuffer::default();
    let writer = logs.clone();
    let _guard = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
        .with_ansi(false)
        .finish()
        .set_default();
    let db = TestDb::migrated();
    let engine = Engine::builder(&db.url)
        .handlers(Handlers::new().on("billing.*", |_: Job<()>| async { Ok(()) }))
        .build()
        .await
        .unwrap();
    let shutdown = CancellationToken::new();
    shutdown.cancel();
    engine.run(shutdown).await.unwrap();
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("postbox engine running"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        line.contains("INFO") && line.contains("billing.*"),
        "{line}"
    );
    assert!(
        text.lines().any(|l| l.contains("INFO")
            && l.contains("postbox engine stopped")
            && l.contains("delivered: 0")),
        "{text}"
    );
}

/// An app that embeds the engine stops it as the relay stops: the first SIGTERM (or Ctrl-C)
/// cancels the graceful shutdown, the second the hard stop.
#[tokio::test]
async fn stop_on_signals_cancels_shutdown_then_hard_stop() {
    let stop = postbox::engine::stop_on_signals();
    let term = || {
        std::process::Command::new("kill")
            .args(["-TERM", &std::process::id().to_string()])
            .status()
            .unwrap()
    };
    term();
    tokio::time::timeout(Duration::from_secs(10), stop.shutdown.cancelled())
        .await
        .expect("the first signal did not cancel shutdown");
    assert!(!stop.hard_stop.is_cancelled());
    term();
    tokio::time::timeout(Duration::from_secs(10), stop.hard_stop.cancelled())
        .await
        .expect("the second signal did not cancel the hard stop");
}

/// A pool of the app's whose connections run transactions above READ COMMITTED would break the
/// engine's claims under limits and its promotions: `build()` refuses it, naming the setting and
/// the way to build the pool.
#[tokio::test]
async fn an_app_pool_without_postbox_session_settings_is_refused_or_warned_at_build() {
    let db = TestDb::migrated();
    db.exec(&format!(
        "ALTER DATABASE {} SET default_transaction_isolation = 'repeatable read'",
        db.name
    ));
    let manager = diesel_async::pooled_connection::AsyncDieselConnectionManager::<
        diesel_async::AsyncPgConnection,
    >::new(&db.url);
    let pool = bb8::Pool::builder()
        .max_size(2)
        .build(manager)
        .await
        .unwrap();
    let e = match Engine::builder(&db.url)
        .pool(pool)
        .handlers(Handlers::new().on("t", |_: Job<()>| async { Ok(()) }))
        .build()
        .await
    {
        Ok(_) => panic!("built on a repeatable-read pool"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.starts_with("pool:") && e.contains("read committed") && e.contains("custom_setup"),
        "{e}"
    );
}

/// An embedded engine exports the relay's series on the app's own registry in one call: its
/// deliveries, and the database's gauges sampled while it runs (a topic it does not serve stays
/// in the table and shows in the queue depth). A second export on the same registry is refused.
#[cfg(feature = "metrics")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_engine_exports_the_relays_metrics_on_the_apps_registry() {
    use postbox::metrics::prometheus::{Encoder, Registry, TextEncoder};
    let db = TestDb::migrated();
    db.exec(
        "INSERT INTO postbox.messages (topic) SELECT 't' FROM generate_series(1, 5);
         INSERT INTO postbox.messages (topic) VALUES ('not.served')",
    );
    let registry = Registry::new();
    let seen: Seen = Arc::default();
    let engine = Engine::builder(db.url.clone())
        .handlers(recording("t", seen.clone()))
        .metrics(&registry)
        .build()
        .await
        .unwrap();
    let running = start(engine);
    let text = || {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&registry.gather(), &mut buf)
            .unwrap();
        String::from_utf8(buf).unwrap()
    };
    let exported = eventually(Duration::from_secs(30), || async {
        let t = text();
        t.contains(r#"postbox_messages_delivered_total{sink="handlers",topic="t"} 5"#)
            && t.contains(r#"postbox_queue_depth{state="available",topic="not.served"} 1"#)
    })
    .await;
    assert!(exported, "{}", text());
    let again = Engine::builder(db.url.clone())
        .handlers(recording("t", seen.clone()))
        .metrics(&registry)
        .build()
        .await;
    assert!(
        matches!(
            again,
            Err(postbox::Error::InvalidArgument {
                field: "metrics",
                ..
            })
        ),
        "a second export on one registry"
    );
    running.stop().await;
}

/// Snooze: a handler puts a message off without using an attempt (River's `JobSnooze`, Oban's
/// `{:snooze, s}`): it runs again after the delay with the same attempt number and no error
/// recorded, its ordered key waits with it, and on a backlog (held batches) as on single claims.
/// Past `max_snoozes` a snooze uses an attempt, so a message that only ever snoozes reaches the
/// dead letters, with a reason that says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snooze_runs_the_message_again_later_without_using_an_attempt_up_to_the_cap() {
    let db = TestDb::migrated();
    // payload: how many times to snooze before succeeding (-1: always).
    type Call = (i64, String, i32, Option<String>, Instant);
    let calls: Arc<Mutex<Vec<Call>>> = Default::default();
    let c = calls.clone();
    let handlers = Handlers::new().on("jobs", move |job: Job<i64>| {
        let c = c.clone();
        async move {
            let runs = {
                let mut c = c.lock().unwrap();
                c.push((
                    job.id,
                    job.key.clone().unwrap_or_default(),
                    job.attempt,
                    job.last_error.clone(),
                    Instant::now(),
                ));
                c.iter().filter(|x| x.0 == job.id).count() as i64
            };
            if job.payload < 0 || runs <= job.payload {
                return Err(HandlerError::snooze(Duration::from_millis(100)));
            }
            Ok(())
        }
    });
    let engine = Engine::builder(&db.url)
        .handlers(handlers)
        .backoff(fast_backoff())
        .max_snoozes(3)
        .build()
        .await
        .unwrap();
    let running = start(engine);
    let mut conn = db.conn();
    // A backlog that snoozes once each (taken in held batches), an ordered key whose head snoozes
    // twice, and one that always snoozes on its two attempts.
    let backlog: Vec<Message> = (0..300).map(|_| Message::new("jobs").payload(&1)).collect();
    postbox::enqueue_many(&mut conn, &backlog).unwrap();
    let ordered = [2, 0].map(|n| Message::new("jobs").key("k").ordered().payload(&n));
    postbox::enqueue_many(&mut conn, &ordered).unwrap();
    postbox::enqueue(
        &mut conn,
        &Message::new("jobs")
            .key("always")
            .payload(&-1)
            .max_attempts(2),
    )
    .unwrap();
    assert!(
        eventually(Duration::from_secs(60), || async {
            let s = running.counters.snapshot();
            s.delivered == 302 && s.dead_lettered == 1
        })
        .await,
        "{:?}",
        running.counters.snapshot()
    );
    let report = running.stop().await;
    // 300 + 2 under the cap, and the three the cap allows of the one that always snoozes.
    assert_eq!(report.snoozed, 305, "{report:?}");
    // The fourth snooze of that one used its first attempt, the fifth its last.
    assert_eq!(report.retried, 1, "{report:?}");
    let calls = calls.lock().unwrap().clone();
    let of_key = |k: &str| {
        calls
            .iter()
            .filter(|c| c.1 == k)
            .cloned()
            .collect::<Vec<_>>()
    };
    // Every run under the cap is attempt 1, with no error recorded, and after the delay.
    for c in calls.iter().filter(|c| c.1.is_empty()) {
        assert_eq!((c.2, c.3.as_deref()), (1, None), "{c:?}");
    }
    assert_eq!(calls.iter().filter(|c| c.1.is_empty()).count(), 600);
    let k = of_key("k");
    assert_eq!(k.len(), 4, "{k:?}");
    assert_eq!(k[0].0, k[1].0, "the head runs again");
    assert_eq!(k[1].0, k[2].0, "and again");
    assert!(
        k[3].0 > k[0].0,
        "the key's next message waits for its head: {k:?}"
    );
    assert!(
        k[1].4 - k[0].4 >= Duration::from_millis(90),
        "put off by the delay"
    );
    let always = of_key("always");
    assert_eq!(
        always.iter().map(|c| c.2).collect::<Vec<_>>(),
        [1, 1, 1, 1, 2],
        "three snoozes under the cap, then attempts"
    );
    assert!(
        always[4]
            .3
            .as_deref()
            .unwrap_or_default()
            .contains("max_snoozes"),
        "{always:?}"
    );
    let store = postbox::Store::connect(&db.url, 2).await.unwrap();
    let dead = store.dead_list(None, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert!(dead[0].reason.contains("max_snoozes"), "{}", dead[0].reason);
}

/// A handler's transaction: the completion record, the work (a row of the app's) and a
/// follow-up message, committed together or not at all.
type Pool = bb8::Pool<
    diesel_async::pooled_connection::AsyncDieselConnectionManager<diesel_async::AsyncPgConnection>,
>;

async fn app_pool(db: &TestDb) -> Pool {
    db.exec("CREATE TABLE effects (message_id bigint NOT NULL)");
    bb8::Pool::builder()
        .max_size(8)
        .build(diesel_async::pooled_connection::AsyncDieselConnectionManager::new(&db.url))
        .await
        .unwrap()
}

/// Does `job`'s work in one transaction with its completion and a follow-up message; `fail`
/// rolls it back after the work. Ok(false): an earlier delivery had done it.
async fn work_in_a_transaction(
    pool: &Pool,
    job: &Job<String>,
    fail: bool,
) -> Result<bool, HandlerError> {
    use diesel_async::{AsyncConnection, RunQueryDsl};
    let mut conn = pool
        .get()
        .await
        .map_err(|e| HandlerError::retry(e.to_string()))?;
    let did = conn
        .transaction::<_, postbox::Error, _>(async |conn| {
            if !job.complete_in(conn).await? {
                return Ok(false);
            }
            diesel::sql_query("INSERT INTO effects (message_id) VALUES ($1)")
                .bind::<diesel::sql_types::BigInt, _>(job.id)
                .execute(conn)
                .await?;
            postbox::enqueue_async(conn, &Message::new("followups").payload(&job.id)).await?;
            if fail {
                return Err(postbox::Error::InvalidArgument {
                    field: "work",
                    problem: "failed after its writes".into(),
                });
            }
            Ok(true)
        })
        .await?;
    Ok(did)
}

/// Each message's work, its completion and its follow-up messages commit together or not at all,
/// and happen once: a transaction that rolls back leaves nothing and the message is retried; a
/// delivery cut off after its commit (the engine never recorded the outcome: a failed attempt) is
/// delivered again and finds its work done. Leased messages here (`hold_limit` 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_completes_its_message_in_its_own_transaction_once() {
    let db = TestDb::migrated();
    let pool = app_pool(&db).await;
    let calls: Arc<Mutex<Vec<(String, bool)>>> = Arc::default();
    let (p, c) = (pool.clone(), calls.clone());
    let handlers = Handlers::new().on("orders", move |job: Job<String>| {
        let (pool, calls) = (p.clone(), c.clone());
        async move {
            let first = !calls.lock().unwrap().iter().any(|c| c.0 == job.payload);
            let did = work_in_a_transaction(&pool, &job, job.payload == "rollback" && first).await;
            calls
                .lock()
                .unwrap()
                .push((job.payload.clone(), *did.as_ref().unwrap_or(&false)));
            did?;
            if job.payload == "hang" && first {
                tokio::time::sleep(Duration::from_secs(3600)).await;
            }
            if job.payload == "dead after its work" && first {
                return Err(HandlerError::dead("after its work"));
            }
            Ok(())
        }
    });
    let engine = Engine::builder(&db.url)
        .handlers(handlers)
        .backoff(fast_backoff())
        .hold_limit(Duration::ZERO)
        .delivery_timeout(Duration::from_millis(500))
        .build()
        .await
        .unwrap();
    let running = start(engine);
    let msgs = ["plain", "rollback", "hang", "dead after its work"]
        .map(|k| Message::new("orders").payload(&k));
    postbox::enqueue_many(&mut db.conn(), &msgs).unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            let s = running.counters.snapshot();
            s.delivered == 3 && s.dead_lettered == 1
        })
        .await,
        "{:?}",
        running.counters.snapshot()
    );
    // A dead letter keeps its record: replayed, it is completed without doing its work again.
    let store = postbox::Store::connect(&db.url, 2).await.unwrap();
    store.forget_completions().await.unwrap();
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.completed_in_tx"),
        1,
        "the dead letter's record is kept"
    );
    let replayed = store
        .dead_replay(&postbox::store::DeadSelector::Topic("orders".into()))
        .await
        .unwrap();
    assert_eq!(replayed.replayed.len(), 1, "{replayed:?}");
    assert!(
        eventually(Duration::from_secs(30), || async {
            running.counters.snapshot().delivered == 4
        })
        .await,
        "{:?}",
        running.counters.snapshot()
    );
    let report = running.stop().await;
    assert_eq!(
        report.retried, 2,
        "the rollback and the cut-off delivery: {report:?}"
    );
    let calls = calls.lock().unwrap().clone();
    let of = |k: &str| {
        calls
            .iter()
            .filter(|c| c.0 == k)
            .map(|c| c.1)
            .collect::<Vec<_>>()
    };
    assert_eq!(of("plain"), [true]);
    assert_eq!(of("rollback"), [false, true], "rolled back, then done");
    assert_eq!(of("hang"), [true, false], "done, then found done");
    assert_eq!(
        of("dead after its work"),
        [true, false],
        "done, dead-lettered, replayed: found done"
    );
    assert_eq!(db.scalar("SELECT count(*) AS v FROM effects"), 4);
    assert_eq!(
        db.scalar("SELECT count(DISTINCT message_id) AS v FROM effects"),
        4
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE topic = 'followups'"),
        4,
        "one follow-up each, none from the rolled-back transaction"
    );
    // The records of settled messages are dropped by the upkeep.
    store.forget_completions().await.unwrap();
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.completed_in_tx"),
        0
    );
    // Outside a transaction it refuses (it would mark the work done before it is).
    let mut conn = pool.get().await.unwrap();
    let job_id = db.scalar("SELECT min(id) AS v FROM postbox.messages");
    let err = postbox::store::completion::complete_in(&mut conn, job_id, 1)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("inside the transaction"), "{err}");
    // A delivery is named by its lease token: a message not leased under it (a lost lease, or a
    // role guessing) is refused, and its transaction's work rolls back with it; so is token 0 (a
    // head kept for a writer after its delivery names no delivery).
    use diesel_async::AsyncConnection;
    for (token, state) in [(1, None), (0, Some("lease_token = 0"))] {
        if let Some(set) = state {
            db.exec(&format!(
                "UPDATE postbox.messages SET state = 'running', {set}, locked_until = now() + interval '1 minute', locked_by = 'x' WHERE id = {job_id}"
            ));
        }
        let refused = conn
            .transaction::<(), postbox::Error, _>(async |conn| {
                postbox::store::completion::complete_in(conn, job_id, token).await?;
                Ok(())
            })
            .await
            .unwrap_err();
        assert!(
            refused
                .to_string()
                .contains("no longer delivered under this lease"),
            "token {token}: {refused}"
        );
    }
}

/// Held batches: the engine's connections holding them are cut (as when a relay dies) after a
/// handler committed its work and before the hold recorded it; every held message is delivered
/// again, and each message's work still happens once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_messages_whose_hold_is_lost_after_the_handler_committed_are_not_done_twice() {
    let db = TestDb::migrated();
    let pool = app_pool(&db).await;
    let committed = Arc::new(tokio::sync::Notify::new());
    let go = Arc::new(tokio::sync::Notify::new());
    let state_then: Arc<Mutex<Option<String>>> = Arc::default();
    let calls: Arc<Mutex<Vec<(String, bool)>>> = Arc::default();
    let (p, c, done, resume) = (pool.clone(), calls.clone(), committed.clone(), go.clone());
    let url = db.url.clone();
    let state = state_then.clone();
    let handlers = Handlers::new().on("orders", move |job: Job<String>| {
        let (pool, calls, done, resume) = (p.clone(), c.clone(), done.clone(), resume.clone());
        let (url, state) = (url.clone(), state.clone());
        async move {
            let first = !calls.lock().unwrap().iter().any(|c| c.0 == job.payload);
            let did = work_in_a_transaction(&pool, &job, false).await?;
            calls.lock().unwrap().push((job.payload.clone(), did));
            if job.payload == "cut" && first {
                let mut conn = diesel::PgConnection::establish(&url).unwrap();
                #[derive(diesel::QueryableByName)]
                struct S {
                    #[diesel(sql_type = diesel::sql_types::Text)]
                    state: String,
                }
                use diesel::RunQueryDsl;
                let s: S = diesel::sql_query(format!(
                    "SELECT state::text AS state FROM postbox.messages WHERE id = {}",
                    job.id
                ))
                .get_result(&mut conn)
                .unwrap();
                *state.lock().unwrap() = Some(s.state);
                done.notify_one();
                resume.notified().await;
            }
            Ok(())
        }
    });
    let msgs: Vec<Message> = (0..60)
        .map(|i| {
            Message::new("orders").payload(&if i == 5 {
                "cut".to_owned()
            } else {
                format!("m{i}")
            })
        })
        .collect();
    postbox::enqueue_many(&mut db.conn(), &msgs).unwrap();
    let engine = Engine::builder(&db.url)
        .handlers(handlers)
        .batch_size(10)
        // The hold waits for its handlers however slow the machine (it is cut before then).
        .hold_limit(Duration::from_secs(20))
        .build()
        .await
        .unwrap();
    let running = start(engine);
    tokio::time::timeout(Duration::from_secs(30), committed.notified())
        .await
        .expect("the handler committed");
    assert_eq!(
        state_then.lock().unwrap().as_deref(),
        Some("available"),
        "held (not leased) when its handler ran"
    );
    // Every hold open now is lost: its transaction ends without a commit.
    let cut = db.scalar(
        "SELECT count(pg_terminate_backend(pid)) AS v FROM pg_stat_activity
         WHERE datname = current_database() AND state = 'idle in transaction' AND pid <> pg_backend_pid()",
    );
    assert!(cut >= 1, "no hold was open");
    go.notify_one();
    assert!(
        eventually(Duration::from_secs(60), || async {
            db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE topic = 'orders'") == 0
        })
        .await,
        "{:?}",
        running.counters.snapshot()
    );
    running.stop().await;
    let calls = calls.lock().unwrap().clone();
    let cut_calls: Vec<bool> = calls.iter().filter(|c| c.0 == "cut").map(|c| c.1).collect();
    assert_eq!(cut_calls, [true, false], "done, then found done");
    assert_eq!(db.scalar("SELECT count(*) AS v FROM effects"), 60);
    assert_eq!(
        db.scalar("SELECT count(DISTINCT message_id) AS v FROM effects"),
        60
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE topic = 'followups'"),
        60
    );
}

/// A database that cannot be reached is said at build with the server's own words (the pool
/// alone would time out after 10 s saying only that).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_on_a_database_that_does_not_exist_says_so_at_build() {
    let db = TestDb::migrated();
    let url = format!("{}_missing", db.url);
    let e = match Engine::builder(url)
        .handlers(recording("t", Seen::default()))
        .build()
        .await
    {
        Ok(_) => panic!("built on a database that does not exist"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("does not exist"), "{e}");
}
