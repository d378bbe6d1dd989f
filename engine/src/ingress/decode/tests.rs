//! Unit tests of the payload decoder (formerly `decode.rs`'s test module).

use super::error::{DecodeErrorKind as K, Result};
use super::fixture::*;
use super::*;
use rmp::encode as en;

fn decode(v: &V) -> Result<DecodedBatch> {
    let mut out = DecodedBatch::default();
    decode_batch(&enc(v), &mut out).map(|()| out)
}

fn err(v: &V) -> DecodeError {
    decode(v).expect_err("payload must be rejected")
}

fn err_kind(v: &V) -> K {
    err(v).kind
}

// vLLM's default hashes: the last 8 bytes of a SHA-256 as uint64 (large, so 0xcf).
const H1: u64 = 0xf3a1_0000_0000_0001;
const H2: u64 = 0x8000_0000_dead_beef;
const H3: u64 = 0x0123_4567_89ab_cdef;

/// REFERENCE.md §2's BlockStored as seen on the wire (vLLM 0.33.0), two blocks of 16.
fn ref_stored() -> V {
    m(vec![
        ("type", s("BlockStored")),
        ("block_hashes", a(vec![V::U64(H1), V::U64(H2)])),
        ("parent_block_hash", V::Nil),
        ("token_ids", toks(0..32)),
        ("block_size", u(16)),
        ("lora_id", V::Nil),
        ("medium", s("GPU")),
        ("lora_name", V::Nil),
        ("extra_keys", a(vec![V::Nil, V::Nil])),
        ("group_idx", u(0)),
        ("kv_cache_spec_kind", s("full_attention")),
    ])
}

fn stored(
    b: &DecodedBatch,
    i: usize,
) -> (Vec<u64>, Option<u64>, Vec<u32>, u32, Option<String>, Medium) {
    match &b.events[i] {
        DecodedEvent::Stored {
            hashes,
            parent,
            tokens,
            block_size,
            lora_name,
            medium,
            ..
        } => (
            b.hashes[hashes.clone()].to_vec(),
            *parent,
            b.tokens[tokens.clone()].to_vec(),
            *block_size,
            lora_name.clone().map(|r| b.text[r].to_owned()),
            *medium,
        ),
        e => panic!("event {i} is not Stored: {e:?}"),
    }
}

fn removed(b: &DecodedBatch, i: usize) -> (Vec<u64>, Medium) {
    match &b.events[i] {
        DecodedEvent::Removed { hashes, medium, .. } => {
            (b.hashes[hashes.clone()].to_vec(), *medium)
        }
        e => panic!("event {i} is not Removed: {e:?}"),
    }
}

#[test]
fn reference_tagged_events_literally() {
    let mut cpu = ref_stored();
    if let V::M(entries) = &mut cpu {
        entries.retain(|(k, _)| !matches!(k, V::S(k) if k == "medium"));
        entries.push((s("medium"), s("CPU")));
        entries.push((s("locality"), s("LOCAL")));
    }
    let b = decode(&batch(vec![
        ref_stored(),
        cpu,
        m(vec![
            ("type", s("BlockRemoved")),
            ("block_hashes", a(vec![V::U64(H1)])),
            ("medium", s("GPU")),
            ("group_idx", u(0)),
        ]),
        m(vec![("type", s("AllBlocksCleared"))]),
    ]))
    .unwrap();
    assert_eq!(b.ts, 1700000000.25);
    assert_eq!(b.data_parallel_rank, Some(0));
    assert_eq!(b.events.len(), 4);
    let toks: Vec<u32> = (0..32).collect();
    assert_eq!(
        stored(&b, 0),
        (vec![H1, H2], None, toks.clone(), 16, None, Medium::Gpu)
    );
    assert_eq!(
        stored(&b, 1),
        (vec![H1, H2], None, toks, 16, None, Medium::Cpu)
    );
    assert_eq!(removed(&b, 2), (vec![H1], Medium::Gpu));
    assert_eq!(b.events[3], DecodedEvent::Cleared);
}

