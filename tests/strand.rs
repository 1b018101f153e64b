//! Ordered keys never strand, against a real PostgreSQL: each race that once left a key with
//! waiting messages and no head (nothing would ever take them again) is driven here with two
//! connections, one held at the worst point by a lock the test owns; after each, the key goes on
//! and `Store::check` finds nothing wrong.

mod common;

use std::time::Duration;

use common::{TestDb, enqueue, eventually};
use diesel::PgConnection;
use diesel::connection::SimpleConnection;
use postbox::store::{CancelSelector, DeadSelector, Limit};
use postbox::{Message, Store, Topics};

const LEASE: Duration = Duration::from_secs(30);
const GATE: i64 = 4242;

fn ord(key: &str) -> Message {
    Message::new("t").key(key).ordered()
}

fn topics() -> Topics {
    Topics::exact(["t"])
}

/// Holds every transaction that reaches `event` on `table` (an AFTER … FOR EACH STATEMENT
/// trigger waits for an advisory lock the test holds) until `open`.
struct Gate {
    conn: PgConnection,
}

impl Gate {
    fn on(db: &TestDb, table: &str, event: &str) -> Gate {
        db.exec(&format!(
            "CREATE OR REPLACE FUNCTION public.test_gate() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN PERFORM pg_advisory_xact_lock_shared({GATE}); RETURN NULL; END $$;
             CREATE TRIGGER test_gate AFTER {event} ON {table}
             FOR EACH STATEMENT EXECUTE FUNCTION public.test_gate();"
        ));
        let mut conn = db.conn();
        conn.batch_execute(&format!("SELECT pg_advisory_lock({GATE})"))
            .unwrap();
        Gate { conn }
    }

    fn open(mut self) {
        self.conn
            .batch_execute(&format!("SELECT pg_advisory_unlock({GATE})"))
            .unwrap();
    }
}

/// Waits until `n` sessions of the test's database wait for a lock of this kind (`advisory`, or
/// `row` for a row's transaction or tuple lock).
async fn blocked(db: &TestDb, kind: &str, n: i64) {
    let filter = match kind {
        "advisory" => "wait_event = 'advisory'",
        _ => "wait_event IN ('transactionid', 'tuple')",
    };
    let sql = format!(
        "SELECT count(*) AS v FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock' AND {filter}"
    );
    assert!(
        eventually(Duration::from_secs(20), || async { db.scalar(&sql) >= n }).await,
        "{n} sessions never waited for a {kind} lock"
    );
}

async fn assert_clean(store: &Store) {
    let found = store.check(100).await.unwrap();
    assert!(found.is_empty(), "{found:?}");
}

async fn claim_ids(store: &Store) -> Vec<i64> {
    let mut ids: Vec<i64> = store
        .claim(10, LEASE, &topics())
        .await
        .unwrap()
        .iter()
        .map(|m| m.id)
        .collect();
    ids.sort_unstable();
    ids
}

