//! Held batches, the fast path of the claim (see the migration `held_batches`): a batch is taken
//! by locking its rows in a transaction that stays open while it is delivered; the delivered
//! messages are deleted in that transaction and it commits. No lease is written for them. Whatever
//! is not delivered when the hold ends is leased in the same transaction and settled as a claimed
//! message is.

use std::time::Duration;

use diesel::QueryableByName;
use diesel::sql_types::{Array, BigInt, Bool, Double, Integer, Nullable, SmallInt, Text};
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, TransactionManager};

use super::{ClaimedMessage, Store, Topics};
use crate::error::{Error, Result};
use crate::message::MessageId;

/// The columns of a held message, as a claim returns them: the attempt it would be, the token its
/// lease will carry if it is leased when the hold ends, and the holding transaction.
macro_rules! take_columns {
    () => {
        take_columns!("")
    };
    ($($extra:tt)+) => {
        concat!(
            "SELECT id, topic, key, ordered, payload, headers, priority, run_at, attempts + 1 AS attempts,
       max_attempts, created_at, now() + make_interval(secs => $1) AS locked_until,
       $2::bigint AS lease_token, last_error, dedup_key, pg_current_xact_id()::text AS xid",
            $($extra)+,
            "\nFROM "
        )
    };
}

/// The take of every topic (`$3` NULL) or of one topic named exactly: `postbox.take_ready`, the
/// claim's walk from the floors (see the migration `ready_takes`), from the newest floors the store
/// has seen when its connection has none or older ones (`$5`); the first row carries the floors
/// the session keeps after it.
pub(super) const TAKE_READY: &str = concat!(
    take_columns!(
        ", ready_xid::text AS ready_xid, CASE WHEN row_number() OVER () = 1
            THEN postbox.boot_token() || '|' || current_setting(postbox.claim_floors_setting($3), true)
            END AS floors"
    ),
    "postbox.take_ready($3, $4, ",
    floors_in!("$5"),
    ")"
);

/// The take of up to 16 topics named exactly (`$3`): `postbox.take_set` from the newest floors the
/// store has seen of each (`$5`, in the order of `$3`); the first row carries the floors the
/// session keeps of each after it.
const TAKE_SET: &str = concat!(
    take_columns!(
        ", CASE WHEN row_number() OVER () = 1 THEN ",
        floors_set_out!("$3"),
        " END AS floors"
    ),
    "postbox.take_set($3, $4, NULL, NULL, NULL, ",
    floors_set_in!("$5"),
    ")"
);

/// The take of every topic after a position of the floors' order, while the claim loop's holds are
/// in flight: its priority only ($5), after ($6 ready_xid, $7 id). One statement, no function: the
/// floors stay where they are (below the rows in flight), and a short take sends the loop back to
/// [`TAKE_READY`].
const TAKE_READY_AFTER: &str = concat!(
    take_columns!(", ready_xid::text AS ready_xid, NULL::text AS floors"),
    "postbox.messages m WHERE $3::text IS NULL AND state = 'available' AND priority::integer = $5
       AND m.ready_xid >= $6::text::xid8 AND (m.ready_xid, m.id) > ($6::text::xid8, $7)
     ORDER BY m.priority::integer, m.ready_xid, m.id LIMIT $4 FOR NO KEY UPDATE SKIP LOCKED"
);

/// [`TAKE_READY_AFTER`] for one topic ($3). (The order names the table's columns: a bare
/// `ready_xid` there would be the text the statement returns, sorted. The topic is an array of
/// one, so that only `messages_ready_topic_idx` gives the order: see the migration `ready_sets`.)
pub(super) const TAKE_READY_AFTER_ONE: &str = concat!(
    take_columns!(", ready_xid::text AS ready_xid, NULL::text AS floors"),
    "postbox.messages m WHERE state = 'available' AND topic = ANY(ARRAY[$3::text]) AND priority::integer = $5
       AND m.ready_xid >= $6::text::xid8 AND (m.ready_xid, m.id) > ($6::text::xid8, $7)
     ORDER BY m.topic, m.priority::integer, m.ready_xid, m.id LIMIT $4 FOR NO KEY UPDATE SKIP LOCKED"
);

