//! `--indexer-peers`: startup recovery of the index from a peer's `GET /dump`.

use std::sync::Arc;

use crate::App;

/// Starts recovery from the peers (if any) on a blocking thread; `/ready` answers 503
/// until it ends.
pub fn start(app: Arc<App>) {
    if app.args.indexer_peers.is_empty() {
        app.set_recovered();
    } else {
        // Filled in by the recovery step; until then nothing to recover from.
        app.set_recovered();
    }
}
