//! Bulkheads of the state model, against a real PostgreSQL: a settle never waits on a writer and
//! never fails because of one, and no role below relay can hold up another key's delivery. Each
//! case drives a writer's transaction held open at the worst point (a bulk commit of 5,000 keys,
//! `SET CONSTRAINTS ALL IMMEDIATE`, the advisory locks of every slot taken by hand) while a relay
//! settles; the relay's connections run with a `lock_timeout` of 200 ms, so a settle that waited
//! for the writer would fail the test instead of passing late.

mod common;

use std::time::Duration;

use common::{TestDb, enqueue, eventually};
use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection};
use postbox::store::{CancelSelector, Retry};
use postbox::{Message, Store, Topics};

const LEASE: Duration = Duration::from_secs(30);

/// A store whose statements give up on any lock held for more than 200 ms.
async fn impatient(db: &TestDb) -> Store {
    Store::connect(&format!("{}?options=-c%20lock_timeout%3D200", db.url), 8)
        .await
        .unwrap()
}

fn ord(topic: &str, key: &str) -> Message {
    Message::new(topic).key(key).ordered()
}

async fn assert_clean(store: &Store) {
    let found = store.check(100).await.unwrap();
    assert!(found.is_empty(), "{found:?}");
}

async fn claim(store: &Store, topic: &str, n: usize) -> Vec<postbox::ClaimedMessage> {
    store
        .claim(n, LEASE, &Topics::exact([topic]))
        .await
        .unwrap()
}

fn ids(msgs: &[postbox::ClaimedMessage]) -> Vec<i64> {
    let mut v: Vec<i64> = msgs.iter().map(|m| m.id).collect();
    v.sort_unstable();
    v
}

