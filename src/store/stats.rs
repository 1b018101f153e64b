//! Queue statistics for `status` and the metrics: their cost grows with the number of topics,
//! never with the number of rows.
//!
//! Below [`EXACT_LIMIT`] live messages (and dead letters) every figure is an exact count. Above
//! it, running messages are still counted exactly (they are few: what relays hold), available ones
//! exactly per topic up to [`EXACT_LIMIT`] through the claim index, and the rest (scheduled,
//! waiting, large available backlogs, dead letters) is estimated from a sample of about
//! [`SAMPLE_ROWS`] rows; [`Stats::estimated`] says so.

use std::collections::BTreeMap;

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Double, Nullable, Text};
use diesel_async::{AsyncConnection, RunQueryDsl, SimpleAsyncConnection};

use super::Store;
use crate::error::Result;

/// Up to this many live messages (or dead letters) the figures are exact counts.
pub const EXACT_LIMIT: i64 = 50_000;
/// About this many rows are sampled to estimate the figures of a larger table.
pub const SAMPLE_ROWS: f64 = 20_000.0;
/// On a large table, a topic's available messages are counted exactly through the claim index up
/// to this many (a small topic may be missed by the sample); above, the sample's estimate is used.
pub const TOPIC_EXACT_LIMIT: i64 = 1_000;

/// Depth of one topic.
#[derive(Debug, Clone, Default, PartialEq, QueryableByName, serde::Serialize)]
pub struct TopicStats {
    /// The topic.
    #[diesel(sql_type = Text)]
    pub topic: String,
    /// Claimable now.
    #[diesel(sql_type = BigInt)]
    pub available: i64,
    /// Waiting for their `run_at` (delayed, or backing off after a failure).
    #[diesel(sql_type = BigInt)]
    pub scheduled: i64,
    /// Leased by a relay.
    #[diesel(sql_type = BigInt)]
    pub running: i64,
    /// Ordered messages waiting behind the head of their key.
    #[diesel(sql_type = BigInt)]
    pub waiting: i64,
    /// In the dead letters.
    #[diesel(sql_type = BigInt)]
    pub dead: i64,
    /// Seconds the next message to be claimed has been claimable.
    #[diesel(sql_type = Nullable<Double>)]
    pub oldest_available_secs: Option<f64>,
}

/// Depth of every topic that has live or dead messages.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Stats {
    /// Per topic, the largest first.
    pub topics: Vec<TopicStats>,
    /// True when some figures are estimates (a table above [`EXACT_LIMIT`] rows).
    pub estimated: bool,
}

impl Stats {
    /// Messages in the dead letters, all topics.
    pub fn dead_total(&self) -> i64 {
        self.topics.iter().map(|t| t.dead).sum()
    }

    /// Live messages (available, scheduled, running or waiting), all topics.
    pub fn live_total(&self) -> i64 {
        self.topics
            .iter()
            .map(|t| t.available + t.scheduled + t.running + t.waiting)
            .sum()
    }
}

/// Live tuples of a table as the statistics system counts them: O(1), a little behind.
const LIVE_ESTIMATE: &str = "SELECT greatest(coalesce(s.n_live_tup, 0), c.reltuples::bigint) AS n
    FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
    WHERE c.oid = $1::regclass";

/// Exact depth of a small table: at most $1 rows are read (the caller checks it did not hit that).
const EXACT_LIVE: &str = r#"
SELECT topic,
       count(*) FILTER (WHERE state = 'available') AS available,
       count(*) FILTER (WHERE state = 'scheduled') AS scheduled,
       count(*) FILTER (WHERE state = 'running') AS running,
       count(*) FILTER (WHERE state = 'waiting') AS waiting,
       0::bigint AS dead,
       extract(epoch FROM now() - min(run_at) FILTER (WHERE state = 'available'))::float8 AS oldest_available_secs
FROM (SELECT topic, state, run_at FROM postbox.messages LIMIT $1) m
GROUP BY topic
"#;

const EXACT_DEAD: &str = r#"
SELECT topic, count(*) AS n FROM (SELECT topic FROM postbox.dead_letters LIMIT $1) d GROUP BY topic
"#;

