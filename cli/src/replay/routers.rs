//! Several router replicas in front of one simulated cluster (`kvr replay --routers N`),
//! and how they share their bookings (`--sync`).
//!
//! Each replica is a [`Router`] with its own engine and partition: the same KV events
//! reach every replica's index (each after `--event-delay-ms`), but a replica books only
//! what it routed itself, so without sync each one sees about 1/N of the load. Requests
//! are spread over the replicas round robin (arrival order) or at random.
//!
//! With sync, a replica's booking lifecycle (booked with its prompt blocks and prefill
//! tokens; prefill complete; output blocks; free) reaches every other replica
//! `--sync-latency-ms` later, where it is installed as a replica booking
//! ([`ReservationTable::install_replica_booking`]) and found by `mark_prefill_complete`,
//! `add_output_blocks` and `free` like a local one.
//!
//! * `dynamo` — Dynamo 1.6.1's replica sync: best effort (ZMQ PUB/SUB), no sequencing,
//!   acknowledgement, replay or resync. Each (event, peer) pair is lost with probability
//!   `--sync-loss`, independently (a slow subscriber's queue drops per subscriber). A lost
//!   add hides the request from that peer for its whole life (its later prefill and free
//!   find nothing there); a lost free leaves a phantom booking until it expires; output
//!   blocks are not synced.
//! * `jetstream` — per-replica sequenced streams (NATS JetStream): every event arrives, in
//!   order, after the latency; output blocks too.
//!
//! In both modes a peer's booking lives at most 300 s after it was received (Dynamo's
//! expiry, and the engine's cap on replica bookings, `MAX_REPLICA_BOOKING_TTL`). The
//! engine's expiry runs on the clock it is handed: `Engine::install_replica_booking`
//! takes the wall clock (`Instant::now()`), which means nothing under simulated time, so
//! the replicas install peer bookings on the partition's table at the *simulated* time of
//! receipt and the simulation sweeps that table at simulated receipt + 300 s
//! ([`SyncMsg::Expire`]). (A consequence: `kvr-approx` replicas do not record peer
//! bookings in their approximate index, which the engine's install would do.)

use std::time::{Duration, Instant};

use kvr::cost::SelectionRng;
use kvr::{BookingRequest, BookingStatus, FreeOutcome, FreedBy, RankId, ReservationTable};

use super::policy::{hasher, PolicyKind, Routed, Router};

/// How the replicas share bookings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SyncMode {
    None,
    Dynamo,
    Jetstream,
}

impl SyncMode {
    pub(crate) const ALL: [SyncMode; 3] = [SyncMode::None, SyncMode::Dynamo, SyncMode::Jetstream];

    pub(crate) fn name(self) -> &'static str {
        match self {
            SyncMode::None => "none",
            SyncMode::Dynamo => "dynamo",
            SyncMode::Jetstream => "jetstream",
        }
    }

    pub(crate) fn parse(s: &str) -> Result<SyncMode, String> {
        SyncMode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown sync mode {s:?} (known: none, dynamo, jetstream)"))
    }

    /// The default sync latency, ms: a ZMQ PUB/SUB hop inside a cluster is well under a
    /// millisecond plus the publisher's batching (1 ms); a JetStream publish is
    /// acknowledged by the stream's replicas (R=3) before consumers get it (3 ms).
    pub(crate) fn default_latency_ms(self) -> f64 {
        match self {
            SyncMode::None => 0.0,
            SyncMode::Dynamo => 1.0,
            SyncMode::Jetstream => 3.0,
        }
    }
}

/// How requests are spread over the replicas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Spread {
    RoundRobin,
    Random,
}

/// The replicas' shape and sync.
#[derive(Clone, Debug)]
pub(crate) struct ReplicaConfig {
    pub routers: u32,
    pub sync: SyncMode,
    pub latency_ms: f64,
    /// `dynamo` only: probability that one event is lost for one peer.
    pub loss: f64,
    pub spread: Spread,
    /// The race window, ms: two replicas picking the same rank within it is a race.
    pub race_window_ms: f64,
    pub seed: u64,
}

