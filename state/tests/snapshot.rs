//! A snapshot written and read back restores an index that answers every prompt as the
//! original did; every damaged or foreign file is refused with its reason, never applied
//! in part.

use kvr::config::PartitionConfig;
use kvr::{KvEvent, Partition, PartitionKey, RankId, StoredBlock, Tier, TieredScores};
use kvr_state::format::{FileError, Identity};
use kvr_state::frame::{put_frame, FrameStop};
use kvr_state::snapshot::Snapshot;

const BS: u32 = 4;

fn partition(model: &str) -> Partition {
    Partition::new(
        PartitionKey::new(model, "default"),
        PartitionConfig::new(BS),
    )
}

fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BS).map(|i| seed * 1_000 + i / 3).collect()
}

/// Stores `tokens` on `rank`'s `tier` (engine hashes made from the local ones).
fn store(p: &Partition, rank: RankId, tier: Tier, tokens: &[u32]) {
    let (mut local, mut seq) = (Vec::new(), Vec::new());
    p.hasher().hash_tokens(tokens, &mut local, &mut seq);
    let engine = |h: u64| h ^ (u64::from(rank.dp_rank) << 60) ^ 0x5eed;
    let blocks: Vec<StoredBlock> = local
        .iter()
        .map(|&h| StoredBlock {
            external_hash: engine(h),
            local_hash: h,
        })
        .collect();
    let r = p.apply_events(
        rank,
        [KvEvent::Stored {
            tier,
            parent: None,
            blocks: &blocks,
        }],
    );
    assert_eq!(r.rejected, 0);
}

/// A few ranks with shared heads, branches and host copies.
fn filled() -> (Partition, Vec<Vec<u32>>) {
    let p = partition("m");
    let mut prompts = Vec::new();
    for w in 1..=3u64 {
        for dp in 0..2u32 {
            let rank = RankId::new(w, dp);
            for s in 0..20u32 {
                let mut t = prompt(s % 7, 6);
                t.extend(prompt(100 + s + w as u32, 1 + s % 5));
                store(&p, rank, Tier::Device, &t);
                if s % 3 == 0 {
                    store(&p, rank, Tier::Host, &t[..(BS * 4) as usize]);
                }
                prompts.push(t);
            }
        }
    }
    prompts.push(prompt(999, 8));
    (p, prompts)
}

/// Every prompt's tiered overlap on every rank.
fn answers(p: &Partition, prompts: &[Vec<u32>]) -> Vec<Vec<(RankId, u32, u32)>> {
    let (mut local, mut seq) = (Vec::new(), Vec::new());
    let mut scores = TieredScores::new();
    prompts
        .iter()
        .map(|t| {
            p.hasher().hash_tokens(t, &mut local, &mut seq);
            p.overlap(&local, &mut scores);
            let mut v: Vec<(RankId, u32, u32)> =
                scores.iter().map(|o| (o.rank, o.device, o.host)).collect();
            v.sort();
            v
        })
        .collect()
}

/// Where two streams were (the journal's writer hands these to a snapshot).
fn marks() -> Vec<kvr::StreamResume> {
    vec![
        kvr::StreamResume {
            worker_id: 1,
            stream: 0,
            last: Some((41, 0xfeed)),
            dp_ranks: vec![0],
        },
        kvr::StreamResume {
            worker_id: 2,
            stream: 3,
            last: None,
            dp_ranks: vec![0, 1, 3],
        },
    ]
}

#[test]
fn a_snapshot_restores_an_index_that_answers_as_the_original() {
    let (p, prompts) = filled();
    let snap = Snapshot::of(&p, marks());
    assert!(snap.blocks() > 100);
    let bytes = snap.to_bytes();
    let fresh = partition("m");
    let read = Snapshot::read(&bytes, &Identity::of(&fresh)).expect("reads back");
    assert_eq!(read, snap);
    let r = read.restore(&fresh);
    assert_eq!((r.blocks, r.refused), (snap.blocks(), 0));
    let want = answers(&p, &prompts);
    assert!(want.iter().any(|a| !a.is_empty()));
    assert_eq!(answers(&fresh, &prompts), want);
    // Negative control: a snapshot missing one run answers differently.
    let mut less = snap.clone();
    less.stores.remove(0);
    let other = partition("m");
    less.restore(&other);
    assert_ne!(answers(&other, &prompts), want);
}

#[test]
fn damaged_and_foreign_files_are_refused_with_their_reason() {
    let (p, _) = filled();
    let snap = Snapshot::of(&p, marks());
    let bytes = snap.to_bytes();
    let id = Identity::of(&partition("m"));
    assert_eq!(Snapshot::read(&[], &id), Err(FileError::Empty));
    assert_eq!(
        Snapshot::read(b"not a state file at all", &id),
        Err(FileError::NotKvr)
    );
    // Every cut: refused (a snapshot is whole or nothing), never a partial index.
    for cut in (1..bytes.len()).step_by(37) {
        let e = Snapshot::read(&bytes[..cut], &id).expect_err("a cut snapshot");
        assert!(
            matches!(
                e,
                FileError::Frame(FrameStop::Truncated)
                    | FileError::Header(FrameStop::Truncated)
                    | FileError::NotKvr
                    | FileError::Malformed("no end record")
            ),
            "cut at {cut}: {e:?}"
        );
    }
    // Flipped bits: refused.
    for i in (0..bytes.len() * 8).step_by(101) {
        let mut b = bytes.clone();
        b[i / 8] ^= 1 << (i % 8);
        assert!(Snapshot::read(&b, &id).is_err(), "bit {i}");
    }
    // Another partition's, another hashing's, another version's, another kind's.
    let other = Identity::of(&partition("other-model"));
    assert!(matches!(
        Snapshot::read(&bytes, &other),
        Err(FileError::Partition(k)) if k.model == "m"
    ));
    let wider = Partition::new(PartitionKey::new("m", "default"), PartitionConfig::new(8));
    assert_eq!(
        Snapshot::read(&bytes, &Identity::of(&wider)),
        Err(FileError::Hashing)
    );
    let rewrite_header = |patch: &dyn Fn(&mut Vec<u8>)| {
        let len = u32::from_le_bytes(bytes[0..4].try_into().unwrap()) as usize;
        let mut head = bytes[8..8 + len].to_vec();
        patch(&mut head);
        let mut out = Vec::new();
        put_frame(&mut out, &head);
        out.extend_from_slice(&bytes[8 + len..]);
        out
    };
    let v2 = rewrite_header(&|h| h[8..10].copy_from_slice(&2u16.to_le_bytes()));
    assert_eq!(Snapshot::read(&v2, &id), Err(FileError::Version(2)));
    let journal = rewrite_header(&|h| h[10] = 2);
    assert_eq!(Snapshot::read(&journal, &id), Err(FileError::Kind(2)));
}
