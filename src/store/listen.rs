//! Registration of waiting listeners (see the migration: writers notify only while one waits).

use diesel::QueryableByName;
use diesel::sql_types::{Array, BigInt};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use crate::error::Result;

#[derive(QueryableByName)]
struct Xids {
    #[diesel(sql_type = Array<BigInt>)]
    xids: Vec<i64>,
}

/// Registers the backend of `conn` as waiting, so inserts notify channel `postbox`. Also drops
/// rows of backends that no longer exist (a relay killed while waiting). Run it on the connection
/// that LISTENs, then look for work once more before waiting.
///
/// Returns the transactions in progress once the registration committed. A writer among them may
/// have inserted before the registration (its insert saw no listener, so its commit sends no
/// NOTIFY) and commit after the look that follows: watch them with [`still_running`] and look
/// again when one ends.
pub async fn register_listener(conn: &mut AsyncPgConnection) -> Result<Vec<i64>> {
    conn.batch_execute(
        "DELETE FROM postbox.listeners WHERE pid NOT IN (SELECT pid FROM pg_stat_activity);
         INSERT INTO postbox.listeners (pid) VALUES (pg_backend_pid()) ON CONFLICT DO NOTHING;",
    )
    .await?;
    let x: Xids = diesel::sql_query(
        "SELECT coalesce(array_agg(x::text::bigint), '{}') AS xids
         FROM pg_snapshot_xip(pg_current_snapshot()) AS x",
    )
    .get_result(conn)
    .await?;
    Ok(x.xids)
}

/// The transactions of `xids` that are still in progress.
pub async fn still_running(conn: &mut AsyncPgConnection, xids: &[i64]) -> Result<Vec<i64>> {
    let x: Xids = diesel::sql_query(
        "SELECT coalesce(array_agg(x), '{}') AS xids FROM unnest($1::bigint[]) AS x
         WHERE pg_xact_status(x::text::xid8) = 'in progress'",
    )
    .bind::<Array<BigInt>, _>(xids)
    .get_result(conn)
    .await?;
    Ok(x.xids)
}

impl crate::store::Store {
    /// Drops the registrations of waiting listeners whose backend is gone (a relay killed while
    /// waiting): while one is left, every writer NOTIFYs for nothing. Returns how many.
    pub async fn clean_listeners(&self) -> Result<usize> {
        let mut conn = self.conn().await?;
        Ok(diesel::sql_query(
            "DELETE FROM postbox.listeners WHERE pid NOT IN (SELECT pid FROM pg_stat_activity)",
        )
        .execute(&mut conn)
        .await?)
    }
}

/// Unregisters the backend of `conn`: writers stop notifying unless another relay waits.
pub async fn unregister_listener(conn: &mut AsyncPgConnection) -> Result<()> {
    conn.batch_execute("DELETE FROM postbox.listeners WHERE pid = pg_backend_pid()")
        .await?;
    Ok(())
}

/// Starts listening on channel `postbox` on `conn`.
pub async fn listen(conn: &mut AsyncPgConnection) -> Result<()> {
    conn.batch_execute("LISTEN postbox").await?;
    Ok(())
}
