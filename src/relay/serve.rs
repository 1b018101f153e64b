//! `/metrics`, `/healthz` and `/readyz`.

use std::sync::Arc;

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
    Ok(tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await;
    }))
}
