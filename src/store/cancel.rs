//! Cancelling messages: those not running go to the dead letters with reason `cancelled` (they can
//! be replayed like any dead letter); a running one finishes its current attempt and, should that
//! fail or its lease expire, is dead-lettered the same way instead of retried.

use diesel::QueryableByName;
use diesel::sql_types::{Array, BigInt, Nullable, Text};
use diesel_async::{AsyncConnection, RunQueryDsl};

use super::Store;
use crate::error::{Error, Result};
use crate::message::MessageId;

/// Which messages to cancel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CancelSelector {
    /// These ids.
    Ids(Vec<MessageId>),
    /// Every live message of this topic.
    Topic(String),
}

/// What a cancel did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cancelled {
    /// Moved to the dead letters (pending, scheduled or waiting).
    pub dead: usize,
    /// Running: they finish their current attempt and are not retried.
    pub running: usize,
}

/// The messages chosen, locked (a held batch that has them is waited for: at most its hold
/// limit; a writer's pin on a head is not: see the migration `head_pins`). Heads first, then the
/// waiting messages: a held batch whose end promotes the next message of its key must not find it
/// locked by a cancel that waits for the batch's head (a deadlock).
const CHOOSE: &str = "SELECT id FROM postbox.messages
WHERE id = ANY($1::bigint[]) OR ($2::text IS NOT NULL AND topic = $2)
ORDER BY state = 'waiting', id FOR NO KEY UPDATE";

/// What writers committed to the intake and no relay has moved yet: straight to the dead letters
/// (a move racing this waits for it, then finds the row gone; a row it moved first is in
/// `postbox.messages` for [`CHOOSE`], a later statement).
const BURY_INTAKE: &str = "WITH chosen AS (
    -- Locked in the move's order, (xid, id): a cancel and a move never wait for each other in a
    -- cycle.
    SELECT xid, id FROM postbox.intake
    WHERE id = ANY($1::bigint[]) OR ($2::text IS NOT NULL AND topic = $2)
    ORDER BY xid, id FOR UPDATE
), gone AS (
    DELETE FROM postbox.intake t USING chosen c WHERE t.xid = c.xid AND t.id = c.id
    RETURNING t.*
), buried AS (
    INSERT INTO postbox.dead_letters (id, topic, key, ordered, payload, headers, priority, attempts,
        max_attempts, created_at, reason)
    SELECT id, topic, key, false, payload, headers, priority, 0, max_attempts, created_at, 'cancelled'
    FROM gone
    RETURNING id
)
SELECT id FROM buried";

/// Whether the intake holds any of them.
const IN_INTAKE: &str = "SELECT id FROM postbox.intake
WHERE id = ANY($1::bigint[]) OR ($2::text IS NOT NULL AND topic = $2) LIMIT 1";

/// Those not running, to the dead letters; their ordered keys for the promotion: after each head
/// taken out (not kept for a writer of its key), and of a key whose waiting messages were taken
/// while its head was gone (a held batch's end that met this cancel's lock on its next message
/// left the key to it: `ids` NULL, promoted if it has no head).
const BURY: &str = concat!(
    "WITH ",
    take_out_cte!(
        "gone",
        "ARRAY(SELECT id FROM postbox.messages WHERE id = ANY($1::bigint[]) AND state <> 'running' ORDER BY id)",
        "NULL::bigint[]"
    ),
    ",
buried AS (
    INSERT INTO postbox.dead_letters (id, topic, key, ordered, payload, headers, priority, attempts,
        max_attempts, created_at, dedup_key, first_error, last_error, reason)
    SELECT id, topic, key, ordered, payload, headers, priority, attempts, max_attempts, created_at,
        dedup_key, first_error, last_error, 'cancelled'
    FROM gone
    RETURNING id
)
SELECT (SELECT count(*) FROM buried) AS n, count(*) FILTER (WHERE kept) AS kept,
       array_agg(topic) FILTER (WHERE ordered AND NOT kept) AS topics,
       array_agg(key) FILTER (WHERE ordered AND NOT kept) AS keys,
       array_agg(CASE WHEN state <> 'waiting' THEN id END) FILTER (WHERE ordered AND NOT kept) AS ids
FROM gone"
);