/// The planner settings of the claim functions, for the transaction of a hold (one round trip
/// with its BEGIN), and the server's limit on it: idle in the transaction for longer than the
/// hold's limit plus [`HOLD_GRACE`] (the relay is frozen, paused or cut off), the server ends the
/// session, its locks go, and `lost_holds` counts the attempt.
fn begin_take(limit: Duration) -> String {
    let ms = (limit + HOLD_GRACE).as_millis();
    format!(
        "BEGIN; SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL enable_sort = off; SET LOCAL enable_incremental_sort = off; SET LOCAL jit = off; SET LOCAL idle_in_transaction_session_timeout = {ms}"
    )
}

/// The take of a filter with patterns or exclusions (`$3`–`$7`): `postbox.take_matching` from the
/// newest floors the store has seen of the filter (`$9`); the first row carries the floors the
/// session keeps of it after it (see the migration `filter_floors`).
const TAKE_MATCHING: &str = concat!(
    take_columns!(
        ", CASE WHEN row_number() OVER () = 1
            THEN postbox.boot_token() || '|' || current_setting(postbox.filter_floors_setting($3, $4, $5, $6, $7), true)
            END AS floors"
    ),
    "postbox.take_matching($3, $4, $5, $6, $7, $8, NULL, NULL, NULL, ",
    floors_in!("$9"),
    ")"
);

/// `postbox.pick`: the claim order across the topics of a filter (with exclusions or patterns),
/// after a position (while the claim loop's holds are in flight).
const TAKE: &str = concat!(
    take_columns!(),
    "postbox.pick($3, $4, $5, $6, $7, $8, $9, $10)"
);

/// The messages behind ordered heads that a hold takes with them (see [`Store::take`]): for each
/// head ($3 topics, $4 keys, $5 ids) the next $6 waiting messages of its key, as far as they are
/// due; the rows not locked by another transaction are locked (`chain`: the head's place in the
/// arrays, from 1; `place`: the follower's place behind it, from 1). A chain is cut at its first
/// follower that is missing from the result.
pub(super) const FOLLOWERS: &str = concat!(
    "WITH cand AS (
    SELECT w.id, h.n AS chain, row_number() OVER (PARTITION BY h.n ORDER BY w.id) AS place,
           bool_and(w.due) OVER (PARTITION BY h.n ORDER BY w.id) AS due
    FROM unnest($3::text[], $4::text[], $5::bigint[]) WITH ORDINALITY AS h(topic, key, head, n),
    LATERAL (SELECT w.id, w.run_at <= now() AS due FROM postbox.messages w
             WHERE w.state = 'waiting' AND w.topic = h.topic AND w.key = h.key AND w.id > h.head
             ORDER BY w.id LIMIT $6) w
),
locked AS (
    -- By primary key. `state::text`: with `state = 'waiting'` the planner may scan all of
    -- messages_waiting_idx for the ids on a table it has no statistics for yet (190 ms against
    -- 2 ms for 100 heads in a freshly filled table of 20,000 ordered messages).
    SELECT m.* FROM postbox.messages m
    WHERE m.id = ANY(ARRAY(SELECT id FROM cand WHERE due)) AND m.state::text = 'waiting'
    FOR NO KEY UPDATE SKIP LOCKED
)
",
    take_columns!(", cand.chain, cand.place"),
    "locked JOIN cand USING (id)"
);

/// The most messages a hold takes behind one ordered head.
const MAX_FOLLOWERS: usize = 64;

const REGISTER: &str = "INSERT INTO postbox.holds (xid, ids, held_by, hold_limit, token)
VALUES ($1::text::xid8, $2, $3, make_interval(secs => $4), $5)";

