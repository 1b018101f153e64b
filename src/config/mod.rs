//! The relay's configuration: a TOML file, the environment and command-line flags, in that order of
//! increasing precedence over the defaults. Unknown keys are refused; every error names the field.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::engine::EngineConfig;
use crate::engine::config as defaults;

mod durations;
mod jobs;
mod redact;
mod route;
mod stream;
mod ui;
pub use durations::parse_duration;
use durations::{duration_map, opt_bytes, opt_duration};
pub use jobs::{LimitSection, RetentionSection, ScheduleSection};
pub use redact::{is_secret, redact_url, redact_values};
pub use route::{FORMAT_NAMES, Route};
pub use stream::{StreamSection, StreamSettings};
pub use ui::{DEFAULT_UI_LISTEN, UiSection, UiSettings};

/// The database a relay uses when none is configured.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@localhost/postbox";
/// Where metrics and health are served when nothing is configured.
pub const DEFAULT_METRICS_LISTEN: &str = "0.0.0.0:9464";

/// A configuration problem: the field and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct ConfigError {
    /// The field, as a path of the file (`relay.lease`, `routes[1].format`) and, when the value came
    /// from the environment, the variable.
    pub field: String,
    /// What is wrong with the value.
    pub problem: String,
}

fn err(field: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        problem: problem.into(),
    }
}

/// serde's words for a value of the wrong type name our Rust types (`expected struct
/// RelaySection`); an operator reads `expected a table`.
fn plain_serde_message(msg: &str) -> String {
    let mut out = msg.to_owned();
    while let Some(at) = out.find("expected struct ") {
        let rest = &out[at + "expected struct ".len()..];
        let end = rest
            .find(|c: char| !c.is_alphanumeric() && c != '_')
            .unwrap_or(rest.len());
        out = format!(
            "{}expected a table{}",
            &out[..at],
            &out[at + "expected struct ".len() + end..]
        );
    }
    out
}

/// The whole file.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// PostgreSQL URL (`sslmode=require|verify-full` supported).
    pub database_url: Option<String>,
    /// `[relay]`: claims, leases, delivery and shutdown.
    #[serde(default)]
    pub relay: RelaySection,
    /// `[metrics]`: the metrics and health server.
    #[serde(default)]
    pub metrics: MetricsSection,
    /// `[sinks]`: the sinks routes can name.
    #[serde(default)]
    pub sinks: SinksSection,
    /// `[retention]`: keeping delivered messages.
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
    /// Stream mode: also deliver messages published into the WAL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<StreamSection>,
    /// The operator console.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ui: Option<UiSection>,
}

/// `[relay]`: the engine's settings.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RelaySection {
    /// Messages per claim (default 100).
    pub batch_size: Option<usize>,
    /// Deliveries at once (default 100).
    pub concurrency: Option<usize>,
    /// Visibility timeout of a claimed message, extended while it is delivered (default 30s).
    #[serde(default, with = "opt_duration")]
    pub lease: Option<Duration>,
    /// Fallback poll when no NOTIFY arrives (default 5s).
    #[serde(default, with = "opt_duration")]
    pub poll_interval: Option<Duration>,
    /// Longest sleep of the scheduler that makes due scheduled messages available.
    #[serde(default, with = "opt_duration")]
    pub schedule_interval: Option<Duration>,
    /// How long running deliveries may finish at shutdown (default 25s).
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
    /// Bytes of claimed messages in memory at once across the relay's routes (`"64MiB"`, a
    /// number of bytes; `0`: no limit).
    #[serde(default, with = "opt_bytes", skip_serializing_if = "Option::is_none")]
    pub payload_budget: Option<usize>,
}

/// `[metrics]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsSection {
    /// `host:port` for `/metrics`, `/healthz`, `/readyz`.
    pub listen: Option<String>,
    /// How often the database gauges are sampled, in one query (default 5s).
    #[serde(default, with = "opt_duration")]
    pub sample_interval: Option<Duration>,
    /// How many topics get series of their own (the largest; the others count under the label
    /// value `(other)`). Default 50: about 30 series a topic.
    pub max_topics: Option<usize>,
}

