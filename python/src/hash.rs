//! `kvr.hash_tokens`: Dynamo's `compute_block_hash_for_seq` (the local block hashes of a
//! prompt's complete blocks), from the engine's own hashing (`kvr::hash`).

use kvr::hash::{local_block_hash_mm, HashSalt};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::tokens;

/// One block's multimodal objects, as Dynamo takes them (`offsets` is required by
/// Dynamo 1.6.1 and does not enter the hash).
#[derive(serde::Deserialize)]
struct MmInfo {
    #[serde(default)]
    mm_objects: Vec<MmObject>,
}

#[derive(serde::Deserialize)]
struct MmObject {
    mm_hash: u64,
    #[allow(dead_code)]
    offsets: serde::de::IgnoredAny,
}

/// The local hashes of `tokens`' complete blocks of `kv_block_size` tokens; with
/// `is_eagle`, windows of `kv_block_size + 1` tokens at a stride of `kv_block_size`.
#[pyfunction]
#[pyo3(signature = (tokens, kv_block_size, block_mm_infos=None, lora_name=None, is_eagle=None, cache_namespace=None))]
pub(crate) fn hash_tokens(
    py: Python<'_>,
    tokens: &Bound<'_, PyAny>,
    kv_block_size: i64,
    block_mm_infos: Option<&Bound<'_, PyAny>>,
    lora_name: Option<&str>,
    is_eagle: Option<bool>,
    cache_namespace: Option<&str>,
) -> PyResult<Vec<u64>> {
    if kv_block_size <= 0 {
        return Err(PyValueError::new_err("kv_block_size must be at least 1"));
    }
    let bs = usize::try_from(kv_block_size)
        .map_err(|_| PyValueError::new_err("kv_block_size is too large"))?;
    let tokens = tokens::extract(tokens)?;
    let infos: Vec<Option<MmInfo>> = match block_mm_infos {
        None => Vec::new(),
        Some(o) if o.is_none() => Vec::new(),
        Some(o) => pythonize::depythonize(o)
            .map_err(|e| PyValueError::new_err(format!("block_mm_infos: {e}")))?,
    };
    let salt = HashSalt::new(lora_name, cache_namespace);
    let window = if is_eagle.unwrap_or(false) {
        bs + 1
    } else {
        bs
    };
    let t = tokens.as_slice();
    Ok(py.detach(|| {
        let mut out = Vec::with_capacity(t.len() / bs);
        let mut mm: Vec<u64> = Vec::new();
        let mut start = 0;
        let mut block = 0;
        while start + window <= t.len() {
            mm.clear();
            if let Some(Some(info)) = infos.get(block) {
                mm.extend(info.mm_objects.iter().map(|o| o.mm_hash));
            }
            out.push(local_block_hash_mm(&t[start..start + window], &mm, salt));
            start += bs;
            block += 1;
        }
        out
    }))
}
