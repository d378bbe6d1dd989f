//! A body's top-level `token_ids` read by hand: the one field that is large (an 8k-token
//! prompt is ~40 KB of digits), where serde's per-element visitor calls took a fifth of
//! the server's core under load.
//!
//! [`split_token_ids`] walks the top-level object just far enough to find the
//! `token_ids` array, parses it as plain unsigned decimal integers, and hands back the
//! body with that value replaced by `null`, for serde to parse the (small) rest as
//! before. It only ever *declines* (`None`): anything irregular (no object, a key with
//! escapes, the key twice, a float, a sign, a leading zero, a value over `u32::MAX`,
//! whitespace or bytes serde would refuse) leaves the body to serde, which then gives
//! Dynamo's exact answer, error text included. So it changes speed, never an outcome: on
//! a body it accepts, serde would read the same tokens (a test and the `service_bodies`
//! fuzz target check that).

/// The parsed tokens and the body with their array replaced by `null`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Split {
    pub tokens: Vec<u32>,
    pub rest: Vec<u8>,
}

const KEY: &[u8] = b"token_ids";

/// Finds and parses the top-level `token_ids` array, or declines (see the module docs).
pub(crate) fn split_token_ids(body: &[u8]) -> Option<Split> {
    let mut at = skip_ws(body, 0);
    if body.get(at) != Some(&b'{') {
        return None;
    }
    at = skip_ws(body, at + 1);
    let mut found: Option<(usize, usize, Vec<u32>)> = None;
    if body.get(at) == Some(&b'}') {
        return None;
    }
    loop {
        // A key: a string without escapes (an escaped key could spell `token_ids`).
        if body.get(at) != Some(&b'"') {
            return None;
        }
        let key_start = at + 1;
        let key_len = body[key_start..].iter().position(|&b| b == b'"')?;
        let key = &body[key_start..key_start + key_len];
        if key.contains(&b'\\') {
            return None;
        }
        at = skip_ws(body, key_start + key_len + 1);
        if body.get(at) != Some(&b':') {
            return None;
        }
        at = skip_ws(body, at + 1);
        if key == KEY {
            // Twice (serde's "duplicate field"), or not an array (`null`, a wrong type):
            // serde's to read.
            if found.is_some() || body.get(at) != Some(&b'[') {
                return None;
            }
            let (tokens, end) = parse_array(body, at)?;
            found = Some((at, end, tokens));
            at = end;
        } else {
            at = skip_value(body, at)?;
        }
        at = skip_ws(body, at);
        match body.get(at) {
            Some(b',') => at = skip_ws(body, at + 1),
            Some(b'}') => break,
            _ => return None,
        }
    }
    let (start, end, tokens) = found?;
    let mut rest = Vec::with_capacity(body.len() - (end - start) + 4);
    rest.extend_from_slice(&body[..start]);
    rest.extend_from_slice(b"null");
    rest.extend_from_slice(&body[end..]);
    Some(Split { tokens, rest })
}

/// JSON whitespace (serde_json's set: space, tab, newline, carriage return).
fn skip_ws(b: &[u8], mut at: usize) -> usize {
    while let Some(c) = b.get(at) {
        if !matches!(c, b' ' | b'\t' | b'\n' | b'\r') {
            break;
        }
        at += 1;
    }
    at
}

