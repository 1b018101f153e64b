//! Running limits across relays, against a real PostgreSQL: several engines with slow handlers
//! never run more messages of a limited topic at once than the limit (in all, or per key), while
//! other topics run unlimited beside them.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{TestDb, enqueue, eventually};
use postbox::Message;
use postbox::engine::Engine;
use postbox::sink::handlers::{Handlers, Job};
use postbox::store::Limit;
use tokio_util::sync::CancellationToken;

/// Running handlers per group (a topic family or a key), and the most seen at once.
#[derive(Default)]
struct Peaks {
    now: HashMap<String, usize>,
    peak: HashMap<String, usize>,
    done: usize,
}

type Shared = Arc<Mutex<Peaks>>;

fn slow_handlers(
    topics: &[&str],
    group: fn(&Job<serde_json::Value>) -> String,
    peaks: Shared,
) -> Handlers {
    let mut h = Handlers::new();
    for t in topics {
        let peaks = peaks.clone();
        h = h.on(*t, move |job: Job<serde_json::Value>| {
            let peaks = peaks.clone();
            async move {
                let g = group(&job);
                {
                    let mut p = peaks.lock().unwrap();
                    let n = p.now.entry(g.clone()).or_default();
                    *n += 1;
                    let n = *n;
                    let peak = p.peak.entry(g.clone()).or_default();
                    *peak = (*peak).max(n);
                }
                // The work: long enough for the claims of every engine to overlap it.
                tokio::time::sleep(Duration::from_millis(25)).await;
                let mut p = peaks.lock().unwrap();
                *p.now.get_mut(&g).unwrap() -= 1;
                p.done += 1;
                Ok(())
            }
        });
    }
    h
}