/// How long past its limit the server lets a hold's transaction sit idle before it ends it (and
/// the session): a frozen or cut-off relay's rows are claimable again after the limit plus this.
pub const HOLD_GRACE: Duration = Duration::from_secs(2);

/// Ends a hold: deletes the delivered messages ($1), leases the others ($2; $3 seconds, token $4,
/// owner $5) and deletes the registration. The ordered keys whose last delivered message is in $7
/// (none of their messages leased: no head left in the hold) hand the next message over to the
/// caller, up to $6 of them, or promote it (see `postbox.hand_over`; the lease is counted from now,
/// not from the start of the hold). Rows: the messages handed over, then one summary row. The
/// second form also copies the delivered messages into `postbox.completed` (sink $8; a held
/// message's attempt is not in its row yet).
macro_rules! settle_sql {
    ($archive:literal) => {
        concat!(
            r#"
WITH "#,
            take_out_cte!("gone", "$1::bigint[]", "NULL::bigint[]"),
            r#","#,
            $archive,
            r#"
heads AS (
    -- Each key's first delivered message: where the search for its next one starts. A key whose
    -- head is kept for a writer of the key still has it: nothing to promote.
    SELECT array_agg(topic) AS topics, array_agg(key) AS keys, array_agg(first) AS ids
    FROM (SELECT topic, key, min(id) AS first FROM gone
          WHERE ordered AND (topic, key) IN (SELECT topic, key FROM gone WHERE id = ANY($7::bigint[]))
          GROUP BY topic, key
          HAVING NOT bool_or(kept)) k
),
handed AS (
    SELECT h.* FROM heads, postbox.hand_over(heads.topics, heads.keys, heads.ids, $6,
        $3 + extract(epoch FROM statement_timestamp() - now())::float8, $4, $5) AS h
),
leased AS (
    UPDATE postbox.messages m
    SET state = 'running', attempts = m.attempts + 1,
        -- now() is when the hold began.
        locked_until = statement_timestamp() + make_interval(secs => $3), lease_token = $4, locked_by = $5
    WHERE m.id = ANY($2::bigint[])
    RETURNING m.id
),
unregistered AS (
    DELETE FROM postbox.holds WHERE xid = pg_current_xact_id() RETURNING xid
)
SELECT NULL::bigint AS deleted, NULL::bigint AS leased, NULL::bool AS unregistered,
       NULL::bigint AS kept, id, topic, key, ordered, payload, headers, priority, run_at, attempts, max_attempts,
       created_at, locked_until, lease_token, last_error, dedup_key
FROM handed
UNION ALL
SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM leased),
       (SELECT count(*) FROM unregistered) = 1, (SELECT count(*) FROM gone WHERE kept),
       0, '', NULL, false, 'null', '{}', 0::smallint, now(), 0, 0, now(), now(), 0::bigint, NULL, NULL
"#
        )
    };
}

pub(super) const SETTLE: &str = settle_sql!("");

const SETTLE_KEEP: &str = settle_sql!(
    r#"
archived AS (
    INSERT INTO postbox.completed (id, topic, key, payload, headers, attempts, created_at,
                                   delivered_at, sink, relay)
    SELECT id, topic, key, payload, headers, attempts + 1, created_at, statement_timestamp(), $8,
           $5
    FROM gone
),"#
);

#[derive(QueryableByName)]
pub(super) struct HeldRow {
    #[diesel(embed)]
    pub(super) message: ClaimedMessage,
    #[diesel(sql_type = Text)]
    xid: String,
}

/// A row of [`TAKE_READY`]: the first carries the floors its session keeps.
#[derive(QueryableByName)]
pub(super) struct HeldReadyRow {
    #[diesel(embed)]
    pub(super) held: HeldRow,
    #[diesel(sql_type = Text)]
    pub(super) ready_xid: String,
    #[diesel(sql_type = Nullable<Text>)]
    floors: Option<String>,
}

