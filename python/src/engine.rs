//! The typed hot path: `Engine` → `Partition` → `select(tokens) -> Decision`, the engine
//! crate's root facade without dicts. Tokens come from any integer buffer (read in place
//! when it holds u32s) or a sequence; the engine's work runs without the GIL.
//!
//! A partition minimises the cost model it was created with: `cost_model="latency"` (the
//! engine's default: predicted time to first token, ms, with the latency knobs as keyword
//! arguments) or `"dynamo"` (Dynamo's scorer, block equivalents); `Decision.cost` is in
//! that model's unit.

use std::sync::Arc;

use kvr::config::CostModel;
use kvr::config::PartitionConfig;
use kvr::{KvEvent, Outcome, PartitionKey, RankId, StoredBlock, Tier, WorkerInfo};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::service_error;
use crate::state;
use crate::tokens;

fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// `kvr.Engine`: partitions and the booking lifecycle by selection id.
#[pyclass(module = "kvr._kvr", frozen)]
pub struct Engine {
    inner: Arc<kvr::Engine>,
}

#[pymethods]
impl Engine {
    /// A new engine with no partitions; `seed` fixes the tie-break and temperature
    /// sampling for reproducible selections (None: seeded from the clock).
    #[new]
    #[pyo3(signature = (seed=None))]
    fn new(seed: Option<u64>) -> Self {
        let inner = match seed {
            Some(s) => kvr::Engine::with_seed(s),
            None => kvr::Engine::new(),
        };
        Self {
            inner: Arc::new(inner),
        }
    }

