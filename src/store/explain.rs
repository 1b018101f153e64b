//! The plans of the settle statements, as deployed: for operators who wonder why settling is
//! slow, and for the tests that keep the plans honest over backlogs.

use diesel::QueryableByName;
use diesel::sql_types::{Array, BigInt, Double, Integer, Nullable, Text};
use diesel_async::{AsyncConnection, RunQueryDsl};

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

impl Store {
    /// `EXPLAIN (ANALYZE, BUFFERS)` of `statement` settling `leases`, run in a transaction that is
    /// rolled back: nothing is settled.
    pub async fn explain_settle(
        &self,
        statement: SettleStatement,
        leases: &[Lease],
    ) -> Result<String> {
        #[derive(QueryableByName)]
        struct Line {
            #[diesel(sql_type = Text, column_name = "QUERY PLAN")]
            line: String,
        }
        let (ids, tokens) = split(leases.iter().copied());
        let texts = vec!["explain"; leases.len()];
        let delays: Vec<Option<f64>> = vec![None; leases.len()];
        let b = self.backoff;
        let owner = &*self.owner;
        let explain = |sql: &str| format!("EXPLAIN (ANALYZE, BUFFERS) {sql}");
        let mut conn = self.conn().await?;
        let mut plan = String::new();
        let r = conn
            .transaction(async |conn| {
                let q = |sql: &str| {
                    diesel::sql_query(explain(sql))
                        .into_boxed()
                        .bind::<Array<BigInt>, _>(&ids)
                        .bind::<Array<BigInt>, _>(&tokens)
                };
                let lines: Vec<Line> = match statement {
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
                            Some(sink) => {
                                q(COMPLETE_KEEP).bind::<Text, _>(&**sink).load(conn).await?
                            }
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
                Err::<(), _>(diesel::result::Error::RollbackTransaction)
            })
            .await;
        match r {
            Err(diesel::result::Error::RollbackTransaction) => Ok(plan),
            Err(e) => Err(e.into()),
            Ok(()) => unreachable!("the transaction always rolls back"),
        }
    }
}
