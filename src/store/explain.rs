//! The plans of the settle statements, as deployed: for operators who wonder why settling is
//! slow, and for the tests that keep the plans honest over backlogs.

use diesel::QueryableByName;
use diesel::sql_types::{Array, BigInt, Bool, Double, Integer, Nullable, Text};
use diesel_async::SimpleAsyncConnection;
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, TransactionManager};

use super::hold::{FOLLOWERS, HeldReadyRow, SETTLE, TAKE_READY, TAKE_READY_AFTER_ONE};
use super::settle::{COMPLETE, COMPLETE_KEEP, DEAD_LETTER, EXTEND, RELEASE, RETRY};
use super::{Lease, Store, Topics, split};
use crate::error::{Error, Result};

/// One of the statements that settle leased messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettleStatement {
    /// [`Store::complete`] (with retention on, the form that keeps the messages).
    Complete,
    /// [`Store::retry`], every message with the backoff's delay.
    Retry,
    /// [`Store::dead_letter`].
    DeadLetter,
    /// [`Store::release`].
    Release,
    /// [`Store::extend`] (the heartbeat).
    Extend,
}

/// One line of an `EXPLAIN` result.
#[derive(QueryableByName)]
pub(super) struct PlanLine {
    #[diesel(sql_type = Text, column_name = "QUERY PLAN")]
    pub(super) line: String,
}

/// Runs `f` in a transaction that is always rolled back: an `EXPLAIN ANALYZE` runs its statement,
/// and nothing of it stays.
pub(super) async fn rolled_back(
    conn: &mut AsyncPgConnection,
    f: impl AsyncFnOnce(&mut AsyncPgConnection) -> diesel::QueryResult<()>,
) -> Result<()> {
    AnsiTransactionManager::begin_transaction(conn).await?;
    let r = f(conn).await;
    AnsiTransactionManager::rollback_transaction(conn).await?;
    Ok(r?)
}

impl Store {
    /// `EXPLAIN (ANALYZE, BUFFERS)` of `statement` settling `leases`, run in a transaction that is
    /// rolled back: nothing is settled.
    pub async fn explain_settle(
        &self,
        statement: SettleStatement,
        leases: &[Lease],
    ) -> Result<String> {
        let (ids, tokens) = split(leases.iter().copied());
        let texts = vec!["explain"; leases.len()];
        let delays: Vec<Option<f64>> = vec![None; leases.len()];
        let b = self.backoff;
        let owner = &*self.owner;
        let explain = |sql: &str| format!("EXPLAIN (ANALYZE, BUFFERS) {sql}");
        let mut conn = self.conn().await?;
        let mut plan = String::new();
        rolled_back(&mut conn, async |conn| {
            let q = |sql: &str| {
                diesel::sql_query(explain(sql))
                    .into_boxed()
                    .bind::<Array<BigInt>, _>(&ids)
                    .bind::<Array<BigInt>, _>(&tokens)
            };
            let lines: Vec<PlanLine> = match statement {
                SettleStatement::Complete => {
                    let q = |sql| {
                        q(sql)
                            .bind::<Integer, _>(0)
                            .bind::<Double, _>(30.0)
                            .bind::<BigInt, _>(0)
                            .bind::<Text, _>(owner)
                    };
                    match &self.archive {
                        None => q(COMPLETE).load(conn).await?,
                        Some(sink) => q(COMPLETE_KEEP).bind::<Text, _>(&**sink).load(conn).await?,
                    }
                }
                SettleStatement::Retry => {
                    q(RETRY)
                        .bind::<Array<Text>, _>(&texts)
                        .bind::<Array<Nullable<Double>>, _>(&delays)
                        .bind::<Double, _>(b.base.as_secs_f64())
                        .bind::<Double, _>(b.cap.as_secs_f64())
                        .bind::<Double, _>(b.jitter)
                        .bind::<Bool, _>(false)
                        .bind::<Integer, _>(0)
                        .load(conn)
                        .await?
                }
                SettleStatement::DeadLetter => {
                    q(DEAD_LETTER)
                        .bind::<Array<Text>, _>(&texts)
                        .load(conn)
                        .await?
                }
                SettleStatement::Release => q(RELEASE).load(conn).await?,
                SettleStatement::Extend => q(EXTEND).bind::<Double, _>(30.0).load(conn).await?,
            };
            plan.extend(lines.into_iter().map(|l| l.line + "\n"));
            Ok(())
        })
        .await?;
        Ok(plan)
    }