#[test]
fn positional_sglang_and_older_vllm() {
    // SGLang: BlockStored with 9 fields, BlockRemoved with 3; signed int64 hashes.
    let sglang = batch(vec![
        a(vec![
            s("BlockStored"),
            a(vec![V::I64(-5), V::I64(7)]),
            V::I64(-1),
            toks(0..8),
            u(4),
            V::Nil,
            s("GPU"),
            V::Nil,
            V::Nil,
            u(0),
        ]),
        a(vec![s("BlockRemoved"), a(vec![V::I64(-5)]), V::Nil, u(0)]),
        a(vec![s("AllBlocksCleared")]),
    ]);
    let b = decode(&sglang).unwrap();
    assert_eq!(
        stored(&b, 0),
        (
            vec![(-5i64) as u64, 7],
            Some(u64::MAX),
            (0..8).collect(),
            4,
            None,
            Medium::Gpu
        )
    );
    assert_eq!(removed(&b, 1), (vec![(-5i64) as u64], Medium::Gpu));
    assert_eq!(b.events[2], DecodedEvent::Cleared);

    // Older vLLM: 2-element batch (no DP rank), trailing defaults omitted (no medium).
    let old = a(vec![
        V::F64(3.5),
        a(vec![
            a(vec![
                s("BlockStored"),
                a(vec![u(1)]),
                u(9),
                toks(10..14),
                u(4),
                V::Nil,
            ]),
            a(vec![s("BlockRemoved"), a(vec![u(1), u(2)])]),
            a(vec![s("BlockStored"), a(vec![]), V::Nil, a(vec![]), u(4)]),
        ]),
    ]);
    let b = decode(&old).unwrap();
    assert_eq!(b.data_parallel_rank, None);
    assert_eq!(
        stored(&b, 0),
        (vec![1], Some(9), (10..14).collect(), 4, None, Medium::Gpu)
    );
    assert_eq!(removed(&b, 1), (vec![1, 2], Medium::Gpu));
    assert_eq!(stored(&b, 2), (vec![], None, vec![], 4, None, Medium::Gpu));
}

#[test]
fn all_fifteen_stored_fields_positional_and_tagged() {
    let values = vec![
        a(vec![u(11), u(12)]),
        u(10),
        toks(0..4),
        u(2),
        u(3),
        s("CPU"),
        s("my-lora"),
        a(vec![
            a(vec![s("my-lora")]),
            a(vec![s("my-lora"), a(vec![s("mm"), u(5)])]),
        ]),
        u(1),
        s("sliding_window"),
        u(4096),
        s("LOCAL"),
        s("OWNED"),
        s("sess-1"),
        a(vec![toks(100..103), a(vec![])]),
    ];
    let names = [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
        "lookahead_token_ids",
    ];
    let mut positional = vec![s("BlockStored")];
    positional.extend(values.iter().cloned());
    let tagged = m(std::iter::once(("type", s("BlockStored")))
        .chain(names.iter().copied().zip(values.iter().cloned()))
        .collect());
    let expect = (
        vec![11, 12],
        Some(10),
        (0..4).collect::<Vec<u32>>(),
        2,
        Some("my-lora".to_owned()),
        Medium::Cpu,
    );
    for ev in [a(positional), tagged] {
        let b = decode(&batch(vec![ev])).unwrap();
        assert_eq!(stored(&b, 0), expect);
        // Lookahead tokens have a buffer of their own.
        assert_eq!(b.tokens.len(), 4);
    }
    // BlockRemoved's 5 fields.
    let b = decode(&batch(vec![a(vec![
        s("BlockRemoved"),
        a(vec![u(1)]),
        s("STORAGE"),
        u(0),
        s("REMOTE"),
        V::Nil,
    ])]))
    .unwrap();
    assert_eq!(removed(&b, 0), (vec![1], Medium::Storage));
}

