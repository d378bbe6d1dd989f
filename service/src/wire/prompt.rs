//! The prompt fields Dynamo flattens into every request that carries a prompt
//! (REFERENCE.md §7): `token_ids`, or `block_hashes` + `sequence_hashes` + `isl_tokens`,
//! with `lora_name`, `cache_salt` and `block_mm_infos`. Hashes travel as signed i64 (the
//! u64 bits, two's complement).

use kvr::hash::{BlockExtras, HashSalt};
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
    /// kvr's extension: the prompt's multimodal inputs as vLLM places them, so that their
    /// blocks match the engine's `extra_keys`.
    #[serde(default)]
    pub mm_inputs: Option<Vec<MmInput>>,
}

/// One multimodal input of a prompt (kvr's `mm_inputs`): vLLM's `mm_feature.identifier`
/// and `mm_position` (`offset`, `length` in tokens).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct MmInput {
    pub identifier: String,
    pub offset: u64,
    pub length: u64,
}

/// A prompt checked and brought to the engine's terms: the local hashes of its complete
/// blocks (computed here from `token_ids`, multimodal objects mixed in, or given by the
/// caller) and its length in tokens; a tokens prompt keeps its tokens and extra keys, so
/// that ranks whose engines hash with lookahead can be matched (`kvr::hash::lookahead`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResolvedPrompt {
    pub hashes: Vec<u64>,
    pub prompt_tokens: u64,
    /// The prompt's tokens (empty when it came as hashes).
    pub tokens: Vec<u32>,
    /// Their extra keys.
    pub extras: BlockExtras,
}

impl ResolvedPrompt {
    /// An engine request of this prompt (the caller sets the rest).
    pub fn request(&self) -> kvr::SelectRequest<'_> {
        let mut req = kvr::SelectRequest::local_hashes(&self.hashes, self.prompt_tokens);
        if !self.tokens.is_empty() {
            req.source_tokens = Some(&self.tokens);
            req.extras = Some(&self.extras).filter(|e| !e.is_empty());
        }
        req
    }

    /// Approximate heap bytes (the pending-selection cache's budget).
    pub fn heap_bytes(&self) -> usize {
        self.hashes.capacity() * 8 + self.tokens.capacity() * 4
    }
}

impl PromptBody {
    /// The extra keys of a tokens prompt: `cache_salt`, `block_mm_infos`, `mm_inputs`.
    fn extras(&self, block_size: u32) -> Result<BlockExtras, ApiError> {
        let mut extras = BlockExtras::new();
        extras.set_cache_salt(self.cache_salt.as_deref());
        let too_many = |e: kvr::hash::TooManyExtraKeys| ApiError::bad_request(e.to_string());
        if let Some(infos) = &self.block_mm_infos {
            let blocks = self.token_ids.as_ref().map_or(0, Vec::len) / block_size.max(1) as usize;
            if infos.len() > blocks.max(1) + 1 {
                return Err(ApiError::bad_request(format!(
                    "block_mm_infos has {} entries for {blocks} blocks",
                    infos.len()
                )));
            }
            for (i, info) in infos.iter().enumerate() {
                for o in info.iter().flat_map(|info| &info.mm_objects) {
                    extras.block_key(i, o.mm_hash).map_err(too_many)?;
                }
            }
        }
        for m in self.mm_inputs.iter().flatten() {
            extras
                .multimodal(m.identifier.as_bytes(), m.offset, m.length)
                .map_err(too_many)?;
        }
        Ok(extras)
    }

    /// Whether the body names any prompt at all.
    pub fn is_present(&self) -> bool {
        self.token_ids.is_some() || self.block_hashes.is_some()
    }

