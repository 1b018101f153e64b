//! Writing messages inside the caller's own transaction, on the caller's own connection.
//!
//! The same queries are built once and run either on a sync [`PgConnection`] or on an async
//! `AsyncPgConnection`. One message is a cached prepared `INSERT ... VALUES`; a batch is one
//! `INSERT ... SELECT FROM unnest(arrays) ... ON CONFLICT DO NOTHING RETURNING` statement (one
//! round trip for up to [`ROWS_PER_STATEMENT`] messages, nine bind parameters whatever their
//! number); a second query runs only when some dedup key matched a live message, to say which one.
//!
//! The routing of unordered messages without a dedup key to `postbox.intake` (migration
//! `intake`: a table with a primary key and nothing else on the writer's path, which the relays
//! move into `postbox.messages` in bulk) is built and off (`ROUTE_TO_INTAKE`). Ordered messages
//! and messages with a dedup key are decided at the writer's commit (a key's order, a duplicate)
//! and are always written to `postbox.messages` directly.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use diesel::PgConnection;
use diesel::{ExpressionMethods, QueryDsl};

use crate::error::Result;
use crate::message::{DEFAULT_MAX_ATTEMPTS, Message, MessageId};
use crate::schema::postbox::{intake, messages};

/// Rows per INSERT statement (the arrays of one statement are built and sent whole).
pub const ROWS_PER_STATEMENT: usize = 5_000;

/// What `enqueue` did with one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enqueued {
    /// A new message with this id.
    New(MessageId),
    /// Nothing was written: a live message of the same topic holds the dedup key. `existing` is
    /// its id, or `None` if it was delivered in the instant between the insert and the lookup.
    Duplicate {
        /// The live message that holds the dedup key.
        existing: Option<MessageId>,
    },
}

impl Enqueued {
    /// The id of the new message, or of the live duplicate it matched.
    pub fn id(&self) -> Option<MessageId> {
        match *self {
            Enqueued::New(id) => Some(id),
            Enqueued::Duplicate { existing } => existing,
        }
    }
}

/// One message, validated, as bound into the INSERT.
struct NewMessage<'a> {
    topic: &'a str,
    key: Option<&'a str>,
    ordered: bool,
    payload: &'a serde_json::Value,
    headers: serde_json::Value,
    priority: i16,
    run_at: Option<DateTime<Utc>>,
    max_attempts: i32,
    dedup_key: Option<&'a str>,
}

/// Whether `enqueue` writes unordered messages without a dedup key to the intake. Off: with it
/// on, the app's transaction rate reached 0.86–0.88 of the bare insert (`bench --only write`,
/// against 0.70–0.75 direct), but the e2e p99 of a steady 800 msg/s flow rose from 5.9 ms to
/// 72–81 ms (`bench --only xmin`, its clean minutes), for a cause not found yet (not the
/// scheduler's move, not the movers' try-lock). Until it is, the intake is for plain-SQL writers
/// that choose it, and every store moves it.
const ROUTE_TO_INTAKE: bool = false;

impl NewMessage<'_> {
    /// Whether the message goes to the intake: routing on, and nothing about it decided at the
    /// writer's commit (no key order, no dedup key).
    fn to_intake(&self) -> bool {
        ROUTE_TO_INTAKE && !self.ordered && self.dedup_key.is_none()
    }
}

type Returned = (MessageId, String, Option<String>);

diesel::define_sql_function! {
    /// `coalesce` for the optional run_at: the database clock when the message names no time.
    fn coalesce(x: diesel::sql_types::Nullable<diesel::sql_types::Timestamptz>, y: diesel::sql_types::Timestamptz) -> diesel::sql_types::Timestamptz;
}

diesel::define_sql_function! {
    /// Takes the writer locks of ordered keys in one sorted order (see the state-model migration):
    /// a batch never waits for another batch in a cycle, and id order is commit order per key.
    #[sql_name = "postbox.lock_keys"]
    fn lock_keys(topics: diesel::sql_types::Array<diesel::sql_types::Text>, keys: diesel::sql_types::Array<diesel::sql_types::Text>) -> diesel::sql_types::BigInt;
}

