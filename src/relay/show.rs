//! `postbox show ID`: where a message is and what happened to it.

use super::{RelayError, Result};
use crate::config::Settings;
use crate::store::Shown;

/// Prints the message (a table of fields, or `json`); a message found nowhere is an error (exit
/// 1) that says why it may be missing.
pub async fn run(settings: &Settings, id: i64, json: bool) -> Result<()> {
    if id < 1 {
        return Err(RelayError::Usage(format!(
            "invalid id {id}: message ids start at 1"
        )));
    }
    let store = super::admin_store(settings).await?;
    let shown = store
        .show(id)
        .await
        .map_err(|e| RelayError::Runtime(e.into()))?;
    let Some(shown) = shown else {
        let why = match settings.engine.keep_completed {
            Some(keep) => format!(
                "never enqueued, or delivered more than {} ago (keep_completed)",
                humantime::format_duration(keep)
            ),
            None => "never enqueued, or delivered (completed messages are not kept: set [retention] keep_completed)".to_owned(),
        };
        return Err(RelayError::Runtime(anyhow::anyhow!(
            "message {id} not found: {why}"
        )));
    };
    let value = serde_json::to_value(&shown).map_err(|e| RelayError::Runtime(e.into()))?;
    if json {
        println!("{value}");
        return Ok(());
    }
    let headline = match &shown {
        Shown::Queued { state, .. } => format!("queued ({state})"),
        Shown::Dead { reason, .. } => format!("dead-lettered: {reason}"),
        Shown::Delivered {
            sink, delivered_at, ..
        } => format!("delivered by the {sink} sink at {delivered_at}"),
    };
    println!("message {id}: {}", super::printable(&headline));
    if let serde_json::Value::Object(fields) = value {
        for (k, v) in fields.iter().filter(|(k, _)| *k != "status" && *k != "id") {
            let v = match v {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Null => "-".to_owned(),
                other => other.to_string(),
            };
            println!("  {k:<13} {}", super::printable(&v));
        }
    }
    Ok(())
}
