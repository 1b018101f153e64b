//! The relay's configuration: a TOML file, the environment and command-line flags, in that order of
//! increasing precedence over the defaults. Unknown keys are refused; every error names the field.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::engine::EngineConfig;
use crate::engine::config as defaults;

/// The database a relay uses when none is configured.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@localhost/postbox";
/// Where metrics and health are served when nothing is configured.
pub const DEFAULT_METRICS_LISTEN: &str = "0.0.0.0:9464";

/// A configuration problem: the field and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct ConfigError {
    pub field: String,
    pub problem: String,
}

fn err(field: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        problem: problem.into(),
    }
}

/// The whole file.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// PostgreSQL URL (`sslmode=require|verify-full` supported).
    pub database_url: Option<String>,
    #[serde(default)]
    pub relay: RelaySection,
    #[serde(default)]
    pub metrics: MetricsSection,
    #[serde(default)]
    pub sinks: SinksSection,
    #[serde(default)]
    pub retention: RetentionSection,
    /// Topic patterns → sink, first match wins. None: everything goes to the log sink.
    #[serde(default)]
    pub routes: Vec<Route>,
    /// Cron schedules: a message at every tick, once across every relay.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub schedules: Vec<ScheduleSection>,
    /// Running limits, enforced in every relay's claims.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub limits: Vec<LimitSection>,
}

/// `[[limits]]`: at most `max_running` messages of `topics` running at once across every relay.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSection {
    /// Exact names or globs, as in a route.
    pub topics: Vec<String>,
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
    pub topic: String,
    /// The message's payload (any TOML value; `{}` when absent).
    pub payload: Option<toml::Value>,
    /// The payload as a JSON document instead (what the Helm chart writes).
    pub payload_json: Option<String>,
    pub key: Option<String>,
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

/// `[relay]`: the engine's settings.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RelaySection {
    pub batch_size: Option<usize>,
    pub concurrency: Option<usize>,
    #[serde(default, with = "opt_duration")]
    pub lease: Option<Duration>,
    #[serde(default, with = "opt_duration")]
    pub poll_interval: Option<Duration>,
    /// Longest sleep of the scheduler that makes due scheduled messages available.
    #[serde(default, with = "opt_duration")]
    pub schedule_interval: Option<Duration>,
    #[serde(default, with = "opt_duration")]
    pub shutdown_deadline: Option<Duration>,
    /// A delivery running longer counts as a failed attempt.
    #[serde(default, with = "opt_duration")]
    pub delivery_timeout: Option<Duration>,
    /// Per-topic delivery timeouts: `{ "reports.*" = "1h" }`; the longest matching pattern wins.
    #[serde(
        default,
        with = "duration_map",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub topic_timeouts: BTreeMap<String, Duration>,
    /// Longest a batch is held under its row locks before what is undelivered is leased
    /// (`"0s"`: always lease).
    #[serde(default, with = "opt_duration")]
    pub hold_limit: Option<Duration>,
}

/// `[retention]`: keep delivered messages for `postbox show` (off by default).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionSection {
    /// How long delivered messages are kept in `postbox.completed` (expired by the hour).
    #[serde(
        default,
        with = "opt_duration",
        skip_serializing_if = "Option::is_none"
    )]
    pub keep_completed: Option<Duration>,
}

/// `[metrics]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsSection {
    /// `host:port` for `/metrics`, `/healthz`, `/readyz`.
    pub listen: Option<String>,
    #[serde(default, with = "opt_duration")]
    pub sample_interval: Option<Duration>,
}

/// `[sinks]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SinksSection {
    pub kafka: Option<KafkaSink>,
}

/// `[sinks.kafka]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaSink {
    /// `bootstrap.servers`.
    pub brokers: String,
    /// Any librdkafka producer property (SASL, TLS, compression, ...).
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
}