    /// A new partition (one model and routing group); ValueError if it exists, for an
    /// unknown `cost_model` or a knob out of range. A knob left `None` keeps the engine's
    /// default (`kvr::config::CostConfig::default()`, `LatencyConfig::default()`);
    /// `itl_target_ms=None` is no per-token latency target, `credit_decay=None` no decay, a
    /// `busy_*` threshold `None` none (a selection whose every rank is busy raises 429).
    #[pyo3(signature = (
        model_name="default", routing_group="default", *, block_size=16, use_kv_events=true,
        cache_namespace=None, booking_ttl_ms=None,
        cost_model="latency", prefill_rate_prior=None, learn_prefill_rate=None,
        request_overhead_ms=None, kv_pressure_threshold=None, kv_pressure_ms=None,
        itl_target_ms=None, itl_base_ms=None, itl_per_request_ms=None, queue_externality=None,
        decode_block_us=None, overlap_score_credit=None, prefill_load_scale=None,
        host_cache_hit_weight=None, disk_cache_hit_weight=None, temperature=None,
        decode_active_request_weight=None, credit_decay=None, busy_decode_blocks_fraction=None,
        busy_prefill_tokens=None, busy_prefill_tokens_fraction=None,
        state_dir=None, state_io="auto",
    ))]
    #[allow(clippy::too_many_arguments)]
    fn create_partition(
        &self,
        model_name: &str,
        routing_group: &str,
        block_size: u32,
        use_kv_events: bool,
        cache_namespace: Option<String>,
        booking_ttl_ms: Option<u64>,
        cost_model: &str,
        prefill_rate_prior: Option<f64>,
        learn_prefill_rate: Option<bool>,
        request_overhead_ms: Option<f64>,
        kv_pressure_threshold: Option<f64>,
        kv_pressure_ms: Option<f64>,
        itl_target_ms: Option<f64>,
        itl_base_ms: Option<f64>,
        itl_per_request_ms: Option<f64>,
        queue_externality: Option<f64>,
        decode_block_us: Option<f64>,
        overlap_score_credit: Option<f64>,
        prefill_load_scale: Option<f64>,
        host_cache_hit_weight: Option<f64>,
        disk_cache_hit_weight: Option<f64>,
        temperature: Option<f64>,
        decode_active_request_weight: Option<f64>,
        credit_decay: Option<f64>,
        busy_decode_blocks_fraction: Option<f64>,
        busy_prefill_tokens: Option<u64>,
        busy_prefill_tokens_fraction: Option<f64>,
        state_dir: Option<String>,
        state_io: &str,
    ) -> PyResult<Partition> {
        let mut c = PartitionConfig::new(block_size);
        c.indexer.use_kv_events = use_kv_events;
        c.cache_namespace = cache_namespace.filter(|ns| !ns.is_empty());
        if let Some(ms) = booking_ttl_ms {
            c.booking_ttl = std::time::Duration::from_millis(ms);
        }
        c.cost.model = CostModel::parse(cost_model).ok_or_else(|| {
            let valid: Vec<&str> = CostModel::ALL.iter().map(|m| m.name()).collect();
            PyValueError::new_err(format!(
                "unknown cost_model {cost_model:?} (valid: {valid:?})"
            ))
        })?;
        let l = &mut c.cost.latency;
        let set = |slot: &mut f64, v: Option<f64>| {
            if let Some(v) = v {
                *slot = v;
            }
        };
        set(&mut l.prefill_rate_prior, prefill_rate_prior);
        if let Some(v) = learn_prefill_rate {
            l.learn_prefill_rate = v;
        }
        set(&mut l.request_overhead_ms, request_overhead_ms);
        set(&mut l.kv_pressure_threshold, kv_pressure_threshold);
        set(&mut l.kv_pressure_ms, kv_pressure_ms);
        if itl_target_ms.is_some() {
            l.itl_target_ms = itl_target_ms;
        }
        set(&mut l.itl_base_ms, itl_base_ms);
        set(&mut l.itl_per_request_ms, itl_per_request_ms);
        set(&mut l.queue_externality, queue_externality);
        set(&mut l.decode_block_us, decode_block_us);
        let k = &mut c.cost;
        set(&mut k.overlap_score_credit, overlap_score_credit);
        set(&mut k.prefill_load_scale, prefill_load_scale);
        set(&mut k.host_cache_hit_weight, host_cache_hit_weight);
        set(&mut k.disk_cache_hit_weight, disk_cache_hit_weight);
        set(&mut k.temperature, temperature);
        set(
            &mut k.decode_active_request_weight,
            decode_active_request_weight,
        );
        if credit_decay.is_some() {
            k.credit_decay = credit_decay;
        }
        c.busy.decode_blocks_fraction = busy_decode_blocks_fraction;
        c.busy.prefill_tokens = busy_prefill_tokens;
        c.busy.prefill_tokens_fraction = busy_prefill_tokens_fraction;
        c.validate().map_err(value_error)?;
        // The state directory and I/O are checked first: nothing is created without them.
        let prepared = match state_dir.as_deref() {
            Some(d) => Some(state::prepare(d, state::io_mode(state_io)?)?),
            None => None,
        };
        // Snapshots are the index's dump, which needs each block's lineage.
        c.index_dump |= prepared.is_some();
        let key = PartitionKey::new(model_name, routing_group);
        let p = self
            .inner
            .create_partition(key.clone(), c)
            .map_err(value_error)?;
        let state = match prepared.map(|pr| pr.keep(&p)).transpose() {
            Ok(s) => s,
            Err(e) => {
                self.inner.remove_partition(&key);
                return Err(e);
            }
        };
        Ok(Partition {
            engine: self.inner.clone(),
            inner: p,
            state,
        })
    }

    /// The booking's prefill is done (its prefill tokens leave the rank's load).
    fn mark_prefill_complete(&self, py: Python<'_>, selection_id: u64) -> PyResult<()> {
        let e = &*self.inner;
        py.detach(|| e.mark_prefill_complete(selection_id))
            .map_err(|e| lifecycle_error(py, e))
    }

    /// The booking's decode grew by `n` output blocks (they join its rank's decode load).
    #[pyo3(signature = (selection_id, n=1))]
    fn add_output_blocks(&self, py: Python<'_>, selection_id: u64, n: u64) -> PyResult<()> {
        let e = &*self.inner;
        py.detach(|| e.add_output_blocks(selection_id, n))
            .map_err(|e| lifecycle_error(py, e))
    }

    /// Ends a booking: true if it was live (false if freed before or ended with its rank).
    fn free(&self, py: Python<'_>, selection_id: u64) -> PyResult<bool> {
        let e = &*self.inner;
        match py.detach(|| e.free(selection_id)) {
            Ok(kvr::FreeOutcome::Freed(_)) => Ok(true),
            Ok(_) => Ok(false),
            Err(e) => Err(lifecycle_error(py, e)),
        }
    }
}

fn lifecycle_error(py: Python<'_>, e: kvr::EngineError) -> PyErr {
    match e {
        kvr::EngineError::UnknownSelectionId(id) => {
            service_error(py, 404, "not_found", &format!("reservation {id} not found"))
        }
        other => value_error(other),
    }
}

