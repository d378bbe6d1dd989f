#!/usr/bin/env python3
"""Regenerates fuzz/seeds/decode/*.msgpack: real-shaped vLLM / SGLang KVEventBatch payloads
(REFERENCE.md §2), encoded by msgspec exactly as the engines do (msgspec structs with
`tag=True`; tagged maps for current vLLM, `array_like=True` for older vLLM and SGLang).

Usage: python3 fuzz/gen_seeds.py   (needs `msgspec`; the outputs are committed)
"""
import hashlib
import os
from typing import Any, Optional, Union

import msgspec

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seeds", "decode")


STORED = [  # (name, type, required in current vLLM's tagged form)
    ("block_hashes", list[Union[int, bytes]], True),
    ("parent_block_hash", Optional[Union[int, bytes]], True),
    ("token_ids", list[int], True),
    ("block_size", int, True),
    ("lora_id", Optional[int], True),
    ("medium", Optional[str], True),
    ("lora_name", Optional[str], True),
    ("extra_keys", Optional[list[Optional[list[Any]]]], False),
    ("group_idx", Optional[int], False),
    ("kv_cache_spec_kind", Optional[str], False),
    ("kv_cache_spec_sliding_window", Optional[int], False),
    ("locality", Optional[str], False),
    ("ownership", Optional[str], False),
    ("session_id", Optional[str], False),
    ("lookahead_token_ids", Optional[list[list[int]]], False),
]
REMOVED = [
    ("block_hashes", list[Union[int, bytes]], True),
    ("medium", Optional[str], True),
    ("group_idx", Optional[int], False),
    ("locality", Optional[str], False),
    ("ownership", Optional[str], False),
]


def make_types(array_like: bool, n_stored: int = len(STORED), n_removed: int = len(REMOVED)):
    """The event structs with the first n fields of REFERENCE.md §2's order (older engine
    versions have fewer). In the tagged form, optional fields at their default (None) are
    omitted (`omit_defaults`), the others always written, as the wire example in
    REFERENCE.md shows (`parent_block_hash: nil`, `lora_id: nil`, `lora_name: nil`)."""

    def fields(spec, n):
        return [(name, ty) if req else (name, ty, None) for name, ty, req in spec[:n]]

    kw = dict(array_like=array_like, omit_defaults=True, gc=False, tag=True)
    return (
        msgspec.defstruct("BlockStored", fields(STORED, n_stored), **kw),
        msgspec.defstruct("BlockRemoved", fields(REMOVED, n_removed), **kw),
        msgspec.defstruct("AllBlocksCleared", [], **kw),
    )


class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class OldBatch(msgspec.Struct, array_like=True, gc=False):
    """Before `data_parallel_rank` existed: `[ts, events]`."""

    ts: float
    events: list[Any]


def sha(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def h_u64(i: int) -> int:  # vLLM default: last 8 bytes of the digest as uint64
    return int.from_bytes(sha(i)[-8:], "big")


def h_i64(i: int) -> int:  # SGLang: first 8 bytes of the digest as signed int64
    return int.from_bytes(sha(i)[:8], "big", signed=True)


TS = 1764412345.678901
enc = msgspec.msgpack.Encoder()
seeds = {}

# ---- current vLLM: tagged maps
S, R, C = make_types(array_like=False)
ref_stored = S(
    block_hashes=[h_u64(1), h_u64(2)], parent_block_hash=None, token_ids=list(range(32)),
    block_size=16, lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None],
    group_idx=0, kv_cache_spec_kind="full_attention",
)
seeds["tagged_stored_gpu"] = Batch(TS, [ref_stored], 0)
seeds["tagged_mixed"] = Batch(TS, [
    ref_stored,
    S(block_hashes=[h_u64(3)], parent_block_hash=h_u64(2), token_ids=list(range(32, 48)),
      block_size=16, lora_id=None, medium="CPU", lora_name=None, extra_keys=[None], group_idx=0,
      kv_cache_spec_kind="full_attention", locality="LOCAL"),
    R(block_hashes=[h_u64(1)], medium="GPU", group_idx=0),
    R(block_hashes=[h_u64(3)], medium="CPU", group_idx=0, locality="LOCAL"),
    C(),
], 0)
seeds["tagged_lora"] = Batch(TS, [
    S(block_hashes=[h_u64(10), h_u64(11)], parent_block_hash=None,
      token_ids=[1000 + t for t in range(32)], block_size=16, lora_id=1, medium="GPU",
      lora_name="sql-lora", extra_keys=[["sql-lora"], ["sql-lora"]], group_idx=0,
      kv_cache_spec_kind="full_attention"),
], 0)
seeds["tagged_bin_hashes"] = Batch(TS, [
    S(block_hashes=[sha(20), sha(21)], parent_block_hash=sha(19), token_ids=list(range(8)),
      block_size=4, lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None],
      group_idx=0,
      kv_cache_spec_kind="full_attention"),
    R(block_hashes=[sha(20)], medium="GPU", group_idx=0),
], 1)
seeds["tagged_cleared"] = Batch(TS, [C()], 1)
seeds["tagged_removed_storage"] = Batch(TS, [
    R(block_hashes=[h_u64(30), h_u64(31), h_u64(32)], medium="STORAGE", group_idx=1,
      ownership="OWNED"),
], None)
seeds["tagged_hybrid_sliding_window"] = Batch(TS, [
    S(block_hashes=[h_u64(40)], parent_block_hash=h_u64(39), token_ids=list(range(16)),
      block_size=16, lora_id=None, medium="GPU", lora_name=None, extra_keys=[None], group_idx=1,
      kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4096,
      session_id="sess-42", lookahead_token_ids=[[7, 8, 9]]),
], 3)
# A hybrid model (Qwen3-Next like: its Mamba group 0 first, full attention group 1). In vLLM's
# align mode the Mamba group's store names the blocks it holds a state at (here the last
# one) with the token ids of every block spanned; a state offloaded to the CPU comes without
# token ids; the Mamba group drops its state.
seeds["tagged_hybrid_mamba"] = Batch(TS, [
    S(block_hashes=[h_u64(91)], parent_block_hash=None, token_ids=list(range(32)),
      block_size=16, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
      kv_cache_spec_kind="mamba"),
    S(block_hashes=[h_u64(90), h_u64(91)], parent_block_hash=None, token_ids=list(range(32)),
      block_size=16, lora_id=None, medium="GPU", lora_name=None, group_idx=1,
      kv_cache_spec_kind="full_attention"),
    S(block_hashes=[h_u64(91)], parent_block_hash=None, token_ids=[], block_size=0,
      lora_id=None, medium="CPU", lora_name=None, group_idx=0, kv_cache_spec_kind="mamba"),
    R(block_hashes=[h_u64(91)], medium="GPU", group_idx=0),
], 0)
seeds["empty_batch"] = Batch(TS, [], 0)

