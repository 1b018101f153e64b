//! Where an ordered message stands in its key, for an operator (the console's message page): the
//! key's head, and how many of the key's messages are ahead of it. Two index descents
//! (`messages_heads_idx`, `messages_waiting_idx`), the count capped, whatever the key's length.

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Nullable};
use diesel_async::RunQueryDsl;

use super::Store;
use crate::error::Result;
use crate::message::MessageId;

/// Messages ahead of one are counted up to this many; above, [`KeyPosition::ahead`] says "at least".
pub const AHEAD_MAX: i64 = 10_000;

/// An ordered message's place in its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, QueryableByName, serde::Serialize)]
pub struct KeyPosition {
    /// The key's head (the one message of the key that may be claimed or is running); `None`
    /// while the key has none (a head being promoted, or the key's messages are all scheduled).
    #[diesel(sql_type = Nullable<BigInt>)]
    pub head: Option<i64>,
    /// Messages of the key before this one: the head (for a waiting message) and the waiting ones
    /// with a lower id (at most [`AHEAD_MAX`]; see `capped`); 0 for the head itself.
    #[diesel(sql_type = BigInt)]
    pub ahead: i64,
    /// True when more than [`AHEAD_MAX`] are ahead.
    #[diesel(sql_type = diesel::sql_types::Bool)]
    pub capped: bool,
}

/// $1 the message, $2 the cap. Nothing for a message that is not queued, unordered, or has no
/// key. The head is the key's one message that is not waiting, whatever its id (a replayed older
/// message waits behind a newer head); the waiting ones go in id order after it.
const POSITION: &str = r#"
SELECT h.id AS head,
       least(a.n, $2) AS ahead,
       a.n > $2 AS capped
FROM postbox.messages m
LEFT JOIN LATERAL (SELECT h.id FROM postbox.messages h
                   WHERE h.topic = m.topic AND h.key = m.key AND h.ordered AND h.state <> 'waiting'
                   ORDER BY h.id LIMIT 1) h ON true,
LATERAL (SELECT CASE WHEN m.state <> 'waiting' THEN 0
                     ELSE (h.id IS NOT NULL)::int + (
                         SELECT count(*) FROM (
                             SELECT 1 FROM postbox.messages w
                             WHERE w.topic = m.topic AND w.key = m.key AND w.state = 'waiting'
                               AND w.id < m.id
                             LIMIT $2 + 1) c)
                END::bigint AS n) a
WHERE m.id = $1 AND m.ordered AND m.key IS NOT NULL
"#;

impl Store {
    /// Where ordered message `id` stands in its key; `None` when it is not queued, not ordered or
    /// has no key.
    pub async fn key_position(&self, id: MessageId) -> Result<Option<KeyPosition>> {
        let mut conn = self.conn().await?;
        let rows: Vec<KeyPosition> = diesel::sql_query(POSITION)
            .bind::<BigInt, _>(id)
            .bind::<BigInt, _>(AHEAD_MAX)
            .load(&mut conn)
            .await?;
        Ok(rows.into_iter().next())
    }

    /// Enqueues one message on a connection of the pool (as [`crate::enqueue_async`] does in the
    /// caller's transaction).
    pub async fn enqueue(&self, msg: &crate::Message) -> Result<crate::Enqueued> {
        let mut conn = self.conn().await?;
        crate::enqueue_async(&mut conn, msg).await
    }
}
