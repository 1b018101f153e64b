//! `postbox`: the relay and its operator commands. A thin layer: parse, load the configuration,
//! set up logging (standard error), run, map errors to exit codes (0 ok, 1 runtime, 2 usage).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use postbox::Message;
use postbox::config::{Config, Overrides, Settings, parse_duration};
use postbox::relay::{self, RelayError};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "postbox",
    version,
    about = "PostgreSQL transactional outbox relay"
)]
struct Cli {
    /// Configuration file (TOML).
    #[arg(long, global = true, env = "POSTBOX_CONFIG")]
    config: Option<PathBuf>,
    /// PostgreSQL URL (overrides POSTBOX_DATABASE_URL, DATABASE_URL and the file).
    #[arg(long, global = true)]
    database_url: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create the database if it does not exist, run pending migrations.
    Migrate,
    /// Run the relay.
    Run {
        /// Exit 0 once nothing claimable is left.
        #[arg(long)]
        drain: bool,
    },
    /// Depth per topic and state, oldest pending age, dead letters, stalled ordered keys.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// The dead letters.
    #[command(subcommand)]
    Dead(DeadCommand),
    /// Enqueue one message.
    Enqueue(EnqueueArgs),
    /// The configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Migrate, enqueue sample orders in transactions, relay them to the log sink, summarise.
    Demo {
        /// Orders to create.
        #[arg(long, default_value_t = 2000)]
        orders: usize,
    },
}

#[derive(Subcommand)]
enum DeadCommand {
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
    Purge {
        #[command(flatten)]
        selector: Selector,
        /// Dead for longer than this (e.g. 7d).
        #[arg(long, value_parser = duration)]
        older_than: Option<Duration>,
    },
}

#[derive(Args)]
struct Selector {
    /// These ids (repeatable).
    #[arg(long = "id")]
    ids: Vec<i64>,
    /// Every dead letter of this topic.
    #[arg(long)]
    topic: Option<String>,
    /// All of them.
    #[arg(long)]
    all: bool,
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Validate the configuration and print it with secrets redacted.
    Check,
}

#[derive(Args)]
struct EnqueueArgs {
    #[arg(long)]
    topic: String,
    /// The payload, as JSON.
    #[arg(long, value_parser = json)]
    payload: serde_json::Value,
    #[arg(long)]
    key: Option<String>,
    #[arg(long)]
    ordered: bool,
    /// A header NAME=VALUE (repeatable).
    #[arg(long = "header", value_parser = header)]
    headers: Vec<(String, String)>,
    /// Not before this long from now (e.g. 30s).
    #[arg(long, value_parser = duration)]
    delay: Option<Duration>,
}

fn duration(s: &str) -> Result<Duration, String> {
    parse_duration(s)
}

fn json(s: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(s).map_err(|e| format!("not valid JSON: {e}"))
}

fn header(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("{s:?} is not NAME=VALUE"))
}

fn settings(cli: &Cli) -> Result<Settings, RelayError> {
    let file = match &cli.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| RelayError::Usage(format!("--config {}: {e}", path.display())))?;
            Config::from_toml(&text)
                .map_err(|e| RelayError::Usage(format!("{}: {e}", path.display())))?
        }
        None => Config::default(),
    };
    let mut env = Overrides::from_env();
    if let Some(url) = &cli.database_url {
        env.database_url = Some(url.clone());
    }
    file.resolve(env)
        .map_err(|e| RelayError::Usage(e.to_string()))
}

fn signals(shutdown: CancellationToken, hard_stop: CancellationToken) {
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            return;
        };
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        tracing::info!("shutting down (a second signal hands everything back at once)");
        shutdown.cancel();
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        hard_stop.cancel();
    });
}

