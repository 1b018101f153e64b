//! The state model under random interleavings, against a real PostgreSQL. Several workers, each
//! with its own connections, run random operations for about a minute (`POSTBOX_MODEL_SECS`):
//! enqueue (ordered, unordered, scheduled, with dedup keys; now and then a bulk over many keys) in
//! transactions that commit or roll back — one worker holds each of its transactions open for up
//! to 1.5 s after its writes, its checks run at once half the time — claim by lease and by hold, complete, retry, dead-letter, release, abandon a lease, drop
//! a hold, cancel, replay dead letters, pause and resume, rescue, count lost holds, terminate a
//! relay backend. After every operation `Store::check` must find nothing; at the end everything is
//! drained, and every message committed must have been delivered exactly once or be dead, and
//! each ordered key's deliveries must be in id order (replayed messages aside, which go back in
//! front).
//!
//! Seeded: `POSTBOX_MODEL_SEED` replays a run's choices (the database's timing is its own). A
//! failure prints the seed and writes the operation log to `target/model-<seed>.log`.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::TestDb;
use diesel_async::{AsyncConnection, AsyncPgConnection};
use postbox::store::{CancelSelector, Dead, DeadSelector, Retry};
use postbox::{Enqueued, Message, Store, Topics};

const KEYS: usize = 5;
/// The worker that only writes, each time holding its transaction open for a while.
const LINGERING_WRITER: usize = 4;
const LEASE: Duration = Duration::from_secs(1);
const HOLD_LIMIT: Duration = Duration::from_secs(1);

/// What the workers share: the log, what was committed, what was delivered.
#[derive(Default)]
struct World {
    log: Mutex<Vec<String>>,
    /// Ids of committed enqueues.
    produced: Mutex<HashSet<i64>>,
    /// Claims, in the order they were handed out: (sequence, key, id).
    claims: Mutex<Vec<(u64, Option<String>, i64)>>,
    seq: AtomicU64,
    /// Claim sequences whose message was then completed by the claimer.
    completed: Mutex<HashSet<u64>>,
    replayed: Mutex<HashSet<i64>>,
    terminated: AtomicBool,
    violations: Mutex<Vec<String>>,
    errors: AtomicU64,
}

impl World {
    fn note(&self, worker: usize, what: String) {
        self.log.lock().unwrap().push(format!("w{worker} {what}"));
    }

    /// Records the claim of `ids` (in delivery order); returns their claim sequences.
    fn claimed(&self, msgs: &[&postbox::store::ClaimedMessage]) -> Vec<u64> {
        let mut claims = self.claims.lock().unwrap();
        msgs.iter()
            .map(|m| {
                let s = self.seq.fetch_add(1, Ordering::Relaxed);
                claims.push((s, m.key.clone().filter(|_| m.ordered), m.id));
                s
            })
            .collect()
    }
}

fn message(rng: &mut fastrand::Rng) -> Message {
    let mut m = if rng.u8(..10) < 7 {
        Message::new("m")
            .key(format!("k{}", rng.usize(..KEYS)))
            .ordered()
    } else {
        Message::new("u")
    };
    if rng.u8(..10) == 0 {
        m = m.dedup_key(format!("d{}", rng.u8(..6)));
    }
    if rng.u8(..10) == 0 {
        m = m.delay(Duration::from_millis(rng.u64(..300)));
    }
    m.max_attempts(3)
}

