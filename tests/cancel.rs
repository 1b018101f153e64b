//! Cancelling messages against a real PostgreSQL: pending, scheduled and waiting messages go to
//! the dead letters with reason `cancelled` (and can be replayed); a running one finishes its
//! attempt and is not retried, whether the attempt fails or its lease expires; an ordered key
//! whose head is cancelled goes on with the next message.

mod common;

use std::time::Duration;

use common::{TestDb, enqueue, eventually};
use postbox::store::{CancelSelector, Cancelled, DeadSelector, Retry};
use postbox::{Message, Topics};

const LEASE: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_messages_go_to_the_dead_letters_and_running_ones_are_not_retried() {
    let db = TestDb::migrated();
    let store = db.store().await;
    let reason = |id: i64| {
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.dead_letters WHERE id = {id} AND reason = 'cancelled'"
        ))
    };
    let state = |id: i64| {
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.messages WHERE id = {id} AND state = 'available'"
        ))
    };

    // Running: one fails its attempt, one succeeds.
    let r = enqueue(&db, vec![Message::new("r"), Message::new("r")]);
    let claimed = store.claim(2, LEASE, &Topics::exact(["r"])).await.unwrap();
    assert_eq!(claimed.len(), 2);
    let got = store.cancel(&CancelSelector::Ids(r.clone())).await.unwrap();
    assert_eq!(
        got,
        Cancelled {
            dead: 0,
            running: 2
        }
    );
    let (failed, delivered) = (&claimed[0], &claimed[1]);
    let report = store
        .retry(&[Retry {
            lease: failed.lease(),
            error: "boom".into(),
            delay: None,
        }])
        .await
        .unwrap();
    assert_eq!(report.dead, [failed.id], "{report:?}");
    assert_eq!(reason(failed.id), 1);
    store.complete(&[delivered.lease()]).await.unwrap();
    assert_eq!(
        reason(delivered.id),
        0,
        "a delivered message is not a dead letter"
    );

    // A whole topic: pending, scheduled and an ordered key; another topic is untouched.
    let t = enqueue(
        &db,
        vec![
            Message::new("t"),
            Message::new("t").delay(Duration::from_secs(3600)),
            Message::new("t").key("k").ordered(),
            Message::new("t").key("k").ordered(),
        ],
    );
    let u = enqueue(&db, vec![Message::new("u")]);
    let got = store
        .cancel(&CancelSelector::Topic("t".into()))
        .await
        .unwrap();
    assert_eq!(
        got,
        Cancelled {
            dead: 4,
            running: 0
        }
    );
    assert!(t.iter().all(|&id| reason(id) == 1));
    common::move_intake(&db);
    assert_eq!(state(u[0]), 1);

    // The head of an ordered key: the next one takes its place.
    let k = enqueue(
        &db,
        (0..3)
            .map(|_| Message::new("v").key("k").ordered())
            .collect(),
    );
    store
        .cancel(&CancelSelector::Ids(vec![k[0]]))
        .await
        .unwrap();
    assert_eq!((reason(k[0]), state(k[1])), (1, 1));
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.messages WHERE id = {} AND state = 'waiting'",
            k[2]
        )),
        1
    );

    // A running message whose lease expires is not retried either.
    let w = enqueue(&db, vec![Message::new("w")]);
    store
        .claim(1, Duration::from_millis(200), &Topics::exact(["w"]))
        .await
        .unwrap();
    store.cancel(&CancelSelector::Ids(w.clone())).await.unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            store.rescue_expired().await.unwrap();
            reason(w[0]) == 1
        })
        .await
    );

    // Cancelled messages replay like any dead letter.
    let replayed = store
        .dead_replay(&DeadSelector::Ids(vec![t[0]]))
        .await
        .unwrap();
    assert_eq!(replayed.replayed, [t[0]]);
    assert_eq!(state(t[0]), 1);
    assert!(
        store
            .cancel(&CancelSelector::Ids(Vec::new()))
            .await
            .is_err(),
        "nothing named"
    );
}

/// A message cancelled while it ran and then snoozed by its handler goes to the dead letters with
/// reason `cancelled`, its own errors kept (not the text a snooze past the cap would record).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_cancelled_while_running_and_then_snoozed_is_a_cancelled_dead_letter() {
    let db = TestDb::migrated();
    let store = db.store().await;
    let ids = enqueue(&db, vec![Message::new("s")]);
    common::move_intake(&db);
    db.exec(&format!(
        "UPDATE postbox.messages SET last_error = 'earlier', first_error = 'first' WHERE id = {}",
        ids[0]
    ));
    let claimed = store.claim(1, LEASE, &Topics::exact(["s"])).await.unwrap();
    store
        .cancel(&CancelSelector::Ids(ids.clone()))
        .await
        .unwrap();
    let report = store
        .snooze(
            &[postbox::store::Snooze {
                lease: claimed[0].lease(),
                delay: Duration::from_secs(60),
            }],
            5,
        )
        .await
        .unwrap();
    assert_eq!(report.dead, ids, "{report:?}");
    assert!(report.snoozed.is_empty(), "{report:?}");
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.dead_letters
             WHERE id = {} AND reason = 'cancelled' AND last_error = 'earlier' AND first_error = 'first'",
            ids[0]
        )),
        1
    );
}