/// `[[routes]]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// Exact names or globs (`orders.*`, `*`).
    pub topics: Vec<String>,
    /// `kafka` or `log`.
    pub sink: String,
    /// Kafka topic to send to instead of the postbox topic.
    pub kafka_topic: Option<String>,
}

/// The sinks a route may name.
pub const SINK_NAMES: [&str; 2] = ["kafka", "log"];

/// Settings from the environment (`POSTBOX_*`), applied over the file.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// `--database-url`, else `POSTBOX_DATABASE_URL`: over the file.
    pub database_url: Option<String>,
    /// `DATABASE_URL`: the generic variable every diesel user has exported (diesel CLI, `.env`), so
    /// only a fallback, under the file's `database_url`.
    pub database_url_fallback: Option<String>,
    pub metrics_listen: Option<String>,
    pub batch_size: Option<String>,
    pub concurrency: Option<String>,
    pub lease: Option<String>,
    pub poll_interval: Option<String>,
    pub shutdown_deadline: Option<String>,
    pub kafka_brokers: Option<String>,
    /// librdkafka properties from `POSTBOX_KAFKA_PROPERTY_<NAME>`: `SASL_PASSWORD` → `sasl.password`
    /// (how the Helm chart passes credentials from Secrets).
    pub kafka_properties: BTreeMap<String, String>,
}

impl Overrides {
    /// Reads `POSTBOX_DATABASE_URL` (and `DATABASE_URL`, which only applies when the file has no
    /// `database_url`), `POSTBOX_METRICS_LISTEN`,
    /// `POSTBOX_BATCH_SIZE`, `POSTBOX_CONCURRENCY`, `POSTBOX_LEASE`, `POSTBOX_POLL_INTERVAL`,
    /// `POSTBOX_SHUTDOWN_DEADLINE`, `POSTBOX_KAFKA_BROKERS`.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Overrides {
            database_url: var("POSTBOX_DATABASE_URL"),
            database_url_fallback: var("DATABASE_URL"),
            metrics_listen: var("POSTBOX_METRICS_LISTEN"),
            batch_size: var("POSTBOX_BATCH_SIZE"),
            concurrency: var("POSTBOX_CONCURRENCY"),
            lease: var("POSTBOX_LEASE"),
            poll_interval: var("POSTBOX_POLL_INTERVAL"),
            shutdown_deadline: var("POSTBOX_SHUTDOWN_DEADLINE"),
            kafka_brokers: var("POSTBOX_KAFKA_BROKERS"),
            // vars_os: other programs' variables need not be UTF-8 (vars() would panic).
            kafka_properties: std::env::vars_os()
                .filter_map(|(k, v)| {
                    let name = k.to_str()?.strip_prefix("POSTBOX_KAFKA_PROPERTY_")?;
                    let Some(v) = v.to_str() else {
                        tracing::warn!(variable = %k.to_string_lossy(), "not UTF-8; ignored");
                        return None;
                    };
                    Some((name.to_ascii_lowercase().replace('_', "."), v.to_owned()))
                })
                .collect(),
        }
    }
}

/// Parses a duration as humantime does: `30s`, `250ms`, `1.5s`, `5m`, `1h 30m`, `2d`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim())
        .map_err(|e| format!("{s:?} is not a duration like 30s, 250ms or 1h 30m ({e})"))
}

fn format_duration(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

mod opt_duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_str(&super::format_duration(*d)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let s = Option::<String>::deserialize(d)?;
        s.map(|s| super::parse_duration(&s).map_err(serde::de::Error::custom))
            .transpose()
    }
}

