//! Queue statistics for `status` and the metrics sampler: one light query.

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Double, Nullable, Text};
use diesel_async::RunQueryDsl;

use super::Store;
use crate::error::Result;

/// Depth of one topic.
#[derive(Debug, Clone, PartialEq, QueryableByName, serde::Serialize)]
pub struct TopicStats {
    #[diesel(sql_type = Text)]
    pub topic: String,
    /// Pending and claimable now (`run_at` passed); includes ordered messages waiting behind
    /// the head of their key.
    #[diesel(sql_type = BigInt)]
    pub available: i64,
    /// Pending with `run_at` in the future (delayed, or backing off after a failure).
    #[diesel(sql_type = BigInt)]
    pub scheduled: i64,
    /// Leased by a relay.
    #[diesel(sql_type = BigInt)]
    pub running: i64,
    /// In the dead letters.
    #[diesel(sql_type = BigInt)]
    pub dead: i64,
    /// Seconds the oldest available message has been claimable and not claimed.
    #[diesel(sql_type = Nullable<Double>)]
    pub oldest_available_secs: Option<f64>,
}

/// Depth of every topic that has live or dead messages.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Stats {
    pub topics: Vec<TopicStats>,
}

impl Stats {
    /// Messages in the dead letters, all topics.
    pub fn dead_total(&self) -> i64 {
        self.topics.iter().map(|t| t.dead).sum()
    }

    /// Live messages (available, scheduled or running), all topics.
    pub fn live_total(&self) -> i64 {
        self.topics
            .iter()
            .map(|t| t.available + t.scheduled + t.running)
            .sum()
    }
}

/// Depth per topic: shared by `stats` and the metrics sample.
macro_rules! live_cte {
    () => {
        r#"
WITH live AS (
    SELECT topic,
           count(*) FILTER (WHERE locked_until IS NULL AND run_at <= now()) AS available,
           count(*) FILTER (WHERE locked_until IS NULL AND run_at > now()) AS scheduled,
           count(*) FILTER (WHERE locked_until IS NOT NULL) AS running,
           extract(epoch FROM now() - min(run_at) FILTER (WHERE locked_until IS NULL AND run_at <= now()))::float8
               AS oldest_available_secs
    FROM postbox.messages
    GROUP BY topic
),"#
    };
}

const STATS: &str = concat!(
    live_cte!(),
    r#"
dead AS (
    SELECT topic, count(*) AS dead FROM postbox.dead_letters GROUP BY topic
)
SELECT coalesce(l.topic, d.topic) AS topic,
       coalesce(l.available, 0) AS available,
       coalesce(l.scheduled, 0) AS scheduled,
       coalesce(l.running, 0) AS running,
       coalesce(d.dead, 0) AS dead,
       l.oldest_available_secs
FROM live l FULL JOIN dead d ON l.topic = d.topic
ORDER BY 1
"#
);

/// The head of an ordered key that has failed and so holds back the messages behind it.
#[derive(Debug, Clone, PartialEq, QueryableByName, serde::Serialize)]
pub struct StalledKey {
    #[diesel(sql_type = Text)]
    pub topic: String,
    #[diesel(sql_type = Text)]
    pub key: String,
    /// The head message.
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    #[diesel(sql_type = diesel::sql_types::Integer)]
    pub attempts: i32,
    /// Seconds since the head was enqueued.
    #[diesel(sql_type = Double)]
    pub age_secs: f64,
    #[diesel(sql_type = Nullable<Text>)]
    pub last_error: Option<String>,
    /// Messages of the key waiting behind the head.
    #[diesel(sql_type = BigInt)]
    pub waiting: i64,
}

const STALLED: &str = r#"
WITH heads AS (
    SELECT DISTINCT ON (topic, key) topic, key, id, attempts, created_at, last_error
    FROM postbox.messages
    WHERE ordered
    ORDER BY topic, key, id
)
SELECT h.topic, h.key, h.id, h.attempts,
       extract(epoch FROM now() - h.created_at)::float8 AS age_secs, h.last_error,
       (SELECT count(*) FROM postbox.messages w
        WHERE w.ordered AND w.topic = h.topic AND w.key = h.key AND w.id > h.id) AS waiting
FROM heads h
WHERE h.last_error IS NOT NULL
ORDER BY h.created_at
LIMIT $1
"#;

