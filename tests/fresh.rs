//! Claims on a table without statistics (after `pg_upgrade`, a restore, a fresh deploy's first
//! burst, a TRUNCATE): every claim shape reads about what it returns, as on an analyzed table.
//! Each shape is run as the relay runs it, inside `EXPLAIN (ANALYZE, BUFFERS)`, in a transaction
//! rolled back; the buffers it read (the function's own statements included) must stay within
//! 1.5 times what the same claim reads once the table is analyzed (walking the table costs tens
//! of thousands of buffer reads here).

mod common;

use common::TestDb;
use diesel::RunQueryDsl;
use diesel::connection::SimpleConnection;

/// Buffers a claim on the table never analyzed may read beyond 1.5 times what it reads analyzed
/// (a claim of 100 writes its rows: about 2,000 buffers either way; a plan that visits every row
/// reads tens of thousands more).
const SLACK: i64 = 300;

#[derive(diesel::QueryableByName)]
struct Line {
    #[diesel(sql_type = diesel::sql_types::Text, column_name = "QUERY PLAN")]
    line: String,
}

/// The buffers (hit + read) the statement's top node reports: everything it and the functions
/// it called read.
fn buffers(db: &TestDb, sql: &str) -> (i64, String) {
    let mut c = db.conn();
    c.batch_execute("BEGIN").unwrap();
    let lines: Vec<Line> = diesel::sql_query(format!("EXPLAIN (ANALYZE, BUFFERS) {sql}"))
        .load(&mut c)
        .unwrap();
    c.batch_execute("ROLLBACK").unwrap();
    let plan: String = lines.iter().map(|l| l.line.clone() + "\n").collect();
    let first = plan
        .lines()
        .find(|l| l.trim_start().starts_with("Buffers:"))
        .unwrap_or("");
    let n = first
        .split_whitespace()
        .filter_map(|w| {
            w.split_once('=').and_then(|(k, v)| {
                matches!(k, "hit" | "read")
                    .then(|| v.parse::<i64>().ok())
                    .flatten()
            })
        })
        .sum();
    (n, plan)
}

const CLAIM: &str =
    "SELECT * FROM postbox.claim(100, 30, {all}, {exact}, {like}, '{{}}', '{{}}', 1, 'x')";

fn claim(all: bool, exact: &str, like: &str) -> String {
    CLAIM
        .replace("{all}", if all { "true" } else { "false" })
        .replace("{exact}", exact)
        .replace("{like}", like)
        .replace("{{}}", "{}")
}