mod duration_map {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(
        m: &BTreeMap<String, Duration>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_map(m.iter().map(|(k, d)| (k, super::format_duration(*d))))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<String, Duration>, D::Error> {
        BTreeMap::<String, String>::deserialize(d)?
            .into_iter()
            .map(|(k, v)| {
                super::parse_duration(&v)
                    .map(|d| (k.clone(), d))
                    .map_err(|e| serde::de::Error::custom(format!("{k:?}: {e}")))
            })
            .collect()
    }
}

/// The configuration a relay runs with, every default filled in and validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub database_url: String,
    pub engine: EngineConfig,
    pub metrics_listen: SocketAddr,
    pub sample_interval: Duration,
    pub kafka: Option<KafkaSink>,
    pub routes: Vec<Route>,
    /// Validated: each builds its [`crate::CronSchedule`].
    pub schedules: Vec<ScheduleSection>,
    /// Validated: each builds its [`crate::store::Limit`].
    pub limits: Vec<LimitSection>,
}

impl Settings {
    /// The cron schedules (validated when the settings were made).
    pub fn cron_schedules(&self) -> Vec<crate::CronSchedule> {
        self.schedules
            .iter()
            .map(|s| s.schedule().expect("validated"))
            .collect()
    }

    /// The running limits (validated when the settings were made).
    pub fn running_limits(&self) -> Vec<crate::store::Limit> {
        self.limits
            .iter()
            .map(|l| l.limit().expect("validated"))
            .collect()
    }
}

