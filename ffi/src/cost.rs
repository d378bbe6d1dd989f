//! The cost model of a partition: which model its selections minimise, the latency
//! model's knobs (set on the partition options), and the prefill rate a partition learned.
//!
//! Each setter refuses, as `KVR_ERR_INVALID_ARGUMENT` and changing nothing, exactly what
//! `PartitionConfig::validate` would refuse for its knob (the tests below hold the two
//! together), so options that every setter accepted make a partition.

#[cfg(test)]
use kvr::config::PartitionConfig;
use kvr::config::{CostModel, LatencyConfig};

use crate::handles::{kvr_partition, kvr_partition_options};
use crate::status::*;

/// Cost model: each candidate's predicted time to first token in ms (its booked prefill
/// queue plus the prompt's uncached part at the partition's prefill rate), with decode
/// load as a tie-break until KV memory nears full or a per-token latency target is set.
/// The default.
pub const KVR_COST_MODEL_LATENCY: u32 = 0;
/// Cost model: Dynamo's default scorer, term for term, in block equivalents (prefill
/// blocks after cache credit plus decode blocks), for a deployment that must route
/// exactly as Dynamo does.
pub const KVR_COST_MODEL_DYNAMO: u32 = 1;

/// Which cost the partition's selections minimise: `KVR_COST_MODEL_LATENCY` (the
/// default; `kvr_decision.cost` is then a TTFT estimate in ms) or `KVR_COST_MODEL_DYNAMO`
/// (`kvr_decision.cost` in block equivalents). Any other value is
/// `KVR_ERR_INVALID_ARGUMENT` and changes nothing. The latency knobs
/// (`kvr_partition_options_set_prefill_rate_prior` and the others) are kept, and checked,
/// whichever model is set.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_cost_model(
    opts: *mut kvr_partition_options,
    model: u32,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let o = unsafe { handle_mut(opts) }?;
        o.config.cost.model = match model {
            KVR_COST_MODEL_LATENCY => CostModel::Latency,
            KVR_COST_MODEL_DYNAMO => CostModel::Dynamo,
            _ => return Err(KVR_ERR_INVALID_ARGUMENT),
        };
        Ok(())
    })
}

/// Sets one latency knob: `set` writes `value` into a copy of the options' latency
/// knobs, which is kept only if every knob is then in range
/// (`LatencyConfig::out_of_range`, the ranges `PartitionConfig::validate` checks);
/// otherwise `KVR_ERR_INVALID_ARGUMENT` and nothing changes. A NULL handle is
/// `KVR_ERR_NULL`.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
unsafe fn set_latency<T>(
    opts: *mut kvr_partition_options,
    value: T,
    set: impl FnOnce(&mut LatencyConfig, T),
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let o = unsafe { handle_mut(opts) }?;
        let mut l = o.config.cost.latency;
        set(&mut l, value);
        if l.out_of_range().is_some() {
            return Err(KVR_ERR_INVALID_ARGUMENT);
        }
        o.config.cost.latency = l;
        Ok(())
    })
}

/// Latency model: prefill throughput of one rank, tokens/s, before any is learned
/// (default 10,000; finite and > 0, else `KVR_ERR_INVALID_ARGUMENT`). A learned rate is
/// kept within [prior / 10, prior × 10].
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_prefill_rate_prior(
    opts: *mut kvr_partition_options,
    tokens_per_s: f64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { set_latency(opts, tokens_per_s, |l, v| l.prefill_rate_prior = v) }
}

/// Latency model: whether the partition learns its prefill rate from the timings of
/// `kvr_engine_mark_prefill_complete` (non-zero, the default) or keeps the prior (0).
/// `kvr_partition_prefill_rate` reports what was learned either way.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_learn_prefill_rate(
    opts: *mut kvr_partition_options,
    on: u32,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { set_latency(opts, on != 0, |l, v| l.learn_prefill_rate = v) }
}

/// Latency model: fixed cost of one request's prefill, ms (default 5; finite and ≥ 0).
/// It shifts every candidate alike and makes the reported cost a TTFT estimate.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_request_overhead_ms(
    opts: *mut kvr_partition_options,
    ms: f64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { set_latency(opts, ms, |l, v| l.request_overhead_ms = v) }
}