/// Per topic with available messages (one index descent per topic): available counted exactly up
/// to $1, and the age of the next message to be claimed.
const AVAILABLE_BY_INDEX: &str = r#"
SELECT t AS topic,
       (SELECT count(*) FROM (SELECT 1 FROM postbox.messages m
                              WHERE m.state = 'available' AND m.topic = u.t LIMIT $1) c) AS n,
       (SELECT extract(epoch FROM now() - m.run_at)::float8 FROM postbox.messages m
        WHERE m.state = 'available' AND m.topic = u.t ORDER BY m.priority, m.id LIMIT 1) AS oldest
FROM unnest(postbox.available_topics(true, '{}', '{}', '{}', '{}')) AS u(t)
"#;

/// The intake's rows no relay has moved yet (migration `intake`), per topic, at most $1 read:
/// available (or scheduled) messages like any other.
const EXACT_INTAKE: &str = r#"
SELECT topic,
       count(*) FILTER (WHERE run_at <= now()) AS available,
       count(*) FILTER (WHERE run_at > now()) AS scheduled,
       0::bigint AS running,
       0::bigint AS waiting,
       0::bigint AS dead,
       extract(epoch FROM now() - min(run_at) FILTER (WHERE run_at <= now()))::float8 AS oldest_available_secs
FROM (SELECT topic, run_at FROM postbox.intake LIMIT $1) i
GROUP BY topic
"#;

/// Dead tuples of the intake as the statistics system counts them. A relay moving under a pinned
/// xmin horizon leaves every moved row as one; past [`INTAKE_SCAN_DEAD_MAX`] the intake is not
/// read for the figures (its live rows are then the few a running relay has not moved yet).
const INTAKE_DEAD: &str = "SELECT coalesce((SELECT n_dead_tup FROM pg_stat_user_tables
    WHERE relid = 'postbox.intake'::regclass), 0)::bigint AS n";

/// See [`INTAKE_DEAD`].
const INTAKE_SCAN_DEAD_MAX: i64 = 100_000;

const RUNNING: &str = "SELECT topic, count(*) AS n, NULL::float8 AS oldest
    FROM postbox.messages WHERE state = 'running' GROUP BY topic";

/// A sample of live messages: (topic, state, rows seen). $1: the percentage of pages.
const SAMPLE_LIVE: &str = "SELECT topic, state::text AS state, count(*) AS n
    FROM postbox.messages TABLESAMPLE SYSTEM ($1) GROUP BY topic, state";

const SAMPLE_DEAD: &str = "SELECT topic, 'dead' AS state, count(*) AS n
    FROM postbox.dead_letters TABLESAMPLE SYSTEM ($1) GROUP BY topic";

#[derive(QueryableByName)]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

#[derive(QueryableByName)]
struct TopicN {
    #[diesel(sql_type = Text)]
    topic: String,
    #[diesel(sql_type = BigInt)]
    n: i64,
}

#[derive(QueryableByName)]
struct TopicCount {
    #[diesel(sql_type = Text)]
    topic: String,
    #[diesel(sql_type = BigInt)]
    n: i64,
    #[diesel(sql_type = Nullable<Double>)]
    oldest: Option<f64>,
}