/// Parses `[d, d, ...]` of u32 decimals from `b[at] == '['`; returns the tokens and the
/// index just past `]`.
fn parse_array(b: &[u8], at: usize) -> Option<(Vec<u32>, usize)> {
    // At most one token per two bytes ("d,"): bounded by the body, never by a number in it.
    let mut tokens = Vec::with_capacity((b.len() - at) / 2 + 1);
    let mut i = skip_ws(b, at + 1);
    if b.get(i) == Some(&b']') {
        return Some((tokens, i + 1));
    }
    loop {
        // The common case, compact `d,d`: the number, its comma and the next number's
        // first digit all in the one word read at `i`, so the next position follows from
        // that word alone (one load per token on the loop's dependency chain, not three).
        if let Some((word, n)) = digit_word(b, i) {
            let v = fold_digits(word, n);
            if word as u8 == b'0' && n > 1 {
                return None; // a leading zero
            }
            tokens.push(v);
            if n < 7
                && (word >> (8 * n)) as u8 == b','
                && ((word >> (8 * (n + 1))) as u8).is_ascii_digit()
            {
                i += n + 1;
                continue;
            }
            i = skip_ws(b, i + n);
        } else {
            let (v, n) = number(b, i)?;
            tokens.push(v);
            i = skip_ws(b, i + n);
        }
        match b.get(i) {
            Some(b',') => i = skip_ws(b, i + 1),
            Some(b']') => return Some((tokens, i + 1)),
            _ => return None, // '.', 'e', garbage, or the end
        }
    }
}

/// The plain u32 decimal at `b[at..]` and its length in digits: no sign, no leading
/// zero, at most `u32::MAX`.
#[inline(always)]
fn number(b: &[u8], at: usize) -> Option<(u32, usize)> {
    // The common case (up to 7 digits, then a delimiter) without a branch per digit.
    let (v, n) = match eight_digits(b, at) {
        Some(r) => r,
        None => digit_run(b, at)?,
    };
    (b[at] != b'0' || n == 1).then_some((v, n))
}

/// The digits at `b[at..]` a byte at a time (8 or more, or too near the end for a word).
fn digit_run(b: &[u8], at: usize) -> Option<(u32, usize)> {
    let mut v = 0u64;
    let mut n = 0;
    while let Some(c) = b.get(at + n).filter(|c| c.is_ascii_digit()) {
        v = v * 10 + u64::from(c - b'0');
        n += 1;
        if n > 10 {
            return None; // far over u32::MAX (and v cannot overflow u64)
        }
    }
    (n > 0 && v <= u64::from(u32::MAX)).then_some((v as u32, n))
}

/// The run of 1 to 7 ASCII digits at `b[at..]` and its value, read as one 8-byte word
/// (SWAR: a mask of the non-digit bytes, then the digits folded pairwise by three
/// multiplies). `None` when fewer than 8 bytes remain, the first byte is not a digit, or
/// all 8 are digits (longer numbers take the byte loop).
#[inline(always)]
fn eight_digits(b: &[u8], at: usize) -> Option<(u32, usize)> {
    let (word, n) = digit_word(b, at)?;
    Some((fold_digits(word, n), n))
}

/// One in every byte of a word: the SWAR digit tests and folds below.
const LO: u64 = 0x0101_0101_0101_0101;

/// The 8-byte little-endian word at `b[at..]` and the length of the run of 1 to 7 ASCII
/// digits it starts with (see [`eight_digits`]).
#[inline(always)]
fn digit_word(b: &[u8], at: usize) -> Option<(u64, usize)> {
    let word = u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?);
    // A byte is a digit iff its high nibble is 3 and stays 3 when 6 is added (0x30..=0x39).
    // A carry out of a byte only reaches later bytes after a non-digit, never the run.
    let high = (word & (0xF0 * LO)) ^ (0x30 * LO);
    let plus6 = (word.wrapping_add(0x06 * LO) & (0xF0 * LO)) ^ (0x30 * LO);
    let bad = high | plus6;
    // The top bit of each non-zero (non-digit) byte.
    let flags = (((bad & (0x7F * LO)) + 0x7F * LO) | bad) & (0x80 * LO);
    let n = (flags.trailing_zeros() / 8) as usize;
    if n == 0 || n == 8 {
        return None;
    }
    Some((word, n))
}