    /// `EXPLAIN (ANALYZE, BUFFERS)` of a held batch of `topic` as deployed, each statement under a
    /// `-- take`, `-- take after`, `-- followers`, `-- settle` line: the take of up to `batch`
    /// messages from the store's floors, the next take while that one is in flight, the take
    /// of up to `followers` messages behind each ordered head among them, and the end of a hold
    /// that delivered the heads (each key hands over to its next message; the settle's plan
    /// counts the buffers of the promotion it calls). Run in a transaction that is rolled back:
    /// nothing is held or settled.
    pub async fn explain_hold(
        &self,
        topic: &str,
        batch: usize,
        followers: usize,
    ) -> Result<String> {
        let batch = i32::try_from(batch).unwrap_or(i32::MAX);
        let followers = i32::try_from(followers).unwrap_or(i32::MAX);
        let owner = &*self.owner;
        let mut conn = self.conn().await?;
        let mut plan = String::new();
        rolled_back(&mut conn, async |conn| {
            conn.batch_execute("SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL enable_sort = off; SET LOCAL enable_incremental_sort = off; SET LOCAL jit = off")
                .await?;
            let floors = self.floors_of(&Some(topic.to_owned()));
            let take = |sql: &str| {
                diesel::sql_query(sql.to_owned())
                    .bind::<Double, _>(30.0)
                    .bind::<BigInt, _>(0)
                    .bind::<Nullable<Text>, _>(Some(topic))
                    .bind::<Integer, _>(batch)
                    .bind::<Nullable<Text>, _>(floors.clone())
            };
            conn.batch_execute("SAVEPOINT take").await?;
            let lines: Vec<PlanLine> = take(&format!("EXPLAIN (ANALYZE, BUFFERS) {TAKE_READY}"))
                .load(conn)
                .await?;
            plan.push_str("-- take\n");
            plan.extend(lines.into_iter().map(|l| l.line + "\n"));
            // What the plan's run locked is taken again for the statements below.
            conn.batch_execute("ROLLBACK TO SAVEPOINT take").await?;
            let held: Vec<HeldReadyRow> = take(TAKE_READY).load(conn).await?;
            // The next take while this one is in flight: after its last row.
            if let Some(last) = held
                .iter()
                .map(|r| (r.held.message.priority, r.ready_xid.as_str(), r.held.message.id))
                .max_by_key(|(p, x, id)| (*p, x.parse::<u64>().unwrap_or(0), *id))
            {
                let lines: Vec<PlanLine> =
                    diesel::sql_query(format!("EXPLAIN (ANALYZE, BUFFERS) {TAKE_READY_AFTER_ONE}"))
                        .bind::<Double, _>(30.0)
                        .bind::<BigInt, _>(0)
                        .bind::<Text, _>(topic)
                        .bind::<Integer, _>(batch)
                        .bind::<Integer, _>(i32::from(last.0))
                        .bind::<Text, _>(last.1)
                        .bind::<BigInt, _>(last.2)
                        .load(conn)
                        .await?;
                plan.push_str("-- take after\n");
                plan.extend(lines.into_iter().map(|l| l.line + "\n"));
            }
            let held: Vec<_> = held.into_iter().map(|r| r.held).collect();
            let heads: Vec<_> = held
                .iter()
                .map(|r| &r.message)
                .filter(|m| m.ordered && m.key.is_some())
                .collect();
            let topics: Vec<&str> = heads.iter().map(|m| m.topic.as_str()).collect();
            let keys: Vec<&str> = heads.iter().filter_map(|m| m.key.as_deref()).collect();
            let ids: Vec<i64> = heads.iter().map(|m| m.id).collect();
            let lines: Vec<PlanLine> =
                diesel::sql_query(format!("EXPLAIN (ANALYZE, BUFFERS) {FOLLOWERS}"))
                    .bind::<Double, _>(30.0)
                    .bind::<BigInt, _>(0)
                    .bind::<Array<Text>, _>(&topics)
                    .bind::<Array<Text>, _>(&keys)
                    .bind::<Array<BigInt>, _>(&ids)
                    .bind::<Integer, _>(followers)
                    .load(conn)
                    .await?;
            plan.push_str("-- followers\n");
            plan.extend(lines.into_iter().map(|l| l.line + "\n"));
            let delivered: Vec<i64> = held.iter().map(|r| r.message.id).collect();
            let lines: Vec<PlanLine> =
                diesel::sql_query(format!("EXPLAIN (ANALYZE, BUFFERS) {SETTLE}"))
                    .bind::<Array<BigInt>, _>(&delivered)
                    .bind::<Array<BigInt>, _>(Vec::<i64>::new())
                    .bind::<Double, _>(30.0)
                    .bind::<BigInt, _>(0)
                    .bind::<Text, _>(owner)
                    .bind::<Integer, _>(batch)
                    .bind::<Array<BigInt>, _>(&ids)
                    .load(conn)
                    .await?;
            plan.push_str("-- settle\n");
            plan.extend(lines.into_iter().map(|l| l.line + "\n"));
            Ok(())
        })
        .await?;
        Ok(plan)
    }
}

