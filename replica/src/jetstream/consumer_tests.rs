//! The consumer's decisions without a server: messages fed as (stream position, time,
//! bytes) to an [`Applier`] over a sink that records what it was told.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Mutex;

use kvr::{PartitionKey, RankId};

use super::*;
use crate::event::AddRequest;

/// Bookings by id; adds refused as for an unknown partition while `ready` is false.
#[derive(Default)]
struct Recorder {
    live: Mutex<HashMap<String, Duration>>,
    ready: AtomicBool,
}

impl BookingSink for Recorder {
    fn apply(&self, ev: BookingEvent) -> Applied {
        self.apply_with_ttl(ev, Duration::from_secs(300))
    }

    fn apply_with_ttl(&self, ev: BookingEvent, ttl: Duration) -> Applied {
        let mut live = self.live.lock().unwrap();
        match ev.data {
            EventData::Add(_) if !self.ready.load(Ordering::Relaxed) => Applied::UnknownPartition,
            EventData::Add(_) if live.contains_key(&ev.request_id) => Applied::Duplicate,
            EventData::Add(_) => {
                live.insert(ev.request_id, ttl);
                Applied::Applied
            }
            EventData::Free => match live.remove(&ev.request_id) {
                Some(_) => Applied::Applied,
                None => Applied::UnknownBooking,
            },
            EventData::PrefillComplete => Applied::Applied,
        }
    }

    fn expire(&self, request_id: &str) -> bool {
        self.live.lock().unwrap().remove(request_id).is_some()
    }
}

impl Recorder {
    fn ids(&self) -> Vec<String> {
        let mut v: Vec<String> = self.live.lock().unwrap().keys().cloned().collect();
        v.sort();
        v
    }
}

const ME: &str = "me";
const MY_INC: u64 = 100;

fn applier(sink: Arc<Recorder>) -> Applier {
    sink.ready.store(true, Ordering::Relaxed);
    Applier {
        sink,
        me: ME.to_string(),
        incarnation: MY_INC,
        counters: Arc::default(),
        js: Arc::default(),
        senders: Senders::default(),
        lifetime: Duration::from_secs(300),
        silence: Duration::from_secs(10),
        replay: true,
        last_stream_seq: None,
        replayed_gap_at: None,
        link_up: true,
        parked: ParkedAdds::default(),
    }
}

fn event(id: &str, data: EventData) -> BookingEvent {
    BookingEvent {
        key: PartitionKey::new("m", "g"),
        block_size: 16,
        request_id: id.to_string(),
        rank: RankId::new(1, 0),
        data,
        router_id: 0,
        lora_name: None,
    }
}

fn add(id: &str) -> BookingEvent {
    event(
        id,
        EventData::Add(AddRequest {
            token_sequence: Some(vec![1, 2]),
            track_prefill_tokens: true,
            ..Default::default()
        }),
    )
}

fn now_ns() -> i128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i128
}

/// Feeds one message; whether the consumer must replay.
fn feed(a: &mut Applier, sseq: u64, name: &str, inc: u64, seq: u64, ev: &BookingEvent) -> bool {
    let bytes = envelope::encode(name, inc, seq, ev);
    matches!(a.take_payload(sseq, now_ns(), &bytes), Flow::Replay)
}

#[test]
fn a_sender_gap_replays_once_from_its_last_applied_message_then_counts_the_loss() {
    let sink = Arc::new(Recorder::default());
    let mut a = applier(sink.clone());
    assert!(!feed(&mut a, 1, "p", 1, 1, &add("x")));
    assert!(!feed(&mut a, 2, "q", 1, 1, &add("y")));
    assert!(!feed(&mut a, 3, "q", 1, 1, &add("y")), "a repeat");
    assert_eq!(a.js.snapshot().repeated, 1);
    // p's 2 and 3 are missing.
    assert!(feed(&mut a, 4, "p", 1, 4, &add("z")), "a gap: replay");
    assert_eq!(
        a.last_stream_seq,
        Some(1),
        "from after p's last applied message"
    );
    assert_eq!(
        a.deliver_policy(),
        DeliverPolicy::ByStartSequence { start_sequence: 2 }
    );
    // The replay brings q's message again (a repeat) and the same gap: accepted, lost.
    assert!(!feed(&mut a, 2, "q", 1, 1, &add("y")));
    assert!(!feed(&mut a, 3, "q", 1, 1, &add("y")));
    assert!(!feed(&mut a, 4, "p", 1, 4, &add("z")));
    let js = a.js.snapshot();
    assert_eq!((js.gaps, js.lost, js.fell_behind), (1, 2, 0));
    assert_eq!(sink.ids(), ["x", "y", "z"]);
}

