//! kvr's own ZMQ subscriber through C: the host names an engine's endpoints (or one
//! endpoint for kvr to bind), kvr subscribes a partition to its KV events on its ingest
//! thread, and the host stops it.
//!
//! Ownership: `kvr_subscribe_options_new_*` and `kvr_partition_subscribe` hand out handles
//! the caller frees (`kvr_subscribe_options_free`, `kvr_subscription_free`; NULL is a
//! no-op). Options are only read by `kvr_partition_subscribe` (which copies them) and may
//! be freed or reused at once. A subscription holds its own reference to the partition
//! until it stops: the partition and engine handles may be freed before it.
//!
//! Threads: an options builder is used by one thread at a time. `kvr_partition_subscribe`
//! and `kvr_subscription_is_running` take `const` handles and may run concurrently;
//! `kvr_subscription_stop` and `kvr_subscription_free` need the subscription exclusively.
//! kvr's ingest thread (named `kvr-ingest`, one for every subscription of the process,
//! started with the first and ended with the last) applies the events; it never calls
//! into the host.

use std::io;
use std::os::raw::c_char;

use kvr::ingress::TopicRoute;
use kvr::ingress::DEFAULT_MAX_UNROUTED_TOPICS;
use kvr_zmq::subscribe::{subscribe_with, SubscribeConfig, SubscribeOptions, Subscription};

use crate::handles::kvr_partition;
use crate::status::*;

/// What to subscribe a partition to (opaque): one engine's PUB endpoint to connect to
/// (`kvr_subscribe_options_new_connect`), or one endpoint kvr binds and many engines
/// connect to (`kvr_subscribe_options_new_bind`, with topic routes).
#[allow(non_camel_case_types)]
#[derive(Debug)]
pub struct kvr_subscribe_options {
    config: SubscribeConfig,
    /// Bind: route-less topics given a stream (`kvr_subscribe_options_set_max_unrouted_topics`).
    max_unrouted_topics: usize,
}

impl kvr_subscribe_options {
    /// Options of `config`, every other knob at its default.
    fn of(config: SubscribeConfig) -> Self {
        kvr_subscribe_options {
            config,
            max_unrouted_topics: DEFAULT_MAX_UNROUTED_TOPICS,
        }
    }
}

/// A running (or stopped) subscription of a partition to engine KV events (opaque).
#[allow(non_camel_case_types)]
#[derive(Debug)]
pub struct kvr_subscription {
    subscription: Subscription,
}

/// The status of a failed start: a malformed endpoint is the caller's, anything else
/// (creating the ingest thread or its runtime) is an I/O failure.
fn start_status(e: &io::Error) -> kvr_status {
    match e.kind() {
        io::ErrorKind::InvalidInput => KVR_ERR_INVALID_ARGUMENT,
        _ => KVR_ERR_IO,
    }
}

/// New options connecting to one engine's PUB endpoint `endpoint` (`tcp://HOST:PORT` or
/// `ipc://PATH`, copied; checked by `kvr_partition_subscribe`), whose batches are
/// `worker_id`'s stream `stream` (one per publisher socket, e.g. its DP rank). No replay
/// endpoint, every topic. Free with `kvr_subscribe_options_free`.
///
/// # Safety
/// `endpoint` points to `endpoint_len` bytes; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_subscribe_options_new_connect(
    endpoint: *const c_char,
    endpoint_len: usize,
    worker_id: u64,
    stream: u32,
    out: *mut *mut kvr_subscribe_options,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let endpoint = unsafe { str_arg(endpoint, endpoint_len) }?;
        let config = SubscribeConfig::Connect {
            endpoint: endpoint.to_owned(),
            replay_endpoint: None,
            topic: Vec::new(),
            worker_id,
            stream,
        };
        // SAFETY: forwarded caller contract.
        unsafe { give(out, kvr_subscribe_options::of(config)) }
    })
}

