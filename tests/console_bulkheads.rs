//! Bulkheads of the relay's listeners, against a real relay and PostgreSQL: nothing a client of
//! the console or of the metrics port does, without the token, can take the delivery's
//! connections, keep a probe out, or take the relay's memory; the console acts on exact names and
//! logs what clients sent escaped.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{TestDb, free_port, hermetic};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_postbox");
const TOKEN: &str = "a-console-token-of-some-length";

/// A relay (log sink, console, metrics) whose delivered ids and stderr are kept.
struct Relay {
    child: Child,
    ui: u16,
    metrics: u16,
    delivered: Arc<Mutex<Vec<i64>>>,
    stderr: std::path::PathBuf,
    config: std::path::PathBuf,
}

impl Relay {
    fn start(db: &TestDb, ui_extra: &str) -> Relay {
        let (ui, metrics) = (free_port(), free_port());
        let dir = std::env::temp_dir().join(format!("postbox-bulkheads-{ui}"));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("relay.toml");
        std::fs::write(
            &config,
            format!(
                "database_url = \"{}\"\n[relay]\npoll_interval = \"100ms\"\n[metrics]\nlisten = \"127.0.0.1:{metrics}\"\n\
                 [ui]\nenabled = true\nlisten = \"127.0.0.1:{ui}\"\nactions = true\ntoken = \"{TOKEN}\"\n{ui_extra}\n",
                db.url
            ),
        )
        .unwrap();
        let stderr = dir.join("stderr");
        let mut child = hermetic(BIN)
            .args(["run", "--config", config.to_str().unwrap()])
            .env("POSTBOX_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap();
        let delivered: Arc<Mutex<Vec<i64>>> = Arc::default();
        let (out, d) = (child.stdout.take().unwrap(), delivered.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(id) = serde_json::from_str::<Value>(&line)
                    .ok()
                    .and_then(|v| v["id"].as_i64())
                {
                    d.lock().unwrap().push(id);
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", ui)).is_err()
            || TcpStream::connect(("127.0.0.1", metrics)).is_err()
        {
            assert!(Instant::now() < deadline, "the relay never listened");
            std::thread::sleep(Duration::from_millis(20));
        }
        Relay {
            child,
            ui,
            metrics,
            delivered,
            stderr,
            config,
        }
    }

    fn delivered(&self, id: i64) -> bool {
        self.delivered.lock().unwrap().contains(&id)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.config);
    }
}

/// One request on a connection of its own: status, lower-cased head, body. `None` when no
/// answer came within `wait`.
fn request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
    wait: Duration,
) -> Option<(u16, String, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(wait)).ok()?;
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    for (k, v) in headers {
        req += &format!("{k}: {v}\r\n");
    }
    if method == "POST" {
        req += &format!(
            "Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n",
            body.len()
        );
    }
    req += "\r\n";
    req += body;
    s.write_all(req.as_bytes()).ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).ok()?;
    let buf = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = buf.split_once("\r\n\r\n").unwrap_or((&buf, ""));
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, head.to_lowercase(), body.to_owned()))
}

fn get_json(port: u16, path: &str) -> (u16, Value) {
    let (code, _, body) = request(
        port,
        "GET",
        path,
        &[("Accept", "application/json")],
        "",
        Duration::from_secs(20),
    )
    .expect("an answer");
    (code, serde_json::from_str(&body).unwrap_or(Value::Null))
}

/// A POST of a console form with the token and the console's own CSRF cookie.
fn act(port: u16, path: &str, form: &str) -> (u16, String) {
    let csrf = "c".repeat(64);
    let auth = format!("Bearer {TOKEN}");
    let cookie = format!("postbox_csrf={csrf}");
    let (code, _, body) = request(
        port,
        "POST",
        path,
        &[
            ("Accept", "application/json"),
            ("Authorization", &auth),
            ("Cookie", &cookie),
        ],
        &format!("{form}&csrf={csrf}"),
        Duration::from_secs(20),
    )
    .expect("an answer");
    (code, body)
}

