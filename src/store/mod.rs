//! The store: the only module that speaks SQL.
//!
//! One function per state transition of the message state model (the book, "Message life cycle"). Every transition on a claimed message names it
//! by its [`Lease`] (id and lease token), so a late call from a lease that expired and was claimed
//! again matches no row: it changes nothing and comes back in the report's `fenced` list.

pub mod migrate;

/// The floors a store kept of each of a claim's topics (an array in the order of the topics; see
/// [`floors_in!`]), as `postbox.take_set` takes them.
#[cfg(feature = "async")]
macro_rules! floors_set_in {
    ($param:literal) => {
        concat!(
            "ARRAY(SELECT CASE WHEN split_part(u.f, '|', 1) = postbox.boot_token() THEN split_part(u.f, '|', 2) END
             FROM unnest(",
            $param,
            "::text[]) WITH ORDINALITY AS u(f, n) ORDER BY u.n)"
        )
    };
}

/// The floors the session keeps of each of the topics `$param` (an array in their order; NULL
/// for a topic without), stamped with the server run's token as a store keeps them.
#[cfg(feature = "async")]
macro_rules! floors_set_out {
    ($param:literal) => {
        concat!(
            "ARRAY(SELECT postbox.boot_token() || '|' || nullif(current_setting(postbox.claim_floors_setting(u.t), true), '')
             FROM unnest(",
            $param,
            "::text[]) WITH ORDINALITY AS u(t, n) ORDER BY u.n)"
        )
    };
}

/// The floors a store kept (`stamp|floors`, see `Store::keep_floors`) as the claim functions take
/// them: only on the server run that gave them (`postbox.boot_token()`, which a crash or a
/// promotion changes; NULL until the upkeep made one), else NULL (the session's own, or a walk
/// from the front once).
#[cfg(feature = "async")]
macro_rules! floors_in {
    ($param:literal) => {
        concat!(
            "CASE WHEN split_part(",
            $param,
            ", '|', 1) = postbox.boot_token() THEN split_part(",
            $param,
            ", '|', 2) END"
        )
    };
}

/// The CTEs that take messages out of the queue for good (delivered, dead-lettered, cancelled),
/// ending in `$name`: every column of each message as it was, and `kept`. `$ids`, `$tokens`: the
/// messages and their leases (`NULL::bigint[]` for rows the statement has locked itself: a held
/// batch's, a cancel's, a rescue's). They are deleted, except an ordered head whose row a writer of
/// its key pins (`FOR KEY SHARE`, see the migration `head_pins`): tried `FOR UPDATE SKIP LOCKED`,
/// never waited for, it is kept in place as a delivered head (running, lease token 0, locked until
/// `postbox.kept_head_lease()`, `kept` true) and its key promotes nothing past it until
/// `postbox.finish_heads` takes it out. The caller promotes after the heads not kept.
#[cfg(feature = "async")]
macro_rules! take_out_cte {
    ($name:literal, $ids:literal, $tokens:literal) => {
        concat!(
            $name,
            "_input AS (SELECT * FROM unnest(",
            $ids,
            ", ",
            $tokens,
            ") AS i(id, token)),
",
            $name,
            "_free AS (
    SELECT m.id FROM postbox.messages m JOIN ",
            $name,
            "_input i ON i.id = m.id
    WHERE m.id = ANY(ARRAY(SELECT id FROM ",
            $name,
            "_input)) AND (i.token IS NULL OR m.lease_token = i.token)
      -- state as text: a condition that matched messages_heads_idx's predicate let the planner
      -- walk that index whole for the ids (its third column) - under a pinned horizon, every
      -- settled head's entry (120,559 buffers for 100 heads in tests/backlog.rs).
      AND m.ordered AND m.state::text <> 'waiting'
    FOR UPDATE OF m SKIP LOCKED
),
",
            $name,
            "_deleted AS (
    DELETE FROM postbox.messages m USING ",
            $name,
            "_input i
    WHERE m.id = ANY(ARRAY(SELECT id FROM ",
            $name,
            "_input)) AND m.id = i.id
      AND (i.token IS NULL OR m.lease_token = i.token)
      AND (NOT m.ordered OR m.state = 'waiting' OR m.id IN (SELECT id FROM ",
            $name,
            "_free))
    RETURNING m.*
),
",
            $name,
            "_pinned AS (
    SELECT m.* FROM postbox.messages m JOIN ",
            $name,
            "_input i ON i.id = m.id
    WHERE m.id = ANY(ARRAY(SELECT id FROM ",
            $name,
            "_input)) AND (i.token IS NULL OR m.lease_token = i.token)
      AND m.ordered AND m.state::text <> 'waiting' AND m.id NOT IN (SELECT id FROM ",
            $name,
            "_free)
    FOR NO KEY UPDATE OF m
),
",
            $name,
            "_marked AS (
    UPDATE postbox.messages m
    SET state = 'running', lease_token = 0, locked_until = postbox.kept_head_lease(),
        locked_by = 'postbox: delivered; kept as its key''s head until its writer is done',
        first_error = NULL, last_error = NULL
    FROM ",
            $name,
            "_pinned p WHERE m.id = ANY(ARRAY(SELECT id FROM ",
            $name,
            "_pinned)) AND m.id = p.id
    RETURNING m.id
),
",
            $name,
            " AS (
    SELECT d.*, false AS kept FROM ",
            $name,
            "_deleted d
    UNION ALL
    SELECT p.*, true AS kept FROM ",
            $name,
            "_pinned p
)"
        )
    };
}

/// A new lease token: never 0, the token of a head kept for a writer of its key (see
/// `take_out_cte!`).
#[cfg(feature = "async")]
fn new_token() -> i64 {
    loop {
        let t = fastrand::i64(..);
        if t != 0 {
            return t;
        }
    }
}

#[cfg(feature = "async")]
mod analyze;
#[cfg(feature = "async")]
pub mod browse;
#[cfg(feature = "async")]
mod cancel;
#[cfg(feature = "async")]
mod check;
#[cfg(feature = "async")]
mod claim;
#[cfg(feature = "async")]
pub mod completion;
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
mod intake;
#[cfg(feature = "async")]
mod kept;
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
pub mod storable;
#[cfg(feature = "async")]
mod stream;
#[cfg(feature = "async")]
mod stream_guard;
#[cfg(feature = "async")]
mod upkeep;

#[cfg(feature = "async")]
pub use self::{
    analyze::Analyzed,
    cancel::{CancelSelector, Cancelled},
    check::{RepairedKey, VIOLATION_KINDS, Violation},
    claim::{ClaimedMessage, Topics},
    dead::{DeadLetter, DeadSelector, ReplayReport},
    explain::SettleStatement,
    hold::{HOLD_GRACE, Hold, HoldEnded, TakePosition},
    intake::MOVE_BATCH,
    kept::{FINISH_BATCH, Finished},
    limit::Limit,
    listen::{listen, register_listener, still_running, unregister_listener},
    pause::unpaused,
    retention::{Maintained, Omitted, Shown},
    schedule::{PROMOTE_BATCH, Promoted},
    settle::{Dead, RESCUE_BATCH, Retry, RetryReport, Settled, Snooze},
    stats::{
        EXACT_LIMIT, SAMPLE_ROWS, SampleRow, StalledKey, Stats, TOPIC_EXACT_LIMIT, TopicStats,
    },
    stream::{StreamSetup, StreamSlot, check_slot_name, stream_session_alive},
    stream_guard::SlotRecord,
    upkeep::{DEFAULT_UPKEEP_SWEEP, UPKEEP_MARGIN, UPKEEP_SWEEP_BUDGET},
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

    /// How a pool opens and sets up a connection.
    type Setup = dyn for<'a> Fn(
            &'a str,
        ) -> futures_util::future::BoxFuture<
            'a,
            diesel::ConnectionResult<AsyncPgConnection>,
        > + Send
        + Sync;

    /// The queue's state transitions over a connection pool.
    #[derive(Clone)]
    pub struct Store {
        pub(crate) pool: Pool,
        pub(crate) backoff: Backoff,
        pub(crate) owner: Arc<str>,
        /// Keeps delivered messages in `postbox.completed`, naming this sink.
        pub(crate) archive: Option<Arc<str>>,
        /// Heads this store kept for their writers (see the migration `head_pins`).
        pub(crate) kept: Arc<super::kept::KeptHeads>,
        /// The newest floors of the claim of every topic (`None`) and of each topic claimed by
        /// name, for a connection that has none or older ones (see the migration
        /// `ready_positions`).
        pub(crate) floors: Arc<std::sync::Mutex<std::collections::HashMap<Option<String>, String>>>,
        /// Where the upkeep's walks start (see the migration `upkeep_windows`).
        pub(crate) upkeep: Arc<super::upkeep::Windows>,
        /// Where this store's next move of `postbox.intake` starts (see the migration `intake`).
        pub(crate) intake: Arc<super::intake::IntakeFloor>,
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
                kept: super::kept::new_kept(),
                floors: Arc::default(),
                upkeep: Arc::default(),
                intake: Arc::default(),
            }
        }

        /// Opens a pool of at most `max_size` connections to `database_url`, with the session
        /// settings of [`super::connect::establish`]. Connections are not pinged on checkout (a
        /// broken one fails its query, is discarded, and the operation is retried by its caller).
        pub async fn connect(database_url: &str, max_size: u32) -> Result<Self> {
            use futures_util::FutureExt;
            Self::connect_with(
                database_url,
                max_size,
                std::time::Duration::from_secs(10),
                Arc::new(|url: &str| super::connect::establish(url).boxed()),
            )
            .await
        }

        /// A store of its own for a part of the relay that is not delivery (the console): at
        /// most `max_size` connections, each statement ended by the server after
        /// `statement_timeout`, and a caller that waits longer than `checkout` for a connection
        /// is refused ([`Error::Pool`]) rather than queued. Its connections are never the
        /// delivery's.
        pub async fn connect_bounded(
            database_url: &str,
            max_size: u32,
            statement_timeout: std::time::Duration,
            checkout: std::time::Duration,
            application_name: &'static str,
        ) -> Result<Self> {
            use futures_util::FutureExt;
            let ms = statement_timeout.as_millis().max(1);
            Self::connect_with(
                database_url,
                max_size,
                checkout,
                Arc::new(move |url: &str| {
                    let url = url.to_owned();
                    async move {
                        use diesel_async::SimpleAsyncConnection;
                        let mut conn = super::connect::establish(&url).await?;
                        conn.batch_execute(&format!(
                            "SET statement_timeout = {ms}; SET idle_in_transaction_session_timeout = {ms}; SET application_name = '{application_name}'"
                        ))
                        .await
                        .map_err(|e| diesel::ConnectionError::BadConnection(e.to_string()))?;
                        Ok(conn)
                    }
                    .boxed()
                }),
            )
            .await
        }

        async fn connect_with(
            database_url: &str,
            max_size: u32,
            checkout: std::time::Duration,
            setup: Arc<Setup>,
        ) -> Result<Self> {
            use diesel_async::pooled_connection::{ManagerConfig, RecyclingMethod};
            let mut config = ManagerConfig::<AsyncPgConnection>::default();
            config.recycling_method = RecyclingMethod::Fast;
            config.custom_setup = Box::new(move |url| setup(url));
            let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new_with_config(
                database_url,
                config,
            );
            let pool = bb8::Pool::builder()
                .max_size(max_size)
                .test_on_check_out(false)
                .connection_timeout(checkout)
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

        /// Walks the whole of the upkeep's indexes (expired leases, kept heads, due scheduled
        /// messages) every `every` ([`DEFAULT_UPKEEP_SWEEP`](crate::store::DEFAULT_UPKEEP_SWEEP)); in between, each walk starts
        /// [`UPKEEP_MARGIN`](crate::store::UPKEEP_MARGIN) before where its previous pass ended, so that a pinned xmin horizon
        /// does not make every pass step over what went through that state since the pin. A row
        /// the window cannot see (made due by a transaction older than the margin that committed
        /// after a pass) waits for the next whole walk. A whole walk that took long (a pin keeps
        /// every entry) puts the next off to keep within [`UPKEEP_SWEEP_BUDGET`](crate::store::UPKEEP_SWEEP_BUDGET) of the time.
        /// `Duration::ZERO`: every pass walks everything.
        pub fn with_upkeep_sweep(mut self, every: std::time::Duration) -> Self {
            self.upkeep = Arc::new(super::upkeep::Windows::new(every));
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