/// Claims the key's head, expects `want`, completes it.
async fn deliver(store: &Store, want: i64) {
    let got = store.claim(10, LEASE, &topics()).await.unwrap();
    assert_eq!(got.iter().map(|m| m.id).collect::<Vec<_>>(), [want]);
    store.complete(&[got[0].lease()]).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_racing_the_heads_settle_leaves_the_key_its_next_message() {
    let db = TestDb::migrated();
    let store = db.store().await;
    let ids = enqueue(&db, vec![ord("k"), ord("k"), ord("k")]);
    let (a, b, c) = (ids[0], ids[1], ids[2]);
    let head = store.claim(10, LEASE, &topics()).await.unwrap();
    assert_eq!(head[0].id, a);

    // The cancel has deleted B and waits before its commit; the head's settle then waits for
    // B's row; B goes, the settle must promote C.
    let gate = Gate::on(&db, "postbox.dead_letters", "INSERT");
    let s = store.clone();
    let cancel = tokio::spawn(async move { s.cancel(&CancelSelector::Ids(vec![b])).await });
    blocked(&db, "advisory", 1).await;
    let s = store.clone();
    let lease = head[0].lease();
    let complete = tokio::spawn(async move { s.complete(&[lease]).await });
    blocked(&db, "row", 1).await;
    gate.open();
    assert_eq!(cancel.await.unwrap().unwrap().dead, 1);
    assert_eq!(complete.await.unwrap().unwrap().done, [a]);

    assert_clean(&store).await;
    deliver(&store, c).await;
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_delete_of_a_waiting_message_racing_the_heads_settle_strands_nothing() {
    let db = TestDb::migrated();
    let store = db.store().await;
    let ids = enqueue(&db, vec![ord("k"), ord("k"), ord("k")]);
    let head = store.claim(10, LEASE, &topics()).await.unwrap();
    assert_eq!(head[0].id, ids[0]);

    let mut operator = db.conn();
    operator
        .batch_execute(&format!(
            "BEGIN; DELETE FROM postbox.messages WHERE id = {}",
            ids[1]
        ))
        .unwrap();
    let s = store.clone();
    let lease = head[0].lease();
    let complete = tokio::spawn(async move { s.complete(&[lease]).await });
    blocked(&db, "row", 1).await;
    operator.batch_execute("COMMIT").unwrap();
    complete.await.unwrap().unwrap();

    assert_clean(&store).await;
    deliver(&store, ids[2]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_that_loses_its_dedup_key_changes_nothing() {
    let db = TestDb::migrated();
    let store = db.store().await;
    // Same key: M1 (d1) is cancelled; M2 takes d1 again and is the head; M3 waits behind it.
    let m1 = enqueue(&db, vec![ord("k").dedup_key("d1")])[0];
    store.cancel(&CancelSelector::Ids(vec![m1])).await.unwrap();
    let m2 = enqueue(&db, vec![ord("k").dedup_key("d1")])[0];
    let m3 = enqueue(&db, vec![ord("k")])[0];
    // Another key: N1 (d2) is cancelled, d2 is taken by a message of key j, and key n goes on
    // with N2.
    let n1 = enqueue(&db, vec![ord("n").dedup_key("d2")])[0];
    store.cancel(&CancelSelector::Ids(vec![n1])).await.unwrap();
    let j = enqueue(&db, vec![ord("j").dedup_key("d2")])[0];
    let n2 = enqueue(&db, vec![ord("n")])[0];

    let report = store
        .dead_replay(&DeadSelector::Topic("t".into()))
        .await
        .unwrap();
    assert!(report.replayed.is_empty(), "{report:?}");
    assert_eq!(report.skipped.len(), 2, "{report:?}");

    assert_clean(&store).await;
    let mut heads = vec![m2, j, n2];
    heads.sort_unstable();
    let got = store.claim(10, LEASE, &topics()).await.unwrap();
    let mut got_ids: Vec<i64> = got.iter().map(|m| m.id).collect();
    got_ids.sort_unstable();
    assert_eq!(got_ids, heads);
    let more = store.claim(10, LEASE, &topics()).await.unwrap();
    assert!(more.is_empty(), "one head per key: {more:?}");
    let m2_lease = got.iter().find(|m| m.id == m2).unwrap().lease();
    store.complete(&[m2_lease]).await.unwrap();
    assert_eq!(claim_ids(&store).await, [m3]);
    assert_clean(&store).await;
}

/// A running, X cancelled into the dead letters, B waiting. The replay of X goes in (waiting
/// behind A, which it pins) and waits before its commit; A is settled meanwhile: kept as its
/// key's head (the replay is a writer of the key), B not promoted. Returns (store, x, b).
async fn replay_racing_a_settle(db: &TestDb) -> (Store, i64, i64) {
    let store = db.store().await;
    let ids = enqueue(db, vec![ord("k"), ord("k"), ord("k")]);
    let (a, x, b) = (ids[0], ids[1], ids[2]);
    let head = store.claim(10, LEASE, &topics()).await.unwrap();
    assert_eq!(head[0].id, a);
    store.cancel(&CancelSelector::Ids(vec![x])).await.unwrap();
    let gate = Gate::on(db, "postbox.dead_letters", "DELETE");
    let s = store.clone();
    let replay = tokio::spawn(async move { s.dead_replay(&DeadSelector::Ids(vec![x])).await });
    blocked(db, "advisory", 1).await;
    store.complete(&[head[0].lease()]).await.unwrap();
    // The key waits for the replay: nothing of it is claimable, B is not promoted past X.
    assert!(claim_ids(&store).await.is_empty());
    assert_clean(&store).await;
    gate.open();
    assert_eq!(replay.await.unwrap().unwrap().replayed, [x]);
    assert_clean(&store).await;
    (store, x, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_committing_while_the_head_is_settled_goes_in_front_of_the_next() {
    let db = TestDb::migrated();
    let (store, x, b) = replay_racing_a_settle(&db).await;
    // As if the replay had committed first: X before B.
    deliver(&store, x).await;
    assert_clean(&store).await;
    deliver(&store, b).await;
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
    assert_eq!(db.scalar("SELECT count(*) AS v FROM postbox.behind"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_of_a_key_whose_next_started_stays_dead_until_it_is_settled() {
    let db = TestDb::migrated();
    let store = db.store().await;
    let ids = enqueue(&db, vec![ord("k"), ord("k"), ord("k")]);
    let (a, x, b) = (ids[0], ids[1], ids[2]);
    let head = store.claim(10, LEASE, &topics()).await.unwrap();
    store.cancel(&CancelSelector::Ids(vec![x])).await.unwrap();
    store.complete(&[head[0].lease()]).await.unwrap();
    assert_eq!(head[0].id, a);
    let started = store.claim(10, LEASE, &topics()).await.unwrap();
    assert_eq!(started[0].id, b);
    // B runs: X, older, cannot go in front of it, nor behind it (it would pass B's successors).
    let r = store
        .dead_replay(&DeadSelector::Ids(vec![x]))
        .await
        .unwrap();
    assert_eq!((r.replayed, r.skipped), (vec![], vec![x]));
    let more = enqueue(&db, vec![ord("k")])[0];
    store.complete(&[started[0].lease()]).await.unwrap();
    // Once B is settled, the replay goes in front of what came after.
    let r = store
        .dead_replay(&DeadSelector::Ids(vec![x]))
        .await
        .unwrap();
    assert_eq!(r.replayed, [x]);
    deliver(&store, x).await;
    deliver(&store, more).await;
    assert_clean(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_message_that_is_released_goes_to_the_dead_letters() {
    let db = TestDb::migrated();
    let store = db.store().await;
    let ids = enqueue(&db, vec![Message::new("t"), ord("k"), ord("k")]);
    let claimed = store.claim(10, LEASE, &topics()).await.unwrap();
    assert_eq!(claimed.len(), 2);
    let got = store
        .cancel(&CancelSelector::Ids(vec![ids[0], ids[1]]))
        .await
        .unwrap();
    assert_eq!(got.running, 2);
    let leases: Vec<_> = claimed.iter().map(|m| m.lease()).collect();
    let released = store.release(&leases).await.unwrap();
    assert_eq!(released.done.len(), 2, "{released:?}");
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.dead_letters
             WHERE id IN ({}, {}) AND reason = 'cancelled'",
            ids[0], ids[1]
        )),
        2
    );
    assert_clean(&store).await;
    // The ordered key goes on with its next message.
    deliver(&store, ids[2]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_defaulting_to_repeatable_read_keeps_limits_and_keys() {
    let db = TestDb::migrated();
    db.exec(&format!(
        "ALTER DATABASE {} SET default_transaction_isolation = 'repeatable read'",
        db.name
    ));
    let store = db.store().await;
    let limit = Limit::new(["lim"], 1).unwrap();
    let mut app = db.conn();
    app.batch_execute("SET default_transaction_isolation = 'read committed'")
        .unwrap();
    let msgs: Vec<Message> = (0..4).map(|_| Message::new("lim")).collect();
    postbox::enqueue_many(&mut app, &msgs).unwrap();

    // Two claims wait for the limit's turn; the second must see what the first claimed.
    let mut holder = db.conn();
    holder
        .batch_execute(&format!(
            "BEGIN; SELECT postbox.take_turn('limit:{}')",
            limit.name().replace('\'', "''")
        ))
        .unwrap();
    let claims: Vec<_> = (0..2)
        .map(|_| {
            let (s, l) = (store.clone(), limit.clone());
            tokio::spawn(async move {
                s.claim_limited(&l, 10, LEASE, &Topics::exact(["lim"]))
                    .await
            })
        })
        .collect();
    blocked(&db, "row", 2).await;
    holder.batch_execute("COMMIT").unwrap();
    let mut claimed = 0;
    for c in claims {
        claimed += c.await.unwrap().unwrap().len();
    }
    assert_eq!(claimed, 1, "a limit of 1");

    // An ordered key drains in order through hand-overs.
    let ordered: Vec<Message> = (0..3).map(|_| ord("k")).collect();
    let ids: Vec<i64> = postbox::enqueue_many(&mut app, &ordered)
        .unwrap()
        .into_iter()
        .map(|e| e.id().unwrap())
        .collect();
    for id in ids {
        assert_clean(&store).await;
        deliver(&store, id).await;
    }
    assert_clean(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_what_the_model_forbids_and_repair_gives_stranded_keys_their_head() {
    let db = TestDb::migrated();
    let store = db.store().await;
    let ids = enqueue(&db, vec![ord("k"), ord("k"), ord("k"), ord("h"), ord("h")]);
    assert_clean(&store).await;

    // An operator's SQL that bypasses the promotion strands key k; another makes two heads in h.
    db.exec(&format!(
        "SET postbox.promotes_heads = 'caller'; DELETE FROM postbox.messages WHERE id = {};
         UPDATE postbox.messages SET state = 'available' WHERE id = {}",
        ids[0], ids[4]
    ));
    let found = store.check(100).await.unwrap();
    let kinds: Vec<(&str, Option<&str>)> = found
        .iter()
        .map(|v| (v.kind.as_str(), v.key.as_deref()))
        .collect();
    assert_eq!(
        kinds,
        [("double_head", Some("h")), ("stranded_key", Some("k"))],
        "{found:?}"
    );
    assert_eq!(found[1].detail, "2 waiting");

    let repaired = store.repair(100).await.unwrap();
    assert_eq!(repaired.len(), 1);
    assert_eq!(
        (repaired[0].topic.as_str(), repaired[0].key.as_str()),
        ("t", "k")
    );
    let found = store.check(100).await.unwrap();
    assert_eq!(
        found.len(),
        1,
        "a double head is reported, not repaired: {found:?}"
    );
    assert!(claim_ids(&store).await.contains(&ids[1]));
    assert!(store.repair(100).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rescuer_repairs_stranded_keys_and_the_metrics_show_them() {
    let db = TestDb::migrated();
    let store = db.store().await;
    let ids = enqueue(&db, vec![ord("k"), ord("k"), ord("k")]);
    db.exec(&format!(
        "SET postbox.promotes_heads = 'caller'; DELETE FROM postbox.messages WHERE id = {}",
        ids[0]
    ));
    let metrics = postbox::metrics::Metrics::new(&["log"]);
    metrics.invariants(&store.check(100).await.unwrap());
    let text = metrics.render();
    assert!(
        text.contains("postbox_invariant_violations{kind=\"stranded_key\"} 1"),
        "{text}"
    );
    assert!(text.contains("postbox_invariant_violations{kind=\"double_head\"} 0"));

    let rescuer = postbox::engine::Rescuer::new(store.clone(), Duration::from_secs(1))
        .observer(metrics.clone());
    rescuer.run_once().await.unwrap();
    metrics.invariants(&store.check(100).await.unwrap());
    let text = metrics.render();
    assert!(text.contains("postbox_keys_repaired_total 1"), "{text}");
    assert!(text.contains("postbox_invariant_violations{kind=\"stranded_key\"} 0"));
    deliver(&store, ids[1]).await;
    deliver(&store, ids[2]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_one_key_with_a_transaction_open_costs_the_same_per_message() {
    let db = TestDb::migrated();
    let store = db.store().await;
    db.exec(
        "INSERT INTO postbox.messages (topic, key, ordered) SELECT 't', 'k', true FROM generate_series(1, 1200)",
    );
    // Another session's snapshot keeps every promoted message's old index entry alive.
    let mut open = db.conn();
    open.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM postbox.holds")
        .unwrap();
    for _ in 0..1000 {
        let got = store.claim(1, LEASE, &topics()).await.unwrap();
        store.complete(&[got[0].lease()]).await.unwrap();
    }
    let head: i64 = db.scalar("SELECT id AS v FROM postbox.messages WHERE state <> 'waiting'");
    let read = common::index_entries_read(
        &db,
        &format!(
            "SET LOCAL postbox.promotes_heads = 'caller';
             DELETE FROM postbox.messages WHERE id = {head};
             SELECT count(*) FROM postbox.promote_after(ARRAY['t'], ARRAY['k'], ARRAY[{head}::bigint])"
        ),
    );
    open.batch_execute("COMMIT").unwrap();
    // From the removed head on: its own entry and the next one's, not the 1,000 promoted before.
    assert!(read < 50, "{read} index entries read by one hand-over");
    eprintln!("one hand-over after 1,000 with a snapshot open: {read} index entries read");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_commit_does_not_wait_for_a_held_head_and_goes_behind_it() {
    let db = TestDb::migrated();
    let store = db.store().await;
    let ids = enqueue(&db, vec![ord("k"), ord("k"), ord("k")]);
    let (a, r, m) = (ids[0], ids[1], ids[2]);
    let head = store.claim(10, LEASE, &topics()).await.unwrap();
    assert_eq!(head[0].id, a);
    store.cancel(&CancelSelector::Ids(vec![r])).await.unwrap();
    // A is settled (M is the head) and a held batch takes M.
    store.complete(&[head[0].lease()]).await.unwrap();
    let hold = store
        .take(10, Duration::from_secs(30), &topics(), None, 0)
        .await
        .unwrap()
        .unwrap();
    store.register_hold(&hold).await.unwrap();
    assert_eq!(hold.messages.iter().map(|m| m.id).collect::<Vec<_>>(), [m]);

    // R's replay goes in behind the held head (it is starting), held before its commit; then it
    // commits while the hold is open: it does not wait for the held head.
    let gate = Gate::on(&db, "postbox.dead_letters", "DELETE");
    let s = store.clone();
    let replay = tokio::spawn(async move { s.dead_replay(&DeadSelector::Ids(vec![r])).await });
    blocked(&db, "advisory", 1).await;
    gate.open();
    let report = tokio::time::timeout(Duration::from_secs(20), replay)
        .await
        .expect("the replay's commit waited for the held batch")
        .unwrap()
        .unwrap();
    assert_eq!(report.replayed, [r]);
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.behind WHERE id = {r}"
        )),
        1
    );
    // The held batch settles M; R is next.
    store.end_hold(hold, &[m], &[], LEASE, 0).await.unwrap();
    assert_clean(&store).await;
    deliver(&store, r).await;
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
    assert_eq!(db.scalar("SELECT count(*) AS v FROM postbox.behind"), 0);
}
