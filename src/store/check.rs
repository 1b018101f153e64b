//! The invariants of the state model (the book, "Message life cycle"), checked and repaired: every ordered key with
//! waiting messages has exactly one head; no hold is kept open past its limit.

use diesel::QueryableByName;
use diesel::sql_types::{Array, Integer, Nullable, Text};
use diesel_async::{AsyncConnection, RunQueryDsl, SimpleAsyncConnection};
use serde::Serialize;

use super::Store;
use crate::error::Result;

/// The kinds of violation [`Store::check`] reports, in the order it reports them.
pub const VIOLATION_KINDS: [&str; 3] = ["stranded_key", "double_head", "hold_over_limit"];

/// Something the state model forbids, found by [`Store::check`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, QueryableByName)]
pub struct Violation {
    /// `stranded_key` (waiting messages, no head: nothing would take them), `double_head` (more
    /// than one message of an ordered key deliverable at once), `hold_over_limit` (a held batch
    /// open past its hold limit).
    #[diesel(sql_type = Text)]
    pub kind: String,
    /// The topic, for a key's violation.
    #[diesel(sql_type = Nullable<Text>)]
    pub topic: Option<String>,
    /// The key, for a key's violation.
    #[diesel(sql_type = Nullable<Text>)]
    pub key: Option<String>,
    /// What was found (ids, states, the hold's owner).
    #[diesel(sql_type = Text)]
    pub detail: String,
}

/// A key [`Store::repair`] gave a head again.
#[derive(Debug, Clone, PartialEq, Eq, QueryableByName)]
pub struct RepairedKey {
    /// The key's topic.
    #[diesel(sql_type = Text)]
    pub topic: String,
    /// The key.
    #[diesel(sql_type = Text)]
    pub key: String,
}

const CHECK: &str =
    "SELECT kind, topic, key, detail FROM postbox.check_invariants($1) ORDER BY kind, topic, key";

const STRANDED: &str = "SELECT topic, key FROM postbox.stranded_keys($1)";

/// Marks of replayed messages that no longer wait (cancelled while waiting, in a key that had no
/// promotion since): the next promotion of the key would drop them; the rescuer does meanwhile.
const STALE_MARKS: &str = "DELETE FROM postbox.behind b WHERE NOT EXISTS
    (SELECT 1 FROM postbox.messages m WHERE m.id = b.id AND m.state = 'waiting')";

/// The promotion of keys without a head: a key that has a head by now is left alone.
const PROMOTE: &str = "SELECT count(*) FROM postbox.promote_keys($1, $2, NULL, true, 0, 1, 0, '')";

impl Store {
    /// Everything the state model forbids, up to `limit` of each kind (see [`Violation`]). The
    /// keys are found with one index probe per key with waiting messages, not one per message.
    pub async fn check(&self, limit: u32) -> Result<Vec<Violation>> {
        let mut conn = self.conn().await?;
        Ok(diesel::sql_query(CHECK)
            .bind::<Integer, _>(i32::try_from(limit).unwrap_or(i32::MAX))
            .load(&mut conn)
            .await?)
    }

    /// Gives up to `limit` stranded keys (waiting messages, no head) their head again: their first
    /// waiting message. Defence in depth: no path of the model strands a key, but an operator's
    /// SQL can. Safe beside other relays and writers (it promotes as a writer's commit does).
    pub async fn repair(&self, limit: u32) -> Result<Vec<RepairedKey>> {
        let mut conn = self.conn().await?;
        let limit = i32::try_from(limit).unwrap_or(i32::MAX);
        let keys = conn
            .transaction(async |conn| {
                diesel::sql_query(STALE_MARKS).execute(conn).await?;
                let keys: Vec<RepairedKey> = diesel::sql_query(STRANDED)
                    .bind::<Integer, _>(limit)
                    .load(conn)
                    .await?;
                if !keys.is_empty() {
                    let topics: Vec<&str> = keys.iter().map(|k| k.topic.as_str()).collect();
                    let names: Vec<&str> = keys.iter().map(|k| k.key.as_str()).collect();
                    diesel::sql_query(PROMOTE)
                        .bind::<Array<Text>, _>(&topics)
                        .bind::<Array<Text>, _>(&names)
                        .execute(conn)
                        .await?;
                    conn.batch_execute("SELECT postbox.wake()").await?;
                }
                Ok::<_, diesel::result::Error>(keys)
            })
            .await?;
        Ok(keys)
    }
}