impl Config {
    /// Parses a TOML document; unknown keys and wrong types are errors naming the key.
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| {
            let msg = e.message().trim().to_owned();
            let (field, line) = match e.span() {
                Some(span) => field_at(text, span.start),
                None => ("config file".to_owned(), 0),
            };
            err(field, format!("{msg} (line {line})"))
        })
    }

    /// Applies the environment, fills in defaults, validates.
    pub fn resolve(mut self, env: Overrides) -> Result<Settings, ConfigError> {
        let num = |field: &str, v: &str| {
            v.parse::<usize>()
                .map_err(|_| err(field, format!("{v:?} is not a whole number")))
        };
        let dur = |field: &str, v: &str| parse_duration(v).map_err(|p| err(field, p));
        if let Some(v) = env.database_url {
            self.database_url = Some(v);
        } else if self.database_url.is_none() {
            self.database_url = env.database_url_fallback;
        }
        if let Some(v) = env.metrics_listen {
            self.metrics.listen = Some(v);
        }
        if let Some(v) = env.batch_size {
            self.relay.batch_size = Some(num("relay.batch_size (POSTBOX_BATCH_SIZE)", &v)?);
        }
        if let Some(v) = env.concurrency {
            self.relay.concurrency = Some(num("relay.concurrency (POSTBOX_CONCURRENCY)", &v)?);
        }
        if let Some(v) = env.lease {
            self.relay.lease = Some(dur("relay.lease (POSTBOX_LEASE)", &v)?);
        }
        if let Some(v) = env.poll_interval {
            self.relay.poll_interval =
                Some(dur("relay.poll_interval (POSTBOX_POLL_INTERVAL)", &v)?);
        }
        if let Some(v) = env.shutdown_deadline {
            self.relay.shutdown_deadline = Some(dur(
                "relay.shutdown_deadline (POSTBOX_SHUTDOWN_DEADLINE)",
                &v,
            )?);
        }
        if let Some(v) = env.kafka_brokers {
            self.sinks
                .kafka
                .get_or_insert_with(Default::default)
                .brokers = v;
        }
        if !env.kafka_properties.is_empty() {
            let kafka = self.sinks.kafka.as_mut().ok_or_else(|| {
                err(
                    "POSTBOX_KAFKA_PROPERTY_*",
                    "Kafka properties are set but [sinks.kafka] is not configured",
                )
            })?;
            kafka.properties.extend(env.kafka_properties);
        }
        self.settings()
    }

    fn settings(self) -> Result<Settings, ConfigError> {
        let database_url = self
            .database_url
            .unwrap_or_else(|| DEFAULT_DATABASE_URL.to_owned());
        if !(database_url.starts_with("postgres://") || database_url.starts_with("postgresql://")) {
            return Err(err(
                "database_url",
                format!("{} is not a postgres:// URL", redact_url(&database_url)),
            ));
        }
        let mut engine = EngineConfig::default();
        let r = &self.relay;
        engine.batch_size = r.batch_size.unwrap_or(defaults::DEFAULT_BATCH_SIZE);
        engine.concurrency = r.concurrency.unwrap_or(defaults::DEFAULT_CONCURRENCY);
        engine.lease = r.lease.unwrap_or(defaults::DEFAULT_LEASE);
        engine.poll_interval = r.poll_interval.unwrap_or(defaults::DEFAULT_POLL_INTERVAL);
        engine.schedule_interval = r
            .schedule_interval
            .unwrap_or(defaults::DEFAULT_SCHEDULE_INTERVAL);
        engine.shutdown_deadline = r
            .shutdown_deadline
            .unwrap_or(defaults::DEFAULT_SHUTDOWN_DEADLINE);
        engine.delivery_timeout = r
            .delivery_timeout
            .unwrap_or(defaults::DEFAULT_DELIVERY_TIMEOUT);
        engine.topic_timeouts = r
            .topic_timeouts
            .iter()
            .map(|(k, d)| (k.clone(), *d))
            .collect();
        engine.hold_limit = r.hold_limit.unwrap_or(defaults::DEFAULT_HOLD_LIMIT);
        engine.keep_completed = self.retention.keep_completed;
        engine.validate().map_err(|e| match e {
            crate::Error::InvalidArgument {
                field: "keep_completed",
                problem,
            } => err("retention.keep_completed", problem),
            crate::Error::InvalidArgument { field, problem } => {
                err(format!("relay.{field}"), problem)
            }
            other => err("relay", other.to_string()),
        })?;
        let listen = self
            .metrics
            .listen
            .as_deref()
            .unwrap_or(DEFAULT_METRICS_LISTEN);
        let metrics_listen = listen.parse::<SocketAddr>().map_err(|_| {
            err(
                "metrics.listen",
                format!("{listen:?} is not host:port (like 0.0.0.0:9464)"),
            )
        })?;
        let sample_interval = self
            .metrics
            .sample_interval
            .unwrap_or(Duration::from_secs(5));
        if sample_interval < Duration::from_millis(100) {
            return Err(err("metrics.sample_interval", "must be at least 100ms"));
        }
        if let Some(k) = &self.sinks.kafka {
            if k.brokers.trim().is_empty() {
                return Err(err(
                    "sinks.kafka.brokers",
                    "must name at least one broker (host:port)",
                ));
            }
        }
        let mut routes = self.routes;
        if routes.is_empty() {
            routes.push(Route {
                topics: vec!["*".into()],
                sink: "log".into(),
                kafka_topic: None,
            });
        }
        for (i, route) in routes.iter().enumerate() {
            let at = |f: &str| format!("routes[{i}].{f}");
            if route.topics.is_empty() || route.topics.iter().any(|t| t.is_empty()) {
                return Err(err(
                    at("topics"),
                    "must list at least one non-empty topic or pattern",
                ));
            }
            match route.sink.as_str() {
                "kafka" if self.sinks.kafka.is_none() => {
                    return Err(err(
                        at("sink"),
                        "routes to kafka but [sinks.kafka] is not configured",
                    ));
                }
                "kafka" => {}
                "log" if route.kafka_topic.is_some() => {
                    return Err(err(
                        at("kafka_topic"),
                        "only a kafka route can rename its topic",
                    ));
                }
                "log" => {}
                other => {
                    return Err(err(
                        at("sink"),
                        format!("unknown sink {other:?} (expected one of {SINK_NAMES:?})"),
                    ));
                }
            }
        }
        let mut names = std::collections::HashSet::new();
        for (i, schedule) in self.schedules.iter().enumerate() {
            if let Err((field, problem)) = schedule.schedule() {
                return Err(err(format!("schedules.{i}.{field}"), problem));
            }
            if !names.insert(schedule.name.as_str()) {
                return Err(err(
                    format!("schedules.{i}.name"),
                    format!("{:?} names another schedule too", schedule.name),
                ));
            }
        }
        for (i, limit) in self.limits.iter().enumerate() {
            if let Err((field, problem)) = limit.limit() {
                return Err(err(format!("limits.{i}.{field}"), problem));
            }
        }
        Ok(Settings {
            database_url,
            engine,
            metrics_listen,
            sample_interval,
            kafka: self.sinks.kafka,
            routes,
            schedules: self.schedules,
            limits: self.limits,
        })
    }
}