/// `kvr.Partition`: workers, their cached blocks and selection.
#[pyclass(module = "kvr._kvr", frozen)]
pub struct Partition {
    /// `create_partition(state_dir=...)`: closed (a final snapshot) when this object goes.
    /// Declared first so that it is dropped first: the final snapshot needs the partition,
    /// which this object may be the last to hold.
    state: Option<state::Kept>,
    engine: Arc<kvr::Engine>,
    inner: Arc<kvr::Partition>,
}

/// `kvr.Decision`: the chosen rank and what the engine knew choosing it.
#[pyclass(module = "kvr._kvr", frozen, get_all)]
#[derive(Clone, Debug)]
pub struct Decision {
    pub worker_id: u64,
    pub dp_rank: u32,
    /// The booking's id (`select(..., reserve=True)`), else None.
    pub selection_id: Option<u64>,
    pub cached_tokens: u64,
    pub device_blocks: u32,
    pub host_blocks: u32,
    pub disk_blocks: u32,
    pub projected_prefill_tokens: u64,
    pub projected_decode_blocks: u64,
    pub cost: f64,
}

#[pymethods]
impl Decision {
    /// `Decision(worker_id=…, dp_rank=…, selection_id=…, cached_tokens=…, cost=…)`.
    fn __repr__(&self) -> String {
        format!(
            "Decision(worker_id={}, dp_rank={}, selection_id={}, cached_tokens={}, cost={})",
            self.worker_id,
            self.dp_rank,
            self.selection_id
                .map_or_else(|| "None".to_string(), |i| i.to_string()),
            self.cached_tokens,
            self.cost
        )
    }
}

#[pymethods]
impl Partition {
    /// The partition's model name.
    #[getter]
    fn model_name(&self) -> String {
        self.inner.key().model.to_string()
    }

    /// The partition's routing group.
    #[getter]
    fn routing_group(&self) -> String {
        self.inner.key().routing_group.to_string()
    }

    /// Tokens per KV block (the workers' `kv_block_size`).
    #[getter]
    fn block_size(&self) -> u32 {
        self.inner.block_size()
    }