fn enqueue(db: &TestDb, topic: &str) -> i64 {
    db.scalar(&format!(
        "INSERT INTO postbox.messages (topic, payload) VALUES ('{topic}', '{{}}') RETURNING id AS v"
    ))
}

/// Every console connection stuck (its pages wait on a lock of the dead letters, held by the
/// test) and twenty clients asking for more: live messages are delivered all the while, the
/// console answers 503 for what its pool cannot take, and it recovers once the lock goes. (With
/// the delivery's pool shared, the stuck pages took every connection and delivery stopped.)
#[test]
fn console_readers_never_take_the_delivery_connections() {
    let db = TestDb::migrated();
    db.exec(
        "INSERT INTO postbox.dead_letters (id, topic, key, ordered, payload, headers, priority, attempts, max_attempts, created_at, reason)
         SELECT g, 'orders', NULL, false, '{}', '{}', 0, 1, 1, now(), 'boom' FROM generate_series(1, 1000) g",
    );
    let relay = Relay::start(&db, "pool_size = 2\nstatement_timeout = \"20s\"");
    let first = enqueue(&db, "live");
    assert!(common::relay::wait(Duration::from_secs(20), || relay.delivered(first)));

    let mut locker = db.conn();
    use diesel::connection::SimpleConnection;
    locker
        .batch_execute("BEGIN; LOCK TABLE postbox.dead_letters IN ACCESS EXCLUSIVE MODE")
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let busy = Arc::new(AtomicUsize::new(0));
    let readers: Vec<_> = (0..20)
        .map(|_| {
            let (stop, busy, port) = (stop.clone(), busy.clone(), relay.ui);
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    if let Some((503, _, _)) = request(
                        port,
                        "GET",
                        "/dead?topic=o*,r*,e*&limit=500",
                        &[("Accept", "application/json")],
                        "",
                        Duration::from_secs(30),
                    ) {
                        busy.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    // Live messages, one every 200 ms for 6 s, each delivered while the console is jammed.
    for _ in 0..30 {
        let id = enqueue(&db, "live");
        assert!(
            common::relay::wait(Duration::from_secs(10), || relay.delivered(id)),
            "message {id} was not delivered while the console's readers waited"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        busy.load(Ordering::SeqCst) > 0,
        "no reader was told the console is busy"
    );
    locker.batch_execute("ROLLBACK").unwrap();
    stop.store(true, Ordering::SeqCst);
    for r in readers {
        r.join().unwrap();
    }
    let (code, page) = get_json(relay.ui, "/dead?topic=orders&limit=5");
    assert_eq!(code, 200, "{page}");
    assert_eq!(page["rows"].as_array().unwrap().len(), 5);
    // The console's sessions are its own, named so.
    assert!(
        db.scalar(
            "SELECT count(*) AS v FROM pg_stat_activity
             WHERE datname = current_database() AND application_name = 'postbox console'"
        ) <= 2
    );
}

/// 300 idle connections on each listener: a probe (1 s, as kubelet's default) is answered, and
/// so is a page of the console.
#[test]
fn idle_connections_keep_no_probe_out() {
    let db = TestDb::migrated();
    let relay = Relay::start(&db, "");
    for port in [relay.metrics, relay.ui] {
        let idle: Vec<TcpStream> = (0..300)
            .filter_map(|_| TcpStream::connect(("127.0.0.1", port)).ok())
            .collect();
        assert!(idle.len() >= 250, "{} connections opened", idle.len());
        for _ in 0..10 {
            let path = if port == relay.metrics {
                "/healthz"
            } else {
                "/"
            };
            let got = request(port, "GET", path, &[], "", Duration::from_secs(1));
            assert!(
                matches!(got, Some((200, _, _))),
                "probe of {path} on {port}: {got:?}"
            );
        }
        drop(idle);
    }
}

/// A form's body is read only from a client with the token: without it, the refusal comes before
/// the body (a client trickling bodies holds nothing); with it, a body that does not arrive is cut
/// off.
#[test]
fn a_body_is_read_only_after_the_token_and_within_a_deadline() {
    let db = TestDb::migrated();
    let relay = Relay::start(&db, "");
    let send_head = |auth: bool| {
        let mut s = TcpStream::connect(("127.0.0.1", relay.ui)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
        let auth = if auth {
            format!("Authorization: Bearer {TOKEN}\r\n")
        } else {
            String::new()
        };
        write!(
            s,
            "POST /topics/pause HTTP/1.1\r\nHost: localhost\r\n{auth}Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 1000\r\n\r\ntopic="
        )
        .unwrap();
        s
    };
    let status = |mut s: TcpStream| {
        let started = Instant::now();
        let mut buf = [0u8; 64];
        let n = s.read(&mut buf).unwrap_or(0);
        let head = String::from_utf8_lossy(&buf[..n]).into_owned();
        (
            head.split_whitespace().nth(1).unwrap_or("").to_owned(),
            started.elapsed(),
        )
    };
    let (code, _) = status(send_head(false));
    assert_eq!(code, "401", "refused before the body was read");
    let (code, took) = status(send_head(true));
    assert_eq!(code, "408", "a body that never arrives is cut off");
    assert!(took < Duration::from_secs(14), "{took:?}");
    assert_eq!(db.scalar("SELECT count(*) AS v FROM postbox.pauses"), 0);
}

/// Pages of large messages carry previews cut in the database; a message's page carries its
/// payload whole up to 1 MiB and says how large it is beyond.
#[test]
fn list_pages_carry_previews_and_a_message_page_is_bounded() {
    let db = TestDb::migrated();
    db.exec("INSERT INTO postbox.pauses (pattern) VALUES ('*')");
    // 40 payloads of about 1.3 MB of text that does not compress, one of 100 kB, one small.
    db.exec(
        "INSERT INTO postbox.messages (topic, payload)
         SELECT 'big', jsonb_build_object('blob', (SELECT string_agg(md5(random()::text || g || i), '')
                                                   FROM generate_series(1, 40000) i))
         FROM generate_series(1, 40) g;
         INSERT INTO postbox.messages (topic, payload)
         VALUES ('big', jsonb_build_object('blob', repeat('y', 100000))), ('big', '{\"n\": 1}');",
    );
    let relay = Relay::start(&db, "");
    let (code, _, body) = request(
        relay.ui,
        "GET",
        "/messages?topic=big&limit=500",
        &[("Accept", "application/json")],
        "",
        Duration::from_secs(30),
    )
    .unwrap();
    assert_eq!(code, 200);
    assert!(
        body.len() < 256 * 1024,
        "a page of 42 messages carried {} bytes",
        body.len()
    );
    let page: Value = serde_json::from_str(&body).unwrap();
    let rows = page["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 42);
    let small = &rows[0];
    assert_eq!(small["payload"], serde_json::json!({"n": 1}));
    let mid = &rows[1];
    assert!(mid["payload"].is_null());
    let preview = mid["payload_preview"].as_str().unwrap();
    assert!(preview.starts_with("{\"blob\": \"yyy") && preview.ends_with('…'));
    assert!(preview.chars().count() <= 1025);
    for big in &rows[2..] {
        assert!(big["payload"].is_null() && big["payload_preview"].is_null());
        assert!(big["payload_bytes"].as_i64().unwrap() > 64 * 1024, "{big}");
    }
    // The pages: the 100 kB payload whole, a 1.3 MB one as its size.
    let mid_id = mid["id"].as_i64().unwrap();
    let (code, v) = get_json(relay.ui, &format!("/messages/{mid_id}"));
    assert_eq!(code, 200);
    assert_eq!(v["payload"]["blob"].as_str().unwrap().len(), 100_000);
    let big_id = rows[2]["id"].as_i64().unwrap();
    let (code, v) = get_json(relay.ui, &format!("/messages/{big_id}"));
    assert_eq!(code, 200);
    assert!(v["payload"].is_null());
    assert!(
        v["payload_omitted_bytes"].as_i64().unwrap() > 1024 * 1024,
        "{v}"
    );
    let (code, _, html) = request(
        relay.ui,
        "GET",
        &format!("/messages/{big_id}"),
        &[],
        "",
        Duration::from_secs(30),
    )
    .unwrap();
    assert_eq!(code, 200);
    assert!(html.contains("larger than the console shows"), "{html}");
    assert!(html.len() < 256 * 1024);
}

/// A topic that begins with a space is not the topic without it: its Pause pauses it alone, and
/// its dead letters are its own.
#[test]
fn actions_and_filters_take_topic_names_exactly_as_stored() {
    let db = TestDb::migrated();
    db.exec(
        "INSERT INTO postbox.pauses (pattern) VALUES ('other');
         INSERT INTO postbox.dead_letters (id, topic, key, ordered, payload, headers, priority, attempts, max_attempts, created_at, reason)
         SELECT g, CASE WHEN g <= 3 THEN ' ws.t' ELSE 'ws.t' END, NULL, false, '{}', '{}', 0, 1, 1, now(), 'boom'
         FROM generate_series(1, 8) g",
    );
    let relay = Relay::start(&db, "");
    let (code, body) = act(relay.ui, "/topics/pause", "topic=%20ws.t");
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.pauses WHERE pattern = ' ws.t'"),
        1
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.pauses WHERE pattern = 'ws.t'"),
        0
    );
    let (_, page) = get_json(relay.ui, "/dead?topic=%20ws.t");
    assert_eq!(page["rows"].as_array().unwrap().len(), 3);
    let (_, confirm) = get_json(relay.ui, "/dead/confirm?action=purge&topic=%20ws.t");
    assert_eq!(confirm["matching"], 3);
    // A topic paused by a pattern: the overview's Resume posts the pattern.
    db.exec(
        "INSERT INTO postbox.pauses (pattern) VALUES ('emails.*');
         INSERT INTO postbox.messages (topic) VALUES ('emails.welcome')",
    );
    let (_, _, html) = request(relay.ui, "GET", "/", &[], "", Duration::from_secs(20)).unwrap();
    assert!(
        html.contains("name=\"topic\" value=\"emails.*\"") && html.contains("Resume emails.*"),
        "{html}"
    );
    let (code, _) = act(relay.ui, "/topics/resume", "topic=emails.*");
    assert_eq!(code, 200);
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.pauses WHERE pattern = 'emails.*'"),
        0
    );
}

/// What a client sent (a topic with a line break, an `X-Forwarded-For` that reads as more
/// fields) is logged escaped: no line of the audit log is the client's.
#[test]
fn audit_lines_cannot_be_forged() {
    let db = TestDb::migrated();
    db.exec("INSERT INTO postbox.pauses (pattern) VALUES ('*')");
    let relay = Relay::start(&db, "");
    let forged = "x\n2026-01-01T00:00:00Z  INFO postbox::ui::audit: console action who=\"basic auth\" action=\"purged\"";
    let topic: String = forged.bytes().map(|b| format!("%{b:02X}")).collect();
    let (code, body) = act(relay.ui, "/enqueue", &format!("topic={topic}&payload=1"));
    assert_eq!(code, 200, "{body}");
    let csrf = "c".repeat(64);
    let (code, _, _) = request(
        relay.ui,
        "POST",
        "/topics/pause",
        &[
            ("Authorization", &format!("Bearer {TOKEN}")),
            ("Cookie", &format!("postbox_csrf={csrf}")),
            (
                "X-Forwarded-For",
                "10.9.9.9) action=\"purged\" done=100000 (x",
            ),
        ],
        &format!("topic=t&csrf={csrf}"),
        Duration::from_secs(20),
    )
    .unwrap();
    assert_eq!(code, 200);
    assert!(common::relay::wait(Duration::from_secs(10), || relay
        .log()
        .matches("console action")
        .count()
        >= 2));
    let log = relay.log();
    let audit: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("console action"))
        .collect();
    assert_eq!(audit.len(), 2, "{log}");
    assert!(!log.contains("action=\"purged\" done"), "{log}");
    assert!(
        !log.lines()
            .any(|l| l.starts_with("2026-01-01") || l.starts_with("x")),
        "{log}"
    );
    assert!(audit[0].contains("\\n2026-01-01"), "{}", audit[0]);
    assert!(
        audit[1].contains("from=Some(\"10.9.9.9) action=\\\"purged\\\""),
        "{}",
        audit[1]
    );
}

/// A token read with a line break (a Secret made from a file) is the token without it; a
/// connection string's password is never printed, however it is written.
#[test]
fn a_token_with_a_line_break_and_a_spaced_password_are_handled() {
    let db = TestDb::migrated();
    let config = std::env::temp_dir().join(format!("postbox-token-{}.toml", free_port()));
    std::fs::write(&config, "[ui]\nenabled = true\nactions = true\n").unwrap();
    let out = hermetic(BIN)
        .args(["config", "check", "--config", config.to_str().unwrap()])
        .env("POSTBOX_DATABASE_URL", &db.url)
        .env("POSTBOX_UI_TOKEN", format!("{TOKEN}\n"))
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&config);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("note: ui.token"), "{err}");
    for url in [
        "host=db user=app password = hunter2-secret dbname=x",
        "host=db user=app password='hunter2 secret' dbname=x",
    ] {
        let out = hermetic(BIN)
            .args(["config", "check"])
            .env("POSTBOX_DATABASE_URL", url)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!text.contains("secret"), "{text}");
    }
}

