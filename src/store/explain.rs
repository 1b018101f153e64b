//! The plans of the settle statements, as deployed: for operators who wonder why settling is
//! slow, and for the tests that keep the plans honest over backlogs.

use diesel::QueryableByName;
use diesel::sql_types::{Array, BigInt, Double, Integer, Nullable, Text};
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, TransactionManager};

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
}