impl ReplicaConfig {
    /// One router, no sync: today's replay.
    pub(crate) fn single(seed: u64) -> Self {
        ReplicaConfig {
            routers: 1,
            sync: SyncMode::None,
            latency_ms: 0.0,
            loss: 0.0,
            spread: Spread::RoundRobin,
            race_window_ms: 10.0,
            seed,
        }
    }
}

/// How long a peer's booking lives after receipt (Dynamo's expiry; the engine's cap).
pub(crate) const PEER_BOOKING_TTL: Duration = Duration::from_secs(300);

/// A sync event on its way to replica `to`.
pub(crate) enum SyncMsg {
    Booked {
        to: u32,
        req: BookingRequest,
    },
    Prefilled {
        to: u32,
        id: u64,
    },
    Output {
        to: u32,
        id: u64,
    },
    Freed {
        to: u32,
        id: u64,
    },
    /// Replica `to` sweeps its table at `at` (a peer booking's expiry, simulated).
    Expire {
        to: u32,
        id: u64,
        at: Instant,
    },
}

/// What the replicas did and saw.
#[derive(Clone, Debug, Default)]
pub(crate) struct FleetStats {
    /// Sync events sent (per peer), lost on the way, applied by the peer.
    pub sent: u64,
    pub lost: u64,
    pub applied: u64,
    /// Events for a booking the peer does not hold (its add was lost) or no longer holds.
    pub unmatched: u64,
    /// Peer bookings that expired (phantoms of a lost free, or bookings living > 300 s).
    pub peer_expired: Vec<u64>,
    /// Bookings the simulation's expiry sweeps freed, per replica.
    pub swept: Vec<u64>,
    /// Requests routed to a rank another replica picked within the race window.
    pub races: u64,
    /// Requests routed while another replica had routed any request within the window.
    pub exposed: u64,
    /// Requests routed to a rank holding a live request of another replica that the
    /// routing replica does not see.
    pub blind: u64,
    /// Load samples with work in flight, and the sums of their per-sample figures.
    pub samples: u64,
    pub cov_sum: f64,
    pub peak_ratio_sum: f64,
    pub visible_sum: f64,
    /// The most requests any rank held at a sample.
    pub max_active: u32,
}

/// The replicas and the sync between them.
pub(crate) struct Fleet<'r> {
    routers: &'r mut [Router],
    cfg: ReplicaConfig,
    dp_size: usize,
    spread_rng: SelectionRng,
    loss_rng: SelectionRng,
    next: usize,
    /// Sync events to schedule: (simulated time, event). The simulation drains it.
    pub outbox: Vec<(f64, SyncMsg)>,
    /// The last time each replica picked each rank (`rank × routers + router`), and the
    /// last time it picked any.
    last_pick: Vec<f64>,
    last_any: Vec<f64>,
    /// The live requests on each rank: (selection id, replica).
    live: Vec<Vec<(u64, u32)>>,
    seq: Vec<u64>,
    local: Vec<u64>,
    pub stats: FleetStats,
}

impl<'r> Fleet<'r> {
    pub(crate) fn new(
        routers: &'r mut [Router],
        cfg: ReplicaConfig,
        dp_size: u32,
        ranks: usize,
    ) -> Self {
        let n = routers.len();
        let seed = cfg.seed;
        Fleet {
            routers,
            cfg,
            dp_size: dp_size as usize,
            spread_rng: SelectionRng::from_seed(seed ^ 0x7370_7265_6164),
            loss_rng: SelectionRng::from_seed(seed ^ 0x6c6f_7373),
            next: 0,
            outbox: Vec::new(),
            last_pick: vec![f64::NEG_INFINITY; ranks * n],
            last_any: vec![f64::NEG_INFINITY; n],
            live: vec![Vec::new(); ranks],
            seq: Vec::new(),
            local: Vec::new(),
            stats: FleetStats {
                peer_expired: vec![0; n],
                swept: vec![0; n],
                ..FleetStats::default()
            },
        }
    }

