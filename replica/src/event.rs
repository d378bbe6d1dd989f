//! One booking's lifecycle event as replicas exchange it: which partition, which booking,
//! which rank, what happened, and who sent it.

use kvr::{PartitionKey, RankId};

/// A booking event of one router replica, for its peers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BookingEvent {
    /// The partition (model, routing group) the booking is in.
    pub key: PartitionKey,
    /// The partition's block size: a peer with another block size drops the event.
    pub block_size: u32,
    /// The booking's id as clients name it (the service's wire selection id).
    pub request_id: String,
    /// The rank booked (absolute DP rank, as the HTTP API names it).
    pub rank: RankId,
    /// What happened.
    pub data: EventData,
    /// The sending process's id: random, non-zero, fixed for the process's life.
    pub router_id: u64,
    /// The request's LoRA adapter, if any.
    pub lora_name: Option<String>,
}

/// What happened to the booking.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventData {
    /// The booking was made.
    Add(AddRequest),
    /// Its prefill ran: its prefill tokens leave the rank's load.
    PrefillComplete,
    /// It ended: everything it added leaves the load.
    Free,
}

/// A new booking's content.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AddRequest {
    /// The sequence hashes of the prompt's complete blocks, first block first (`None`: a
    /// request with no blocks).
    pub token_sequence: Option<Vec<u64>>,
    /// Whether the prefill tokens count on the rank (Dynamo's default when absent: true).
    pub track_prefill_tokens: bool,
    /// The caller's expected output length, tokens.
    pub expected_output_tokens: Option<u32>,
    /// The prefill tokens the sender booked (`None`: no hint, no prefill load).
    pub prefill_tokens: Option<u64>,
    /// The expected prefill duration, if the sender gave one (kept for the wire; kvr does
    /// not use it).
    pub expected_prefill_duration: Option<std::time::Duration>,
}

impl AddRequest {
    /// The prefill tokens a receiver books: the hint when tracked, else none.
    pub fn booked_prefill_tokens(&self) -> u64 {
        if self.track_prefill_tokens {
            self.prefill_tokens.unwrap_or(0)
        } else {
            0
        }
    }
}
