//! The sections for work beyond routing: `[[schedules]]`, `[[limits]]`, `[retention]`.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// `[[limits]]`: at most `max_running` messages of `topics` running at once across every relay.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSection {
    /// Exact names or globs, as in a route.
    pub topics: Vec<String>,
    /// At most this many of the topics' messages running at once across every relay.
    pub max_running: i64,
    /// At most `max_running` per key instead of in all.
    #[serde(default)]
    pub per_key: bool,
}

impl LimitSection {
    /// The limit, or the problem and the field (relative to this entry) it is in.
    pub fn limit(&self) -> Result<crate::store::Limit, (&'static str, String)> {
        let max = u32::try_from(self.max_running).map_err(|_| {
            (
                "max_running",
                format!("{} is not a count", self.max_running),
            )
        })?;
        crate::store::Limit::new(&self.topics, max)
            .map(|l| l.per_key(self.per_key))
            .map_err(invalid)
    }
}

/// `[[schedules]]`: a message enqueued at every tick of `cron`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSection {
    /// Unique among the schedules; every relay with a schedule of this name shares its ticks.
    pub name: String,
    /// 5 fields (minute hour day-of-month month day-of-week), or 6 with seconds first.
    pub cron: String,
    /// IANA name (`Europe/Berlin`); UTC when absent.
    pub timezone: Option<String>,
    /// The topic of each tick's message.
    pub topic: String,
    /// The message's payload (any TOML value; `{}` when absent).
    pub payload: Option<toml::Value>,
    /// The payload as a JSON document instead (what the Helm chart writes).
    pub payload_json: Option<String>,
    /// The message's key.
    pub key: Option<String>,
    /// The message's attempts before it is dead-lettered (default 25).
    pub max_attempts: Option<i32>,
}

impl ScheduleSection {
    /// The schedule, or the problem and the field (relative to this entry) it is in.
    pub fn schedule(&self) -> Result<crate::CronSchedule, (&'static str, String)> {
        let mut message = crate::Message::new(self.topic.clone());
        match (&self.payload, &self.payload_json) {
            (Some(_), Some(_)) => {
                return Err((
                    "payload_json",
                    "give payload or payload_json, not both".into(),
                ));
            }
            (Some(p), None) => message = message.payload(p),
            (None, Some(j)) => {
                let v: serde_json::Value = serde_json::from_str(j)
                    .map_err(|e| ("payload_json", format!("not a JSON document: {e}")))?;
                message = message.payload(&v);
            }
            (None, None) => {}
        }
        if let Some(k) = &self.key {
            message = message.key(k.clone());
        }
        if let Some(n) = self.max_attempts {
            message = message.max_attempts(n);
        }
        message.validate().map_err(|e| {
            // Its text is "field: problem".
            let text = e.to_string();
            let (field, problem) = text.split_once(": ").unwrap_or(("topic", &text));
            let field = match field {
                "key" => "key",
                "max_attempts" => "max_attempts",
                "payload" => "payload",
                _ => "topic",
            };
            (field, problem.to_owned())
        })?;
        let mut s =
            crate::CronSchedule::new(self.name.clone(), &self.cron, message).map_err(invalid)?;
        if let Some(tz) = &self.timezone {
            s = s.timezone(tz).map_err(invalid)?;
        }
        Ok(s)
    }
}

fn invalid(e: crate::Error) -> (&'static str, String) {
    match e {
        crate::Error::InvalidArgument { field, problem } => (field, problem),
        other => ("cron", other.to_string()),
    }
}

/// `[retention]`: keep delivered messages for `postbox show` (off by default).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionSection {
    /// How long delivered messages are kept in `postbox.completed` (expired by the hour).
    #[serde(
        default,
        with = "super::opt_duration",
        skip_serializing_if = "Option::is_none"
    )]
    pub keep_completed: Option<Duration>,
}
