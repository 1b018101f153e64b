//! Running postbox's own migrations, sync or async, with a bookkeeping of their own:
//! `postbox.schema_migrations`, never the app's `__diesel_schema_migrations` (an app migration of
//! the same version as one of postbox's would be skipped there, and the app's `diesel migration
//! revert` would stop at a version it cannot find). An install that an earlier release recorded in
//! diesel's table has its records moved by the first [`migrate`] run as the schema's owner.

use diesel::PgConnection;
use diesel::RunQueryDsl;
use diesel::migration::{self, Migration, MigrationSource, MigrationVersion};
use diesel::pg::Pg;
use diesel::sql_types::{Array, Bool, Text};
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};

use crate::error::{Error, Result};

/// The migrations of this crate, embedded at build time.
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations");

/// A digest of the migration files [`MIGRATIONS`] embeds (computed by the build script when they
/// were embedded): the same embedded migrations, the same digest.
#[doc(hidden)]
pub const MIGRATIONS_DIGEST: &str = env!("BUILT_MIGRATIONS_DIGEST");

/// One migration at a time across every process: the key of the advisory lock they share. It is
/// tried, not waited for: a session waiting in `pg_advisory_lock` holds a snapshot, and a
/// migration building an index `CONCURRENTLY` waits for every snapshot — a deadlock.
const TRY_LOCK: &str = "SELECT pg_try_advisory_lock(7206185462771339348) AS yes";
/// How often a process waiting for another's migrations tries the lock again.
const LOCK_RETRY: std::time::Duration = std::time::Duration::from_millis(50);
const UNLOCK: &str = "SELECT pg_advisory_unlock(7206185462771339348)";

const TABLE_EXISTS: &str = "SELECT to_regclass('postbox.schema_migrations') IS NOT NULL AS yes";
/// Created with the schema, by the transaction of the first migration; readable by every role, so
/// that any role can see that nothing is pending (versions are all it holds).
const CREATE_TABLE: &str = "CREATE TABLE postbox.schema_migrations (
    version text PRIMARY KEY,
    run_on timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE postbox.schema_migrations IS
    'The postbox migrations applied (postbox::migrate, postbox migrate): postbox keeps them apart from the app''s __diesel_schema_migrations';
GRANT SELECT ON postbox.schema_migrations TO PUBLIC";
const RECORD: &str = "INSERT INTO postbox.schema_migrations (version) VALUES ($1)";
const FORGET: &str = "DELETE FROM postbox.schema_migrations WHERE version = $1";
const APPLIED: &str = "SELECT version FROM postbox.schema_migrations ORDER BY version DESC";
/// An install an earlier release recorded in diesel's table (found on the search path, where
/// diesel creates it): its records of postbox's versions, once schema postbox exists.
const LEGACY: &str = "SELECT to_regnamespace('postbox') IS NOT NULL
    AND to_regclass('__diesel_schema_migrations') IS NOT NULL AS yes";
const LEGACY_APPLIED: &str = "SELECT version FROM __diesel_schema_migrations
    WHERE version = ANY($1) ORDER BY version DESC";
/// Whether this role can move them (it owns the schema postbox's table goes in, and may delete
/// from diesel's).
const CAN_MOVE: &str = "SELECT has_schema_privilege('postbox', 'CREATE')
    AND has_table_privilege('__diesel_schema_migrations', 'DELETE') AS yes";
const MOVE: &str = "WITH moved AS (
        DELETE FROM __diesel_schema_migrations WHERE version = ANY($1) RETURNING version, run_on
    )
    INSERT INTO postbox.schema_migrations (version, run_on) SELECT version, run_on FROM moved";

#[derive(diesel::QueryableByName)]
struct Yes {
    #[diesel(sql_type = Bool)]
    yes: bool,
}

#[derive(diesel::QueryableByName)]
struct Version {
    #[diesel(sql_type = Text)]
    version: String,
}

fn yes<C>(conn: &mut C, sql: &str) -> diesel::QueryResult<bool>
where
    C: diesel::Connection<Backend = Pg> + diesel::connection::LoadConnection,
{
    diesel::sql_query(sql)
        .get_result::<Yes>(conn)
        .map(|y| y.yes)
}

/// The versions of this crate's migrations.
fn ours() -> migration::Result<Vec<String>> {
    Ok(MigrationSource::<Pg>::migrations(&MIGRATIONS)?
        .iter()
        .map(|m| m.name().version().to_string())
        .collect())
}

/// diesel's [`MigrationHarness`] over `conn`, with postbox's own bookkeeping
/// (`postbox.schema_migrations`): what [`migrate`] runs, and what reverts postbox's migrations
/// (an app never runs them with its own harness, which would record them in its
/// `__diesel_schema_migrations`).
///
/// ```no_run
/// use diesel::Connection;
/// use diesel_migrations::MigrationHarness;
/// let mut conn = diesel::PgConnection::establish("postgres://localhost/app").unwrap();
/// postbox::migrate(&mut conn).unwrap();
/// // Back to the schema before postbox's latest migration.
/// postbox::Migrations::new(&mut conn)
///     .revert_last_migration(postbox::MIGRATIONS)
///     .unwrap();
/// ```
pub struct Migrations<'a, C> {
    conn: &'a mut C,
}