#[derive(QueryableByName)]
struct Sampled {
    #[diesel(sql_type = Text)]
    topic: String,
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// The head of an ordered key that has failed and so holds back the messages behind it.
#[derive(Debug, Clone, PartialEq, QueryableByName, serde::Serialize)]
pub struct StalledKey {
    /// The key's topic.
    #[diesel(sql_type = Text)]
    pub topic: String,
    /// The key.
    #[diesel(sql_type = Text)]
    pub key: String,
    /// The head message.
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    /// Attempts the head has used.
    #[diesel(sql_type = diesel::sql_types::Integer)]
    pub attempts: i32,
    /// Seconds since the head was enqueued.
    #[diesel(sql_type = Double)]
    pub age_secs: f64,
    /// The head's last error.
    #[diesel(sql_type = Nullable<Text>)]
    pub last_error: Option<String>,
    /// Messages of the key waiting behind the head (counted up to 100,000).
    #[diesel(sql_type = BigInt)]
    pub waiting: i64,
}

/// Heads that have failed, through messages_stalled_idx: the cost is the number of such heads.
/// A replayed head carries its old error but has not failed again until it is tried
/// (`attempts > 0`): it is no stalled key.
const STALLED: &str = r#"
SELECT h.topic, h.key, h.id, h.attempts,
       extract(epoch FROM now() - h.created_at)::float8 AS age_secs, h.last_error,
       (SELECT count(*) FROM (SELECT 1 FROM postbox.messages w
                              WHERE w.state = 'waiting' AND w.topic = h.topic AND w.key = h.key
                              LIMIT 100000) c) AS waiting
FROM postbox.messages h
WHERE h.ordered AND h.state <> 'waiting' AND h.last_error IS NOT NULL AND h.attempts > 0
ORDER BY h.created_at
LIMIT $1
"#;

const STALLED_PER_TOPIC: &str = "SELECT topic, count(*) AS n FROM postbox.messages
    WHERE ordered AND state <> 'waiting' AND last_error IS NOT NULL AND attempts > 0 GROUP BY topic";

/// One figure of a metrics sample.
#[derive(Debug, Clone, PartialEq, QueryableByName, serde::Serialize, serde::Deserialize)]
pub struct SampleRow {
    /// depth, oldest_available, dead, stalled, dead_tuples, live_tuples, oldest_transaction,
    /// horizon (the oldest transaction's holder), slot_xmin, sample_seconds (what computing the
    /// sample took)
    #[diesel(sql_type = Text)]
    pub metric: String,
    /// Topic or table.
    #[diesel(sql_type = Text)]
    pub label: String,
    /// Message state, for depth.
    #[diesel(sql_type = Text)]
    pub state: String,
    /// The figure.
    #[diesel(sql_type = Double)]
    pub value: f64,
}

/// The database's own figures: dead and live tuples of postbox's tables, the oldest transaction.
const TABLE_FIGURES: &str = r#"
SELECT 'dead_tuples' AS metric, relname::text AS label, '' AS state, n_dead_tup::float8 AS value
FROM pg_stat_user_tables WHERE schemaname = 'postbox'
UNION ALL SELECT 'live_tuples', relname::text, '', n_live_tup::float8
FROM pg_stat_user_tables WHERE schemaname = 'postbox'
UNION ALL SELECT 'oldest_transaction', '', '',
       coalesce(extract(epoch FROM max(now() - xact_start)), 0)::float8
       FROM pg_stat_activity
       WHERE pid <> pg_backend_pid() AND (backend_xid IS NOT NULL OR backend_xmin IS NOT NULL)
UNION ALL (SELECT 'horizon', pid::text || '|' || left(coalesce(application_name, ''), 64) || '|' || coalesce(state, ''),
       '', extract(epoch FROM now() - xact_start)::float8
       FROM pg_stat_activity
       WHERE datname = current_database() AND pid <> pg_backend_pid() AND xact_start IS NOT NULL
         AND (backend_xid IS NOT NULL OR backend_xmin IS NOT NULL)
       ORDER BY xact_start LIMIT 1)
UNION ALL (SELECT 'horizon', '|' || left(gid, 64) || '|prepared', '', extract(epoch FROM now() - prepared)::float8
       FROM pg_prepared_xacts WHERE database = current_database() ORDER BY prepared LIMIT 1)
UNION ALL SELECT 'slot_xmin', slot_name::text, '', age(xmin)::float8
       FROM pg_replication_slots WHERE xmin IS NOT NULL
"#;

/// One relay computes the sample at a time (its turn: a row lock no role below relay can take);
/// the others read what it stored.
const SAMPLE_LEADER: &str = "WITH turn AS (
    SELECT 1 FROM postbox.turns WHERE name = 'sample' FOR UPDATE SKIP LOCKED
)
SELECT CASE WHEN EXISTS (SELECT 1 FROM turn)
        AND coalesce((SELECT taken_at < now() - make_interval(secs => $1) FROM postbox.samples), true)
    THEN 1 ELSE 0 END::bigint AS n";
