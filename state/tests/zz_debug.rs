#![allow(clippy::disallowed_types)]
use kvr::config::PartitionConfig;
use kvr::{Partition, PartitionKey};
#[test]
fn debug_dir() {
    let dir = std::env::var("DBG_DIR").unwrap();
    let p = std::sync::Arc::new(Partition::new(
        PartitionKey::new("m", "default"),
        PartitionConfig::new(16),
    ));
    let r = kvr_state::restore(std::path::Path::new(&dir), &p);
    eprintln!("{r:?}");
    let d = p.dump_index();
    eprintln!("skipped {}", d.skipped_blocks);
    for s in &d.stores {
        eprintln!(
            "{:?} {:?} parent={:?} n={}",
            s.rank,
            s.tier,
            s.parent,
            s.blocks.len()
        );
    }
    let h = kvr::hash::BlockHasher::new(16, kvr::hash::HashSalt::NONE).unwrap();
    for head in [500u32, 600, 700, 800] {
        let toks: Vec<u32> = (head..head + 32).collect();
        let mut l = Vec::new();
        h.local_hashes(&toks, &mut l);
        eprintln!(
            "head {head}: {:?}",
            p.index()
                .find_matches_tiered(&l)
                .iter()
                .map(|o| (o.rank, o.device))
                .collect::<Vec<_>>()
        );
    }
}
