//! The write-only intake (migration `intake`) against a real PostgreSQL: what a writer commits to
//! `postbox.intake` reaches `postbox.messages` with its id and its enqueue time, exactly once and
//! only if the writer committed; a writer still in progress below the move's floor is moved when
//! it commits; one mover at a time, and a mover that rolls back gives everything back; under a
//! pinned xmin horizon a move reads from its floor, not over every row moved since the pin; an
//! operator finds, counts and cancels a message that no relay has moved yet.

mod common;

use std::time::Duration;

use common::TestDb;
use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection, QueryableByName, RunQueryDsl};
use postbox::store::{CancelSelector, MOVE_BATCH};
use postbox::{Message, Topics};

const LEASE: Duration = Duration::from_secs(30);

#[derive(Debug, QueryableByName)]
struct Moved {
    #[diesel(sql_type = diesel::sql_types::Integer)]
    moved: i32,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
    floor: Option<String>,
}

/// `postbox.move_intake(max, floor)` in a transaction of its own on `conn`.
fn move_from(conn: &mut PgConnection, max: i32, floor: Option<&str>) -> Moved {
    diesel::sql_query("SELECT moved, floor FROM postbox.move_intake($1, $2)")
        .bind::<diesel::sql_types::Integer, _>(max)
        .bind::<diesel::sql_types::Nullable<diesel::sql_types::Text>, _>(floor)
        .get_result(conn)
        .unwrap()
}

fn write_intake(conn: &mut PgConnection, topic: &str, n: usize) {
    conn.batch_execute(&format!(
        "INSERT INTO postbox.intake (topic, payload) SELECT '{topic}', to_jsonb(g) FROM generate_series(1, {n}) g"
    ))
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_writer_commits_to_the_intake_is_claimed_once_with_its_id_and_nothing_else() {
    let db = TestDb::migrated();
    let store = db.store().await;
    let mut writer = db.conn();
    writer
        .batch_execute(
            "BEGIN;
             INSERT INTO postbox.intake (topic, payload, created_at) VALUES ('t', '1', now() - interval '1 minute');
             INSERT INTO postbox.intake (topic, payload, run_at) VALUES ('t', '2', now() + interval '1 hour');
             COMMIT;
             BEGIN;
             INSERT INTO postbox.intake (topic, payload) VALUES ('t', '3');
             ROLLBACK;",
        )
        .unwrap();
    let ids: Vec<i64> = {
        #[derive(QueryableByName)]
        struct Id {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            id: i64,
        }
        diesel::sql_query("SELECT id FROM postbox.intake ORDER BY id")
            .load::<Id>(&mut writer)
            .unwrap()
            .into_iter()
            .map(|r| r.id)
            .collect()
    };
    assert_eq!(ids.len(), 2);

    // The claim moves first: the available one is claimed, the delayed one is scheduled.
    let claimed = store.claim(10, LEASE, &Topics::all()).await.unwrap();
    assert_eq!(claimed.len(), 1, "{claimed:?}");
    assert_eq!(
        claimed[0].id, ids[0],
        "the id the writer got is the message's"
    );
    assert_eq!(claimed[0].payload, serde_json::json!(1));
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.messages WHERE id = {} AND created_at < now() - interval '50 seconds'",
            ids[0]
        )),
        1,
        "the enqueue time is the writer's"
    );
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.messages WHERE id = {} AND state = 'scheduled'",
            ids[1]
        )),
        1
    );
    assert_eq!(db.scalar("SELECT count(*) AS v FROM postbox.intake"), 0);
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE payload = '3'"),
        0,
        "a rolled-back writer's message does not exist"
    );
    assert!(
        store
            .claim(10, LEASE, &Topics::all())
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(store.intake_failure(), None);
}

/// A writer that took its transaction id before another writer committed, and commits after a
/// move passed it, is in the floor's list of transactions in progress: the next move looks its
/// rows up. Also when the move before was cut by its batch size in the middle of the walk.
#[test]
fn a_writer_in_progress_when_a_move_passed_it_is_moved_when_it_commits() {
    let db = TestDb::migrated();
    let mut mover = db.conn();
    for cut in [false, true] {
        let mut slow = db.conn();
        slow.batch_execute("BEGIN").unwrap();
        write_intake(&mut slow, "slow", 3);
        write_intake(&mut db.conn(), "fast", if cut { 25 } else { 5 });
        let mut floor = None;
        let mut moved = 0;
        loop {
            let m = move_from(&mut mover, 10, floor.as_deref());
            moved += m.moved;
            floor = m.floor;
            if m.moved < 10 {
                break;
            }
        }
        assert_eq!(moved, if cut { 25 } else { 5 });
        slow.batch_execute("COMMIT").unwrap();
        let m = move_from(&mut mover, 10, floor.as_deref());
        assert_eq!(m.moved, 3, "cut: {cut}, floor {floor:?} → {:?}", m.floor);
        assert_eq!(db.scalar("SELECT count(*) AS v FROM postbox.intake"), 0);
    }
    assert_eq!(
        db.scalar("SELECT count(DISTINCT id) AS v FROM postbox.messages"),
        36
    );
}

