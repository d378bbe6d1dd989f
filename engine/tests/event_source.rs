//! A second event source, written as socket code alone: in-process publishers send their
//! batches over std channels (a lossy "PUB socket" and a "replay ROUTER" each), and the
//! subscriber here only moves messages and the clock between those channels and the
//! engine's `kvr::ingress::EventSource`, doing what it answers. Sequence tracking, replay
//! bookkeeping, stream routing by topic and idle probes are the engine's, exactly as for
//! kvr's ZMQ subscriber, and every event goes through the same door.
//!
//! The check: after messages are lost (in a burst's middle, and at its end, where only an
//! idle probe can find the loss) and replayed, the partition's index equals that of a
//! partition that heard every message (`Partition::ingest`, no loss).

// Threads of the test itself, outside the engine's sync facade.
#![allow(clippy::disallowed_types)]

mod common;

use std::collections::VecDeque;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::partition::{locals, B};
use common::rng::Rng;
use kvr::config::PartitionConfig;
use kvr::ingress::{EventSource, Medium, ReplayResult, SourceAction, TopicRoute};
use kvr::{Partition, PartitionKey, TieredScores, WorkerInfo};
use kvr_emulator::BatchEncoder;

/// What a publisher sends the subscriber.
enum Frame {
    Live {
        topic: Vec<u8>,
        seq: u64,
        payload: Vec<u8>,
    },
    Replayed {
        id: u32,
        generation: u64,
        seq: u64,
        payload: Vec<u8>,
    },
    ReplayEnd {
        id: u32,
        generation: u64,
    },
}

/// A replay request to a publisher: resend from `from_seq` as replay `id`, request number
/// `generation` (a newer request supersedes an older one of the same id, whose frames the
/// subscriber then drops, as a transport that closes the old replay socket would).
struct ReplayRequest {
    id: u32,
    generation: u64,
    from_seq: u64,
}

/// One in-process publisher: its batches, the ones the "socket" loses, and its replay
/// buffer, on a thread of its own. It sends its next batch only once the subscriber has
/// handled the last one it heard (`acks`), so each loss is known, and its replay asked
/// for, before the next batch: the runs are the same every time.
struct Publisher {
    topic: Vec<u8>,
    thread: JoinHandle<()>,
    requests: Sender<Option<ReplayRequest>>,
    acks: Sender<()>,
}

/// The batches of worker `worker`: stores of fresh prompts, and now and then the removal
/// of an earlier prompt's last block (so a lost batch can hide a removal too).
fn batches(worker: u64, n: usize, rng: &mut Rng) -> Vec<Vec<u8>> {
    let mut stored: Vec<Vec<u64>> = Vec::new();
    let mut out = Vec::new();
    for i in 0..n {
        let mut e = BatchEncoder::new();
        if i % 5 == 4 && !stored.is_empty() {
            let k = rng.below(stored.len());
            if let Some(last) = stored[k].pop() {
                e.removed(&[last], Medium::Gpu);
            }
        } else {
            let base = worker * 1_000_000 + i as u64 * 100;
            let hashes: Vec<u64> = (0..4).map(|b| base + b).collect();
            let tokens = prompt_tokens(worker, i);
            e.stored(&hashes, None, &tokens, B, Medium::Gpu, None);
            stored.push(hashes);
        }
        out.push(e.finish(i as f64, Some(0)));
    }
    out
}

/// The tokens of worker `worker`'s `i`-th prompt (four blocks).
fn prompt_tokens(worker: u64, i: usize) -> Vec<u32> {
    (0..4 * B)
        .map(|t| (worker as u32) * 100_000 + i as u32 * 64 + t)
        .collect()
}

/// Starts a publisher under `topic` that sends `batches` to `to_sub`, losing the messages
/// whose sequence number `lost` names, and answers replays from what it still buffers.
fn publish(
    topic: &[u8],
    batches: Vec<Vec<u8>>,
    lost: impl Fn(u64) -> bool + Send + 'static,
    to_sub: Sender<Frame>,
) -> Publisher {
    let (requests, inbox): (Sender<Option<ReplayRequest>>, Receiver<_>) = channel();
    let (acks, heard) = channel::<()>();
    let topic = topic.to_vec();
    let name = topic.clone();
    let thread = std::thread::spawn(move || {
        let mut buffer: VecDeque<(u64, Vec<u8>)> = VecDeque::new();
        let answer = |r: ReplayRequest, buffer: &VecDeque<(u64, Vec<u8>)>| {
            for (seq, payload) in buffer.iter().filter(|(s, _)| *s >= r.from_seq) {
                let f = Frame::Replayed {
                    id: r.id,
                    generation: r.generation,
                    seq: *seq,
                    payload: payload.clone(),
                };
                if to_sub.send(f).is_err() {
                    return;
                }
            }
            let _ = to_sub.send(Frame::ReplayEnd {
                id: r.id,
                generation: r.generation,
            });
        };
        for (seq, payload) in batches.into_iter().enumerate() {
            let seq = seq as u64;
            buffer.push_back((seq, payload.clone()));
            if !lost(seq) {
                let f = Frame::Live {
                    topic: topic.clone(),
                    seq,
                    payload,
                };
                if to_sub.send(f).is_err() || heard.recv().is_err() {
                    return;
                }
            }
            while let Ok(Some(r)) = inbox.try_recv() {
                answer(r, &buffer);
            }
        }
        // Published everything: answer replays until told to stop.
        while let Ok(Some(r)) = inbox.recv() {
            answer(r, &buffer);
        }
    });
    Publisher {
        topic: name,
        thread,
        requests,
        acks,
    }
}