/// Enqueues a few messages in a transaction that commits or rolls back; now and then a bulk of
/// ordered messages over many keys (an app's import). `linger`: the transaction stays open that
/// long after its writes, its checks run at once (`SET CONSTRAINTS ALL IMMEDIATE`) half the time,
/// as a slow commit or an app that holds its transaction open does.
async fn enqueue(
    world: &World,
    w: usize,
    conn: &mut AsyncPgConnection,
    rng: &mut fastrand::Rng,
    linger: Option<Duration>,
) {
    let msgs: Vec<Message> = if rng.u8(..12) == 0 {
        (0..rng.usize(20..200))
            .map(|_| {
                Message::new("m")
                    .key(format!("k{}", rng.usize(..KEYS * 4)))
                    .ordered()
                    .max_attempts(3)
            })
            .collect()
    } else {
        (0..rng.usize(1..4)).map(|_| message(rng)).collect()
    };
    let commit = rng.u8(..5) != 0;
    let immediate = rng.bool();
    let r = conn
        .transaction(async |c| {
            let got = postbox::enqueue_many_async(c, &msgs)
                .await
                .map_err(|e| diesel::result::Error::QueryBuilderError(e.to_string().into()))?;
            if let Some(linger) = linger {
                if immediate {
                    use diesel_async::SimpleAsyncConnection;
                    c.batch_execute("SET CONSTRAINTS ALL IMMEDIATE").await?;
                }
                tokio::time::sleep(linger).await;
            }
            if commit {
                Ok(got)
            } else {
                Err(diesel::result::Error::RollbackTransaction)
            }
        })
        .await;
    match r {
        Ok(got) => {
            let ids: Vec<i64> = got
                .iter()
                .filter_map(|e| match *e {
                    Enqueued::New(id) => Some(id),
                    Enqueued::Duplicate { .. } => None,
                })
                .collect();
            world.note(w, format!("enqueue committed {ids:?}"));
            world.produced.lock().unwrap().extend(ids);
        }
        Err(diesel::result::Error::RollbackTransaction) => {
            world.note(w, "enqueue rolled back".into())
        }
        Err(e) => {
            world.errors.fetch_add(1, Ordering::Relaxed);
            world.note(w, format!("enqueue failed: {e}"));
        }
    }
}

async fn claim_and_settle(world: &World, w: usize, store: &Store, rng: &mut fastrand::Rng) {
    let topics = Topics::exact(["m", "u"]);
    let got = match store.claim(rng.usize(1..6), LEASE, &topics).await {
        Ok(g) => g,
        Err(e) => {
            world.errors.fetch_add(1, Ordering::Relaxed);
            return world.note(w, format!("claim failed: {e}"));
        }
    };
    let seqs = world.claimed(&got.iter().collect::<Vec<_>>());
    for (m, s) in got.iter().zip(seqs) {
        let what = rng.u8(..20);
        let r = match what {
            0..=11 => store.complete(&[m.lease()]).await.map(|r| {
                if r.done == [m.id] {
                    world.completed.lock().unwrap().insert(s);
                }
                format!("complete {} -> {:?}", m.id, r)
            }),
            12..=14 => store
                .retry(&[Retry {
                    lease: m.lease(),
                    error: "random".into(),
                    delay: Some(Duration::from_millis(rng.u64(..100))),
                }])
                .await
                .map(|r| format!("retry {} -> {r:?}", m.id)),
            15 => store
                .dead_letter(&[Dead {
                    lease: m.lease(),
                    reason: "random".into(),
                }])
                .await
                .map(|r| format!("dead-letter {} -> {r:?}", m.id)),
            16..=17 => store
                .release(&[m.lease()])
                .await
                .map(|r| format!("release {} -> {r:?}", m.id)),
            _ => Ok(format!("abandon {} (its lease expires)", m.id)),
        };
        match r {
            Ok(s) => world.note(w, s),
            Err(e) => {
                world.errors.fetch_add(1, Ordering::Relaxed);
                world.note(w, format!("settle of {} failed: {e}", m.id));
            }
        }
    }
}