/// A row of [`TAKE_SET`]: the first carries the floors its session keeps of each topic.
#[derive(QueryableByName)]
pub(super) struct HeldSetRow {
    #[diesel(embed)]
    pub(super) held: HeldRow,
    #[diesel(sql_type = Nullable<Array<Nullable<Text>>>)]
    floors: Option<Vec<Option<String>>>,
}

/// A row of [`TAKE_MATCHING`]: the first carries the floors its session keeps of the filter.
#[derive(QueryableByName)]
pub(super) struct HeldMatchingRow {
    #[diesel(embed)]
    pub(super) held: HeldRow,
    #[diesel(sql_type = Nullable<Text>)]
    floors: Option<String>,
}

/// A position in the order a take walks, where the last take of a claim loop ended: the next
/// take, while the loop's holds are in flight, starts after it (see [`Store::take`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct TakePosition {
    priority: i16,
    /// The transaction that made the message available, for the takes that walk the floors'
    /// order (priority, ready_xid, id); none for the others' (priority, id).
    ready: Option<u64>,
    id: i64,
}

impl TakePosition {
    /// The position of message `id` of `priority` in the order (priority, id).
    pub fn at(priority: i16, id: i64) -> Self {
        TakePosition {
            priority,
            ready: None,
            id,
        }
    }
}

#[derive(QueryableByName)]
struct FollowerRow {
    #[diesel(embed)]
    message: ClaimedMessage,
    #[diesel(sql_type = BigInt)]
    chain: i64,
    #[diesel(sql_type = BigInt)]
    place: i64,
}

/// A batch held by a transaction that is open on `conn`. Dropping it without [`Store::end_hold`]
/// drops the connection (the pool discards a connection left in a transaction): the transaction
/// rolls back and the lost hold is counted by [`Store::lost_holds`].
pub struct Hold {
    conn: bb8::PooledConnection<'static, AsyncDieselConnectionManager<AsyncPgConnection>>,
    xid: String,
    token: i64,
    limit: Duration,
    ids: Vec<MessageId>,
    /// The ordered messages held (heads and followers): id, topic, key.
    keys: Vec<(MessageId, String, String)>,
    /// The messages, in (priority, id) order. `attempts` is the attempt this delivery is;
    /// `lease_token` the token of the lease they get if they are still unsettled when the hold ends.
    pub messages: Vec<ClaimedMessage>,
    /// The messages taken behind the ordered heads among `messages` (still waiting, locked by the
    /// hold): by key in the order of their heads, each key's in id order. One may be delivered
    /// only once the message before it in its key was delivered.
    pub followers: Vec<ClaimedMessage>,
    /// True when a key's share of the followers was used up: more of its messages may wait
    /// behind them.
    pub followers_capped: bool,
    /// Where the take ended in the order it walked (its last message): the position for the
    /// next take while this one is in flight.
    pub last: Option<TakePosition>,
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hold")
            .field("xid", &self.xid)
            .field("messages", &self.messages.len())
            .finish_non_exhaustive()
    }
}

impl Hold {
    /// The holding transaction's id.
    pub fn xid(&self) -> &str {
        &self.xid
    }
}

/// What ending a hold did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HoldEnded {
    /// Delivered messages deleted.
    pub deleted: usize,
    /// Messages leased to the caller (token of the hold), to settle as claimed ones.
    pub leased: usize,
}

/// A message handed over, or (the last row) the summary.
#[derive(QueryableByName)]
struct SettleRow {
    #[diesel(sql_type = Nullable<BigInt>)]
    deleted: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    leased: Option<i64>,
    #[diesel(sql_type = Nullable<Bool>)]
    unregistered: Option<bool>,
    /// Heads kept for a writer of their key (see the migration `head_pins`).
    #[diesel(sql_type = Nullable<BigInt>)]
    kept: Option<i64>,
    #[diesel(embed)]
    message: ClaimedMessage,
}