/// The (topic, key) of every ordered message, for [`lock_keys`]; `None` when they name one key
/// and no dedup key comes before the first of them. One key needs no sorted order: the insert
/// trigger takes its writer lock before it draws the id, and a separate `lock_keys` round trip
/// cost an ordered enqueue about a fifth of the app's transaction rate (`bench --only write`).
/// But a row with a dedup key inserted before that lock holds the dedup key while it waits for
/// the key's writer, who may be about to insert the same dedup key: such a batch locks first.
fn ordered_keys<'a>(rows: &[NewMessage<'a>]) -> Option<(Vec<&'a str>, Vec<&'a str>)> {
    let pairs: Vec<(&str, &str)> = rows
        .iter()
        .filter(|r| r.ordered)
        .filter_map(|r| Some((r.topic, r.key?)))
        .collect();
    let first = *pairs.first()?;
    let one_key = pairs.iter().all(|p| *p == first);
    let dedup_before = rows
        .iter()
        .take_while(|r| !r.ordered)
        .any(|r| r.dedup_key.is_some());
    (!one_key || dedup_before).then(|| pairs.into_iter().unzip())
}

diesel::define_sql_function! {
    /// `now()` as timestamptz.
    #[sql_name = "now"]
    fn db_now() -> diesel::sql_types::Timestamptz;
}

fn rows(msgs: &[Message]) -> Result<Vec<NewMessage<'_>>> {
    let now = Utc::now();
    msgs.iter()
        .map(|m| {
            m.validate()?;
            let (Ok(payload), Ok(headers)) = (&m.payload, &m.headers) else {
                unreachable!("validate() accepted the message");
            };
            let run_at = m.resolved_run_at(now)?;
            Ok(NewMessage {
                topic: &m.topic,
                key: m.key.as_deref(),
                ordered: m.ordered,
                payload,
                headers: headers_json(headers),
                priority: m.priority,
                run_at,
                max_attempts: m.max_attempts.unwrap_or(DEFAULT_MAX_ATTEMPTS),
                dedup_key: m.dedup_key.as_deref(),
            })
        })
        .collect()
}

/// The headers as stored; with feature `otel`, the current trace context added (see `otel`).
pub(crate) fn headers_json(
    headers: &std::collections::BTreeMap<String, String>,
) -> serde_json::Value {
    #[cfg(feature = "otel")]
    {
        let mut headers = headers.clone();
        crate::otel::inject(&mut headers);
        serde_json::to_value(headers).expect("string map is JSON")
    }
    #[cfg(not(feature = "otel"))]
    serde_json::to_value(headers).expect("string map is JSON")
}

/// Every column is a bind parameter (no `DEFAULT`), so a one-message insert is one prepared
/// statement that the connection caches; `run_at` falls back to the database clock.
macro_rules! row_values {
    ($r:expr) => {
        (
            messages::topic.eq($r.topic),
            messages::key.eq($r.key),
            messages::ordered.eq($r.ordered),
            messages::payload.eq($r.payload),
            messages::headers.eq(&$r.headers),
            messages::priority.eq($r.priority),
            messages::run_at.eq(coalesce($r.run_at, db_now())),
            messages::max_attempts.eq($r.max_attempts),
            messages::dedup_key.eq($r.dedup_key),
        )
    };
}

/// [`row_values`] for `postbox.intake` (no order, no dedup key).
macro_rules! intake_values {
    ($r:expr) => {
        (
            intake::topic.eq($r.topic),
            intake::key.eq($r.key),
            intake::payload.eq($r.payload),
            intake::headers.eq(&$r.headers),
            intake::priority.eq($r.priority),
            intake::run_at.eq(coalesce($r.run_at, db_now())),
            intake::max_attempts.eq($r.max_attempts),
        )
    };
}

/// [`INSERT_MANY`] for `postbox.intake`. Ids are drawn row by row in the order given, so they
/// ascend in that order.
const INSERT_MANY_INTAKE: &str = "INSERT INTO postbox.intake (topic, key, payload, headers, priority, run_at, max_attempts)
SELECT t, k, p, h, pr, coalesce(r, now()), ma
FROM unnest($1::text[], $2::text[], $3::jsonb[], $4::jsonb[], $5::int2[], $6::timestamptz[], $7::int4[])
     WITH ORDINALITY AS u(t, k, p, h, pr, r, ma, n)
ORDER BY n
RETURNING id";

