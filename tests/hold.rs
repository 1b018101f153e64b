//! Held batches, the claim's fast path, against a real PostgreSQL: a hold locks its batch without
//! writing a lease, deletes what was delivered and leases the rest when it ends, and a hold that
//! never commits still uses its attempt, so a message that crashes its relay every time ends in
//! the dead letters.

mod common;

use std::time::Duration;

use common::{TestDb, enqueue, eventually};
use postbox::store::TakePosition;
use postbox::{Message, Topics};

const LEASE: Duration = Duration::from_secs(30);
const HOLD: Duration = Duration::from_secs(1);

/// Available messages not locked by any transaction: held rows stay `available`, so a dropped
/// hold's rows are claimable only once its connection is gone (the rollback is not instant).
fn unlocked_now(db: &TestDb) -> i64 {
    db.scalar(
        "SELECT count(*) AS v FROM (SELECT id FROM postbox.messages WHERE state = 'available'
         FOR UPDATE SKIP LOCKED) s",
    )
}

async fn unlocked(db: &TestDb, n: i64) {
    assert!(
        eventually(Duration::from_secs(10), || async { unlocked_now(db) == n }).await,
        "a dropped hold still locks its rows"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_locks_its_batch_deletes_the_delivered_and_leases_the_rest() {
    let db = TestDb::migrated();
    let ids = enqueue(
        &db,
        (0..10).map(|i| Message::new("t").payload(&i)).collect(),
    );
    let store = db.store().await;
    let topics = Topics::exact(["t"]);

    let hold = store
        .take(6, HOLD, &topics, None, 0)
        .await
        .unwrap()
        .unwrap();
    store.register_hold(&hold).await.unwrap();
    let held: Vec<i64> = hold.messages.iter().map(|m| m.id).collect();
    assert_eq!(held, ids[..6]);
    assert!(hold.messages.iter().all(|m| m.attempts == 1));
    // Nothing is written for the held rows: they stay available, locked; claims skip them.
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE state = 'available'"),
        10
    );
    let other = store.claim(100, LEASE, &topics).await.unwrap();
    let other_ids: Vec<i64> = other.iter().map(|m| m.id).collect();
    assert_eq!(other_ids, ids[6..]);
    assert!(
        store
            .take(100, HOLD, &topics, None, 0)
            .await
            .unwrap()
            .is_none()
    );
    // A hold in progress is not lost.
    assert_eq!(store.lost_holds().await.unwrap(), 0);
    assert_eq!(db.scalar("SELECT count(*) AS v FROM postbox.holds"), 1);

    let rest: Vec<_> = hold.messages[4..].iter().map(|m| m.lease()).collect();
    let (ended, _) = store
        .end_hold(hold, &held[..4], &held[4..], LEASE, 0)
        .await
        .unwrap();
    assert_eq!((ended.deleted, ended.leased), (4, 2));
    assert_eq!(db.scalar("SELECT count(*) AS v FROM postbox.holds"), 0);
    assert_eq!(
        db.scalar(
            "SELECT count(*) AS v FROM postbox.messages WHERE state = 'running' AND attempts = 1"
        ),
        2 + 4
    );
    // The rest carry the lease the hold's messages named: they settle as claimed messages do.
    let done = store.complete(&rest).await.unwrap();
    assert!(done.fenced.is_empty(), "{done:?}");
    let leases: Vec<_> = other.iter().map(|m| m.lease()).collect();
    store.complete(&leases).await.unwrap();
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_that_never_commits_uses_its_attempt_until_the_message_is_dead_lettered() {
    let db = TestDb::migrated();
    enqueue(&db, vec![Message::new("t").max_attempts(2)]);
    let store = db.store().await;
    let topics = Topics::exact(["t"]);
    for attempt in 1..=2 {
        let hold = store
            .take(10, HOLD, &topics, None, 0)
            .await
            .unwrap()
            .unwrap();
        store.register_hold(&hold).await.unwrap();
        assert_eq!(hold.messages[0].attempts, attempt);
        // The relay dies mid-delivery: its connection goes, the transaction rolls back.
        drop(hold);
        assert!(
            eventually(Duration::from_secs(10), || async {
                store.lost_holds().await.unwrap() == 1
            })
            .await,
            "the lost hold was not counted"
        );
        let rescued = store.rescue_expired().await.unwrap();
        if attempt == 1 {
            assert_eq!((rescued.retried.len(), rescued.dead.len()), (1, 0));
            db.exec("UPDATE postbox.messages SET run_at = now() WHERE state = 'scheduled'; SELECT postbox.promote_due(10)");
        } else {
            assert_eq!((rescued.retried.len(), rescued.dead.len()), (0, 1));
        }
    }
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters WHERE reason LIKE '%attempts exhausted (2 of 2)%without a commit%'"),
        1
    );
    assert_eq!(db.scalar("SELECT count(*) AS v FROM postbox.holds"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_take_ordered_heads_only_and_their_delivery_promotes_the_next() {
    let db = TestDb::migrated();
    let ids = enqueue(
        &db,
        (0..3)
            .map(|i| Message::new("o").key("k").ordered().payload(&i))
            .collect(),
    );
    let store = db.store().await;
    let topics = Topics::exact(["o"]);
    for id in ids {
        let hold = store
            .take(10, HOLD, &topics, None, 0)
            .await
            .unwrap()
            .unwrap();
        let got: Vec<i64> = hold.messages.iter().map(|m| m.id).collect();
        assert_eq!(got, [id]);
        store.register_hold(&hold).await.unwrap();
        store.end_hold(hold, &[id], &[], LEASE, 0).await.unwrap();
    }
    assert!(
        store
            .take(10, HOLD, &topics, None, 0)
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_cannot_end_unregistered_and_a_lease_taken_at_its_end_runs_from_then() {
    let db = TestDb::migrated();
    enqueue(&db, vec![Message::new("t"), Message::new("t")]);
    let store = db.store().await;
    let topics = Topics::exact(["t"]);

    // Unregistered: its loss could not be counted, so it may not commit.
    let hold = store
        .take(1, HOLD, &topics, None, 0)
        .await
        .unwrap()
        .unwrap();
    let id = hold.messages[0].id;
    assert!(store.end_hold(hold, &[id], &[], LEASE, 0).await.is_err());
    assert!(
        eventually(Duration::from_secs(10), || async { unlocked_now(&db) == 2 }).await,
        "rolled back: both messages are claimable"
    );

    // A hold that ends later than its start leases for the full lease from its end.
    let hold = store
        .take(2, HOLD, &topics, None, 0)
        .await
        .unwrap()
        .unwrap();
    store.register_hold(&hold).await.unwrap();
    let ids: Vec<i64> = hold.messages.iter().map(|m| m.id).collect();
    tokio::time::sleep(Duration::from_millis(1_500)).await; // time passing, not a race
    store
        .end_hold(hold, &[], &ids, Duration::from_secs(1), 0)
        .await
        .unwrap();
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE state = 'running' AND locked_until > now()"),
        2
    );
}

/// A take starts after the position it is given (where the claim loop's last take ended, while
/// that hold is in flight): in the floors' order (priority, ready_xid, id) for every topic or one
/// topic named exactly, which a position in (priority, id) does not move; in (priority, id) for
/// several topics or patterns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_take_after_a_position_starts_there_on_one_topic_or_several() {
    let db = TestDb::migrated();
    let a = enqueue(&db, (0..4).map(|_| Message::new("a")).collect());
    let b = enqueue(&db, (0..4).map(|_| Message::new("b")).collect());
    let store = db.store().await;
    let ids = |h: &postbox::store::Hold| h.messages.iter().map(|m| m.id).collect::<Vec<_>>();

    // One topic, and every topic: after the last take's position.
    for (topics, all) in [
        (Topics::exact(["a"]), a.clone()),
        (Topics::all(), a.iter().chain(&b).copied().collect()),
    ] {
        let first = store
            .take(2, HOLD, &topics, None, 0)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(ids(&first), all[..2]);
        let next = store
            .take(10, HOLD, &topics, first.last, 0)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(ids(&next), all[2..], "{topics:?}");
        drop((first, next));
        unlocked(&db, 8).await;
        // A position in (priority, id) is not one of this order: from the floors.
        let hold = store
            .take(10, HOLD, &topics, Some(TakePosition::at(0, a[1])), 0)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(ids(&hold), all, "{topics:?}");
        drop(hold);
        unlocked(&db, 8).await;
    }

    // Several topics (postbox.pick): after the position in the claim order, whatever the topic.
    let hold = store
        .take(
            10,
            HOLD,
            &Topics::exact(["a", "b"]),
            Some(TakePosition::at(0, b[1])),
            0,
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ids(&hold), b[2..]);
    drop(hold);
    unlocked(&db, 8).await;
    let hold = store
        .take(
            10,
            HOLD,
            &Topics::only(["a*", "b"]),
            Some(TakePosition::at(0, a[2])),
            0,
        )
        .await
        .unwrap()
        .unwrap();
    let want: Vec<i64> = a[3..].iter().chain(&b).copied().collect();
    assert_eq!(ids(&hold), want);
}

/// A take after a position skips what is before it, and the floors it leaves stay below: a hold
/// in flight that rolls back is taken by the next take without a position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_floors_of_a_take_after_a_position_stay_below_it() {
    let db = TestDb::migrated();
    let ids = enqueue(&db, (0..6).map(|_| Message::new("t")).collect());
    let store = db.store().await;
    let topics = Topics::exact(["t"]);
    let first = store
        .take(2, HOLD, &topics, None, 0)
        .await
        .unwrap()
        .unwrap();
    let second = store
        .take(2, HOLD, &topics, first.last, 0)
        .await
        .unwrap()
        .unwrap();
    let third = store
        .take(10, HOLD, &topics, second.last, 0)
        .await
        .unwrap()
        .unwrap();
    let taken = |h: &postbox::store::Hold| h.messages.iter().map(|m| m.id).collect::<Vec<_>>();
    assert_eq!(taken(&second), ids[2..4]);
    assert_eq!(taken(&third), ids[4..]);
    drop((first, third));
    unlocked(&db, 4).await;
    let again = store
        .take(10, HOLD, &topics, None, 0)
        .await
        .unwrap()
        .unwrap();
    let want: Vec<i64> = ids[..2].iter().chain(&ids[4..]).copied().collect();
    assert_eq!(taken(&again), want);
}

/// A hold of the store's floors that rolls back (its connection dropped) while another hold took
/// past its rows: the next take, from the floors both left, has them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_rolled_back_behind_another_leaves_its_rows_to_the_next_take() {
    let db = TestDb::migrated();
    let ids = enqueue(&db, (0..6).map(|_| Message::new("t")).collect());
    let store = db.store().await;
    for topics in [Topics::exact(["t"]), Topics::all()] {
        let first = store
            .take(2, HOLD, &topics, None, 0)
            .await
            .unwrap()
            .unwrap();
        let second = store
            .take(2, HOLD, &topics, None, 0)
            .await
            .unwrap()
            .unwrap();
        let taken: Vec<i64> = second.messages.iter().map(|m| m.id).collect();
        assert_eq!(taken, ids[2..4]);
        drop(first);
        unlocked(&db, 4).await;
        let third = store
            .take(10, HOLD, &topics, None, 0)
            .await
            .unwrap()
            .unwrap();
        let again: Vec<i64> = third.messages.iter().map(|m| m.id).collect();
        let want: Vec<i64> = ids[..2].iter().chain(&ids[4..]).copied().collect();
        assert_eq!(again, want, "{topics:?}");
        // And a claim from the floors the takes left.
        drop((second, third));
        unlocked(&db, 6).await;
        let mut claimed: Vec<i64> = store
            .claim(10, LEASE, &topics)
            .await
            .unwrap()
            .iter()
            .map(|m| m.id)
            .collect();
        claimed.sort_unstable();
        assert_eq!(claimed, ids);
        db.exec("UPDATE postbox.messages SET state = 'available', locked_until = NULL, lease_token = NULL, locked_by = NULL, attempts = 0");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivered_head_hands_the_next_of_its_key_over_to_the_holder() {
    let db = TestDb::migrated();
    let ids = enqueue(
        &db,
        (0..3)
            .map(|i| Message::new("o").key("k").ordered().payload(&i))
            .collect(),
    );
    let store = db.store().await;
    let hold = store
        .take(10, HOLD, &Topics::exact(["o"]), None, 0)
        .await
        .unwrap()
        .unwrap();
    store.register_hold(&hold).await.unwrap();
    let (_, next) = store
        .end_hold(hold, &[ids[0]], &[], LEASE, 1)
        .await
        .unwrap();
    // The next message of the key is leased to the holder (attempt counted), the third waits.
    assert_eq!(next.iter().map(|m| m.id).collect::<Vec<_>>(), [ids[1]]);
    assert_eq!(next[0].attempts, 1);
    assert!(next[0].locked_until > chrono::Utc::now() + chrono::Duration::seconds(25));
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE state = 'waiting'"),
        1
    );
    let leases: Vec<_> = next.iter().map(|m| m.lease()).collect();
    let (done, after) = store.complete_and_take(&leases, 1, LEASE).await.unwrap();
    assert!(done.fenced.is_empty());
    assert_eq!(after.iter().map(|m| m.id).collect::<Vec<_>>(), [ids[2]]);
}

/// The state of message `id`, or "gone".
fn state(db: &TestDb, id: i64) -> String {
    use diesel::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct S {
        #[diesel(sql_type = diesel::sql_types::Text)]
        s: String,
    }
    let r: Vec<S> = diesel::sql_query(format!(
        "SELECT state::text AS s FROM postbox.messages WHERE id = {id}"
    ))
    .load(&mut db.conn())
    .unwrap();
    r.into_iter().next().map_or("gone".to_owned(), |r| r.s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_takes_the_messages_behind_its_ordered_heads_in_order_and_settles_each_key() {
    let db = TestDb::migrated();
    let o = |k: &str| Message::new("o").key(k).ordered();
    let a = enqueue(&db, (0..5).map(|_| o("a")).collect());
    let b = enqueue(&db, (0..3).map(|_| o("b")).collect());
    // The second message of c is not due: its chain stops before it.
    let c = enqueue(
        &db,
        vec![o("c"), o("c").delay(Duration::from_secs(3600)), o("c")],
    );
    // The second message of d is locked by another transaction: its chain stops before it, and
    // nothing behind it is taken.
    let d = enqueue(&db, (0..3).map(|_| o("d")).collect());
    let u = enqueue(&db, vec![Message::new("o")]);
    let mut locker = db.conn();
    {
        use diesel::{Connection, RunQueryDsl};
        locker.begin_test_transaction().unwrap();
        diesel::sql_query(format!(
            "SELECT id FROM postbox.messages WHERE id = {} FOR UPDATE",
            d[1]
        ))
        .execute(&mut locker)
        .unwrap();
    }
    let store = db.store().await;
    let topics = Topics::exact(["o"]);

    // Four ordered heads share 8 followers: two each, at most.
    let hold = store
        .take(10, HOLD, &topics, None, 8)
        .await
        .unwrap()
        .unwrap();
    let ids = |ms: &[postbox::store::ClaimedMessage]| ms.iter().map(|m| m.id).collect::<Vec<_>>();
    assert_eq!(ids(&hold.messages), [a[0], b[0], c[0], d[0], u[0]]);
    assert_eq!(ids(&hold.followers), [a[1], a[2], b[1], b[2]]);
    assert!(hold.followers.iter().all(|m| m.attempts == 1 && m.ordered));
    store.register_hold(&hold).await.unwrap();
    // The followers stay waiting; nothing else can take them or their heads meanwhile.
    assert_eq!(state(&db, a[1]), "waiting");
    assert!(
        store
            .take(10, HOLD, &topics, None, 8)
            .await
            .unwrap()
            .is_none()
    );
    drop(locker);

    // a: its head and first follower delivered, the second not started: it becomes the head.
    // b: its head delivered, its first follower failed (leased for its retry), the last untouched.
    // c, d: heads delivered; the next due message of each becomes the head, or is scheduled.
    let delivered = [a[0], a[1], b[0], c[0], d[0], u[0]];
    let (ended, _) = store
        .end_hold(hold, &delivered, &[b[1]], LEASE, 0)
        .await
        .unwrap();
    assert_eq!((ended.deleted, ended.leased), (6, 1));
    let states = |ids: &[i64]| ids.iter().map(|&i| state(&db, i)).collect::<Vec<_>>();
    assert_eq!(
        states(&a),
        ["gone", "gone", "available", "waiting", "waiting"]
    );
    assert_eq!(states(&b), ["gone", "running", "waiting"]);
    assert_eq!(states(&c), ["gone", "scheduled", "waiting"]);
    assert_eq!(states(&d), ["gone", "available", "waiting"]);
}