/// The dotted name of the key whose line holds byte `at` (`relay.lease`), and the line number.
fn field_at(text: &str, at: usize) -> (String, usize) {
    let at = at.min(text.len());
    let line_start = text[..at].rfind('\n').map_or(0, |i| i + 1);
    let line_no = text[..at].matches('\n').count() + 1;
    let line = text[line_start..].lines().next().unwrap_or("");
    let key = line
        .split('=')
        .next()
        .unwrap_or("")
        .trim()
        .trim_matches('"');
    let section = text[..line_start]
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('['))
        .map(|l| l.trim_matches(|c| c == '[' || c == ']').trim().to_owned());
    let key = if key.is_empty() || key.starts_with('[') {
        None
    } else {
        Some(key)
    };
    let field = match (section, key) {
        (Some(s), Some(k)) => format!("{s}.{k}"),
        (None, Some(k)) => k.to_owned(),
        (Some(s), None) => s,
        (None, None) => "config file".to_owned(),
    };
    (field, line_no)
}

impl Settings {
    /// The effective configuration as TOML, secrets redacted (what `postbox config check` prints).
    pub fn to_redacted_toml(&self) -> String {
        let file = Config {
            database_url: Some(redact_url(&self.database_url)),
            relay: RelaySection {
                batch_size: Some(self.engine.batch_size),
                concurrency: Some(self.engine.concurrency),
                lease: Some(self.engine.lease),
                poll_interval: Some(self.engine.poll_interval),
                schedule_interval: Some(self.engine.schedule_interval),
                shutdown_deadline: Some(self.engine.shutdown_deadline),
                delivery_timeout: Some(self.engine.delivery_timeout),
                topic_timeouts: self.engine.topic_timeouts.iter().cloned().collect(),
                hold_limit: Some(self.engine.hold_limit),
            },
            metrics: MetricsSection {
                listen: Some(self.metrics_listen.to_string()),
                sample_interval: Some(self.sample_interval),
            },
            sinks: SinksSection {
                kafka: self.kafka.as_ref().map(|k| KafkaSink {
                    brokers: k.brokers.clone(),
                    properties: k
                        .properties
                        .iter()
                        .map(|(key, v)| {
                            (
                                key.clone(),
                                if is_secret(key) {
                                    "<redacted>".to_owned()
                                } else {
                                    v.clone()
                                },
                            )
                        })
                        .collect(),
                }),
            },
            routes: self.routes.clone(),
            retention: RetentionSection {
                keep_completed: self.engine.keep_completed,
            },
            schedules: self.schedules.clone(),
            limits: self.limits.clone(),
        };
        toml::to_string(&file).expect("the configuration serializes")
    }
}

/// True for librdkafka properties that hold credentials.
pub fn is_secret(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    [
        "password",
        "secret",
        "sasl.jaas",
        "sasl.oauthbearer.config",
        "ssl.key.pem",
        "ssl_key",
        "token",
    ]
    .iter()
    .any(|s| k.contains(s))
}

