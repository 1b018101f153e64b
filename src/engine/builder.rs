//! [`EngineBuilder`]: an engine's settings, checked at `build()` (the database's schema, the
//! role's privileges, an app pool's session settings).

use std::sync::Arc;
use std::time::Duration;

use super::*;

/// Builds an [`Engine`]; every setting has a documented default (see [`config`]).
pub struct EngineBuilder {
    database_url: String,
    store: Option<Store>,
    pool: Option<Pool>,
    sink: Option<Arc<dyn Sink>>,
    config: EngineConfig,
    backoff: Option<Backoff>,
    observer: Arc<dyn Observer>,
    listen: bool,
    #[cfg(feature = "cron")]
    schedules: Vec<CronSchedule>,
    limits: Vec<Limit>,
    budget: Option<Arc<PayloadBudget>>,
    #[cfg(feature = "metrics")]
    metrics: Option<prometheus::Registry>,
}

impl EngineBuilder {
    /// The builder of [`Engine::builder`].
    pub(super) fn new(database_url: String) -> Self {
        EngineBuilder {
            database_url,
            store: None,
            pool: None,
            sink: None,
            config: EngineConfig::default(),
            backoff: None,
            observer: Arc::new(NoObserver),
            #[cfg(feature = "metrics")]
            metrics: None,
            listen: true,
            #[cfg(feature = "cron")]
            schedules: Vec::new(),
            limits: Vec::new(),
            budget: None,
        }
    }

