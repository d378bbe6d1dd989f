//! The wire against messages captured from Dynamo 1.6.1's replica publisher (a booking of
//! 69 tokens at block size 16 on worker 1, its prefill completion and its free), and
//! against the forms Dynamo's reader accepts.

use super::*;

fn unhex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

const ADD: &str = "84aa6d6f64656c5f6e616d65a16dad726f7574696e675f67726f7570a764656661756c74aa626c6f636b5f73697a6510
a56576656e7485aa726571756573745f6964a56361702d31a6776f726b657282a9776f726b65725f696401a764705f72616e6b00
a46461746181aa4164645265717565737484ae746f6b656e5f73657175656e636594cfea06fc71a5ee6e88cfad01835a37dd294c
cf0d55e56c2bccbd1acf445502a8048d6688b4747261636b5f70726566696c6c5f746f6b656e73c3b665787065637465645f6f75
747075745f746f6b656e7320b170726566696c6c5f6c6f61645f68696e7482d920696e697469616c5f6566666563746976655f70
726566696c6c5f746f6b656e7345b965787065637465645f70726566696c6c5f6475726174696f6ec0a9726f757465725f6964cf
8bbf4d02ea81a9bba96c6f72615f6e616d65c0";

const PREFILL: &str = "84aa6d6f64656c5f6e616d65a16dad726f7574696e675f67726f7570a764656661756c74aa626c6f636b5f73697a6510
a56576656e7485aa726571756573745f6964a56361702d31a6776f726b657282a9776f726b65725f696401a764705f72616e6b00
a464617461b44d61726b50726566696c6c436f6d706c65746564a9726f757465725f6964cf8bbf4d02ea81a9bba96c6f72615f6e
616d65c0";

const FREE: &str = "84aa6d6f64656c5f6e616d65a16dad726f7574696e675f67726f7570a764656661756c74aa626c6f636b5f73697a6510
a56576656e7485aa726571756573745f6964a56361702d31a6776f726b657282a9776f726b65725f696401a764705f72616e6b00
a464617461a446726565a9726f757465725f6964cf8bbf4d02ea81a9bba96c6f72615f6e616d65c0";

const ROUTER: u64 = 10_069_851_966_743_357_883;

fn base(data: EventData) -> BookingEvent {
    BookingEvent {
        key: PartitionKey::new("m", "default"),
        block_size: 16,
        request_id: "cap-1".into(),
        rank: RankId::new(1, 0),
        data,
        router_id: ROUTER,
        lora_name: None,
    }
}

fn captured_add() -> BookingEvent {
    base(EventData::Add(AddRequest {
        token_sequence: Some(vec![
            16_863_443_419_780_771_464,
            12_466_389_667_045_779_788,
            960_926_348_267_535_642,
            4_923_844_688_253_642_376,
        ]),
        track_prefill_tokens: true,
        expected_output_tokens: Some(32),
        prefill_tokens: Some(69),
        expected_prefill_duration: None,
    }))
}

#[test]
fn dynamo_messages_read_and_write_byte_for_byte() {
    for (hex, want) in [
        (ADD, captured_add()),
        (PREFILL, base(EventData::PrefillComplete)),
        (FREE, base(EventData::Free)),
    ] {
        let bytes = unhex(hex);
        let got = decode(&bytes).expect("a captured message decodes");
        assert_eq!(got, want);
        assert_eq!(encode(&want), bytes, "kvr writes what Dynamo wrote");
    }
}

