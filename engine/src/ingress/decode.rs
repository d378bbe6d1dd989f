//! vLLM / SGLang `KVEventBatch` msgpack payloads (REFERENCE.md §2). (Being written.)
