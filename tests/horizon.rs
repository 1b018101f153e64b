//! Claims where a pinned xmin horizon keeps every claimed row's index entry (a long `pg_dump`, a
//! session left idle in transaction, a standby with `hot_standby_feedback`): the claim of every
//! topic starts from the floors its session kept (migration `ready_positions`), so it reads what
//! it returns however many entries the pin keeps; and the floors never hide a message, whatever
//! commits, rolls back or comes back below them. Each interleaving is driven by a second
//! connection held at the point that matters.

mod common;

use common::TestDb;
use diesel::connection::SimpleConnection;
use diesel::{PgConnection, QueryableByName, RunQueryDsl};

fn claim(n: usize) -> String {
    format!("SELECT * FROM postbox.claim({n}, 30, true, '{{}}', '{{}}', '{{}}', '{{}}', 1, 'x')")
}

/// The claim of one topic named exactly (an engine's handlers, a relay's route).
fn claim_topic(n: usize) -> String {
    format!("SELECT * FROM postbox.claim_topic('t', {n}, 30, 1, 'x')")
}

/// The claim of a few topics named exactly (an engine with several handlers): from the floors
/// each topic keeps (migration `ready_sets`).
fn claim_set(n: usize) -> String {
    format!(
        "SELECT * FROM postbox.claim({n}, 30, false, '{{t,u}}', '{{}}', '{{}}', '{{}}', 1, 'x')"
    )
}

/// A held batch of a few topics named exactly.
fn take_set(n: usize) -> String {
    format!(
        "DELETE FROM postbox.messages
         WHERE id = ANY(ARRAY(SELECT id FROM postbox.pick({n}, false, '{{t,u}}', '{{}}', '{{}}', '{{}}'))) RETURNING id"
    )
}

/// The claim of a glob (an engine's handler of `t*`, a route of patterns): from the floors of the
/// filter (migration `filter_floors`).
fn claim_glob(n: usize) -> String {
    format!("SELECT * FROM postbox.claim({n}, 30, false, '{{}}', '{{t%}}', '{{}}', '{{}}', 1, 'x')")
}

/// The claim of every topic but some (a relay's last route, a paused topic).
fn claim_but(n: usize) -> String {
    format!("SELECT * FROM postbox.claim({n}, 30, true, '{{}}', '{{}}', '{{v}}', '{{w%}}', 1, 'x')")
}

/// A held batch of a glob.
fn take_glob(n: usize) -> String {
    format!(
        "DELETE FROM postbox.messages
         WHERE id = ANY(ARRAY(SELECT id FROM postbox.take_matching(false, '{{}}', '{{t%}}', '{{}}', '{{}}', {n}))) RETURNING id"
    )
}

/// A held batch of every topic but some.
fn take_but(n: usize) -> String {
    format!(
        "DELETE FROM postbox.messages
         WHERE id = ANY(ARRAY(SELECT id FROM postbox.take_matching(true, '{{}}', '{{}}', '{{v}}', '{{w%}}', {n}))) RETURNING id"
    )
}

/// A held batch of every topic: its take (`postbox.take_ready`) locks the rows, and the hold
/// deletes them by id and commits (here, in the same statement).
fn take(n: usize) -> String {
    format!(
        "DELETE FROM postbox.messages
         WHERE id = ANY(ARRAY(SELECT id FROM postbox.take_ready(NULL, {n}))) RETURNING id"
    )
}

/// A held batch of one topic named exactly.
fn take_topic(n: usize) -> String {
    format!(
        "DELETE FROM postbox.messages
         WHERE id = ANY(ARRAY(SELECT id FROM postbox.take_ready('t', {n}))) RETURNING id"
    )
}

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    id: i64,
}

/// The ids `sql` returns on `conn`, in order.
fn claimed_by(conn: &mut PgConnection, sql: &str) -> Vec<i64> {
    let mut ids: Vec<i64> = diesel::sql_query(sql)
        .load::<Id>(conn)
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    ids.sort_unstable();
    ids
}

fn ids(db: &TestDb, sql: &str) -> Vec<i64> {
    let mut ids: Vec<i64> = diesel::sql_query(sql)
        .load::<Id>(&mut db.conn())
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    ids.sort_unstable();
    ids
}

/// Index entries of `postbox.messages` that `sql` reads on `conn` (in a transaction rolled back).
fn entries_read(conn: &mut PgConnection, sql: &str) -> i64 {
    #[derive(QueryableByName)]
    struct V {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        v: i64,
    }
    let read = |conn: &mut PgConnection| {
        conn.batch_execute("SELECT pg_stat_force_next_flush(); SELECT pg_stat_clear_snapshot()")
            .unwrap();
        diesel::sql_query(
            "SELECT coalesce(sum(idx_tup_read), 0)::bigint AS v FROM pg_stat_user_indexes
             WHERE schemaname = 'postbox' AND relname = 'messages'",
        )
        .get_result::<V>(conn)
        .unwrap()
        .v
    };
    let before = read(conn);
    conn.batch_execute(&format!("BEGIN; {sql}; ROLLBACK"))
        .unwrap();
    read(conn) - before
}

