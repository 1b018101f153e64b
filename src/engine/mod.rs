//! The engine (the book, "Internals"): producer (claim loop), dispatcher (deliveries under a concurrency
//! limit, leases extended while they run), completer (batched outcomes), notifier (LISTEN with
//! a polling fallback), maintenance (rescue), graceful shutdown. The same engine runs embedded in
//! an app with [`Handlers`](crate::sink::handlers) and inside the relay with other sinks.
//!
//! ```no_run
//! use postbox::engine::Engine;
//! use postbox::sink::handlers::{Handlers, Job};
//! use tokio_util::sync::CancellationToken;
//!
//! # async fn run() -> Result<(), postbox::Error> {
//! let handlers = Handlers::new().on("order.created", |job: Job<serde_json::Value>| async move {
//!     println!("order {}", job.payload);
//!     Ok(())
//! });
//! let engine = Engine::builder("postgres://postgres@localhost/app").handlers(handlers).build().await?;
//! let shutdown = CancellationToken::new();
//! let report = engine.run(shutdown.clone()).await?; // until shutdown.cancel()
//! # Ok(()) }
//! ```

pub mod budget;
mod builder;
mod completer;
pub mod config;
#[cfg(feature = "cron")]
pub mod cron;
mod flush;
mod held;
pub mod maintenance;
mod notifier;
pub mod observer;
mod pauses;
mod producer;
mod signals;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

pub use self::budget::{DEFAULT_PAYLOAD_BUDGET, PayloadBudget};
pub use self::builder::EngineBuilder;
pub use self::config::{DEFAULT_MAX_SNOOZES, EngineConfig};
pub use self::maintenance::{REPAIR_BATCH, Rescuer, Scheduler};
pub use self::observer::{Counters, NoObserver, Observer, RunReport, Settlement};
use self::producer::{InFlight, Producer, SinkHealth};
pub use self::signals::{StopSignals, stop_on_signals};
use crate::backoff::Backoff;
#[cfg(feature = "cron")]
use crate::cron::CronSchedule;
use crate::error::{Error, Result};
use crate::sink::Sink;
use crate::sink::handlers::Handlers;
use crate::store::{Limit, Pool, Store};

/// Connections the engine's own pool opens: claims, up to four completer statements at once,
/// heartbeats and rescue.
pub const DEFAULT_POOL_SIZE: u32 = 10;

/// Aborts a claim loop's deliveries if the task waiting for them is aborted.
struct AbortOnDrop<'a>(&'a mut tokio::task::JoinSet<()>);
impl Drop for AbortOnDrop<'_> {
    fn drop(&mut self) {
        self.0.abort_all();
    }
}

/// A configured engine; [`Engine::run`] drives it.
pub struct Engine {
    store: Store,
    sink: Arc<dyn Sink>,
    config: EngineConfig,
    database_url: String,
    observer: Arc<dyn Observer>,
    counters: Arc<Counters>,
    listen: bool,
    #[cfg(feature = "cron")]
    schedules: Vec<CronSchedule>,
    limits: Vec<Limit>,
    budget: Arc<PayloadBudget>,
    #[cfg(feature = "metrics")]
    metrics: Option<Arc<crate::metrics::Metrics>>,
}

impl Engine {
    /// Starts building an engine for the database at `database_url` (also used for the
    /// notifier's dedicated LISTEN connection).
    pub fn builder(database_url: impl Into<String>) -> EngineBuilder {
        EngineBuilder::new(database_url.into())
    }

