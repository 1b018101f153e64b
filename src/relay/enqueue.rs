//! `postbox enqueue`: one message from the command line.

use std::time::Duration;

use clap::Args;

use super::{RelayError, Result};
use crate::Message;
use crate::config::{Settings, redact_url};

/// Enqueues one message from the command line.
pub async fn enqueue(settings: &Settings, msg: Message) -> Result<crate::Enqueued> {
    msg.validate()
        .map_err(|e| RelayError::Usage(e.to_string()))?;
    let mut conn = crate::store::connect::open(&settings.database_url)
        .await
        .map_err(|e| anyhow::anyhow!("connect to {}: {e}", redact_url(&settings.database_url)))?;
    Ok(crate::enqueue_async(&mut conn, &msg).await?)
}

#[derive(Args)]
pub struct EnqueueArgs {
    #[arg(long)]
    topic: String,
    /// The payload, as JSON.
    #[arg(long, value_parser = super::cli::json)]
    payload: serde_json::Value,
    #[arg(long)]
    key: Option<String>,
    #[arg(long)]
    ordered: bool,
    /// A header NAME=VALUE (repeatable).
    #[arg(long = "header", value_parser = super::cli::header)]
    headers: Vec<(String, String)>,
    /// Not before this long from now (e.g. 30s).
    #[arg(long, value_parser = super::cli::duration)]
    delay: Option<Duration>,
}

/// Runs `enqueue`: prints the new id, or the live message holding the dedup key.
pub async fn run(settings: &Settings, a: EnqueueArgs) -> Result<()> {
    let mut msg = Message::new(a.topic).payload(&a.payload);
    if let Some(k) = a.key {
        msg = msg.key(k);
    }
    if a.ordered {
        msg = msg.ordered();
    }
    for (k, v) in a.headers {
        msg = msg.header(k, v);
    }
    if let Some(d) = a.delay {
        msg = msg.delay(d);
    }
    match enqueue(settings, msg).await? {
        crate::Enqueued::New(id) => println!("{id}"),
        crate::Enqueued::Duplicate { existing } => println!(
            "duplicate of {}",
            existing.map_or("-".into(), |i| i.to_string())
        ),
    }
    Ok(())
}
