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
    /// Be a gateway's endpoint picker: an Envoy ext_proc server (Gateway API Inference
    /// Extension protocol) that sends each request to the pod holding its prefix.
    Epp(kvr_epp::EppArgs),
    /// Emulate GPU-free model servers: OpenAI-compatible HTTP, a prefix KV cache per pod,
    /// and its KV events on vLLM's ZMQ wire (for testing and demonstrating routing).
    Emulate(kvr_emulate::EmulateArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Hash(args) => hash_cmd::run(&args),
        Command::Replay(args) => replay::run(&args),
        Command::Serve(args) => kvr_service::run(args),
        Command::Epp(args) => kvr_epp::run(args),
        Command::Emulate(args) => kvr_emulate::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("kvr: {msg}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod help_tests {
    //! `kvr --help` and every subcommand's help say what the binary does: every option
    //! shown has a help line (hidden ones: Dynamo's accepted-but-ignored flags), and `replay --policy` names every policy there is.

    use clap::CommandFactory;

    use super::Cli;
    use crate::replay::policy::PolicyKind;

    /// `cmd`'s options and subcommands (recursively) that have no help text, as
    /// `path --flag` or `path sub`.
    fn undocumented(cmd: &clap::Command, path: &str) -> Vec<String> {
        let mut out = Vec::new();
        for arg in cmd.get_arguments() {
            let builtin = matches!(arg.get_id().as_str(), "help" | "version");
            if !builtin
                && !arg.is_hide_set()
                && arg.get_help().is_none()
                && arg.get_long_help().is_none()
            {
                out.push(format!(
                    "{path} --{}",
                    arg.get_long().unwrap_or(arg.get_id().as_str())
                ));
            }
        }
        for sub in cmd.get_subcommands() {
            let sub_path = format!("{path} {}", sub.get_name());
            if sub.get_about().is_none() && sub.get_name() != "help" {
                out.push(sub_path.clone());
            }
            out.extend(undocumented(sub, &sub_path));
        }
        out
    }

    #[test]
    fn every_option_and_subcommand_has_help() {
        let missing = undocumented(&Cli::command(), "kvr");
        assert!(missing.is_empty(), "no help text: {missing:?}");
    }

    #[test]
    fn the_help_check_finds_an_undocumented_option() {
        let cmd = clap::Command::new("x")
            .arg(clap::Arg::new("documented").long("documented").help("yes"))
            .arg(clap::Arg::new("bare").long("bare"));
        assert_eq!(undocumented(&cmd, "x"), ["x --bare"]);
    }

    #[test]
    fn replay_help_names_every_policy_and_promises_nothing() {
        let mut cmd = Cli::command();
        let top = cmd.render_long_help().to_string();
        assert!(
            !top.contains("later"),
            "kvr --help promises later work: {top}"
        );
        let replay = cmd
            .find_subcommand_mut("replay")
            .expect("replay")
            .render_help()
            .to_string();
        for p in PolicyKind::ALL {
            assert!(
                replay.contains(p.name()),
                "kvr replay --help does not name policy {}",
                p.name()
            );
        }
    }
}
