//! A journal reads back record for record; a torn or corrupt tail is cut at the last
//! whole record and what came before is kept; a foreign header refuses the file.

use kvr::config::PartitionConfig;
use kvr::{Partition, PartitionKey, RankId, StoredBlock, Tier};
use kvr_state::format::{FileError, Identity};
use kvr_state::journal::{header_frame, put_record, read, OwnedEvent, Record};

fn id(model: &str) -> Identity {
    Identity::of(&Partition::new(
        PartitionKey::new(model, "default"),
        PartitionConfig::new(16),
    ))
}

fn records() -> Vec<Record> {
    let r = RankId::new(7, 1);
    let blocks = |n: u64| -> Vec<StoredBlock> {
        (0..n)
            .map(|i| StoredBlock {
                external_hash: 100 + i,
                local_hash: 900 + i,
            })
            .collect()
    };
    (0..20u64)
        .map(|i| match i % 8 {
            3 => Record::Clear {
                worker_id: 7,
                dp_ranks: vec![1],
            },
            5 => Record::Removed { worker_id: 8 },
            6 => Record::Gap { records: i },
            7 => Record::Direct {
                events: vec![(r, OwnedEvent::Cleared)],
            },
            _ => Record::Batch {
                worker_id: 7,
                stream: 1,
                seq: i,
                digest: i * 31,
                events: vec![
                    (
                        r,
                        OwnedEvent::Stored {
                            tier: Tier::Device,
                            parent: (i % 2 == 1).then_some(99),
                            blocks: blocks(1 + i % 5),
                        },
                    ),
                    (
                        r,
                        OwnedEvent::StoredKnown {
                            tier: Tier::Host,
                            external_hashes: vec![100],
                        },
                    ),
                    (
                        r,
                        OwnedEvent::Removed {
                            tier: Tier::Device,
                            external_hashes: vec![101, 102],
                        },
                    ),
                    (r, OwnedEvent::Cleared),
                    (
                        r,
                        OwnedEvent::StatesStored {
                            tier: Tier::Disk,
                            external_hashes: vec![100],
                        },
                    ),
                    (
                        r,
                        OwnedEvent::StatesRemoved {
                            tier: Tier::Disk,
                            external_hashes: vec![100],
                        },
                    ),
                ],
            },
        })
        .collect()
}

fn journal() -> (Vec<u8>, Vec<usize>) {
    let mut b = header_frame(&id("m"));
    let mut ends = vec![b.len()];
    for r in records() {
        put_record(&mut b, &r);
        ends.push(b.len());
    }
    (b, ends)
}

#[test]
fn a_journal_reads_back_record_for_record_and_events_round_trip() {
    let (b, _) = journal();
    let j = read(&b, &id("m")).unwrap();
    assert_eq!(j.records, records());
    assert_eq!((j.valid_len, j.stop), (b.len(), None));
    if let Record::Batch { events, .. } = &j.records[0] {
        for (_, e) in events {
            assert_eq!(&OwnedEvent::of(&e.as_event()), e);
        }
    }
}

#[test]
fn a_torn_or_corrupt_tail_is_cut_at_the_last_whole_record() {
    let (b, ends) = journal();
    for cut in ends[0]..b.len() {
        let j = read(&b[..cut], &id("m")).unwrap();
        let whole = ends.iter().filter(|&&e| e <= cut).count() - 1;
        assert_eq!(j.records, records()[..whole], "cut at {cut}");
        assert_eq!(j.valid_len, ends[whole]);
    }
    for i in (ends[0] * 8..b.len() * 8).step_by(53) {
        let mut c = b.clone();
        c[i / 8] ^= 1 << (i % 8);
        let j = read(&c, &id("m")).unwrap();
        let n = j.records.len();
        assert!(n < 20 && j.records[..] == records()[..n], "bit {i}");
        assert!(j.stop.is_some());
    }
}

#[test]
fn a_foreign_or_damaged_header_refuses_the_journal() {
    let (b, ends) = journal();
    assert_eq!(read(&[], &id("m")), Err(FileError::Empty));
    assert!(matches!(
        read(&b, &id("other")),
        Err(FileError::Partition(_))
    ));
    assert!(read(&b[..ends[0] - 1], &id("m")).is_err());
    // A snapshot's header is another kind.
    let snap = kvr_state::snapshot::Snapshot {
        identity: id("m"),
        stores: vec![],
        holes: vec![],
        streams: vec![],
    };
    assert_eq!(read(&snap.to_bytes(), &id("m")), Err(FileError::Kind(1)));
}

#[test]
fn a_batch_built_event_by_event_is_the_same_record() {
    use kvr_state::journal::BatchPayload;
    for rec in records() {
        let Record::Batch {
            worker_id,
            stream,
            seq,
            digest,
            events,
        } = &rec
        else {
            continue;
        };
        let mut b = BatchPayload::new(*worker_id, *stream, *seq, *digest, vec![9; 3]);
        for (rank, e) in events {
            b.push(*rank, &e.as_event());
        }
        let (payload, n) = b.finish();
        assert_eq!(n as usize, events.len());
        let mut framed = Vec::new();
        kvr_state::frame::put_frame(&mut framed, &payload);
        let mut want = Vec::new();
        put_record(&mut want, &rec);
        assert_eq!(framed, want);
    }
}
