//! The command line: what `postbox` accepts, and the dispatch to each command's file.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};

use super::RelayError;
use super::cancel::CancelArgs;
use super::dead::DeadCommand;
use super::enqueue::EnqueueArgs;
use super::grant::GrantArgs;
use super::pause::TopicArgs;
use super::stream::StreamCommand;
use crate::config::{Config, Overrides, Settings, parse_duration};

#[derive(Parser)]
#[command(
    name = "postbox",
    version,
    about = "PostgreSQL transactional outbox relay"
)]
/// PostgreSQL transactional outbox relay
pub struct Cli {
    /// Configuration file (TOML).
    #[arg(long, global = true, env = "POSTBOX_CONFIG")]
    config: Option<PathBuf>,
    /// PostgreSQL URL (overrides POSTBOX_DATABASE_URL, DATABASE_URL and the file).
    #[arg(long, global = true)]
    database_url: Option<String>,
    #[command(subcommand)]
    command: Command,
}

impl Cli {
    /// For a command that prints its answer and ends (all but `run` and `demo`), a reader that
    /// closes its end early (`postbox status | head -1`) ends the process quietly, as it ends
    /// `ls`, instead of a panic on the broken pipe. The relay keeps the default of Rust programs:
    /// its log sink sees a closed stdout as an error and says so.
    pub fn quiet_on_closed_stdout(&self) {
        if matches!(self.command, Command::Run { .. } | Command::Demo { .. }) {
            return;
        }
        #[cfg(unix)]
        // SAFETY: restores the default disposition of SIGPIPE before any thread is started; no
        // handler is installed.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
}

/// The commands.
#[derive(Subcommand)]
pub enum Command {
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
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Every topic in the table (by default the 20 largest, and a line for the rest).
        #[arg(long)]
        all: bool,
    },
    /// What the state model forbids (stranded ordered keys, keys with two heads, holds past
    /// their limit); exit 1 when any is found.
    Check {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// The dead letters.
    #[command(subcommand)]
    Dead(DeadCommand),
    /// Enqueue one message.
    Enqueue(EnqueueArgs),
    /// Stop every relay and engine from claiming these topics (running deliveries finish).
    Pause(TopicArgs),
    /// Let paused topics be claimed again (the patterns as they were paused).
    Resume(TopicArgs),
    /// Move pending and scheduled messages to the dead letters (reason "cancelled"); running ones
    /// finish their current attempt and are not retried.
    Cancel(CancelArgs),
    /// Where a message is: queued (and its state), dead-lettered (and why), or delivered (when,
    /// by which sink; with `[retention] keep_completed`).
    Show {
        /// The message's id.
        id: i64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// The configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Stream mode's replication slot: set it up, see it, drop it.
    #[command(subcommand)]
    Stream(StreamCommand),
    /// Least-privilege roles: give a role the rights of a writer, a relay or an operator on this
    /// database's postbox schema, or take them back (`--sql` prints the statements).
    Grant(GrantArgs),
    /// Migrate, enqueue sample orders in transactions, relay them to the log sink, summarise.
    Demo {
        /// Orders to create.
        #[arg(long, default_value_t = 2000)]
        orders: usize,
    },
}

/// `postbox config ...`.
#[derive(Subcommand)]
pub enum ConfigCommand {
    /// Validate the configuration and print it with secrets redacted.
    Check,
}

pub(super) fn duration(s: &str) -> Result<Duration, String> {
    parse_duration(s)
}

pub(super) fn json(s: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(s).map_err(|e| format!("not valid JSON: {e}"))
}

pub(super) fn header(s: &str) -> Result<(String, String), String> {
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

/// Runs the command `cli` names.
pub async fn execute(cli: Cli) -> Result<(), RelayError> {
    let settings = settings(&cli)?;
    match cli.command {
        Command::Config(ConfigCommand::Check) => {
            print!("{}", settings.to_redacted_toml());
            for note in settings.ui.iter().flat_map(|u| u.notes()) {
                eprintln!("note: {note}");
            }
            eprintln!("configuration ok");
        }
        Command::Migrate => {
            let applied = super::migrate(&settings).await?;
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
            let stop = crate::engine::stop_on_signals();
            super::run(settings, drain, stop.shutdown, stop.hard_stop).await?;
        }
        Command::Status { json, all } => super::status::run(&settings, json, all).await?,
        Command::Check { json } => super::check::run(&settings, json).await?,
        Command::Dead(command) => super::dead::run(&settings, command).await?,
        Command::Enqueue(args) => super::enqueue::run(&settings, args).await?,
        Command::Pause(args) => super::pause::pause(&settings, args).await?,
        Command::Resume(args) => super::pause::resume(&settings, args).await?,
        Command::Cancel(args) => super::cancel::run(&settings, args).await?,
        Command::Show { id, json } => super::show::run(&settings, id, json).await?,
        Command::Stream(command) => super::stream::run(&settings, command).await?,
        Command::Grant(args) => super::grant::run(&settings, args).await?,
        Command::Demo { orders } => {
            let s = super::demo(settings, orders).await?;
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