/// New options binding `endpoint` (`tcp://HOST:PORT`, where a HOST of `*` means every
/// IPv4 interface, or `ipc://PATH`; copied; checked by `kvr_partition_subscribe`), which any
/// number of engines connect to (vLLM connects when its endpoint has no `*`). Each topic
/// is its own stream: its worker comes from a route (`kvr_subscribe_options_add_route`),
/// else from the digits that end the topic (`"kv-17"` → worker 17, stream 0); messages
/// of a topic that names no worker are counted as bad frames. Free with
/// `kvr_subscribe_options_free`.
///
/// # Safety
/// `endpoint` points to `endpoint_len` bytes; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_subscribe_options_new_bind(
    endpoint: *const c_char,
    endpoint_len: usize,
    out: *mut *mut kvr_subscribe_options,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let endpoint = unsafe { str_arg(endpoint, endpoint_len) }?;
        let config = SubscribeConfig::Bind {
            endpoint: endpoint.to_owned(),
            routes: Vec::new(),
        };
        // SAFETY: forwarded caller contract.
        unsafe { give(out, kvr_subscribe_options::of(config)) }
    })
}

/// Frees subscribe options; NULL is a no-op. Subscriptions made from them are not
/// affected.
///
/// # Safety
/// `opts` is NULL or from `kvr_subscribe_options_new_*`, not freed before.
#[no_mangle]
pub unsafe extern "C" fn kvr_subscribe_options_free(opts: *mut kvr_subscribe_options) {
    // SAFETY: forwarded caller contract.
    guard_void(|| unsafe { take_back(opts) })
}

/// Connect mode: the engine's replay ROUTER (`tcp://HOST:PORT` or `ipc://PATH`, copied;
/// `(NULL, 0)` = none, the default). With one, a sequence gap is filled by a replay from
/// the engine's buffer before newer batches apply; without one, or when the replay
/// fails, the stream's ranks are cleared and rebuild. `KVR_ERR_INVALID_ARGUMENT` on
/// bind-mode options (each route names its own replay endpoint).
///
/// # Safety
/// `opts` is NULL or live and not shared during the call; `endpoint` points to
/// `endpoint_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvr_subscribe_options_set_replay_endpoint(
    opts: *mut kvr_subscribe_options,
    endpoint: *const c_char,
    endpoint_len: usize,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (o, endpoint) = unsafe { (handle_mut(opts)?, str_arg(endpoint, endpoint_len)?) };
        match &mut o.config {
            SubscribeConfig::Connect {
                replay_endpoint, ..
            } => {
                *replay_endpoint = (!endpoint.is_empty()).then(|| endpoint.to_owned());
                Ok(())
            }
            SubscribeConfig::Bind { .. } => Err(KVR_ERR_INVALID_ARGUMENT),
        }
    })
}

/// Connect mode: subscribe only to topics starting with these bytes (copied; `(NULL, 0)`
/// = every topic, the default). `KVR_ERR_INVALID_ARGUMENT` on bind-mode options.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call; `topic` points to `topic_len`
/// bytes.
#[no_mangle]
pub unsafe extern "C" fn kvr_subscribe_options_set_topic(
    opts: *mut kvr_subscribe_options,
    topic: *const u8,
    topic_len: usize,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (o, t) = unsafe { (handle_mut(opts)?, slice(topic, topic_len)?) };
        match &mut o.config {
            SubscribeConfig::Connect { topic, .. } => {
                *topic = t.to_vec();
                Ok(())
            }
            SubscribeConfig::Bind { .. } => Err(KVR_ERR_INVALID_ARGUMENT),
        }
    })
}

/// Bind mode: messages whose topic is exactly `topic` (copied; may be empty) are
/// `worker_id`'s stream `stream`, whose publisher serves replays at `replay_endpoint`
/// (copied; `(NULL, 0)` = none; checked by `kvr_partition_subscribe`). A later route for
/// the same topic replaces the earlier one. `KVR_ERR_INVALID_ARGUMENT` on connect-mode
/// options. Each stream replays on its own: up to 64 replays run at once per
/// subscription, each with its own timeout; a stream that needs one while 64 are in
/// flight has its replay fail at once, as a timed-out one would. Messages under a topic no route names get a stream of their own, for the
/// worker named by the topic's trailing digits, for at most 256 such topics per
/// subscription (`kvr_subscribe_options_set_max_unrouted_topics`; and `KVR_MAX_INGRESS_STREAMS` streams per partition beyond its registered ranks); messages under
/// further unknown topics are dropped and counted (`kvr_indexer_stats.ingress_refused`).
/// A replayed batch under another topic than its stream's is dropped, as a live one
/// would not reach that stream.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call; `topic` and `replay_endpoint`
/// point to their lengths in bytes.
#[no_mangle]
pub unsafe extern "C" fn kvr_subscribe_options_add_route(
    opts: *mut kvr_subscribe_options,
    topic: *const u8,
    topic_len: usize,
    worker_id: u64,
    stream: u32,
    replay_endpoint: *const c_char,
    replay_endpoint_len: usize,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (o, topic, replay) = unsafe {
            (
                handle_mut(opts)?,
                slice(topic, topic_len)?,
                str_arg(replay_endpoint, replay_endpoint_len)?,
            )
        };
        let SubscribeConfig::Bind { routes, .. } = &mut o.config else {
            return Err(KVR_ERR_INVALID_ARGUMENT);
        };
        let route = TopicRoute {
            topic: topic.to_vec(),
            worker_id,
            stream,
            replay_endpoint: (!replay.is_empty()).then(|| replay.to_owned()),
        };
        match routes.iter_mut().find(|r| r.topic == route.topic) {
            Some(slot) => *slot = route,
            None => routes.push(route),
        }
        Ok(())
    })
}

