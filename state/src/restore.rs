//! A restart: the newest snapshot, then the journal segments from its number on, record by
//! record, up to the first thing that does not continue what came before (a torn or
//! corrupt record, a writer's gap, a missing segment). What is applied is always a true
//! prefix of what the index held, and each stream's resume point is the last batch of
//! that prefix: the stream asks its publisher for what followed ([`kvr::StreamResume`]).
//!
//! A snapshot that cannot be read (corrupt, truncated, another version's or another
//! partition's) is refused with its reason and counted, and the restart begins empty:
//! the segments after it are deltas on a base that is gone. Nothing here panics on a
//! file's content.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::time::Instant;

use kvr::{KvEvent, Partition, RankId, StreamResume, WorkerId};

use crate::format::{FileError, Identity};
use crate::journal::{self, OwnedEvent, Record};
use crate::snapshot::Snapshot;

/// What a restore found and did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Restored {
    /// The snapshot's number and blocks (`None`: none used).
    pub snapshot: Option<u64>,
    pub snapshot_blocks: u64,
    /// Journal records applied, and events in them.
    pub records: u64,
    pub events: u64,
    /// Blocks or events the partition refused (a rank past its budget, an unknown
    /// parent), as for live events.
    pub refused: u64,
    /// Files refused, each with its name and the reason.
    pub refused_files: Vec<(String, String)>,
    /// Why reading stopped before the end of the last segment (`None`: read to the end).
    pub stopped: Option<String>,
    /// Where streams resume (also handed to the partition).
    pub streams: Vec<StreamResume>,
    /// The first segment number not used yet: the writer's next.
    pub next_segment: u64,
    pub seconds: f64,
}

/// `("snapshot" | "journal", N)` for a state file's name.
pub(crate) fn numbered(name: &str) -> Option<(&'static str, u64)> {
    let rest = name.strip_suffix(".kvr")?;
    for kind in ["snapshot", "journal"] {
        if let Some(n) = rest.strip_prefix(kind).and_then(|r| r.strip_prefix('-')) {
            return n.parse().ok().map(|n| (kind, n));
        }
    }
    None
}

/// Restores `p` (an empty partition) from `dir` (a partition's directory; missing or
/// empty: nothing to restore) and hands each stream's resume point to it.
pub fn restore(dir: &Path, p: &Partition) -> Restored {
    let t = Instant::now();
    let mut out = Restored::default();
    let want = Identity::of(p);
    let mut snaps = BTreeMap::new();
    let mut segs = BTreeMap::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            match numbered(&name) {
                Some(("snapshot", n)) => {
                    snaps.insert(n, e.path());
                }
                Some((_, n)) => {
                    segs.insert(n, e.path());
                }
                None => {}
            }
        }
    }
    out.next_segment = snaps
        .keys()
        .chain(segs.keys())
        .max()
        .map_or(0, |n| n.saturating_add(1));
    let Some((&n, path)) = snaps.iter().next_back() else {
        if !segs.is_empty() {
            out.stopped = Some("journal segments without a snapshot".into());
        }
        out.seconds = t.elapsed().as_secs_f64();
        return out;
    };
    let mut state = Replay::default();
    match std::fs::read(path)
        .map_err(|e| e.to_string())
        .and_then(|b| Snapshot::read(&b, &want).map_err(|e| describe(&e)))
    {
        Ok(snap) => {
            let r = snap.restore(p);
            out.snapshot = Some(n);
            out.snapshot_blocks = r.blocks;
            out.refused += r.refused;
            for s in &snap.stores {
                state.note_rank(s.rank);
            }
            for m in snap.streams {
                state.marks.insert((m.worker_id, m.stream), m);
            }
        }
        Err(why) => {
            out.refused_files.push((file_name(path), why));
            out.stopped = Some("the snapshot was refused: starting empty".into());
            out.seconds = t.elapsed().as_secs_f64();
            return out;
        }
    }
    // The segments from the snapshot's on, with no number missing.
    for (expect, (&k, path)) in (n..).zip(segs.range(n..)) {
        if k != expect {
            out.stopped = Some(format!("journal segment {expect} is missing"));
            break;
        }
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) => {
                out.refused_files.push((file_name(path), e.to_string()));
                out.stopped = Some("a journal segment could not be read".into());
                break;
            }
        };
        let read = match journal::read(&bytes, &want) {
            Ok(r) => r,
            Err(e) => {
                out.refused_files.push((file_name(path), describe(&e)));
                out.stopped = Some("a journal segment was refused".into());
                break;
            }
        };
        let mut gap = false;
        for rec in &read.records {
            if let Record::Gap { records } = rec {
                out.stopped = Some(format!("the writer lost {records} events here"));
                gap = true;
                break;
            }
            state.apply(p, rec, &mut out);
            out.records += 1;
        }
        if gap {
            break;
        }
        if let Some(why) = read.stop {
            out.stopped = Some(format!("{}: {why}", file_name(path)));
            break;
        }
    }
    out.streams = state.marks.into_values().collect();
    out.streams.sort_by_key(|m| (m.worker_id, m.stream));
    for m in &out.streams {
        p.resume_stream(m.clone());
    }
    out.seconds = t.elapsed().as_secs_f64();
    out
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
}