/// The value of the `n` (1 to 7) leading digits of `word`.
#[inline(always)]
fn fold_digits(word: u64, n: usize) -> u32 {
    // The n digits moved to the top bytes, zeros (as '0') below them; then the classic
    // fold: pairs, quads, the eight.
    let digits = (word & (0x0F * LO)) << (8 * (8 - n));
    let v = digits.wrapping_mul((10 << 8) + 1) >> 8;
    let v = (v & 0x00FF_00FF_00FF_00FF).wrapping_mul((100 << 16) + 1) >> 16;
    let v = (v & 0x0000_FFFF_0000_FFFF).wrapping_mul((10_000 << 32) + 1) >> 32;
    v as u32
}

/// Skips one value starting at `b[at]` (its syntax is serde's to check later; this only
/// has to find where it ends without being fooled by brackets or quotes in strings).
fn skip_value(b: &[u8], at: usize) -> Option<usize> {
    match *b.get(at)? {
        b'"' => skip_string(b, at),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut i = at;
            loop {
                match *b.get(i)? {
                    b'"' => {
                        i = skip_string(b, i)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
        }
        _ => {
            // A number or a literal: up to the next delimiter.
            let mut i = at;
            while let Some(&c) = b.get(i) {
                if matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                    break;
                }
                i += 1;
            }
            (i > at).then_some(i)
        }
    }
}

/// Skips a string from its opening quote; returns the index past the closing one.
fn skip_string(b: &[u8], at: usize) -> Option<usize> {
    let mut i = at + 1;
    loop {
        match *b.get(i)? {
            b'"' => return Some(i + 1),
            b'\\' => i += 2,
            _ => i += 1,
        }
    }
}

/// What serde reads from a body, for [`agrees_with_serde`].
#[derive(serde::Deserialize, Debug, PartialEq)]
struct Probe {
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
    #[serde(flatten)]
    rest: serde_json::Map<String, serde_json::Value>,
}

/// The split's property, for tests and the `service_bodies` fuzz target: when it accepts a
/// body, serde reads the same tokens from the original and the same everything else from
/// the rest; serde refuses the original exactly when it refuses the rest.
pub fn agrees_with_serde(body: &[u8]) -> bool {
    let Some(s) = split_token_ids(body) else {
        return true;
    };
    let whole = serde_json::from_slice::<Probe>(body);
    let rest = serde_json::from_slice::<Probe>(&s.rest);
    match (whole, rest) {
        (Ok(w), Ok(mut r)) => {
            let became_null = r.token_ids.is_none();
            r.token_ids = Some(s.tokens);
            became_null && w == r
        }
        (Err(_), Err(_)) => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agrees(body: &[u8]) -> bool {
        agrees_with_serde(body)
    }

    #[test]
    fn reads_plain_arrays_and_leaves_the_rest_to_serde() {
        let s = split_token_ids(
            br#" {"model_name":"m", "token_ids" : [ 1, 22 ,4294967295 ] ,"x":{"token_ids":[9]}} "#,
        )
        .unwrap();
        assert_eq!(s.tokens, vec![1, 22, u32::MAX]);
        assert_eq!(
            s.rest,
            br#" {"model_name":"m", "token_ids" : null ,"x":{"token_ids":[9]}} "#.to_vec()
        );
        assert_eq!(
            split_token_ids(br#"{"token_ids":[]}"#).unwrap().tokens,
            Vec::<u32>::new()
        );
        assert_eq!(
            split_token_ids(br#"{"token_ids":[0]}"#).unwrap().tokens,
            vec![0]
        );
    }

    #[test]
    fn eight_digit_words_read_every_length_and_delimiter() {
        for v in [
            0u32, 7, 10, 99, 123, 4_096, 65_535, 100_000, 999_999, 1_234_567, 9_999_999,
        ] {
            for tail in [",", "]", " ", "x", "\u{ff}", ".5"] {
                let text = format!("{v}{tail}00000000");
                let n = v.to_string().len();
                assert_eq!(eight_digits(text.as_bytes(), 0), Some((v, n)), "{text}");
            }
        }
        assert_eq!(
            eight_digits(b"12345678,", 0),
            None,
            "8 digits: the byte loop"
        );
        assert_eq!(eight_digits(b",1234567", 0), None);
        assert_eq!(eight_digits(b"1234567", 0), None, "fewer than 8 bytes");
        // Bytes just outside the digits' range on both sides.
        for c in [b'/', b':', 0x2A, 0x3A, 0xFA, 0xFF, 0x00, 0x80] {
            let mut w = *b"12300000";
            w[3] = c;
            assert_eq!(eight_digits(&w, 0), Some((123, 3)), "{c:#x}");
        }
    }

    #[test]
    fn declines_whatever_serde_should_judge() {
        for body in [
            &br#"{"token_ids":[1,2.5]}"#[..],
            br#"{"token_ids":[-1]}"#,
            br#"{"token_ids":[01]}"#,
            br#"{"token_ids":[4294967296]}"#,
            br#"{"token_ids":[99999999999999999999999]}"#,
            br#"{"token_ids":[1e3]}"#,
            br#"{"token_ids":[1,]}"#,
            br#"{"token_ids":[1 2]}"#,
            br#"{"token_ids":[1],"token_ids":[2]}"#,
            br#"{"token_ids":null,"token_ids":[2]}"#,
            br#"{"token_ids":[2],"token_ids":null}"#,
            br#"{"token\u005fids":[1]}"#,
            br#"{"token_ids":"[1]"}"#,
            br#"{"token_ids":[1]"#,
            br#"[{"token_ids":[1]}]"#,
            br#"{"model_name":"m"}"#,
            br#"{}"#,
            b"",
        ] {
            assert_eq!(
                split_token_ids(body),
                None,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn reads_long_arrays_as_serde_does() {
        // Numbers of every length up to u32::MAX, with the separators clients send.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for sep in [",", ", ", " , ", ",\n  "] {
            let tokens: Vec<u32> = (0..2_000)
                .map(|_| {
                    let r = next();
                    (r >> 32) as u32 >> (r % 32)
                })
                .collect();
            let body = format!(
                r#"{{"model_name":"m","token_ids":[{}]}}"#,
                tokens
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(sep)
            );
            let split = split_token_ids(body.as_bytes()).expect("a plain array");
            assert_eq!(split.tokens, tokens, "separator {sep:?}");
            assert!(agrees(body.as_bytes()));
        }
    }

    #[test]
    fn never_disagrees_with_serde() {
        let seeds: [&[u8]; 10] = [
            br#"{"token_ids":[12345678,0, 4294967295,  7,123456789]}"#,
            br#"{"token_ids":[ 1 ,2, 3 ],"x":1}"#,
            br#"{"token_ids":[99999,1,22,333,4444,55555,666666,7777777,1]}"#,
            br#"{"token_ids":[]}"#,
            br#"{"model_name":"m","token_ids":[1,2,3],"x":[{"a":"]\"}"},null,1.5]}"#,
            br#"{"token_ids":[0,10,200],"model_name":"a\"b\\"}"#,
            br#"{"x":"{\"token_ids\":[","token_ids":[5]}"#,
            br#"{"token_ids":[7],"model_name":1}"#,
            br#"{"token_ids":[7]} trailing"#,
            b"{\"token_ids\":[\n7\r,\t8]}",
        ];
        for s in seeds {
            assert!(agrees(s), "{}", String::from_utf8_lossy(s));
        }
        // Every one-byte mutation of every seed (deterministic, exhaustive over a small
        // alphabet of JSON's structural bytes and digits).
        let alphabet = b"{}[]\",:\\ 0123456789.-etnul\x00\xff";
        for s in seeds {
            for i in 0..s.len() {
                for &c in alphabet {
                    let mut m = s.to_vec();
                    m[i] = c;
                    assert!(agrees(&m), "{}", String::from_utf8_lossy(&m));
                    let mut ins = s.to_vec();
                    ins.insert(i, c);
                    assert!(agrees(&ins), "{}", String::from_utf8_lossy(&ins));
                }
                let mut del = s.to_vec();
                del.remove(i);
                assert!(agrees(&del), "{}", String::from_utf8_lossy(&del));
            }
        }
    }
}
