//! Least privilege against a real PostgreSQL with real roles: `postbox grant` gives a writer, a
//! relay and an operator what each needs, each does its work logged in as itself, and each
//! forbidden action fails with a permission error. Every test runs a server of its own (roles are
//! the server's, not a database's: no test sees another's).

mod common;

use std::process::Output;

use common::{OwnServer, TestDb, hermetic};
use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection, RunQueryDsl};
use postbox::Message;
use postbox::store::grant::{RoleKind, TABLES, grant_sql};

const BIN: &str = env!("CARGO_BIN_EXE_postbox");

fn postbox(url: &str, args: &[&str]) -> Output {
    let mut cmd = hermetic(BIN);
    cmd.args(["--database-url", url])
        .args(args)
        .env("POSTBOX_LOG", "info")
        .env("POSTBOX_METRICS_LISTEN", "off");
    cmd.output().expect("run postbox")
}

fn ok(out: &Output) -> String {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "postbox failed: {text}");
    text
}

/// A URL of `server` for `role` (trust auth: no password).
fn as_role(server: &OwnServer, role: &str, db: &str) -> String {
    format!("postgres://{role}@127.0.0.1:{}/{db}", server.port)
}

/// A server of its own with postbox migrated into database `postbox`, and the login roles
/// `app` (a writer), `relayer` (a relay) and `oncall` (an operator), each a member of the NOLOGIN
/// role `postbox grant` created.
fn setup() -> (OwnServer, TestDb) {
    let server = OwnServer::start(&["wal_level=logical", "max_wal_senders=4"]);
    let db = server.migrated();
    let out = postbox(
        &db.url,
        &[
            "grant",
            "--writer",
            "postbox_writer",
            "--relay",
            "postbox_relay",
            "--operator",
            "postbox_operator",
        ],
    );
    let text = ok(&out);
    for role in ["postbox_writer", "postbox_relay", "postbox_operator"] {
        assert!(text.contains(&format!("created role {role}")), "{text}");
    }
    db.exec(
        "CREATE ROLE app LOGIN IN ROLE postbox_writer;
         CREATE ROLE relayer LOGIN IN ROLE postbox_relay;
         CREATE ROLE oncall LOGIN IN ROLE postbox_operator;",
    );
    (server, db)
}

/// Runs `sql` as the connection's role; the error it fails with.
fn refused(conn: &mut PgConnection, sql: &str) -> String {
    match conn.batch_execute(sql) {
        Ok(()) => panic!("{sql}: allowed, should have been refused"),
        Err(e) => {
            let e = e.to_string();
            assert!(
                e.contains("permission denied") || e.contains("must be owner"),
                "{sql}: refused, but not for a privilege: {e}"
            );
            e
        }
    }
}

#[derive(diesel::QueryableByName)]
struct V {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    v: i64,
}

