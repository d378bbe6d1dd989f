//! The file operations the writer needs: a journal segment appended with a durable sync,
//! and a snapshot written aside, synced and renamed over the old one.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// How state files are written.
#[derive(Clone, Debug, Default)]
pub struct Files {}

/// A journal segment open for appending.
#[derive(Debug)]
pub struct JournalFile {
    file: File,
}

impl Files {
    /// A new segment at `path` (replacing any file there) that starts with `header`.
    pub fn create_journal(&self, path: &Path, header: &[u8]) -> std::io::Result<JournalFile> {
        let mut file = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(path)?;
        file.write_all(header)?;
        file.sync_data()?;
        if let Some(dir) = path.parent() {
            sync_dir(dir)?;
        }
        Ok(JournalFile { file })
    }

    /// Writes `dir/name` whole or not at all: to `name.tmp`, synced, then renamed and
    /// the directory synced. On failure the temporary file is removed and any previous
    /// `name` is left as it was.
    pub fn write_atomic(
        &self,
        dir: &Path,
        name: &str,
        produce: &mut dyn FnMut(&mut dyn FnMut(&[u8])),
    ) -> std::io::Result<()> {
        let tmp: PathBuf = dir.join(format!("{name}.tmp"));
        let r = (|| {
            let file = File::create(&tmp)?;
            let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
            let mut err = None;
            produce(&mut |b: &[u8]| {
                if err.is_none() {
                    if let Err(e) = w.write_all(b) {
                        err = Some(e);
                    }
                }
            });
            if let Some(e) = err {
                return Err(e);
            }
            let file = w.into_inner().map_err(|e| e.into_error())?;
            file.sync_all()?;
            std::fs::rename(&tmp, dir.join(name))?;
            sync_dir(dir)
        })();
        if r.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        r
    }
}

impl JournalFile {
    /// Appends `bytes` and waits until they are durable.
    pub fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.file.write_all(bytes)?;
        self.file.sync_data()
    }
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}
