//! The first frame of every state file: what it is and whose.
//!
//! `KVRSTATE`, the format version, the file's kind, the partition (model and routing
//! group) and how it hashes (its block size and a probe: the local hash of a fixed token
//! sequence, which changes with anything that changes local hashes: block size, hash
//! seed, cache namespace). A file whose partition or hashing differs would make the index
//! name blocks no prompt hashes to, so it is refused, never applied.

use kvr::{Partition, PartitionKey, StoredBlock, Tier};

use crate::frame::{FrameStop, Frames};

/// The file's first bytes.
pub const MAGIC: &[u8; 8] = b"KVRSTATE";
/// The format this crate writes and reads.
pub const VERSION: u16 = 1;

/// What a state file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Snapshot = 1,
    Journal = 2,
}

/// Whose a file is: checked against the partition it is loaded into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub key: PartitionKey,
    pub block_size: u32,
    /// The partition's local hash of [`PROBE_TOKENS`].
    pub hash_probe: u64,
}

/// Tokens hashed for [`Identity::hash_probe`] (two blocks at any block size up to 64).
pub const PROBE_TOKENS: [u32; 128] = {
    let mut t = [0u32; 128];
    let mut i = 0;
    while i < 128 {
        t[i] = (i as u32).wrapping_mul(2_654_435_761) >> 16;
        i += 1;
    }
    t
};

impl Identity {
    /// The identity of `p`.
    pub fn of(p: &Partition) -> Identity {
        let bs = p.block_size().max(1) as usize;
        let tokens: Vec<u32> = PROBE_TOKENS.iter().cycle().take(bs * 2).copied().collect();
        let (mut local, mut seq) = (Vec::new(), Vec::new());
        p.hasher().hash_tokens(&tokens, &mut local, &mut seq);
        Identity {
            key: p.key().clone(),
            block_size: p.block_size(),
            hash_probe: local.last().copied().unwrap_or(0),
        }
    }
}

/// Why a state file was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FileError {
    /// No bytes.
    Empty,
    /// The first frame is not a kvr state header.
    NotKvr,
    /// A header frame that does not read (cut short, a flipped bit).
    Header(FrameStop),
    /// Another format version.
    Version(u16),
    /// Another kind of file (a journal where a snapshot was expected, ...).
    Kind(u8),
    /// Another partition's file.
    Partition(PartitionKey),
    /// This partition's, hashed differently (block size, seed, namespace).
    Hashing,
    /// A frame after the header is cut short or corrupt (a snapshot must be whole).
    Frame(FrameStop),
    /// A record that does not read, or counts that disagree with the end record.
    Malformed(&'static str),
}

impl FileError {
    /// A stable name, for counters.
    pub fn name(&self) -> &'static str {
        match self {
            FileError::Empty => "empty",
            FileError::NotKvr => "not_kvr",
            FileError::Header(_) => "bad_header",
            FileError::Version(_) => "version",
            FileError::Kind(_) => "kind",
            FileError::Partition(_) => "other_partition",
            FileError::Hashing => "other_hashing",
            FileError::Frame(s) => s.name(),
            FileError::Malformed(_) => "malformed",
        }
    }
}

impl std::fmt::Display for FileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FileError::Empty => write!(f, "the file is empty"),
            FileError::NotKvr => write!(f, "not a kvr state file"),
            FileError::Header(s) => write!(f, "its header does not read ({})", s.name()),
            FileError::Version(v) => write!(f, "format version {v}; this kvr reads {VERSION}"),
            FileError::Kind(k) => write!(f, "a file of another kind ({k})"),
            FileError::Partition(k) => {
                write!(f, "the file of partition {}/{}", k.model, k.routing_group)
            }
            FileError::Hashing => write!(
                f,
                "written by a partition hashing blocks differently (block size, seed or namespace)"
            ),
            FileError::Frame(s) => write!(f, "a record does not read ({})", s.name()),
            FileError::Malformed(m) => write!(f, "malformed: {m}"),
        }
    }
}

impl std::error::Error for FileError {}

/// The header frame's payload.
pub fn header(kind: Kind, id: &Identity) -> Vec<u8> {
    let mut w = Writer::default();
    w.bytes(MAGIC);
    w.u16(VERSION);
    w.u8(kind as u8);
    w.str(&id.key.model);
    w.str(&id.key.routing_group);
    w.u32(id.block_size);
    w.u64(id.hash_probe);
    w.0
}

