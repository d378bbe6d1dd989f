//! A pod's KV events feed kvr's own ZMQ subscriber (`kvr_zmq::subscribe` into a
//! `kvr::Partition`); the index it builds must equal the pod's cache: the same blocks, and
//! for every prompt the overlap kvr computes equals the blocks the pod holds of it. Under
//! eviction, after a batch dropped on the PUB socket (recovered through the replay
//! ROUTER), and after a prefix-cache reset. A pod without a replay socket is the negative
//! control: its dropped batch is never recovered.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{config, Emu};
use kvr::config::PartitionConfig;
use kvr::{Partition, PartitionKey, RankId, TieredScores};
use kvr_zmq::subscribe::{subscribe, SubscribeConfig, Subscription};
use serde_json::json;

const WORKER: u64 = 7;

fn subscribed(e: &Emu, partition: &Arc<Partition>) -> Subscription {
    subscribe(
        partition.clone(),
        SubscribeConfig::Connect {
            endpoint: e.h.pod.kv_events_endpoint().unwrap().to_owned(),
            replay_endpoint: e.h.pod.replay_endpoint().map(str::to_owned),
            topic: Vec::new(),
            worker_id: WORKER,
            stream: 0,
        },
    )
    .expect("subscribe")
}

/// How the index differs from the pod's cache (empty: equal), checked on every cached
/// block and on the overlap of every prompt in `prompts`.
fn differences(e: &Emu, p: &Partition, prompts: &[Vec<u32>]) -> Vec<String> {
    let rank = RankId::new(WORKER, 0);
    let hasher = p.hasher();
    let (mut local, mut seq) = (Vec::new(), Vec::new());
    let mut diffs = Vec::new();
    let cached = e.h.pod.cached_prefixes();
    let held = p.index().rank_stats(rank).map_or(0, |s| s.tier_blocks[0]);
    if held != cached.len() as u64 {
        diffs.push(format!(
            "index holds {held} blocks, the pod {}",
            cached.len()
        ));
    }
    for prefix in &cached {
        hasher.hash_tokens(prefix, &mut local, &mut seq);
        if p.index().block_tiers(rank, &local) & 1 == 0 {
            diffs.push(format!("block {} of a cached chain missing", local.len()));
        }
    }
    let mut scores = TieredScores::new();
    for (i, tokens) in prompts.iter().enumerate() {
        hasher.hash_tokens(tokens, &mut local, &mut seq);
        p.overlap(&local, &mut scores);
        let kvr = scores.get(rank).map_or(0, |o| o.device) as usize;
        let pod = e.h.pod.cached_prefix_blocks(tokens);
        if kvr != pod {
            diffs.push(format!("prompt {i}: kvr overlap {kvr}, pod holds {pod}"));
        }
    }
    diffs
}

