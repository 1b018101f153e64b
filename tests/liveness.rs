//! Liveness: outcomes the database refuses, and outcomes that cannot be stored as given, do not
//! stall the engine; everything else keeps being delivered.

mod common;

use std::time::{Duration, Instant};

use common::{TestDb, enqueue, eventually};
use postbox::Message;
use postbox::engine::Engine;
use postbox::sink::handlers::{HandlerError, Handlers, Job};
use tokio_util::sync::CancellationToken;

/// Handlers for topic `t`: payload "ok" succeeds, anything else fails with what `fail` returns.
fn handlers(fail: fn(&str) -> HandlerError) -> Handlers {
    Handlers::new().on("t", move |job: Job<String>| async move {
        if job.payload == "ok" {
            Ok(())
        } else {
            Err(fail(&job.payload))
        }
    })
}

async fn start(
    db: &TestDb,
    handlers: Handlers,
) -> (
    CancellationToken,
    tokio::task::JoinHandle<postbox::Result<postbox::engine::RunReport>>,
) {
    let engine = Engine::builder(db.url.clone())
        .handlers(handlers)
        .poll_interval(Duration::from_millis(50))
        .shutdown_deadline(Duration::from_secs(5))
        .build()
        .await
        .unwrap();
    let stop = CancellationToken::new();
    let task = tokio::spawn(engine.run(stop.clone()));
    (stop, task)
}

fn ok_messages(n: usize) -> Vec<Message> {
    (0..n).map(|_| Message::new("t").payload("ok")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_with_a_nul_in_its_reason_and_an_endless_delay_is_stored_and_stalls_nothing() {
    let db = TestDb::migrated();
    let mut msgs = ok_messages(30);
    msgs.insert(10, Message::new("t").payload("poison"));
    let ids = enqueue(&db, msgs);
    let poison = ids[10];
    let (stop, task) = start(
        &db,
        handlers(|_| {
            HandlerError::retry_after(format!("bad\0reason {}", "x".repeat(20_000)), Duration::MAX)
        }),
    )
    .await;
    assert!(
        eventually(Duration::from_secs(20), || async {
            db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v") == 1
                && db.scalar(&format!(
                    "SELECT count(*) AS v FROM postbox.messages WHERE id = {poison} AND state = 'scheduled'"
                )) == 1
        })
        .await,
        "the other messages were not delivered, or the poison's retry was not written"
    );
    // Stored as PostgreSQL can: no NUL, cut to a bounded length, the delay shortened to a year.
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.messages WHERE id = {poison}
               AND position(U&'\\FFFD' IN last_error) > 0
               AND octet_length(last_error) <= 8 * 1024
               AND run_at BETWEEN now() + interval '364 days' AND now() + interval '366 days'"
        )),
        1,
        "{}",
        db.scalar(&format!(
            "SELECT (octet_length(last_error)::bigint * 1000000 + position(U&'\\FFFD' IN last_error))::bigint AS v FROM postbox.messages WHERE id = {poison}"
        ))
    );
    let t = Instant::now();
    stop.cancel();
    task.await.unwrap().unwrap();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_the_database_refuses_is_isolated_and_its_message_dead_lettered() {
    let db = TestDb::migrated();
    // Any statement that records this error fails, as a statement error would.
    db.exec(
        "CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'refused by the test'; END $$;
         CREATE TRIGGER refuse BEFORE UPDATE ON postbox.messages FOR EACH ROW
             WHEN (NEW.last_error = 'refuse me') EXECUTE FUNCTION public.refuse();",
    );
    let mut msgs = ok_messages(40);
    msgs.insert(20, Message::new("t").payload("poison"));
    let ids = enqueue(&db, msgs);
    let poison = ids[20];
    let (stop, task) = start(&db, handlers(|_| HandlerError::retry("refuse me"))).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v") == 0
        })
        .await,
        "messages left: {}",
        db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v")
    );
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.dead_letters
             WHERE id = {poison} AND reason LIKE '%could not record its outcome%refused by the test%'"
        )),
        1
    );
    // The engine keeps delivering.
    enqueue(&db, ok_messages(5));
    assert!(
        eventually(Duration::from_secs(10), || async {
            db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v") == 0
        })
        .await
    );
    stop.cancel();
    task.await.unwrap().unwrap();
}

/// Handlers for topic `t` that never return for payload "hang".
fn hanging() -> Handlers {
    Handlers::new().on("t", |job: Job<String>| async move {
        if job.payload == "hang" {
            std::future::pending::<()>().await;
        }
        Ok(())
    })
}

