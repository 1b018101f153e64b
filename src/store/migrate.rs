//! Running postbox's own migrations, sync or async, compatible with diesel CLI's bookkeeping
//! (`__diesel_schema_migrations`), so an app may also copy `migrations/` into its own.

use diesel::PgConnection;
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};

use crate::error::{Error, Result};

/// The migrations of this crate, embedded at build time.
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations");

/// The same migrations as (version, up.sql) for the async runner. A unit test keeps the two lists
/// equal.
#[cfg_attr(not(feature = "async"), allow(dead_code))]
pub(crate) const SQL_MIGRATIONS: &[(&str, &str)] = &[
    (
        "20261130000001",
        include_str!("../../migrations/2026-11-30-000001_postbox_core/up.sql"),
    ),
    (
        "20261201000001",
        include_str!("../../migrations/2026-12-01-000001_state_model/up.sql"),
    ),
    (
        "20261201000002",
        include_str!("../../migrations/2026-12-01-000002_hand_over/up.sql"),
    ),
    (
        "20261201000003",
        include_str!("../../migrations/2026-12-01-000003_hand_over_settle/up.sql"),
    ),
    (
        "20261201000004",
        include_str!("../../migrations/2026-12-01-000004_held_batches/up.sql"),
    ),
];

/// One migration at a time across every process: the key of the advisory lock they share.
const LOCK: &str = "SELECT pg_advisory_lock(7206185462771339348)";
const UNLOCK: &str = "SELECT pg_advisory_unlock(7206185462771339348)";

/// Runs the pending migrations on `conn`; returns the versions it applied. Safe to call from
/// many processes at once (they take turns on an advisory lock).
pub fn migrate(conn: &mut PgConnection) -> Result<Vec<String>> {
    use diesel::RunQueryDsl;
    diesel::sql_query(LOCK).execute(conn)?;
    let applied = conn
        .run_pending_migrations(MIGRATIONS)
        .map(|v| v.iter().map(|v| v.to_string()).collect())
        .map_err(|e| Error::Migration(e.to_string()));
    diesel::sql_query(UNLOCK).execute(conn)?;
    applied
}

/// [`migrate`] on an async connection.
#[cfg(feature = "async")]
pub async fn migrate_async(conn: &mut diesel_async::AsyncPgConnection) -> Result<Vec<String>> {
    use diesel_async::SimpleAsyncConnection;
    conn.batch_execute(LOCK).await?;
    let applied = run_async(conn).await;
    conn.batch_execute(UNLOCK).await?;
    applied
}

/// Creates database `name` (quoted as an identifier) from a connection to another database of the
/// server; a database that already exists (another process was first) is not an error.
#[cfg(feature = "async")]
pub async fn create_database(conn: &mut diesel_async::AsyncPgConnection, name: &str) -> Result<()> {
    use diesel_async::SimpleAsyncConnection;
    let quoted = format!("\"{}\"", name.replace('"', "\"\""));
    match conn
        .batch_execute(&format!("CREATE DATABASE {quoted}"))
        .await
    {
        Ok(()) => Ok(()),
        Err(e) if e.to_string().contains("already exists") => Ok(()),
        Err(e) => Err(e.into()),
    }
}

#[cfg(feature = "async")]
async fn run_async(conn: &mut diesel_async::AsyncPgConnection) -> Result<Vec<String>> {
    use diesel::sql_types::Text;
    use diesel_async::{AsyncConnection, RunQueryDsl, SimpleAsyncConnection};

    #[derive(diesel::QueryableByName)]
    struct Version {
        #[diesel(sql_type = Text)]
        version: String,
    }

    conn.batch_execute(
        "CREATE TABLE IF NOT EXISTS __diesel_schema_migrations (
             version VARCHAR(50) PRIMARY KEY NOT NULL,
             run_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP)",
    )
    .await?;
    let done: Vec<Version> = diesel::sql_query("SELECT version FROM __diesel_schema_migrations")
        .load(conn)
        .await?;
    let mut applied = Vec::new();
    for (version, up) in SQL_MIGRATIONS {
        if done.iter().any(|d| d.version == *version) {
            continue;
        }
        conn.transaction(async |conn| {
            conn.batch_execute(up).await?;
            diesel::sql_query("INSERT INTO __diesel_schema_migrations (version) VALUES ($1)")
                .bind::<Text, _>(*version)
                .execute(conn)
                .await?;
            Ok::<_, diesel::result::Error>(())
        })
        .await?;
        applied.push((*version).to_owned());
    }
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use diesel::migration::MigrationSource;
    use diesel::pg::Pg;

    #[test]
    fn async_list_matches_embedded_migrations() {
        let embedded: Vec<String> = MigrationSource::<Pg>::migrations(&super::MIGRATIONS)
            .unwrap()
            .iter()
            .map(|m| m.name().version().to_string())
            .collect();
        let listed: Vec<String> = super::SQL_MIGRATIONS
            .iter()
            .map(|(v, _)| v.to_string())
            .collect();
        assert_eq!(embedded, listed);
    }
}