fn scalar(conn: &mut PgConnection, sql: &str) -> i64 {
    diesel::sql_query(sql).get_result::<V>(conn).unwrap().v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_enqueues_and_publishes_and_can_do_nothing_else() {
    let (server, db) = setup();
    // Stream mode set up by the schema's owner: the writer's publish must pass its slot check.
    db.store()
        .await
        .stream_setup("postbox", "postbox_stream")
        .await
        .unwrap();
    let url = as_role(&server, "app", "postbox");
    let mut app = PgConnection::establish(&url).unwrap();

    // Sync enqueue, in the app's own transaction: an ordered key (the second waits behind the
    // first: the writer's insert ran the key's order as the owner), a scheduled message, and a
    // dedup key given twice.
    app.transaction::<_, postbox::Error, _>(|c| {
        postbox::enqueue_many(
            c,
            &[
                Message::new("orders")
                    .payload(&serde_json::json!({"n": 1}))
                    .key("o-1")
                    .ordered(),
                Message::new("orders")
                    .payload(&serde_json::json!({"n": 2}))
                    .key("o-1")
                    .ordered(),
                Message::new("mail")
                    .payload(&serde_json::json!({}))
                    .delay(std::time::Duration::from_secs(3600)),
            ],
        )?;
        Ok(())
    })
    .unwrap();
    let first = postbox::enqueue(
        &mut app,
        &Message::new("mail")
            .payload(&serde_json::json!({}))
            .dedup_key("welcome-7"),
    )
    .unwrap();
    let again = postbox::enqueue(
        &mut app,
        &Message::new("mail")
            .payload(&serde_json::json!({}))
            .dedup_key("welcome-7"),
    )
    .unwrap();
    assert!(matches!(first, postbox::Enqueued::New(_)), "{first:?}");
    assert_eq!(
        again,
        postbox::Enqueued::Duplicate {
            existing: first.id()
        }
    );
    // Async enqueue and publish, and plain SQL.
    {
        use diesel_async::AsyncConnection;
        let mut a = diesel_async::AsyncPgConnection::establish(&url)
            .await
            .unwrap();
        postbox::enqueue_async(
            &mut a,
            &Message::new("orders").payload(&serde_json::json!({"n": 3})),
        )
        .await
        .unwrap();
        postbox::publish_async(
            &mut a,
            &Message::new("events").payload(&serde_json::json!({"e": 1})),
        )
        .await
        .unwrap();
    }
    postbox::publish(
        &mut app,
        &Message::new("events").payload(&serde_json::json!({"e": 2})),
    )
    .unwrap();
    app.batch_execute("INSERT INTO postbox.messages (topic, payload) VALUES ('sql', '{}')")
        .unwrap();

    let mut owner = db.conn();
    assert_eq!(
        scalar(
            &mut owner,
            "SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"
        ),
        6
    );
    assert_eq!(
        scalar(
            &mut owner,
            "SELECT count(*) AS v FROM postbox.messages WHERE key = 'o-1' AND state = 'waiting'"
        ),
        1
    );
    // Wherever it went (the intake, with its routing on), moved by a relay it is scheduled.
    common::move_intake(&db);
    assert_eq!(
        scalar(
            &mut owner,
            "SELECT count(*) AS v FROM postbox.messages WHERE topic = 'mail' AND state = 'scheduled'"
        ),
        1
    );

    // Nothing else: no payload, no dead letter, no change to a message, no relay's work, no
    // schema change, no way around the state model by naming a column it does not own.
    for sql in [
        "SELECT payload FROM postbox.messages",
        "SELECT headers FROM postbox.messages",
        "SELECT * FROM postbox.dead_letters",
        "SELECT * FROM postbox.completed",
        "UPDATE postbox.messages SET priority = 1",
        "DELETE FROM postbox.messages",
        "INSERT INTO postbox.messages (topic, payload, state) VALUES ('t', '{}', 'running')",
        "INSERT INTO postbox.messages (topic, payload, attempts) VALUES ('t', '{}', 99)",
        "INSERT INTO postbox.dead_letters (id, topic, payload) VALUES (1, 't', '{}')",
        "SELECT * FROM postbox.claim(10, 30, true, '{}', '{}', '{}', '{}', 1, 'w')",
        "SELECT postbox.completed_partitions('1 hour')",
        "INSERT INTO postbox.pauses (pattern) VALUES ('orders')",
        // A handler's completion goes through postbox.complete_in_tx, for its own delivery.
        "INSERT INTO postbox.completed_in_tx (id) VALUES (1)",
        "CREATE TABLE postbox.mine (id int)",
        "ALTER TABLE postbox.messages ADD COLUMN mine int",
        // The triggers that run as the owner cannot be put on a table of the writer's own (whose
        // column types it would choose, to run code of its own as the owner).
        "CREATE TEMP TABLE t (id bigint, topic text, key text, ordered boolean, state postbox.message_state);
         CREATE TRIGGER t_replay AFTER INSERT ON t FOR EACH ROW EXECUTE FUNCTION postbox.messages_after_replay()",
        "CREATE TEMP TABLE t2 (id bigint, topic text, key text, ordered boolean, run_at timestamptz, state postbox.message_state);
         CREATE TRIGGER t_state BEFORE INSERT ON t2 FOR EACH ROW EXECUTE FUNCTION postbox.messages_before_insert()",
    ] {
        refused(&mut app, sql);
    }
    // The writer may record a completion, but only for a delivery it holds the lease token of.
    let forged = app
        .batch_execute("BEGIN; SELECT postbox.complete_in_tx(1, 1); ROLLBACK")
        .unwrap_err()
        .to_string();
    app.batch_execute("ROLLBACK").unwrap();
    assert!(
        forged.contains("no longer delivered under this lease"),
        "{forged}"
    );
    // Nor by a role given EXECUTE on them by hand: they run on postbox.messages only.
    owner
        .batch_execute("GRANT EXECUTE ON FUNCTION postbox.messages_after_replay() TO app")
        .unwrap();
    let mut app = PgConnection::establish(&url).unwrap();
    refused(
        &mut app,
        "CREATE TEMP TABLE t (id bigint, topic text, key text, ordered boolean, state postbox.message_state);
         CREATE TRIGGER t_replay AFTER INSERT ON t FOR EACH ROW EXECUTE FUNCTION postbox.messages_after_replay();
         INSERT INTO t VALUES (1, 'orders', 'o-1', true, 'available')",
    );
    assert_eq!(
        scalar(
            &mut owner,
            "SELECT count(*) AS v FROM postbox.messages WHERE key = 'o-1' AND state = 'waiting'"
        ),
        1
    );
}

/// A writer that sets `postbox.keep_ids` (a replay's setting) cannot keep an id drawn early: its
/// message takes its place in the key when it takes the key's lock, behind a writer that committed
/// meanwhile, as any writer's does.
#[test]
fn a_writer_cannot_keep_an_early_id_to_jump_ahead_of_its_key() {
    let (server, db) = setup();
    let url = as_role(&server, "app", "postbox");
    let mut owner = db.conn();
    // The early writer's payload waits on a lock the test holds: its id is drawn, its row not yet
    // built (the identity default comes before the other values of a VALUES row).
    owner
        .batch_execute("SELECT pg_advisory_lock(4242)")
        .unwrap();
    let early = {
        let url = url.clone();
        std::thread::spawn(move || {
            let mut c = PgConnection::establish(&url).unwrap();
            c.batch_execute(
                "BEGIN; SET LOCAL postbox.keep_ids = on;
                 INSERT INTO postbox.messages (topic, key, ordered, payload)
                 VALUES ('race', 'k', true, jsonb_build_object('w', pg_advisory_lock_shared(4242)::text));
                 COMMIT",
            )
        })
    };
    let waiting = "SELECT count(*) AS v FROM pg_locks WHERE locktype = 'advisory' AND objid = 4242 AND NOT granted";
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while scalar(&mut owner, waiting) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the early writer never reached its payload"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let mut late = PgConnection::establish(&url).unwrap();
    late.batch_execute(
        "INSERT INTO postbox.messages (topic, key, ordered, payload) VALUES ('race', 'k', true, '{\"w\": \"late\"}')",
    )
    .unwrap();
    owner
        .batch_execute("SELECT pg_advisory_unlock(4242)")
        .unwrap();
    early.join().unwrap().unwrap();
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Text)]
        state: String,
        #[diesel(sql_type = diesel::sql_types::Text)]
        w: String,
    }
    let rows: Vec<Row> = diesel::sql_query(
        "SELECT state::text AS state, payload ->> 'w' AS w FROM postbox.messages WHERE key = 'k' ORDER BY id",
    )
    .load(&mut owner)
    .unwrap();
    let got: Vec<(&str, &str)> = rows
        .iter()
        .map(|r| (r.w.as_str(), r.state.as_str()))
        .collect();
    assert_eq!(got.len(), 2);
    assert_eq!(got[0], ("late", "available"), "{got:?}");
    assert_eq!(got[1].1, "waiting", "{got:?}");
}

