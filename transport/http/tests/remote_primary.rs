//! The remote primary (DESIGN.md §5, seed 000): a remote service answers the overlap
//! query; a remote that is unreachable, hangs or answers garbage gives that selection no
//! overlap — counted, never a failed selection; the partition starts no event
//! subscription and applies no events.
//!
//! The partitions with an HTTP remote get their client as a host gives it:
//! `kvr_remote::with_http_client` (the engine cannot reach a URL by itself).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvr::config::PartitionConfig;
use kvr::config::{IndexerConfig, IndexerPolicy};
use kvr::cost::SelectionRng;
use kvr::RankId;
use kvr::RemoteClient;
use kvr::{Outcome, SelectRequest};
use kvr::{Partition, PartitionKey, WorkerInfo};
use kvr::{RemoteError, RemoteIndex, TieredOverlap, TieredScores};

const B: u32 = 4;

/// A remote double: rank (1, 0) holds `blocks` device blocks, or every query fails.
struct Fake {
    blocks: u32,
    fail: bool,
    calls: AtomicU64,
}

impl RemoteIndex for Fake {
    fn query_tiered(
        &self,
        key: &PartitionKey,
        block_size: u32,
        local_hashes: &[u64],
        out: &mut TieredScores,
    ) -> Result<(), RemoteError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        assert_eq!((key.model.as_str(), block_size), ("m", B));
        assert_eq!(local_hashes.len(), 8, "the prompt's local hashes");
        if self.fail {
            let _ = out.fill_from(std::iter::empty());
            return Err(RemoteError::Timeout);
        }
        out.fill_from([TieredOverlap {
            rank: RankId::new(1, 0),
            device: self.blocks,
            host: 0,
            disk: 0,
        }])
        .unwrap();
        Ok(())
    }
}

/// A remote primary at `url`: `client` if given, else the HTTP client of `url`.
fn remote_partition(client: Option<Arc<dyn RemoteIndex>>, url: &str) -> Partition {
    let indexer = IndexerConfig {
        remote_url: Some(url.into()),
        remote_client: client.map(RemoteClient),
        remote_connect_timeout: std::time::Duration::from_millis(100),
        remote_request_timeout: std::time::Duration::from_millis(300),
        ..IndexerConfig::default()
    };
    let indexer = kvr_remote::with_http_client(&indexer).unwrap();
    assert!(indexer.remote_client.is_some());
    let p = Partition::try_new(
        PartitionKey::new("m", "g"),
        PartitionConfig {
            indexer,
            ..PartitionConfig::new(B)
        },
    )
    .unwrap();
    for w in 0..3 {
        p.upsert_worker(WorkerInfo::new(w, 1)).unwrap();
    }
    p
}

fn select(p: &Partition) -> (RankId, u32) {
    let tokens: Vec<u32> = (0..8 * B).collect();
    let mut rng = SelectionRng::from_seed(3);
    match p.select(&SelectRequest::tokens(&tokens), &mut rng) {
        Outcome::Selected(d) => (d.rank, d.overlap.device_blocks),
        o => panic!("{o:?}"),
    }
}

#[test]
fn remote_primary_answers_the_overlap_query() {
    let fake = Arc::new(Fake {
        blocks: 6,
        fail: false,
        calls: AtomicU64::new(0),
    });
    let p = remote_partition(Some(fake.clone()), "http://index.invalid:1");
    assert!(matches!(
        p.indexer_stats().policy,
        IndexerPolicy::RemotePrimary { .. }
    ));
    assert_eq!(select(&p), (RankId::new(1, 0), 6));
    assert_eq!(fake.calls.load(Ordering::Relaxed), 1);
    let s = p.indexer_stats();
    assert_eq!((s.remote_queries, s.remote_failures), (1, 0));
}

#[test]
fn remote_failure_yields_no_overlap_counted_never_a_failed_selection() {
    let fake = Arc::new(Fake {
        blocks: 6,
        fail: true,
        calls: AtomicU64::new(0),
    });
    let p = remote_partition(Some(fake), "http://index.invalid:1");
    for _ in 0..3 {
        assert_eq!(select(&p).1, 0);
    }
    let s = p.indexer_stats();
    assert_eq!((s.remote_queries, s.remote_failures), (3, 3));
}