/// 20,000 messages claimed and deleted while a snapshot (and, in the second case, a transaction
/// with an id of its own, which stays in every later snapshot's running list) pins the horizon:
/// the relay's session then claims 100 reading a few hundred index entries; a new session, which
/// has no floors yet, walks the 20,000 entries the pin keeps (what every claim did before).
#[test]
fn a_claim_under_a_pinned_horizon_reads_what_it_returns() {
    pinned(claim, Given::Topic(""), "every topic", 500);
    pinned(claim_topic, Given::Topic("'t', "), "one topic", 500);
    pinned(claim_set, Given::Set, "a few topics", 500);
    pinned(
        claim_glob,
        Given::Filter("false, '{}', '{t%}', '{}', '{}'"),
        "a glob",
        500,
    );
    pinned(
        claim_but,
        Given::Filter("true, '{}', '{}', '{v}', '{w%}'"),
        "every topic but some",
        500,
    );
}

/// The same for held batches, whose floors stop at the rows they lock: the take after a hold
/// walks that hold's entries (500 here) twice (its walk, and the floor it leaves) besides what
/// it returns and deletes by id; what the pin keeps of the 39 holds before is not read.
#[test]
fn a_take_under_a_pinned_horizon_reads_what_it_returns_and_the_last_hold() {
    pinned(take, Given::Topic(""), "held, every topic", 1_500);
    pinned(take_topic, Given::Topic("'t', "), "held, one topic", 1_500);
    pinned(take_set, Given::Set, "held, a few topics", 1_500);
    pinned(
        take_glob,
        Given::Filter("false, '{}', '{t%}', '{}', '{}'"),
        "held, a glob",
        1_500,
    );
    pinned(
        take_but,
        Given::Filter("true, '{}', '{}', '{v}', '{w%}'"),
        "held, every topic but some",
        1_500,
    );
}

