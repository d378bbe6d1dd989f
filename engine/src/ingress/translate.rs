//! The door's second step: one decoded engine event into a [`KvEvent`] with kvr's own
//! local hashes, or a counted reason to skip it.
//!
//! Decisions (where the engines' formats leave them open): a block's `extra_keys`
//! (multimodal inputs, cache salt, prompt-embeddings digests) are folded into its local
//! hash by the rule requests hash with (`crate::hash::BlockExtras`), so equal tokens with
//! different images or salts are different blocks; a store whose `block_size` differs
//! from the sink's is refused and counted; an event of a KV-cache group routing does not
//! follow is skipped (`groups`); an unknown `medium` is skipped; a tokenless store
//! applies to the blocks the rank already holds (`KvEvent::StoredKnown`: their tokens are
//! known), its other blocks are left out and counted; a malformed store is skipped and
//! counted; a store's lookahead tokens (`crate::hash::lookahead`) are folded into its
//! blocks' local hashes, if the sink hashes prompts with that length (else the store is
//! skipped and counted); a recurrent (Mamba) group's stores and removals are recurrent
//! state ([`translate_state`]), applied after the batch's other events. No skip ever
//! touches the batch's other events.

use smallvec::SmallVec;

use crate::hash::{local_block_hash_mm, lookahead_key, HashSalt};
use crate::ids::Tier;
use crate::index::{KvEvent, StoredBlock};

use super::decode::{DecodedBatch, DecodedEvent, Medium};
use super::groups::{GroupRouting, APPLY};

/// What the sink a batch goes to asks of every event.
#[derive(Clone, Copy)]
pub(crate) struct SinkShape<'a> {
    pub(crate) block_size: u32,
    pub(crate) namespace: Option<&'a str>,
    /// `EventSink::accepts_lookahead`.
    pub(crate) accepts_lookahead: &'a dyn Fn(u32) -> bool,
}

/// Events skipped, by why, and routing-group switches, in one batch.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Skips {
    pub(crate) block_size: u64,
    pub(crate) group: u64,
    pub(crate) medium: u64,
    pub(crate) malformed: u64,
    pub(crate) group_switches: u64,
}

/// One decoded event, translated.
pub(crate) struct Translated<'a> {
    /// The routing group changed: the stream's ranks are cleared before `event` applies.
    pub(crate) clear_first: bool,
    /// The event to apply, or `None` (skipped and counted, or `state`).
    pub(crate) event: Option<KvEvent<'a>>,
    /// A recurrent group's event: applied by [`translate_state`] once the batch's other
    /// events are in (its hashes name attention blocks, which the same batch may store
    /// after it).
    pub(crate) state: bool,
}

/// A recurrent group's event (`Translated::state`) as recurrent state.
pub(crate) fn translate_state<'a>(
    ev: &'a DecodedEvent,
    b: &'a DecodedBatch,
) -> Option<KvEvent<'a>> {
    match ev {
        DecodedEvent::Tokenless { hashes, medium, .. } => Some(KvEvent::StatesStored {
            tier: tier(*medium)?,
            external_hashes: &b.hashes[hashes.clone()],
        }),
        DecodedEvent::Removed { hashes, medium, .. } => Some(KvEvent::StatesRemoved {
            tier: tier(*medium)?,
            external_hashes: &b.hashes[hashes.clone()],
        }),
        _ => None,
    }
}

