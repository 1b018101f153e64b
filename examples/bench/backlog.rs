//! `--only backlog`: what a backlog costs (DESIGN §2.10).
//!
//! 1. Claim latency, batch 100, of one topic (`target`) on five tables: clean (100,000 available
//!    messages); the same with N scheduled rows an hour ahead in front of them; with N available
//!    rows of another topic; N ordered rows over 10 keys; N ordered rows over 10,000 keys (N =
//!    `--backlog-rows`, default 1,000,000). Each claim's messages are completed between claims (not
//!    timed), as a relay would. A shape stops after 1,000 claims (p99: the tenth slowest) or 30 s.
//! 2. The drain rate of the embedded engine on 100,000 ordered messages over 1,000 keys against
//!    100,000 unordered ones, twice each, alternating.
//!    Then the same on tables the planner has no statistics for: 20,000 ordered messages over 200
//!    keys against 20,000 unordered ones, each inserted by one statement into a freshly migrated
//!    database (autovacuum off on it, so that no ANALYZE runs meanwhile), drained at once
//!    (`ordered_drain_ratio_unanalyzed`).
//! 3. Limited claims (`--only limits` alone): claim latency, batch 100, of a per-key limit (5 per
//!    key) when one key at its limit has 100,000 available messages ahead of 100,000 over 1,000
//!    other keys (`limited_full_key`), and of a total limit (100,000) of a topic when 50,000
//!    messages of other topics run (`limited_busy`), each against the clean claim measured in the
//!    same run.
//! 4. `status` (`Store::stats`) and the metrics sample at `--status-rows` rows (default 10M), next
//!    to the exact per-topic count that `status` ran before.
//!
//! Backlog rows are written with plain `INSERT ... SELECT` through the insert trigger (ordered
//! rows take their key's lock and get their state exactly as an app's enqueue would).

use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection};
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use postbox::{Message, Store, Topics};

use super::{drain_engine, percentile, reset};

const BATCH: usize = 100;
const CLAIMS: usize = 1000;
const SHAPE_BUDGET: Duration = Duration::from_secs(30);

pub(crate) fn exec(url: &str, sql: &str) {
    PgConnection::establish(url)
        .unwrap()
        .batch_execute(sql)
        .unwrap();
}

/// Claim latencies (ms) of `target`, batch 100, under `limit` if given, completing each batch
/// before the next claim.
async fn claim_latencies(store: &Store, limit: Option<&postbox::store::Limit>) -> Vec<f64> {
    claim_latencies_of(store, limit, &Topics::only(["target"])).await
}

async fn claim_latencies_of(
    store: &Store,
    limit: Option<&postbox::store::Limit>,
    topics: &Topics,
) -> Vec<f64> {
    let lease = Duration::from_secs(300);
    let started = Instant::now();
    let mut lat = Vec::new();
    while lat.len() < CLAIMS && started.elapsed() < SHAPE_BUDGET {
        let t = Instant::now();
        let got = match limit {
            None => store.claim(BATCH, lease, topics).await,
            Some(l) => store.claim_limited(l, BATCH, lease, topics).await,
        }
        .unwrap();
        lat.push(t.elapsed().as_secs_f64() * 1000.0);
        if got.is_empty() {
            break;
        }
        let leases: Vec<_> = got.iter().map(|m| m.lease()).collect();
        store.complete(&leases).await.unwrap();
    }
    lat.sort_by(f64::total_cmp);
    lat
}

async fn enqueue_ordered(url: &str, n: usize, keys: usize) -> f64 {
    let mut conn = AsyncPgConnection::establish(url).await.unwrap();
    let t = Instant::now();
    let mut i = 0;
    while i < n {
        let k = (n - i).min(1000);
        let msgs: Vec<Message> = (i..i + k)
            .map(|j| {
                Message::new("bench.noop")
                    .key(format!("k{}", j % keys))
                    .ordered()
            })
            .collect();
        postbox::enqueue_many_async(&mut conn, &msgs).await.unwrap();
        i += k;
    }
    let rate = n as f64 / t.elapsed().as_secs_f64();
    conn.batch_execute("ANALYZE postbox.messages")
        .await
        .unwrap();
    rate
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    percentile(v, 0.5)
}