#[test]
fn falling_behind_the_retention_is_counted_once_and_not_replayed() {
    let sink = Arc::new(Recorder::default());
    let mut a = applier(sink.clone());
    assert!(!feed(&mut a, 1, "p", 1, 1, &add("x")));
    // Messages 2..=9 aged out of the stream.
    assert!(!feed(&mut a, 10, "p", 1, 10, &add("y")), "no replay");
    let js = a.js.snapshot();
    assert_eq!((js.fell_behind, js.gaps, js.lost), (1, 0, 8));
    assert_eq!(sink.ids(), ["x", "y"]);
}

#[test]
fn an_old_incarnation_s_frees_apply_and_its_adds_do_not() {
    let sink = Arc::new(Recorder::default());
    let mut a = applier(sink.clone());
    feed(&mut a, 1, "p", 5, 1, &add("p1"));
    feed(&mut a, 2, "p", 5, 2, &add("p2"));
    feed(&mut a, 3, "q", 1, 1, &add("q1"));
    // p restarts: its bookings go at its first event of the new incarnation.
    feed(&mut a, 4, "p", 6, 1, &add("p3"));
    assert_eq!(sink.ids(), ["p3", "q1"]);
    // A late event of p's old process: its free of q's booking holds, its add does not.
    feed(&mut a, 5, "p", 5, 3, &event("q1", EventData::Free));
    feed(&mut a, 6, "p", 5, 4, &add("p4"));
    assert_eq!(sink.ids(), ["p3"]);
    assert_eq!(a.js.snapshot().stale, 2);
    // This replica's own earlier process freed p3: applied; its own add: not; the
    // current process's own events: skipped.
    feed(&mut a, 7, ME, MY_INC - 1, 9, &add("mine-old"));
    feed(&mut a, 8, ME, MY_INC - 1, 10, &event("p3", EventData::Free));
    feed(&mut a, 9, ME, MY_INC, 1, &add("mine"));
    assert!(sink.ids().is_empty());
    assert_eq!(a.counters.snapshot().own, 3);
}

#[test]
fn adds_for_workers_not_registered_wait_and_apply_later_unless_freed() {
    let sink = Arc::new(Recorder::default());
    let mut a = applier(sink.clone());
    sink.ready.store(false, Ordering::Relaxed);
    feed(&mut a, 1, "p", 1, 1, &add("x"));
    feed(&mut a, 2, "p", 1, 2, &add("y"));
    feed(&mut a, 3, "p", 1, 3, &event("y", EventData::Free));
    assert_eq!(a.parked.len(), 1);
    a.retry_parked();
    assert_eq!(a.parked.len(), 1, "still not registered");
    sink.ready.store(true, Ordering::Relaxed);
    a.retry_parked();
    assert_eq!(sink.ids(), ["x"]);
    assert!(a.parked.is_empty());
    let js = a.js.snapshot();
    assert_eq!((js.parked, js.unparked), (2, 1));
    // A new incarnation drops its predecessor's waiting adds too.
    sink.ready.store(false, Ordering::Relaxed);
    feed(&mut a, 4, "p", 1, 4, &add("z"));
    assert_eq!(a.parked.len(), 1);
    feed(
        &mut a,
        5,
        "p",
        2,
        1,
        &event("x", EventData::PrefillComplete),
    );
    assert!(a.parked.is_empty());
}

#[test]
fn a_replayed_add_lives_what_is_left_of_its_lifetime_and_an_older_one_not_at_all() {
    let sink = Arc::new(Recorder::default());
    let mut a = applier(sink.clone());
    let old = |secs: i128| now_ns() - secs * 1_000_000_000;
    a.take_payload(1, old(100), &envelope::encode("p", 1, 1, &add("x")));
    a.take_payload(2, old(400), &envelope::encode("p", 1, 2, &add("y")));
    let ttl = sink.live.lock().unwrap()["x"];
    assert!(
        ttl <= Duration::from_secs(200) && ttl > Duration::from_secs(195),
        "{ttl:?}"
    );
    assert_eq!(sink.ids(), ["x"]);
    assert_eq!(a.js.snapshot().too_old, 1);
}
