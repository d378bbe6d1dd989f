//! Extra keys (REFERENCE.md §9, `kvr::hash`): equal tokens with different images,
//! cache salts or prompt embeddings are different blocks, on the event side (vLLM 0.33's
//! `extra_keys`, through `Partition::ingest`) and on the request side (`BlockExtras`),
//! which agree.

use kvr::config::PartitionConfig;
use kvr::hash::{mm_key, prompt_embeds_key};
use kvr::hash::{BlockExtras, HashSalt};
use kvr::ingress::{decode_batch, DecodeErrorKind, DecodedBatch, DecodedEvent, Medium};
use kvr::{Outcome, RankId, SelectRequest, WorkerInfo};
use kvr::{Partition, PartitionKey};
use kvr_emulator::{BatchEncoder, WireExtraKey as K};

const BS: u32 = 4;
/// Two blocks of image placeholder tokens: only the extra keys tell images apart.
const TOKENS: [u32; 8] = [9; 8];

fn partition() -> Partition {
    let p = Partition::new(PartitionKey::new("m", "g"), PartitionConfig::new(BS));
    for w in 1..=4 {
        p.upsert_worker(WorkerInfo::new(w, 1)).unwrap();
    }
    p
}

/// Worker `w` stores TOKENS with these extra keys (and LoRA name), as vLLM publishes.
fn store(p: &Partition, w: u64, keys: &[Option<&[K<'_>]>], lora: Option<&str>) {
    let mut e = BatchEncoder::new();
    e.with_extra_keys(keys)
        .stored(&[w * 10, w * 10 + 1], None, &TOKENS, BS, Medium::Gpu, lora);
    let out = p.ingest(w, 0, b"", 0, &e.finish(1.0, None));
    assert_eq!((out.batches_applied, out.decode_errors), (1, 0), "{out:?}");
}

fn depth(p: &Partition, extras: &BlockExtras, lora: Option<&str>, w: u64) -> u32 {
    let mut local = Vec::new();
    extras.local_hashes(&TOKENS, BS as usize, HashSalt::new(lora, None), &mut local);
    p.index().find_matches(&local).get(RankId::new(w, 0))
}

fn image(id: &str) -> BlockExtras {
    let mut e = BlockExtras::new();
    // The image fills tokens 2..7: block 0 at offset 2, block 1 at offset -2 (vLLM's).
    e.multimodal(id.as_bytes(), 2, 5).unwrap();
    e
}

#[test]
fn different_images_on_equal_tokens_are_different_blocks() {
    let p = partition();
    store(
        &p,
        1,
        &[Some(&[K::Mm("imgA", 2)]), Some(&[K::Mm("imgA", -2)])],
        None,
    );
    store(
        &p,
        2,
        &[Some(&[K::Mm("imgB", 2)]), Some(&[K::Mm("imgB", -2)])],
        None,
    );
    assert_eq!(depth(&p, &image("imgA"), None, 1), 2);
    assert_eq!(depth(&p, &image("imgA"), None, 2), 0);
    assert_eq!(depth(&p, &image("imgB"), None, 2), 2);
    // Image C: nobody holds it, though both hold the placeholder tokens.
    assert_eq!(depth(&p, &image("imgC"), None, 1), 0);
    assert_eq!(depth(&p, &image("imgC"), None, 2), 0);
    // The same image at another position in the block is another block.
    let mut moved = BlockExtras::new();
    moved.multimodal(b"imgA", 1, 6).unwrap();
    assert_eq!(depth(&p, &moved, None, 1), 0);
    // Without any extra key the request matches neither.
    assert_eq!(depth(&p, &BlockExtras::new(), None, 1), 0);

    // Selection hashes a tokens prompt with its extras: it picks the holder of image A.
    let a = image("imgA");
    let req = SelectRequest {
        extras: Some(&a),
        ..SelectRequest::tokens(&TOKENS)
    };
    match p.select(&req, &mut kvr::cost::SelectionRng::from_seed(1)) {
        Outcome::Selected(d) => {
            assert_eq!(d.rank, RankId::new(1, 0));
            assert_eq!(d.overlap.device_blocks, 2);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_cache_salt_matches_only_its_own_salt() {
    let p = partition();
    // vLLM puts the salt on block 0 only; the chain carries it to every later block.
    store(&p, 3, &[Some(&[K::Text("s1")]), None], None);
    let mut salted = BlockExtras::new();
    salted.set_cache_salt(Some("s1"));
    assert_eq!(depth(&p, &salted, None, 3), 2);
    let mut other = BlockExtras::new();
    other.set_cache_salt(Some("s2"));
    assert_eq!(depth(&p, &other, None, 3), 0);
    assert_eq!(depth(&p, &BlockExtras::new(), None, 3), 0);
}

#[test]
fn the_lora_name_in_extra_keys_is_the_lora_salt_not_a_key() {
    let p = partition();
    // vLLM 0.33 sends the LoRA name per block in extra_keys as well as in lora_name.
    store(
        &p,
        4,
        &[Some(&[K::Text("L")]), Some(&[K::Text("L")])],
        Some("L"),
    );
    assert_eq!(depth(&p, &BlockExtras::new(), Some("L"), 4), 2);
    assert_eq!(depth(&p, &BlockExtras::new(), None, 4), 0);
}

#[test]
fn prompt_embeddings_fold_as_raw_block_keys() {
    let p = partition();
    store(&p, 1, &[None, Some(&[K::Bytes(b"digest")])], None);
    let mut e = BlockExtras::new();
    e.block_key(1, prompt_embeds_key(b"digest")).unwrap();
    assert_eq!(depth(&p, &e, None, 1), 2);
    let mut wrong = BlockExtras::new();
    wrong.block_key(1, prompt_embeds_key(b"other")).unwrap();
    assert_eq!(
        depth(&p, &wrong, None, 1),
        1,
        "block 0 has no key, block 1 differs"
    );
}

fn decoded(keys: &[Option<&[K<'_>]>], lora: Option<&str>) -> Result<DecodedBatch, DecodeErrorKind> {
    let mut e = BatchEncoder::new();
    e.with_extra_keys(keys)
        .stored(&[1, 2], None, &TOKENS, BS, Medium::Gpu, lora);
    let mut b = DecodedBatch::default();
    decode_batch(&e.finish(1.0, None), &mut b).map_err(|e| e.kind)?;
    Ok(b)
}

fn extras_of(b: &DecodedBatch) -> Vec<Vec<u64>> {
    let DecodedEvent::Stored { extras, .. } = &b.events[0] else {
        panic!("not a store")
    };
    (0..2)
        .map(|i| b.block_extra_keys(extras, i).to_vec())
        .collect()
}

#[test]
fn the_decoder_reads_each_key_kind_and_checks_the_count() {
    let b = decoded(
        &[
            Some(&[K::Mm("i", 3), K::Text("salt")]),
            Some(&[K::Text("L")]),
        ],
        Some("L"),
    )
    .unwrap();
    assert_eq!(
        extras_of(&b),
        vec![
            vec![mm_key(b"i", 3), kvr::hash::cache_salt_key(b"salt")],
            vec![]
        ]
    );
    // Only the LoRA name: no extras at all (the plain, salted hash).
    let b = decoded(&[Some(&[K::Text("L")]), Some(&[K::Text("L")])], Some("L")).unwrap();
    let DecodedEvent::Stored { extras, .. } = &b.events[0] else {
        panic!()
    };
    assert!(extras.is_empty() && b.extra_keys.is_empty() && b.block_extras.is_empty());
    // One entry per block, or nil: anything else makes the store unusable (never a
    // silent misread that could credit a block its keys do not name); it is skipped.
    assert!(matches!(
        decoded(&[None], None).unwrap().events[0],
        DecodedEvent::Malformed { .. }
    ));
}

#[test]
fn sglang_cache_salt_field_salts_the_first_block_of_a_prompt() {
    // SGLang 0.5.23 publishes the request's salt as BlockStored.cache_salt.
    let p = partition();
    let mut e = BatchEncoder::new();
    e.with_cache_salt("s1")
        .stored(&[1, 2], None, &TOKENS, BS, Medium::Gpu, None);
    p.ingest(1, 0, b"", 0, &e.finish(1.0, None));
    let mut salted = BlockExtras::new();
    salted.set_cache_salt(Some("s1"));
    assert_eq!(depth(&p, &salted, None, 1), 2);
    assert_eq!(depth(&p, &BlockExtras::new(), None, 1), 0);
    // A continuation (it has a parent) is not the prompt's first block: its hashes chain
    // from the salted parent, so the salt is not folded again.
    let more: Vec<u32> = TOKENS.iter().chain(&[3, 3, 3, 3]).copied().collect();
    let mut e = BatchEncoder::new();
    e.with_cache_salt("s1")
        .stored(&[3], Some(2), &[3, 3, 3, 3], BS, Medium::Gpu, None);
    p.ingest(1, 0, b"", 1, &e.finish(1.0, None));
    let mut local = Vec::new();
    salted.local_hashes(&more, BS as usize, HashSalt::NONE, &mut local);
    assert_eq!(p.index().find_matches(&local).get(RankId::new(1, 0)), 3);
    // With extra_keys too, both fold: the salt joins block 0's own keys.
    let b = {
        let mut e = BatchEncoder::new();
        e.with_extra_keys(&[Some(&[K::Mm("i", 0)]), None])
            .with_cache_salt("s")
            .stored(&[1, 2], None, &TOKENS, BS, Medium::Gpu, None);
        let mut b = DecodedBatch::default();
        decode_batch(&e.finish(1.0, None), &mut b).unwrap();
        b
    };
    assert_eq!(
        extras_of(&b),
        vec![
            vec![mm_key(b"i", 0), kvr::hash::cache_salt_key(b"s")],
            vec![]
        ]
    );
}
