//! `kv_hint` (DESIGN.md §7, seed 000): a booked response names a peer rank that holds a
//! longer device prefix than the chosen one and can serve it — each condition tested by
//! breaking it alone.

// A host of the engine, not engine code: the sync-facade rule (engine/clippy.toml) is
// for engine/src.
#![allow(clippy::disallowed_types)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use kvr::config::{BusyThresholds, HintConfig, PartitionConfig};
use kvr::cost::SelectionRng;
use kvr::hash::{BlockHasher, HashSalt};
use kvr::{BackendRole, HostHooks, Partition, PartitionKey, WorkerInfo};
use kvr::{KvHint, Outcome, SelectRequest};
use kvr::{RankId, StoredBlock, Tier};

const B: u32 = 4;
const BLOCKS: usize = 16;

fn tokens() -> Vec<u32> {
    (0..BLOCKS as u32 * B).collect()
}

/// Worker 0 (decode, the pin) holds 2 blocks; the others as given: (role, endpoint,
/// blocks held).
fn setup(hints: Option<HintConfig>, peers: &[(BackendRole, Option<&str>, usize)]) -> Partition {
    setup_with(
        PartitionConfig {
            hints,
            ..PartitionConfig::new(B)
        },
        peers,
    )
}

/// [`setup`] on a partition of `config`.
fn setup_with(config: PartitionConfig, peers: &[(BackendRole, Option<&str>, usize)]) -> Partition {
    let p = Partition::new(PartitionKey::new("m", "g"), config);
    let mut w0 = WorkerInfo::new(0, 1);
    w0.role = BackendRole::Decode;
    p.upsert_worker(w0).unwrap();
    let h = BlockHasher::new(B as usize, HashSalt::default()).unwrap();
    let mut local = Vec::new();
    h.local_hashes(&tokens(), &mut local);
    let hold = |rank: RankId, n: usize| {
        let blocks: Vec<StoredBlock> = local[..n]
            .iter()
            .map(|&l| StoredBlock {
                external_hash: l.rotate_left(rank.worker_id as u32 + 1),
                local_hash: l,
            })
            .collect();
        p.index().store(rank, Tier::Device, None, &blocks).unwrap();
    };
    hold(RankId::new(0, 0), 2);
    for (i, (role, endpoint, n)) in peers.iter().enumerate() {
        let w = i as u64 + 1;
        let mut info = WorkerInfo::new(w, 1);
        info.role = *role;
        info.control_endpoints = vec![endpoint.map(String::from)];
        p.upsert_worker(info).unwrap();
        hold(RankId::new(w, 0), *n);
    }
    p
}

fn booked_hint(p: &Partition) -> Option<KvHint> {
    let t = tokens();
    let mut req = SelectRequest::tokens(&t);
    req.pinned_worker = Some(0);
    let mut rng = SelectionRng::from_seed(1);
    static IDS: AtomicU64 = AtomicU64::new(1);
    let id = IDS.fetch_add(1, Ordering::Relaxed);
    match p
        .select_and_reserve(&req, id, Instant::now(), &mut rng)
        .unwrap()
    {
        Outcome::Selected(d) => {
            assert_eq!(d.rank, RankId::new(0, 0));
            d.kv_hint
        }
        o => panic!("{o:?}"),
    }
}

const PREFILL: BackendRole = BackendRole::Prefill;
const EP: Option<&str> = Some("tcp://peer:7000");

/// The hint from worker `source` for `range`, naming the source's own block hashes (what
/// `setup` stored: each local hash rotated by the worker id + 1).
fn hint(source: u64, range: (u32, u32)) -> Option<KvHint> {
    let h = BlockHasher::new(B as usize, HashSalt::default()).unwrap();
    let mut local = Vec::new();
    h.local_hashes(&tokens(), &mut local);
    Some(KvHint {
        source: RankId::new(source, 0),
        control_endpoint: EP.unwrap().into(),
        block_range: range,
        block_hashes: local[range.0 as usize..range.1 as usize]
            .iter()
            .map(|l| l.rotate_left(source as u32 + 1))
            .collect(),
    })
}

#[test]
fn booked_response_carries_a_hint_from_a_longer_eligible_prefix() {
    let p = setup(Some(HintConfig::default()), &[(PREFILL, EP, 12)]);
    assert_eq!(booked_hint(&p), hint(1, (2, 12)));
}

#[test]
fn advisory_selection_never_emits_a_hint() {
    let p = setup(Some(HintConfig::default()), &[(PREFILL, EP, 12)]);
    let t = tokens();
    let mut req = SelectRequest::tokens(&t);
    req.pinned_worker = Some(0);
    let mut rng = SelectionRng::from_seed(1);
    match p.select(&req, &mut rng) {
        Outcome::Selected(d) => assert_eq!(d.kv_hint, None),
        o => panic!("{o:?}"),
    }
}

