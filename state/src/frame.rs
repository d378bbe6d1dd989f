//! Frames: `[length: u32 LE][crc32 of the payload: u32 LE][payload]`.
//!
//! A reader stops at the first frame that is incomplete (a torn write at the end of a
//! file) or whose checksum does not match (a flipped bit, a block of zeros): what comes
//! before is valid, what comes after is not trusted. [`MAX_FRAME`] bounds a frame, so a
//! corrupt length can never ask for an absurd allocation.

/// The largest payload a frame may hold (64 MiB).
pub const MAX_FRAME: usize = 64 << 20;

/// Bytes before a frame's payload.
pub const FRAME_HEAD: usize = 8;

/// Appends a frame holding `payload` to `out`.
///
/// # Panics
/// If `payload` is longer than [`MAX_FRAME`] (a writer's bug: writers split their data).
pub fn put_frame(out: &mut Vec<u8>, payload: &[u8]) {
    assert!(
        payload.len() <= MAX_FRAME,
        "frame of {} bytes",
        payload.len()
    );
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    out.extend_from_slice(payload);
}

/// Why a reader stopped before the end of its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameStop {
    /// Fewer bytes left than a frame head, or than the frame's length says: a torn tail.
    Truncated,
    /// The frame's length is over [`MAX_FRAME`].
    TooLong,
    /// The payload's checksum does not match.
    Checksum,
}

impl FrameStop {
    /// A stable name, for counters and messages.
    pub fn name(self) -> &'static str {
        match self {
            FrameStop::Truncated => "truncated",
            FrameStop::TooLong => "frame_too_long",
            FrameStop::Checksum => "checksum",
        }
    }
}

/// Reads frames from a byte slice, in order.
#[derive(Debug)]
pub struct Frames<'a> {
    bytes: &'a [u8],
    at: usize,
    stop: Option<FrameStop>,
}

impl<'a> Frames<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Frames {
            bytes,
            at: 0,
            stop: None,
        }
    }

    /// Bytes read as whole valid frames so far: where a torn or corrupt tail starts.
    pub fn valid_len(&self) -> usize {
        self.at
    }

    /// Why reading stopped before the end (`None`: at the end, or not stopped yet).
    pub fn stop(&self) -> Option<FrameStop> {
        self.stop
    }
}

impl<'a> Iterator for Frames<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        if self.stop.is_some() || self.at == self.bytes.len() {
            return None;
        }
        let rest = &self.bytes[self.at..];
        let fail = |s: &mut Self, why| {
            s.stop = Some(why);
            None
        };
        if rest.len() < FRAME_HEAD {
            return fail(self, FrameStop::Truncated);
        }
        let len = u32::from_le_bytes(rest[0..4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(rest[4..8].try_into().expect("4 bytes"));
        if len > MAX_FRAME {
            return fail(self, FrameStop::TooLong);
        }
        if rest.len() - FRAME_HEAD < len {
            return fail(self, FrameStop::Truncated);
        }
        let payload = &rest[FRAME_HEAD..FRAME_HEAD + len];
        if crc32fast::hash(payload) != crc {
            return fail(self, FrameStop::Checksum);
        }
        self.at += FRAME_HEAD + len;
        Some(payload)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn three() -> Vec<u8> {
        let mut b = Vec::new();
        for p in [&b"alpha"[..], b"", b"gamma and more"] {
            put_frame(&mut b, p);
        }
        b
    }

    #[test]
    fn frames_round_trip() {
        let b = three();
        let mut f = Frames::new(&b);
        let got: Vec<&[u8]> = f.by_ref().collect();
        assert_eq!(got, vec![&b"alpha"[..], b"", b"gamma and more"]);
        assert_eq!((f.valid_len(), f.stop()), (b.len(), None));
    }

    #[test]
    fn every_torn_tail_is_cut_at_the_last_whole_frame() {
        let b = three();
        let ends = [0, 13, 21, b.len()];
        for cut in 0..b.len() {
            let mut f = Frames::new(&b[..cut]);
            let n = f.by_ref().count();
            let whole = ends.iter().filter(|&&e| e <= cut).count() - 1;
            assert_eq!(n, whole, "cut at {cut}");
            assert_eq!(f.valid_len(), ends[whole]);
            let torn = !ends.contains(&cut);
            assert_eq!(
                f.stop(),
                torn.then_some(FrameStop::Truncated),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn every_flipped_bit_is_caught() {
        let b = three();
        for i in 0..b.len() * 8 {
            let mut c = b.clone();
            c[i / 8] ^= 1 << (i % 8);
            let mut f = Frames::new(&c);
            let got: Vec<&[u8]> = f.by_ref().collect();
            // Never a wrong payload: only a prefix of the true frames.
            let truth = [&b"alpha"[..], b"", b"gamma and more"];
            assert!(
                got.len() < 3 && got[..] == truth[..got.len()],
                "bit {i}: {got:?}"
            );
            assert!(f.stop().is_some(), "bit {i}");
        }
    }

    #[test]
    fn an_absurd_length_is_refused_before_allocating() {
        let mut b = Vec::new();
        b.extend_from_slice(&u32::MAX.to_le_bytes());
        b.extend_from_slice(&[0; 12]);
        let mut f = Frames::new(&b);
        assert_eq!(f.next(), None);
        assert_eq!(f.stop(), Some(FrameStop::TooLong));
    }
}