    /// The cost model selections minimise: `"latency"` or `"dynamo"`.
    #[getter]
    fn cost_model(&self) -> &'static str {
        self.inner.config().cost.model.name()
    }

    /// What the restore at creation found (`snapshot_found`, `snapshot_blocks`, `records`,
    /// `events`, `refused`, `refused_files`, `streams`, `stopped`, `seconds`); None without
    /// a `state_dir`.
    fn state_restored<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        self.state.as_ref().map(|k| k.restored(py)).transpose()
    }

    /// The journal writer's figures (`events_queued`, `snapshots`, ..., `uring`,
    /// `closed`); None without a `state_dir`.
    fn state_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        self.state.as_ref().map(|k| k.stats(py)).transpose()
    }

    /// Writes a final snapshot and stops the journal (a graceful shutdown: the next start
    /// replays nothing); what the partition applies afterwards is not kept. Idempotent;
    /// also done when the partition object goes away. ValueError without a `state_dir`.
    fn close_state(&self, py: Python<'_>) -> PyResult<()> {
        let k = self
            .state
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("the partition keeps no state (no state_dir)"))?;
        py.detach(|| k.close());
        Ok(())
    }

    /// The prefill rate learned from `mark_prefill_complete` timings, tokens/s (one rank's
    /// throughput, before the latency model clamps it to [prior / 10, prior × 10]); None
    /// until a few prefills that took measurable time were observed.
    fn prefill_rate(&self) -> Option<f64> {
        self.inner.bookings().prefill_rate()
    }

    /// Prefills observed for the learned rate so far (local bookings marked
    /// prefill-complete with a non-empty prefill).
    fn prefill_rate_observations(&self) -> u64 {
        self.inner.bookings().prefill_rate_observations()
    }

    /// The decode drag learned from the same timings, seconds of time to first token per
    /// decode block a rank holds (before the latency model caps it at 1 ms a block); None
    /// until enough prefills were observed on ranks of different decode loads.
    fn decode_drag(&self) -> Option<f64> {
        self.inner.bookings().decode_drag()
    }

    /// Prefills observed for the learned decode drag so far.
    fn decode_drag_observations(&self) -> u64 {
        self.inner.bookings().decode_drag_observations()
    }

    /// Adds or replaces a worker of `dp_size` ranks from `dp_start`.
    #[pyo3(signature = (worker_id, *, dp_size=1, dp_start=0, total_kv_blocks=0))]
    fn upsert_worker(
        &self,
        py: Python<'_>,
        worker_id: u64,
        dp_size: u32,
        dp_start: u32,
        total_kv_blocks: u64,
    ) -> PyResult<()> {
        let mut w = WorkerInfo::new(worker_id, dp_size);
        w.dp_start = dp_start;
        w.total_kv_blocks = total_kv_blocks;
        let p = &*self.inner;
        py.detach(|| p.upsert_worker(w)).map_err(value_error)?;
        Ok(())
    }

    /// Removes a worker, its ranks' cached blocks and bookings; false if it was unknown.
    fn remove_worker(&self, py: Python<'_>, worker_id: u64) -> bool {
        let p = &*self.inner;
        py.detach(|| p.remove_worker(worker_id))
    }

    /// Records that a rank caches the complete blocks of `tokens` on its device (a
    /// KV "stored" event, its hashes computed as the engines publish them); returns the
    /// blocks stored.
    fn store(
        &self,
        py: Python<'_>,
        worker_id: u64,
        dp_rank: u32,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let t = tokens::extract(tokens)?;
        let t = t.as_slice();
        let p = &*self.inner;
        let out = py.detach(|| {
            let (mut local, mut seq) = (Vec::new(), Vec::new());
            p.hasher().hash_tokens(t, &mut local, &mut seq);
            let blocks: Vec<StoredBlock> = local
                .iter()
                .zip(&seq)
                .map(|(&l, &s)| StoredBlock {
                    external_hash: s,
                    local_hash: l,
                })
                .collect();
            p.apply_events(
                RankId::new(worker_id, dp_rank),
                [KvEvent::Stored {
                    tier: Tier::Device,
                    parent: None,
                    blocks: &blocks,
                }],
            )
        });
        if out.ignored {
            return Err(PyValueError::new_err(
                "this partition takes no KV events (use_kv_events=False)",
            ));
        }
        Ok(out.blocks_stored)
    }

    /// Chooses a rank for `tokens` (a sequence of ints or any integer buffer); with
    /// `reserve`, books it and answers its selection id.
    #[pyo3(signature = (tokens, *, reserve=false, allowed_workers=None, pinned_worker=None, lora_name=None, expected_output_tokens=0))]
    #[allow(clippy::too_many_arguments)]
    fn select(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        reserve: bool,
        allowed_workers: Option<Vec<u64>>,
        pinned_worker: Option<u64>,
        lora_name: Option<String>,
        expected_output_tokens: u64,
    ) -> PyResult<Decision> {
        let t = tokens::extract(tokens)?;
        let t = t.as_slice();
        let (e, p) = (&*self.engine, &*self.inner);
        let outcome = py.detach(|| {
            let mut req = kvr::SelectRequest::tokens(t);
            req.allowed_workers = allowed_workers.as_deref();
            req.pinned_worker = pinned_worker;
            req.lora_name = lora_name.as_deref();
            req.expected_output_tokens = expected_output_tokens;
            if reserve {
                e.select_and_reserve(p, &req)
            } else {
                e.select(p, &req)
            }
        });
        let key = p.key();
        match outcome.map_err(value_error)? {
            Outcome::Selected(d) => Ok(Decision {
                worker_id: d.rank.worker_id,
                dp_rank: d.rank.dp_rank,
                selection_id: d.selection_id,
                cached_tokens: d.cached_tokens,
                device_blocks: d.overlap.device_blocks,
                host_blocks: d.overlap.host_blocks,
                disk_blocks: d.overlap.disk_blocks,
                projected_prefill_tokens: d.projected_prefill_tokens,
                projected_decode_blocks: d.projected_decode_blocks,
                cost: d.cost,
            }),
            Outcome::Busy => Err(service_error(
                py,
                429,
                "overloaded",
                &format!(
                    "all workers are busy for model={} routing_group={}",
                    key.model, key.routing_group
                ),
            )),
            _ => Err(service_error(
                py,
                503,
                "not_ready",
                &format!(
                    "no schedulable workers for model={} routing_group={}",
                    key.model, key.routing_group
                ),
            )),
        }
    }

    /// A rank's booked load: (prefill tokens, decode blocks, active requests).
    #[pyo3(signature = (worker_id, dp_rank=0))]
    fn load(&self, worker_id: u64, dp_rank: u32) -> (u64, u64, u64) {
        let l = self
            .inner
            .bookings()
            .rank_load(RankId::new(worker_id, dp_rank));
        (
            l.active_prefill_tokens,
            l.active_decode_blocks,
            l.active_requests,
        )
    }
}