#[test]
fn hash_encodings() {
    let mut digest = [0u8; 32];
    for (i, b) in digest.iter_mut().enumerate() {
        *b = i as u8;
    }
    let hashes = a(vec![
        u(5),                           // fixint
        V::U(300),                      // u16
        V::U64(u64::MAX),               // uint64
        V::I(-1),                       // negative fixint
        V::I64(i64::MIN),               // int64
        V::I64(42),                     // int64 marker, positive
        V::Bin(digest.to_vec()),        // 32-byte digest → last 8 bytes BE
        V::Bin(vec![0xab, 0xcd, 0xef]), // short → left-padded
        V::Bin(vec![]),                 // empty → 0
    ]);
    let b = decode(&batch(vec![m(vec![
        ("type", s("BlockRemoved")),
        ("block_hashes", hashes),
    ])]))
    .unwrap();
    assert_eq!(
        removed(&b, 0).0,
        vec![
            5,
            300,
            u64::MAX,
            u64::MAX,
            1 << 63,
            42,
            0x18191a1b1c1d1e1f,
            0xabcdef,
            0
        ]
    );
    // Parent in each kind too.
    for (parent, want) in [
        (V::U64(H3), H3),
        (V::I64(-2), (-2i64) as u64),
        (V::Bin(H3.to_be_bytes().to_vec()), H3),
    ] {
        let b = decode(&batch(vec![a(vec![
            s("BlockStored"),
            a(vec![u(1)]),
            parent,
            toks(0..2),
            u(2),
        ])]))
        .unwrap();
        assert_eq!(stored(&b, 0).1, Some(want));
    }
}

#[test]
fn absent_fields_and_any_key_order() {
    // "type" last, most fields absent.
    let b = decode(&batch(vec![
        m(vec![
            ("token_ids", toks(0..3)),
            ("block_hashes", a(vec![u(7)])),
            ("block_size", u(3)),
            ("type", s("BlockStored")),
        ]),
        m(vec![("type", s("BlockRemoved"))]),
        m(vec![("type", s("BlockStored"))]),
    ]))
    .unwrap();
    assert_eq!(
        stored(&b, 0),
        (vec![7], None, vec![0, 1, 2], 3, None, Medium::Gpu)
    );
    assert_eq!(removed(&b, 1), (vec![], Medium::Gpu));
    assert_eq!(stored(&b, 2), (vec![], None, vec![], 0, None, Medium::Gpu));
}

#[test]
fn unknown_keys_fields_and_trailing_elements_are_skipped() {
    let nested = a(vec![
        m(vec![(
            "x",
            a(vec![
                V::F32(1.5),
                V::Bin(vec![1; 300]),
                V::Ext(5, vec![1, 2, 3]),
            ]),
        )]),
        V::M(vec![(u(1), V::Bool(true)), (V::Nil, a(vec![]))]),
        V::Ext(-1, vec![0; 16]),
        V::Ext(2, vec![0; 70_000]),
        s(&"long".repeat(20_000)),
        V::I(-100_000),
        V::F64(2.0),
    ]);
    let b = decode(&a(vec![
        V::F64(1.0),
        a(vec![
            m(vec![
                ("type", s("BlockStored")),
                ("future_field", nested.clone()),
                ("block_hashes", a(vec![u(1)])),
                ("token_ids", toks(0..1)),
                ("block_size", u(1)),
            ]),
            // A non-string key with a nested value.
            V::M(vec![
                (s("type"), s("BlockRemoved")),
                (a(vec![u(1), m(vec![("k", V::Nil)])]), nested.clone()),
                (s("block_hashes"), a(vec![u(2)])),
                // A Stored-only key on a Removed event is unknown here.
                (s("token_ids"), s("not tokens")),
            ]),
            a(vec![
                s("BlockRemoved"),
                a(vec![u(3)]),
                V::Nil,
                V::Nil,
                V::Nil,
                V::Nil,
                nested.clone(),
            ]),
            a(vec![s("AllBlocksCleared"), nested.clone(), u(1)]),
            m(vec![
                ("type", s("AllBlocksCleared")),
                ("reason", s("reset")),
            ]),
        ]),
        u(3),
        nested,
        V::Nil,
    ]))
    .unwrap();
    assert_eq!(b.data_parallel_rank, Some(3));
    assert_eq!(stored(&b, 0).0, vec![1]);
    assert_eq!(removed(&b, 1).0, vec![2]);
    assert_eq!(removed(&b, 2).0, vec![3]);
    assert_eq!(b.events[3], DecodedEvent::Cleared);
    assert_eq!(b.events[4], DecodedEvent::Cleared);
}

