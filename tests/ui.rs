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
    assert!(dead.contains("9 dead letters match"), "{dead}");
    assert!(
        !dead.contains("<form class=\"actions\""),
        "read-only: no action forms"
    );
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
    let (_, listed) = ui.json(&format!("/dead?{filter}"));
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
    let (_, listed) = ui.json("/dead?topic=orders");
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
    let (_, listed) = ui.json("/dead?topic=orders");
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

/// What a person does in a real browser (headless Chromium): the overview, a JSON filter typed
/// into the messages form, a message opened from the list, a topic paused and resumed with its
/// buttons, every dead letter a filter matches replayed with its button; each effect checked in
/// the database, and a screenshot of each page written to `target/ui-screenshots/`.
#[test]
fn a_person_uses_the_console_in_a_browser() {
    let db = unpaused();
    // Only `emails` is routed: the other topics stay queued for the pages to show.
    let ui = Console::start(
        &db,
        &format!(
            "actions = true\ntoken = \"{TOKEN}\"\n[[routes]]\ntopics = [\"emails\"]\nsink = \"log\""
        ),
    );
    let shots = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/ui-screenshots");
    let base = format!("http://127.0.0.1:{}", ui.port);
    let browser = common::webdriver::Browser::start();
    browser.always_send(
        "Authorization",
        &format!("Basic {}", base64(&format!("oncall:{TOKEN}"))),
    );

    browser.goto(&format!("{base}/"));
    let text = browser.text();
    assert!(
        text.contains("orders") && text.contains("reports"),
        "{text}"
    );
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
    browser.wait_for("3 dead letters match");
    browser.screenshot(&shots.join("dead.png"));
    browser.click("form[action='/dead/replay'] button");
    browser.wait_for("replayed 3 dead letters");
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters"),
        6
    );
    assert_eq!(
        db.scalar(
            "SELECT count(*) AS v FROM postbox.messages WHERE id IN (100002, 100005, 100008)"
        ),
        3
    );
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
