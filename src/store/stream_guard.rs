//! The record that lets a relay tell its slot from one created again under the same name, or
//! moved by something else (see the migration `stream_slot_guard`): before it confirms a position
//! past its record, a relay records that position as the new limit, durably, after checking that
//! the slot is still at or before the old one. A slot found confirmed past the limit was not
//! confirmed by postbox, and the range from the last position postbox had confirmed to the slot's
//! may never have been streamed.

use diesel::sql_types::{BigInt, Nullable, Text};
use diesel::{OptionalExtension, QueryableByName};
use diesel_async::RunQueryDsl;

use super::Store;
use crate::error::Result;

/// What a check (and record) of the confirmation limit found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotRecord {
    /// The slot is postbox's: confirmed at or before the limit, which is now this (a WAL
    /// position as a number; `None`: never recorded, and nothing was asked to be).
    Ours {
        /// The limit the slot may be confirmed up to.
        limit: Option<u64>,
    },
    /// The slot was confirmed past the limit: the range `from..to` may never have been streamed
    /// (recorded, joined to one found before and not yet acknowledged); the limit is now `limit`.
    Gap {
        /// The last position postbox had confirmed when it last recorded.
        from: String,
        /// The slot's position when found.
        to: String,
        /// The limit from now on.
        limit: u64,
    },
    /// The slot is not registered (`postbox stream drop` ran) or the server has no such slot.
    Missing,
}

#[derive(QueryableByName)]
struct Row {
    #[diesel(sql_type = Nullable<BigInt>)]
    confirm_limit: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    at: Option<i64>,
}

const READ: &str = "
SELECT (r.confirm_limit - '0/0'::pg_lsn)::bigint AS confirm_limit,
       (s.confirmed_flush_lsn - '0/0'::pg_lsn)::bigint AS at
FROM postbox.stream_slots r
LEFT JOIN pg_catalog.pg_replication_slots s
       ON s.slot_name = r.slot_name AND s.database = current_database()
WHERE r.slot_name = $1";

/// A record in one statement (one round trip: a busy stream's confirmations wait for it),
/// committed durably: the slot's position is read, the row locked by the update, a gap found
/// against the row's limit as it is when locked.
const RECORD: &str = "
WITH s AS (
    SELECT set_config('synchronous_commit', 'on', true) AS durable,
           (SELECT confirmed_flush_lsn FROM pg_catalog.pg_replication_slots
            WHERE slot_name = $1 AND database = current_database()) AS at,
           '0/0'::pg_lsn + $2::numeric AS target,
           '0/0'::pg_lsn + $3::numeric AS confirmed,
           '0/0'::pg_lsn + $4::numeric AS ours
)
UPDATE postbox.stream_slots r
SET gap_from = CASE WHEN s.at > r.confirm_limit AND s.at > s.ours
                    THEN LEAST(r.gap_from, coalesce(r.confirmed_before, r.confirm_limit))
                    ELSE r.gap_from END,
    gap_to = CASE WHEN s.at > r.confirm_limit AND s.at > s.ours
                  THEN GREATEST(r.gap_to, s.at) ELSE r.gap_to END,
    gap_found_at = CASE WHEN s.at > r.confirm_limit AND s.at > s.ours
                        THEN now() ELSE r.gap_found_at END,
    confirm_limit = CASE WHEN s.at > r.confirm_limit AND s.at > s.ours
                         THEN GREATEST(s.at, s.target)
                         ELSE GREATEST(r.confirm_limit, s.target, LEAST(s.at, s.ours)) END,
    confirmed_before = CASE WHEN s.at > r.confirm_limit AND s.at > s.ours
                            THEN s.at ELSE GREATEST(r.confirmed_before, s.confirmed) END
FROM s
WHERE r.slot_name = $1 AND s.at IS NOT NULL AND s.durable IS NOT NULL
RETURNING r.gap_found_at IS NOT DISTINCT FROM now() AS gap_now,
          coalesce(r.gap_from::text, '') AS gap_from, coalesce(r.gap_to::text, '') AS gap_to,
          (r.confirm_limit - '0/0'::pg_lsn)::bigint AS confirm_limit";

#[derive(QueryableByName)]
struct Recorded {
    #[diesel(sql_type = diesel::sql_types::Bool)]
    gap_now: bool,
    #[diesel(sql_type = Text)]
    gap_from: String,
    #[diesel(sql_type = Text)]
    gap_to: String,
    #[diesel(sql_type = BigInt)]
    confirm_limit: i64,
}

