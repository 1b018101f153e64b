//! Completed-message retention: `postbox.completed`, one partition per UTC hour, filled by the
//! settle statements of a store [`with_archive`](Store::with_archive), expired by dropping whole
//! partitions; and where a message is now ([`Store::show`]).

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Bool, Double, Integer, Jsonb, Nullable, Text, Timestamptz};
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};

use super::Store;
use super::lenient::{LenientJson, LenientOptText, LenientText};
use crate::error::Result;
use crate::message::MessageId;

/// Partitions are created this far ahead, so a relay whose maintenance stops (or a clock that
/// jumps) does not find the hour's partition missing for a day.
pub const COMPLETED_AHEAD: Duration = Duration::from_secs(24 * 3600);

/// What one round of [`Store::maintain_completed`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Maintained {
    /// Hourly partitions created.
    pub created: usize,
    /// Hourly partitions dropped (every message in them delivered longer ago than kept).
    pub dropped: usize,
}

/// Where a message is, and what happened to it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Shown {
    /// In the queue: `state` is available, scheduled, running or waiting.
    Queued {
        /// The message's id.
        id: MessageId,
        /// Its topic.
        topic: String,
        /// Its key, if any.
        key: Option<String>,
        /// `available`, `scheduled`, `running` or `waiting`.
        state: String,
        /// Attempts used.
        attempts: i32,
        /// Attempts allowed.
        max_attempts: i32,
        /// When it was enqueued.
        created_at: DateTime<Utc>,
        /// When it is (or was) claimable.
        run_at: DateTime<Utc>,
        /// The relay that holds it, while it runs.
        locked_by: Option<String>,
        /// The error of its last failed attempt.
        last_error: Option<String>,
        /// The error of its first failed attempt.
        first_error: Option<String>,
        /// Its payload.
        payload: serde_json::Value,
        /// Its headers.
        headers: serde_json::Value,
    },
    /// In the dead letters.
    Dead {
        /// The message's id.
        id: MessageId,
        /// Its topic.
        topic: String,
        /// Its key, if any.
        key: Option<String>,
        /// Why it was dead-lettered.
        reason: String,
        /// Attempts used.
        attempts: i32,
        /// When it was enqueued.
        created_at: DateTime<Utc>,
        /// When it was dead-lettered.
        dead_at: DateTime<Utc>,
        /// The error of its last failed attempt.
        last_error: Option<String>,
        /// The error of its first failed attempt.
        first_error: Option<String>,
        /// Its payload.
        payload: serde_json::Value,
        /// Its headers.
        headers: serde_json::Value,
    },
    /// Delivered, and kept by retention.
    Delivered {
        /// The message's id.
        id: MessageId,
        /// Its topic.
        topic: String,
        /// Its key, if any.
        key: Option<String>,
        /// Attempts used.
        attempts: i32,
        /// When it was enqueued.
        created_at: DateTime<Utc>,
        /// When it was delivered.
        delivered_at: DateTime<Utc>,
        /// The sink that delivered it.
        sink: String,
        /// The relay that delivered it.
        relay: Option<String>,
        /// Its payload.
        payload: serde_json::Value,
        /// Its headers.
        headers: serde_json::Value,
    },
}

/// What a bounded read of a message left out: the sizes of a payload and of headers too large
/// to carry (stored bytes or JSON text, whichever is larger).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Omitted {
    /// The payload's size, when it was left out.
    pub payload: Option<i64>,
    /// The headers' size, when they were left out.
    pub headers: Option<i64>,
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = Integer)]
    n: i32,
}

#[derive(QueryableByName)]
struct Expired {
    #[diesel(sql_type = Text)]
    name: String,
    #[diesel(sql_type = Bool)]
    detach_pending: bool,
}

