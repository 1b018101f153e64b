//! The message state machine of DESIGN §2 against a real PostgreSQL: claim, complete, retry,
//! dead-letter, release, extend, rescue, fencing, per-key order, dead letters, stats, wake-up.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{TestDb, enqueue};
use diesel_async::SimpleAsyncConnection;
use postbox::store::{Dead, DeadSelector, Retry};
use postbox::{Backoff, Message, Store, Topics};

const LEASE: Duration = Duration::from_secs(30);

/// Makes every message claimable now (the test's stand-in for waiting out a backoff).
fn make_due(db: &TestDb) {
    db.exec("UPDATE postbox.messages SET run_at = now() WHERE state = 'scheduled'; SELECT postbox.promote_due(1000000)");
}

/// Expires every lease now (the test's stand-in for a relay that died).
fn expire_leases(db: &TestDb) {
    db.exec("UPDATE postbox.messages SET locked_until = now() - interval '1 second' WHERE locked_until IS NOT NULL");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_concurrent_claimers_claim_each_message_exactly_once() {
    let db = TestDb::migrated();
    let msgs: Vec<Message> = (0..10_000)
        .map(|i| Message::new("load").payload(&i))
        .collect();
    let ids = enqueue(&db, msgs);
    let store = db.store().await;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let store = store.clone();
            let seen = seen.clone();
            tokio::spawn(async move {
                loop {
                    let batch = store.claim(64, LEASE, &Topics::all()).await.unwrap();
                    if batch.is_empty() {
                        break;
                    }
                    let leases: Vec<_> = batch.iter().map(|m| m.lease()).collect();
                    seen.lock().unwrap().extend(batch.iter().map(|m| m.id));
                    let done = store.complete(&leases).await.unwrap();
                    assert!(done.fenced.is_empty());
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    let mut seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen.len(),
        10_000,
        "some message was claimed twice or never"
    );
    seen.sort_unstable();
    let mut expected = ids;
    expected.sort_unstable();
    assert_eq!(seen, expected);
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_respects_topics_run_at_and_priority_and_uses_an_attempt() {
    let db = TestDb::migrated();
    let ids = enqueue(
        &db,
        vec![
            Message::new("a.one"),
            Message::new("b"),
            Message::new("a.two").priority(-1),
            Message::new("a.later").delay(Duration::from_secs(3600)),
            Message::new("c"),
        ],
    );
    let store = db.store().await;
    let got = store
        .claim(10, LEASE, &Topics::only(["a.*", "c"]))
        .await
        .unwrap();
    let order: Vec<i64> = got.iter().map(|m| m.id).collect();
    assert_eq!(
        order,
        vec![ids[2], ids[0], ids[4]],
        "priority first, then id; b and the delayed one stay"
    );
    assert!(
        got.iter()
            .all(|m| m.attempts == 1 && m.locked_until > chrono::Utc::now())
    );
    // Claimed rows are not claimable again.
    assert!(
        store
            .claim(10, LEASE, &Topics::only(["a.*", "c"]))
            .await
            .unwrap()
            .is_empty()
    );
    let b = store.claim(10, LEASE, &Topics::all()).await.unwrap();
    assert_eq!(b.iter().map(|m| m.id).collect::<Vec<_>>(), vec![ids[1]]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_settlement_from_an_expired_reclaimed_lease_is_fenced() {
    let db = TestDb::migrated();
    enqueue(&db, vec![Message::new("t").payload(&1)]);
    let store = db.store().await;
    let first = store
        .claim(1, LEASE, &Topics::all())
        .await
        .unwrap()
        .remove(0);
    expire_leases(&db);
    let rescued = store.rescue_expired().await.unwrap();
    assert_eq!(rescued.retried, vec![first.id]);
    make_due(&db);
    let second = store
        .claim(1, LEASE, &Topics::all())
        .await
        .unwrap()
        .remove(0);
    assert_eq!(second.id, first.id);
    assert_ne!(second.lease_token, first.lease_token);

    // The first holder comes back late: every operation is fenced and changes nothing.
    let c = store.complete(&[first.lease()]).await.unwrap();
    assert_eq!((c.done.len(), c.fenced.clone()), (0, vec![first.id]));
    let r = store
        .retry(&[Retry {
            lease: first.lease(),
            error: "late".into(),
            delay: None,
        }])
        .await
        .unwrap();
    assert_eq!(r.fenced, vec![first.id]);
    let d = store
        .dead_letter(&[Dead {
            lease: first.lease(),
            reason: "late".into(),
        }])
        .await
        .unwrap();
    assert_eq!(d.fenced, vec![first.id]);
    assert_eq!(
        store.release(&[first.lease()]).await.unwrap().fenced,
        vec![first.id]
    );
    assert_eq!(
        store.extend(&[first.lease()], LEASE).await.unwrap().fenced,
        vec![first.id]
    );
    let untouched = db.scalar(&format!(
        "SELECT count(*) AS v FROM postbox.messages WHERE id = {} AND lease_token = {} AND attempts = 2
         AND last_error LIKE 'lease expired%'",
        first.id, second.lease_token
    ));
    assert_eq!(untouched, 1);
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters"),
        0
    );

    // The current holder settles normally.
    assert_eq!(
        store.complete(&[second.lease()]).await.unwrap().done,
        vec![second.id]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backoff_is_persisted_and_grows() {
    let db = TestDb::migrated();
    let [id] = enqueue(&db, vec![Message::new("t").max_attempts(10)])[..] else {
        unreachable!()
    };
    let backoff = Backoff {
        base: Duration::from_secs(10),
        cap: Duration::from_secs(100),
        jitter: 0.1,
    };
    let store = db.store().await.with_backoff(backoff).unwrap();
    let mut waits = Vec::new();
    for attempt in 1..=5 {
        let m = store
            .claim(1, LEASE, &Topics::all())
            .await
            .unwrap()
            .remove(0);
        assert_eq!(m.attempts, attempt);
        let r = store
            .retry(&[Retry {
                lease: m.lease(),
                error: format!("boom {attempt}"),
                delay: None,
            }])
            .await
            .unwrap();
        assert_eq!(r.retried, vec![id]);
        // Stored in the row: seconds from now until run_at.
        let wait_ms = db.scalar(&format!(
            "SELECT (extract(epoch FROM run_at - now()) * 1000)::bigint AS v FROM postbox.messages WHERE id = {id}"
        ));
        let (lo, hi) = backoff.bounds(attempt);
        assert!(
            wait_ms as u128 >= lo.as_millis() - 200 && wait_ms as u128 <= hi.as_millis(),
            "attempt {attempt}: waits {wait_ms} ms, expected {lo:?}..{hi:?}"
        );
        waits.push(wait_ms);
        // Not claimable before run_at.
        assert!(
            store
                .claim(1, LEASE, &Topics::all())
                .await
                .unwrap()
                .is_empty()
        );
        make_due(&db);
    }
    assert!(
        waits[0] < waits[1] && waits[1] < waits[2] && waits[2] < waits[3],
        "{waits:?}"
    );
    assert!(waits[4] <= 110_000, "capped: {waits:?}");
    let errors = db.scalar(&format!(
        "SELECT count(*) AS v FROM postbox.messages WHERE id = {id} AND first_error = 'boom 1' AND last_error = 'boom 5'"
    ));
    assert_eq!(errors, 1);

    // A requested delay overrides the backoff.
    let m = store
        .claim(1, LEASE, &Topics::all())
        .await
        .unwrap()
        .remove(0);
    store
        .retry(&[Retry {
            lease: m.lease(),
            error: "later".into(),
            delay: Some(Duration::from_secs(500)),
        }])
        .await
        .unwrap();
    let wait = db.scalar(&format!(
        "SELECT extract(epoch FROM run_at - now())::bigint AS v FROM postbox.messages WHERE id = {id}"
    ));
    assert!((498..=500).contains(&wait), "{wait}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_at_max_attempts_dead_letters_with_the_reason() {
    let db = TestDb::migrated();
    let [id] = enqueue(
        &db,
        vec![Message::new("t").payload(&"p").key("k").max_attempts(2)],
    )[..] else {
        unreachable!()
    };
    let store = db.store().await;
    let m = store
        .claim(1, LEASE, &Topics::all())
        .await
        .unwrap()
        .remove(0);
    let r = store
        .retry(&[Retry {
            lease: m.lease(),
            error: "first failure".into(),
            delay: None,
        }])
        .await
        .unwrap();
    assert_eq!(r.retried, vec![id]);
    make_due(&db);
    let m = store
        .claim(1, LEASE, &Topics::all())
        .await
        .unwrap()
        .remove(0);
    assert!(m.is_last_attempt());
    assert_eq!(m.last_error.as_deref(), Some("first failure"));
    let r = store
        .retry(&[Retry {
            lease: m.lease(),
            error: "second failure".into(),
            delay: None,
        }])
        .await
        .unwrap();
    assert_eq!((r.retried.len(), r.dead.clone()), (0, vec![id]));
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
    let dead = store.dead_list(None, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    let d = &dead[0];
    assert_eq!((d.id, d.attempts, d.max_attempts), (id, 2, 2));
    assert_eq!(d.payload, serde_json::json!("p"));
    assert_eq!(d.key.as_deref(), Some("k"));
    assert_eq!(d.first_error.as_deref(), Some("first failure"));
    assert_eq!(d.last_error.as_deref(), Some("second failure"));
    assert!(
        d.reason.contains("attempts exhausted (2 of 2)") && d.reason.contains("second failure"),
        "{}",
        d.reason
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanent_failure_dead_letters_at_once() {
    let db = TestDb::migrated();
    enqueue(&db, vec![Message::new("t"), Message::new("t")]);
    let store = db.store().await;
    let ms = store.claim(2, LEASE, &Topics::all()).await.unwrap();
    let dead: Vec<Dead> = ms
        .iter()
        .map(|m| Dead {
            lease: m.lease(),
            reason: "schema mismatch".into(),
        })
        .collect();
    assert_eq!(store.dead_letter(&dead).await.unwrap().done.len(), 2);
    let listed = store.dead_list(Some("t"), 10).await.unwrap();
    assert!(
        listed
            .iter()
            .all(|d| d.reason == "schema mismatch" && d.attempts == 1)
    );
    assert_eq!(listed.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_hands_back_without_using_an_attempt() {
    let db = TestDb::migrated();
    let [id] = enqueue(&db, vec![Message::new("t").max_attempts(1)])[..] else {
        unreachable!()
    };
    let store = db.store().await;
    for _ in 0..5 {
        let m = store
            .claim(1, LEASE, &Topics::all())
            .await
            .unwrap()
            .remove(0);
        assert_eq!(m.attempts, 1);
        assert_eq!(store.release(&[m.lease()]).await.unwrap().done, vec![id]);
        assert_eq!(
            db.scalar(&format!("SELECT attempts::bigint AS v FROM postbox.messages WHERE id = {id} AND locked_until IS NULL")),
            0
        );
    }
    // Still deliverable on its one attempt.
    let m = store
        .claim(1, LEASE, &Topics::all())
        .await
        .unwrap()
        .remove(0);
    assert_eq!(store.complete(&[m.lease()]).await.unwrap().done, vec![id]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extend_moves_the_lease() {
    let db = TestDb::migrated();
    enqueue(&db, vec![Message::new("t")]);
    let store = db.store().await;
    let m = store
        .claim(1, Duration::from_secs(5), &Topics::all())
        .await
        .unwrap()
        .remove(0);
    store
        .extend(&[m.lease()], Duration::from_secs(600))
        .await
        .unwrap();
    let left = db.scalar(
        "SELECT extract(epoch FROM locked_until - now())::bigint AS v FROM postbox.messages",
    );
    assert!((598..=600).contains(&left), "{left}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rescue_returns_expired_leases_or_dead_letters_the_exhausted() {
    let db = TestDb::migrated();
    let ids = enqueue(
        &db,
        vec![
            Message::new("t").max_attempts(3),
            Message::new("t").max_attempts(1),
            Message::new("t"),
        ],
    );
    let store = db.store().await;
    let claimed = store.claim(2, LEASE, &Topics::all()).await.unwrap();
    assert_eq!(claimed.len(), 2);
    // Nothing expired yet: rescue does nothing.
    assert_eq!(store.rescue_expired().await.unwrap(), Default::default());
    expire_leases(&db);
    let r = store.rescue_expired().await.unwrap();
    assert_eq!(r.retried, vec![ids[0]]);
    assert_eq!(r.dead, vec![ids[1]]);
    let back = db.scalar(&format!(
        "SELECT count(*) AS v FROM postbox.messages WHERE id = {} AND locked_until IS NULL AND lease_token IS NULL
         AND attempts = 1 AND run_at > now() AND last_error LIKE 'lease expired on attempt 1 (held by %'",
        ids[0]
    ));
    assert_eq!(back, 1);
    let dead = store.dead_list(None, 10).await.unwrap();
    assert!(
        dead[0]
            .reason
            .starts_with("attempts exhausted (1 of 1): lease expired"),
        "{}",
        dead[0].reason
    );
    // The untouched pending message stays pending.
    assert_eq!(
        db.scalar(&format!(
            "SELECT attempts::bigint AS v FROM postbox.messages WHERE id = {}",
            ids[2]
        )),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordered_keys_are_delivered_one_at_a_time_in_order_under_concurrent_claimers() {
    let db = TestDb::migrated();
    let mut msgs = Vec::new();
    for i in 0..60 {
        for k in 0..5 {
            msgs.push(
                Message::new("acct")
                    .key(format!("k{k}"))
                    .ordered()
                    .payload(&i),
            );
        }
        msgs.push(Message::new("acct").key("free").payload(&i)); // unordered: flows freely
    }
    let ids = enqueue(&db, msgs);
    assert_eq!(ids.len(), 360);
    let store = db.store().await;
    let held: Arc<Mutex<HashSet<String>>> = Default::default();
    let delivered: Arc<Mutex<HashMap<String, Vec<i64>>>> = Default::default();
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let (store, held, delivered) = (store.clone(), held.clone(), delivered.clone());
            tokio::spawn(async move {
                let mut idle = 0;
                while idle < 50 {
                    let batch = store.claim(8, LEASE, &Topics::all()).await.unwrap();
                    if batch.is_empty() {
                        idle += 1;
                        tokio::task::yield_now().await;
                        continue;
                    }
                    idle = 0;
                    for m in &batch {
                        if m.ordered {
                            let k = m.key.clone().unwrap();
                            assert!(
                                held.lock().unwrap().insert(k.clone()),
                                "two messages of {k} held at once"
                            );
                            delivered.lock().unwrap().entry(k).or_default().push(m.id);
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(w)).await;
                    for m in &batch {
                        if m.ordered {
                            held.lock().unwrap().remove(m.key.as_ref().unwrap());
                        }
                    }
                    let leases: Vec<_> = batch.iter().map(|m| m.lease()).collect();
                    store.complete(&leases).await.unwrap();
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
    let delivered = delivered.lock().unwrap();
    assert_eq!(delivered.len(), 5);
    for (k, seq) in delivered.iter() {
        assert_eq!(seq.len(), 60, "{k}");
        assert!(
            seq.windows(2).all(|w| w[0] < w[1]),
            "{k} out of order: {seq:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_head_blocks_only_its_own_key_and_dead_lettering_it_unblocks_the_next() {
    let db = TestDb::migrated();
    let ids = enqueue(
        &db,
        vec![
            Message::new("t").key("a").ordered(),
            Message::new("t").key("a").ordered(),
            Message::new("t").key("b").ordered(),
            Message::new("other").key("a").ordered(), // same key, other topic: independent
        ],
    );
    let store = db.store().await;
    let first = store.claim(10, LEASE, &Topics::all()).await.unwrap();
    assert_eq!(
        first.iter().map(|m| m.id).collect::<Vec<_>>(),
        vec![ids[0], ids[2], ids[3]]
    );
    assert!(
        store
            .claim(10, LEASE, &Topics::all())
            .await
            .unwrap()
            .is_empty()
    );
    // A retried head still blocks (it is pending, earlier).
    store
        .retry(&[Retry {
            lease: first[0].lease(),
            error: "x".into(),
            delay: None,
        }])
        .await
        .unwrap();
    make_due(&db);
    let again = store.claim(10, LEASE, &Topics::all()).await.unwrap();
    assert_eq!(again.iter().map(|m| m.id).collect::<Vec<_>>(), vec![ids[0]]);
    // Dead-lettering the head lets the next of its key go.
    store
        .dead_letter(&[Dead {
            lease: again[0].lease(),
            reason: "poison".into(),
        }])
        .await
        .unwrap();
    let next = store.claim(10, LEASE, &Topics::all()).await.unwrap();
    assert_eq!(next.iter().map(|m| m.id).collect::<Vec<_>>(), vec![ids[1]]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_replay_with_their_ids_and_purge() {
    let db = TestDb::migrated();
    let ids = enqueue(
        &db,
        vec![
            Message::new("a")
                .payload(&1)
                .dedup_key("once")
                .max_attempts(3),
            Message::new("a").payload(&2),
            Message::new("b").payload(&3),
        ],
    );
    let store = db.store().await;
    let ms = store.claim(3, LEASE, &Topics::all()).await.unwrap();
    store
        .dead_letter(
            &ms.iter()
                .map(|m| Dead {
                    lease: m.lease(),
                    reason: "bad".into(),
                })
                .collect::<Vec<_>>(),
        )
        .await
        .unwrap();
    assert_eq!(store.stats().await.unwrap().dead_total(), 3);

    // A live message holding the dedup key keeps its dead twin dead.
    postbox::enqueue(&mut db.conn(), &Message::new("a").dedup_key("once")).unwrap();
    let r = store
        .dead_replay(&DeadSelector::Topic("a".into()))
        .await
        .unwrap();
    assert_eq!(r.replayed, vec![ids[1]]);
    assert_eq!(r.skipped, vec![ids[0]]);
    let revived = db.scalar(&format!(
        "SELECT count(*) AS v FROM postbox.messages WHERE id = {} AND attempts = 0 AND locked_until IS NULL
         AND run_at <= now() AND payload = '2' AND last_error = 'replayed after: bad'",
        ids[1]
    ));
    assert_eq!(revived, 1);
    let again = store.claim(10, LEASE, &Topics::only(["a"])).await.unwrap();
    assert!(again.iter().any(|m| m.id == ids[1] && m.attempts == 1));

    assert_eq!(
        store
            .dead_purge(&DeadSelector::OlderThan(Duration::from_secs(3600)))
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        store
            .dead_purge(&DeadSelector::Ids(vec![ids[2]]))
            .await
            .unwrap(),
        1
    );
    assert_eq!(store.dead_purge(&DeadSelector::All).await.unwrap(), 1);
    assert!(store.dead_list(None, 10).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_count_each_state_per_topic() {
    let db = TestDb::migrated();
    enqueue(
        &db,
        vec![
            Message::new("a"),
            Message::new("a"),
            Message::new("a").delay(Duration::from_secs(600)),
            Message::new("b"),
        ],
    );
    common::move_intake(&db);
    db.exec("UPDATE postbox.messages SET run_at = now() - interval '90 seconds' WHERE topic = 'a' AND run_at <= now()");
    let store = db.store().await;
    let m = store
        .claim(1, LEASE, &Topics::only(["b"]))
        .await
        .unwrap()
        .remove(0);
    store
        .dead_letter(&[Dead {
            lease: m.lease(),
            reason: "x".into(),
        }])
        .await
        .unwrap();
    enqueue(&db, vec![Message::new("b")]);
    store.claim(1, LEASE, &Topics::only(["b"])).await.unwrap();
    let s = store.stats().await.unwrap();
    let a = s.topics.iter().find(|t| t.topic == "a").unwrap();
    assert_eq!((a.available, a.scheduled, a.running, a.dead), (2, 1, 0, 0));
    assert!((89.0..100.0).contains(&a.oldest_available_secs.unwrap()));
    let b = s.topics.iter().find(|t| t.topic == "b").unwrap();
    assert_eq!((b.available, b.scheduled, b.running, b.dead), (0, 0, 1, 1));
    assert_eq!(b.oldest_available_secs, None);
    assert_eq!((s.live_total(), s.dead_total()), (4, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inserts_notify_only_while_a_listener_waits() {
    use futures_util::StreamExt;
    let db = TestDb::migrated();
    let mut listener = db.aconn().await;
    postbox::store::listen(&mut listener).await.unwrap();
    let mut writer = db.aconn().await;

    // Nobody registered: the insert sends nothing; the marker sent after it arrives first.
    postbox::enqueue_async(&mut writer, &Message::new("t"))
        .await
        .unwrap();
    writer
        .batch_execute("NOTIFY postbox, 'marker'")
        .await
        .unwrap();
    {
        let mut stream = std::pin::pin!(listener.notifications_stream());
        let n = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(
            n.payload, "marker",
            "an insert notified although nobody waited"
        );
    }

    postbox::store::register_listener(&mut listener)
        .await
        .unwrap();
    postbox::enqueue_async(&mut writer, &Message::new("t"))
        .await
        .unwrap();
    {
        let mut stream = std::pin::pin!(listener.notifications_stream());
        let n = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!((n.channel.as_str(), n.payload.as_str()), ("postbox", ""));
    }

    postbox::store::unregister_listener(&mut listener)
        .await
        .unwrap();
    postbox::enqueue_async(&mut writer, &Message::new("t"))
        .await
        .unwrap();
    writer
        .batch_execute("NOTIFY postbox, 'marker2'")
        .await
        .unwrap();
    let mut stream = std::pin::pin!(listener.notifications_stream());
    let n = tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(n.payload, "marker2");
}

/// A writer whose INSERT began before a relay registered (so its commit sends no NOTIFY) but has
/// not built its first row yet is among the transactions the registration watches: the insert
/// trigger gives it its transaction id before it looks for listeners. Held here on an advisory
/// lock inside its `INSERT … SELECT`; without the id, it was in neither and its message waited
/// for the poll interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_that_looked_before_a_registration_is_watched_by_it() {
    use diesel::connection::SimpleConnection;
    let db = TestDb::migrated();
    let mut gate = db.conn();
    gate.batch_execute("SELECT pg_advisory_lock(4242)").unwrap();
    let url = db.url.clone();
    let writer = std::thread::spawn(move || {
        use diesel::Connection;
        let mut c = diesel::PgConnection::establish(&url).unwrap();
        c.batch_execute(
            "SET application_name = 'held-writer';
             BEGIN;
             INSERT INTO postbox.messages (topic) SELECT 't' FROM (SELECT pg_advisory_xact_lock(4242)) g;
             COMMIT;",
        )
        .unwrap();
    });
    let held = "SELECT count(*) AS v FROM pg_stat_activity
                WHERE application_name = 'held-writer' AND wait_event_type = 'Lock'";
    assert!(
        common::eventually(Duration::from_secs(10), || async { db.scalar(held) == 1 }).await,
        "the writer never waited on the gate"
    );
    let writer_xid = db.scalar(
        "SELECT coalesce(backend_xid::text::bigint, 0) AS v FROM pg_stat_activity
         WHERE application_name = 'held-writer'",
    );
    assert_ne!(
        writer_xid, 0,
        "the writer looked for listeners without a transaction id"
    );
    let mut listener = db.aconn().await;
    postbox::store::listen(&mut listener).await.unwrap();
    let watched = postbox::store::register_listener(&mut listener)
        .await
        .unwrap();
    assert!(
        watched.contains(&writer_xid),
        "{writer_xid} not in {watched:?}"
    );
    gate.batch_execute("SELECT pg_advisory_unlock(4242)")
        .unwrap();
    writer.join().unwrap();
    let left = postbox::store::still_running(&mut listener, &watched)
        .await
        .unwrap();
    assert!(!left.contains(&writer_xid), "its end is seen: {left:?}");
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_plan_walks_the_claim_index_even_with_stale_statistics() {
    let db = TestDb::migrated();
    // The hard case: statistics say the table is empty, then a bulk insert lands.
    db.exec("VACUUM ANALYZE postbox.messages");
    db.exec("INSERT INTO postbox.messages (topic, payload) SELECT 'bulk', to_jsonb(g) FROM generate_series(1, 100000) g");
    let store: Store = db.store().await;
    let plan = store
        .explain_claim(100, &Topics::only(["bulk"]))
        .await
        .unwrap();
    assert!(plan.contains("messages_ready_topic_idx"), "{plan}");
    assert!(!plan.contains("Seq Scan on messages"), "{plan}");
    assert!(!plan.contains("Sort"), "{plan}");
    // And the function itself claims in order.
    let got = store
        .claim(100, LEASE, &Topics::only(["bulk"]))
        .await
        .unwrap();
    assert_eq!(got.len(), 100);
    assert!(got.windows(2).all(|w| w[0].id < w[1].id) && got[0].payload == serde_json::json!(1));
}
