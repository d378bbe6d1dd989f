//! Disk writes for the state files: a journal appended to and synced batch by batch, and
//! snapshots written whole under a temporary name and renamed into place.
//!
//! Two backends do the same writes. [`Backend::Uring`] goes through io_uring: a batch's
//! writes and the data sync that makes them durable are one submission (the writes linked
//! to the sync), and small writes are copied into a registered buffer. [`Backend::Plain`]
//! uses `pwrite` and `fdatasync`. [`Io::new`] picks one at run time: containers often
//! refuse `io_uring_setup` (a seccomp profile, a sysctl), so [`IoMode::Auto`] tries a ring
//! and falls back to plain writes, keeping the reason; `plain` forces the fallback.
//!
//! One [`Io`] serves any number of files from one thread (it owns a ring and a 1 MiB
//! buffer, which io_uring counts as locked memory); it is `Send`, so it may be created
//! where the configuration is read and moved to the writer thread.

mod plain;
mod uring;

use std::ffi::OsStr;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// The environment variable [`IoMode::from_env_or`] reads: `auto`, `uring` or `plain`.
pub const ENV_VAR: &str = "KVR_STATE_IO";

/// Bytes of the staging buffer (the registered buffer with io_uring): an append up to this
/// size is one write from it; a snapshot is written through it in pieces of this size.
pub const STAGE_BYTES: usize = 1 << 20;

/// Which backend to use (the `--state-io` flag, or [`ENV_VAR`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IoMode {
    /// io_uring when the kernel and the sandbox allow it, plain writes otherwise.
    #[default]
    Auto,
    /// io_uring, or an error saying why it cannot be used.
    Uring,
    /// `pwrite` and `fdatasync`; io_uring is not tried.
    Plain,
}

impl IoMode {
    pub fn name(self) -> &'static str {
        match self {
            IoMode::Auto => "auto",
            IoMode::Uring => "uring",
            IoMode::Plain => "plain",
        }
    }

    /// The mode [`ENV_VAR`] names when it is set, else `default`; an unknown value is an
    /// error (never silently ignored). A command-line flag, when given, wins over it.
    pub fn from_env_or(default: IoMode) -> Result<IoMode, String> {
        mode_from(std::env::var_os(ENV_VAR).as_deref(), default)
    }
}

/// [`IoMode::from_env_or`] given the variable's value.
fn mode_from(value: Option<&OsStr>, default: IoMode) -> Result<IoMode, String> {
    match value {
        None => Ok(default),
        Some(v) => v
            .to_str()
            .ok_or_else(|| format!("{ENV_VAR} is not valid UTF-8"))?
            .parse()
            .map_err(|e| format!("{ENV_VAR}: {e}")),
    }
}

impl FromStr for IoMode {
    type Err = String;

    fn from_str(s: &str) -> Result<IoMode, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(IoMode::Auto),
            "uring" | "io_uring" | "io-uring" => Ok(IoMode::Uring),
            "plain" => Ok(IoMode::Plain),
            _ => Err(format!(
                "unknown state I/O mode '{s}' (expected auto, uring or plain)"
            )),
        }
    }
}

impl fmt::Display for IoMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The backend an [`Io`] writes through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Uring,
    Plain,
}

impl Backend {
    /// A stable name, for logs and metrics labels.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Uring => "uring",
            Backend::Plain => "plain",
        }
    }
}

/// A failed disk operation: what was done, to which file, and the OS's error.
#[derive(Debug)]
pub struct IoError {
    op: &'static str,
    path: Option<PathBuf>,
    source: io::Error,
}

impl IoError {
    fn new(op: &'static str, path: Option<&Path>, source: io::Error) -> IoError {
        IoError {
            op,
            path: path.map(Path::to_path_buf),
            source,
        }
    }

    /// The operation: `open`, `create`, `write`, `fdatasync`, `truncate`, `rename`,
    /// `fsync directory`, `io_uring_enter`; starting the io_uring backend:
    /// `io_uring_setup`, `io_uring_register (probe)`, `io_uring_register (buffers)`.
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// The file or directory it was done to (none for starting the backend).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The OS's error (its `raw_os_error()` is the errno: `ENOSPC`, `EACCES`, ...).
    pub fn os_error(&self) -> &io::Error {
        &self.source
    }
}

impl fmt::Display for IoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.path {
            Some(p) => write!(f, "{} failed for {}: {}", self.op, p.display(), self.source),
            None => write!(f, "{} failed: {}", self.op, self.source),
        }
    }
}

