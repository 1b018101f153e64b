//! Runs an engine's cron schedules: each is fired (see [`Store::fire`]) when its next tick is
//! due, by the database's clock; between ticks the task sleeps. Every relay running a schedule
//! does this; the schedule's row makes each tick one message.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Observer;
use crate::cron::CronSchedule;
use crate::store::Store;

/// Longest sleep between two looks at a schedule: a schedule another relay redefined, or a clock
/// that jumped, is seen within this long.
pub const CRON_RECHECK: Duration = Duration::from_secs(60);

/// After a failed look (database away), the next one comes after this long, doubling up to
/// [`CRON_RECHECK`].
const FIRST_BACKOFF: Duration = Duration::from_millis(500);

struct Due {
    schedule: CronSchedule,
    at: Instant,
    backoff: Duration,
}

/// Fires `schedules` as their ticks come, until `stop`.
pub(crate) async fn run(
    store: Store,
    schedules: Vec<CronSchedule>,
    observer: Arc<dyn Observer>,
    stop: CancellationToken,
) {
    let now = Instant::now();
    let mut due: Vec<Due> = schedules
        .into_iter()
        .map(|schedule| Due {
            schedule,
            at: now,
            backoff: FIRST_BACKOFF,
        })
        .collect();
    loop {
        for d in due.iter_mut().filter(|d| d.at <= Instant::now()) {
            if stop.is_cancelled() {
                return;
            }
            match store.fire(&d.schedule).await {
                Ok(f) => {
                    if let Some((tick, id)) = f.fired {
                        tracing::info!(schedule = d.schedule.name(), %tick, id, "schedule fired");
                    }
                    observer.schedule(
                        d.schedule.name(),
                        f.last_tick,
                        f.next_tick,
                        f.fired.is_some(),
                    );
                    // Just past the tick, so the next look finds it due.
                    let wait = (f.next_tick - f.now).to_std().unwrap_or(Duration::ZERO)
                        + Duration::from_millis(1);
                    d.at = Instant::now() + wait.min(CRON_RECHECK);
                    d.backoff = FIRST_BACKOFF;
                }
                Err(e) => {
                    tracing::warn!(schedule = d.schedule.name(), error = %e, retry_in = ?d.backoff, "could not fire the schedule");
                    d.at = Instant::now() + d.backoff;
                    d.backoff = (d.backoff * 2).min(CRON_RECHECK);
                }
            }
        }
        let Some(next) = due.iter().map(|d| d.at).min() else {
            return;
        };
        tokio::select! {
            _ = tokio::time::sleep_until(next) => {}
            _ = stop.cancelled() => return,
        }
    }
}
