//! `publish`: a message into the WAL inside the caller's transaction (stream mode).
//!
//! The check that a stream will read what is emitted (`wal_level`, the slot, its publication)
//! costs more than the emit itself when commits do not wait for the disk
//! (`synchronous_commit = off`). Each connection therefore remembers, in the session setting
//! `postbox.stream_checked_in`, the second (of the app's clock, since the epoch) in which it last
//! checked: within that second a publish emits in one statement whose only extra work is reading
//! the setting; in another second, the statement finds nothing to do and `postbox.publish` checks
//! again and records the new second. A check holds for less than [`CHECK_HOLDS`], never longer: a
//! clock set back, or another process's clock through a transaction pooler, names another second
//! and costs a check, not a skip. A setting from a rolled-back transaction is rolled back with it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use chrono::Utc;

use super::encoding::{Encoded, VERSION};
use crate::enqueue::ROWS_PER_STATEMENT;
use crate::{InvalidMessage, Message, Result};

/// How long a connection's check holds, at most: a slot or publication dropped less than this
/// before a publish may still see it accepted (as one dropped just after the commit would lose
/// it).
pub const CHECK_HOLDS: Duration = Duration::from_secs(1);

/// The statement of one message while the check holds: no row when it does not (a one-time
/// filter: the emit is not evaluated).
const EMIT_ONE: &str =
    "SELECT (pg_catalog.pg_logical_emit_message(true, 'postbox', $1) IS NOT NULL)::int AS n
    WHERE pg_catalog.current_setting('postbox.stream_checked_in', true) = $2";

/// The statement of a chunk while the check holds: 0 when it does not.
const EMIT_MANY: &str =
    "SELECT count(pg_catalog.pg_logical_emit_message(true, 'postbox', c) ORDER BY i)::int AS n
    FROM unnest($1::text[]) WITH ORDINALITY AS u(c, i)
    WHERE pg_catalog.current_setting('postbox.stream_checked_in', true) = $2";

/// The statement of a chunk when the check is due: `postbox.publish` checks that a stream slot
/// will read what it emits, then emits every element in order; the setting records the second
/// in which that check was made.
const PUBLISH: &str = "SELECT postbox.publish($1) AS n,
    pg_catalog.set_config('postbox.stream_checked_in', $2, false) AS until";

/// The second of the app's clock a check holds in (whole seconds since the epoch).
fn second() -> String {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
        .to_string()
}

#[derive(diesel::QueryableByName)]
struct Published {
    #[diesel(sql_type = diesel::sql_types::Integer)]
    n: i32,
}

#[derive(diesel::QueryableByName)]
struct Checked {
    #[diesel(sql_type = diesel::sql_types::Integer)]
    #[allow(dead_code)]
    n: i32,
    #[diesel(sql_type = diesel::sql_types::Text)]
    #[allow(dead_code)]
    until: String,
}

/// Validates `msg` as `enqueue` does, refuses what stream mode cannot honour, and encodes it.
pub fn encode(msg: &Message) -> Result<String, InvalidMessage> {
    msg.validate()?;
    if msg.run_at.is_some() {
        return Err(InvalidMessage::NotInStream { field: "run_at" });
    }
    if msg.delay.is_some() {
        return Err(InvalidMessage::NotInStream { field: "delay" });
    }
    if msg.priority != 0 {
        return Err(InvalidMessage::NotInStream { field: "priority" });
    }
    if msg.dedup_key.is_some() {
        return Err(InvalidMessage::NotInStream { field: "dedup_key" });
    }
    if msg.max_attempts.is_some() {
        return Err(InvalidMessage::NotInStream {
            field: "max_attempts",
        });
    }
    let (Ok(payload), Ok(headers)) = (&msg.payload, &msg.headers) else {
        unreachable!("validate() accepted the message");
    };
    let headers = match crate::enqueue::headers_json(headers) {
        serde_json::Value::Object(map) => map
            .into_iter()
            .filter_map(|(k, v)| match v {
                serde_json::Value::String(s) => Some((k, s)),
                _ => None,
            })
            .collect(),
        _ => Default::default(),
    };
    Ok(Encoded {
        v: VERSION,
        topic: msg.topic.clone(),
        key: msg.key.clone(),
        headers,
        payload: payload.clone(),
        created_at: Some(Utc::now()),
    }
    .to_content())
}

