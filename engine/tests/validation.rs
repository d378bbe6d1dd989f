//! Rust refuses what C refuses (issue 13): a partition configuration or a worker's
//! metadata that the C ABI's setters refuse is refused by `PartitionConfig::validate` /
//! `WorkerInfo::validate`, and so by `Partition::try_new`, `Engine::create_partition`
//! and `Partition::upsert_worker` (Rust used to clamp or accept them silently).

use std::time::Duration;

use kvr::config::PartitionConfig;
use kvr::config::{AffinityMode, SessionConfig};
use kvr::config::{ConfigError, HintConfig};
use kvr::MAX_CONTROL_ENDPOINT_LEN;
use kvr::{Engine, EngineError};
use kvr::{Partition, PartitionKey, WorkerError, WorkerInfo};

fn refused(config: PartitionConfig) -> ConfigError {
    let e = config.validate().expect_err("refused");
    assert_eq!(
        Partition::try_new(PartitionKey::new("m", "g"), config.clone()).err(),
        Some(e.clone())
    );
    assert_eq!(
        Engine::new()
            .create_partition(PartitionKey::new("m", "g"), config)
            .err(),
        Some(EngineError::InvalidConfig(e.clone()))
    );
    e
}

#[test]
fn partition_configurations_the_c_abi_refuses_are_refused() {
    assert!(PartitionConfig::new(16).validate().is_ok());
    assert_eq!(refused(PartitionConfig::new(0)), ConfigError::ZeroBlockSize);
    let mut c = PartitionConfig::new(16);
    c.booking_ttl = Duration::ZERO;
    assert_eq!(refused(c), ConfigError::ZeroBookingTtl);
    for (i, name) in [
        "overlap_score_credit",
        "temperature",
        "prefill_tokens_fraction",
    ]
    .into_iter()
    .enumerate()
    {
        let mut c = PartitionConfig::new(16);
        let bad = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY][i];
        match i {
            0 => c.cost.overlap_score_credit = bad,
            1 => c.cost.temperature = bad,
            _ => c.busy.prefill_tokens_fraction = Some(bad),
        }
        assert_eq!(refused(c), ConfigError::NotFinite(name));
    }
    let mut c = PartitionConfig::new(16);
    c.hints = Some(HintConfig {
        source_roles: Vec::new(),
        ..HintConfig::default()
    });
    assert!(matches!(refused(c), ConfigError::Hints(_)));
    let mut c = PartitionConfig::new(16);
    c.sessions = Some(SessionConfig {
        mode: AffinityMode::Soft {
            penalty_blocks: -1.0,
        },
        ..SessionConfig::default()
    });
    let e = refused(c);
    assert!(matches!(e, ConfigError::Sessions(_)));
    assert!(e.to_string().contains("soft penalty"), "{e}");
    // Each latency knob outside its range is refused by name.
    type Set = fn(&mut kvr::config::LatencyConfig);
    let cases: [(Set, &str); 6] = [
        (|l| l.prefill_rate_prior = 0.0, "prefill_rate_prior"),
        (|l| l.request_overhead_ms = -1.0, "request_overhead_ms"),
        (|l| l.kv_pressure_threshold = 1.5, "kv_pressure_threshold"),
        (|l| l.itl_target_ms = Some(0.0), "itl_target_ms"),
        (|l| l.queue_externality = f64::NAN, "queue_externality"),
        (|l| l.decode_block_us = f64::INFINITY, "decode_block_us"),
    ];
    for (set, name) in cases {
        let mut c = PartitionConfig::new(16);
        set(&mut c.cost.latency);
        let e = refused(c);
        assert_eq!(e, ConfigError::OutOfRange(name));
        assert!(e.to_string().contains(name), "{e}");
    }
    // The indexer's own refusal comes through typed.
    let mut c = PartitionConfig::new(16);
    c.indexer.use_kv_events = false;
    c.indexer.remote_url = Some("http://127.0.0.1:1".into());
    assert!(matches!(refused(c), ConfigError::Indexer(_)));
}

#[test]
fn worker_metadata_the_c_abi_refuses_is_refused() {
    let p = Partition::try_new(PartitionKey::new("m", "g"), PartitionConfig::new(16)).unwrap();
    let mut w = WorkerInfo::new(1, 2);
    w.dp_size = 0;
    assert_eq!(p.upsert_worker(w), Err(WorkerError::ZeroDpSize));

    let mut w = WorkerInfo::new(1, 2);
    w.control_endpoints = vec![Some("a".repeat(MAX_CONTROL_ENDPOINT_LEN)), None];
    assert_eq!(
        p.upsert_worker(w.clone()),
        Ok(true),
        "the longest endpoint is fine"
    );
    w.control_endpoints[1] = Some("b".repeat(MAX_CONTROL_ENDPOINT_LEN + 1));
    assert_eq!(
        p.upsert_worker(w.clone()),
        Err(WorkerError::EndpointTooLong {
            dp_rank: 1,
            len: MAX_CONTROL_ENDPOINT_LEN + 1
        })
    );
    w.control_endpoints = vec![None, None, None];
    assert!(matches!(
        p.upsert_worker(w),
        Err(WorkerError::TooManyEndpoints { .. })
    ));
    let mut w = WorkerInfo::new(2, 1);
    w.lora_adapters = vec![String::new()];
    assert_eq!(p.upsert_worker(w), Err(WorkerError::EmptyLoraName));
    // Nothing refused was stored: worker 1 is as first registered, worker 2 absent.
    let set = p.workers();
    assert_eq!(set.len(), 1);
    assert_eq!(
        set.get(1).unwrap().control_endpoints[0]
            .as_deref()
            .map(str::len),
        Some(MAX_CONTROL_ENDPOINT_LEN)
    );
}