fn describe(e: &FileError) -> String {
    format!("{} ({e:?})", e.name())
}

/// The replay's own view: which ranks each worker has (a clear of all of a worker's
/// ranks, or its removal, clears these) and where streams are.
#[derive(Default)]
struct Replay {
    ranks: HashMap<WorkerId, HashSet<u32>>,
    marks: HashMap<(WorkerId, u32), StreamResume>,
}

impl Replay {
    fn note_rank(&mut self, r: RankId) {
        self.ranks.entry(r.worker_id).or_default().insert(r.dp_rank);
    }

    fn events(&mut self, p: &Partition, events: &[(RankId, OwnedEvent)], out: &mut Restored) {
        for (rank, e) in events {
            self.note_rank(*rank);
            let o = p.apply_events(*rank, [e.as_event()]);
            out.events += 1;
            out.refused += o.rejected;
        }
    }

    fn clear(&mut self, p: &Partition, worker: WorkerId, dp_ranks: &[u32]) {
        let all: Vec<u32> = match self.ranks.get(&worker) {
            Some(r) if dp_ranks.is_empty() => r.iter().copied().collect(),
            _ => dp_ranks.to_vec(),
        };
        for d in all {
            p.apply_events(RankId::new(worker, d), [KvEvent::Cleared]);
        }
    }

    fn apply(&mut self, p: &Partition, rec: &Record, out: &mut Restored) {
        match rec {
            Record::Batch {
                worker_id,
                stream,
                seq,
                digest,
                events,
            } => {
                self.events(p, events, out);
                note_place(
                    &mut self.marks,
                    (*worker_id, *stream),
                    (*seq, *digest),
                    events.iter().map(|(r, _)| r.dp_rank),
                );
            }
            Record::Direct { events } => self.events(p, events, out),
            Record::Clear {
                worker_id,
                dp_ranks,
            } => self.clear(p, *worker_id, dp_ranks),
            Record::Removed { worker_id } => {
                self.clear(p, *worker_id, &[]);
                self.ranks.remove(worker_id);
                self.marks.retain(|k, _| k.0 != *worker_id);
            }
            Record::Gap { .. } => {}
        }
    }
}

/// Notes batch `last` (seq, digest) of stream `key` as the stream's place, with the DP
/// ranks it fed (the journal's writer and the restore keep places alike).
pub(crate) fn note_place(
    marks: &mut HashMap<(WorkerId, u32), StreamResume>,
    key: (WorkerId, u32),
    last: (u64, u64),
    ranks: impl IntoIterator<Item = u32>,
) {
    let mark = marks.entry(key).or_insert_with(|| StreamResume {
        worker_id: key.0,
        stream: key.1,
        last: None,
        dp_ranks: Vec::new(),
    });
    mark.last = Some(last);
    for r in ranks {
        if !mark.dp_ranks.contains(&r) && mark.dp_ranks.len() < kvr::MAX_DP_SIZE as usize {
            mark.dp_ranks.push(r);
        }
    }
}
