//! Selection ids as strings on the wire (Dynamo mints UUIDs and accepts the caller's own
//! strings), numbers in the engine.
//!
//! - An id the service mints is the engine's number written into a UUID-shaped string
//!   whose first 76 bits are this process's random prefix: `pppppppp-pppp-4ppp-8ppp-nnnnnnnnnnnn`
//!   (`n` = the number, 48 bits). Parsing it back needs no table.
//! - A caller's own string (any other text) is given an engine number from the same
//!   counter and remembered in a table until its booking ends.
//!
//! A caller's string that happens to carry this process's prefix is still looked up in
//! the table first, so it never aliases a minted id in the table's direction; it could
//! shadow the minted id of the same number only by guessing the random prefix.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvr::hash::splitmix64;
use kvr::{PartitionKey, SelectionId};

/// A caller-named id younger than this is never swept (it may be between naming and
/// booking).
pub const SWEEP_GRACE: Duration = Duration::from_secs(10);

/// The largest number a minted string carries (48 bits of hex).
const MINTED_MAX: u64 = (1 << 48) - 1;

/// The most caller-named ids remembered at once; beyond it a new caller-named booking is
/// refused with 429 (no caller grows the table without bound).
pub const MAX_NAMED_IDS: usize = 1 << 20;

#[derive(Debug)]
pub struct SelectionIds {
    prefix: String,
    named: Mutex<HashMap<String, Named>>,
}

/// Why a caller's string could not be named.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameError {
    /// It names a live booking (or one being made).
    Taken,
    /// [`MAX_NAMED_IDS`] strings are live.
    Full,
}

#[derive(Debug)]
struct Named {
    id: SelectionId,
    key: PartitionKey,
    at: Instant,
}

impl SelectionIds {
    pub fn new(seed: u64) -> Self {
        // 76 random bits in the UUID v4 layout (version nibble 4, variant nibble 8).
        let a = splitmix64(seed);
        let b = splitmix64(a);
        let prefix = format!(
            "{:08x}-{:04x}-4{:03x}-8{:03x}-",
            (a >> 32) as u32,
            (a >> 16) as u16,
            (a as u16) & 0xfff,
            (b as u16) & 0xfff
        );
        Self {
            prefix,
            named: Mutex::new(HashMap::new()),
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<String, Named>> {
        self.named.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The wire form of a minted id.
    pub fn render(&self, id: SelectionId) -> String {
        debug_assert!(id <= MINTED_MAX);
        format!("{}{:012x}", self.prefix, id & MINTED_MAX)
    }

    /// The engine number of a wire id the service minted or was told, if known.
    pub fn lookup(&self, s: &str) -> Option<SelectionId> {
        if let Some(n) = self.table().get(s) {
            return Some(n.id);
        }
        self.parse_minted(s)
    }

    fn parse_minted(&self, s: &str) -> Option<SelectionId> {
        let hex = s.strip_prefix(self.prefix.as_str())?;
        if hex.len() != 12 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u64::from_str_radix(hex, 16).ok()
    }

    /// Whether a caller's string is in the table (its booking is live or being made).
    pub fn is_named(&self, s: &str) -> bool {
        self.table().contains_key(s)
    }

    /// Gives a caller's new string an engine number (`mint` draws it) for a booking in
    /// `key`. Checked and inserted under one lock, so of two requests naming the same
    /// string at once exactly one gets it.
    pub fn name(
        &self,
        s: &str,
        key: &PartitionKey,
        mint: impl FnOnce() -> SelectionId,
    ) -> Result<SelectionId, NameError> {
        let mut t = self.table();
        if t.contains_key(s) {
            return Err(NameError::Taken);
        }
        if t.len() >= MAX_NAMED_IDS {
            return Err(NameError::Full);
        }
        let id = mint();
        t.insert(
            s.to_string(),
            Named {
                id,
                key: key.clone(),
                at: Instant::now(),
            },
        );
        Ok(id)
    }

    /// Forgets the caller's strings whose bookings ended without a `DELETE` (expired, or
    /// their worker left): `live(id, key)` says whether a booking is still there.
    /// Returns how many went.
    pub fn sweep(&self, now: Instant, live: impl Fn(SelectionId, &PartitionKey) -> bool) -> usize {
        let mut t = self.table();
        let before = t.len();
        t.retain(|_, n| now.duration_since(n.at) < SWEEP_GRACE || live(n.id, &n.key));
        before - t.len()
    }

    /// Forgets a caller's string (its booking ended or was refused).
    pub fn forget(&self, s: &str) {
        self.table().remove(s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minted_ids_round_trip_in_uuid_shape() {
        let ids = SelectionIds::new(7);
        let s = ids.render(0x1234);
        assert_eq!(s.len(), 36);
        assert_eq!(s.as_bytes()[14], b'4');
        assert_eq!(ids.lookup(&s), Some(0x1234));
        assert_eq!(ids.lookup("not-ours"), None);
        assert_eq!(
            SelectionIds::new(8).lookup(&s),
            None,
            "another process's prefix"
        );
    }

    #[test]
    fn caller_names_are_remembered_until_forgotten() {
        let ids = SelectionIds::new(1);
        let key = PartitionKey::new("m", "default");
        assert_eq!(ids.name("abc", &key, || 5), Ok(5));
        assert_eq!(ids.name("abc", &key, || 6), Err(NameError::Taken));
        assert!(ids.is_named("abc"));
        assert_eq!(ids.lookup("abc"), Some(5));
        ids.forget("abc");
        assert_eq!(ids.lookup("abc"), None);
        // A caller's string in the minted form is looked up in the table first.
        let forged = ids.render(9);
        assert_eq!(ids.name(&forged, &key, || 11), Ok(11));
        assert_eq!(ids.lookup(&forged), Some(11));
    }

    #[test]
    fn sweep_keeps_young_and_live_names() {
        let ids = SelectionIds::new(2);
        let key = PartitionKey::new("m", "default");
        ids.name("young", &key, || 1).unwrap();
        ids.name("live", &key, || 2).unwrap();
        ids.name("dead", &key, || 3).unwrap();
        let now = Instant::now();
        assert_eq!(ids.sweep(now, |_, _| false), 0, "all within the grace");
        let later = now + SWEEP_GRACE + Duration::from_secs(1);
        assert_eq!(ids.sweep(later, |id, _| id == 2), 2);
        assert!(ids.is_named("live"));
        assert!(!ids.is_named("dead"));
    }
}
