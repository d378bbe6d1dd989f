//! Dynamo 1.6.1's replica-sync messages (topic `dynamo.slot-tracker.v1`), byte for byte.
//!
//! A message is two ZMQ frames: the topic, then one msgpack value. Dynamo writes maps with
//! string keys in a fixed order and integers in their smallest form; it reads the map or
//! the positional (array) form of every struct and ignores keys it does not know. kvr
//! writes what Dynamo writes and reads what Dynamo reads: a sender's hashes are unsigned
//! 64-bit numbers (a negative one makes the whole message unreadable, as in Dynamo).

use std::time::Duration;

use kvr::{PartitionKey, RankId};
use rmpv::Value;

use crate::event::{AddRequest, BookingEvent, EventData};

/// The topic booking events travel on.
pub const BOOKING_TOPIC: &[u8] = b"dynamo.slot-tracker.v1";

/// The largest payload a receiver reads (a 100k-token prompt's hashes take ~60 KiB).
pub const MAX_PAYLOAD_BYTES: usize = 4 << 20;

/// Nesting deeper than any valid message is refused before it is read.
const MAX_DEPTH: usize = 16;

/// Why a payload is not a booking event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireError {
    /// Over [`MAX_PAYLOAD_BYTES`].
    TooLarge(usize),
    /// Not one msgpack value.
    NotMsgpack(String),
    /// Msgpack, but not the booking envelope: the field that did not fit.
    Schema(&'static str),
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireError::TooLarge(n) => write!(
                f,
                "booking event of {n} bytes is over the {MAX_PAYLOAD_BYTES}-byte limit"
            ),
            WireError::NotMsgpack(e) => write!(f, "booking event is not msgpack: {e}"),
            WireError::Schema(what) => write!(f, "booking event has a bad or missing {what}"),
        }
    }
}

impl std::error::Error for WireError {}

/// Writes `ev` as Dynamo does (map form, Dynamo's key order, smallest integers).
pub fn encode(ev: &BookingEvent) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        160 + ev.request_id.len()
            + match &ev.data {
                EventData::Add(a) => a.token_sequence.as_ref().map_or(0, |s| 9 * s.len()),
                _ => 0,
            },
    );
    let w = &mut out;
    // Writing into a Vec cannot fail.
    let _ = rmp::encode::write_map_len(w, 4);
    str_field(w, "model_name", &ev.key.model);
    str_field(w, "routing_group", &ev.key.routing_group);
    uint_field(w, "block_size", u64::from(ev.block_size));
    let _ = rmp::encode::write_str(w, "event");
    let _ = rmp::encode::write_map_len(w, 5);
    str_field(w, "request_id", &ev.request_id);
    let _ = rmp::encode::write_str(w, "worker");
    let _ = rmp::encode::write_map_len(w, 2);
    uint_field(w, "worker_id", ev.rank.worker_id);
    uint_field(w, "dp_rank", u64::from(ev.rank.dp_rank));
    let _ = rmp::encode::write_str(w, "data");
    match &ev.data {
        EventData::Add(a) => write_add(w, a),
        EventData::PrefillComplete => {
            let _ = rmp::encode::write_str(w, "MarkPrefillCompleted");
        }
        EventData::Free => {
            let _ = rmp::encode::write_str(w, "Free");
        }
    }
    uint_field(w, "router_id", ev.router_id);
    let _ = rmp::encode::write_str(w, "lora_name");
    match &ev.lora_name {
        Some(l) => {
            let _ = rmp::encode::write_str(w, l);
        }
        None => {
            let _ = rmp::encode::write_nil(w);
        }
    }
    out
}