/// One figure of a metrics sample.
#[derive(Debug, Clone, PartialEq, QueryableByName)]
pub struct SampleRow {
    /// depth, oldest_available, dead, stalled, dead_tuples, live_tuples, oldest_transaction
    #[diesel(sql_type = Text)]
    pub metric: String,
    /// Topic or table.
    #[diesel(sql_type = Text)]
    pub label: String,
    /// Message state, for depth.
    #[diesel(sql_type = Text)]
    pub state: String,
    #[diesel(sql_type = Double)]
    pub value: f64,
}

/// Everything the metrics need from the database, in one statement.
const SAMPLE: &str = concat!(
    live_cte!(),
    r#"
dead AS (SELECT topic, count(*) AS n FROM postbox.dead_letters GROUP BY topic),
heads AS (
    SELECT DISTINCT ON (topic, key) topic, last_error FROM postbox.messages WHERE ordered ORDER BY topic, key, id
),
stalled AS (SELECT topic, count(*) AS n FROM heads WHERE last_error IS NOT NULL GROUP BY topic)
SELECT 'depth' AS metric, topic AS label, 'available' AS state, available::float8 AS value FROM live
UNION ALL SELECT 'depth', topic, 'scheduled', scheduled::float8 FROM live
UNION ALL SELECT 'depth', topic, 'running', running::float8 FROM live
UNION ALL SELECT 'oldest_available', topic, '', oldest_available_secs FROM live WHERE oldest_available_secs IS NOT NULL
UNION ALL SELECT 'dead', topic, '', n::float8 FROM dead
UNION ALL SELECT 'stalled', topic, '', n::float8 FROM stalled
UNION ALL SELECT 'dead_tuples', relname::text, '', n_dead_tup::float8 FROM pg_stat_user_tables WHERE schemaname = 'postbox'
UNION ALL SELECT 'live_tuples', relname::text, '', n_live_tup::float8 FROM pg_stat_user_tables WHERE schemaname = 'postbox'
UNION ALL SELECT 'oldest_transaction', '', '',
       coalesce(extract(epoch FROM max(now() - xact_start)), 0)::float8
       FROM pg_stat_activity
       WHERE pid <> pg_backend_pid() AND (backend_xid IS NOT NULL OR backend_xmin IS NOT NULL)
"#
);

/// Every object the store needs, as of the latest migration.
const SCHEMA_READY: &str = "SELECT to_regclass('postbox.messages') IS NOT NULL
    AND to_regclass('postbox.dead_letters') IS NOT NULL
    AND to_regclass('postbox.listeners') IS NOT NULL
    AND to_regprocedure('postbox.claim(integer, double precision, boolean, text[], text[], text[], text[], bigint, text)') IS NOT NULL
    AS ready";

impl Store {
    /// Fails with [`crate::Error::Migration`] unless the database has postbox's schema as of the
    /// latest migration (engines check this before they start, so a missing migration is an error
    /// at startup rather than a relay that silently claims nothing).
    pub async fn check_schema(&self) -> Result<()> {
        #[derive(QueryableByName)]
        struct Ready {
            #[diesel(sql_type = diesel::sql_types::Bool)]
            ready: bool,
        }
        let mut conn = self.conn().await?;
        let r: Ready = diesel::sql_query(SCHEMA_READY)
            .get_result(&mut conn)
            .await?;
        if r.ready {
            Ok(())
        } else {
            Err(crate::Error::Migration(
                "the postbox schema is missing or outdated in this database: run postbox::migrate (or `postbox migrate`)".into(),
            ))
        }
    }

    /// Ordered keys whose head has failed at least once (oldest first, at most `limit`).
    pub async fn stalled_keys(&self, limit: i64) -> Result<Vec<StalledKey>> {
        let mut conn = self.conn().await?;
        Ok(diesel::sql_query(STALLED)
            .bind::<BigInt, _>(limit)
            .load(&mut conn)
            .await?)
    }

    /// The figures of the database gauges (queue depth, oldest available age, dead letters,
    /// stalled keys, dead and live tuples of postbox's tables, the oldest open transaction).
    pub async fn sample(&self) -> Result<Vec<SampleRow>> {
        let mut conn = self.conn().await?;
        Ok(diesel::sql_query(SAMPLE).load(&mut conn).await?)
    }

    /// Depth per topic and state, the age of the oldest available message, dead letters.
    pub async fn stats(&self) -> Result<Stats> {
        let mut conn = self.conn().await?;
        let topics = diesel::sql_query(STATS).load(&mut conn).await?;
        Ok(Stats { topics })
    }
}