    /// Shares this payload budget with other engines (a relay's routes share one); without it
    /// the engine has one of its own, of [`EngineConfig::payload_budget`] bytes.
    pub fn payload_budget(mut self, budget: Arc<PayloadBudget>) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Uses this store (and its pool) instead of opening a pool of its own.
    pub fn store(mut self, store: Store) -> Self {
        self.store = Some(store);
        self
    }
    /// Uses this pool instead of opening one: a bb8 pool of diesel-async connections (other
    /// pools are not supported). Its connections need postbox's session settings, which
    /// [`establish`](crate::store::connect::establish) gives when it is the manager's
    /// `custom_setup` (as `examples/app` does): `default_transaction_isolation = 'read
    /// committed'` (without it a claim under a running limit fails and an ordered key's promotion
    /// may miss a commit: [`build`](Self::build) refuses such a pool), `postbox.promotes_heads =
    /// 'caller'` (without it each settle of an ordered message promotes twice), a
    /// `statement_timeout` (without one a claim waiting on a lock waits for ever; both warned at
    /// `build`), and `synchronous_commit = off`, which the app's own transactions on the pool get
    /// too (they still commit whole or not at all, but a server crash can lose the last moments
    /// of commits): an app that wants its commits synchronous lets the engine open its own pool.
    pub fn pool(mut self, pool: Pool) -> Self {
        self.pool = Some(pool);
        self
    }
    /// Delivers to `sink`.
    pub fn sink(mut self, sink: impl Sink) -> Self {
        self.sink = Some(Arc::new(sink));
        self
    }
    /// Delivers to a shared sink.
    pub fn sink_arc(mut self, sink: Arc<dyn Sink>) -> Self {
        self.sink = Some(sink);
        self
    }
    /// The embedded queue: delivers to in-process handlers.
    pub fn handlers(self, handlers: Handlers) -> Self {
        self.sink(handlers)
    }
    /// All settings at once.
    pub fn config(mut self, config: EngineConfig) -> Self {
        self.config = config;
        self
    }
    /// Messages per claim (default 100).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.config.batch_size = n;
        self
    }
    /// Deliveries at once (default 100).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.config.concurrency = n;
        self
    }
    /// Lease per claim (default 30 s).
    pub fn lease(mut self, d: Duration) -> Self {
        self.config.lease = d;
        self
    }
    /// Fallback poll interval (default 5 s).
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.config.poll_interval = d;
        self
    }
    /// Longest pause of the scheduler that makes due scheduled messages available (default
    /// 100 ms).
    pub fn schedule_interval(mut self, d: Duration) -> Self {
        self.config.schedule_interval = d;
        self
    }
    /// See [`EngineConfig::delivery_timeout`].
    pub fn delivery_timeout(mut self, d: Duration) -> Self {
        self.config.delivery_timeout = d;
        self
    }
    /// A delivery timeout for the topics `pattern` matches (`*` globs), e.g. long report jobs.
    pub fn topic_timeout(mut self, pattern: impl Into<String>, d: Duration) -> Self {
        self.config.topic_timeouts.push((pattern.into(), d));
        self
    }
    /// See [`EngineConfig::keep_completed`] (default: delivered messages are deleted).
    pub fn keep_completed(mut self, keep: Duration) -> Self {
        self.config.keep_completed = Some(keep);
        self
    }

    /// See [`EngineConfig::hold_limit`] (default 1 s; zero: always lease).
    pub fn hold_limit(mut self, d: Duration) -> Self {
        self.config.hold_limit = d;
        self
    }
    /// Snoozes a message may take without using an attempt (default
    /// [`DEFAULT_MAX_SNOOZES`]); past them a snooze uses an attempt.
    pub fn max_snoozes(mut self, n: i32) -> Self {
        self.config.max_snoozes = n;
        self
    }
    /// Shutdown deadline (default 25 s).
    pub fn shutdown_deadline(mut self, d: Duration) -> Self {
        self.config.shutdown_deadline = d;
        self
    }
    /// Retry policy (default [`Backoff::default`]).
    pub fn backoff(mut self, b: Backoff) -> Self {
        self.backoff = Some(b);
        self
    }
    /// Receives the engine's events (metrics).
    pub fn observer(mut self, o: Arc<dyn Observer>) -> Self {
        self.observer = o;
        self
    }
    /// Exports the engine's metrics on `registry`, the app's: the relay's series (see
    /// [`Metrics::register_on`](crate::metrics::Metrics::register_on)), with the database's
    /// gauges (queue depth and age, dead letters, table health, limits, retention) sampled every
    /// [`SAMPLE_INTERVAL`](crate::metrics::SAMPLE_INTERVAL) while the engine runs, so the
    /// shipped dashboard and alerts work for an embedded engine. In place of an
    /// [`observer`](Self::observer); `build()` fails if the registry has them already.
    #[cfg(feature = "metrics")]
    pub fn metrics(mut self, registry: &prometheus::Registry) -> Self {
        self.metrics = Some(registry.clone());
        self
    }
    /// Stop once nothing claimable is left.
    pub fn drain(mut self, drain: bool) -> Self {
        self.config.drain = drain;
        self
    }
    /// Without LISTEN/NOTIFY: find work by polling only (default: listen).
    pub fn listen(mut self, listen: bool) -> Self {
        self.listen = listen;
        self
    }

    #[cfg(feature = "cron")]
    /// Runs this cron schedule (see [`CronSchedule`]): at each tick its message is enqueued,
    /// once across every engine and relay that runs a schedule of this name. Not in drain mode.
    pub fn schedule(mut self, schedule: CronSchedule) -> Self {
        self.schedules.push(schedule);
        self
    }

    /// Enforces this running limit in the engine's claims (see [`Limit`]); a topic under several
    /// limits is governed by the first. Every engine and relay claiming its topics must have it.
    pub fn limit(mut self, limit: Limit) -> Self {
        self.limits.push(limit);
        self
    }

    /// Validates the settings (errors name the field) and opens the pool if none was given.
    pub async fn build(self) -> Result<Engine> {
        self.config.validate()?;
        #[cfg(feature = "cron")]
        {
            let mut names: Vec<&str> = self.schedules.iter().map(|s| s.name()).collect();
            names.sort_unstable();
            if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
                return Err(Error::InvalidArgument {
                    field: "schedules",
                    problem: format!("two schedules are named {:?}", w[0]),
                });
            }
        }
        let sink = self.sink.ok_or(Error::InvalidArgument {
            field: "sink",
            problem: "no sink or handlers given".into(),
        })?;
        let topics = sink.topics();
        if topics.is_empty() {
            return Err(Error::InvalidArgument {
                field: "sink",
                problem: format!("sink {:?} serves no topics", sink.name()),
            });
        }
        let given = self.store.is_some() || self.pool.is_some();
        let mut store = match (self.store, self.pool) {
            (Some(s), _) => s,
            (None, Some(p)) => Store::new(p),
            (None, None) => {
                // One connection first: the server's own error (a database that does not exist,
                // a refused login) at once, where the pool would time out without it.
                drop(crate::store::connect::establish(&self.database_url).await?);
                Store::connect(&self.database_url, DEFAULT_POOL_SIZE).await?
            }
        };
        if given {
            // A pool of the app's: its connections may lack the store's session settings.
            let (missing, fatal) = store.missing_session_settings().await?;
            if fatal {
                return Err(Error::InvalidArgument {
                    field: "pool",
                    problem: format!(
                        "its connections lack postbox's session settings: {}; build the pool with `postbox::store::connect::establish` as its manager's custom_setup (as examples/app does), or let the engine open its own pool",
                        missing.join("; ")
                    ),
                });
            }
            if !missing.is_empty() {
                tracing::warn!(missing = %missing.join("; "), "the engine's pool lacks postbox's session settings: build it with `postbox::store::connect::establish` as its manager's custom_setup");
            }
        }
        if let Some(b) = self.backoff {
            store = store.with_backoff(b)?;
        }
        store.check_schema().await?;
        // An engine claims, settles and dead-letters as a relay does: a role without those
        // rights (an app's writer role) would retry for ever at WARN. Said now, by name.
        let missing = store.missing_relay_privileges().await?;
        if !missing.is_empty() {
            // Most of them missing: a writer's role, or none of postbox's; said in a line.
            let lacks = if missing.len() > 8 {
                format!(
                    "{} of the relay's rights ({}, …)",
                    missing.len(),
                    missing[..3].join(", ")
                )
            } else {
                missing.join(", ")
            };
            return Err(Error::InvalidArgument {
                field: if given { "pool" } else { "database_url" },
                problem: format!(
                    "the engine's role lacks {lacks}: an embedded engine needs the relay's rights (as the schema's owner, `postbox grant --relay ROLE` gives them to ROLE); keep the writer role for the app's own transactions and give the engine a pool of its own (the book's roles page: two pools)"
                ),
            });
        }
        if self.config.keep_completed.is_some() {
            // The partitions of this hour and the next must exist before anything is completed
            // (expired ones are dropped in the background: a detach waits for older transactions).
            store.prepare_completed().await?;
            store = store.with_archive(sink.name());
        }
        let budget = self
            .budget
            .unwrap_or_else(|| PayloadBudget::new(self.config.payload_budget));
        #[cfg(feature = "metrics")]
        let (observer, metrics) = match &self.metrics {
            Some(registry) => {
                let m = crate::metrics::Metrics::register_on(registry)?;
                (m.clone() as Arc<dyn Observer>, Some(m))
            }
            None => (self.observer, None),
        };
        #[cfg(not(feature = "metrics"))]
        let observer = self.observer;
        Ok(Engine {
            store,
            sink,
            config: self.config,
            database_url: self.database_url,
            observer,
            #[cfg(feature = "metrics")]
            metrics,
            counters: Arc::new(Counters::default()),
            listen: self.listen,
            #[cfg(feature = "cron")]
            schedules: self.schedules,
            limits: self.limits,
            budget,
        })
    }
}