/// Checks a header frame's payload against what is expected.
pub fn check_header(payload: &[u8], kind: Kind, want: &Identity) -> Result<(), FileError> {
    let mut r = Reader::new(payload);
    if r.take(8) != Some(&MAGIC[..]) {
        return Err(FileError::NotKvr);
    }
    let bad = FileError::Malformed("header");
    let version = r.u16().ok_or(bad.clone())?;
    if version != VERSION {
        return Err(FileError::Version(version));
    }
    let k = r.u8().ok_or(bad.clone())?;
    if k != kind as u8 {
        return Err(FileError::Kind(k));
    }
    let model = r.str().ok_or(bad.clone())?;
    let group = r.str().ok_or(bad.clone())?;
    let block_size = r.u32().ok_or(bad.clone())?;
    let probe = r.u64().ok_or(bad.clone())?;
    if !r.done() {
        return Err(bad);
    }
    if model != want.key.model || group != want.key.routing_group {
        return Err(FileError::Partition(PartitionKey::new(model, group)));
    }
    if block_size != want.block_size || probe != want.hash_probe {
        return Err(FileError::Hashing);
    }
    Ok(())
}

/// Opens a state file of `kind` for the partition `want` names: its frames after a header
/// that checks out, or why the file is refused.
pub fn open<'a>(bytes: &'a [u8], kind: Kind, want: &Identity) -> Result<Frames<'a>, FileError> {
    if bytes.is_empty() {
        return Err(FileError::Empty);
    }
    let mut frames = Frames::new(bytes);
    let Some(head) = frames.next() else {
        let stop = frames.stop().unwrap_or(FrameStop::Truncated);
        // No whole first frame: a header cut short, or not a kvr file at all.
        return Err(
            if bytes.len() < 16 || !bytes[8..].starts_with(&MAGIC[..4]) {
                FileError::NotKvr
            } else {
                FileError::Header(stop)
            },
        );
    };
    check_header(head, kind, want)?;
    Ok(frames)
}

/// Little-endian encoding of records.
#[derive(Default, Debug)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    pub fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub fn bytes(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }
    pub fn tier(&mut self, t: Tier) {
        self.u8(t as u8);
    }
    /// A count, then each block's engine and local hash.
    pub fn blocks(&mut self, blocks: &[StoredBlock]) {
        self.u32(blocks.len() as u32);
        // Sized once, then filled: no capacity check per block (the ingest path writes
        // every stored block through here).
        let start = self.0.len();
        self.0.resize(start + blocks.len() * 16, 0);
        for (out, b) in self.0[start..].chunks_exact_mut(16).zip(blocks) {
            out[..8].copy_from_slice(&b.external_hash.to_le_bytes());
            out[8..].copy_from_slice(&b.local_hash.to_le_bytes());
        }
    }
    /// A string of at most 65,535 bytes (longer ones are cut at a char boundary).
    pub fn str(&mut self, s: &str) {
        let mut end = s.len().min(u16::MAX as usize);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u16(end as u16);
        self.bytes(&s.as_bytes()[..end]);
    }
}

/// Reads what [`Writer`] wrote; `None` past the end.
#[derive(Debug)]
pub struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub fn new(b: &'a [u8]) -> Self {
        Reader { b, at: 0 }
    }
    pub fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.b.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(s)
    }
    pub fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    pub fn u16(&mut self) -> Option<u16> {
        self.take(2)
            .map(|b| u16::from_le_bytes(b.try_into().expect("2 bytes")))
    }
    pub fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }
    pub fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }
    pub fn str(&mut self) -> Option<String> {
        let n = self.u16()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }
    pub fn tier(&mut self) -> Option<Tier> {
        match self.u8()? {
            0 => Some(Tier::Device),
            1 => Some(Tier::Host),
            2 => Some(Tier::Disk),
            _ => None,
        }
    }
    /// What [`Writer::blocks`] wrote; `None` when the count is over `max` or over what
    /// is left (a corrupt count cannot allocate much).
    pub fn blocks(&mut self, max: usize) -> Option<Vec<StoredBlock>> {
        let n = self.u32()? as usize;
        if n > max || n.checked_mul(16)? > self.left() {
            return None;
        }
        Some(
            (0..n)
                .map(|_| StoredBlock {
                    external_hash: self.u64().expect("length checked"),
                    local_hash: self.u64().expect("length checked"),
                })
                .collect(),
        )
    }
    /// Bytes left.
    pub fn left(&self) -> usize {
        self.b.len() - self.at
    }
    pub fn done(&self) -> bool {
        self.at == self.b.len()
    }
}