/// One mover at a time: a second finds the first moving and moves nothing (without waiting);
/// a mover that rolls back leaves every row to the next, and nothing is moved twice.
#[test]
fn one_mover_at_a_time_and_a_rolled_back_move_gives_everything_back() {
    let db = TestDb::migrated();
    write_intake(&mut db.conn(), "t", 50);
    let mut first = db.conn();
    let mut second = db.conn();
    first.batch_execute("BEGIN").unwrap();
    assert_eq!(move_from(&mut first, 20, None).moved, 20);
    assert_eq!(move_from(&mut second, 100, None).moved, 0);
    first.batch_execute("ROLLBACK").unwrap();
    assert_eq!(db.scalar("SELECT count(*) AS v FROM postbox.intake"), 50);
    assert_eq!(db.scalar("SELECT count(*) AS v FROM postbox.messages"), 0);

    first.batch_execute("BEGIN").unwrap();
    assert_eq!(move_from(&mut first, 20, None).moved, 20);
    let waiting = std::thread::spawn(move || {
        let m = move_from(&mut second, 100, None);
        (m.moved, second)
    });
    let (moved, mut second) = waiting.join().unwrap();
    assert_eq!(moved, 0, "a second mover does not wait for the first");
    first.batch_execute("COMMIT").unwrap();
    assert_eq!(move_from(&mut second, 100, None).moved, 30);
    assert_eq!(
        db.scalar("SELECT count(DISTINCT id) AS v FROM postbox.messages"),
        50
    );
}

/// Index entries of `postbox.intake` read by `sql`, run in a transaction rolled back.
fn intake_entries_read(db: &TestDb, sql: &str) -> i64 {
    #[derive(QueryableByName)]
    struct V {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        v: i64,
    }
    let mut conn = db.conn();
    let read = |conn: &mut PgConnection| {
        conn.batch_execute("SELECT pg_stat_force_next_flush()")
            .unwrap();
        conn.batch_execute("SELECT pg_stat_clear_snapshot()")
            .unwrap();
        diesel::sql_query(
            "SELECT coalesce(sum(idx_tup_read), 0)::bigint AS v FROM pg_stat_user_indexes
             WHERE schemaname = 'postbox' AND relname = 'intake'",
        )
        .get_result::<V>(conn)
        .unwrap()
        .v
    };
    let before = read(&mut conn);
    conn.batch_execute(&format!("BEGIN; {sql}; ROLLBACK"))
        .unwrap();
    read(&mut conn) - before
}

/// A session holding the horizon with a transaction id of its own (in every later snapshot's
/// list of transactions in progress): what is moved while it lasts stays as dead index entries.
fn pinned(db: &TestDb) -> PgConnection {
    let mut pin = db.conn();
    pin.batch_execute(
        "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT pg_current_xact_id(); SELECT count(*) FROM postbox.messages",
    )
    .unwrap();
    pin
}

