//! Unit tests of the recorder's internals (the behaviour is tested end to end in
//! engine/tests/approx_index.rs).

use super::records::COMPACT_SLACK;
use super::*;
use crate::hash::sequence_hashes;

/// Runs `f` on `rank`'s records.
fn with_rank<R>(rec: &ApproxRecorder, rank: RankId, f: impl FnOnce(&RankState) -> R) -> R {
    let ranks = rec.ranks.load();
    let st = ranks.get(&rank).expect("rank has records").state.lock();
    f(&st)
}

fn rank(w: u64) -> RankId {
    RankId::new(w, 0)
}

#[test]
fn queue_stays_bounded_under_hot_refreshes() {
    let index = Index::new();
    let rec = ApproxRecorder::default();
    let t0 = Instant::now();
    let prompt: Vec<u64> = (1..=50).collect();
    for i in 0..10_000u64 {
        rec.record(&index, rank(1), &prompt, t0 + Duration::from_millis(i))
            .unwrap();
    }
    assert_eq!(rec.len(), 50);
    let queued = with_rank(&rec, rank(1), |st| st.queue_len());
    assert!(
        queued <= 2 * 50 + COMPACT_SLACK + prompt.len(),
        "queue grew to {queued}"
    );
}

#[test]
fn gen_and_queue_invariants_after_backwards_time() {
    let index = Index::new();
    let rec = ApproxRecorder::default();
    let t0 = Instant::now() + Duration::from_secs(1000);
    rec.record(&index, rank(1), &[1, 2, 3], t0).unwrap();
    rec.record(&index, rank(2), &[4, 5], t0 - Duration::from_secs(500))
        .unwrap();
    rec.record(&index, rank(1), &[1, 9], t0 - Duration::from_secs(900))
        .unwrap();
    // Sorted queues, and exactly one live entry per record.
    for r in [rank(1), rank(2)] {
        with_rank(&rec, r, |st| st.check_queue()).unwrap();
    }
    assert_eq!(rec.len(), 6);
}

/// An index that refuses every store (as at `MAX_RANKS`; the integration test
/// `index_refusal_is_returned_and_counted` fills a real one).
struct Refusing<'a>(&'a Index);

impl Sink for Refusing<'_> {
    fn store(&self, _: RankId, _: &[u64]) -> Result<usize, IndexError> {
        Err(IndexError::TooManyRanks)
    }
    fn remove(&self, rank: RankId, seqs: &[u64]) {
        Sink::remove(self.0, rank, seqs)
    }
}

#[test]
fn index_refusal_is_returned_counted_and_changes_nothing() {
    let index = Index::new();
    let rec = ApproxRecorder::default();
    let t0 = Instant::now();
    rec.record(&index, rank(1), &[1, 2], t0).unwrap();
    let refusing = Refusing(&index);
    let r = rec.record_into(&refusing, rank(2), &[1, 2], t0 + Duration::from_secs(1));
    assert_eq!(r, Err(IndexError::TooManyRanks));
    // A prompt with a new block is refused whole: its known prefix is not refreshed.
    let r = rec.record_into(&refusing, rank(1), &[1, 2, 3], t0 + Duration::from_secs(1));
    assert_eq!(r, Err(IndexError::TooManyRanks));
    let s = rec.stats();
    assert_eq!((s.record_errors, s.records, s.blocks_recorded), (2, 1, 2));
    assert_eq!(s.blocks_refreshed, 0);
    assert_eq!(rec.len(), 2);
    // The refused calls refreshed nothing: the first record's deadline still holds.
    assert_eq!(rec.expire(&index, t0 + ApproxConfig::default().ttl), 2);
    assert!(index.find_matches(&sequence_hashes(&[1, 2])).is_empty());
}

#[test]
fn nan_and_out_of_range_prune_to_are_clamped() {
    let mk = |p: f64| {
        ApproxRecorder::new(ApproxConfig {
            max_blocks: 100,
            prune_to: p,
            ..Default::default()
        })
        .target
    };
    assert_eq!(mk(f64::NAN), 80);
    assert_eq!(mk(2.0), 100);
    assert_eq!(mk(-1.0), 0);
    assert_eq!(mk(0.8), 80);
}

#[test]
fn huge_ttl_never_expires_and_does_not_panic() {
    let index = Index::new();
    let rec = ApproxRecorder::new(ApproxConfig {
        ttl: Duration::MAX,
        ..Default::default()
    });
    let t0 = Instant::now();
    rec.record(&index, rank(1), &[1, 2], t0).unwrap();
    assert_eq!(rec.expire(&index, t0 + Duration::from_secs(1 << 40)), 0);
    assert_eq!(rec.len(), 2);
    // An index fed by bookings is keyed by sequence hashes.
    assert_eq!(
        index.find_matches(&sequence_hashes(&[1, 2])).get(rank(1)),
        2
    );
}