pub async fn run(url: &str, rows: usize, status_rows: usize) {
    let store = Store::connect(url, 4).await.unwrap();
    let p99s = claim_shapes(url, &store, rows).await;
    let drain_ratio = ordered_drain(url).await;
    let unanalyzed_ratio = ordered_drain_unanalyzed(url).await;
    limited_claims(url, &store).await;
    let (status_ms, sample_ms) = status_at_scale(url, &store, status_rows).await;
    let clean = p99s[0].1;
    for (name, p99) in &p99s {
        println!("claim_p99_ms_{name}={p99:.2}");
    }
    for (name, p99) in &p99s[1..] {
        println!("claim_p99_ratio_{name}={:.2}", p99 / clean);
    }
    println!("ordered_drain_ratio={drain_ratio:.2}");
    println!("ordered_drain_ratio_unanalyzed={unanalyzed_ratio:.2}");
    println!("status_ms_10m={status_ms:.1}");
    println!("sample_ms_10m={sample_ms:.1}");
}

/// Claim latency (p99, ms) per backlog shape.
async fn claim_shapes(url: &str, store: &Store, rows: usize) -> Vec<(&'static str, f64)> {
    let target =
        "INSERT INTO postbox.messages (topic) SELECT 'target' FROM generate_series(1, 100000);";
    let shapes: [(&str, String); 5] = [
        ("clean", target.to_owned()),
        (
            "scheduled_1m",
            format!(
                "INSERT INTO postbox.messages (topic, run_at) SELECT 'target', now() + interval '1 hour' FROM generate_series(1, {rows}); {target}"
            ),
        ),
        (
            "other_topic_1m",
            format!(
                "INSERT INTO postbox.messages (topic) SELECT 'other' FROM generate_series(1, {rows}); {target}"
            ),
        ),
        (
            "ordered_10_keys",
            format!(
                "INSERT INTO postbox.messages (topic, key, ordered) SELECT 'target', 'k' || (g % 10), true FROM generate_series(1, {rows}) g"
            ),
        ),
        (
            "ordered_10k_keys",
            format!(
                "INSERT INTO postbox.messages (topic, key, ordered) SELECT 'target', 'k' || (g % 10000), true FROM generate_series(1, {rows}) g"
            ),
        ),
    ];
    let mut p99s = Vec::new();
    for (name, setup) in &shapes {
        reset(url);
        let t = Instant::now();
        exec(url, setup);
        exec(url, "VACUUM ANALYZE postbox.messages");
        let built = t.elapsed();
        let lat = claim_latencies(store, None).await;
        let (p50, p99) = (percentile(&lat, 0.5), percentile(&lat, 0.99));
        println!(
            "claim batch {BATCH} on {name}: p50 {p50:.2} ms, p99 {p99:.2} ms over {} claims (table built in {:.1} s)",
            lat.len(),
            built.as_secs_f64()
        );
        p99s.push((*name, p99));
    }
    p99s
}

