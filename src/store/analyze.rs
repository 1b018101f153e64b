//! A table without statistics (after `pg_upgrade`, a restore, a fresh deploy's first burst): the
//! relay and `postbox migrate` analyze `postbox.messages` when they find it never analyzed, so
//! that every statement plans on real figures from the start, not only the claims (which pin
//! their plans and stay fast without statistics: see `tests/fresh.rs`).

use diesel::QueryableByName;
use diesel::sql_types::Bool;
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};

use super::Store;
use crate::error::Result;

/// Whether the table was never analyzed (by hand or by autovacuum) since its statistics were
/// last reset, and holds rows enough to be worth it (an empty table analyzed would tell the
/// planner it stays empty: its first burst plans better on no statistics at all).
const NEVER_ANALYZED: &str =
    "SELECT coalesce((SELECT last_analyze IS NULL AND last_autoanalyze IS NULL
    FROM pg_catalog.pg_stat_user_tables WHERE relid = 'postbox.messages'::regclass), false)
    AND (SELECT count(*) FROM (SELECT 1 FROM postbox.messages LIMIT 1000) r) >= 1000 AS never";

/// Whether this session may analyze it (its owner, or a superuser).
const MAY_ANALYZE: &str = "SELECT pg_catalog.pg_has_role(c.relowner, 'USAGE')
    OR (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user) AS never
    FROM pg_catalog.pg_class c WHERE c.oid = 'postbox.messages'::regclass";

#[derive(QueryableByName)]
struct Flag {
    #[diesel(sql_type = Bool)]
    never: bool,
}

/// What [`Store::analyze_if_never_analyzed`] found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Analyzed {
    /// The table had statistics, or holds fewer than 1,000 rows: nothing done.
    HadStatistics,
    /// It had none, and was analyzed now.
    Now,
    /// It had none, and this role may not analyze it (not its owner): the schema's owner should.
    NotAllowed,
}

impl Store {
    /// Analyzes `postbox.messages` if it was never analyzed and holds 1,000 rows or more (a
    /// sample of 30,000 rows whatever its size; it takes a lock that writers, claims and settles
    /// do not wait for). Safe while everything runs.
    pub async fn analyze_if_never_analyzed(&self) -> Result<Analyzed> {
        let mut conn = self.conn().await?;
        let never: Flag = diesel::sql_query(NEVER_ANALYZED)
            .get_result(&mut conn)
            .await?;
        if !never.never {
            return Ok(Analyzed::HadStatistics);
        }
        let may: Flag = diesel::sql_query(MAY_ANALYZE).get_result(&mut conn).await?;
        if !may.never {
            return Ok(Analyzed::NotAllowed);
        }
        conn.batch_execute("ANALYZE postbox.messages").await?;
        Ok(Analyzed::Now)
    }
}
