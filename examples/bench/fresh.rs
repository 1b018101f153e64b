//! `--only fresh`: every claim shape on a table never analyzed, against the same table analyzed
//! (after `pg_upgrade`, a restore, a fresh deploy's first burst). Each claim of 100 runs in a
//! transaction rolled back, so every run claims from the same table; the p50 of 50 runs of each
//! shape, fresh then analyzed, and the ratio.

use std::time::Instant;

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection};

use super::backlog::exec;
use super::percentile;

const RUNS: usize = 50;

/// The shapes, as the relay runs them.
const SHAPES: [(&str, &str); 9] = [
    (
        "every_topic",
        "SELECT count(*) FROM postbox.claim(100, 30, true, '{}', '{}', '{}', '{}', 1, 'x')",
    ),
    (
        "one_topic",
        "SELECT count(*) FROM postbox.claim_topic('u', 100, 30, 1, 'x')",
    ),
    (
        "one_keyed_topic",
        "SELECT count(*) FROM postbox.claim_topic('keyed', 100, 30, 1, 'x')",
    ),
    (
        "ordered_heads",
        "SELECT count(*) FROM postbox.claim_topic('ord', 100, 30, 1, 'x')",
    ),
    (
        "a_few_topics",
        "SELECT count(*) FROM postbox.claim(100, 30, false, ARRAY['u', 'keyed', 'ord'], '{}', '{}', '{}', 1, 'x')",
    ),
    (
        "a_glob",
        "SELECT count(*) FROM postbox.claim(100, 30, false, '{}', ARRAY['emails.%'], '{}', '{}', 1, 'x')",
    ),
    (
        "many_topics_glob",
        "SELECT count(*) FROM postbox.claim(100, 30, false, '{}', ARRAY['tenant.%'], '{}', '{}', 1, 'x')",
    ),
    (
        "limited_per_key",
        "SELECT count(*) FROM postbox.claim_limited('keyed', 5, true, false, ARRAY['keyed'], '{}', 100, 30, false, ARRAY['keyed'], '{}', '{}', '{}', 1, 'x')",
    ),
    (
        "limited_glob",
        "SELECT count(*) FROM postbox.claim_limited('emails.*', 1000, false, false, '{}', ARRAY['emails.%'], 100, 30, false, '{}', ARRAY['emails.%'], '{}', '{}', 1, 'x')",
    ),
];

fn timings(url: &str) -> Vec<f64> {
    let mut c = PgConnection::establish(url).unwrap();
    SHAPES
        .iter()
        .map(|(_, sql)| {
            let mut lat: Vec<f64> = (0..RUNS)
                .map(|_| {
                    c.batch_execute("BEGIN").unwrap();
                    let t = Instant::now();
                    c.batch_execute(sql).unwrap();
                    let ms = t.elapsed().as_secs_f64() * 1000.0;
                    c.batch_execute("ROLLBACK").unwrap();
                    ms
                })
                .collect();
            lat.sort_by(f64::total_cmp);
            percentile(&lat, 0.5)
        })
        .collect()
}

pub async fn run(url: &str) {
    let (server, _) = url.rsplit_once('/').expect("a database URL");
    let fresh = format!("{server}/postbox_bench_fresh_shapes");
    let mut admin = PgConnection::establish(&format!("{server}/postgres")).unwrap();
    admin
        .batch_execute("DROP DATABASE IF EXISTS postbox_bench_fresh_shapes WITH (FORCE)")
        .unwrap();
    admin
        .batch_execute("CREATE DATABASE postbox_bench_fresh_shapes")
        .unwrap();
    postbox::migrate(&mut PgConnection::establish(&fresh).unwrap()).unwrap();
    exec(
        &fresh,
        "ALTER TABLE postbox.messages SET (autovacuum_enabled = false);
         INSERT INTO postbox.messages (topic) SELECT 'u' FROM generate_series(1, 20000);
         INSERT INTO postbox.messages (topic, key) SELECT 'keyed', 'k' || (g % 500) FROM generate_series(1, 20000) g;
         INSERT INTO postbox.messages (topic, key, ordered) SELECT 'ord', 'k' || (g % 200), true FROM generate_series(1, 20000) g;
         INSERT INTO postbox.messages (topic) SELECT 'tenant.' || g FROM generate_series(1, 10000) g;
         INSERT INTO postbox.messages (topic) SELECT 'emails.welcome' FROM generate_series(1, 20000);",
    );
    let never = timings(&fresh);
    exec(&fresh, "ANALYZE postbox.messages");
    let analyzed = timings(&fresh);
    for (((name, _), n), a) in SHAPES.iter().zip(&never).zip(&analyzed) {
        println!("claim of 100, {name}: never analyzed p50 {n:.2} ms, analyzed p50 {a:.2} ms");
        println!("claim_fresh_ratio_{name}={:.2}", n / a);
    }
    admin
        .batch_execute("DROP DATABASE IF EXISTS postbox_bench_fresh_shapes WITH (FORCE)")
        .unwrap();
}
