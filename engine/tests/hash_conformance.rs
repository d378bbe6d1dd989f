//! Checks `kvr::hash` against the hash conformance vectors of the project's reference
//! (REFERENCE.md §1, `conformance/hash_vectors.json` in the shared reference directory).
//!
//! Every vector in the file is checked; a vector of an unknown kind, or with a key this
//! test does not understand, fails the test so that nothing is silently skipped.
//! The vectors are vendored in `engine/tests/conformance/hash_vectors.json` (see the
//! README beside them for their source), so the test reads no file outside the
//! repository. `$KVR_SHARED_DIR` (the shared reference directory) checks its copy
//! instead, and then the vendored copy must equal it byte for byte (a vendored file that
//! drifted from the contract fails here); .ci/run sets it when that directory is there.

use std::path::PathBuf;

use kvr::hash::{local_block_hash_mm, sequence_hashes, BlockHasher, HashSalt};
use serde_json::{Map, Value};
use xxhash_rust::xxh3::xxh3_64_with_seed;

const VECTORS: &str = "conformance/hash_vectors.json";

fn vendored_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(VECTORS)
}

fn vectors_path() -> PathBuf {
    match std::env::var_os("KVR_SHARED_DIR") {
        Some(dir) => PathBuf::from(dir).join(VECTORS),
        None => vendored_path(),
    }
}

#[test]
fn vendored_vectors_equal_the_shared_contract() {
    let Some(dir) = std::env::var_os("KVR_SHARED_DIR") else {
        eprintln!("KVR_SHARED_DIR unset: the vendored vectors are the contract");
        return;
    };
    let shared = PathBuf::from(dir).join(VECTORS);
    let contract = std::fs::read(&shared)
        .unwrap_or_else(|e| panic!("KVR_SHARED_DIR is set but {}: {e}", shared.display()));
    let vendored = std::fs::read(vendored_path()).expect("the vendored vectors");
    assert!(
        vendored == contract,
        "{} differs from {}: copy the shared file over it",
        vendored_path().display(),
        shared.display()
    );
}

fn load_vectors() -> Vec<Value> {
    let path = vectors_path();
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "cannot read the hash conformance vectors at {}: {e} \
             (vendored in engine/tests/conformance; KVR_SHARED_DIR overrides)",
            path.display()
        )
    });
    let doc: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{} is not valid JSON: {e}", path.display()));
    let vectors = doc
        .get("vectors")
        .and_then(Value::as_array)
        .unwrap_or_else(|| panic!("{} has no \"vectors\" array", path.display()));
    assert!(!vectors.is_empty(), "{} has no vectors", path.display());
    vectors.clone()
}

/// Field access with failure messages naming the vector.
struct Vector<'a> {
    name: String,
    obj: &'a Map<String, Value>,
}

impl<'a> Vector<'a> {
    fn new(index: usize, v: &'a Value) -> Self {
        let obj = v
            .as_object()
            .unwrap_or_else(|| panic!("vector #{index} is not a JSON object: {v}"));
        let name = match obj.get("name").and_then(Value::as_str) {
            Some(n) => format!("vector #{index} ({n:?})"),
            None => format!("vector #{index}"),
        };
        Vector { name, obj }
    }

    fn has(&self, key: &str) -> bool {
        self.obj.contains_key(key)
    }

    /// Fails on any key outside `known`.
    fn only_keys(&self, known: &[&str]) {
        for key in self.obj.keys() {
            assert!(
                known.contains(&key.as_str()),
                "{}: unknown key {key:?} (known for this kind: {known:?}); \
                 teach tests/hash_conformance.rs about it",
                self.name
            );
        }
    }

    fn get(&self, key: &str) -> &'a Value {
        self.obj
            .get(key)
            .unwrap_or_else(|| panic!("{}: missing {key:?}", self.name))
    }

    fn u64(&self, key: &str) -> u64 {
        as_u64(self.get(key), || format!("{}: {key:?}", self.name))
    }

    fn str(&self, key: &str) -> &'a str {
        self.get(key)
            .as_str()
            .unwrap_or_else(|| panic!("{}: {key:?} must be a string", self.name))
    }

    /// `null` or absent = `None`.
    fn opt_str(&self, key: &str) -> Option<&'a str> {
        match self.obj.get(key) {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s),
            Some(other) => panic!(
                "{}: {key:?} must be a string or null, got {other}",
                self.name
            ),
        }
    }

    fn u64_array(&self, key: &str) -> Vec<u64> {
        u64_array(self.get(key), || format!("{}: {key:?}", self.name))
    }
}

fn as_u64(v: &Value, what: impl Fn() -> String) -> u64 {
    v.as_u64()
        .unwrap_or_else(|| panic!("{}: expected an unsigned 64-bit integer, got {v}", what()))
}

