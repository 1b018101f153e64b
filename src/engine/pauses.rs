//! Paused topics as an engine sees them: the patterns of `postbox.pauses`, read every
//! [`PAUSE_POLL`]; claims and takes use what the engine serves minus what is paused, and no
//! message is handed over while any pause is in force (hand-over would bypass the claim).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::store::{Store, Topics, unpaused};

/// How often every engine reads the pauses: a pause takes effect within about this long (plus a
/// claim in flight).
pub const PAUSE_POLL: Duration = Duration::from_secs(1);

pub(crate) struct Pauses {
    served: Topics,
    current: RwLock<(Vec<String>, Arc<Topics>)>,
    any: AtomicBool,
}

impl Pauses {
    pub(crate) fn new(served: Topics) -> Self {
        let all = Arc::new(served.clone());
        Pauses {
            served,
            current: RwLock::new((Vec::new(), all)),
            any: AtomicBool::new(false),
        }
    }

    /// What claims may take now.
    pub(crate) fn topics(&self) -> Arc<Topics> {
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
        *current = (
            patterns.clone(),
            Arc::new(unpaused(&self.served, &patterns)),
        );
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