impl<'a, C> Migrations<'a, C>
where
    C: diesel::Connection<Backend = Pg> + diesel::connection::LoadConnection + 'static,
{
    /// The harness on `conn`.
    pub fn new(conn: &'a mut C) -> Self {
        Migrations { conn }
    }

    /// Moves what an earlier release recorded in `__diesel_schema_migrations` (postbox's versions
    /// only) into `postbox.schema_migrations`, when there is something to move and this role may;
    /// true if it did.
    fn move_legacy_records(&mut self) -> migration::Result<bool> {
        if yes(self.conn, TABLE_EXISTS)? || !yes(self.conn, LEGACY)? || !yes(self.conn, CAN_MOVE)? {
            return Ok(false);
        }
        let ours = ours()?;
        self.conn
            .transaction::<_, diesel::result::Error, _>(|conn| {
                conn.batch_execute(CREATE_TABLE)?;
                diesel::sql_query(MOVE)
                    .bind::<Array<Text>, _>(&ours)
                    .execute(conn)?;
                Ok(())
            })?;
        Ok(true)
    }

    /// Runs `migration` (or reverts it) and records it, in a transaction unless its metadata says
    /// otherwise.
    fn apply(
        &mut self,
        migration: &dyn Migration<Pg>,
        revert: bool,
    ) -> migration::Result<MigrationVersion<'static>> {
        let version = migration.name().version().as_owned();
        // The first of postbox's migrations creates schema postbox.
        let first = ours()?.iter().min() == Some(&version.to_string());
        let apply = |conn: &mut C| -> migration::Result<()> {
            if revert && first {
                // Its down.sql drops the schema, which must be empty by then.
                conn.batch_execute("DROP TABLE IF EXISTS postbox.schema_migrations")?;
                migration.revert(conn)?;
            } else if revert {
                migration.revert(conn)?;
                diesel::sql_query(FORGET)
                    .bind::<Text, _>(version.to_string())
                    .execute(conn)?;
            } else {
                migration.run(conn)?;
                // The first migration creates the schema: the table comes with it.
                if !yes(conn, TABLE_EXISTS)? {
                    conn.batch_execute(CREATE_TABLE)?;
                }
                diesel::sql_query(RECORD)
                    .bind::<Text, _>(version.to_string())
                    .execute(conn)?;
            }
            Ok(())
        };
        if migration.metadata().run_in_transaction() {
            self.conn
                .transaction::<_, Box<dyn std::error::Error + Send + Sync>, _>(apply)?;
        } else {
            apply(self.conn)?;
        }
        Ok(version)
    }
}

impl<C> MigrationHarness<Pg> for Migrations<'_, C>
where
    C: diesel::Connection<Backend = Pg> + diesel::connection::LoadConnection + 'static,
{
    fn run_migration(
        &mut self,
        migration: &dyn Migration<Pg>,
    ) -> migration::Result<MigrationVersion<'static>> {
        self.apply(migration, false)
    }

    fn revert_migration(
        &mut self,
        migration: &dyn Migration<Pg>,
    ) -> migration::Result<MigrationVersion<'static>> {
        self.apply(migration, true)
    }

    /// The versions in `postbox.schema_migrations`; on an install an earlier release recorded in
    /// diesel's table (and this role may not move), postbox's versions there.
    fn applied_migrations(&mut self) -> migration::Result<Vec<MigrationVersion<'static>>> {
        let rows: Vec<Version> = if yes(self.conn, TABLE_EXISTS)? {
            diesel::sql_query(APPLIED).load(self.conn)?
        } else if yes(self.conn, LEGACY)? {
            diesel::sql_query(LEGACY_APPLIED)
                .bind::<Array<Text>, _>(ours()?)
                .load(self.conn)?
        } else {
            Vec::new()
        };
        Ok(rows
            .into_iter()
            .map(|r| MigrationVersion::from(r.version))
            .collect())
    }
}

/// Runs the pending migrations on `conn`; returns the versions it applied. Safe to call from
/// many processes at once (they take turns on an advisory lock). With nothing pending it writes
/// nothing, so any role with USAGE on schema `postbox` may call it (an app's writer at start);
/// what is pending must be run by the role that owns schema `postbox`.
pub fn migrate(conn: &mut PgConnection) -> Result<Vec<String>> {
    run(conn)
}

/// The migrations under the advisory lock, with postbox's bookkeeping.
fn run<C>(conn: &mut C) -> Result<Vec<String>>
where
    C: diesel::Connection<Backend = Pg> + diesel::connection::LoadConnection + 'static,
{
    while !yes(conn, TRY_LOCK)? {
        std::thread::sleep(LOCK_RETRY);
    }
    let applied = pending(conn);
    diesel::sql_query(UNLOCK).execute(conn)?;
    applied
}

