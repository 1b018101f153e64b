//! `postbox`: the relay and its operator commands. A thin layer: parse, set up logging (standard
//! error), dispatch (`postbox::relay::cli`), map errors to exit codes (0 ok, 1 runtime, 2 usage).

use std::process::ExitCode;

use clap::Parser;
use postbox::relay::cli::{Cli, execute};

fn main() -> ExitCode {
    let cli = Cli::parse(); // usage errors exit 2
    cli.quiet_on_closed_stdout();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("POSTBOX_LOG")
                // The replication client's own error lines are off: the streamer logs each of its
                // errors with what it does about it (a standby would otherwise log one a second).
                .unwrap_or_else(|_| "info,pgwire_replication=off".into()),
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