/// Claim p99 (ms) of the clean claim, of a per-key limited claim behind a full key, and of a total
/// limited claim beside 50,000 running messages of other topics; prints the ratios.
pub async fn limited_claims(url: &str, store: &Store) -> Vec<(&'static str, f64)> {
    use postbox::store::Limit;
    let target =
        "INSERT INTO postbox.messages (topic) SELECT 'target' FROM generate_series(1, 100000);";
    let running = |topic: &str, key: &str, n: usize| {
        format!(
            "INSERT INTO postbox.messages (topic, key, state, attempts, lease_token, locked_until, locked_by)
             SELECT '{topic}', {key}, 'running', 1, 1, now() + interval '1 hour', 'bench' FROM generate_series(1, {n});"
        )
    };
    let per_key = Limit::new(["target"], 5).unwrap().per_key(true);
    let total = Limit::new(["target"], 100_000).unwrap();
    let shapes: [(&str, String, Option<&Limit>); 3] = [
        ("clean", target.to_owned(), None),
        (
            "limited_full_key",
            format!(
                "{} INSERT INTO postbox.messages (topic, key) SELECT 'target', 'full' FROM generate_series(1, 100000);
                 INSERT INTO postbox.messages (topic, key) SELECT 'target', 'k' || (g % 1000) FROM generate_series(1, 100000) g;",
                running("target", "'full'", 5)
            ),
            Some(&per_key),
        ),
        (
            "limited_busy",
            format!("{} {target}", running("other", "NULL", 50_000)),
            Some(&total),
        ),
    ];
    let mut p99s = Vec::new();
    for (name, setup, limit) in &shapes {
        reset(url);
        exec(url, setup);
        exec(url, "VACUUM ANALYZE postbox.messages");
        let lat = claim_latencies(store, *limit).await;
        let (p50, p99) = (percentile(&lat, 0.5), percentile(&lat, 0.99));
        println!(
            "claim batch {BATCH} on {name}: p50 {p50:.2} ms, p99 {p99:.2} ms over {} claims",
            lat.len()
        );
        p99s.push((*name, p99));
    }
    let clean = p99s[0].1;
    for (name, p99) in &p99s[1..] {
        println!("claim_p99_ratio_{name}={:.2}", p99 / clean);
    }
    glob_limit(url, store).await;
    p99s
}

/// A limit on a glob (`emails.*`) beside 100,000 other topics with a message each: the limited
/// claim's p99 over the plain claim's of the same filter, measured on the same table, alternating.
async fn glob_limit(url: &str, store: &Store) {
    use postbox::store::Limit;
    reset(url);
    exec(
        url,
        "INSERT INTO postbox.messages (topic) SELECT 'tenant.' || g FROM generate_series(1, 100000) g;
         INSERT INTO postbox.messages (topic) SELECT 'emails.welcome' FROM generate_series(1, 200000);",
    );
    exec(url, "VACUUM ANALYZE postbox.messages");
    let topics = Topics::only(["emails.*"]);
    let limit = Limit::new(["emails.*"], 1_000_000).unwrap();
    let (mut plain, mut limited) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        plain.extend(claim_latencies_of(store, None, &topics).await);
        limited.extend(claim_latencies_of(store, Some(&limit), &topics).await);
    }
    plain.sort_by(f64::total_cmp);
    limited.sort_by(f64::total_cmp);
    let (p, l) = (percentile(&plain, 0.99), percentile(&limited, 0.99));
    println!(
        "claim batch {BATCH} of emails.* beside 100,000 other topics: plain p99 {p:.2} ms, limited (glob limit) p99 {l:.2} ms"
    );
    println!("claim_p99_ratio_glob_limit_100k_topics={:.2}", l / p);
}

