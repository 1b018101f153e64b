//! Noisy neighbours (chaos): one relay, a writer of live messages, and at once everything that is
//! not delivery pressing on it — bulk ordered commits of 5,000 keys every few seconds, an app's
//! transaction left open after `SET CONSTRAINTS ALL IMMEDIATE`, twelve console readers without a
//! token on the dearest pages, 300 connections held on the metrics port, list pages over 1 MB
//! payloads. Measured and printed: the live messages' lateness (p50, p99, max), held batches rolled
//! back, messages delivered twice, the relay's peak memory, the health probes answered; then an
//! exact ledger (nothing lost, each key in order).

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{TestDb, free_port, hermetic};
use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection};

const BIN: &str = env!("CARGO_BIN_EXE_postbox");
const KEYS: usize = 5_000;
const ATTACK: Duration = Duration::from_secs(30);

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// What the relay's log sink printed: each delivery (id, topic, key, payload) with when it was seen.
#[derive(Default)]
struct Seen {
    lines: Vec<(i64, String, Option<String>, serde_json::Value, i64)>,
}

fn get(port: u16, path: &str, wait: Duration) -> Option<u16> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(wait)).ok()?;
    s.set_write_timeout(Some(wait)).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).ok()?;
    let head = String::from_utf8_lossy(&buf[..buf.len().min(64)]).into_owned();
    head.split_whitespace().nth(1)?.parse().ok()
}