/// `[sinks]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SinksSection {
    /// `[sinks.kafka]`: the Kafka producer.
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
    /// `POSTBOX_METRICS_LISTEN`.
    pub metrics_listen: Option<String>,
    /// `POSTBOX_BATCH_SIZE`.
    pub batch_size: Option<String>,
    /// `POSTBOX_CONCURRENCY`.
    pub concurrency: Option<String>,
    /// `POSTBOX_LEASE`.
    pub lease: Option<String>,
    /// `POSTBOX_POLL_INTERVAL`.
    pub poll_interval: Option<String>,
    /// `POSTBOX_SHUTDOWN_DEADLINE`.
    pub shutdown_deadline: Option<String>,
    /// `POSTBOX_KAFKA_BROKERS`.
    pub kafka_brokers: Option<String>,
    /// librdkafka properties from `POSTBOX_KAFKA_PROPERTY_<NAME>`: `SASL_PASSWORD` → `sasl.password`
    /// (how the Helm chart passes credentials from Secrets).
    pub kafka_properties: BTreeMap<String, String>,
    /// `POSTBOX_UI_TOKEN`: the console's token (a Secret's, in the chart).
    pub ui_token: Option<String>,
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
            ui_token: var("POSTBOX_UI_TOKEN"),
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

/// The configuration a relay runs with, every default filled in and validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// The database: the file's, `POSTBOX_DATABASE_URL`, or `DATABASE_URL`.
    pub database_url: String,
    /// The engine every route runs with (claims, leases, timeouts, limits).
    pub engine: EngineConfig,
    /// `None`: `metrics.listen = "off"`, no metrics and health server.
    pub metrics_listen: Option<SocketAddr>,
    /// `metrics.sample_interval`.
    pub sample_interval: Duration,
    /// `metrics.max_topics`.
    pub metrics_max_topics: usize,
    /// `[sinks.kafka]`, with the environment's brokers and properties.
    pub kafka: Option<KafkaSink>,
    /// `[[routes]]` (one route of every topic to the log sink when there are none).
    pub routes: Vec<Route>,
    /// Validated: each builds its [`crate::CronSchedule`].
    pub schedules: Vec<ScheduleSection>,
    /// Validated: each builds its [`crate::store::Limit`].
    pub limits: Vec<LimitSection>,
    /// `[stream]`, when stream mode is on.
    pub stream: Option<StreamSettings>,
    /// `[ui]`, when the console is on.
    pub ui: Option<UiSettings>,
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
            let msg = plain_serde_message(e.message().trim());
            let (field, line) = match e.span() {
                Some(span) => field_at(text, span.start),
                None => ("config file".to_owned(), 0),
            };
            err(field, format!("{msg} (line {line})"))
        })
    }

    /// Applies the environment, fills in defaults, validates. A value from the environment that
    /// is wrong is named with its variable (`relay.lease (POSTBOX_LEASE)`).
    pub fn resolve(self, env: Overrides) -> Result<Settings, ConfigError> {
        let from_env: Vec<(&str, &str)> = [
            (
                "database_url",
                env.database_url.is_some(),
                "POSTBOX_DATABASE_URL",
            ),
            (
                "database_url",
                env.database_url.is_none()
                    && self.database_url.is_none()
                    && env.database_url_fallback.is_some(),
                "DATABASE_URL",
            ),
            (
                "metrics.listen",
                env.metrics_listen.is_some(),
                "POSTBOX_METRICS_LISTEN",
            ),
            (
                "relay.batch_size",
                env.batch_size.is_some(),
                "POSTBOX_BATCH_SIZE",
            ),
            (
                "relay.concurrency",
                env.concurrency.is_some(),
                "POSTBOX_CONCURRENCY",
            ),
            ("relay.lease", env.lease.is_some(), "POSTBOX_LEASE"),
            (
                "relay.poll_interval",
                env.poll_interval.is_some(),
                "POSTBOX_POLL_INTERVAL",
            ),
            (
                "relay.shutdown_deadline",
                env.shutdown_deadline.is_some(),
                "POSTBOX_SHUTDOWN_DEADLINE",
            ),
            (
                "sinks.kafka.brokers",
                env.kafka_brokers.is_some(),
                "POSTBOX_KAFKA_BROKERS",
            ),
            ("ui.token", env.ui_token.is_some(), "POSTBOX_UI_TOKEN"),
        ]
        .into_iter()
        .filter(|(_, set, _)| *set)
        .map(|(field, _, var)| (field, var))
        .collect();
        self.apply(env).map_err(|mut e| {
            if let Some((_, var)) = from_env.iter().find(|(f, _)| e.field == *f) {
                e.field = format!("{} ({var})", e.field);
            }
            e
        })
    }

    /// The environment over the file, then [`Config::settings`]; an error's field is the key alone
    /// (`resolve` adds the variable when the value came from one).
    fn apply(mut self, env: Overrides) -> Result<Settings, ConfigError> {
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
            self.relay.batch_size = Some(num("relay.batch_size", &v)?);
        }
        if let Some(v) = env.concurrency {
            self.relay.concurrency = Some(num("relay.concurrency", &v)?);
        }
        if let Some(v) = env.lease {
            self.relay.lease = Some(dur("relay.lease", &v)?);
        }
        if let Some(v) = env.poll_interval {
            self.relay.poll_interval = Some(dur("relay.poll_interval", &v)?);
        }
        if let Some(v) = env.shutdown_deadline {
            self.relay.shutdown_deadline = Some(dur("relay.shutdown_deadline", &v)?);
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
        if let Some(t) = env.ui_token {
            self.ui.get_or_insert_default().token = Some(t);
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
        engine.payload_budget = r
            .payload_budget
            .unwrap_or(crate::engine::DEFAULT_PAYLOAD_BUDGET);
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
        // "off": no metrics and health server (a one-off `run --drain` beside a running relay).
        let metrics_listen = if listen == "off" {
            None
        } else {
            Some(listen.parse::<SocketAddr>().map_err(|_| {
                err(
                    "metrics.listen",
                    format!("{listen:?} is not host:port (like 0.0.0.0:9464) or \"off\""),
                )
            })?)
        };
        let sample_interval = self
            .metrics
            .sample_interval
            .unwrap_or(Duration::from_secs(5));
        if sample_interval < Duration::from_millis(100) {
            return Err(err("metrics.sample_interval", "must be at least 100ms"));
        }
        if let Some(k) = &self.sinks.kafka
            && k.brokers.trim().is_empty()
        {
            return Err(err(
                "sinks.kafka.brokers",
                "must name at least one broker (host:port)",
            ));
        }
        let mut routes = self.routes;
        if routes.is_empty() {
            routes.push(Route {
                topics: vec!["*".into()],
                sink: "log".into(),
                ..Route::default()
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
                "kafka" if !cfg!(feature = "kafka") => {
                    return Err(err(
                        at("sink"),
                        "this build of postbox has no kafka sink (cargo feature `kafka`)",
                    ));
                }
                "kafka" => {
                    route
                        .layout()
                        .map_err(|(field, problem)| err(at(field), problem))?;
                }
                "log" if route.has_kafka_settings().is_some() => {
                    let field = route.has_kafka_settings().expect("checked");
                    return Err(err(at(field), "applies to a kafka route only"));
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
            metrics_max_topics: self
                .metrics
                .max_topics
                .unwrap_or(crate::metrics::DEFAULT_MAX_TOPICS),
            kafka: self.sinks.kafka,
            routes,
            schedules: self.schedules,
            limits: self.limits,
            stream: self
                .stream
                .as_ref()
                .map(StreamSection::settings)
                .transpose()?,
            ui: self
                .ui
                .as_ref()
                .map(UiSection::settings)
                .transpose()?
                .flatten(),
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

#[cfg(test)]
mod tests;
