//! The operator console (`[ui]`) over HTTP against a real relay and PostgreSQL: the overview, the
//! filtered and paginated lists, a message's page, JSON at the same URLs, bad input as a 4xx with
//! its reason, and actions only with the token, from the console's own pages.

mod common;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{TestDb, free_port, hermetic};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_postbox");
const TOKEN: &str = "a-console-token-of-some-length";

/// A relay serving the console, killed when dropped.
struct Console {
    child: Child,
    port: u16,
    _config: std::path::PathBuf,
}

impl Console {
    fn start(db: &TestDb, ui: &str) -> Console {
        let port = free_port();
        let config = std::env::temp_dir().join(format!("postbox-ui-{port}.toml"));
        std::fs::write(
            &config,
            format!(
                "database_url = \"{}\"\n[metrics]\nlisten = \"off\"\n[ui]\nenabled = true\nlisten = \"127.0.0.1:{port}\"\n{ui}\n",
                db.url
            ),
        )
        .unwrap();
        let child = hermetic(BIN)
            .args(["run", "--config", config.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "the console never listened");
            std::thread::sleep(Duration::from_millis(20));
        }
        Console {
            child,
            port,
            _config: config,
        }
    }

    /// One request; the status, the headers (lower-cased names) and the body.
    fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> (u16, String, String) {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nConnection: close\r\n",
            self.port
        );
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
        s.write_all(req.as_bytes()).unwrap();
        let mut buf = String::new();
        s.read_to_string(&mut buf).unwrap();
        let (head, body) = buf.split_once("\r\n\r\n").unwrap_or((&buf, ""));
        let code = head.split_whitespace().nth(1).unwrap().parse().unwrap();
        (code, head.to_lowercase(), body.to_owned())
    }

    fn json(&self, path: &str) -> (u16, Value) {
        let (code, _, body) = self.request("GET", path, &[("Accept", "application/json")], "");
        (
            code,
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}")),
        )
    }

    fn post(&self, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
        let mut h = vec![("Accept", "application/json")];
        h.extend_from_slice(headers);
        let (code, _, body) = self.request("POST", path, &h, body);
        (code, body)
    }
}

impl Drop for Console {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self._config);
    }
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

/// Three topics of messages, paused so that the relay leaves them queued, and dead letters.
fn seeded() -> TestDb {
    let db = unpaused();
    db.exec("INSERT INTO postbox.pauses (pattern) VALUES ('*')");
    db
}

/// [`seeded`] without the pause.
fn unpaused() -> TestDb {
    let db = TestDb::migrated();
    db.exec(
        "INSERT INTO postbox.messages (topic, key, payload, headers)
         SELECT (ARRAY['orders','emails','reports'])[1 + i % 3], 'c-' || (i % 50),
                jsonb_build_object('customer', 'c-' || (i % 50), 'n', i), '{\"type\": \"created\"}'
         FROM generate_series(1, 3000) i;
         INSERT INTO postbox.messages (topic, payload) VALUES ('orders', '{\"note\": \"<script>alert(1)</script>\"}');
         INSERT INTO postbox.dead_letters (id, topic, key, ordered, payload, headers, priority, attempts, max_attempts, created_at, reason)
         SELECT 100000 + i, 'orders', 'd-' || i, false, jsonb_build_object('customer', 'c-' || (i % 3)), '{}', 0, 3, 3, now(), 'boom'
         FROM generate_series(1, 9) i;",
    );
    db
}

