//! The dead letters: list, replay, purge.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{Array, BigInt, Bool, Double, Nullable, Text};
use diesel_async::RunQueryDsl;

use super::Store;
use super::lenient::{LenientJson, LenientOptText, LenientText};
use crate::error::Result;
use crate::message::MessageId;
use crate::schema::postbox::dead_letters;

/// A message that failed for good, with everything needed to debug and replay it.
#[derive(Debug, Clone, PartialEq, Queryable, Selectable, serde::Serialize)]
#[diesel(table_name = dead_letters, check_for_backend(diesel::pg::Pg))]
pub struct DeadLetter {
    /// Its id while it was live; a replay gives it back.
    pub id: MessageId,
    /// Its topic.
    #[diesel(deserialize_as = LenientText)]
    pub topic: String,
    /// Its key, if any.
    #[diesel(deserialize_as = LenientOptText)]
    pub key: Option<String>,
    /// Whether it was an ordered message (a replay puts it back in its key's order).
    pub ordered: bool,
    /// A payload this process cannot parse (nested deeper than serde_json's 128 levels) is given
    /// as its JSON text, a string; replay moves the stored value itself.
    #[diesel(deserialize_as = LenientJson)]
    pub payload: serde_json::Value,
    /// Its headers.
    #[diesel(deserialize_as = LenientJson)]
    pub headers: serde_json::Value,
    /// Its priority.
    pub priority: i16,
    /// Attempts it used.
    pub attempts: i32,
    /// Attempts it was allowed.
    pub max_attempts: i32,
    /// When it was enqueued.
    pub created_at: DateTime<Utc>,
    /// Its dedup key, if any.
    #[diesel(deserialize_as = LenientOptText)]
    pub dedup_key: Option<String>,
    /// The error of its first failed attempt.
    #[diesel(deserialize_as = LenientOptText)]
    pub first_error: Option<String>,
    /// The error of its last failed attempt.
    #[diesel(deserialize_as = LenientOptText)]
    pub last_error: Option<String>,
    /// Why it died: the permanent error, or attempts exhausted with the last error.
    #[diesel(deserialize_as = LenientText)]
    pub reason: String,
    /// When it was dead-lettered.
    pub dead_at: DateTime<Utc>,
}

/// Which dead letters an operation applies to.
#[derive(Debug, Clone, PartialEq)]
pub enum DeadSelector {
    /// These ids.
    Ids(Vec<MessageId>),
    /// Every dead letter of this topic.
    Topic(String),
    /// Dead for longer than this (purge only makes sense with it, but replay accepts it too).
    OlderThan(Duration),
    /// All of them.
    All,
}

/// What a replay did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplayReport {
    /// Back in `postbox.messages` with their original ids, attempts reset, claimable now.
    pub replayed: Vec<MessageId>,
    /// Still dead: a live message of the same topic holds their dedup key, or they are ordered
    /// and a later message of their key is running now (they cannot go back in front of it), or
    /// another replay of the same id won the race. Replay them once that is over.
    pub skipped: Vec<MessageId>,
}

#[derive(QueryableByName)]
struct IdRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// Selector binds: $1 all, $2 ids, $3 topic, $4 older-than seconds.
const SELECTED: &str =
    "($1 OR d.id = ANY($2) OR d.topic = $3 OR d.dead_at < now() - make_interval(secs => $4))";

fn replay_sql() -> String {
    format!(
        r#"
WITH chosen AS (
    SELECT * FROM postbox.dead_letters d WHERE {SELECTED} ORDER BY d.id FOR UPDATE
),
revived AS (
    INSERT INTO postbox.messages
        (id, topic, key, ordered, payload, headers, priority, max_attempts, created_at, dedup_key,
         first_error, last_error)
    OVERRIDING SYSTEM VALUE
    SELECT id, topic, key, ordered, payload, headers, priority, max_attempts, created_at, dedup_key,
           first_error, 'replayed after: ' || reason
    FROM chosen
    ORDER BY id
    ON CONFLICT DO NOTHING
    RETURNING id
)
DELETE FROM postbox.dead_letters d USING revived r WHERE d.id = r.id RETURNING d.id
"#
    )
}