/// A claim that waits on a lock of the table shows as a stall of its route in the metrics
/// (`PostboxDeliveryStalled` fires on it), and goes back to 0 once it goes through.
#[test]
fn a_claim_stuck_on_a_lock_shows_as_a_stalled_route() {
    let db = TestDb::migrated();
    let relay = Relay::start(&db, "");
    let stalled = || -> f64 {
        let (_, _, body) = request(
            relay.metrics,
            "GET",
            "/metrics",
            &[],
            "",
            Duration::from_secs(5),
        )
        .unwrap_or_default();
        body.lines()
            .find(|l| l.starts_with("postbox_claim_stalled_seconds{sink=\"log\"}"))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(-1.0)
    };
    assert!(common::relay::wait(Duration::from_secs(20), || stalled() == 0.0));
    let mut migration = db.conn();
    use diesel::connection::SimpleConnection;
    migration
        .batch_execute("BEGIN; LOCK TABLE postbox.messages IN ACCESS EXCLUSIVE MODE")
        .unwrap();
    assert!(
        common::relay::wait(Duration::from_secs(30), || stalled() >= 2.0),
        "the stuck claim never showed: {}",
        stalled()
    );
    migration.batch_execute("ROLLBACK").unwrap();
    assert!(common::relay::wait(Duration::from_secs(30), || stalled() == 0.0));
}

