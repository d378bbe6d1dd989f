//! Loom models of the load view (`crate::load`): a selection reads one snapshot
//! throughout while a host publishes; two publishers' multi-entry batches are applied
//! whole, one after the other, and a reader never sees part of one.

use super::{model, must_fail};
use crate::ids::RankId;
use crate::load::{LoadView, RankLoad};
use crate::sync::faults::Faults;
use crate::sync::Arc;

fn used(n: u64) -> RankLoad {
    RankLoad {
        kv_blocks_used: n,
        kv_blocks_total: 100,
        ..RankLoad::default()
    }
}

/// Two single-rank workers with 100 KV blocks each and a busy threshold at half of them;
/// one is reported at 90 blocks (busy), the other at 10. A host publishes one batch that
/// swaps the two while a selection runs: every snapshot has exactly one busy rank, so a
/// selection that reads one snapshot throughout always finds a free rank. Reading the
/// load per candidate can see the old busy rank and the new busy rank together.
fn load_swap_never_tears_a_selection() {
    use crate::config::{BusyThresholds, PartitionConfig};
    use crate::cost::SelectionRng;
    use crate::ids::PartitionKey;
    use crate::partition::Partition;
    use crate::select::{Outcome, SelectRequest};
    use crate::workers::WorkerInfo;
    let mut config = PartitionConfig::new(4);
    config.busy = BusyThresholds {
        decode_blocks_fraction: Some(0.5),
        ..BusyThresholds::default()
    };
    let p = Arc::new(Partition::new(PartitionKey::new("m", "g"), config));
    for w in [1, 2] {
        let mut info = WorkerInfo::new(w, 1);
        info.total_kv_blocks = 100;
        p.upsert_worker(info).unwrap();
    }
    let (a, b) = (RankId::new(1, 0), RankId::new(2, 0));
    p.load_view().publish(&[(a, used(90)), (b, used(10))]);
    let host = p.clone();
    let publisher = loom::thread::spawn(move || {
        host.load_view().publish(&[(a, used(10)), (b, used(90))]);
    });
    let tokens = [1, 2, 3, 4];
    let outcome = p.select(
        &SelectRequest::tokens(&tokens),
        &mut SelectionRng::from_seed(7),
    );
    assert!(
        matches!(outcome, Outcome::Selected(_)),
        "torn load view: a selection saw both ranks busy ({outcome:?})"
    );
    publisher.join().unwrap();
}

#[test]
fn load_snapshot_swap_vs_selection() {
    model(load_swap_never_tears_a_selection);
}

#[test]
fn load_snapshot_negative_reload_per_rank() {
    must_fail(
        "loom_models::load::load_snapshot_negative_reload_per_rank",
        Faults {
            reload_load_per_rank: true,
            ..Faults::default()
        },
        "torn load view",
        load_swap_never_tears_a_selection,
    );
}

/// Ranks a, b, c all at 1; publisher P1 sends the batch {a: 2, b: 2}, publisher P2 the
/// batch {b: 3, c: 3}, while a reader loads the view. Each snapshot holds every batch
/// published before it whole and none of the others: the initial state, P1's, P2's, or
/// both in either order (b then says which came last). Afterwards both batches are in.
fn two_publishers_batches() {
    let (a, b, c) = (RankId::new(1, 0), RankId::new(2, 0), RankId::new(3, 0));
    let v = Arc::new(LoadView::new());
    v.publish(&[(a, used(1)), (b, used(1)), (c, used(1))]);
    let state = |v: &LoadView| {
        let s = v.snapshot();
        let get = |r| s.get(r).map_or(0, |l| l.kv_blocks_used);
        (s.version(), [get(a), get(b), get(c)])
    };
    let v1 = v.clone();
    let p1 = loom::thread::spawn(move || v1.publish(&[(a, used(2)), (b, used(2))]));
    let v2 = v.clone();
    let p2 = loom::thread::spawn(move || v2.publish(&[(b, used(3)), (c, used(3))]));
    let seen = state(&v);
    assert!(
        matches!(
            seen,
            (1, [1, 1, 1]) | (2, [2, 2, 1]) | (2, [1, 3, 3]) | (3, [2, 3, 3]) | (3, [2, 2, 3])
        ),
        "torn batch: a reader saw {seen:?}"
    );
    let (n1, n2) = (p1.join().unwrap(), p2.join().unwrap());
    let end = state(&v);
    assert!(
        matches!(end, (3, [2, 3, 3]) | (3, [2, 2, 3])) && n1 != n2,
        "lost batch: the view ended as {end:?} (publishers got versions {n1} and {n2})"
    );
}

#[test]
fn load_snapshot_batches() {
    model(two_publishers_batches);
}

#[test]
fn load_snapshot_batches_negative_per_entry() {
    must_fail(
        "loom_models::load::load_snapshot_batches_negative_per_entry",
        Faults {
            load_publish_per_entry: true,
            ..Faults::default()
        },
        "torn batch",
        two_publishers_batches,
    );
}

#[test]
fn load_snapshot_batches_negative_unlocked() {
    must_fail(
        "loom_models::load::load_snapshot_batches_negative_unlocked",
        Faults {
            load_publish_unlocked: true,
            ..Faults::default()
        },
        "lost batch",
        two_publishers_batches,
    );
}