const SAMPLE_STORE: &str = "INSERT INTO postbox.samples (taken_at, body) VALUES (now(), $1::jsonb)
    ON CONFLICT (singleton) DO UPDATE SET taken_at = excluded.taken_at, body = excluded.body";
const SAMPLE_READ: &str = "SELECT body::text AS body FROM postbox.samples";

/// Every object the store needs, as of the latest migration.
const SCHEMA_READY: &str = "SELECT to_regclass('postbox.messages') IS NOT NULL
    AND to_regclass('postbox.dead_letters') IS NOT NULL
    AND to_regclass('postbox.listeners') IS NOT NULL
    AND to_regclass('postbox.samples') IS NOT NULL
    AND to_regprocedure('postbox.claim(integer, double precision, boolean, text[], text[], text[], text[], bigint, text)') IS NOT NULL
    AND to_regprocedure('postbox.promote_due(integer, timestamptz)') IS NOT NULL
    AND to_regprocedure('postbox.hand_over(text[], text[], bigint[], integer, double precision, bigint, text)') IS NOT NULL
    AND to_regprocedure('postbox.lost_holds()') IS NOT NULL
    AND to_regprocedure('postbox.kept_head_lease()') IS NOT NULL
    AND to_regclass('postbox.turns') IS NOT NULL
    AND to_regprocedure('postbox.finish_heads(integer, timestamptz)') IS NOT NULL
    AND to_regclass('postbox.pauses') IS NOT NULL
    AND to_regclass('postbox.schedules') IS NOT NULL
    AND to_regclass('postbox.completed') IS NOT NULL
    AND to_regprocedure('postbox.take_ready(text, integer, text)') IS NOT NULL
    AND to_regprocedure('postbox.boot_start()') IS NOT NULL
    AND to_regprocedure('postbox.claim_limited(text, integer, boolean, boolean, text[], text[], integer, double precision, boolean, text[], text[], text[], text[], bigint, text)') IS NOT NULL
    AS ready";

type Conn = diesel_async::AsyncPgConnection;

/// The live rows of `table` as the statistics system counts them.
async fn live_estimate(conn: &mut Conn, table: &str) -> Result<i64> {
    let r: N = diesel::sql_query(LIVE_ESTIMATE)
        .bind::<Text, _>(table)
        .get_result(conn)
        .await?;
    Ok(r.n)
}

/// The percentage of pages to sample for about [`SAMPLE_ROWS`] of `rows`.
fn sample_percent(rows: i64) -> f64 {
    (100.0 * SAMPLE_ROWS / rows.max(1) as f64).clamp(0.01, 100.0)
}

async fn exact_live(conn: &mut Conn) -> Result<Option<Vec<TopicStats>>> {
    let rows: Vec<TopicStats> = diesel::sql_query(EXACT_LIVE)
        .bind::<BigInt, _>(EXACT_LIMIT + 1)
        .load(conn)
        .await?;
    let seen: i64 = rows
        .iter()
        .map(|t| t.available + t.scheduled + t.running + t.waiting)
        .sum();
    Ok((seen <= EXACT_LIMIT).then_some(rows))
}

async fn estimated_live(conn: &mut Conn, rows: i64) -> Result<Vec<TopicStats>> {
    let mut by_topic: BTreeMap<String, TopicStats> = BTreeMap::new();
    let pct = sample_percent(rows);
    let sampled: Vec<Sampled> = diesel::sql_query(SAMPLE_LIVE)
        .bind::<Double, _>(pct)
        .load(conn)
        .await?;
    for s in sampled {
        let t = topic_entry(&mut by_topic, &s.topic);
        let n = (s.n as f64 * 100.0 / pct).round() as i64;
        match s.state.as_str() {
            "available" => t.available = n,
            "scheduled" => t.scheduled = n,
            "waiting" => t.waiting = n,
            _ => {} // running: counted exactly below
        }
    }
    let available: Vec<TopicCount> = diesel::sql_query(AVAILABLE_BY_INDEX)
        .bind::<BigInt, _>(TOPIC_EXACT_LIMIT + 1)
        .load(conn)
        .await?;
    for a in available {
        let t = topic_entry(&mut by_topic, &a.topic);
        if a.n <= TOPIC_EXACT_LIMIT {
            t.available = a.n;
        }
        t.oldest_available_secs = a.oldest;
    }
    let running: Vec<TopicCount> = diesel::sql_query(RUNNING).load(conn).await?;
    for r in running {
        topic_entry(&mut by_topic, &r.topic).running = r.n;
    }
    Ok(by_topic.into_values().collect())
}