/// The state of message `id`, `kept` for a head kept for its writer.
fn state(db: &TestDb, id: i64) -> String {
    #[derive(diesel::QueryableByName)]
    struct S {
        #[diesel(sql_type = diesel::sql_types::Text)]
        s: String,
    }
    use diesel::RunQueryDsl;
    diesel::sql_query(
        "SELECT coalesce((SELECT CASE WHEN lease_token = 0 THEN 'kept' ELSE state::text END
                          FROM postbox.messages WHERE id = $1), 'gone') AS s",
    )
    .bind::<diesel::sql_types::BigInt, _>(id)
    .get_result::<S>(&mut db.conn())
    .unwrap()
    .s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_commit_of_5000_keys_held_open_neither_delays_nor_rolls_back_a_held_batch() {
    let db = TestDb::migrated();
    // 5,000 accounts with a head each, and an unrelated topic: one ordered key and unordered ones.
    db.exec(
        "INSERT INTO postbox.messages (topic, key, ordered) SELECT 'acct', 'a' || g, true FROM generate_series(1, 5000) g;
         INSERT INTO postbox.messages (topic, key, ordered) VALUES ('orders', 'victim', true), ('orders', 'victim', true);
         INSERT INTO postbox.messages (topic) SELECT 'orders' FROM generate_series(1, 5);
         ANALYZE postbox.messages;",
    );
    let store = impatient(&db).await;
    // The app: the next event of every account in one transaction, its checks run at once (as an
    // app does to check its own deferred constraints), left open as a slow commit is.
    let mut app = PgConnection::establish(&db.url).unwrap();
    app.batch_execute("BEGIN").unwrap();
    let next: Vec<Message> = (1..=5000).map(|i| ord("acct", &format!("a{i}"))).collect();
    let written: Vec<i64> = postbox::enqueue_many(&mut app, &next)
        .unwrap()
        .into_iter()
        .map(|e| e.id().unwrap())
        .collect();
    app.batch_execute("SET CONSTRAINTS ALL IMMEDIATE").unwrap();

    // The relay: a held batch of the other topic, its ordered head among it, all delivered.
    let hold = store
        .take(
            10,
            Duration::from_secs(5),
            &Topics::exact(["orders"]),
            None,
            0,
        )
        .await
        .unwrap()
        .expect("a batch");
    assert_eq!(hold.messages.len(), 6);
    store.register_hold(&hold).await.unwrap();
    let held = ids(&hold.messages);
    let head = held[0];
    let (ended, _) = store
        .end_hold(hold, &held, &[], LEASE, 0)
        .await
        .expect("the hold ends while the app's commit is open");
    assert_eq!(ended.deleted, 6);
    for id in &held {
        assert_eq!(
            state(&db, *id),
            "gone",
            "message {id} of the hold is queued again"
        );
    }
    // Its key's next message is promoted at once.
    let victim_next = claim(&store, "orders", 10).await;
    assert_eq!(victim_next.len(), 1);
    assert!(victim_next[0].id > head);
    store.complete(&[victim_next[0].lease()]).await.unwrap();

    // Heads of the app's own keys are delivered too, leased and held: settled without waiting,
    // kept as their keys' heads until the app is done.
    let leased = claim(&store, "acct", 100).await;
    assert_eq!(leased.len(), 100);
    let leases: Vec<_> = leased.iter().map(|m| m.lease()).collect();
    let done = store.complete(&leases).await.unwrap();
    assert_eq!(done.done.len(), 100);
    assert!(done.fenced.is_empty());
    let held = store
        .take(
            100,
            Duration::from_secs(5),
            &Topics::exact(["acct"]),
            None,
            0,
        )
        .await
        .unwrap()
        .expect("a batch");
    store.register_hold(&held).await.unwrap();
    let held_ids = ids(&held.messages);
    store
        .end_hold(held, &held_ids, &[], LEASE, 0)
        .await
        .expect("a hold of the app's keys ends too");
    for id in leased.iter().map(|m| m.id).chain(held_ids.iter().copied()) {
        assert_eq!(state(&db, id), "kept");
    }
    assert!(store.kept_heads());
    // Nothing of those keys is claimable: each still has its head.
    let f = store.finish_heads().await.unwrap();
    assert_eq!((f.finished, f.still_kept), (0, 200));
    assert_clean(&store).await;

    // The app commits: the kept heads go and each key's next message (the app's) is promoted.
    app.batch_execute("COMMIT").unwrap();
    let f = store.finish_heads().await.unwrap();
    assert_eq!((f.finished, f.still_kept), (200, 0));
    assert!(!store.kept_heads());
    assert_clean(&store).await;
    // Every key delivers its two messages in order: 10,000 deliveries, each key's head first.
    let mut delivered = Vec::new();
    loop {
        let got = claim(&store, "acct", 1000).await;
        if got.is_empty() {
            break;
        }
        delivered.extend(got.iter().map(|m| (m.key.clone().unwrap(), m.id)));
        let leases: Vec<_> = got.iter().map(|m| m.lease()).collect();
        store.complete(&leases).await.unwrap();
    }
    assert_eq!(delivered.len(), 10_000 - 200);
    let mut last = std::collections::HashMap::new();
    for (k, id) in &delivered {
        if let Some(prev) = last.insert(k.clone(), *id) {
            assert!(prev < *id, "key {k}: {id} after {prev}");
        }
    }
    assert!(written.iter().all(|id| state(&db, *id) == "gone"));
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_left_open_holds_up_its_own_key_only_and_never_a_settle() {
    let db = TestDb::migrated();
    let store = impatient(&db).await;
    // Key k: a head and a message committed behind it. Another key of the same topic.
    let k = enqueue(&db, vec![ord("t", "k"), ord("t", "k")]);
    let other = enqueue(&db, vec![ord("t", "other"), ord("t", "other")]);
    // A writer of key k, open (the head is pinned for it).
    let mut app = PgConnection::establish(&db.url).unwrap();
    app.batch_execute("BEGIN").unwrap();
    let mine = postbox::enqueue(&mut app, &ord("t", "k"))
        .unwrap()
        .id()
        .unwrap();
    app.batch_execute("SET CONSTRAINTS ALL IMMEDIATE").unwrap();

    // Both heads are claimable (the pin keeps no one from starting a head) and settle at once.
    let got = claim(&store, "t", 10).await;
    assert_eq!(ids(&got), [k[0], other[0]]);
    let leases: Vec<_> = got.iter().map(|m| m.lease()).collect();
    let (done, next) = store
        .complete_and_take(&leases, 10, LEASE)
        .await
        .expect("a settle does not wait for the writer");
    assert_eq!(done.done.len(), 2);
    // The other key's next message is handed over; key k keeps its head for the writer.
    assert_eq!(ids(&next), [other[1]]);
    assert_eq!(state(&db, k[0]), "kept");
    assert_eq!(state(&db, k[1]), "waiting");
    assert!(claim(&store, "t", 10).await.is_empty());
    store.complete(&[next[0].lease()]).await.unwrap();
    assert_clean(&store).await;

    // The writer rolls back: the kept head goes, the committed message behind it is next.
    app.batch_execute("ROLLBACK").unwrap();
    store.finish_heads().await.unwrap();
    let got = claim(&store, "t", 10).await;
    assert_eq!(ids(&got), [k[1]]);
    assert_eq!(state(&db, mine), "gone");
    store.complete(&[got[0].lease()]).await.unwrap();
    assert_clean(&store).await;
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_settle_keeps_a_pinned_head_and_the_writers_commit_lets_its_key_go_on() {
    let db = TestDb::migrated();
    let store = impatient(&db).await;
    // One key per way a head leaves: complete, dead-letter, retry on its last attempt, release
    // after a cancel, rescue on its last attempt, cancel while pending.
    let keys = ["complete", "dead", "retry", "release", "rescue", "cancel"];
    let mut heads = std::collections::HashMap::new();
    for k in keys {
        let m = ord("t", k).max_attempts(1);
        let ids = enqueue(&db, vec![m, ord("t", k)]);
        heads.insert(k, ids);
    }
    // The head of `cancel` is not due: no claim takes it.
    let pending = heads["cancel"][0];
    db.exec(&format!(
        "UPDATE postbox.messages SET run_at = now() + interval '1 hour', state = 'scheduled' WHERE id = {pending}"
    ));
    let mut app = PgConnection::establish(&db.url).unwrap();
    app.batch_execute("BEGIN").unwrap();
    let mine: Vec<i64> = postbox::enqueue_many(&mut app, &keys.map(|k| ord("t", k)))
        .unwrap()
        .into_iter()
        .map(|e| e.id().unwrap())
        .collect();

    let got = claim(&store, "t", 10).await;
    let by_key = |k: &str| got.iter().find(|m| m.key.as_deref() == Some(k)).unwrap();
    assert_eq!(got.len(), 5, "every head but the pending one's");
    store.complete(&[by_key("complete").lease()]).await.unwrap();
    store
        .dead_letter(&[postbox::store::Dead {
            lease: by_key("dead").lease(),
            reason: "refused".into(),
        }])
        .await
        .unwrap();
    let r = store
        .retry(&[Retry {
            lease: by_key("retry").lease(),
            error: "failed".into(),
            delay: None,
        }])
        .await
        .unwrap();
    assert_eq!(r.dead.len(), 1, "its last attempt");
    store
        .cancel(&CancelSelector::Ids(vec![by_key("release").id]))
        .await
        .unwrap();
    store.release(&[by_key("release").lease()]).await.unwrap();
    db.exec(&format!(
        "UPDATE postbox.messages SET locked_until = now() - interval '1 second' WHERE id = {}",
        by_key("rescue").id
    ));
    let r = store.rescue_expired().await.unwrap();
    assert_eq!(r.dead.len(), 1);
    // Pending, cancelled: the head no claim took.
    let c = store
        .cancel(&CancelSelector::Ids(vec![pending]))
        .await
        .unwrap();
    assert_eq!(c.dead, 1);
    // Each head is kept (delivered or dead-lettered already), its next message still waiting.
    for k in keys {
        assert_eq!(state(&db, heads[k][0]), "kept", "{k}");
        assert_eq!(state(&db, heads[k][1]), "waiting", "{k}");
    }
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters"),
        5,
        "every one but the completed one is a dead letter already"
    );
    assert_clean(&store).await;

    app.batch_execute("COMMIT").unwrap();
    let f = store.finish_heads().await.unwrap();
    assert_eq!((f.finished, f.still_kept), (6, 0));
    // Each key: the committed message, then the writer's.
    for round in [0, 1] {
        let got = claim(&store, "t", 10).await;
        let mut want: Vec<i64> = if round == 0 {
            keys.iter().map(|k| heads[k][1]).collect()
        } else {
            mine.clone()
        };
        want.sort_unstable();
        assert_eq!(ids(&got), want);
        let leases: Vec<_> = got.iter().map(|m| m.lease()).collect();
        store.complete(&leases).await.unwrap();
    }
    assert_clean(&store).await;
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_locks_taken_by_hand_hold_up_no_settle_and_no_promotion() {
    let db = TestDb::migrated();
    let store = impatient(&db).await;
    let msgs: Vec<Message> = (0..300)
        .flat_map(|i| [ord("t", &format!("k{i}")), ord("t", &format!("k{i}"))])
        .collect();
    enqueue(&db, msgs);
    // Every slot of every advisory lock class postbox ever used, taken by a session that is
    // not postbox's, and kept.
    let mut squatter = PgConnection::establish(&db.url).unwrap();
    squatter
        .batch_execute(
            "SELECT pg_advisory_lock(c, s) FROM generate_series(1886352244, 1886352247) c,
                                                generate_series(0, 255) s",
        )
        .unwrap();
    // 300 heads delivered, leased and held; 300 next messages promoted and delivered.
    let got = claim(&store, "t", 150).await;
    assert_eq!(got.len(), 150);
    let leases: Vec<_> = got.iter().map(|m| m.lease()).collect();
    let (_, next) = store.complete_and_take(&leases, 0, LEASE).await.unwrap();
    assert!(next.is_empty());
    let hold = store
        .take(150, Duration::from_secs(5), &Topics::exact(["t"]), None, 0)
        .await
        .unwrap()
        .unwrap();
    store.register_hold(&hold).await.unwrap();
    let held = ids(&hold.messages);
    assert_eq!(held.len(), 150);
    store.end_hold(hold, &held, &[], LEASE, 0).await.unwrap();
    let mut left = 300;
    while left > 0 {
        let got = claim(&store, "t", 100).await;
        assert!(
            !got.is_empty(),
            "{left} promoted messages never became claimable"
        );
        left -= got.len();
        let leases: Vec<_> = got.iter().map(|m| m.lease()).collect();
        store.complete(&leases).await.unwrap();
    }
    assert!(!store.kept_heads(), "no head is pinned: none is kept");
    assert_clean(&store).await;
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
}

/// A cancel marks a running head in a transaction of its own, held open; a release or a retry of
/// that head comes meanwhile and waits for it (a relay's settle may wait for an operator).
async fn settle_racing_a_cancel(retry: bool) {
    let db = TestDb::migrated();
    let store = db.store().await;
    let k = enqueue(&db, vec![ord("t", "k"), ord("t", "k")]);
    let got = claim(&store, "t", 1).await;
    assert_eq!(ids(&got), [k[0]]);
    let lease = got[0].lease();
    let mut operator = PgConnection::establish(&db.url).unwrap();
    operator
        .batch_execute(&format!(
            "BEGIN; UPDATE postbox.messages SET cancelled = true WHERE id = {} AND state = 'running'",
            k[0]
        ))
        .unwrap();
    let settle = {
        let store = store.clone();
        tokio::spawn(async move {
            if retry {
                let r = store
                    .retry(&[Retry {
                        lease,
                        error: "sink down".into(),
                        delay: Some(Duration::ZERO),
                    }])
                    .await
                    .unwrap();
                (r.dead, r.fenced)
            } else {
                let r = store.release(&[lease]).await.unwrap();
                (r.done, r.fenced)
            }
        })
    };
    let waiting = "SELECT count(*) AS v FROM pg_stat_activity
        WHERE datname = current_database() AND wait_event_type = 'Lock'";
    assert!(
        eventually(Duration::from_secs(20), || async {
            db.scalar(waiting) >= 1
        })
        .await
    );
    operator.batch_execute("COMMIT").unwrap();
    let (settled, fenced) = settle.await.unwrap();
    assert_eq!(settled, [k[0]], "the settle applied to the cancelled head");
    assert!(fenced.is_empty());
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.dead_letters WHERE id = {} AND reason = 'cancelled'",
            k[0]
        )),
        1
    );
    // Its key goes on at once: no lease to wait out.
    assert_eq!(ids(&claim(&store, "t", 1).await), [k[1]]);
    assert_clean(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_racing_a_cancels_mark_dead_letters_the_head_and_promotes_its_key() {
    settle_racing_a_cancel(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_racing_a_cancels_mark_dead_letters_the_head_and_promotes_its_key() {
    settle_racing_a_cancel(true).await;
}

/// A writer's message may carry any header, `postbox-stream-id` included: two of its messages
/// with the same one are both dead-lettered, and a rescue batch they fall into goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writers_stream_id_header_cannot_stop_dead_lettering_or_rescues() {
    let db = TestDb::migrated();
    let store = impatient(&db).await;
    db.exec(
        "INSERT INTO postbox.messages (topic, headers, max_attempts)
         VALUES ('x', '{\"postbox-stream-id\": \"s1\"}', 1), ('x', '{\"postbox-stream-id\": \"s1\"}', 1),
                ('x', '{\"postbox-stream-id\": \"s1\"}', 1), ('y', '{}', 1)",
    );
    let got = claim(&store, "x", 3).await;
    let dead = store
        .dead_letter(&[postbox::store::Dead {
            lease: got[0].lease(),
            reason: "refused".into(),
        }])
        .await
        .unwrap();
    assert_eq!(dead.done, [got[0].id]);
    let r = store
        .retry(&[Retry {
            lease: got[1].lease(),
            error: "failed".into(),
            delay: None,
        }])
        .await
        .expect("a second message with the header is dead-lettered too");
    assert_eq!(r.dead, [got[1].id]);
    // The third, and another topic's message, expire together: the rescue takes both.
    let other = claim(&store, "y", 1).await;
    db.exec("UPDATE postbox.messages SET locked_until = now() - interval '1 second' WHERE state = 'running'");
    let r = store.rescue_expired().await.expect("the rescue goes on");
    let mut dead = r.dead.clone();
    dead.sort_unstable();
    assert_eq!(dead, [got[2].id, other[0].id]);
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters"),
        4
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters WHERE stream_id IS NOT NULL"),
        0
    );
}

/// A thousand heads kept for one open bulk writer do not hide a head whose writer is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heads_kept_for_an_open_writer_hide_no_other_key_from_the_finish() {
    let db = TestDb::migrated();
    let store = impatient(&db).await;
    let heads: Vec<Message> = (0..1100).map(|i| ord("t", &format!("b{i}"))).collect();
    enqueue(&db, heads);
    let victim = enqueue(&db, vec![ord("t", "victim"), ord("t", "victim")]);
    let mut bulk = PgConnection::establish(&db.url).unwrap();
    bulk.batch_execute("BEGIN").unwrap();
    postbox::enqueue_many(
        &mut bulk,
        &(0..1100)
            .map(|i| ord("t", &format!("b{i}")))
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let mut writer = PgConnection::establish(&db.url).unwrap();
    writer.batch_execute("BEGIN").unwrap();
    postbox::enqueue(&mut writer, &ord("t", "victim")).unwrap();
    // Every head delivered: all kept (the bulk writer's 1,100 first, in the claim's order).
    loop {
        let got = claim(&store, "t", 500).await;
        if got.is_empty() {
            break;
        }
        let leases: Vec<_> = got.iter().map(|m| m.lease()).collect();
        store.complete(&leases).await.unwrap();
    }
    assert_eq!(state(&db, victim[0]), "kept");
    writer.batch_execute("COMMIT").unwrap();
    let f = store.finish_heads().await.unwrap();
    assert_eq!((f.finished, f.still_kept), (1, 1100));
    assert_eq!(ids(&claim(&store, "t", 10).await), [victim[1]]);
    bulk.batch_execute("ROLLBACK").unwrap();
}

/// Writers of unrelated keys never wait for each other, whatever their keys hash to: a writer
/// that pinned a head is not held (and that head kept) by another key's writer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_of_unrelated_keys_never_wait_for_each_other() {
    let db = TestDb::migrated();
    // Keys that shared a writer slot of the 256 the writer locks once were.
    let same_slot = (0..100_000)
        .map(|i| format!("x{i}"))
        .find(|k| {
            db.scalar(&format!(
                "SELECT (postbox.key_lock_id('t', 'a') = postbox.key_lock_id('t', '{k}'))::int::bigint AS v"
            )) == 1
        })
        .unwrap();
    let mut one = PgConnection::establish(&db.url).unwrap();
    one.batch_execute("BEGIN").unwrap();
    postbox::enqueue(&mut one, &ord("t", "a")).unwrap();
    let mut two = PgConnection::establish(&db.url).unwrap();
    two.batch_execute("BEGIN; SET LOCAL lock_timeout = 500")
        .unwrap();
    postbox::enqueue(&mut two, &ord("t", &same_slot)).expect("no wait for another key's writer");
    two.batch_execute("COMMIT").unwrap();
    one.batch_execute("COMMIT").unwrap();
}

