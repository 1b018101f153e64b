//! The record that lets a relay tell its slot from one created again under the same name (see the
//! migration `stream_slot_guard`): before it confirms a position past its record, a relay records
//! the server's WAL position as the new limit, durably; a slot found confirmed past the limit was
//! not confirmed by postbox, and the range from the last position postbox confirmed to the slot's
//! may never have been streamed.

use diesel::sql_types::{BigInt, Text};
use diesel::{OptionalExtension, QueryableByName};
use diesel_async::RunQueryDsl;

use super::Store;
use crate::error::{Error, Result};

/// What a record of the confirmation limit left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recorded {
    /// The slot may be confirmed up to here (the server's WAL position when it was recorded, or a
    /// later one another relay recorded).
    pub limit: u64,
    /// The server's WAL position right after the record committed: the record's own WAL ends
    /// before it (a keepalive up to here says nothing of anyone else's writes).
    pub own_end: u64,
}

#[derive(QueryableByName)]
struct Limit {
    #[diesel(sql_type = BigInt)]
    limit: i64,
}

#[derive(QueryableByName)]
struct Position {
    #[diesel(sql_type = BigInt)]
    at: i64,
}

#[derive(QueryableByName)]
struct Gap {
    #[diesel(sql_type = Text)]
    gap_from: String,
    #[diesel(sql_type = Text)]
    gap_to: String,
}

impl Store {
    /// Records that the relay may confirm `slot` up to the server's WAL position now, and that it
    /// had confirmed up to `confirmed` (a WAL position as a number) by then; committed durably
    /// (the server may keep the slot's confirmed position across a crash). `None` when the slot
    /// is not registered (`postbox stream drop` ran).
    pub async fn stream_record_limit(
        &self,
        slot: &str,
        confirmed: u64,
    ) -> Result<Option<Recorded>> {
        use diesel_async::AsyncConnection;
        let mut conn = self.conn().await?;
        let confirmed = i64::try_from(confirmed).unwrap_or(i64::MAX);
        let limit: Option<Limit> = conn
            .transaction::<_, Error, _>(async |c| {
                diesel::sql_query("SET LOCAL synchronous_commit = on")
                    .execute(c)
                    .await?;
                Ok(diesel::sql_query(
                    "UPDATE postbox.stream_slots
                     SET confirm_limit = GREATEST(confirm_limit, pg_current_wal_insert_lsn()),
                         confirmed_before = GREATEST(confirmed_before, '0/0'::pg_lsn + $2::numeric)
                     WHERE slot_name = $1
                     RETURNING (confirm_limit - '0/0'::pg_lsn)::bigint AS limit",
                )
                .bind::<Text, _>(slot)
                .bind::<BigInt, _>(confirmed)
                .get_result(c)
                .await
                .optional()?)
            })
            .await?;
        let Some(limit) = limit else {
            return Ok(None);
        };
        let end: Position =
            diesel::sql_query("SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint AS at")
                .get_result(&mut *conn)
                .await?;
        Ok(Some(Recorded {
            limit: u64::try_from(limit.limit).unwrap_or_default(),
            own_end: u64::try_from(end.at).unwrap_or_default(),
        }))
    }

    /// Looks for `slot` confirmed past the limit its relays recorded (created again under the
    /// same name, advanced by hand, or streamed by another program). When found, the range that
    /// may never have been streamed is recorded (joined to one found before and not yet
    /// acknowledged by `postbox stream setup`), the limit moves to the slot's position, and the
    /// range is returned (`from`, `to`). One relay finds it: the row is locked.
    pub async fn stream_find_gap(&self, slot: &str) -> Result<Option<(String, String)>> {
        let gap: Option<Gap> = diesel::sql_query(
            "UPDATE postbox.stream_slots r
             SET gap_from = LEAST(r.gap_from, coalesce(r.confirmed_before, r.confirm_limit)),
                 gap_to = GREATEST(r.gap_to, s.confirmed_flush_lsn),
                 gap_found_at = now(),
                 confirm_limit = s.confirmed_flush_lsn,
                 confirmed_before = s.confirmed_flush_lsn
             FROM pg_catalog.pg_replication_slots s
             WHERE r.slot_name = $1
               AND s.slot_name = r.slot_name
               AND s.database = current_database()
               AND s.confirmed_flush_lsn > r.confirm_limit
             RETURNING r.gap_from::text AS gap_from, r.gap_to::text AS gap_to",
        )
        .bind::<Text, _>(slot)
        .get_result(&mut *self.conn().await?)
        .await
        .optional()?;
        Ok(gap.map(|g| (g.gap_from, g.gap_to)))
    }
}