/// A writer role holds its transaction open after writing ordered messages (its checks run at
/// once, `SET CONSTRAINTS ALL IMMEDIATE`) and takes every advisory lock postbox ever used by
/// hand: the relay's settles of other keys neither wait (its connections give up on a lock after
/// 200 ms) nor fail, and the other keys go on. Its own key waits for its commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_role_holds_up_no_settle_and_no_other_key() {
    let (server, db) = setup();
    // Keys of every slot the old promotion locks had, two messages each.
    postbox::enqueue_many(
        &mut db.conn(),
        &(0..600)
            .flat_map(|i| {
                let m = Message::new("orders").key(format!("k{i}")).ordered();
                [m.clone(), m]
            })
            .chain([Message::new("app").key("mine").ordered()])
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let mut app = PgConnection::establish(&as_role(&server, "app", "postbox")).unwrap();
    app.batch_execute(
        "BEGIN;
         INSERT INTO postbox.messages (topic, key, ordered) VALUES ('app', 'mine', true), ('app', 'mine', true);
         SET CONSTRAINTS ALL IMMEDIATE;
         SELECT pg_advisory_lock(c, s) FROM generate_series(1886352244, 1886352247) c,
                                             generate_series(0, 255) s;",
    )
    .unwrap();
    // What a writer cannot do: lock a message row itself.
    let mut other = PgConnection::establish(&as_role(&server, "app", "postbox")).unwrap();
    refused(
        &mut other,
        "SELECT id FROM postbox.messages WHERE key = 'k1' FOR KEY SHARE",
    );

    let relay = format!(
        "{}?options=-c%20lock_timeout%3D200",
        as_role(&server, "relayer", "postbox")
    );
    let store = postbox::Store::connect(&relay, 4).await.unwrap();
    let topics = postbox::Topics::exact(["orders"]);
    let lease = std::time::Duration::from_secs(30);
    // Leased and completed, held and settled: 1,200 messages, each key's second after its first.
    let mut delivered = 0;
    while delivered < 1200 {
        let got = store.claim(200, lease, &topics).await.unwrap();
        assert!(
            !got.is_empty(),
            "{delivered} delivered, then nothing claimable"
        );
        let leases: Vec<_> = got.iter().map(|m| m.lease()).collect();
        let done = store.complete(&leases).await.unwrap();
        assert_eq!(done.done.len(), got.len());
        delivered += got.len();
        if let Some(hold) = store
            .take(200, std::time::Duration::from_secs(5), &topics, None, 0)
            .await
            .unwrap()
        {
            store.register_hold(&hold).await.unwrap();
            let ids: Vec<i64> = hold.messages.iter().map(|m| m.id).collect();
            let (ended, _) = store
                .end_hold(hold, &ids, &[], lease, 0)
                .await
                .expect("a held batch ends whatever the writer holds");
            delivered += ended.deleted;
        }
    }
    assert!(store.check(10).await.unwrap().is_empty());
    // The writer's own key: its head is delivered and kept until the writer is done.
    let mine = store
        .claim(10, lease, &postbox::Topics::exact(["app"]))
        .await
        .unwrap();
    assert_eq!(mine.len(), 1);
    store.complete(&[mine[0].lease()]).await.unwrap();
    assert!(
        store
            .claim(10, lease, &postbox::Topics::exact(["app"]))
            .await
            .unwrap()
            .is_empty()
    );
    app.batch_execute("COMMIT").unwrap();
    store.finish_heads().await.unwrap();
    let next = store
        .claim(10, lease, &postbox::Topics::exact(["app"]))
        .await
        .unwrap();
    assert_eq!(
        next.len(),
        1,
        "the writer's first message is its key's head now"
    );
}

