//! Booked selection side by side at fleet scale: kvr's `Engine::select_and_reserve` and
//! Dynamo's `SelectionService::select_and_reserve`, its selection service built in
//! process by its own builder (the default 4 indexer threads; the reference policy, its
//! default cost formula, as its own selection benchmark builds it; the index fed by the
//! host), over the same workers with the same index content, asked the same prompts.
//!
//! Each side's index is filled from the same engine messages: the fleet stream's first
//! round (four private 16-block chains a rank) and, on every rank, one of `POOL` shared
//! 256-token prompts (rank `r` holds prompt `r % POOL`). Queries alternate between a
//! pool prompt (held by many ranks: the common case) and a fresh random prompt (held by
//! none: every rank must be priced on load alone). Each call is timed alone; the booking
//! is freed right after, untimed, so no load builds up. A round of `calls` calls gives a
//! p50 and a p99; the sides alternate round by round.

use std::sync::Arc;
use std::time::Instant;

use dynamo_kv_router::identity::RoutingPartitionId;
use dynamo_kv_router::plugins::RouterPluginRegistry;
use dynamo_kv_router::protocols::RoutingConstraints;
use dynamo_kv_router::services::indexer::backend::Indexer;
use dynamo_kv_router::services::indexer::registry::WorkerRegistry;
use dynamo_kv_router::services::selection::{
    HostCache, KvEventIngress, KvIndexSource, PromptRequest, SelectAndReserveRequest,
    SelectionHost, SelectionService, SelectionServiceBuilder, WorkerRequest,
};
use dynamo_kv_router::zmq_wire::ZmqEventNormalizer;
use dynamo_kv_router::{KvRouterConfig, WorkerSelectionPolicy, WorkerType};
use kvr::ingress::Medium;
use kvr::{Outcome, SelectRequest};
use kvr_emulator::BatchEncoder;

use crate::events::{ingest_all, partition, EventShape, Message, Messages, SplitMix, BS};
use crate::ingest::dynamo_decode;
use crate::median_min_max;

/// Shared prompts; rank `r` holds prompt `r % POOL`.
const POOL: usize = 64;
/// Tokens a prompt (16 blocks).
const PROMPT: usize = 256;

/// A random `PROMPT`-token prompt.
fn prompt(rng: &mut SplitMix) -> Vec<u32> {
    (0..PROMPT).map(|_| (rng.next_u64() >> 47) as u32).collect()
}

/// Every rank's message storing its pool prompt (sequence 1: after the fill round's 0).
fn pool_messages(shape: EventShape, pool: &[Vec<u32>]) -> Vec<Message> {
    (0..shape.ranks())
        .map(|r| {
            let (worker, dp) = (r / u64::from(shape.dp), (r % u64::from(shape.dp)) as u32);
            let blocks = PROMPT / BS as usize;
            let hashes: Vec<u64> = (0..blocks as u64)
                .map(|i| (1 << 62) + r * blocks as u64 + i)
                .collect();
            let mut batch = BatchEncoder::new();
            batch.stored(
                &hashes,
                None,
                &pool[r as usize % pool.len()],
                BS,
                Medium::Gpu,
                None,
            );
            Message {
                worker,
                dp,
                seq: 1,
                payload: batch.finish(1.0, Some(dp)),
                ops: blocks as u64,
            }
        })
        .collect()
}

/// The host feeds the index itself (as Dynamo's own frontend does over its runtime), so
/// no ZMQ subscription is opened and no endpoint is needed for a worker to be scheduled.
struct HostFed;

#[async_trait::async_trait]
impl KvEventIngress for HostFed {
    fn open(
        &self,
        registry: &WorkerRegistry,
        key: &RoutingPartitionId,
        block_size: u32,
    ) -> Indexer {
        registry.get_or_create_indexer(key.clone(), block_size)
    }
}

