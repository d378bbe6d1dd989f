//! Replica sync for `kvr serve`: local bookings published to peers, peers' bookings
//! applied to the engine as replica bookings, in the same per-rank accounting as local
//! ones.
//!
//! Peers' bookings are named in the service's id table under the peer's wire id, so a
//! local `prefill_complete` or `DELETE` can end a peer's booking (and is published again,
//! as Dynamo does), and a local booking under an id a peer booked is refused with 409.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use kvr::{BookingRequest, EngineError, PartitionKey, RankId, SelectionId};
use kvr_replica::{
    AddRequest, Applied, BookingEvent, BookingSink, DynamoSync, EventData, JetStreamConfig,
    JetStreamSync,
};

use crate::ids::NameError;
use crate::replica::{check_args, MAX_PEER_BOOKING_BLOCKS, PEER_BOOKING_TTL};
use crate::App;

/// Starts the sync when `--replica-sync-port` is given: binds the publisher on
/// `--replica-sync-host` (else the service's host) and connects to the peers.
pub async fn start(app: &Arc<App>) -> Result<(), String> {
    if let Some(url) = &app.args.replica_sync {
        return start_jetstream(app, url).await;
    }
    let Some(port) = app.args.replica_sync_port else {
        return Ok(());
    };
    check_args(Some(port), &app.args.replica_sync_peers)?;
    let host = app
        .args
        .replica_sync_host
        .as_deref()
        .unwrap_or(app.args.host.as_str());
    let ip: IpAddr = match host {
        "localhost" => IpAddr::from([127, 0, 0, 1]),
        h => h
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .map_err(|_| format!("replica sync host `{h}` is not an IP address"))?,
    };
    let sink = Arc::new(Sink(Arc::downgrade(app)));
    let silence = match app.args.replica_sync_peer_timeout_secs {
        0 => Duration::MAX,
        s => Duration::from_secs(s),
    };
    let sync = DynamoSync::start(
        SocketAddr::new(ip, port),
        &app.args.replica_sync_peers,
        silence,
        sink,
    )
    .await?;
    tracing::info!(
        addr = %sync.local_addr(),
        router_id = sync.router_id(),
        peers = ?app.args.replica_sync_peers,
        "replica sync: publishing bookings"
    );
    app.replicas.set(sync);
    Ok(())
}

/// Starts the JetStream sync (`--replica-sync nats://...`).
async fn start_jetstream(app: &Arc<App>, url: &str) -> Result<(), String> {
    let name = app
        .args
        .replica_name
        .clone()
        .unwrap_or_else(random_replica_name);
    let cfg = JetStreamConfig {
        url: url.to_string(),
        name,
        stream: app.args.replica_sync_stream.clone(),
        peer_silence: match app.args.replica_sync_heartbeat_timeout_secs {
            0 => Duration::MAX,
            s => Duration::from_secs(s),
        },
        booking_lifetime: PEER_BOOKING_TTL,
        max_bytes: app.args.replica_sync_stream_max_bytes,
        replay: !app.args.replica_sync_test_no_replay,
    };
    let sink = Arc::new(Sink(Arc::downgrade(app)));
    let sync = JetStreamSync::start(cfg, sink).await?;
    app.replicas.set_jetstream(sync);
    Ok(())
}

/// A random replica name (`kvr-` and 16 hex digits) for a replica started without
/// `--replica-name`.
fn random_replica_name() -> String {
    format!("kvr-{:016x}", kvr_replica::dynamo_sync::new_router_id())
}

/// Applies peers' events to the app's engine.
struct Sink(Weak<App>);

impl BookingSink for Sink {
    fn apply(&self, ev: BookingEvent) -> Applied {
        match self.0.upgrade() {
            Some(app) => app.apply_peer_event(ev, PEER_BOOKING_TTL),
            None => Applied::Refused,
        }
    }

    fn apply_with_ttl(&self, ev: BookingEvent, ttl: Duration) -> Applied {
        match self.0.upgrade() {
            Some(app) => app.apply_peer_event(ev, ttl.min(PEER_BOOKING_TTL)),
            None => Applied::Refused,
        }
    }