/// Bind mode: gives at most `max` route-less topics a stream of their own (default 256;
/// 0 = routed topics only). Messages under further topics no route names are dropped
/// and counted (`kvr_indexer_stats.ingress_refused`), so a peer sending ever new topics
/// cannot grow the partition. `KVR_ERR_INVALID_ARGUMENT` on connect-mode options.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_subscribe_options_set_max_unrouted_topics(
    opts: *mut kvr_subscribe_options,
    max: u32,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let o = unsafe { handle_mut(opts) }?;
        if !matches!(o.config, SubscribeConfig::Bind { .. }) {
            return Err(KVR_ERR_INVALID_ARGUMENT);
        }
        o.max_unrouted_topics = max as usize;
        Ok(())
    })
}

const _: () = assert!(kvr_zmq::transport::MAX_REPLAYS == 64);
const _: () = assert!(kvr::ingress::DEFAULT_MAX_UNROUTED_TOPICS == 256);

/// Subscribes the partition to engine KV events as `opts` says, on kvr's ingest thread
/// (shared by every subscription of the process): it connects (or binds), reconnects (or retries the bind) for as long as it runs,
/// sequence-checks, replays or clears on gaps, decodes and applies every batch, and
/// counts per stream (`kvr_partition_ingress_stats`). `opts` is only read (copied); it
/// may be freed after the call.
///
/// Fails with `KVR_ERR_INVALID_CONFIG` when the partition's indexer policy applies no
/// engine events (KV events off, or a remote primary), `KVR_ERR_INVALID_ARGUMENT` when an
/// endpoint (the main one or a replay endpoint) is malformed, `KVR_ERR_IO` when the ingest
/// thread or its runtime cannot be created; nothing was started then. An endpoint that is
/// well-formed but unreachable (or a port that is taken) is not an error: kvr keeps
/// trying.
///
/// # Safety
/// `partition` and `opts` are NULL or live; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_subscribe(
    partition: *const kvr_partition,
    opts: *const kvr_subscribe_options,
    out: *mut *mut kvr_subscription,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (p, o) = unsafe { (handle(partition)?, handle(opts)?) };
        if out.is_null() {
            return Err(KVR_ERR_NULL);
        }
        if !p.partition.indexer_policy().applies_events() {
            return Err(KVR_ERR_INVALID_CONFIG);
        }
        // The engine checks every endpoint (replay ones too) before anything else, so a
        // refused start leaves nothing behind.
        let options = SubscribeOptions {
            max_unrouted_topics: o.max_unrouted_topics,
            ..SubscribeOptions::default()
        };
        let subscription = subscribe_with(p.partition.clone(), o.config.clone(), options)
            .map_err(|e| start_status(&e))?;
        // SAFETY: forwarded caller contract.
        unsafe { give(out, kvr_subscription { subscription }) }
    })
}

/// Stops the subscription and waits for it to end: when this returns, no event of it is
/// applied any more and its sockets are closed (a bound port is free again). Idempotent;
/// the handle stays valid (to free, or to ask `kvr_subscription_is_running`).
///
/// # Safety
/// `sub` is NULL or live and not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_subscription_stop(sub: *mut kvr_subscription) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        unsafe { handle_mut(sub) }?.subscription.stop();
        Ok(())
    })
}