#[test]
fn no_hint_when_the_partition_consumes_none() {
    let p = setup(None, &[(PREFILL, EP, 12)]);
    assert_eq!(booked_hint(&p), None);
}

#[test]
fn no_hint_below_the_minimum_advantage() {
    // Advantage 3 < 4: none; 4: a hint.
    assert_eq!(
        booked_hint(&setup(Some(HintConfig::default()), &[(PREFILL, EP, 5)])),
        None
    );
    assert_eq!(
        booked_hint(&setup(Some(HintConfig::default()), &[(PREFILL, EP, 6)])),
        hint(1, (2, 6))
    );
}

#[test]
fn no_hint_from_a_role_not_allowed_to_serve_transfers() {
    let p = setup(
        Some(HintConfig::default()),
        &[(BackendRole::Decode, EP, 12)],
    );
    assert_eq!(booked_hint(&p), None);
    let only_prefill = HintConfig {
        source_roles: vec![PREFILL],
        ..HintConfig::default()
    };
    let p = setup(Some(only_prefill), &[(BackendRole::Aggregated, EP, 12)]);
    assert_eq!(booked_hint(&p), None);
    let p = setup(
        Some(HintConfig::default()),
        &[(BackendRole::Aggregated, EP, 12)],
    );
    assert_eq!(booked_hint(&p), hint(1, (2, 12)));
}

#[test]
fn no_hint_without_a_control_endpoint() {
    assert_eq!(
        booked_hint(&setup(Some(HintConfig::default()), &[(PREFILL, None, 12)])),
        None
    );
    assert_eq!(
        booked_hint(&setup(
            Some(HintConfig::default()),
            &[(PREFILL, Some(""), 12)]
        )),
        None
    );
}

#[test]
fn no_hint_from_a_source_the_host_marks_unavailable() {
    let p = setup(Some(HintConfig::default()), &[(PREFILL, EP, 12)]);
    p.set_hooks(HostHooks {
        availability: Some(Arc::new(|r: RankId| r.worker_id != 1)),
        ..HostHooks::default()
    });
    assert_eq!(booked_hint(&p), None);
}

#[test]
fn a_hint_names_only_blocks_whose_engine_names_the_source_still_has() {
    // The source evicts blocks 8.. on its device: the hint ends at 8 (and names 2..8).
    let p = setup(Some(HintConfig::default()), &[(PREFILL, EP, 12)]);
    let h = BlockHasher::new(B as usize, HashSalt::default()).unwrap();
    let mut local = Vec::new();
    h.local_hashes(&tokens(), &mut local);
    let names: Vec<u64> = local[8..12].iter().map(|l| l.rotate_left(2)).collect();
    p.index().remove(RankId::new(1, 0), Tier::Device, &names);
    assert_eq!(booked_hint(&p), hint(1, (2, 8)));
}

#[test]
fn no_hint_from_an_overloaded_source() {
    let p = setup(Some(HintConfig::default()), &[(PREFILL, EP, 12)]);
    p.set_hooks(HostHooks {
        overload: Some(Arc::new(|r: RankId| r.worker_id == 1)),
        ..HostHooks::default()
    });
    assert_eq!(booked_hint(&p), None);
}

#[test]
fn no_hint_from_a_source_over_a_busy_threshold() {
    let p = setup_with(
        PartitionConfig {
            hints: Some(HintConfig::default()),
            busy: BusyThresholds {
                prefill_tokens: Some(100),
                ..BusyThresholds::default()
            },
            ..PartitionConfig::new(B)
        },
        &[(PREFILL, EP, 12)],
    );
    assert_eq!(
        booked_hint(&p),
        hint(1, (2, 12)),
        "under the threshold: a hint"
    );
    // Book 500 prefill tokens on the source: over the threshold, no hint.
    p.reserve(RankId::new(1, 0), None, Some(500), 1 << 40, Instant::now())
        .unwrap();
    assert_eq!(booked_hint(&p), None);
}

#[test]
fn hint_is_limited_by_the_maximum_transfer_length() {
    let short = HintConfig {
        max_transfer_blocks: 4,
        ..HintConfig::default()
    };
    assert_eq!(
        booked_hint(&setup(Some(short), &[(PREFILL, EP, 12)])),
        hint(1, (2, 6))
    );
}

#[test]
fn the_longest_eligible_source_wins() {
    let p = setup(
        Some(HintConfig::default()),
        &[
            (PREFILL, EP, 10),
            (BackendRole::Decode, EP, 15),
            (PREFILL, EP, 13),
        ],
    );
    assert_eq!(booked_hint(&p), hint(3, (2, 13)));
}