/// Drain rate of ordered messages over that of unordered ones, side by side.
pub async fn ordered_drain(url: &str) -> f64 {
    let n = 100_000;
    let (mut ordered, mut unordered, mut ordered_enqueue) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..2 {
        for which in if round == 0 {
            ["unordered", "ordered"]
        } else {
            ["ordered", "unordered"]
        } {
            reset(url);
            if which == "ordered" {
                ordered_enqueue.push(enqueue_ordered(url, n, 1000).await);
                ordered.push(drain_engine(url, n, None).await);
            } else {
                super::enqueue_noop(url, n).await;
                unordered.push(drain_engine(url, n, None).await);
            }
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let drain_ratio = mean(&ordered) / mean(&unordered);
    println!(
        "drain {n}: ordered over 1000 keys {ordered:.0?} msg/s, unordered {unordered:.0?} msg/s: ratio {drain_ratio:.2}; ordered enqueue_many {ordered_enqueue:.0?} msg/s"
    );
    drain_ratio
}

/// Drain rate of 20,000 ordered messages over 200 keys over that of 20,000 unordered ones, each
/// inserted by one statement into a freshly migrated database that was never analyzed; twice
/// each, alternating.
pub async fn ordered_drain_unanalyzed(url: &str) -> f64 {
    let n = 20_000;
    let (server, _) = url.rsplit_once('/').expect("a database URL");
    let fresh = format!("{server}/postbox_bench_fresh");
    let admin = format!("{server}/postgres");
    let (mut ordered, mut unordered) = (Vec::new(), Vec::new());
    for round in 0..2 {
        for is_ordered in if round == 0 {
            [false, true]
        } else {
            [true, false]
        } {
            exec(
                &admin,
                "DROP DATABASE IF EXISTS postbox_bench_fresh WITH (FORCE)",
            );
            exec(&admin, "CREATE DATABASE postbox_bench_fresh");
            postbox::migrate(&mut PgConnection::establish(&fresh).unwrap()).unwrap();
            let rows = if is_ordered {
                format!(
                    "INSERT INTO postbox.messages (topic, key, ordered) SELECT 'bench.noop', 'k' || (g % 200), true FROM generate_series(1, {n}) g"
                )
            } else {
                format!(
                    "INSERT INTO postbox.messages (topic) SELECT 'bench.noop' FROM generate_series(1, {n}) g"
                )
            };
            exec(
                &fresh,
                &format!("ALTER TABLE postbox.messages SET (autovacuum_enabled = false); {rows}"),
            );
            let rate = drain_engine(&fresh, n, None).await;
            if is_ordered {
                ordered.push(rate);
            } else {
                unordered.push(rate);
            }
        }
    }
    exec(
        &admin,
        "DROP DATABASE IF EXISTS postbox_bench_fresh WITH (FORCE)",
    );
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let ratio = mean(&ordered) / mean(&unordered);
    println!(
        "drain {n} on never-analyzed tables: ordered over 200 keys {ordered:.0?} msg/s, unordered {unordered:.0?} msg/s: ratio {ratio:.2}"
    );
    ratio
}

/// `status` and the metrics sample (median ms) at `status_rows` rows.
pub async fn status_at_scale(url: &str, store: &Store, status_rows: usize) -> (f64, f64) {
    reset(url);
    let t = Instant::now();
    let scheduled = status_rows * 3 / 10;
    exec(
        url,
        &format!(
            "INSERT INTO postbox.messages (topic) SELECT 'topic.' || (g % 10) FROM generate_series(1, {}) g;
             INSERT INTO postbox.messages (topic, run_at) SELECT 'topic.' || (g % 10), now() + interval '1 hour' FROM generate_series(1, {scheduled}) g",
            status_rows - scheduled
        ),
    );
    exec(url, "VACUUM ANALYZE postbox.messages");
    println!(
        "status table: {status_rows} rows built in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let mut status_ms = Vec::new();
    let mut sample_ms = Vec::new();
    let mut estimated = false;
    for _ in 0..5 {
        let t = Instant::now();
        estimated = store.stats().await.unwrap().estimated;
        status_ms.push(t.elapsed().as_secs_f64() * 1000.0);
        let t = Instant::now();
        store.sample(Duration::ZERO).await.unwrap();
        sample_ms.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let mut conn = AsyncPgConnection::establish(url).await.unwrap();
    let t = Instant::now();
    conn.batch_execute(
        "SELECT topic, count(*) FILTER (WHERE state = 'available'), count(*) FILTER (WHERE state = 'scheduled')
         FROM postbox.messages GROUP BY topic",
    )
    .await
    .unwrap();
    let exact_ms = t.elapsed().as_secs_f64() * 1000.0;
    let (status_ms, sample_ms) = (median(&mut status_ms), median(&mut sample_ms));
    println!(
        "status at {status_rows} rows: {status_ms:.1} ms (estimated: {estimated}), metrics sample {sample_ms:.1} ms; the exact GROUP BY count: {exact_ms:.0} ms"
    );
    reset(url);
    (status_ms, sample_ms)
}
