//! What a table tells its owner: the ids it frees on its own, the ids of every booking
//! that ends, and the end of each expiry sweep.

use std::time::Instant;

use crate::ids::SelectionId;

/// See [`ReservationTable::with_forget_listener`].
///
/// [`ReservationTable::with_forget_listener`]: super::ReservationTable::with_forget_listener
pub type ForgetListener = crate::sync::StdArc<dyn Fn(SelectionId) + Send + Sync>;

/// See [`Listeners::sweep`].
pub(crate) type SweepListener = crate::sync::StdArc<dyn Fn(Instant) + Send + Sync>;

/// What a table tells its owner (see [`ReservationTable::with_listeners`]).
///
/// [`ReservationTable::with_listeners`]: super::ReservationTable::with_listeners
#[derive(Clone, Default)]
pub(crate) struct Listeners {
    /// Told the id of every booking the table frees on its own (expiry, rank removal).
    pub(crate) forget: Option<ForgetListener>,
    /// Told the id of every booking that ends, however it ends.
    pub(crate) end: Option<ForgetListener>,
    /// Called with the sweep's `now` after every expiry sweep (the background one and
    /// [`ReservationTable::sweep_expired`]).
    ///
    /// [`ReservationTable::sweep_expired`]: super::ReservationTable::sweep_expired
    pub(crate) sweep: Option<SweepListener>,
}

impl std::fmt::Debug for Listeners {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listeners")
            .field("forget", &self.forget.is_some())
            .field("end", &self.end.is_some())
            .field("sweep", &self.sweep.is_some())
            .finish()
    }
}
