//! The relay and its commands, behind the thin `main.rs`: the command line (`cli`) dispatches to a
//! file per command group (`dead`, `enqueue`, `status`, `demo`); running the relay, migrating and
//! the admin store are here, the metrics server in `serve`.

mod cancel;
mod check;
pub mod cli;
mod dead;
mod demo;
mod enqueue;
mod grant;
mod pause;
mod serve;
mod show;
mod status;
mod stream;
mod ui;

pub use dead::selector;
pub use demo::{DemoSummary, demo};
pub use enqueue::enqueue;
pub use serve::serve_metrics;
pub use ui::{RelayView, serve_ui};

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::Error;
use crate::config::{Settings, redact_url};
use crate::engine::{Engine, RunReport};
use crate::metrics::Metrics;
use crate::sink::Sink;
use crate::sink::log::LogSink;
use crate::store::{Store, Topics};

/// An error of the relay, with the exit code it maps to.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// Bad usage or configuration: exit code 2.
    #[error("{0}")]
    Usage(String),
    /// Anything that went wrong while running: exit code 1.
    #[error(transparent)]
    Runtime(#[from] anyhow::Error),
}

impl RelayError {
    /// The process exit code.
    pub fn exit_code(&self) -> i32 {
        match self {
            RelayError::Usage(_) => 2,
            RelayError::Runtime(_) => 1,
        }
    }
}

impl From<Error> for RelayError {
    fn from(e: Error) -> Self {
        match e {
            Error::InvalidMessage(_) | Error::InvalidArgument { .. } => {
                RelayError::Usage(e.to_string())
            }
            other => RelayError::Runtime(other.into()),
        }
    }
}

type Result<T> = std::result::Result<T, RelayError>;