/// What a writer can put in a message is carried bounded, whatever its shape: a payload of
/// nested arrays of empty strings (which pretty-printing and attribute escaping used to grow
/// sixty-fold), headers of megabytes, a key of a megabyte; on a message's page and on a list.
#[test]
fn no_value_a_writer_can_write_makes_a_page_grow_past_its_bounds() {
    let db = TestDb::migrated();
    db.exec(
        "INSERT INTO postbox.pauses (pattern) VALUES ('w.*');
         INSERT INTO postbox.messages (topic, payload)
         SELECT 'w.nest', (repeat('[', 120) || string_agg('\"\"', ',') || repeat(']', 120))::jsonb
         FROM generate_series(1, 200000);
         INSERT INTO postbox.messages (topic, payload, headers)
         VALUES ('w.hdr', '{}', jsonb_build_object('h', repeat('\"', 5000000)));
         INSERT INTO postbox.messages (topic, key, payload, run_at)
         SELECT 'w.key', repeat('\"', 1000000) || g, '{}', now() + interval '1 day'
         FROM generate_series(1, 50) g;",
    );
    let relay = Relay::start(&db, "");
    let id = |topic: &str| {
        db.scalar(&format!(
            "SELECT min(id) AS v FROM postbox.messages WHERE topic = '{topic}'"
        ))
    };
    for (path, json) in [
        (format!("/messages/{}", id("w.nest")), false),
        (format!("/messages/{}", id("w.nest")), true),
        (format!("/messages/{}", id("w.hdr")), false),
        (format!("/messages/{}", id("w.key")), false),
        ("/messages?topic=w.*&limit=500".to_owned(), false),
        ("/messages?topic=w.*&limit=500".to_owned(), true),
    ] {
        let accept = if json {
            "application/json"
        } else {
            "text/html"
        };
        let (code, _, body) = request(
            relay.ui,
            "GET",
            &path,
            &[("Accept", accept)],
            "",
            Duration::from_secs(30),
        )
        .unwrap();
        assert!(
            code == 200 && body.len() < 8 * 1024 * 1024,
            "{path} ({accept}): {code}, {} bytes",
            body.len()
        );
    }
    let (_, v) = get_json(relay.ui, &format!("/messages/{}", id("w.hdr")));
    assert!(
        v["headers_omitted_bytes"].as_i64().unwrap() > 64 * 1024,
        "{v}"
    );
    let (_, v) = get_json(relay.ui, &format!("/messages/{}", id("w.key")));
    assert!(
        v["key"].as_str().unwrap().len() <= 8 * 1024,
        "a key of a megabyte carried whole"
    );
}

