//! The state files' disk I/O, through both backends: appends read back byte for byte
//! (across reopening and truncation), snapshots replace a file whole or not at all, and a
//! full disk, a path that cannot be a directory, a read-only mount and a sandbox that
//! refuses io_uring give errors, never a panic or a damaged file.
//!
//! The io_uring cases skip (saying why) only where this machine cannot make a ring; set
//! `KVR_REQUIRE_URING=1` to make that a failure. The tmpfs cases mount a small tmpfs
//! (as root) and skip, saying why, where mounting is refused.

use std::fs;

use kvr_state::io::{AppendFile, Backend, Io, IoMode, STAGE_BYTES};

mod common;
use common::{TempDir, Tmpfs};

/// Plain always; io_uring unless this machine cannot make a ring (printed).
fn backends() -> Vec<Io> {
    let mut v = vec![Io::new(IoMode::Plain).unwrap()];
    match Io::new(IoMode::Uring) {
        Ok(io) => v.push(io),
        Err(e) => {
            assert!(
                std::env::var_os("KVR_REQUIRE_URING").is_none(),
                "io_uring required: {e}"
            );
            eprintln!("skipping the io_uring backend: {e}");
        }
    }
    v
}

/// Distinct, recognisable bytes (a position-dependent pattern catches misplaced writes).
fn bytes(seed: u64, n: usize) -> Vec<u8> {
    (0..n as u64)
        .map(|i| (i.wrapping_mul(31).wrapping_add(seed.wrapping_mul(131)) % 251) as u8)
        .collect()
}

fn append_all(io: &mut Io, f: &mut AppendFile, bufs: &[Vec<u8>], expect: &mut Vec<u8>) {
    let refs: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
    io.append(f, &refs).unwrap();
    for b in bufs {
        expect.extend_from_slice(b);
    }
    assert_eq!(f.len(), expect.len() as u64);
}

#[test]
fn appends_read_back_across_reopen_and_truncate() {
    for mut io in backends() {
        let name = io.backend().name();
        let d = TempDir::new(name);
        let path = d.path().join("p.journal");
        let mut expect = Vec::new();
        let mut f = io.open_append(&path).unwrap();
        assert_eq!(f.len(), 0);
        // Small batches of several buffers (through the stage), one empty.
        for i in 0..20u64 {
            let bufs = vec![bytes(i, 100 + i as usize), Vec::new(), bytes(i + 1000, 7)];
            append_all(&mut io, &mut f, &bufs, &mut expect);
        }
        // A batch larger than the stage (written from the caller's buffers), with more
        // buffers than one submission holds.
        let big: Vec<Vec<u8>> = (0..100u64)
            .map(|i| bytes(i, STAGE_BYTES / 64 + 3))
            .collect();
        append_all(&mut io, &mut f, &big, &mut expect);
        // One buffer larger than the stage.
        append_all(
            &mut io,
            &mut f,
            &[bytes(9, 3 * STAGE_BYTES + 5)],
            &mut expect,
        );
        assert_eq!(fs::read(&path).unwrap(), expect, "{name}: after appends");
        drop(f);

        // Reopened, it continues at the end.
        let mut f = io.open_append(&path).unwrap();
        assert_eq!(f.len(), expect.len() as u64, "{name}");
        append_all(&mut io, &mut f, &[bytes(77, 333)], &mut expect);
        assert_eq!(fs::read(&path).unwrap(), expect, "{name}: after reopen");

        // Cut a "torn tail", then append: the new bytes follow the cut.
        let cut = expect.len() - 200;
        f.truncate(cut as u64).unwrap();
        expect.truncate(cut);
        assert_eq!(f.len(), cut as u64);
        append_all(&mut io, &mut f, &[bytes(5, 50), bytes(6, 60)], &mut expect);
        assert_eq!(fs::read(&path).unwrap(), expect, "{name}: after truncate");
        let e = f.truncate(expect.len() as u64 + 1).unwrap_err();
        assert_eq!(e.op(), "truncate");
        assert_eq!(
            fs::read(&path).unwrap(),
            expect,
            "{name}: a refused truncate"
        );
    }
}

