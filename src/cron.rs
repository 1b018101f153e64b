//! Cron schedules: a message enqueued at every tick of a cron expression, exactly once per tick
//! however many relays or engines run the schedule (they share one row per schedule in
//! `postbox.schedules`; see [`Store::fire`](crate::store::Store::fire)).
//!
//! ```
//! use postbox::{CronSchedule, Message};
//!
//! let nightly = CronSchedule::new(
//!     "nightly-report",
//!     "0 3 * * *",
//!     Message::new("reports.nightly").payload(&serde_json::json!({"kind": "nightly"})),
//! )?
//! .timezone("Europe/Berlin")?;
//! assert_eq!(nightly.name(), "nightly-report");
//! # Ok::<(), postbox::Error>(())
//! ```

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};

use crate::error::{Error, Result};
use crate::message::Message;

/// Header naming the schedule on every message a schedule enqueues (`postbox-` names are the
/// relay's own on Kafka records).
pub const SCHEDULE_HEADER: &str = "cron-schedule";
/// Header with the tick a message was enqueued for (RFC 3339, UTC).
pub const TICK_HEADER: &str = "cron-tick";

/// A message to enqueue at every tick of a cron expression.
#[derive(Debug, Clone)]
pub struct CronSchedule {
    name: String,
    expression: String,
    cron: Cron,
    timezone: Tz,
    message: Message,
}

impl CronSchedule {
    /// `expression` has 5 fields (minute hour day-of-month month day-of-week), or 6 with seconds
    /// first; ticks are read in UTC unless [`CronSchedule::timezone`] says otherwise. `message`
    /// is the template of every tick's message (topic, payload, key, headers, max attempts).
    pub fn new(name: impl Into<String>, expression: &str, message: Message) -> Result<Self> {
        let name = name.into();
        if name.is_empty() {
            return Err(Error::InvalidArgument {
                field: "name",
                problem: "must not be empty".into(),
            });
        }
        let cron = parse(expression).map_err(|problem| Error::InvalidArgument {
            field: "cron",
            problem,
        })?;
        Ok(CronSchedule {
            name,
            expression: expression.trim().to_owned(),
            cron,
            timezone: Tz::UTC,
            message,
        })
    }

    /// Reads the expression's times in this IANA time zone (`Europe/Berlin`): `0 3 * * *` is 3:00
    /// there, summer and winter.
    pub fn timezone(mut self, name: &str) -> Result<Self> {
        self.timezone = name.parse().map_err(|_| Error::InvalidArgument {
            field: "timezone",
            problem: format!("{name:?} is not an IANA time zone name (e.g. Europe/Berlin)"),
        })?;
        Ok(self)
    }

    /// The schedule's name: the row every relay running it shares.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The cron expression as given.
    pub fn expression(&self) -> &str {
        &self.expression
    }

    /// The time zone's name (`UTC` by default).
    pub fn timezone_name(&self) -> &str {
        self.timezone.name()
    }

    /// The message template.
    pub fn message(&self) -> &Message {
        &self.message
    }

    /// The first tick strictly after `t`.
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.cron
            .find_next_occurrence(&t.with_timezone(&self.timezone), false)
            .ok()
            .map(|d| d.with_timezone(&Utc))
    }

    /// The latest tick at or before `t`.
    pub fn latest_at(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.cron
            .find_previous_occurrence(&t.with_timezone(&self.timezone), true)
            .ok()
            .map(|d| d.with_timezone(&Utc))
    }

    /// The message of the tick at `tick`: the template, with the schedule's name and the tick in
    /// headers, and a dedup key made of both.
    pub fn message_for(&self, tick: DateTime<Utc>) -> Message {
        let at = tick.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        self.message
            .clone()
            .header(SCHEDULE_HEADER, self.name.clone())
            .header(TICK_HEADER, at.clone())
            .dedup_key(format!("schedule:{}:{at}", self.name))
    }
}

/// Parses 5 or 6 fields (seconds first); errors say what is wrong.
fn parse(expression: &str) -> std::result::Result<Cron, String> {
    let fields = expression.split_whitespace().count();
    if !(fields == 5 || fields == 6) {
        return Err(format!(
            "{expression:?} has {fields} fields; expected 5 (minute hour day-of-month month day-of-week) or 6 (seconds first)"
        ));
    }
    CronParser::builder()
        .seconds(Seconds::Optional)
        .year(Year::Disallowed)
        .build()
        .parse(expression)
        .map_err(|e| format!("{expression:?} is not a valid cron expression: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    #[test]
    fn ticks_in_a_time_zone() {
        let s = CronSchedule::new("n", "0 3 * * *", Message::new("t"))
            .unwrap()
            .timezone("Europe/Berlin")
            .unwrap();
        // 3:00 in Berlin is 2:00 UTC in summer, 1:00 UTC in winter (CET).
        assert_eq!(
            s.next_after(at("2026-07-01T00:00:00Z")),
            Some(at("2026-07-01T01:00:00Z"))
        );
        assert_eq!(
            s.next_after(at("2026-12-01T00:00:00Z")),
            Some(at("2026-12-01T02:00:00Z"))
        );
        assert_eq!(
            s.latest_at(at("2026-12-01T02:00:00Z")),
            Some(at("2026-12-01T02:00:00Z"))
        );
        assert_eq!(
            s.latest_at(at("2026-12-01T01:59:59Z")),
            Some(at("2026-11-30T02:00:00Z"))
        );
        assert_eq!(
            Utc.with_ymd_and_hms(2026, 12, 1, 2, 0, 0).unwrap(),
            at("2026-12-01T02:00:00Z")
        );
    }

    #[test]
    fn six_fields_have_seconds_first() {
        let s = CronSchedule::new("s", "*/10 * * * * *", Message::new("t")).unwrap();
        assert_eq!(
            s.next_after(at("2026-12-01T00:00:00Z")),
            Some(at("2026-12-01T00:00:10Z"))
        );
    }

    #[test]
    fn bad_expressions_name_the_field() {
        for bad in [
            "",
            "* * *",
            "61 * * * *",
            "* * * * * * *",
            "nonsense x y z w",
        ] {
            match CronSchedule::new("x", bad, Message::new("t")) {
                Err(Error::InvalidArgument { field: "cron", .. }) => {}
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        match CronSchedule::new("x", "* * * * *", Message::new("t"))
            .unwrap()
            .timezone("Mars/Olympus")
        {
            Err(Error::InvalidArgument {
                field: "timezone", ..
            }) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_ticks_message_names_schedule_and_tick() {
        let s = CronSchedule::new("n", "0 * * * *", Message::new("t")).unwrap();
        let m = s.message_for(at("2026-12-01T05:00:00Z"));
        assert_eq!(
            m.dedup_key.as_deref(),
            Some("schedule:n:2026-12-01T05:00:00Z")
        );
    }
}