/// 20,000 messages moved while a transaction with an id of its own (which stays in every later
/// snapshot's list of transactions in progress) pins the horizon: every moved row stays as a dead
/// index entry. A move of the next 100 from the floor the last move left reads about those 100;
/// a move from the front walks the 20,000.
#[test]
fn under_a_pinned_horizon_a_move_reads_from_its_floor() {
    let db = TestDb::migrated();
    let mut pin = pinned(&db);
    let mut mover = db.conn();
    let mut floor = None;
    for round in 0..20 {
        write_intake(&mut db.conn(), "t", 1_000);
        let m = move_from(&mut mover, MOVE_BATCH, floor.as_deref());
        assert_eq!(m.moved, 1_000);
        floor = m.floor;
        if round == 1 {
            // 2,000 dead entries: the first call on a connection (a plan made for p_max rows
            // once joined a scan of the whole index then) reads about what it moves.
            let m = move_from(&mut mover, MOVE_BATCH, floor.as_deref());
            floor = m.floor;
            write_intake(&mut db.conn(), "t", 200);
            let read = intake_entries_read(
                &db,
                &format!(
                    "SELECT * FROM postbox.move_intake(1000, '{}')",
                    floor.as_deref().unwrap()
                ),
            );
            assert!(read <= 800, "a first move of 200 read {read} index entries");
            let m = move_from(&mut mover, MOVE_BATCH, floor.as_deref());
            assert_eq!(m.moved, 200);
            floor = m.floor;
        }
    }
    // The move that found nothing left is the one whose floor is past everything.
    let m = move_from(&mut mover, MOVE_BATCH, floor.as_deref());
    assert_eq!(m.moved, 0);
    let floor = m.floor.unwrap();
    write_intake(&mut db.conn(), "t", 100);
    let from_floor = intake_entries_read(
        &db,
        &format!("SELECT * FROM postbox.move_intake(1000, '{floor}')"),
    );
    let from_front = intake_entries_read(&db, "SELECT * FROM postbox.move_intake(1000, NULL)");
    println!(
        "index entries read by a move of 100: from the floor {from_floor}, from the front {from_front}"
    );
    assert!(
        from_floor <= 400,
        "a move from its floor read {from_floor} index entries (from the front: {from_front})"
    );
    assert!(
        from_front >= 20_000,
        "the pin keeps the moved rows' entries: from the front {from_front}"
    );
    pin.batch_execute("ROLLBACK").unwrap();
    assert_eq!(move_from(&mut mover, MOVE_BATCH, Some(&floor)).moved, 100);
}

/// The same pin after an ANALYZE that saw the intake nearly empty (its rows dead): a move whose
/// floor lists a pending transaction that has ended looks its rows up by its id, not by a scan
/// of the whole index joined afterwards (the plan the look-up once took after such an ANALYZE:
/// 62,600-78,000 buffers a move under a 3-minute pin at 800 messages a second).
#[test]
fn after_an_analyze_under_a_pin_a_move_looks_up_pending_writers_by_id() {
    let db = TestDb::migrated();
    let mut pin = pinned(&db);
    let mut mover = db.conn();
    let mut floor = None;
    let mut moved = 1;
    while moved > 0 {
        let n = db.scalar("SELECT count(*) AS v FROM postbox.messages");
        if n < 20_000 {
            write_intake(&mut db.conn(), "t", 1_000);
        }
        let m = move_from(&mut mover, MOVE_BATCH, floor.as_deref());
        moved = m.moved;
        floor = m.floor;
    }
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages"),
        20_000
    );
    let position = floor.unwrap().split(';').next().unwrap().to_owned();
    db.conn().batch_execute("ANALYZE postbox.intake").unwrap();
    // A writer that was in progress when the last move passed it, and has ended since.
    let ended = db_text(&mut db.conn(), "SELECT pg_current_xact_id()::text AS v");
    write_intake(&mut db.conn(), "t", 100);
    let read = intake_entries_read(
        &db,
        &format!("SELECT * FROM postbox.move_intake(1000, '{position};{ended}:0')"),
    );
    assert!(
        read <= 400,
        "a move of 100 with an ended writer pending read {read} index entries"
    );
    pin.batch_execute("ROLLBACK").unwrap();
}

/// What no relay has moved yet is a live message for an operator: `show` finds it, the depth
/// counts it, a cancel sends it to the dead letters (and no move brings it back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_finds_counts_and_cancels_a_message_not_moved_yet() {
    let db = TestDb::migrated();
    let store = db.store().await;
    write_intake(&mut db.conn(), "op", 3);
    let id = db.scalar("SELECT min(id) AS v FROM postbox.intake");

    match store.show(id).await.unwrap().expect("shown") {
        postbox::store::Shown::Queued {
            state, attempts, ..
        } => {
            assert_eq!((state.as_str(), attempts), ("available", 0));
        }
        other => panic!("{other:?}"),
    }

    let stats = store.stats().await.unwrap();
    let op = stats
        .topics
        .iter()
        .find(|t| t.topic == "op")
        .expect("topic");
    assert_eq!(op.available, 3, "{stats:?}");
    assert!(op.oldest_available_secs.is_some());

    let page = store
        .browse_messages(&Default::default(), None, 10, true)
        .await
        .unwrap();
    assert_eq!(page.rows.len(), 3, "{page:?}");

    let got = store.cancel(&CancelSelector::Ids(vec![id])).await.unwrap();
    assert_eq!(got.dead, 1);
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.dead_letters WHERE id = {id} AND reason = 'cancelled'"
        )),
        1
    );
    let got = store
        .cancel(&CancelSelector::Topic("op".into()))
        .await
        .unwrap();
    assert_eq!(got.dead, 2);
    assert_eq!(store.move_intake_all().await.unwrap(), 0);
    assert!(
        store
            .claim(10, LEASE, &Topics::all())
            .await
            .unwrap()
            .is_empty()
    );
}

