//! Dynamo's active-sequence identity flags (`--router-tracking-hash`, `--router-tracking-key-file`,
//! `--router-tracking-key-id`, and their `DYN_ROUTER_TRACKING_*` variables): accepted and
//! checked as Dynamo 1.6.1 checks them, with its error messages, so a deployment's command
//! line and environment start kvr as they start Dynamo.
//!
//! What kvr does instead: Dynamo derives the identities of booked blocks with the chosen
//! hash (`keyed-xxh3-v1`: keyed by the provider's secret, so identities shared with other
//! routers cannot be matched to a guessed prompt). kvr shares no identities (it has no
//! replica sync), and always names booked blocks by the public sequence hashes, which is
//! what a `/select_and_reserve` answer returns. A keyed configuration is warned about at
//! start (tests/compat/known-differences.md).

use std::path::PathBuf;

use clap::Args;

/// The two hashes Dynamo 1.6.1 knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrackingHash {
    /// `public-xxh3-v1`: the default, the sequence hashes everybody computes alike.
    Public,
    /// `keyed-xxh3-v1`: keyed by a 32-byte provider secret.
    Keyed,
}

fn parse_tracking_hash(s: &str) -> Result<TrackingHash, String> {
    match s {
        "public-xxh3-v1" => Ok(TrackingHash::Public),
        "keyed-xxh3-v1" => Ok(TrackingHash::Keyed),
        _ => Err(format!(
            "router_tracking_hash must be public-xxh3-v1 or keyed-xxh3-v1, got {s:?}"
        )),
    }
}

/// Dynamo's tracking-identity flags.
#[derive(Clone, Debug, Args)]
pub struct TrackingArgs {
    /// Hash of active-sequence identities (Dynamo's flag): `public-xxh3-v1` or
    /// `keyed-xxh3-v1`. Checked as Dynamo does; kvr always uses the public hashes.
    #[arg(long, env = "DYN_ROUTER_TRACKING_HASH", default_value = "public-xxh3-v1", value_parser = parse_tracking_hash)]
    pub router_tracking_hash: TrackingHash,
    /// File holding the 32-byte tracking key (Dynamo's flag; needs `keyed-xxh3-v1`).
    #[arg(long, env = "DYN_ROUTER_TRACKING_KEY_FILE")]
    pub router_tracking_key_file: Option<PathBuf>,
    /// The tracking key's epoch id (Dynamo's flag; needs `keyed-xxh3-v1`).
    #[arg(long, env = "DYN_ROUTER_TRACKING_KEY_ID")]
    pub router_tracking_key_id: Option<String>,
}

impl TrackingArgs {
    /// Dynamo's start-up checks, in its order and words. `Ok(Some(warning))` for a valid
    /// keyed configuration, which kvr accepts but does not apply.
    pub fn check(&self) -> Result<Option<String>, String> {
        let key_options =
            self.router_tracking_key_file.is_some() || self.router_tracking_key_id.is_some();
        match self.router_tracking_hash {
            TrackingHash::Public if key_options => {
                Err("router tracking key options require router_tracking_hash=keyed-xxh3-v1".into())
            }
            TrackingHash::Public => Ok(None),
            TrackingHash::Keyed => {
                let Some(file) = &self.router_tracking_key_file else {
                    return Err("keyed-xxh3-v1 requires router_tracking_key_file".into());
                };
                if self
                    .router_tracking_key_id
                    .as_deref()
                    .is_none_or(str::is_empty)
                {
                    return Err("keyed-xxh3-v1 requires a nonempty router_tracking_key_id".into());
                }
                let key = std::fs::read(file)
                    .map_err(|_| "failed to read router tracking key file".to_string())?;
                if key.len() != 32 {
                    return Err(format!(
                        "router tracking key file must contain exactly 32 raw bytes; found {}",
                        key.len()
                    ));
                }
                Ok(Some(
                    "--router-tracking-hash keyed-xxh3-v1 is accepted but not applied: kvr \
                     shares no active-sequence identities (no replica sync) and names booked \
                     blocks by the public sequence hashes"
                        .into(),
                ))
            }
        }
    }
}
