//! kvr's index kept on disk so that a restarted router comes back warm: a snapshot of
//! each partition's index and a journal of the batches applied since.
//!
//! Everything on disk is a sequence of checksummed frames ([`frame`]) after a header that
//! names the file's kind, the format version and the partition it belongs to
//! ([`format`](mod@format)); a reader takes the longest valid prefix and says why it stopped, so a
//! torn tail is cut, and a foreign or corrupt file is refused with a reason, never half
//! applied. [`snapshot`] writes and reads a partition's index (its ranks' chains of
//! blocks per tier, as the engine's dump gives them) and where each stream was;
//! [`journal`] the records applied since. [`log`] is the writer a partition hands what
//! it applies to; [`restore`](mod@restore) reads a directory back into a partition at start.

pub mod config;
pub mod format;
pub mod frame;
pub mod io;
pub mod journal;
pub mod log;
mod priority;
pub mod restore;
pub mod snapshot;
mod snapshotter;
mod staged;

pub use config::{partition_dir, StateConfig};
pub use io::{Io, IoMode};
pub use log::{StateLog, StateStats};
pub use restore::{restore, Restored};
