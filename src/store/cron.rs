//! Cron schedules in the database: `postbox.schedules`, one row per schedule, which every relay
//! running the schedule locks to fire a tick. See [`crate::cron`].

use chrono::{DateTime, Utc};
use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Nullable, Text, Timestamptz};
use diesel_async::{AsyncConnection, RunQueryDsl};

use super::Store;
use crate::cron::CronSchedule;
use crate::error::{Error, Result};
use crate::message::MessageId;

/// What one call of [`Store::fire`] found or did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fired {
    /// The tick this call enqueued a message for, and the message (`None`: the next tick has not
    /// come, or another relay fired it first).
    pub fired: Option<(DateTime<Utc>, Option<MessageId>)>,
    /// The schedule's last fired tick (by any relay).
    pub last_tick: Option<DateTime<Utc>>,
    /// When the next tick is due.
    pub next_tick: DateTime<Utc>,
    /// The database's clock when the row was read: sleep `next_tick - now`.
    pub now: DateTime<Utc>,
}

/// A schedule as the database knows it (for `status`).
#[derive(Debug, Clone, PartialEq, Eq, QueryableByName, serde::Serialize)]
pub struct ScheduleRow {
    /// The schedule's name.
    #[diesel(sql_type = Text)]
    pub name: String,
    /// Its cron expression.
    #[diesel(sql_type = Text)]
    pub cron: String,
    /// Its time zone (an IANA name, or UTC).
    #[diesel(sql_type = Text)]
    pub timezone: String,
    /// The topic of its messages.
    #[diesel(sql_type = Text)]
    pub topic: String,
    /// The last tick that enqueued a message.
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub last_tick: Option<DateTime<Utc>>,
    /// The id of that message.
    #[diesel(sql_type = Nullable<BigInt>)]
    pub last_message_id: Option<i64>,
    /// The next tick.
    #[diesel(sql_type = Timestamptz)]
    pub next_tick: DateTime<Utc>,
}

#[derive(QueryableByName)]
struct Locked {
    #[diesel(sql_type = Text)]
    cron: String,
    #[diesel(sql_type = Text)]
    timezone: String,
    #[diesel(sql_type = Text)]
    topic: String,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    last_tick: Option<DateTime<Utc>>,
    #[diesel(sql_type = Timestamptz)]
    next_tick: DateTime<Utc>,
    #[diesel(sql_type = Timestamptz)]
    now: DateTime<Utc>,
}

#[derive(QueryableByName)]
struct Now {
    #[diesel(sql_type = Timestamptz)]
    now: DateTime<Utc>,
}

const NOW: &str = "SELECT clock_timestamp() AS now";

/// A schedule seen for the first time starts at its next tick (no message for the past).
const REGISTER: &str = "INSERT INTO postbox.schedules (name, cron, timezone, topic, next_tick)
VALUES ($1, $2, $3, $4, $5) ON CONFLICT (name) DO NOTHING";

/// Locked for the rest of the transaction: a relay firing the same schedule waits, then sees the
/// tick gone.
const LOCK: &str = "SELECT cron, timezone, topic, last_tick, next_tick, clock_timestamp() AS now
FROM postbox.schedules WHERE name = $1 FOR UPDATE";

const REDEFINE: &str = "UPDATE postbox.schedules
SET cron = $2, timezone = $3, topic = $4, next_tick = $5, updated_at = now() WHERE name = $1";

const ADVANCE: &str = "UPDATE postbox.schedules
SET last_tick = $2, last_message_id = $3, next_tick = $4, updated_at = now() WHERE name = $1";

const LIST: &str = "SELECT name, cron, timezone, topic, last_tick, last_message_id, next_tick
FROM postbox.schedules ORDER BY name";

fn no_tick(s: &CronSchedule) -> Error {
    Error::InvalidArgument {
        field: "cron",
        problem: format!(
            "schedule {:?}: {:?} has no tick to come",
            s.name(),
            s.expression()
        ),
    }
}

impl Store {
    /// Fires `schedule` if its next tick has come (by the database's clock), in one transaction
    /// with the schedule's row locked: the tick's message is enqueued and the row moved on to the
    /// next tick, so each tick gives exactly one message across every relay. When several ticks
    /// were missed (every relay down), one message is enqueued, for the latest. A schedule seen
    /// for the first time, or whose expression or time zone changed, starts at its next tick.
    pub async fn fire(&self, schedule: &CronSchedule) -> Result<Fired> {
        let mut conn = self.conn().await?;
        conn.transaction(async |conn| {
            let now: Now = diesel::sql_query(NOW).get_result(conn).await?;
            let first = schedule.next_after(now.now).ok_or_else(|| no_tick(schedule))?;
            diesel::sql_query(REGISTER)
                .bind::<Text, _>(schedule.name())
                .bind::<Text, _>(schedule.expression())
                .bind::<Text, _>(schedule.timezone_name())
                .bind::<Text, _>(&schedule.message().topic)
                .bind::<Timestamptz, _>(first)
                .execute(conn)
                .await?;
            let row: Locked = diesel::sql_query(LOCK)
                .bind::<Text, _>(schedule.name())
                .get_result(conn)
                .await?;
            if row.cron != schedule.expression()
                || row.timezone != schedule.timezone_name()
                || row.topic != schedule.message().topic
            {
                let next = schedule.next_after(row.now).ok_or_else(|| no_tick(schedule))?;
                tracing::info!(schedule = schedule.name(), cron = schedule.expression(), %next, "schedule redefined; it starts at its next tick");
                diesel::sql_query(REDEFINE)
                    .bind::<Text, _>(schedule.name())
                    .bind::<Text, _>(schedule.expression())
                    .bind::<Text, _>(schedule.timezone_name())
                    .bind::<Text, _>(&schedule.message().topic)
                    .bind::<Timestamptz, _>(next)
                    .execute(conn)
                    .await?;
                return Ok(Fired {
                    fired: None,
                    last_tick: row.last_tick,
                    next_tick: next,
                    now: row.now,
                });
            }
            if row.now < row.next_tick {
                return Ok(Fired {
                    fired: None,
                    last_tick: row.last_tick,
                    next_tick: row.next_tick,
                    now: row.now,
                });
            }
            // The latest tick that has come (one catch-up message for any number missed).
            let tick = schedule
                .latest_at(row.now)
                .filter(|t| *t >= row.next_tick)
                .unwrap_or(row.next_tick);
            let next = schedule.next_after(row.now).ok_or_else(|| no_tick(schedule))?;
            let enqueued = crate::enqueue::enqueue_async(conn, &schedule.message_for(tick)).await?;
            // A live message already holding the tick's dedup key (only if a row was reset by
            // hand) stands for the tick.
            let id = enqueued.id();
            diesel::sql_query(ADVANCE)
                .bind::<Text, _>(schedule.name())
                .bind::<Timestamptz, _>(tick)
                .bind::<Nullable<BigInt>, _>(id)
                .bind::<Timestamptz, _>(next)
                .execute(conn)
                .await?;
            Ok::<_, Error>(Fired {
                fired: Some((tick, id)),
                last_tick: Some(tick),
                next_tick: next,
                now: row.now,
            })
        })
        .await
    }

    /// Every schedule the database knows, by name.
    pub async fn schedules(&self) -> Result<Vec<ScheduleRow>> {
        let mut conn = self.conn().await?;
        Ok(diesel::sql_query(LIST).load(&mut conn).await?)
    }
}