const PROMOTE: &str = "SELECT postbox.promote_after($1, $2, $3) AS n";

/// (Not a head kept for a writer of its key: it is delivered.)
const MARK_RUNNING: &str = "UPDATE postbox.messages SET cancelled = true
WHERE id = ANY($1::bigint[]) AND state = 'running' AND lease_token <> 0 RETURNING id";

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

#[derive(QueryableByName)]
struct Buried {
    #[diesel(sql_type = BigInt)]
    n: i64,
    #[diesel(sql_type = BigInt)]
    kept: i64,
    #[diesel(sql_type = Nullable<Array<Text>>)]
    topics: Option<Vec<String>>,
    #[diesel(sql_type = Nullable<Array<Text>>)]
    keys: Option<Vec<String>>,
    #[diesel(sql_type = Nullable<Array<Nullable<BigInt>>>)]
    ids: Option<Vec<Option<i64>>>,
}

#[derive(QueryableByName)]
struct N {
    #[diesel(sql_type = diesel::sql_types::Integer)]
    #[allow(dead_code)]
    n: i32,
}

impl Store {
    /// Cancels messages (see the module): in one transaction, those not running move to the dead
    /// letters with reason `cancelled` (the next message of an ordered key whose head went is
    /// promoted), the running ones are marked so that they are not retried.
    pub async fn cancel(&self, selector: &CancelSelector) -> Result<Cancelled> {
        let (ids, topic): (&[i64], Option<&str>) = match selector {
            CancelSelector::Ids(ids) if !ids.is_empty() => (ids, None),
            CancelSelector::Topic(t) if !t.is_empty() => (&[], Some(t)),
            _ => {
                return Err(Error::InvalidArgument {
                    field: "cancel",
                    problem: "name the ids or the topic to cancel".into(),
                });
            }
        };
        let mut conn = self.conn().await?;
        let (dead, running) = conn
            .transaction(async |conn| {
                // Looked for first: the burial is an insert into the dead letters, whose
                // statement triggers would fire for nothing.
                let in_intake = !diesel::sql_query(IN_INTAKE)
                    .bind::<Array<BigInt>, _>(ids)
                    .bind::<Nullable<Text>, _>(topic)
                    .load::<Id>(conn)
                    .await?
                    .is_empty();
                let intake = if in_intake {
                    diesel::sql_query(BURY_INTAKE)
                        .bind::<Array<BigInt>, _>(ids)
                        .bind::<Nullable<Text>, _>(topic)
                        .load::<Id>(conn)
                        .await?
                        .len()
                } else {
                    0
                };
                let chosen: Vec<i64> = diesel::sql_query(CHOOSE)
                    .bind::<Array<BigInt>, _>(ids)
                    .bind::<Nullable<Text>, _>(topic)
                    .load::<Id>(conn)
                    .await?
                    .into_iter()
                    .map(|r| r.id)
                    .collect();
                let buried: Buried = diesel::sql_query(BURY)
                    .bind::<Array<BigInt>, _>(&chosen)
                    .get_result(conn)
                    .await?;
                self.note_kept(buried.kept);
                if let (Some(t), Some(k), Some(i)) = (buried.topics, buried.keys, buried.ids) {
                    diesel::sql_query(PROMOTE)
                        .bind::<Array<Text>, _>(t)
                        .bind::<Array<Text>, _>(k)
                        .bind::<Array<Nullable<BigInt>>, _>(i)
                        .get_result::<N>(conn)
                        .await?;
                }
                let running = diesel::sql_query(MARK_RUNNING)
                    .bind::<Array<BigInt>, _>(&chosen)
                    .load::<Id>(conn)
                    .await?
                    .len();
                Ok::<_, diesel::result::Error>((intake + buried.n as usize, running))
            })
            .await?;
        Ok(Cancelled { dead, running })
    }
}
