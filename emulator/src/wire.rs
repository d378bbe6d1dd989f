//! Writes KV-event batches the way vLLM 0.33 publishes them (REFERENCE.md §2: a msgpack
//! array `[ts, [events...], data_parallel_rank]`, events as tagged maps), the inverse of
//! kvr's decoder (`kvr::ingress::decode_batch`) for its common case.

use rmp::encode as enc;

use kvr::ingress::Medium;

/// One batch under construction.
#[derive(Debug, Default)]
pub struct BatchEncoder {
    events: u32,
    body: Vec<u8>,
    /// The next event's `group_idx` and spec kind ([`BatchEncoder::in_group`]).
    group: Option<(u32, Option<String>)>,
    /// The next store's `extra_keys`, encoded ([`BatchEncoder::with_extra_keys`]).
    extra_keys: Option<Vec<u8>>,
    /// The next store's `cache_salt` ([`BatchEncoder::with_cache_salt`]).
    cache_salt: Option<String>,
    /// The next store's `lookahead_token_ids`, encoded ([`BatchEncoder::with_lookahead`]).
    lookahead: Option<Vec<u8>>,
}

/// One extra key as vLLM 0.33 publishes it (untagged; folded into the block hash by `kvr::hash`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireExtraKey<'a> {
    /// A bare string: the LoRA name or the cache salt.
    Text(&'a str),
    /// `(mm identifier, offset)`.
    Mm(&'a str, i64),
    /// A prompt-embeddings digest.
    Bytes(&'a [u8]),
}

// Writing into a Vec<u8> cannot fail: the `expect`s below never fire.
const INFALLIBLE: &str = "msgpack into a Vec";

fn medium_name(m: Medium) -> &'static str {
    match m {
        Medium::Gpu => "GPU",
        Medium::Cpu => "CPU",
        Medium::Storage => "STORAGE",
        // Not a name kvr knows (Medium::from_name reads it back as Unknown).
        Medium::Unknown => "UNKNOWN_MEDIUM",
    }
}

impl BatchEncoder {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    fn key(&mut self, k: &str) {
        enc::write_str(&mut self.body, k).expect(INFALLIBLE);
    }

    fn hashes(&mut self, hashes: &[u64]) {
        enc::write_array_len(&mut self.body, hashes.len() as u32).expect(INFALLIBLE);
        for h in hashes {
            enc::write_uint(&mut self.body, *h).expect(INFALLIBLE);
        }
    }

    /// The next `stored` / `removed` carries `group_idx` (and, on a store, this
    /// `kv_cache_spec_kind`), as vLLM's hybrid KV-cache manager sends them.
    pub fn in_group(&mut self, group_idx: u32, kind: Option<&str>) -> &mut Self {
        self.group = Some((group_idx, kind.map(str::to_owned)));
        self
    }

    /// The next `stored` carries `extra_keys`: one entry per block (`None` = nil).
    pub fn with_extra_keys(&mut self, per_block: &[Option<&[WireExtraKey<'_>]>]) -> &mut Self {
        let mut buf = Vec::new();
        enc::write_array_len(&mut buf, per_block.len() as u32).expect(INFALLIBLE);
        for entry in per_block {
            let Some(keys) = entry else {
                enc::write_nil(&mut buf).expect(INFALLIBLE);
                continue;
            };
            enc::write_array_len(&mut buf, keys.len() as u32).expect(INFALLIBLE);
            for k in *keys {
                match *k {
                    WireExtraKey::Text(t) => enc::write_str(&mut buf, t).expect(INFALLIBLE),
                    WireExtraKey::Mm(id, offset) => {
                        enc::write_array_len(&mut buf, 2).expect(INFALLIBLE);
                        enc::write_str(&mut buf, id).expect(INFALLIBLE);
                        enc::write_sint(&mut buf, offset).expect(INFALLIBLE);
                    }
                    WireExtraKey::Bytes(b) => enc::write_bin(&mut buf, b).expect(INFALLIBLE),
                }
            }
        }
        self.extra_keys = Some(buf);
        self
    }

    /// The next `stored` carries SGLang 0.5's `cache_salt` field.
    pub fn with_cache_salt(&mut self, salt: &str) -> &mut Self {
        self.cache_salt = Some(salt.to_owned());
        self
    }

    /// The next `stored` carries vLLM's `lookahead_token_ids`: per block, the tokens after
    /// it that its engine hash covers (speculative decoding's lookahead).
    pub fn with_lookahead(&mut self, per_block: &[&[u32]]) -> &mut Self {
        let mut buf = Vec::new();
        enc::write_array_len(&mut buf, per_block.len() as u32).expect(INFALLIBLE);
        for tokens in per_block {
            enc::write_array_len(&mut buf, tokens.len() as u32).expect(INFALLIBLE);
            for t in *tokens {
                enc::write_uint(&mut buf, u64::from(*t)).expect(INFALLIBLE);
            }
        }
        self.lookahead = Some(buf);
        self
    }

    /// Takes the pending group: its fields (a removal carries no kind) and how many.
    fn take_group(&mut self, with_kind: bool) -> (Option<(u32, Option<String>)>, u32) {
        let group = self
            .group
            .take()
            .map(|(g, kind)| (g, kind.filter(|_| with_kind)));
        let n = group
            .as_ref()
            .map_or(0, |(_, kind)| 1 + u32::from(kind.is_some()));
        (group, n)
    }

    /// Writes a group taken by [`BatchEncoder::take_group`].
    fn group_fields(&mut self, group: Option<(u32, Option<String>)>) {
        if let Some((g, kind)) = group {
            self.key("group_idx");
            enc::write_uint(&mut self.body, u64::from(g)).expect(INFALLIBLE);
            if let Some(k) = kind {
                self.key("kv_cache_spec_kind");
                self.key(&k);
            }
        }
    }

    /// The fields every `BlockStored` starts with, in vLLM's order: the tag, the block
    /// hashes, the parent, the token ids and the block size.
    fn stored_head(
        &mut self,
        hashes: &[u64],
        parent: Option<u64>,
        tokens: &[u32],
        block_size: u32,
    ) {
        self.key("type");
        self.key("BlockStored");
        self.key("block_hashes");
        self.hashes(hashes);
        self.key("parent_block_hash");
        match parent {
            Some(p) => {
                enc::write_uint(&mut self.body, p).expect(INFALLIBLE);
            }
            None => enc::write_nil(&mut self.body).expect(INFALLIBLE),
        }
        self.key("token_ids");
        enc::write_array_len(&mut self.body, tokens.len() as u32).expect(INFALLIBLE);
        for t in tokens {
            enc::write_uint(&mut self.body, u64::from(*t)).expect(INFALLIBLE);
        }
        self.key("block_size");
        enc::write_uint(&mut self.body, u64::from(block_size)).expect(INFALLIBLE);
    }

    /// A `BlockStored` of `hashes` (the engine's block ids) extending `parent`, with the
    /// blocks' `tokens` (`hashes.len() * block_size` of them).
    pub fn stored(
        &mut self,
        hashes: &[u64],
        parent: Option<u64>,
        tokens: &[u32],
        block_size: u32,
        medium: Medium,
        lora_name: Option<&str>,
    ) -> &mut Self {
        let (group, group_fields) = self.take_group(true);
        let extra_keys = self.extra_keys.take();
        let cache_salt = self.cache_salt.take();
        let lookahead = self.lookahead.take();
        let fields = 6
            + u32::from(lora_name.is_some())
            + u32::from(extra_keys.is_some())
            + u32::from(cache_salt.is_some())
            + u32::from(lookahead.is_some())
            + group_fields;
        enc::write_map_len(&mut self.body, fields).expect(INFALLIBLE);
        self.stored_head(hashes, parent, tokens, block_size);
        self.key("medium");
        self.key(medium_name(medium));
        if let Some(l) = lora_name {
            self.key("lora_name");
            self.key(l);
        }
        if let Some(keys) = extra_keys {
            self.key("extra_keys");
            self.body.extend_from_slice(&keys);
        }
        if let Some(salt) = cache_salt {
            self.key("cache_salt");
            self.key(&salt);
        }
        if let Some(tokens) = lookahead {
            self.key("lookahead_token_ids");
            self.body.extend_from_slice(&tokens);
        }
        self.group_fields(group);
        self.events += 1;
        self
    }

    /// A `BlockStored` exactly as vLLM 0.33's scheduler publishes a full-attention model's
    /// device blocks: every required field written even when nil (`lora_id`, `lora_name`),
    /// `extra_keys` one entry per block (nil, or `[lora_name]`), `group_idx` 0 and
    /// `kv_cache_spec_kind` "full_attention", in vLLM's field order (msgspec writes a
    /// struct's fields in declaration order and omits only defaulted ones at their default),
    /// under msgspec's map header.
    pub fn vllm_stored(
        &mut self,
        hashes: &[u64],
        parent: Option<u64>,
        tokens: &[u32],
        block_size: u32,
        lora_name: Option<&str>,
    ) -> &mut Self {
        // msgspec sizes a struct's map header by the fields it could have (BlockStored's
        // 15 and the tag: map16, 0xde) before omitting defaults, so 11 entries go under a
        // map16 header, not the fixmap a minimal encoder picks.
        self.body.push(0xde);
        self.body.extend_from_slice(&11u16.to_be_bytes());
        self.stored_head(hashes, parent, tokens, block_size);
        self.key("lora_id");
        enc::write_nil(&mut self.body).expect(INFALLIBLE);
        self.key("medium");
        self.key(medium_name(Medium::Gpu));
        self.key("lora_name");
        match lora_name {
            Some(l) => self.key(l),
            None => enc::write_nil(&mut self.body).expect(INFALLIBLE),
        }
        self.key("extra_keys");
        enc::write_array_len(&mut self.body, hashes.len() as u32).expect(INFALLIBLE);
        for _ in hashes {
            match lora_name {
                Some(l) => {
                    enc::write_array_len(&mut self.body, 1).expect(INFALLIBLE);
                    self.key(l);
                }
                None => enc::write_nil(&mut self.body).expect(INFALLIBLE),
            }
        }
        self.key("group_idx");
        enc::write_uint(&mut self.body, 0).expect(INFALLIBLE);
        self.key("kv_cache_spec_kind");
        self.key("full_attention");
        self.events += 1;
        self
    }

    /// A `BlockRemoved` of device blocks exactly as vLLM 0.33 publishes it (`group_idx` 0).
    pub fn vllm_removed(&mut self, hashes: &[u64]) -> &mut Self {
        enc::write_map_len(&mut self.body, 4).expect(INFALLIBLE);
        self.key("type");
        self.key("BlockRemoved");
        self.key("block_hashes");
        self.hashes(hashes);
        self.key("medium");
        self.key(medium_name(Medium::Gpu));
        self.key("group_idx");
        enc::write_uint(&mut self.body, 0).expect(INFALLIBLE);
        self.events += 1;
        self
    }

    /// A `BlockRemoved` of `hashes` from `medium`.
    pub fn removed(&mut self, hashes: &[u64], medium: Medium) -> &mut Self {
        let (group, group_fields) = self.take_group(false);
        enc::write_map_len(&mut self.body, 3 + group_fields).expect(INFALLIBLE);
        self.key("type");
        self.key("BlockRemoved");
        self.key("block_hashes");
        self.hashes(hashes);
        self.key("medium");
        self.key(medium_name(medium));
        self.group_fields(group);
        self.events += 1;
        self
    }

    /// An `AllBlocksCleared`.
    pub fn cleared(&mut self) -> &mut Self {
        enc::write_map_len(&mut self.body, 1).expect(INFALLIBLE);
        self.key("type");
        self.key("AllBlocksCleared");
        self.events += 1;
        self
    }

    /// The payload: `[ts, [events...], data_parallel_rank]`; the encoder is emptied.
    pub fn finish(&mut self, ts: f64, data_parallel_rank: Option<u32>) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.body.len() + 16);
        enc::write_array_len(&mut out, 3).expect(INFALLIBLE);
        enc::write_f64(&mut out, ts).expect(INFALLIBLE);
        enc::write_array_len(&mut out, self.events).expect(INFALLIBLE);
        out.extend_from_slice(&self.body);
        match data_parallel_rank {
            Some(r) => {
                enc::write_uint(&mut out, u64::from(r)).expect(INFALLIBLE);
            }
            None => enc::write_nil(&mut out).expect(INFALLIBLE),
        }
        self.body.clear();
        self.events = 0;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvr::ingress::{decode_batch, DecodedBatch, DecodedEvent};

    #[test]
    fn vllms_exact_shapes_decode_as_a_full_attention_group() {
        let mut e = BatchEncoder::new();
        let tokens: Vec<u32> = (0..8).collect();
        e.vllm_stored(&[u64::MAX, 3], Some(1), &tokens, 4, None)
            .vllm_removed(&[3]);
        let payload = e.finish(1.0, Some(0));
        let mut b = DecodedBatch::default();
        decode_batch(&payload, &mut b).unwrap();
        match &b.events[0] {
            DecodedEvent::Stored {
                hashes,
                parent,
                medium,
                group,
                lora_name,
                ..
            } => {
                assert_eq!(&b.hashes[hashes.clone()], &[u64::MAX, 3]);
                assert_eq!((*parent, *medium, *group), (Some(1), Medium::Gpu, Some(0)));
                assert!(lora_name.is_none());
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            &b.events[1],
            DecodedEvent::Removed {
                medium: Medium::Gpu,
                group: Some(0),
                ..
            }
        ));
    }

    #[test]
    fn what_it_writes_decodes_to_the_same_events() {
        let mut e = BatchEncoder::new();
        let tokens: Vec<u32> = (0..8).collect();
        e.stored(&[1, 2], Some(9), &tokens, 4, Medium::Cpu, Some("adapter"))
            .removed(&[7], Medium::Gpu)
            .cleared();
        let payload = e.finish(2.5, Some(3));
        let mut b = DecodedBatch::default();
        decode_batch(&payload, &mut b).unwrap();
        assert_eq!(
            (b.ts, b.data_parallel_rank, b.events.len()),
            (2.5, Some(3), 3)
        );
        match &b.events[0] {
            DecodedEvent::Stored {
                hashes,
                parent,
                tokens: t,
                block_size,
                lora_name,
                medium,
                ..
            } => {
                assert_eq!(&b.hashes[hashes.clone()], &[1, 2]);
                assert_eq!(*parent, Some(9));
                assert_eq!(&b.tokens[t.clone()], &tokens[..]);
                assert_eq!((*block_size, *medium), (4, Medium::Cpu));
                assert_eq!(lora_name.clone().map(|r| &b.text[r]), Some("adapter"));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            &b.events[1],
            DecodedEvent::Removed {
                medium: Medium::Gpu,
                ..
            }
        ));
        assert!(matches!(&b.events[2], DecodedEvent::Cleared));
        assert!(e.finish(0.0, None).len() < 16, "finish empties the encoder");
    }
}