/// The subscriber: moves frames and the clock into `source`, doing what it answers (a
/// replay goes to the publisher its endpoint names), until no live message came for
/// `quiet` (several idle-probe periods, so the probes have run) and no replay is in
/// flight.
fn subscribe(
    source: &mut EventSource<&Partition>,
    frames: &Receiver<Frame>,
    publishers: &[(&str, &Publisher)],
    quiet: Duration,
) {
    let tick = source.tick_interval().expect("the source probes");
    let started = Instant::now();
    let mut last_live = Instant::now();
    // Per replay id, the generation of the request in flight (`None`: none).
    let mut in_flight: Vec<(u32, u64)> = Vec::new();
    let mut generation = 0u64;
    let mut actions = Vec::new();
    loop {
        // The topic of a live message handled in this turn, acknowledged to its publisher
        // once the actions it caused are carried out.
        let mut heard: Option<Vec<u8>> = None;
        assert!(started.elapsed() < GIVE_UP, "the source never settled");
        match frames.recv_timeout(tick) {
            Ok(frame) => {
                let now = Instant::now();
                let action = match frame {
                    Frame::Live {
                        topic,
                        seq,
                        payload,
                    } => {
                        last_live = now;
                        heard = Some(topic.clone());
                        source.on_message(&topic, seq, &payload, now)
                    }
                    Frame::Replayed {
                        id,
                        generation,
                        seq,
                        payload,
                    } => {
                        if !in_flight.contains(&(id, generation)) {
                            continue; // a superseded replay's late frame
                        }
                        source.on_replayed(id, seq, &payload, now)
                    }
                    Frame::ReplayEnd { id, generation } => {
                        if !in_flight.contains(&(id, generation)) {
                            continue;
                        }
                        in_flight.retain(|r| r.0 != id);
                        source.on_replay_end(id, ReplayResult::Completed, now)
                    }
                };
                actions.push(action);
            }
            Err(RecvTimeoutError::Timeout) => {
                if in_flight.is_empty() && last_live.elapsed() >= quiet {
                    return;
                }
                source.on_tick(Instant::now(), &mut actions);
            }
            Err(RecvTimeoutError::Disconnected) => return,
        }
        for action in actions.drain(..) {
            if let SourceAction::Replay {
                id,
                from_seq,
                endpoint,
            } = action
            {
                let endpoint = endpoint.expect("every publisher has a replay endpoint");
                let (_, publisher) = publishers
                    .iter()
                    .find(|(e, _)| *e == endpoint)
                    .expect("a known replay endpoint");
                generation += 1;
                in_flight.retain(|r| r.0 != id);
                in_flight.push((id, generation));
                let request = ReplayRequest {
                    id,
                    generation,
                    from_seq,
                };
                publisher.requests.send(Some(request)).unwrap();
            }
        }
        if let Some(topic) = heard {
            let (_, publisher) = publishers
                .iter()
                .find(|(_, p)| p.topic == topic)
                .expect("a known topic");
            let _ = publisher.acks.send(());
        }
    }
}

/// How long a run may take before the test fails (a replay that is never answered).
const GIVE_UP: Duration = Duration::from_secs(60);

fn partition(workers: &[u64]) -> Partition {
    let p = Partition::new(PartitionKey::new("m", "g"), PartitionConfig::new(B));
    for w in workers {
        p.upsert_worker(WorkerInfo::new(*w, 1)).unwrap();
    }
    p
}