fn fast_backoff() -> postbox::Backoff {
    postbox::Backoff {
        base: Duration::from_millis(20),
        cap: Duration::from_millis(100),
        jitter: 0.0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_never_returns_times_out_and_ends_in_the_dead_letters() {
    let db = TestDb::migrated();
    let mut msgs = ok_messages(10);
    msgs.push(Message::new("t").payload("hang").max_attempts(2));
    let ids = enqueue(&db, msgs);
    let hung = ids[10];
    let engine = Engine::builder(db.url.clone())
        .handlers(hanging())
        .delivery_timeout(Duration::from_secs(3600))
        .topic_timeout("t", Duration::from_millis(200))
        .backoff(fast_backoff())
        .build()
        .await
        .unwrap();
    let stop = CancellationToken::new();
    let task = tokio::spawn(engine.run(stop.clone()));
    assert!(
        eventually(Duration::from_secs(20), || async {
            db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v") == 0
        })
        .await
    );
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.dead_letters
             WHERE id = {hung} AND attempts = 2 AND reason LIKE '%timed out after 200ms%'"
        )),
        1
    );
    stop.cancel();
    let report = task.await.unwrap().unwrap();
    assert_eq!((report.delivered, report.dead_lettered), (10, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_cut_off_by_shutdown_use_their_attempt_so_a_hang_ends_in_the_dead_letters_across_restarts()
 {
    let db = TestDb::migrated();
    let id = enqueue(&db, vec![Message::new("t").payload("hang").max_attempts(2)])[0];
    for restart in 0..2 {
        let engine = Engine::builder(db.url.clone())
            .handlers(hanging())
            .shutdown_deadline(Duration::from_millis(100))
            .backoff(fast_backoff())
            .poll_interval(Duration::from_millis(50))
            .build()
            .await
            .unwrap();
        let stop = CancellationToken::new();
        let task = tokio::spawn(engine.run(stop.clone()));
        assert!(
            eventually(Duration::from_secs(10), || async {
                db.scalar(&format!(
                    "SELECT count(*) AS v FROM postbox.messages WHERE id = {id} AND state = 'running'"
                )) == 1
            })
            .await,
            "not claimed after restart {restart}"
        );
        stop.cancel();
        task.await.unwrap().unwrap();
    }
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.dead_letters
             WHERE id = {id} AND attempts = 2 AND reason LIKE '%interrupted by shutdown%'"
        )),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rescuer_drops_registrations_of_listeners_that_died_while_waiting() {
    let db = TestDb::migrated();
    // A live backend's registration stays; one whose backend is gone (pid not in use) goes.
    let _other_backend = db.aconn().await;
    db.exec(
        "INSERT INTO postbox.listeners (pid)
         SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() LIMIT 1;
         INSERT INTO postbox.listeners (pid) VALUES (2147483000);",
    );
    assert_eq!(db.scalar("SELECT count(*) AS v FROM postbox.listeners"), 2);
    let store = db.store().await;
    postbox::engine::Rescuer::new(store, Duration::from_secs(1))
        .run_once()
        .await
        .unwrap();
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.listeners WHERE pid = 2147483000"),
        0,
        "the dead registration is still there: every writer keeps notifying"
    );
    assert_eq!(db.scalar("SELECT count(*) AS v FROM postbox.listeners"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_that_inserted_before_the_relay_registered_and_commits_after_its_last_look_wakes_it()
 {
    use diesel::connection::SimpleConnection;
    let db = TestDb::migrated();
    // The writer inserts while no relay waits: its insert queues no NOTIFY.
    let mut writer = db.conn();
    writer
        .batch_execute(
            "BEGIN; INSERT INTO postbox.messages (topic, payload) VALUES ('t', '\"ok\"')",
        )
        .unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let handlers = Handlers::new().on("t", move |job: Job<String>| {
        let tx = tx.clone();
        async move {
            let _ = tx.send(job.id);
            Ok(())
        }
    });
    let engine = Engine::builder(db.url.clone())
        .handlers(handlers)
        .poll_interval(Duration::from_secs(60))
        .build()
        .await
        .unwrap();
    let stop = CancellationToken::new();
    let task = tokio::spawn(engine.run(stop.clone()));
    // The relay registers as waiting and looks once more (finding nothing: not committed yet).
    assert!(
        eventually(Duration::from_secs(10), || async {
            db.scalar("SELECT count(*) AS v FROM postbox.listeners") == 1
        })
        .await
    );
    // Let its last look pass (this orders the race the test is about; it cannot make it pass).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let committed = Instant::now();
    writer.batch_execute("COMMIT").unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await;
    assert!(
        got.is_ok(),
        "the message waited for the 60 s poll: nothing woke the relay"
    );
    assert!(
        committed.elapsed() < Duration::from_secs(2),
        "{:?}",
        committed.elapsed()
    );
    stop.cancel();
    task.await.unwrap().unwrap();
}
