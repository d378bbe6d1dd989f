//! How kvr is built and why it is correct: layout, invariants, memory ordering, which
//! paths take which locks, and the fixed limits.
//!
//! This module holds no code (the pattern of arc-swap's `docs`): each submodule is text
//! only. Each atomic protocol argued here has a loom model in `loom_models.rs` and a
//! negative control that must fail.
//!
//! - [`design`]: the layout of every concurrent structure (the index's runs, covers,
//!   branch table, rank state and slot directory; the load view; bookings; the
//!   selection-id index; session affinity).
//! - [`invariants`]: what the index's writers maintain, and what a concurrent reader may
//!   therefore see.
//! - [`ordering`]: the memory orderings of each publication step, and reclamation.
//! - [`locking`]: per public path, whether it is lock-free and, if not, which locks it
//!   takes and what it may wait for.
//! - [`limits`]: the fixed limits (ranks, inline sizes, id ranges, endpoint lengths, …).
//! - [`mutations`]: every step a loom negative control weakens, the model that catches
//!   it, and the one command that shows them all caught.

pub(crate) mod design;
pub(crate) mod invariants;
pub(crate) mod limits;
pub(crate) mod locking;
pub(crate) mod mutations;
pub(crate) mod ordering;