/// The statements of the claim functions as deployed, marked in their source by a line
/// `-- explain: NAME` (the claim of one topic named exactly has one statement, after
/// `RETURN QUERY`).
const FUNCTION_SOURCE: &str = "SELECT prosrc AS body FROM pg_proc WHERE oid = $1::regprocedure";
const TAKE_MATCHING: &str = "postbox.take_matching(boolean, text[], text[], text[], text[], integer, double precision, bigint, text, text)";
const WHOLE_MATCHING: &str = concat!(
    "EXPLAIN (ANALYZE, BUFFERS) SELECT * FROM postbox.take_matching($1, $2, $3, $4, $5, $6, 30, 0, 'explain', ",
    floors_in!("$7"),
    ")"
);
const CLAIM_READY: &str =
    "postbox.claim_ready(text, integer, double precision, bigint, text, text)";
const WHOLE_CLAIM: &str = concat!(
    "EXPLAIN (ANALYZE, BUFFERS) SELECT * FROM postbox.claim_ready($1, $2, 30, 0, 'explain', ",
    floors_in!("$3"),
    ")"
);
const TAKE_SET: &str = "postbox.take_set(text[], integer, double precision, bigint, text, text[])";
/// The topics of a set of names with its exclusions, and the most urgent priority among them.
const SET_OF: &str = "SELECT s.topics, (SELECT min(m.priority)::integer FROM postbox.messages m
        WHERE m.state = 'available' AND m.topic = ANY(s.topics)) AS priority
    FROM (SELECT ARRAY(SELECT DISTINCT t FROM unnest($1::text[]) AS u(t)
                       WHERE NOT (t = ANY($2::text[]) OR t LIKE ANY($3::text[]))) AS topics) s";
const WHOLE_SET: &str = concat!(
    "EXPLAIN (ANALYZE, BUFFERS) SELECT * FROM postbox.take_set($1, $2, 30, 0, 'explain', ",
    floors_set_in!("$3"),
    ")"
);
/// The variables of `postbox.take_set`'s marked statement, in the order they are bound.
const SET_VARS: [&str; 4] = ["v_topic", "v_level", "v_floor", "v_batch - v_got"];
const MOST_URGENT: &str = "SELECT min(priority)::integer AS priority FROM postbox.messages
     WHERE state = 'available' AND ($1::text IS NULL OR topic = $1)";
const NARROW: &str = "SELECT postbox.narrow_topics($1, $2, $3, $4, $5, 16) AS topics";

/// The statement of `body` after the line `-- explain: NAME` (or after `RETURN QUERY` when
/// `name` is empty), without its `RETURN QUERY` and `INTO` parts, its variables numbered as
/// `vars` says (`$1` for the first).
fn marked_statement(body: &str, name: &str, vars: &[&str]) -> Option<String> {
    let start = if name.is_empty() {
        body.find("RETURN QUERY")?
    } else {
        let marker = format!("-- explain: {name}\n");
        body.find(&marker)? + marker.len()
    };
    let stmt = body[start..].split(';').next()?;
    let mut out: String = stmt
        .lines()
        .filter(|l| !l.trim_start().starts_with("INTO "))
        .collect::<Vec<_>>()
        .join("\n")
        .replace("RETURN QUERY", "");
    for (i, var) in vars.iter().enumerate() {
        out = replace_word(&out, var, &format!("${}", i + 1));
    }
    Some(out)
}

/// `text` with every `word` that stands alone (not part of a longer identifier) replaced.
fn replace_word(text: &str, word: &str, with: &str) -> String {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(word) {
        let before = rest[..at].chars().next_back();
        let after = rest[at + word.len()..].chars().next();
        out.push_str(&rest[..at]);
        if before.is_some_and(ident) || after.is_some_and(ident) {
            out.push_str(word);
        } else {
            out.push_str(with);
        }
        rest = &rest[at + word.len()..];
    }
    out.push_str(rest);
    out
}