/// A topic whose name holds `,` or `*` is its own: the overview's links list its dead letters
/// alone, and "purge all matching" from there purges them alone.
#[test]
fn a_topic_named_with_a_comma_or_a_star_is_acted_on_alone() {
    let db = TestDb::migrated();
    db.exec(
        "INSERT INTO postbox.dead_letters (id, topic, key, ordered, payload, headers, priority, attempts, max_attempts, created_at, reason)
         SELECT g, (ARRAY['pay', 'ment', 'pay,ment', 'orders', 'ord*s'])[1 + g % 5], NULL, false, '{}', '{}', 0, 1, 1, now(), 'boom'
         FROM generate_series(1, 50) g",
    );
    let relay = Relay::start(&db, "");
    let (_, _, html) = request(relay.ui, "GET", "/", &[], "", Duration::from_secs(20)).unwrap();
    for name in ["pay%2Cment", "ord*s"] {
        let link = format!("/dead?exact={name}");
        assert!(html.contains(&link), "no link {link}: {html}");
        let (code, page) = get_json(relay.ui, &format!("{link}&limit=500"));
        assert_eq!(code, 200, "{page}");
        assert_eq!(page["rows"].as_array().unwrap().len(), 10, "{link}: {page}");
        let (_, confirm) = get_json(
            relay.ui,
            &format!("/dead/confirm?exact={name}&action=purge"),
        );
        assert_eq!(confirm["matching"], 10);
        let selection = confirm["selection"].as_str().unwrap().to_owned();
        let (code, body) = act(
            relay.ui,
            "/dead/purge",
            &format!("exact={name}&expected=10&selection={selection}"),
        );
        assert_eq!(code, 200, "{body}");
    }
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters WHERE topic IN ('pay', 'ment', 'orders')"),
        30,
        "other topics' dead letters were purged"
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters"),
        30
    );
}

