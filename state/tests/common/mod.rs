//! Test helpers shared by the kvr-state tests: temporary directories and small tmpfs
//! mounts, removed (unmounted) when dropped, a failing test's too.
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// A directory removed (with what is in it) when dropped.
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub(crate) fn new(tag: &str) -> TempDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("kvr-state-io-{}-{n}-{tag}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A tmpfs mounted on a fresh directory, unmounted when dropped (a failing test too).
pub(crate) struct Tmpfs {
    dir: TempDir,
}

impl Tmpfs {
    /// Mounts a tmpfs with `options` (e.g. `size=64k`), or says why it could not.
    pub(crate) fn mount(tag: &str, options: &str) -> Result<Tmpfs, String> {
        let dir = TempDir::new(tag);
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "tmpfs"])
            .arg(dir.path())
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount -t tmpfs refused: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(Tmpfs { dir })
    }
    pub(crate) fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(self.dir.path())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("could not unmount {}", self.dir.path().display());
        }
    }
}