/// An operator reached through a role it SETs (a login role without the operator's rights of
/// its own, `options=-c role=…` as a pooler or `SET ROLE` gives): a replay of an ordered message
/// keeps its id and its place, and its dead letter goes. Replayed again: nothing to replay.
#[test]
fn an_operator_reached_by_set_role_replays_in_place() {
    let (server, db) = setup();
    db.exec("CREATE ROLE jump LOGIN NOINHERIT IN ROLE postbox_operator");
    let ids = postbox::enqueue_many(
        &mut db.conn(),
        &(0..3)
            .map(|_| Message::new("acct").key("k").ordered())
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let first = ids[0].id().unwrap();
    let mut owner = db.conn();
    // The first message to the dead letters, the key's head passes to the second.
    owner
        .batch_execute(&format!(
            "INSERT INTO postbox.dead_letters (id, topic, key, ordered, payload, headers, priority, attempts, max_attempts, created_at, reason)
             SELECT id, topic, key, ordered, payload, headers, priority, attempts, max_attempts, created_at, 'refused'
             FROM postbox.messages WHERE id = {first};
             DELETE FROM postbox.messages WHERE id = {first};"
        ))
        .unwrap();
    let url = format!(
        "{}?options=-c%20role%3Dpostbox_operator",
        as_role(&server, "jump", "postbox")
    );
    let mut jump = PgConnection::establish(&url).unwrap();
    assert_eq!(
        scalar(
            &mut jump,
            "SELECT (session_user = 'jump' AND current_user = 'postbox_operator')::int::bigint AS v"
        ),
        1
    );
    let text = ok(&postbox(
        &url,
        &["dead", "replay", "--id", &first.to_string()],
    ));
    assert!(text.contains("replayed 1"), "{text}");
    assert_eq!(
        scalar(&mut owner, "SELECT count(*) AS v FROM postbox.dead_letters"),
        0
    );
    assert_eq!(
        scalar(
            &mut owner,
            &format!(
                "SELECT count(*) AS v FROM postbox.messages WHERE id = {first} AND state = 'available'"
            )
        ),
        1,
        "the replayed message is its key's head again, under its own id"
    );
    assert_eq!(
        scalar(
            &mut owner,
            "SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"
        ),
        3
    );
    // SET ROLE by hand in a session of the login role: the same.
    owner
        .batch_execute(&format!(
            "INSERT INTO postbox.dead_letters (id, topic, key, ordered, payload, headers, priority, attempts, max_attempts, created_at, reason)
             SELECT id, topic, key, ordered, payload, headers, priority, attempts, max_attempts, created_at, 'refused'
             FROM postbox.messages WHERE id = {first};
             DELETE FROM postbox.messages WHERE id = {first};
             SELECT postbox.promote_after(ARRAY['acct'], ARRAY['k'], ARRAY[{first}::bigint]);"
        ))
        .unwrap();
    let mut by_hand = PgConnection::establish(&as_role(&server, "jump", "postbox")).unwrap();
    by_hand
        .batch_execute(&format!(
            "SET ROLE postbox_operator;
             BEGIN;
             SET LOCAL postbox.keep_ids = on;
             INSERT INTO postbox.messages (id, topic, key, ordered, payload, headers, priority, max_attempts, created_at)
             OVERRIDING SYSTEM VALUE
             SELECT id, topic, key, ordered, payload, headers, priority, max_attempts, created_at
             FROM postbox.dead_letters WHERE id = {first};
             DELETE FROM postbox.dead_letters WHERE id = {first};
             COMMIT;"
        ))
        .unwrap();
    assert_eq!(
        scalar(
            &mut owner,
            &format!(
                "SELECT count(*) AS v FROM postbox.messages WHERE id = {first} AND state = 'available'"
            )
        ),
        1
    );
    assert_eq!(
        scalar(
            &mut owner,
            "SELECT count(*) AS v FROM postbox.messages WHERE state <> 'waiting'"
        ),
        1,
        "one head"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_delivers_and_keeps_retention_without_owning_the_schema() {
    let (server, db) = setup();
    postbox::enqueue_many(
        &mut db.conn(),
        &(0..20)
            .map(|i| {
                Message::new("orders")
                    .payload(&serde_json::json!({ "i": i }))
                    .key(format!("k{}", i % 3))
                    .ordered()
            })
            .collect::<Vec<_>>(),
    )
    .unwrap();
    // An hourly partition long expired, made by the owner: the relay's upkeep must drop it.
    db.exec(
        "CREATE TABLE postbox.completed_20200101_00 PARTITION OF postbox.completed
         FOR VALUES FROM ('2020-01-01 00:00+00') TO ('2020-01-01 01:00+00')",
    );
    let url = as_role(&server, "relayer", "postbox");
    let config = std::env::temp_dir().join(format!("postbox-roles-{}.toml", server.port));
    std::fs::write(&config, "[retention]\nkeep_completed = \"1h\"\n").unwrap();
    let out = postbox(
        &url,
        &["--config", config.to_str().unwrap(), "run", "--drain"],
    );
    let _ = std::fs::remove_file(&config);
    ok(&out);
    let mut owner = db.conn();
    assert_eq!(
        scalar(
            &mut owner,
            "SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"
        ),
        0
    );
    assert_eq!(
        scalar(&mut owner, "SELECT count(*) AS v FROM postbox.completed"),
        20
    );

    // The drain's upkeep dropped the expired partition through the function that runs as the
    // owner (the relay role cannot detach a partition of a table it does not own).
    let expired = "SELECT count(*) AS v FROM pg_class WHERE relname LIKE 'completed_2020%'";
    assert_eq!(scalar(&mut owner, expired), 0);
    // And the upkeep called as the library does it, as the relay role.
    db.exec(
        "CREATE TABLE postbox.completed_20200101_01 PARTITION OF postbox.completed
         FOR VALUES FROM ('2020-01-01 01:00+00') TO ('2020-01-01 02:00+00')",
    );
    let store = postbox::Store::connect(&url, 2).await.unwrap();
    let m = store
        .maintain_completed(std::time::Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(m.dropped, 1, "{m:?}");
    assert_eq!(scalar(&mut owner, expired), 0);

    let mut relay = PgConnection::establish(&url).unwrap();
    for sql in [
        "CREATE TABLE postbox.mine (id int)",
        "ALTER TABLE postbox.messages ADD COLUMN mine int",
        "DROP TABLE postbox.dead_letters",
        "DROP INDEX postbox.messages_available_idx",
        "CREATE OR REPLACE FUNCTION postbox.wake() RETURNS void LANGUAGE sql AS 'SELECT'",
        "SELECT * FROM postbox.grants",
        "TRUNCATE postbox.messages",
    ] {
        refused(&mut relay, sql);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_pauses_cancels_replays_and_purges_and_changes_no_schema() {
    let (server, db) = setup();
    let url = as_role(&server, "oncall", "postbox");
    postbox::enqueue_many(
        &mut db.conn(),
        &(0..6)
            .map(|i| {
                Message::new("acct")
                    .payload(&serde_json::json!({ "i": i }))
                    .key("a")
                    .ordered()
            })
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let mut owner = db.conn();
    let count = |owner: &mut PgConnection, sql: &str| scalar(owner, sql);

    ok(&postbox(&url, &["pause", "acct"]));
    assert_eq!(
        count(&mut owner, "SELECT count(*) AS v FROM postbox.pauses"),
        1
    );
    ok(&postbox(&url, &["status"]));
    ok(&postbox(&url, &["check"]));
    ok(&postbox(&url, &["cancel", "--topic", "acct"]));
    assert_eq!(
        count(
            &mut owner,
            "SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"
        ),
        0
    );
    assert_eq!(
        count(&mut owner, "SELECT count(*) AS v FROM postbox.dead_letters"),
        6
    );
    ok(&postbox(&url, &["dead", "list"]));
    let id = count(&mut owner, "SELECT min(id) AS v FROM postbox.dead_letters");
    ok(&postbox(&url, &["show", &id.to_string()]));
    ok(&postbox(&url, &["dead", "replay", "--id", &id.to_string()]));
    assert_eq!(
        count(
            &mut owner,
            "SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"
        ),
        1
    );
    ok(&postbox(&url, &["dead", "replay", "--topic", "acct"]));
    assert_eq!(
        count(
            &mut owner,
            "SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"
        ),
        6
    );
    assert_eq!(
        count(
            &mut owner,
            "SELECT count(*) AS v FROM postbox.messages WHERE state <> 'waiting'"
        ),
        1,
        "the replayed key has one head"
    );
    ok(&postbox(&url, &["cancel", "--topic", "acct"]));
    ok(&postbox(&url, &["dead", "purge", "--all"]));
    assert_eq!(
        count(&mut owner, "SELECT count(*) AS v FROM postbox.dead_letters"),
        0
    );
    ok(&postbox(&url, &["resume", "acct"]));
    assert_eq!(
        count(&mut owner, "SELECT count(*) AS v FROM postbox.pauses"),
        0
    );
    ok(&postbox(
        &url,
        &["enqueue", "--topic", "acct", "--payload", "{}"],
    ));
    assert_eq!(
        count(
            &mut owner,
            "SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"
        ),
        1
    );

    let mut operator = PgConnection::establish(&url).unwrap();
    for sql in [
        "CREATE TABLE postbox.mine (id int)",
        "ALTER TABLE postbox.messages ADD COLUMN mine int",
        "DROP TABLE postbox.pauses",
        "SELECT postbox.completed_partitions('1 hour')",
        "SELECT postbox.drop_expired_completed(now())",
        "DELETE FROM postbox.holds",
        "DELETE FROM postbox.completed",
        "SELECT * FROM postbox.grants",
    ] {
        refused(&mut operator, sql);
    }
}

/// What `postbox grant` recorded is given again by `postbox migrate` (to what later migrations
/// create), and `--revoke` takes everything back.
#[test]
fn migrate_grants_again_and_revoke_takes_everything_back() {
    let (server, db) = setup();
    let url = as_role(&server, "app", "postbox");
    // As if a later migration had made the table anew: its grants are gone.
    db.exec("REVOKE ALL ON postbox.messages FROM postbox_writer");
    let mut app = PgConnection::establish(&url).unwrap();
    refused(
        &mut app,
        "INSERT INTO postbox.messages (topic, payload) VALUES ('t', '{}')",
    );
    ok(&postbox(&db.url, &["migrate"]));
    app.batch_execute("INSERT INTO postbox.messages (topic, payload) VALUES ('t', '{}')")
        .unwrap();
    // The library's migrate too, as an app that migrates at start after an upgrade: the latest
    // migration's objects made anew get the recorded roles' rights.
    {
        use diesel_migrations::MigrationHarness;
        let mut owner = db.conn();
        postbox::Migrations::new(&mut owner)
            .revert_last_migration(postbox::MIGRATIONS)
            .unwrap();
        assert_eq!(postbox::migrate(&mut owner).unwrap().len(), 1);
    }
    assert_eq!(
        db.scalar(
            "SELECT count(*) AS v WHERE has_function_privilege('postbox_writer', 'postbox.complete_in_tx(bigint, bigint)', 'EXECUTE')
               AND has_table_privilege('postbox_relay', 'postbox.completed_in_tx', 'DELETE')"
        ),
        1,
        "granted again by postbox::migrate"
    );

    let text = ok(&postbox(&db.url, &["grant", "--revoke", "postbox_writer"]));
    assert!(text.contains("granted as: writer"), "{text}");
    refused(
        &mut app,
        "INSERT INTO postbox.messages (topic, payload) VALUES ('t', '{}')",
    );
    ok(&postbox(&db.url, &["migrate"]));
    refused(
        &mut app,
        "INSERT INTO postbox.messages (topic, payload) VALUES ('t', '{}')",
    );

    // Only the owner grants.
    let out = postbox(
        &as_role(&server, "oncall", "postbox"),
        &["grant", "--writer", "app"],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("owner of schema postbox"), "{err}");
}

/// `postbox migrate` as a role that may not create the schema names the privilege it lacks.
#[test]
fn migrate_names_the_privilege_it_lacks() {
    let server = OwnServer::start(&[]);
    let mut admin = PgConnection::establish(&server.url("postgres")).unwrap();
    admin.batch_execute("CREATE DATABASE app").unwrap();
    admin.batch_execute("CREATE ROLE deployer LOGIN").unwrap();
    let migrate = |role: &str| postbox(&as_role(&server, role, "app"), &["migrate"]);
    // postbox's bookkeeping is in schema postbox (not diesel's table in schema public, where
    // PostgreSQL 15 and later let only the database's owner create): CREATE on the database is
    // all the first migration needs.
    let out = migrate("deployer");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("CREATE on database app"), "{err}");
    assert!(!err.contains("schema public"), "{err}");
    admin
        .batch_execute("GRANT CREATE ON DATABASE app TO deployer")
        .unwrap();
    ok(&migrate("deployer"));

    // Another role (an app's writer migrating at start) with nothing pending: nothing to do.
    admin.batch_execute("CREATE ROLE app_writer LOGIN").unwrap();
    ok(&postbox(
        &as_role(&server, "deployer", "app"),
        &["grant", "--writer", "app_writer"],
    ));
    let text = ok(&migrate("app_writer"));
    assert!(text.contains("none (up to date)"), "{text}");
    // With one pending: it says whose job it is, and nothing changed.
    let mut deployer = PgConnection::establish(&as_role(&server, "deployer", "app")).unwrap();
    {
        use diesel_migrations::MigrationHarness;
        postbox::Migrations::new(&mut deployer)
            .revert_last_migration(postbox::MIGRATIONS)
            .unwrap();
    }
    let out = migrate("app_writer");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("1 migration(s) pending")
            && err.contains("the role that owns schema postbox, deployer"),
        "{err}"
    );
    ok(&migrate("deployer"));
    ok(&migrate("app_writer"));
}

/// Every table of the schema has a decision for each role, and the SQL `--sql` prints is the SQL
/// `postbox grant` runs.
#[test]
fn every_table_is_in_the_grant_list_and_the_printed_sql_is_the_run_sql() {
    let db = TestDb::migrated();
    #[derive(diesel::QueryableByName)]
    struct T {
        #[diesel(sql_type = diesel::sql_types::Text)]
        t: String,
    }
    let mut tables: Vec<String> = diesel::sql_query(
        "SELECT c.relname::text AS t FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'postbox' AND c.relkind IN ('r', 'p') AND NOT c.relispartition
         ORDER BY 1",
    )
    .load::<T>(&mut db.conn())
    .unwrap()
    .into_iter()
    .map(|t| t.t)
    .collect();
    tables.sort();
    let mut listed: Vec<String> = TABLES.iter().map(|t| t.table.to_owned()).collect();
    listed.sort();
    assert_eq!(
        tables, listed,
        "src/store/grant.rs TABLES must name every table"
    );

    let out = postbox(&db.url, &["grant", "--sql", "--writer", "app"]);
    let text = ok(&out);
    for s in grant_sql(RoleKind::Writer, "app") {
        assert!(text.contains(&format!("{s};")), "{s} not in:\n{text}");
    }
    // Printing changes nothing.
    assert_eq!(db.scalar("SELECT count(*) AS v FROM postbox.grants"), 0);
}

/// A stream relay records its slot's confirmation limit before it confirms (a slot created again
/// by hand is told apart by it): a relay role without UPDATE on `postbox.stream_slots` does not
/// stream, and says which privilege it lacks, rather than confirm unguarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_relay_streams_as_the_relay_role_and_names_the_privilege_it_lacks() {
    let (server, db) = setup();
    db.store()
        .await
        .stream_setup("postbox", "postbox_stream")
        .await
        .unwrap();
    db.exec("ALTER ROLE relayer REPLICATION");
    let url = as_role(&server, "relayer", "postbox");
    let relay = common::relay::Relay::start(&url, "");
    postbox::publish(
        &mut db.conn(),
        &Message::new("events").payload(&serde_json::json!({"e": 1})),
    )
    .unwrap();
    assert!(
        relay.wait_lines(1, std::time::Duration::from_secs(30)),
        "{}",
        relay.log()
    );
    drop(relay);
    db.exec("REVOKE UPDATE ON postbox.stream_slots FROM postbox_relay");
    let relay = common::relay::Relay::start(&url, "");
    assert!(
        common::relay::wait(std::time::Duration::from_secs(20), || relay
            .log()
            .contains("GRANT UPDATE ON postbox.stream_slots")),
        "{}",
        relay.log()
    );
    postbox::publish(
        &mut db.conn(),
        &Message::new("events").payload(&serde_json::json!({"e": 2})),
    )
    .unwrap();
    assert!(relay.lines().is_empty(), "{:?}", relay.lines());
    drop(relay);
    // `stream setup` as the relay role, where the publication must be created: the privilege
    // is named.
    db.exec("DROP PUBLICATION postbox_stream");
    let out = hermetic(env!("CARGO_BIN_EXE_postbox"))
        .args(["stream", "setup"])
        .env("POSTBOX_DATABASE_URL", &url)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("GRANT CREATE ON DATABASE postbox"),
        "{err}"
    );
}

/// An embedded engine needs the relay's rights: built on the app's writer role it fails at once,
/// naming what the role lacks (it used to build, then retry for ever at WARN); on the relay role
/// it builds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_on_the_writer_role_fails_to_build_naming_the_missing_privileges() {
    let (server, _db) = setup();
    let handlers = || {
        postbox::sink::handlers::Handlers::new().on(
            "t",
            |_job: postbox::sink::handlers::Job<serde_json::Value>| async move { Ok(()) },
        )
    };
    let e = match postbox::engine::Engine::builder(as_role(&server, "app", "postbox"))
        .handlers(handlers())
        .build()
        .await
    {
        Ok(_) => panic!("an engine on the writer role was built"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("database_url")
            && e.contains("UPDATE on postbox.messages")
            && e.contains("of the relay's rights")
            && e.contains("postbox grant --relay ROLE"),
        "{e}"
    );
    assert!(
        postbox::engine::Engine::builder(as_role(&server, "relayer", "postbox"))
            .handlers(handlers())
            .build()
            .await
            .is_ok()
    );
}
