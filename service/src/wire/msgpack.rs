//! The msgpack form of a request body (`Content-Type: application/msgpack`): the same map
//! with the same field names as the JSON body, so that one set of serde types reads both.
//!
//! [`transcode`] walks the msgpack value once (with `rmp`'s markers) and writes it as JSON
//! for serde to read, except the top-level `token_ids`, which it reads straight into a
//! `Vec<u32>` (writing `null` in its place, as the JSON split does): either an array of
//! unsigned integers or a `bin` of little-endian u32s, which is one copy with no per-token
//! parse. The rest of a prompt body is small, so transcoding it costs little and keeps
//! every other field's checks and error texts exactly the JSON body's.
//!
//! Malformed msgpack (truncated, trailing bytes, a reserved marker, a map key that is not a
//! string, a string that is not UTF-8, a non-finite float, `bin` or `ext` anywhere but
//! `token_ids`, nesting deeper than serde_json would read) is a 400; a `token_ids` of the
//! wrong type or out of u32's range is a 422, as the JSON body's is. A declared length is
//! checked against the bytes left before anything is reserved for it, so no allocation is
//! sized by a claim (a token array takes at most four bytes per byte of body).

use rmp::Marker;

/// serde_json's own nesting limit: deeper JSON would be refused anyway.
const MAX_DEPTH: usize = 128;

/// A transcoded body: JSON for serde, and the `token_ids` read natively.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Transcoded {
    pub json: Vec<u8>,
    /// `Some` when the top-level map had a non-nil `token_ids` (and they were asked for).
    pub tokens: Option<Vec<u32>>,
    /// Where `null` stands for them in `json`.
    pub tokens_at: usize,
}

/// Why a msgpack body was refused.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Not well-formed msgpack, or a value JSON has no form for (400).
    Malformed(String),
    /// Well-formed, but `token_ids` has the wrong type (422).
    Type(String),
}

impl Refused {
    fn malformed(what: impl Into<String>) -> Self {
        Refused::Malformed(format!("Failed to parse the msgpack body: {}", what.into()))
    }

    fn tokens(what: impl std::fmt::Display) -> Self {
        Refused::Type(format!(
            "Failed to deserialize the msgpack body: token_ids: {what}"
        ))
    }
}

type Result<T> = std::result::Result<T, Refused>;

/// A read position in the body.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn left(&self) -> usize {
        self.b.len() - self.at
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.left() {
            return Err(Refused::malformed("truncated"));
        }
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn marker(&mut self) -> Result<Marker> {
        Ok(Marker::from_u8(self.take(1)?[0]))
    }

    /// A length that must fit in the bytes left, each item taking at least `min` bytes.
    fn len_of(&mut self, n: usize, min: usize) -> Result<usize> {
        if n.saturating_mul(min) > self.left() {
            return Err(Refused::malformed(format!(
                "a length of {n} exceeds the {} bytes left",
                self.left()
            )));
        }
        Ok(n)
    }

    fn u16(&mut self) -> Result<usize> {
        Ok(usize::from(u16::from_be_bytes(self.be()?)))
    }

    fn u32(&mut self) -> Result<usize> {
        Ok(u32::from_be_bytes(self.be()?) as usize)
    }
}

/// What the next value is, once its header is read.
enum Head {
    Nil,
    Bool(bool),
    Uint(u64),
    Int(i64),
    Float(f64),
    Str(usize),
    Bin(usize),
    Array(usize),
    Map(usize),
    Ext,
}