#[test]
fn deep_nesting_in_skipped_values_does_not_recurse() {
    // 200k nested single-element arrays inside an unknown key: no stack growth.
    let depth = 200_000;
    let mut p = Vec::new();
    en::write_array_len(&mut p, 3).unwrap();
    en::write_f64(&mut p, 0.0).unwrap();
    en::write_array_len(&mut p, 1).unwrap();
    en::write_map_len(&mut p, 2).unwrap();
    en::write_str(&mut p, "type").unwrap();
    en::write_str(&mut p, "AllBlocksCleared").unwrap();
    en::write_str(&mut p, "deep").unwrap();
    p.extend(std::iter::repeat_n(0x91, depth));
    en::write_nil(&mut p).unwrap();
    en::write_nil(&mut p).unwrap();
    let mut out = DecodedBatch::default();
    decode_batch(&p, &mut out).unwrap();
    assert_eq!(out.events, vec![DecodedEvent::Cleared]);
    // The same nesting, one level short of its innermost value: truncated.
    p.truncate(p.len() - 2);
    assert_eq!(decode_batch(&p, &mut out).unwrap_err().kind, K::Truncated);
}

#[test]
fn ts_and_dp_rank_forms() {
    let with = |ts: V, rest: Vec<V>| {
        let mut items = vec![ts, a(vec![])];
        items.extend(rest);
        decode(&a(items))
    };
    assert_eq!(with(V::F32(2.5), vec![]).unwrap().ts, 2.5);
    assert_eq!(with(u(7), vec![]).unwrap().ts, 7.0);
    assert_eq!(with(V::I(-7), vec![]).unwrap().ts, -7.0);
    assert_eq!(with(V::U64(u64::MAX), vec![]).unwrap().ts, u64::MAX as f64);
    assert_eq!(
        with(V::F64(1.0), vec![V::Nil]).unwrap().data_parallel_rank,
        None
    );
    assert_eq!(
        with(V::F64(1.0), vec![u(7)]).unwrap().data_parallel_rank,
        Some(7)
    );
    assert_eq!(with(s("now"), vec![]).unwrap_err().kind, K::FieldType);
    assert_eq!(with(V::Nil, vec![]).unwrap_err().kind, K::FieldType);
    assert_eq!(
        with(V::F64(1.0), vec![V::I(-1)]).unwrap_err().kind,
        K::FieldType
    );
    assert_eq!(
        with(V::F64(1.0), vec![u(1 << 32)]).unwrap_err().kind,
        K::FieldType
    );
    assert_eq!(
        with(V::F64(1.0), vec![s("0")]).unwrap_err().kind,
        K::FieldType
    );
}

