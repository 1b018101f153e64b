//! `postbox check`: what the state model forbids, by kind; exit 1 when anything is found.

use super::{RelayError, Result};
use crate::config::Settings;
use crate::store::VIOLATION_KINDS;

/// The most violations listed per kind.
const LIMIT: u32 = 1000;

/// Prints each violation (or, with `json`, `{"ok": bool, "counts": {kind: n}, "violations": [..]}`)
/// and fails (exit 1) when any is found.
pub async fn run(settings: &Settings, json: bool) -> Result<()> {
    let store = super::admin_store(settings).await?;
    let found = store
        .check(LIMIT)
        .await
        .map_err(|e| RelayError::Runtime(e.into()))?;
    let counts: serde_json::Map<String, serde_json::Value> = VIOLATION_KINDS
        .iter()
        .map(|k| {
            let n = found.iter().filter(|v| v.kind == *k).count();
            ((*k).to_owned(), n.into())
        })
        .collect();
    if json {
        println!(
            "{}",
            serde_json::json!({"ok": found.is_empty(), "counts": counts, "violations": found})
        );
    } else if found.is_empty() {
        println!("ok: no stranded keys, no keys with two heads, no holds past their limit");
    } else {
        for v in &found {
            let at = match (&v.topic, &v.key) {
                (Some(t), Some(k)) => format!(" {t} / {k}:"),
                _ => ":".to_owned(),
            };
            println!("{}{at} {}", v.kind, v.detail);
        }
    }
    if found.is_empty() {
        return Ok(());
    }
    let summary: Vec<String> = counts
        .iter()
        .filter(|(_, n)| n.as_u64() != Some(0))
        .map(|(k, n)| format!("{n} {k}"))
        .collect();
    Err(RelayError::Runtime(anyhow::anyhow!(
        "the state model's invariants do not hold: {} (the relay's rescuer repairs stranded keys; see the runbook)",
        summary.join(", ")
    )))
}
