//! Msgpack payloads built as value trees, for the decoder's tests and the ingress loom
//! models (which need real engine payloads without the emulator crate).

use std::ops::Range;

use rmp::encode as en;

/// A msgpack value tree for building payloads; encoded with `rmp::encode`.
#[derive(Clone, Debug)]
pub(crate) enum V {
    Nil,
    Bool(bool),
    /// Smallest unsigned encoding.
    U(u64),
    /// Smallest signed encoding.
    I(i64),
    /// Forced 0xcf.
    U64(u64),
    /// Forced 0xd3.
    I64(i64),
    F64(f64),
    F32(f32),
    S(String),
    Bin(Vec<u8>),
    A(Vec<V>),
    M(Vec<(V, V)>),
    Ext(i8, Vec<u8>),
}

pub(crate) fn enc_into(v: &V, w: &mut Vec<u8>) {
    match v {
        V::Nil => en::write_nil(w).unwrap(),
        V::Bool(b) => en::write_bool(w, *b).unwrap(),
        V::U(x) => {
            en::write_uint(w, *x).unwrap();
        }
        V::I(x) => {
            en::write_sint(w, *x).unwrap();
        }
        V::U64(x) => en::write_u64(w, *x).unwrap(),
        V::I64(x) => en::write_i64(w, *x).unwrap(),
        V::F64(x) => en::write_f64(w, *x).unwrap(),
        V::F32(x) => en::write_f32(w, *x).unwrap(),
        V::S(s) => en::write_str(w, s).unwrap(),
        V::Bin(b) => en::write_bin(w, b).unwrap(),
        V::A(items) => {
            en::write_array_len(w, items.len() as u32).unwrap();
            items.iter().for_each(|i| enc_into(i, w));
        }
        V::M(entries) => {
            en::write_map_len(w, entries.len() as u32).unwrap();
            for (k, v) in entries {
                enc_into(k, w);
                enc_into(v, w);
            }
        }
        V::Ext(ty, data) => {
            en::write_ext_meta(w, data.len() as u32, *ty).unwrap();
            w.extend_from_slice(data);
        }
    }
}

pub(crate) fn enc(v: &V) -> Vec<u8> {
    let mut w = Vec::new();
    enc_into(v, &mut w);
    w
}

pub(crate) fn s(x: &str) -> V {
    V::S(x.to_owned())
}
pub(crate) fn u(x: u64) -> V {
    V::U(x)
}
pub(crate) fn a(items: Vec<V>) -> V {
    V::A(items)
}
/// A map with string keys.
pub(crate) fn m(entries: Vec<(&str, V)>) -> V {
    V::M(entries.into_iter().map(|(k, v)| (s(k), v)).collect())
}
pub(crate) fn toks(r: Range<u32>) -> V {
    a(r.map(|t| u(u64::from(t))).collect())
}
pub(crate) fn batch(events: Vec<V>) -> V {
    a(vec![V::F64(1700000000.25), a(events), u(0)])
}