/// Builds a msgpack value's bytes.
fn pack(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn s(x: &str) -> Value {
    Value::from(x)
}

fn map(kv: Vec<(&str, Value)>) -> Value {
    Value::Map(kv.into_iter().map(|(k, v)| (s(k), v)).collect())
}

#[test]
fn the_array_form_and_unknown_keys_are_read() {
    // Dynamo's reader takes the positional form of every struct.
    let arr = Value::Array(vec![
        s("m"),
        s("default"),
        Value::from(16),
        Value::Array(vec![
            s("a-1"),
            Value::Array(vec![Value::from(7), Value::from(1)]),
            map(vec![(
                "AddRequest",
                Value::Array(vec![
                    Value::Array(vec![Value::from(1u64), Value::from(u64::MAX)]),
                    Value::from(true),
                    Value::Nil,
                    Value::Nil,
                ]),
            )]),
            Value::from(5),
            Value::Nil,
        ]),
    ]);
    let ev = decode(&pack(&arr)).unwrap();
    assert_eq!(ev.rank, RankId::new(7, 1));
    assert_eq!(ev.request_id, "a-1");
    match ev.data {
        EventData::Add(a) => {
            assert_eq!(a.token_sequence, Some(vec![1, u64::MAX]));
            assert_eq!(a.booked_prefill_tokens(), 0, "no hint, no prefill load");
        }
        other => panic!("{other:?}"),
    }
    // Extra keys at every level, a missing lora_name and a minimal AddRequest (tracking
    // defaults to true).
    let m = map(vec![
        ("stride", Value::from(3)),
        ("model_name", s("m")),
        ("routing_group", s("g")),
        ("block_size", Value::from(64)),
        (
            "event",
            map(vec![
                ("request_id", s("x")),
                (
                    "worker",
                    map(vec![
                        ("worker_id", Value::from(2)),
                        ("dp_rank", Value::from(0)),
                        ("extra", Value::Nil),
                    ]),
                ),
                (
                    "data",
                    map(vec![(
                        "AddRequest",
                        map(vec![
                            ("token_sequence", Value::Array(vec![Value::from(9)])),
                            (
                                "prefill_load_hint",
                                map(vec![
                                    ("initial_effective_prefill_tokens", Value::from(40)),
                                    (
                                        "expected_prefill_duration",
                                        map(vec![
                                            ("secs", Value::from(1)),
                                            ("nanos", Value::from(5)),
                                        ]),
                                    ),
                                ]),
                            ),
                            ("new_field", Value::from(true)),
                        ]),
                    )]),
                ),
                ("router_id", Value::from(0)),
            ]),
        ),
    ]);
    let ev = decode(&pack(&m)).unwrap();
    assert_eq!(ev.lora_name, None);
    match ev.data {
        EventData::Add(a) => {
            assert!(a.track_prefill_tokens);
            assert_eq!(a.booked_prefill_tokens(), 40);
            assert_eq!(a.expected_prefill_duration, Some(Duration::new(1, 5)));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn what_dynamo_refuses_is_refused() {
    let mut bad_hash = captured_add();
    if let EventData::Add(a) = &mut bad_hash.data {
        a.token_sequence = Some(vec![1]);
    }
    // A negative hash: swap the positive 1 for -1 in the bytes.
    let mut bytes = encode(&bad_hash);
    let at = bytes.windows(2).position(|w| w == [0x91, 0x01]).unwrap();
    bytes[at + 1] = 0xff;
    assert_eq!(decode(&bytes), Err(WireError::Schema("token_sequence")));
    // An unknown variant.
    let unknown = map(vec![
        ("model_name", s("m")),
        ("routing_group", s("g")),
        ("block_size", Value::from(16)),
        (
            "event",
            map(vec![
                ("request_id", s("x")),
                (
                    "worker",
                    map(vec![
                        ("worker_id", Value::from(1)),
                        ("dp_rank", Value::from(0)),
                    ]),
                ),
                ("data", map(vec![("NewKind", map(vec![]))])),
                ("router_id", Value::from(1)),
            ]),
        ),
    ]);
    assert_eq!(decode(&pack(&unknown)), Err(WireError::Schema("data")));
    // The older envelope naming the group `tenant_id`.
    let old = map(vec![
        ("model_name", s("m")),
        ("tenant_id", s("g")),
        ("block_size", Value::from(16)),
    ]);
    assert_eq!(decode(&pack(&old)), Err(WireError::Schema("routing_group")));
    assert!(decode(&[0xc1]).is_err());
    assert!(matches!(decode(&[0x92]), Err(WireError::NotMsgpack(_))));
    assert_eq!(
        decode(&vec![0; MAX_PAYLOAD_BYTES + 1]),
        Err(WireError::TooLarge(MAX_PAYLOAD_BYTES + 1))
    );
}

#[test]
fn hostile_bytes_never_panic_nor_allocate_what_they_claim() {
    // An array claiming 2^32 - 1 entries in five bytes, and maps nested past the limit.
    assert!(decode(&[0xdd, 0xff, 0xff, 0xff, 0xff]).is_err());
    assert!(decode(&[0x81; 64]).is_err());
    // Every cut of a valid message, and bytes flipped through it.
    let good = unhex(ADD);
    for n in 0..good.len() {
        let _ = decode(&good[..n]);
    }
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..20_000 {
        x = kvr::hash::splitmix64(x);
        let mut b = good.clone();
        let i = (x as usize) % b.len();
        b[i] ^= (x >> 32) as u8 | 1;
        let _ = decode(&b);
    }
}