/// Text from the database for a terminal: control characters (an escape sequence in a key or an
/// error would repaint the operator's terminal) are shown escaped, `\u{1b}`.
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(text);
    }
    std::borrow::Cow::Owned(
        text.chars()
            .map(|c| {
                if c.is_control() {
                    c.escape_unicode().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect(),
    )
}

/// Splits `postgres://host/db?x` into the server URL (database `postgres`) and the name `db`.
fn admin_url(url: &str) -> Option<(String, String)> {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let scheme_end = base.find("://")? + 3;
    let slash = base[scheme_end..].find('/')? + scheme_end;
    let name = &base[slash + 1..];
    if name.is_empty() {
        return None;
    }
    let admin = format!(
        "{}/postgres{}",
        &base[..slash],
        query.map(|q| format!("?{q}")).unwrap_or_default()
    );
    Some((admin, name.to_owned()))
}

/// Creates the database if it does not exist, then runs the pending migrations.
pub async fn migrate(settings: &Settings) -> Result<Vec<String>> {
    let url = &settings.database_url;
    if crate::store::connect::open(url).await.is_err() {
        let (admin, name) = admin_url(url).ok_or_else(|| {
            RelayError::Usage(format!(
                "database_url: {} names no database",
                redact_url(url)
            ))
        })?;
        let mut conn = crate::store::connect::open(&admin)
            .await
            .map_err(|e| anyhow::anyhow!("cannot reach the server of {}: {e}", redact_url(url)))?;
        crate::store::migrate::create_database(&mut conn, &name)
            .await
            .map_err(|e| anyhow::anyhow!("create database {name}: {e}"))?;
        tracing::info!(database = %name, "created database");
    }
    let conn = crate::store::connect::open(url)
        .await
        .map_err(|e| anyhow::anyhow!("connect to {}: {e}", redact_url(url)))?;
    let database = admin_url(url).map(|(_, name)| name).unwrap_or_default();
    let applied = match crate::migrate_async(conn).await {
        Ok((applied, _)) => applied,
        Err(e) => return Err(missing_privilege(&e.to_string(), &database).unwrap_or(e.into())),
    };
    // Roles given rights by `postbox grant` get them on what migrations created (and back where
    // someone took some of them): the owner's upkeep, which another role with nothing to apply
    // (an app's writer migrating at start) leaves to it.
    let store = Store::connect(url, 1).await?;
    if applied.is_empty() && !store.owns_schema().await? {
        return Ok(applied);
    }
    note_analyzed(store.analyze_if_never_analyzed().await);
    for (role, kind, done) in store.regrant().await? {
        match done {
            Ok(()) => tracing::info!(role, kind = kind.name(), "granted again"),
            Err(e) => tracing::warn!(
                role,
                kind = kind.name(),
                error = %e,
                "could not grant again: run `postbox grant`"
            ),
        }
    }
    Ok(applied)
}

/// A migration refused for want of a privilege, said with the privilege it needs.
fn missing_privilege(error: &str, database: &str) -> Option<RelayError> {
    let needs = if error.contains("permission denied for database") {
        format!(
            "the migrating role needs CREATE on database {database} to create schema postbox \
             (GRANT CREATE ON DATABASE {database} TO the role), or to be the database's owner"
        )
    } else if error.contains("must be owner of") || error.contains("permission denied") {
        "the migrating role must own schema postbox and its objects: run `postbox migrate` as the \
         role that ran it first (the relay and the apps need not: see `postbox grant`)"
            .to_owned()
    } else {
        return None;
    };
    Some(RelayError::Runtime(anyhow::anyhow!(
        "migrate: {}\n{needs}",
        error.trim()
    )))
}

/// Opens the store, retrying with back-off while the database is unreachable (a relay that
/// starts before its database must not crash-loop), until `stop`.
pub async fn connect(settings: &Settings, stop: &CancellationToken) -> Result<Store> {
    let mut pause = Duration::from_millis(250);
    loop {
        let attempt = async {
            // A direct connection first: it fails at once when nothing listens (a pool would wait
            // out its checkout timeout).
            drop(crate::store::connect::establish(&settings.database_url).await?);
            let store =
                Store::connect(&settings.database_url, crate::engine::DEFAULT_POOL_SIZE).await?;
            store.check_schema().await?;
            note_analyzed(store.analyze_if_never_analyzed().await);
            Ok::<_, Error>(store)
        };
        match attempt.await {
            Ok(store) => return Ok(store),
            Err(Error::Migration(_)) => return Err(missing_schema(settings).into()),
            Err(e) => {
                tracing::warn!(database = %redact_url(&settings.database_url), error = %redact_url(&e.to_string()), retry_in = ?pause, "database unreachable");
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = stop.cancelled() => return Err(anyhow::anyhow!("stopped before the database was reachable").into()),
                }
                pause = (pause * 2).min(Duration::from_secs(30));
            }
        }
    }
}

/// What finding `postbox.messages` without statistics led to, in the log.
fn note_analyzed(r: std::result::Result<crate::store::Analyzed, Error>) {
    use crate::store::Analyzed;
    match r {
        Ok(Analyzed::HadStatistics) => {}
        Ok(Analyzed::Now) => tracing::info!(
            "postbox.messages had never been analyzed (a new deploy, pg_upgrade, a restore): analyzed it"
        ),
        Ok(Analyzed::NotAllowed) => tracing::warn!(
            "postbox.messages has never been analyzed, and this role may not (run ANALYZE postbox.messages as its owner, or `postbox migrate`); claims are planned to do without"
        ),
        Err(e) => {
            tracing::debug!(error = %e, "could not tell whether postbox.messages was analyzed")
        }
    }
}

/// One sink per route. Each route claims its topics minus those of the routes before it (first
/// match wins), so each runs its own engine: a sink that is down backs off alone, and the other
/// routes keep flowing.
pub fn build_sinks(settings: &Settings) -> Result<Vec<Arc<dyn Sink>>> {
    let mut sinks: Vec<Arc<dyn Sink>> = Vec::new();
    let mut earlier: Option<Topics> = None;
    #[cfg(feature = "kafka")]
    let mut producer = None;
    for (i, r) in settings.routes.iter().enumerate() {
        let mine = Topics::only(&r.topics);
        let topics = match &earlier {
            Some(e) => mine.clone().excluding(e),
            None => mine.clone(),
        };
        earlier = Some(match earlier {
            Some(e) => Topics::only(e.patterns_and(&r.topics)),
            None => mine,
        });
        if topics.is_empty() {
            tracing::warn!(
                route = i,
                "route never matches: earlier routes take all its topics"
            );
            continue;
        }
        // One name per route in metrics and health: `kafka`, or `kafka[N]` (N the route's index)
        // when several routes use the same kind of sink.
        let shared = settings.routes.iter().filter(|o| o.sink == r.sink).count() > 1;
        let name = if shared {
            format!("{}[{i}]", r.sink)
        } else {
            r.sink.clone()
        };
        let sink: Arc<dyn Sink> = match r.sink.as_str() {
            "log" => Arc::new(LogSink::new(topics).named(name)),
            #[cfg(feature = "kafka")]
            "kafka" => {
                let kafka = settings.kafka.as_ref().ok_or_else(|| {
                    RelayError::Usage(format!("routes[{i}].sink: [sinks.kafka] is not configured"))
                })?;
                if producer.is_none() {
                    producer = Some(
                        crate::sink::kafka::producer(&kafka.brokers, &kafka.properties)
                            .map_err(RelayError::Usage)?,
                    );
                }
                let p = producer.clone().expect("created above");
                let layout = r
                    .layout()
                    .map_err(|(field, e)| RelayError::Usage(format!("routes[{i}].{field}: {e}")))?;
                Arc::new(crate::sink::kafka::KafkaSink::new(p, topics, layout).named(name))
            }
            #[cfg(not(feature = "kafka"))]
            "kafka" => {
                return Err(RelayError::Usage(format!(
                    "routes[{i}].sink: this build has no kafka sink (feature `kafka`)"
                )));
            }
            other => {
                return Err(RelayError::Usage(format!(
                    "routes[{i}].sink: unknown sink {other:?}"
                )));
            }
        };
        sinks.push(sink);
    }
    Ok(sinks)
}

/// Runs the relay until a signal (or, with `drain`, until nothing claimable is left): one engine
/// per route over one connection pool, metrics and health on the configured address, database
/// gauges sampled on an interval.
pub async fn run(
    settings: Settings,
    drain: bool,
    shutdown: CancellationToken,
    hard_stop: CancellationToken,
) -> Result<RunReport> {
    let sinks = build_sinks(&settings)?;
    let mut names: Vec<&str> = sinks.iter().map(|s| s.name()).collect();
    names.sort_unstable();
    names.dedup();
    let metrics = Metrics::with_max_topics(&names, settings.metrics_max_topics);
    metrics.routes(
        sinks
            .iter()
            .map(|s| (s.name().to_owned(), s.topics()))
            .collect(),
    );
    metrics.stall_after(Some(stall_limit(&settings.engine)));
    let server = match settings.metrics_listen {
        Some(addr) => serve_metrics(addr, metrics.clone(), shutdown.clone()).await?,
        None => tokio::spawn(async {}),
    };
    let store = match connect(&settings, &shutdown).await {
        Ok(s) => s,
        // Asked to stop while still waiting for the database: nothing was claimed, a clean exit.
        Err(_) if shutdown.is_cancelled() => {
            let _ = server.await;
            return Ok(RunReport::default());
        }
        Err(e) => return Err(e),
    };
    let console = match &settings.ui {
        Some(ui) if !drain => {
            for note in ui.notes() {
                tracing::warn!("{note}");
            }
            let view = RelayView {
                metrics: Some(metrics.clone()),
                schedules: settings.cron_schedules(),
                limits: settings.running_limits(),
                stream_slot: settings.stream.as_ref().map(|s| s.slot.clone()),
            };
            Some(ui::serve_ui(ui.clone(), &settings.database_url, view, shutdown.clone()).await?)
        }
        _ => None,
    };
    let sampler = tokio::spawn(crate::metrics::sample(
        store.clone(),
        metrics.clone(),
        settings.sample_interval,
        settings.running_limits(),
        settings.engine.keep_completed.is_some(),
        settings.stream.is_some(),
        shutdown.clone(),
    ));
    // Stream mode reads the slot through the same routes' sinks; a one-off drain does not stream.
    let streamer = match &settings.stream {
        Some(s) if !drain => Some(stream::spawn(
            &settings,
            s,
            sinks.clone(),
            store.clone(),
            metrics.clone(),
            shutdown.clone(),
            hard_stop.clone(),
        )?),
        _ => None,
    };
    let mut engines = Vec::new();
    // One payload budget for every route: the relay's memory, not each route's.
    let budget = crate::engine::PayloadBudget::new(settings.engine.payload_budget);
    for sink in sinks {
        let mut builder = Engine::builder(&settings.database_url)
            .store(store.clone())
            .payload_budget(budget.clone())
            .sink_arc(sink)
            .config(settings.engine.clone())
            .drain(drain)
            .observer(metrics.clone());
        if drain {
            builder = builder.listen(false);
        }
        for l in settings.running_limits() {
            builder = builder.limit(l);
        }
        // The first engine runs the schedules (once per process is enough: the database makes
        // each tick one message across relays anyway).
        if engines.is_empty() {
            for s in settings.cron_schedules() {
                builder = builder.schedule(s);
            }
        }
        engines.push(builder.build().await?);
    }
    tracing::info!(database = %redact_url(&settings.database_url), metrics = %settings.metrics_listen.map_or_else(|| "off".to_owned(), |a| a.to_string()), routes = engines.len(), "relay running");
    let runs: Vec<_> = engines
        .into_iter()
        .map(|e| tokio::spawn(e.run_until(shutdown.clone(), hard_stop.clone())))
        .collect();
    let mut report = RunReport::default();
    let mut failure = None;
    for r in runs {
        match r.await {
            Ok(Ok(r)) => {
                report.claimed += r.claimed;
                report.delivered += r.delivered;
                report.retried += r.retried;
                report.dead_lettered += r.dead_lettered;
                report.released += r.released;
                report.fenced += r.fenced;
            }
            Ok(Err(e)) => failure = Some(RelayError::from(e)),
            Err(e) => failure = Some(RelayError::Runtime(anyhow::anyhow!("engine task: {e}"))),
        }
    }
    shutdown.cancel();
    if let Some(s) = streamer {
        match s.await {
            Ok(r) => {
                report.delivered += r.delivered;
                report.dead_lettered += r.dead_lettered;
            }
            Err(e) => tracing::error!(error = %e, "stream task"),
        }
    }
    let _ = sampler.await;
    let _ = server.await;
    if let Some(c) = console {
        let _ = c.await;
    }
    tracing::info!(?report, "relay stopped");
    match failure {
        Some(e) => Err(e),
        None => Ok(report),
    }
}

/// How long an engine may go without progress before `/healthz` calls it stuck: twice the longest
/// a healthy claim loop can wait (for a notification, for a delivery to end, for a sink to come
/// back, for a write to be retried), plus a margin.
pub fn stall_limit(e: &crate::engine::EngineConfig) -> std::time::Duration {
    let longest_delivery = e
        .topic_timeouts
        .iter()
        .map(|(_, t)| *t)
        .chain([e.delivery_timeout])
        .max()
        .unwrap_or(e.delivery_timeout);
    let wait = [
        e.poll_interval,
        longest_delivery,
        e.max_unavailable_backoff,
        std::time::Duration::from_secs(5),
    ]
    .into_iter()
    .max()
    .unwrap_or_default();
    wait * 2 + std::time::Duration::from_secs(30)
}

/// Opens a store for the admin commands (status, dead ...), without retrying.
pub async fn admin_store(settings: &Settings) -> Result<Store> {
    let cannot_connect = |e: &dyn std::fmt::Display| {
        anyhow::anyhow!(
            "connect to {}: {}",
            redact_url(&settings.database_url),
            redact_url(&e.to_string())
        )
    };
    // One connection first, so the real cause (no such database, connection refused, bad
    // password) is said at once, not a pool's timeout after it retried for seconds.
    crate::store::connect::establish(&settings.database_url)
        .await
        .map_err(|e| cannot_connect(&e))?;
    let store = Store::connect(&settings.database_url, 2)
        .await
        .map_err(|e| cannot_connect(&e))?;
    store.check_schema().await.map_err(|e| match e {
        crate::Error::Migration(_) => missing_schema(settings),
        e => anyhow::anyhow!("{e}"),
    })?;
    Ok(store)
}

/// What an operator is told when the database has no (or an old) postbox schema.
fn missing_schema(settings: &Settings) -> anyhow::Error {
    anyhow::anyhow!(
        "the postbox schema is missing or outdated in {}: run `postbox migrate` with this \
         configuration",
        redact_url(&settings.database_url)
    )
}