/// A writer role (`postbox grant --writer`) writes the intake and reads back the id, and nothing
/// else: not the payloads there, not the move.
#[test]
fn a_writer_role_writes_the_intake_and_cannot_read_or_move_it() {
    let db = TestDb::migrated();
    let role = format!("w_{}", fastrand::u32(..));
    let mut admin = db.conn();
    admin
        .batch_execute(&format!("CREATE ROLE {role} NOLOGIN"))
        .unwrap();
    for sql in postbox::store::grant::grant_sql(postbox::store::grant::RoleKind::Writer, &role) {
        admin.batch_execute(&sql).unwrap();
    }
    admin.batch_execute(&format!("SET ROLE {role}")).unwrap();
    let id = postbox::enqueue(&mut admin, &Message::new("w").payload(&1))
        .unwrap()
        .id()
        .unwrap();
    assert!(id > 0);
    admin
        .batch_execute("INSERT INTO postbox.intake (topic) VALUES ('w') RETURNING id")
        .unwrap();
    for denied in [
        "SELECT payload FROM postbox.intake",
        "SELECT * FROM postbox.move_intake(10, NULL)",
        "DELETE FROM postbox.intake",
    ] {
        let e = admin.batch_execute(denied).unwrap_err().to_string();
        assert!(e.contains("permission denied"), "{denied}: {e}");
    }
    admin.batch_execute("RESET ROLE").unwrap();
    let _ = admin.transaction::<_, diesel::result::Error, _>(|c| {
        c.batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
    });
}

/// A move that finds nothing writes nothing: no transaction id (every claim moves first, and
/// the scheduler every tick), and so no wake-up of the listening relays, which would claim and
/// move again.
#[test]
fn a_move_that_finds_nothing_writes_nothing() {
    let db = TestDb::migrated();
    let mut conn = db.conn();
    db.exec("INSERT INTO postbox.listeners (pid) VALUES (pg_backend_pid())");
    conn.batch_execute("BEGIN").unwrap();
    assert_eq!(move_from(&mut conn, 10, None).moved, 0);
    let assigned = db_text(
        &mut conn,
        "SELECT coalesce(pg_current_xact_id_if_assigned()::text, 'none') AS v",
    );
    assert_eq!(assigned, "none");
    conn.batch_execute("COMMIT").unwrap();
    write_intake(&mut db.conn(), "t", 1);
    conn.batch_execute("BEGIN").unwrap();
    assert_eq!(move_from(&mut conn, 10, None).moved, 1);
    assert_ne!(
        db_text(
            &mut conn,
            "SELECT coalesce(pg_current_xact_id_if_assigned()::text, 'none') AS v"
        ),
        "none"
    );
    conn.batch_execute("COMMIT").unwrap();
}

fn db_text(conn: &mut PgConnection, sql: &str) -> String {
    #[derive(QueryableByName)]
    struct V {
        #[diesel(sql_type = diesel::sql_types::Text)]
        v: String,
    }
    diesel::sql_query(sql).get_result::<V>(conn).unwrap().v
}

/// Waits until `n` sessions of the test's database wait for a row lock.
async fn row_waiters(db: &TestDb, n: i64) {
    let sql = "SELECT count(*) AS v FROM pg_stat_activity WHERE datname = current_database()
               AND wait_event_type = 'Lock' AND wait_event IN ('transactionid', 'tuple')";
    assert!(
        common::eventually(Duration::from_secs(20), || async { db.scalar(sql) >= n }).await,
        "{n} sessions never waited for a row lock"
    );
}