fn head(r: &mut Reader<'_>) -> Result<Head> {
    Ok(match r.marker()? {
        Marker::Null => Head::Nil,
        Marker::True => Head::Bool(true),
        Marker::False => Head::Bool(false),
        Marker::FixPos(v) => Head::Uint(u64::from(v)),
        Marker::FixNeg(v) => Head::Int(i64::from(v)),
        Marker::U8 => Head::Uint(u64::from(r.be::<1>()?[0])),
        Marker::U16 => Head::Uint(u64::from(u16::from_be_bytes(r.be()?))),
        Marker::U32 => Head::Uint(u64::from(u32::from_be_bytes(r.be()?))),
        Marker::U64 => Head::Uint(u64::from_be_bytes(r.be()?)),
        Marker::I8 => Head::Int(i64::from(i8::from_be_bytes(r.be()?))),
        Marker::I16 => Head::Int(i64::from(i16::from_be_bytes(r.be()?))),
        Marker::I32 => Head::Int(i64::from(i32::from_be_bytes(r.be()?))),
        Marker::I64 => Head::Int(i64::from_be_bytes(r.be()?)),
        Marker::F32 => Head::Float(f64::from(f32::from_be_bytes(r.be()?))),
        Marker::F64 => Head::Float(f64::from_be_bytes(r.be()?)),
        Marker::FixStr(n) => Head::Str(r.len_of(usize::from(n), 1)?),
        Marker::Str8 => Head::Str(r.be::<1>().map(|b| usize::from(b[0]))?),
        Marker::Str16 => Head::Str(r.u16()?),
        Marker::Str32 => Head::Str(r.u32()?),
        Marker::Bin8 => Head::Bin(r.be::<1>().map(|b| usize::from(b[0]))?),
        Marker::Bin16 => Head::Bin(r.u16()?),
        Marker::Bin32 => Head::Bin(r.u32()?),
        Marker::FixArray(n) => Head::Array(usize::from(n)),
        Marker::Array16 => Head::Array(r.u16()?),
        Marker::Array32 => Head::Array(r.u32()?),
        Marker::FixMap(n) => Head::Map(usize::from(n)),
        Marker::Map16 => Head::Map(r.u16()?),
        Marker::Map32 => Head::Map(r.u32()?),
        Marker::FixExt1
        | Marker::FixExt2
        | Marker::FixExt4
        | Marker::FixExt8
        | Marker::FixExt16
        | Marker::Ext8
        | Marker::Ext16
        | Marker::Ext32 => Head::Ext,
        Marker::Reserved => return Err(Refused::malformed("the reserved marker 0xc1")),
    })
}

/// Transcodes a msgpack body to JSON; with `take_tokens`, the top-level map's
/// `token_ids` are read natively instead (see the module docs).
pub(crate) fn transcode(body: &[u8], take_tokens: bool) -> Result<Transcoded> {
    let mut r = Reader { b: body, at: 0 };
    let mut out = Transcoded {
        json: Vec::with_capacity(256),
        tokens: None,
        tokens_at: 0,
    };
    let top = head(&mut r)?;
    match top {
        Head::Map(n) if take_tokens => top_map(&mut r, n, &mut out)?,
        h => value(&mut r, h, &mut out.json, 1)?,
    }
    if r.left() > 0 {
        return Err(Refused::malformed(format!(
            "{} bytes after the body's value",
            r.left()
        )));
    }
    Ok(out)
}

/// The top-level map, its `token_ids` read natively.
fn top_map(r: &mut Reader<'_>, n: usize, out: &mut Transcoded) -> Result<()> {
    let n = r.len_of(n, 2)?;
    out.json.push(b'{');
    let mut seen = false;
    for i in 0..n {
        if i > 0 {
            out.json.push(b',');
        }
        let key = key(r)?;
        write_str(&mut out.json, key);
        out.json.push(b':');
        let h = head(r)?;
        if key == "token_ids" {
            if seen {
                return Err(Refused::Type(
                    "Failed to deserialize the msgpack body: duplicate field `token_ids`"
                        .to_string(),
                ));
            }
            seen = true;
            out.tokens_at = out.json.len();
            out.json.extend_from_slice(b"null");
            out.tokens = tokens(r, h)?;
        } else {
            value(r, h, &mut out.json, 2)?;
        }
    }
    out.json.push(b'}');
    Ok(())
}

/// A map key: a string (JSON has no other).
fn key<'a>(r: &mut Reader<'a>) -> Result<&'a str> {
    match head(r)? {
        Head::Str(n) => utf8(r.take(n)?),
        _ => Err(Refused::malformed("a map key that is not a string")),
    }
}

fn utf8(b: &[u8]) -> Result<&str> {
    std::str::from_utf8(b).map_err(|_| Refused::malformed("a string that is not UTF-8"))
}

fn write_str(json: &mut Vec<u8>, s: &str) {
    // serde_json's own escaping; writing to a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *json, s);
}

