//! Where the upkeep's walks start (see the migration `upkeep_windows`).
//!
//! The rescue of expired leases, the finish of kept heads whose lease an operator moved and the
//! promotion of due scheduled messages each walk an index by time (`locked_until`, `run_at`) up to
//! `now()`. Walked from the front, each pass steps over the entries of every row that passed
//! through that state since the xmin horizon was last free: under a pinned horizon (a long report,
//! a session idle in a transaction) the passes grow with the pin, and the scheduler passes ten
//! times a second. Each walk here starts a margin before where the same walk of this store last
//! finished, and the whole index is walked every [`DEFAULT_UPKEEP_SWEEP`] (and by a store's first
//! pass): a row the window cannot see (made due by a transaction older than the margin that
//! committed after a pass, or skipped by a pass while another transaction held it locked) is
//! handled by that whole walk.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Double, Integer, Nullable};
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};

use super::Store;
use super::explain::{PlanLine, rolled_back};
use super::kept::FINISH_BATCH;
use super::schedule::PROMOTE_BATCH;
use super::settle::{RESCUE, RESCUE_BATCH, RESCUE_PLAN};
use crate::error::Result;

/// How far before the end of the previous pass (the server's `now()` then) a walk starts.
pub const UPKEEP_MARGIN: Duration = Duration::from_secs(5);

/// How often the upkeep's walks go over their whole index (see the module), by default.
pub const DEFAULT_UPKEEP_SWEEP: Duration = Duration::from_secs(60);

/// The share of the time a walk over the whole index may take: under a pin it grows with what
/// the pin keeps (at 800 messages/s, 0.4 s for the rescue and 0.7 s for the finish 10 minutes
/// in), and the next one is put off to keep within this.
pub const UPKEEP_SWEEP_BUDGET: f64 = 0.02;

/// The server's `now()`, in seconds since the epoch.
pub(crate) const NOW: &str = "SELECT extract(epoch FROM now())::float8 AS now";

/// A row of [`NOW`].
#[derive(QueryableByName)]
pub(crate) struct Now {
    #[diesel(sql_type = Double)]
    pub(crate) now: f64,
}

/// One walk's window.
#[derive(Debug, Default)]
struct Window {
    /// Where the next pass starts (seconds since the epoch, the server's clock); `None`: nowhere
    /// yet, the whole index.
    from: Option<f64>,
    /// When the last whole walk started.
    swept: Option<Instant>,
    /// What the last whole walk took.
    took: Duration,
}

/// The windows of a store's walks, shared by its clones.
#[derive(Debug)]
pub(crate) struct Windows {
    every: Duration,
    rescue: Mutex<Window>,
    finish: Mutex<Window>,
    promote: Mutex<Window>,
}

/// Which walk.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Walk {
    Rescue,
    Finish,
    Promote,
}

/// A pass about to run: where it starts (`None`: the whole index) and when it began.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pass {
    walk: Walk,
    pub(crate) from: Option<f64>,
    began: Instant,
}

impl Windows {
    pub(crate) fn new(every: Duration) -> Self {
        Windows {
            every,
            rescue: Mutex::default(),
            finish: Mutex::default(),
            promote: Mutex::default(),
        }
    }

    fn of(&self, walk: Walk) -> &Mutex<Window> {
        match walk {
            Walk::Rescue => &self.rescue,
            Walk::Finish => &self.finish,
            Walk::Promote => &self.promote,
        }
    }

    /// The next pass of `walk`.
    pub(crate) fn pass(&self, walk: Walk) -> Pass {
        let w = self.of(walk).lock().expect("not poisoned");
        let began = Instant::now();
        // (Zero: every pass walks everything, whatever it takes.)
        let every = match self.every.is_zero() {
            true => Duration::ZERO,
            false => self.every.max(w.took.div_f64(UPKEEP_SWEEP_BUDGET)),
        };
        let from = match w.swept {
            Some(at) if began.duration_since(at) < every => w.from,
            _ => None,
        };
        Pass { walk, from, began }
    }

    /// The next pass of `walk` from its window, whenever the last whole walk was (the whole
    /// index only while there is no window yet): for passes on the path of a claim, which leave
    /// the whole walks to the upkeep's own passes.
    pub(crate) fn pass_in_window(&self, walk: Walk) -> Pass {
        let w = self.of(walk).lock().expect("not poisoned");
        Pass {
            walk,
            from: w.from,
            began: Instant::now(),
        }
    }

    /// `pass` walked everything it could see up to the server's `walked_to` (it did not stop at
    /// its batch limit): the next starts a margin before that.
    pub(crate) fn ended(&self, pass: Pass, walked_to: f64) {
        let mut w = self.of(pass.walk).lock().expect("not poisoned");
        if pass.from.is_none() {
            w.swept = Some(w.swept.map_or(pass.began, |at| at.max(pass.began)));
            w.took = pass.began.elapsed();
        }
        let next = walked_to - UPKEEP_MARGIN.as_secs_f64();
        w.from = Some(w.from.map_or(next, |f| f.max(next)));
    }
}

impl Default for Windows {
    fn default() -> Self {
        Windows::new(DEFAULT_UPKEEP_SWEEP)
    }
}

