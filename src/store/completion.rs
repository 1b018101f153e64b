//! Transactional completion: a handler records in its own transaction that its message's work is
//! done (see the migration `completed_in_tx`), so a redelivery of the message does not do it again.

use diesel::QueryableByName;
use diesel::sql_types::BigInt;

use super::Store;
use crate::error::{Error, Result};
use crate::message::MessageId;

/// The message's claim on its effect, for the delivery its lease token names (see the function):
/// true when this transaction is the first to record it; false when another delivery's
/// transaction committed it (one still open is waited for).
const RECORD: &str = "SELECT postbox.complete_in_tx($1, $2) AS first";

/// Records dropped per statement.
const FORGET_BATCH: i64 = 10_000;

/// The records of messages that are gone from the table and from the dead letters (delivered, or
/// purged), a batch at a time, each by its primary key; rows another relay is dropping are
/// skipped. A replay moves a dead letter back in one transaction, so a message is always in one
/// of the two while it can be delivered again: its record is never dropped meanwhile.
const FORGET: &str = "DELETE FROM postbox.completed_in_tx c
    WHERE c.id = ANY (ARRAY(
        SELECT r.id FROM postbox.completed_in_tx r
        WHERE NOT EXISTS (SELECT FROM postbox.messages m WHERE m.id = r.id)
          AND NOT EXISTS (SELECT FROM postbox.dead_letters d WHERE d.id = r.id)
        LIMIT $1
        FOR UPDATE SKIP LOCKED))";

#[derive(QueryableByName)]
struct Recorded {
    #[diesel(sql_type = diesel::sql_types::Bool)]
    first: bool,
}

fn refuse_stream(id: MessageId) -> Result<()> {
    if id <= 0 {
        return Err(Error::InvalidArgument {
            field: "id",
            problem: "a stream message has no row: its completion cannot be recorded".into(),
        });
    }
    Ok(())
}

fn outside_a_transaction() -> Error {
    Error::InvalidArgument {
        field: "conn",
        problem: "complete_in runs inside the transaction that does the message's work \
                  (committed alone, it would mark the work done before it is)"
            .into(),
    }
}

/// Records, in the transaction open on `conn`, that message `id`'s work is done, for the delivery
/// of lease `token`; true if this transaction is the first to, false if an earlier delivery's
/// transaction committed it (skip the work). A delivery of the same message whose transaction is
/// still open is waited for; a delivery that lost its message (its lease expired) is refused.
pub async fn complete_in(
    conn: &mut diesel_async::AsyncPgConnection,
    id: MessageId,
    token: i64,
) -> Result<bool> {
    use diesel_async::{AsyncConnection, RunQueryDsl, TransactionManager};
    refuse_stream(id)?;
    let depth = <diesel_async::AsyncPgConnection as AsyncConnection>::TransactionManager::transaction_manager_status_mut(conn)
        .transaction_depth()
        .map_err(Error::from)?;
    if depth.is_none() {
        return Err(outside_a_transaction());
    }
    let r: Recorded = diesel::sql_query(RECORD)
        .bind::<BigInt, _>(id)
        .bind::<BigInt, _>(token)
        .get_result(conn)
        .await?;
    Ok(r.first)
}

/// [`complete_in`] on a sync connection.
pub fn complete_in_sync(
    conn: &mut diesel::PgConnection,
    id: MessageId,
    token: i64,
) -> Result<bool> {
    use diesel::RunQueryDsl;
    use diesel::connection::{AnsiTransactionManager, TransactionManager};
    refuse_stream(id)?;
    let depth = AnsiTransactionManager::transaction_manager_status_mut(conn)
        .transaction_depth()
        .map_err(Error::from)?;
    if depth.is_none() {
        return Err(outside_a_transaction());
    }
    let r: Recorded = diesel::sql_query(RECORD)
        .bind::<BigInt, _>(id)
        .bind::<BigInt, _>(token)
        .get_result(conn)?;
    Ok(r.first)
}

impl Store {
    /// Drops the completion records of messages that are gone (from the table and the dead
    /// letters), a batch at a time until fewer than a batch are left; how many.
    pub async fn forget_completions(&self) -> Result<usize> {
        use diesel_async::RunQueryDsl;
        let mut total = 0;
        let mut conn = self.conn().await?;
        loop {
            let n = diesel::sql_query(FORGET)
                .bind::<BigInt, _>(FORGET_BATCH)
                .execute(&mut *conn)
                .await?;
            total += n;
            if (n as i64) < FORGET_BATCH {
                return Ok(total);
            }
        }
    }
}