fn topic_entry<'a>(m: &'a mut BTreeMap<String, TopicStats>, topic: &str) -> &'a mut TopicStats {
    m.entry(topic.to_owned()).or_insert_with(|| TopicStats {
        topic: topic.to_owned(),
        ..TopicStats::default()
    })
}

/// Dead letters per topic, and whether they are estimated.
async fn dead(conn: &mut Conn) -> Result<(Vec<TopicN>, bool)> {
    let rows = live_estimate(conn, "postbox.dead_letters").await?;
    if rows <= EXACT_LIMIT {
        let exact: Vec<TopicN> = diesel::sql_query(EXACT_DEAD)
            .bind::<BigInt, _>(EXACT_LIMIT + 1)
            .load(conn)
            .await?;
        if exact.iter().map(|t| t.n).sum::<i64>() <= EXACT_LIMIT {
            return Ok((exact, false));
        }
    }
    let pct = sample_percent(rows);
    let sampled: Vec<Sampled> = diesel::sql_query(SAMPLE_DEAD)
        .bind::<Double, _>(pct)
        .load(conn)
        .await?;
    Ok((
        sampled
            .into_iter()
            .map(|s| TopicN {
                topic: s.topic,
                n: (s.n as f64 * 100.0 / pct).round() as i64,
            })
            .collect(),
        true,
    ))
}