impl Store {
    /// `EXPLAIN (ANALYZE, BUFFERS)` of the next pass of each upkeep walk as this store would run
    /// it (from where its previous pass ended, see [`Store::with_upkeep_sweep`]): the rescue of
    /// expired leases (`-- rescue`), the finish of kept heads (`-- finish heads`) and the
    /// promotion of due scheduled messages (`-- promote`); a function's plan counts the buffers of
    /// the statements it runs. Run in a transaction that is rolled back: nothing is rescued,
    /// finished or promoted, and the windows stay where they are.
    pub async fn explain_upkeep(&self) -> Result<String> {
        let b = self.backoff;
        let mut conn = self.conn().await?;
        let mut plan = String::new();
        rolled_back(&mut conn, async |conn| {
            conn.batch_execute(RESCUE_PLAN).await?;
            let lines: Vec<PlanLine> =
                diesel::sql_query(format!("EXPLAIN (ANALYZE, BUFFERS) {RESCUE}"))
                    .bind::<BigInt, _>(RESCUE_BATCH)
                    .bind::<Double, _>(b.base.as_secs_f64())
                    .bind::<Double, _>(b.cap.as_secs_f64())
                    .bind::<Double, _>(b.jitter)
                    .bind::<Nullable<Double>, _>(self.upkeep.pass(Walk::Rescue).from)
                    .load(conn)
                    .await?;
            plan.push_str("-- rescue\n");
            plan.extend(lines.into_iter().map(|l| l.line + "\n"));
            let lines: Vec<PlanLine> = diesel::sql_query(
                "EXPLAIN (ANALYZE, BUFFERS) SELECT * FROM postbox.finish_heads($1, to_timestamp($2))",
            )
            .bind::<Integer, _>(FINISH_BATCH)
            .bind::<Nullable<Double>, _>(self.upkeep.pass(Walk::Finish).from)
            .load(conn)
            .await?;
            plan.push_str("-- finish heads\n");
            plan.extend(lines.into_iter().map(|l| l.line + "\n"));
            let lines: Vec<PlanLine> = diesel::sql_query(
                "EXPLAIN (ANALYZE, BUFFERS) SELECT * FROM postbox.promote_due($1, to_timestamp($2))",
            )
            .bind::<Integer, _>(PROMOTE_BATCH)
            .bind::<Nullable<Double>, _>(self.upkeep.pass(Walk::Promote).from)
            .load(conn)
            .await?;
            plan.push_str("-- promote\n");
            plan.extend(lines.into_iter().map(|l| l.line + "\n"));
            Ok(())
        })
        .await?;
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_first_pass_and_a_pass_after_the_sweep_interval_walk_everything() {
        let w = Windows::new(Duration::from_secs(3600));
        let first = w.pass(Walk::Rescue);
        assert_eq!(first.from, None);
        w.ended(first, 1000.0);
        assert_eq!(w.pass(Walk::Rescue).from, Some(995.0));
        // Each walk has its own window.
        assert_eq!(w.pass(Walk::Promote).from, None);
        let always = Windows::new(Duration::ZERO);
        let p = always.pass(Walk::Finish);
        always.ended(p, 1000.0);
        assert_eq!(always.pass(Walk::Finish).from, None);
    }

    #[test]
    fn a_slow_whole_walk_puts_the_next_off_to_keep_within_its_budget() {
        let w = Windows::new(Duration::from_secs(60));
        let p = w.pass(Walk::Rescue);
        w.ended(p, 1000.0);
        {
            let mut r = w.rescue.lock().unwrap();
            r.took = Duration::from_secs(2);
            // 61 s ago: past the interval, within the 100 s the budget asks for.
            r.swept = Instant::now().checked_sub(Duration::from_secs(61));
        }
        assert_eq!(w.pass(Walk::Rescue).from, Some(995.0));
        w.rescue.lock().unwrap().swept = Instant::now().checked_sub(Duration::from_secs(101));
        assert_eq!(w.pass(Walk::Rescue).from, None);
    }

    #[test]
    fn a_pass_in_the_window_never_walks_the_whole_index_once_there_is_a_window() {
        let w = Windows::new(Duration::ZERO);
        assert_eq!(w.pass_in_window(Walk::Finish).from, None);
        let p = w.pass(Walk::Finish);
        w.ended(p, 1000.0);
        assert_eq!(w.pass(Walk::Finish).from, None);
        assert_eq!(w.pass_in_window(Walk::Finish).from, Some(995.0));
    }

    #[test]
    fn a_pass_cut_short_by_its_batch_leaves_the_window_alone() {
        let w = Windows::new(Duration::from_secs(3600));
        let p = w.pass(Walk::Rescue);
        w.ended(p, 1000.0);
        // A pass that hit its limit does not call `ended`: the next starts where it did.
        let _cut = w.pass(Walk::Rescue);
        assert_eq!(w.pass(Walk::Rescue).from, Some(995.0));
        // A slower pass ending after a later one does not move the window back.
        let late = w.pass(Walk::Rescue);
        w.ended(w.pass(Walk::Rescue), 2000.0);
        w.ended(late, 1500.0);
        assert_eq!(w.pass(Walk::Rescue).from, Some(1995.0));
    }
}