/// How the claim from the floors another connection kept is given them.
enum Given {
    /// The claim's topic argument (`postbox.claim_ready`).
    Topic(&'static str),
    /// A few topics, `t` and `u`, given the floors of each (`postbox.take_set`).
    Set,
    /// The filter's arguments (`postbox.take_matching`).
    Filter(&'static str),
}

fn pinned(claim: fn(usize) -> String, given: Given, shape: &str, most: i64) {
    for pin_sql in [
        "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM postbox.turns",
        "BEGIN; SELECT pg_current_xact_id()",
    ] {
        let db = TestDb::migrated();
        db.exec("ALTER TABLE postbox.messages SET (autovacuum_enabled = false)");
        let mut pin = db.conn();
        pin.batch_execute(pin_sql).unwrap();
        let mut relay = db.conn();
        // Another long transaction with an id (any database's counts), which ends just before
        // the claim measured: its rows are looked up by its id, not by a walk from it.
        let mut long = db.conn();
        long.batch_execute("BEGIN; SELECT pg_current_xact_id()")
            .unwrap();
        for _ in 0..40 {
            db.exec(
                "INSERT INTO postbox.messages (topic) SELECT 't' FROM generate_series(1, 500) g",
            );
            assert_eq!(claimed_by(&mut relay, &claim(500)).len(), 500);
            relay
                .batch_execute("DELETE FROM postbox.messages WHERE state = 'running'")
                .unwrap();
        }
        // Statistics taken under the pin (autovacuum's ANALYZE does it every minute): a table of
        // dead rows and few live ones, for which a plan the functions keep once could walk every
        // entry of a priority (see the migration ready_takes).
        db.exec("VACUUM ANALYZE postbox.messages");
        long.batch_execute("COMMIT").unwrap();
        db.exec("INSERT INTO postbox.messages (topic) SELECT 't' FROM generate_series(1, 100) g");
        let warm = entries_read(&mut relay, &claim(100));
        let cold = entries_read(&mut db.conn(), &claim(100));
        // Another connection of the relay's process: given the floors its store saw last.
        #[derive(QueryableByName)]
        struct Floors {
            #[diesel(sql_type = diesel::sql_types::Text)]
            floors: String,
        }
        let floors_of = |relay: &mut PgConnection, topic: &str| {
            diesel::sql_query(format!(
                "SELECT coalesce(current_setting(postbox.claim_floors_setting({topic}), true), '') AS floors"
            ))
            .get_result::<Floors>(relay)
            .unwrap()
            .floors
        };
        let lease = if shape.starts_with("held") {
            "NULL, NULL, NULL"
        } else {
            "30, 1, 'x'"
        };
        let shared_sql = match given {
            Given::Topic(topic_arg) => {
                let floors = floors_of(
                    &mut relay,
                    if topic_arg.is_empty() { "NULL" } else { "'t'" },
                );
                format!(
                    "SELECT * FROM postbox.claim_ready({}100, 30, 1, 'x', '{floors}')",
                    if topic_arg.is_empty() {
                        "NULL, "
                    } else {
                        topic_arg
                    }
                )
            }
            Given::Filter(args) => {
                let floors = diesel::sql_query(format!(
                    "SELECT coalesce(current_setting(postbox.filter_floors_setting({args}), true), '') AS floors"
                ))
                .get_result::<Floors>(&mut relay)
                .unwrap()
                .floors;
                format!("SELECT * FROM postbox.take_matching({args}, 100, {lease}, '{floors}')")
            }
            // A few topics: the floors of each, in the order of the topics.
            Given::Set => {
                let (t, u) = (floors_of(&mut relay, "'t'"), floors_of(&mut relay, "'u'"));
                format!(
                    "SELECT * FROM postbox.take_set(ARRAY['t', 'u'], 100, {lease}, ARRAY['{t}', '{u}'])"
                )
            }
        };
        let shared = entries_read(&mut db.conn(), &shared_sql);
        if let Given::Filter(args) = given {
            // What the claim of such a filter read before (postbox.pick's windows from the front).
            let (all, rest) = args.split_once(", ").unwrap();
            let old = entries_read(
                &mut relay,
                &format!("SELECT * FROM postbox.pick(100, {all}, {rest})"),
            );
            eprintln!("{shape}, {pin_sql}: postbox.pick read {old} index entries");
        }
        eprintln!(
            "{shape}, {pin_sql}: index entries read by a claim of 100: {warm} (relay's session), {shared} (a new one given its floors), {cold} (a new one without)"
        );
        assert!(shared <= most, "{pin_sql}: with the floors given, {shared}");
        assert!(
            warm <= most,
            "{pin_sql}: the relay's claim read {warm} index entries"
        );
        assert!(
            cold >= 20_000,
            "{pin_sql}: a session without floors read {cold}: the pin did not keep the entries?"
        );
        assert_eq!(claimed_by(&mut relay, &claim(1000)).len(), 100, "{pin_sql}");
        pin.batch_execute("ROLLBACK").unwrap();
    }
}

/// The floors never hide a message: a writer's transaction open across claims, another
/// session's claim that rolls back after this one skipped its rows, a running message an
/// operator puts back by hand, a more urgent priority that appears later, and a priority not
/// seen before committed by a transaction that was open across claims: each is claimed by the
/// session's next claim.
#[test]
fn the_floors_never_hide_a_message() {
    never_hidden(claim, "NULL", claim_from);
    never_hidden(claim_topic, "'t'", claim_from);
    never_hidden_by(claim_set, "'t'", None);
    never_hidden_by(claim_glob, "'t'", None);
    never_hidden_by(claim_but, "'t'", None);
}

/// The same for held batches: a hold that rolls back after another took past its rows, in
/// particular, leaves them claimable (the floors stop at the rows a hold locks).
#[test]
fn the_floors_of_held_batches_never_hide_a_message() {
    never_hidden(take, "NULL", take_from);
    never_hidden(take_topic, "'t'", take_from);
    never_hidden_by(take_set, "'t'", None);
    never_hidden_by(take_glob, "'t'", None);
    never_hidden_by(take_but, "'t'", None);
}

/// A claim of up to 10 of `topic` from `floors`.
fn claim_from(topic: &str, floors: &str) -> String {
    format!("SELECT * FROM postbox.claim_ready({topic}, 10, 30, 1, 'x', '{floors}')")
}

/// A held batch of up to 10 of `topic` from `floors`.
fn take_from(topic: &str, floors: &str) -> String {
    format!(
        "DELETE FROM postbox.messages
         WHERE id = ANY(ARRAY(SELECT id FROM postbox.take_ready({topic}, 10, '{floors}'))) RETURNING id"
    )
}

fn never_hidden(claim: fn(usize) -> String, topic: &str, from: fn(&str, &str) -> String) {
    never_hidden_by(claim, topic, Some(from))
}

/// `from`: the claim from floors given (none for a few topics, whose floors stay in the session).
fn never_hidden_by(
    claim: fn(usize) -> String,
    topic: &str,
    from: Option<fn(&str, &str) -> String>,
) {
    let claimed = |conn: &mut PgConnection, n: usize| claimed_by(conn, &claim(n));
    let db = TestDb::migrated();
    let mut relay = db.conn();
    let new_ids = |db: &TestDb| {
        ids(
            db,
            "SELECT id FROM postbox.messages WHERE state = 'available'",
        )
    };

    // A writer's transaction that began before the claims and commits after them.
    let mut writer = db.conn();
    writer
        .batch_execute(
            "BEGIN; INSERT INTO postbox.messages (topic, key) VALUES ('t', 'late'), ('t', 'late')",
        )
        .unwrap();
    db.exec("INSERT INTO postbox.messages (topic, key) VALUES ('t', 'early')");
    let want = new_ids(&db);
    assert_eq!(claimed(&mut relay, 10), want);
    db.exec("INSERT INTO postbox.messages (topic, key) VALUES ('t', 'after')");
    let want = new_ids(&db);
    assert_eq!(claimed(&mut relay, 10), want);
    writer.batch_execute("COMMIT").unwrap();
    let late = new_ids(&db);
    assert_eq!(late.len(), 2);
    assert_eq!(claimed(&mut relay, 10), late, "the late commit's messages");

    // Another session's claim holds two rows while this one claims past them, then rolls back.
    db.exec("INSERT INTO postbox.messages (topic) SELECT 't' FROM generate_series(1, 3)");
    let mut other = db.conn();
    other
        .batch_execute(&format!("BEGIN; {}", claim(2)))
        .unwrap();
    assert_eq!(claimed(&mut relay, 10).len(), 1);
    db.exec("INSERT INTO postbox.messages (topic, key) VALUES ('t', 'newer')");
    assert_eq!(claimed(&mut relay, 10).len(), 1, "the newer one");
    other.batch_execute("ROLLBACK").unwrap();
    let released = new_ids(&db);
    assert_eq!(released.len(), 2);
    assert_eq!(
        claimed(&mut relay, 10),
        released,
        "the rows of the claim rolled back"
    );

    // A running message put back by hand, as an operator's SQL would.
    db.exec(
        "INSERT INTO postbox.messages (topic, key, state, attempts, locked_until, lease_token, locked_by)
         VALUES ('t', 'by hand', 'running', 1, now() + interval '1 hour', 1, 'x')",
    );
    let back = ids(
        &db,
        "SELECT min(id) AS id FROM postbox.messages WHERE state = 'running'",
    );
    db.exec(&format!(
        "UPDATE postbox.messages SET state = 'available', locked_until = NULL, lease_token = NULL, locked_by = NULL
         WHERE id = {}",
        back[0]
    ));
    assert_eq!(claimed(&mut relay, 10), back, "the message put back");

    // A more urgent priority, and one less urgent, after the floors were set.
    db.exec("INSERT INTO postbox.messages (topic, key, priority) VALUES ('t', 'low', 9), ('t', 'plain', 0), ('t', 'urgent', -9)");
    for topic in ["urgent", "plain", "low"] {
        let want = ids(
            &db,
            &format!("SELECT id FROM postbox.messages WHERE key = '{topic}'"),
        );
        assert_eq!(claimed(&mut relay, 1), want, "{topic}");
    }

    // A priority never seen, from a transaction open across claims.
    writer
        .batch_execute(
            "BEGIN; INSERT INTO postbox.messages (topic, key, priority) VALUES ('t', 'odd', 4)",
        )
        .unwrap();
    db.exec("INSERT INTO postbox.messages (topic, key) VALUES ('t', 'x')");
    assert_eq!(claimed(&mut relay, 10).len(), 1);
    assert_eq!(claimed(&mut relay, 10).len(), 0);
    writer.batch_execute("COMMIT").unwrap();
    let odd = ids(&db, "SELECT id FROM postbox.messages WHERE key = 'odd'");
    assert_eq!(odd.len(), 1);
    assert_eq!(
        claimed(&mut relay, 10),
        odd,
        "the unseen priority's message"
    );

    // A claim inside a longer transaction that makes a message available after it (its own
    // transaction id is not in its snapshot's running list).
    relay
        .batch_execute("BEGIN; SELECT pg_current_xact_id()")
        .unwrap();
    assert_eq!(claimed(&mut relay, 10).len(), 0);
    db.exec("INSERT INTO postbox.messages (topic, key) VALUES ('t', 'meanwhile')");
    assert_eq!(claimed(&mut relay, 10).len(), 1);
    relay
        .batch_execute("INSERT INTO postbox.messages (topic, key) VALUES ('t', 'mine'); COMMIT")
        .unwrap();
    let mine = ids(&db, "SELECT id FROM postbox.messages WHERE key = 'mine'");
    assert_eq!(mine.len(), 1);
    assert_eq!(
        claimed(&mut relay, 10),
        mine,
        "the message of the claiming transaction"
    );

    let Some(from) = from else {
        assert_eq!(
            db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE state = 'available'"),
            0
        );
        return;
    };
    // Floors from the future (another server's): ignored, and the session's own are kept.
    db.exec("INSERT INTO postbox.messages (topic, key) VALUES ('t', 'future')");
    let future = ids(&db, "SELECT id FROM postbox.messages WHERE key = 'future'");
    assert_eq!(
        claimed_by(&mut relay, &from(topic, "900000000000;;0:900000000000")),
        future
    );

    // A row copied in with a ready_xid of its own, below the floors: it gets its insert's.
    db.exec("INSERT INTO postbox.messages (topic, key, ready_xid) VALUES ('t', 'copied', '3')");
    let copied = ids(&db, "SELECT id FROM postbox.messages WHERE key = 'copied'");
    assert_eq!(copied.len(), 1);
    assert_eq!(claimed(&mut relay, 10), copied);
    // Only with triggers off can a row be made available below the floors; '' asks for a walk
    // from the front.
    db.exec(
        "SET session_replication_role = replica;
             INSERT INTO postbox.messages (topic, key, ready_xid) VALUES ('t', 'copied again', '3');
             RESET session_replication_role",
    );
    assert_eq!(
        claimed(&mut relay, 10).len(),
        0,
        "below the floors, by hand"
    );
    let again = ids(
        &db,
        "SELECT id FROM postbox.messages WHERE key = 'copied again'",
    );
    assert_eq!(claimed_by(&mut relay, &from(topic, "")), again);
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE state = 'available'"),
        0
    );
}

/// Rows restored from another cluster carry its transaction ids, ahead of this one's: the insert
/// gives them the restoring transaction's, so they do not queue behind every message written
/// here (and the floors never pass them by).
#[test]
fn restored_rows_queue_as_of_the_restore() {
    let db = TestDb::migrated();
    db.exec(
        "ALTER TABLE postbox.messages SET (autovacuum_enabled = false);
         INSERT INTO postbox.messages (topic, key, ready_xid)
             SELECT 't', 'restored', '900000000000' FROM generate_series(1, 1500);
         INSERT INTO postbox.messages (topic, key, state, run_at, ready_xid)
             VALUES ('t', 'restored later', 'scheduled', now() + interval '1 hour', '900000000000')",
    );
    assert_eq!(
        db.scalar(
            "SELECT count(*) AS v FROM postbox.messages
             WHERE ready_xid > pg_snapshot_xmax(pg_current_snapshot())"
        ),
        0
    );
    db.exec("INSERT INTO postbox.messages (topic, key) VALUES ('t', 'new')");
    let mut relay = db.conn();
    let first = claimed_by(&mut relay, &claim_topic(1500));
    assert_eq!(
        first,
        ids(
            &db,
            "SELECT id FROM postbox.messages WHERE key = 'restored'"
        ),
        "the restored messages first"
    );
}

/// The floors a store keeps are of the server that gave them. A standby promoted after it lagged
/// (or a server that lost asynchronous commits in a crash) hands out again transaction ids the
/// floors had passed: once its counter is back past them, a message made available by one of
/// those ids would sit below the floors. The store's next claim, on the new server, walks from
/// the front once instead, and takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floors_of_a_server_that_went_away_hide_nothing_on_the_next() {
    let server = common::OwnServer::start(&[]);
    let db = server.migrated();
    let data = server.data_dir();
    let copy = |from: &std::path::Path, to: &std::path::Path| {
        let ok = std::process::Command::new("cp")
            .args(["-a", from.to_str().unwrap(), to.to_str().unwrap()])
            .status()
            .unwrap();
        assert!(ok.success());
    };
    // The standby, as it was: a copy of the data directory before the primary went on.
    server.stop("fast");
    let standby = data.with_file_name("standby");
    copy(&data, &standby);
    server.start_again();

