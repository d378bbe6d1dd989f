//! What the JetStream sync puts on the wire: each booking event in Dynamo's msgpack
//! encoding (unchanged), wrapped in kvr's envelope that names the sending replica, its
//! incarnation (one process's life) and the event's sequence number in that incarnation;
//! and the heartbeat a replica sends every second on core NATS.

use rmpv::Value;

use crate::dynamo_wire::{self, WireError, MAX_PAYLOAD_BYTES};
use crate::event::BookingEvent;

/// The longest replica name: one NATS subject token of letters, digits, `-` and `_`.
pub const MAX_NAME_LEN: usize = 64;

/// One booking event of one replica's incarnation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Envelope {
    pub(crate) name: String,
    pub(crate) incarnation: u64,
    pub(crate) seq: u64,
    pub(crate) event: BookingEvent,
}

/// A replica's heartbeat: alive, in this incarnation, having enqueued `seq` events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Heartbeat {
    pub(crate) name: String,
    pub(crate) incarnation: u64,
    pub(crate) seq: u64,
}

/// Whether `name` can be a replica name (a subject token that needs no escaping).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

pub(crate) fn encode(name: &str, incarnation: u64, seq: u64, ev: &BookingEvent) -> Vec<u8> {
    let inner = dynamo_wire::encode(ev);
    let mut out = Vec::with_capacity(inner.len() + name.len() + 48);
    let w = &mut out;
    // Writing into a Vec cannot fail.
    let _ = rmp::encode::write_map_len(w, 4);
    let _ = rmp::encode::write_str(w, "name");
    let _ = rmp::encode::write_str(w, name);
    let _ = rmp::encode::write_str(w, "inc");
    let _ = rmp::encode::write_uint(w, incarnation);
    let _ = rmp::encode::write_str(w, "seq");
    let _ = rmp::encode::write_uint(w, seq);
    let _ = rmp::encode::write_str(w, "event");
    let _ = rmp::encode::write_bin(w, &inner);
    out
}

pub(crate) fn encode_heartbeat(hb: &Heartbeat) -> Vec<u8> {
    let mut out = Vec::with_capacity(hb.name.len() + 32);
    let w = &mut out;
    let _ = rmp::encode::write_map_len(w, 3);
    let _ = rmp::encode::write_str(w, "name");
    let _ = rmp::encode::write_str(w, &hb.name);
    let _ = rmp::encode::write_str(w, "inc");
    let _ = rmp::encode::write_uint(w, hb.incarnation);
    let _ = rmp::encode::write_str(w, "seq");
    let _ = rmp::encode::write_uint(w, hb.seq);
    out
}

fn read_map(payload: &[u8]) -> Result<Vec<(Value, Value)>, WireError> {
    if payload.len() > MAX_PAYLOAD_BYTES + 256 {
        return Err(WireError::TooLarge(payload.len()));
    }
    let mut rd = payload;
    match rmpv::decode::read_value_with_max_depth(&mut rd, 8) {
        Ok(Value::Map(m)) => Ok(m),
        Ok(_) => Err(WireError::Schema("envelope")),
        Err(e) => Err(WireError::NotMsgpack(e.to_string())),
    }
}

fn field<'a>(m: &'a [(Value, Value)], k: &str) -> Option<&'a Value> {
    m.iter()
        .find(|(key, _)| key.as_str() == Some(k))
        .map(|(_, v)| v)
}

fn head(m: &[(Value, Value)]) -> Result<(String, u64, u64), WireError> {
    let name = field(m, "name")
        .and_then(Value::as_str)
        .filter(|n| valid_name(n))
        .ok_or(WireError::Schema("name"))?;
    let inc = field(m, "inc")
        .and_then(Value::as_u64)
        .ok_or(WireError::Schema("inc"))?;
    let seq = field(m, "seq")
        .and_then(Value::as_u64)
        .ok_or(WireError::Schema("seq"))?;
    Ok((name.to_string(), inc, seq))
}

pub(crate) fn decode(payload: &[u8]) -> Result<Envelope, WireError> {
    let m = read_map(payload)?;
    let (name, incarnation, seq) = head(&m)?;
    if seq == 0 {
        return Err(WireError::Schema("seq"));
    }
    let inner = match field(&m, "event") {
        Some(Value::Binary(b)) => b,
        _ => return Err(WireError::Schema("event")),
    };
    let event = dynamo_wire::decode(inner)?;
    Ok(Envelope {
        name,
        incarnation,
        seq,
        event,
    })
}

pub(crate) fn decode_heartbeat(payload: &[u8]) -> Result<Heartbeat, WireError> {
    let m = read_map(payload)?;
    let (name, incarnation, seq) = head(&m)?;
    Ok(Heartbeat {
        name,
        incarnation,
        seq,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{AddRequest, EventData};
    use kvr::{PartitionKey, RankId};

    #[test]
    fn an_envelope_round_trips_and_bad_ones_are_refused() {
        let ev = BookingEvent {
            key: PartitionKey::new("m", "g"),
            block_size: 16,
            request_id: "r1".into(),
            rank: RankId::new(7, 1),
            data: EventData::Add(AddRequest {
                token_sequence: Some(vec![1, u64::MAX]),
                track_prefill_tokens: true,
                expected_output_tokens: Some(9),
                prefill_tokens: Some(40),
                expected_prefill_duration: None,
            }),
            router_id: 5,
            lora_name: None,
        };
        let b = encode("a-1", 77, 3, &ev);
        let e = decode(&b).unwrap();
        assert_eq!((e.name.as_str(), e.incarnation, e.seq), ("a-1", 77, 3));
        assert_eq!(e.event, ev);
        assert!(
            decode(&encode("a.b", 1, 1, &ev)).is_err(),
            "a dot in a name"
        );
        assert!(decode(&encode("a", 1, 0, &ev)).is_err(), "sequence 0");
        assert!(decode(b"\x01").is_err());
        let hb = Heartbeat {
            name: "x".into(),
            incarnation: 2,
            seq: 0,
        };
        assert_eq!(decode_heartbeat(&encode_heartbeat(&hb)).unwrap(), hb);
        assert!(!valid_name("") && !valid_name("a b") && !valid_name(&"x".repeat(65)));
    }
}