fn contents(msgs: &[Message]) -> Result<Vec<String>> {
    Ok(msgs.iter().map(encode).collect::<Result<Vec<_>, _>>()?)
}

/// Publishes `msg` into the WAL on `conn`, inside the caller's transaction: a relay with
/// `[stream]` delivers it when, and only if, that transaction commits, in commit order. One
/// round trip (two when the connection's check is due, at most once per [`CHECK_HOLDS`]). Fails (and so fails the caller's transaction) when the server is not set up for
/// stream mode (`wal_level` below `logical`, or no postbox stream slot in this database): a
/// message is never written where nothing will read it (checked at most [`CHECK_HOLDS`] before,
/// on this connection).
///
/// A delay, `run_at`, a priority, a dedup key or max attempts are refused with
/// [`crate::Error::InvalidMessage`]: use [`crate::enqueue()`] for those.
///
/// ```no_run
/// use diesel::prelude::*;
/// # fn demo(conn: &mut PgConnection) -> Result<(), postbox::Error> {
/// conn.transaction(|conn| {
///     // diesel::insert_into(orders::table).values(&order).execute(conn)?;
///     postbox::publish(conn, &postbox::Message::new("order.created").key("order-42").payload(&42))
/// })
/// # }
/// ```
pub fn publish(conn: &mut diesel::PgConnection, msg: &Message) -> Result<()> {
    publish_many(conn, std::slice::from_ref(msg))
}

/// Publishes every message, in order, one round trip per [`ROWS_PER_STATEMENT`] messages. All
/// are validated before anything is sent.
pub fn publish_many(conn: &mut diesel::PgConnection, msgs: &[Message]) -> Result<()> {
    use diesel::RunQueryDsl;
    use diesel::sql_types::{Array, Text};
    let contents = contents(msgs)?;
    for chunk in contents.chunks(ROWS_PER_STATEMENT) {
        let now = second();
        let emitted = if let [one] = chunk {
            // The row count: 1 when emitted.
            diesel::sql_query(EMIT_ONE)
                .bind::<Text, _>(one)
                .bind::<Text, _>(&now)
                .execute(conn)?
                == 1
        } else {
            diesel::sql_query(EMIT_MANY)
                .bind::<Array<Text>, _>(chunk)
                .bind::<Text, _>(&now)
                .get_result::<Published>(conn)?
                .n
                > 0
        };
        if !emitted {
            diesel::sql_query(PUBLISH)
                .bind::<Array<Text>, _>(chunk)
                .bind::<Text, _>(&now)
                .get_result::<Checked>(conn)?;
        }
    }
    Ok(())
}

/// [`publish`] for a `diesel_async::AsyncPgConnection`.
#[cfg(feature = "async")]
pub async fn publish_async(
    conn: &mut diesel_async::AsyncPgConnection,
    msg: &Message,
) -> Result<()> {
    publish_many_async(conn, std::slice::from_ref(msg)).await
}

/// [`publish_many`] for a `diesel_async::AsyncPgConnection`.
#[cfg(feature = "async")]
pub async fn publish_many_async(
    conn: &mut diesel_async::AsyncPgConnection,
    msgs: &[Message],
) -> Result<()> {
    use diesel::sql_types::{Array, Text};
    use diesel_async::RunQueryDsl;
    let contents = contents(msgs)?;
    for chunk in contents.chunks(ROWS_PER_STATEMENT) {
        let now = second();
        let emitted = if let [one] = chunk {
            diesel::sql_query(EMIT_ONE)
                .bind::<Text, _>(one)
                .bind::<Text, _>(&now)
                .execute(conn)
                .await?
                == 1
        } else {
            diesel::sql_query(EMIT_MANY)
                .bind::<Array<Text>, _>(chunk)
                .bind::<Text, _>(&now)
                .get_result::<Published>(conn)
                .await?
                .n
                > 0
        };
        if !emitted {
            diesel::sql_query(PUBLISH)
                .bind::<Array<Text>, _>(chunk)
                .bind::<Text, _>(&now)
                .get_result::<Checked>(conn)
                .await?;
        }
    }
    Ok(())
}
