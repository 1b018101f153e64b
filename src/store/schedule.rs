//! The scheduler's transition: scheduled → available once `run_at` has come.

use std::time::Duration;

use diesel::QueryableByName;
use diesel::sql_types::{Double, Integer, Nullable};
use diesel_async::RunQueryDsl;

use super::Store;
use super::upkeep::Walk;
use crate::error::Result;

/// Rows `promote_due` moves per statement.
pub const PROMOTE_BATCH: i32 = 5_000;

/// What one call of [`Store::promote_due`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Promoted {
    /// Messages that became available.
    pub promoted: usize,
    /// The next scheduled message is due in this long (`None`: nothing is scheduled).
    pub next_due: Option<Duration>,
}

#[derive(QueryableByName)]
struct Row {
    #[diesel(sql_type = Integer)]
    promoted: i32,
    #[diesel(sql_type = Nullable<Double>)]
    next_due_secs: Option<f64>,
    #[diesel(sql_type = Double)]
    walked_to: f64,
}

const PROMOTE_DUE: &str =
    "SELECT promoted, next_due_secs, walked_to FROM postbox.promote_due($1, to_timestamp($2))";

impl Store {
    /// Makes due scheduled messages (delayed, or backing off after a failure) available, at most
    /// [`PROMOTE_BATCH`] per call, and says when the next one is due. Safe on every replica at
    /// once; waiting relays are woken when something was promoted.
    pub async fn promote_due(&self) -> Result<Promoted> {
        // Delayed messages in the intake become scheduled rows when they are moved: the
        // scheduler moves too (so it knows when they are due, and what writers committed moves at
        // least every schedule interval even while nothing claims).
        self.move_before_claim().await;
        let pass = self.upkeep.pass(Walk::Promote);
        let mut conn = self.conn().await?;
        let r: Row = diesel::sql_query(PROMOTE_DUE)
            .bind::<Integer, _>(PROMOTE_BATCH)
            .bind::<Nullable<Double>, _>(pass.from)
            .get_result(&mut conn)
            .await?;
        if r.promoted < PROMOTE_BATCH {
            self.upkeep.ended(pass, r.walked_to);
        }
        Ok(Promoted {
            promoted: usize::try_from(r.promoted).unwrap_or(0),
            next_due: r
                .next_due_secs
                .map(|s| Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::MAX)),
        })
    }
}
