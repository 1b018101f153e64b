//! The one error type of the library.

/// Why a message was refused before any SQL ran.
///
/// Every variant names the offending field, so the caller can fix the input instead of reading
/// a database error.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvalidMessage {
    /// The topic is the routing name; an empty one routes nowhere.
    #[error("topic: must not be empty")]
    EmptyTopic,
    /// Topics become Kafka topic names and metric labels; keep them short.
    #[error("topic: {len} bytes, the limit is {limit}")]
    TopicTooLong {
        /// The topic's length in bytes.
        len: usize,
        /// The most it may have.
        limit: usize,
    },
    /// The payload could not be serialized to JSON.
    #[error("payload: cannot serialize to JSON: {0}")]
    PayloadNotJson(String),
    /// The serialized payload is larger than [`crate::MAX_PAYLOAD_BYTES`].
    #[error("payload: {len} bytes of JSON, the limit is {limit}")]
    PayloadTooLarge {
        /// The payload's length as JSON, in bytes.
        len: usize,
        /// The most it may have.
        limit: usize,
    },
    /// Headers must be a JSON object whose values are all strings.
    #[error("headers: {0}")]
    BadHeaders(String),
    /// A key is too long (over [`crate::MAX_KEY_BYTES`]).
    #[error("{field}: {len} bytes, the limit is {limit}")]
    TooLong {
        /// The field (`key`, `dedup_key`, a header).
        field: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The most it may have.
        limit: usize,
    },
    /// Ordering is per key: an ordered message needs one.
    #[error("ordered: an ordered message needs a key")]
    OrderedWithoutKey,
    /// At least one attempt is needed to deliver anything.
    #[error("max_attempts: must be at least 1, got {0}")]
    MaxAttempts(i32),
    /// PostgreSQL text and JSON cannot hold the NUL character (0x00).
    #[error("{field}: contains a NUL character (0x00), which PostgreSQL cannot store")]
    Nul {
        /// The field that holds it.
        field: &'static str,
    },
    /// [`crate::publish`] was given a field stream mode cannot honour: a published message goes
    /// out once, at commit, in commit order (no delay, priority, dedup key or attempts).
    #[error(
        "{field}: stream mode cannot honour it (a published message is delivered at commit, in commit order); enqueue the message instead"
    )]
    NotInStream {
        /// The field set (`run_at`, `delay`, `priority`, `dedup_key`, `max_attempts`).
        field: &'static str,
    },
    /// The run time is out of the range a message can be scheduled in.
    #[error("{field}: {problem}")]
    RunAt {
        /// `run_at` or `delay`.
        field: &'static str,
        /// Why it is out of range.
        problem: String,
    },
}

/// Everything that can go wrong in postbox.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The message was refused before any SQL ran; nothing was written.
    #[error("invalid message: {0}")]
    InvalidMessage(#[from] InvalidMessage),
    /// A query failed. Its text is in this error's message, and it is not repeated as a source
    /// (an error chain prints "database: X", not "database: X: X"); match the variant for it.
    #[error("database: {0}")]
    Database(diesel::result::Error),
    /// A connection could not be established (its text in the message, as for `Database`).
    #[error("connection: {0}")]
    Connection(diesel::ConnectionError),
    /// No connection could be taken from the pool.
    #[error("connection pool: {0}")]
    Pool(String),
    /// Running the migrations failed.
    #[error("migration: {0}")]
    Migration(String),
    /// A caller passed an argument that cannot work (names the argument).
    #[error("{field}: {problem}")]
    InvalidArgument {
        /// The argument.
        field: &'static str,
        /// What is wrong with it.
        problem: String,
    },
}

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<diesel::result::Error> for Error {
    fn from(e: diesel::result::Error) -> Self {
        Error::Database(e)
    }
}

impl From<diesel::ConnectionError> for Error {
    fn from(e: diesel::ConnectionError) -> Self {
        Error::Connection(e)
    }
}

/// `?` on postbox's calls inside a diesel transaction whose closure returns
/// `diesel::QueryResult`: a database error stays what it was; anything else (an invalid message,
/// a pool or an argument refused) becomes a `QueryBuilderError` carrying it, and the transaction
/// rolls back either way.
///
/// ```no_run
/// use diesel::{Connection, PgConnection, QueryResult};
/// # fn demo(conn: &mut PgConnection) -> QueryResult<()> {
/// conn.transaction(|conn| -> QueryResult<()> {
///     postbox::enqueue(conn, &postbox::Message::new("order.created"))?;
///     Ok(())
/// })
/// # }
/// ```
impl From<Error> for diesel::result::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Database(e) => e,
            other => diesel::result::Error::QueryBuilderError(Box::new(other)),
        }
    }
}
