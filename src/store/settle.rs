//! Settling claimed messages: complete, retry, dead-letter, release, extend; and rescue of
//! expired leases. Each is one statement over a whole batch, fenced by the lease.
//!
//! The leases come as arrays (`$1` ids, `$2` tokens) joined to the table, and every statement also
//! says `m.id = ANY($1)`: without it the planner may join a large batch to a mid-sized backlog by
//! hashing the whole table (1,000 leases in 100,000 rows: a 17 ms scan instead of 2 ms of
//! primary-key lookups; see `Store::explain_settle`).

use std::time::Duration;

use diesel::QueryableByName;
use diesel::sql_types::{Array, BigInt, Bool, Double, Integer, Nullable, Text};
use diesel_async::{AsyncConnection, RunQueryDsl, SimpleAsyncConnection};

use super::upkeep::{NOW, Now, Walk};
use super::{ClaimedMessage, Lease, Store, fenced, split};
use crate::error::Result;
use crate::message::MessageId;

/// What a batch operation did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settled {
    /// Messages the operation applied to.
    pub done: Vec<MessageId>,
    /// Messages it did not touch because their lease is gone (expired and re-claimed, or settled
    /// already): the caller no longer owns them.
    pub fenced: Vec<MessageId>,
}

/// A failed delivery to try again later.
#[derive(Debug, Clone, PartialEq)]
pub struct Retry {
    /// The claim it settles.
    pub lease: Lease,
    /// Recorded as the message's `last_error`.
    pub error: String,
    /// Wait this long instead of the backoff.
    pub delay: Option<Duration>,
}

/// A delivery put off: the message runs again after `delay` without using an attempt (River's
/// `JobSnooze`, Oban's `{:snooze, s}`), while it has been snoozed fewer times than the cap
/// [`Store::snooze`] is given; past the cap the snooze is a retry (an attempt used, the dead
/// letters at the last), so a message that only ever snoozes does not run for ever unnoticed.
#[derive(Debug, Clone, PartialEq)]
pub struct Snooze {
    /// The claim it settles.
    pub lease: Lease,
    /// When to run it again, from now.
    pub delay: Duration,
}

/// A message that can never be delivered.
#[derive(Debug, Clone, PartialEq)]
pub struct Dead {
    /// The claim it settles.
    pub lease: Lease,
    /// Why: kept in the dead letter.
    pub reason: String,
}

/// What `retry` (or `rescue_expired`) did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RetryReport {
    /// Back to pending, with `run_at` moved by the backoff.
    pub retried: Vec<MessageId>,
    /// Out of attempts: moved to the dead letters.
    pub dead: Vec<MessageId>,
    /// Lease gone; untouched.
    pub fenced: Vec<MessageId>,
    /// Of `retried`, those [`Store::snooze`] put off without using an attempt.
    pub snoozed: Vec<MessageId>,
}

/// A row of the retry statement.
#[derive(QueryableByName)]
struct RetryRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Bool)]
    dead: bool,
    #[diesel(sql_type = Bool)]
    kept: bool,
    #[diesel(sql_type = Bool)]
    snoozing: bool,
}

#[derive(QueryableByName)]
struct IdRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

#[cfg(test)]
mod tests {
    #[test]
    fn storable_text_has_no_nul_and_a_bounded_length() {
        assert_eq!(super::storable("plain"), "plain");
        assert_eq!(super::storable("a\0b"), "a\u{FFFD}b");
        let long = "é".repeat(super::MAX_ERROR_BYTES);
        let cut = super::storable(&long);
        assert!(cut.len() <= super::MAX_ERROR_BYTES);
        assert!(cut.ends_with('…'));
    }
}

#[derive(QueryableByName)]
struct CompleteRow {
    /// Set on the last row only.
    #[diesel(sql_type = Nullable<Array<BigInt>>)]
    done: Option<Vec<i64>>,
    /// Set on the last row only: heads kept for a writer of their key.
    #[diesel(sql_type = Nullable<BigInt>)]
    kept: Option<i64>,
    #[diesel(embed)]
    message: ClaimedMessage,
}

#[derive(QueryableByName)]
struct IdDeadRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Bool)]
    dead: bool,
    /// A head kept for a writer of its key (see the migration `head_pins`).
    #[diesel(sql_type = Bool)]
    kept: bool,
}

