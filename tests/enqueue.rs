//! Enqueue from diesel transactions (sync and async), the SQL contract, dedup, bad input.
//! DESIGN §2 promise 1 (atomic with the business write) and the enqueue API of issue "Core".

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::TestDb;
use diesel::connection::{Instrumentation, InstrumentationEvent, SimpleConnection};
use diesel::{Connection, RunQueryDsl};
use diesel_async::AsyncConnection;
use postbox::{Enqueued, InvalidMessage, Message, Topics};

/// Messages that exist: in the queue, or in the intake until a relay moves them.
fn count(db: &TestDb) -> i64 {
    db.scalar(
        "SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v",
    )
}

fn business_table(db: &TestDb) {
    db.exec("CREATE TABLE orders (id bigint PRIMARY KEY, total int NOT NULL)");
}

#[test]
fn sync_rollback_leaves_no_message_and_commit_keeps_both() {
    let db = TestDb::migrated();
    business_table(&db);
    let mut conn = db.conn();
    let r: Result<(), postbox::Error> = conn.transaction(|conn| {
        conn.batch_execute("INSERT INTO orders VALUES (1, 10)")?;
        postbox::enqueue(conn, &Message::new("order.created").payload(&1))?;
        Err(postbox::Error::Database(
            diesel::result::Error::RollbackTransaction,
        ))
    });
    assert!(r.is_err());
    assert_eq!(count(&db), 0);
    assert_eq!(db.scalar("SELECT count(*) AS v FROM orders"), 0);

    conn.transaction(|conn| {
        conn.batch_execute("INSERT INTO orders VALUES (1, 10)")?;
        postbox::enqueue(conn, &Message::new("order.created").payload(&1))
    })
    .unwrap();
    assert_eq!(count(&db), 1);
    assert_eq!(db.scalar("SELECT count(*) AS v FROM orders"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_rollback_leaves_no_message_and_commit_keeps_both() {
    let db = TestDb::migrated();
    business_table(&db);
    let mut conn = db.aconn().await;
    let r = conn
        .transaction(async |conn| {
            use diesel_async::SimpleAsyncConnection;
            conn.batch_execute("INSERT INTO orders VALUES (1, 10)")
                .await?;
            postbox::enqueue_async(conn, &Message::new("order.created").payload(&1)).await?;
            Err::<(), _>(postbox::Error::Database(
                diesel::result::Error::RollbackTransaction,
            ))
        })
        .await;
    assert!(r.is_err());
    assert_eq!(count(&db), 0);
    let ids = conn
        .transaction(async |conn| {
            use diesel_async::SimpleAsyncConnection;
            conn.batch_execute("INSERT INTO orders VALUES (1, 10)")
                .await?;
            let msgs: Vec<Message> = (0..3)
                .map(|i| Message::new("order.created").payload(&i))
                .collect();
            postbox::enqueue_many_async(conn, &msgs).await
        })
        .await
        .unwrap();
    assert_eq!(ids.len(), 3);
    assert!(ids.iter().all(|e| matches!(e, Enqueued::New(_))));
    assert_eq!(count(&db), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncommitted_message_is_invisible_to_claim() {
    let db = TestDb::migrated();
    let store = db.store().await;
    let mut writer = db.conn();
    writer.batch_execute("BEGIN").unwrap();
    postbox::enqueue(&mut writer, &Message::new("t").payload(&1)).unwrap();
    let claimed = store
        .claim(10, Duration::from_secs(30), &Topics::all())
        .await
        .unwrap();
    assert!(claimed.is_empty(), "claimed an uncommitted message");
    writer.batch_execute("COMMIT").unwrap();
    let claimed = store
        .claim(10, Duration::from_secs(30), &Topics::all())
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
}

#[test]
fn builder_fields_reach_the_row() {
    let db = TestDb::migrated();
    let mut conn = db.conn();
    let at = chrono::Utc::now() + chrono::Duration::hours(1);
    let id = postbox::enqueue(
        &mut conn,
        &Message::new("invoice.due")
            .payload(&serde_json::json!({"n": 5}))
            .key("cust-1")
            .ordered()
            .header("trace", "abc")
            .priority(-3)
            .run_at(at)
            .max_attempts(4)
            .dedup_key("inv-5"),
    )
    .unwrap()
    .id()
    .unwrap();
    let ok = db.scalar(&format!(
        "SELECT count(*) AS v FROM postbox.messages WHERE id = {id} AND topic = 'invoice.due'
         AND key = 'cust-1' AND ordered AND payload = '{{\"n\": 5}}' AND headers = '{{\"trace\": \"abc\"}}'
         AND priority = -3 AND abs(extract(epoch FROM run_at - '{}'::timestamptz)) < 0.001
         AND max_attempts = 4 AND dedup_key = 'inv-5' AND attempts = 0 AND locked_until IS NULL",
        at.to_rfc3339()
    ));
    assert_eq!(ok, 1);

    // The same through the many-rows statement (unnested arrays), next to a plain message.
    let out = postbox::enqueue_many(
        &mut conn,
        &[
            Message::new("invoice.due")
                .payload(&serde_json::json!({"n": 5}))
                .key("cust-1")
                .ordered()
                .header("trace", "abc")
                .priority(-3)
                .run_at(at)
                .max_attempts(4)
                .dedup_key("inv-6"),
            Message::new("plain"),
        ],
    )
    .unwrap();
    let (full, plain) = (out[0].id().unwrap(), out[1].id().unwrap());
    // Whatever went to the intake (with its routing on), moved: every field is the message's.
    common::move_intake(&db);
    let ok = db.scalar(&format!(
        "SELECT count(*) AS v FROM postbox.messages WHERE id = {full} AND topic = 'invoice.due'
         AND key = 'cust-1' AND ordered AND payload = '{{\"n\": 5}}' AND headers = '{{\"trace\": \"abc\"}}'
         AND priority = -3 AND abs(extract(epoch FROM run_at - '{}'::timestamptz)) < 0.001
         AND max_attempts = 4 AND dedup_key = 'inv-6' AND state = 'waiting'",
        at.to_rfc3339()
    ));
    assert_eq!(ok, 1, "behind the first message of its key");
    let ok = db.scalar(&format!(
        "SELECT count(*) AS v FROM postbox.messages WHERE id = {plain} AND key IS NULL AND NOT ordered
         AND payload = '{{}}' AND headers = '{{}}' AND priority = 0 AND run_at <= now()
         AND max_attempts = 25 AND dedup_key IS NULL AND state = 'available'"
    ));
    assert_eq!(ok, 1);

    let id = postbox::enqueue(
        &mut conn,
        &Message::new("later").delay(Duration::from_secs(3600)),
    )
    .unwrap()
    .id()
    .unwrap();
    common::move_intake(&db);
    let delayed = db.scalar(&format!(
        "SELECT count(*) AS v FROM postbox.messages WHERE id = {id} AND run_at > now() + interval '59 minutes'
         AND state = 'scheduled'"
    ));
    assert_eq!(delayed, 1);
}

#[test]
fn plain_sql_insert_is_a_valid_enqueue() {
    let db = TestDb::migrated();
    db.exec(r#"INSERT INTO postbox.messages (topic, payload) VALUES ('from.sql', '{"a": 1}')"#);
    let defaults = db.scalar(
        "SELECT count(*) AS v FROM postbox.messages WHERE topic = 'from.sql' AND key IS NULL
         AND NOT ordered AND headers = '{}' AND priority = 0 AND run_at <= now() AND attempts = 0
         AND max_attempts = 25 AND locked_until IS NULL AND lease_token IS NULL
         AND created_at <= now() AND dedup_key IS NULL AND id > 0",
    );
    assert_eq!(defaults, 1);
    // The contract columns, written by name.
    db.exec(
        r#"INSERT INTO postbox.messages (topic, key, payload, headers, priority, run_at)
           VALUES ('from.sql', 'k', '[1]', '{"h": "v"}', 2, now())"#,
    );
    assert_eq!(count(&db), 2);
    // The table refuses what Rust would refuse.
    let mut conn = db.conn();
    for bad in [
        r#"INSERT INTO postbox.messages (topic, headers) VALUES ('t', '{"h": 1}')"#,
        r#"INSERT INTO postbox.messages (topic, headers) VALUES ('t', '[]')"#,
        r#"INSERT INTO postbox.messages (topic) VALUES ('')"#,
        r#"INSERT INTO postbox.messages (topic, ordered) VALUES ('t', true)"#,
    ] {
        assert!(conn.batch_execute(bad).is_err(), "accepted: {bad}");
    }
    assert_eq!(count(&db), 2);
}

#[test]
fn bad_input_is_rejected_before_sql_and_writes_nothing() {
    let db = TestDb::migrated();
    let mut conn = db.conn();
    let statements = Arc::new(AtomicUsize::new(0));
    conn.set_instrumentation(Counter(statements.clone()));
    type Expect = fn(&InvalidMessage) -> bool;
    let cases: Vec<(Message, Expect)> = vec![
        (Message::new(""), |e| {
            matches!(e, InvalidMessage::EmptyTopic)
        }),
        (Message::new("x".repeat(256)), |e| {
            matches!(e, InvalidMessage::TopicTooLong { len: 256, .. })
        }),
        (
            Message::new("t").headers_json(serde_json::json!({"a": 1})),
            |e| matches!(e, InvalidMessage::BadHeaders(_)),
        ),
        (
            Message::new("t").payload(&"x".repeat(postbox::MAX_PAYLOAD_BYTES + 1)),
            |e| matches!(e, InvalidMessage::PayloadTooLarge { .. }),
        ),
        (Message::new("t").ordered(), |e| {
            matches!(e, InvalidMessage::OrderedWithoutKey)
        }),
    ];
    for (msg, expected) in cases {
        // A bad message anywhere in a batch refuses the whole batch.
        let batch = vec![Message::new("ok"), msg];
        match postbox::enqueue_many(&mut conn, &batch) {
            Err(postbox::Error::InvalidMessage(e)) => assert!(expected(&e), "wrong error: {e}"),
            other => panic!("expected InvalidMessage, got {other:?}"),
        }
    }
    assert_eq!(
        statements.load(Ordering::SeqCst),
        0,
        "SQL ran for invalid input"
    );
    assert_eq!(count(&db), 0);
}

struct Counter(Arc<AtomicUsize>);
impl Instrumentation for Counter {
    fn on_connection_event(&mut self, event: InstrumentationEvent<'_>) {
        if let InstrumentationEvent::StartQuery { .. } = event {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[test]
fn a_single_enqueue_is_a_cached_prepared_statement() {
    struct Cached(Arc<AtomicUsize>, Arc<AtomicUsize>);
    impl Instrumentation for Cached {
        fn on_connection_event(&mut self, event: InstrumentationEvent<'_>) {
            match event {
                InstrumentationEvent::CacheQuery { .. } => {
                    self.0.fetch_add(1, Ordering::SeqCst);
                }
                InstrumentationEvent::StartQuery { .. } => {
                    self.1.fetch_add(1, Ordering::SeqCst);
                }
                _ => {}
            }
        }
    }
    let db = TestDb::migrated();
    let mut conn = db.conn();
    let (cached, started) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    conn.set_instrumentation(Cached(cached.clone(), started.clone()));
    for i in 0..5 {
        let m = Message::new("t").payload(&i);
        let m = if i % 2 == 0 {
            m.delay(Duration::from_secs(1))
        } else {
            m.key("k")
        };
        postbox::enqueue(&mut conn, &m).unwrap();
    }
    assert_eq!(started.load(Ordering::SeqCst), 5);
    assert_eq!(
        cached.load(Ordering::SeqCst),
        1,
        "each enqueue was prepared anew"
    );
}

#[test]
fn enqueue_many_of_1000_is_one_round_trip() {
    let db = TestDb::migrated();
    let mut conn = db.conn();
    let statements = Arc::new(AtomicUsize::new(0));
    conn.set_instrumentation(Counter(statements.clone()));
    let msgs: Vec<Message> = (0..1000)
        .map(|i| Message::new("bulk").payload(&i).key(format!("k{i}")))
        .collect();
    let out = postbox::enqueue_many(&mut conn, &msgs).unwrap();
    assert_eq!(statements.load(Ordering::SeqCst), 1);
    assert_eq!(out.len(), 1000);
    // Ids come back in input order and match the rows.
    let ids: Vec<i64> = out.iter().map(|e| e.id().unwrap()).collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]));
    common::move_intake(&db);
    let matching = db.scalar(&format!(
        "SELECT count(*) AS v FROM postbox.messages WHERE id = {} AND payload = '999' AND key = 'k999'",
        ids[999]
    ));
    assert_eq!(matching, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_key_is_a_no_op_that_names_the_live_message() {
    let db = TestDb::migrated();
    let mut conn = db.conn();
    let first =
        postbox::enqueue(&mut conn, &Message::new("t").dedup_key("d1").payload(&1)).unwrap();
    let Enqueued::New(first_id) = first else {
        panic!("{first:?}")
    };
    // Same key, same topic: no-op that names the first. Other topic: independent.
    let out = postbox::enqueue_many(
        &mut conn,
        &[
            Message::new("t").dedup_key("d1").payload(&2),
            Message::new("t").payload(&3),
            Message::new("t").dedup_key("d2").payload(&4),
            Message::new("t").dedup_key("d2").payload(&5),
            Message::new("other").dedup_key("d1").payload(&6),
        ],
    )
    .unwrap();
    assert_eq!(
        out[0],
        Enqueued::Duplicate {
            existing: Some(first_id)
        }
    );
    assert!(matches!(out[1], Enqueued::New(_)));
    let Enqueued::New(d2) = out[2] else {
        panic!("{:?}", out[2])
    };
    assert_eq!(out[3], Enqueued::Duplicate { existing: Some(d2) });
    assert!(matches!(out[4], Enqueued::New(_)));
    assert_eq!(count(&db), 4);
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE payload = '2'"),
        0
    );

    // Once the first is delivered, the key is free again.
    let store = db.store().await;
    let claimed = store
        .claim(10, Duration::from_secs(30), &Topics::only(["t"]))
        .await
        .unwrap();
    let lease = claimed.iter().find(|m| m.id == first_id).unwrap().lease();
    store.complete(&[lease]).await.unwrap();
    let again = postbox::enqueue(&mut conn, &Message::new("t").dedup_key("d1")).unwrap();
    assert!(matches!(again, Enqueued::New(id) if id != first_id));
}

/// How many migrations there are (each is a directory of migrations/).
fn migrations() -> usize {
    std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"))
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().is_dir())
        .count()
}

#[test]
fn migrations_run_sync_are_idempotent_and_revert() {
    use diesel_migrations::MigrationHarness;
    let db = TestDb::empty();
    let mut conn = db.conn();
    assert_eq!(postbox::migrate(&mut conn).unwrap().len(), migrations());
    assert!(postbox::migrate(&mut conn).unwrap().is_empty());
    postbox::Migrations::new(&mut conn)
        .revert_all_migrations(postbox::MIGRATIONS)
        .unwrap();
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM pg_namespace WHERE nspname = 'postbox'"),
        0,
        "down.sql left the schema behind"
    );
    assert_eq!(postbox::migrate(&mut conn).unwrap().len(), migrations());
    db.exec("INSERT INTO postbox.messages (topic) VALUES ('t')");
}

/// postbox keeps its own bookkeeping (`postbox.schema_migrations`) and never the app's: on a
/// database an earlier release migrated into the app's `__diesel_schema_migrations`, between app
/// migrations before and after postbox's, `migrate` moves postbox's records out; the app's
/// migration of the same version as one of postbox's (which diesel skipped) then runs, and the
/// app's harness reverts all of its own, which stopped at postbox's latest version before.
#[test]
fn postbox_keeps_its_migrations_apart_from_the_apps() {
    use diesel_migrations::{FileBasedMigrations, MigrationHarness};
    let app = || {
        FileBasedMigrations::from_path(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/app_migrations"))
            .unwrap()
    };
    let table = |db: &TestDb, name: &str| {
        db.scalar(&format!(
            "SELECT count(*) AS v FROM pg_tables WHERE schemaname = 'public' AND tablename = '{name}'"
        ))
    };
    let db = TestDb::empty();
    let mut conn = db.conn();
    // As an app did with the earlier release: its first migration, postbox's in its own table,
    // then the rest of its own.
    conn.run_next_migration(app()).unwrap();
    conn.run_pending_migrations(postbox::MIGRATIONS).unwrap();
    conn.run_pending_migrations(app()).unwrap();
    assert_eq!(table(&db, "app_after"), 1);
    assert_eq!(
        table(&db, "app_same_version"),
        0,
        "diesel skipped the app's migration of postbox's version"
    );
    let stuck = conn
        .revert_last_migration(app())
        .and_then(|_| conn.revert_last_migration(app()));
    assert!(
        stuck
            .unwrap_err()
            .to_string()
            .contains("Unable to find migration version"),
        "the app's revert stops at postbox's version"
    );
    conn.run_pending_migrations(app()).unwrap();

    // This release: nothing pending, the records moved.
    assert!(postbox::migrate(&mut conn).unwrap().is_empty());
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.schema_migrations"),
        migrations() as i64
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM __diesel_schema_migrations"),
        2,
        "the app's own two records stay, postbox's left"
    );
    conn.run_pending_migrations(app()).unwrap();
    assert_eq!(
        table(&db, "app_same_version"),
        1,
        "the app's skipped migration ran"
    );
    conn.revert_all_migrations(app()).unwrap();
    for t in ["app_before", "app_same_version", "app_after"] {
        assert_eq!(table(&db, t), 0, "{t} reverted");
    }
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM __diesel_schema_migrations"),
        0
    );
    // postbox is untouched by it, still migrated, and migrates on a database of its own too.
    assert!(postbox::migrate(&mut conn).unwrap().is_empty());
    db.exec("INSERT INTO postbox.messages (topic) VALUES ('t')");
    let fresh = TestDb::empty();
    assert_eq!(
        postbox::migrate(&mut fresh.conn()).unwrap().len(),
        migrations()
    );
    assert_eq!(
        fresh.scalar(
            "SELECT count(*) AS v FROM pg_tables WHERE tablename = '__diesel_schema_migrations'"
        ),
        0,
        "postbox created no table of diesel's"
    );
}

/// diesel's harness runs on a blocking thread: a current-thread runtime (as `#[tokio::main(flavor =
/// "current_thread")]` apps have) migrates as well.
#[tokio::test]
async fn async_migrations_run_on_a_current_thread_runtime() {
    let db = TestDb::empty();
    let (applied, _) = postbox::migrate_async(db.aconn().await).await.unwrap();
    assert_eq!(applied.len(), migrations());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_run_async_and_agree_with_sync_bookkeeping() {
    let db = TestDb::empty();
    let conn = db.aconn().await;
    let (applied, conn) = postbox::migrate_async(conn).await.unwrap();
    assert_eq!(applied.len(), migrations());
    let (again, mut conn) = postbox::migrate_async(conn).await.unwrap();
    assert!(again.is_empty());
    // The sync runner (and diesel CLI) see them as applied.
    assert!(postbox::migrate(&mut db.conn()).unwrap().is_empty());
    postbox::enqueue_async(&mut conn, &Message::new("t"))
        .await
        .unwrap();
    assert_eq!(count(&db), 1);
}

/// An app with a bb8 pool migrates through it: the pool's settings, no pooled connection taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_run_through_the_apps_pool_and_leave_it_as_it_was() {
    use diesel_async::AsyncPgConnection;
    use diesel_async::pooled_connection::AsyncDieselConnectionManager;
    let db = TestDb::empty();
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(&db.url);
    let pool = bb8::Pool::builder()
        .max_size(1)
        .build(manager)
        .await
        .unwrap();
    // The app holds its only pooled connection meanwhile.
    let mut held = pool.get().await.unwrap();
    assert_eq!(
        postbox::migrate_pool(&pool).await.unwrap().len(),
        migrations()
    );
    assert!(postbox::migrate_pool(&pool).await.unwrap().is_empty());
    postbox::enqueue_async(&mut held, &Message::new("t"))
        .await
        .unwrap();
    drop(held);
    assert_eq!(pool.state().connections, 1);
    assert_eq!(count(&db), 1);
}

#[test]
fn concurrent_migrations_take_turns() {
    let db = TestDb::empty();
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let url = db.url.clone();
            std::thread::spawn(move || {
                let mut c = diesel::PgConnection::establish(&url).unwrap();
                postbox::migrate(&mut c).unwrap().len()
            })
        })
        .collect();
    let applied: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert_eq!(applied, migrations());
    let _ = diesel::sql_query("SELECT 1")
        .execute(&mut db.conn())
        .unwrap();
}

/// An app whose transaction closures return diesel's `QueryResult` uses `?` on postbox's calls:
/// the message commits with the business row; an invalid message rolls both back and stays
/// readable as what it was.
#[test]
fn enqueue_in_a_transaction_returning_query_result() {
    let db = TestDb::migrated();
    business_table(&db);
    let mut conn = db.conn();
    conn.transaction(|conn| -> diesel::QueryResult<()> {
        conn.batch_execute("INSERT INTO orders VALUES (1, 10)")?;
        postbox::enqueue(conn, &Message::new("order.created").payload(&1))?;
        Ok(())
    })
    .unwrap();
    assert_eq!(count(&db), 1);
    let e = conn
        .transaction(|conn| -> diesel::QueryResult<()> {
            conn.batch_execute("INSERT INTO orders VALUES (2, 20)")?;
            postbox::enqueue(conn, &Message::new(""))?;
            Ok(())
        })
        .unwrap_err();
    assert!(e.to_string().contains("topic: must not be empty"), "{e}");
    assert_eq!(count(&db), 1);
    assert_eq!(db.scalar("SELECT count(*) AS v FROM orders"), 1);
}

/// A database error says what the database said once, in `{}` and in an error chain alike.
#[test]
fn a_database_error_says_its_text_once() {
    let db = TestDb::migrated();
    // The table each kind goes to: the queue (ordered), the intake (unordered).
    db.exec("ALTER TABLE postbox.messages RENAME TO gone; ALTER TABLE postbox.intake RENAME TO gone_too");
    for m in [Message::new("t").key("k").ordered(), Message::new("t")] {
        let e = postbox::enqueue(&mut db.conn(), &m).unwrap_err();
        assert!(matches!(e, postbox::Error::Database(_)), "{e:?}");
        let chain = format!("{:#}", anyhow::Error::from(e));
        assert_eq!(chain.matches("does not exist").count(), 1, "{chain}");
        assert!(chain.starts_with("database: "), "{chain}");
    }
}

/// A batch of one ordered key whose unordered dedup row comes first must take the key's writer
/// lock before it inserts anything: otherwise it holds its dedup key while it waits for the key,
/// and a writer of that key that then enqueues the same dedup key waits for it — a deadlock the
/// sorted `lock_keys` never had (found by a review with two psql sessions).
#[test]
fn a_dedup_row_before_a_single_ordered_key_takes_the_key_lock_first() {
    let db = TestDb::migrated();
    // The writer of the key: its ordered message holds the key's writer lock until it commits.
    let mut holder = db.conn();
    holder.batch_execute("BEGIN").unwrap();
    let head = postbox::enqueue(&mut holder, &Message::new("acct").key("m").ordered())
        .unwrap()
        .id()
        .unwrap();
    // The batch: an unordered message with a dedup key, then one of the ordered key.
    let url = db.url.clone();
    let batch = std::thread::spawn(move || {
        let mut c = diesel::PgConnection::establish(&url).unwrap();
        c.transaction(|c| {
            postbox::enqueue_many(
                c,
                &[
                    Message::new("mail").dedup_key("y"),
                    Message::new("acct").key("m").ordered(),
                ],
            )
        })
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while db
        .scalar("SELECT count(*) AS v FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
        == 0
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the batch never waited for the key"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The batch waits for the key and holds nothing the holder needs: its dedup key is free.
    let mine = postbox::enqueue(&mut holder, &Message::new("mail").dedup_key("y"))
        .expect("no deadlock: the batch holds no dedup key while it waits for the ordered key");
    assert!(matches!(mine, Enqueued::New(_)), "{mine:?}");
    holder.batch_execute("COMMIT").unwrap();
    let got = batch
        .join()
        .unwrap()
        .expect("the batch commits after the holder");
    assert!(matches!(got[0], Enqueued::Duplicate { .. }), "{got:?}");
    let behind = got[1].id().unwrap();
    assert!(
        head < behind,
        "ids {head} and {behind} are not in commit order"
    );
    assert_eq!(
        db.text(&format!(
            "SELECT state::text AS v FROM postbox.messages WHERE id = {behind}"
        )),
        "waiting"
    );
}
