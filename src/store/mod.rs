//! The store: the only module that speaks SQL.
//!
//! One function per state transition of the message state model (the book, "Message life cycle"). Every transition on a claimed message names it
//! by its [`Lease`] (id and lease token), so a late call from a lease that expired and was claimed
//! again matches no row: it changes nothing and comes back in the report's `fenced` list.

pub mod migrate;

#[cfg(feature = "async")]
pub mod browse;
#[cfg(feature = "async")]
mod cancel;
#[cfg(feature = "async")]
mod check;
#[cfg(feature = "async")]
mod claim;
#[cfg(feature = "async")]
pub mod connect;
#[cfg(feature = "cron")]
mod cron;
#[cfg(feature = "async")]
mod dead;
#[cfg(feature = "async")]
mod explain;
#[cfg(feature = "async")]
pub mod grant;
#[cfg(feature = "async")]
mod hold;
#[cfg(feature = "async")]
mod lenient;
#[cfg(feature = "async")]
mod limit;
#[cfg(feature = "async")]
mod listen;
#[cfg(feature = "async")]
mod pause;
#[cfg(feature = "async")]
pub mod position;
#[cfg(feature = "async")]
mod retention;
#[cfg(feature = "async")]
mod schedule;
#[cfg(feature = "async")]
mod settle;
#[cfg(feature = "async")]
mod stats;
#[cfg(feature = "async")]
mod stream;

#[cfg(feature = "async")]
pub use self::{
    cancel::{CancelSelector, Cancelled},
    check::{RepairedKey, VIOLATION_KINDS, Violation},
    claim::{ClaimedMessage, Topics},
    dead::{DeadLetter, DeadSelector, ReplayReport},
    explain::SettleStatement,
    hold::{HOLD_GRACE, Hold, HoldEnded},
    limit::Limit,
    listen::{listen, register_listener, still_running, unregister_listener},
    pause::unpaused,
    retention::{Maintained, Shown},
    schedule::{PROMOTE_BATCH, Promoted},
    settle::{Dead, RESCUE_BATCH, Retry, RetryReport, Settled},
    stats::{
        EXACT_LIMIT, SAMPLE_ROWS, SampleRow, StalledKey, Stats, TOPIC_EXACT_LIMIT, TopicStats,
    },
    stream::{StreamSetup, StreamSlot, check_slot_name, stream_session_alive},
};

#[cfg(feature = "cron")]
pub use self::cron::{Fired, ScheduleRow};

#[cfg(feature = "async")]
pub use self::pool::*;

#[cfg(feature = "async")]
mod pool {
    use std::sync::Arc;

    use diesel_async::AsyncPgConnection;
    use diesel_async::pooled_connection::AsyncDieselConnectionManager;

    use crate::backoff::Backoff;
    use crate::error::{Error, Result};
    use crate::message::MessageId;

    /// A bb8 pool of async diesel connections.
    pub type Pool = bb8::Pool<AsyncDieselConnectionManager<AsyncPgConnection>>;
    /// A connection taken from [`Pool`].
    pub type PooledConn<'a> =
        bb8::PooledConnection<'a, AsyncDieselConnectionManager<AsyncPgConnection>>;

    /// Names one claim of one message: the id and the token written by that claim.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct Lease {
        /// The message.
        pub id: MessageId,
        /// Random per claim; a re-claim writes a new one, which fences the old holder out.
        pub token: i64,
    }

    /// The queue's state transitions over a connection pool.
    #[derive(Clone)]
    pub struct Store {
        pub(crate) pool: Pool,
        pub(crate) backoff: Backoff,
        pub(crate) owner: Arc<str>,
        /// Keeps delivered messages in `postbox.completed`, naming this sink.
        pub(crate) archive: Option<Arc<str>>,
    }

    impl std::fmt::Debug for Store {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Store")
                .field("backoff", &self.backoff)
                .field("owner", &self.owner)
                .finish_non_exhaustive()
        }
    }

    impl Store {
        /// A store over `pool`, with the default [`Backoff`] and an owner name made of the host
        /// name and process id (written to `locked_by` of claimed rows, for operators).
        pub fn new(pool: Pool) -> Self {
            let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "postbox".into());
            Store {
                pool,
                backoff: Backoff::default(),
                owner: format!("{host}:{}", std::process::id()).into(),
                archive: None,
            }
        }

        /// Opens a pool of at most `max_size` connections to `database_url`, with the session
        /// settings of [`super::connect::establish`]. Connections are not pinged on checkout (a
        /// broken one fails its query, is discarded, and the operation is retried by its caller).
        pub async fn connect(database_url: &str, max_size: u32) -> Result<Self> {
            use diesel_async::pooled_connection::{ManagerConfig, RecyclingMethod};
            use futures_util::FutureExt;
            let mut config = ManagerConfig::<AsyncPgConnection>::default();
            config.recycling_method = RecyclingMethod::Fast;
            config.custom_setup = Box::new(|url| super::connect::establish(url).boxed());
            let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new_with_config(
                database_url,
                config,
            );
            let pool = bb8::Pool::builder()
                .max_size(max_size)
                .test_on_check_out(false)
                .connection_timeout(std::time::Duration::from_secs(10))
                .build(manager)
                .await
                .map_err(|e| Error::Pool(e.to_string()))?;
            Ok(Store::new(pool))
        }

        /// Uses `backoff` for retries and rescues.
        pub fn with_backoff(mut self, backoff: Backoff) -> Result<Self> {
            backoff.validate()?;
            self.backoff = backoff;
            Ok(self)
        }

        /// Copies every message this store completes into `postbox.completed` (see
        /// [`Store::maintain_completed`]), recording `sink` as what delivered it. The hot table is
        /// unchanged: the copy is made by the statement that deletes the message.
        pub fn with_archive(mut self, sink: impl Into<String>) -> Self {
            self.archive = Some(sink.into().into());
            self
        }

        /// Names this process in `locked_by` of the rows it claims.
        pub fn with_owner(mut self, owner: impl Into<String>) -> Self {
            self.owner = owner.into().into();
            self
        }

        /// The pool, for callers that also need connections of their own.
        pub fn pool(&self) -> &Pool {
            &self.pool
        }

        /// The retry policy in use.
        pub fn backoff(&self) -> &Backoff {
            &self.backoff
        }

        pub(crate) async fn conn(&self) -> Result<PooledConn<'_>> {
            self.pool
                .get()
                .await
                .map_err(|e| Error::Pool(e.to_string()))
        }
    }

    /// Ids and tokens as two arrays, the shape the SQL unnests.
    pub(crate) fn split(leases: impl IntoIterator<Item = Lease>) -> (Vec<i64>, Vec<i64>) {
        leases.into_iter().map(|l| (l.id, l.token)).unzip()
    }

    /// The requested ids that no row matched: their lease was gone.
    pub(crate) fn fenced(requested: &[i64], done: &[i64]) -> Vec<MessageId> {
        let done: std::collections::HashSet<_> = done.iter().collect();
        requested
            .iter()
            .filter(|id| !done.contains(id))
            .copied()
            .collect()
    }
}
