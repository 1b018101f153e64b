//! The `postbox` command line as a contract: exit codes, configuration errors that name the field,
//! redaction, the commands against a real database, metrics and health over HTTP, signals.

mod common;

use std::io::{Read, Write};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{TestDb, free_port, hermetic, http_get as get};
use diesel::connection::SimpleConnection;
use postbox::Message;

const BIN: &str = env!("CARGO_BIN_EXE_postbox");

fn postbox(args: &[&str]) -> Output {
    let mut cmd = hermetic(BIN);
    cmd.args(args).env("POSTBOX_LOG", "info");
    if args.contains(&"run") {
        // Relays of tests running in parallel must not race for the default metrics port.
        cmd.env("POSTBOX_METRICS_LISTEN", "127.0.0.1:0");
    }
    cmd.output().expect("run postbox")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn file(contents: &str) -> tempfile_path::Path {
    tempfile_path::Path::new(contents)
}

/// A file in the temp dir, removed on drop (no extra crate needed).
mod tempfile_path {
    pub struct Path(pub std::path::PathBuf);
    impl Path {
        pub fn new(contents: &str) -> Self {
            let p = std::env::temp_dir().join(format!(
                "postbox-test-{}-{}.toml",
                std::process::id(),
                fastrand::u64(..)
            ));
            std::fs::write(&p, contents).unwrap();
            Path(p)
        }
        pub fn as_str(&self) -> &str {
            self.0.to_str().unwrap()
        }
    }
    impl Drop for Path {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

const CONTRACT: &str = r#"
database_url = "postgres://postgres@localhost/postbox"

[relay]
batch_size = 500
concurrency = 64
lease = "30s"
poll_interval = "5s"
shutdown_deadline = "25s"

[metrics]
listen = "0.0.0.0:9464"

[sinks.kafka]
brokers = "localhost:9092"
properties = { "compression.type" = "lz4" }   # any librdkafka property

[[routes]]
topics = ["orders.*"]
sink = "kafka"
kafka_topic = "orders"                        # optional rename

[[routes]]
topics = ["*"]
sink = "log"
"#;

#[test]
fn config_check_accepts_the_contract_file_and_redacts_secrets() {
    let f = file(&CONTRACT.replace("postgres@localhost", "postgres:hunter2@localhost").replace(
        r#"properties = { "compression.type" = "lz4" }"#,
        r#"properties = { "compression.type" = "lz4", "sasl.password" = "s3cret", "sasl.username" = "relay" }"#,
    ));
    let out = postbox(&["--config", f.as_str(), "config", "check"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let printed = text(&out.stdout);
    assert!(
        !printed.contains("hunter2") && !printed.contains("s3cret"),
        "{printed}"
    );
    assert!(
        printed.contains("<redacted>")
            && printed.contains("relay")
            && printed.contains("batch_size = 500"),
        "{printed}"
    );
    // What it prints is a valid configuration again.
    let again = file(&printed);
    assert_eq!(
        postbox(&["--config", again.as_str(), "config", "check"])
            .status
            .code(),
        Some(0)
    );
}

#[test]
fn invalid_configuration_exits_2_naming_the_field() {
    for (toml, field) in [
        ("[relay]\nbatchsize = 5\n", "relay.batchsize"),
        ("[relay]\nbatch_size = 0\n", "relay.batch_size"),
        ("[relay]\nlease = \"soon\"\n", "relay.lease"),
        ("[metrics]\nlisten = \"everywhere\"\n", "metrics.listen"),
        (
            "[[routes]]\ntopics = [\"*\"]\nsink = \"carrier-pigeon\"\n",
            "routes[0].sink",
        ),
        ("surprise = 1\n", "surprise"),
        (
            "[[schedules]]\nname = \"n\"\ncron = \"0 25 * * *\"\ntopic = \"t\"\n",
            "schedules.0.cron",
        ),
        (
            "[[schedules]]\nname = \"n\"\ncron = \"0 3 * * *\"\ntimezone = \"Europe/Atlantis\"\ntopic = \"t\"\n",
            "schedules.0.timezone",
        ),
        (
            "[[limits]]\ntopics = [\"emails.*\"]\nmax_running = 0\n",
            "limits.0.max_running",
        ),
    ] {
        let f = file(toml);
        let out = postbox(&["--config", f.as_str(), "config", "check"]);
        assert_eq!(out.status.code(), Some(2), "{toml}");
        assert!(
            text(&out.stderr).contains(field),
            "{toml}: {}",
            text(&out.stderr)
        );
    }
    let out = hermetic(BIN)
        .args(["config", "check"])
        .env("POSTBOX_BATCH_SIZE", "many")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("POSTBOX_BATCH_SIZE"),
        "{}",
        text(&out.stderr)
    );
    let out = postbox(&["--config", "/nonexistent/postbox.toml", "config", "check"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn bad_usage_exits_2() {
    let out = postbox(&["enqueue", "--topic", "t", "--payload", "{not json"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("--payload"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(postbox(&["frobnicate"]).status.code(), Some(2));
    let out = postbox(&["dead", "replay"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("--id"), "{}", text(&out.stderr));
    // No message has id 0: said before any database is asked.
    let out = postbox(&["show", "0"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("invalid id 0"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn messages_that_sql_cannot_store_are_refused_with_exit_2_and_nothing_written() {
    let db = TestDb::migrated();
    for (args, field) in [
        (["--payload", "1", "--delay", "100000000d"], "delay"),
        (["--payload", r#""a\u0000b""#, "--key", "k"], "payload"),
        (["--payload", "1", "--header", "postbox-id=7"], "postbox-id"),
    ] {
        let mut cmd = vec!["--database-url", &db.url, "enqueue", "--topic", "t"];
        cmd.extend(args);
        let out = postbox(&cmd);
        assert_eq!(out.status.code(), Some(2), "{cmd:?}: {}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains(field),
            "{cmd:?}: {}",
            text(&out.stderr)
        );
    }
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
}

#[test]
fn an_environment_variable_that_is_not_utf8_does_not_crash_the_relay() {
    use std::os::unix::ffi::OsStrExt;
    let out = hermetic(BIN)
        .args(["config", "check"])
        .env("SOME_OTHER_TOOL", std::ffi::OsStr::from_bytes(b"caf\xe9"))
        .output()
        .expect("run postbox");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
}

#[test]
fn a_foreign_database_url_in_the_environment_does_not_beat_the_config_file() {
    let f = file("database_url = \"postgres://postgres@from-the-file/postbox\"\n");
    let out = hermetic(BIN)
        .args(["--config", f.as_str(), "config", "check"])
        .env("DATABASE_URL", "postgres://someone@another-app/db")
        .output()
        .expect("run postbox");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    assert!(shown.contains("from-the-file"), "{shown}");
    assert!(!shown.contains("another-app"), "{shown}");
    // POSTBOX_DATABASE_URL is meant for postbox: it wins.
    let out = hermetic(BIN)
        .args(["--config", f.as_str(), "config", "check"])
        .env(
            "POSTBOX_DATABASE_URL",
            "postgres://postgres@from-postbox-env/postbox",
        )
        .output()
        .expect("run postbox");
    assert!(
        text(&out.stdout).contains("from-postbox-env"),
        "{}",
        text(&out.stdout)
    );
}

/// What an operator who points a command at the wrong place is told: the real cause at once,
/// never a pool's timeout, and `postbox migrate` (not a Rust function) for a missing schema.
#[test]
fn admin_commands_say_what_is_wrong_with_the_database_they_were_pointed_at() {
    let db = TestDb::empty();
    let missing = format!("{}_missing", db.url);
    for args in [vec!["status"], vec!["dead", "list"]] {
        let out = postbox(&[&["--database-url", missing.as_str()][..], &args].concat());
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("does not exist"), "{args:?}: {err}");
        assert!(!err.contains("Timed out"), "{args:?}: {err}");
    }
    let refused = format!("postgres://postgres@127.0.0.1:{}/x", free_port());
    let out = postbox(&["--database-url", &refused, "status"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("Timed out"), "{err}");
    assert!(err.to_lowercase().contains("refused"), "{err}");
    let out = postbox(&["--database-url", &db.url, "status"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("run `postbox migrate`"), "{err}");
    assert!(!err.contains("postbox::migrate"), "{err}");
    // A topic with nothing to cancel is said so (a typo is the usual cause).
    let out = postbox(&["--database-url", &db.url, "migrate"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let out = postbox(&["--database-url", &db.url, "cancel", "--topic", "ordres"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("topic \"ordres\" has no live message"),
        "{}",
        text(&out.stderr)
    );
}

/// A one-off `run --drain` beside a relay that holds the metrics port: refused with the field
/// named, and runs with `metrics.listen = "off"`.
#[test]
fn a_drain_can_run_without_a_metrics_server_beside_a_relay_that_has_one() {
    let db = TestDb::migrated();
    common::enqueue(&db, vec![Message::new("t").payload(&1)]);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let drain = |listen: &str| {
        hermetic(BIN)
            .args(["--database-url", &db.url, "run", "--drain"])
            .env("POSTBOX_METRICS_LISTEN", listen)
            .output()
            .unwrap()
    };
    let out = drain(&format!("127.0.0.1:{port}"));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("metrics.listen"),
        "{}",
        text(&out.stderr)
    );
    let out = drain("off");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"),
        0,
        "drained"
    );
}

#[test]
fn migrate_creates_the_database_then_the_commands_work_on_it() {
    let db = TestDb::empty();
    // A database that does not exist yet: migrate creates it.
    let url = format!("{}_new", db.url);
    let name = format!("{}_new", db.name);
    struct Drop_(String);
    impl Drop for Drop_ {
        fn drop(&mut self) {
            let _ = Command::new("psql")
                .args([
                    &format!("{}/postgres", common::server_url()),
                    "-qc",
                    &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.0),
                ])
                .output();
        }
    }
    let _cleanup = Drop_(name);
    let out = postbox(&["--database-url", &url, "migrate"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let out = postbox(&["--database-url", &url, "migrate"]);
    assert!(
        text(&out.stderr).contains("up to date"),
        "{}",
        text(&out.stderr)
    );

    let out = postbox(&[
        "--database-url",
        &url,
        "enqueue",
        "--topic",
        "orders.created",
        "--payload",
        r#"{"id": 7}"#,
        "--key",
        "c1",
        "--ordered",
        "--header",
        "trace=abc",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let id: i64 = text(&out.stdout).trim().parse().unwrap();
    let out = postbox(&[
        "--database-url",
        &url,
        "enqueue",
        "--topic",
        "later",
        "--payload",
        "1",
        "--delay",
        "1h",
    ]);
    assert_eq!(out.status.code(), Some(0));

    let out = postbox(&["--database-url", &url, "status", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let topics = status["topics"].as_array().unwrap();
    assert!(
        topics
            .iter()
            .any(|t| t["topic"] == "orders.created" && t["available"] == 1)
    );
    assert!(
        topics
            .iter()
            .any(|t| t["topic"] == "later" && t["scheduled"] == 1)
    );

    // run --drain: every claimable message once on stdout as a JSON line, logs on stderr only.
    let out = postbox(&["--database-url", &url, "run", "--drain"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let lines: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("stdout carries only JSON lines"))
        .collect();
    assert_eq!(lines.len(), 1);
    assert_eq!(
        lines[0],
        serde_json::json!({"id": id, "topic": "orders.created", "key": "c1", "headers": {"trace": "abc"}, "payload": {"id": 7}})
    );
    assert!(text(&out.stderr).contains("relay stopped"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_commands_list_replay_and_purge() {
    let db = TestDb::migrated();
    let ids: Vec<i64> = postbox::enqueue_many(
        &mut db.conn(),
        &[Message::new("a"), Message::new("a"), Message::new("b")],
    )
    .unwrap()
    .iter()
    .map(|e| e.id().unwrap())
    .collect();
    let store = db.store().await;
    let claimed = store
        .claim(10, Duration::from_secs(30), &postbox::Topics::all())
        .await
        .unwrap();
    let dead: Vec<_> = claimed
        .iter()
        .map(|m| postbox::store::Dead {
            lease: m.lease(),
            reason: "broken".into(),
        })
        .collect();
    store.dead_letter(&dead).await.unwrap();

    let out = postbox(&[
        "--database-url",
        &db.url,
        "dead",
        "list",
        "--topic",
        "a",
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let listed: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed.len(), 2);
    assert!(listed.iter().all(|d| d["reason"] == "broken"));
    // A limit below what exists says that more exist; one at or above it gives the count.
    let list = |limit: &str| {
        postbox(&[
            "--database-url",
            &db.url,
            "dead",
            "list",
            "--topic",
            "a",
            "--limit",
            limit,
        ])
    };
    let out = list("1");
    assert_eq!(
        text(&out.stdout).lines().count(),
        1,
        "{}",
        text(&out.stdout)
    );
    assert!(
        text(&out.stderr).contains("the first 1 dead letter(s); more exist"),
        "{}",
        text(&out.stderr)
    );
    let out = list("2");
    assert_eq!(text(&out.stderr).trim(), "2 dead letter(s)");

    let out = postbox(&[
        "--database-url",
        &db.url,
        "dead",
        "replay",
        "--id",
        &ids[0].to_string(),
    ]);
    assert_eq!(
        (out.status.code(), text(&out.stdout).trim()),
        (Some(0), "replayed 1")
    );
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.messages WHERE id = {}",
            ids[0]
        )),
        1
    );
    // --older-than selects for replay as for purge: one of the two left is two hours dead.
    db.exec(
        "UPDATE postbox.dead_letters SET dead_at = now() - interval '2 hours'
         WHERE id = (SELECT min(id) FROM postbox.dead_letters)",
    );
    let out = postbox(&[
        "--database-url",
        &db.url,
        "dead",
        "replay",
        "--older-than",
        "1h",
    ]);
    assert_eq!(
        (out.status.code(), text(&out.stdout).trim()),
        (Some(0), "replayed 1"),
        "{}",
        text(&out.stderr)
    );
    let out = postbox(&[
        "--database-url",
        &db.url,
        "dead",
        "purge",
        "--older-than",
        "1h",
    ]);
    assert_eq!(text(&out.stdout).trim(), "purged 0");
    let out = postbox(&["--database-url", &db.url, "dead", "purge", "--all"]);
    assert_eq!(text(&out.stdout).trim(), "purged 1");
    let out = postbox(&["--database-url", &db.url, "status"]);
    assert!(
        text(&out.stdout).contains("dead letters: 0"),
        "{}",
        text(&out.stdout)
    );
}

#[test]
fn a_relay_runs_the_configured_schedules_and_limits_and_status_lists_them() {
    let db = TestDb::migrated();
    let port = free_port();
    let config = file(&format!(
        r#"database_url = "{}"
[metrics]
listen = "127.0.0.1:{port}"

[[schedules]]
name = "heartbeat"
cron = "* * * * * *"
topic = "cron.heartbeat"
payload = {{ kind = "heartbeat" }}
key = "hb"

[[limits]]
topics = ["emails.*"]
max_running = 5
"#,
        db.url
    ));
    let mut relay = hermetic(BIN)
        .args(["--config", config.as_str(), "run"])
        .env("POSTBOX_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = || {
        let out = postbox(&["--config", config.as_str(), "status", "--json"]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    assert!(
        wait_for(Duration::from_secs(30), || {
            status()["schedules"][0]["last_message_id"].is_i64()
        }),
        "a tick fired within 30 s"
    );
    let s = status();
    let row = &s["schedules"][0];
    assert_eq!(row["name"], "heartbeat");
    assert_eq!(row["cron"], "* * * * * *");
    assert_eq!(row["timezone"], "UTC");
    assert_eq!(row["topic"], "cron.heartbeat");
    assert!(row["next_tick"].as_str().unwrap() > row["last_tick"].as_str().unwrap());
    assert_eq!(
        s["limits"],
        serde_json::json!([{"name": "emails.*", "topics": ["emails.*"], "max_running": 5, "per_key": false, "running": 0}])
    );
    let out = postbox(&["--config", config.as_str(), "status"]);
    let table = text(&out.stdout);
    assert!(
        table.contains("SCHEDULE") && table.contains("heartbeat") && table.contains("NEXT RUN"),
        "{table}"
    );
    assert!(
        table.contains("LIMIT") && table.contains("emails.*"),
        "{table}"
    );
    let (code, metrics) = get(port, "/metrics").unwrap();
    assert_eq!(code, 200);
    assert!(
        metrics.contains("postbox_schedule_next_tick_timestamp_seconds{schedule=\"heartbeat\"}")
            && metrics
                .contains("postbox_schedule_last_tick_timestamp_seconds{schedule=\"heartbeat\"}"),
        "{metrics}"
    );
    assert_eq!(terminate(&mut relay).code(), Some(0));
    // The log sink printed the ticks' messages.
    let mut stdout = String::new();
    relay
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    let first: serde_json::Value = serde_json::from_str(stdout.lines().next().unwrap()).unwrap();
    assert_eq!(first["topic"], "cron.heartbeat");
    assert_eq!(first["key"], "hb");
    assert_eq!(first["payload"], serde_json::json!({"kind": "heartbeat"}));
    assert_eq!(first["headers"]["cron-schedule"], "heartbeat");
}

#[test]
fn show_tells_where_a_message_is_and_which_sink_delivered_it() {
    let db = TestDb::migrated();
    // Its own metrics port: other tests' relays may hold the default one.
    let config = file(&format!(
        "database_url = \"{}\"\n[metrics]\nlisten = \"127.0.0.1:{}\"\n[retention]\nkeep_completed = \"1h\"\n",
        db.url,
        free_port()
    ));
    let c = config.as_str();
    let enqueue = |extra: &[&str]| {
        let mut args = vec![
            "--config",
            c,
            "enqueue",
            "--topic",
            "orders",
            "--payload",
            "{\"n\": 1}",
        ];
        args.extend_from_slice(extra);
        let out = postbox(&args);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        text(&out.stdout).trim().to_owned()
    };
    let delivered = enqueue(&[]);
    let later = enqueue(&["--delay", "1h"]);
    let out = postbox(&["--config", c, "run", "--drain"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));

    let out = postbox(&["--config", c, "show", &delivered]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("delivered by the log sink at"),
        "{}",
        text(&out.stdout)
    );
    let out = postbox(&["--config", c, "show", &delivered, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (
            v["status"].as_str(),
            v["sink"].as_str(),
            v["attempts"].as_i64()
        ),
        (Some("delivered"), Some("log"), Some(1))
    );
    assert_eq!(v["payload"], serde_json::json!({"n": 1}));
    let out = postbox(&["--config", c, "show", &later, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (v["status"].as_str(), v["state"].as_str()),
        (Some("queued"), Some("scheduled"))
    );
    let out = postbox(&["--config", c, "show", "999999"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("message 999999 not found"),
        "{}",
        text(&out.stderr)
    );
    // What is kept is in the database: any relay's show finds it, whatever its configuration.
    let out = postbox(&["--database-url", &db.url, "show", &delivered]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let out = postbox(&["--config", c, "status"]);
    assert!(
        text(&out.stdout).contains("retention: keep_completed 1h"),
        "{}",
        text(&out.stdout)
    );
}

fn spawn_relay(url: &str, port: u16) -> Child {
    hermetic(BIN)
        .args(["--database-url", url, "run"])
        .env("POSTBOX_METRICS_LISTEN", format!("127.0.0.1:{port}"))
        .env("POSTBOX_POLL_INTERVAL", "200ms")
        .env("POSTBOX_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn wait_for(deadline: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + deadline;
    while Instant::now() < end {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

fn terminate(child: &mut Child) -> std::process::ExitStatus {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < end, "relay did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn metrics_and_health_are_served_and_pass_promtool() {
    let db = TestDb::migrated();
    postbox::enqueue_many(
        &mut db.conn(),
        &[
            Message::new("m.one").key("k").ordered(),
            Message::new("m.two"),
            // Waits: the samples show its topic, whose outcome counters then exist at 0.
            Message::new("m.later").delay(Duration::from_secs(3600)),
        ],
    )
    .unwrap();
    // A dead letter, and an ordered head retrying later (a stalled key): every gauge has a series.
    db.exec(
        "INSERT INTO postbox.dead_letters (id, topic, ordered, payload, headers, priority, attempts, max_attempts, created_at, reason, dead_at)
         VALUES (-1, 'm.dead', false, 'null', '{}', 0, 1, 1, now(), 'test', now());
         INSERT INTO postbox.messages (topic, key, ordered, run_at, attempts, last_error)
         VALUES ('m.stalled', 'k', true, now() + interval '1 hour', 1, 'refused');",
    );
    let port = free_port();
    // A schedule, a limit and retention: their metric families exist too.
    let config = file(&format!(
        r#"database_url = "{}"
[retention]
keep_completed = "1h"

[[schedules]]
name = "every-second"
cron = "* * * * * *"
topic = "m.tick"

[[limits]]
topics = ["m.limited"]
max_running = 2
"#,
        db.url
    ));
    let mut relay = hermetic(BIN)
        .args(["--config", config.as_str(), "run"])
        .env("POSTBOX_METRICS_LISTEN", format!("127.0.0.1:{port}"))
        .env("POSTBOX_POLL_INTERVAL", "200ms")
        .env("POSTBOX_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    assert!(
        wait_for(Duration::from_secs(20), || get(port, "/readyz")
            .is_some_and(|(c, _)| c == 200)),
        "never ready"
    );
    assert_eq!(get(port, "/healthz").unwrap().0, 200);
    assert!(wait_for(Duration::from_secs(20), || get(port, "/metrics")
        .is_some_and(|(_, b)| b
            .contains("postbox_schedule_last_tick_timestamp_seconds{")
            && b.contains("postbox_completed_kept"))));
    assert!(wait_for(Duration::from_secs(20), || get(port, "/metrics")
        .is_some_and(|(_, b)| b.contains(
            r#"postbox_messages_delivered_total{sink="log",topic="m.two"} 1"#
        ))));
    assert!(wait_for(Duration::from_secs(20), || get(port, "/metrics")
        .is_some_and(|(_, b)| b.contains(
            r#"postbox_messages_dead_lettered_total{sink="log",topic="m.later"} 0"#
        ))));
    // A session holding the xmin horizon (a report left open): the alert's metric names it.
    let mut report = db.conn();
    report
        .batch_execute("SET application_name = 'cli-test-report'; BEGIN; SELECT txid_current()")
        .unwrap();
    assert!(wait_for(Duration::from_secs(30), || get(port, "/metrics")
        .is_some_and(|(_, b)| b.lines().any(|l| l
            .starts_with("postbox_xmin_horizon_holder_age_seconds{")
            && l.contains(r#"application_name="cli-test-report""#)))));
    let (_, body) = get(port, "/metrics").unwrap();
    report.batch_execute("ROLLBACK").unwrap();
    dashboard_and_alerts_use_only_exported_metrics(&body);
    for name in [
        "postbox_messages_delivered_total",
        "postbox_delivery_duration_seconds_bucket",
        "postbox_end_to_end_latency_seconds_bucket",
        "postbox_claim_batch_size_bucket",
        "postbox_table_dead_tuples",
        "postbox_table_live_tuples",
        "postbox_oldest_transaction_age_seconds",
        "postbox_sink_up",
        "postbox_database_up 1",
        "postbox_notifier_connected 1",
        "postbox_build_info",
        "postbox_limit_running{limit=\"m.limited\"} 0",
        "postbox_limit_max_running{limit=\"m.limited\"} 2",
        "postbox_schedule_fired_total{schedule=\"every-second\"}",
        "postbox_invariant_violations{kind=\"stranded_key\"} 0",
        "postbox_keys_repaired_total 0",
    ] {
        assert!(body.contains(name), "{name} missing:\n{body}");
    }
    assert!(
        !body.contains("{id=\"") && !body.contains(",id=\""),
        "a message id became a label"
    );
    // promtool (Debian package `prometheus`; .ci/run installs it) lints the exposition.
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool is installed (apt-get install --no-install-recommends prometheus)");
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    let lint = promtool.wait_with_output().unwrap();
    assert!(
        lint.status.success(),
        "promtool: {}{}",
        text(&lint.stdout),
        text(&lint.stderr)
    );
    assert!(terminate(&mut relay).success());
    // Stopped by SIGTERM, it handed nothing back because nothing was running: stdout has both
    // messages (and the schedule's ticks).
    let mut out = String::new();
    relay
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let enqueued = out.lines().filter(|l| !l.contains("\"m.tick\"")).count();
    assert_eq!(enqueued, 2, "{out}");
}

/// Every `postbox_*` metric named by the chart's Grafana dashboard and alerts is in `scrape`.
fn dashboard_and_alerts_use_only_exported_metrics(scrape: &str) {
    let exported: std::collections::HashSet<&str> = scrape
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    let dashboard: serde_json::Value =
        serde_json::from_str(include_str!("../helm/postbox/files/grafana-dashboard.json")).unwrap();
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            queries.push(target["expr"].as_str().unwrap().to_owned());
        }
    }
    for var in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(q) = var["definition"].as_str() {
            queries.push(q.to_owned());
        }
    }
    assert!(queries.len() >= 15, "{queries:?}");
    let rules = include_str!("../helm/postbox/templates/prometheusrule.yaml");
    let exprs: Vec<String> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("expr:"))
        .map(str::to_owned)
        .collect();
    assert_eq!(exprs.len(), 15, "one expression per alert");
    for q in queries.iter().chain(&exprs) {
        // The stream's metrics are exported by a relay that streams: tests/stream.rs checks them.
        let names = q
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("postbox_") && !w.starts_with("postbox_stream_"));
        for name in names {
            assert!(
                exported.contains(name),
                "{name} (in `{q}`) is not exported by the relay:\n{scrape}"
            );
        }
    }
}

#[test]
fn an_unreachable_database_is_retried_not_crash_looped_and_sigterm_exits_cleanly() {
    let port = free_port();
    let dead_port = free_port();
    let mut relay = spawn_relay(
        &format!("postgres://postgres@127.0.0.1:{dead_port}/nothing"),
        port,
    );
    // Alive, not ready, retrying.
    assert!(wait_for(Duration::from_secs(20), || get(port, "/healthz")
        .is_some_and(|(c, _)| c == 200)));
    assert_eq!(get(port, "/readyz").unwrap().0, 503);
    std::thread::sleep(Duration::from_millis(800));
    assert!(
        relay.try_wait().unwrap().is_none(),
        "the relay exited instead of retrying"
    );
    let status = terminate(&mut relay);
    let mut err = String::new();
    relay
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(status.success(), "{err}");
    assert!(err.matches("database unreachable").count() >= 2, "{err}");
}

#[test]
fn demo_writes_orders_relays_them_and_summarises() {
    let db = TestDb::empty();
    let out = postbox(&["--database-url", &db.url, "demo", "--orders", "60"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 61, "{stdout}");
    for l in &lines[..60] {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert_eq!(v["topic"], "demo.order.created");
    }
    assert!(
        lines[60].starts_with("demo: 60 orders, 60 messages relayed"),
        "{}",
        lines[60]
    );
    assert_eq!(db.scalar("SELECT count(*) AS v FROM demo_orders"), 60);
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_a_stalled_ordered_key() {
    let db = TestDb::migrated();
    postbox::enqueue_many(
        &mut db.conn(),
        &[
            Message::new("acct").key("a-1").ordered(),
            Message::new("acct").key("a-1").ordered(),
        ],
    )
    .unwrap();
    let store = db.store().await;
    let head = store
        .claim(10, Duration::from_secs(30), &postbox::Topics::all())
        .await
        .unwrap()
        .remove(0);
    store
        .retry(&[postbox::store::Retry {
            lease: head.lease(),
            error: "ledger locked".into(),
            delay: Some(Duration::from_secs(600)),
        }])
        .await
        .unwrap();
    let out = postbox(&["--database-url", &db.url, "status", "--json"]);
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let stalled = &status["stalled_keys"][0];
    assert_eq!(
        (
            stalled["key"].as_str(),
            stalled["attempts"].as_i64(),
            stalled["waiting"].as_i64()
        ),
        (Some("a-1"), Some(1), Some(1))
    );
    assert_eq!(stalled["last_error"], "ledger locked");
    let out = postbox(&["--database-url", &db.url, "status"]);
    assert!(
        text(&out.stdout).contains("acct / a-1: head #"),
        "{}",
        text(&out.stdout)
    );
    // Cancelled, then replayed into a paused topic: the replayed head carries its old error but
    // has not been tried since, so it is no stalled key (nor would it fire PostboxStalledKey).
    let url = db.url.as_str();
    let out = postbox(&["--database-url", url, "cancel", "--topic", "acct"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let out = postbox(&["--database-url", url, "pause", "acct"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let out = postbox(&["--database-url", url, "dead", "replay", "--topic", "acct"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        db.scalar(
            "SELECT count(*) AS v FROM postbox.messages WHERE last_error IS NOT NULL AND attempts = 0"
        ),
        2
    );
    let out = postbox(&["--database-url", url, "status", "--json"]);
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["stalled_keys"], serde_json::json!([]), "{status}");
}

#[test]
fn pause_and_resume_topics_from_the_command_line_and_status_marks_them() {
    let db = TestDb::migrated();
    postbox::enqueue(&mut db.conn(), &Message::new("emails.welcome")).unwrap();
    let url = db.url.as_str();
    let out = postbox(&["--database-url", url, "pause", "emails.*", "reports"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "paused 2 (0 already paused)");
    let out = postbox(&["--database-url", url, "pause", "reports"]);
    assert_eq!(text(&out.stdout).trim(), "paused 1 (1 already paused)");

    let out = postbox(&["--database-url", url, "status", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["paused"], serde_json::json!(["emails.*", "reports"]));
    assert_eq!(v["paused_topics"], serde_json::json!(["emails.welcome"]));
    let out = postbox(&["--database-url", url, "status"]);
    let table = text(&out.stdout);
    let row = table
        .lines()
        .find(|l| l.starts_with("emails.welcome"))
        .unwrap();
    assert!(row.trim_end().ends_with("yes"), "{table}");
    assert!(table.contains("paused: emails.*, reports"), "{table}");

    // A relay leaves the paused topic alone (run --drain ends with it still queued).
    let out = postbox(&["--database-url", url, "run", "--drain"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "", "a paused topic was relayed");
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 1);

    let out = postbox(&["--database-url", url, "resume", "emails.*", "nothing"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "resumed 1");
    assert!(
        text(&out.stderr).contains("not paused"),
        "{}",
        text(&out.stderr)
    );
    let out = postbox(&["--database-url", url, "run", "--drain"]);
    assert_eq!(
        text(&out.stdout).lines().count(),
        1,
        "{}",
        text(&out.stdout)
    );

    // Usage: no topic, or an empty one.
    assert_eq!(
        postbox(&["--database-url", url, "pause"]).status.code(),
        Some(2)
    );
    assert_eq!(
        postbox(&["--database-url", url, "pause", ""]).status.code(),
        Some(2)
    );
}

#[test]
fn cancel_from_the_command_line_prints_how_many_and_refuses_a_vague_selector() {
    let db = TestDb::migrated();
    let ids = postbox::enqueue_many(
        &mut db.conn(),
        &[Message::new("c"), Message::new("c"), Message::new("d")],
    )
    .unwrap();
    let url = db.url.as_str();
    let out = postbox(&["--database-url", url, "cancel", "--topic", "c"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).starts_with("cancelled 2 (moved to the dead letters"),
        "{}",
        text(&out.stdout)
    );
    let d = ids[2].id().unwrap().to_string();
    let out = postbox(&["--database-url", url, "cancel", "--id", &d]);
    assert!(
        text(&out.stdout).starts_with("cancelled 1 "),
        "{}",
        text(&out.stdout)
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.dead_letters WHERE reason = 'cancelled'"),
        3
    );
    for vague in [vec!["cancel"], vec!["cancel", "--topic", "c", "--id", "1"]] {
        let mut args = vec!["--database-url", url];
        args.extend(vague);
        assert_eq!(postbox(&args).status.code(), Some(2));
    }
}

#[test]
fn check_exits_1_naming_a_stranded_key_and_0_once_it_is_repaired() {
    let db = TestDb::migrated();
    let ok = postbox(&["--database-url", &db.url, "check"]);
    assert_eq!(ok.status.code(), Some(0), "{}", text(&ok.stderr));
    assert!(text(&ok.stdout).starts_with("ok"), "{}", text(&ok.stdout));

    let msgs: Vec<postbox::Message> = (0..3)
        .map(|_| postbox::Message::new("orders").key("o-1").ordered())
        .collect();
    let ids = postbox::enqueue_many(&mut db.conn(), &msgs).unwrap();
    db.exec(&format!(
        "SET postbox.promotes_heads = 'caller'; DELETE FROM postbox.messages WHERE id = {}",
        ids[0].id().unwrap()
    ));
    let bad = postbox(&["--database-url", &db.url, "check"]);
    assert_eq!(bad.status.code(), Some(1));
    assert_eq!(
        text(&bad.stdout).trim(),
        "stranded_key orders / o-1: 2 waiting"
    );
    assert!(
        text(&bad.stderr).contains("1 stranded_key"),
        "{}",
        text(&bad.stderr)
    );
    let json = postbox(&["--database-url", &db.url, "check", "--json"]);
    assert_eq!(json.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["ok"], false);
    assert_eq!(v["counts"]["stranded_key"], 1);
    assert_eq!(v["counts"]["double_head"], 0);
    assert_eq!(v["violations"][0]["key"], "o-1");

    db.exec("SELECT postbox.promote_key('orders', 'o-1')");
    let ok = postbox(&["--database-url", &db.url, "check", "--json"]);
    assert_eq!(ok.status.code(), Some(0), "{}", text(&ok.stderr));
}

#[test]
fn a_reader_of_stdout_that_stalls_never_stops_health_or_shutdown() {
    let db = TestDb::migrated();
    // Far more than a pipe holds: the log sink's writes block once the pipe is full.
    db.exec(
        "INSERT INTO postbox.messages (topic, payload)
         SELECT 'loud', to_jsonb(repeat('x', 1000)) FROM generate_series(1, 3000)",
    );
    let port = free_port();
    let mut relay = hermetic(BIN)
        .args(["--database-url", &db.url, "run"])
        .env("POSTBOX_METRICS_LISTEN", format!("127.0.0.1:{port}"))
        .env("POSTBOX_POLL_INTERVAL", "200ms")
        .env("POSTBOX_SHUTDOWN_DEADLINE", "2s")
        .stdout(Stdio::piped()) // never read
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert!(wait_for(Duration::from_secs(20), || get(port, "/healthz")
        .is_some_and(|(c, _)| c == 200)));
    // The first batch fills the pipe; the log sink reports itself down (its write is stuck)
    // while the relay keeps answering.
    assert!(
        wait_for(Duration::from_secs(30), || get(port, "/metrics")
            .is_some_and(
                |(_, body)| body.contains("postbox_sink_up{sink=\"log\"} 0")
            )),
        "the log sink never reported the stalled stdout"
    );
    for _ in 0..5 {
        let answer = get(port, "/healthz");
        assert!(
            answer.as_ref().is_some_and(|(c, _)| *c == 200),
            "/healthz did not answer with stdout stalled: {answer:?}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let stopped = Instant::now();
    let status = terminate(&mut relay);
    assert!(status.success(), "{status:?}");
    assert!(stopped.elapsed() < Duration::from_secs(15));
    // What was not written is still there, no attempt used by the stall.
    assert_eq!(
        db.scalar(
            "SELECT count(*) AS v FROM postbox.messages WHERE attempts > 0 AND state = 'available'"
        ),
        0
    );
}

#[test]
fn the_http_listener_cuts_off_slow_clients_and_bounds_its_connections() {
    let db = TestDb::migrated();
    let port = free_port();
    let mut relay = spawn_relay(&db.url, port);
    assert!(wait_for(Duration::from_secs(20), || get(port, "/healthz")
        .is_some_and(|(c, _)| c == 200)));
    // A client that never finishes its headers is cut off (HEADER_TIMEOUT is 5 s).
    let mut slow = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    let started = Instant::now();
    let mut buf = [0u8; 256];
    // Closed (or answered, then closed) rather than left waiting: the read ends before its
    // own 15 s timeout.
    let closed = slow.read(&mut buf).is_ok();
    assert!(
        closed && started.elapsed() < Duration::from_secs(10),
        "a connection with partial headers stayed open {:?}",
        started.elapsed()
    );
    // Many idle connections: the relay holds at most MAX_CONNECTIONS (128) of them, the rest
    // wait in the backlog, and health answers once the idle ones are cut off.
    let idle: Vec<std::net::TcpStream> = (0..400)
        .filter_map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).ok())
        .collect();
    assert!(
        idle.len() >= 300,
        "could open only {} connections",
        idle.len()
    );
    std::thread::sleep(Duration::from_millis(500));
    let fds = std::fs::read_dir(format!("/proc/{}/fd", relay.id()))
        .unwrap()
        .count();
    assert!(fds < 128 + 64, "the relay holds {fds} descriptors");
    assert!(
        wait_for(Duration::from_secs(30), || get(port, "/healthz")
            .is_some_and(|(c, _)| c == 200)),
        "/healthz did not answer behind idle connections"
    );
    drop(idle);
    assert!(terminate(&mut relay).success());
}

#[test]
fn status_shows_control_characters_escaped_never_raw() {
    let db = TestDb::migrated();
    db.exec(
        "INSERT INTO postbox.messages (topic, key, ordered, payload)
         VALUES (E'evil\\x1b[2J\\x1b]0;owned\\x07', E'k\\x1b[31m', true, '1')",
    );
    let out = postbox(&["--database-url", &db.url, "status"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    assert!(
        !shown.contains('\u{1b}') && !shown.contains('\u{7}'),
        "{shown:?}"
    );
    assert!(
        shown.contains(r"evil\u{1b}[2J\u{1b}]0;owned\u{7}"),
        "{shown}"
    );
}

#[test]
fn two_routes_to_the_same_kind_of_sink_report_their_health_apart() {
    let db = TestDb::migrated();
    let cfg = file(
        r#"
[[routes]]
topics = ["a.*"]
sink = "log"

[[routes]]
topics = ["*"]
sink = "log"
"#,
    );
    let port = free_port();
    let mut relay = hermetic(BIN)
        .args([
            "--config",
            cfg.0.to_str().unwrap(),
            "--database-url",
            &db.url,
            "run",
        ])
        .env("POSTBOX_METRICS_LISTEN", format!("127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert!(
        wait_for(Duration::from_secs(20), || get(port, "/metrics")
            .is_some_and(|(_, b)| {
                b.contains("postbox_sink_up{sink=\"log[0]\"} 1")
                    && b.contains("postbox_sink_up{sink=\"log[1]\"} 1")
            })),
        "{:?}",
        get(port, "/metrics")
    );
    assert!(terminate(&mut relay).success());
}

#[test]
fn pgsslmode_from_the_environment_encrypts_the_relays_connections() {
    let db = TestDb::migrated();
    let port = free_port();
    let mut relay = hermetic(BIN)
        .args(["--database-url", &db.url, "run"])
        .env("POSTBOX_METRICS_LISTEN", format!("127.0.0.1:{port}"))
        .env("PGSSLMODE", "require")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let sessions = |ssl: bool| {
        db.scalar(&format!(
            "SELECT count(*) AS v FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
             WHERE a.datname = '{}' AND a.application_name = 'postbox' AND s.ssl = {ssl}",
            db.name
        ))
    };
    assert!(
        wait_for(Duration::from_secs(20), || sessions(true) > 0),
        "no encrypted relay session"
    );
    assert_eq!(sessions(false), 0, "a relay session is not encrypted");
    assert!(terminate(&mut relay).success());
}

#[test]
fn config_check_hides_a_password_holding_url_delimiters() {
    let out = postbox(&[
        "--database-url",
        "postgres://app:pa?ss/w@db.internal:5432/orders?password=second",
        "config",
        "check",
    ]);
    let shown = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(
        shown.contains("app:<redacted>@db.internal:5432/orders"),
        "{shown}"
    );
    assert!(
        !shown.contains("pa?ss") && !shown.contains("second"),
        "{shown}"
    );
}

/// With 10,000 topics `status` prints the 20 largest, a line for the rest and the totals;
/// `--all` prints every topic and `--json` gives all of them.
#[test]
fn status_at_ten_thousand_topics_shows_the_largest_and_a_summary() {
    let db = TestDb::migrated();
    db.exec(
        "INSERT INTO postbox.messages (topic) SELECT 't.' || (g % 10000) FROM generate_series(1, 20000) g;
         INSERT INTO postbox.messages (topic) SELECT 'big' FROM generate_series(1, 500)",
    );
    let out = postbox(&["--database-url", &db.url, "status"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    let rows: Vec<&str> = shown
        .lines()
        .take_while(|l| !l.starts_with("dead letters"))
        .collect();
    assert!(rows.len() < 30, "{shown}");
    assert!(rows[1].starts_with("big "), "the largest first: {shown}");
    assert!(
        shown.contains("(9981 more topics)") && shown.contains("TOTAL (10001 topics)"),
        "{shown}"
    );
    let total = rows
        .iter()
        .find(|l| l.starts_with("TOTAL"))
        .unwrap()
        .split_whitespace()
        .nth(3)
        .unwrap()
        .to_owned();
    assert_eq!(total, "20500", "{shown}");
    let all = text(&postbox(&["--database-url", &db.url, "status", "--all"]).stdout);
    assert!(all.lines().count() > 10_000, "--all lists every topic");
    let json: serde_json::Value = serde_json::from_str(&text(
        &postbox(&["--database-url", &db.url, "status", "--json"]).stdout,
    ))
    .unwrap();
    assert_eq!(json["topics"].as_array().unwrap().len(), 10_001);
}

/// A command that prints and ends, read by a reader that goes away early (`postbox status |
/// head -1`), ends as `ls` does (SIGPIPE), not with a panic on the broken pipe.
#[cfg(unix)]
#[test]
fn a_reader_that_goes_away_ends_a_printing_command_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let db = TestDb::migrated();
    db.exec("INSERT INTO postbox.messages (topic) SELECT 't' || g FROM generate_series(1, 200) g");
    let mut child = hermetic(BIN)
        .args(["--database-url", &db.url, "status", "--all"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Gone before anything is written: the command connects to the database first.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(
        out.status.signal(),
        Some(13),
        "SIGPIPE: {:?} {err}",
        out.status
    );
}