fn purge_sql() -> String {
    format!("DELETE FROM postbox.dead_letters d WHERE {SELECTED} RETURNING d.id")
}

fn chosen_sql() -> String {
    format!("SELECT d.id FROM postbox.dead_letters d WHERE {SELECTED}")
}

/// Takes the writer locks of the ordered keys about to be replayed, in one sorted order (the
/// insert trigger takes them again, at no cost), and tells that trigger to keep the ids.
fn lock_replayed_keys_sql() -> String {
    format!(
        "SELECT set_config('postbox.keep_ids', 'on', true) AS keep,
                postbox.lock_keys(coalesce(array_agg(d.topic), '{{}}'), coalesce(array_agg(d.key), '{{}}')) AS locked
         FROM postbox.dead_letters d WHERE {SELECTED} AND d.ordered"
    )
}

macro_rules! bind_selector {
    ($query:expr, $sel:expr) => {{
        let (all, ids, topic, older) = match $sel {
            DeadSelector::Ids(ids) => (false, ids.clone(), None, None),
            DeadSelector::Topic(t) => (false, Vec::new(), Some(t.clone()), None),
            DeadSelector::OlderThan(d) => (false, Vec::new(), None, Some(d.as_secs_f64())),
            DeadSelector::All => (true, Vec::new(), None, None),
        };
        $query
            .bind::<Bool, _>(all)
            .bind::<Array<BigInt>, _>(ids)
            .bind::<Nullable<Text>, _>(topic)
            .bind::<Nullable<Double>, _>(older)
    }};
}

impl Store {
    /// Dead letters, oldest id first, optionally of one topic, at most `limit`.
    pub async fn dead_list(&self, topic: Option<&str>, limit: i64) -> Result<Vec<DeadLetter>> {
        let mut conn = self.conn().await?;
        let mut q = dead_letters::table
            .select(DeadLetter::as_select())
            .order(dead_letters::id)
            .limit(limit)
            .into_boxed();
        if let Some(t) = topic {
            q = q.filter(dead_letters::topic.eq(t.to_owned()));
        }
        Ok(q.load(&mut conn).await?)
    }

    /// Puts dead letters back into the queue with their original ids, attempts reset to 0 and
    /// claimable now. An ordered message keeps its place: it is the head of its key again, before
    /// any later message of that key that has not started (if one is running, the replay skips
    /// the message: replay it again once that one is settled).
    pub async fn dead_replay(&self, selector: &DeadSelector) -> Result<ReplayReport> {
        let mut conn = self.conn().await?;
        let sql = replay_sql();
        let chosen_q = chosen_sql();
        let lock_q = lock_replayed_keys_sql();
        use diesel_async::AsyncConnection;
        let (chosen, replayed) = conn
            .transaction(async |conn| {
                let chosen: Vec<IdRow> = bind_selector!(diesel::sql_query(&chosen_q), selector)
                    .load(conn)
                    .await?;
                bind_selector!(diesel::sql_query(&lock_q), selector)
                    .execute(conn)
                    .await?;
                let replayed: Vec<IdRow> = bind_selector!(diesel::sql_query(&sql), selector)
                    .load(conn)
                    .await?;
                Ok::<_, diesel::result::Error>((chosen, replayed))
            })
            .await?;
        let replayed: Vec<i64> = replayed.into_iter().map(|r| r.id).collect();
        let chosen: Vec<i64> = chosen.into_iter().map(|r| r.id).collect();
        Ok(ReplayReport {
            skipped: super::fenced(&chosen, &replayed),
            replayed,
        })
    }

    /// Deletes dead letters for good; returns how many.
    pub async fn dead_purge(&self, selector: &DeadSelector) -> Result<usize> {
        let mut conn = self.conn().await?;
        let rows: Vec<IdRow> = bind_selector!(diesel::sql_query(purge_sql()), selector)
            .load(&mut conn)
            .await?;
        Ok(rows.len())
    }
}
