//! The `miles` command.
//!
//! Exit status: 0 on success, 2 for bad usage (clap), 1 for any other failure.

#![forbid(unsafe_code)]

mod bench_train;
mod model_cmd;

use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

/// RL post-training with training and rollout colocated on the same devices.
#[derive(Parser, Debug)]
#[command(name = "miles", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The commands of `miles`; each lives in its own module.
#[derive(Subcommand, Debug)]
enum Command {
    /// Make, inspect and score models.
    Model(model_cmd::ModelArgs),
    /// Benchmarks that print our figure next to a baseline measured in the same run.
    Bench {
        /// Which benchmark.
        #[command(subcommand)]
        bench: BenchCommand,
    },
}

/// The benchmarks.
#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Training step throughput and the share of time in matrix products.
    Train(bench_train::BenchTrainArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    let result = match cli.command {
        Command::Model(args) => model_cmd::run(args),
        Command::Bench {
            bench: BenchCommand::Train(args),
        } => bench_train::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // Printing can only fail when stderr is gone; the exit status still tells.
            let _ = writeln!(std::io::stderr().lock(), "error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Logs go to stderr through `tracing`; RUST_LOG filters them (default `info`).
fn init_logging() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
}