/// A message taken out, and whether it is a head kept for a writer of its key.
#[derive(QueryableByName)]
struct IdKeptRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Bool)]
    kept: bool,
}

/// The removed heads of ordered keys (in a CTE `$from` of rows `take_out_cte!` took out) promote
/// the next message of their keys: one call for the whole statement, none when no head was removed
/// (see `postbox.promote_after`; the session setting `postbox.promotes_heads = 'caller'` of the
/// store's connections tells the delete trigger that it need not). A head kept for a writer of its
/// key promotes nothing: it is still its key's head (`postbox.finish_heads` promotes after it).
macro_rules! promote_heads_cte {
    ($from:literal) => {
        concat!(
            "heads AS (SELECT CASE WHEN count(*) > 0 THEN postbox.promote_after(array_agg(topic), array_agg(key), array_agg(id)) END AS promoted FROM ",
            $from,
            " WHERE ordered AND state <> 'waiting' AND NOT kept)"
        )
    };
}

/// Deletes the delivered messages; every ordered head among them promotes the next message of its
/// key, and the first `$3` of those that are due are leased to the caller at once (`$4` seconds,
/// token `$5`, owner `$6`): see `postbox.hand_over`. Rows: the messages handed over, as a claim
/// returns them, then one row whose `done` holds the ids deleted (its other columns are filler).
/// The second form also copies them into `postbox.completed` (sink `$7`).
macro_rules! complete_sql {
    ($archive:literal) => {
        concat!(
            r#"
WITH "#,
            take_out_cte!("gone", "$1::bigint[]", "$2::bigint[]"),
            r#","#,
            $archive,
            r#"
heads AS (
    SELECT array_agg(topic) AS topics, array_agg(key) AS keys, array_agg(id) AS ids
    FROM gone WHERE ordered AND state <> 'waiting' AND NOT kept
),
handed AS (
    SELECT h.* FROM heads, postbox.hand_over(heads.topics, heads.keys, heads.ids, $3, $4, $5, $6) AS h
)
SELECT NULL::bigint[] AS done, NULL::bigint AS kept, id, topic, key, ordered, payload, headers,
       priority, run_at, attempts, max_attempts, created_at, locked_until, lease_token, last_error,
       dedup_key
FROM handed
UNION ALL
SELECT coalesce((SELECT array_agg(id) FROM gone), '{}'), (SELECT count(*) FROM gone WHERE kept),
       0, '', NULL, false, 'null', '{}', 0::smallint, now(), 0, 0, now(), now(), 0::bigint, NULL,
       NULL
"#
        )
    };
}

pub(super) const COMPLETE: &str = complete_sql!("");

pub(super) const COMPLETE_KEEP: &str = complete_sql!(
    r#"
archived AS (
    INSERT INTO postbox.completed (id, topic, key, payload, headers, attempts, created_at,
                                   delivered_at, sink, relay)
    SELECT id, topic, key, payload, headers, attempts, created_at, statement_timestamp(), $7,
           locked_by
    FROM gone
),"#
);

/// Columns copied from a message into its dead letter (without the reason columns).
macro_rules! dead_columns {
    () => {
        "id, topic, key, ordered, payload, headers, priority, attempts, max_attempts, created_at, dedup_key"
    };
}

/// The backoff (the book, "Message life cycle: Backoff"), in SQL so that `run_at` is computed on the database clock:
/// `min(cap, base * 2^(attempts-1)) * (1 + jitter * u)`, `u` uniform in [-1, 1).
/// Arguments: the placeholders of base seconds, cap seconds and jitter.
macro_rules! backoff_sql {
    ($base:literal, $cap:literal, $jitter:literal) => {
        concat!(
            "least(",
            $cap,
            ", ",
            $base,
            " * power(2, least(m.attempts - 1, 62)))",
            " * (1 + ",
            $jitter,
            " * (2 * random() - 1))"
        )
    };
}