    pub(crate) fn kind(&self) -> PolicyKind {
        self.routers[0].kind()
    }

    pub(crate) fn routers(&self) -> &[Router] {
        self.routers
    }

    fn rank_index(&self, r: RankId) -> usize {
        r.worker_id as usize * self.dp_size + r.dp_rank as usize
    }

    fn syncing(&self) -> bool {
        self.routers.len() > 1 && self.cfg.sync != SyncMode::None
    }

    /// Sends `msg` (built per peer) from replica `from` to every other replica.
    fn broadcast(&mut self, from: u32, now: f64, mut msg: impl FnMut(u32) -> SyncMsg) {
        for to in 0..self.routers.len() as u32 {
            if to == from {
                continue;
            }
            self.stats.sent += 1;
            if self.cfg.sync == SyncMode::Dynamo
                && self.cfg.loss > 0.0
                && self.loss_rng.next_f64() < self.cfg.loss
            {
                self.stats.lost += 1;
                continue;
            }
            self.outbox.push((now + self.cfg.latency_ms, msg(to)));
        }
    }

    /// Routes and books one request on the replica whose turn it is; returns the replica.
    pub(crate) fn route(
        &mut self,
        tokens: &[u32],
        output_tokens: u32,
        session: Option<u64>,
        now: f64,
        at: Instant,
    ) -> Result<(u32, Routed), String> {
        let n = self.routers.len();
        let a = match self.cfg.spread {
            _ if n == 1 => 0,
            Spread::RoundRobin => {
                self.next += 1;
                (self.next - 1) % n
            }
            Spread::Random => (self.spread_rng.next_u64() % n as u64) as usize,
        };
        let routed = self.routers[a].route(tokens, output_tokens, session, at)?;
        let w = self.rank_index(routed.rank);
        if n > 1 {
            self.note_pick(a, w, now);
        }
        self.live[w].push((routed.selection_id, a as u32));
        if self.syncing() {
            let id = routed.selection_id;
            let view = self.routers[a]
                .partition()
                .bookings()
                .get(id)
                .ok_or("a booking just made is not in its table")?;
            hasher(self.routers[a].partition().block_size()).hash_tokens(
                tokens,
                &mut self.local,
                &mut self.seq,
            );
            let req = BookingRequest {
                selection_id: id,
                rank: routed.rank,
                prompt_blocks: self.seq.clone(),
                prefill_tokens: view.prefill_tokens,
                expected_output_tokens: view.expected_output_tokens,
                ttl: Some(PEER_BOOKING_TTL),
            };
            self.broadcast(a as u32, now, |to| SyncMsg::Booked {
                to,
                req: req.clone(),
            });
        }
        Ok((a as u32, routed))
    }

    /// Race and blindness accounting for replica `a` picking rank `w` at `now`.
    fn note_pick(&mut self, a: usize, w: usize, now: f64) {
        let n = self.routers.len();
        let since = now - self.cfg.race_window_ms;
        let others = |v: &[f64]| (0..n).filter(|&b| b != a).any(|b| v[b] > since);
        if others(&self.last_any) {
            self.stats.exposed += 1;
        }
        if others(&self.last_pick[w * n..(w + 1) * n]) {
            self.stats.races += 1;
        }
        let table = self.routers[a].partition().bookings();
        if self.live[w]
            .iter()
            .any(|&(id, b)| b as usize != a && !table.contains(id))
        {
            self.stats.blind += 1;
        }
        self.last_pick[w * n + a] = now;
        self.last_any[a] = now;
    }