    let store = db.store().await;
    // The token of the server's run, as the relay's upkeep makes it.
    store.start_run().await.unwrap();
    let topics = postbox::Topics::exact(["t"]);
    let burn = |n: usize| {
        let mut conn = db.conn();
        for _ in 0..n {
            conn.batch_execute("SELECT pg_current_xact_id()").unwrap();
        }
    };
    // And a few topics named exactly, from the floors of each.
    let set = postbox::Topics::exact(["u", "v"]);
    burn(300);
    db.exec("INSERT INTO postbox.messages (topic) VALUES ('t'), ('u')");
    for topics in [&topics, &set] {
        assert_eq!(
            store
                .claim(10, std::time::Duration::from_secs(30), topics)
                .await
                .unwrap()
                .len(),
            1
        );
    }
    // The primary goes; the standby takes its place (its data, on the same address).
    server.stop("immediate");
    std::fs::rename(&data, data.with_file_name("old primary")).unwrap();
    std::fs::rename(&standby, &data).unwrap();
    server.start_again();
    db.exec(
        "INSERT INTO postbox.messages (topic, key) VALUES ('t', 'after the failover'), ('u', 'u after the failover')",
    );
    burn(400);
    for (topics, key) in [
        (&topics, "after the failover"),
        (&set, "u after the failover"),
    ] {
        let want = db.scalar(&format!(
            "SELECT id AS v FROM postbox.messages WHERE key = '{key}'"
        ));
        // The pool's connections to the old server fail once each.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let mut got = Vec::new();
        while got.is_empty() && std::time::Instant::now() < deadline {
            if let Ok(claimed) = store
                .claim(10, std::time::Duration::from_secs(30), topics)
                .await
            {
                got.extend(claimed.into_iter().map(|m| m.id));
            }
        }
        assert_eq!(got, [want], "{key}");
    }
}

