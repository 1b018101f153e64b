//! The upkeep's walks under a pinned xmin horizon (migration `upkeep_windows`): the rescue of
//! expired leases, the finish of kept heads and the promotion of due scheduled messages start
//! where the store's previous pass ended, so what a pin keeps of the rows that went through those
//! states before is not read again on every pass; and what a window cannot see (a row made due
//! below it) is handled by the next walk of the whole index.

mod common;

use std::time::Duration;

use common::{TestDb, enqueue, eventually};
use diesel::connection::SimpleConnection;
use postbox::{Message, Topics};

const LEASE: Duration = Duration::from_secs(30);

/// Buffers (hit + read) of the top node of each `-- name` section of `plan`.
fn buffers(plan: &str, section: &str) -> f64 {
    plan.split("-- ")
        .find(|s| s.starts_with(section))
        .unwrap_or_else(|| panic!("no section {section} in {plan}"))
        .lines()
        .find(|l| l.trim_start().starts_with("Buffers:"))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|w| w.split_once('='))
                .filter(|(k, _)| matches!(*k, "hit" | "read"))
                .filter_map(|(_, v)| v.parse::<f64>().ok())
                .sum()
        })
        .unwrap_or(0.0)
}

/// 5,000 messages leased and 5,000 scheduled, each then moved a minute or so into the past (in an
/// order of their own, so that a walk visits their heap pages in no order) and deleted while a snapshot pins the horizon: their index entries stay where every walk from the
/// front steps over them. A store that has passed once since reads none of them; a new store
/// (whose first pass walks everything) reads them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upkeep_walks_under_a_pinned_horizon_read_what_came_since_their_last_pass() {
    let db = TestDb::migrated();
    db.exec("ALTER TABLE postbox.messages SET (autovacuum_enabled = false)");
    let store = db.store().await;
    store.rescue_expired().await.unwrap();
    store.finish_heads().await.unwrap();
    store.promote_due().await.unwrap();

    let mut pin = db.conn();
    pin.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM postbox.turns")
        .unwrap();
    db.exec(
        "INSERT INTO postbox.messages (topic) SELECT 't' FROM generate_series(1, 5000);
         SELECT count(*) FROM postbox.claim(5000, 30, true, '{}', '{}', '{}', '{}', 1, 'x');
         UPDATE postbox.messages SET locked_until = now() - interval '1 minute' - random() * interval '30 seconds'
             WHERE state = 'running';
         DELETE FROM postbox.messages WHERE state = 'running';
         INSERT INTO postbox.messages (topic, run_at)
             SELECT 's', now() + interval '1 day' FROM generate_series(1, 5000);
         UPDATE postbox.messages SET run_at = now() - interval '1 minute' - random() * interval '30 seconds'
             WHERE state = 'scheduled';
         DELETE FROM postbox.messages WHERE topic = 's';
         INSERT INTO postbox.messages (topic, run_at) VALUES ('later', now() + interval '1 hour')",
    );
    let windowed = store.explain_upkeep().await.unwrap();
    let whole = db.store().await.explain_upkeep().await.unwrap();
    for section in ["rescue", "finish heads", "promote"] {
        let (w, all) = (buffers(&windowed, section), buffers(&whole, section));
        eprintln!("{section}: {w} buffers from the window, {all} from the front");
        assert!(
            w <= 100.0,
            "{section} read {w} buffers from its window:\n{windowed}"
        );
        assert!(
            all >= 2_500.0,
            "{section} read {all} buffers from the front: the pin kept no entries?\n{whole}"
        );
    }
    pin.batch_execute("ROLLBACK").unwrap();
}

/// A lease that expires after a pass is rescued by the next (windowed) one; one moved below the
/// window by hand waits for the next walk of the whole index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_are_rescued_from_the_window_and_below_it_by_the_whole_walk() {
    let db = TestDb::migrated();
    let store = db
        .store()
        .await
        .with_upkeep_sweep(Duration::from_secs(3600));
    assert!(store.rescue_expired().await.unwrap().retried.is_empty());
    let ids = enqueue(&db, vec![Message::new("t"), Message::new("t")]);
    let claimed = store
        .claim(1, Duration::from_millis(200), &Topics::only(["t"]))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    let rescued = eventually(Duration::from_secs(20), || async {
        store.rescue_expired().await.unwrap().retried == [claimed[0].id]
    })
    .await;
    assert!(
        rescued,
        "a lease that expired in the window was not rescued"
    );

    let other = ids.iter().copied().find(|&id| id != claimed[0].id).unwrap();
    let below = store.claim(1, LEASE, &Topics::only(["t"])).await.unwrap();
    assert_eq!(below[0].id, other);
    db.exec(&format!(
        "UPDATE postbox.messages SET locked_until = now() - interval '1 minute' WHERE id = {other}"
    ));
    assert!(store.rescue_expired().await.unwrap().retried.is_empty());
    let whole = store.clone().with_upkeep_sweep(Duration::ZERO);
    assert_eq!(whole.rescue_expired().await.unwrap().retried, [other]);
}

/// The same for scheduled messages: one due after a pass is promoted by the next; one made due
/// below the window by hand, by the next walk of the whole index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduled_messages_are_promoted_from_the_window_and_below_it_by_the_whole_walk() {
    let db = TestDb::migrated();
    let store = db
        .store()
        .await
        .with_upkeep_sweep(Duration::from_secs(3600));
    assert_eq!(store.promote_due().await.unwrap().promoted, 0);
    let ids = enqueue(
        &db,
        vec![
            Message::new("t").delay(Duration::from_millis(200)),
            Message::new("t").delay(Duration::from_secs(3600)),
        ],
    );
    let promoted = eventually(Duration::from_secs(20), || async {
        store.promote_due().await.unwrap().promoted == 1
    })
    .await;
    assert!(promoted, "a message due in the window was not promoted");
    db.exec(&format!(
        "UPDATE postbox.messages SET run_at = now() - interval '1 minute' WHERE id = {}",
        ids[1]
    ));
    assert_eq!(store.promote_due().await.unwrap().promoted, 0);
    let whole = store.clone().with_upkeep_sweep(Duration::ZERO);
    assert_eq!(whole.promote_due().await.unwrap().promoted, 1);
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE state = 'available'"),
        2
    );
}