impl Store {
    /// Takes up to `batch` claimable messages of `topics` into a hold (see the module): their rows
    /// are locked by a transaction left open on a connection of the pool. `None` when nothing is
    /// claimable. Before delivering any of them, [`Store::register_hold`]: a hold that is not
    /// registered cannot end (its messages would be delivered without their attempt being
    /// counted should it never commit). `limit` is only what `locked_until` of the returned
    /// messages says: ending the hold in time is the caller's duty.
    ///
    /// Every topic, or one topic named exactly, is taken as it is claimed: from the floors this
    /// store's claims and takes keep (see the migration `ready_takes`), so that a take walks no
    /// entry a pinned xmin horizon keeps of the rows settled before. The floors stop at the first
    /// row still available, so at the rows of the holds in flight: a hold that rolls back hides
    /// nothing.
    ///
    /// Other filters (exclusions, patterns) take from the front of (priority, id), after
    /// `after` when it is given: a relay whose holds are in flight passes where its last take
    /// ended, so that its take does not pay a lock check for each row its own holds have locked
    /// (and goes back to the front every few tens of milliseconds for rows that became available
    /// behind it).
    ///
    /// Up to `followers` messages in all are taken behind the ordered heads of the batch, shared
    /// between them (at least one each, at most 64): the next messages of each head's key, in
    /// order, as far as they are due and not locked by another transaction
    /// ([`Hold::followers`]). A key's messages are then delivered one after the other within the
    /// hold, each one's row locked and deleted like the head's: no promotion between them.
    pub async fn take(
        &self,
        batch: usize,
        limit: Duration,
        topics: &Topics,
        after: Option<TakePosition>,
        followers: usize,
    ) -> Result<Option<Hold>> {
        if batch == 0 || topics.is_empty() {
            return Ok(None);
        }
        self.finish_before_claim().await;
        let mut conn = self
            .pool
            .get_owned()
            .await
            .map_err(|e| Error::Pool(e.to_string()))?;
        let batch = i32::try_from(batch).unwrap_or(i32::MAX);
        let token = super::new_token();
        AnsiTransactionManager::begin_transaction_sql(&mut *conn, &begin_take(limit)).await?;
        let plain = topics.all && topics.not_exact.is_empty() && topics.not_like.is_empty();
        let single = topics.single();
        let (rows, last): (Vec<HeldRow>, Option<TakePosition>) = if plain || single.is_some() {
            // From the floors the store's claims and takes keep (see the migration
            // `ready_takes`), or after the position, in the floors' order.
            let which = single.map(str::to_owned);
            let floors = self.floors_of(&which);
            let after =
                after.and_then(|a| Some((i32::from(a.priority), a.ready?.to_string(), a.id)));
            let got: Vec<HeldReadyRow> = match (after, &which) {
                (Some((priority, ready, id)), None) => {
                    diesel::sql_query(TAKE_READY_AFTER)
                        .bind::<Double, _>(limit.as_secs_f64())
                        .bind::<BigInt, _>(token)
                        .bind::<Nullable<Text>, _>(&which)
                        .bind::<Integer, _>(batch)
                        .bind::<Integer, _>(priority)
                        .bind::<Text, _>(ready)
                        .bind::<BigInt, _>(id)
                        .load(&mut *conn)
                        .await?
                }
                (Some((priority, ready, id)), Some(topic)) => {
                    diesel::sql_query(TAKE_READY_AFTER_ONE)
                        .bind::<Double, _>(limit.as_secs_f64())
                        .bind::<BigInt, _>(token)
                        .bind::<Text, _>(topic)
                        .bind::<Integer, _>(batch)
                        .bind::<Integer, _>(priority)
                        .bind::<Text, _>(ready)
                        .bind::<BigInt, _>(id)
                        .load(&mut *conn)
                        .await?
                }
                (None, _) => {
                    diesel::sql_query(TAKE_READY)
                        .bind::<Double, _>(limit.as_secs_f64())
                        .bind::<BigInt, _>(token)
                        .bind::<Nullable<Text>, _>(&which)
                        .bind::<Integer, _>(batch)
                        .bind::<Nullable<Text>, _>(floors)
                        .load(&mut *conn)
                        .await?
                }
            };
            if let Some(newest) = got.iter().find_map(|r| r.floors.clone()) {
                self.keep_floors(which, newest);
            }
            let last = got
                .iter()
                .map(|r| TakePosition {
                    priority: r.held.message.priority,
                    ready: r.ready_xid.parse().ok(),
                    id: r.held.message.id,
                })
                .max();
            (got.into_iter().map(|r| r.held).collect(), last)
        } else if let (None, Some(named)) = (after, topics.named()) {
            // Up to 16 topics named exactly: from the floors of each (see the migration
            // `ready_sets`); the position it leaves is in (priority, id), for the takes after it
            // while its holds are in flight.
            let floors = self.floors_of_each(&named);
            let got: Vec<HeldSetRow> = if named.is_empty() {
                Vec::new()
            } else {
                diesel::sql_query(TAKE_SET)
                    .bind::<Double, _>(limit.as_secs_f64())
                    .bind::<BigInt, _>(token)
                    .bind::<Array<Text>, _>(&named)
                    .bind::<Integer, _>(batch)
                    .bind::<Array<Nullable<Text>>, _>(&floors)
                    .load(&mut *conn)
                    .await?
            };
            if let Some(newest) = got.iter().find_map(|r| r.floors.clone()) {
                self.keep_floors_of_each(&named, newest);
            }
            let last = got
                .iter()
                .map(|r| TakePosition::at(r.held.message.priority, r.held.message.id))
                .max();
            (got.into_iter().map(|r| r.held).collect(), last)
        } else if after.is_none() {
            // Patterns or exclusions: from the floors of the filter (see the migration
            // `filter_floors`); the position it leaves is in (priority, id), as above.
            let key = Some(topics.floors_key());
            let floors = self.floors_of(&key);
            let got: Vec<HeldMatchingRow> = diesel::sql_query(TAKE_MATCHING)
                .bind::<Double, _>(limit.as_secs_f64())
                .bind::<BigInt, _>(token)
                .bind::<Bool, _>(topics.all)
                .bind::<Array<Text>, _>(&topics.exact)
                .bind::<Array<Text>, _>(&topics.like)
                .bind::<Array<Text>, _>(&topics.not_exact)
                .bind::<Array<Text>, _>(&topics.not_like)
                .bind::<Integer, _>(batch)
                .bind::<Nullable<Text>, _>(floors)
                .load(&mut *conn)
                .await?;
            if let Some(newest) = got.iter().find_map(|r| r.floors.clone()) {
                self.keep_floors(key, newest);
            }
            let last = got
                .iter()
                .map(|r| TakePosition::at(r.held.message.priority, r.held.message.id))
                .max();
            (got.into_iter().map(|r| r.held).collect(), last)
        } else {
            let after = after.map(|a| (a.priority, a.id));
            let rows: Vec<HeldRow> = diesel::sql_query(TAKE)
                .bind::<Double, _>(limit.as_secs_f64())
                .bind::<BigInt, _>(token)
                .bind::<Integer, _>(batch)
                .bind::<Bool, _>(topics.all)
                .bind::<Array<Text>, _>(&topics.exact)
                .bind::<Array<Text>, _>(&topics.like)
                .bind::<Array<Text>, _>(&topics.not_exact)
                .bind::<Array<Text>, _>(&topics.not_like)
                .bind::<Nullable<SmallInt>, _>(after.map(|a| a.0))
                .bind::<Nullable<BigInt>, _>(after.map(|a| a.1))
                .load(&mut *conn)
                .await?;
            let last = rows
                .iter()
                .map(|r| TakePosition::at(r.message.priority, r.message.id))
                .max();
            (rows, last)
        };
        let Some(xid) = rows.as_slice().first().map(|r| r.xid.clone()) else {
            AnsiTransactionManager::commit_transaction(&mut *conn).await?;
            return Ok(None);
        };
        let mut messages: Vec<ClaimedMessage> = rows.into_iter().map(|r| r.message).collect();
        messages.sort_unstable_by_key(|m| (m.priority, m.id));
        let heads: Vec<&ClaimedMessage> = messages
            .iter()
            .filter(|m| m.ordered && m.key.is_some())
            .collect();
        let (followers, followers_capped) = if followers == 0 || heads.is_empty() {
            (Vec::new(), false)
        } else {
            let each = (followers / heads.len()).clamp(1, MAX_FOLLOWERS);
            let topics: Vec<&str> = heads.iter().map(|m| m.topic.as_str()).collect();
            let keys: Vec<&str> = heads.iter().filter_map(|m| m.key.as_deref()).collect();
            let ids: Vec<i64> = heads.iter().map(|m| m.id).collect();
            let rows: Vec<FollowerRow> = diesel::sql_query(FOLLOWERS)
                .bind::<Double, _>(limit.as_secs_f64())
                .bind::<BigInt, _>(token)
                .bind::<Array<Text>, _>(&topics)
                .bind::<Array<Text>, _>(&keys)
                .bind::<Array<BigInt>, _>(&ids)
                .bind::<Integer, _>(i32::try_from(each).unwrap_or(i32::MAX))
                .load(&mut *conn)
                .await?;
            let followers = chains(rows);
            let capped = followers
                .chunk_by(|a, b| (&a.topic, &a.key) == (&b.topic, &b.key))
                .any(|c| c.len() >= each);
            (followers, capped)
        };
        let keys = messages
            .iter()
            .chain(&followers)
            .filter(|m| m.ordered)
            .filter_map(|m| Some((m.id, m.topic.clone(), m.key.clone()?)))
            .collect();
        Ok(Some(Hold {
            conn,
            xid,
            token,
            limit,
            ids: messages.iter().chain(&followers).map(|m| m.id).collect(),
            keys,
            messages,
            followers,
            followers_capped,
            last,
        }))
    }

