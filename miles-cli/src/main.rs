//! The `miles` command.

#![forbid(unsafe_code)]

mod bench_offload;

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use bench_offload::{BadSettings, OffloadBenchArgs};

/// RL post-training with training and rollout colocated on the same devices.
#[derive(Debug, Parser)]
#[command(name = "miles", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Benchmarks that print our figure next to a baseline measured in the same run.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Pause/resume throughput of one tag against plain memcpy and O_DIRECT I/O.
    Offload(OffloadBenchArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Bench(BenchCommand::Offload(args)) => bench_offload::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            let _ = writeln!(std::io::stderr(), "error: {error:#}");
            if error.downcast_ref::<BadSettings>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}