#[test]
fn the_console_filters_pages_and_answers_json_and_html() {
    let db = seeded();
    let ui = Console::start(&db, "");

    let (code, overview) = ui.json("/");
    assert_eq!(code, 200);
    let topics = overview["topics"].as_array().unwrap();
    let orders = topics.iter().find(|t| t["topic"] == "orders").unwrap();
    assert_eq!(orders["available"], 1001);
    assert_eq!(orders["dead"], 9);
    assert_eq!(overview["paused"], json!(["*"]));

    // A JSON containment filter, followed page by page: exactly the matching rows, newest first.
    let filter = format!("topic=orders&payload={}", enc(r#"{"customer": "c-42"}"#));
    let mut seen = Vec::new();
    let mut path = format!("/messages?{filter}&limit=7");
    loop {
        let (code, page) = ui.json(&path);
        assert_eq!(code, 200, "{page}");
        for row in page["rows"].as_array().unwrap() {
            assert_eq!(row["topic"], "orders");
            assert_eq!(row["payload"]["customer"], "c-42");
            seen.push(row["id"].as_i64().unwrap());
        }
        match page["next"].as_i64() {
            Some(next) => path = format!("/messages?{filter}&limit=7&before={next}"),
            None => break,
        }
    }
    let expected: Vec<i64> = {
        let mut v: Vec<i64> = (1..=3000)
            .filter(|i| 1 + i % 3 == 1 && i % 50 == 42)
            .map(|i| i as i64)
            .collect();
        v.reverse();
        v
    };
    // Ids are 1..=3000 in insertion order on a fresh database.
    assert_eq!(seen, expected);
    assert_eq!(
        seen.iter().collect::<BTreeSet<_>>().len(),
        seen.len(),
        "no row twice"
    );

    // Glob topics and a state; an id range.
    let (_, page) =
        ui.json("/messages?topic=em*,rep*&state=available&min_id=10&max_id=20&limit=50");
    let ids: Vec<i64> = page["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_i64().unwrap())
        .collect();
    assert_eq!(ids, vec![20, 19, 17, 16, 14, 13, 11, 10]);

    // A message's page.
    let (code, m) = ui.json("/messages/42");
    assert_eq!(code, 200);
    assert_eq!(m["status"], "queued");
    assert_eq!(m["payload"]["n"], 42);

    // Bad input: a 4xx that says what is wrong, as a page and as JSON.
    for (path, code, says) in [
        (
            format!("/messages?payload={}", enc("{bad")),
            400,
            "payload: not valid JSON",
        ),
        ("/messages?state=gone".to_owned(), 400, "state"),
        ("/messages?min_id=x".to_owned(), 400, "min_id"),
        ("/messages?older_than=soon".to_owned(), 400, "older_than"),
        ("/messages?limit=100000".to_owned(), 400, "limit"),
        ("/messages/abc".to_owned(), 400, "not a message id"),
        ("/messages/999999".to_owned(), 404, "no message 999999"),
        (format!("/dead?headers={}", enc("[1]")), 400, "headers"),
        ("/dead?state=available".to_owned(), 400, "state"),
        ("/messages?key=%00".to_owned(), 400, "NUL"),
        (
            format!("/messages?payload={}", enc(r#"{"a": "\u0000"}"#)),
            400,
            "NUL",
        ),
        (
            "/messages?older_than=99999999999d".to_owned(),
            400,
            "older_than",
        ),
    ] {
        let (got, _, body) = ui.request("GET", &path, &[], "");
        assert_eq!(got, code, "{path}: {body}");
        assert!(body.contains(says), "{path}: {body}");
        let (got, v) = ui.json(&path);
        assert_eq!(got, code, "{path}");
        assert!(v["error"].as_str().unwrap().contains(says), "{path}: {v}");
    }

    // HTML: values are escaped, the page sets its CSRF cookie, read-only pages show no forms.
    let (code, head, body) = ui.request("GET", "/messages?topic=orders&limit=1", &[], "");
    assert_eq!(code, 200);
    assert!(head.contains("set-cookie: postbox_csrf="), "{head}");
    assert!(
        !body.contains("<script>alert"),
        "a payload's markup must be escaped"
    );
    assert!(body.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
    let (_, _, dead) = ui.request("GET", "/dead", &[], "");
    assert!(!dead.contains("all matching"), "read-only: no action links");
    // Read-only: the confirmation page (which counts what an action would take) is not served.
    let (code, _, confirm) = ui.request("GET", "/dead/confirm?action=purge", &[], "");
    assert_eq!(code, 404, "{confirm}");
    assert!(confirm.contains("actions are off"), "{confirm}");
}

#[test]
fn actions_need_the_token_and_a_form_of_the_console() {
    let db = seeded();
    let ui = Console::start(&db, &format!("actions = true\ntoken = \"{TOKEN}\""));
    let paused = || db.scalar("SELECT count(*) AS v FROM postbox.pauses");
    let dead = || db.scalar("SELECT count(*) AS v FROM postbox.dead_letters");
    let basic = format!("Basic {}", base64(&format!("oncall:{TOKEN}")));
    let bearer = format!("Bearer {TOKEN}");

    // No credential, a wrong one: refused, nothing changed.
    let (code, body) = ui.post("/topics/resume", &[], "topic=*");
    assert_eq!(code, 401, "{body}");
    let (code, _) = ui.post(
        "/topics/resume",
        &[("Authorization", "Bearer not-the-token-at-all")],
        "topic=*",
    );
    assert_eq!(code, 401);
    // A browser's credential without the page's CSRF token, or from another site: refused.
    let (code, body) = ui.post("/topics/resume", &[("Authorization", &basic)], "topic=*");
    assert_eq!(code, 403, "{body}");
    let (code, _) = ui.post(
        "/topics/resume",
        &[
            ("Authorization", &basic),
            ("Cookie", "postbox_csrf=abc"),
            ("Origin", "http://evil.example"),
        ],
        "topic=*&csrf=abc",
    );
    assert_eq!(code, 403);
    let (code, _) = ui.post(
        "/topics/resume",
        &[
            ("Authorization", &basic),
            ("Cookie", "postbox_csrf=abc"),
            ("Sec-Fetch-Site", "cross-site"),
        ],
        "topic=*&csrf=abc",
    );
    assert_eq!(code, 403);
    assert_eq!(paused(), 1);

    // The console's own form: the cookie its page set, the same token in the form.
    let (_, head, page) = ui.request("GET", "/", &[("Authorization", &basic)], "");
    let cookie = head
        .lines()
        .find_map(|l| l.strip_prefix("set-cookie: postbox_csrf="))
        .and_then(|v| v.split(';').next())
        .unwrap()
        .to_owned();
    assert!(
        page.contains(&format!("name=\"csrf\" value=\"{cookie}\"")),
        "the form carries the cookie's token"
    );
    let (code, body) = ui.post(
        "/topics/resume",
        &[
            ("Authorization", &basic),
            ("Cookie", &format!("postbox_csrf={cookie}")),
            ("Origin", &format!("http://127.0.0.1:{}", ui.port)),
        ],
        &format!("topic={}&csrf={cookie}", enc("*")),
    );
    assert_eq!(code, 200, "{body}");
    assert_eq!(paused(), 0);
    let (code, _) = ui.post(
        "/topics/pause",
        &[("Authorization", &bearer)],
        "topic=orders",
    );
    assert_eq!(code, 200);
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.pauses WHERE pattern = 'orders'"),
        1
    );

    // Replay everything a filter matches — the topic filter included: another topic's dead
    // letters that match the payload stay — with the count and the selection the user saw.
    db.exec(
        "INSERT INTO postbox.dead_letters (id, topic, ordered, payload, headers, priority, attempts, max_attempts, created_at, reason)
         VALUES (200001, 'emails', false, '{\"customer\": \"c-1\"}', '{}', 0, 3, 3, now(), 'boom'),
                (200002, 'emails', false, '{\"customer\": \"c-1\"}', '{}', 0, 3, 3, now(), 'boom')",
    );
    let filter = format!("topic=orders&payload={}", enc(r#"{"customer": "c-1"}"#));
    let (_, listed) = ui.json(&format!("/dead/confirm?{filter}&action=replay"));
    assert_eq!(listed["matching"], 3);
    let selection = listed["selection"].as_str().unwrap().to_owned();
    // A stale count, or no selection: refused, nothing changed.
    for form in [
        format!("{filter}&expected=2&selection={selection}"),
        format!("{filter}&expected=3"),
    ] {
        let (code, body) = ui.post("/dead/replay", &[("Authorization", &bearer)], &form);
        assert_eq!(code, 409, "{form}: {body}");
        assert_eq!(dead(), 11);
    }
    let (code, body) = ui.post(
        "/dead/replay",
        &[("Authorization", &bearer)],
        &format!("{filter}&expected=3&selection={selection}"),
    );
    assert_eq!(code, 200, "{body}");
    assert_eq!(dead(), 8);
    assert_eq!(
        db.scalar(
            "SELECT count(*) AS v FROM postbox.messages WHERE id IN (100001, 100004, 100007)"
        ),
        3
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters WHERE topic = 'emails'"),
        2
    );

    // The same count but not the same dead letters (one went, another came to match): refused.
    let (_, listed) = ui.json("/dead/confirm?topic=orders&action=purge");
    assert_eq!(listed["matching"], 6);
    let selection = listed["selection"].as_str().unwrap().to_owned();
    db.exec(
        "DELETE FROM postbox.dead_letters WHERE id = 100002;
         INSERT INTO postbox.dead_letters (id, topic, ordered, payload, headers, priority, attempts, max_attempts, created_at, reason)
         VALUES (300001, 'orders', false, '{}', '{}', 0, 3, 3, now(), 'boom')",
    );
    let form = format!("topic=orders&expected=6&selection={selection}");
    let (code, _) = ui.post("/dead/purge", &[("Authorization", &bearer)], &form);
    assert_eq!(code, 409);
    let (_, listed) = ui.json("/dead/confirm?topic=orders&action=purge");
    let form = format!(
        "topic=orders&expected=6&selection={}",
        listed["selection"].as_str().unwrap()
    );
    let (code, _) = ui.post("/dead/purge", &[("Authorization", &bearer)], &form);
    assert_eq!(code, 200);
    assert_eq!(dead(), 2, "the other topic's dead letters stay");
}

#[test]
fn a_read_only_console_refuses_actions_and_can_hide_payloads() {
    let db = seeded();
    let ui = Console::start(&db, "show_payloads = false");
    let (code, body) = ui.post(
        "/topics/resume",
        &[("Authorization", &format!("Bearer {TOKEN}"))],
        "topic=*",
    );
    assert_eq!(code, 403, "{body}");
    assert!(body.contains("read-only"));
    let (_, page) = ui.json("/messages?topic=orders&limit=3");
    for row in page["rows"].as_array().unwrap() {
        assert_eq!(row["payload"], Value::Null);
    }
    let (_, m) = ui.json("/messages/42");
    assert_eq!(m["payload"], Value::Null);
    // A payload filter would tell hidden payloads one guess at a time.
    let (code, v) = ui.json(&format!("/messages?payload={}", enc(r#"{"n": 42}"#)));
    assert_eq!(code, 400, "{v}");
    let (_, _, html) = ui.request("GET", "/messages/42", &[], "");
    assert!(
        html.contains("hidden") && !html.contains("\"n\": 42"),
        "{html}"
    );
    // With actions on and payloads hidden, a dead-letter action's payload filter is refused too
    // (its count would tell whether a guess matched), and so is its confirmation page.
    drop(ui);
    let ui = Console::start(
        &db,
        &format!("show_payloads = false\nactions = true\ntoken = \"{TOKEN}\""),
    );
    let payload = enc(r#"{"customer": "c-1"}"#);
    let (code, body) = ui.post(
        "/dead/purge",
        &[("Authorization", &format!("Bearer {TOKEN}"))],
        &format!("payload={payload}&expected=3&selection=x"),
    );
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("payloads are hidden"), "{body}");
    let (code, _) = ui.json(&format!("/dead/confirm?action=purge&payload={payload}"));
    assert_eq!(code, 400);
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters"),
        9
    );
}

#[test]
fn bad_console_settings_name_their_field() {
    for (toml, env, field) in [
        ("[ui]\nenabled = true\nactions = true\n", None, "ui.actions"),
        (
            "[ui]\nenabled = true\ntoken = \"short\"\n",
            None,
            "ui.token",
        ),
        ("[ui]\nenabled = true\n", Some("short"), "POSTBOX_UI_TOKEN"),
        (
            "[ui]\nenabled = true\nlisten = \"nowhere\"\n",
            None,
            "ui.listen",
        ),
        (
            "[ui]\nenabled = true\npath_prefix = \"postbox/\"\n",
            None,
            "ui.path_prefix",
        ),
        (
            "[ui]\nenabled = true\nallowed_hosts = [\"http://console.internal\"]\n",
            None,
            "ui.allowed_hosts",
        ),
        (
            "[ui]\nenabled = true\nallowed_hosts = [\"console.internal:9465\"]\n",
            None,
            "ui.allowed_hosts",
        ),
        (
            "[ui]\nenabled = true\nallowed_hosts = []\n",
            None,
            "ui.allowed_hosts",
        ),
    ] {
        let config =
            std::env::temp_dir().join(format!("postbox-ui-bad-{}.toml", fastrand::u64(..)));
        std::fs::write(&config, toml).unwrap();
        let mut cmd = hermetic(BIN);
        cmd.args(["--config", config.to_str().unwrap(), "config", "check"]);
        if let Some(t) = env {
            cmd.env("POSTBOX_UI_TOKEN", t);
        }
        let out = cmd.output().unwrap();
        let _ = std::fs::remove_file(&config);
        assert_eq!(out.status.code(), Some(2), "{toml}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(field), "{toml}: {err}");
    }
}

fn base64(s: &str) -> String {
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in s.as_bytes().chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(A[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A backlog of a million messages in three topics (`orders`, `invoices`, `reports`; not routed,
/// so they stay), a thousand `emails` the relay delivers, and nine dead letters.
fn million() -> TestDb {
    let db = TestDb::migrated();
    db.exec(
        "INSERT INTO postbox.messages (topic, key, payload, headers)
         SELECT (ARRAY['orders','invoices','reports'])[1 + i % 3], 'c-' || (i % 50),
                jsonb_build_object('customer', 'c-' || (i % 50), 'n', i), '{\"type\": \"created\"}'
         FROM generate_series(1, 1000000) i;
         INSERT INTO postbox.messages (topic, payload)
         SELECT 'emails', jsonb_build_object('n', i) FROM generate_series(1, 1000) i;
         INSERT INTO postbox.dead_letters (id, topic, key, ordered, payload, headers, priority, attempts, max_attempts, created_at, reason)
         SELECT 2000000 + i, 'orders', 'd-' || i, false, jsonb_build_object('customer', 'c-' || (i % 3)), '{}', 0, 3, 3, now(), 'boom'
         FROM generate_series(1, 9) i;",
    );
    db
}

/// A page of another site (`localhost`, where the console is `127.0.0.1`) that posts a form to the
/// console as soon as it loads: a forged cross-site request.
fn forger(console_port: u16) -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let page = format!(
        "<!doctype html><html><body><form id=\"f\" method=\"post\" action=\"http://127.0.0.1:{console_port}/topics/pause\">\
         <input name=\"topic\" value=\"orders\"><input name=\"csrf\" value=\"guessed\"></form>\
         <script>document.getElementById('f').submit()</script></body></html>"
    );
    std::thread::spawn(move || {
        for mut s in listener.incoming().flatten() {
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let _ = write!(
                s,
                "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{page}",
                page.len()
            );
        }
    });
    port
}

/// What a person does in a real browser (headless Chromium), over a million-message backlog: the
/// overview (with the relay's rate and sink), a JSON filter typed into the messages form, a
/// message opened from the list, a topic paused and resumed with its buttons, every dead letter a
/// filter matches replayed with its button, one picked and purged, a schedule run now, a message
/// enqueued from the form; each effect checked in the database, and a screenshot of each page
/// written to `target/ui-screenshots/`. A page of another site that posts to the console, in the
/// same browser that holds the credentials, is refused.
#[test]
fn a_person_uses_the_console_in_a_browser() {
    let db = million();
    // Only `emails` is routed: the other topics stay queued for the pages to show.
    let ui = Console::start(
        &db,
        &format!(
            "actions = true\ntoken = \"{TOKEN}\"\n[[routes]]\ntopics = [\"emails\"]\nsink = \"log\"\n\
             [[schedules]]\nname = \"nightly\"\ncron = \"0 0 3 * * *\"\ntopic = \"reports.nightly\"\n\
             [[limits]]\ntopics = [\"emails\"]\nmax_running = 7"
        ),
    );
    let shots = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/ui-screenshots");
    let base = format!("http://127.0.0.1:{}", ui.port);
    let browser = common::webdriver::Browser::start();
    browser.always_send(
        "Authorization",
        &format!("Basic {}", base64(&format!("oncall:{TOKEN}"))),
    );

    // The overview of the backlog; the routed topic drained, by the log sink, at its rate.
    poll("emails delivered", || {
        (db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE topic = 'emails'") == 0)
            .then_some(())
    });
    browser.goto(&format!("{base}/"));
    let text = browser.text();
    assert!(
        text.contains("orders") && text.contains("invoices") && text.contains("reports"),
        "{text}"
    );
    assert!(text.contains("log up"), "{text}");
    browser.screenshot(&shots.join("overview.png"));

    // Filter the messages by payload JSON, through the form.
    browser.goto(&format!("{base}/messages"));
    browser.fill("input[name=topic]", "orders");
    browser.fill("input[name=payload]", r#"{"customer": "c-42"}"#);
    browser.click("form.filter button[type=submit]");
    browser.wait_url("payload=");
    let text = browser.wait_for("c-42");
    assert!(!text.contains("c-41 "), "{text}");
    browser.screenshot(&shots.join("messages.png"));

    // Open the first message of the list.
    browser.click("tbody td a");
    browser.wait_for("queued");
    assert!(browser.url().contains("/messages/"), "{}", browser.url());
    browser.screenshot(&shots.join("message.png"));

    // Pause a topic with its button, then resume it.
    browser.goto(&format!("{base}/"));
    browser.click("form[action='/topics/pause'] input[value=reports] ~ button");
    browser.wait_for("paused reports");
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.pauses WHERE pattern = 'reports'"),
        1
    );
    browser.goto(&format!("{base}/"));
    browser.screenshot(&shots.join("overview-paused.png"));
    browser.click("form[action='/topics/resume'] input[value=reports] ~ button");
    browser.wait_for("resumed reports");
    assert_eq!(db.scalar("SELECT count(*) AS v FROM postbox.pauses"), 0);

    // Replay every dead letter a filter matches.
    browser.goto(&format!("{base}/dead"));
    browser.fill("input[name=payload]", r#"{"customer": "c-2"}"#);
    browser.click("form.filter button[type=submit]");
    browser.wait_url("payload=");
    browser.screenshot(&shots.join("dead.png"));
    browser.click("a[href*='action=replay']");
    browser.wait_for("3 dead letters match");
    browser.screenshot(&shots.join("dead-confirm.png"));
    browser.click("form[action='/dead/replay'] button");
    browser.wait_for("replayed 3 dead letters");
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters"),
        6
    );
    assert_eq!(
        db.scalar(
            "SELECT count(*) AS v FROM postbox.messages WHERE id IN (2000002, 2000005, 2000008)"
        ),
        3
    );

    // Pick one dead letter in the list and purge it.
    browser.goto(&format!("{base}/dead"));
    browser.click("input[type=checkbox][value='2000001']");
    browser.click("form#pick button[value=purge]");
    browser.wait_for("purged 1 of 1 picked dead letters");
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters WHERE id = 2000001"),
        0
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters"),
        5
    );

    // Run a schedule now.
    browser.goto(&format!("{base}/schedules"));
    browser.wait_for("nightly");
    browser.screenshot(&shots.join("schedules.png"));
    browser.click("form[action='/schedules/run'] button");
    browser.wait_for("enqueued message");
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE topic = 'reports.nightly'"),
        1
    );

    // The limits page.
    browser.goto(&format!("{base}/limits"));
    browser.wait_for("emails");
    browser.screenshot(&shots.join("limits.png"));

    // Enqueue a message from the form: first with a payload that is not JSON, then right.
    browser.goto(&format!("{base}/enqueue"));
    browser.fill("input[name=topic]", "audit");
    browser.fill("input[name=key]", "k-1");
    browser.fill("textarea[name=payload]", r#"{"by": "browser""#);
    browser.click("form.enqueue button[type=submit]");
    browser.wait_for("payload: not valid JSON");
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE topic = 'audit'"),
        0
    );
    browser.fill("textarea[name=payload]", r#"{"by": "browser"}"#);
    browser.click("form.enqueue button[type=submit]");
    browser.wait_for("enqueued message");
    browser.screenshot(&shots.join("enqueue.png"));
    assert_eq!(
        db.scalar(
            "SELECT count(*) AS v FROM postbox.messages
             WHERE topic = 'audit' AND key = 'k-1' AND payload = '{\"by\": \"browser\"}'"
        ),
        1
    );

    // Cancel all of a topic: the confirmation page (not submitted: a third of a million rows).
    browser.goto(&format!("{base}/topics/cancel?topic=invoices"));
    browser.wait_for("Type the topic's name to confirm");
    browser.screenshot(&shots.join("cancel.png"));

    // Without the credential (the browser stops sending it), an action is refused: nothing paused.
    browser.goto(&format!("{base}/"));
    browser.always_send("X-Nothing", "1");
    browser.click("form[action='/topics/pause'] input[value=orders] ~ button");
    // The 401 asks for basic auth; headless, no one answers, and the page stays empty.
    browser.wait_url("/topics/pause");
    assert!(!browser.text().contains("paused orders"));
    assert_eq!(db.scalar("SELECT count(*) AS v FROM postbox.pauses"), 0);

    // A page of another site posts to the console from this same browser, which sends the
    // credentials with every request again: refused, nothing paused.
    browser.always_send(
        "Authorization",
        &format!("Basic {}", base64(&format!("oncall:{TOKEN}"))),
    );
    let evil = forger(ui.port);
    browser.goto(&format!("http://localhost:{evil}/"));
    browser.wait_for("another site");
    assert_eq!(db.scalar("SELECT count(*) AS v FROM postbox.pauses"), 0);
}

/// Against DNS rebinding: a console on a loopback address answers only loopback host names by
/// default; `allowed_hosts` names others, `"*"` any.
#[test]
fn the_console_answers_only_its_own_host_names() {
    let db = seeded();
    let ui = Console::start(&db, "");
    for (h, code) in [
        ("localhost:1234", 200),
        ("LOCALHOST", 200),
        ("[::1]:9465", 200),
        ("attacker.example:9465", 421),
        ("127.0.0.1.attacker.example", 421),
        ("[::1]evil", 421),
        ("localhost:evil", 421),
        ("127.0.0.1:9465@evil.example", 421),
        ("localhost:", 421),
    ] {
        assert_eq!(host_only(&ui, h), code, "{h}");
    }
    // An absolute-form target names the host that governs; two Host headers are refused.
    for req in [
        "GET http://attacker.example/ HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: localhost\r\nHost: attacker.example\r\nConnection: close\r\n\r\n",
    ] {
        assert_ne!(raw_status(&ui, req), 200, "{req}");
    }
    assert_eq!(
        raw_status(
            &ui,
            "GET http://localhost:1/ HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        ),
        200
    );
    drop(ui);
    let ui = Console::start(&db, "allowed_hosts = [\"Console.Internal\"]");
    assert_eq!(host_only(&ui, "console.internal:443"), 200);
    assert_eq!(host_only(&ui, "127.0.0.1"), 421);
    drop(ui);
    let ui = Console::start(&db, "allowed_hosts = [\"*\"]");
    assert_eq!(host_only(&ui, "anything.example"), 200);
}

/// The status of `GET /` with only this `Host` header.
fn host_only(ui: &Console, host: &str) -> u16 {
    raw_status(
        ui,
        &format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"),
    )
}

/// The status of a request written as it is.
fn raw_status(ui: &Console, request: &str) -> u16 {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", ui.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).unwrap();
    buf.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn behind_a_path_prefix_every_link_carries_it() {
    let db = seeded();
    let ui = Console::start(&db, "path_prefix = \"/pb\"");
    for path in ["/pb", "/pb/messages", "/pb/dead", "/pb/messages/42"] {
        let (code, _, body) = ui.request("GET", path, &[], "");
        assert_eq!(code, 200, "{path}");
        assert!(body.contains("href=\"/pb\">Overview"), "{path}");
        assert!(body.contains("href=\"/pb/messages\""), "{path}");
    }
    let (code, _, _) = ui.request("GET", "/messages", &[], "");
    assert_eq!(code, 404);
}

/// Enqueues through the console's form; the new id.
fn ui_enqueue(ui: &Console, auth: &[(&str, &str)], form: &str) -> i64 {
    let (code, body) = ui.post("/enqueue", auth, form);
    assert_eq!(code, 200, "{form}: {body}");
    serde_json::from_str::<Value>(&body).unwrap()["enqueued"]
        .as_i64()
        .unwrap()
}

/// Polls `f` until it returns `Some`, or fails after 30 s.
fn poll<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The relay's side of the overview (rates, sinks), schedules run now, limits, the enqueue form
/// validated as the API validates, a message's place in its key, a topic cancelled only when
/// its name is typed again, dead letters picked one by one.
#[test]
fn schedules_limits_enqueue_cancel_and_picked_dead_letters() {
    let db = unpaused();
    let ui = Console::start(
        &db,
        &format!(
            "actions = true\ntoken = \"{TOKEN}\"\n[[routes]]\ntopics = [\"emails\"]\nsink = \"log\"\n\
             [[schedules]]\nname = \"nightly\"\ncron = \"0 0 3 * * *\"\ntopic = \"reports.nightly\"\n\
             [[limits]]\ntopics = [\"emails\"]\nmax_running = 7"
        ),
    );
    let bearer = format!("Bearer {TOKEN}");
    let auth = [("Authorization", bearer.as_str())];

    // Overview: the routed topic drains to the log sink, and its rate and sink show; the
    // others have no sink in this relay.
    let emails = poll("emails delivered and counted", || {
        let (_, v) = ui.json("/");
        let t = v["topics"]
            .as_array()?
            .iter()
            .find(|t| t["topic"] == "emails")?
            .clone();
        (t["per_minute"]["delivered"].as_u64()? == 1000).then_some(t)
    });
    assert_eq!(emails["sink"], json!({"name": "log", "up": true}));
    assert_eq!(emails["last_hour"].as_array().unwrap().len(), 1);
    let (_, v) = ui.json("/");
    let orders = v["topics"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["topic"] == "orders")
        .unwrap();
    assert_eq!(orders["sink"], Value::Null);
    assert_eq!(orders["available"], 1001);
    let (_, _, html) = ui.request("GET", "/", &[], "");
    assert!(html.contains("<svg class=\"chart\""), "{html}");
    assert!(html.contains("log <span class=\"up\">up</span>"), "{html}");

    // Schedules: the relay registered its schedule; run it now, twice: two messages, each with a
    // dedup key of its own, and the ticks untouched.
    let (_, v) = poll("the schedule registered", || {
        let (c, v) = ui.json("/schedules");
        (v["schedules"].as_array()?.len() == 1).then_some((c, v))
    });
    assert_eq!(v["schedules"][0]["name"], "nightly");
    assert_eq!(v["schedules"][0]["this_relay"], true);
    assert_eq!(v["schedules"][0]["last_tick"], Value::Null);
    for _ in 0..2 {
        let (code, body) = ui.post("/schedules/run", &auth, "name=nightly");
        assert_eq!(code, 200, "{body}");
    }
    assert_eq!(
        db.scalar(
            "SELECT count(DISTINCT dedup_key) AS v FROM postbox.messages
             WHERE topic = 'reports.nightly' AND dedup_key LIKE 'schedule:nightly:run-now:%'
               AND headers->>'cron-schedule' = 'nightly'"
        ),
        2
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.schedules WHERE last_tick IS NOT NULL"),
        0
    );
    let (code, body) = ui.post("/schedules/run", &auth, "name=weekly");
    assert_eq!(code, 404, "{body}");
    let (code, _) = ui.post("/schedules/run", &[], "name=nightly");
    assert_eq!(code, 401);

    // Limits: what runs now against each.
    let (code, v) = ui.json("/limits");
    assert_eq!(code, 200);
    assert_eq!(v["limits"][0]["max_running"], 7);
    assert_eq!(v["limits"][0]["topics"], json!(["emails"]));
    assert!(v["limits"][0]["running"].as_i64().unwrap() <= 7);

    // Enqueue: every mistake is a 400 naming the field, nothing enqueued.
    let before = db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v");
    for (form, field) in [
        ("topic=&payload=%7B%7D", "topic"),
        ("topic=t&payload=%7Bnope", "payload"),
        ("topic=t&headers=%7B%22a%22%3A1%7D", "headers"),
        ("topic=t&delay=soon", "delay"),
        ("topic=t&payload=%22%5Cu0000%22", "payload"),
    ] {
        let (code, body) = ui.post("/enqueue", &auth, form);
        assert_eq!(code, 400, "{form}: {body}");
        assert!(body.contains(field), "{form}: {body}");
    }
    assert_eq!(
        db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"),
        before
    );
    let (code, body) = ui.post(
        "/enqueue",
        &auth,
        "topic=audit&key=k-9&ordered=on&headers=%7B%22type%22%3A%22x%22%7D&payload=%7B%22n%22%3A1%7D&delay=1h",
    );
    assert_eq!(code, 200, "{body}");
    let id = serde_json::from_str::<Value>(&body).unwrap()["enqueued"]
        .as_i64()
        .unwrap();
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.messages WHERE id = {id} AND topic = 'audit' AND key = 'k-9'
             AND ordered AND headers = '{{\"type\": \"x\"}}' AND payload = '{{\"n\": 1}}'
             AND state = 'scheduled' AND run_at > now() + interval '50 minutes'"
        )),
        1
    );

    // A message's place in its key: the head, then two waiting behind it.
    let ids: Vec<i64> = (0..3)
        .map(|n| {
            let (code, body) = ui.post(
                "/enqueue",
                &auth,
                &format!("topic=ledger&key=acct-1&ordered=on&payload={n}"),
            );
            assert_eq!(code, 200, "{body}");
            serde_json::from_str::<Value>(&body).unwrap()["enqueued"]
                .as_i64()
                .unwrap()
        })
        .collect();
    let (_, v) = ui.json(&format!("/messages/{}", ids[2]));
    assert_eq!(
        v["key_position"],
        json!({"head": ids[0], "ahead": 2, "capped": false})
    );
    let (_, v) = ui.json(&format!("/messages/{}", ids[0]));
    assert_eq!(v["key_position"]["head"], ids[0]);
    assert_eq!(v["key_position"]["ahead"], 0);
    let (_, _, html) = ui.request("GET", &format!("/messages/{}", ids[1]), &[], "");
    assert!(html.contains("Waiting behind 1 of its key"), "{html}");

    // Cancel all of a topic: the page says how many; the name must be typed again.
    let (code, v) = ui.json("/topics/cancel?topic=reports");
    assert_eq!(code, 200);
    assert_eq!(v["live"], 1000);
    let (code, body) = ui.post("/topics/cancel", &auth, "topic=reports&confirm=report");
    assert_eq!(code, 400, "{body}");
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE topic = 'reports'"),
        1000
    );
    let (code, body) = ui.post("/topics/cancel", &auth, "topic=reports&confirm=reports");
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE topic = 'reports'"),
        0
    );
    assert_eq!(
        db.scalar(
            "SELECT count(*) AS v FROM postbox.dead_letters WHERE topic = 'reports' AND reason = 'cancelled'"
        ),
        1000
    );

    // Dead letters picked one by one: replay two, purge one; bad picks refused.
    let (code, body) = ui.post("/dead/pick", &auth, "action=replay&id=100001&id=100002");
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE id IN (100001, 100002)"),
        2
    );
    let (code, body) = ui.post("/dead/pick", &auth, "action=purge&id=100003&id=100003");
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"purged\":1"), "{body}");
    assert_eq!(
        db.scalar(
            "SELECT count(*) AS v FROM postbox.dead_letters WHERE id BETWEEN 100001 AND 100009"
        ),
        6
    );
    for form in [
        "action=replay",
        "action=burn&id=100004",
        "action=purge&id=x",
    ] {
        let (code, body) = ui.post("/dead/pick", &auth, form);
        assert_eq!(code, 400, "{form}: {body}");
    }
    let (code, _) = ui.post("/dead/pick", &[], "action=purge&id=100004");
    assert_eq!(code, 401);
    // A dead letter's page offers both, for that one message.
    let (code, body) = ui.post("/dead/pick", &auth, "action=purge&action=replay&id=100004");
    assert_eq!(code, 400, "two actions: {body}");
    let (code, body) = ui.post(
        "/dead/replay",
        &auth,
        "state=running&expected=1&selection=x",
    );
    assert_eq!(code, 400, "a state on dead letters: {body}");
    let (code, body) = ui.post("/topics/cancel", &auth, "topic=a%00b&confirm=a%00b");
    assert_eq!(code, 400, "NUL: {body}");
    // A dead letter's page: its first and last errors, and its own replay / purge.
    db.exec(
        "UPDATE postbox.dead_letters SET first_error = 'first boom', last_error = 'last boom' WHERE id = 100004",
    );
    let (_, v) = ui.json("/messages/100004");
    assert_eq!(v["first_error"], "first boom");
    assert_eq!(v["last_error"], "last boom");
    let (_, _, html) = ui.request("GET", "/messages/100004", &[], "");
    assert!(
        html.contains("action=\"/dead/pick\"") && html.contains("value=\"100004\""),
        "{html}"
    );
    assert!(html.contains("first boom"), "{html}");
    // A plain field's `\u0000` is text, not a NUL: a key may hold it.
    let (code, body) = ui.json(&format!("/messages?key={}", enc(r"C:\u0000x")));
    assert_eq!(code, 200, "{body}");
    // An empty CSRF cookie is none: the page sets a fresh one.
    let (_, head, _) = ui.request("GET", "/", &[("Cookie", "postbox_csrf=")], "");
    assert!(head.contains("set-cookie: postbox_csrf="), "{head}");
    // A topic whose name holds `*` gets no Pause button (a pause is a pattern: it would pause
    // others too).
    ui_enqueue(&ui, &auth, "topic=o*&payload=1");
    let (_, _, html) = ui.request("GET", "/", &[], "");
    assert!(!html.contains("name=\"topic\" value=\"o*\""), "{html}");
    assert!(html.contains("a * in its name"), "{html}");

    // A replayed older message of an ordered key waits behind the newer head (which was locked,
    // as a claim locks it, when the replay came): the head is the head, whatever the ids.
    let older = ui_enqueue(&ui, &auth, "topic=ledger2&key=k&ordered=on&payload=0");
    db.exec(&format!(
        "INSERT INTO postbox.dead_letters (id, topic, key, ordered, payload, headers, priority, attempts, max_attempts, created_at, reason)
         SELECT id, topic, key, ordered, payload, headers, priority, attempts, max_attempts, created_at, 'test'
         FROM postbox.messages WHERE id = {older};
         DELETE FROM postbox.messages WHERE id = {older}"
    ));
    let head = ui_enqueue(&ui, &auth, "topic=ledger2&key=k&ordered=on&payload=1");
    let last = ui_enqueue(&ui, &auth, "topic=ledger2&key=k&ordered=on&payload=2");
    {
        use diesel::connection::SimpleConnection;
        let mut holder = db.conn();
        holder
            .batch_execute(&format!(
                "BEGIN; SELECT id FROM postbox.messages WHERE id = {head} FOR NO KEY UPDATE"
            ))
            .unwrap();
        let (code, body) = ui.post("/dead/pick", &auth, &format!("action=replay&id={older}"));
        assert_eq!(code, 200, "{body}");
        holder.batch_execute("COMMIT").unwrap();
    }
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.messages WHERE id = {older} AND state = 'waiting'"
        )),
        1,
        "the replayed message waits behind the locked head"
    );
    for (id, ahead) in [(head, 0), (older, 1), (last, 2)] {
        let (_, v) = ui.json(&format!("/messages/{id}"));
        assert_eq!(
            v["key_position"],
            json!({"head": head, "ahead": ahead, "capped": false}),
            "{id}"
        );
    }
    assert_eq!(
        db.scalar(
            "SELECT count(*) AS v FROM postbox.dead_letters WHERE id BETWEEN 100001 AND 100009"
        ),
        6
    );
}

/// With stream mode on, the overview shows the slot: streaming, its lag, its WAL status.
#[test]
fn the_overview_shows_stream_modes_slot() {
    let server = common::OwnServer::start(&["wal_level=logical", "max_wal_senders=10"]);
    let db = server.migrated();
    let ui = Console::start(&db, "[stream]\nslot = \"postbox_console\"");
    let slot = poll("the slot streaming", || {
        let (_, v) = ui.json("/");
        let s = v["stream_slots"].as_array()?.first()?.clone();
        (s["active"] == true).then_some(s)
    });
    assert_eq!(slot["slot_name"], "postbox_console");
    assert_eq!(slot["exists"], true);
    assert!(slot["lag_bytes"].is_i64(), "{slot}");
    let (_, _, html) = ui.request("GET", "/", &[], "");
    assert!(
        html.contains(
            "Stream slot <strong>postbox_console</strong>: <span class=\"up\">streaming</span>"
        ),
        "{html}"
    );
}