/// Waits (up to `within`) for the index to equal the pod's cache; the last differences.
fn settle(e: &Emu, p: &Partition, prompts: &[Vec<u32>], within: Duration) -> Vec<String> {
    let t0 = Instant::now();
    loop {
        let d = differences(e, p, prompts);
        if d.is_empty() || t0.elapsed() > within {
            return d;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

fn prompt(i: usize) -> String {
    // Shared system prefix, then a question of its own: chains that share a head.
    format!(
        "You route requests to the pod that holds their prefix. Question {i}: which of \
         the {} pods holds block {} of conversation {}?",
        i % 3,
        i * 7,
        i / 2
    )
}

#[test]
fn the_index_kvr_builds_from_a_pods_events_equals_the_pods_cache() {
    let mut cfg = config("events");
    cfg.cache.capacity_blocks = 24;
    let e = Emu::start(cfg);
    let partition = Arc::new(Partition::new(
        PartitionKey::new("emulate", "default"),
        PartitionConfig::new(4),
    ));
    let _sub = subscribed(&e, &partition);
    // Prompts whose blocks overflow the cache: evictions on the way.
    let mut prompts = Vec::new();
    for i in 0..12 {
        let text = prompt(i);
        e.complete(json!(text), 2);
        prompts.push(e.h.pod.tokenize(&text));
        if i % 4 == 3 {
            e.complete(json!(prompt(i - 2)), 1); // a repeat refreshes its chain
        }
    }
    let s = e.state();
    assert!(
        s["cache"]["evicted_blocks"].as_u64().unwrap() > 0,
        "no eviction: {s}"
    );
    let d = settle(&e, &partition, &prompts, Duration::from_secs(15));
    assert!(
        d.is_empty(),
        "after eviction: {d:#?}\n{:#?}",
        partition.ingress_stats()
    );
    let some_hit = prompts.iter().any(|t| e.h.pod.cached_prefix_blocks(t) > 0);
    assert!(some_hit, "the comparison must cover cached prompts");

    // One batch is not sent live: kvr sees the gap and replays it from the ROUTER.
    let replays_before = e.state()["replays_served"].as_u64().unwrap();
    assert!(e.h.pod.drop_next_event_batches(1));
    let lost = prompt(100);
    e.complete(json!(lost), 1);
    prompts.push(e.h.pod.tokenize(&lost));
    e.complete(json!(prompt(101)), 1); // the next batch reveals the gap
    prompts.push(e.h.pod.tokenize(&prompt(101)));
    let d = settle(&e, &partition, &prompts, Duration::from_secs(15));
    assert!(d.is_empty(), "after a dropped batch: {d:#?}");
    let s = e.state();
    assert_eq!(s["events_dropped_live"], 1);
    assert!(
        s["replays_served"].as_u64().unwrap() > replays_before,
        "{s}"
    );
    assert!(e.h.pod.cached_prefix_blocks(prompts.last().unwrap()) > 0);

    // A reset clears the rank.
    assert_eq!(e.post("/reset_prefix_cache", &json!({})).status, 200);
    let d = settle(&e, &partition, &prompts, Duration::from_secs(15));
    assert!(d.is_empty(), "after a reset: {d:#?}");
    let rank = RankId::new(WORKER, 0);
    assert_eq!(
        partition
            .index()
            .rank_stats(rank)
            .map_or(0, |s| s.tier_blocks[0]),
        0
    );
}

#[test]
fn without_a_replay_socket_a_dropped_batch_stays_lost() {
    let mut cfg = config("no-replay");
    cfg.replay_endpoint = None;
    let e = Emu::start(cfg);
    let partition = Arc::new(Partition::new(
        PartitionKey::new("emulate", "default"),
        PartitionConfig::new(4),
    ));
    let _sub = subscribed(&e, &partition);
    // Without replay, batches sent before the subscription took are lost too: publish
    // until one arrives. Each warm-up prompt has a head of its own (a lost batch holding
    // a shared head would orphan every later store), and a reset then starts both sides
    // from an empty cache.
    let rank = RankId::new(WORKER, 0);
    let held = || {
        partition
            .index()
            .rank_stats(rank)
            .map_or(0, |s| s.tier_blocks[0])
    };
    let t0 = Instant::now();
    for i in 0.. {
        e.complete(json!(format!("Warm-up {i}. {}", prompt(i))), 1);
        if held() > 0 {
            break;
        }
        // Generous: on a loaded machine the subscription can take seconds to connect.
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no batch ever arrived: {:#?}",
            partition.ingress_stats()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(e.post("/reset_prefix_cache", &json!({})).status, 200);
    let live = vec![e.h.pod.tokenize(&prompt(200))];
    e.complete(json!(prompt(200)), 1);
    let d = settle(&e, &partition, &live, Duration::from_secs(30));
    assert!(d.is_empty(), "after the reset: {d:#?}");
    e.h.pod.drop_next_event_batches(1);
    let lost = e.h.pod.tokenize(&prompt(300));
    e.complete(json!(prompt(300)), 1);
    e.complete(json!(prompt(301)), 1);
    let d = settle(
        &e,
        &partition,
        std::slice::from_ref(&lost),
        Duration::from_secs(4),
    );
    assert!(
        !d.is_empty(),
        "a batch dropped without replay was recovered?"
    );
    assert!(e.h.pod.cached_prefix_blocks(&lost) > 0);
}