#[test]
fn write_atomic_creates_replaces_and_keeps_the_old_file_on_failure() {
    for mut io in backends() {
        let name = io.backend().name();
        let d = TempDir::new(name);
        // New file, written through the stage in several pieces.
        let first: Vec<Vec<u8>> = (0..5u64).map(|i| bytes(i, STAGE_BYTES / 2 + 11)).collect();
        let n = io
            .write_atomic(d.path(), "p.snapshot", |out| {
                first.iter().for_each(|c| out(c))
            })
            .unwrap();
        assert_eq!(n, first.concat().len() as u64);
        assert_eq!(
            fs::read(d.path().join("p.snapshot")).unwrap(),
            first.concat()
        );
        assert!(!d.path().join("p.snapshot.tmp").exists());

        // Replaces a longer file with a shorter one (no old bytes left past the end).
        let second = bytes(42, 1000);
        io.write_atomic(d.path(), "p.snapshot", |out| out(&second))
            .unwrap();
        assert_eq!(
            fs::read(d.path().join("p.snapshot")).unwrap(),
            second,
            "{name}"
        );

        // A failure (the temporary name cannot be created: a directory is in its way)
        // leaves the previous file as it was.
        fs::create_dir(d.path().join("q.snapshot.tmp")).unwrap();
        fs::write(d.path().join("q.snapshot"), b"old").unwrap();
        let e = io
            .write_atomic(d.path(), "q.snapshot", |out| out(b"new"))
            .unwrap_err();
        assert_eq!(e.op(), "create");
        assert_eq!(fs::read(d.path().join("q.snapshot")).unwrap(), b"old");
        assert!(e.to_string().contains("q.snapshot.tmp"), "{e}");

        // A failure after the temporary file was written (the rename target is a
        // non-empty directory) removes it and leaves the target alone.
        fs::create_dir_all(d.path().join("r.snapshot/inside")).unwrap();
        let e = io
            .write_atomic(d.path(), "r.snapshot", |out| out(b"new"))
            .unwrap_err();
        assert_eq!(e.op(), "rename", "{e}");
        assert!(d.path().join("r.snapshot/inside").is_dir());
        assert!(
            !d.path().join("r.snapshot.tmp").exists(),
            "{name}: tmp left"
        );
    }
}

