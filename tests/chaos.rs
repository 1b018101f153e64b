//! Chaos: the relay keeps its promises under infrastructure faults, checked with an exact ledger.
//! The writer records each message it produced in its own table in the same transaction (a
//! transaction that fails is not counted); the handler records each delivery. Afterwards:
//! lost = produced − delivered − still queued − dead must be empty; duplicates are counted.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{TestDb, create_ledger, eventually, ledger, ledger_writer};
use diesel::{Connection, PgConnection, RunQueryDsl};
use postbox::engine::{Engine, EngineConfig};
use postbox::sink::handlers::{Handlers, Job};
use tokio_util::sync::CancellationToken;

type Delivered = Arc<Mutex<HashMap<i64, u32>>>;

fn recording(delivered: &Delivered) -> Handlers {
    let d = delivered.clone();
    Handlers::new().on("chaos", move |job: Job<serde_json::Value>| {
        let d = d.clone();
        async move {
            *d.lock().unwrap().entry(job.id).or_default() += 1;
            Ok(())
        }
    })
}

fn chaos_config() -> EngineConfig {
    EngineConfig {
        lease: Duration::from_secs(2),
        rescue_interval: Duration::from_millis(500),
        poll_interval: Duration::from_millis(100),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_crashing_every_two_seconds_next_to_another_loses_nothing() {
    let db = TestDb::migrated();
    let url = db.url.clone();
    let crashes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let c = crashes.clone();
    // The other relay runs on a runtime of its own, dropped every 2 s without any shutdown: its
    // tasks stop where they are and its connections close, as when the process is killed.
    let (produced, lost, _, dead, _) = ledger_run(&db, "relay crashed", |delivered| async move {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            let (url, handlers) = (url.clone(), recording(&delivered));
            rt.spawn(async move {
                let engine = Engine::builder(url)
                    .handlers(handlers)
                    .config(chaos_config())
                    .build()
                    .await
                    .unwrap();
                let _ = engine.run(CancellationToken::new()).await;
            });
            tokio::time::sleep(Duration::from_secs(2)).await;
            rt.shutdown_background();
            c.fetch_add(1, Ordering::Relaxed);
        }
    })
    .await;
    eprintln!("{} crashes", crashes.load(Ordering::Relaxed));
    assert!(lost.is_empty(), "lost: {lost:?}");
    assert_eq!(dead, 0);
    assert!(produced > 100, "the writer barely wrote: {produced}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_relay_backend_terminated_twice_a_second_for_thirty_seconds_loses_nothing() {
    let db = TestDb::migrated();
    let url = db.url.clone();
    let terminated = Arc::new(std::sync::atomic::AtomicI64::new(0));
    let t = terminated.clone();
    // The faults: every connection of the relay (application_name 'postbox') terminated, twice a
    // second; recovery without restarting the relay.
    let (produced, lost, _, dead, _) = ledger_run(&db, "backends terminated", |_| async move {
        let mut killer = PgConnection::establish(&url).unwrap();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(30) {
            #[derive(diesel::QueryableByName)]
            struct N {
                #[diesel(sql_type = diesel::sql_types::BigInt)]
                n: i64,
            }
            let n: N = diesel::sql_query(
                "SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity
                 WHERE datname = current_database() AND application_name = 'postbox'",
            )
            .get_result(&mut killer)
            .unwrap();
            t.fetch_add(n.n, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
    .await;
    eprintln!("{} backends terminated", terminated.load(Ordering::Relaxed));
    assert!(lost.is_empty(), "lost: {lost:?}");
    assert_eq!(dead, 0);
    assert!(terminated.load(Ordering::Relaxed) > 0);
    assert!(produced > 100, "the writer barely wrote: {produced}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_held_open_shows_in_the_metrics_and_holds_up_no_delivery() {
    use diesel::connection::SimpleConnection;
    let db = TestDb::migrated();
    create_ledger(&db);
    let delivered: Delivered = Arc::default();
    let engine = Engine::builder(db.url.clone())
        .handlers(recording(&delivered))
        .config(chaos_config())
        .build()
        .await
        .unwrap();
    let stop_engine = CancellationToken::new();
    let task = tokio::spawn(engine.run(stop_engine.clone()));
    // Another session holds a transaction (and its snapshot) open: vacuum cannot clean behind it.
    let mut holder = db.conn();
    holder
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT txid_current()")
        .unwrap();
    let stop_writing = Arc::new(AtomicBool::new(false));
    let w = ledger_writer(db.url.clone(), "chaos", stop_writing.clone());
    tokio::time::sleep(Duration::from_secs(50)).await;
    let ten_before = delivered.lock().unwrap().len();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let store = db.store().await;
    let oldest = store
        .sample(Duration::ZERO)
        .await
        .unwrap()
        .into_iter()
        .find(|r| r.metric == "oldest_transaction")
        .map(|r| r.value)
        .unwrap();
    let during = delivered.lock().unwrap().len();
    holder.batch_execute("COMMIT").unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let after = delivered.lock().unwrap().len();
    stop_writing.store(true, Ordering::Release);
    tokio::task::spawn_blocking(move || w.join().unwrap())
        .await
        .unwrap();
    let drained = eventually(Duration::from_secs(30), || async {
        db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v") == 0
    })
    .await;
    stop_engine.cancel();
    task.await.unwrap().unwrap();
    let delivered = delivered.lock().unwrap().clone();
    let (produced, lost, duplicates, dead) = ledger(&db, &delivered);
    eprintln!(
        "chaos (transaction held open 60 s): oldest transaction {oldest:.1} s in the sample, \
         {during} delivered while it was open ({:.0}/s in its last 10 s, {:.0}/s in the 10 s \
         after it); produced {produced}, lost {}, duplicates {duplicates}, dead {dead}",
        (during - ten_before) as f64 / 10.0,
        (after - during) as f64 / 10.0,
        lost.len()
    );
    assert!(
        oldest >= 59.0,
        "the sample shows the oldest transaction at {oldest} s"
    );
    assert!(
        during > 100,
        "deliveries stalled behind the open transaction: {during}"
    );
    assert!(drained);
    assert!(lost.is_empty(), "lost: {lost:?}");
    assert_eq!(dead, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_crashes_its_relay_every_time_ends_in_the_dead_letters() {
    use postbox::engine::maintenance::{Rescuer, Scheduler};
    use std::sync::atomic::AtomicUsize;
    let db = TestDb::migrated();
    postbox::enqueue(
        &mut db.conn(),
        &postbox::Message::new("crash").max_attempts(3),
    )
    .unwrap();
    // Another replica's rescuer counts the attempts of holds that never committed.
    let fast = postbox::Backoff {
        base: Duration::from_millis(10),
        cap: Duration::from_millis(10),
        jitter: 0.0,
    };
    let rescuer = Rescuer::new(
        db.store().await.with_backoff(fast).unwrap(),
        Duration::from_millis(200),
    );
    let stop_rescuer = CancellationToken::new();
    let rescuing = tokio::spawn(rescuer.run(stop_rescuer.clone()));
    let scheduler = Scheduler::new(
        db.store().await,
        Duration::from_millis(50),
        Arc::new(tokio::sync::Notify::new()),
    );
    let scheduling = tokio::spawn(scheduler.run(stop_rescuer.clone()));
    let calls = Arc::new(AtomicUsize::new(0));
    let mut crashes = 0;
    // The handler takes the relay down: its runtime is dropped while the batch is held (the
    // hold never commits, as when the process dies).
    while db.scalar("SELECT count(*) AS v FROM postbox.dead_letters") == 0 && crashes < 10 {
        // The next relay starts once the last lost hold was counted and the message is claimable
        // again: its first claim holds it.
        // One snapshot: a held row stays `available`, so a check of the message and one of the
        // holds made apart can both pass before the lost hold is counted.
        eventually(Duration::from_secs(10), || async {
            db.scalar(
                "SELECT count(*) AS v FROM postbox.messages
                 WHERE state = 'available' AND NOT EXISTS (SELECT FROM postbox.holds)",
            ) == 1
                || db.scalar("SELECT count(*) AS v FROM postbox.dead_letters") > 0
        })
        .await;
        if db.scalar("SELECT count(*) AS v FROM postbox.dead_letters") > 0 {
            break;
        }
        let before = calls.load(Ordering::SeqCst);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (url, c) = (db.url.clone(), calls.clone());
        rt.spawn(async move {
            let handlers = Handlers::new().on("crash", move |_: Job<serde_json::Value>| {
                let c = c.clone();
                async move {
                    c.fetch_add(1, Ordering::SeqCst);
                    std::future::pending::<()>().await;
                    Ok(())
                }
            });
            // Held: a relay that starts takes its first batch into a hold, kept here until the
            // crash (a hold that outlives its limit leases what is still running).
            let engine = Engine::builder(url)
                .handlers(handlers)
                .config(EngineConfig {
                    hold_limit: Duration::from_secs(60),
                    ..chaos_config()
                })
                .build()
                .await
                .unwrap();
            let _ = engine.run(CancellationToken::new()).await;
        });
        eventually(Duration::from_secs(10), || async {
            calls.load(Ordering::SeqCst) > before
                || db.scalar("SELECT count(*) AS v FROM postbox.dead_letters") > 0
        })
        .await;
        rt.shutdown_background();
        crashes += 1;
    }
    let dead = eventually(Duration::from_secs(10), || async {
        // Usually "… held by X (its transaction ended without a commit)"; when the crash lands
        // while the relay's next claim is on the wire, that claim may lease the message as the
        // hold's transaction ends, and the last attempt is an expired lease instead. Either way
        // every attempt was counted: without the holds' counting it would never get here.
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters WHERE reason LIKE 'attempts exhausted (3 of 3)%'") == 1
    })
    .await;
    stop_rescuer.cancel();
    rescuing.await.unwrap();
    scheduling.await.unwrap();
    assert!(
        dead,
        "after {crashes} crashes the message is not in the dead letters"
    );
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
    let calls = calls.load(Ordering::SeqCst);
    assert!((3..=6).contains(&calls), "delivered {calls} times");
}

/// Runs a relay's deliveries against `db` while a writer produces, calls `fault` (given the time
/// the faults may take, and the delivery record, for relays of its own), then stops the writer and
/// waits for the queue to empty. Prints the ledger and returns (produced, lost, duplicates, dead,
/// recovery time).
async fn ledger_run<F, Fut>(
    db: &TestDb,
    name: &str,
    fault: F,
) -> (usize, Vec<i64>, u32, usize, Duration)
where
    F: FnOnce(Delivered) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    create_ledger(db);
    let delivered: Delivered = Arc::default();
    let engine = Engine::builder(db.url.clone())
        .handlers(recording(&delivered))
        .config(chaos_config())
        .build()
        .await
        .unwrap();
    let stop_engine = CancellationToken::new();
    let task = tokio::spawn(engine.run(stop_engine.clone()));
    let stop_writing = Arc::new(AtomicBool::new(false));
    let w = ledger_writer(db.url.clone(), "chaos", stop_writing.clone());
    tokio::time::sleep(Duration::from_secs(2)).await;
    fault(delivered.clone()).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop_writing.store(true, Ordering::Release);
    let commits = tokio::task::spawn_blocking(move || w.join().unwrap())
        .await
        .unwrap();
    let faults_ended = Instant::now();
    let recovered = eventually(Duration::from_secs(60), || async {
        db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v") == 0
    })
    .await;
    let recovery = faults_ended.elapsed();
    stop_engine.cancel();
    task.await.unwrap().unwrap();
    let delivered = delivered.lock().unwrap().clone();
    let (produced, lost, duplicates, dead) = ledger(db, &delivered);
    eprintln!(
        "chaos ({name}): produced {produced} ({commits} commits seen by the writer), delivered {}, \
         duplicates {duplicates}, lost {}, dead {dead}, queue empty {recovery:?} after the writer stopped",
        delivered.len(),
        lost.len()
    );
    assert!(recovered, "{name}: the queue did not drain");
    (produced, lost, duplicates, dead, recovery)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarted_mid_drain_loses_nothing_and_the_relay_recovers_by_itself() {
    let server = common::OwnServer::start(&[]);
    let db = server.migrated();
    let (produced, lost, _, dead, _) = ledger_run(&db, "PostgreSQL restarted", |_| async {
        // A fast stop (every session terminated), about 10 s down, then up again.
        let down = Instant::now();
        let s = &server;
        tokio::task::block_in_place(|| s.stop("fast"));
        tokio::time::sleep(Duration::from_secs(10)).await;
        tokio::task::block_in_place(|| s.start_again());
        eprintln!("PostgreSQL was down for {:?}", down.elapsed());
    })
    .await;
    assert!(lost.is_empty(), "lost: {lost:?}");
    assert_eq!(dead, 0);
    assert!(produced > 100, "the writer barely wrote: {produced}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_exhausted_for_twenty_seconds_the_relay_survives_and_recovers() {
    let server = common::OwnServer::start(&["max_connections=30"]);
    let db = server.migrated();
    let url = db.url.clone();
    let (produced, lost, _, dead, _) = ledger_run(&db, "connections exhausted", |_| async move {
        // Other clients take every connection the server has left, and the relay's own are
        // terminated (their slots taken too, as often as it takes), so it must reconnect while
        // none is to be had.
        let mut held: Vec<PgConnection> = Vec::new();
        let grab = |held: &mut Vec<PgConnection>| {
            while let Ok(c) = PgConnection::establish(&url) {
                held.push(c);
            }
        };
        let relay_backends = |c: &mut PgConnection| -> i64 {
            #[derive(diesel::QueryableByName)]
            struct N {
                #[diesel(sql_type = diesel::sql_types::BigInt)]
                n: i64,
            }
            diesel::sql_query(
                "SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity WHERE application_name = 'postbox'",
            )
            .get_result::<N>(c)
            .unwrap()
            .n
        };
        tokio::task::block_in_place(|| {
            grab(&mut held);
            while relay_backends(&mut held[0]) > 0 {
                std::thread::sleep(Duration::from_millis(50));
                grab(&mut held);
            }
        });
        // For 20 s: a slot that frees (a terminated backend going away) is taken at once, and a
        // relay connection that slipped into one is terminated again.
        let start = Instant::now();
        let mut slipped = 0;
        while start.elapsed() < Duration::from_secs(20) {
            tokio::time::sleep(Duration::from_millis(200)).await;
            slipped += tokio::task::block_in_place(|| {
                let n = relay_backends(&mut held[0]);
                grab(&mut held);
                n
            });
        }
        eprintln!(
            "{} connections held by other clients for 20 s ({slipped} relay connections got a freed slot and were terminated)",
            held.len()
        );
        drop(held);
    })
    .await;
    assert!(lost.is_empty(), "lost: {lost:?}");
    assert_eq!(dead, 0);
    assert!(produced > 100, "the writer barely wrote: {produced}");
}

/// A relay process (the `postbox` binary, log sink) whose stdout lines are counted per message id
/// into `delivered` by a thread of its own.
fn relay_process(
    url: &str,
    delivered: &Delivered,
) -> (std::process::Child, std::thread::JoinHandle<()>) {
    relay_process_with(url, &[], delivered, Arc::default())
}

/// [`relay_process`] with more arguments before `run` (`--config FILE`); its output is not read
/// while `paused` is set (once the pipe is full, the relay blocks in the middle of a delivery).
fn relay_process_with(
    url: &str,
    args: &[&str],
    delivered: &Delivered,
    paused: Arc<AtomicBool>,
) -> (std::process::Child, std::thread::JoinHandle<()>) {
    use std::io::BufRead;
    let mut child = common::hermetic(env!("CARGO_BIN_EXE_postbox"))
        .args(args)
        .args(["--database-url", url, "run"])
        .env("POSTBOX_LEASE", "2s")
        .env("POSTBOX_POLL_INTERVAL", "100ms")
        .env("POSTBOX_BATCH_SIZE", "100")
        .env("POSTBOX_METRICS_LISTEN", "127.0.0.1:0")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let d = delivered.clone();
    let reader = std::thread::spawn(move || {
        let mut lines = std::io::BufReader::new(out).lines();
        loop {
            while paused.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(10));
            }
            let Some(line) = lines.next() else { break };
            let Ok(line) = line else { break };
            // A process killed mid-line leaves a partial line: not a delivery it reported.
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line)
                && let Some(id) = v["id"].as_i64()
            {
                *d.lock().unwrap().entry(id).or_default() += 1;
            }
        }
    });
    (child, reader)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_processes_sigkilled_every_two_seconds_next_to_another_lose_nothing() {
    let db = TestDb::migrated();
    create_ledger(&db);
    // A backlog of 20,000, recorded in the ledger in the same transaction, and a writer running.
    {
        let mut conn = db.conn();
        conn.transaction::<_, postbox::Error, _>(|c| {
            let msgs: Vec<postbox::Message> = (0..20_000)
                .map(|_| postbox::Message::new("chaos"))
                .collect();
            let ids: Vec<String> = postbox::enqueue_many(c, &msgs)?
                .iter()
                .map(|e| e.id().unwrap().to_string())
                .collect();
            diesel::sql_query(format!(
                "INSERT INTO public.produced (id) SELECT unnest('{{{}}}'::bigint[])",
                ids.join(",")
            ))
            .execute(c)?;
            Ok(())
        })
        .unwrap();
    }
    let delivered: Delivered = Arc::default();
    let stop_writing = Arc::new(AtomicBool::new(false));
    let w = ledger_writer(db.url.clone(), "chaos", stop_writing.clone());
    let (mut steady, steady_out) = relay_process(&db.url, &delivered);
    let start = Instant::now();
    let mut kills = 0;
    while start.elapsed() < Duration::from_secs(16) {
        let (mut victim, out) = relay_process(&db.url, &delivered);
        tokio::time::sleep(Duration::from_secs(2)).await;
        victim.kill().unwrap(); // SIGKILL
        victim.wait().unwrap();
        out.join().unwrap();
        kills += 1;
    }
    stop_writing.store(true, Ordering::Release);
    let commits = tokio::task::spawn_blocking(move || w.join().unwrap())
        .await
        .unwrap();
    let faults_ended = Instant::now();
    let recovered = eventually(Duration::from_secs(60), || async {
        db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v") == 0
    })
    .await;
    let recovery = faults_ended.elapsed();
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &steady.id().to_string()])
        .status();
    assert!(steady.wait().unwrap().success());
    steady_out.join().unwrap();

    let delivered = delivered.lock().unwrap().clone();
    let (produced, lost, duplicates, dead) = ledger(&db, &delivered);
    eprintln!(
        "chaos (relay processes SIGKILLed): produced {produced} ({commits} by the writer after a \
         backlog of 20000), {kills} kills, delivered {}, duplicates {duplicates}, lost {}, dead \
         {dead}, queue empty {recovery:?} after the kills",
        delivered.len(),
        lost.len()
    );
    assert!(recovered);
    assert!(lost.is_empty(), "lost: {lost:?}");
    assert_eq!(dead, 0);
    // What a killed relay had taken and not settled (at most its holds and leases in flight, 5
    // batches of 100) is delivered again; nothing else.
    assert!(
        duplicates as usize <= kills * 500,
        "{duplicates} duplicates for {kills} kills"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_outcomes_and_hung_handlers_end_in_the_dead_letters_and_the_rest_flows() {
    use postbox::sink::handlers::HandlerError;
    let db = TestDb::migrated();
    create_ledger(&db);
    let delivered: Delivered = Arc::default();
    let d = delivered.clone();
    // Poison: a dead-letter reason the database refuses as it is (NUL bytes, 100 KB). Hung: a
    // handler that never returns.
    let poison = |id: i64| id % 97 == 0;
    let hung = |id: i64| id % 89 == 0;
    let handlers = Handlers::new().on("chaos", move |job: Job<serde_json::Value>| {
        let d = d.clone();
        async move {
            if poison(job.id) {
                return Err(HandlerError::dead(format!("bad\0{}", "x".repeat(100_000))));
            }
            if hung(job.id) {
                std::future::pending::<()>().await;
            }
            *d.lock().unwrap().entry(job.id).or_default() += 1;
            Ok(())
        }
    });
    let engine = Engine::builder(db.url.clone())
        .handlers(handlers)
        .config(EngineConfig {
            delivery_timeout: Duration::from_millis(300),
            shutdown_deadline: Duration::from_secs(1),
            ..chaos_config()
        })
        .backoff(postbox::Backoff {
            base: Duration::from_millis(10),
            cap: Duration::from_millis(10),
            jitter: 0.0,
        })
        .build()
        .await
        .unwrap();
    let stop_engine = CancellationToken::new();
    let task = tokio::spawn(engine.run(stop_engine.clone()));
    let stop_writing = Arc::new(AtomicBool::new(false));
    let w = ledger_writer(db.url.clone(), "chaos", stop_writing.clone());
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop_writing.store(true, Ordering::Release);
    tokio::task::spawn_blocking(move || w.join().unwrap())
        .await
        .unwrap();
    // Everything else is delivered; the poison and the hung ones (25 timed-out attempts each)
    // reach the dead letters.
    let settled = eventually(Duration::from_secs(60), || async {
        db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v") == 0
    })
    .await;
    // A handler hangs while the relay shuts down: it exits within its deadline. (Messages are
    // enqueued until one hangs; the others are delivered, outside the ledger.)
    let hang_id = loop {
        let id = postbox::enqueue(&mut db.conn(), &postbox::Message::new("chaos"))
            .unwrap()
            .id()
            .unwrap();
        if hung(id) && !poison(id) {
            break id;
        }
    };
    eventually(Duration::from_secs(10), || async {
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.messages WHERE id = {hang_id} AND state = 'running'"
        )) == 1
    })
    .await;
    let stopping = Instant::now();
    stop_engine.cancel();
    task.await.unwrap().unwrap();
    let shutdown = stopping.elapsed();

    let delivered = delivered.lock().unwrap().clone();
    let (produced, lost, duplicates, dead) = ledger(&db, &delivered);
    let mut conn = db.conn();
    #[derive(diesel::QueryableByName)]
    struct Dead {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        id: i64,
        #[diesel(sql_type = diesel::sql_types::Text)]
        reason: String,
    }
    let dead_letters: Vec<Dead> = diesel::sql_query("SELECT id, reason FROM postbox.dead_letters")
        .load(&mut conn)
        .unwrap();
    let expected = dead_letters.iter().all(|d| poison(d.id) || hung(d.id));
    eprintln!(
        "chaos (poison outcomes and hung handlers): produced {produced}, delivered {}, dead {dead} \
         (poison {}, hung {}), lost {}, duplicates {duplicates}, settled: {settled}, shutdown with \
         a hung handler took {shutdown:?}",
        delivered.len(),
        dead_letters.iter().filter(|d| poison(d.id)).count(),
        dead_letters
            .iter()
            .filter(|d| hung(d.id) && !poison(d.id))
            .count(),
        lost.len()
    );
    assert!(settled, "the poison or the hung messages held the queue");
    assert!(lost.is_empty(), "lost: {lost:?}");
    assert!(expected, "only poison and hung messages are dead");
    assert!(dead > 0, "no poison was produced: {produced} messages");
    for d in dead_letters.iter().filter(|d| poison(d.id)) {
        assert!(
            !d.reason.contains('\0') && d.reason.len() <= 8 * 1024 + 64,
            "{}",
            d.reason.len()
        );
    }
    assert!(
        dead_letters
            .iter()
            .filter(|d| hung(d.id) && !poison(d.id))
            .all(|d| d.reason.contains("timed out")),
        "hung handlers are dead-lettered as timed out"
    );
    assert!(
        shutdown < Duration::from_secs(3),
        "shutdown took {shutdown:?} with a deadline of 1 s"
    );
}

fn signal(child: &std::process::Child, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_frozen_for_a_minute_mid_hold_holds_up_nothing_and_settles_nothing_twice() {
    let db = TestDb::migrated();
    create_ledger(&db);
    let config = std::env::temp_dir().join(format!("postbox-frozen-{}.toml", std::process::id()));
    std::fs::write(&config, "[retention]\nkeep_completed = \"1h\"\n").unwrap();
    let config_path = config.to_str().unwrap().to_owned();
    let delivered: Delivered = Arc::default();
    let stop_writing = Arc::new(AtomicBool::new(false));
    let w = ledger_writer(db.url.clone(), "chaos", stop_writing.clone());
    // A backlog, so that batches are full.
    let backlog: Vec<postbox::Message> =
        (0..5_000).map(|_| postbox::Message::new("chaos")).collect();
    let ids = postbox::enqueue_many(&mut db.conn(), &backlog).unwrap();
    db.exec(&format!(
        "INSERT INTO public.produced (id) SELECT unnest('{{{}}}'::bigint[])",
        ids.iter()
            .map(|e| e.id().unwrap().to_string())
            .collect::<Vec<_>>()
            .join(",")
    ));
    // The relay to freeze writes its deliveries to a pipe nobody reads: it soon blocks in the
    // middle of a held batch, its transaction idle.
    let unread = Arc::new(AtomicBool::new(true));
    let (mut frozen, frozen_out) = relay_process_with(
        &db.url,
        &["--config", &config_path],
        &delivered,
        unread.clone(),
    );
    let (mut steady, steady_out) = relay_process_with(
        &db.url,
        &["--config", &config_path],
        &delivered,
        Arc::default(),
    );
    let frozen_owner = format!("%:{}", frozen.id());

    // Stop the relay while one of its holds is open (its transaction idle, its rows locked): stop
    // it, look, and let it go on to try again if none was.
    let held_sql = format!(
        "SELECT coalesce(max(cardinality(ids)), 0)::bigint AS v FROM postbox.holds
         WHERE held_by LIKE '{frozen_owner}' AND pg_xact_status(xid) = 'in progress'"
    );
    let caught = Instant::now();
    let held: Vec<i64> = loop {
        assert!(
            caught.elapsed() < Duration::from_secs(60),
            "the relay never held a batch"
        );
        assert!(
            eventually(Duration::from_secs(20), || async {
                db.scalar(&held_sql) > 0
            })
            .await,
            "the relay never held a batch"
        );
        signal(&frozen, "-STOP");
        if db.scalar(&held_sql) > 0 {
            #[derive(diesel::QueryableByName)]
            struct Ids {
                #[diesel(sql_type = diesel::sql_types::Array<diesel::sql_types::BigInt>)]
                ids: Vec<i64>,
            }
            let rows: Vec<Ids> = diesel::sql_query(format!(
                "SELECT ids FROM postbox.holds
                 WHERE held_by LIKE '{frozen_owner}' AND pg_xact_status(xid) = 'in progress'"
            ))
            .load(&mut db.conn())
            .unwrap();
            break rows.into_iter().flat_map(|r| r.ids).collect();
        }
        signal(&frozen, "-CONT");
    };
    let stopped = Instant::now();

    // The server ends the frozen hold after its limit (1 s) and a grace (2 s): the other relay
    // delivers and settles every message it held.
    let settled_sql = format!(
        "SELECT count(*) AS v FROM postbox.completed WHERE id IN ({}) AND relay NOT LIKE '{frozen_owner}'",
        held.iter()
            .map(i64::to_string)
            .collect::<Vec<_>>()
            .join(",")
    );
    let all = held.len() as i64;
    assert!(
        eventually(Duration::from_secs(20), || async {
            db.scalar(&settled_sql) == all
        })
        .await,
        "{} of the {all} messages the frozen relay held were settled by the other",
        db.scalar(&settled_sql)
    );
    let took = stopped.elapsed();
    // The rest of the minute frozen, while the other relay and the writer go on.
    tokio::time::sleep(Duration::from_secs(60).saturating_sub(stopped.elapsed())).await;
    let before = db.scalar(&format!(
        "SELECT count(*) AS v FROM postbox.completed WHERE relay LIKE '{frozen_owner}'"
    ));
    signal(&frozen, "-CONT");
    unread.store(false, Ordering::Release);
    // It carries on: it delivers again (new messages keep coming from the writer).
    assert!(
        eventually(Duration::from_secs(30), || async {
            db.scalar(&format!(
                "SELECT count(*) AS v FROM postbox.completed WHERE relay LIKE '{frozen_owner}'"
            )) > before
        })
        .await,
        "the relay did not carry on after SIGCONT"
    );
    stop_writing.store(true, Ordering::Release);
    let commits = tokio::task::spawn_blocking(move || w.join().unwrap())
        .await
        .unwrap();
    assert!(
        eventually(Duration::from_secs(60), || async {
            db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v") == 0
        })
        .await
    );
    for p in [&mut frozen, &mut steady] {
        signal(p, "-TERM");
        assert!(p.wait().unwrap().success());
    }
    frozen_out.join().unwrap();
    steady_out.join().unwrap();
    let _ = std::fs::remove_file(&config);

    // Fencing: every message was settled once (the frozen relay's hold settled nothing: its
    // session was gone), none lost.
    assert_eq!(
        db.scalar(
            "SELECT count(*) AS v FROM (SELECT id FROM postbox.completed GROUP BY id HAVING count(*) > 1) d"
        ),
        0,
        "a message settled twice"
    );
    assert_eq!(
        db.scalar(&settled_sql),
        all,
        "the frozen relay settled a message it had held"
    );
    let delivered = delivered.lock().unwrap().clone();
    let (produced, lost, duplicates, dead) = ledger(&db, &delivered);
    eprintln!(
        "frozen relay: held {all} messages when stopped; the other relay settled them all {took:?} \
         after the stop; produced {produced} ({commits} commits), duplicates {duplicates}, lost {}, dead {dead}",
        lost.len()
    );
    assert!(lost.is_empty(), "lost: {lost:?}");
    assert_eq!(dead, 0);
    assert!(
        db.scalar("SELECT count(*) AS v FROM postbox.holds") == 0,
        "registrations left"
    );
}