/// One value as JSON.
fn value(r: &mut Reader<'_>, h: Head, json: &mut Vec<u8>, depth: usize) -> Result<()> {
    if depth > MAX_DEPTH {
        return Err(Refused::malformed("nested too deeply"));
    }
    match h {
        Head::Nil => json.extend_from_slice(b"null"),
        Head::Bool(b) => json.extend_from_slice(if b { b"true" } else { b"false" }),
        Head::Uint(v) => {
            let _ = serde_json::to_writer(&mut *json, &v);
        }
        Head::Int(v) => {
            let _ = serde_json::to_writer(&mut *json, &v);
        }
        Head::Float(v) => {
            if !v.is_finite() {
                return Err(Refused::malformed("a float that is not finite"));
            }
            let _ = serde_json::to_writer(&mut *json, &v);
        }
        Head::Str(n) => write_str(json, utf8(r.take(n)?)?),
        Head::Bin(_) => {
            return Err(Refused::malformed(
                "bin is read only as the top-level token_ids",
            ))
        }
        Head::Ext => return Err(Refused::malformed("an ext value")),
        Head::Array(n) => {
            let n = r.len_of(n, 1)?;
            json.push(b'[');
            for i in 0..n {
                if i > 0 {
                    json.push(b',');
                }
                let h = head(r)?;
                value(r, h, json, depth + 1)?;
            }
            json.push(b']');
        }
        Head::Map(n) => {
            let n = r.len_of(n, 2)?;
            json.push(b'{');
            for i in 0..n {
                if i > 0 {
                    json.push(b',');
                }
                write_str(json, key(r)?);
                json.push(b':');
                let h = head(r)?;
                value(r, h, json, depth + 1)?;
            }
            json.push(b'}');
        }
    }
    Ok(())
}

/// `token_ids`: nil (absent), an array of integers in u32's range, or a bin of
/// little-endian u32s.
fn tokens(r: &mut Reader<'_>, h: Head) -> Result<Option<Vec<u32>>> {
    match h {
        Head::Nil => Ok(None),
        Head::Bin(n) => {
            let bytes = r.take(n)?;
            if n % 4 != 0 {
                return Err(Refused::malformed(format!(
                    "token_ids as bin must be little-endian u32s (a length that is a multiple of 4), got {n} bytes"
                )));
            }
            Ok(Some(
                bytes
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ))
        }
        Head::Array(n) => {
            let n = r.len_of(n, 1)?;
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(token(r)?);
            }
            Ok(Some(v))
        }
        _ => Err(Refused::tokens(
            "expected an array of u32 or a bin of little-endian u32",
        )),
    }
}

