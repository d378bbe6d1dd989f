//! [`SessionTable::audit`]: checks the table's invariants (module docs, "Invariants")
//! exactly, for tests and diagnostics on a table no other thread is using.
//!
//! [`SessionTable::audit`]: super::SessionTable::audit

use std::collections::HashMap;

use super::table::SessionTable;
use crate::ids::SelectionId;

impl SessionTable {
    /// Checks the invariants of the module docs: the lease index and the entries' leases
    /// agree exactly, no final entry is lease-less, no lease is held twice, no shard is
    /// over its bound. Locks every shard in turn: exact only on a table no other thread
    /// is using (tests, diagnostics).
    pub(crate) fn audit(&self) -> Result<(), String> {
        let mut held: HashMap<SelectionId, String> = HashMap::new();
        for (i, s) in self.sessions.iter().enumerate() {
            let g = s.lock();
            if g.entries.len() > self.per_shard {
                return Err(format!(
                    "session shard {i} holds {} entries, bound {}",
                    g.entries.len(),
                    self.per_shard
                ));
            }
            for (k, e) in &g.entries {
                if e.final_requested && e.leases.is_empty() {
                    return Err(format!(
                        "session {:?} is final without leases: nothing will release it",
                        k.as_str()
                    ));
                }
                for &l in &e.leases {
                    if let Some(other) = held.insert(l, k.as_str().to_owned()) {
                        return Err(format!(
                            "lease {l} held by sessions {other:?} and {:?}",
                            k.as_str()
                        ));
                    }
                }
            }
        }
        let mut indexed = 0;
        for s in self.leases.iter() {
            let g = s.lock();
            for (l, k) in &g.owner {
                indexed += 1;
                match held.get(l) {
                    Some(owner) if owner == k.as_str() => {}
                    Some(owner) => {
                        return Err(format!(
                            "lease index: {l} → {:?}, but session {owner:?} holds it",
                            k.as_str()
                        ))
                    }
                    None => {
                        return Err(format!(
                            "lease index: {l} → {:?}, which does not hold it (leaked lease)",
                            k.as_str()
                        ))
                    }
                }
            }
        }
        if indexed != held.len() {
            return Err(format!(
                "sessions hold {} leases, the lease index knows {indexed}",
                held.len()
            ));
        }
        Ok(())
    }
}