fn write_add(w: &mut Vec<u8>, a: &AddRequest) {
    let _ = rmp::encode::write_map_len(w, 1);
    let _ = rmp::encode::write_str(w, "AddRequest");
    let _ = rmp::encode::write_map_len(w, 4);
    let _ = rmp::encode::write_str(w, "token_sequence");
    match &a.token_sequence {
        Some(seq) => {
            let _ = rmp::encode::write_array_len(w, seq.len() as u32);
            for &h in seq {
                let _ = rmp::encode::write_uint(w, h);
            }
        }
        None => {
            let _ = rmp::encode::write_nil(w);
        }
    }
    let _ = rmp::encode::write_str(w, "track_prefill_tokens");
    let _ = rmp::encode::write_bool(w, a.track_prefill_tokens);
    let _ = rmp::encode::write_str(w, "expected_output_tokens");
    match a.expected_output_tokens {
        Some(n) => {
            let _ = rmp::encode::write_uint(w, u64::from(n));
        }
        None => {
            let _ = rmp::encode::write_nil(w);
        }
    }
    let _ = rmp::encode::write_str(w, "prefill_load_hint");
    match a.prefill_tokens {
        Some(n) => {
            let _ = rmp::encode::write_map_len(w, 2);
            uint_field(w, "initial_effective_prefill_tokens", n);
            let _ = rmp::encode::write_str(w, "expected_prefill_duration");
            match a.expected_prefill_duration {
                Some(d) => {
                    let _ = rmp::encode::write_map_len(w, 2);
                    uint_field(w, "secs", d.as_secs());
                    uint_field(w, "nanos", u64::from(d.subsec_nanos()));
                }
                None => {
                    let _ = rmp::encode::write_nil(w);
                }
            }
        }
        None => {
            let _ = rmp::encode::write_nil(w);
        }
    }
}

fn str_field(w: &mut Vec<u8>, k: &str, v: &str) {
    let _ = rmp::encode::write_str(w, k);
    let _ = rmp::encode::write_str(w, v);
}

fn uint_field(w: &mut Vec<u8>, k: &str, v: u64) {
    let _ = rmp::encode::write_str(w, k);
    let _ = rmp::encode::write_uint(w, v);
}

/// Reads a booking event (map or array form; unknown keys ignored).
pub fn decode(payload: &[u8]) -> Result<BookingEvent, WireError> {
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(WireError::TooLarge(payload.len()));
    }
    let mut rd = payload;
    let v = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| WireError::NotMsgpack(e.to_string()))?;
    let env = Fields::of(&v, &["model_name", "routing_group", "block_size", "event"])
        .ok_or(WireError::Schema("envelope"))?;
    let model = string(env.get(0)).ok_or(WireError::Schema("model_name"))?;
    let group = string(env.get(1)).ok_or(WireError::Schema("routing_group"))?;
    let block_size = uint(env.get(2))
        .and_then(|n| u32::try_from(n).ok())
        .ok_or(WireError::Schema("block_size"))?;
    let event = env.get(3).ok_or(WireError::Schema("event"))?;
    let ev = Fields::of(
        event,
        &["request_id", "worker", "data", "router_id", "lora_name"],
    )
    .ok_or(WireError::Schema("event"))?;
    let request_id = string(ev.get(0)).ok_or(WireError::Schema("request_id"))?;
    let worker = ev
        .get(1)
        .and_then(|w| Fields::of(w, &["worker_id", "dp_rank"]))
        .ok_or(WireError::Schema("worker"))?;
    let worker_id = uint(worker.get(0)).ok_or(WireError::Schema("worker_id"))?;
    let dp_rank = uint(worker.get(1))
        .and_then(|n| u32::try_from(n).ok())
        .ok_or(WireError::Schema("dp_rank"))?;
    let data = data(ev.get(2).ok_or(WireError::Schema("data"))?)?;
    let router_id = uint(ev.get(3)).ok_or(WireError::Schema("router_id"))?;
    let lora_name = match ev.get(4) {
        None | Some(Value::Nil) => None,
        Some(v) => Some(string(Some(v)).ok_or(WireError::Schema("lora_name"))?),
    };
    Ok(BookingEvent {
        key: PartitionKey::new(model, group),
        block_size,
        request_id,
        rank: RankId::new(worker_id, dp_rank),
        data,
        router_id,
        lora_name,
    })
}