fn pending<C>(conn: &mut C) -> Result<Vec<String>>
where
    C: diesel::Connection<Backend = Pg> + diesel::connection::LoadConnection + 'static,
{
    let failed = |e: Box<dyn std::error::Error + Send + Sync>| Error::Migration(e.to_string());
    let mut harness = Migrations::new(conn);
    harness.move_legacy_records().map_err(failed)?;
    let waiting = harness.pending_migrations(MIGRATIONS).map_err(failed)?;
    if waiting.is_empty() {
        return Ok(Vec::new());
    }
    let names: Vec<String> = waiting.iter().map(|m| m.name().to_string()).collect();
    let ran = harness
        .run_migrations(&waiting)
        .map(|v| v.iter().map(|v| v.to_string()).collect::<Vec<String>>())
        .map_err(|e| e.to_string());
    let applied = match ran {
        Ok(applied) => applied,
        Err(text) if text.contains("permission denied") || text.contains("must be owner") => {
            #[derive(diesel::QueryableByName)]
            struct Owner {
                #[diesel(sql_type = Text)]
                owner: String,
            }
            let owner: Vec<Owner> = diesel::sql_query(
                "SELECT nspowner::regrole::text AS owner FROM pg_catalog.pg_namespace
                 WHERE nspname = 'postbox'",
            )
            .load(conn)
            .unwrap_or_default();
            let who = match owner.first() {
                Some(o) => format!("the role that owns schema postbox, {}", o.owner),
                None => "a role with CREATE on the database (it will own schema postbox)".into(),
            };
            return Err(Error::Migration(format!(
                "{text}: {} migration(s) pending ({}): run migrate as {who}",
                names.len(),
                names.join(", ")
            )));
        }
        Err(text) => return Err(Error::Migration(text)),
    };
    #[cfg(feature = "async")]
    grant_again(conn, &applied)?;
    Ok(applied)
}

/// The roles `postbox grant` recorded get their rights again, on what the migrations created (as
/// `postbox migrate` does).
#[cfg(feature = "async")]
fn grant_again<C>(conn: &mut C, applied: &[String]) -> Result<()>
where
    C: diesel::Connection<Backend = Pg> + diesel::connection::LoadConnection + 'static,
{
    use super::grant::{RoleKind, grant_sql};
    #[derive(diesel::QueryableByName)]
    struct Granted {
        #[diesel(sql_type = Text)]
        role: String,
        #[diesel(sql_type = Text)]
        kind: String,
    }
    let grants: Vec<Granted> = diesel::sql_query(
        "SELECT role, kind FROM postbox.grants g
             WHERE EXISTS (SELECT FROM pg_catalog.pg_roles r WHERE r.rolname = g.role)
             ORDER BY role, kind",
    )
    .load(conn)?;
    for g in grants {
        let Some(kind) = RoleKind::parse(&g.kind) else {
            continue;
        };
        if let Err(e) = conn.batch_execute(&grant_sql(kind, &g.role).join(";\n")) {
            return Err(Error::Migration(format!(
                "migrations applied ({}), but giving role {} its {} rights again failed: {e}: \
                 run `postbox grant --{} {}`",
                applied.join(", "),
                g.role,
                kind.name(),
                kind.name(),
                g.role
            )));
        }
    }
    Ok(())
}

/// [`migrate`] on an async connection: diesel's migration harness over diesel-async's
/// `AsyncConnectionWrapper`, on a blocking thread (so any tokio runtime will do, current-thread
/// included). The connection is handed back with the versions applied.
#[cfg(feature = "async")]
pub async fn migrate_async(
    conn: diesel_async::AsyncPgConnection,
) -> Result<(Vec<String>, diesel_async::AsyncPgConnection)> {
    use diesel_async::async_connection_wrapper::AsyncConnectionWrapper;
    tokio::task::spawn_blocking(move || {
        let mut wrapped = AsyncConnectionWrapper::<diesel_async::AsyncPgConnection>::from(conn);
        let applied = run(&mut wrapped);
        applied.map(|a| (a, wrapped.into_inner()))
    })
    .await
    .map_err(|e| Error::Migration(format!("the migration task failed: {e}")))?
}

/// [`migrate_async`] for an app that has a bb8 pool of diesel-async connections: the migrations
/// run on a connection of their own made with the pool's settings (`Pool::dedicated_connection`),
/// closed afterwards, so no pooled connection is taken and the pool is left as it was.
///
/// ```no_run
/// # async fn run() -> Result<(), postbox::Error> {
/// use diesel_async::AsyncPgConnection;
/// use diesel_async::pooled_connection::AsyncDieselConnectionManager;
/// let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new("postgres://localhost/app");
/// let pool = bb8::Pool::builder().build(manager).await.expect("a pool");
/// let applied = postbox::migrate_pool(&pool).await?;
/// # Ok(()) }
/// ```
#[cfg(feature = "async")]
pub async fn migrate_pool(pool: &crate::store::Pool) -> Result<Vec<String>> {
    let conn = pool
        .dedicated_connection()
        .await
        .map_err(|e| Error::Pool(e.to_string()))?;
    migrate_async(conn).await.map(|(applied, _)| applied)
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
