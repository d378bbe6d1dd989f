"""Encodes KV-event batches with vLLM's own code and compares them with the emulator's.

Reads JSON lines from stdin, one batch each:
  {"payload": hex, "ts": float, "dp_rank": int,
   "events": [{"type": "stored", "hashes": [...], "parent": int|null,
               "tokens": [...], "block_size": int} |
              {"type": "removed", "hashes": [...]} | {"type": "cleared"}]}
and writes one JSON line per batch:
  {"built": hex of vLLM's encoding of the events built as vLLM's KV cache manager builds
            them (lora_id/lora_name None, medium "GPU", extra_keys [None] per block,
            group_idx 0, kv_cache_spec_kind "full_attention"),
   "roundtrip": hex of vLLM's encoding of the payload decoded into vLLM's own
                KVEventBatch type (raises if the payload does not decode as one)}
vLLM's kv_events.py is imported unchanged (tests/compat/vllm_publisher.py's loader); its
publisher thread encodes with a plain msgspec.msgpack.Encoder(), as here.
"""

import json
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "tests", "compat"))

import msgspec  # noqa: E402
from vllm_publisher import load_kv_events  # noqa: E402

kv = load_kv_events()
pack = msgspec.msgpack.Encoder()
decode = msgspec.msgpack.Decoder(type=kv.KVEventBatch)


def build(ev):
    if ev["type"] == "stored":
        n = len(ev["hashes"])
        return kv.BlockStored(
            block_hashes=ev["hashes"],
            parent_block_hash=ev["parent"],
            token_ids=ev["tokens"],
            block_size=ev["block_size"],
            lora_id=None,
            medium=kv.MEDIUM_GPU,
            lora_name=None,
            extra_keys=[None] * n,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
    if ev["type"] == "removed":
        return kv.BlockRemoved(block_hashes=ev["hashes"], medium=kv.MEDIUM_GPU, group_idx=0)
    return kv.AllBlocksCleared()


for line in sys.stdin:
    case = json.loads(line)
    batch = kv.KVEventBatch(
        ts=float(case["ts"]),
        events=[build(e) for e in case["events"]],
        data_parallel_rank=case["dp_rank"],
    )
    out = {"built": pack.encode(batch).hex()}
    try:
        out["roundtrip"] = pack.encode(decode.decode(bytes.fromhex(case["payload"]))).hex()
    except Exception as e:  # a payload vLLM's type refuses
        out["roundtrip"] = None
        out["error"] = repr(e)
    print(json.dumps(out), flush=True)