    fn expire(&self, request_id: &str) -> bool {
        self.0
            .upgrade()
            .is_some_and(|app| app.expire_peer_booking(request_id))
    }
}

impl App {
    /// Applies one event of a peer replica to this service's bookings (what the sync's
    /// receiver calls; public for other transports and for tests).
    pub fn apply_replica_event(&self, ev: BookingEvent) -> Applied {
        self.apply_peer_event(ev, PEER_BOOKING_TTL)
    }

    /// As [`App::apply_replica_event`]; an add lives `ttl` at most.
    fn apply_peer_event(&self, ev: BookingEvent, ttl: Duration) -> Applied {
        let Some(entry) = self.registry.partition(&ev.key) else {
            return Applied::UnknownPartition;
        };
        if entry.partition.block_size() != ev.block_size {
            return Applied::BlockSizeMismatch;
        }
        match ev.data {
            EventData::Add(a) => {
                self.apply_peer_add(&entry.partition, &ev.key, &ev.request_id, ev.rank, a, ttl)
            }
            EventData::PrefillComplete | EventData::Free => {
                let free = matches!(ev.data, EventData::Free);
                let Some((_, b)) = self
                    .ids
                    .lookup(&ev.request_id)
                    .and_then(|id| self.engine.booking(id))
                else {
                    // A free ahead of its add: the add, if it comes, is dropped.
                    if free {
                        self.replicas.bury(&ev.request_id, Instant::now());
                    }
                    return Applied::UnknownBooking;
                };
                let id = b.selection_id;
                // Dynamo matches a booking by id and worker: another rank's event is not it.
                if b.rank != ev.rank {
                    return Applied::WrongRank;
                }
                if free {
                    let r = self.engine.free(id);
                    self.ids.forget(&ev.request_id);
                    // A repeated or late copy of the add must not bring it back.
                    self.replicas.bury(&ev.request_id, Instant::now());
                    match r {
                        Ok(kvr::FreeOutcome::Freed(_)) => Applied::Applied,
                        _ => Applied::UnknownBooking,
                    }
                } else if b.prefill_complete {
                    Applied::Duplicate
                } else {
                    match self.engine.mark_prefill_complete(id) {
                        Ok(()) => Applied::Applied,
                        Err(_) => Applied::UnknownBooking,
                    }
                }
            }
        }
    }

    /// Ends a peer's booking without publishing anything (its peer is gone); a local
    /// booking under that id is left alone.
    fn expire_peer_booking(&self, request_id: &str) -> bool {
        let Some((_, b)) = self
            .ids
            .lookup(request_id)
            .and_then(|id| self.engine.booking(id))
        else {
            return false;
        };
        if b.origin != kvr::BookingOrigin::Replica {
            return false;
        }
        let freed = matches!(
            self.engine.free(b.selection_id),
            Ok(kvr::FreeOutcome::Freed(_))
        );
        self.ids.forget(request_id);
        freed
    }

    fn apply_peer_add(
        &self,
        partition: &Arc<kvr::Partition>,
        key: &PartitionKey,
        request_id: &str,
        rank: RankId,
        a: AddRequest,
        ttl: Duration,
    ) -> Applied {
        let blocks = a.token_sequence.clone().unwrap_or_default();
        if blocks.len() > MAX_PEER_BOOKING_BLOCKS || request_id.is_empty() {
            return Applied::Refused;
        }
        if self.replicas.buried(request_id, Instant::now()) {
            return Applied::Duplicate;
        }
        // A live id (local, or a peer's already applied) is left as it is: Dynamo's rule.
        if self
            .ids
            .lookup(request_id)
            .is_some_and(|id| self.engine.booking(id).is_some())
        {
            return Applied::Duplicate;
        }
        let id: SelectionId = match self
            .ids
            .name(request_id, key, || self.engine.mint_selection_id())
        {
            Ok(id) => id,
            Err(NameError::Taken) => return Applied::Duplicate,
            Err(NameError::Full) => return Applied::Refused,
        };
        let booking = BookingRequest {
            selection_id: id,
            rank,
            prompt_blocks: blocks,
            prefill_tokens: a.booked_prefill_tokens(),
            expected_output_tokens: a.expected_output_tokens.map_or(0, u64::from),
            ttl: Some(ttl),
        };
        match self.engine.install_replica_booking(partition, booking) {
            Ok(()) => Applied::Applied,
            Err(e) => {
                self.ids.forget(request_id);
                match e {
                    EngineError::UnknownRank(_) => Applied::UnknownRank,
                    EngineError::DuplicateSelectionId(_) => Applied::Duplicate,
                    _ => Applied::Refused,
                }
            }
        }
    }