#[test]
fn medium_mapping() {
    let removed_on = |medium: V| {
        decode(&batch(vec![m(vec![
            ("type", s("BlockRemoved")),
            ("block_hashes", a(vec![u(1)])),
            ("medium", medium),
        ])]))
        .map(|b| removed(&b, 0).1)
    };
    assert_eq!(removed_on(V::Nil).unwrap(), Medium::Gpu);
    assert_eq!(removed_on(s("GPU")).unwrap(), Medium::Gpu);
    assert_eq!(removed_on(s("CPU")).unwrap(), Medium::Cpu);
    assert_eq!(removed_on(s("cpu")).unwrap(), Medium::Cpu);
    assert_eq!(removed_on(s("STORAGE")).unwrap(), Medium::Storage);
    assert_eq!(removed_on(s("DISK")).unwrap(), Medium::Storage);
    // REFERENCE.md §9's names seen in the field.
    for (name, want) in [
        ("DEVICE", Medium::Gpu),
        ("CPU_PINNED", Medium::Cpu),
        ("cpu_tier1", Medium::Cpu),
        ("CPU_TIER2", Medium::Storage),
        ("NVME", Medium::Storage),
        ("EXTERNAL", Medium::Storage),
        ("NETWORK", Medium::Storage),
        ("REMOTE", Medium::Storage),
        ("SHARED", Medium::Storage),
    ] {
        assert_eq!(removed_on(s(name)).unwrap(), want, "{name}");
    }
    // Any other name decodes (its event is skipped at ingest, not the batch).
    assert_eq!(removed_on(s("HBM3")).unwrap(), Medium::Unknown);
    assert_eq!(removed_on(s("")).unwrap(), Medium::Unknown);
    assert_eq!(removed_on(u(1)).unwrap_err().kind, K::FieldType);
}

#[test]
fn groups_and_spec_kinds_are_read() {
    let store_in = |group: u64, kind: &str| {
        m(vec![
            ("type", s("BlockStored")),
            ("block_hashes", a(vec![u(1)])),
            ("token_ids", toks(0..4)),
            ("block_size", u(4)),
            ("group_idx", u(group)),
            ("kv_cache_spec_kind", s(kind)),
        ])
    };
    let b = decode(&batch(vec![
        store_in(1, "sliding_window"),
        store_in(0, "full_attention"),
        store_in(2, "MLA_attention"),
        store_in(3, "sink_full_attention"),
        // A recurrent group's store names states: tokenless whatever its token ids.
        store_in(4, "mamba"),
        store_in(5, "chunked_local_attention"),
        m(vec![
            ("type", s("BlockRemoved")),
            ("block_hashes", a(vec![u(1)])),
            ("group_idx", V::I(-3)),
        ]),
        m(vec![
            ("type", s("BlockRemoved")),
            ("block_hashes", a(vec![u(1)])),
        ]),
    ]))
    .unwrap();
    assert!(matches!(b.events[4], DecodedEvent::Tokenless { .. }));
    let groups: Vec<_> = b
        .events
        .iter()
        .map(|e| match e {
            DecodedEvent::Stored { group, spec, .. }
            | DecodedEvent::Tokenless { group, spec, .. } => (*group, Some(*spec)),
            DecodedEvent::Removed { group, .. } => (*group, None),
            DecodedEvent::Cleared | DecodedEvent::Malformed { .. } => (None, None),
        })
        .collect();
    assert_eq!(
        groups,
        vec![
            (Some(1), Some(SpecKind::Other)),
            (Some(0), Some(SpecKind::FullAttention)),
            (Some(2), Some(SpecKind::FullAttention)),
            (Some(3), Some(SpecKind::FullAttention)),
            (Some(4), Some(SpecKind::Recurrent)),
            (Some(5), Some(SpecKind::Other)),
            (Some(u32::MAX), None),
            (None, None),
        ]
    );
}

#[test]
fn lora_names_share_the_text_buffer() {
    let ev = |name: V| {
        a(vec![
            s("BlockStored"),
            a(vec![u(1)]),
            V::Nil,
            toks(0..1),
            u(1),
            u(1),
            V::Nil,
            name,
        ])
    };
    let b = decode(&batch(vec![
        ev(s("alpha")),
        ev(s("alpha")),
        ev(s("βeta")),
        ev(s("")),
        ev(V::Nil),
    ]))
    .unwrap();
    let names: Vec<_> = (0..5).map(|i| stored(&b, i).4).collect();
    assert_eq!(
        names,
        vec![
            Some("alpha".into()),
            Some("alpha".into()),
            Some("βeta".into()),
            None,
            None
        ]
    );
    assert_eq!(b.text, "alphaβeta");
}

