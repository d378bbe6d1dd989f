//! The prompt fields Dynamo flattens into every request that carries a prompt
//! (REFERENCE.md §7): `token_ids`, or `block_hashes` + `sequence_hashes` + `isl_tokens`,
//! with `lora_name`, `cache_salt` and `block_mm_infos`. Hashes travel as signed i64 (the
//! u64 bits, two's complement).

use kvr::hash::{local_block_hash_mm, HashSalt};
use serde::{Deserialize, Serialize};

use crate::error::ApiError;

/// One block's multimodal objects (`block_mm_infos[i]`).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct BlockMmInfo {
    #[serde(default)]
    pub mm_objects: Vec<MmObject>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct MmObject {
    pub mm_hash: u64,
}

/// The prompt of a request, as it arrives.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct PromptBody {
    #[serde(default)]
    pub token_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub block_hashes: Option<Vec<i64>>,
    #[serde(default)]
    pub sequence_hashes: Option<Vec<i64>>,
    #[serde(default)]
    pub isl_tokens: Option<u64>,
    #[serde(default)]
    pub block_mm_infos: Option<Vec<Option<BlockMmInfo>>>,
    #[serde(default)]
    pub lora_name: Option<String>,
    #[serde(default)]
    pub cache_salt: Option<String>,
}

/// A prompt checked and brought to the engine's terms: the local hashes of its complete
/// blocks (computed here from `token_ids`, multimodal objects mixed in, or given by the
/// caller) and its length in tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedPrompt {
    pub hashes: Vec<u64>,
    pub prompt_tokens: u64,
}

impl ResolvedPrompt {
    /// An engine request of this prompt (the caller sets the rest).
    pub fn request(&self) -> kvr::SelectRequest<'_> {
        kvr::SelectRequest::local_hashes(&self.hashes, self.prompt_tokens)
    }

    /// Approximate heap bytes (the pending-selection cache's budget).
    pub fn heap_bytes(&self) -> usize {
        self.hashes.capacity() * 8
    }
}

impl PromptBody {
    /// Whether the body names any prompt at all.
    pub fn is_present(&self) -> bool {
        self.token_ids.is_some() || self.block_hashes.is_some()
    }