async fn execute(cli: Cli) -> Result<(), RelayError> {
    let settings = settings(&cli)?;
    match cli.command {
        Command::Config(ConfigCommand::Check) => {
            print!("{}", settings.to_redacted_toml());
            eprintln!("configuration ok");
        }
        Command::Migrate => {
            let applied = relay::migrate(&settings).await?;
            eprintln!(
                "migrations applied: {}",
                if applied.is_empty() {
                    "none (up to date)".to_owned()
                } else {
                    applied.join(", ")
                }
            );
        }
        Command::Run { drain } => {
            let (shutdown, hard_stop) = (CancellationToken::new(), CancellationToken::new());
            signals(shutdown.clone(), hard_stop.clone());
            relay::run(settings, drain, shutdown, hard_stop).await?;
        }
        Command::Status { json } => {
            let store = relay::admin_store(&settings).await?;
            let stats = store
                .stats()
                .await
                .map_err(|e| RelayError::Runtime(e.into()))?;
            let stalled = store
                .stalled_keys(100)
                .await
                .map_err(|e| RelayError::Runtime(e.into()))?;
            if json {
                println!(
                    "{}",
                    serde_json::json!({"topics": stats.topics, "estimated": stats.estimated, "dead_total": stats.dead_total(), "stalled_keys": stalled})
                );
            } else {
                println!(
                    "{:<32} {:>10} {:>10} {:>10} {:>10} {:>10} {:>14}",
                    "TOPIC", "AVAILABLE", "SCHEDULED", "RUNNING", "WAITING", "DEAD", "OLDEST (s)"
                );
                let approx = if stats.estimated { "~" } else { "" };
                for t in &stats.topics {
                    let oldest = t
                        .oldest_available_secs
                        .map_or("-".to_owned(), |s| format!("{s:.1}"));
                    let n = |v: i64| format!("{approx}{v}");
                    println!(
                        "{:<32} {:>10} {:>10} {:>10} {:>10} {:>10} {:>14}",
                        t.topic,
                        n(t.available),
                        n(t.scheduled),
                        t.running,
                        n(t.waiting),
                        n(t.dead),
                        oldest
                    );
                }
                if stats.estimated {
                    println!(
                        "(~: estimated from a sample: the queue holds more than {} messages)",
                        postbox::store::EXACT_LIMIT
                    );
                }
                println!("dead letters: {}", stats.dead_total());
                if stalled.is_empty() {
                    println!("stalled ordered keys: none");
                } else {
                    println!("stalled ordered keys:");
                    for s in &stalled {
                        println!(
                            "  {} / {}: head #{} on attempt {}, {:.0}s old, {} waiting; last error: {}",
                            s.topic,
                            s.key,
                            s.id,
                            s.attempts,
                            s.age_secs,
                            s.waiting,
                            s.last_error.as_deref().unwrap_or("-")
                        );
                    }
                }
            }
        }
        Command::Dead(DeadCommand::List { topic, limit, json }) => {
            let store = relay::admin_store(&settings).await?;
            let dead = store
                .dead_list(topic.as_deref(), limit)
                .await
                .map_err(|e| RelayError::Runtime(e.into()))?;
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
                        d.topic,
                        d.key.as_deref().unwrap_or("-"),
                        d.attempts,
                        d.max_attempts,
                        d.dead_at.to_rfc3339(),
                        d.reason
                    );
                }
                eprintln!("{} dead letter(s)", dead.len());
            }
        }
        Command::Dead(DeadCommand::Replay(s)) => {
            let selector = relay::selector(s.ids, s.topic, None, s.all)?;
            let store = relay::admin_store(&settings).await?;
            let r = store
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
        Command::Dead(DeadCommand::Purge {
            selector,
            older_than,
        }) => {
            let selector = relay::selector(selector.ids, selector.topic, older_than, selector.all)?;
            let store = relay::admin_store(&settings).await?;
            let n = store
                .dead_purge(&selector)
                .await
                .map_err(|e| RelayError::Runtime(e.into()))?;
            println!("purged {n}");
        }
        Command::Enqueue(a) => {
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
            match relay::enqueue(&settings, msg).await? {
                postbox::Enqueued::New(id) => println!("{id}"),
                postbox::Enqueued::Duplicate { existing } => println!(
                    "duplicate of {}",
                    existing.map_or("-".into(), |i| i.to_string())
                ),
            }
        }
        Command::Demo { orders } => {
            let s = relay::demo(settings, orders).await?;
            println!(
                "demo: {} orders, {} messages relayed to the log sink in {:.2} s ({:.0} msg/s); end-to-end latency p50 {:.1} ms, p99 {:.1} ms",
                s.orders,
                s.messages,
                s.seconds,
                s.messages as f64 / s.seconds,
                s.p50_ms,
                s.p99_ms
            );
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse(); // usage errors exit 2
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("POSTBOX_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match runtime.block_on(execute(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!(
                "postbox: {}",
                postbox::config::redact_url(&format!("{e:#}"))
            );
            ExitCode::from(e.exit_code() as u8)
        }
    }
}
