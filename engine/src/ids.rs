//! The identities every layer keys by (DESIGN.md §2): workers, their data-parallel ranks,
//! storage tiers and partitions. The lowest layer: it imports nothing of the crate.

/// An inference worker (engine process or pod).
pub type WorkerId = u64;
/// A data-parallel rank inside a worker.
pub type DpRank = u32;

/// A booking's id: unique across an engine (the engine mints one, or the caller supplies
/// its own; a duplicate is refused, never an overwrite).
pub type SelectionId = u64;

/// The unit every index entry, load figure and booking is keyed by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RankId {
    /// The worker.
    pub worker_id: WorkerId,
    /// The data-parallel rank inside that worker.
    pub dp_rank: DpRank,
}

impl RankId {
    /// DP rank `dp_rank` of worker `worker_id`.
    pub const fn new(worker_id: WorkerId, dp_rank: DpRank) -> Self {
        Self { worker_id, dp_rank }
    }

    /// A well-mixed digest of the rank (splitmix64's finalizer over both fields): two
    /// registries list the same ranks when the wrapping sums of these agree (and their
    /// lengths do), without a walk over both.
    #[inline]
    pub(crate) fn fingerprint(self) -> u64 {
        let mut z = self
            .worker_id
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(u64::from(self.dp_rank).wrapping_mul(0xD6E8_FEB8_6659_FD93))
            .wrapping_add(0x632B_E59B_D9B4_E019);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

impl std::fmt::Display for RankId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.worker_id, self.dp_rank)
    }
}

/// Where a rank keeps a block: GPU memory (the primary tier), host memory or disk
/// (vLLM's `medium` = "GPU" | "CPU" | "STORAGE").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Tier {
    /// GPU memory (`GPU`).
    Device = 0,
    /// Host memory (`CPU`).
    Host = 1,
    /// Disk or other storage (`STORAGE`).
    Disk = 2,
}

impl Tier {
    /// Every tier, in the order of the per-tier arrays (device, host, disk).
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];
}

/// A routing domain: requests of one model (and routing group) go to its workers only.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PartitionKey {
    /// The model's name.
    pub model: String,
    /// The routing group: one model's workers split into separate routing domains.
    pub routing_group: String,
}

impl PartitionKey {
    /// The partition of `model` in `routing_group`.
    pub fn new(model: impl Into<String>, routing_group: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            routing_group: routing_group.into(),
        }
    }
}
