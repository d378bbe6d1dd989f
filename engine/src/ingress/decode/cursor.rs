//! The reader: a `Copy` position in the payload over `rmp`'s low-level reader, with the
//! checked reads every decoder goes through (length prefixes checked against the bytes
//! left, an iterative skipper for unknown values, checked arithmetic).

use rmp::decode::bytes::BytesReadError;
use rmp::decode::{self as rd, Bytes, NumValueReadError, RmpRead, ValueReadError};
use rmp::Marker;

use super::error::{DecodeError, DecodeErrorKind as K, Result};

/// A position in the payload. `Copy`, so a probe can read ahead and be dropped.
#[derive(Clone, Copy)]
pub(super) struct Cursor<'a> {
    rd: Bytes<'a>,
}

#[cold]
fn value_err(e: ValueReadError<BytesReadError>, kind: K, detail: &'static str) -> DecodeError {
    match e {
        ValueReadError::InvalidMarkerRead(_) | ValueReadError::InvalidDataRead(_) => {
            DecodeError::truncated()
        }
        ValueReadError::TypeMismatch(_) => DecodeError::new(kind, detail),
    }
}

#[cold]
fn num_err(e: NumValueReadError<BytesReadError>, kind: K, detail: &'static str) -> DecodeError {
    match e {
        NumValueReadError::InvalidMarkerRead(_) | NumValueReadError::InvalidDataRead(_) => {
            DecodeError::truncated()
        }
        NumValueReadError::TypeMismatch(_) | NumValueReadError::OutOfRange => {
            DecodeError::new(kind, detail)
        }
    }
}

fn is_int(m: Marker) -> bool {
    matches!(
        m,
        Marker::FixPos(_)
            | Marker::FixNeg(_)
            | Marker::U8
            | Marker::U16
            | Marker::U32
            | Marker::U64
            | Marker::I8
            | Marker::I16
            | Marker::I32
            | Marker::I64
    )
}

impl<'a> Cursor<'a> {
    pub(super) fn new(payload: &'a [u8]) -> Self {
        Self {
            rd: Bytes::new(payload),
        }
    }

    pub(super) fn remaining(&self) -> usize {
        self.rd.remaining_slice().len()
    }

    /// The next value's marker, not consumed.
    pub(super) fn peek(&self) -> Result<Marker> {
        match self.rd.remaining_slice().first() {
            Some(&b) => Ok(Marker::from_u8(b)),
            None => Err(DecodeError::truncated()),
        }
    }

    pub(super) fn marker(&mut self) -> Result<Marker> {
        rd::read_marker(&mut self.rd).map_err(|_| DecodeError::truncated())
    }

