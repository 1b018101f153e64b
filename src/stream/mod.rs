//! Stream mode: messages published into the WAL in the app's transaction (no table row), read by
//! the relay through a logical replication slot and delivered in commit order.
//!
//! - [`publish`] / [`publish_many`] (and `_async`): the writer, in the caller's transaction.
//! - [`encoding`]: the stable, versioned format of a published message, for writers in other
//!   languages.
//! - `relay` (feature `stream`): the streamer that reads the slot and confirms only what its
//!   sinks stored.

#[cfg(feature = "stream")]
mod config;
#[cfg(feature = "stream")]
mod connect;
#[cfg(feature = "stream")]
mod deliver;
pub mod encoding;
#[cfg(feature = "stream")]
mod guard;
mod publish;
#[cfg(feature = "stream")]
mod relay;
#[cfg(feature = "stream")]
mod session;

#[cfg(feature = "stream")]
pub use config::{StreamConfig, StreamError, StreamObserver, StreamReport};
#[cfg(feature = "stream")]
pub use connect::CONFIRM_EVERY;
#[cfg(feature = "stream")]
pub use deliver::{Delivered, MAX_RETRIES};
pub use publish::{CHECK_HOLDS, encode, publish, publish_many};
#[cfg(feature = "async")]
pub use publish::{publish_async, publish_many_async};
#[cfg(feature = "stream")]
pub use relay::{Streamer, stream_id};
