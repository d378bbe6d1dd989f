//! The `kvr` binary. Subcommands live one per file; `serve` and `replay` join later.

mod hash_cmd;
mod tokens;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// kvr: a KV-cache-aware LLM routing engine.
#[derive(Debug, Parser)]
#[command(name = "kvr", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Hash a token sequence into Dynamo-compatible local and sequence block hashes.
    Hash(hash_cmd::HashArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Hash(args) => hash_cmd::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("kvr: {msg}");
            ExitCode::FAILURE
        }
    }
}