#[test]
fn every_error_kind() {
    let one = |ev: V| err(&batch(vec![ev]));
    let stored_with = |extra: Vec<(&str, V)>| {
        let mut e = vec![
            ("type", s("BlockStored")),
            ("block_hashes", a(vec![u(1), u(2)])),
            ("token_ids", toks(0..8)),
            ("block_size", u(4)),
        ];
        e.extend(extra);
        one(m(e))
    };
    let mut ok = enc(&batch(vec![ref_stored()]));

    // Truncated: every strict prefix of a valid payload.
    for cut in 0..ok.len() {
        let mut out = DecodedBatch::default();
        let e = decode_batch(&ok[..cut], &mut out).unwrap_err();
        assert_eq!(e.kind, K::Truncated, "prefix of {cut} bytes: {e}");
    }
    // Truncated: a length prefix larger than the payload.
    assert_eq!(
        decode_batch(
            &[0xdd, 0xff, 0xff, 0xff, 0xff, 0xcb],
            &mut DecodedBatch::default()
        )
        .unwrap_err()
        .kind,
        K::Truncated
    );
    assert_eq!(
        one(a(vec![s("BlockRemoved"), V::Bin(vec![])])).kind,
        K::FieldType
    );

    // TrailingBytes.
    ok.push(0xc0);
    assert_eq!(
        decode_batch(&ok, &mut DecodedBatch::default())
            .unwrap_err()
            .kind,
        K::TrailingBytes
    );

    // BatchShape.
    assert_eq!(err_kind(&m(vec![("ts", V::F64(1.0))])), K::BatchShape);
    assert_eq!(err_kind(&a(vec![V::F64(1.0)])), K::BatchShape);
    assert_eq!(err_kind(&a(vec![V::F64(1.0), V::Nil])), K::BatchShape);
    assert_eq!(err_kind(&V::Nil), K::BatchShape);

    // EventShape.
    assert_eq!(one(s("BlockStored")).kind, K::EventShape);
    assert_eq!(one(a(vec![])).kind, K::EventShape);
    assert_eq!(one(a(vec![u(0)])).kind, K::EventShape);
    assert_eq!(
        one(m(vec![("block_hashes", a(vec![]))])).kind,
        K::EventShape
    );
    assert_eq!(one(m(vec![("type", u(1))])).kind, K::EventShape);

    // UnknownEventType.
    assert_eq!(
        one(m(vec![("type", s("BlockEvicted"))])).kind,
        K::UnknownEventType
    );
    assert_eq!(one(a(vec![s("blockstored")])).kind, K::UnknownEventType);

    // FieldType: every listed field with a wrong type.
    for (key, bad) in [
        ("block_hashes", V::Nil),
        ("token_ids", V::Nil),
        ("token_ids", a(vec![V::I(-1)])),
        ("token_ids", a(vec![u(1 << 32)])),
        ("token_ids", a(vec![s("1")])),
        ("block_size", V::Nil),
        ("block_size", V::I(-4)),
        ("block_size", u(1 << 32)),
        ("lora_id", s("1")),
        ("lora_id", V::F64(1.0)),
        ("medium", a(vec![])),
        ("lora_name", u(1)),
        ("lora_name", V::Bin(b"x".to_vec())),
        ("extra_keys", s("x")),
        ("extra_keys", a(vec![u(1)])),
        ("group_idx", s("0")),
        ("kv_cache_spec_kind", u(0)),
        ("kv_cache_spec_sliding_window", s("4096")),
        ("locality", V::Bool(true)),
        ("ownership", u(1)),
        ("session_id", u(1)),
        ("lookahead_token_ids", s("x")),
        ("lookahead_token_ids", a(vec![V::Nil])),
        ("lookahead_token_ids", a(vec![a(vec![V::I(-1)])])),
    ] {
        let e = stored_with(vec![(key, bad.clone())]);
        assert_eq!(e.kind, K::FieldType, "{key} = {bad:?}: {e}");
        assert_eq!(e.event_index, Some(0));
    }
    // Invalid UTF-8 in a string field.
    let mut p = enc(&batch(vec![a(vec![
        s("BlockRemoved"),
        a(vec![]),
        s("G\u{e9}"),
    ])]));
    let at = p.len() - 3; // the "é" bytes
    p[at] = 0xff;
    assert_eq!(
        decode_batch(&p, &mut DecodedBatch::default())
            .unwrap_err()
            .kind,
        K::FieldType
    );
    // Reserved marker inside a skipped value.
    let mut p = enc(&batch(vec![m(vec![
        ("type", s("AllBlocksCleared")),
        ("x", V::Nil),
    ])]));
    let at = p.len() - 2; // the nil value of "x"
    p[at] = 0xc1;
    assert_eq!(
        decode_batch(&p, &mut DecodedBatch::default())
            .unwrap_err()
            .kind,
        K::FieldType
    );

    // HashType.
    for bad in [s("h"), V::F64(1.0), V::Nil, a(vec![])] {
        let e = one(a(vec![s("BlockRemoved"), a(vec![u(1), bad])]));
        assert_eq!(e.kind, K::HashType);
    }
    assert_eq!(
        one(a(vec![s("BlockStored"), a(vec![]), s("parent")])).kind,
        K::HashType
    );

    // TooLarge.
    let big = vec![0u8; MAX_PAYLOAD_BYTES + 1];
    assert_eq!(
        decode_batch(&big, &mut DecodedBatch::default())
            .unwrap_err()
            .kind,
        K::TooLarge
    );

    // The event index points at the failing event.
    let e = err(&batch(vec![
        m(vec![("type", s("AllBlocksCleared"))]),
        m(vec![("type", s("Nope"))]),
    ]));
    assert_eq!((e.kind, e.event_index), (K::UnknownEventType, Some(1)));
    assert_eq!(err(&a(vec![V::Nil, a(vec![])])).event_index, None);
}