    /// Checks the prompt against a partition of `block_size` tokens per block and brings
    /// it to local block hashes (salted with `salt`: LoRA, namespace, `cache_salt`).
    ///
    /// - `token_ids` wins over hashes when both come (Dynamo's order).
    /// - `block_hashes` needs `sequence_hashes` of the same length; a prompt of
    ///   `isl_tokens` has at most `isl_tokens / block_size` complete blocks, so a longer
    ///   hash list is refused rather than overcounting.
    /// - `block_mm_infos` mixes each block's multimodal hashes into its local hash, as the
    ///   engines do, so the prompt matches the blocks they publish.
    pub fn resolve(&self, block_size: u32, salt: HashSalt) -> Result<ResolvedPrompt, ApiError> {
        if let Some(tokens) = &self.token_ids {
            return match &self.block_mm_infos {
                Some(infos) if infos.iter().any(|i| i.is_some()) => {
                    let bs = block_size.max(1) as usize;
                    let blocks = tokens.len() / bs;
                    if infos.len() > blocks.max(1) + 1 {
                        return Err(ApiError::bad_request(format!(
                            "block_mm_infos has {} entries for {blocks} blocks",
                            infos.len()
                        )));
                    }
                    let mut mm = Vec::new();
                    let hashes = tokens
                        .chunks_exact(bs)
                        .enumerate()
                        .map(|(i, block)| {
                            mm.clear();
                            if let Some(Some(info)) = infos.get(i) {
                                mm.extend(info.mm_objects.iter().map(|o| o.mm_hash));
                            }
                            local_block_hash_mm(block, &mm, salt)
                        })
                        .collect();
                    Ok(ResolvedPrompt {
                        hashes,
                        prompt_tokens: tokens.len() as u64,
                    })
                }
                _ => {
                    let mut hashes = Vec::new();
                    kvr::hash::BlockHasher::new(block_size.max(1) as usize, salt)
                        .map_err(|e| ApiError::internal(e.to_string()))?
                        .local_hashes(tokens, &mut hashes);
                    Ok(ResolvedPrompt {
                        hashes,
                        prompt_tokens: tokens.len() as u64,
                    })
                }
            };
        }
        let Some(hashes) = &self.block_hashes else {
            return Err(ApiError::bad_request(
                "block_hashes is required without token_ids",
            ));
        };
        let Some(seq) = &self.sequence_hashes else {
            return Err(ApiError::bad_request(
                "sequence_hashes is required without token_ids",
            ));
        };
        if seq.len() != hashes.len() {
            return Err(ApiError::bad_request(format!(
                "block_hashes length {} must match sequence_hashes length {}",
                hashes.len(),
                seq.len()
            )));
        }
        let isl = self
            .isl_tokens
            .unwrap_or(hashes.len() as u64 * u64::from(block_size.max(1)));
        let max_blocks = isl / u64::from(block_size.max(1));
        if hashes.len() as u64 > max_blocks {
            return Err(ApiError::bad_request(format!(
                "{} block_hashes for isl_tokens {isl} at block_size {block_size} (at most {max_blocks})",
                hashes.len()
            )));
        }
        Ok(ResolvedPrompt {
            hashes: hashes
                .iter()
                .map(|&h| kvr_remote::hash_from_wire(h))
                .collect(),
            prompt_tokens: isl,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn salt() -> HashSalt {
        HashSalt::new(None, None)
    }

    #[test]
    fn signed_hashes_keep_their_bits() {
        let p = PromptBody {
            block_hashes: Some(vec![-1, 5]),
            sequence_hashes: Some(vec![-1, 7]),
            isl_tokens: Some(32),
            ..PromptBody::default()
        };
        let r = p.resolve(16, salt()).unwrap();
        assert_eq!(
            r,
            ResolvedPrompt {
                hashes: vec![u64::MAX, 5],
                prompt_tokens: 32
            }
        );
        assert_eq!(kvr_remote::hash_to_wire(u64::MAX), -1);
    }

    #[test]
    fn more_hashes_than_the_prompt_has_blocks_are_refused() {
        let p = PromptBody {
            block_hashes: Some(vec![1, 2, 3]),
            sequence_hashes: Some(vec![1, 2, 3]),
            isl_tokens: Some(47),
            ..PromptBody::default()
        };
        assert!(p.resolve(16, salt()).is_err());
        let p = PromptBody {
            block_hashes: Some(vec![1, 2]),
            sequence_hashes: Some(vec![1]),
            isl_tokens: Some(47),
            ..PromptBody::default()
        };
        assert!(p.resolve(16, salt()).is_err());
        let p = PromptBody {
            block_hashes: Some(vec![1, 2]),
            ..PromptBody::default()
        };
        assert!(p.resolve(16, salt()).is_err());
        assert!(PromptBody::default().resolve(16, salt()).is_err());
    }

    #[test]
    fn multimodal_blocks_hash_apart_from_plain_ones() {
        let tokens: Vec<u32> = (0..32).collect();
        let plain = PromptBody {
            token_ids: Some(tokens.clone()),
            ..PromptBody::default()
        };
        let mm = PromptBody {
            token_ids: Some(tokens.clone()),
            block_mm_infos: Some(vec![
                None,
                Some(BlockMmInfo {
                    mm_objects: vec![MmObject { mm_hash: 9 }],
                }),
            ]),
            ..PromptBody::default()
        };
        let ResolvedPrompt { hashes, .. } = mm.resolve(16, salt()).unwrap();
        let mut plain_hashes = Vec::new();
        kvr::hash::BlockHasher::new(16, salt())
            .unwrap()
            .local_hashes(&tokens, &mut plain_hashes);
        assert_eq!(hashes[0], plain_hashes[0]);
        assert_ne!(hashes[1], plain_hashes[1]);
        assert_eq!(
            plain.resolve(16, salt()).unwrap(),
            ResolvedPrompt {
                hashes: plain_hashes,
                prompt_tokens: 32
            }
        );
    }
}