#[derive(diesel::QueryableByName)]
struct IntakeRow {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    id: MessageId,
}

/// The insert of `chunk` (rows for the intake) in its cheapest form; their ids, in the order of
/// `chunk`.
macro_rules! intake_chunk {
    ($chunk:expr, $conn:expr, $($await:tt)*) => {{
        use diesel::sql_types::{Array, Integer, Jsonb, Nullable, SmallInt, Text, Timestamptz};
        let rows: &[NewMessage<'_>] = $chunk;
        let mut ids: Vec<MessageId> = match rows {
            [one] => vec![diesel::insert_into(intake::table).values(intake_values!(one)).returning(intake::id).get_result($conn)$($await)*?],
            many => {
                let got: Vec<IntakeRow> = diesel::sql_query(INSERT_MANY_INTAKE)
                    .bind::<Array<Text>, _>(many.iter().map(|r| r.topic).collect::<Vec<_>>())
                    .bind::<Array<Nullable<Text>>, _>(many.iter().map(|r| r.key).collect::<Vec<_>>())
                    .bind::<Array<Jsonb>, _>(many.iter().map(|r| r.payload).collect::<Vec<_>>())
                    .bind::<Array<Jsonb>, _>(many.iter().map(|r| &r.headers).collect::<Vec<_>>())
                    .bind::<Array<SmallInt>, _>(many.iter().map(|r| r.priority).collect::<Vec<_>>())
                    .bind::<Array<Nullable<Timestamptz>>, _>(many.iter().map(|r| r.run_at).collect::<Vec<_>>())
                    .bind::<Array<Integer>, _>(many.iter().map(|r| r.max_attempts).collect::<Vec<_>>())
                    .load($conn)$($await)*?;
                got.into_iter().map(|r| r.id).collect()
            }
        };
        ids.sort_unstable();
        ids
    }};
}

/// The whole of `enqueue_many` on a sync or an async connection: the writer locks of ordered
/// keys, then the direct rows and the intake's, a statement per [`ROWS_PER_STATEMENT`] of each;
/// one [`Enqueued`] per input, in order.
macro_rules! enqueue_rows {
    ($rows:expr, $conn:expr, $($await:tt)*) => {{
        let rows: Vec<NewMessage<'_>> = $rows;
        if let Some((topics, keys)) = ordered_keys(&rows) {
            diesel::select(lock_keys(topics, keys)).get_result::<i64>($conn)$($await)*?;
        }
        let mut out: Vec<Option<Enqueued>> = vec![None; rows.len()];
        let (fast, direct): (Vec<_>, Vec<_>) = rows.into_iter().enumerate().partition(|(_, r)| r.to_intake());
        let (direct_at, direct): (Vec<usize>, Vec<NewMessage<'_>>) = direct.into_iter().unzip();
        let (fast_at, fast): (Vec<usize>, Vec<NewMessage<'_>>) = fast.into_iter().unzip();
        for (chunk, at) in direct.chunks(ROWS_PER_STATEMENT).zip(direct_at.chunks(ROWS_PER_STATEMENT)) {
            let inserted = insert_chunk!(chunk, $conn, $($await)*);
            let ids = match_inserted(chunk, inserted);
            let keys = duplicate_keys(chunk, &ids);
            let existing = if keys.is_empty() {
                Vec::new()
            } else {
                duplicates_query!(&keys).load($conn)$($await)*?
            };
            for (i, e) in at.iter().zip(resolve(chunk, ids, existing)) {
                out[*i] = Some(e);
            }
        }
        for (chunk, at) in fast.chunks(ROWS_PER_STATEMENT).zip(fast_at.chunks(ROWS_PER_STATEMENT)) {
            let ids = intake_chunk!(chunk, $conn, $($await)*);
            for (i, id) in at.iter().zip(ids) {
                out[*i] = Some(Enqueued::New(id));
            }
        }
        out.into_iter().map(|e| e.expect("every message was written")).collect::<Vec<Enqueued>>()
    }};
}

/// Runs the insert of `chunk` in its cheapest form: one row or many, and `ON CONFLICT DO NOTHING`
/// only when some message has a dedup key (it costs a speculative insertion).
/// Many messages in one statement: nine arrays unnested, instead of nine bind parameters a row
/// (building, sending and parsing a statement of 45,000 parameters costs more than the insert).
/// Rows are inserted in the order given, so their ids ascend in that order.
const INSERT_MANY: &str = "INSERT INTO postbox.messages (topic, key, ordered, payload, headers, priority, run_at, max_attempts, dedup_key)
SELECT t, k, o, p, h, pr, coalesce(r, now()), ma, d
FROM unnest($1::text[], $2::text[], $3::bool[], $4::jsonb[], $5::jsonb[], $6::int2[], $7::timestamptz[], $8::int4[], $9::text[])
     WITH ORDINALITY AS u(t, k, o, p, h, pr, r, ma, d, n)
ORDER BY n";

#[derive(diesel::QueryableByName)]
struct ReturnedRow {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    id: MessageId,
    #[diesel(sql_type = diesel::sql_types::Text)]
    topic: String,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
    dedup_key: Option<String>,
}

/// [`INSERT_MANY`] for `rows`, with its binds.
macro_rules! insert_many {
    ($rows:expr) => {{
        use diesel::sql_types::{
            Array, Bool, Integer, Jsonb, Nullable, SmallInt, Text, Timestamptz,
        };
        let rows: &[NewMessage<'_>] = $rows;
        let dedup = rows.iter().any(|r| r.dedup_key.is_some());
        let sql = format!(
            "{INSERT_MANY}{} RETURNING id, topic, dedup_key",
            if dedup { " ON CONFLICT DO NOTHING" } else { "" }
        );
        diesel::sql_query(sql)
            .bind::<Array<Text>, _>(rows.iter().map(|r| r.topic).collect::<Vec<_>>())
            .bind::<Array<Nullable<Text>>, _>(rows.iter().map(|r| r.key).collect::<Vec<_>>())
            .bind::<Array<Bool>, _>(rows.iter().map(|r| r.ordered).collect::<Vec<_>>())
            .bind::<Array<Jsonb>, _>(rows.iter().map(|r| r.payload).collect::<Vec<_>>())
            .bind::<Array<Jsonb>, _>(rows.iter().map(|r| &r.headers).collect::<Vec<_>>())
            .bind::<Array<SmallInt>, _>(rows.iter().map(|r| r.priority).collect::<Vec<_>>())
            .bind::<Array<Nullable<Timestamptz>>, _>(
                rows.iter().map(|r| r.run_at).collect::<Vec<_>>(),
            )
            .bind::<Array<Integer>, _>(rows.iter().map(|r| r.max_attempts).collect::<Vec<_>>())
            .bind::<Array<Nullable<Text>>, _>(rows.iter().map(|r| r.dedup_key).collect::<Vec<_>>())
    }};
}

macro_rules! insert_chunk {
    ($chunk:expr, $conn:expr, $($await:tt)*) => {{
        let returning = (messages::id, messages::topic, messages::dedup_key);
        let dedup = $chunk.iter().any(|r| r.dedup_key.is_some());
        let inserted: Vec<Returned> = match ($chunk, dedup) {
            ([one], false) => diesel::insert_into(messages::table).values(row_values!(one)).returning(returning).get_results($conn)$($await)*?,
            ([one], true) => diesel::insert_into(messages::table).values(row_values!(one)).on_conflict_do_nothing().returning(returning).get_results($conn)$($await)*?,
            (many, _) => {
                let rows: Vec<ReturnedRow> = insert_many!(many).load($conn)$($await)*?;
                rows.into_iter().map(|r| (r.id, r.topic, r.dedup_key)).collect()
            }
        };
        inserted
    }};
}

macro_rules! duplicates_query {
    ($keys:expr) => {
        messages::table
            .filter(messages::dedup_key.eq_any($keys))
            .select((messages::id, messages::topic, messages::dedup_key))
    };
}

/// Pairs the inserted rows with the inputs. Ids follow the order of the VALUES list, so walking
/// both in order matches them; an input with no matching row was a duplicate.
fn match_inserted(rows: &[NewMessage<'_>], mut inserted: Vec<Returned>) -> Vec<Option<MessageId>> {
    inserted.sort_unstable_by_key(|r| r.0);
    let mut next = inserted.into_iter().peekable();
    rows.iter()
        .map(|row| match next.peek() {
            Some((_, topic, dedup)) if topic == row.topic && dedup.as_deref() == row.dedup_key => {
                next.next().map(|r| r.0)
            }
            _ => None,
        })
        .collect()
}

fn duplicate_keys(rows: &[NewMessage<'_>], ids: &[Option<MessageId>]) -> Vec<String> {
    rows.iter()
        .zip(ids)
        .filter(|(_, id)| id.is_none())
        .filter_map(|(r, _)| r.dedup_key.map(str::to_owned))
        .collect()
}

fn resolve(
    rows: &[NewMessage<'_>],
    ids: Vec<Option<MessageId>>,
    existing: Vec<Returned>,
) -> Vec<Enqueued> {
    let by_key: HashMap<(String, Option<String>), MessageId> = existing
        .into_iter()
        .map(|(id, t, k)| ((t, k), id))
        .collect();
    rows.iter()
        .zip(ids)
        .map(|(row, id)| match id {
            Some(id) => Enqueued::New(id),
            None => Enqueued::Duplicate {
                existing: by_key
                    .get(&(row.topic.to_owned(), row.dedup_key.map(str::to_owned)))
                    .copied(),
            },
        })
        .collect()
}

/// Writes one message on `conn`, inside whatever transaction is open there.
///
/// ```no_run
/// use diesel::{Connection, PgConnection};
/// # fn demo(conn: &mut PgConnection) -> Result<(), postbox::Error> {
/// conn.transaction(|conn| {
///     // diesel::insert_into(orders::table).values(&order).execute(conn)?;
///     postbox::enqueue(conn, &postbox::Message::new("order.created").payload(&42))?;
///     Ok::<_, postbox::Error>(())
/// })
/// # }
/// ```
pub fn enqueue(conn: &mut PgConnection, msg: &Message) -> Result<Enqueued> {
    Ok(enqueue_many(conn, std::slice::from_ref(msg))?.remove(0))
}

/// Writes many messages on `conn` in one statement per [`ROWS_PER_STATEMENT`] messages. All
/// messages are validated before anything is sent. Returns one [`Enqueued`] per input, in order.
pub fn enqueue_many(conn: &mut PgConnection, msgs: &[Message]) -> Result<Vec<Enqueued>> {
    use diesel::RunQueryDsl;
    Ok(enqueue_rows!(rows(msgs)?, conn,))
}

/// [`enqueue`] for a `diesel_async::AsyncPgConnection`.
#[cfg(feature = "async")]
pub async fn enqueue_async(
    conn: &mut diesel_async::AsyncPgConnection,
    msg: &Message,
) -> Result<Enqueued> {
    Ok(enqueue_many_async(conn, std::slice::from_ref(msg))
        .await?
        .remove(0))
}

/// [`enqueue_many`] for a `diesel_async::AsyncPgConnection`.
#[cfg(feature = "async")]
pub async fn enqueue_many_async(
    conn: &mut diesel_async::AsyncPgConnection,
    msgs: &[Message],
) -> Result<Vec<Enqueued>> {
    use diesel_async::RunQueryDsl;
    Ok(enqueue_rows!(rows(msgs)?, conn, .await))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ordered(topic: &str, key: &str) -> Message {
        Message::new(topic).key(key).ordered()
    }

    #[test]
    fn only_a_batch_of_two_or_more_ordered_keys_takes_them_in_sorted_order_first() {
        let keys = |msgs: &[Message]| ordered_keys(&rows(msgs).unwrap()).map(|(_, k)| k.len());
        assert_eq!(keys(&[Message::new("t").key("a")]), None);
        assert_eq!(keys(&[ordered("t", "a")]), None);
        assert_eq!(keys(&[ordered("t", "a"), ordered("t", "a")]), None);
        assert_eq!(keys(&[ordered("t", "a"), Message::new("t").key("b")]), None);
        assert_eq!(keys(&[ordered("t", "a"), ordered("t", "b")]), Some(2));
        assert_eq!(keys(&[ordered("t", "a"), ordered("u", "a")]), Some(2));
        // A dedup key inserted before the key's lock would be held while waiting for it.
        let dedup = || Message::new("u").dedup_key("d");
        assert_eq!(keys(&[dedup(), ordered("t", "a")]), Some(1));
        assert_eq!(keys(&[ordered("t", "a"), dedup()]), None);
        assert_eq!(keys(&[dedup()]), None);
    }
}