    /// Registers `hold` (committed, on another connection of the pool), so that its attempt is
    /// counted if its transaction never commits. Dropping the hold after an error is safe: nothing
    /// was delivered.
    pub async fn register_hold(&self, hold: &Hold) -> Result<()> {
        diesel::sql_query(REGISTER)
            .bind::<Text, _>(&hold.xid)
            .bind::<Array<BigInt>, _>(&hold.ids)
            .bind::<Text, _>(&*self.owner)
            .bind::<Double, _>(hold.limit.as_secs_f64())
            .bind::<BigInt, _>(hold.token)
            .execute(&mut *self.conn().await?)
            .await?;
        Ok(())
    }

    /// Ends `hold` and commits: `delivered` are deleted, `rest` are leased to the caller for
    /// `lease` (token: the hold's, as its messages carry it), the registration goes. Delivered
    /// heads of ordered keys hand up to `take` next messages of their keys over to the caller
    /// (leased for `lease`, returned; see [`Store::complete_and_take`]). If this fails, the
    /// transaction is rolled back: every message of the hold is claimable again, and
    /// [`Store::lost_holds`] counts the attempt.
    pub async fn end_hold(
        &self,
        mut hold: Hold,
        delivered: &[MessageId],
        rest: &[MessageId],
        lease: Duration,
        take: usize,
    ) -> Result<(HoldEnded, Vec<ClaimedMessage>)> {
        let after = last_delivered(&hold.keys, delivered, rest);
        let conn = &mut *hold.conn;
        let take = i32::try_from(take).unwrap_or(i32::MAX);
        let query = |sql| {
            diesel::sql_query(sql)
                .bind::<Array<BigInt>, _>(delivered)
                .bind::<Array<BigInt>, _>(rest)
                .bind::<Double, _>(lease.as_secs_f64())
                .bind::<BigInt, _>(hold.token)
                .bind::<Text, _>(&*self.owner)
                .bind::<Integer, _>(take)
                .bind::<Array<BigInt>, _>(&after)
        };
        let rows: Vec<SettleRow> = match &self.archive {
            None => query(SETTLE).load(conn).await?,
            Some(sink) => {
                query(SETTLE_KEEP)
                    .bind::<Text, _>(&**sink)
                    .load(conn)
                    .await?
            }
        };
        let mut summary = (0, 0, false);
        let mut kept = 0;
        let mut handed = Vec::new();
        for row in rows {
            match (row.deleted, row.leased, row.unregistered) {
                (Some(d), Some(l), Some(u)) => {
                    summary = (d, l, u);
                    kept = row.kept.unwrap_or(0);
                }
                _ => handed.push(row.message),
            }
        }
        handed.sort_unstable_by_key(|m| (m.priority, m.id));
        let (deleted, leased, unregistered) = summary;
        if !unregistered {
            // Not registered (or registered twice): roll back rather than commit a hold whose
            // loss could not have been counted. Dropping the connection does it.
            return Err(Error::InvalidArgument {
                field: "hold",
                problem: format!("hold {} was not registered; rolled back", hold.xid),
            });
        }
        AnsiTransactionManager::commit_transaction(conn).await?;
        self.note_kept(kept);
        Ok((
            HoldEnded {
                deleted: deleted as usize,
                leased: leased as usize,
            },
            handed,
        ))
    }