    /// Consumes `n` bytes.
    pub(super) fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        let rest = self.rd.remaining_slice();
        if n > rest.len() {
            return Err(DecodeError::truncated());
        }
        let (head, tail) = rest.split_at(n);
        self.rd = Bytes::new(tail);
        Ok(head)
    }

    pub(super) fn be<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut buf = [0u8; N];
        self.rd
            .read_exact_buf(&mut buf)
            .map_err(|_| DecodeError::truncated())?;
        Ok(buf)
    }

    /// Consumes a nil if one is next.
    pub(super) fn take_nil(&mut self) -> Result<bool> {
        if self.peek()? == Marker::Null {
            self.bytes(1)?;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// An array header; its length is at most the bytes left (each element takes ≥ 1).
    pub(super) fn array_len(&mut self, kind: K, detail: &'static str) -> Result<usize> {
        let n = rd::read_array_len(&mut self.rd).map_err(|e| value_err(e, kind, detail))?;
        let n = usize::try_from(n).map_err(|_| DecodeError::truncated())?;
        if n > self.remaining() {
            return Err(DecodeError::new(
                K::Truncated,
                "array length exceeds the remaining payload",
            ));
        }
        Ok(n)
    }

    /// A map header; its 2·len keys and values fit in the bytes left.
    pub(super) fn map_len(&mut self, kind: K, detail: &'static str) -> Result<usize> {
        let n = rd::read_map_len(&mut self.rd).map_err(|e| value_err(e, kind, detail))?;
        let n = usize::try_from(n).map_err(|_| DecodeError::truncated())?;
        if n.saturating_mul(2) > self.remaining() {
            return Err(DecodeError::new(
                K::Truncated,
                "map length exceeds the remaining payload",
            ));
        }
        Ok(n)
    }

    /// A str's raw bytes (not UTF-8 checked).
    pub(super) fn str_bytes(&mut self, kind: K, detail: &'static str) -> Result<&'a [u8]> {
        let n = rd::read_str_len(&mut self.rd).map_err(|e| value_err(e, kind, detail))?;
        let n = usize::try_from(n).map_err(|_| DecodeError::truncated())?;
        self.bytes(n)
    }

    /// A map key: `Some(bytes)` if it is a str, `None` (consumed) otherwise.
    pub(super) fn key(&mut self) -> Result<Option<&'a [u8]>> {
        match self.peek()? {
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => {
                self.str_bytes(K::FieldType, "map key").map(Some)
            }
            _ => {
                self.skip_values(1)?;
                Ok(None)
            }
        }
    }

    /// `str|nil`, UTF-8 checked.
    pub(super) fn opt_str(&mut self, detail: &'static str) -> Result<Option<&'a str>> {
        if self.take_nil()? {
            return Ok(None);
        }
        let b = self.str_bytes(K::FieldType, detail)?;
        std::str::from_utf8(b)
            .map(Some)
            .map_err(|_| DecodeError::new(K::FieldType, detail))
    }

    /// `int|nil`, any width and sign.
    pub(super) fn opt_int(&mut self, detail: &'static str) -> Result<()> {
        let m = self.peek()?;
        if m == Marker::Null || is_int(m) {
            self.skip_values(1)
        } else {
            Err(DecodeError::new(K::FieldType, detail))
        }
    }

    /// `int|nil` as a u32: `None` for nil; an int outside u32 (negative, too large) reads
    /// as `u32::MAX`.
    pub(super) fn opt_u32_saturating(&mut self, detail: &'static str) -> Result<Option<u32>> {
        let m = self.peek()?;
        if m == Marker::Null {
            self.skip_values(1)?;
            return Ok(None);
        }
        if !is_int(m) {
            return Err(DecodeError::new(K::FieldType, detail));
        }
        let mut probe = *self;
        match rd::read_int::<u32, _>(&mut probe.rd) {
            Ok(v) => {
                *self = probe;
                Ok(Some(v))
            }
            Err(_) => {
                self.skip_values(1)?;
                Ok(Some(u32::MAX))
            }
        }
    }

    pub(super) fn u32(&mut self, kind: K, detail: &'static str) -> Result<u32> {
        rd::read_int::<u32, _>(&mut self.rd).map_err(|e| num_err(e, kind, detail))
    }

    /// A number as f64: f64, f32 or any int.
    pub(super) fn float(&mut self, kind: K, detail: &'static str) -> Result<f64> {
        match self.peek()? {
            Marker::F64 => rd::read_f64(&mut self.rd).map_err(|e| value_err(e, kind, detail)),
            Marker::F32 => rd::read_f32(&mut self.rd)
                .map(f64::from)
                .map_err(|e| value_err(e, kind, detail)),
            Marker::U64 => rd::read_int::<u64, _>(&mut self.rd)
                .map(|v| v as f64)
                .map_err(|e| num_err(e, kind, detail)),
            m if is_int(m) => rd::read_int::<i64, _>(&mut self.rd)
                .map(|v| v as f64)
                .map_err(|e| num_err(e, kind, detail)),
            _ => Err(DecodeError::new(kind, detail)),
        }
    }

    /// An engine block hash: uint64 as is, int64 as its two's-complement bits, bin folded
    /// to its last 8 bytes big-endian (shorter bins left-padded with zeros).
    pub(super) fn hash(&mut self) -> Result<u64> {
        const DETAIL: &str = "block hash is not uint64, int64 or bin";
        match self.peek()? {
            Marker::FixPos(_) | Marker::U8 | Marker::U16 | Marker::U32 | Marker::U64 => {
                rd::read_int::<u64, _>(&mut self.rd).map_err(|e| num_err(e, K::HashType, DETAIL))
            }
            Marker::FixNeg(_) | Marker::I8 | Marker::I16 | Marker::I32 | Marker::I64 => {
                rd::read_int::<i64, _>(&mut self.rd)
                    .map(|v| v as u64)
                    .map_err(|e| num_err(e, K::HashType, DETAIL))
            }
            Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
                let n = rd::read_bin_len(&mut self.rd)
                    .map_err(|e| value_err(e, K::HashType, DETAIL))?;
                let n = usize::try_from(n).map_err(|_| DecodeError::truncated())?;
                let bin = self.bytes(n)?;
                let tail = &bin[n.saturating_sub(8)..];
                let mut b = [0u8; 8];
                b[8 - tail.len()..].copy_from_slice(tail);
                Ok(u64::from_be_bytes(b))
            }
            _ => Err(DecodeError::new(K::HashType, DETAIL)),
        }
    }

    /// An array of u32 token ids, appended to `dst`.
    pub(super) fn tokens(&mut self, dst: &mut Vec<u32>, detail: &'static str) -> Result<()> {
        let n = self.array_len(K::FieldType, detail)?;
        // The unsigned encodings a publisher writes, read straight from the slice (a
        // token per one to five bytes); anything else (a signed encoding, a wrong type, the
        // end of the payload) goes through rmp's checked read, which decides.
        let bytes = self.rd.remaining_slice();
        // Every token takes at least a byte: a count past the payload reserves no more.
        dst.reserve(n.min(bytes.len()));
        let mut at = 0;
        let mut done = 0;
        // While 8 bytes are left, without a branch on the encoding: each marker byte's
        // length, and the shift and mask that take its value out of the 8 bytes read from
        // it (random token ids mix three encodings, and a branch on each mispredicted).
        while done < n && at + 8 <= bytes.len() {
            let m = usize::from(bytes[at]);
            let (len, shift, mask) = (TOKEN_LEN[m], TOKEN_SHIFT[m], TOKEN_MASK[m]);
            if len == 0 {
                break; // not an unsigned encoding: the checked path below decides
            }
            let mut word = [0u8; 8];
            word.copy_from_slice(&bytes[at..at + 8]);
            dst.push((u64::from_be_bytes(word) >> shift) as u32 & mask);
            at += usize::from(len);
            done += 1;
        }
        while done < n {
            let t = match bytes.get(at) {
                Some(&m @ 0x00..=0x7f) => {
                    at += 1;
                    u32::from(m)
                }
                Some(0xcc) if at + 2 <= bytes.len() => {
                    at += 2;
                    u32::from(bytes[at - 1])
                }
                Some(0xcd) if at + 3 <= bytes.len() => {
                    at += 3;
                    u32::from(u16::from_be_bytes([bytes[at - 2], bytes[at - 1]]))
                }
                Some(0xce) if at + 5 <= bytes.len() => {
                    at += 5;
                    u32::from_be_bytes([bytes[at - 4], bytes[at - 3], bytes[at - 2], bytes[at - 1]])
                }
                _ => break,
            };
            dst.push(t);
            done += 1;
        }
        self.rd = Bytes::new(&bytes[at..]);
        for _ in done..n {
            let t = self.u32(K::FieldType, "token id is not a u32")?;
            dst.push(t);
        }
        Ok(())
    }

    /// Skips `n` complete values of any type. Iterative: `pending` counts the values still
    /// to skip (containers add their elements), so nesting depth costs no stack; `pending`
    /// never exceeds the bytes left, as every value takes at least one byte.
    /// One entry of a block's `extra_keys`, as its key value (`crate::hash::extra`'s
    /// event rules: a str is a cache salt — the caller drops the LoRA name's — bytes a
    /// prompt-embeddings digest, `[str, int]` a multimodal input and its offset, any other
    /// value opaque); `None` for nil.
    pub(super) fn extra_key(&mut self) -> Result<Option<u64>> {
        use crate::hash::extra::{cache_salt_key, mm_key, opaque_key, prompt_embeds_key};
        let start = self.rd.remaining_slice();
        match self.peek()? {
            Marker::Null => {
                self.bytes(1)?;
                return Ok(None);
            }
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => {
                let s = self.str_bytes(K::FieldType, "extra key")?;
                return Ok(Some(cache_salt_key(s)));
            }
            Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
                let n = rd::read_bin_len(&mut self.rd)
                    .map_err(|e| value_err(e, K::FieldType, "extra key"))?;
                let n = usize::try_from(n).map_err(|_| DecodeError::truncated())?;
                return Ok(Some(prompt_embeds_key(self.bytes(n)?)));
            }
            Marker::FixArray(2) | Marker::Array16 | Marker::Array32 => {
                let mut probe = *self;
                let pair = (|| {
                    if rd::read_array_len(&mut probe.rd).ok()? != 2 {
                        return None;
                    }
                    let id = probe.str_bytes(K::FieldType, "").ok()?;
                    let offset = rd::read_int::<i64, _>(&mut probe.rd).ok()?;
                    Some(mm_key(id, offset))
                })();
                if let Some(v) = pair {
                    *self = probe;
                    return Ok(Some(v));
                }
            }
            _ => {}
        }
        self.skip_values(1)?;
        let used = start.len() - self.remaining();
        Ok(Some(opaque_key(&start[..used])))
    }

    pub(super) fn skip_values(&mut self, n: usize) -> Result<()> {
        let mut pending = n;
        while pending > 0 {
            if pending > self.remaining() {
                return Err(DecodeError::new(
                    K::Truncated,
                    "container length exceeds the remaining payload",
                ));
            }
            pending -= 1;
            let (data, children): (usize, usize) = match self.marker()? {
                Marker::FixPos(_)
                | Marker::FixNeg(_)
                | Marker::Null
                | Marker::True
                | Marker::False => (0, 0),
                Marker::U8 | Marker::I8 => (1, 0),
                Marker::U16 | Marker::I16 => (2, 0),
                Marker::U32 | Marker::I32 | Marker::F32 => (4, 0),
                Marker::U64 | Marker::I64 | Marker::F64 => (8, 0),
                Marker::FixStr(l) => (usize::from(l), 0),
                Marker::Str8 | Marker::Bin8 => (usize::from(self.be::<1>()?[0]), 0),
                Marker::Str16 | Marker::Bin16 => (usize::from(u16::from_be_bytes(self.be()?)), 0),
                Marker::Str32 | Marker::Bin32 => (self.len32()?, 0),
                Marker::FixArray(l) => (0, usize::from(l)),
                Marker::Array16 => (0, usize::from(u16::from_be_bytes(self.be()?))),
                Marker::Array32 => (0, self.len32()?),
                Marker::FixMap(l) => (0, usize::from(l) * 2),
                Marker::Map16 => (0, usize::from(u16::from_be_bytes(self.be()?)) * 2),
                Marker::Map32 => (0, self.len32()?.saturating_mul(2)),
                // Ext: a type byte, then the data.
                Marker::FixExt1 => (2, 0),
                Marker::FixExt2 => (3, 0),
                Marker::FixExt4 => (5, 0),
                Marker::FixExt8 => (9, 0),
                Marker::FixExt16 => (17, 0),
                Marker::Ext8 => (usize::from(self.be::<1>()?[0]) + 1, 0),
                Marker::Ext16 => (usize::from(u16::from_be_bytes(self.be()?)) + 1, 0),
                Marker::Ext32 => (self.len32()?.saturating_add(1), 0),
                Marker::Reserved => {
                    return Err(DecodeError::new(
                        K::FieldType,
                        "reserved msgpack marker 0xc1",
                    ))
                }
            };
            self.bytes(data)?;
            pending = pending.saturating_add(children);
        }
        Ok(())
    }

    fn len32(&mut self) -> Result<usize> {
        usize::try_from(u32::from_be_bytes(self.be()?)).map_err(|_| DecodeError::truncated())
    }
}