/// A cancel and a move lock intake rows in the same order, (xid, id): with a row the move wants
/// first locked by a third session, and the cancel naming it after a row the move wants second
/// (and that comes first on disk), neither ends in a deadlock; the move moves both, the cancel
/// then finds them in the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_racing_a_move_never_deadlocks_with_it() {
    let db = TestDb::migrated();
    let store = db.store().await;
    let mut early = db.conn();
    early
        .batch_execute("BEGIN; SELECT pg_current_xact_id()")
        .unwrap();
    write_intake(&mut db.conn(), "c", 1);
    let y = db.scalar("SELECT max(id) AS v FROM postbox.intake");
    write_intake(&mut early, "c", 1);
    early.batch_execute("COMMIT").unwrap();
    let x = db.scalar("SELECT max(id) AS v FROM postbox.intake");
    assert_eq!(
        db.scalar(&format!(
            "SELECT ((SELECT xid FROM postbox.intake WHERE id = {x}) < (SELECT xid FROM postbox.intake WHERE id = {y}))::int::bigint AS v"
        )),
        1,
        "the move takes x first"
    );
    let mut holder = db.conn();
    holder
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM postbox.intake WHERE id = {x} FOR UPDATE"
        ))
        .unwrap();
    let mut mover = db.conn();
    let moving = std::thread::spawn(move || move_from(&mut mover, 10, None).moved);
    row_waiters(&db, 1).await;
    let s = store.clone();
    let cancel = tokio::spawn(async move { s.cancel(&CancelSelector::Ids(vec![y, x])).await });
    row_waiters(&db, 2).await;
    holder.batch_execute("COMMIT").unwrap();
    assert_eq!(moving.join().unwrap(), 2);
    let cancelled = cancel.await.unwrap().expect("no deadlock");
    assert_eq!(cancelled.dead, 2);
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.dead_letters WHERE id IN ({x}, {y}) AND reason = 'cancelled'"
        )),
        2
    );
}

/// The move refuses to run in a transaction that has written: the writer's own rows would be
/// moved and its transaction left below the floor.
#[test]
fn a_move_in_a_transaction_that_wrote_is_refused() {
    let db = TestDb::migrated();
    let mut conn = db.conn();
    conn.batch_execute("BEGIN").unwrap();
    write_intake(&mut conn, "t", 1);
    let e = diesel::sql_query("SELECT moved, floor FROM postbox.move_intake(10, NULL)")
        .get_result::<Moved>(&mut conn)
        .unwrap_err()
        .to_string();
    assert!(e.contains("transaction of its own"), "{e}");
}

/// A message due when its writer wrote it is available once moved, not scheduled: a writer that
/// began after the move's transaction began (its run_at, its own now(), later than the mover's)
/// and committed before the move looked is due all the same (it waited for the scheduler's next
/// promotion: 2.8 % of a steady flow, 40-110 ms each). One scheduled for later stays scheduled.
#[test]
fn a_message_due_when_written_is_available_once_moved() {
    let db = TestDb::migrated();
    let mut mover = db.conn();
    mover
        .batch_execute("BEGIN; SELECT now(); SELECT pg_sleep(0.01)")
        .unwrap();
    db.conn()
        .batch_execute(
            "INSERT INTO postbox.intake (topic, payload) VALUES ('due', '1');
             INSERT INTO postbox.intake (topic, payload, run_at) VALUES ('later', '2', now() + interval '1 hour')",
        )
        .unwrap();
    assert_eq!(
        db_text(
            &mut mover,
            "SELECT (now() < (SELECT run_at FROM postbox.intake WHERE topic = 'due'))::text AS v"
        ),
        "true",
        "the writer's run_at is later than the mover's now()"
    );
    assert_eq!(move_from(&mut mover, 10, None).moved, 2);
    mover.batch_execute("COMMIT").unwrap();
    let mut conn = db.conn();
    assert_eq!(
        db_text(
            &mut conn,
            "SELECT string_agg(topic || ':' || state, ',' ORDER BY topic) AS v FROM postbox.messages"
        ),
        "due:available,later:scheduled"
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE topic = 'later' AND run_at > now() + interval '59 minutes'"),
        1,
        "a run_at to come is kept as written"
    );
}

/// An intake row is never updated (the move deletes what it picked by tuple id; an updated row
/// would have another, past the move's floor): the update is refused, the row moved as written.
#[test]
fn an_intake_row_cannot_be_updated() {
    let db = TestDb::migrated();
    let mut conn = db.conn();
    write_intake(&mut conn, "t", 1);
    let err = conn
        .batch_execute("UPDATE postbox.intake SET topic = 'u'")
        .unwrap_err()
        .to_string();
    assert!(err.contains("postbox.intake rows are not updated"), "{err}");
    assert_eq!(move_from(&mut db.conn(), 10, None).moved, 1);
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE topic = 't'"),
        1
    );
}