    /// Holds whose transaction ended without a commit (see the module): their messages that are
    /// still claimable get an expired lease with the attempt counted, for
    /// [`Store::rescue_expired`] to retry or dead-letter. Returns how many. Safe on every replica
    /// at once.
    pub async fn lost_holds(&self) -> Result<usize> {
        #[derive(QueryableByName)]
        struct N {
            #[diesel(sql_type = Integer)]
            n: i32,
        }
        let mut conn = self.conn().await?;
        let r: N = diesel::sql_query("SELECT postbox.lost_holds() AS n")
            .get_result(&mut conn)
            .await?;
        Ok(r.n as usize)
    }
}

/// The followers of each chain up to its first gap (a follower not due, or locked elsewhere), in
/// the order of the chains.
fn chains(mut rows: Vec<FollowerRow>) -> Vec<ClaimedMessage> {
    rows.sort_unstable_by_key(|r| (r.chain, r.place));
    let mut out = Vec::with_capacity(rows.len());
    let mut chain = (0, 0);
    for r in rows {
        if r.chain != chain.0 {
            chain = (r.chain, 0);
        }
        if r.place == chain.1 + 1 {
            chain.1 = r.place;
            out.push(r.message);
        }
    }
    out
}

/// For each ordered key of a hold with messages in `delivered` and none in `rest` (its head is no
/// longer in the hold), the last of its delivered messages: the next message of the key goes
/// after it.
fn last_delivered(
    keys: &[(MessageId, String, String)],
    delivered: &[MessageId],
    rest: &[MessageId],
) -> Vec<MessageId> {
    use std::collections::{HashMap, HashSet};
    let delivered: HashSet<MessageId> = delivered.iter().copied().collect();
    let rest: HashSet<MessageId> = rest.iter().copied().collect();
    // Per key: the last delivered id, and whether one of its messages is leased.
    let mut by_key: HashMap<(&str, &str), (Option<MessageId>, bool)> = HashMap::new();
    for (id, topic, key) in keys {
        let e = by_key.entry((topic, key)).or_default();
        if delivered.contains(id) {
            e.0 = e.0.max(Some(*id));
        }
        e.1 |= rest.contains(id);
    }
    by_key
        .into_values()
        .filter(|(_, leased)| !leased)
        .filter_map(|(last, _)| last)
        .collect()
}
