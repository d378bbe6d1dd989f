//! The io_uring backend: one small ring and one registered (fixed) buffer per [`super::Io`].
//!
//! A write of several pieces is one submission: a chain of write SQEs linked to a
//! data-only `fsync`, so the sync runs only after every write completed in full. Each
//! completion is checked: a negative result is an error (`EINTR`/`EAGAIN`, and the
//! `ECANCELED` of the links after a short write, are retried from where the data stopped);
//! a short write continues with the rest in a new submission.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use io_uring::{opcode, squeue, types, IoUring, Probe};

use super::Failed;

/// Submission queue entries (the completion queue is twice as large).
const ENTRIES: u32 = 64;
/// Writes per submission: one entry is kept for the sync that closes the chain.
const WRITES_PER_ROUND: usize = ENTRIES as usize - 1;
/// The largest write one SQE carries (its length is a `u32`).
const MAX_SQE_BYTES: usize = 1 << 30;
/// Consecutive submissions that moved nothing forward before giving up.
const MAX_IDLE_ROUNDS: u32 = 64;

/// Bytes to write: from the registered buffer (`WriteFixed`) or from the caller's memory.
#[derive(Clone, Copy, Debug)]
pub(super) struct Piece {
    ptr: *const u8,
    len: usize,
    fixed: bool,
}

/// A ring and its registered buffer.
pub(super) struct Ring {
    // Declared before `fixed`: the ring (and the kernel's registration) goes first.
    ring: IoUring,
    fixed: Box<[u8]>,
    /// Tags the completions of one submission (user data `round << 16 | index`), so a
    /// completion left over from a failed call is never taken for a current one.
    round: u64,
    /// Set when `io_uring_enter` failed with entries possibly still queued or in flight:
    /// the ring is not used again (a later submission could carry stale entries).
    broken: Option<String>,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("entries", &ENTRIES)
            .field("fixed_bytes", &self.fixed.len())
            .finish()
    }
}

