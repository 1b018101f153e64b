//! `/metrics`, `/healthz` and `/readyz`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

/// Connections held at once. Past this, a new connection is still accepted, and the one that has
/// been idle longest (no request in flight: one that sent nothing yet, or waits between requests)
/// among those of the address holding the most connections is closed to make room: a client that opens hundreds of idle connections cannot keep a probe
/// out, and the process never holds more descriptors than this. Only when every connection has a
/// request in flight is a new one closed at once.
pub const MAX_CONNECTIONS: usize = 128;

/// A client must send a request's headers within this long (a slow or silent client is cut off).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest one connection is served (keep-alive included): a scraper reconnects, a client
/// that holds a connection open for nothing lets it go.
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(30);

/// One connection being served: whether a request is in flight, since when it has been idle, and
/// how to close it.
struct Held {
    busy: Arc<AtomicUsize>,
    idle_since: Arc<Mutex<Instant>>,
    close: CancellationToken,
    peer: std::net::IpAddr,
}

/// The connections being served, by number.
#[derive(Default)]
struct Table {
    next: u64,
    held: HashMap<u64, Held>,
}

impl Table {
    /// Room for one more: true if there was, or the longest-idle connection of the address that
    /// holds the most was closed for it (a client flooding the listener evicts its own
    /// connections first, not a prober's from another address).
    fn make_room(&mut self) -> bool {
        if self.held.len() < MAX_CONNECTIONS {
            return true;
        }
        let mut by_peer: HashMap<std::net::IpAddr, usize> = HashMap::new();
        for h in self.held.values() {
            *by_peer.entry(h.peer).or_default() += 1;
        }
        let oldest = self
            .held
            .iter()
            .filter(|(_, h)| h.busy.load(Ordering::SeqCst) == 0)
            .max_by_key(|(_, h)| {
                (
                    by_peer.get(&h.peer).copied().unwrap_or(0),
                    std::cmp::Reverse(*h.idle_since.lock().expect("not poisoned")),
                )
            })
            .map(|(n, _)| *n);
        match oldest.and_then(|n| self.held.remove(&n)) {
            Some(h) => {
                h.close.cancel();
                true
            }
            None => false,
        }
    }
}

/// Accepts and serves connections (HTTP/1.1) until `stop`, within [`MAX_CONNECTIONS`] (the
/// longest-idle one making room for a new one), [`HEADER_TIMEOUT`] and [`CONNECTION_LIFETIME`].
pub(super) async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    stop: CancellationToken,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;
    let table = Arc::new(Mutex::new(Table::default()));
    let mut connections = tokio::task::JoinSet::new();
    loop {
        while connections.try_join_next().is_some() {}
        let (stream, peer) = tokio::select! {
            a = listener.accept() => match a {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors, or a connection reset before it was accepted.
                    tracing::warn!(error = %e, "listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = stop.cancelled() => break,
        };
        let (number, busy, idle_since, close) = {
            let mut t = table.lock().expect("not poisoned");
            if !t.make_room() {
                // Every connection has a request in flight: this one waits for none of them.
                drop(stream);
                continue;
            }
            let number = t.next;
            t.next += 1;
            let held = Held {
                busy: Arc::new(AtomicUsize::new(0)),
                idle_since: Arc::new(Mutex::new(Instant::now())),
                close: CancellationToken::new(),
                peer: peer.ip(),
            };
            let parts = (
                number,
                held.busy.clone(),
                held.idle_since.clone(),
                held.close.clone(),
            );
            t.held.insert(number, held);
            parts
        };
        let inner = TowerToHyperService::new(app.clone());
        let service = hyper::service::service_fn(move |request| {
            // In flight from the moment its headers are read until its response is made.
            busy.fetch_add(1, Ordering::SeqCst);
            let response = hyper::service::Service::call(&inner, request);
            let (busy, idle_since) = (busy.clone(), idle_since.clone());
            async move {
                let r = response.await;
                *idle_since.lock().expect("not poisoned") = Instant::now();
                busy.fetch_sub(1, Ordering::SeqCst);
                r
            }
        });
        let stop = stop.clone();
        let table = table.clone();
        connections.spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = tokio::time::sleep(CONNECTION_LIFETIME) => {}
                _ = close.cancelled() => {}
                _ = stop.cancelled() => {
                    // Let a request in progress finish, briefly.
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(Duration::from_secs(1), conn).await;
                }
            }
            table.lock().expect("not poisoned").held.remove(&number);
        });
    }
    connections.shutdown().await;
}