/// One row of the three places a message can be (the columns a place lacks are NULL).
#[derive(QueryableByName)]
struct Found {
    #[diesel(sql_type = Text)]
    place: String,
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Text, deserialize_as = LenientText)]
    topic: String,
    #[diesel(sql_type = Nullable<Text>, deserialize_as = LenientOptText)]
    key: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    state: Option<String>,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = Nullable<Integer>)]
    max_attempts: Option<i32>,
    #[diesel(sql_type = Timestamptz)]
    created_at: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<Text>)]
    who: Option<String>,
    #[diesel(sql_type = Nullable<Text>, deserialize_as = LenientOptText)]
    detail: Option<String>,
    #[diesel(sql_type = Nullable<Text>, deserialize_as = LenientOptText)]
    first_error: Option<String>,
    #[diesel(sql_type = Jsonb, deserialize_as = LenientJson)]
    payload: serde_json::Value,
    #[diesel(sql_type = Nullable<Integer>)]
    omitted: Option<i32>,
    #[diesel(sql_type = Jsonb, deserialize_as = LenientJson)]
    headers: serde_json::Value,
    #[diesel(sql_type = Nullable<Integer>)]
    headers_omitted: Option<i32>,
}

#[derive(QueryableByName)]
struct Kept {
    #[diesel(sql_type = BigInt)]
    n: i64,
    #[diesel(sql_type = BigInt)]
    p: i64,
}

/// The statistics' live rows of the hourly partitions (no scan).
const KEPT: &str = "SELECT coalesce(sum(n_live_tup), 0)::bigint AS n, count(*)::bigint AS p
FROM pg_stat_user_tables
WHERE schemaname = 'postbox' AND relname ~ '^completed_[0-9]{8}_[0-9]{2}$'";

const PARTITIONS: &str = "SELECT postbox.completed_partitions(make_interval(secs => $1)) AS n";
/// Whether this session owns `postbox.completed` (else the partitions are dropped through
/// `postbox.drop_expired_completed`, which runs as the owner).
const OWNS_COMPLETED: &str = "SELECT pg_catalog.pg_has_role(c.relowner, 'USAGE') AS owner
FROM pg_catalog.pg_class c WHERE c.oid = 'postbox.completed'::regclass";
const DROP_EXPIRED: &str =
    "SELECT postbox.drop_expired_completed(now() - make_interval(secs => $1)) AS n";
const EXPIRED: &str =
    "SELECT name, detach_pending FROM postbox.completed_expired(now() - make_interval(secs => $1))";

/// The live message first, then its dead letter, then its delivered copies (a replayed dead
/// letter can have been delivered once before), newest first. `$2`: the longest payload (bytes
/// of JSON text) to read, a larger one read as `null` with its size in `omitted`; then the
/// headers are read up to [`SHOWN_HEADERS_MAX`] (`headers_omitted` beyond), the key and the error
/// texts cut to [`SHOWN_TEXT_MAX`] characters. `$2` NULL: everything whole.
const FIND: &str = "
SELECT 'queued' AS place, id, topic, KEY, state::text AS state, attempts, max_attempts, created_at,
       run_at AS at, locked_by AS who, TEXT(last_error) AS detail, TEXT(first_error) AS first_error,
       PAYLOAD, HEADERS, 0 AS rank, now() AS sort
FROM postbox.messages WHERE id = $1
UNION ALL
SELECT 'queued', id, topic, KEY, CASE WHEN run_at > now() THEN 'scheduled' ELSE 'available' END, 0, max_attempts,
       created_at, run_at, NULL::text, TEXT(NULL::text), TEXT(NULL::text), PAYLOAD, HEADERS, 0, now()
FROM postbox.intake WHERE id = $1
UNION ALL
SELECT 'dead', id, topic, KEY, NULL, attempts, max_attempts, created_at, dead_at,
       TEXT(reason), TEXT(last_error), TEXT(first_error), PAYLOAD, HEADERS, 1, dead_at
FROM postbox.dead_letters WHERE id = $1
UNION ALL
SELECT 'delivered', id, topic, KEY, NULL, attempts, NULL, created_at, delivered_at, relay,
       sink, NULL::text, PAYLOAD, HEADERS, 2, delivered_at
FROM postbox.completed WHERE id = $1
ORDER BY rank, sort DESC";