impl std::error::Error for IoError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// What failed inside a backend, before the path is attached.
type Failed = (&'static str, io::Error);

#[derive(Debug)]
enum Inner {
    Plain { stage: Box<[u8]> },
    Uring(Box<uring::Ring>),
}

/// The chosen backend and its buffer. See the module's documentation.
#[derive(Debug)]
pub struct Io {
    inner: Inner,
    fallback_reason: Option<String>,
}

impl Io {
    /// Starts the backend `mode` asks for. Only [`IoMode::Uring`] can fail (io_uring
    /// unavailable or refused: the error names the step and carries the OS's error,
    /// e.g. `io_uring_setup failed: Operation not permitted (os error 1)`).
    pub fn new(mode: IoMode) -> Result<Io, IoError> {
        let plain = |reason| Io {
            inner: Inner::Plain {
                stage: vec![0u8; STAGE_BYTES].into_boxed_slice(),
            },
            fallback_reason: reason,
        };
        match mode {
            IoMode::Plain => Ok(plain(None)),
            IoMode::Auto => Ok(match uring::Ring::probe(STAGE_BYTES) {
                Ok(ring) => Io {
                    inner: Inner::Uring(Box::new(ring)),
                    fallback_reason: None,
                },
                Err((step, e)) => plain(Some(format!("{step}: {e}"))),
            }),
            IoMode::Uring => match uring::Ring::probe(STAGE_BYTES) {
                Ok(ring) => Ok(Io {
                    inner: Inner::Uring(Box::new(ring)),
                    fallback_reason: None,
                }),
                Err((step, e)) => Err(IoError::new(step, None, e)),
            },
        }
    }

    pub fn backend(&self) -> Backend {
        match self.inner {
            Inner::Plain { .. } => Backend::Plain,
            Inner::Uring(_) => Backend::Uring,
        }
    }

    /// Why [`IoMode::Auto`] fell back to plain writes, e.g.
    /// `io_uring_setup: Operation not permitted (os error 1)`; `None` otherwise.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback_reason.as_deref()
    }

    fn stage_mut(&mut self) -> &mut [u8] {
        match &mut self.inner {
            Inner::Plain { stage } => stage,
            Inner::Uring(ring) => ring.fixed_mut(),
        }
    }

    /// Writes the first `len` staged bytes at `off`, then syncs the data if `sync`.
    fn write_stage(&mut self, file: &File, off: u64, len: usize, sync: bool) -> Result<(), Failed> {
        match &mut self.inner {
            Inner::Plain { stage } => plain::write_at(file, off, &[&stage[..len]], sync),
            Inner::Uring(ring) => ring.write_fixed(file, off, len, sync),
        }
    }

    /// Writes `bufs` from the caller's memory at `off`, then syncs the data if `sync`.
    fn write_bufs(
        &mut self,
        file: &File,
        off: u64,
        bufs: &[&[u8]],
        sync: bool,
    ) -> Result<(), Failed> {
        match &mut self.inner {
            Inner::Plain { .. } => plain::write_at(file, off, bufs, sync),
            Inner::Uring(ring) => ring.write_bufs(file, off, bufs, sync),
        }
    }

    /// Opens the append-only file at `path`, creating it (and syncing its directory, so
    /// the new name survives a crash) when missing. Writes go at its current end.
    pub fn open_append(&mut self, path: &Path) -> Result<AppendFile, IoError> {
        let mut opts = OpenOptions::new();
        opts.read(true).write(true).mode(0o644);
        let (file, created) = match opts.clone().create_new(true).open(path) {
            Ok(f) => (f, true),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let f = opts
                    .open(path)
                    .map_err(|e| IoError::new("open", Some(path), e))?;
                (f, false)
            }
            Err(e) => return Err(IoError::new("create", Some(path), e)),
        };
        if created {
            sync_parent(path)?;
        }
        let len = file
            .metadata()
            .map_err(|e| IoError::new("open", Some(path), e))?
            .len();
        Ok(AppendFile {
            file,
            path: path.to_path_buf(),
            len,
        })
    }

    /// Appends `bufs`, in order, at the end of `file`, and returns once they are durable
    /// (written and data-synced). Up to [`STAGE_BYTES`] in all they are copied into the
    /// stage and written at once; larger, each is written from where it is, batched.
    ///
    /// On an error (`ENOSPC`, `EIO`, ...) the file is cut back to its length before the
    /// call (best effort) and [`AppendFile::len`] is unchanged, so what was there stays a
    /// valid prefix and a later append continues from it. After a failed sync the kernel
    /// may have dropped written data: the caller should start a new snapshot rather than
    /// trust this file.
    pub fn append(&mut self, file: &mut AppendFile, bufs: &[&[u8]]) -> Result<(), IoError> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 {
            return Ok(());
        }
        let res = if total <= STAGE_BYTES {
            let stage = self.stage_mut();
            let mut at = 0;
            for b in bufs {
                stage[at..at + b.len()].copy_from_slice(b);
                at += b.len();
            }
            self.write_stage(&file.file, file.len, total, true)
        } else {
            self.write_bufs(&file.file, file.len, bufs, true)
        };
        match res {
            Ok(()) => {
                file.len += total as u64;
                Ok(())
            }
            Err((op, e)) => {
                let _ = file.file.set_len(file.len);
                Err(IoError::new(op, Some(&file.path), e))
            }
        }
    }

    /// Writes the file `name` in `dir` whole, or not at all: `produce` hands its bytes,
    /// chunk by chunk, to the function it is given (`|out| snapshot.write(out)`); they go
    /// to `name.tmp` (created or emptied), which is synced, renamed to `name`, and the
    /// directory synced. Returns the bytes written.
    ///
    /// On an error the temporary file is removed and a previous `name` is left as it
    /// was; chunks produced after the first failed write are dropped.
    pub fn write_atomic<F>(&mut self, dir: &Path, name: &str, produce: F) -> Result<u64, IoError>
    where
        F: FnOnce(&mut dyn FnMut(&[u8])),
    {
        let tmp = dir.join(format!("{name}.tmp"));
        let dst = dir.join(name);
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .open(&tmp)
            .map_err(|e| IoError::new("create", Some(&tmp), e))?;
        let written = self.write_whole(&file, produce);
        drop(file);
        let done = written
            .map_err(|(op, e)| IoError::new(op, Some(&tmp), e))
            .and_then(|n| {
                std::fs::rename(&tmp, &dst)
                    .map(|()| n)
                    .map_err(|e| IoError::new("rename", Some(&tmp), e))
            });
        match done {
            Ok(n) => {
                sync_dir(dir)?;
                Ok(n)
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    /// Streams what `produce` hands out through the stage into `file` from offset 0; the
    /// last write is linked to the data sync.
    fn write_whole<F>(&mut self, file: &File, produce: F) -> Result<u64, Failed>
    where
        F: FnOnce(&mut dyn FnMut(&[u8])),
    {
        let (mut off, mut fill) = (0u64, 0usize);
        let mut failed: Option<Failed> = None;
        produce(&mut |mut chunk: &[u8]| {
            while failed.is_none() && !chunk.is_empty() {
                let stage = self.stage_mut();
                let n = (stage.len() - fill).min(chunk.len());
                stage[fill..fill + n].copy_from_slice(&chunk[..n]);
                fill += n;
                chunk = &chunk[n..];
                if fill == STAGE_BYTES {
                    match self.write_stage(file, off, fill, false) {
                        Ok(()) => (off, fill) = (off + fill as u64, 0),
                        Err(f) => failed = Some(f),
                    }
                }
            }
        });
        if let Some(f) = failed {
            return Err(f);
        }
        self.write_stage(file, off, fill, true)?;
        Ok(off + fill as u64)
    }
}

/// An append-only file (a journal): its length is tracked here, and every write goes at
/// that offset, never at a shared file position.
#[derive(Debug)]
pub struct AppendFile {
    file: File,
    path: PathBuf,
    len: u64,
}

impl AppendFile {
    /// Bytes in the file: where the next append goes.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Cuts the file to `len` bytes (a torn tail found when reading it back) and syncs
    /// it. Only shortens: a `len` past the end is an error.
    pub fn truncate(&mut self, len: u64) -> Result<(), IoError> {
        if len > self.len {
            let e = io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("cannot truncate {} bytes to {len}", self.len),
            );
            return Err(IoError::new("truncate", Some(&self.path), e));
        }
        self.file
            .set_len(len)
            .map_err(|e| IoError::new("truncate", Some(&self.path), e))?;
        self.len = len;
        plain::sync_data(&self.file).map_err(|(op, e)| IoError::new(op, Some(&self.path), e))
    }
}

/// Syncs the directory holding `path` (a new name in it survives a crash).
fn sync_parent(path: &Path) -> Result<(), IoError> {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => sync_dir(p),
        _ => sync_dir(Path::new(".")),
    }
}

