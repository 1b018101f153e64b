//! Running limits: claims that keep the running messages of some topics at or under a maximum,
//! across every relay (`postbox.claim_limited`: claims of one limit take turns on its row of
//! `postbox.turns` and count what is running first).

use std::time::Duration;

use diesel::QueryableByName;
use diesel::sql_types::{Array, BigInt, Bool, Double, Integer, Text};
use diesel_async::RunQueryDsl;

use super::{ClaimedMessage, Store, Topics};
use crate::error::{Error, Result};

/// At most `max_running` messages of `topics` running at once across every relay (or, with
/// `per_key`, at most that many per key; messages without a key count as one key). Every relay
/// and engine that claims these topics must carry the same limit: the limit is enforced by the
/// claims that know it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    name: String,
    patterns: Vec<String>,
    topics: Topics,
    max_running: u32,
    per_key: bool,
}

impl Limit {
    /// A limit on `topics` (exact names, or globs as in a route: `emails.*`).
    pub fn new<I, S>(topics: I, max_running: u32) -> Result<Self>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut patterns: Vec<String> = topics.into_iter().map(|s| s.as_ref().to_owned()).collect();
        if patterns.is_empty() || patterns.iter().any(|p| p.is_empty()) {
            return Err(Error::InvalidArgument {
                field: "topics",
                problem: "must list at least one non-empty topic or pattern".into(),
            });
        }
        if max_running == 0 {
            return Err(Error::InvalidArgument {
                field: "max_running",
                problem: "must be at least 1".into(),
            });
        }
        patterns.sort_unstable();
        patterns.dedup();
        Ok(Limit {
            name: patterns.join(","),
            topics: Topics::only(&patterns),
            patterns,
            max_running,
            per_key: false,
        })
    }

    /// At most `max_running` per key instead of in all.
    pub fn per_key(mut self, per_key: bool) -> Self {
        self.per_key = per_key;
        self
    }

    /// Claims of limits of the same name take turns: by default the sorted topic patterns, so
    /// relays configured alike share it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The topic patterns, sorted.
    pub fn patterns(&self) -> &[String] {
        &self.patterns
    }

    /// The topics it covers.
    pub fn topics(&self) -> &Topics {
        &self.topics
    }

    /// At most this many running at once (in all, or per key).
    pub fn max_running(&self) -> u32 {
        self.max_running
    }

    /// Whether the limit counts per key.
    pub fn is_per_key(&self) -> bool {
        self.per_key
    }
}

const CLAIM_LIMITED: &str = r#"
SELECT id, topic, key, ordered, payload, headers, priority, run_at, attempts, max_attempts,
       created_at, locked_until, lease_token, last_error, dedup_key
FROM postbox.claim_limited($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
"#;

/// Running messages of a limit's topics: in all (`key` NULL), or of its busiest key.
const RUNNING: &str = "SELECT coalesce(max(n), 0)::bigint AS n FROM (
    SELECT count(*) AS n FROM postbox.messages m
    WHERE m.state = 'running' AND ($1 OR m.topic = ANY($2) OR m.topic LIKE ANY($3))
    GROUP BY CASE WHEN $4 THEN m.key END) per";

#[derive(QueryableByName)]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

impl Store {
    /// Leases up to `batch` messages of the limit's topics that `topics` lets through, as many as
    /// the limit has room for now (see [`Limit`]), in (priority, id) order per topic.
    pub async fn claim_limited(
        &self,
        limit: &Limit,
        batch: usize,
        lease: Duration,
        topics: &Topics,
    ) -> Result<Vec<ClaimedMessage>> {
        if batch == 0 || topics.is_empty() {
            return Ok(Vec::new());
        }
        self.finish_before_claim().await;
        let mut conn = self.conn().await?;
        let l = &limit.topics;
        let mut rows: Vec<ClaimedMessage> = diesel::sql_query(CLAIM_LIMITED)
            .bind::<Text, _>(&limit.name)
            .bind::<Integer, _>(i32::try_from(limit.max_running).unwrap_or(i32::MAX))
            .bind::<Bool, _>(limit.per_key)
            .bind::<Bool, _>(l.all)
            .bind::<Array<Text>, _>(&l.exact)
            .bind::<Array<Text>, _>(&l.like)
            .bind::<Integer, _>(i32::try_from(batch).unwrap_or(i32::MAX))
            .bind::<Double, _>(lease.as_secs_f64())
            .bind::<Bool, _>(topics.all)
            .bind::<Array<Text>, _>(&topics.exact)
            .bind::<Array<Text>, _>(&topics.like)
            .bind::<Array<Text>, _>(&topics.not_exact)
            .bind::<Array<Text>, _>(&topics.not_like)
            .bind::<BigInt, _>(super::new_token())
            .bind::<Text, _>(&*self.owner)
            .load(&mut conn)
            .await?;
        rows.sort_unstable_by_key(|m| (m.priority, m.id));
        Ok(rows)
    }

    /// Messages of the limit's topics running now across every relay (with `per_key`: those of
    /// its busiest key), to compare with [`Limit::max_running`].
    pub async fn limit_running(&self, limit: &Limit) -> Result<i64> {
        let mut conn = self.conn().await?;
        let l = &limit.topics;
        let r: N = diesel::sql_query(RUNNING)
            .bind::<Bool, _>(l.all)
            .bind::<Array<Text>, _>(&l.exact)
            .bind::<Array<Text>, _>(&l.like)
            .bind::<Bool, _>(limit.per_key)
            .get_result(&mut conn)
            .await?;
        Ok(r.n)
    }
}