async fn hold(world: &World, w: usize, store: &Store, rng: &mut fastrand::Rng) {
    let topics = Topics::exact(["m", "u"]);
    let hold = match store
        .take(rng.usize(1..6), HOLD_LIMIT, &topics, None, rng.usize(0..5))
        .await
    {
        Ok(Some(h)) => h,
        Ok(None) => return,
        Err(e) => {
            world.errors.fetch_add(1, Ordering::Relaxed);
            return world.note(w, format!("take failed: {e}"));
        }
    };
    if let Err(e) = store.register_hold(&hold).await {
        world.errors.fetch_add(1, Ordering::Relaxed);
        return world.note(w, format!("register failed: {e}"));
    }
    let all: Vec<&postbox::store::ClaimedMessage> =
        hold.messages.iter().chain(&hold.followers).collect();
    let ids: Vec<i64> = all.iter().map(|m| m.id).collect();
    let seqs = world.claimed(&all);
    if rng.u8(..8) == 0 {
        world.note(w, format!("hold {ids:?} dropped (lost)"));
        drop(hold);
        return;
    }
    match store.end_hold(hold, &ids, &[], LEASE, 0).await {
        Ok((ended, _)) => {
            world.note(w, format!("hold {ids:?} ended: {ended:?}"));
            if ended.deleted == ids.len() {
                world.completed.lock().unwrap().extend(seqs);
            }
        }
        Err(e) => {
            world.errors.fetch_add(1, Ordering::Relaxed);
            world.note(w, format!("hold {ids:?} end failed: {e}"));
        }
    }
}

async fn random_ids(conn: &mut AsyncPgConnection, table: &str, n: i64) -> Vec<i64> {
    use diesel_async::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct Id {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        id: i64,
    }
    diesel::sql_query(format!(
        "SELECT id FROM postbox.{table} ORDER BY random() LIMIT {n}"
    ))
    .load::<Id>(conn)
    .await
    .map(|v| v.into_iter().map(|r| r.id).collect())
    .unwrap_or_default()
}

async fn other(
    world: &World,
    w: usize,
    store: &Store,
    conn: &mut AsyncPgConnection,
    rng: &mut fastrand::Rng,
) {
    let r = match rng.u8(..8) {
        0 => {
            let ids = random_ids(conn, "messages", rng.i64(1..3)).await;
            store
                .cancel(&CancelSelector::Ids(ids.clone()))
                .await
                .map(|r| format!("cancel {ids:?} -> {r:?}"))
        }
        1 => {
            let ids = random_ids(conn, "dead_letters", rng.i64(1..3)).await;
            let r = store.dead_replay(&DeadSelector::Ids(ids.clone())).await;
            if let Ok(r) = &r {
                world.replayed.lock().unwrap().extend(&r.replayed);
            }
            r.map(|r| format!("replay {ids:?} -> {r:?}"))
        }
        2 => store
            .pause(&["m".to_owned()])
            .await
            .map(|n| format!("pause m -> {n}")),
        3 => store
            .resume(&["m".to_owned()])
            .await
            .map(|n| format!("resume m -> {n}")),
        4 => store
            .rescue_expired()
            .await
            .map(|r| format!("rescue -> {r:?}")),
        5 => store
            .lost_holds()
            .await
            .map(|n| format!("lost holds -> {n}")),
        6 if rng.bool() => store
            .promote_due()
            .await
            .map(|p| format!("promote due -> {}", p.promoted)),
        6 => store
            .finish_heads()
            .await
            .map(|f| format!("finish heads -> {f:?}")),
        _ => {
            if rng.u8(..4) != 0 {
                return;
            }
            world.terminated.store(true, Ordering::Release);
            use diesel_async::RunQueryDsl;
            diesel::sql_query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                 WHERE datname = current_database() AND application_name = 'postbox'
                   AND pid <> pg_backend_pid() ORDER BY random() LIMIT 1",
            )
            .execute(conn)
            .await
            .map(|n| format!("terminated {n} relay backend"))
            .map_err(postbox::Error::from)
        }
    };
    match r {
        Ok(s) => world.note(w, s),
        Err(e) => {
            world.errors.fetch_add(1, Ordering::Relaxed);
            world.note(w, format!("failed: {e}"));
        }
    }
}