/// `*out` = 1 while the subscription runs, 0 after `kvr_subscription_stop` (or if it ended
/// on an internal error).
///
/// # Safety
/// `sub` is NULL or live; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_subscription_is_running(
    sub: *const kvr_subscription,
    out: *mut u32,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let s = unsafe { handle(sub) }?;
        // SAFETY: forwarded caller contract.
        unsafe { write_out(out, u32::from(s.subscription.is_running())) }
    })
}

/// Stops the subscription if it is running (as `kvr_subscription_stop`: returns once it
/// has ended) and frees the handle; NULL is a no-op.
///
/// # Safety
/// `sub` is NULL or from `kvr_partition_subscribe`, not freed before, and not used by
/// another thread.
#[no_mangle]
pub unsafe extern "C" fn kvr_subscription_free(sub: *mut kvr_subscription) {
    // SAFETY: forwarded caller contract; dropping the subscription stops and joins it.
    guard_void(|| unsafe { take_back(sub) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvr::config::PartitionConfig;
    use kvr::{Partition, PartitionKey};
    use kvr_zmq::subscribe::subscribe;

    fn partition() -> std::sync::Arc<Partition> {
        std::sync::Arc::new(Partition::new(
            PartitionKey::new("m", "g"),
            PartitionConfig::new(4),
        ))
    }

    /// A malformed endpoint (the subscription's own or a replay endpoint, in either mode)
    /// is the caller's error, and a refused subscription leaves no stream behind.
    #[test]
    fn refused_subscriptions_are_invalid_arguments_and_leave_nothing() {
        let p = partition();
        let bad = [
            "",
            "127.0.0.1:5557",
            "tcp://127.0.0.1",
            "tcp://127.0.0.1:",
            "tcp://:5557",
            "tcp://*:5557",
            "tcp://127.0.0.1:65536",
            "tcp://127.0.0.1:+1",
            "tcp://127.0.0.1:5557\n",
            "udp://127.0.0.1:5557",
            "ipc://",
        ];
        for b in bad {
            let configs = [
                SubscribeConfig::Connect {
                    endpoint: b.to_owned(),
                    replay_endpoint: None,
                    topic: Vec::new(),
                    worker_id: 1,
                    stream: 0,
                },
                SubscribeConfig::Connect {
                    endpoint: "tcp://127.0.0.1:1".to_owned(),
                    replay_endpoint: Some(b.to_owned()),
                    topic: Vec::new(),
                    worker_id: 1,
                    stream: 0,
                },
                SubscribeConfig::Bind {
                    endpoint: "tcp://127.0.0.1:0".to_owned(),
                    routes: vec![TopicRoute {
                        topic: b"t".to_vec(),
                        worker_id: 2,
                        stream: 0,
                        replay_endpoint: Some(b.to_owned()),
                    }],
                },
            ];
            for c in configs {
                match subscribe(p.clone(), c) {
                    Ok(mut s) => {
                        s.stop();
                        panic!("{b:?} started");
                    }
                    Err(e) => assert_eq!(start_status(&e), KVR_ERR_INVALID_ARGUMENT, "{b:?}"),
                }
            }
        }
        assert!(p.ingress_stats().is_empty(), "{:?}", p.ingress_stats());
    }

    /// Every endpoint form the header documents starts.
    #[test]
    fn documented_endpoint_forms_start() {
        let p = partition();
        let dir = std::env::temp_dir().join(format!("kvr-ffi-{}.sock", std::process::id()));
        let ipc = format!("ipc://{}", dir.display());
        for (endpoint, bind) in [
            ("tcp://127.0.0.1:1", false),
            ("tcp://[::1]:1", false),
            ("tcp://localhost:1", false),
            (ipc.as_str(), false),
            ("tcp://127.0.0.1:0", true),
            ("tcp://*:0", true),
        ] {
            let config = if bind {
                SubscribeConfig::Bind {
                    endpoint: endpoint.to_owned(),
                    routes: Vec::new(),
                }
            } else {
                SubscribeConfig::Connect {
                    endpoint: endpoint.to_owned(),
                    replay_endpoint: Some(endpoint.to_owned()),
                    topic: Vec::new(),
                    worker_id: 1,
                    stream: 0,
                }
            };
            let mut s = subscribe(p.clone(), config).unwrap_or_else(|e| panic!("{endpoint}: {e}"));
            s.stop();
        }
        let _ = std::fs::remove_file(dir);
    }
}