fn rss_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn percentile(sorted: &[i64], p: f64) -> i64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[test]
fn noisy_neighbours_neither_stall_nor_undo_delivery() {
    let db = TestDb::migrated();
    // The ordered accounts, each with a head; dead letters for the console's dear pages; large
    // payloads, paused (they stay for the list pages).
    db.exec(&format!(
        "INSERT INTO postbox.messages (topic, key, ordered, payload)
         SELECT 'acct', 'a' || g, true, jsonb_build_object('n', 0) FROM generate_series(1, {KEYS}) g;
         INSERT INTO postbox.dead_letters (id, topic, key, ordered, payload, headers, priority, attempts, max_attempts, created_at, reason)
         SELECT -g, 'orders.' || (g % 50), NULL, false, jsonb_build_object('customer', 'c-' || g), '{{}}', 0, 1, 1, now(), 'boom'
         FROM generate_series(1, 100000) g;
         INSERT INTO postbox.pauses (pattern) VALUES ('big');
         INSERT INTO postbox.messages (topic, payload)
         SELECT 'big', jsonb_build_object('blob', (SELECT string_agg(md5(random()::text || g || i), '')
                                                   FROM generate_series(1, 32000) i))
         FROM generate_series(1, 40) g;
         ANALYZE postbox.messages; ANALYZE postbox.dead_letters;"
    ));
    let produced_acct = KEYS as i64;
    let (ui, metrics) = (free_port(), free_port());
    let dir = std::env::temp_dir().join(format!("postbox-noisy-{ui}"));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("relay.toml");
    std::fs::write(
        &config,
        format!(
            "database_url = \"{}\"\n[relay]\npoll_interval = \"200ms\"\n[metrics]\nlisten = \"127.0.0.1:{metrics}\"\n\
             [ui]\nenabled = true\nlisten = \"127.0.0.1:{ui}\"\n",
            db.url
        ),
    )
    .unwrap();
    let stderr = dir.join("stderr");
    let mut relay: Child = hermetic(BIN)
        .args(["run", "--config", config.to_str().unwrap()])
        .env("POSTBOX_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .unwrap();
    let pid = relay.id();
    let seen: Arc<Mutex<Seen>> = Arc::default();
    {
        let (out, seen) = (relay.stdout.take().unwrap(), seen.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line)
                    && let Some(id) = v["id"].as_i64()
                {
                    seen.lock().unwrap().lines.push((
                        id,
                        v["topic"].as_str().unwrap_or_default().to_owned(),
                        v["key"].as_str().map(str::to_owned),
                        v["payload"].clone(),
                        now_ms(),
                    ));
                }
            }
        });
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while get(metrics, "/healthz", Duration::from_secs(1)) != Some(200) {
        assert!(Instant::now() < deadline, "the relay never became healthy");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The accounts' heads drained before the noise starts.
    assert!(common::relay::wait(Duration::from_secs(60), || {
        seen.lock()
            .unwrap()
            .lines
            .iter()
            .filter(|l| l.1 == "acct")
            .count()
            >= KEYS
    }));
    let rss_before = rss_kib(pid).0;

    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    // The app's transaction, left open after its checks ran, on a key of its own.
    let mut open_app = PgConnection::establish(&db.url).unwrap();
    open_app.batch_execute("BEGIN").unwrap();
    let open_ids: Vec<i64> = postbox::enqueue_many(
        &mut open_app,
        &[
            postbox::Message::new("acct").key("open").ordered(),
            postbox::Message::new("acct").key("open").ordered(),
        ],
    )
    .unwrap()
    .into_iter()
    .map(|e| e.id().unwrap())
    .collect();
    open_app
        .batch_execute("SET CONSTRAINTS ALL IMMEDIATE")
        .unwrap();
    // Bulk ordered commits: the next event of every account, every 3 s.
    let bulks = Arc::new(AtomicUsize::new(0));
    {
        let (url, stop, bulks) = (db.url.clone(), stop.clone(), bulks.clone());
        threads.push(std::thread::spawn(move || {
            let mut c = PgConnection::establish(&url).unwrap();
            while !stop.load(Ordering::SeqCst) {
                let n = bulks.load(Ordering::SeqCst) + 1;
                let msgs: Vec<postbox::Message> = (1..=KEYS)
                    .map(|g| {
                        postbox::Message::new("acct")
                            .key(format!("a{g}"))
                            .ordered()
                            .payload(&serde_json::json!({ "n": n }))
                    })
                    .collect();
                c.transaction::<_, postbox::Error, _>(|c| {
                    postbox::enqueue_many(c, &msgs).map(|_| ())
                })
                .unwrap();
                bulks.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_secs(3));
            }
        }));
    }
    // Twelve readers of the console without a token, on the dearest pages.
    let pages = [
        "/dead?topic=o*,x*,y*,z*,a*,b*,c*,d*,e*,f*,g*,h*,i*,j*,k*,l*,m*,n*,p*,q*&limit=500",
        "/messages?limit=500",
        "/dead?payload=%7B%22customer%22%3A%22nobody%22%7D&limit=500",
        "/",
    ];
    for r in 0..12 {
        let (stop, page) = (stop.clone(), pages[r % pages.len()]);
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let _ = get(ui, page, Duration::from_secs(30));
            }
        }));
    }
    // 300 connections held on the metrics port, reopened as they are closed.
    {
        let stop = stop.clone();
        threads.push(std::thread::spawn(move || {
            let mut held: Vec<TcpStream> = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                held.retain(|s| {
                    let mut b = [0u8; 1];
                    s.set_nonblocking(true).ok();
                    !matches!(s.peek(&mut b), Ok(0))
                });
                while held.len() < 300 {
                    match TcpStream::connect(("127.0.0.1", metrics)) {
                        Ok(s) => held.push(s),
                        Err(_) => break,
                    }
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }));
    }
    // Probes, as kubelet's: 1 s each, once a second.
    let probes = Arc::new(Mutex::new((0usize, 0usize)));
    {
        let (stop, probes) = (stop.clone(), probes.clone());
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let ok = get(metrics, "/healthz", Duration::from_secs(1)) == Some(200);
                let mut p = probes.lock().unwrap();
                p.0 += 1;
                p.1 += ok as usize;
                drop(p);
                std::thread::sleep(Duration::from_secs(1));
            }
        }));
    }
    // Memory, twice a second.
    let peak = Arc::new(AtomicUsize::new(0));
    {
        let (stop, peak) = (stop.clone(), peak.clone());
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                peak.fetch_max(rss_kib(pid).1 as usize, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(500));
            }
        }));
    }
    // The live writer: one message every 200 ms, its commit time in its payload.
    let mut live = PgConnection::establish(&db.url).unwrap();
    let mut live_ids = Vec::new();
    let started = Instant::now();
    while started.elapsed() < ATTACK {
        let id = postbox::enqueue(
            &mut live,
            &postbox::Message::new("live").payload(&serde_json::json!({ "sent": now_ms() })),
        )
        .unwrap()
        .id()
        .unwrap();
        live_ids.push(id);
        std::thread::sleep(Duration::from_millis(200));
    }
    // The live messages of the attack, each delivered: how late.
    assert!(
        common::relay::wait(Duration::from_secs(30), || {
            let s = seen.lock().unwrap();
            live_ids.iter().all(|id| s.lines.iter().any(|l| l.0 == *id))
        }),
        "live messages were never delivered"
    );
    stop.store(true, Ordering::SeqCst);
    for t in threads {
        t.join().unwrap();
    }
    open_app.batch_execute("COMMIT").unwrap();
    let bulk_commits = bulks.load(Ordering::SeqCst);
    let produced_acct = produced_acct + (bulk_commits * KEYS) as i64 + 2;
    // Everything of the accounts drains: each key in order, each message once.
    assert!(
        common::relay::wait(Duration::from_secs(120), || {
            seen.lock()
                .unwrap()
                .lines
                .iter()
                .filter(|l| l.1 == "acct")
                .count() as i64
                >= produced_acct
        }),
        "the accounts never drained: {} of {produced_acct}",
        seen.lock()
            .unwrap()
            .lines
            .iter()
            .filter(|l| l.1 == "acct")
            .count()
    );
    let s = seen.lock().unwrap();
    let mut lateness: Vec<i64> = s
        .lines
        .iter()
        .filter(|l| l.1 == "live")
        .filter_map(|l| Some(l.4 - l.3["sent"].as_i64()?))
        .collect();
    lateness.sort_unstable();
    let mut times: HashMap<i64, usize> = HashMap::new();
    for l in &s.lines {
        *times.entry(l.0).or_default() += 1;
    }
    let twice = times.values().filter(|&&n| n > 1).count();
    let mut by_key: HashMap<&str, Vec<i64>> = HashMap::new();
    for l in s.lines.iter().filter(|l| l.1 == "acct") {
        by_key.entry(l.2.as_deref().unwrap()).or_default().push(l.0);
    }
    let out_of_order = by_key
        .values()
        .filter(|ids| ids.windows(2).any(|w| w[0] > w[1]))
        .count();
    let log = std::fs::read_to_string(&stderr).unwrap_or_default();
    let rolled_back = log
        .matches("it was rolled back and will be delivered again")
        .count();
    let (asked, answered) = *probes.lock().unwrap();
    let peak_mib = peak.load(Ordering::SeqCst) as f64 / 1024.0;
    println!(
        "noisy neighbours ({:?}): live lateness p50 {} ms, p99 {} ms, max {} ms ({} messages); \
         bulk commits of {KEYS} keys: {bulk_commits}; held batches rolled back: {rolled_back}; \
         delivered twice: {twice}; keys out of order: {out_of_order}; relay RSS {} MiB before, \
         peak {peak_mib:.0} MiB; /healthz answered {answered} of {asked}",
        ATTACK,
        percentile(&lateness, 0.5),
        percentile(&lateness, 0.99),
        lateness.last().copied().unwrap_or(0),
        lateness.len(),
        rss_before / 1024,
    );
    let _ = relay.kill();
    let _ = relay.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(lateness.len(), live_ids.len());
    assert_eq!(rolled_back, 0, "held batches rolled back:\n{log}");
    assert_eq!(twice, 0, "messages delivered twice");
    assert_eq!(out_of_order, 0, "keys delivered out of order");
    assert!(open_ids.iter().all(|id| times.get(id) == Some(&1)));
    assert_eq!(answered, asked, "health probes unanswered");
    assert!(
        peak_mib <= 64.0 + 64.0,
        "the relay's memory peaked at {peak_mib:.0} MiB (payload budget 64 MiB + 64 MiB)"
    );
    assert!(
        lateness.last().copied().unwrap_or(0) <= 2_000,
        "a live message was {} ms late",
        lateness.last().copied().unwrap_or(0)
    );
    assert!(bulk_commits >= 5, "only {bulk_commits} bulk commits");
}
