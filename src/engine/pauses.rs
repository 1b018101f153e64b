//! Paused topics as an engine sees them: the patterns of `postbox.pauses`, read every
//! [`PAUSE_POLL`]; claims and takes use what the engine serves minus what is paused, and no
//! message is handed over while any pause is in force (hand-over would bypass the claim).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::store::{Limit, Store, Topics, unpaused};

/// How often every engine reads the pauses: a pause takes effect within about this long (plus a
/// claim in flight).
pub const PAUSE_POLL: Duration = Duration::from_secs(1);

pub(crate) struct Pauses {
    served: Topics,
    limits: Vec<Limit>,
    current: RwLock<(Vec<String>, Arc<Claimable>)>,
    any: AtomicBool,
}

/// What claims may take now: outside every limit, and within each limit.
pub(crate) struct Claimable {
    /// Served, not paused, under no limit.
    pub unlimited: Topics,
    /// Per limit (in order): served, not paused, and under no limit before it.
    pub limited: Vec<(Limit, Topics)>,
}

impl Claimable {
    fn new(served: &Topics, paused: &[String], limits: &[Limit]) -> Self {
        let base = unpaused(served, paused);
        let mut unlimited = base.clone();
        let mut limited = Vec::with_capacity(limits.len());
        for l in limits {
            limited.push((l.clone(), unlimited.clone()));
            unlimited = unlimited.excluding(l.topics());
        }
        Claimable { unlimited, limited }
    }
}

impl Claimable {
    /// This, minus `topics` everywhere.
    pub(crate) fn without(&self, topics: &Topics) -> Claimable {
        Claimable {
            unlimited: self.unlimited.clone().excluding(topics),
            limited: self
                .limited
                .iter()
                .map(|(l, t)| (l.clone(), t.clone().excluding(topics)))
                .collect(),
        }
    }
}

impl Pauses {
    pub(crate) fn new(served: Topics, limits: Vec<Limit>) -> Self {
        let all = Arc::new(Claimable::new(&served, &[], &limits));
        Pauses {
            served,
            limits,
            current: RwLock::new((Vec::new(), all)),
            any: AtomicBool::new(false),
        }
    }

    /// What claims and held batches may take now, outside the limits.
    pub(crate) fn topics(&self) -> Arc<Claimable> {
        self.current.read().expect("pauses lock").1.clone()
    }

    /// True while any pause is in force.
    pub(crate) fn any(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }

    fn set(&self, patterns: Vec<String>) {
        let mut current = self.current.write().expect("pauses lock");
        if current.0 == patterns {
            return;
        }
        if patterns.is_empty() {
            tracing::info!("no topic is paused");
        } else {
            tracing::info!(paused = ?patterns, "paused topics are not claimed");
        }
        self.any.store(!patterns.is_empty(), Ordering::Release);
        let claimable = Arc::new(Claimable::new(&self.served, &patterns, &self.limits));
        *current = (patterns, claimable);
    }
}

impl Pauses {
    /// Reads the pauses once (a failed read keeps the last).
    pub(crate) async fn load(&self, store: &Store) {
        match store.paused().await {
            Ok(patterns) => self.set(patterns),
            Err(e) => tracing::debug!(error = %e, "could not read the paused topics"),
        }
    }
}

/// Reads the pauses every [`PAUSE_POLL`] until `stop`.
pub(crate) async fn watch(store: Store, pauses: Arc<Pauses>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(PAUSE_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => return,
        }
        pauses.load(&store).await;
    }
}