#[test]
fn every_claim_shape_reads_what_it_returns_on_a_table_never_analyzed() {
    let db = TestDb::migrated();
    db.exec(
        "ALTER TABLE postbox.messages SET (autovacuum_enabled = false);
         INSERT INTO postbox.messages (topic) SELECT 'u' FROM generate_series(1, 20000);
         INSERT INTO postbox.messages (topic, key) SELECT 'keyed', 'k' || (g % 500) FROM generate_series(1, 20000) g;
         INSERT INTO postbox.messages (topic, key, ordered) SELECT 'ord', 'k' || (g % 200), true FROM generate_series(1, 20000) g;
         INSERT INTO postbox.messages (topic) SELECT 'tenant.' || g FROM generate_series(1, 10000) g;
         INSERT INTO postbox.messages (topic) SELECT 'emails.welcome' FROM generate_series(1, 20000);",
    );
    let never_analyzed = "SELECT count(*) AS v FROM pg_stat_user_tables
        WHERE relid = 'postbox.messages'::regclass AND last_analyze IS NULL AND last_autoanalyze IS NULL";
    let shapes: Vec<(&str, String)> = vec![
        ("every topic", claim(true, "'{}'", "'{}'")),
        ("one topic", "SELECT * FROM postbox.claim_topic('u', 100, 30, 1, 'x')".into()),
        ("one keyed topic", "SELECT * FROM postbox.claim_topic('keyed', 100, 30, 1, 'x')".into()),
        ("ordered heads", "SELECT * FROM postbox.claim_topic('ord', 100, 30, 1, 'x')".into()),
        ("held, every topic", "SELECT * FROM postbox.take_ready(NULL, 100)".into()),
        ("held, one topic", "SELECT * FROM postbox.take_ready('keyed', 100)".into()),
        ("a few topics", claim(false, "ARRAY['u', 'keyed', 'ord']", "'{}'")),
        ("a glob", claim(false, "'{}'", "ARRAY['emails.%']")),
        ("a glob among 10,000 topics", claim(false, "'{}'", "ARRAY['tenant.%']")),
        (
            "limited, per key",
            "SELECT * FROM postbox.claim_limited('keyed', 5, true, false, ARRAY['keyed'], '{}', 100, 30, false, ARRAY['keyed'], '{}', '{}', '{}', 1, 'x')".into(),
        ),
        (
            "limited by a glob",
            "SELECT * FROM postbox.claim_limited('emails.*', 1000, false, false, '{}', ARRAY['emails.%'], 100, 30, false, '{}', ARRAY['emails.%'], '{}', '{}', 1, 'x')".into(),
        ),
    ];
    let fresh: Vec<(i64, String)> = shapes.iter().map(|(_, sql)| buffers(&db, sql)).collect();
    assert_eq!(
        db.scalar(never_analyzed),
        1,
        "nothing analyzed the table meanwhile"
    );
    db.exec("ANALYZE postbox.messages");
    let mut report = Vec::new();
    for ((name, sql), (n, plan)) in shapes.iter().zip(&fresh) {
        let (analyzed, analyzed_plan) = buffers(&db, sql);
        report.push((*name, *n, analyzed));
        assert!(
            *n <= analyzed * 3 / 2 + SLACK,
            "{name}: {n} buffers on the table never analyzed, {analyzed} analyzed\n{plan}\n-- analyzed:\n{analyzed_plan}"
        );
    }
    eprintln!("buffers of a claim of 100 (never analyzed, analyzed): {report:?}");
}