async fn worker(world: Arc<World>, w: usize, url: String, store: Store, seed: u64, until: Instant) {
    let mut rng = fastrand::Rng::with_seed(seed.wrapping_add(w as u64 * 7919));
    let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
    let mut ops = 0u64;
    while Instant::now() < until && world.violations.lock().unwrap().is_empty() {
        if w == LINGERING_WRITER {
            let linger = Duration::from_millis(rng.u64(50..1500));
            enqueue(&world, w, &mut conn, &mut rng, Some(linger)).await;
            ops += 1;
            continue;
        }
        match rng.u8(..10) {
            0..=3 => enqueue(&world, w, &mut conn, &mut rng, None).await,
            4..=5 => claim_and_settle(&world, w, &store, &mut rng).await,
            6..=7 => hold(&world, w, &store, &mut rng).await,
            _ => other(&world, w, &store, &mut conn, &mut rng).await,
        }
        ops += 1;
        match store.check(100).await {
            Ok(found) if found.is_empty() => {}
            Ok(found) => {
                let v = format!("w{w} after op {ops}: {found:?}");
                world.note(w, format!("VIOLATION {found:?}"));
                world.violations.lock().unwrap().push(v);
            }
            Err(e) => world.note(w, format!("check failed: {e}")),
        }
        if conn_broken(&mut conn).await {
            conn = AsyncPgConnection::establish(&url).await.unwrap();
        }
    }
    world.note(w, format!("stopped after {ops} operations"));
}

async fn conn_broken(conn: &mut AsyncPgConnection) -> bool {
    use diesel_async::RunQueryDsl;
    diesel::sql_query("SELECT 1").execute(conn).await.is_err()
}