/// Translates `ev` of batch `b`: its tier, its group's verdict and, for a store, its
/// blocks (external hash and local hash) into `blocks`, which the event then borrows.
pub(crate) fn translate<'a>(
    ev: &'a DecodedEvent,
    b: &'a DecodedBatch,
    shape: SinkShape<'_>,
    groups: &mut GroupRouting,
    blocks: &'a mut Vec<StoredBlock>,
    skips: &mut Skips,
) -> Translated<'a> {
    let skip = Translated {
        clear_first: false,
        event: None,
        state: false,
    };
    let medium = match ev {
        DecodedEvent::Stored { medium, .. }
        | DecodedEvent::Tokenless { medium, .. }
        | DecodedEvent::Removed { medium, .. } => *medium,
        DecodedEvent::Cleared => Medium::Gpu,
        DecodedEvent::Malformed { .. } => {
            skips.malformed += 1;
            return skip;
        }
    };
    let Some(tier) = tier(medium) else {
        skips.medium += 1;
        return skip;
    };
    let verdict = match ev {
        DecodedEvent::Stored { block_size, .. } if *block_size != shape.block_size => {
            skips.block_size += 1;
            return skip;
        }
        DecodedEvent::Stored { group, spec, .. } | DecodedEvent::Tokenless { group, spec, .. } => {
            groups.on_store(*group, *spec)
        }
        DecodedEvent::Removed { group, .. } => groups.on_remove(*group),
        DecodedEvent::Cleared | DecodedEvent::Malformed { .. } => APPLY,
    };
    skips.group_switches += u64::from(verdict.clear_first);
    if !verdict.apply || verdict.state {
        skips.group += u64::from(!verdict.apply);
        return Translated {
            clear_first: verdict.clear_first,
            event: None,
            state: verdict.state,
        };
    }
    let event = match ev {
        DecodedEvent::Stored {
            hashes,
            parent,
            tokens,
            lora_name,
            extras,
            lookahead,
            ..
        } => {
            // Every block's lookahead has one length (vLLM's `num_hash_lookahead_tokens`),
            // one the sink hashes prompts with; anything else is skipped, counted.
            let la = |i| b.block_lookahead_tokens(lookahead, i);
            let la_len = la(0).len();
            if (1..hashes.len()).any(|i| la(i).len() != la_len)
                || !(shape.accepts_lookahead)(u32::try_from(la_len).unwrap_or(u32::MAX))
            {
                skips.malformed += 1;
                return Translated {
                    clear_first: verdict.clear_first,
                    event: None,
                    state: false,
                };
            }
            let lora = lora_name.clone().map(|r| &b.text[r]);
            let salt = HashSalt::new(lora, shape.namespace);
            blocks.clear();
            let toks = &b.tokens[tokens.clone()];
            let mut keys: SmallVec<[u64; 8]> = SmallVec::new();
            for (i, (h, chunk)) in b.hashes[hashes.clone()]
                .iter()
                .zip(toks.chunks_exact(shape.block_size as usize))
                .enumerate()
            {
                // Without extra keys or lookahead this is the plain token hash.
                let extra = b.block_extra_keys(extras, i);
                let local_hash = if la_len == 0 {
                    local_block_hash_mm(chunk, extra, salt)
                } else {
                    keys.clear();
                    keys.extend_from_slice(extra);
                    keys.push(lookahead_key(la(i)));
                    local_block_hash_mm(chunk, &keys, salt)
                };
                blocks.push(StoredBlock {
                    external_hash: *h,
                    local_hash,
                });
            }
            KvEvent::Stored {
                tier,
                parent: *parent,
                blocks,
            }
        }
        DecodedEvent::Tokenless { hashes, .. } => KvEvent::StoredKnown {
            tier,
            external_hashes: &b.hashes[hashes.clone()],
        },
        DecodedEvent::Removed { hashes, .. } => KvEvent::Removed {
            tier,
            external_hashes: &b.hashes[hashes.clone()],
        },
        DecodedEvent::Cleared => KvEvent::Cleared,
        // Returned above.
        DecodedEvent::Malformed { .. } => return skip,
    };
    Translated {
        clear_first: verdict.clear_first,
        event: Some(event),
        state: false,
    }
}

/// The tier of a medium (`None`: unknown, the event is skipped).
fn tier(m: Medium) -> Option<Tier> {
    match m {
        Medium::Gpu => Some(Tier::Device),
        Medium::Cpu => Some(Tier::Host),
        Medium::Storage => Some(Tier::Disk),
        Medium::Unknown => None,
    }
}