    /// Publishes a local booking `id` (just made, under wire id `request_id`) to the
    /// peers. `hint`: the prefill tokens to announce and whether they are tracked (`None`
    /// for an explicit reservation, which books none).
    pub(crate) fn publish_booked(
        &self,
        partition: &kvr::Partition,
        id: SelectionId,
        request_id: &str,
        hint: Option<(u64, bool)>,
        expected_output_tokens: Option<u64>,
        lora_name: Option<&str>,
    ) {
        if !self.replicas.active() {
            return;
        }
        let Some(view) = partition.bookings().get(id) else {
            return;
        };
        let add = AddRequest {
            token_sequence: partition.bookings().prompt_blocks(id),
            track_prefill_tokens: hint.is_none_or(|(_, track)| track),
            expected_output_tokens: expected_output_tokens
                .map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
            prefill_tokens: hint.map(|(n, _)| n),
            expected_prefill_duration: None,
        };
        self.replicas.publish(BookingEvent {
            key: partition.key().clone(),
            block_size: partition.block_size(),
            request_id: request_id.to_string(),
            rank: view.rank,
            data: EventData::Add(add),
            router_id: 0,
            lora_name: lora_name.map(str::to_string),
        });
    }

    /// Publishes the end of a booking's prefill, or its free (`booking`: read before).
    pub(crate) fn publish_lifecycle(
        &self,
        request_id: &str,
        booking: Option<(Arc<kvr::Partition>, kvr::BookingView)>,
        data: EventData,
    ) {
        let Some((p, b)) = booking.filter(|_| self.replicas.active()) else {
            return;
        };
        self.replicas.publish(BookingEvent {
            key: p.key().clone(),
            block_size: p.block_size(),
            request_id: request_id.to_string(),
            rank: b.rank,
            data,
            router_id: 0,
            lora_name: None,
        });
    }
}

/// The peer operations without HTTP (the routes' core, also the Python bindings').
impl App {
    fn running_sync(&self) -> Result<&Arc<DynamoSync>, crate::error::ApiError> {
        if self.replicas.jetstream().is_some() {
            return Err(crate::error::ApiError::conflict(
                "replica peers are registered only with --replica-sync-port; the JetStream sync finds its peers through the stream",
            ));
        }
        self.replicas
            .get()
            .ok_or_else(|| crate::error::ApiError::conflict("replica sync is disabled"))
    }

    /// Connects to a peer replica: true when it is new.
    pub fn register_replica_peer(&self, endpoint: &str) -> Result<bool, crate::error::ApiError> {
        self.running_sync()?
            .register_peer(endpoint)
            .map_err(crate::error::ApiError::bad_request)
    }

    /// Disconnects from a peer replica: false when it was not one.
    pub fn deregister_replica_peer(&self, endpoint: &str) -> Result<bool, crate::error::ApiError> {
        self.running_sync()?
            .deregister_peer(endpoint)
            .map_err(crate::error::ApiError::bad_request)
    }

    /// The peer replicas, sorted (none when replica sync is off).
    pub fn replica_peers(&self) -> Vec<String> {
        self.replicas.get().map_or_else(Vec::new, |s| s.peers())
    }
}
