//! Heads kept for their writers (see the migration `head_pins`): a settle never waits for a
//! writer. A writer's insert pins the head of its key that its message goes behind (`FOR KEY
//! SHARE`, until its transaction ends); a settle that takes such a head out leaves it in place as
//! a delivered head (running, lease token 0, locked until `infinity`): the key keeps it as its
//! head, so nothing is promoted past the writer's message. Once the writer is done,
//! `postbox.finish_heads` deletes it and promotes the next message of its key.
//!
//! A store that kept a head runs the finish before each of its claims (the writer's commit wakes
//! the relays) until none is kept; every relay's maintenance runs it too.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use diesel::QueryableByName;
use diesel::sql_types::{Double, Integer, Nullable};
use diesel_async::RunQueryDsl;

use super::Store;
use super::upkeep::{Pass, Walk};
use crate::error::Result;

/// Kept heads finished per statement.
pub const FINISH_BATCH: i32 = 1_000;

/// How long after it last kept a head [`Store::finish_kept_heads`] looks before every claim;
/// past that, while the heads it kept are still pinned (a writer left open), at most every
/// [`FINISH_EVERY`].
const FINISH_EAGER: Duration = Duration::from_secs(1);
/// See [`FINISH_EAGER`].
const FINISH_EVERY: Duration = Duration::from_millis(100);

const FINISH: &str =
    "SELECT finished, still_kept, walked_to FROM postbox.finish_heads($1, to_timestamp($2))";

/// What this store knows of the heads it kept.
#[derive(Debug, Default)]
pub(crate) struct KeptHeads {
    /// Bumped whenever a statement of this store kept a head; 0 when none is known to be kept.
    marks: AtomicUsize,
    /// When a statement last kept a head, and when the last finish that found some still
    /// pinned ran.
    times: Mutex<(Option<Instant>, Option<Instant>)>,
}

/// What [`Store::finish_heads`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Finished {
    /// Kept heads deleted (their keys' next messages promoted).
    pub finished: usize,
    /// Heads still kept: their writers are still open.
    pub still_kept: usize,
}

#[derive(QueryableByName)]
struct Row {
    #[diesel(sql_type = Integer)]
    finished: i32,
    #[diesel(sql_type = Integer)]
    still_kept: i32,
    #[diesel(sql_type = Double)]
    walked_to: f64,
}

impl Store {
    /// Notes that a statement kept `n` heads for their writers.
    pub(super) fn note_kept(&self, n: i64) {
        if n > 0 {
            self.kept.times.lock().expect("not poisoned").0 = Some(Instant::now());
            self.kept.marks.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// True while heads this store kept may still be waiting for their writers.
    pub fn kept_heads(&self) -> bool {
        AtomicUsize::load(&self.kept.marks, Ordering::SeqCst) > 0
    }

    /// Deletes the kept heads whose writers are done and promotes the next message of each key
    /// (up to [`FINISH_BATCH`]); safe on every relay at once. Heads a writer still pins are
    /// skipped, never waited for.
    pub async fn finish_heads(&self) -> Result<Finished> {
        self.finish_heads_in(self.upkeep.pass(Walk::Finish)).await
    }

    async fn finish_heads_in(&self, pass: Pass) -> Result<Finished> {
        let seen = AtomicUsize::load(&self.kept.marks, Ordering::SeqCst);
        let mut conn = self.conn().await?;
        let r: Row = diesel::sql_query(FINISH)
            .bind::<Integer, _>(FINISH_BATCH)
            .bind::<Nullable<Double>, _>(pass.from)
            .get_result(&mut conn)
            .await?;
        if r.finished < FINISH_BATCH {
            self.upkeep.ended(pass, r.walked_to);
        }
        if r.still_kept == 0 {
            // None left, unless a statement kept one since this one looked.
            let _ = self
                .kept
                .marks
                .compare_exchange(seen, 0, Ordering::SeqCst, Ordering::SeqCst);
        }
        Ok(Finished {
            finished: r.finished as usize,
            still_kept: r.still_kept as usize,
        })
    }

    /// [`Store::finish_heads`] if this store kept heads that may not be finished yet, at most
    /// every few milliseconds: every claim of this store does it first (the wake-up that brought
    /// the claim may be such a writer's commit).
    pub async fn finish_kept_heads(&self) -> Result<Finished> {
        if !self.kept_heads() {
            return Ok(Finished::default());
        }
        let now = Instant::now();
        {
            let (kept, looked) = *self.kept.times.lock().expect("not poisoned");
            let lately = kept.is_some_and(|at| now.duration_since(at) < FINISH_EAGER);
            if !lately && looked.is_some_and(|at| now.duration_since(at) < FINISH_EVERY) {
                return Ok(Finished::default());
            }
        }
        // From the window only: the whole walk (which a pin makes long) is the upkeep's, not
        // the claim's to wait for.
        let f = self
            .finish_heads_in(self.upkeep.pass_in_window(Walk::Finish))
            .await?;
        if f.still_kept > 0 {
            self.kept.times.lock().expect("not poisoned").1 = Some(now);
        }
        Ok(f)
    }
}

impl Store {
    /// [`Store::finish_kept_heads`] and [`Store::move_intake`] before a claim. Its failure is the claim's to meet (the
    /// claim that follows fails the same way, or the next one finishes what this one could not).
    pub(super) async fn finish_before_claim(&self) {
        let _ = self.finish_kept_heads().await;
        self.move_before_claim().await;
    }
}

/// A store's record of its kept heads, shared by its clones.
pub(crate) fn new_kept() -> Arc<KeptHeads> {
    Arc::new(KeptHeads::default())
}