/// Latency model: share of a rank's KV blocks in use (after the booking) above which KV
/// memory pressure is charged (default 0.9; in [0, 1], else `KVR_ERR_INVALID_ARGUMENT`).
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_kv_pressure_threshold(
    opts: *mut kvr_partition_options,
    share: f64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { set_latency(opts, share, |l, v| l.kv_pressure_threshold = v) }
}

/// Latency model: the KV pressure charge at full KV memory, ms, rising linearly from the
/// threshold (default 1,000; finite and ≥ 0).
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_kv_pressure_ms(
    opts: *mut kvr_partition_options,
    ms: f64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { set_latency(opts, ms, |l, v| l.kv_pressure_ms = v) }
}

/// Latency model: a per-token latency target, ms. A rank whose predicted per-token
/// latency exceeds it is charged the excess over the request's expected output. Default:
/// no target. `ms` > 0 (finite) sets the target; **0 clears it** (no target); negative,
/// NaN or infinite values are `KVR_ERR_INVALID_ARGUMENT` and change nothing.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_itl_target_ms(
    opts: *mut kvr_partition_options,
    ms: f64,
) -> kvr_status {
    // 0 (or -0) clears the target; anything else must be a valid target.
    // SAFETY: forwarded caller contract.
    unsafe { set_latency(opts, ms, |l, v| l.itl_target_ms = (v != 0.0).then_some(v)) }
}

/// Latency model: predicted per-token latency of a lone request, ms (default 20; finite
/// and ≥ 0; only read with a target, `kvr_partition_options_set_itl_target_ms`).
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_itl_base_ms(
    opts: *mut kvr_partition_options,
    ms: f64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { set_latency(opts, ms, |l, v| l.itl_base_ms = v) }
}

/// Latency model: predicted extra per-token latency per request running on the rank, ms
/// (default 0.2; finite and ≥ 0; only read with a target).
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_itl_per_request_ms(
    opts: *mut kvr_partition_options,
    ms: f64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { set_latency(opts, ms, |l, v| l.itl_per_request_ms = v) }
}

/// Latency model: weight of the queue externality (default 2; 0 = price only this
/// request's TTFT; finite and ≥ 0): a prompt's uncached tokens also delay the requests
/// that will queue behind them, so under load a cache miss costs more than its own
/// prefill.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_queue_externality(
    opts: *mut kvr_partition_options,
    weight: f64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { set_latency(opts, weight, |l, v| l.queue_externality = v) }
}

/// Latency model's tie-break: µs charged per decode block the rank would hold after the
/// booking (default 1; finite and ≥ 0).
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_decode_block_us(
    opts: *mut kvr_partition_options,
    us: f64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { set_latency(opts, us, |l, v| l.decode_block_us = v) }
}

/// The partition's prefill throughput per rank learned from the timings of
/// `kvr_engine_mark_prefill_complete`, tokens/s, in `*out_rate`, and the prefill
/// completions observed so far in `*out_observations`. `*out_rate` is 0 while none is
/// learned (fewer than a few completions observed, or none took measurable time); the
/// call is then still `KVR_OK`. The rate is the estimate itself: a selection with the
/// latency model and learning on uses it within [prior / 10, prior × 10], else the prior.
/// Lock-free (two atomic loads).
///
/// # Safety
/// `partition` is NULL or live; `out_rate` and `out_observations` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_prefill_rate(
    partition: *const kvr_partition,
    out_rate: *mut f64,
    out_observations: *mut u64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        write_learned(partition, out_rate, out_observations, 0.0, |b| {
            (b.prefill_rate(), b.prefill_rate_observations())
        })
    }
}

/// How much a rank's decode load lengthens a request's time to first token there,
/// learned from the same timings as `kvr_partition_prefill_rate`: seconds per decode block
/// the rank holds, in `*out_drag`, and the prefill completions observed so far in
/// `*out_observations`. `*out_drag` is -1 while none is learned (fewer than a few dozen
/// completions observed, or none on ranks of different decode loads; 0 is a learned
/// value: decode load adds nothing); the call is then still `KVR_OK`. The drag is the
/// estimate itself: a selection with the latency model and learning on charges it capped
/// at 1 ms a block, else nothing. Lock-free.
///
/// # Safety
/// `partition` is NULL or live; `out_drag` and `out_observations` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_decode_drag(
    partition: *const kvr_partition,
    out_drag: *mut f64,
    out_observations: *mut u64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        write_learned(partition, out_drag, out_observations, -1.0, |b| {
            (b.decode_drag(), b.decode_drag_observations())
        })
    }
}