fn sync_dir(dir: &Path) -> Result<(), IoError> {
    let d = File::open(dir).map_err(|e| IoError::new("fsync directory", Some(dir), e))?;
    loop {
        match d.sync_all() {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r.map_err(|e| IoError::new("fsync directory", Some(dir), e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_unknown_ones_are_refused() {
        assert_eq!("auto".parse(), Ok(IoMode::Auto));
        assert_eq!(" Uring".parse(), Ok(IoMode::Uring));
        assert_eq!("plain".parse(), Ok(IoMode::Plain));
        assert!("fast".parse::<IoMode>().unwrap_err().contains("'fast'"));
        for m in [IoMode::Auto, IoMode::Uring, IoMode::Plain] {
            assert_eq!(m.name().parse(), Ok(m));
        }
    }

    #[test]
    fn the_variable_wins_over_the_default_and_a_bad_value_is_an_error() {
        let v = |s: &str| Some(OsStr::new(s).to_owned());
        assert_eq!(mode_from(None, IoMode::Uring), Ok(IoMode::Uring));
        assert_eq!(
            mode_from(v("plain").as_deref(), IoMode::Uring),
            Ok(IoMode::Plain)
        );
        let e = mode_from(v("uring2").as_deref(), IoMode::Auto).unwrap_err();
        assert!(e.starts_with(ENV_VAR), "{e}");
    }
}