fn u64_array(v: &Value, what: impl Fn() -> String) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("{}: expected an array, got {v}", what()))
        .iter()
        .enumerate()
        .map(|(i, x)| as_u64(x, || format!("{}[{i}]", what())))
        .collect()
}

/// Raw xxh3-64 of UTF-8 bytes with a seed: pins the hash function itself.
fn check_raw(v: &Vector) {
    v.only_keys(&["name", "bytes_utf8", "seed", "xxh3_64"]);
    let got = xxh3_64_with_seed(v.str("bytes_utf8").as_bytes(), v.u64("seed"));
    assert_eq!(got, v.u64("xxh3_64"), "{}: xxh3_64", v.name);
}

/// Tokens → local and sequence hashes through the engine.
fn check_tokens(v: &Vector) {
    v.only_keys(&[
        "name",
        "tokens",
        "block_size",
        "lora_name",
        "cache_namespace",
        "mm_hashes",
        "local",
        "sequence",
    ]);
    let tokens: Vec<u32> = v
        .u64_array("tokens")
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            u32::try_from(t)
                .unwrap_or_else(|_| panic!("{}: tokens[{i}] = {t} is not a u32", v.name))
        })
        .collect();
    let block_size = usize::try_from(v.u64("block_size")).expect("block_size fits usize");
    let salt = HashSalt::new(v.opt_str("lora_name"), v.opt_str("cache_namespace"));
    let want_local = v.u64_array("local");
    let want_seq = v.u64_array("sequence");

    let hasher = BlockHasher::new(block_size, salt)
        .unwrap_or_else(|e| panic!("{}: block_size {block_size}: {e}", v.name));
    let n_blocks = hasher.complete_blocks(tokens.len());

    let (local, seq) = match v.obj.get("mm_hashes") {
        None | Some(Value::Null) => {
            let (mut local, mut seq) = (Vec::new(), Vec::new());
            hasher.hash_tokens(&tokens, &mut local, &mut seq);
            // The local-only path must agree with the combined one.
            let mut local_only = Vec::new();
            hasher.local_hashes(&tokens, &mut local_only);
            assert_eq!(local_only, local, "{}: local_hashes vs hash_tokens", v.name);
            (local, seq)
        }
        Some(mm) => {
            let local = mm_local_hashes(v, mm, &tokens, block_size, n_blocks, salt);
            let seq = sequence_hashes(&local);
            (local, seq)
        }
    };

    assert_eq!(local.len(), n_blocks, "{}: number of local hashes", v.name);
    assert_eq!(local, want_local, "{}: local hashes", v.name);
    assert_eq!(seq, want_seq, "{}: sequence hashes", v.name);
}

/// `mm_hashes`: one entry per block, each an array of u64 (any order) or null (no
/// multimodal content). Entries for a trailing partial block are allowed and unused;
/// more entries than blocks (complete or partial) is a malformed vector.
fn mm_local_hashes(
    v: &Vector,
    mm: &Value,
    tokens: &[u32],
    block_size: usize,
    n_blocks: usize,
    salt: HashSalt,
) -> Vec<u64> {
    let entries = mm.as_array().unwrap_or_else(|| {
        panic!(
            "{}: \"mm_hashes\" must be an array of per-block arrays",
            v.name
        )
    });
    let max_entries = tokens.len().div_ceil(block_size);
    assert!(
        entries.len() >= n_blocks && entries.len() <= max_entries,
        "{}: \"mm_hashes\" has {} entries for {n_blocks} complete blocks",
        v.name,
        entries.len()
    );
    tokens
        .chunks_exact(block_size)
        .zip(entries)
        .enumerate()
        .map(|(i, (block, entry))| {
            let hashes = match entry {
                Value::Null => Vec::new(),
                e => u64_array(e, || format!("{}: mm_hashes[{i}]", v.name)),
            };
            local_block_hash_mm(block, &hashes, salt)
        })
        .collect()
}

#[test]
fn all_hash_vectors_conform() {
    let vectors = load_vectors();
    let (mut raw, mut tok) = (0, 0);
    for (i, value) in vectors.iter().enumerate() {
        let v = Vector::new(i, value);
        if v.has("xxh3_64") || v.has("bytes_utf8") {
            check_raw(&v);
            raw += 1;
        } else if v.has("tokens") {
            check_tokens(&v);
            tok += 1;
        } else {
            let keys: Vec<&String> = v.obj.keys().collect();
            panic!(
                "{}: unknown vector kind (keys {keys:?}); \
                 teach tests/hash_conformance.rs about it",
                v.name
            );
        }
    }
    assert_eq!(raw + tok, vectors.len());
    // The pinned vectors of REFERENCE.md §1 must be among them.
    assert!(raw >= 1, "no raw xxh3 vector in the conformance file");
    assert!(tok >= 1, "no token vector in the conformance file");
}