/// Headers (bytes of JSON text) a bounded read of a message carries at most.
pub const SHOWN_HEADERS_MAX: i32 = 64 * 1024;
/// Characters of a key or an error text a bounded read of a message carries at most.
pub const SHOWN_TEXT_MAX: i32 = 8 * 1024;

/// [`FIND`]'s bounded columns.
fn find_sql() -> String {
    let bounded = |col: &str, max: &str, omitted: &str| {
        format!(
            "CASE WHEN $2::int IS NULL THEN {col}
                  WHEN pg_column_size({col}) <= {max} AND octet_length({col}::text) <= {max} THEN {col}
                  ELSE '{{}}'::jsonb END AS {col},
             CASE WHEN $2::int IS NULL THEN NULL
                  WHEN pg_column_size({col}) > {max} OR octet_length({col}::text) > {max}
                  THEN greatest(pg_column_size({col}), CASE WHEN pg_column_size({col}) <= {max} * 16
                                                              THEN octet_length({col}::text) END)
                  END AS {omitted}"
        )
    };
    let payload = bounded("payload", "$2", "omitted").replace("'{}'::jsonb", "'null'::jsonb");
    let headers = bounded("headers", &SHOWN_HEADERS_MAX.to_string(), "headers_omitted");
    let mut sql = FIND
        .replace("PAYLOAD", &payload)
        .replace("HEADERS", &headers)
        .replace(
            "KEY",
            &format!(
                "CASE WHEN $2::int IS NULL THEN key ELSE left(key, {SHOWN_TEXT_MAX}) END AS key"
            ),
        );
    // TEXT(x): x, cut when bounded.
    while let Some(at) = sql.find("TEXT(") {
        let close = at + sql[at..].find(')').expect("a closing parenthesis");
        let col = sql[at + 5..close].to_owned();
        sql.replace_range(
            at..=close,
            &format!("CASE WHEN $2::int IS NULL THEN {col} ELSE left({col}, {SHOWN_TEXT_MAX}) END"),
        );
    }
    sql
}

impl Store {
    /// Creates the hourly partitions of `postbox.completed` from this hour to
    /// `COMPLETED_AHEAD` (a day) (what an engine keeping completed messages needs before it completes
    /// any); returns how many it created.
    pub async fn prepare_completed(&self) -> Result<usize> {
        let mut conn = self.conn().await?;
        let created: Count = diesel::sql_query(PARTITIONS)
            .bind::<Double, _>(COMPLETED_AHEAD.as_secs_f64())
            .get_result(&mut conn)
            .await?;
        Ok(usize::try_from(created.n).unwrap_or(0))
    }

    /// Retention upkeep, safe on every replica at once: creates the hourly partitions of
    /// `postbox.completed` from this hour to `COMPLETED_AHEAD` (a day), and detaches (concurrently: the
    /// settle path is never blocked) and drops those whose hour ended more than `keep` ago. A
    /// relay that does not own the table (a role given by `postbox grant --relay`) detaches them
    /// at once instead, under a two-second lock timeout, as the owner.
    pub async fn maintain_completed(&self, keep: Duration) -> Result<Maintained> {
        #[derive(QueryableByName)]
        struct Owner {
            #[diesel(sql_type = diesel::sql_types::Bool)]
            owner: bool,
        }
        let created = self.prepare_completed().await?;
        let mut conn = self.conn().await?;
        let o: Owner = diesel::sql_query(OWNS_COMPLETED)
            .get_result(&mut conn)
            .await?;
        if !o.owner {
            let dropped: Count = diesel::sql_query(DROP_EXPIRED)
                .bind::<Double, _>(keep.as_secs_f64())
                .get_result(&mut conn)
                .await?;
            let dropped = usize::try_from(dropped.n).unwrap_or(0);
            return Ok(Maintained { created, dropped });
        }
        let expired: Vec<Expired> = diesel::sql_query(EXPIRED)
            .bind::<Double, _>(keep.as_secs_f64())
            .load(&mut conn)
            .await?;
        let mut dropped = 0;
        for p in expired {
            // The name matched ^completed_[0-9]{8}_[0-9]{2}$: nothing to quote.
            let detach = if p.detach_pending {
                format!(
                    "ALTER TABLE postbox.completed DETACH PARTITION postbox.{} FINALIZE",
                    p.name
                )
            } else {
                format!(
                    "ALTER TABLE postbox.completed DETACH PARTITION postbox.{} CONCURRENTLY",
                    p.name
                )
            };
            match conn.batch_execute(&detach).await {
                Ok(()) => {}
                // Another relay detached it first.
                Err(e) if e.to_string().contains("is not a partition") => continue,
                Err(e) => return Err(e.into()),
            }
            conn.batch_execute(&format!("DROP TABLE IF EXISTS postbox.{}", p.name))
                .await?;
            dropped += 1;
        }
        Ok(Maintained { created, dropped })
    }