/// A take inside a transaction that already wrote sees its own changes (a row it made running
/// looks claimed): it keeps no floors, which another session could be handed and which would pass
/// that row once the transaction rolls back.
#[test]
fn a_take_after_its_transaction_wrote_keeps_no_floors() {
    let db = TestDb::migrated();
    db.exec("INSERT INTO postbox.messages (topic) SELECT 't' FROM generate_series(1, 3)");
    let first = ids(&db, "SELECT min(id) AS id FROM postbox.messages");
    let mut a = db.conn();
    a.batch_execute(&format!(
        "BEGIN; UPDATE postbox.messages SET state = 'running', lease_token = 1, locked_until = now() + interval '1 hour', locked_by = 'x'
         WHERE id = {}",
        first[0]
    ))
    .unwrap();
    assert_eq!(
        claimed_by(&mut a, "SELECT * FROM postbox.take_ready(NULL, 1)").len(),
        1
    );
    assert_eq!(
        db_text(
            &mut a,
            "SELECT coalesce(current_setting('postbox.claim_floors', true), '') AS v"
        ),
        ""
    );
    a.batch_execute("ROLLBACK").unwrap();
    assert_eq!(claimed_by(&mut a, &take(10)).len(), 3);
}

fn db_text(conn: &mut PgConnection, sql: &str) -> String {
    #[derive(QueryableByName)]
    struct V {
        #[diesel(sql_type = diesel::sql_types::Text)]
        v: String,
    }
    diesel::sql_query(sql).get_result::<V>(conn).unwrap().v
}

