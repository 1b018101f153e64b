//! `publish`: a message into the WAL inside the caller's transaction (stream mode).

use chrono::Utc;

use super::encoding::{Encoded, VERSION};
use crate::enqueue::ROWS_PER_STATEMENT;
use crate::{InvalidMessage, Message, Result};

/// The statement of one chunk: `postbox.publish` checks that a stream slot will read what it
/// emits, then emits every element in order.
const PUBLISH: &str = "SELECT postbox.publish($1) AS n";

#[derive(diesel::QueryableByName)]
struct Published {
    #[diesel(sql_type = diesel::sql_types::Integer)]
    #[allow(dead_code)]
    n: i32,
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
/// round trip. Fails (and so fails the caller's transaction) when the server is not set up for
/// stream mode (`wal_level` below `logical`, or no postbox stream slot in this database): a
/// message is never written where nothing will read it.
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
    let contents = contents(msgs)?;
    for chunk in contents.chunks(ROWS_PER_STATEMENT) {
        diesel::sql_query(PUBLISH)
            .bind::<diesel::sql_types::Array<diesel::sql_types::Text>, _>(chunk)
            .get_result::<Published>(conn)?;
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
    use diesel_async::RunQueryDsl;
    let contents = contents(msgs)?;
    for chunk in contents.chunks(ROWS_PER_STATEMENT) {
        diesel::sql_query(PUBLISH)
            .bind::<diesel::sql_types::Array<diesel::sql_types::Text>, _>(chunk)
            .get_result::<Published>(conn)
            .await?;
    }
    Ok(())
}