/// A cancel that chose a key's replayed message (locking it) and waits for the head a held
/// batch delivers, and that batch's end, which would promote the replayed message: no deadlock,
/// the held batch ends, the cancel takes the message, the key goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_and_a_held_batchs_end_do_not_deadlock_over_a_key() {
    let db = TestDb::migrated();
    let store = db.store().await;
    let ids0 = enqueue(&db, vec![ord("t", "a"), ord("t", "a"), ord("t", "a")]);
    let (r, m, last) = (ids0[0], ids0[1], ids0[2]);
    // R to the dead letters (M is the head), a held batch takes M, R is replayed behind it.
    store.cancel(&CancelSelector::Ids(vec![r])).await.unwrap();
    let hold = store
        .take(10, Duration::from_secs(30), &Topics::exact(["t"]), None, 0)
        .await
        .unwrap()
        .unwrap();
    store.register_hold(&hold).await.unwrap();
    assert_eq!(ids(&hold.messages), [m]);
    let replayed = store
        .dead_replay(&postbox::store::DeadSelector::Ids(vec![r]))
        .await
        .unwrap();
    assert_eq!(replayed.replayed, [r]);
    // The operator cancels topic t: it locks R, then waits for M.
    let s = store.clone();
    let cancel = tokio::spawn(async move { s.cancel(&CancelSelector::Topic("t".into())).await });
    let waiting = "SELECT count(*) AS v FROM pg_stat_activity
        WHERE datname = current_database() AND wait_event_type = 'Lock'";
    assert!(
        eventually(Duration::from_secs(20), || async {
            db.scalar(waiting) >= 1
        })
        .await
    );
    let (ended, _) = store
        .end_hold(hold, &[m], &[], LEASE, 0)
        .await
        .expect("the held batch ends");
    assert_eq!(ended.deleted, 1);
    let c = cancel.await.unwrap().expect("the cancel ends");
    assert_eq!(c.dead, 2, "R and the last message");
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.dead_letters WHERE id IN ({r}, {last}) AND reason = 'cancelled'"
        )),
        2
    );
    assert_clean(&store).await;
}