#[test]
fn error_kinds_names_and_display() {
    let names: std::collections::HashSet<_> =
        DecodeErrorKind::ALL.iter().map(|k| k.name()).collect();
    assert_eq!(names.len(), DecodeErrorKind::ALL.len());
    assert!(names
        .iter()
        .all(|n| n.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')));
    let e = DecodeError::new(K::HashType, "block hash is not uint64, int64 or bin").in_event(3);
    assert_eq!(
        e.to_string(),
        "kv event payload: hash_type: block hash is not uint64, int64 or bin (event 3)"
    );
    assert_eq!(K::TooLarge.to_string(), "too_large");
}

#[test]
fn reused_batch_is_cleared_and_stops_allocating() {
    let big = enc(&batch(vec![
        ref_stored(),
        a(vec![
            s("BlockStored"),
            a(vec![u(1)]),
            V::Nil,
            toks(0..16),
            u(16),
            V::Nil,
            V::Nil,
            s("lora"),
        ]),
    ]));
    let small = enc(&a(vec![
        V::F64(9.0),
        a(vec![m(vec![("type", s("AllBlocksCleared"))])]),
    ]));
    let mut out = DecodedBatch::default();
    decode_batch(&big, &mut out).unwrap();
    let caps = |b: &DecodedBatch| {
        (
            b.events.capacity(),
            b.hashes.capacity(),
            b.tokens.capacity(),
            b.text.capacity(),
            b.events.as_ptr(),
            b.hashes.as_ptr(),
            b.tokens.as_ptr(),
            b.text.as_ptr(),
        )
    };
    let warm = caps(&out);
    decode_batch(&small, &mut out).unwrap();
    assert_eq!(out.events, vec![DecodedEvent::Cleared]);
    assert!(out.hashes.is_empty() && out.tokens.is_empty() && out.text.is_empty());
    assert_eq!((out.ts, out.data_parallel_rank), (9.0, None));
    for _ in 0..3 {
        decode_batch(&big, &mut out).unwrap();
        assert_eq!(caps(&out), warm, "a warmed-up batch reallocated");
    }
    // A failed decode leaves no stale events from the previous batch before the failure.
    let bad = enc(&batch(vec![m(vec![("type", s("Nope"))])]));
    assert!(decode_batch(&bad, &mut out).is_err());
    assert!(out.events.is_empty());
}

/// A store kvr cannot use, or one without token ids, is an event of its own: the batch
/// still decodes and its neighbours are intact (the old rule refused the whole batch).
#[test]
fn unusable_and_tokenless_stores_are_events_of_their_own() {
    let stored = |extra: Vec<(&str, V)>| {
        let mut e = vec![
            ("type", s("BlockStored")),
            ("block_hashes", a(vec![u(1), u(2)])),
            ("token_ids", toks(0..8)),
            ("block_size", u(4)),
        ];
        for (k, v) in extra {
            match e.iter_mut().find(|f| f.0 == k) {
                Some(f) => f.1 = v,
                None => e.push((k, v)),
            }
        }
        m(e)
    };
    let removed = m(vec![
        ("type", s("BlockRemoved")),
        ("block_hashes", a(vec![u(9)])),
    ]);
    let malformed = [
        stored(vec![("token_ids", toks(0..7))]),
        stored(vec![("token_ids", toks(0..9))]),
        stored(vec![("block_size", u(0))]),
        stored(vec![("extra_keys", a(vec![V::Nil]))]),
        stored(vec![("lookahead_token_ids", a(vec![toks(8..9)]))]),
        m(vec![
            ("type", s("BlockStored")),
            ("token_ids", toks(0..4)),
            ("block_size", u(4)),
        ]),
    ];
    for bad in malformed {
        let b = decode(&batch(vec![bad.clone(), removed.clone()])).unwrap();
        assert!(
            matches!(b.events[0], DecodedEvent::Malformed { .. }),
            "{bad:?}: {:?}",
            b.events[0]
        );
        assert!(
            matches!(&b.events[1], DecodedEvent::Removed { hashes, .. } if b.hashes[hashes.clone()] == [9])
        );
    }
    // vLLM's offloading placeholder (block_size 0, no tokens) and a Mamba state
    // checkpoint (one hash, its parent, no tokens, block_size set).
    for (ev, medium) in [
        (
            stored(vec![
                ("token_ids", a(vec![])),
                ("block_size", u(0)),
                ("medium", s("CPU")),
            ]),
            Medium::Cpu,
        ),
        (
            stored(vec![
                ("block_hashes", a(vec![u(7)])),
                ("parent_block_hash", u(6)),
                ("token_ids", a(vec![])),
                ("kv_cache_spec_kind", s("mamba")),
                ("group_idx", u(1)),
            ]),
            Medium::Gpu,
        ),
    ] {
        let b = decode(&batch(vec![ev, removed.clone()])).unwrap();
        let DecodedEvent::Tokenless {
            hashes,
            medium: got,
            ..
        } = &b.events[0]
        else {
            panic!("{:?}", b.events[0])
        };
        assert_eq!(*got, medium);
        assert!(!hashes.is_empty());
        assert!(matches!(b.events[1], DecodedEvent::Removed { .. }));
    }
    // Lookahead tokens are kept per block.
    let b = decode(&batch(vec![stored(vec![(
        "lookahead_token_ids",
        a(vec![toks(4..6), toks(8..10)]),
    )])]))
    .unwrap();
    let DecodedEvent::Stored { lookahead, .. } = &b.events[0] else {
        panic!()
    };
    assert_eq!(b.block_lookahead_tokens(lookahead, 0), &[4, 5]);
    assert_eq!(b.block_lookahead_tokens(lookahead, 1), &[8, 9]);
}
