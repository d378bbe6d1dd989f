//! The entry point: [`decode_batch`] reads one `KVEventBatch` payload, the outer array
//! `[ts, events, data_parallel_rank]`, handing each event to `event.rs`.

use super::batch::{DecodedBatch, MAX_PAYLOAD_BYTES};
use super::cursor::Cursor;
use super::error::{DecodeError, DecodeErrorKind as K, Result};
use super::event::decode_event;

/// Decodes one msgpack `KVEventBatch` payload into `out` (cleared first).
///
/// Accepts tagged-map and positional-array events (mixed freely), uint64/int64/bin hashes,
/// `ts` as f64/f32/int, a missing or nil `data_parallel_rank`, and ignores extra trailing
/// batch elements, unknown map keys and extra positional fields. Bytes after the batch are
/// an error ([`DecodeErrorKind::TrailingBytes`]).
///
/// On error `out` may be partially filled; apply nothing from it.
///
/// [`DecodeErrorKind::TrailingBytes`]: super::DecodeErrorKind::TrailingBytes
pub fn decode_batch(payload: &[u8], out: &mut DecodedBatch) -> Result<()> {
    out.reset();
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(DecodeError::new(
            K::TooLarge,
            "payload exceeds MAX_PAYLOAD_BYTES",
        ));
    }
    let mut c = Cursor::new(payload);
    let n = c.array_len(K::BatchShape, "batch is not an array")?;
    if n < 2 {
        return Err(DecodeError::new(
            K::BatchShape,
            "batch array has fewer than 2 elements",
        ));
    }
    out.ts = c.float(K::FieldType, "ts is not a number")?;
    let n_events = c.array_len(K::BatchShape, "events is not an array")?;
    for i in 0..n_events {
        decode_event(&mut c, out).map_err(|e| e.in_event(i))?;
    }
    if n >= 3 {
        out.data_parallel_rank = if c.take_nil()? {
            None
        } else {
            Some(c.u32(K::FieldType, "data_parallel_rank is not a u32 or nil")?)
        };
        c.skip_values(n - 3)?;
    }
    if c.remaining() != 0 {
        return Err(DecodeError::new(
            K::TrailingBytes,
            "bytes follow the batch array",
        ));
    }
    Ok(())
}

/// Whether a payload's first event is `AllBlocksCleared` (tagged or positional), read
/// without decoding the rest: such a batch makes whatever its publisher sent before it
/// irrelevant to the index, so a stream takes it as a fence (a loss or a restart it ends
/// is not replayed, the stream's ranks are cleared). `false` for anything that does not
/// read so far.
pub fn starts_with_clear(payload: &[u8]) -> bool {
    let first_tag = || -> Result<bool> {
        let mut c = Cursor::new(payload);
        if c.array_len(K::BatchShape, "batch is not an array")? < 2 {
            return Ok(false);
        }
        c.skip_values(1)?;
        if c.array_len(K::BatchShape, "events is not an array")? == 0 {
            return Ok(false);
        }
        let tag = match c.peek()? {
            rmp::Marker::FixMap(_) | rmp::Marker::Map16 | rmp::Marker::Map32 => {
                let n = c.map_len(K::EventShape, "event is not a map")?;
                let mut tag = None;
                for _ in 0..n {
                    if c.key()? == Some(&b"type"[..]) {
                        tag = Some(c.str_bytes(K::EventShape, "type is not a string")?);
                        break;
                    }
                    c.skip_values(1)?;
                }
                tag
            }
            _ => {
                if c.array_len(K::EventShape, "event is not an array")? == 0 {
                    return Ok(false);
                }
                Some(c.str_bytes(K::EventShape, "tag is not a string")?)
            }
        };
        Ok(tag == Some(&b"AllBlocksCleared"[..]))
    };
    payload.len() <= MAX_PAYLOAD_BYTES && first_tag().unwrap_or(false)
}
