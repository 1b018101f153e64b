//! `src/store/structure.sql` is the schema the migrations build (functions, triggers, indexes),
//! as `pg_dump --schema-only` prints it: the state model as it is, to read without replaying every
//! migration. This test fails when it is stale; `POSTBOX_BLESS=1 cargo test --test structure`
//! rewrites it.

mod common;

use common::TestDb;

const PATH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src/store/structure.sql");

/// The dump without what varies from one run or server to the next.
fn normalize(dump: &str) -> String {
    let mut out = String::from(
        "-- The postbox schema as the migrations leave it (pg_dump --schema-only --no-owner -n postbox).\n\
         -- Generated: do not edit; tests/structure.rs checks it, POSTBOX_BLESS=1 rewrites it.\n",
    );
    let mut blank = false;
    for line in dump.lines() {
        let skip = line.starts_with("\\restrict")
            || line.starts_with("\\unrestrict")
            || line.starts_with("-- Dumped ")
            || line.starts_with("SET ")
            || line.starts_with("SELECT pg_catalog.set_config");
        if skip {
            continue;
        }
        if line.trim().is_empty() {
            if !blank {
                out.push('\n');
            }
            blank = true;
            continue;
        }
        blank = false;
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[test]
fn structure_sql_is_what_the_migrations_build() {
    let db = TestDb::migrated();
    let out = std::process::Command::new("pg_dump")
        .args([
            "--schema-only",
            "--no-owner",
            "--no-privileges",
            "-n",
            "postbox",
        ])
        .arg(&db.url)
        .env_remove("PGOPTIONS")
        .output()
        .expect("pg_dump is installed (postgresql-client)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let now = normalize(&String::from_utf8(out.stdout).unwrap());
    if std::env::var_os("POSTBOX_BLESS").is_some() {
        std::fs::write(PATH, &now).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(PATH).unwrap_or_default();
    if committed != now {
        let first = committed
            .lines()
            .zip(now.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(committed.lines().count().min(now.lines().count()));
        panic!(
            "src/store/structure.sql is stale (first difference at line {}: committed {:?}, built {:?}); \
             run POSTBOX_BLESS=1 cargo test --test structure",
            first + 1,
            committed.lines().nth(first),
            now.lines().nth(first)
        );
    }
}