/// Dynamo's selection service, in process: its builder with the reference policy, the
/// default 4 indexer threads, and the host-fed ingress; workers registered and the
/// index filled from `msgs`.
fn dynamo_service(
    rt: &tokio::runtime::Runtime,
    shape: EventShape,
    msgs: &[Message],
) -> SelectionService {
    let config = KvRouterConfig {
        use_kv_events: true,
        router_queue_threshold: None,
        ..Default::default()
    };
    let host = SelectionHost {
        cache: HostCache {
            shared: None,
            index: KvIndexSource::Owned(Arc::new(HostFed)),
        },
        ..SelectionHost::default()
    };
    let mut events = Vec::new();
    dynamo_decode(&mut ZmqEventNormalizer::new(BS), msgs, &mut events);
    rt.block_on(async {
        let svc = SelectionServiceBuilder::new(
            config,
            WorkerType::Aggregated,
            RouterPluginRegistry::default(),
        )
        .worker_selection_policy_factory(Arc::new(|config, role, _| {
            WorkerSelectionPolicy::reference(config.clone(), role.default_selector_label())
        }))
        .host(host)
        .build()
        .await
        .expect("Dynamo's selection service starts");
        for w in 0..shape.workers {
            let rec = svc
                .upsert_worker(WorkerRequest {
                    worker_id: w,
                    model_name: "default".to_string(),
                    routing_group: "default".to_string(),
                    endpoint: Some(format!("http://worker-{w}.invalid:8000")),
                    block_size: Some(BS),
                    data_parallel_size: Some(shape.dp),
                    max_num_batched_tokens: Some(8192),
                    ..WorkerRequest::default()
                })
                .await
                .expect("Dynamo registers the worker");
            assert!(
                rec.not_schedulable_reasons.is_empty(),
                "Dynamo cannot schedule worker {w}: {:?}",
                rec.not_schedulable_reasons
            );
        }
        let key = RoutingPartitionId::new("default", "default");
        let indexer = svc
            .core()
            .partition(&key)
            .expect("Dynamo built the default partition")
            .indexer()
            .clone();
        for e in events {
            indexer
                .apply_event_routed(e)
                .await
                .expect("Dynamo applies the event");
        }
        match &indexer {
            Indexer::Concurrent { primary, .. } => primary
                .flush_and_wait()
                .await
                .expect("Dynamo's indexer flushes"),
            Indexer::Single { primary, .. } => {
                primary.flush_and_wait().await.expect("flushes");
            }
            #[allow(unreachable_patterns)]
            _ => {}
        }
        svc
    })
}

fn dynamo_request(id: String, tokens: &[u32]) -> SelectAndReserveRequest {
    SelectAndReserveRequest {
        model_name: "default".to_string(),
        routing_group: "default".to_string(),
        selection_id: Some(id),
        prompt: PromptRequest {
            token_ids: Some(tokens.to_vec()),
            ..PromptRequest::default()
        },
        router_config_override: None,
        expected_output_tokens: None,
        priority_jump: None,
        strict_priority: None,
        session_id: None,
        session_context: None,
        affinity_target: None,
        pinned_worker: None,
        allowed_worker_ids: None,
        routing_constraints: RoutingConstraints::default(),
    }
}

/// p50 and p99 of one round's per-call nanoseconds.
fn p50_p99(mut ns: Vec<u64>) -> (f64, f64) {
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() as f64 * q).ceil() as usize).clamp(1, ns.len()) - 1] as f64;
    (at(0.5), at(0.99))
}

