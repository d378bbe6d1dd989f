//! `kvr hash`: tokens → Dynamo-compatible local and sequence block hashes as one JSON line.

use std::io::{self, Read};

use clap::Args;
use kvr::hash::{BlockHasher, HashSalt};

use crate::tokens;

#[derive(Debug, Args)]
#[command(allow_negative_numbers = true)]
pub(crate) struct HashArgs {
    /// Tokens per block (at least 1); a trailing partial block is not hashed.
    #[arg(long, value_parser = parse_block_size)]
    block_size: usize,

    /// LoRA adapter name salting the hashes (empty = none).
    #[arg(long)]
    lora_name: Option<String>,

    /// Cache namespace salting the hashes (empty = none).
    #[arg(long)]
    cache_namespace: Option<String>,

    /// Tokens as u32 decimals. If none are given, they are read from stdin, separated
    /// by any mix of spaces, tabs, newlines and commas.
    #[arg(value_name = "TOKEN")]
    tokens: Vec<String>,
}

fn parse_block_size(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("block size must be at least 1 token".to_owned()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("not a positive integer: {e}")),
    }
}

pub(crate) fn run(args: &HashArgs) -> Result<(), String> {
    let salt = HashSalt::new(args.lora_name.as_deref(), args.cache_namespace.as_deref());
    let hasher = BlockHasher::new(args.block_size, salt).map_err(|e| format!("hash: {e}"))?;

    let tokens = if args.tokens.is_empty() {
        let mut text = String::new();
        io::stdin()
            .read_to_string(&mut text)
            .map_err(|e| format!("hash: reading tokens from stdin: {e}"))?;
        tokens::parse_token_text(&text)
    } else {
        tokens::parse_tokens(&args.tokens)
    }
    .map_err(|e| format!("hash: {e}"))?;

    let (mut local, mut sequence) = (Vec::new(), Vec::new());
    hasher.hash_tokens(&tokens, &mut local, &mut sequence);

    let line = format!(
        "{{\"local\":{},\"sequence\":{}}}",
        to_json(&local)?,
        to_json(&sequence)?
    );
    crate::output::emit(&format!("{line}\n")).map_err(|e| format!("hash: {e}"))
}

fn to_json(hashes: &[u64]) -> Result<String, String> {
    serde_json::to_string(hashes).map_err(|e| format!("hash: encoding JSON: {e}"))
}
