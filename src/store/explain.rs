//! The plans of the settle statements, as deployed: for operators who wonder why settling is
//! slow, and for the tests that keep the plans honest over backlogs.

use diesel::QueryableByName;
use diesel::sql_types::{Array, BigInt, Double, Integer, Nullable, Text};
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, TransactionManager};

use super::hold::{FOLLOWERS, HeldRow, SETTLE, TAKE_ONE};
use super::settle::{COMPLETE, COMPLETE_KEEP, DEAD_LETTER, EXTEND, RELEASE, RETRY};
use super::{Lease, Store, split};
use crate::error::Result;

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
    /// `-- take`, `-- followers`, `-- settle` line: the take of up to `batch` messages, the take
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
            use diesel_async::SimpleAsyncConnection;
            conn.batch_execute("SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL enable_sort = off; SET LOCAL jit = off")
                .await?;
            let take = |sql: &str| {
                diesel::sql_query(sql.to_owned())
                    .bind::<Double, _>(30.0)
                    .bind::<BigInt, _>(0)
                    .bind::<Text, _>(topic)
                    .bind::<Integer, _>(batch)
            };
            let lines: Vec<PlanLine> = take(&format!("EXPLAIN (ANALYZE, BUFFERS) {TAKE_ONE}"))
                .load(conn)
                .await?;
            plan.push_str("-- take\n");
            plan.extend(lines.into_iter().map(|l| l.line + "\n"));
            let held: Vec<HeldRow> = take(TAKE_ONE).load(conn).await?;
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