    pub(crate) fn prefill_done(
        &mut self,
        a: u32,
        id: u64,
        now: f64,
        at: Instant,
    ) -> Result<(), String> {
        self.routers[a as usize].prefill_done(id, at)?;
        if self.syncing() {
            self.broadcast(a, now, |to| SyncMsg::Prefilled { to, id });
        }
        Ok(())
    }

    pub(crate) fn output_block(&mut self, a: u32, id: u64, now: f64) -> Result<(), String> {
        self.routers[a as usize].output_block(id)?;
        // Dynamo's replica sync does not carry output blocks.
        if self.syncing() && self.cfg.sync == SyncMode::Jetstream {
            self.broadcast(a, now, |to| SyncMsg::Output { to, id });
        }
        Ok(())
    }

    /// Frees replica `a`'s booking `id` of the request that ran on rank `rank`.
    pub(crate) fn free(&mut self, a: u32, id: u64, rank: usize, now: f64) -> Result<(), String> {
        self.live[rank].retain(|&(x, _)| x != id);
        self.routers[a as usize].free(id)?;
        if self.syncing() {
            self.broadcast(a, now, |to| SyncMsg::Freed { to, id });
        }
        Ok(())
    }

    fn table(&self, to: u32) -> &ReservationTable {
        self.routers[to as usize].partition().bookings()
    }

    /// Applies a sync event that arrived at simulated `now` (`at`).
    pub(crate) fn apply(&mut self, msg: SyncMsg, now: f64, at: Instant) {
        let ok = match msg {
            SyncMsg::Booked { to, req } => {
                let id = req.selection_id;
                let installed = self.table(to).install_replica_booking(req, at).is_ok();
                if installed {
                    let expires = at + PEER_BOOKING_TTL;
                    let t = now + PEER_BOOKING_TTL.as_secs_f64() * 1e3;
                    self.outbox.push((
                        t,
                        SyncMsg::Expire {
                            to,
                            id,
                            at: expires,
                        },
                    ));
                }
                installed
            }
            SyncMsg::Prefilled { to, id } => {
                let t = self.table(to);
                // A booking the peer no longer holds is answered Ok (idempotent): check.
                t.contains(id) && t.mark_prefill_complete_at(id, at).is_ok()
            }
            SyncMsg::Output { to, id } => self.table(to).add_output_blocks(id, 1).is_ok(),
            SyncMsg::Freed { to, id } => {
                matches!(self.table(to).free(id), Ok(FreeOutcome::Freed(_)))
            }
            SyncMsg::Expire { to, id, at } => {
                let t = self.table(to);
                let swept = t.sweep_expired(at) as u64;
                let expired = t.status(id) == Some(BookingStatus::Freed(FreedBy::Expired));
                self.stats.swept[to as usize] += swept;
                self.stats.peer_expired[to as usize] += u64::from(expired);
                return;
            }
        };
        if ok {
            self.stats.applied += 1;
        } else {
            self.stats.unmatched += 1;
        }
    }

    /// One load sample: `active` requests per rank (queued or running), the truth.
    pub(crate) fn sample(&mut self, active: &[u32]) {
        let total: u64 = active.iter().map(|&a| u64::from(a)).sum();
        if total == 0 {
            return;
        }
        let n = active.len() as f64;
        let mean = total as f64 / n;
        let var = active
            .iter()
            .map(|&a| (f64::from(a) - mean).powi(2))
            .sum::<f64>()
            / n;
        let max = active.iter().copied().max().unwrap_or(0);
        let s = &mut self.stats;
        s.samples += 1;
        s.cov_sum += var.sqrt() / mean;
        s.peak_ratio_sum += f64::from(max) / mean;
        s.max_active = s.max_active.max(max);
        // What replica 0 believes: the requests its bookings (local and peer) count.
        let loads = self.routers[0].partition().bookings().loads();
        let seen: u64 = self.routers[0]
            .ranks()
            .iter()
            .map(|&r| loads.get(r).active_requests)
            .sum();
        self.stats.visible_sum += seen as f64 / total as f64;
    }
}
