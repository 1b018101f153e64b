//! `postbox cancel (--id ID... | --topic T)`.

use clap::Args;

use super::{RelayError, Result};
use crate::config::Settings;
use crate::store::CancelSelector;

#[derive(Args)]
pub struct CancelArgs {
    /// These messages (repeatable).
    #[arg(long = "id")]
    pub ids: Vec<i64>,
    /// Every live message of this topic.
    #[arg(long)]
    pub topic: Option<String>,
}

/// Cancels: prints how many went to the dead letters and how many were running.
pub async fn run(settings: &Settings, a: CancelArgs) -> Result<()> {
    let selector = match (a.ids.is_empty(), a.topic) {
        (false, None) => CancelSelector::Ids(a.ids),
        (true, Some(t)) if !t.is_empty() => CancelSelector::Topic(t),
        _ => {
            return Err(RelayError::Usage(
                "choose exactly one of --id and --topic".into(),
            ));
        }
    };
    let store = super::admin_store(settings).await?;
    let c = store
        .cancel(&selector)
        .await
        .map_err(|e| RelayError::Runtime(e.into()))?;
    if c.dead == 0 && c.running == 0 {
        match &selector {
            CancelSelector::Topic(t) => {
                eprintln!("cancelled nothing: topic {t:?} has no live message (is the name right?)")
            }
            CancelSelector::Ids(_) => eprintln!(
                "cancelled nothing: no live message has these ids (delivered, dead or never there)"
            ),
        }
    }
    println!(
        "cancelled {} (moved to the dead letters, reason \"cancelled\"); {} running: they finish their current attempt and are not retried",
        c.dead, c.running
    );
    Ok(())
}