/// Runs `reps` rounds of `calls` calls a side, alternating; prints the table.
pub(crate) fn run(shape: EventShape, calls: usize, reps: usize) {
    println!(
        "select side by side: {} workers × {} ranks, {} shared {}-token prompts (each on 1 rank in {}) beside 4 private 16-block chains a rank; {} calls a round, half shared prompts, half uncached; {} rounds a side",
        shape.workers, shape.dp, POOL, PROMPT, POOL, calls, reps
    );
    let mut rng = SplitMix(0x5e1ec7);
    let pool: Vec<Vec<u32>> = (0..POOL).map(|_| prompt(&mut rng)).collect();
    let mut msgs = Messages::new(shape).round();
    msgs.extend(pool_messages(shape, &pool));
    let queries: Vec<Vec<u32>> = (0..calls)
        .map(|i| {
            if i % 2 == 0 {
                pool[(i / 2) % POOL].clone()
            } else {
                prompt(&mut rng)
            }
        })
        .collect();

    let t0 = Instant::now();
    let (e, p) = partition(shape, 0);
    ingest_all(&p, &msgs);
    let kvr_fill = t0.elapsed();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let t0 = Instant::now();
    let core = dynamo_service(&rt, shape, &msgs);
    println!(
        "filled: kvr in {:.2} s, Dynamo in {:.2} s (workers registered, events applied)",
        kvr_fill.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );

    // Per side and round: the calls' nanoseconds, all, shared prompts, uncached prompts.
    let (mut kvr_rounds, mut dyn_rounds) = (Vec::new(), Vec::new());
    let (mut k_hits, mut d_hits, mut n) = (0usize, 0usize, 0u64);
    for _ in 0..reps {
        let mut ns = Vec::with_capacity(calls);
        for (i, q) in queries.iter().enumerate() {
            let req = SelectRequest::tokens(q);
            let t = Instant::now();
            let got = e.select_and_reserve(&p, &req);
            ns.push(t.elapsed().as_nanos() as u64);
            let Ok(Outcome::Selected(d)) = got else {
                panic!("kvr selects: {got:?}")
            };
            k_hits += usize::from(i % 2 == 0 && d.cached_tokens > 0);
            e.free(d.selection_id.expect("a booked decision has an id"))
                .expect("kvr frees its booking");
        }
        kvr_rounds.push(ns);

        let mut ns = Vec::with_capacity(calls);
        for (i, q) in queries.iter().enumerate() {
            n += 1;
            let id = format!("peer-{n}");
            let req = dynamo_request(id.clone(), q);
            let t = Instant::now();
            let got = rt.block_on(core.select_and_reserve(req));
            ns.push(t.elapsed().as_nanos() as u64);
            let r = got.expect("Dynamo selects");
            d_hits += usize::from(i % 2 == 0 && r.overlap.longest_matched > 0);
            rt.block_on(core.free_reservation(&id))
                .expect("Dynamo frees its booking");
        }
        dyn_rounds.push(ns);
    }
    let shared = reps * calls.div_ceil(2);
    println!(
        "shared prompts placed on a rank holding them: kvr {k_hits} of {shared}, Dynamo {d_hits} of {shared}"
    );
    println!("| select_and_reserve | kvr | Dynamo 1.6.1 | Dynamo ÷ kvr |");
    println!("|---|---|---|---|");
    let part = |rounds: &[Vec<u64>], which: usize| -> (Vec<f64>, Vec<f64>) {
        rounds
            .iter()
            .map(|ns| {
                let sel: Vec<u64> = ns
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| which == 2 || i % 2 == which)
                    .map(|(_, v)| *v)
                    .collect();
                p50_p99(sel)
            })
            .unzip()
    };
    for (which, label) in [
        (2, "all calls"),
        (0, "shared prompts"),
        (1, "uncached prompts"),
    ] {
        let (k50, k99) = part(&kvr_rounds, which);
        let (d50, d99) = part(&dyn_rounds, which);
        for (q, k, d) in [("p50", k50, d50), ("p99", k99, d99)] {
            let ratio = median_min_max(d.clone()).0 / median_min_max(k.clone()).0;
            let (km, klo, khi) = median_min_max(k);
            let (dm, dlo, dhi) = median_min_max(d);
            println!(
                "| {label}, {q} | {:.1} µs ({:.1}–{:.1}) | {:.1} µs ({:.1}–{:.1}) | {ratio:.1}× |",
                km / 1e3,
                klo / 1e3,
                khi / 1e3,
                dm / 1e3,
                dlo / 1e3,
                dhi / 1e3
            );
        }
    }
}