/// The URL with its password (and any `password=` parameter) replaced by `<redacted>`.
pub fn redact_url(url: &str) -> String {
    let mut out = url.to_owned();
    if let Some(scheme_end) = out.find("://") {
        let rest_start = scheme_end + 3;
        let authority_end = out[rest_start..]
            .find(['/', '?'])
            .map_or(out.len(), |i| rest_start + i);
        if let Some(at) = out[rest_start..authority_end].rfind('@') {
            let userinfo = &out[rest_start..rest_start + at];
            if let Some(colon) = userinfo.find(':') {
                let start = rest_start + colon + 1;
                out.replace_range(start..rest_start + at, "<redacted>");
            }
        }
    }
    if let Some(q) = out.find("password=") {
        let end = out[q..].find('&').map_or(out.len(), |i| q + i);
        out.replace_range(q + "password=".len()..end, "<redacted>");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONTRACT: &str = r#"
database_url = "postgres://postgres@localhost/postbox"

[relay]
batch_size = 500
concurrency = 64
lease = "30s"
poll_interval = "5s"
shutdown_deadline = "25s"

[metrics]
listen = "0.0.0.0:9464"

[sinks.kafka]
brokers = "localhost:9092"
properties = { "compression.type" = "lz4" }   # any librdkafka property

[[routes]]
topics = ["orders.*"]
sink = "kafka"
kafka_topic = "orders"                        # optional rename

[[routes]]
topics = ["*"]
sink = "log"
"#;

    #[test]
    fn the_contract_file_is_accepted_as_it_is() {
        let s = Config::from_toml(CONTRACT)
            .unwrap()
            .resolve(Overrides::default())
            .unwrap();
        assert_eq!(s.engine.batch_size, 500);
        assert_eq!(s.engine.concurrency, 64);
        assert_eq!(s.engine.lease, Duration::from_secs(30));
        assert_eq!(s.engine.schedule_interval, Duration::from_millis(100));
        let tuned = Config::from_toml("[relay]\nschedule_interval = \"250ms\"\n")
            .unwrap()
            .resolve(Overrides::default())
            .unwrap();
        assert_eq!(tuned.engine.schedule_interval, Duration::from_millis(250));
        assert_eq!(s.engine.delivery_timeout, Duration::from_secs(60));
        let timed = Config::from_toml(
            "[relay]\ndelivery_timeout = \"10s\"\ntopic_timeouts = { \"reports.*\" = \"1h\", \"reports.big\" = \"2h\" }\n",
        )
        .unwrap()
        .resolve(Overrides::default())
        .unwrap();
        assert_eq!(timed.engine.timeout_for("orders"), Duration::from_secs(10));
        assert_eq!(
            timed.engine.timeout_for("reports.x"),
            Duration::from_secs(3600)
        );
        assert_eq!(
            timed.engine.timeout_for("reports.big"),
            Duration::from_secs(7200)
        );
        let e = Config::from_toml("[relay]\ntopic_timeouts = { \"a\" = \"soon\" }\n").unwrap_err();
        assert!(e.to_string().contains("topic_timeouts"), "{e}");
        assert_eq!(s.engine.hold_limit, Duration::from_secs(1));
        let leasing = Config::from_toml("[relay]\nhold_limit = \"0s\"\n")
            .unwrap()
            .resolve(Overrides::default())
            .unwrap();
        assert!(leasing.engine.hold_limit.is_zero());
        let e = Config::from_toml("[relay]\nhold_limit = \"2m\"\n")
            .unwrap()
            .resolve(Overrides::default())
            .unwrap_err();
        assert!(e.to_string().contains("relay.hold_limit"), "{e}");
        assert_eq!(s.routes.len(), 2);
        assert_eq!(s.kafka.unwrap().properties["compression.type"], "lz4");
    }

    #[test]
    fn unknown_keys_are_named() {
        let e = Config::from_toml("[relay]\nbatchsize = 5\n").unwrap_err();
        assert_eq!(e.field, "relay.batchsize", "{e}");
        assert!(e.problem.contains("unknown field"), "{e}");
        let e = Config::from_toml("databse_url = \"x\"\n").unwrap_err();
        assert_eq!(e.field, "databse_url", "{e}");
        let e = Config::from_toml("[metrics]\nlisten = \"a\"\n[relay]\nlease = \"soon\"\n")
            .unwrap_err();
        assert_eq!(e.field, "relay.lease", "{e}");
        assert!(e.problem.contains("line 4"), "{e}");
    }

    #[test]
    fn invalid_values_name_the_field() {
        let bad = |toml: &str| {
            Config::from_toml(toml)
                .and_then(|c| c.resolve(Overrides::default()))
                .unwrap_err()
                .field
        };
        assert_eq!(bad("[relay]\nbatch_size = 0\n"), "relay.batch_size");
        assert_eq!(
            bad("[relay]\nschedule_interval = \"1ms\"\n"),
            "relay.schedule_interval"
        );
        assert_eq!(bad("[relay]\nlease = \"30 parsecs\"\n"), "relay.lease");
        assert_eq!(bad("[metrics]\nlisten = \"nowhere\"\n"), "metrics.listen");
        assert_eq!(
            bad("[[routes]]\ntopics = [\"*\"]\nsink = \"kafka\"\n"),
            "routes[0].sink"
        );
        assert_eq!(
            bad("[[routes]]\ntopics = [\"*\"]\nsink = \"s3\"\n"),
            "routes[0].sink"
        );
        assert_eq!(bad("database_url = \"mysql://x\"\n"), "database_url");
        let schedule = |fields: &str| format!("[[schedules]]\nname = \"a\"\n{fields}\n");
        assert_eq!(
            bad(&schedule("cron = \"* * * *\"\ntopic = \"t\"")),
            "schedules.0.cron"
        );
        assert_eq!(
            bad(&schedule("cron = \"* * * * *\"\ntopic = \"\"")),
            "schedules.0.topic"
        );
        assert_eq!(
            bad(&format!(
                "{}{}",
                schedule("cron = \"* * * * *\"\ntopic = \"t\""),
                schedule("cron = \"* * * * *\"\ntopic = \"u\"")
            )),
            "schedules.1.name"
        );
        let ok = Config::from_toml(&schedule(
            "cron = \"0 3 * * *\"\ntimezone = \"Europe/Berlin\"\ntopic = \"r\"\npayload = { kind = \"nightly\" }",
        ))
        .unwrap()
        .resolve(Overrides::default())
        .unwrap();
        let s = &ok.cron_schedules()[0];
        assert_eq!((s.name(), s.timezone_name()), ("a", "Europe/Berlin"));
        // config check prints them back.
        assert!(ok.to_redacted_toml().contains("[[schedules]]"));
        assert_eq!(
            bad("[[limits]]\ntopics = [\"a\"]\nmax_running = 0\n"),
            "limits.0.max_running"
        );
        assert_eq!(
            bad(
                "[[limits]]\ntopics = [\"a\"]\nmax_running = 1\n[[limits]]\ntopics = []\nmax_running = 1\n"
            ),
            "limits.1.topics"
        );
        let ok = Config::from_toml(
            "[[limits]]\ntopics = [\"emails.*\"]\nmax_running = 5\nper_key = true\n",
        )
        .unwrap()
        .resolve(Overrides::default())
        .unwrap();
        let l = &ok.running_limits()[0];
        assert_eq!((l.max_running(), l.is_per_key()), (5, true));
        assert!(ok.to_redacted_toml().contains("[[limits]]"));
        assert_eq!(
            bad("[retention]\nkeep_completed = \"10s\"\n"),
            "retention.keep_completed"
        );
        let kept = Config::from_toml("[retention]\nkeep_completed = \"24h\"\n")
            .unwrap()
            .resolve(Overrides::default())
            .unwrap();
        assert_eq!(
            kept.engine.keep_completed,
            Some(Duration::from_secs(24 * 3600))
        );
        assert!(
            kept.to_redacted_toml()
                .contains("keep_completed = \"1day\"")
        );
    }

    #[test]
    fn precedence_is_env_over_file_over_default() {
        let c =
            Config::from_toml("database_url = \"postgres://file/db\"\n[relay]\nbatch_size = 7\n")
                .unwrap();
        let s = c.clone().resolve(Overrides::default()).unwrap();
        assert_eq!(
            (
                s.database_url.as_str(),
                s.engine.batch_size,
                s.engine.concurrency
            ),
            ("postgres://file/db", 7, 100)
        );
        let env = Overrides {
            database_url: Some("postgres://env/db".into()),
            batch_size: Some("9".into()),
            ..Default::default()
        };
        let s = c.resolve(env).unwrap();
        assert_eq!(
            (s.database_url.as_str(), s.engine.batch_size),
            ("postgres://env/db", 9)
        );
        // DATABASE_URL, which every diesel user has exported, does not beat the file...
        let generic = Overrides {
            database_url_fallback: Some("postgres://other/app".into()),
            ..Default::default()
        };
        let s = Config::from_toml("database_url = \"postgres://file/db\"\n")
            .unwrap()
            .resolve(generic.clone())
            .unwrap();
        assert_eq!(s.database_url, "postgres://file/db");
        // ...it is the fallback when the file has none (the chart passes it so)...
        let s = Config::default().resolve(generic.clone()).unwrap();
        assert_eq!(s.database_url, "postgres://other/app");
        // ...and POSTBOX_DATABASE_URL (or --database-url) beats both.
        let s = Config::from_toml("database_url = \"postgres://file/db\"\n")
            .unwrap()
            .resolve(Overrides {
                database_url: Some("postgres://postbox/db".into()),
                ..generic
            })
            .unwrap();
        assert_eq!(s.database_url, "postgres://postbox/db");
        let e = Config::default()
            .resolve(Overrides {
                lease: Some("soon".into()),
                ..Default::default()
            })
            .unwrap_err();
        assert_eq!(e.field, "relay.lease (POSTBOX_LEASE)");
    }

    #[test]
    fn kafka_properties_come_from_the_environment_too() {
        let c = Config::from_toml("[sinks.kafka]\nbrokers = \"b:9092\"\n").unwrap();
        let env = Overrides {
            kafka_properties: [("sasl.password".to_owned(), "pw".to_owned())].into(),
            ..Default::default()
        };
        let s = c.resolve(env).unwrap();
        assert_eq!(s.kafka.as_ref().unwrap().properties["sasl.password"], "pw");
        assert!(!s.to_redacted_toml().contains("\"pw\""));
    }

    #[test]
    fn secrets_are_redacted() {
        assert_eq!(
            redact_url("postgres://u:hunter2@h:5432/db?sslmode=require"),
            "postgres://u:<redacted>@h:5432/db?sslmode=require"
        );
        assert_eq!(
            redact_url("postgres://u@h/db?password=hunter2&x=1"),
            "postgres://u@h/db?password=<redacted>&x=1"
        );
        let c = Config::from_toml(
            "database_url = \"postgres://u:pw@h/db\"\n[sinks.kafka]\nbrokers = \"b:9092\"\nproperties = { \"sasl.password\" = \"pw\", \"sasl.username\" = \"u\" }\n",
        )
        .unwrap();
        let out = c.resolve(Overrides::default()).unwrap().to_redacted_toml();
        assert!(!out.contains("pw\""), "{out}");
        assert!(
            out.contains("sasl.username") && out.contains("<redacted>"),
            "{out}"
        );
        // What is printed is itself a valid config.
        Config::from_toml(&out).unwrap();
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(
            parse_duration("7d").unwrap(),
            Duration::from_secs(7 * 86400)
        );
        assert_eq!(parse_duration("1h 30m").unwrap(), Duration::from_secs(5400));
        assert!(parse_duration("5").is_err());
        assert!(parse_duration("5 fortnights").is_err());
        assert_eq!(format_duration(Duration::from_millis(1500)), "1s 500ms");
    }
}
