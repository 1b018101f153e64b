//! The intake's move (migration `intake`): unordered messages without a dedup key that writers
//! committed to `postbox.intake` are moved into `postbox.messages` by the relays, in short
//! transactions of their own, before they claim.
//!
//! Every claim and take of a store moves first ([`Store::move_intake`], at most [`MOVE_BATCH`]
//! rows), so whatever path delivers (a relay's claim loop, a held batch, `postbox run --drain`, an
//! app calling [`Store::claim`] itself) sees what writers committed. The move is one statement
//! and one transaction, never a held batch's (rows moved inside a hold would stay invisible to the
//! other relays until it ends). One relay moves at a time; the others find the try-lock taken and
//! claim what is there. A failed move does not stop the claim that follows: what is already in
//! `postbox.messages` is delivered, and the intake's depth (`postbox status`, the metrics) shows
//! what waits.
//!
//! Each store keeps the floor its last move left (stamped with the server run's token, as the
//! claims' floors are), so under a pinned xmin horizon a move walks from where the last one
//! stopped, not over every row moved since the pin began.

use std::sync::Mutex;

use diesel::QueryableByName;
use diesel::sql_types::{Integer, Nullable, Text};
use diesel_async::RunQueryDsl;

use super::Store;
use crate::error::{Error, Result};

/// The most rows one move takes: about 25–35 ms of work for the mover at 22–33 µs a row
/// (`bench --only write`, line (g)), ten claims of 100.
pub const MOVE_BATCH: i32 = 1_000;

/// The move, with the floor a store kept (`stamp|floor`, used only on the server run that gave
/// it), returning the next one stamped.
const MOVE: &str = "SELECT m.moved, postbox.boot_token() || '|' || m.floor AS floor
FROM postbox.move_intake($1, CASE WHEN split_part($2, '|', 1) = postbox.boot_token() THEN split_part($2, '|', 2) END) m";

/// A store's record of its intake floor and of the last failed move, shared by its clones.
#[derive(Debug, Default)]
pub(crate) struct IntakeFloor {
    floor: Mutex<Option<String>>,
    failure: Mutex<Option<String>>,
}

#[derive(QueryableByName)]
struct Moved {
    #[diesel(sql_type = Integer)]
    moved: i32,
    #[diesel(sql_type = Nullable<Text>)]
    floor: Option<String>,
}

impl Store {
    /// Moves up to [`MOVE_BATCH`] messages that writers committed to `postbox.intake` into
    /// `postbox.messages`, from this store's floor, in a transaction of its own; returns how many
    /// (0 also when another relay was moving at that instant).
    pub async fn move_intake(&self) -> Result<usize> {
        let floor = self.intake.floor.lock().expect("not poisoned").clone();
        let mut conn = self
            .pool
            .get()
            .await
            .map_err(|e| Error::Pool(e.to_string()))?;
        let m: Moved = diesel::sql_query(MOVE)
            .bind::<Integer, _>(MOVE_BATCH)
            .bind::<Nullable<Text>, _>(&floor)
            .get_result(&mut *conn)
            .await?;
        // A move that found another mover hands back the floor it was given: keep whatever a
        // concurrent move of this store left instead. (An older floor is never wrong, only a
        // longer walk.)
        if m.floor != floor {
            *self.intake.floor.lock().expect("not poisoned") = m.floor;
        }
        Ok(usize::try_from(m.moved).unwrap_or(0))
    }

    /// Moves until the intake has nothing committed left (for `postbox run --drain` and tests);
    /// returns how many were moved.
    pub async fn move_intake_all(&self) -> Result<usize> {
        let mut total = 0;
        loop {
            let n = self.move_intake().await?;
            total += n;
            if n < MOVE_BATCH as usize {
                return Ok(total);
            }
        }
    }

    /// The error of the last move, while moves fail (`None` once one succeeds).
    pub fn intake_failure(&self) -> Option<String> {
        self.intake.failure.lock().expect("not poisoned").clone()
    }

    /// [`Store::move_intake`] before a claim. Its failure is recorded (and logged once per
    /// distinct error), not returned: the claim goes on with what `postbox.messages` holds.
    pub(super) async fn move_before_claim(&self) {
        let result = self.move_intake().await;
        let mut failure = self.intake.failure.lock().expect("not poisoned");
        match result {
            Ok(_) => *failure = None,
            Err(e) => {
                let text = e.to_string();
                if failure.as_deref() != Some(text.as_str()) {
                    #[cfg(feature = "engine")]
                    tracing::warn!(error = %text, "could not move messages from postbox.intake; claiming what postbox.messages holds");
                    *failure = Some(text);
                }
            }
        }
    }
}