/// Adds what writers committed to the intake and no relay has moved yet to the topics' available
/// and scheduled messages; true when that part is estimated (or left out: see [`INTAKE_DEAD`]).
async fn add_intake(conn: &mut Conn, by_topic: &mut BTreeMap<String, TopicStats>) -> Result<bool> {
    let dead: N = diesel::sql_query(INTAKE_DEAD).get_result(conn).await?;
    if dead.n > INTAKE_SCAN_DEAD_MAX {
        return Ok(true);
    }
    let rows: Vec<TopicStats> = diesel::sql_query(EXACT_INTAKE)
        .bind::<BigInt, _>(EXACT_LIMIT + 1)
        .load(conn)
        .await?;
    let read: i64 = rows.iter().map(|r| r.available + r.scheduled).sum();
    let scale = if read > EXACT_LIMIT {
        (live_estimate(conn, "postbox.intake").await?.max(read) as f64) / read as f64
    } else {
        1.0
    };
    for r in rows {
        let t = topic_entry(by_topic, &r.topic);
        t.available += (r.available as f64 * scale).round() as i64;
        t.scheduled += (r.scheduled as f64 * scale).round() as i64;
        t.oldest_available_secs = match (t.oldest_available_secs, r.oldest_available_secs) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
    Ok(scale != 1.0)
}

/// The whole depth picture, on one connection, with the claim index's planner settings.
async fn stats_on(conn: &mut Conn) -> Result<Stats> {
    conn.transaction(async |conn| {
        conn.batch_execute("SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL jit = off")
            .await?;
        let rows = live_estimate(conn, "postbox.messages").await?;
        let (mut topics, mut estimated) = match rows <= EXACT_LIMIT {
            true => match exact_live(conn).await? {
                Some(t) => (t, false),
                None => (estimated_live(conn, rows.max(EXACT_LIMIT + 1)).await?, true),
            },
            false => (estimated_live(conn, rows).await?, true),
        };
        let (dead, dead_estimated) = dead(conn).await?;
        estimated |= dead_estimated;
        let mut by_topic: BTreeMap<String, TopicStats> =
            topics.drain(..).map(|t| (t.topic.clone(), t)).collect();
        estimated |= add_intake(conn, &mut by_topic).await?;
        for d in dead {
            topic_entry(&mut by_topic, &d.topic).dead = d.n;
        }
        Ok::<_, crate::Error>(Stats {
            topics: by_topic.into_values().collect(),
            estimated,
        })
    })
    .await
}

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

    /// Depth per topic and state, the age of the next available message, dead letters. Exact on
    /// small tables, partly estimated on large ones ([`Stats::estimated`]).
    pub async fn stats(&self) -> Result<Stats> {
        let mut conn = self.conn().await?;
        stats_on(&mut conn).await
    }

    /// The figures of the database gauges (queue depth, oldest available age, dead letters,
    /// stalled keys, dead and live tuples of postbox's tables, the oldest open transaction).
    ///
    /// One relay at a time computes them, at most once per `every`, and stores them in
    /// `postbox.samples`; the others read that copy. So the cost on the database does not grow
    /// with the number of replicas.
    pub async fn sample(&self, every: std::time::Duration) -> Result<Vec<SampleRow>> {
        #[derive(QueryableByName)]
        struct Body {
            #[diesel(sql_type = Text)]
            body: String,
        }
        let mut conn = self.conn().await?;
        let body = conn
            .transaction(async |conn| {
                let lead: N = diesel::sql_query(SAMPLE_LEADER)
                    .bind::<Double, _>(every.as_secs_f64() * 0.9)
                    .get_result(conn)
                    .await?;
                if lead.n == 1 {
                    let rows = compute_sample(conn).await?;
                    let body = serde_json::to_string(&rows).expect("sample rows are JSON");
                    diesel::sql_query(SAMPLE_STORE)
                        .bind::<Text, _>(&body)
                        .execute(conn)
                        .await?;
                    return Ok::<_, crate::Error>(Some(rows));
                }
                let stored: Option<Body> = diesel::sql_query(SAMPLE_READ)
                    .get_result(conn)
                    .await
                    .map(Some)
                    .or_else(|e| match e {
                        diesel::result::Error::NotFound => Ok(None),
                        e => Err(e),
                    })?;
                Ok(stored.and_then(|b| serde_json::from_str(&b.body).ok()))
            })
            .await?;
        match body {
            Some(rows) => Ok(rows),
            // Nothing stored yet and another relay is computing it: compute without storing.
            None => compute_sample(&mut conn).await,
        }
    }
}

async fn compute_sample(conn: &mut Conn) -> Result<Vec<SampleRow>> {
    let began = std::time::Instant::now();
    let stats = stats_on(conn).await?;
    let mut rows = Vec::new();
    for t in &stats.topics {
        for (state, n) in [
            ("available", t.available),
            ("scheduled", t.scheduled),
            ("running", t.running),
            ("waiting", t.waiting),
        ] {
            rows.push(SampleRow {
                metric: "depth".into(),
                label: t.topic.clone(),
                state: state.into(),
                value: n as f64,
            });
        }
        if let Some(age) = t.oldest_available_secs {
            rows.push(SampleRow {
                metric: "oldest_available".into(),
                label: t.topic.clone(),
                state: String::new(),
                value: age,
            });
        }
        if t.dead > 0 {
            rows.push(SampleRow {
                metric: "dead".into(),
                label: t.topic.clone(),
                state: String::new(),
                value: t.dead as f64,
            });
        }
    }
    let stalled: Vec<TopicN> = diesel::sql_query(STALLED_PER_TOPIC).load(conn).await?;
    rows.extend(stalled.into_iter().map(|s| SampleRow {
        metric: "stalled".into(),
        label: s.topic,
        state: String::new(),
        value: s.n as f64,
    }));
    let figures: Vec<SampleRow> = diesel::sql_query(TABLE_FIGURES).load(conn).await?;
    rows.extend(figures);
    // What it cost, for every relay's sampler to keep within its budget.
    rows.push(SampleRow {
        metric: "sample_seconds".into(),
        label: String::new(),
        state: String::new(),
        value: began.elapsed().as_secs_f64(),
    });
    Ok(rows)
}
