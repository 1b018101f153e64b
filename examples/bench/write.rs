//! `--only write`: what an outbox costs the app's own transactions. 8 writers, each transaction
//! one business row plus:
//!
//! - (a) nothing; (b) one message by `enqueue`, unordered; (c) ordered, by a key of 100,000;
//! - (d) a plain INSERT of the same columns into a table with only a primary key (the physical
//!   floor of a table row);
//! - (e) `publish` and (f) a bare `pg_logical_emit_message` of the same content, when the server
//!   runs with `wal_level = logical` (they are skipped otherwise);
//!
//! - (g) the same columns as `postbox.messages` into a table with a primary key and the wake-up
//!   statement trigger only: what the app would pay if its row went to a write-only intake table
//!   that the relay moves into the queue in bulk (the design in the book's internals page); after
//!   each (g) round the rows it wrote are moved into `postbox.messages` by one statement, and the
//!   time per row moved is printed (what the relay would pay for the same index entries);
//!
//! alternating, two rounds of 4 s, with `synchronous_commit` on and off; then (b) while the
//! engine drains the table, against (d) while a raw SQL drainer (a held-lock cycle of up to 100
//! rows, as the engine's default batch; see `raw_drainer`) empties the floor table.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection, RunQueryDsl};
use postbox::Message;

use super::{median, reset};

#[derive(Clone, Copy, PartialEq, Debug)]
enum Extra {
    Nothing,
    Enqueue,
    Ordered,
    Floor,
    Publish,
    Emit,
    Intake,
}

/// A message's key (one of 100,000) and payload.
fn parts(w: usize, i: u64) -> (String, serde_json::Value) {
    (
        format!("k{}", (i * 7919 + w as u64 * 104_729) % 100_000),
        serde_json::json!({"n": i, "customer": w}),
    )
}

fn message(w: usize, i: u64, ordered: bool) -> Message {
    let (key, payload) = parts(w, i);
    let m = Message::new("bench.order").key(key).payload(&payload);
    if ordered { m.ordered() } else { m }
}

