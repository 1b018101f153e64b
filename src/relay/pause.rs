//! `postbox pause TOPIC...` and `postbox resume TOPIC...`.

use clap::Args;

use super::{RelayError, Result};
use crate::config::Settings;

#[derive(Args)]
pub struct TopicArgs {
    /// Topic names or patterns (`*` matches any run of characters: `emails.*`).
    #[arg(required = true, value_name = "TOPIC")]
    pub topics: Vec<String>,
}

/// Pauses the topics: within about two seconds no relay or engine claims them.
pub async fn pause(settings: &Settings, a: TopicArgs) -> Result<()> {
    let store = super::admin_store(settings).await?;
    let n = store.pause(&a.topics).await.map_err(usage_or_runtime)?;
    println!(
        "paused {} ({} already paused)",
        a.topics.len(),
        a.topics.len() - n
    );
    Ok(())
}

/// Removes the pauses named by exactly these patterns.
pub async fn resume(settings: &Settings, a: TopicArgs) -> Result<()> {
    let store = super::admin_store(settings).await?;
    let n = store.resume(&a.topics).await.map_err(usage_or_runtime)?;
    println!("resumed {n}");
    if n < a.topics.len() {
        let still = store
            .paused()
            .await
            .map_err(|e| RelayError::Runtime(e.into()))?;
        let missing: Vec<&String> = a.topics.iter().filter(|t| !still.contains(t)).collect();
        eprintln!("not paused (nothing to resume): {missing:?}; paused now: {still:?}");
    }
    Ok(())
}

fn usage_or_runtime(e: crate::Error) -> RelayError {
    match e {
        crate::Error::InvalidArgument { .. } => RelayError::Usage(e.to_string()),
        e => RelayError::Runtime(e.into()),
    }
}