/// A held batch that delivered a key's pinned head and leased the follower it did not deliver:
/// the kept head and the leased follower are no double head.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_head_beside_a_follower_leased_at_a_holds_end_is_no_double_head() {
    let db = TestDb::migrated();
    let store = impatient(&db).await;
    let k = enqueue(&db, vec![ord("t", "k"), ord("t", "k"), ord("t", "k")]);
    let hold = store
        .take(1, Duration::from_secs(30), &Topics::exact(["t"]), None, 2)
        .await
        .unwrap()
        .unwrap();
    store.register_hold(&hold).await.unwrap();
    assert_eq!(ids(&hold.followers), [k[1], k[2]]);
    let mut writer = PgConnection::establish(&db.url).unwrap();
    writer.batch_execute("BEGIN").unwrap();
    postbox::enqueue(&mut writer, &ord("t", "k")).unwrap();
    store
        .end_hold(hold, &[k[0], k[1]], &[k[2]], LEASE, 0)
        .await
        .unwrap();
    assert_eq!(state(&db, k[0]), "kept");
    assert_eq!(state(&db, k[2]), "running");
    assert_clean(&store).await;
    writer.batch_execute("COMMIT").unwrap();
    store.finish_heads().await.unwrap();
    assert_clean(&store).await;
}

/// A head in backoff that a writer pins is made due all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_head_in_backoff_is_made_due() {
    let db = TestDb::migrated();
    let store = impatient(&db).await;
    let k = enqueue(&db, vec![ord("t", "k").delay(Duration::from_millis(100))]);
    let mut writer = PgConnection::establish(&db.url).unwrap();
    writer.batch_execute("BEGIN").unwrap();
    postbox::enqueue(&mut writer, &ord("t", "k")).unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            store.promote_due().await.unwrap().promoted == 1
        })
        .await
    );
    assert_eq!(ids(&claim(&store, "t", 10).await), [k[0]]);
    writer.batch_execute("ROLLBACK").unwrap();
}
