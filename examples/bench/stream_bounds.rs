//! Two more `--only stream` lines, on the same server (its database set up for stream mode):
//!
//! - `publish_vs_emit_async_commit`: `publish` (its check included) against a bare
//!   `pg_logical_emit_message` of the same content, 2 clients each side by side, one message a
//!   transaction, `synchronous_commit = off` (the commit does not wait for the disk: the check is
//!   what is left to see), the ratio of the totals of eight 1.5 s runs (the side the scheduler favours changes
//!   from run to run). Both encode the message each time
//!   (publish's client-side work): what differs is the statement.
//! - `stream_redelivered_after_kill`: a streamer at the defaults killed mid-stream (its runtime
//!   dropped at once: no last word to the server, as with `kill -9`), then a new one: how many
//!   messages both delivered.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection, RunQueryDsl};

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use postbox::sink::{Outcome, Sink, Unavailable};
use postbox::{ClaimedMessage, Message, Topics};
use tokio_util::sync::CancellationToken;

use super::median;

/// Transactions a second of `clients` threads calling `publish` and, at the same time, as many
/// calling a bare emit, for `secs`: side by side, the machine's noise falls on both.
fn rates(url: &str, clients: usize, secs: f64) -> (f64, f64) {
    let done = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..clients * 2)
        .map(|i| {
            let (url, done, stop) = (url.to_owned(), done.clone(), stop.clone());
            let emit = i % 2 == 1;
            std::thread::spawn(move || {
                let mut conn = PgConnection::establish(&url).unwrap();
                conn.batch_execute("SET synchronous_commit = off").unwrap();
                let msg = Message::new("bench")
                    .key(format!("k{i}"))
                    .payload(&serde_json::json!({"n": i, "body": "x".repeat(200)}));
                while !stop.load(Ordering::Relaxed) {
                    if emit {
                        // Encoded each time, as publish does: what differs is the statement.
                        let content = postbox::stream::encode(&msg).unwrap();
                        diesel::sql_query(
                            "SELECT pg_logical_emit_message(true, 'postbox', $1)::text AS v",
                        )
                        .bind::<diesel::sql_types::Text, _>(&content)
                        .execute(&mut conn)
                        .unwrap();
                    } else {
                        postbox::publish(&mut conn, &msg).unwrap();
                    }
                    done[usize::from(emit)].fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let start = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(secs));
    let n = [0, 1].map(|k| done[k].load(Ordering::Relaxed));
    let elapsed = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    (n[0] as f64 / elapsed, n[1] as f64 / elapsed)
}

pub fn publish_vs_emit(url: &str) {
    let (mut publish, mut emit) = (Vec::new(), Vec::new());
    for _ in 0..8 {
        let (p, e) = rates(url, 2, 1.5);
        publish.push(p);
        emit.push(e);
    }
    println!(
        "stream: 2 clients publishing and 2 emitting side by side, one message a transaction, synchronous_commit = off: publish {publish:.0?} tx/s; bare pg_logical_emit_message {emit:.0?} tx/s"
    );
    // Which side the scheduler favours changes from run to run: the ratio of the totals.
    println!(
        "publish_vs_emit_async_commit={:.2}",
        publish.iter().sum::<f64>() / emit.iter().sum::<f64>()
    );
}

/// Records the `n` of every message delivered.
struct Seen(Arc<Mutex<Vec<u64>>>);

impl Sink for Seen {
    fn name(&self) -> &str {
        "seen"
    }
    fn topics(&self) -> Topics {
        Topics::all()
    }
    fn deliver(
        &self,
        batch: Vec<ClaimedMessage>,
    ) -> BoxFuture<'_, Result<Vec<Outcome>, Unavailable>> {
        async move {
            let mut seen = self.0.lock().unwrap();
            for m in &batch {
                seen.push(m.payload["n"].as_u64().unwrap_or(u64::MAX));
            }
            Ok(vec![Outcome::Delivered; batch.len()])
        }
        .boxed()
    }
}

/// A streamer at the defaults on its own runtime (thread), delivering into `seen`; the token
/// stops it, the receiver hears when it has.
fn spawn_streamer(
    url: &str,
    seen: Arc<Mutex<Vec<u64>>>,
) -> (
    tokio::runtime::Runtime,
    CancellationToken,
    std::sync::mpsc::Receiver<()>,
) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let url = url.to_owned();
    let (stop, (tx, rx)) = (CancellationToken::new(), std::sync::mpsc::channel());
    let token = stop.clone();
    rt.spawn(async move {
        let store = postbox::Store::connect(&url, 4).await.unwrap();
        let s = postbox::stream::Streamer {
            url,
            config: postbox::stream::StreamConfig {
                create_slot: false,
                ..Default::default()
            },
            sinks: vec![Arc::new(Seen(seen))],
            store,
            observer: None,
        };
        let _ = s.run(token).await;
        let _ = tx.send(());
    });
    (rt, stop, rx)
}

pub fn redelivered_after_kill(url: &str, n: usize) {
    let mut runs = Vec::new();
    for _ in 0..3 {
        super::stream::skip_to_now(url);
        super::stream::publish_events(url, n);
        let first: Arc<Mutex<Vec<u64>>> = Arc::default();
        let (rt, _, _) = spawn_streamer(url, first.clone());
        // Killed at about half way.
        while first.lock().unwrap().len() < n / 2 {
            std::thread::sleep(Duration::from_millis(1));
        }
        rt.shutdown_background();
        let before: HashSet<u64> = first.lock().unwrap().iter().copied().collect();
        // The server notices the connection gone before the next streamer can take the slot.
        let second: Arc<Mutex<Vec<u64>>> = Arc::default();
        let (rt, stop, stopped) = spawn_streamer(url, second.clone());
        // Commit order: the last message delivered means every one was.
        let t = Instant::now();
        while !second.lock().unwrap().contains(&(n as u64 - 1)) {
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "the second streamer stalled"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        stop.cancel();
        let _ = stopped.recv_timeout(Duration::from_secs(30));
        rt.shutdown_background();
        let again = second
            .lock()
            .unwrap()
            .iter()
            .filter(|i| before.contains(i))
            .count();
        runs.push(again as f64);
    }
    println!(
        "stream: {n} messages (100 a transaction), streamer at the defaults killed half way, then a new one: redelivered {runs:.0?}"
    );
    println!("stream_redelivered_after_kill={:.0}", median(&runs));
}
