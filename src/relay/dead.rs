//! `postbox dead list | replay | purge`.

use std::time::Duration;

use clap::{Args, Subcommand};

use super::{RelayError, Result};
use crate::config::Settings;
use crate::store::DeadSelector;

/// `dead replay` / `dead purge` selectors from the command line.
pub fn selector(
    ids: Vec<i64>,
    topic: Option<String>,
    older_than: Option<Duration>,
    all: bool,
) -> Result<DeadSelector> {
    let given = usize::from(!ids.is_empty())
        + usize::from(topic.is_some())
        + usize::from(older_than.is_some())
        + usize::from(all);
    if given != 1 {
        return Err(RelayError::Usage(
            "choose exactly one of --id, --topic, --older-than, --all".into(),
        ));
    }
    Ok(if !ids.is_empty() {
        DeadSelector::Ids(ids)
    } else if let Some(t) = topic {
        DeadSelector::Topic(t)
    } else if let Some(d) = older_than {
        DeadSelector::OlderThan(d)
    } else {
        DeadSelector::All
    })
}

#[derive(Subcommand)]
pub enum DeadCommand {
    /// List dead letters, oldest first.
    List {
        #[arg(long)]
        topic: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: i64,
        #[arg(long)]
        json: bool,
    },
    /// Put dead letters back into the queue (same ids, attempts reset).
    Replay(Selector),
    /// Delete dead letters for good.
    Purge(Selector),
}

#[derive(Args)]
pub struct Selector {
    /// These ids (repeatable).
    #[arg(long = "id")]
    pub ids: Vec<i64>,
    /// Every dead letter of this topic.
    #[arg(long)]
    pub topic: Option<String>,
    /// Dead for longer than this (e.g. 7d).
    #[arg(long, value_parser = super::cli::duration)]
    pub older_than: Option<Duration>,
    /// All of them.
    #[arg(long)]
    pub all: bool,
}

/// Runs a `dead` command (its arguments are checked before the database is reached).
pub async fn run(settings: &Settings, command: DeadCommand) -> Result<()> {
    let store = || super::admin_store(settings);
    match command {
        DeadCommand::List { topic, limit, json } => {
            // One more than asked: whether more exist, without counting them all.
            let mut dead = store()
                .await?
                .dead_list(topic.as_deref(), limit.saturating_add(1))
                .await
                .map_err(|e| RelayError::Runtime(e.into()))?;
            let more = usize::try_from(limit).is_ok_and(|l| dead.len() > l);
            if more {
                dead.truncate(usize::try_from(limit).unwrap_or_default());
            }
            if json {
                println!(
                    "{}",
                    serde_json::to_string(&dead).expect("dead letters serialize")
                );
            } else {
                for d in &dead {
                    println!(
                        "#{} {} key={} attempts={}/{} dead_at={} reason: {}",
                        d.id,
                        super::printable(&d.topic),
                        super::printable(d.key.as_deref().unwrap_or("-")),
                        d.attempts,
                        d.max_attempts,
                        d.dead_at.to_rfc3339(),
                        super::printable(&d.reason)
                    );
                }
                if more {
                    eprintln!(
                        "the first {} dead letter(s); more exist (raise --limit, or narrow with --topic)",
                        dead.len()
                    );
                } else {
                    eprintln!("{} dead letter(s)", dead.len());
                }
            }
        }
        DeadCommand::Replay(s) => {
            let selector = selector(s.ids, s.topic, s.older_than, s.all)?;
            let r = store()
                .await?
                .dead_replay(&selector)
                .await
                .map_err(|e| RelayError::Runtime(e.into()))?;
            println!("replayed {}", r.replayed.len());
            if !r.skipped.is_empty() {
                println!(
                    "skipped {} (a live message holds their dedup key): {:?}",
                    r.skipped.len(),
                    r.skipped
                );
            }
        }
        DeadCommand::Purge(s) => {
            let selector = selector(s.ids, s.topic, s.older_than, s.all)?;
            let n = store()
                .await?
                .dead_purge(&selector)
                .await
                .map_err(|e| RelayError::Runtime(e.into()))?;
            println!("purged {n}");
        }
    }
    Ok(())
}