    /// Live totals (claimed, delivered, ...), readable while the engine runs.
    pub fn counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }

    /// The store the engine works on.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Runs until `shutdown` is cancelled (or, in drain mode, until nothing is left), then shuts
    /// down gracefully: stops claiming, hands back what it had not started, lets running
    /// deliveries finish within the shutdown deadline, cuts off the rest (each counts as a failed
    /// attempt, retried with backoff, as River and Oban treat interrupted jobs: a message whose
    /// delivery always hangs still reaches the dead letters), writes every outcome, and returns
    /// what it did.
    pub async fn run(self, shutdown: CancellationToken) -> Result<RunReport> {
        self.run_until(shutdown, CancellationToken::new()).await
    }

    /// [`Engine::run`], with a second token that cuts the shutdown deadline short (a second
    /// signal): running deliveries are cut off at once (an attempt each, as at the deadline).
    pub async fn run_until(
        self,
        shutdown: CancellationToken,
        hard_stop: CancellationToken,
    ) -> Result<RunReport> {
        tracing::info!(
            sink = %self.sink.name(),
            topics = %self.sink.topics().patterns_and::<&str>(&[]).join(", "),
            concurrency = self.config.concurrency,
            "postbox engine running"
        );
        let observer: Arc<dyn Observer> = Arc::new(observer::Counting {
            counters: self.counters.clone(),
            inner: self.observer.clone(),
        });
        let background = CancellationToken::new();
        #[cfg(feature = "metrics")]
        if let Some(m) = &self.metrics {
            tokio::spawn(crate::metrics::sample(
                self.store.clone(),
                m.clone(),
                crate::metrics::SAMPLE_INTERVAL,
                self.limits.clone(),
                self.config.keep_completed.is_some(),
                false,
                background.clone(),
            ));
        }
        let inflight = Arc::new(InFlight::default());
        let unwritten = Arc::new(AtomicUsize::new(0));
        let (settle_tx, settle_rx) = tokio::sync::mpsc::channel(self.config.completer_batch * 2);
        let wake = Arc::new(Notify::new());
        let permits = Arc::new(tokio::sync::Semaphore::new(self.config.concurrency));
        let health = Arc::new(SinkHealth::new(self.config.max_unavailable_backoff));
        let pauses = Arc::new(pauses::Pauses::new(self.sink.topics(), self.limits.clone()));
        let hand_over = Arc::new(completer::HandOver::new(
            permits.clone(),
            self.sink.max_batch(),
            self.config.lease,
            shutdown.clone(),
            health.clone(),
            inflight.clone(),
            pauses.clone(),
        ));
        let completer = tokio::spawn(completer::run(
            completer::Completer {
                store: self.store.clone(),
                max_batch: self.config.completer_batch,
                observer: observer.clone(),
                sink: self.sink.clone(),
                unwritten: unwritten.clone(),
                written: wake.clone(),
                inflight: inflight.clone(),
                hand_over: hand_over.clone(),
                shutdown_deadline: self.config.shutdown_deadline,
                max_snoozes: self.config.max_snoozes,
            },
            settle_rx,
        ));
        let (notifier, notifier_task) = if self.listen && !self.config.drain {
            let obs = observer.clone();
            let (n, t) = notifier::Notifier::spawn(
                self.database_url.clone(),
                notifier::NotifierShared {
                    wake: wake.clone(),
                    connected: Arc::new(AtomicBool::new(false)),
                    on_connected: Box::new(move |up| obs.notifier_connected(up)),
                },
                background.clone(),
            );
            (Some(n), Some(t))
        } else {
            (None, None)
        };
        let heartbeat = tokio::spawn(producer::heartbeat(
            self.store.clone(),
            inflight.clone(),
            self.config.lease,
            observer.clone(),
            background.clone(),
        ));
        // Before the first claim: a relay that starts must not take a paused topic.
        pauses.load(&self.store).await;
        let watching = tokio::spawn(pauses::watch(
            self.store.clone(),
            pauses.clone(),
            background.clone(),
        ));
        let rescuer = tokio::spawn(
            Rescuer::new(self.store.clone(), self.config.rescue_interval)
                .observer(observer.clone())
                .run(background.clone()),
        );
        #[cfg(not(feature = "cron"))]
        let cron: Option<tokio::task::JoinHandle<()>> = None;
        #[cfg(feature = "cron")]
        let cron = (!self.schedules.is_empty() && !self.config.drain).then(|| {
            tokio::spawn(cron::run(
                self.store.clone(),
                self.schedules.clone(),
                observer.clone(),
                background.clone(),
            ))
        });
        let retention = self.config.keep_completed.map(|keep| {
            tokio::spawn(maintenance::keep_completed(
                self.store.clone(),
                keep,
                background.clone(),
            ))
        });
        let scheduler = tokio::spawn(
            Scheduler::new(
                self.store.clone(),
                self.config.schedule_interval,
                wake.clone(),
            )
            .run(background.clone()),
        );

        let producer = Arc::new(Producer {
            store: self.store.clone(),
            sink: self.sink.clone(),
            pauses: pauses.clone(),
            config: self.config.clone(),
            observer: observer.clone(),
            inflight: inflight.clone(),
            health,
            settle_tx,
            unwritten,
            wake,
            notifier,
            shutdown: shutdown.clone(),
            permits,
            rate: producer::ClaimRate::new(),
            hand_over: hand_over.clone(),
            holds: Arc::new(tokio::sync::Semaphore::new(config::MAX_HOLDS)),
            budget: self.budget.clone(),
        });
        let mut loops = tokio::task::JoinSet::new();
        for _ in 0..self.config.claimers {
            loops.spawn(producer.clone().run());
        }
        drop(producer);
        let mut running = tokio::task::JoinSet::new();
        // The claim loops end at shutdown (or, draining, when nothing is left). One that is in a
        // claim waiting on a lock (a migration's ALTER TABLE) is given until the deadline, then
        // abandoned with its deliveries: shutdown keeps its deadline and the hard stop.
        let mut deadline: Option<tokio::time::Instant> = None;
        let mut abandoned = false;
        loop {
            let joined = tokio::select! {
                j = loops.join_next() => j,
                _ = shutdown.cancelled(), if deadline.is_none() => {
                    deadline = Some(tokio::time::Instant::now() + self.config.shutdown_deadline);
                    continue;
                }
                _ = tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)),
                    if deadline.is_some() && !abandoned => {
                    tracing::warn!(loops = loops.len(), "shutdown deadline reached in a claim; abandoning it");
                    abandoned = true;
                    loops.abort_all();
                    continue;
                }
                _ = hard_stop.cancelled(), if !abandoned => {
                    abandoned = true;
                    loops.abort_all();
                    continue;
                }
            };
            match joined {
                None => break,
                Some(Ok(mut tasks)) => {
                    // Keep the deliveries of every loop in one set (aborting it aborts them all).
                    running.spawn(async move {
                        let _guard = AbortOnDrop(&mut tasks);
                        while _guard.0.join_next().await.is_some() {}
                    });
                }
                Some(Err(e)) if e.is_cancelled() => {}
                Some(Err(e)) => std::panic::resume_unwind(e.into_panic()),
            }
        }

        // Shutdown: no more claims. Running deliveries get until the deadline.
        let until =
            deadline.unwrap_or_else(|| tokio::time::Instant::now() + self.config.shutdown_deadline);
        let finished = !abandoned
            && tokio::select! {
                _ = async { while running.join_next().await.is_some() {} } => true,
                _ = tokio::time::sleep_until(until) => false,
                _ = hard_stop.cancelled() => false,
            };
        if !finished && hard_stop.is_cancelled() {
            tracing::warn!(
                running = running.len(),
                "a second stop signal: handing back running messages now, before the shutdown deadline"
            );
            running.abort_all();
            while running.join_next().await.is_some() {}
        } else if !finished {
            tracing::warn!(
                running = running.len(),
                "shutdown deadline reached; handing back running messages"
            );
            running.abort_all();
            while running.join_next().await.is_some() {}
        }
        // Every sender is gone once the deliveries are: the completer writes what it has and ends.
        // The writes of shutdown get a short window of their own, so shutdown ends within the
        // deadline plus that window even when the database is down or the table is locked: what
        // is not written by then is left to lease expiry (at least once still holds).
        let writes_by = tokio::time::Instant::now() + config::SHUTDOWN_WRITE_WINDOW;
        // The window closes at its end, or HARD_STOP_GRACE after a hard stop (now or during it):
        // a second signal hands back now, whatever the database does.
        let cut = CancellationToken::new();
        let closer = {
            let (cut, hard_stop) = (cut.clone(), hard_stop.clone());
            tokio::spawn(async move {
                tokio::select! {
                    _ = tokio::time::sleep_until(writes_by) => {}
                    _ = async {
                        hard_stop.cancelled().await;
                        tokio::time::sleep(config::HARD_STOP_GRACE).await;
                    } => {}
                }
                cut.cancel();
            })
        };
        let within = |cut: &CancellationToken| cut.clone().cancelled_owned();
        let mut completer = completer;
        let written = tokio::select! {
            _ = &mut completer => true,
            _ = within(&cut) => false,
        };
        if !written {
            tracing::warn!("outcomes still unwritten at the end of shutdown; left to lease expiry");
            completer.abort();
            // Its flushes end with it (they are its tasks); anything they hand over from now on
            // is refused by the closed hand-over below.
            let _ = completer.await;
        }
        // Handed-over messages that never started go back without using an attempt; deliveries
        // cut off by the deadline (or a hard stop) used theirs: they are retried with backoff, and
        // dead-lettered at max_attempts, so a handler that always hangs cannot live forever
        // through restarts.
        let not_started: std::collections::HashSet<i64> =
            hand_over.take_queued().iter().map(|l| l.id).collect();
        let (not_started, interrupted): (Vec<_>, Vec<_>) = inflight
            .take_all()
            .into_iter()
            .partition(|l| not_started.contains(&l.id));
        let hand_back = async {
            if !not_started.is_empty() {
                self.release(&not_started, &*observer, |id| inflight.topic_of(id))
                    .await;
            }
            if !interrupted.is_empty() {
                self.interrupt(
                    &interrupted,
                    &*observer,
                    |id| inflight.topic_of(id),
                    hard_stop.is_cancelled(),
                )
                .await;
            }
        };
        let handed_back = tokio::select! {
            _ = hand_back => true,
            _ = within(&cut) => false,
        };
        if !handed_back {
            tracing::warn!(
                "could not hand back in-flight messages in time; their leases will expire"
            );
        }
        // Holds that ended without a commit (this process's, cut off by the deadline, or another
        // relay's that exited): counted now rather than on some relay's next rescue tick.
        tokio::select! {
            r = self.store.lost_holds() => if let Err(e) = r {
                tracing::debug!(error = %e, "could not look for lost holds at shutdown");
            },
            _ = within(&cut) => {}
        }
        background.cancel();
        // A background service in a statement (waiting on a lock, or on a silent connection)
        // does not see the cancel until it ends: it gets the same window, then is dropped.
        let mut services: Vec<tokio::task::JoinHandle<()>> =
            vec![heartbeat, rescuer, watching, scheduler];
        services.extend(cron);
        services.extend(retention);
        services.extend(notifier_task);
        let until = writes_by.max(tokio::time::Instant::now() + Duration::from_secs(1));
        for mut service in services {
            let ended = tokio::select! {
                _ = &mut service => true,
                _ = tokio::time::sleep_until(until) => false,
                _ = async {
                    hard_stop.cancelled().await;
                    cut.cancelled().await;
                } => false,
            };
            if !ended {
                service.abort();
            }
        }
        closer.abort();
        let report = self.counters.snapshot();
        tracing::info!(sink = %self.sink.name(), ?report, "postbox engine stopped");
        Ok(report)
    }

    async fn interrupt(
        &self,
        leases: &[crate::store::Lease],
        observer: &dyn Observer,
        topic_of: impl Fn(i64) -> String,
        hard: bool,
    ) {
        let retries: Vec<crate::store::Retry> = leases
            .iter()
            .map(|&lease| crate::store::Retry {
                lease,
                error: if hard {
                    "delivery interrupted by a second stop signal during shutdown".to_owned()
                } else {
                    format!(
                        "delivery interrupted by shutdown after the {:?} deadline",
                        self.config.shutdown_deadline
                    )
                },
                delay: None,
            })
            .collect();
        match self.store.retry(&retries).await {
            Ok(r) => {
                let sink = self.sink.name();
                for id in &r.retried {
                    observer.settled(&topic_of(*id), sink, Settlement::Retried, Duration::ZERO);
                }
                for id in &r.dead {
                    observer.settled(
                        &topic_of(*id),
                        sink,
                        Settlement::DeadLettered,
                        Duration::ZERO,
                    );
                }
                for id in &r.fenced {
                    observer.settled(&topic_of(*id), sink, Settlement::Fenced, Duration::ZERO);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, n = leases.len(), "could not record interrupted deliveries; their leases will expire")
            }
        }
    }

    async fn release(
        &self,
        leases: &[crate::store::Lease],
        observer: &dyn Observer,
        topic_of: impl Fn(i64) -> String,
    ) {
        match self.store.release(leases).await {
            Ok(r) => {
                for id in &r.done {
                    observer.settled(
                        &topic_of(*id),
                        self.sink.name(),
                        Settlement::Released,
                        Duration::ZERO,
                    );
                }
                for id in &r.fenced {
                    observer.settled(
                        &topic_of(*id),
                        self.sink.name(),
                        Settlement::Fenced,
                        Duration::ZERO,
                    );
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, n = leases.len(), "could not hand back messages; their leases will expire")
            }
        }
    }
}
