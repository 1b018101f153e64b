//! A process's stop signals as the engine's two tokens: what the relay does, for an app that
//! embeds the engine.

use tokio_util::sync::CancellationToken;

/// The tokens [`stop_on_signals`] cancels.
#[derive(Clone, Debug, Default)]
pub struct StopSignals {
    /// Cancelled at the first SIGTERM or SIGINT (Ctrl-C): stop claiming, let running deliveries
    /// finish within the shutdown deadline.
    pub shutdown: CancellationToken,
    /// Cancelled at the second: hand everything back at once.
    pub hard_stop: CancellationToken,
}

/// Listens for SIGTERM and SIGINT (Ctrl-C elsewhere than Unix) on the current tokio runtime: the
/// first cancels [`StopSignals::shutdown`], the second [`StopSignals::hard_stop`]. Give both to
/// [`Engine::run_until`](super::Engine::run_until).
///
/// Once it listens, these signals no longer end the process: they only cancel the tokens. An app
/// whose other parts (an HTTP server, a consumer) should stop too waits on `shutdown` for them
/// (`stop.shutdown.cancelled().await`, or axum's `with_graceful_shutdown`), and `main` returns when
/// everything has stopped.
///
/// ```no_run
/// # async fn demo(engine: postbox::engine::Engine) -> Result<(), postbox::Error> {
/// let stop = postbox::engine::stop_on_signals();
/// let report = engine.run_until(stop.shutdown, stop.hard_stop).await?;
/// # Ok(()) }
/// ```
pub fn stop_on_signals() -> StopSignals {
    let stop = StopSignals::default();
    let (shutdown, hard_stop) = (stop.shutdown.clone(), stop.hard_stop.clone());
    // Registered before this returns: a signal that comes at once is caught, not fatal.
    #[cfg(unix)]
    let signals = {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(term), Ok(int)) => Some((term, int)),
            _ => {
                tracing::warn!(
                    "cannot listen for SIGTERM and SIGINT: stop the engine with its tokens"
                );
                None
            }
        }
    };
    tokio::spawn(async move {
        #[cfg(unix)]
        {
            let Some((mut term, mut int)) = signals else {
                return;
            };
            tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
            tracing::info!("shutting down (a second signal hands everything back at once)");
            shutdown.cancel();
            tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
            hard_stop.cancel();
        }
        #[cfg(not(unix))]
        {
            if tokio::signal::ctrl_c().await.is_err() {
                return;
            }
            tracing::info!("shutting down (a second signal hands everything back at once)");
            shutdown.cancel();
            let _ = tokio::signal::ctrl_c().await;
            hard_stop.cancel();
        }
    });
    stop
}
