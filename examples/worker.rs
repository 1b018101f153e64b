//! A standalone worker: the embedded engine with handlers, running until Ctrl-C (first: graceful
//! shutdown within the deadline; second: hand everything back now).
//!
//! cargo run --release --example worker [-- DATABASE_URL]
//! Then, from any client:  INSERT INTO postbox.messages (topic, payload) VALUES ('email.send', '{"to": "a@example.com"}');

use std::time::Duration;

use postbox::engine::Engine;
use postbox::sink::handlers::{HandlerError, Handlers, Job};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

#[derive(Deserialize)]
struct Email {
    to: String,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let url = std::env::args()
        .nth(1)
        .or_else(|| std::env::var("DATABASE_URL").ok())
        .unwrap_or_else(|| "postgres://postgres@localhost/postbox".into());
    let mut conn = <diesel::PgConnection as diesel::Connection>::establish(&url)?;
    postbox::migrate(&mut conn)?;

    let handlers = Handlers::new().on("email.send", |job: Job<Email>| async move {
        if !job.payload.to.contains('@') {
            return Err(HandlerError::dead(format!(
                "not an address: {}",
                job.payload.to
            )));
        }
        println!(
            "#{} attempt {}: sending to {}",
            job.id, job.attempt, job.payload.to
        );
        Ok(())
    });
    let engine = Engine::builder(&url)
        .handlers(handlers)
        .concurrency(32)
        .shutdown_deadline(Duration::from_secs(10))
        .build()
        .await?;

    let (shutdown, hard_stop) = (CancellationToken::new(), CancellationToken::new());
    let (s, h) = (shutdown.clone(), hard_stop.clone());
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        eprintln!("shutting down (Ctrl-C again to hand everything back now)");
        s.cancel();
        let _ = tokio::signal::ctrl_c().await;
        h.cancel();
    });
    eprintln!("worker running; Ctrl-C to stop");
    let report = engine.run_until(shutdown, hard_stop).await?;
    eprintln!("stopped: {report:?}");
    Ok(())
}
