//! The `kvr` binary. Subcommands live one per file (or directory); `serve` is the
//! `kvr-service` crate's.

mod hash_cmd;
mod output;
mod replay;
mod tokens;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// kvr: KV-cache-aware selection for LLM inference routing. Hash prompts as Dynamo does,
/// replay a simulated cluster to compare routing policies, or serve Dynamo's selection API.
#[derive(Debug, Parser)]
#[command(name = "kvr", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Hash a token sequence into Dynamo-compatible local and sequence block hashes.
    Hash(hash_cmd::HashArgs),
    /// Simulate a routed cluster on a workload (built-in, or a Mooncake trace) and compare
    /// routing policies: cache hits, time to first token, balance.
    Replay(replay::ReplayArgs),
    /// Serve Dynamo's selection-service HTTP API (a drop-in for `python -m
    /// dynamo.select_service`): workers, selection, bookings, loads, metrics.
    Serve(kvr_service::ServeArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Hash(args) => hash_cmd::run(&args),
        Command::Replay(args) => replay::run(&args),
        Command::Serve(args) => kvr_service::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("kvr: {msg}");
            ExitCode::FAILURE
        }
    }
}