/// The relay finds the table never analyzed (a new deploy, `pg_upgrade`, a restore) with a
/// backlog and analyzes it as it starts; so does `postbox migrate`. An empty one is left alone.
#[test]
fn the_relay_and_migrate_analyze_a_table_never_analyzed() {
    let db = TestDb::migrated();
    db.exec(
        "ALTER TABLE postbox.messages SET (autovacuum_enabled = false);
         INSERT INTO postbox.messages (topic) SELECT 'u' FROM generate_series(1, 2000);",
    );
    let analyzed = "SELECT count(*) AS v FROM pg_stat_user_tables
        WHERE relid = 'postbox.messages'::regclass AND last_analyze IS NOT NULL";
    assert_eq!(db.scalar(analyzed), 0);
    let run = |args: &[&str]| {
        let out = common::hermetic(env!("CARGO_BIN_EXE_postbox"))
            .args(["--database-url", &db.url])
            .args(args)
            .env("POSTBOX_LOG", "info")
            .env("POSTBOX_METRICS_LISTEN", "off")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let log = run(&["run", "--drain"]);
    assert_eq!(db.scalar(analyzed), 1, "{log}");
    assert!(log.contains("had never been analyzed"), "{log}");
    assert_eq!(db.scalar("SELECT (SELECT count(*) FROM postbox.messages) + (SELECT count(*) FROM postbox.intake) AS v"), 0);
    // Statistics reset (as pg_upgrade leaves them) on a table with a backlog: migrate analyzes.
    db.exec(
        "INSERT INTO postbox.messages (topic) SELECT 'u' FROM generate_series(1, 2000);
         SELECT pg_stat_reset_single_table_counters('postbox.messages'::regclass);",
    );
    assert_eq!(db.scalar(analyzed), 0);
    let log = run(&["migrate"]);
    assert_eq!(db.scalar(analyzed), 1, "{log}");
}

/// Index entries of `postbox.messages` that `sql` reads (in a transaction rolled back).
fn entries_read(db: &TestDb, sql: &str) -> i64 {
    let mut c = db.conn();
    let read = |c: &mut diesel::PgConnection| {
        c.batch_execute("SELECT pg_stat_force_next_flush(); SELECT pg_stat_clear_snapshot()")
            .unwrap();
        #[derive(diesel::QueryableByName)]
        struct V {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            v: i64,
        }
        diesel::sql_query(
            "SELECT coalesce(sum(idx_tup_read), 0)::bigint AS v FROM pg_stat_user_indexes
             WHERE schemaname = 'postbox' AND relname = 'messages'",
        )
        .get_result::<V>(c)
        .unwrap()
        .v
    };
    let before = read(&mut c);
    c.batch_execute(&format!("BEGIN; {sql}; ROLLBACK")).unwrap();
    read(&mut c) - before
}

/// Statistics taken while the table held one topic (a new deploy's first topic, analyzed before
/// the others came): for a plan kept for any topic, every row is then of the topic claimed, and
/// the claims of one topic and of a few named exactly walked `messages_ready_idx` filtering on
/// the topic, through every available row of the others (40,000 index entries here, for a claim
/// of 100). Each reads a few hundred entries, as with current statistics.
#[test]
fn claims_of_named_topics_read_what_they_return_on_statistics_of_one_topic() {
    let db = TestDb::migrated();
    db.exec(
        "ALTER TABLE postbox.messages SET (autovacuum_enabled = false);
         INSERT INTO postbox.messages (topic, run_at) SELECT 'reminders', now() + interval '1 hour' FROM generate_series(1, 20000);
         INSERT INTO postbox.messages (topic) SELECT 'reminders' FROM generate_series(1, 100);
         ANALYZE postbox.messages;
         INSERT INTO postbox.messages (topic) SELECT 'other' FROM generate_series(1, 40000);
         INSERT INTO postbox.messages (topic) SELECT 'ours' FROM generate_series(1, 200);",
    );
    let shapes: Vec<(&str, String)> = vec![
        (
            "one topic",
            "SELECT * FROM postbox.claim_topic('ours', 100, 30, 1, 'x')".into(),
        ),
        (
            "held, one topic",
            "SELECT * FROM postbox.take_ready('ours', 100)".into(),
        ),
        (
            "a few topics",
            claim(false, "ARRAY['ours', 'reminders']", "'{}'"),
        ),
        (
            "held, a few topics",
            "SELECT * FROM postbox.pick(100, false, ARRAY['ours', 'reminders'], '{}', '{}', '{}')"
                .into(),
        ),
    ];
    let stale: Vec<i64> = shapes
        .iter()
        .map(|(_, sql)| entries_read(&db, sql))
        .collect();
    db.exec("ANALYZE postbox.messages");
    let current: Vec<i64> = shapes
        .iter()
        .map(|(_, sql)| entries_read(&db, sql))
        .collect();
    let report: Vec<_> = shapes
        .iter()
        .zip(stale.iter().zip(&current))
        .map(|((name, _), (s, c))| (*name, *s, *c))
        .collect();
    eprintln!(
        "index entries read by a claim of 100 (statistics of one topic, current): {report:?}"
    );
    for (name, stale, current) in report {
        assert!(stale <= 1_000, "{name}: {stale} on statistics of one topic");
        assert!(current <= 1_000, "{name}: {current} on current statistics");
    }
}

/// Every function that turns sorts off for its plans turns incremental sorts off too:
/// `enable_sort` does not cover them, and an index that presorts a first column of the order
/// (`messages_available_idx (topic, priority, id)` for an order by topic, priority, ready_xid)
/// lets a plan read every entry of the topic and sort them. The xmin bench's takes of three
/// topics took that plan after an autovacuum ANALYZE under a pin: 775,000 buffers a take.
#[test]
fn functions_that_turn_sorts_off_turn_incremental_sorts_off() {
    let db = TestDb::migrated();
    #[derive(diesel::QueryableByName)]
    struct F {
        #[diesel(sql_type = diesel::sql_types::Text)]
        f: String,
    }
    let missing: Vec<String> = diesel::sql_query(
        "SELECT p.oid::regprocedure::text AS f FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = 'postbox' AND p.proconfig @> '{enable_sort=off}'
           AND NOT p.proconfig @> '{enable_incremental_sort=off}'",
    )
    .load::<F>(&mut db.conn())
    .unwrap()
    .into_iter()
    .map(|r| r.f)
    .collect();
    assert!(missing.is_empty(), "{missing:?}");
    assert!(
        db.scalar(
            "SELECT count(*) AS v FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
             WHERE n.nspname = 'postbox' AND p.proconfig @> '{enable_incremental_sort=off}'"
        ) >= 10
    );
}
