//! `postbox status`: depth per topic and state, oldest pending age, dead letters, stalled keys.

use super::printable;
use super::{RelayError, Result};
use crate::config::Settings;

/// Topics the table shows unless `--all`: the largest, by messages in the table and dead letters.
const TOP_TOPICS: usize = 20;

/// Prints the status, as a table or (`json`) as one JSON object (every topic); the table shows
/// the [`TOP_TOPICS`] largest topics and a line for the rest, unless `all`.
pub async fn run(settings: &Settings, json: bool, all: bool) -> Result<()> {
    let store = super::admin_store(settings).await?;
    let stats = store
        .stats()
        .await
        .map_err(|e| RelayError::Runtime(e.into()))?;
    let stalled = store
        .stalled_keys(100)
        .await
        .map_err(|e| RelayError::Runtime(e.into()))?;
    let paused = store
        .paused()
        .await
        .map_err(|e| RelayError::Runtime(e.into()))?;
    let schedules = store
        .schedules()
        .await
        .map_err(|e| RelayError::Runtime(e.into()))?;
    let mut limits = Vec::new();
    for l in settings.running_limits() {
        let running = store
            .limit_running(&l)
            .await
            .map_err(|e| RelayError::Runtime(e.into()))?;
        limits.push(serde_json::json!({"name": l.name(), "topics": l.patterns(), "max_running": l.max_running(), "per_key": l.is_per_key(), "running": running}));
    }
    let retention = match settings.engine.keep_completed {
        Some(keep) => {
            let (kept, partitions) = store
                .completed_kept()
                .await
                .map_err(|e| RelayError::Runtime(e.into()))?;
            serde_json::json!({"keep_completed": humantime::format_duration(keep).to_string(), "kept": kept, "partitions": partitions})
        }
        None => serde_json::Value::Null,
    };
    let slots = store
        .stream_status(None)
        .await
        .map_err(|e| RelayError::Runtime(e.into()))?;
    let stream: Vec<serde_json::Value> = slots.iter().map(super::stream::slot_json).collect();
    let matcher = crate::store::Topics::only(&paused);
    let is_paused = |topic: &str| !paused.is_empty() && matcher.matches(topic);
    if json {
        let paused_topics: Vec<&str> = stats
            .topics
            .iter()
            .map(|t| t.topic.as_str())
            .filter(|t| is_paused(t))
            .collect();
        println!(
            "{}",
            serde_json::json!({"topics": stats.topics, "estimated": stats.estimated, "dead_total": stats.dead_total(), "stalled_keys": stalled, "paused": paused, "paused_topics": paused_topics, "schedules": schedules, "limits": limits, "retention": retention, "stream": stream})
        );
    } else {
        println!(
            "{:<32} {:>10} {:>10} {:>10} {:>10} {:>10} {:>14} {:>7}",
            "TOPIC", "AVAILABLE", "SCHEDULED", "RUNNING", "WAITING", "DEAD", "OLDEST (s)", "PAUSED"
        );
        let approx = if stats.estimated { "~" } else { "" };
        let size = |t: &crate::store::TopicStats| {
            t.available + t.scheduled + t.running + t.waiting + t.dead
        };
        let mut topics: Vec<&crate::store::TopicStats> = stats.topics.iter().collect();
        if !all && topics.len() > TOP_TOPICS {
            topics.sort_by(|a, b| size(b).cmp(&size(a)).then_with(|| a.topic.cmp(&b.topic)));
        }
        let shown = if all {
            topics.len()
        } else {
            TOP_TOPICS.min(topics.len())
        };
        let row = |name: &str, t: [i64; 5], oldest: String, paused: &str| {
            let n = |v: i64| format!("{approx}{v}");
            println!(
                "{:<32} {:>10} {:>10} {:>10} {:>10} {:>10} {:>14} {:>7}",
                name,
                n(t[0]),
                n(t[1]),
                t[2],
                n(t[3]),
                n(t[4]),
                oldest,
                paused
            );
        };
        let counts =
            |t: &crate::store::TopicStats| [t.available, t.scheduled, t.running, t.waiting, t.dead];
        for t in &topics[..shown] {
            let oldest = t
                .oldest_available_secs
                .map_or("-".to_owned(), |s| format!("{s:.1}"));
            row(
                &printable(&t.topic),
                counts(t),
                oldest,
                if is_paused(&t.topic) { "yes" } else { "" },
            );
        }
        let sum = |ts: &[&crate::store::TopicStats]| {
            ts.iter().fold([0i64; 5], |mut acc, t| {
                for (a, v) in acc.iter_mut().zip(counts(t)) {
                    *a += v;
                }
                acc
            })
        };
        let oldest_of = |ts: &[&crate::store::TopicStats]| {
            ts.iter()
                .filter_map(|t| t.oldest_available_secs)
                .max_by(f64::total_cmp)
                .map_or("-".to_owned(), |s| format!("{s:.1}"))
        };
        let rest = &topics[shown..];
        if !rest.is_empty() {
            let paused_rest = rest.iter().filter(|t| is_paused(&t.topic)).count();
            row(
                &format!("({} more topics)", rest.len()),
                sum(rest),
                oldest_of(rest),
                &if paused_rest > 0 {
                    paused_rest.to_string()
                } else {
                    String::new()
                },
            );
        }
        if topics.len() > 1 {
            row(
                &format!("TOTAL ({} topics)", topics.len()),
                sum(&topics),
                oldest_of(&topics),
                "",
            );
        }
        if !rest.is_empty() {
            println!(
                "(the {shown} largest topics; postbox status --all for every topic, --json for all of it)"
            );
        }
        if stats.estimated {
            println!(
                "(~: estimated from a sample: the queue holds more than {} messages)",
                crate::store::EXACT_LIMIT
            );
        }
        println!("dead letters: {}", stats.dead_total());
        if paused.is_empty() {
            println!("paused: none");
        } else {
            println!("paused: {}", printable(&paused.join(", ")));
        }
        print_schedules(&schedules);
        print_limits(&limits);
        if retention.is_null() {
            println!("retention: off (delivered messages are deleted)");
        } else {
            println!(
                "retention: keep_completed {}; ~{} delivered messages kept in {} hourly partitions (postbox show ID)",
                retention["keep_completed"].as_str().unwrap_or(""),
                retention["kept"],
                retention["partitions"]
            );
        }
        if slots.is_empty() {
            println!("stream: not set up");
        }
        for slot in &slots {
            println!("stream {}", super::stream::text(slot));
        }
        if stalled.is_empty() {
            println!("stalled ordered keys: none");
        } else {
            println!("stalled ordered keys:");
            for s in &stalled {
                println!(
                    "  {} / {}: head #{} on attempt {}, {:.0}s old, {} waiting; last error: {}",
                    printable(&s.topic),
                    printable(&s.key),
                    s.id,
                    s.attempts,
                    s.age_secs,
                    s.waiting,
                    printable(s.last_error.as_deref().unwrap_or("-"))
                );
            }
        }
    }
    Ok(())
}

