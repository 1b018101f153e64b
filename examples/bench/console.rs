//! `--only console`: the console's pages at scale (`--status-rows`, default 10M): a backlog of that
//! many messages (three topics, ~230-byte payloads, 30 % scheduled an hour ahead), a tenth more
//! ordered over 10,000 keys (100 of their heads failed once), and as many dead letters, served by the console in this process. Each page is fetched 40 times (HTML, over
//! HTTP) on the tables as inserted (never analyzed), then after `VACUUM ANALYZE`: p50 and p95.
//!
//! Pages: the overview; messages with a topic and a JSON filter; messages with a JSON filter that
//! matches nothing (a whole window read); dead letters, plain and with a topic and JSON filter.
//! Then the confirmation of "replay all matching" (the count up to 100,000, an action's own step,
//! not a list page), five times.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use super::backlog::exec;
use super::{percentile, reset};

const FETCHES: usize = 40;

/// One GET: the status and the time to the last byte, in ms.
fn get(port: u16, path: &str) -> (u16, f64) {
    let t = Instant::now();
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).unwrap();
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    let head = String::from_utf8_lossy(&buf[..buf.len().min(20)]).into_owned();
    let code = head
        .split_whitespace()
        .nth(1)
        .unwrap_or("0")
        .parse()
        .unwrap();
    (code, ms)
}

fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// p50 and p95 (ms) of `FETCHES` fetches of `path` (each must answer 200).
fn timings(port: u16, path: &str, fetches: usize) -> (f64, f64) {
    let mut ms: Vec<f64> = (0..fetches)
        .map(|_| {
            let (code, ms) = get(port, path);
            assert_eq!(code, 200, "{path}");
            ms
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    (percentile(&ms, 0.5), percentile(&ms, 0.95))
}

pub async fn run(url: &str, rows: usize) {
    reset(url);
    let t = Instant::now();
    let scheduled = rows * 3 / 10;
    let payload =
        "jsonb_build_object('customer', 'c-' || (g % 5000), 'n', g, 'note', repeat('x', 180))";
    // A million rows a statement: each its own transaction.
    let mut done = 0;
    while done < rows {
        let n = (rows - done).min(1_000_000);
        let delayed = if done < scheduled {
            ", now() + interval '1 hour'"
        } else {
            ", now()"
        };
        exec(
            url,
            &format!(
                "INSERT INTO postbox.messages (topic, key, payload, run_at)
                 SELECT (ARRAY['orders','invoices','reports'])[1 + g % 3], 'c-' || (g % 5000), {payload}{delayed}
                 FROM generate_series({}, {}) g",
                done + 1,
                done + n
            ),
        );
        exec(
            url,
            &format!(
                "INSERT INTO postbox.dead_letters (id, topic, key, ordered, payload, headers, priority, attempts, max_attempts, created_at, reason)
                 SELECT 100000000 + g, (ARRAY['orders','invoices','reports'])[1 + g % 3], 'c-' || (g % 5000), false, {payload},
                        '{{}}', 0, 25, 25, now(), 'boom'
                 FROM generate_series({}, {}) g",
                done + 1,
                done + n
            ),
        );
        done += n;
    }
    // A tenth more, ordered over 10,000 keys (through the insert trigger: one head a key, the
    // rest waiting), a hundred of whose heads have failed: the overview's stalled keys and
    // invariant check read these.
    let ordered = rows / 10;
    exec(
        url,
        &format!(
            "INSERT INTO postbox.messages (topic, key, ordered, payload)
             SELECT 'ledger', 'k-' || (g % 10000), true, {payload} FROM generate_series(1, {ordered}) g;
             UPDATE postbox.messages SET attempts = 1, last_error = 'boom'
             WHERE id IN (SELECT id FROM postbox.messages WHERE topic = 'ledger' AND state = 'available' LIMIT 100)"
        ),
    );
    println!(
        "console: {rows} messages (+{ordered} ordered) and {rows} dead letters built in {:.0} s",
        t.elapsed().as_secs_f64()
    );
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let settings = postbox::config::UiSettings {
        listen: format!("127.0.0.1:{port}").parse().unwrap(),
        path_prefix: String::new(),
        actions: true,
        token: Some("a-bench-token-long-enough".into()),
        show_payloads: true,
        allowed_hosts: Vec::new(),
        pool_size: 2,
        statement_timeout: std::time::Duration::from_secs(5),
        token_trimmed: false,
    };
    let view = postbox::relay::RelayView {
        metrics: Some(postbox::metrics::Metrics::new(&["log"])),
        ..Default::default()
    };
    let stop = tokio_util::sync::CancellationToken::new();
    let server = postbox::relay::serve_ui(settings, url, view, stop.clone())
        .await
        .unwrap();
    let json = enc(r#"{"customer": "c-42"}"#);
    let nothing = enc(r#"{"customer": "nobody"}"#);
    let pages = [
        ("overview", "/".to_owned()),
        (
            "messages_json_filter",
            format!("/messages?topic=orders&payload={json}"),
        ),
        ("messages_no_match", format!("/messages?payload={nothing}")),
        ("dead", "/dead".to_owned()),
        (
            "dead_json_filter",
            format!("/dead?topic=orders&payload={json}"),
        ),
    ];
    for analyzed in [false, true] {
        if analyzed {
            exec(url, "VACUUM ANALYZE postbox.messages, postbox.dead_letters");
        }
        let tables = if analyzed {
            "analyzed"
        } else {
            "never analyzed"
        };
        for (name, path) in &pages {
            // One fetch first, not counted: the connection pool's first connections.
            get(port, path);
            let (p50, p95) = timings(port, path, FETCHES);
            println!("console {name} at {rows} rows ({tables}): p50 {p50:.1} ms, p95 {p95:.1} ms");
            let suffix = if analyzed { "" } else { "_fresh" };
            println!("console_{name}_p95_ms{suffix}={p95:.1}");
        }
        let confirm = format!("/dead/confirm?topic=orders&payload={json}&action=replay");
        let (p50, p95) = timings(port, &confirm, 5);
        println!(
            "console dead confirm (count up to 100,000) at {rows} rows ({tables}): p50 {p50:.1} ms, max of 5 {p95:.1} ms"
        );
    }
    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    reset(url);
}