/// An externally tagged enum: a unit variant as its name (or `{name: nil}`), the add as
/// `{"AddRequest": {...}}`.
fn data(v: &Value) -> Result<EventData, WireError> {
    let (tag, body) = match v {
        Value::String(s) => (s.as_str().ok_or(WireError::Schema("data"))?, None),
        Value::Map(m) if m.len() == 1 => {
            let (k, b) = &m[0];
            (k.as_str().ok_or(WireError::Schema("data"))?, Some(b))
        }
        _ => return Err(WireError::Schema("data")),
    };
    match tag {
        "Free" => Ok(EventData::Free),
        "MarkPrefillCompleted" => Ok(EventData::PrefillComplete),
        "AddRequest" => add(body.ok_or(WireError::Schema("AddRequest"))?).map(EventData::Add),
        _ => Err(WireError::Schema("data")),
    }
}

fn add(v: &Value) -> Result<AddRequest, WireError> {
    let f = Fields::of(
        v,
        &[
            "token_sequence",
            "track_prefill_tokens",
            "expected_output_tokens",
            "prefill_load_hint",
        ],
    )
    .ok_or(WireError::Schema("AddRequest"))?;
    let token_sequence = match f.get(0) {
        None | Some(Value::Nil) => None,
        Some(Value::Array(a)) => Some(
            a.iter()
                .map(|h| h.as_u64())
                .collect::<Option<Vec<u64>>>()
                .ok_or(WireError::Schema("token_sequence"))?,
        ),
        Some(_) => return Err(WireError::Schema("token_sequence")),
    };
    let track_prefill_tokens = match f.get(1) {
        None | Some(Value::Nil) => true,
        Some(Value::Boolean(b)) => *b,
        Some(_) => return Err(WireError::Schema("track_prefill_tokens")),
    };
    let expected_output_tokens = match f.get(2) {
        None | Some(Value::Nil) => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or(WireError::Schema("expected_output_tokens"))?,
        ),
    };
    let (prefill_tokens, expected_prefill_duration) = match f.get(3) {
        None | Some(Value::Nil) => (None, None),
        Some(h) => {
            let h = Fields::of(
                h,
                &[
                    "initial_effective_prefill_tokens",
                    "expected_prefill_duration",
                ],
            )
            .ok_or(WireError::Schema("prefill_load_hint"))?;
            let n = uint(h.get(0)).ok_or(WireError::Schema("prefill_load_hint"))?;
            let d = match h.get(1) {
                None | Some(Value::Nil) => None,
                Some(d) => {
                    let d = Fields::of(d, &["secs", "nanos"])
                        .ok_or(WireError::Schema("expected_prefill_duration"))?;
                    let secs = uint(d.get(0)).ok_or(WireError::Schema("secs"))?;
                    let nanos = uint(d.get(1))
                        .and_then(|n| u32::try_from(n).ok())
                        .filter(|&n| n < 1_000_000_000)
                        .ok_or(WireError::Schema("nanos"))?;
                    Some(Duration::new(secs, nanos))
                }
            };
            (Some(n), d)
        }
    };
    Ok(AddRequest {
        token_sequence,
        track_prefill_tokens,
        expected_output_tokens,
        prefill_tokens,
        expected_prefill_duration,
    })
}

/// A struct's fields in declaration order, from its map form (by name, unknown keys
/// ignored, a repeated key's last value) or its array form (by position, extra entries
/// ignored).
struct Fields<'a> {
    values: Vec<Option<&'a Value>>,
}

impl<'a> Fields<'a> {
    fn of(v: &'a Value, names: &[&str]) -> Option<Self> {
        let mut values = vec![None; names.len()];
        match v {
            Value::Map(m) => {
                for (k, val) in m {
                    if let Some(i) = k.as_str().and_then(|k| names.iter().position(|n| *n == k)) {
                        values[i] = Some(val);
                    }
                }
            }
            Value::Array(a) => {
                for (slot, val) in values.iter_mut().zip(a) {
                    *slot = Some(val);
                }
            }
            _ => return None,
        }
        Some(Self { values })
    }

    fn get(&self, i: usize) -> Option<&'a Value> {
        self.values.get(i).copied().flatten()
    }
}

fn string(v: Option<&Value>) -> Option<String> {
    v?.as_str().map(str::to_owned)
}

fn uint(v: Option<&Value>) -> Option<u64> {
    v?.as_u64()
}

#[cfg(test)]
#[path = "dynamo_wire_tests.rs"]
mod tests;