fn print_schedules(schedules: &[crate::store::ScheduleRow]) {
    if schedules.is_empty() {
        println!("schedules: none");
        return;
    }
    println!(
        "{:<24} {:<20} {:<16} {:<24} {:<30} {:<22}",
        "SCHEDULE", "CRON", "TIMEZONE", "TOPIC", "LAST RUN", "NEXT RUN"
    );
    let at = |t: chrono::DateTime<chrono::Utc>| t.format("%Y-%m-%d %H:%M:%SZ").to_string();
    for s in schedules {
        let last = match (s.last_tick, s.last_message_id) {
            (Some(t), Some(id)) => format!("{} #{id}", at(t)),
            (Some(t), None) => at(t),
            _ => "never".to_owned(),
        };
        println!(
            "{:<24} {:<20} {:<16} {:<24} {:<30} {:<22}",
            printable(&s.name),
            printable(&s.cron),
            printable(&s.timezone),
            printable(&s.topic),
            last,
            at(s.next_tick)
        );
    }
}

fn print_limits(limits: &[serde_json::Value]) {
    if limits.is_empty() {
        println!("running limits: none configured");
        return;
    }
    println!(
        "{:<32} {:>12} {:>8} {:>8}",
        "LIMIT (topics)", "MAX RUNNING", "PER KEY", "RUNNING"
    );
    for l in limits {
        println!(
            "{:<32} {:>12} {:>8} {:>8}",
            printable(l["name"].as_str().unwrap_or("")),
            l["max_running"],
            if l["per_key"] == true { "yes" } else { "no" },
            l["running"]
        );
    }
}
