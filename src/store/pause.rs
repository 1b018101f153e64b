//! Paused topics (see the migration `pause_and_cancel`): patterns in `postbox.pauses`, read by every
//! engine every second.

use diesel::QueryableByName;
use diesel::sql_types::{Array, Text};
use diesel_async::RunQueryDsl;

use super::{Store, Topics};
use crate::error::{Error, Result};

#[derive(QueryableByName)]
struct Pattern {
    #[diesel(sql_type = Text)]
    pattern: String,
}

impl Store {
    /// Pauses the topics `patterns` match (exact names, or `*` for any run of characters): within
    /// a second or two no engine claims them; deliveries already running finish. Pausing a topic
    /// that has no messages (yet), or one already paused, is fine. Returns how many patterns
    /// were newly paused.
    pub async fn pause(&self, patterns: &[String]) -> Result<usize> {
        check(patterns)?;
        let n = diesel::sql_query(
            "INSERT INTO postbox.pauses (pattern) SELECT unnest($1::text[]) ON CONFLICT DO NOTHING",
        )
        .bind::<Array<Text>, _>(patterns)
        .execute(&mut *self.conn().await?)
        .await?;
        Ok(n)
    }

    /// Resumes the pauses named by exactly these patterns (a topic another pause matches stays
    /// paused). Returns how many pauses were removed.
    pub async fn resume(&self, patterns: &[String]) -> Result<usize> {
        check(patterns)?;
        let n = diesel::sql_query("DELETE FROM postbox.pauses WHERE pattern = ANY($1::text[])")
            .bind::<Array<Text>, _>(patterns)
            .execute(&mut *self.conn().await?)
            .await?;
        Ok(n)
    }

    /// The patterns paused now, sorted.
    pub async fn paused(&self) -> Result<Vec<String>> {
        let rows: Vec<Pattern> =
            diesel::sql_query("SELECT pattern FROM postbox.pauses ORDER BY pattern")
                .load(&mut *self.conn().await?)
                .await?;
        Ok(rows.into_iter().map(|r| r.pattern).collect())
    }
}

fn check(patterns: &[String]) -> Result<()> {
    if patterns.is_empty() {
        return Err(Error::InvalidArgument {
            field: "topics",
            problem: "name at least one topic or pattern".into(),
        });
    }
    if let Some(p) = patterns.iter().find(|p| p.is_empty() || p.contains('\0')) {
        return Err(Error::InvalidArgument {
            field: "topics",
            problem: format!("{p:?} is not a topic or pattern"),
        });
    }
    Ok(())
}

/// What `served` lets through minus the topics `paused` patterns match.
pub fn unpaused(served: &Topics, paused: &[String]) -> Topics {
    if paused.is_empty() {
        served.clone()
    } else {
        served.clone().excluding(&Topics::only(paused))
    }
}