/// One token id; the unsigned forms up to u32 (what an encoder writes for any id) read
/// without the general header match.
#[inline(always)]
fn token(r: &mut Reader<'_>) -> Result<u32> {
    match r.b.get(r.at) {
        Some(&b) if b < 0x80 => {
            r.at += 1;
            return Ok(u32::from(b));
        }
        Some(&0xcc) => {
            if let Some(&v) = r.b.get(r.at + 1) {
                r.at += 2;
                return Ok(u32::from(v));
            }
        }
        Some(&0xcd) => {
            if let Some(&[hi, lo]) = r.b.get(r.at + 1..r.at + 3) {
                r.at += 3;
                return Ok(u32::from(u16::from_be_bytes([hi, lo])));
            }
        }
        Some(&0xce) => {
            if let Some(&[a, b, c, d]) = r.b.get(r.at + 1..r.at + 5) {
                r.at += 5;
                return Ok(u32::from_be_bytes([a, b, c, d]));
            }
        }
        _ => {}
    }
    let v = match head(r)? {
        Head::Uint(v) => i128::from(v),
        Head::Int(v) => i128::from(v),
        _ => return Err(Refused::tokens("invalid type: expected u32")),
    };
    u32::try_from(v)
        .map_err(|_| Refused::tokens(format_args!("invalid value: integer `{v}`, expected u32")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmp::encode as en;

    fn body(tokens: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let mut b = Vec::new();
        en::write_map_len(&mut b, 3).unwrap();
        en::write_str(&mut b, "model_name").unwrap();
        en::write_str(&mut b, "m\"x").unwrap();
        en::write_str(&mut b, "token_ids").unwrap();
        tokens(&mut b);
        en::write_str(&mut b, "router_config_override").unwrap();
        en::write_map_len(&mut b, 2).unwrap();
        en::write_str(&mut b, "router_temperature").unwrap();
        en::write_f64(&mut b, 0.5).unwrap();
        en::write_str(&mut b, "assume_kv_reuse").unwrap();
        en::write_bool(&mut b, true).unwrap();
        b
    }

    const WANT_JSON: &str = r#"{"model_name":"m\"x","token_ids":null,"router_config_override":{"router_temperature":0.5,"assume_kv_reuse":true}}"#;

    #[test]
    fn arrays_of_any_integer_form_and_bins_read_the_same_tokens() {
        let tokens = [0u32, 1, 127, 128, 255, 256, 65_535, 65_536, u32::MAX];
        let arr = body(|b| {
            en::write_array_len(b, tokens.len() as u32).unwrap();
            for t in tokens {
                en::write_uint(b, u64::from(t)).unwrap();
            }
        });
        let signed = body(|b| {
            en::write_array_len(b, tokens.len() as u32).unwrap();
            for t in tokens {
                en::write_i64(b, i64::from(t)).unwrap();
            }
        });
        let bin = body(|b| {
            let le: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            en::write_bin(b, &le).unwrap();
        });
        for form in [arr, signed, bin] {
            let t = transcode(&form, true).unwrap();
            assert_eq!(t.tokens.as_deref(), Some(&tokens[..]));
            assert_eq!(String::from_utf8(t.json.clone()).unwrap(), WANT_JSON);
            assert_eq!(&t.json[t.tokens_at..t.tokens_at + 4], b"null");
        }
        // Without taking them, an array of tokens is plain JSON.
        let t = transcode(
            &body(|b| en::write_array_len(b, 0).map(|_| ()).unwrap()),
            false,
        )
        .unwrap();
        assert!(String::from_utf8(t.json)
            .unwrap()
            .contains(r#""token_ids":[]"#));
    }

    #[test]
    fn malformed_bodies_are_refused_with_the_reason() {
        let ok = body(|b| en::write_bin(b, &[1, 0, 0, 0]).unwrap());
        let malformed = |b: &[u8]| matches!(transcode(b, true), Err(Refused::Malformed(_)));
        let wrong_type = |b: &[u8]| matches!(transcode(b, true), Err(Refused::Type(_)));
        // Every truncation of a valid body.
        for n in 0..ok.len() {
            assert!(malformed(&ok[..n]), "truncated at {n}");
        }
        let mut trailing = ok.clone();
        trailing.push(0xc0);
        assert!(malformed(&trailing));
        assert!(malformed(&body(|b| en::write_bin(b, &[1, 0, 0]).unwrap())));
        assert!(malformed(&[0xc1]));
        // A map whose key is not a string; an array claiming 2^32-1 items in 5 bytes.
        assert!(malformed(&[0x81, 0x01, 0xc0]));
        assert!(malformed(&[0xdd, 0xff, 0xff, 0xff, 0xff]));
        assert!(malformed(&[
            0x81, 0xa9, b't', b'o', b'k', b'e', b'n', b'_', b'i', b'd', b's', 0xdd, 0xff, 0xff,
            0xff, 0xff
        ]));
        // A non-UTF-8 string, a NaN, an ext, a bin elsewhere.
        assert!(malformed(&[0x81, 0xa1, b'a', 0xa1, 0xff]));
        assert!(malformed(&[
            0x81, 0xa1, b'a', 0xcb, 0x7f, 0xf8, 0, 0, 0, 0, 0, 0
        ]));
        assert!(malformed(&[0x81, 0xa1, b'a', 0xd4, 0x01, 0x00]));
        assert!(malformed(&[0x81, 0xa1, b'a', 0xc4, 0x00]));
        // Nesting past serde_json's limit.
        let mut deep = vec![0x91u8; 200];
        deep.push(0xc0);
        assert!(malformed(&deep));
        // token_ids of the wrong type or range: 422.
        assert!(wrong_type(&body(|b| en::write_str(b, "1,2").unwrap())));
        assert!(wrong_type(&body(|b| {
            en::write_array_len(b, 1).unwrap();
            en::write_sint(b, -1).map(|_| ()).unwrap();
        })));
        assert!(wrong_type(&body(|b| {
            en::write_array_len(b, 1).unwrap();
            en::write_u64(b, 1 << 32).unwrap();
        })));
        assert!(wrong_type(&body(|b| {
            en::write_array_len(b, 1).unwrap();
            en::write_f32(b, 1.0).unwrap();
        })));
        let mut twice = vec![0x82];
        for _ in 0..2 {
            en::write_str(&mut twice, "token_ids").unwrap();
            en::write_array_len(&mut twice, 0).unwrap();
        }
        assert!(wrong_type(&twice));
        assert!(transcode(&ok, true).is_ok());
    }
}
