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

const STATS: &str = r#"
WITH live AS (
    SELECT topic,
           count(*) FILTER (WHERE locked_until IS NULL AND run_at <= now()) AS available,
           count(*) FILTER (WHERE locked_until IS NULL AND run_at > now()) AS scheduled,
           count(*) FILTER (WHERE locked_until IS NOT NULL) AS running,
           extract(epoch FROM now() - min(run_at) FILTER (WHERE locked_until IS NULL AND run_at <= now()))::float8
               AS oldest_available_secs
    FROM postbox.messages
    GROUP BY topic
),
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
"#;

/// Every object the store needs, as of the latest migration.
const SCHEMA_READY: &str = "SELECT to_regclass('postbox.messages') IS NOT NULL
    AND to_regclass('postbox.dead_letters') IS NOT NULL
    AND to_regclass('postbox.listeners') IS NOT NULL
    AND to_regprocedure('postbox.claim(integer, double precision, boolean, text[], text[], bigint, text)') IS NOT NULL
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

    /// Depth per topic and state, the age of the oldest available message, dead letters.
    pub async fn stats(&self) -> Result<Stats> {
        let mut conn = self.conn().await?;
        let topics = diesel::sql_query(STATS).load(&mut conn).await?;
        Ok(Stats { topics })
    }
}