#[test]
fn remote_primary_applies_no_events_and_starts_no_subscription() {
    let fake = Arc::new(Fake {
        blocks: 0,
        fail: false,
        calls: AtomicU64::new(0),
    });
    let p = Arc::new(remote_partition(Some(fake), "http://index.invalid:1"));
    let payload = kvr_emulator::BatchEncoder::new()
        .stored(&[1, 2], None, &[0; 8], B, kvr::ingress::Medium::Gpu, None)
        .finish(0.0, None);
    let out = p.ingest(1, 0, b"t", 0, &payload);
    assert_eq!(out.batches_applied, 0);
    assert_eq!(p.indexer_stats().events_ignored, 1);
    assert_eq!(p.index().stats().holder_blocks, 0);
    {
        let err = kvr_zmq::subscribe(
            p.clone(),
            kvr_zmq::SubscribeConfig::Connect {
                endpoint: "tcp://127.0.0.1:5557".into(),
                replay_endpoint: None,
                topic: Vec::new(),
                worker_id: 1,
                stream: 0,
            },
        )
        .expect_err("refused");
        assert!(err.to_string().contains("no subscription"), "{err}");
    }
}

/// The engine builds no client: a remote URL without one is refused, saying what to supply
/// (this was the engine built without its former `remote` feature; now it always is).
#[test]
fn remote_url_without_a_client_is_refused() {
    let indexer = IndexerConfig {
        remote_url: Some("http://127.0.0.1:1".into()),
        ..IndexerConfig::default()
    };
    let r = Partition::try_new(
        PartitionKey::new("m", "g"),
        PartitionConfig {
            indexer: indexer.clone(),
            ..PartitionConfig::new(B)
        },
    );
    let err = r.err().unwrap().to_string();
    assert!(
        err.contains("no client") && err.contains("kvr-remote"),
        "{err}"
    );
    assert_eq!(indexer.check().unwrap_err().to_string(), err);
    // The host's part: the HTTP client of that URL makes it a remote primary.
    let with = kvr_remote::with_http_client(&indexer).unwrap();
    assert!(with.check().is_ok());
    // A URL the client cannot use is refused there, naming the URL (as the engine did when
    // it built the client itself); policy errors come first, as in the engine's own check.
    let https = IndexerConfig {
        remote_url: Some("https://index".into()),
        ..IndexerConfig::default()
    };
    let e = kvr_remote::with_http_client(&https)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("remote index \"https://index\"") && e.contains("https"),
        "{e}"
    );
    let off = IndexerConfig {
        use_kv_events: false,
        ..https
    };
    let e = kvr_remote::with_http_client(&off).unwrap_err().to_string();
    assert_eq!(e, off.resolve().unwrap_err().to_string());
    // No URL, or a client already there: unchanged.
    let plain = IndexerConfig::default();
    assert_eq!(kvr_remote::with_http_client(&plain).unwrap(), plain);
}

/// The HTTP client against servers that fail in each way.
mod http {
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::time::{Duration, Instant};

    use super::*;

    fn serve(reply: Option<&'static [u8]>) -> String {
        serve_owned(reply.map(<[u8]>::to_vec))
    }

    fn serve_owned(reply: Option<Vec<u8>>) -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for conn in l.incoming() {
                let Ok(mut c) = conn else { return };
                let mut buf = [0u8; 4096];
                let _ = c.read(&mut buf);
                match &reply {
                    Some(r) => {
                        let _ = c.write_all(r);
                    }
                    // Hang: hold the connection open, answer nothing.
                    None => std::thread::sleep(Duration::from_secs(5)),
                }
            }
        });
        format!("http://{addr}")
    }

    fn check_selection_survives(url: &str) {
        let p = remote_partition(None, url);
        let t0 = Instant::now();
        assert_eq!(select(&p).1, 0, "no overlap from a failed remote");
        assert!(
            t0.elapsed() < Duration::from_secs(3),
            "bounded by the timeouts"
        );
        let s = p.indexer_stats();
        assert_eq!((s.remote_queries, s.remote_failures), (1, 1), "{url}");
    }

    #[test]
    fn refused_remote_leaves_selection_working_counted() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        drop(l);
        check_selection_survives(&url);
    }

    #[test]
    fn hanging_remote_leaves_selection_working_counted() {
        check_selection_survives(&serve(None));
    }

    #[test]
    fn garbage_remote_leaves_selection_working_counted() {
        check_selection_survives(&serve(Some(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello",
        )));
        check_selection_survives(&serve(Some(b"not http at all\r\n\r\n")));
    }

    #[test]
    fn a_correct_remote_is_used() {
        let body = r#"{"block_size":4,"tiered":{"device":{"scores":[[{"worker_id":2,"dp_rank":0},5]],"frequencies":[]},"lower_tier":[]}}"#;
        let url = serve_owned(Some(
            format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
                 Connection: close\r\n\r\n{body}",
                body.len()
            )
            .into_bytes(),
        ));
        let p = remote_partition(None, &url);
        assert_eq!(select(&p), (RankId::new(2, 0), 5));
        assert_eq!(p.indexer_stats().remote_failures, 0);
    }
}