    /// Checks the prompt against a partition of `block_size` tokens per block and brings
    /// it to local block hashes (salted with `salt`: LoRA and namespace).
    ///
    /// - `token_ids` wins over hashes when both come (Dynamo's order).
    /// - `block_hashes` needs `sequence_hashes` of the same length; a prompt of
    ///   `isl_tokens` has at most `isl_tokens / block_size` complete blocks, so a longer
    ///   hash list is refused rather than overcounting.
    /// - With `token_ids`, the extra keys (`kvr::hash`) are folded into the blocks'
    ///   local hashes as the engines' events are: `block_mm_infos` (Dynamo's per-block
    ///   `mm_hash`es, raw key values), `mm_inputs` (kvr's: vLLM's `(identifier, offset,
    ///   length)` spans) and `cache_salt` (block 0), so the prompt matches the blocks
    ///   engines publish with the same images and salt — and no others.
    pub fn resolve(&self, block_size: u32, salt: HashSalt) -> Result<ResolvedPrompt, ApiError> {
        let extras = self.token_extras(block_size)?;
        self.resolve_tokens(block_size, salt, self.token_ids.clone(), extras)
    }

    /// [`PromptBody::resolve`], moving the tokens out of the body instead of copying them
    /// (the request paths: a 32k-token prompt is 128 KiB).
    pub fn resolve_taking(
        &mut self,
        block_size: u32,
        salt: HashSalt,
    ) -> Result<ResolvedPrompt, ApiError> {
        let extras = self.token_extras(block_size)?;
        let tokens = self.token_ids.take();
        self.resolve_tokens(block_size, salt, tokens, extras)
    }

    /// The extra keys, read only for a tokens prompt (a hashes prompt has its own).
    fn token_extras(&self, block_size: u32) -> Result<BlockExtras, ApiError> {
        match self.token_ids {
            Some(_) => self.extras(block_size),
            None => Ok(BlockExtras::new()),
        }
    }

    fn resolve_tokens(
        &self,
        block_size: u32,
        salt: HashSalt,
        tokens: Option<Vec<u32>>,
        extras: BlockExtras,
    ) -> Result<ResolvedPrompt, ApiError> {
        if let Some(tokens) = tokens {
            let mut hashes = Vec::new();
            extras.local_hashes(&tokens, block_size.max(1) as usize, salt, &mut hashes);
            return Ok(ResolvedPrompt {
                hashes,
                prompt_tokens: tokens.len() as u64,
                tokens,
                extras,
            });
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
            ..ResolvedPrompt::default()
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
                prompt_tokens: 32,
                ..ResolvedPrompt::default()
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
                prompt_tokens: 32,
                tokens,
                extras: BlockExtras::new(),
            }
        );
    }

    #[test]
    fn cache_salt_and_mm_inputs_fold_as_the_engine_folds_events() {
        let tokens: Vec<u32> = vec![5; 32];
        let body = PromptBody {
            token_ids: Some(tokens.clone()),
            cache_salt: Some("s".into()),
            mm_inputs: Some(vec![MmInput {
                identifier: "img".into(),
                offset: 10,
                length: 12,
            }]),
            ..PromptBody::default()
        };
        let got = body.resolve(16, salt()).unwrap().hashes;
        let mut extras = BlockExtras::new();
        extras.set_cache_salt(Some("s"));
        extras.multimodal(b"img", 10, 12).unwrap();
        let mut want = Vec::new();
        extras.local_hashes(&tokens, 16, salt(), &mut want);
        assert_eq!(got, want);
        // The salt is block 0's key only; the image spans both blocks.
        let mut plain = Vec::new();
        kvr::hash::BlockHasher::new(16, salt())
            .unwrap()
            .local_hashes(&tokens, &mut plain);
        assert!(got.iter().zip(&plain).all(|(g, p)| g != p));
        let unsalted = PromptBody {
            cache_salt: None,
            ..body.clone()
        };
        let u = unsalted.resolve(16, salt()).unwrap().hashes;
        assert_ne!(u[0], got[0]);
        assert_eq!(u[1], got[1]);
    }
}