#[test]
fn a_full_disk_is_an_error_and_leaves_valid_files() {
    for mut io in backends() {
        let name = io.backend().name();
        let fs_ = match Tmpfs::mount(name, "size=64k") {
            Ok(m) => m,
            Err(why) => {
                eprintln!("skipping the full-disk test: {why}");
                return;
            }
        };
        let dir = fs_.path();
        // A small snapshot first, then a journal that fills the disk.
        let snap = bytes(1, 8 << 10);
        io.write_atomic(dir, "p.snapshot", |out| out(&snap))
            .unwrap();
        let path = dir.join("p.journal");
        let mut f = io.open_append(&path).unwrap();
        let mut expect = Vec::new();
        let mut err = None;
        for i in 0..1000u64 {
            let batch = [bytes(i, 3000), bytes(i + 7, 1000)];
            let refs: Vec<&[u8]> = batch.iter().map(Vec::as_slice).collect();
            match io.append(&mut f, &refs) {
                Ok(()) => expect.extend_from_slice(&batch.concat()),
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        let e = err.expect("a 64 KiB tmpfs never filled");
        assert_eq!(
            e.os_error().raw_os_error(),
            Some(libc::ENOSPC),
            "{name}: {e}"
        );
        assert!(e.to_string().contains("p.journal"), "{e}");
        assert!(
            expect.len() > 32 << 10,
            "{name}: only {} bytes fit",
            expect.len()
        );
        // The appended prefix is intact and the failed batch's bytes were cut off.
        assert_eq!(f.len(), expect.len() as u64);
        assert_eq!(fs::read(&path).unwrap(), expect, "{name}");

        // A snapshot that does not fit: an error, the old one stays, no .tmp left.
        let big = bytes(2, 256 << 10);
        let e = io
            .write_atomic(dir, "p.snapshot", |out| big.chunks(10_000).for_each(out))
            .unwrap_err();
        assert_eq!(
            e.os_error().raw_os_error(),
            Some(libc::ENOSPC),
            "{name}: {e}"
        );
        assert_eq!(fs::read(dir.join("p.snapshot")).unwrap(), snap, "{name}");
        assert!(!dir.join("p.snapshot.tmp").exists(), "{name}: tmp left");

        // Space freed: the journal continues right after its valid prefix.
        fs::remove_file(dir.join("p.snapshot")).unwrap();
        let more = bytes(3, 2000);
        io.append(&mut f, &[&more]).unwrap();
        expect.extend_from_slice(&more);
        assert_eq!(
            fs::read(&path).unwrap(),
            expect,
            "{name}: after freeing space"
        );
        drop(f);
    }
}

#[test]
fn paths_that_cannot_be_written_are_errors_naming_them() {
    for mut io in backends() {
        let name = io.backend().name();
        let d = TempDir::new(name);
        // Under a regular file (root ignores permission bits, not this): ENOTDIR.
        let afile = d.path().join("afile");
        fs::write(&afile, b"x").unwrap();
        let bad = afile.join("journal");
        let e = io.open_append(&bad).unwrap_err();
        assert_eq!(e.os_error().raw_os_error(), Some(libc::ENOTDIR), "{e}");
        assert_eq!(e.path(), Some(bad.as_path()));
        assert!(e.to_string().contains(&bad.display().to_string()), "{e}");
        let e = io
            .write_atomic(&afile, "p.snapshot", |out| out(b"x"))
            .unwrap_err();
        assert_eq!(e.os_error().raw_os_error(), Some(libc::ENOTDIR), "{e}");
        assert!(e.to_string().contains("afile"), "{e}");

        // A read-only mount: EROFS.
        match Tmpfs::mount(name, "size=64k,ro") {
            Ok(ro) => {
                let p = ro.path().join("journal");
                let e = io.open_append(&p).unwrap_err();
                assert_eq!(e.os_error().raw_os_error(), Some(libc::EROFS), "{e}");
                assert!(e.to_string().contains("journal"), "{e}");
                let e = io
                    .write_atomic(ro.path(), "s", |out| out(b"x"))
                    .unwrap_err();
                assert_eq!(e.os_error().raw_os_error(), Some(libc::EROFS), "{e}");
            }
            Err(why) => eprintln!("skipping the read-only mount: {why}"),
        }
    }
}

#[test]
fn auto_reports_a_backend_and_plain_does_not_probe() {
    let auto = Io::new(IoMode::Auto).unwrap();
    match Io::new(IoMode::Uring) {
        Ok(_) => {
            assert_eq!(auto.backend(), Backend::Uring);
            assert_eq!(auto.fallback_reason(), None);
        }
        Err(e) => {
            eprintln!("io_uring unavailable here: {e}");
            assert_eq!(auto.backend(), Backend::Plain);
            assert!(auto.fallback_reason().is_some());
        }
    }
    let plain = Io::new(IoMode::Plain).unwrap();
    assert_eq!(
        (plain.backend(), plain.fallback_reason()),
        (Backend::Plain, None)
    );
    // Made where the configuration is read, moved to the writer thread.
    fn send<T: Send>(_: &T) {}
    send(&auto);
    assert_eq!(plain.backend().name(), "plain");
}

/// A sandbox that refuses `io_uring_setup` with `EPERM`, as container runtimes' default
/// seccomp profiles do: a seccomp filter on one thread of this test process.
#[cfg(target_arch = "x86_64")]
#[test]
fn a_refused_io_uring_falls_back_to_plain_with_the_reason() {
    let t = std::thread::spawn(|| {
        if let Err(why) = refuse_io_uring_setup() {
            eprintln!("skipping: cannot install a seccomp filter: {why}");
            return;
        }
        let auto = Io::new(IoMode::Auto).unwrap();
        assert_eq!(auto.backend(), Backend::Plain);
        let why = auto.fallback_reason().expect("a reason");
        assert!(
            why.starts_with("io_uring_setup: Operation not permitted"),
            "{why}"
        );
        let e = Io::new(IoMode::Uring).unwrap_err();
        assert_eq!(e.op(), "io_uring_setup");
        assert_eq!(e.os_error().raw_os_error(), Some(libc::EPERM), "{e}");
        assert!(
            e.to_string()
                .starts_with("io_uring_setup failed: Operation not permitted"),
            "{e}"
        );
        let plain = Io::new(IoMode::Plain).unwrap();
        assert_eq!(plain.fallback_reason(), None);

        // The fallback writes as well.
        let mut io = auto;
        let d = TempDir::new("seccomp");
        let mut f = io.open_append(&d.path().join("j")).unwrap();
        io.append(&mut f, &[b"abc", b"def"]).unwrap();
        assert_eq!(fs::read(d.path().join("j")).unwrap(), b"abcdef");
    });
    t.join().unwrap();
}

/// Installs, on the calling thread only, a seccomp filter under which
/// `io_uring_setup` fails with `EPERM` and every other call is allowed.
#[cfg(target_arch = "x86_64")]
fn refuse_io_uring_setup() -> Result<(), std::io::Error> {
    // Classic BPF over `struct seccomp_data { int nr; u32 arch; ... }`.
    const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
    let stmt = |code: u32, k: u32| libc::sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    };
    let jump = |code: u32, k: u32, jt: u8, jf: u8| libc::sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    };
    let ld = libc::BPF_LD | libc::BPF_W | libc::BPF_ABS;
    let jeq = libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K;
    let ret = libc::BPF_RET | libc::BPF_K;
    let mut prog = [
        stmt(ld, 4),                        // arch
        jump(jeq, AUDIT_ARCH_X86_64, 1, 0), // x86_64: go on
        stmt(ret, libc::SECCOMP_RET_ALLOW), // another ABI: not ours to judge
        stmt(ld, 0),                        // syscall number
        jump(jeq, libc::SYS_io_uring_setup as u32, 0, 1),
        stmt(ret, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32),
        stmt(ret, libc::SECCOMP_RET_ALLOW),
    ];
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_mut_ptr(),
    };
    // SAFETY: PR_SET_NO_NEW_PRIVS takes integer arguments only; it is required before
    // an unprivileged filter and affects this thread (and what it would exec).
    let r = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fprog` points to `prog`, a valid filter that outlives the call (the
    // kernel copies it). Without SECCOMP_FILTER_FLAG_TSYNC it applies to this thread.
    let r = unsafe {
        libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER,
            &fprog as *const libc::sock_fprog,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
