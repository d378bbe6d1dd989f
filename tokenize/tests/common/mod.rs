//! Shared by the integration tests: the asset tokenizer and scratch directories.
#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use kvr_tokenize::Tokenizer;

pub fn asset_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/assets/tokenizer")
}

pub fn asset() -> Tokenizer {
    Tokenizer::from_dir(asset_dir()).expect("the test asset loads")
}

/// A directory for one test, removed when dropped (so test runs leave nothing behind).
pub struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh empty directory under the system's temp dir.
pub fn scratch(name: &str) -> Scratch {
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "kvr-tokenize-{}-{}-{name}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

/// A scratch copy of the asset directory.
pub fn asset_copy(name: &str) -> Scratch {
    let dir = scratch(name);
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(asset_dir().join(f), dir.join(f)).unwrap();
    }
    dir
}
