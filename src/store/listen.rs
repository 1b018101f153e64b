//! Registration of waiting listeners (see the migration: writers notify only while one waits).

use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};

use crate::error::Result;

/// Registers the backend of `conn` as waiting, so inserts notify channel `postbox`. Also drops
/// rows of backends that no longer exist (a relay killed while waiting). Run it on the connection
/// that LISTENs, then look for work once more before waiting.
pub async fn register_listener(conn: &mut AsyncPgConnection) -> Result<()> {
    conn.batch_execute(
        "DELETE FROM postbox.listeners WHERE pid NOT IN (SELECT pid FROM pg_stat_activity);
         INSERT INTO postbox.listeners (pid) VALUES (pg_backend_pid()) ON CONFLICT DO NOTHING;",
    )
    .await?;
    Ok(())
}

impl crate::store::Store {
    /// Drops the registrations of waiting listeners whose backend is gone (a relay killed while
    /// waiting): while one is left, every writer NOTIFYs for nothing. Returns how many.
    pub async fn clean_listeners(&self) -> Result<usize> {
        use diesel_async::RunQueryDsl;
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