/// The token the floors are stamped with changes when the server reinitialises after a crash (a
/// backend killed: the postmaster stays, and with it its start time, but asynchronous commits not
/// yet flushed are lost and their transaction ids handed out again), and stays through a clean
/// restart (which loses nothing).
#[test]
fn the_run_token_changes_on_a_crash_and_not_on_a_clean_restart() {
    let server = common::OwnServer::start(&[]);
    let db = server.migrated();
    let token = || db.text("SELECT coalesce(postbox.boot_token(), '') AS v");
    assert_eq!(token(), "", "none until the upkeep makes one");
    let before = db.text("SELECT postbox.boot_start() AS v");
    assert_eq!(token(), before);
    assert_eq!(db.text("SELECT postbox.boot_start() AS v"), before);
    server.stop("fast");
    server.start_again();
    assert_eq!(token(), before, "a clean restart keeps the token");
    // A backend killed: the postmaster reinitialises the server.
    let mut victim = db.conn();
    let pid = claimed_by(&mut victim, "SELECT pg_backend_pid()::bigint AS id")[0];
    let killed = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let after = loop {
        // Connections fail until it is back.
        use diesel::Connection;
        if let Ok(mut conn) = PgConnection::establish(&db.url)
            && let Ok(t) = diesel::sql_query("SELECT coalesce(postbox.boot_token(), '') AS v")
                .get_result::<TextV>(&mut conn)
        {
            break t.v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the server did not come back"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert_eq!(after, "", "a crash empties the unlogged token");
    let again = db.text("SELECT postbox.boot_start() AS v");
    assert!(
        !again.is_empty() && again != before,
        "a new run, a new token"
    );
}

#[derive(QueryableByName)]
struct TextV {
    #[diesel(sql_type = diesel::sql_types::Text)]
    v: String,
}

/// The rows of pending transactions that ended since the floors were set are looked up by those
/// transactions' ids: a take of 1 after two writers of 2 rows each committed locks the one row it
/// returns, not a batch of each writer's (which it held, unreturned, until it ended).
#[test]
fn a_take_locks_only_what_it_returns_of_the_writers_that_ended() {
    for (shape, take) in [
        ("one topic", "SELECT id FROM postbox.take_ready('a', 1)"),
        (
            "a few topics",
            "SELECT id FROM postbox.pick(1, false, '{a,b}', '{}', '{}', '{}')",
        ),
    ] {
        let db = TestDb::migrated();
        let mut relay = db.conn();
        db.exec("INSERT INTO postbox.messages (topic) VALUES ('a')");
        // The priority is known, and the floors set.
        relay
            .batch_execute(&format!(
                "DELETE FROM postbox.messages WHERE id = ANY(ARRAY({take}))"
            ))
            .unwrap();
        let (mut w1, mut w2) = (db.conn(), db.conn());
        for w in [&mut w1, &mut w2] {
            w.batch_execute("BEGIN; INSERT INTO postbox.messages (topic) VALUES ('a'), ('a')")
                .unwrap();
        }
        // Floors set while both are running: they are pending (a later transaction ended, so
        // the snapshot's end is past them: a running transaction at or past it is above the
        // floors, not pending).
        db.exec("SELECT pg_current_xact_id()");
        relay
            .batch_execute(&format!(
                "DELETE FROM postbox.messages WHERE id = ANY(ARRAY({take}))"
            ))
            .unwrap();
        for w in [&mut w1, &mut w2] {
            w.batch_execute("COMMIT").unwrap();
        }
        relay.batch_execute("BEGIN").unwrap();
        assert_eq!(claimed_by(&mut relay, take).len(), 1, "{shape}");
        assert_eq!(
            db.scalar(
                "SELECT count(*) AS v FROM (SELECT id FROM postbox.messages
                   WHERE topic = 'a' AND state = 'available' FOR UPDATE SKIP LOCKED) l"
            ),
            3,
            "{shape}: rows the take locked beyond the one it returned"
        );
        relay.batch_execute("ROLLBACK").unwrap();
    }
}

/// A glob whose busy topics are few among other traffic is narrowed to them, one descent of the
/// topic index per topic within the prefix's range: its last descent stops at the range's end.
/// Unbounded, it went on into the topic that sorts next and read every entry a pin keeps of it
/// (here `u`, drained under the pin: 20,000 entries at each claim of `t%`).
#[test]
fn narrowing_a_glob_stops_at_the_end_of_its_prefix() {
    let db = TestDb::migrated();
    db.exec("ALTER TABLE postbox.messages SET (autovacuum_enabled = false)");
    let mut pin = db.conn();
    pin.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM postbox.turns")
        .unwrap();
    let mut relay = db.conn();
    for _ in 0..20 {
        db.exec("INSERT INTO postbox.messages (topic) SELECT 'u' FROM generate_series(1, 1000)");
        relay
            .batch_execute(
                "SELECT count(*) FROM postbox.claim_topic('u', 1000, 30, 1, 'x');
                 DELETE FROM postbox.messages WHERE state = 'running'",
            )
            .unwrap();
    }
    // Mostly other topics, and a few rows of `t0`: the claim of `t%` narrows to `t0`.
    db.exec(
        "INSERT INTO postbox.messages (topic) SELECT CASE WHEN g % 10 = 0 THEN 't0' ELSE 'a' || (g % 9) END
         FROM generate_series(1, 2000) g",
    );
    // The session's first claim of the filter walks from the front once (it has no floors).
    assert_eq!(claimed_by(&mut relay, &claim_glob(10)).len(), 10);
    let read = entries_read(&mut relay, &claim_glob(100));
    eprintln!("a glob narrowed beside a topic drained under a pin: {read} index entries");
    assert!(read <= 2_000, "the claim of t% read {read} index entries");
    assert_eq!(claimed_by(&mut relay, &claim_glob(1000)).len(), 190);
    pin.batch_execute("ROLLBACK").unwrap();
}

/// A walk that stops among the rows of one transaction (a bulk insert of other topics in front
/// of a catch-all route) goes on from the row it stopped at: each claim reads about what it
/// walks past, not that transaction's rows from the first again.
#[test]
fn a_walk_goes_on_from_where_it_stopped_within_one_transaction() {
    let db = TestDb::migrated();
    db.exec(
        "INSERT INTO postbox.messages (topic) SELECT CASE WHEN g % 100 = 0 THEN 't' || (g % 7) ELSE 'x' END
         FROM generate_series(1, 30000) g",
    );
    let mut relay = db.conn();
    let but_x = "SELECT * FROM postbox.claim(10, 30, true, '{}', '{}', '{x}', '{}', 1, 'x')";
    let mut reads = Vec::new();
    let mut got = 0;
    for _ in 0..20 {
        reads.push(entries_read(&mut relay, but_x));
        got += claimed_by(&mut relay, but_x).len();
    }
    eprintln!("claims of 10 behind one transaction's backlog: {reads:?} index entries");
    assert_eq!(got, 200);
    assert!(
        reads.iter().all(|&r| r <= 3_000),
        "a claim walked the transaction's rows from the first again: {reads:?}"
    );
}

/// A claim inside a transaction that wrote reads that transaction's own rows: a floor among them
/// keeps no row position (more of that transaction may come, with lower ids: here the message it
/// claimed, given back before its commit), so the next claims find it.
#[test]
fn a_claim_inside_a_writing_transaction_keeps_no_position_among_its_own_rows() {
    let db = TestDb::migrated();
    let mut relay = db.conn();
    let but_x = |n: usize| {
        format!(
            "SELECT * FROM postbox.claim({n}, 60, true, '{{}}', '{{}}', '{{x}}', '{{}}', 1, 'w')"
        )
    };
    assert!(claimed_by(&mut relay, &but_x(1)).is_empty());
    relay
        .batch_execute(
            "BEGIN;
             INSERT INTO postbox.messages (topic) VALUES ('t');
             INSERT INTO postbox.messages (topic) SELECT 'x' FROM generate_series(1, 20)",
        )
        .unwrap();
    // A transaction that began later and ended: the snapshot's end passes the relay's own, so
    // the floor is not merely clamped to the snapshot's end.
    db.exec("INSERT INTO postbox.messages (topic) VALUES ('x')");
    let mine = claimed_by(&mut relay, &but_x(1));
    assert_eq!(mine.len(), 1);
    relay
        .batch_execute(&format!(
            "UPDATE postbox.messages SET state = 'available', locked_until = NULL, lease_token = NULL,
                    locked_by = NULL WHERE id = {};
             COMMIT",
            mine[0]
        ))
        .unwrap();
    assert_eq!(
        claimed_by(&mut relay, &but_x(10)),
        mine,
        "the message given back"
    );
}

/// Buffers (hit + read) of the first plan node of `plan`.
fn first_buffers(plan: &str) -> u64 {
    plan.lines()
        .find(|l| l.trim_start().starts_with("Buffers:"))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|w| w.split_once('='))
                .filter(|(k, _)| matches!(*k, "hit" | "read"))
                .filter_map(|(_, v)| v.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or_else(|| panic!("no buffers in\n{plan}"))
}

/// `Store::explain_claim_as_run` is what a sampler can run every few seconds under a pinned
/// horizon: the whole claim from the store's floors and nothing else, for every shape of filter.
/// `explain_claim` also walks from the front of the claim order (and narrows a glob), which reads
/// every entry the pin keeps: the xmin bench's sampling of it grew to seconds every 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_as_run_is_explained_without_the_walks_from_the_front() {
    use postbox::Topics;
    let db = TestDb::migrated();
    let store = db.store().await;
    let mut pin = db.conn();
    pin.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM postbox.turns")
        .unwrap();
    let shapes = [
        ("every topic", Topics::all()),
        ("one topic", Topics::exact(["t.0"])),
        ("a set", Topics::exact(["t.0", "t.1"])),
        ("a glob", Topics::only(["t.*"])),
    ];
    // 12,000 messages claimed and deleted under the pin, then a few more claimed by each shape
    // (so the store keeps floors of each past what the pin keeps), then one more of each topic
    // (a claim's own writes, a lease of each row it takes, are not what is compared).
    let drain = async |topics: &Topics| loop {
        let got = store
            .claim(500, std::time::Duration::from_secs(30), topics)
            .await
            .unwrap();
        if got.is_empty() {
            break;
        }
        let leases: Vec<_> = got.iter().map(|m| m.lease()).collect();
        store.complete(&leases).await.unwrap();
    };
    db.exec("INSERT INTO postbox.messages (topic) SELECT 't.' || (g % 3) FROM generate_series(1, 12000) g");
    drain(&Topics::all()).await;
    for (_, topics) in &shapes {
        db.exec("INSERT INTO postbox.messages (topic) SELECT 't.' || (g % 3) FROM generate_series(1, 6) g");
        drain(topics).await;
    }
    db.exec("INSERT INTO postbox.messages (topic) VALUES ('t.0'), ('t.1'), ('t.2')");
    for (shape, topics) in &shapes {
        let as_run = store.explain_claim_as_run(100, topics).await.unwrap();
        let sections: Vec<&str> = as_run.lines().filter(|l| l.starts_with("-- ")).collect();
        assert_eq!(
            sections,
            ["-- the claim, from this store's floors"],
            "{shape}\n{as_run}"
        );
        let full = store.explain_claim(100, topics).await.unwrap();
        assert!(
            full.starts_with(&as_run[..as_run.find('\n').unwrap()]),
            "{shape}"
        );
        let (run, whole) = (first_buffers(&as_run), total_buffers(&full));
        println!("{shape}: the claim as run {run} buffers, the whole explain {whole}");
        assert!(run < 2_000, "{shape}: {run}\n{as_run}");
        assert!(whole > 5 * run, "{shape}: {whole} against {run}\n{full}");
    }
    // Nothing was claimed by explaining.
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE state = 'available'"),
        3
    );
    pin.batch_execute("ROLLBACK").unwrap();
}

/// Buffers (hit + read) of the top node of every plan in `plan`.
fn total_buffers(plan: &str) -> u64 {
    plan.split("\n-- ")
        .filter(|p| p.contains("Buffers:"))
        .map(first_buffers)
        .sum()
}