/// Resumes, makes everything due and claimable, and delivers what is left.
async fn drain(world: &World, store: &Store, db: &TestDb) {
    let deadline = Instant::now() + Duration::from_secs(60);
    store.resume(&["m".to_owned()]).await.unwrap();
    loop {
        // The intake's delayed rows are moved (scheduled) first: intake rows are not updated.
        common::move_intake(db);
        db.exec(
            "UPDATE postbox.messages SET run_at = now() WHERE state = 'scheduled';
             UPDATE postbox.messages SET locked_until = now() - interval '1 second'
             WHERE state = 'running' AND lease_token <> 0",
        );
        let _ = store.finish_heads().await;
        let _ = store.lost_holds().await;
        let _ = store.rescue_expired().await;
        let _ = store.promote_due().await;
        let got = store
            .claim(100, Duration::from_secs(30), &Topics::exact(["m", "u"]))
            .await
            .unwrap_or_default();
        let seqs = world.claimed(&got.iter().collect::<Vec<_>>());
        let leases: Vec<_> = got.iter().map(|m| m.lease()).collect();
        if let Ok(done) = store.complete(&leases).await {
            let mut c = world.completed.lock().unwrap();
            for (m, s) in got.iter().zip(seqs) {
                if done.done.contains(&m.id) {
                    c.insert(s);
                }
            }
        }
        // What no relay has moved yet is left too (the intake: unordered messages without a
        // dedup key, as their writers committed them).
        if db.scalar(
            "SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v",
        ) == 0
        {
            return;
        }
        assert!(Instant::now() < deadline, "the drain never ended");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_interleavings_keep_every_invariant() {
    let seed: u64 = std::env::var("POSTBOX_MODEL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    let secs: u64 = std::env::var("POSTBOX_MODEL_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(50);
    let db = TestDb::migrated();
    let store = Store::connect(&db.url, 16)
        .await
        .unwrap()
        .with_archive("model");
    store.prepare_completed().await.unwrap();
    let world = Arc::new(World::default());
    let until = Instant::now() + Duration::from_secs(secs);
    let workers: Vec<_> = (0..=LINGERING_WRITER)
        .map(|w| {
            tokio::spawn(worker(
                world.clone(),
                w,
                db.url.clone(),
                store.clone(),
                seed,
                until,
            ))
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    let report = |why: &str| -> String {
        let path = format!("{}/target/model-{seed}.log", env!("CARGO_MANIFEST_DIR"));
        let log = world.log.lock().unwrap().join("\n");
        let _ = std::fs::write(&path, log);
        format!(
            "{why}\nseed {seed} (POSTBOX_MODEL_SEED={seed} replays its choices); operation log: {path}"
        )
    };
    let violations = world.violations.lock().unwrap().clone();
    assert!(
        violations.is_empty(),
        "{}",
        report(&format!("{violations:?}"))
    );

    drain(&world, &store, &db).await;
    store.repair(100).await.unwrap();
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.behind"),
        0,
        "{}",
        report("marks of replayed messages left")
    );
    let found = store.check(100).await.unwrap();
    assert!(
        found.is_empty(),
        "{}",
        report(&format!("after the drain: {found:?}"))
    );

    // Every committed message: delivered once (completed) or dead, never both.
    #[derive(diesel::QueryableByName)]
    struct Count {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        id: i64,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        completed: i64,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        dead: i64,
    }
    use diesel_async::RunQueryDsl;
    let produced: Vec<i64> = world.produced.lock().unwrap().iter().copied().collect();
    let mut conn = db.aconn().await;
    let counts: Vec<Count> = diesel::sql_query(
        "SELECT p.id,
                (SELECT count(*) FROM postbox.completed c WHERE c.id = p.id) AS completed,
                (SELECT count(*) FROM postbox.dead_letters d WHERE d.id = p.id) AS dead
         FROM unnest($1::bigint[]) AS p(id)",
    )
    .bind::<diesel::sql_types::Array<diesel::sql_types::BigInt>, _>(&produced)
    .load(&mut conn)
    .await
    .unwrap();
    let wrong: Vec<(i64, i64, i64)> = counts
        .iter()
        .filter(|c| c.completed + c.dead != 1)
        .map(|c| (c.id, c.completed, c.dead))
        .collect();
    assert!(
        wrong.is_empty(),
        "{}",
        report(&format!("(id, completed, dead): {wrong:?}"))
    );

    // Each key's completed deliveries, in the order they were handed out, are in id order.
    let replayed = world.replayed.lock().unwrap().clone();
    let completed = world.completed.lock().unwrap().clone();
    let mut by_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (s, key, id) in world.claims.lock().unwrap().iter() {
        if let Some(k) = key
            && completed.contains(s)
            && !replayed.contains(id)
        {
            by_key.entry(k.clone()).or_default().push(*id);
        }
    }
    for (k, ids) in &by_key {
        assert!(
            ids.windows(2).all(|p| p[0] < p[1]),
            "{}",
            report(&format!("key {k} delivered out of order: {ids:?}"))
        );
    }
    // Deliveries more than once (a claim handed out again) only after a terminated backend or
    // a lost hold; counted for the report.
    let mut handed: HashMap<i64, usize> = HashMap::new();
    for (_, _, id) in world.claims.lock().unwrap().iter() {
        *handed.entry(*id).or_default() += 1;
    }
    let log_len = world.log.lock().unwrap().len();
    // What the tolerated errors were, by kind.
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for line in world.log.lock().unwrap().iter() {
        if let Some((_, e)) = line.split_once("failed: ") {
            let kind: String = e.chars().take(60).collect();
            *kinds.entry(kind).or_default() += 1;
        }
    }
    eprintln!("model: tolerated errors by kind: {kinds:#?}");
    eprintln!(
        "model: seed {seed}, {secs} s, {log_len} operations, {} messages ({} dead), {} ordered deliveries checked over {} keys, {} errors tolerated (lock timeouts, terminated backends), terminated: {}",
        produced.len(),
        counts.iter().filter(|c| c.dead == 1).count(),
        by_key.values().map(Vec::len).sum::<usize>(),
        by_key.len(),
        AtomicU64::load(&world.errors, Ordering::Relaxed),
        AtomicBool::load(&world.terminated, Ordering::Relaxed)
    );
    assert!(
        produced.len() > 100,
        "the run barely wrote: {}",
        produced.len()
    );
}