/// One learned estimate of the partition's bookings and its observation count into the
/// two outputs, `unlearned` for the estimate while there is none.
///
/// # Safety
/// `partition` is NULL or live; `out_value` and `out_observations` are NULL or writable.
unsafe fn write_learned(
    partition: *const kvr_partition,
    out_value: *mut f64,
    out_observations: *mut u64,
    unlearned: f64,
    read: impl FnOnce(&kvr::ReservationTable) -> (Option<f64>, u64),
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let p = unsafe { handle(partition) }?;
        if out_value.is_null() || out_observations.is_null() {
            return Err(KVR_ERR_NULL);
        }
        let (value, observations) = read(p.partition.bookings());
        // SAFETY: both checked non-NULL above; writable by the caller's contract.
        unsafe {
            write_out(out_value, value.unwrap_or(unlearned))?;
            write_out(out_observations, observations)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handles::{kvr_partition_options_free, kvr_partition_options_new};

    type Setter = unsafe extern "C" fn(*mut kvr_partition_options, f64) -> kvr_status;
    type Direct = fn(&mut PartitionConfig, f64);

    /// Each f64 setter and how it would write the value into a config directly.
    fn setters() -> Vec<(&'static str, Setter, Direct)> {
        vec![
            (
                "prefill_rate_prior",
                kvr_partition_options_set_prefill_rate_prior,
                |c, v| c.cost.latency.prefill_rate_prior = v,
            ),
            (
                "request_overhead_ms",
                kvr_partition_options_set_request_overhead_ms,
                |c, v| c.cost.latency.request_overhead_ms = v,
            ),
            (
                "kv_pressure_threshold",
                kvr_partition_options_set_kv_pressure_threshold,
                |c, v| c.cost.latency.kv_pressure_threshold = v,
            ),
            (
                "kv_pressure_ms",
                kvr_partition_options_set_kv_pressure_ms,
                |c, v| c.cost.latency.kv_pressure_ms = v,
            ),
            (
                "itl_target_ms",
                kvr_partition_options_set_itl_target_ms,
                // 0 is the C setter's "clear"; every other value is Some.
                |c, v| c.cost.latency.itl_target_ms = (v != 0.0).then_some(v),
            ),
            (
                "itl_base_ms",
                kvr_partition_options_set_itl_base_ms,
                |c, v| c.cost.latency.itl_base_ms = v,
            ),
            (
                "itl_per_request_ms",
                kvr_partition_options_set_itl_per_request_ms,
                |c, v| c.cost.latency.itl_per_request_ms = v,
            ),
            (
                "queue_externality",
                kvr_partition_options_set_queue_externality,
                |c, v| c.cost.latency.queue_externality = v,
            ),
            (
                "decode_block_us",
                kvr_partition_options_set_decode_block_us,
                |c, v| c.cost.latency.decode_block_us = v,
            ),
        ]
    }

    fn new_opts() -> *mut kvr_partition_options {
        let mut o = std::ptr::null_mut();
        // SAFETY: `o` is a writable out-parameter.
        assert_eq!(unsafe { kvr_partition_options_new(16, &mut o) }, KVR_OK);
        o
    }

    #[test]
    fn each_setter_refuses_what_validate_refuses_and_nothing_else() {
        let values = [
            0.0,
            -0.0,
            1e-9,
            0.5,
            0.9,
            1.0,
            1.5,
            20.0,
            1e6,
            -1e-9,
            -1.0,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::MAX,
            f64::MIN_POSITIVE,
        ];
        for (name, setter, direct) in setters() {
            for v in values {
                let o = new_opts();
                // SAFETY: `o` is live and used by this thread only.
                let st = unsafe { setter(o, v) };
                let mut expected = PartitionConfig::new(16);
                direct(&mut expected, v);
                let valid = expected.validate().is_ok();
                assert_eq!(st == KVR_OK, valid, "{name}({v}): status {st}");
                if !valid {
                    assert_eq!(st, KVR_ERR_INVALID_ARGUMENT, "{name}({v})");
                    assert_eq!(
                        expected.validate(),
                        Err(kvr::config::ConfigError::OutOfRange(name)),
                        "{name}({v})"
                    );
                }
                // SAFETY: `o` is live; nothing else uses it.
                let got = unsafe { &*o }.config.cost.latency;
                let want = if valid {
                    expected.cost.latency
                } else {
                    PartitionConfig::new(16).cost.latency
                };
                // NaN is never stored, so `==` compares every field.
                assert_eq!(got, want, "{name}({v}): a refusal changes nothing");
                // SAFETY: `o` came from `kvr_partition_options_new`.
                unsafe { kvr_partition_options_free(o) };
                // SAFETY: a NULL handle is allowed.
                let st = unsafe { setter(std::ptr::null_mut(), v) };
                assert_eq!(st, KVR_ERR_NULL, "{name}(NULL, {v})");
            }
        }
    }

    /// Options no setter would produce (a knob out of range, written directly): the check
    /// names the knob, and creating a partition is `KVR_ERR_INVALID_CONFIG`.
    #[test]
    fn an_out_of_range_knob_is_an_invalid_config_with_its_name() {
        use crate::handles::{kvr_engine_create_partition, kvr_engine_free, kvr_engine_new};
        use crate::indexer::kvr_partition_options_check;
        let o = new_opts();
        // SAFETY: `o` is live and used by this thread only (every call below); the buffer
        // and the out-parameters are writable; the strings are their lengths.
        unsafe {
            (*o).config.cost.latency.kv_pressure_threshold = 1.5;
            let mut why = [0u8; 128];
            let mut len = 0usize;
            let st = kvr_partition_options_check(o, why.as_mut_ptr().cast(), why.len(), &mut len);
            assert_eq!(st, KVR_ERR_INVALID_CONFIG);
            let text = std::str::from_utf8(&why[..len]).unwrap();
            assert_eq!(text, "kv_pressure_threshold is out of range");
            let mut e = std::ptr::null_mut();
            assert_eq!(kvr_engine_new(std::ptr::null(), &mut e), KVR_OK);
            let mut p = std::ptr::null_mut();
            let st = kvr_engine_create_partition(e, c"m".as_ptr(), 1, c"g".as_ptr(), 1, o, &mut p);
            assert_eq!(st, KVR_ERR_INVALID_CONFIG);
            assert!(p.is_null());
            (*o).config.cost.latency.kv_pressure_threshold = 0.9;
            let st = kvr_partition_options_check(o, why.as_mut_ptr().cast(), why.len(), &mut len);
            assert_eq!((st, len), (KVR_OK, 0));
            kvr_engine_free(e);
            kvr_partition_options_free(o);
        }
    }

    #[test]
    fn the_cost_model_codes_are_stable_and_unknown_ones_refused() {
        let o = new_opts();
        // SAFETY: `o` is live and used by this thread only (every call below).
        unsafe {
            assert_eq!((*o).config.cost.model, CostModel::Latency);
            assert_eq!(
                kvr_partition_options_set_cost_model(o, KVR_COST_MODEL_DYNAMO),
                KVR_OK
            );
            assert_eq!((*o).config.cost.model, CostModel::Dynamo);
            for bad in [2, 3, u32::MAX] {
                assert_eq!(
                    kvr_partition_options_set_cost_model(o, bad),
                    KVR_ERR_INVALID_ARGUMENT
                );
                assert_eq!((*o).config.cost.model, CostModel::Dynamo);
            }
            assert_eq!(
                kvr_partition_options_set_cost_model(o, KVR_COST_MODEL_LATENCY),
                KVR_OK
            );
            assert_eq!((*o).config.cost.model, CostModel::Latency);
            assert_eq!(
                kvr_partition_options_set_cost_model(std::ptr::null_mut(), 0),
                KVR_ERR_NULL
            );
            assert_eq!(kvr_partition_options_set_learn_prefill_rate(o, 0), KVR_OK);
            assert!(!(*o).config.cost.latency.learn_prefill_rate);
            assert_eq!(kvr_partition_options_set_learn_prefill_rate(o, 7), KVR_OK);
            assert!((*o).config.cost.latency.learn_prefill_rate);
            assert_eq!(kvr_partition_options_set_itl_target_ms(o, 30.0), KVR_OK);
            assert_eq!((*o).config.cost.latency.itl_target_ms, Some(30.0));
            assert_eq!(kvr_partition_options_set_itl_target_ms(o, 0.0), KVR_OK);
            assert_eq!((*o).config.cost.latency.itl_target_ms, None);
            kvr_partition_options_free(o);
        }
        assert_eq!(KVR_COST_MODEL_LATENCY, 0);
        assert_eq!(KVR_COST_MODEL_DYNAMO, 1);
    }
}
