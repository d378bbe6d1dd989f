//! Peers' adds this replica could not apply yet because their partition or rank is not
//! registered here (a replica that just started replays the stream before its workers
//! are registered). They wait, bounded, and are tried again once a second until they
//! apply, are freed, or outlive the booking lifetime.

use std::collections::HashMap;

use crate::event::BookingEvent;

/// The most adds waiting at once (beyond: dropped, as the Dynamo-compatible sync drops
/// every event for an unknown partition).
pub(crate) const MAX_PARKED: usize = 100_000;

#[derive(Debug)]
pub(crate) struct Parked {
    /// The replica that booked it.
    pub(crate) name: String,
    pub(crate) event: BookingEvent,
    /// When the stream received it (ns since the epoch): its remaining lifetime.
    pub(crate) published_ns: i128,
    /// Its prefill completion came while it waited.
    pub(crate) prefill_done: bool,
}

/// The waiting adds, by booking id.
#[derive(Debug, Default)]
pub(crate) struct ParkedAdds {
    adds: HashMap<String, Parked>,
}

impl ParkedAdds {
    /// Keeps `p` (false when full).
    pub(crate) fn park(&mut self, p: Parked) -> bool {
        if self.adds.len() >= MAX_PARKED && !self.adds.contains_key(&p.event.request_id) {
            return false;
        }
        self.adds.insert(p.event.request_id.clone(), p);
        true
    }

    /// A free of `id` came: the add, if it waited, is dropped (true).
    pub(crate) fn freed(&mut self, id: &str) -> bool {
        self.adds.remove(id).is_some()
    }

    /// A prefill completion of `id` came: remembered for when it applies (true when it
    /// waited).
    pub(crate) fn prefill_done(&mut self, id: &str) -> bool {
        match self.adds.get_mut(id) {
            Some(p) => {
                p.prefill_done = true;
                true
            }
            None => false,
        }
    }

    /// The adds of `name` go (it restarted or fell silent): how many.
    pub(crate) fn drop_sender(&mut self, name: &str) -> usize {
        let before = self.adds.len();
        self.adds.retain(|_, p| p.name != name);
        before - self.adds.len()
    }

    /// Every waiting add, taken out (the caller parks again those still waiting).
    pub(crate) fn take_all(&mut self) -> Vec<Parked> {
        self.adds.drain().map(|(_, p)| p).collect()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.adds.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.adds.len()
    }
}