async fn run_engines(
    db: &TestDb,
    n: usize,
    handlers: impl Fn() -> Handlers,
    limit: Limit,
    total: usize,
    peaks: &Shared,
) {
    let stop = CancellationToken::new();
    let mut engines = Vec::new();
    for _ in 0..n {
        let e = Engine::builder(db.url.clone())
            .handlers(handlers())
            .limit(limit.clone())
            .poll_interval(Duration::from_millis(50))
            .build()
            .await
            .unwrap();
        engines.push(tokio::spawn(e.run(stop.clone())));
    }
    assert!(
        eventually(Duration::from_secs(60), || async {
            peaks.lock().unwrap().done >= total
        })
        .await,
        "all {total} delivered within 60 s (done {})",
        peaks.lock().unwrap().done
    );
    stop.cancel();
    for e in engines {
        e.await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_engines_never_run_more_of_a_limited_topic_than_its_limit() {
    let db = TestDb::migrated();
    let mut msgs = Vec::new();
    for i in 0..60 {
        msgs.push(Message::new(if i % 2 == 0 {
            "emails.welcome"
        } else {
            "emails.receipt"
        }));
        msgs.push(Message::new("reports"));
    }
    enqueue(&db, msgs);
    let peaks: Shared = Arc::default();
    let group = |job: &Job<serde_json::Value>| {
        if job.topic.starts_with("emails.") {
            "emails"
        } else {
            "reports"
        }
        .to_owned()
    };
    let limit = Limit::new(["emails.*"], 5).unwrap();
    let store = db.store().await;
    assert_eq!(store.limit_running(&limit).await.unwrap(), 0);
    run_engines(
        &db,
        3,
        || {
            slow_handlers(
                &["emails.welcome", "emails.receipt", "reports"],
                group,
                peaks.clone(),
            )
        },
        limit,
        120,
        &peaks,
    )
    .await;
    let p = peaks.lock().unwrap();
    eprintln!("peaks: {:?}", p.peak);
    assert!(p.peak["emails"] <= 5, "limit exceeded: {:?}", p.peak);
    assert_eq!(
        p.peak["emails"], 5,
        "the limit's room is used: {:?}",
        p.peak
    );
    assert!(
        p.peak["reports"] > 5,
        "other topics are not limited: {:?}",
        p.peak
    );
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_per_key_limit_caps_each_key_and_lets_keys_run_side_by_side() {
    let db = TestDb::migrated();
    let mut msgs = Vec::new();
    for i in 0..80 {
        msgs.push(Message::new("jobs").key(format!("tenant-{}", i % 4)));
    }
    // A hot key with a backlog ahead of everything else.
    for _ in 0..40 {
        msgs.insert(0, Message::new("jobs").key("tenant-hot"));
    }
    enqueue(&db, msgs);
    let peaks: Shared = Arc::default();
    let tenants: Shared = Arc::default();
    let group = |job: &Job<serde_json::Value>| job.key.clone().unwrap();
    let all = |_: &Job<serde_json::Value>| "all".to_owned();
    let limit = Limit::new(["jobs"], 2).unwrap().per_key(true);
    let (p2, t2) = (peaks.clone(), tenants.clone());
    // Two views of the same deliveries: per key, and in all.
    let handlers = move || {
        let (p, t) = (p2.clone(), t2.clone());
        Handlers::new().on("jobs", move |job: Job<serde_json::Value>| {
            let (p, t) = (p.clone(), t.clone());
            async move {
                let k = group(&job);
                let a = all(&job);
                for (shared, g) in [(&p, &k), (&t, &a)] {
                    let mut s = shared.lock().unwrap();
                    let n = s.now.entry(g.clone()).or_default();
                    *n += 1;
                    let n = *n;
                    let peak = s.peak.entry(g.clone()).or_default();
                    *peak = (*peak).max(n);
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
                for (shared, g) in [(&p, &k), (&t, &a)] {
                    let mut s = shared.lock().unwrap();
                    *s.now.get_mut(g).unwrap() -= 1;
                    s.done += 1;
                }
                Ok(())
            }
        })
    };
    run_engines(&db, 3, handlers, limit, 120, &tenants).await;
    let p = peaks.lock().unwrap();
    let t = tenants.lock().unwrap();
    eprintln!("per key: {:?}, in all: {:?}", p.peak, t.peak);
    assert_eq!(p.peak.len(), 5);
    assert!(
        p.peak.values().all(|&n| n <= 2),
        "a key ran more than 2: {:?}",
        p.peak
    );
    assert_eq!(p.peak["tenant-hot"], 2, "{:?}", p.peak);
    assert!(t.peak["all"] > 2, "keys run side by side: {:?}", t.peak);
}

#[test]
fn a_limit_needs_topics_and_room() {
    assert!(matches!(
        Limit::new(Vec::<String>::new(), 1),
        Err(postbox::Error::InvalidArgument {
            field: "topics",
            ..
        })
    ));
    assert!(matches!(
        Limit::new(["a"], 0),
        Err(postbox::Error::InvalidArgument {
            field: "max_running",
            ..
        })
    ));
    let l = Limit::new(["b", "a.*", "b"], 3).unwrap();
    assert_eq!(l.name(), "a.*,b");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limited_claims_walk_only_what_they_can_take() {
    let db = TestDb::migrated();
    let store = db.store().await;
    let running = |topic: &str, key: &str, n: usize| {
        format!(
            "INSERT INTO postbox.messages (topic, key, state, attempts, lease_token, locked_until, locked_by)
             SELECT '{topic}', {key}, 'running', 1, 1, now() + interval '1 hour', 'test' FROM generate_series(1, {n});"
        )
    };
    // A key at its limit (5 running) with 30,000 messages ahead of 50 other keys' 10 each; 30,000
    // messages of another topic run.
    db.exec(&format!(
        "{} {}
         INSERT INTO postbox.messages (topic, key) SELECT 'jobs', 'full' FROM generate_series(1, 30000);
         INSERT INTO postbox.messages (topic, key) SELECT 'jobs', 'k' || (g % 50) FROM generate_series(1, 500) g;
         INSERT INTO postbox.messages (topic) SELECT 'plain' FROM generate_series(1, 100);
         ANALYZE postbox.messages",
        running("jobs", "'full'", 5),
        running("busy", "NULL", 30_000)
    ));
    let per_key =
        "SELECT * FROM postbox.claim_limited('jobs', 5, true, false, '{jobs}', '{}', 100, 30,
        false, '{jobs}', '{}', '{}', '{}', 1, 'test')";
    // Against an unlimited claim of as many messages. The old per-key claim walked the full
    // key's 30,000 rows; the old total limit walked the 30,000 running rows of the other topic.
    let clean = |topic: &str| {
        common::index_entries_read(
            &db,
            &format!(
                "SELECT * FROM postbox.claim(100, 30, false, '{{{topic}}}', '{{}}', '{{}}', '{{}}', 1, 'test')"
            ),
        )
    };
    let n = common::index_entries_read(&db, per_key);
    let clean_jobs = clean("jobs");
    // The front of the topic is read 4 rows per message wanted, then key by key: bounded by the
    // batch, not by the backlog.
    assert!(
        n <= 5 * clean_jobs,
        "per key: {n} index entries read, clean {clean_jobs}"
    );
    let total =
        "SELECT * FROM postbox.claim_limited('plain', 1000, false, false, '{plain}', '{}', 100, 30,
        false, '{plain}', '{}', '{}', '{}', 1, 'test')";
    let t = common::index_entries_read(&db, total);
    let clean_plain = clean("plain");
    assert!(
        t <= 2 * clean_plain,
        "total: {t} index entries read, clean {clean_plain}"
    );
    eprintln!(
        "limited claims: per key {n} index entries read (clean {clean_jobs}), total {t} (clean {clean_plain})"
    );

    // And what they take: 5 of each other key (its room), none of the full key.
    let limit = Limit::new(["jobs"], 5).unwrap().per_key(true);
    let got = store
        .claim_limited(
            &limit,
            100,
            Duration::from_secs(30),
            &postbox::Topics::exact(["jobs"]),
        )
        .await
        .unwrap();
    assert_eq!(got.len(), 100);
    let mut per: HashMap<String, usize> = HashMap::new();
    for m in &got {
        *per.entry(m.key.clone().unwrap()).or_default() += 1;
    }
    assert!(!per.contains_key("full"), "{per:?}");
    assert!(per.values().all(|n| *n <= 5), "{per:?}");
    let more = store
        .claim_limited(
            &limit,
            500,
            Duration::from_secs(30),
            &postbox::Topics::exact(["jobs"]),
        )
        .await
        .unwrap();
    assert_eq!(more.len(), 150, "the 30 keys not yet taken, 5 each");
    assert!(
        store
            .claim_limited(
                &limit,
                10,
                Duration::from_secs(30),
                &postbox::Topics::exact(["jobs"])
            )
            .await
            .unwrap()
            .is_empty(),
        "every key at its limit"
    );
}

/// A per-key limit over a glob, with nothing of its topics running yet: what a claim takes from
/// a topic's front counts before its key walk and before the next topic (a key's messages were
/// counted only among topics that had something running when the claim began, so a claim could
/// take a key past its limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_per_key_limit_counts_what_the_same_claim_took() {
    let db = TestDb::migrated();
    let store = db.store().await;
    let limit = Limit::new(["lim.*"], 1).unwrap().per_key(true);
    // The front of lim.a is 12 messages of key a; the key walk then finds b, c and d.
    db.exec(
        "INSERT INTO postbox.messages (topic, key) SELECT 'lim.a', 'a' FROM generate_series(1, 12);
         INSERT INTO postbox.messages (topic, key) VALUES
             ('lim.a', 'b'), ('lim.a', 'b'), ('lim.a', 'c'), ('lim.a', 'c'), ('lim.a', 'd'), ('lim.a', 'd')",
    );
    let got = store
        .claim_limited(&limit, 3, Duration::from_secs(30), &postbox::Topics::all())
        .await
        .unwrap();
    let mut keys: Vec<String> = got.iter().map(|m| m.key.clone().unwrap()).collect();
    keys.sort();
    assert_eq!(keys, ["a", "b", "c"]);

    // Two topics of the glob with the same key: one message of it in all.
    db.exec(
        "DELETE FROM postbox.messages;
         INSERT INTO postbox.messages (topic, key) SELECT t, 'k' FROM unnest(ARRAY['lim.x', 'lim.y']) t, generate_series(1, 3)",
    );
    let got = store
        .claim_limited(&limit, 10, Duration::from_secs(30), &postbox::Topics::all())
        .await
        .unwrap();
    assert_eq!(
        got.len(),
        1,
        "{:?}",
        got.iter().map(|m| &m.topic).collect::<Vec<_>>()
    );
}