#[derive(QueryableByName)]
struct Body {
    #[diesel(sql_type = Text)]
    body: String,
}

#[derive(QueryableByName)]
struct Narrow {
    #[diesel(sql_type = Nullable<Array<Text>>)]
    topics: Option<Vec<String>>,
}

#[derive(QueryableByName)]
struct Set {
    #[diesel(sql_type = Array<Text>)]
    topics: Vec<String>,
    #[diesel(sql_type = Nullable<Integer>)]
    priority: Option<i32>,
}

#[derive(QueryableByName)]
struct Urgent {
    #[diesel(sql_type = Nullable<Integer>)]
    priority: Option<i32>,
}

#[derive(QueryableByName)]
struct Window {
    #[diesel(sql_type = Nullable<Array<BigInt>>)]
    ids: Option<Vec<i64>>,
}

/// The variables of `postbox.take_matching`'s marked statements, in the order they are bound.
const MATCHING_VARS: [&str; 10] = [
    "v_priority",
    "v_pos_xid",
    "v_pos_id",
    "v_window",
    "p_all_topics",
    "p_topics",
    "p_patterns",
    "p_not_topics",
    "p_not_patterns",
    "v_try",
];

impl Store {
    /// `EXPLAIN (ANALYZE, BUFFERS)` of the claim as deployed, from the front of the claim order:
    /// the statements `postbox.pick` runs for this filter (see the migration `claim_order`), each
    /// under a `-- NAME` line, with the function's planner settings; for one topic named
    /// exactly, the statement of `postbox.claim_topic`. Run in a transaction that is rolled back:
    /// nothing is claimed. For operators, and for the tests that keep the plans honest.
    pub async fn explain_claim(&self, batch: usize, topics: &Topics) -> Result<String> {
        self.explain_claim_parts(batch, topics, false).await
    }

    /// The first part of [`Store::explain_claim`] alone: the whole claim as this store runs it,
    /// from the floors it kept. It leaves out the walks from the front of the claim order (and,
    /// for a filter, the narrowing to its busy topics), which read whatever a pinned xmin horizon
    /// keeps: what a sampler can afford to run every few seconds, as `bench --only xmin` does.
    pub async fn explain_claim_as_run(&self, batch: usize, topics: &Topics) -> Result<String> {
        self.explain_claim_parts(batch, topics, true).await
    }

