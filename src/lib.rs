//! # postbox
//!
//! A PostgreSQL transactional outbox and job queue for diesel apps. An app writes its business
//! rows and its messages in one transaction, so a message exists if and only if the business write
//! committed; a relay (or an engine embedded in the app) claims messages with
//! `FOR UPDATE SKIP LOCKED` under a lease, delivers them, retries with backoff and dead-letters.
//!
//! ## Quick start (sync)
//!
//! ```no_run
//! use diesel::prelude::*;
//! # fn main() -> Result<(), postbox::Error> {
//! let mut conn = PgConnection::establish("postgres://postgres@localhost/app")?;
//! postbox::migrate(&mut conn)?;
//! conn.transaction(|conn| {
//!     // ... insert the order with diesel ...
//!     postbox::enqueue(conn, &postbox::Message::new("order.created").payload(&serde_json::json!({"id": 7})))
//! })?;
//! # Ok(()) }
//! ```
//!
//! ## Quick start (async, diesel-async)
//!
//! ```no_run
//! use diesel_async::{AsyncConnection, AsyncPgConnection};
//! # async fn run() -> Result<(), postbox::Error> {
//! let conn = AsyncPgConnection::establish("postgres://postgres@localhost/app").await?;
//! let (_applied, mut conn) = postbox::migrate_async(conn).await?;
//! conn.transaction(async |conn| {
//!     postbox::enqueue_async(conn, &postbox::Message::new("order.created").payload(&7)).await
//! })
//! .await?;
//! # Ok(()) }
//! ```
//!
//! Delivery is at least once: handlers and consumers must be idempotent (the message id, also
//! sent as the Kafka header `postbox-id`, is the natural idempotency key).

pub mod backoff;
#[cfg(feature = "relay")]
pub mod config;
#[cfg(feature = "cron")]
pub mod cron;
#[cfg(feature = "engine")]
pub mod engine;
pub mod enqueue;
pub mod error;
pub mod message;
#[cfg(feature = "relay")]
pub mod metrics;
#[cfg(feature = "otel")]
pub mod otel;
#[cfg(feature = "relay")]
pub mod relay;
pub mod schema;
#[cfg(feature = "engine")]
pub mod sink;
pub mod store;
pub mod stream;

pub use backoff::Backoff;
#[cfg(feature = "cron")]
pub use cron::CronSchedule;
pub use enqueue::{Enqueued, enqueue, enqueue_many};
#[cfg(feature = "async")]
pub use enqueue::{enqueue_async, enqueue_many_async};
pub use error::{Error, InvalidMessage, Result};
pub use message::{
    MAX_KEY_BYTES, MAX_PAYLOAD_BYTES, MAX_TOPIC_BYTES, Message, MessageId, RESERVED_HEADER_PREFIX,
};
pub use store::migrate::{MIGRATIONS, migrate};
#[cfg(feature = "async")]
pub use store::migrate::{migrate_async, migrate_pool};
#[cfg(feature = "async")]
pub use store::{ClaimedMessage, Lease, Store, Topics};
pub use stream::{publish, publish_many};
#[cfg(feature = "async")]
pub use stream::{publish_async, publish_many_async};
/// Stops an engine or a relay (`Engine::run(token)`), re-exported so an app needs no
/// `tokio-util` of its own.
#[cfg(feature = "engine")]
pub use tokio_util::sync::CancellationToken;