async fn record(
    conn: &mut diesel_async::AsyncPgConnection,
    slot: &str,
    target: u64,
    confirmed: u64,
    ours: u64,
) -> Result<SlotRecord> {
    let row: Option<Recorded> = diesel::sql_query(RECORD)
        .bind::<Text, _>(slot)
        .bind::<BigInt, _>(lsn(target))
        .bind::<BigInt, _>(lsn(confirmed))
        .bind::<BigInt, _>(lsn(ours))
        .get_result(conn)
        .await
        .optional()?;
    Ok(match row {
        None => SlotRecord::Missing,
        Some(r) if r.gap_now => SlotRecord::Gap {
            from: r.gap_from,
            to: r.gap_to,
            limit: position(r.confirm_limit),
        },
        Some(r) => SlotRecord::Ours {
            limit: Some(position(r.confirm_limit)),
        },
    })
}

fn lsn(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn position(n: i64) -> u64 {
    u64::try_from(n).unwrap_or_default()
}

impl Store {
    /// Checks `slot` against the limit its relays recorded and, with `target`, records that a
    /// relay may confirm it up to `target` (a WAL position as a number), having confirmed up to
    /// `confirmed` by then; committed durably (the server may keep a slot's confirmed position
    /// across a crash). A slot confirmed past the limit is recorded as a gap instead. Without
    /// `target` nothing is written unless a gap is found (a standby relay checks often). A slot
    /// at or before `ours` (what this relay confirmed without a record: a server that shut down
    /// asked for it) is this relay's, and its position becomes the limit.
    pub async fn stream_slot_record(
        &self,
        slot: &str,
        target: Option<u64>,
        confirmed: u64,
        ours: u64,
    ) -> Result<SlotRecord> {
        let mut conn = self.conn().await?;
        let mut target = target;
        if target.is_none() {
            // A plain read first: a check that finds nothing writes nothing.
            let row: Option<Row> = diesel::sql_query(READ)
                .bind::<Text, _>(slot)
                .get_result(&mut *conn)
                .await
                .optional()?;
            match row {
                None
                | Some(Row {
                    confirm_limit: _,
                    at: None,
                }) => return Ok(SlotRecord::Missing),
                Some(Row {
                    confirm_limit: Some(limit),
                    at: Some(at),
                }) if at > limit => {
                    if position(at) <= ours {
                        // Confirmed by this relay when the server shut down: recorded now.
                        target = Some(position(at));
                    }
                }
                Some(r) => {
                    return Ok(SlotRecord::Ours {
                        limit: r.confirm_limit.map(position),
                    });
                }
            }
        }
        // Recorded, or suspected: the statement checks again under the row's lock.
        record(&mut conn, slot, target.unwrap_or(0), confirmed, ours).await
    }

    /// Whether this role may record the confirmation limit (UPDATE on `postbox.stream_slots`):
    /// a relay that cannot does not stream (it could neither confirm safely nor tell a slot
    /// created again by hand).
    pub async fn stream_can_record(&self) -> Result<bool> {
        #[derive(QueryableByName)]
        struct Flag {
            #[diesel(sql_type = diesel::sql_types::Bool)]
            flag: bool,
        }
        let f: Flag = diesel::sql_query(
            "SELECT has_table_privilege('postbox.stream_slots', 'UPDATE') AS flag",
        )
        .get_result(&mut *self.conn().await?)
        .await?;
        Ok(f.flag)
    }
}

impl Store {
    /// How many postbox messages `slot` holds that no relay confirmed yet, read without consuming
    /// them (`pg_logical_slot_peek_binary_changes`; needs the REPLICATION attribute, and the slot
    /// not streamed right now). `None` when the server cannot say (the slot is streamed, or stuck
    /// on WAL it cannot decode).
    pub async fn stream_unread_messages(
        &self,
        slot: &str,
        publication: &str,
    ) -> Result<Option<u64>> {
        #[derive(QueryableByName)]
        struct N {
            #[diesel(sql_type = BigInt)]
            n: i64,
        }
        // A pgoutput message: 'M', flags, its position, then the prefix, NUL-terminated.
        let n: std::result::Result<N, _> = diesel::sql_query(
            "SELECT count(*) FILTER (
                        WHERE get_byte(data, 0) = 77
                          AND position('\\x706f7374626f7800'::bytea IN substring(data FROM 11 FOR 8)) = 1)::bigint AS n
             FROM pg_catalog.pg_logical_slot_peek_binary_changes(
                      $1, NULL, NULL, 'proto_version', '1', 'publication_names', $2, 'messages', 'true')",
        )
        .bind::<Text, _>(slot)
        .bind::<Text, _>(publication)
        .get_result(&mut *self.conn().await?)
        .await;
        Ok(n.ok().map(|n| position(n.n)))
    }
}