    async fn explain_claim_parts(
        &self,
        batch: usize,
        topics: &Topics,
        whole_only: bool,
    ) -> Result<String> {
        let mut conn = self.conn().await?;
        let batch = i32::try_from(batch).unwrap_or(i32::MAX);
        let source = async |conn: &mut AsyncPgConnection, f: &str| {
            diesel::sql_query(FUNCTION_SOURCE)
                .bind::<Text, _>(f)
                .get_result::<Body>(conn)
                .await
                .map(|b| b.body)
        };
        let missing = |what: &str| Error::Migration(format!("no statement {what} in the claim"));
        let mut plan = String::new();
        let plain = topics.all && topics.not_exact.is_empty() && topics.not_like.is_empty();
        let single = topics.single().map(str::to_owned);
        if plain || single.is_some() {
            // The claim of every topic or of one topic named exactly: first the whole claim as
            // this store runs it, from the floors it kept (see the migration `ready_positions`);
            // then its scan of the most urgent priority present from the front of its order, as
            // a session with no floors walks it once.
            let floors = self.floors_of(&single);
            let body = source(&mut conn, CLAIM_READY).await?;
            let (name, vars): (&str, &[&str]) = match single {
                None => ("every topic", &["v_priority", "v_from", "v_batch - v_got"]),
                Some(_) => (
                    "one topic",
                    &["v_priority", "v_from", "v_batch - v_got", "p_topic"],
                ),
            };
            let sql = marked_statement(&body, name, vars)
                .ok_or_else(|| missing(name))?
                .replace("$2", "$2::xid8");
            rolled_back(&mut conn, async |conn| {
                conn.batch_execute("SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL enable_sort = off; SET LOCAL enable_incremental_sort = off; SET LOCAL jit = off")
                    .await?;
                conn.batch_execute("SAVEPOINT whole").await?;
                let whole: Vec<PlanLine> = diesel::sql_query(WHOLE_CLAIM)
                    .bind::<Nullable<Text>, _>(&single)
                    .bind::<Integer, _>(batch)
                    .bind::<Nullable<Text>, _>(floors)
                    .load(conn)
                    .await?;
                plan.push_str("-- the claim, from this store's floors\n");
                plan.extend(whole.into_iter().map(|l| l.line + "\n"));
                if whole_only {
                    return Ok(());
                }
                // What it claimed is not claimed for the scan below.
                conn.batch_execute("ROLLBACK TO SAVEPOINT whole").await?;
                let first: Urgent = diesel::sql_query(MOST_URGENT)
                    .bind::<Nullable<Text>, _>(&single)
                    .get_result(conn)
                    .await?;
                let query = diesel::sql_query(format!("EXPLAIN (ANALYZE, BUFFERS) {sql}"))
                    .bind::<Integer, _>(first.priority.unwrap_or(0))
                    .bind::<Text, _>("0")
                    .bind::<Integer, _>(batch);
                let lines: Vec<PlanLine> = match &single {
                    None => query.load(conn).await?,
                    Some(topic) => query.bind::<Text, _>(topic).load(conn).await?,
                };
                match &single {
                    None => plan.push_str("-- every topic\n"),
                    Some(topic) => plan.push_str(&format!("-- topic {topic}\n")),
                }
                plan.extend(lines.into_iter().map(|l| l.line + "\n"));
                Ok(())
            })
            .await?;
            return Ok(plan);
        }
        if !topics.all && topics.like.is_empty() && topics.exact.len() <= 16 {
            // Up to 16 topics named exactly: the whole claim from this store's floors (see the
            // migration `ready_sets`), then its read of the most urgent priority of each topic
            // from the front, as a session with no floors walks it once.
            let body = source(&mut conn, TAKE_SET).await?;
            let name = "the first rows of a priority of a topic of the set";
            let sql = marked_statement(&body, name, &SET_VARS).ok_or_else(|| missing(name))?;
            // Planned as the function plans it: once, for any topic (its statements keep a
            // generic plan), not for the values given here.
            let prepared = format!("postbox_explain_{}", super::new_token().unsigned_abs());
            rolled_back(&mut conn, async |conn| {
                conn.batch_execute("SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL enable_sort = off; SET LOCAL enable_incremental_sort = off; SET LOCAL jit = off")
                    .await?;
                let set: Set = diesel::sql_query(SET_OF)
                    .bind::<Array<Text>, _>(&topics.exact)
                    .bind::<Array<Text>, _>(&topics.not_exact)
                    .bind::<Array<Text>, _>(&topics.not_like)
                    .get_result(conn)
                    .await?;
                conn.batch_execute("SAVEPOINT whole").await?;
                let named: Vec<&str> = set.topics.iter().map(String::as_str).collect();
                let whole: Vec<PlanLine> = diesel::sql_query(WHOLE_SET)
                    .bind::<Array<Text>, _>(&set.topics)
                    .bind::<Integer, _>(batch)
                    .bind::<Array<Nullable<Text>>, _>(self.floors_of_each(&named))
                    .load(conn)
                    .await?;
                plan.push_str("-- the claim, from this store's floors\n");
                plan.extend(whole.into_iter().map(|l| l.line + "\n"));
                if whole_only {
                    return Ok(());
                }
                conn.batch_execute("ROLLBACK TO SAVEPOINT whole").await?;
                conn.batch_execute(&format!(
                    "SET LOCAL plan_cache_mode = force_generic_plan;
                     PREPARE {prepared}(text, integer, xid8, integer) AS {sql}"
                ))
                .await?;
                for topic in &set.topics {
                    // (EXECUTE takes no parameters of the protocol: a literal, quoted.)
                    let lines: Vec<PlanLine> = diesel::sql_query(format!(
                        "EXPLAIN (ANALYZE, BUFFERS) EXECUTE {prepared}('{}', {}, '0', {batch})",
                        topic.replace('\'', "''"),
                        set.priority.unwrap_or(0)
                    ))
                    .load(conn)
                    .await?;
                    plan.push_str(&format!("-- a few topics named exactly: {topic}\n"));
                    plan.extend(lines.into_iter().map(|l| l.line + "\n"));
                }
                conn.batch_execute(&format!("DEALLOCATE {prepared}")).await?;
                Ok(())
            })
            .await?;
            return Ok(plan);
        }
        // Patterns or exclusions (see the migration `filter_floors`): the whole claim from this
        // store's floors of the filter; then, when the filter's busy topics are a few, what the
        // claim of them runs (it takes them from their floors), else its first window from the
        // front of the most urgent priority, as a session with no floors walks it once, and
        // the lock of what the window served.
        let narrow: Narrow = if whole_only {
            Narrow { topics: None }
        } else {
            diesel::sql_query(NARROW)
                .bind::<Bool, _>(topics.all)
                .bind::<Array<Text>, _>(&topics.exact)
                .bind::<Array<Text>, _>(&topics.like)
                .bind::<Array<Text>, _>(&topics.not_exact)
                .bind::<Array<Text>, _>(&topics.not_like)
                .get_result(&mut conn)
                .await?
        };
        let key = Some(topics.floors_key());
        let floors = self.floors_of(&key);
        let body = source(&mut conn, TAKE_MATCHING).await?;
        let window = batch + (batch / 4).max(16);
        rolled_back(&mut conn, async |conn| {
            conn.batch_execute("SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL enable_sort = off; SET LOCAL enable_incremental_sort = off; SET LOCAL jit = off")
                .await?;
            conn.batch_execute("SAVEPOINT whole").await?;
            let whole: Vec<PlanLine> = diesel::sql_query(WHOLE_MATCHING)
                .bind::<Bool, _>(topics.all)
                .bind::<Array<Text>, _>(&topics.exact)
                .bind::<Array<Text>, _>(&topics.like)
                .bind::<Array<Text>, _>(&topics.not_exact)
                .bind::<Array<Text>, _>(&topics.not_like)
                .bind::<Integer, _>(batch)
                .bind::<Nullable<Text>, _>(floors)
                .load(conn)
                .await?;
            plan.push_str("-- the claim, from this store's floors\n");
            plan.extend(whole.into_iter().map(|l| l.line + "\n"));
            conn.batch_execute("ROLLBACK TO SAVEPOINT whole").await?;
            if whole_only || narrow.topics.is_some() {
                return Ok(());
            }
            let first: Urgent = diesel::sql_query(MOST_URGENT)
                .bind::<Nullable<Text>, _>(None::<String>)
                .get_result(conn)
                .await?;
            let mut ids: Vec<i64> = Vec::new();
            for name in ["a window of the filter", "the window's rows of the filter"] {
                let Some(sql) = marked_statement(&body, name, &MATCHING_VARS) else {
                    return Err(diesel::result::Error::QueryBuilderError(
                        format!("no statement {name} in postbox.take_matching").into(),
                    ));
                };
                let sql = sql.replace("$2", "$2::xid8");
                let bind = |q: &str, ids: Vec<i64>| {
                    diesel::sql_query(q.to_owned())
                        .bind::<Integer, _>(first.priority.unwrap_or(0))
                        .bind::<Text, _>("0")
                        .bind::<BigInt, _>(0)
                        .bind::<Integer, _>(window)
                        .bind::<Bool, _>(topics.all)
                        .bind::<Array<Text>, _>(&topics.exact)
                        .bind::<Array<Text>, _>(&topics.like)
                        .bind::<Array<Text>, _>(&topics.not_exact)
                        .bind::<Array<Text>, _>(&topics.not_like)
                        .bind::<Array<BigInt>, _>(ids)
                };
                if name == "a window of the filter" {
                    let w: Vec<Window> = bind(
                        &format!(
                            "SELECT served AS ids FROM ({sql}) AS w(walked, misses, last, served, served_x)"
                        ),
                        Vec::new(),
                    )
                    .load(conn)
                    .await?;
                    ids = w.into_iter().next().and_then(|w| w.ids).unwrap_or_default();
                    ids.truncate(usize::try_from(batch).unwrap_or(usize::MAX));
                }
                let lines: Vec<PlanLine> =
                    bind(&format!("EXPLAIN (ANALYZE, BUFFERS) {sql}"), ids.clone())
                        .load(conn)
                        .await?;
                plan.push_str(&format!("-- {name}\n"));
                plan.extend(lines.into_iter().map(|l| l.line + "\n"));
            }
            Ok(())
        })
        .await?;
        if let Some(busy) = narrow.topics {
            // The claim of the busy topics, from their floors.
            let set = Box::pin(
                self.explain_claim(usize::try_from(batch).unwrap_or(0), &Topics::exact(busy)),
            )
            .await?;
            plan.push_str("-- a few topics: the filter's busy topics\n");
            plan.push_str(&set);
        }
        Ok(plan)
    }
}