pub(super) const RETRY: &str = concat!(
    r#"
WITH input AS (
    SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::float8[])
        AS i(id, token, error, delay_secs)
),
locked AS (
    -- Which way each goes is decided on the row as locked: a cancel that marked it meanwhile
    -- (and held its lock) is seen. A snooze ($8: every row of the statement) under the cap ($9)
    -- uses no attempt; past it, it is a retry.
    SELECT m.id, i.token, i.error, i.delay_secs, s.snoozing,
           (m.attempts >= m.max_attempts AND NOT s.snoozing) OR m.cancelled AS ends
    FROM postbox.messages m JOIN input i ON m.id = i.id,
         LATERAL (SELECT $8::boolean AND m.snoozes < $9::integer AS snoozing) s
    WHERE m.id = ANY($1::bigint[]) AND m.lease_token = i.token
    FOR NO KEY UPDATE OF m
),
"#,
    take_out_cte!(
        "taken",
        "ARRAY(SELECT id FROM locked WHERE ends ORDER BY id)",
        "ARRAY(SELECT token FROM locked WHERE ends ORDER BY id)"
    ),
    r#",
exhausted AS (
    -- A snooze that ends here was cancelled: its text is no error of the message's.
    SELECT taken.*, CASE WHEN l.snoozing THEN taken.last_error ELSE l.error END AS error
    FROM taken JOIN locked l ON l.id = taken.id
),
"#,
    promote_heads_cte!("exhausted"),
    r#",
