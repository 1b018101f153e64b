//! Running postbox's own migrations, sync or async, compatible with diesel CLI's bookkeeping
//! (`__diesel_schema_migrations`), so an app may also copy `migrations/` into its own.

use diesel::PgConnection;
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};

use crate::error::{Error, Result};

/// The migrations of this crate, embedded at build time.
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations");

/// One migration at a time across every process: the key of the advisory lock they share. It is
/// tried, not waited for: a session waiting in `pg_advisory_lock` holds a snapshot, and a
/// migration building an index `CONCURRENTLY` waits for every snapshot — a deadlock.
const TRY_LOCK: &str = "SELECT pg_try_advisory_lock(7206185462771339348) AS locked";
/// How often a process waiting for another's migrations tries the lock again.
const LOCK_RETRY: std::time::Duration = std::time::Duration::from_millis(50);
const UNLOCK: &str = "SELECT pg_advisory_unlock(7206185462771339348)";

/// Runs the pending migrations on `conn`; returns the versions it applied. Safe to call from
/// many processes at once (they take turns on an advisory lock).
pub fn migrate(conn: &mut PgConnection) -> Result<Vec<String>> {
    run(conn)
}

/// diesel's own migration harness on any PostgreSQL connection, under the advisory lock.
fn run<C>(conn: &mut C) -> Result<Vec<String>>
where
    C: MigrationHarness<diesel::pg::Pg>
        + diesel::Connection<Backend = diesel::pg::Pg>
        + diesel::connection::LoadConnection,
{
    use diesel::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct Locked {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        locked: bool,
    }
    while !diesel::sql_query(TRY_LOCK)
        .get_result::<Locked>(conn)?
        .locked
    {
        std::thread::sleep(LOCK_RETRY);
    }
    let applied = conn
        .run_pending_migrations(MIGRATIONS)
        .map(|v| v.iter().map(|v| v.to_string()).collect())
        .map_err(|e| Error::Migration(e.to_string()));
    diesel::sql_query(UNLOCK).execute(conn)?;
    applied
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