/// Clients that ask for a page whose statement waits (a lock on the dead letters) and go at once:
/// each statement keeps its connection to its end, so the console never holds more sessions than
/// its pool.
#[test]
fn clients_that_go_leave_no_more_console_sessions_than_its_pool() {
    let db = TestDb::migrated();
    let relay = Relay::start(&db, "pool_size = 2\nstatement_timeout = \"3s\"");
    let mut locker = db.conn();
    use diesel::connection::SimpleConnection;
    locker
        .batch_execute("BEGIN; LOCK TABLE postbox.dead_letters IN ACCESS EXCLUSIVE MODE")
        .unwrap();
    let sessions = "SELECT count(*) AS v FROM pg_stat_activity
        WHERE datname = current_database() AND application_name = 'postbox console'";
    let mut most = 0;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(8) {
        for _ in 0..5 {
            if let Ok(mut s) = TcpStream::connect(("127.0.0.1", relay.ui)) {
                let _ = write!(
                    s,
                    "GET /dead?limit=5 HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n\r\n"
                );
                std::thread::sleep(Duration::from_millis(20));
                drop(s);
            }
        }
        most = most.max(db.scalar(sessions));
    }
    locker.batch_execute("ROLLBACK").unwrap();
    assert!(most <= 2, "{most} console sessions with a pool of 2");
}