buried AS (
    INSERT INTO postbox.dead_letters ("#,
    dead_columns!(),
    r#", first_error, last_error, reason)
    SELECT "#,
    dead_columns!(),
    r#", coalesce(first_error, error), error,
           CASE WHEN cancelled THEN 'cancelled'
                ELSE format('attempts exhausted (%s of %s): %s', attempts, max_attempts, error) END
    FROM exhausted, heads
    RETURNING id
),
retried AS (
    UPDATE postbox.messages m
    SET locked_until = NULL, lease_token = NULL, locked_by = NULL,
        last_error = CASE WHEN i.snoozing THEN m.last_error ELSE i.error END,
        first_error = CASE WHEN i.snoozing THEN m.first_error ELSE coalesce(m.first_error, i.error) END,
        attempts = CASE WHEN i.snoozing THEN greatest(m.attempts - 1, 0) ELSE m.attempts END,
        snoozes = m.snoozes + i.snoozing::integer,
        state = CASE WHEN i.delay_secs <= 0 THEN 'available' ELSE 'scheduled' END::postbox.message_state,
        run_at = now() + make_interval(secs => coalesce(i.delay_secs, "#,
    backoff_sql!("$5", "$6", "$7"),
    r#"))
    FROM locked i
    WHERE m.id = ANY($1::bigint[]) AND m.id = i.id AND NOT i.ends
    RETURNING m.id, i.snoozing
)
SELECT id, false AS dead, false AS kept, snoozing FROM retried
UNION ALL
SELECT b.id, true AS dead, e.kept, false AS snoozing FROM buried b JOIN exhausted e ON e.id = b.id
"#
);

pub(super) const DEAD_LETTER: &str = concat!(
    r#"
WITH input AS (
    SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::text[]) AS i(id, token, reason)
),
"#,
    take_out_cte!("taken", "$1::bigint[]", "$2::bigint[]"),
    r#",
gone AS (
    SELECT taken.*, i.reason AS dead_reason FROM taken JOIN input i ON i.id = taken.id
),
"#,
    promote_heads_cte!("gone"),
    r#",
buried AS (
    INSERT INTO postbox.dead_letters ("#,
    dead_columns!(),
    r#", first_error, last_error, reason)
    SELECT "#,
    dead_columns!(),
    r#", coalesce(first_error, dead_reason), dead_reason, dead_reason
    FROM gone, heads
    RETURNING id
)
SELECT b.id, g.kept FROM buried b JOIN gone g ON g.id = b.id
"#
);

/// Back to available without using an attempt; a message cancelled while it ran goes to the dead
/// letters instead (reason `cancelled`), as a cancel promises, promoting its key.
pub(super) const RELEASE: &str = concat!(
    r#"
WITH input AS (
    SELECT * FROM unnest($1::bigint[], $2::bigint[]) AS d(id, token)
),
locked AS (
    -- Which way each goes is decided on the row as locked: a cancel that marked it meanwhile
    -- (and held its lock) is seen.
    SELECT m.id, d.token, m.cancelled
    FROM postbox.messages m JOIN input d ON m.id = d.id
    WHERE m.id = ANY($1::bigint[]) AND m.lease_token = d.token
    FOR NO KEY UPDATE OF m
),
released AS (
    UPDATE postbox.messages m
    SET state = 'available', attempts = greatest(m.attempts - 1, 0), locked_until = NULL, lease_token = NULL, locked_by = NULL
    FROM locked d
    WHERE m.id = ANY($1::bigint[]) AND m.id = d.id AND NOT d.cancelled
    RETURNING m.id
),
"#,
    take_out_cte!(
        "gone",
        "ARRAY(SELECT id FROM locked WHERE cancelled ORDER BY id)",
        "ARRAY(SELECT token FROM locked WHERE cancelled ORDER BY id)"
    ),
    r#",
"#,
    promote_heads_cte!("gone"),
    r#",
buried AS (
    INSERT INTO postbox.dead_letters ("#,
    dead_columns!(),
    r#", first_error, last_error, reason)
    SELECT "#,
    dead_columns!(),
    r#", first_error, last_error, 'cancelled'
    FROM gone, heads
    RETURNING id
)
SELECT id, false AS kept FROM released
UNION ALL
SELECT b.id, g.kept FROM buried b JOIN gone g ON g.id = b.id
"#
);

pub(super) const EXTEND: &str = r#"
UPDATE postbox.messages m
SET locked_until = now() + make_interval(secs => $3)
FROM unnest($1::bigint[], $2::bigint[]) AS d(id, token)
WHERE m.id = ANY($1::bigint[]) AND m.id = d.id AND m.lease_token = d.token
RETURNING m.id
"#;

/// Expired leases: back to pending with backoff (the attempt counts: the holder died or hung), or
/// to the dead letters when that was the last attempt. $1: batch limit; $2–$4: the backoff; $5:
/// where the walk starts (seconds since the epoch; NULL: the front, see `upkeep`).
pub(super) const RESCUE: &str = concat!(
    r#"
WITH expired AS (
    SELECT id, attempts >= max_attempts OR cancelled AS ends FROM postbox.messages
    -- (Not a head kept for a writer of its key: delivered, postbox.finish_heads takes it out.)
    WHERE state = 'running' AND locked_until >= coalesce(to_timestamp($5), '-infinity'::timestamptz)
      AND locked_until < now() AND lease_token <> 0
    ORDER BY locked_until
    LIMIT $1
    FOR NO KEY UPDATE SKIP LOCKED
),
"#,
    take_out_cte!(
        "exhausted",
        "ARRAY(SELECT id FROM expired WHERE ends)",
        "NULL::bigint[]"
    ),
    r#",
"#,
    promote_heads_cte!("exhausted"),
    r#",
buried AS (
    INSERT INTO postbox.dead_letters ("#,
    dead_columns!(),
    r#", first_error, last_error, reason)
    SELECT "#,
    dead_columns!(),
    r#", coalesce(first_error, format('lease expired on attempt %s (held by %s)', attempts, locked_by)),
           format('lease expired on attempt %s (held by %s)', attempts, locked_by),
           CASE WHEN cancelled THEN 'cancelled'
                ELSE format('attempts exhausted (%s of %s): lease expired (held by %s)', attempts, max_attempts, locked_by) END
    FROM exhausted, heads
    RETURNING id
),
back AS (
    UPDATE postbox.messages m
    SET state = 'scheduled', locked_until = NULL, lease_token = NULL, locked_by = NULL,
        last_error = format('lease expired on attempt %s (held by %s)', m.attempts, m.locked_by),
        first_error = coalesce(m.first_error, format('lease expired on attempt %s (held by %s)', m.attempts, m.locked_by)),
        run_at = now() + make_interval(secs => "#,
    backoff_sql!("$2", "$3", "$4"),
    r#")
    FROM expired e
    WHERE m.id = ANY(ARRAY(SELECT id FROM expired)) AND m.id = e.id AND NOT e.ends
    RETURNING m.id
)
SELECT id, false AS dead, false AS kept FROM back
UNION ALL
SELECT b.id, true AS dead, e.kept FROM buried b JOIN exhausted e ON e.id = b.id
"#
);

/// Longest error or reason text stored with a message (longer ones are cut, marked with `…`).
pub const MAX_ERROR_BYTES: usize = 8 * 1024;

/// Longest delay a retry may ask for (longer ones are shortened to it).
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(365 * 24 * 3600);

/// Text that PostgreSQL stores as given: NUL characters (which it refuses) replaced by U+FFFD,
/// and at most [`MAX_ERROR_BYTES`] long (cut on a character boundary, ending in `…`).
pub(crate) fn storable(text: &str) -> std::borrow::Cow<'_, str> {
    if text.len() <= MAX_ERROR_BYTES && !text.contains('\0') {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = text.replace('\0', "\u{FFFD}");
    if out.len() > MAX_ERROR_BYTES {
        let mut cut = MAX_ERROR_BYTES - '…'.len_utf8();
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
        out.push('…');
    }
    std::borrow::Cow::Owned(out)
}

/// The rescue's planner settings: only `messages_running_idx` gives its order without a sort (an
/// ANALYZE under a pinned horizon that saw no live running row made the planner take another
/// index of running rows and filter, reading every entry the pin kept).
pub(super) const RESCUE_PLAN: &str = "SET LOCAL enable_sort = off; SET LOCAL enable_incremental_sort = off; SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL jit = off";

/// Rows `rescue_expired` handles per statement.
pub const RESCUE_BATCH: i64 = 1_000;

impl Store {
    /// Delivered: deletes the messages (one statement).
    pub async fn complete(&self, leases: &[Lease]) -> Result<Settled> {
        Ok(self
            .complete_and_take(leases, 0, Duration::from_secs(1))
            .await?
            .0)
    }

    /// Delivered: deletes the messages, and leases to the caller (for `lease`, as a claim would)
    /// the next message of up to `take` of the ordered keys whose head was among them, if it is
    /// due: the relay that drains a key keeps it, without a claim in between. The next messages
    /// of the other keys become claimable as with [`complete`](Self::complete).
    pub async fn complete_and_take(
        &self,
        leases: &[Lease],
        take: usize,
        lease: Duration,
    ) -> Result<(Settled, Vec<ClaimedMessage>)> {
        if leases.is_empty() {
            return Ok((Settled::default(), Vec::new()));
        }
        let (ids, tokens) = split(leases.iter().copied());
        let token = super::new_token();
        let mut conn = self.conn().await?;
        let take = i32::try_from(take).unwrap_or(i32::MAX);
        let rows: Vec<CompleteRow> = match &self.archive {
            None => {
                diesel::sql_query(COMPLETE)
                    .bind::<Array<BigInt>, _>(&ids)
                    .bind::<Array<BigInt>, _>(&tokens)
                    .bind::<Integer, _>(take)
                    .bind::<Double, _>(lease.as_secs_f64())
                    .bind::<BigInt, _>(token)
                    .bind::<Text, _>(&*self.owner)
                    .load(&mut conn)
                    .await?
            }
            Some(sink) => {
                diesel::sql_query(COMPLETE_KEEP)
                    .bind::<Array<BigInt>, _>(&ids)
                    .bind::<Array<BigInt>, _>(&tokens)
                    .bind::<Integer, _>(take)
                    .bind::<Double, _>(lease.as_secs_f64())
                    .bind::<BigInt, _>(token)
                    .bind::<Text, _>(&*self.owner)
                    .bind::<Text, _>(&**sink)
                    .load(&mut conn)
                    .await?
            }
        };
        let mut done = Vec::new();
        let mut next = Vec::with_capacity(rows.len().saturating_sub(1));
        for row in rows {
            match row.done {
                Some(ids) => {
                    self.note_kept(row.kept.unwrap_or(0));
                    done = ids.into_iter().map(|id| IdRow { id }).collect();
                }
                None => next.push(row.message),
            }
        }
        next.sort_unstable_by_key(|m| (m.priority, m.id));
        Ok((settled(&ids, done), next))
    }

    /// Failed for now: back to pending after the backoff (or the given delay), with the error
    /// recorded; dead-lettered instead when that was the last attempt.
    pub async fn retry(&self, retries: &[Retry]) -> Result<RetryReport> {
        self.retry_or_snooze(retries, None).await
    }

    /// Puts deliveries off (see [`Snooze`]): each message runs again after its delay without
    /// using an attempt while it has been snoozed fewer than `max_snoozes` times; past that, the
    /// snooze is a retry (an attempt used, dead-lettered at the last) whose error says so. A
    /// message cancelled while it ran goes to the dead letters, as a cancel promises.
    pub async fn snooze(&self, snoozes: &[Snooze], max_snoozes: i32) -> Result<RetryReport> {
        let retries: Vec<Retry> = snoozes
            .iter()
            .map(|s| Retry {
                lease: s.lease,
                error: format!(
                    "snoozed {max_snoozes} times already (max_snoozes): this snooze uses an attempt"
                ),
                delay: Some(s.delay),
            })
            .collect();
        self.retry_or_snooze(&retries, Some(max_snoozes)).await
    }

    async fn retry_or_snooze(
        &self,
        retries: &[Retry],
        max_snoozes: Option<i32>,
    ) -> Result<RetryReport> {
        if retries.is_empty() {
            return Ok(RetryReport::default());
        }
        let (ids, tokens) = split(retries.iter().map(|r| r.lease));
        let errors: Vec<std::borrow::Cow<'_, str>> =
            retries.iter().map(|r| storable(&r.error)).collect();
        let errors: Vec<&str> = errors.iter().map(|e| e.as_ref()).collect();
        let delays: Vec<Option<f64>> = retries
            .iter()
            .map(|r| r.delay.map(|d| d.min(MAX_RETRY_DELAY).as_secs_f64()))
            .collect();
        let b = self.backoff;
        let mut conn = self.conn().await?;
        let rows: Vec<RetryRow> = diesel::sql_query(RETRY)
            .bind::<Array<BigInt>, _>(&ids)
            .bind::<Array<BigInt>, _>(&tokens)
            .bind::<Array<Text>, _>(&errors)
            .bind::<Array<Nullable<Double>>, _>(&delays)
            .bind::<Double, _>(b.base.as_secs_f64())
            .bind::<Double, _>(b.cap.as_secs_f64())
            .bind::<Double, _>(b.jitter)
            .bind::<Bool, _>(max_snoozes.is_some())
            .bind::<Integer, _>(max_snoozes.unwrap_or(0))
            .load(&mut conn)
            .await?;
        self.note_kept(rows.iter().filter(|r| r.kept).count() as i64);
        let snoozed = rows.iter().filter(|r| r.snoozing).map(|r| r.id).collect();
        let mut report = retry_report(&ids, rows.into_iter().map(|r| (r.id, r.dead)).collect());
        report.snoozed = snoozed;
        Ok(report)
    }

    /// Permanent failure: moves the messages to the dead letters with their reasons.
    pub async fn dead_letter(&self, dead: &[Dead]) -> Result<Settled> {
        if dead.is_empty() {
            return Ok(Settled::default());
        }
        let (ids, tokens) = split(dead.iter().map(|d| d.lease));
        let reasons: Vec<std::borrow::Cow<'_, str>> =
            dead.iter().map(|d| storable(&d.reason)).collect();
        let reasons: Vec<&str> = reasons.iter().map(|r| r.as_ref()).collect();
        let mut conn = self.conn().await?;
        let rows: Vec<IdKeptRow> = diesel::sql_query(DEAD_LETTER)
            .bind::<Array<BigInt>, _>(&ids)
            .bind::<Array<BigInt>, _>(&tokens)
            .bind::<Array<Text>, _>(&reasons)
            .load(&mut conn)
            .await?;
        Ok(self.settled_kept(&ids, rows))
    }

    /// Hands messages back without using an attempt (shutdown, sink outage), and wakes waiting
    /// relays so another one can take them at once.
    pub async fn release(&self, leases: &[Lease]) -> Result<Settled> {
        if leases.is_empty() {
            return Ok(Settled::default());
        }
        let (ids, tokens) = split(leases.iter().copied());
        let mut conn = self.conn().await?;
        let rows: Vec<IdKeptRow> = conn
            .transaction(async |conn| {
                let rows: Vec<IdKeptRow> = diesel::sql_query(RELEASE)
                    .bind::<Array<BigInt>, _>(&ids)
                    .bind::<Array<BigInt>, _>(&tokens)
                    .load(conn)
                    .await?;
                if !rows.is_empty() {
                    conn.batch_execute("SELECT postbox.wake()").await?;
                }
                Ok::<_, diesel::result::Error>(rows)
            })
            .await?;
        Ok(self.settled_kept(&ids, rows))
    }

    /// [`settled`], noting the heads kept for their writers.
    fn settled_kept(&self, requested: &[i64], rows: Vec<IdKeptRow>) -> Settled {
        self.note_kept(rows.iter().filter(|r| r.kept).count() as i64);
        settled(
            requested,
            rows.into_iter().map(|r| IdRow { id: r.id }).collect(),
        )
    }

    /// True if the database answers (a trivial query on a pooled connection).
    pub async fn ping(&self) -> Result<()> {
        let mut conn = self.conn().await?;
        conn.batch_execute("SELECT 1").await?;
        Ok(())
    }

    /// Heartbeat: the leases now end `lease` from now.
    pub async fn extend(&self, leases: &[Lease], lease: Duration) -> Result<Settled> {
        if leases.is_empty() {
            return Ok(Settled::default());
        }
        let (ids, tokens) = split(leases.iter().copied());
        let mut conn = self.conn().await?;
        let rows: Vec<IdRow> = diesel::sql_query(EXTEND)
            .bind::<Array<BigInt>, _>(&ids)
            .bind::<Array<BigInt>, _>(&tokens)
            .bind::<Double, _>(lease.as_secs_f64())
            .load(&mut conn)
            .await?;
        Ok(settled(&ids, rows))
    }

    /// Expired leases go back to pending (after the backoff: the attempt counts), or to the dead
    /// letters when they were on their last attempt. Handles at most [`RESCUE_BATCH`] rows per
    /// call; safe to run on every replica at once (SKIP LOCKED).
    pub async fn rescue_expired(&self) -> Result<RetryReport> {
        let b = self.backoff;
        let pass = self.upkeep.pass(Walk::Rescue);
        let mut conn = self.conn().await?;
        let (rows, walked_to) = conn
            .transaction(async |conn| {
                conn.batch_execute(RESCUE_PLAN).await?;
                let rows: Vec<IdDeadRow> = diesel::sql_query(RESCUE)
                    .bind::<BigInt, _>(RESCUE_BATCH)
                    .bind::<Double, _>(b.base.as_secs_f64())
                    .bind::<Double, _>(b.cap.as_secs_f64())
                    .bind::<Double, _>(b.jitter)
                    .bind::<Nullable<Double>, _>(pass.from)
                    .load(conn)
                    .await?;
                if rows.iter().any(|r| !r.dead) {
                    conn.batch_execute("SELECT postbox.wake()").await?;
                }
                // The statement's now(): the transaction's.
                let at: Now = diesel::sql_query(NOW).get_result(conn).await?;
                Ok::<_, diesel::result::Error>((rows, at.now))
            })
            .await?;
        if (rows.len() as i64) < RESCUE_BATCH {
            self.upkeep.ended(pass, walked_to);
        }
        self.note_kept(rows.iter().filter(|r| r.kept).count() as i64);
        Ok(retry_report(
            &[],
            rows.into_iter().map(|r| (r.id, r.dead)).collect(),
        ))
    }
}

fn settled(requested: &[i64], rows: Vec<IdRow>) -> Settled {
    let done: Vec<i64> = rows.into_iter().map(|r| r.id).collect();
    Settled {
        fenced: fenced(requested, &done),
        done,
    }
}

/// `rows`: each message's id, and whether it went to the dead letters.
fn retry_report(requested: &[i64], rows: Vec<(i64, bool)>) -> RetryReport {
    let mut report = RetryReport::default();
    for (id, dead) in rows {
        if dead {
            report.dead.push(id);
        } else {
            report.retried.push(id);
        }
    }
    let touched: Vec<i64> = report.retried.iter().chain(&report.dead).copied().collect();
    report.fenced = fenced(requested, &touched);
    report
}
