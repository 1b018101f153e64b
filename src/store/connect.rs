//! Opening connections for the store and the notifier.

use diesel::ConnectionResult;
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};

/// Session settings of the store's own connections.
///
/// `synchronous_commit = off`: the store's transactions (claim, complete, retry, dead-letter,
/// release) do not wait for their commit record to reach disk. Delivery is at least once, so a
/// crash that loses the last few of them loses nothing: a lost claim leaves the message pending, a
/// lost completion or retry leaves it leased until its lease expires and it is delivered again.
/// The enqueue, which must be durable, runs in the app's transaction on the app's connection.
const SESSION: &str = "SET synchronous_commit = off; SET application_name = 'postbox'";

/// Opens one connection with the store's session settings.
pub async fn establish(url: &str) -> ConnectionResult<AsyncPgConnection> {
    let mut conn = AsyncPgConnection::establish(url).await?;
    conn.batch_execute(SESSION)
        .await
        .map_err(|e| diesel::ConnectionError::BadConnection(e.to_string()))?;
    Ok(conn)
}