/// Per msgpack marker byte, for the unsigned encodings a token id takes (a positive
/// fixint, `uint8`, `uint16`, `uint32`): the bytes the value occupies with its marker
/// (0 for any other marker), and how to take the value out of the 8 big-endian bytes
/// starting at the marker (shift right, then mask).
const TOKEN_LEN: [u8; 256] = token_table().0;
const TOKEN_SHIFT: [u8; 256] = token_table().1;
const TOKEN_MASK: [u32; 256] = token_table().2;

const fn token_table() -> ([u8; 256], [u8; 256], [u32; 256]) {
    let (mut len, mut shift, mut mask) = ([0u8; 256], [0u8; 256], [0u32; 256]);
    let mut m = 0;
    while m < 256 {
        let (l, s, k) = match m {
            0x00..=0x7f => (1, 56, 0xff),
            0xcc => (2, 48, 0xff),
            0xcd => (3, 40, 0xffff),
            0xce => (5, 24, 0xffff_ffff),
            _ => (0, 0, 0),
        };
        len[m] = l;
        shift[m] = s;
        mask[m] = k;
        m += 1;
    }
    (len, shift, mask)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Long arrays of every unsigned encoding in random order, each value in any encoding
    /// wide enough (a publisher may write 5 as a `uint32`): the fast paths and the tail
    /// give exactly the values written.
    #[test]
    fn long_token_arrays_of_mixed_encodings_read_back() {
        let mut state = 0x1234_5678_9abc_def0u64;
        let mut next = move || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z ^ (z >> 27)
        };
        for len in [0usize, 1, 7, 8, 9, 100, 1_000] {
            let mut want = Vec::new();
            let mut payload = Vec::new();
            rmp::encode::write_array_len(&mut payload, len as u32).unwrap();
            for _ in 0..len {
                let r = next();
                let t = match r % 4 {
                    0 => (r >> 8) as u32 % 128,
                    1 => (r >> 8) as u32 % 256,
                    2 => (r >> 8) as u32 % 65_536,
                    _ => (r >> 8) as u32,
                };
                match (r >> 40) % 4 {
                    0 if t < 128 => rmp::encode::write_pfix(&mut payload, t as u8).unwrap(),
                    1 if t < 256 => rmp::encode::write_u8(&mut payload, t as u8).unwrap(),
                    2 if t < 65_536 => rmp::encode::write_u16(&mut payload, t as u16).unwrap(),
                    _ => rmp::encode::write_u32(&mut payload, t).unwrap(),
                }
                want.push(t);
            }
            payload.extend_from_slice(&[0xc0, 0xc0]); // what follows stays unread
            let mut c = Cursor::new(&payload);
            let mut got = Vec::new();
            c.tokens(&mut got, "x").unwrap();
            assert_eq!(got, want, "{len} tokens");
            assert_eq!(c.remaining(), 2);
        }
    }

    /// The slice fast path and rmp's checked read agree on every encoding of a token.
    #[test]
    fn token_arrays_read_as_the_checked_reader_does() {
        let checked = |payload: &[u8]| -> Result<Vec<u32>> {
            let mut c = Cursor::new(payload);
            let n = c.array_len(K::FieldType, "x")?;
            (0..n)
                .map(|_| c.u32(K::FieldType, "token id is not a u32"))
                .collect()
        };
        let fast = |payload: &[u8]| -> Result<(Vec<u32>, usize)> {
            let mut c = Cursor::new(payload);
            let mut v = Vec::new();
            c.tokens(&mut v, "x")?;
            Ok((v, c.remaining()))
        };
        let mut mixed = Vec::new();
        rmp::encode::write_array_len(&mut mixed, 9).unwrap();
        for t in [
            0u64,
            127,
            128,
            255,
            256,
            65_535,
            65_536,
            u64::from(u32::MAX),
            5,
        ] {
            rmp::encode::write_uint(&mut mixed, t).unwrap();
        }
        mixed.push(0xc0); // a value after the array stays unread
        let (v, left) = fast(&mixed).unwrap();
        assert_eq!(v, checked(&mixed).unwrap());
        assert_eq!(left, 1);
        // Signed encodings of non-negative values, negative ones, a u64, a string, and
        // every truncation: the same answer either way.
        let mut odd = Vec::new();
        rmp::encode::write_array_len(&mut odd, 4).unwrap();
        rmp::encode::write_u8(&mut odd, 3).unwrap();
        rmp::encode::write_i16(&mut odd, 300).unwrap();
        rmp::encode::write_i8(&mut odd, 4).unwrap();
        rmp::encode::write_u32(&mut odd, 70_000).unwrap();
        for bad in [
            {
                let mut b = odd.clone();
                b[1] = 0xd0; // i8 ...
                b[2] = 0xff; // ... -1
                b
            },
            {
                let mut b = odd.clone();
                rmp::encode::write_u64(&mut b, 1 << 40).unwrap();
                b[0] = 0x95;
                b
            },
            {
                let mut b = odd.clone();
                b.extend_from_slice(&[0xa1, b'x']);
                b[0] = 0x95;
                b
            },
        ]
        .into_iter()
        .chain([odd.clone()])
        {
            for cut in 0..=bad.len() {
                let p = &bad[..cut];
                match (fast(p), checked(p)) {
                    (Ok((v, _)), Ok(w)) => assert_eq!(v, w, "{p:?}"),
                    (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "{p:?}"),
                    (a, b) => panic!("{p:?}: fast {:?} vs checked {:?}", a.is_ok(), b.is_ok()),
                }
            }
        }
    }
}
