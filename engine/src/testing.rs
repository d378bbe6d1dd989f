//! Test support, behind the `testing` feature (never part of a release build's API): the
//! approximate index's recorder for differential tests, and fault injection.

use crate::partition::Partition;
use crate::sync::StdArc;
use crate::RankId;

pub use crate::index::approx::{ApproxRecorder, RecordOutcome};

/// Makes the next `n` recordings of bookings into `partition`'s approximate index fail as
/// a full index would, so a test can see what a failure does (the booking stands).
pub fn fail_next_records(partition: &Partition, n: u64) {
    partition.indexing.fail_next_records(n);
}

/// With events off or a prediction index, `hook` is called with the rank each time a
/// booking's recording holds that rank's records (before it writes the index), so a test
/// can hold it there. `None` removes it.
pub fn set_record_hook(partition: &Partition, hook: Option<StdArc<dyn Fn(RankId) + Send + Sync>>) {
    if let Some(rec) = &partition.indexing.recorder {
        rec.set_record_hook(hook);
    }
}
