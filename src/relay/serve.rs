//! `/metrics`, `/healthz` and `/readyz`.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::{RelayError, Result};
use crate::metrics::Metrics;

/// Serves `/metrics`, `/healthz`, `/readyz` until `stop`.
pub async fn serve_metrics(
    addr: std::net::SocketAddr,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>> {
    use axum::http::{StatusCode, header};
    use axum::routing::get;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| RelayError::Usage(format!("metrics.listen: cannot listen on {addr}: {e}")))?;
    let m1 = metrics.clone();
    let m2 = metrics.clone();
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let m = m1.clone();
                async move {
                    (
                        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                        m.render(),
                    )
                }
            }),
        )
        .route(
            "/healthz",
            get(move || {
                let m = m2.clone();
                async move {
                    match m.alive_at(std::time::Instant::now()) {
                        Ok(()) => (StatusCode::OK, "ok\n".to_owned()),
                        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
                    }
                }
            }),
        )
        .route(
            "/readyz",
            get(move || {
                let m = metrics.clone();
                async move {
                    match m.ready() {
                        Ok(()) => (StatusCode::OK, "ready\n".to_owned()),
                        Err(why) => (
                            StatusCode::SERVICE_UNAVAILABLE,
                            format!("not ready: {why}\n"),
                        ),
                    }
                }
            }),
        );
    Ok(tokio::spawn(serve(listener, app, stop)))
}

/// Connections served at once: past this, new ones wait in the kernel's backlog until one ends,
/// so idle or slow clients cannot take every file descriptor of the process.
pub const MAX_CONNECTIONS: usize = 128;

/// A client must send a request's headers within this long (a slow or silent client is cut off).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest one connection is served (keep-alive included): a scraper reconnects, a client
/// that holds a connection open for nothing lets it go.
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(30);

/// Accepts and serves connections (HTTP/1.1) until `stop`, within [`MAX_CONNECTIONS`],
/// [`HEADER_TIMEOUT`] and [`CONNECTION_LIFETIME`].
pub(super) async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    stop: CancellationToken,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut connections = tokio::task::JoinSet::new();
    loop {
        while connections.try_join_next().is_some() {}
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => s.expect("the semaphore is never closed"),
            _ = stop.cancelled() => break,
        };
        let stream = tokio::select! {
            a = listener.accept() => match a {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors, or a connection reset before it was accepted.
                    tracing::warn!(error = %e, "metrics listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = stop.cancelled() => break,
        };
        let service = TowerToHyperService::new(app.clone());
        let stop = stop.clone();
        connections.spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = tokio::time::sleep(CONNECTION_LIFETIME) => {}
                _ = stop.cancelled() => {
                    // Let a request in progress finish, briefly.
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(Duration::from_secs(1), conn).await;
                }
            }
            drop(slot);
        });
    }
    connections.shutdown().await;
}
