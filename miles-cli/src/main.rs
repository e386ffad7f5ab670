//! The `miles` command: settings from flags and a TOML file, then the chosen command.
//!
//! Exit status: 0 on success, 2 for bad settings (every broken rule is printed), 1 for any other
//! failure.

#![deny(unsafe_code)]

mod backends;
mod bench;
mod check_config;
mod doctor;
mod generate;
mod gpu;
mod launch;
mod model_cmd;
mod settings_args;
mod signals;
mod train;
mod train_data;

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
    /// Print the resolved settings, each with where its value came from.
    CheckConfig(Box<check_config::CheckConfigArgs>),
    /// Print what this machine offers: CPU, memory, CUDA driver and GPUs, NCCL, a disk directory.
    Doctor(doctor::DoctorArgs),
    /// Make, inspect and score models.
    Model(model_cmd::ModelArgs),
    /// Run the colocated RL loop: rollout, rewards, training, offload and weight sync.
    Train(Box<train::TrainArgs>),
    /// Sample completions of prompts from a checkpoint with the rollout engine.
    Generate(Box<generate::GenerateArgs>),
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
    /// Pause/resume throughput of one tag against plain memcpy and O_DIRECT I/O.
    Offload(bench::offload::OffloadBenchArgs),
    /// A training backend's offload and onload per rank against plain copies of the same bytes.
    OffloadTrain(Box<bench::offload_train::OffloadTrainBenchArgs>),
    /// Training step throughput and the share of time in matrix products.
    Train(bench::train::BenchTrainArgs),
    /// Rollout decode throughput and the time of each offload / onload step per level.
    Rollout(Box<bench::rollout::BenchRolloutArgs>),
    /// The model's matrix products: cuBLAS's pick against every cuBLASLt candidate (cuda).
    Gemm(Box<bench::gemm::GemmBenchArgs>),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    let result = match cli.command {
        Command::CheckConfig(args) => check_config::run(*args),
        Command::Doctor(args) => doctor::run(args),
        Command::Model(args) => model_cmd::run(args),
        Command::Train(args) => train::run(*args),
        Command::Generate(args) => generate::run(*args),
        Command::Bench {
            bench: BenchCommand::Train(args),
        } => bench::train(args),
        Command::Bench {
            bench: BenchCommand::Offload(args),
        } => bench::offload(&args),
        Command::Bench {
            bench: BenchCommand::OffloadTrain(args),
        } => bench::offload_train::run(*args),
        Command::Bench {
            bench: BenchCommand::Rollout(args),
        } => bench::rollout::run(&args),
        Command::Bench {
            bench: BenchCommand::Gemm(args),
        } => bench::gemm::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => report(&error),
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

/// Prints the error (every broken rule on its own line) and picks the exit status.
fn report(error: &anyhow::Error) -> ExitCode {
    if let Some(status) = signals::exit_status(error) {
        // Printing can only fail when stderr is gone; the exit status still tells what happened.
        let _ = writeln!(std::io::stderr(), "{error}");
        return status;
    }
    let bad_settings = settings_args::is_bad_settings(error);
    let mut stderr = std::io::stderr().lock();
    // Printing can only fail when stderr is gone; the exit status still tells what happened.
    let _ = if bad_settings {
        writeln!(stderr, "error: invalid settings")
    } else {
        writeln!(stderr, "error: {}", chain_text(error))
    };
    if bad_settings {
        for line in error.to_string().lines() {
            let _ = writeln!(stderr, "  {line}");
        }
        ExitCode::from(2)
    } else {
        ExitCode::FAILURE
    }
}

/// The error and its causes, each cause once: a cause whose text the message before it already
/// holds (an error that prints its source) is not repeated.
fn chain_text(error: &anyhow::Error) -> String {
    let mut text = error.to_string();
    for cause in error.chain().skip(1) {
        let cause = cause.to_string();
        if !text.contains(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_the_message_already_holds_is_printed_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let error = anyhow::Error::new(miles_core::BackendError::Io {
            action: "read",
            path: "config.json".into(),
            source: io,
        })
        .context("actor cannot save");
        let text = chain_text(&error);
        assert_eq!(text.matches("no such file").count(), 1, "{text}");
        assert!(
            text.starts_with("actor cannot save: cannot read config.json"),
            "{text}"
        );
    }
}