/// Every prompt's device overlap on `p`, by (worker, prompt).
fn overlaps(p: &Partition, workers: &[u64], n: usize) -> Vec<(u64, usize, u32)> {
    let mut out = Vec::new();
    let mut t = TieredScores::new();
    for w in workers {
        for i in 0..n {
            p.overlap(&locals(&prompt_tokens(*w, i)), &mut t);
            let device = t.get(kvr::RankId::new(*w, 0)).map_or(0, |o| o.device);
            out.push((*w, i, device));
        }
    }
    out
}

/// The partition that heard every message of `batches` (per worker, in order).
fn lossless(workers: &[u64], batches: &[Vec<Vec<u8>>]) -> Partition {
    let p = partition(workers);
    for (w, bs) in workers.iter().zip(batches) {
        for (seq, payload) in bs.iter().enumerate() {
            p.ingest(*w, 0, b"", seq as u64, payload);
        }
    }
    p
}

fn stop(publishers: Vec<Publisher>) {
    for p in publishers {
        let _ = p.requests.send(None);
        p.thread.join().unwrap();
    }
}

#[test]
fn one_publisher_losses_mid_burst_and_at_its_end_are_replayed() {
    const N: usize = 60;
    let mut rng = Rng::new(7);
    let bs = batches(1, N, &mut rng);
    let truth = lossless(&[1], std::slice::from_ref(&bs));
    let p = partition(&[1]);
    let (to_sub, frames) = channel();
    // Lost: a few in the middle, and the last two (no later batch reveals them).
    let publisher = publish(
        b"",
        bs,
        |seq| matches!(seq, 7 | 8 | 23 | 41) || seq >= N as u64 - 2,
        to_sub,
    );
    let mut source = EventSource::single(
        &p,
        1,
        0,
        Some("inproc://1".into()),
        Some(Duration::from_millis(40)),
    )
    .unwrap();
    subscribe(
        &mut source,
        &frames,
        &[("inproc://1", &publisher)],
        Duration::from_millis(300),
    );
    stop(vec![publisher]);
    assert_eq!(
        overlaps(&p, &[1], N),
        overlaps(&truth, &[1], N),
        "the index equals a lossless feed's"
    );
    assert_eq!(
        p.index().stats().holder_blocks,
        truth.index().stats().holder_blocks
    );
    let stats = &p.ingress_stats()[0];
    assert!(stats.sequence.gaps >= 2, "{stats:?}");
    assert!(stats.sequence.idle_probes >= 1, "{stats:?}");
    assert_eq!(
        stats.sequence.clears, 0,
        "every loss was replayed: {stats:?}"
    );
    assert_eq!(stats.sequence.last_seq, Some(N as u64 - 1));
}

#[test]
fn publishers_told_apart_by_topic_recover_on_their_own() {
    const N: usize = 40;
    let mut rng = Rng::new(11);
    let (b1, b2) = (batches(1, N, &mut rng), batches(2, N, &mut rng));
    let truth = lossless(&[1, 2], &[b1.clone(), b2.clone()]);
    let p = partition(&[1, 2]);
    let (to_sub, frames) = channel();
    let one = publish(b"kv-1", b1, |seq| seq == 5 || seq == 39, to_sub.clone());
    let two = publish(b"kv-2", b2, |seq| seq % 9 == 3, to_sub);
    let routes = vec![
        TopicRoute {
            topic: b"kv-1".to_vec(),
            worker_id: 1,
            stream: 0,
            replay_endpoint: Some("inproc://1".into()),
        },
        TopicRoute {
            topic: b"kv-2".to_vec(),
            worker_id: 2,
            stream: 0,
            replay_endpoint: Some("inproc://2".into()),
        },
    ];
    let mut source = EventSource::by_topic(&p, routes, Some(Duration::from_millis(40))).unwrap();
    subscribe(
        &mut source,
        &frames,
        &[("inproc://1", &one), ("inproc://2", &two)],
        Duration::from_millis(300),
    );
    stop(vec![one, two]);
    assert_eq!(overlaps(&p, &[1, 2], N), overlaps(&truth, &[1, 2], N));
    for s in p.ingress_stats() {
        assert_eq!(s.sequence.clears, 0, "{s:?}");
        assert_eq!(s.sequence.last_seq, Some(N as u64 - 1), "{s:?}");
    }
}

#[test]
fn a_partition_that_takes_no_events_refuses_the_source() {
    let mut config = PartitionConfig::new(B);
    config.indexer.use_kv_events = false;
    let p = Partition::new(PartitionKey::new("m", "g"), config);
    let err = EventSource::single(&p, 1, 0, None, None).unwrap_err();
    assert!(
        err.to_string().contains("applies no engine events"),
        "{err}"
    );
    assert_eq!(
        p.indexer_stats().events_ignored,
        1,
        "the refusal is counted"
    );
    assert!(p.ingress_stats().is_empty(), "no stream was created");
}