/// Transactions a second of 8 writers for `secs`, each adding `extra` to its business row.
fn writers(url: &str, extra: Extra, sync: bool, secs: f64) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..8)
        .map(|w| {
            let (url, stop, done) = (url.to_owned(), stop.clone(), done.clone());
            std::thread::spawn(move || {
                let mut conn = PgConnection::establish(&url).unwrap();
                if !sync {
                    conn.batch_execute("SET synchronous_commit = off").unwrap();
                }
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    conn.transaction(|c| {
                        diesel::sql_query(
                            "INSERT INTO bench_orders (customer, total_cents) VALUES ($1, $2)",
                        )
                        .bind::<diesel::sql_types::Integer, _>(w as i32)
                        .bind::<diesel::sql_types::BigInt, _>(i as i64)
                        .execute(c)?;
                        match extra {
                            Extra::Nothing => {}
                            Extra::Enqueue => {
                                postbox::enqueue(c, &message(w, i, false))?;
                            }
                            Extra::Ordered => {
                                postbox::enqueue(c, &message(w, i, true))?;
                            }
                            Extra::Floor => {
                                let (key, payload) = parts(w, i);
                                diesel::sql_query(
                                    "INSERT INTO bench_floor (topic, key, ordered, payload) VALUES ('bench.order', $1, false, $2)",
                                )
                                .bind::<diesel::sql_types::Text, _>(&key)
                                .bind::<diesel::sql_types::Jsonb, _>(&payload)
                                .execute(c)?;
                            }
                            Extra::Intake => {
                                let (key, payload) = parts(w, i);
                                diesel::sql_query(
                                    "INSERT INTO bench_intake (topic, key, ordered, payload, headers, priority, run_at, max_attempts, dedup_key) VALUES ('bench.order', $1, false, $2, '{}', 0, now(), 25, NULL)",
                                )
                                .bind::<diesel::sql_types::Text, _>(&key)
                                .bind::<diesel::sql_types::Jsonb, _>(&payload)
                                .execute(c)?;
                            }
                            Extra::Publish => postbox::publish(c, &message(w, i, false))?,
                            Extra::Emit => {
                                let content = postbox::stream::encode(&message(w, i, false))?;
                                diesel::sql_query(
                                    "SELECT pg_logical_emit_message(true, 'postbox', $1)::text AS v",
                                )
                                .bind::<diesel::sql_types::Text, _>(&content)
                                .execute(c)?;
                            }
                        }
                        Ok::<_, postbox::Error>(())
                    })
                    .unwrap();
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let start = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(secs));
    let n = done.load(Ordering::Relaxed);
    let elapsed = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    n as f64 / elapsed
}

fn setup(url: &str) {
    reset(url);
    PgConnection::establish(url)
        .unwrap()
        .batch_execute(
            "DROP TABLE IF EXISTS bench_floor;
             CREATE TABLE bench_floor (id bigserial PRIMARY KEY, topic text NOT NULL, key text,
                 ordered boolean NOT NULL, payload jsonb NOT NULL DEFAULT '{}',
                 headers jsonb NOT NULL DEFAULT '{}', created_at timestamptz NOT NULL DEFAULT now());
             DROP TABLE IF EXISTS bench_intake;
             CREATE TABLE bench_intake (LIKE postbox.messages INCLUDING DEFAULTS);
             ALTER TABLE bench_intake ALTER COLUMN id ADD GENERATED BY DEFAULT AS IDENTITY, ADD PRIMARY KEY (id);
             CREATE TRIGGER bench_intake_wake BEFORE INSERT ON bench_intake
                 FOR EACH STATEMENT EXECUTE FUNCTION postbox.messages_inserted();",
        )
        .unwrap();
}

/// Moves what (g) wrote into `postbox.messages` in one statement, as a relay would move an intake
/// table's rows in bulk; returns (rows moved, microseconds per row).
fn move_intake(url: &str) -> (i64, f64) {
    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let mut conn = PgConnection::establish(url).unwrap();
    conn.batch_execute("TRUNCATE postbox.messages").unwrap();
    let start = Instant::now();
    let n: N = diesel::sql_query(
        "WITH moved AS (DELETE FROM bench_intake RETURNING *),
              ins AS (INSERT INTO postbox.messages (topic, key, ordered, payload, headers, priority, run_at, max_attempts, dedup_key, created_at)
                      SELECT topic, key, ordered, payload, headers, priority, run_at, max_attempts, dedup_key, created_at
                      FROM moved ORDER BY id RETURNING 1)
         SELECT count(*) AS n FROM ins",
    )
    .get_result(&mut conn)
    .unwrap();
    (n.n, start.elapsed().as_secs_f64() * 1e6 / n.n.max(1) as f64)
}

/// Drains what the floor's writers insert as the engine drains the queue with its defaults: a
/// held-lock cycle (lock up to 100 rows `FOR UPDATE SKIP LOCKED`, "deliver", delete them, commit)
/// with `synchronous_commit = off` (as the store's sessions), and 1 ms between empty looks (as a
/// lingering engine). Until `stop`; returns the rows deleted.
fn raw_drainer(url: &str, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    let url = url.to_owned();
    std::thread::spawn(move || {
        #[derive(diesel::QueryableByName)]
        struct Id {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            id: i64,
        }
        let mut conn = PgConnection::establish(&url).unwrap();
        conn.batch_execute("SET synchronous_commit = off").unwrap();
        let mut n = 0;
        while !stop.load(Ordering::Relaxed) {
            let k = conn
                .transaction(|c| {
                    let ids: Vec<Id> = diesel::sql_query(
                        "SELECT id FROM bench_floor ORDER BY id FOR UPDATE SKIP LOCKED LIMIT 100",
                    )
                    .load(c)?;
                    let ids: Vec<i64> = ids.into_iter().map(|r| r.id).collect();
                    if !ids.is_empty() {
                        diesel::sql_query("DELETE FROM bench_floor WHERE id = ANY($1)")
                            .bind::<diesel::sql_types::Array<diesel::sql_types::BigInt>, _>(&ids)
                            .execute(c)?;
                    }
                    Ok::<_, diesel::result::Error>(ids.len())
                })
                .unwrap();
            n += k as u64;
            if k == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        n
    })
}

pub async fn run(url: &str) {
    let logical = {
        #[derive(diesel::QueryableByName)]
        struct W {
            #[diesel(sql_type = diesel::sql_types::Text)]
            wal_level: String,
        }
        let w: W = diesel::sql_query("SHOW wal_level")
            .get_result(&mut PgConnection::establish(url).unwrap())
            .unwrap();
        w.wal_level == "logical"
    };
    if logical {
        let store = postbox::Store::connect(url, 2).await.unwrap();
        store
            .stream_setup("postbox", "postbox_stream")
            .await
            .unwrap();
    }
    let mut extras = vec![
        Extra::Nothing,
        Extra::Enqueue,
        Extra::Ordered,
        Extra::Floor,
        Extra::Intake,
    ];
    if logical {
        extras.extend([Extra::Publish, Extra::Emit]);
    }
    let secs = 4.0;
    for sync in [true, false] {
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); extras.len()];
        let mut moves = Vec::new();
        for _ in 0..2 {
            for (k, extra) in extras.iter().enumerate() {
                setup(url);
                rates[k].push(tokio::task::block_in_place(|| {
                    writers(url, *extra, sync, secs)
                }));
                if *extra == Extra::Intake {
                    moves.push(move_intake(url));
                }
            }
        }
        let m: Vec<f64> = rates.iter().map(|r| median(r)).collect();
        let mode = if sync { "on" } else { "off" };
        println!("write: 8 writers, synchronous_commit = {mode}, a business row and:");
        for (k, extra) in extras.iter().enumerate() {
            println!("  {extra:?}: {:.0?} tx/s", rates[k]);
        }
        let tag = if sync { "sync" } else { "async" };
        println!("write_enqueue_vs_floor_{tag}={:.2}", m[1] / m[3]);
        println!("write_ordered_vs_floor_{tag}={:.2}", m[2] / m[3]);
        println!("write_enqueue_vs_row_{tag}={:.2}", m[1] / m[0]);
        println!("write_floor_vs_row_{tag}={:.2}", m[3] / m[0]);
        println!("write_intake_shape_vs_floor_{tag}={:.2}", m[4] / m[3]);
        println!(
            "write: (g)'s rows moved into postbox.messages in one statement: {moves:.1?} (rows, µs a row)"
        );
        if logical {
            println!("write_publish_vs_emit_{tag}={:.2}", m[5] / m[6]);
            println!("write_publish_vs_row_{tag}={:.2}", m[5] / m[0]);
        }
    }
    // The same writers while the table is drained: the engine against a raw SQL drainer of the
    // floor table.
    let (mut engine_side, mut raw_side) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        setup(url);
        let alone = tokio::task::block_in_place(|| writers(url, Extra::Enqueue, true, secs));
        setup(url);
        let (drained, delivered) = super::with_engine(url, async {
            tokio::task::block_in_place(|| writers(url, Extra::Enqueue, true, secs))
        })
        .await;
        engine_side.push((alone, drained, delivered));
        setup(url);
        let floor = tokio::task::block_in_place(|| writers(url, Extra::Floor, true, secs));
        setup(url);
        let stop = Arc::new(AtomicBool::new(false));
        let drainer = raw_drainer(url, stop.clone());
        let floor_drained = tokio::task::block_in_place(|| writers(url, Extra::Floor, true, secs));
        stop.store(true, Ordering::Relaxed);
        let deleted = drainer.join().unwrap();
        raw_side.push((floor, floor_drained, deleted));
    }
    println!(
        "write: enqueue alone / while the engine drains (messages delivered): {engine_side:.0?}"
    );
    println!(
        "write: floor insert alone / while a raw SQL drainer deletes (rows deleted): {raw_side:.0?}"
    );
    let kept = |v: &[(f64, f64, u64)]| median(&v.iter().map(|(a, d, _)| d / a).collect::<Vec<_>>());
    let (engine_kept, raw_kept) = (kept(&engine_side), kept(&raw_side));
    println!("write_kept_while_engine_drains={engine_kept:.2}");
    println!("write_kept_while_raw_drainer_drains={raw_kept:.2}");
    println!("write_engine_vs_raw_drainer={:.2}", engine_kept / raw_kept);
}