impl Ring {
    /// Creates the ring, checks that the kernel has the operations used, registers a
    /// `fixed_len` buffer and runs a no-op through the ring (a filter that lets the ring
    /// be set up but blocks `io_uring_enter` is caught here). The error names the step.
    pub(super) fn probe(fixed_len: usize) -> Result<Ring, Failed> {
        let ring = IoUring::new(ENTRIES).map_err(|e| ("io_uring_setup", e))?;
        let mut probe = Probe::new();
        ring.submitter()
            .register_probe(&mut probe)
            .map_err(|e| ("io_uring_register (probe)", e))?;
        for (code, name) in [
            (opcode::Write::CODE, "IORING_OP_WRITE"),
            (opcode::WriteFixed::CODE, "IORING_OP_WRITE_FIXED"),
            (opcode::Fsync::CODE, "IORING_OP_FSYNC"),
            (opcode::Nop::CODE, "IORING_OP_NOP"),
        ] {
            if !probe.is_supported(code) {
                let e = io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("the kernel's io_uring lacks {name}"),
                );
                return Err(("io_uring_register (probe)", e));
            }
        }
        let fixed = vec![0u8; fixed_len].into_boxed_slice();
        let iov = libc::iovec {
            iov_base: fixed.as_ptr() as *mut libc::c_void,
            iov_len: fixed.len(),
        };
        // SAFETY: `iov` describes `fixed`, a heap allocation owned by the returned `Ring`
        // that is never reallocated or freed before the ring (field order: the ring is
        // dropped first, which unregisters it). The kernel pins its pages for as long as
        // the registration lasts.
        unsafe { ring.submitter().register_buffers(&[iov]) }
            .map_err(|e| ("io_uring_register (buffers)", e))?;
        let mut r = Ring {
            ring,
            fixed,
            round: 0,
            broken: None,
        };
        r.nop().map_err(|e| ("io_uring_enter", e))?;
        Ok(r)
    }

    /// The registered buffer, to stage bytes in before [`Ring::write_fixed`].
    pub(super) fn fixed_mut(&mut self) -> &mut [u8] {
        &mut self.fixed
    }

    fn nop(&mut self) -> io::Result<()> {
        self.round += 1;
        let e = opcode::Nop::new().build().user_data(self.round << 16);
        // SAFETY: a no-op references no memory.
        unsafe { self.ring.submission().push(&e) }
            .map_err(|_| io::Error::other("submission queue full"))?;
        let res = self.complete(1)?;
        match res[0] {
            r if r < 0 => Err(io::Error::from_raw_os_error(-r)),
            _ => Ok(()),
        }
    }

    /// Writes the first `len` bytes of the registered buffer at `off`, then syncs the
    /// file's data if `sync` (linked: in the same submission).
    pub(super) fn write_fixed(
        &mut self,
        file: &File,
        off: u64,
        len: usize,
        sync: bool,
    ) -> Result<(), Failed> {
        let piece = Piece {
            ptr: self.fixed.as_ptr(),
            len: len.min(self.fixed.len()),
            fixed: true,
        };
        self.write(file, off, &[piece], sync)
    }

    /// Writes `bufs` (the caller's memory) one after another at `off`, then syncs the
    /// file's data if `sync`.
    pub(super) fn write_bufs(
        &mut self,
        file: &File,
        off: u64,
        bufs: &[&[u8]],
        sync: bool,
    ) -> Result<(), Failed> {
        let pieces: Vec<Piece> = bufs
            .iter()
            .map(|b| Piece {
                ptr: b.as_ptr(),
                len: b.len(),
                fixed: false,
            })
            .collect();
        self.write(file, off, &pieces, sync)
    }

    /// Submits every piece (in rounds of at most [`WRITES_PER_ROUND`] linked writes, the
    /// last round's chain ending in a data sync when `sync`) until all are written.
    ///
    /// Every piece must stay valid until this returns: it waits for every completion of
    /// each submission before the next, and before returning.
    fn write(
        &mut self,
        file: &File,
        mut off: u64,
        pieces: &[Piece],
        sync: bool,
    ) -> Result<(), Failed> {
        if let Some(why) = &self.broken {
            let e = io::Error::other(format!("the ring failed earlier ({why})"));
            return Err(("io_uring_enter", e));
        }
        let fd = types::Fd(file.as_raw_fd());
        // Where the data not yet written starts: a piece and an offset in it.
        let (mut at, mut within) = (0usize, 0usize);
        let mut idle = 0u32;
        loop {
            // Build one round from the cursor.
            let mut sqes: Vec<squeue::Entry> = Vec::new();
            let mut lens: Vec<usize> = Vec::new();
            let (mut i, mut o, mut pos) = (at, within, off);
            while i < pieces.len() && sqes.len() < WRITES_PER_ROUND {
                let p = pieces[i];
                let n = (p.len - o).min(MAX_SQE_BYTES);
                if n == 0 {
                    (i, o) = (i + 1, 0);
                    continue;
                }
                let ptr = p.ptr.wrapping_add(o);
                let e = if p.fixed {
                    opcode::WriteFixed::new(fd, ptr, n as u32, 0)
                        .offset(pos)
                        .build()
                } else {
                    opcode::Write::new(fd, ptr, n as u32).offset(pos).build()
                };
                sqes.push(e);
                lens.push(n);
                pos += n as u64;
                o += n;
                if o == p.len {
                    (i, o) = (i + 1, 0);
                }
            }
            let last_round = i == pieces.len();
            let with_sync = sync && last_round;
            if sqes.is_empty() && !with_sync {
                return Ok(());
            }
            self.round += 1;
            let tag = self.round << 16;
            let writes = sqes.len();
            let mut chain: Vec<squeue::Entry> = sqes
                .into_iter()
                .enumerate()
                .map(|(k, e)| {
                    let linked = with_sync || k + 1 < writes;
                    let e = e.user_data(tag | k as u64);
                    if linked {
                        e.flags(squeue::Flags::IO_LINK)
                    } else {
                        e
                    }
                })
                .collect();
            if with_sync {
                chain.push(
                    opcode::Fsync::new(fd)
                        .flags(types::FsyncFlags::DATASYNC)
                        .build()
                        .user_data(tag | writes as u64),
                );
            }
            // SAFETY: every entry points into a piece the caller keeps valid until this
            // function returns (the registered buffer, owned by `self`, or the caller's
            // slices), and `complete` reaps every completion of this round before we go
            // on. Writes only read that memory. The queue is empty here (each round is
            // reaped in full) and holds `ENTRIES`, more than a round's entries.
            unsafe { self.ring.submission().push_multiple(&chain) }
                .map_err(|_| ("write", io::Error::other("submission queue full")))?;
            let res = match self.complete(chain.len()) {
                Ok(res) => res,
                Err(e) => {
                    self.broken = Some(e.to_string());
                    return Err(("io_uring_enter", e));
                }
            };

            // Move the cursor over what was written, in order.
            let mut moved = 0usize;
            let mut all_written = true;
            for (k, &want) in lens.iter().enumerate() {
                let r = res[k];
                if r > 0 && r as usize >= want {
                    moved += want;
                    continue;
                }
                all_written = false;
                if r > 0 {
                    moved += r as usize; // short: the rest goes in the next round
                } else if r == 0 {
                    let e = io::Error::new(io::ErrorKind::WriteZero, "the write wrote no bytes");
                    return Err(("write", e));
                } else if !retryable(-r) {
                    return Err(("write", io::Error::from_raw_os_error(-r)));
                }
                break;
            }
            advance(pieces, &mut at, &mut within, moved);
            off += moved as u64;
            if all_written && with_sync {
                match res[writes] {
                    0.. => return Ok(()),
                    r if !retryable(-r) => {
                        return Err(("fdatasync", io::Error::from_raw_os_error(-r)))
                    }
                    _ => {} // interrupted: the next round is the sync alone
                }
            }
            if all_written && last_round && !sync {
                return Ok(());
            }
            if moved == 0 {
                idle += 1;
                if idle >= MAX_IDLE_ROUNDS {
                    let e = io::Error::other("io_uring made no progress (retried too often)");
                    return Err(("write", e));
                }
            } else {
                idle = 0;
            }
        }
    }

    /// Submits what is queued and waits for the `n` completions of the current round,
    /// returned by index. Completions of other rounds are dropped.
    fn complete(&mut self, n: usize) -> io::Result<Vec<i32>> {
        let mut res = vec![0i32; n];
        let mut got = 0usize;
        loop {
            for cqe in self.ring.completion() {
                let ud = cqe.user_data();
                let k = (ud & 0xffff) as usize;
                if ud >> 16 == self.round && k < n {
                    res[k] = cqe.result();
                    got += 1;
                }
            }
            if got >= n {
                return Ok(res);
            }
            match self.ring.submit_and_wait(n - got) {
                Ok(_) => {}
                Err(e) if e.raw_os_error().is_some_and(retryable) => {}
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// Errors a submission is retried after: a signal, a busy queue, a link cut by a short
/// write before it.
fn retryable(errno: i32) -> bool {
    errno == libc::EINTR || errno == libc::EAGAIN || errno == libc::ECANCELED
}

/// Moves the cursor `(at, within)` over `n` bytes of `pieces`.
fn advance(pieces: &[Piece], at: &mut usize, within: &mut usize, mut n: usize) {
    while n > 0 && *at < pieces.len() {
        let step = (pieces[*at].len - *within).min(n);
        *within += step;
        n -= step;
        if *within == pieces[*at].len {
            (*at, *within) = (*at + 1, 0);
        }
    }
}