    /// About how many delivered messages are kept (from the statistics, no scan), and in how
    /// many hourly partitions.
    pub async fn completed_kept(&self) -> Result<(i64, i64)> {
        let mut conn = self.conn().await?;
        let k: Kept = diesel::sql_query(KEPT).get_result(&mut conn).await?;
        Ok((k.n, k.p))
    }

    /// Where message `id` is: queued (with its state), dead-lettered, or delivered and kept by
    /// retention (with when, by which sink and relay). `None`: never enqueued, or delivered and
    /// not kept (retention off, or expired).
    pub async fn show(&self, id: MessageId) -> Result<Option<Shown>> {
        Ok(self.show_bounded(id, None).await?.map(|(s, _)| s))
    }

    /// [`Store::show`], reading the payload only if its JSON text is at most `max_payload`
    /// bytes: a larger one comes back as `null`, with its size (stored or as text, whichever is
    /// larger) beside. The console's message page reads at most a few megabytes this way.
    pub async fn show_bounded(
        &self,
        id: MessageId,
        max_payload: Option<usize>,
    ) -> Result<Option<(Shown, Omitted)>> {
        let mut conn = self.conn().await?;
        let max = max_payload.map(|m| i32::try_from(m).unwrap_or(i32::MAX));
        let rows: Vec<Found> = diesel::sql_query(find_sql())
            .bind::<BigInt, _>(id)
            .bind::<Nullable<Integer>, _>(max)
            .load(&mut conn)
            .await?;
        Ok(rows.into_iter().next().map(|r| {
            let omitted = Omitted {
                payload: r.omitted.map(i64::from),
                headers: r.headers_omitted.map(i64::from),
            };
            (Self::shown(r), omitted)
        }))
    }

    fn shown(r: Found) -> Shown {
        let at = r.at.unwrap_or(r.created_at);
        {
            match r.place.as_str() {
                "queued" => Shown::Queued {
                    id: r.id,
                    topic: r.topic,
                    key: r.key,
                    state: r.state.unwrap_or_default(),
                    attempts: r.attempts,
                    max_attempts: r.max_attempts.unwrap_or_default(),
                    created_at: r.created_at,
                    run_at: at,
                    locked_by: r.who,
                    last_error: r.detail,
                    first_error: r.first_error,
                    payload: r.payload,
                    headers: r.headers,
                },
                "dead" => Shown::Dead {
                    id: r.id,
                    topic: r.topic,
                    key: r.key,
                    reason: r.who.unwrap_or_default(),
                    attempts: r.attempts,
                    created_at: r.created_at,
                    dead_at: at,
                    last_error: r.detail,
                    first_error: r.first_error,
                    payload: r.payload,
                    headers: r.headers,
                },
                _ => Shown::Delivered {
                    id: r.id,
                    topic: r.topic,
                    key: r.key,
                    attempts: r.attempts,
                    created_at: r.created_at,
                    delivered_at: at,
                    sink: r.detail.unwrap_or_default(),
                    relay: r.who,
                    payload: r.payload,
                    headers: r.headers,
                },
            }
        }
    }
}