# ---- older vLLM and SGLang: positional arrays
# older vLLM: 2-element batch, Stored [hashes, parent, tokens, block_size, lora_id, medium].
PS, PR, PC = make_types(array_like=True, n_stored=6, n_removed=2)
seeds["positional_vllm_old"] = OldBatch(TS, [
    PS(block_hashes=[h_u64(50), h_u64(51)], parent_block_hash=None,
       token_ids=list(range(32)), block_size=16, lora_id=None, medium="GPU"),
    PS(block_hashes=[h_u64(52)], parent_block_hash=h_u64(51), token_ids=list(range(32, 48)),
       block_size=16, lora_id=2, medium="CPU"),
    PR(block_hashes=[h_u64(50)], medium="GPU"),
    PC(),
])
# SGLang: signed int64 hashes, Stored with 9 fields, Removed with 3.
PS, PR, PC = make_types(array_like=True, n_stored=9, n_removed=3)
seeds["positional_sglang"] = Batch(TS, [
    PS(block_hashes=[h_i64(57), h_i64(60)], parent_block_hash=h_i64(56),
       token_ids=list(range(64, 80)), block_size=8, lora_id=None, medium="GPU",
       lora_name=None, extra_keys=None, group_idx=0),
    PR(block_hashes=[h_i64(57)], medium="GPU", group_idx=0),
], 0)
# A newer positional encoder with every field.
PS, PR, PC = make_types(array_like=True)
seeds["positional_full"] = Batch(TS, [
    PS(block_hashes=[sha(70)], parent_block_hash=h_i64(69), token_ids=[5, 6, 7, 8],
       block_size=4, lora_id=3, medium="DISK", lora_name="sql-lora",
       extra_keys=[["sql-lora", ["mm-hash", 123]]], group_idx=2,
       kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=128,
       locality="REMOTE", ownership="SHARED", session_id="s", lookahead_token_ids=[[1], []]),
    PR(block_hashes=[sha(70)], medium="DISK", group_idx=2, locality="REMOTE", ownership="SHARED"),
], 7)

for name, b in seeds.items():
    with open(os.path.join(OUT, name + ".msgpack"), "wb") as f:
        f.write(enc.encode(b))

# Hand-assembled (msgspec cannot emit these shapes): a newer engine's unknown keys and
# trailing fields, and a map event whose "type" is not first.
def raw(obj) -> bytes:
    return msgspec.msgpack.encode(obj)

extra = [TS, [
    {"type": "BlockStored", "block_hashes": [h_u64(80)], "parent_block_hash": None,
     "token_ids": list(range(16)), "block_size": 16, "medium": "GPU",
     "future_field": {"nested": [1, 2.5, b"\x00\x01", None, {"x": [True]}]}},
    {"block_hashes": [h_u64(80)], "medium": "GPU", "type": "BlockRemoved", "reason": "evict"},
    ["BlockRemoved", [h_u64(81)], "GPU", 0, None, None, "future", [1, 2]],
    ["AllBlocksCleared", "future"],
], 0, "future batch field"]
with open(os.path.join(OUT, "unknown_keys_and_trailing.msgpack"), "wb") as f:
    f.write(raw(extra))
print(f"wrote {len(seeds) + 1} seeds to {OUT}")
